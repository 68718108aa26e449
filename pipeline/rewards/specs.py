"""A reward a recipe names: `fn(prompt: Prompt, completion_text: str) -> float`,
as "module:function" (data.reward, validation.reward), resolved by
`load_reward`. Rewards are pure functions of the prompt (its `answer`) and the
completion text, so any worker can score without shared state.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

from pipeline.core.types import Prompt

RewardFn = Callable[[Prompt, str], float]

# Modules of earlier releases that a recipe's spec may still name, and where their rewards are now.
MOVED = {
    "pipeline.inputs.rewards": "pipeline.rewards.rules",
    "pipeline.inputs.math_reward": "pipeline.rewards.math_verifier",
    "pipeline.io.rewards": "pipeline.rewards.rules",
    "pipeline.rewards": "pipeline.rewards.rules",
}


class RewardError(ValueError):
    """A reward spec that cannot be used; the message names the spec."""


def load_reward(spec: str) -> RewardFn:
    """Resolve "package.module:function" to a callable."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise RewardError(f"reward spec {spec!r}: expected 'module:function', "
                          "e.g. 'pipeline.rewards.rules:tiny_reward'")
    module_name, attr = spec.split(":")
    if not module_name or not attr:
        raise RewardError(f"reward spec {spec!r}: expected 'module:function' with both parts non-empty")
    module_name = MOVED.get(module_name, module_name)
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
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # some builtins have no signature; a wrong one then fails on the first sample
    try:
        signature.bind(Prompt("id", "prompt", "answer"), "completion")
    except TypeError:
        raise RewardError(f"reward spec {spec!r}: {attr}{signature} cannot be called as "
                          f"{attr}(prompt, completion_text)") from None
    return fn
