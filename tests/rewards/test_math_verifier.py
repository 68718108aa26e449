"""math-verify as a reward (pipeline/rewards/math_verifier.py): equal answers in
the forms GSM8K and MATH write them, and a hung verifier that becomes one
sample's reward failure within its deadline, not a stuck generator."""
from __future__ import annotations

import time

import pytest

from pipeline.core.types import Prompt
from pipeline.rewards.math_verifier import MathVerifier
from pipeline.rewards.specs import load_reward
from tests.support.slow_reward import never_answer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier()
    try:
        yield v
    finally:
        v.close()


@pytest.mark.parametrize("answer,completion,score", [
    ("72", "She sold 48 + 24 = 72 clips.\n#### 72", 1.0),
    ("72", "The answer is $\\boxed{72}$.", 1.0),
    ("0.5", "So the probability is $\\boxed{\\frac{1}{2}}$.", 1.0),
    ("72", "#### 71", 0.0),
    ("72", "I do not know.", 0.0),
])
def test_equal_answers_score_one(verifier, answer, completion, score):
    assert verifier(Prompt("p", "q", answer), completion) == score


def test_the_built_in_spec_loads():
    assert isinstance(load_reward("pipeline.rewards.math_verifier:math_verify_reward"), MathVerifier)


def test_a_hung_verifier_is_a_reward_failure_within_its_deadline():
    v = MathVerifier(timeout_s=0.5, serve=never_answer)
    try:
        v._start()
        v._fresh = False   # the child's start-up allowance is not what is under test
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="math-verify took more than 0.5 s on prompt 'p'"):
            v(Prompt("p", "q", "1"), "1")
        assert time.monotonic() - started < 5
        assert v._child is None   # killed; the next call starts a new one
    finally:
        v.close()
