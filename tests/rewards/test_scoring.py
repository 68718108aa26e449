"""One sample's reward (pipeline/rewards/scoring.py): an environment's sum, a
reward function's value, and each way either fails that sample alone."""
from __future__ import annotations

import pytest

from pipeline.core.types import Completion, Prompt
from pipeline.rewards.scoring import score_sample

pytestmark = pytest.mark.unit

PROMPT = Prompt("p1", "repeat: 1", "1")


def sample(text: str = "11", **kw) -> Completion:
    return Completion((1,), (5, 6), (-1.0, -1.0), text, **kw)


def raises(prompt, text):
    raise KeyError("answer")


@pytest.mark.parametrize("completion,reward_fn,expected", [
    (sample(), lambda p, t: t.count(p.answer) / len(t), (1.0, "")),
    (sample(), lambda p, t: 1, (1.0, "")),
    (sample(), None, (0.0, "")),
    (sample(), raises, (0.0, "prompt p1: KeyError: 'answer'")),
    (sample(), lambda p, t: float("nan"), (0.0, "prompt p1: reward function returned nan")),
    (sample(), lambda p, t: float("-inf"), (0.0, "prompt p1: reward function returned -inf")),
    # An environment's reward is the sample's whatever the function would say.
    (sample(reward=0.5), raises, (0.5, "")),
    (sample(reward=0.5, error="the tool crashed"), None, (0.0, "prompt p1: the tool crashed")),
    (sample(reward=float("inf")), None, (0.0, "prompt p1: environment rewards sum to inf")),
])
def test_a_samples_reward_and_why_it_failed(completion, reward_fn, expected):
    assert score_sample(PROMPT, completion, reward_fn) == expected
