"""The built-in rule rewards: the tiny repeat task's, and GSM8K's last number
(`data.reward: pipeline.rewards.rules:tiny_reward`, `...:gsm8k_reward`), and the tiny picture task's
(`...:digit_reward`).
"""
from __future__ import annotations

import math
import re

from pipeline.core.types import Prompt

# A minus sign counts only when it does not follow a digit ("18-12" ends in 12).
_NUMBER = re.compile(r"(?<![\d.])-?\d[\d,]*(?:\.\d+)?")


def tiny_reward(prompt: Prompt, completion_text: str) -> float:
    """The tiny repeat task: the fraction of response characters equal to the
    requested character (prompt.answer); an empty response scores 0.

    A fraction, not a 0/1 match, so a random policy's samples already differ
    (about half the groups of 4 carry signal at step 0). No partial credit for
    "a digit": that direction is the same for every prompt and the policy
    collapses onto it (see pipeline/inputs/tiny.py).
    """
    target = prompt.answer
    if len(target) != 1:
        raise ValueError(f"tiny_reward: prompt {prompt.id!r} must have a one-character answer, got {target!r}")
    if not completion_text:
        return 0.0
    return sum(ch == target for ch in completion_text) / len(completion_text)


def digit_reward(prompt: Prompt, completion_text: str) -> float:
    """The tiny picture task (pipeline/inputs/tiny_vlm.py): tiny_reward's fraction of
    characters that are the digit shown, and 0 for an answer that names another digit
    too. Without that 0, answers that mix two digits ("1212...", one BPE token
    a pair) scored 0.5 on either's pictures, and GRPO settled on one such answer for
    every picture (greedy validation 0.25, a constant answer's) instead of reading it."""
    if any(ch.isdigit() and ch != prompt.answer for ch in completion_text):
        return 0.0
    return tiny_reward(prompt, completion_text)


def _to_number(text: str) -> float | None:
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def extract_last_number(text: str) -> float | None:
    """The last number in `text` ("1,234", "-3", "2.5", "$40."), or None."""
    matches = _NUMBER.findall(text)
    for raw in reversed(matches):
        value = _to_number(raw)
        if value is not None:
            return value
    return None


def gsm8k_reward(prompt: Prompt, completion_text: str) -> float:
    """1.0 if the completion's last number equals the answer, else 0.0.

    "#### 1,234", "$1234." and "1234" all read as 1234; the prompt's answer may
    itself be a full GSM8K answer ending in "#### N".
    """
    expected = _to_number(prompt.answer.split("####")[-1])
    if expected is None:
        raise ValueError(f"gsm8k_reward: prompt {prompt.id!r} has a non-numeric answer {prompt.answer!r}")
    got = extract_last_number(completion_text)
    if got is None:
        return 0.0
    # rel_tol tiny: a relative 1e-6 would accept 1000001 for 1000000.
    return 1.0 if math.isclose(got, expected, rel_tol=1e-12, abs_tol=1e-9) else 0.0
