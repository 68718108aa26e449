"""The built-in rule rewards (pipeline/rewards/rules.py): the tiny task's graded
fraction and GSM8K's last number."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.types import Prompt
from pipeline.inputs.tiny import TINY_ALPHABET, tiny_prompt
from pipeline.rewards.rules import digit_reward, extract_last_number, gsm8k_reward, tiny_reward

pytestmark = pytest.mark.unit


def test_tiny_reward_is_a_graded_fraction():
    p = Prompt("t", tiny_prompt("0"), "0")
    assert tiny_reward(p, "0000") == 1.0
    assert tiny_reward(p, "0010") == 0.75
    assert tiny_reward(p, "1 1") == 0.0
    assert tiny_reward(p, "") == 0.0
    with pytest.raises(ValueError, match="one-character answer"):
        tiny_reward(Prompt("t", "x", "00"), "00")


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=40), st.sampled_from(list(TINY_ALPHABET)))
def test_tiny_reward_in_unit_interval(text, c):
    r = tiny_reward(Prompt("t", tiny_prompt(c), c), text)
    assert 0.0 <= r <= 1.0
    assert (r == 1.0) == (bool(text) and set(text) == {c})


@pytest.mark.parametrize("completion, reward", [
    ("so the answer is 18", 1.0),
    ("#### 18", 1.0),
    ("####18", 1.0),
    ("She pays $18.", 1.0),
    ("18.0", 1.0),
    ("20 - 2 = 18\n#### 18", 1.0),
    ("18 apples, then 3 more", 0.0),   # the last number counts
    ("#### 19", 0.0),
    ("no number here", 0.0),
    ("", 0.0),
])
def test_gsm8k_reward(completion, reward):
    assert gsm8k_reward(Prompt("g", "q", "18"), completion) == reward


def test_gsm8k_reward_commas_negatives_and_full_answers():
    assert gsm8k_reward(Prompt("g", "q", "6325"), "they sell 6,325 candies") == 1.0
    assert gsm8k_reward(Prompt("g", "q", "1,250"), "#### 1250") == 1.0
    assert gsm8k_reward(Prompt("g", "q", "-3"), "it is -3 degrees") == 1.0
    assert gsm8k_reward(Prompt("g", "q", "6"), "18-12 = 6") == 1.0
    assert gsm8k_reward(Prompt("g", "q", "12"), "18-12") == 1.0  # a dash after a digit is not a sign
    assert gsm8k_reward(Prompt("g", "q", "a\n#### 42"), "42") == 1.0
    with pytest.raises(ValueError, match="non-numeric answer"):
        gsm8k_reward(Prompt("g", "q", "forty"), "40")
    assert extract_last_number("1,234.5 and 7.") == 7.0


@settings(max_examples=50, deadline=None)
@given(st.integers(-10**9, 10**9))
def test_gsm8k_reward_reads_formatted_integers(n):
    p = Prompt("g", "q", str(n))
    assert gsm8k_reward(p, f"reasoning 3 + 4\n#### {n:,}") == 1.0
    assert gsm8k_reward(p, f"#### {n + 1}") == 0.0


@pytest.mark.parametrize("text, reward", [("2", 1.0), ("22 ok", 0.4), ("", 0.0), ("1212", 0.0), ("2 not 3", 0.0),
                                          ("two", 0.0)])
def test_digit_reward_gives_nothing_to_an_answer_that_names_another_digit(text, reward):
    assert digit_reward(Prompt("p", "", "2"), text) == pytest.approx(reward)
