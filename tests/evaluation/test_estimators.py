"""pass@k, maj@k and the per-set metrics, against values worked out by hand."""
from __future__ import annotations

import pytest

from pipeline.config.sections import ValSetConfig
from pipeline.evaluation.estimators import extract_answer, last_boxed, majority_at_k, pass_at_k
from pipeline.evaluation.scores import add_sums, prompt_sums, val_metrics

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n,c,k,expected", [
    (4, 0, 1, 0.0), (4, 4, 4, 1.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5),   # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 2, 2, 5 / 6),                                                   # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (5, 2, 3, 0.9),                                                     # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (10, 3, 2, 1 - 21 / 45), (4, 3, 2, 1.0)])                           # n - c < k: always one correct
def test_pass_at_k_unbiased(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, 1, 5), (4, 1, 0)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_majority_vote_over_every_k_of_the_n_samples_and_its_tie_rule():
    # All 4: 7 twice beats 3 once; the first sample that said 7 (index 1) is correct.
    assert majority_at_k([3, 7, 7, None], [False, True, False, False], 4) == 1.0
    # k=1: the share of samples whose answer is a correct one (7's, samples 1 and 2).
    assert majority_at_k([3, 7, 7, None], [False, True, False, False], 1) == 0.5
    # k=2 of [3, 7, 7, 7]: 3 of the 6 pairs are {3, 7}, a tie that 7 wins half the time; 3 are {7, 7}.
    assert majority_at_k([3, 7, 7, 7], [False, True, True, True], 2) == pytest.approx((3 * 0.5 + 3) / 6)
    # k=3: every triple holds two 7s at least.
    assert majority_at_k([3, 7, 7, 7], [False, True, True, True], 3) == 1.0
    # No sample gave an answer: incorrect.
    assert majority_at_k([None, None], [True, True], 2) == 0.0
    with pytest.raises(ValueError, match="maj@k needs 1 <= k <= n, got n=2, k=3"):
        majority_at_k([1, 2], [True, False], 3)


def test_majority_vote_is_the_mean_over_every_subset():
    """Against the vote counted on each of the C(n, k) subsets, ties split evenly."""
    import itertools
    import random
    rng = random.Random(0)
    for _ in range(100):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        answers = [rng.choice([None, 1, 2, 3]) for _ in range(n)]
        correct = [rng.random() < 0.5 for _ in range(n)]
        right = {}
        for a, ok in zip(answers, correct):
            if a is not None:
                right.setdefault(a, ok)
        votes = []
        for subset in itertools.combinations(range(n), k):
            counts = {}
            for i in subset:
                if answers[i] is not None:
                    counts[answers[i]] = counts.get(answers[i], 0) + 1
            top = [a for a in counts if counts[a] == max(counts.values())]
            votes.append(sum(right[a] for a in top) / len(top) if top else 0.0)
        assert majority_at_k(answers, correct, k) == pytest.approx(sum(votes) / len(votes), abs=1e-12)


def test_answer_extraction():
    assert extract_answer("so 1,234 then 72.", "last_number") == 72.0
    assert extract_answer("no number", "last_number") is None
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{ 2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{unclosed") is None
    assert extract_answer("  yes \n", "text") == "yes" and extract_answer("  ", "text") is None


def test_set_metrics_from_shards_by_data_source():
    spec = ValSetConfig(name="math", n=4, temperature=1.0, k=(1, 4), vote_on="last_number")
    # Prompt a (source s1): rewards 1,0,1,0, answers 5,6,5,6 -> all 4: a tie 5/6 that 5 (correct) wins half the time.
    a = prompt_sums(spec, "s1", [1, 0, 1, 0], [False] * 4, ["5", "6", "5", "6"])
    # Prompt b (source s2): one reward failed; the rest 0,0,1 -> mean@4 1/3; c = 1.
    b = prompt_sums(spec, "s2", [0, 0, 0, 1], [True, False, False, False], ["9", "8", "8", "9"])
    m = val_metrics(add_sums([a, b]))
    assert m["val/math/mean@4"] == pytest.approx((0.5 + 1 / 3) / 2)
    assert m["val/math/pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["val/math/pass@4"] == pytest.approx(1.0)
    # b's vote: the failed sample does not vote; of all 4, 8 (twice) wins and is wrong; of 1, only
    # the last sample's 9 is a correct answer. a's maj@1: half its samples say 5.
    assert m["val/math/maj@4"] == pytest.approx((0.5 + 0) / 2)
    assert m["val/math/maj@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert m["val/math/count"] == 2 and m["val/math/failed"] == 1
    assert m["val/math/s1/mean@4"] == pytest.approx(0.5) and m["val/math/s2/pass@1"] == pytest.approx(0.25)
    assert m["val/math/s2/count"] == 1


def test_implicit_set_is_val_reward():
    spec = ValSetConfig(name="")
    sums = add_sums([prompt_sums(spec, "src", [0.5], [False], ["x"]), prompt_sums(spec, "", [9.0], [True], ["y"]),
                     prompt_sums(spec, "", [1.0], [False], ["z"])])
    # As before validation.sets: the failed sample is out of the mean and the count; no breakdown.
    assert val_metrics(sums) == {"val_reward": 0.75, "val_count": 2.0}
