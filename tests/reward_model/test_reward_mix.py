"""A reward model's scores on a batch (pipeline/rewards/mix.py), what the
judge and the classifier read (pipeline/reward_model/common.py, judge.py), on
hand-made tables: no model."""
from __future__ import annotations

import json
import math
import re

import pyarrow as pa
import pytest

from pipeline.rewards.mix import apply_scores, combine
from pipeline.rewards.scoring import fill_failed_rewards
from pipeline.core.types import TRAJECTORY_SCHEMA, Prompt
from pipeline.reward_model.common import conversation, question, row_prompts
from pipeline.reward_model.judge import parse_score

pytestmark = pytest.mark.unit


def table(rewards: list[float], errors: list[str], lengths: list[int]) -> pa.Table:
    rows = [dict(batch_id="b", target=0, version=0, prompt_id=f"p{i // 2}", prompt_ids=[1], response_ids=[5] * n,
                 logprobs=[-1.0] * n, token_versions=[0] * n, text="x" * n, reward=r, reward_error=e,
                 loss_mask=[1] * n, token_rewards=[0.0] * (n - 1) + [r] if n else [], truncated=False)
            for i, (r, e, n) in enumerate(zip(rewards, errors, lengths))]
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def test_the_reward_is_the_rule_plus_weight_times_the_score():
    scored = apply_scores(table([1.0, 0.0, 0.5, 0.5], [""] * 4, [3, 2, 1, 4]),
                          [(2.0, ""), (4.0, ""), (0.0, ""), (-2.0, "")], 0.5, 2, "rm")
    assert scored.table.column("reward").to_pylist() == [2.0, 2.0, 0.5, -0.5]
    assert scored.failures == ()
    # The reward sits on each completion's last token, as a rule reward's does.
    assert scored.table.column("token_rewards").to_pylist() == [[0.0, 0.0, 2.0], [0.0, 2.0], [0.5],
                                                                [0.0, 0.0, 0.0, -0.5]]


def test_a_failed_score_gets_its_groups_mean_and_is_counted_once():
    scored = apply_scores(table([0.0] * 4, ["", "", "rule broke", ""], [1] * 4),
                          [(1.0, ""), (0.0, "judge said nothing"), (9.0, ""), (float("nan"), "")], 1.0, 2, "rm")
    rewards = scored.table.column("reward").to_pylist()
    # Group 0: the failed sample takes its partner's 1.0. Group 1: both failed (rule, NaN): 0.0.
    assert rewards == [1.0, 1.0, 0.0, 0.0]
    errors = scored.table.column("reward_error").to_pylist()
    assert errors == ["", "judge said nothing", "rule broke", "rm scored nan"]
    # The rule's failure was its generator's to count: the model's own failures only.
    assert scored.failures == ("judge said nothing", "rm scored nan")


@pytest.mark.parametrize("rule,model,expected", [
    ((1.0, ""), (2.0, ""), (3.0, "")),
    ((1.0, "bad rule"), (2.0, ""), (0.0, "bad rule")),
    ((1.0, ""), (2.0, "bad score"), (0.0, "bad score")),
    ((1.0, ""), (math.inf, ""), (0.0, "rm scored inf")),
    ((1e308, ""), (1e308, ""), (0.0, "the reward 1e+308 + 10.0 x 1e+308 is not finite")),
])
def test_combine(rule, model, expected):
    assert combine(rule, model, 10.0 if rule[0] == 1e308 else 1.0, "rm") == expected


def test_fill_failed_rewards_checks_its_shapes():
    assert fill_failed_rewards([1.0, 3.0, 0.0], [False, False, True], 3) == [1.0, 3.0, 2.0]
    with pytest.raises(ValueError, match="failure flags"):
        fill_failed_rewards([1.0], [], 1)
    with pytest.raises(ValueError, match="groups of 2"):
        fill_failed_rewards([1.0, 2.0, 3.0], [False] * 3, 2)


def test_what_a_reward_model_reads_of_a_prompt():
    chat = Prompt("c", "<|user|>\nhow much?</s>\n<|assistant|>\n", "4",
                  messages=json.dumps([{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "how much?"}]))
    text = Prompt("t", "repeat: 0 0", "0")
    assert question(chat) == "how much?" and question(text) == "repeat: 0 0"
    assert conversation(chat, "4")[-1] == {"role": "assistant", "content": "4"}
    assert conversation(chat, "4")[0]["role"] == "system" and conversation(text, "0") is None
    assert row_prompts((chat, text), 4) == [chat, chat, text, text]
    with pytest.raises(ValueError, match="groups"):
        row_prompts((chat, text), 3)


@pytest.mark.parametrize("answer,pattern,score", [
    ("7", r"[0-9]", 7.0), ("Rating: 8/10", r"-?\d+(?:\.\d+)?", 8.0), ("[[4.5]]", r"\[\[(\d+(?:\.\d+)?)\]\]", 4.5),
    ("no idea", r"[0-9]", None), ("[[x]]", r"\[\[(.)\]\]", None)])
def test_a_judges_answer_parses_to_its_first_score(answer, pattern, score):
    assert parse_score(answer, re.compile(pattern)) == score
