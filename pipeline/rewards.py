"""Reward functions: `fn(prompt: Prompt, completion_text: str) -> float`.

A recipe names its reward as "module:function" (data.reward), resolved by
`load_reward`. Rewards are pure functions of the prompt (its `answer`) and the
completion text, so any worker can score without shared state.
"""
from __future__ import annotations

import importlib
import math
import re
from typing import Callable

from pipeline.engines import Prompt

RewardFn = Callable[[Prompt, str], float]

# Partial credit of the tiny task for a character of the right class (a digit
# when a digit is asked for). A random policy emits some digit in most samples,
# so groups differ in reward from step one; exact matches still dominate.
TINY_CLASS_CREDIT = 0.25

# A minus sign counts only when it does not follow a digit ("18-12" ends in 12).
_NUMBER = re.compile(r"(?<![\d.])-?\d[\d,]*(?:\.\d+)?")


class RewardError(ValueError):
    """A reward spec that cannot be used; the message names the spec."""


def load_reward(spec: str) -> RewardFn:
    """Resolve "package.module:function" to a callable."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise RewardError(f"reward spec {spec!r}: expected 'module:function', "
                          "e.g. 'pipeline.rewards:tiny_reward'")
    module_name, attr = spec.split(":")
    if not module_name or not attr:
        raise RewardError(f"reward spec {spec!r}: expected 'module:function' with both parts non-empty")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a module's import can raise anything
        raise RewardError(f"reward spec {spec!r}: cannot import module {module_name!r}: "
                          f"{type(exc).__name__}: {exc}") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardError(f"reward spec {spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardError(f"reward spec {spec!r}: {attr!r} is a {type(fn).__name__}, not callable")
    return fn


def _char_class(ch: str) -> str:
    if ch.isdigit():
        return "digit"
    if ch.isalpha():
        return "alpha"
    return "other"


def tiny_reward(prompt: Prompt, completion_text: str) -> float:
    """The repeat task: mean over the response's characters of 1 for the
    requested character (prompt.answer), TINY_CLASS_CREDIT for another character
    of its class, 0 otherwise. An empty response scores 0."""
    target = prompt.answer
    if len(target) != 1:
        raise ValueError(f"tiny_reward: prompt {prompt.id!r} must have a one-character answer, got {target!r}")
    if not completion_text:
        return 0.0
    cls = _char_class(target)
    score = 0.0
    for ch in completion_text:
        if ch == target:
            score += 1.0
        elif _char_class(ch) == cls:
            score += TINY_CLASS_CREDIT
    return score / len(completion_text)


def tiny_exact(prompt: Prompt, completion_text: str) -> float:
    """Fraction of response characters equal to the requested one: the tiny
    task's plain metric, without the class credit."""
    if not completion_text:
        return 0.0
    return sum(ch == prompt.answer for ch in completion_text) / len(completion_text)


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
    return 1.0 if abs(got - expected) <= 1e-6 * max(1.0, abs(expected)) else 0.0
