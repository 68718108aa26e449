"""The estimators a validation set reports per prompt (docs/evaluation.md):
pass@k by the unbiased estimator of Chen et al. 2021, maj@k by a vote over
the answers extracted from k samples, averaged over every k of the n, as
pass@k is."""
from __future__ import annotations

import math
import re
from collections.abc import Hashable, Sequence
from fractions import Fraction

from pipeline.rewards.rules import extract_last_number


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples drawn without replacement from
    n, of which c are correct, is correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """maj@k of one prompt: the chance that the majority answer of k samples
    drawn without replacement from its n is correct, exactly, as pass_at_k
    averages over the same draws. Samples with no answer (None) do not vote
    (none voting is incorrect); a tie among t answers goes to each with
    chance 1/t (the one given first, in a random order); an answer is correct
    when the first sample that gave it is."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n, got n={n}, k={k}")
    counts: dict[Hashable, int] = {}
    right: dict[Hashable, bool] = {}
    for answer, ok in zip(answers, correct):
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
            right.setdefault(answer, bool(ok))
    silent = n - sum(counts.values())
    won = Fraction(0)
    # Answers given equally often win equally often: one sum for each count a correct answer has.
    for count in set(counts[a] for a in counts if right[a]):
        others = sorted(counts.values())
        others.remove(count)
        wins = sum(math.comb(count, x) * _ways_below(others, silent, x, k - x) for x in range(1, min(count, k) + 1))
        won += sum(1 for a in counts if right[a] and counts[a] == count) * wins
    return float(won / math.comb(n, k))


def _ways_below(others: list[int], silent: int, x: int, rest: int) -> Fraction:
    """Ways to draw `rest` more samples from the other answers (`others`: each
    one's count) and the silent ones so that no other answer has more than x
    votes, each weighted by 1 / (1 + the answers tied at x)."""
    # ways[j][t]: j samples drawn from the answers so far, t of them at exactly x votes.
    ways = [[0] * (len(others) + 1) for _ in range(rest + 1)]
    ways[0][0] = 1
    for m in others:
        grown = [[0] * (len(others) + 1) for _ in range(rest + 1)]
        for j in range(rest + 1):
            for t, w in enumerate(ways[j]):
                if w:
                    for d in range(min(m, x, rest - j) + 1):
                        grown[j + d][t + (d == x)] += w * math.comb(m, d)
        ways = grown
    return sum((Fraction(w * math.comb(silent, rest - j), 1 + t) for j in range(rest + 1)
                for t, w in enumerate(ways[j]) if w), Fraction(0))


_BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), spaces removed; None without one."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return re.sub(r"\s+", "", text[start:i])
    return None


def extract_answer(text: str, vote_on: str) -> Hashable | None:
    """The answer maj@k compares (validation.sets[].vote_on); None: the sample has none."""
    if vote_on == "last_number":
        return extract_last_number(text)
    if vote_on == "boxed":
        return last_boxed(text)
    if vote_on == "text":
        return text.strip() or None
    raise ValueError(f"vote_on: unknown answer extraction {vote_on!r}")
