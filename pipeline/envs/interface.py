"""What an environment is, and how a recipe names one (env.class).

A multi-turn rollout alternates model turns and environment steps for each
sample (pipeline/generator/episodes.py):

    observation = env.reset(prompt)          the model's first context (its text)
    loop up to env.max_turns:
        action = the model's turn, sampled after the context
        observation, reward, done, info = env.step(action)
        stop if done; else the observation, formatted by env.observation_format,
        is appended to the context (its tokens are masked out of the loss)

One instance per sample, built as `Class(**env.args)`, so an environment may
keep per-episode state in `self`. A run replays exactly only if `reset` and
`step` are functions of the prompt and the actions so far (seed any randomness
from `prompt.id`). A single-turn reward function (data.reward) is the one-turn
case and needs no environment.

An environment that can demonstrate its task defines `expert_action()`: the
right action in its current state. The supervised warm-up
(pipeline/trainer/warmup.py) builds its transcripts from it.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Protocol

from pipeline.core.specs import SpecError, resolve_spec
from pipeline.core.types import Prompt


class EnvError(ValueError):
    """An env.class that cannot be used; the message names the spec."""


class Environment(Protocol):
    def reset(self, prompt: Prompt) -> str:
        """Start an episode for `prompt`; the first observation, which the model sees as its prompt."""

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """The model's turn as text -> (observation, reward, done, info)."""


def load_env_class(spec: str, args: dict[str, Any] | None = None) -> type:
    """Resolve "package.module:Class" and check that `Class(**args)` builds an
    environment; raises EnvError naming the spec."""
    try:
        attr, cls = resolve_spec(spec, "module:Class", "pipeline.envs.calculator:CalculatorEnv")
    except SpecError as exc:
        raise EnvError(f"env.class {spec!r}: {exc}") from exc.__cause__
    if not inspect.isclass(cls):
        raise EnvError(f"env.class {spec!r}: {attr!r} is a {type(cls).__name__}, not a class")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise EnvError(f"env.class {spec!r}: {attr} has no {method}() method; an environment defines "
                           "reset(prompt) -> observation and step(action) -> (observation, reward, done, info)")
    try:
        inspect.signature(cls).bind(**(args or {}))
    except TypeError as exc:
        raise EnvError(f"env.class {spec!r}: {attr} cannot be built with env.args {args or {}}: {exc}") from None
    except ValueError:
        pass  # no signature to check (a builtin base): building the first episode will tell
    return cls


def check_step_result(result: Any) -> tuple[str, float, bool, dict]:
    """env.step's answer, checked: a malformed one fails its sample with this message."""
    if not isinstance(result, tuple) or len(result) != 4:
        raise TypeError(f"step() must return (observation, reward, done, info), got {result!r:.200}")
    observation, reward, done, info = result
    if not isinstance(observation, str):
        raise TypeError(f"step() returned a {type(observation).__name__} observation; expected str")
    reward = float(reward)
    if not math.isfinite(reward):
        # Summed into the sample's reward it would reach the loss: fail the sample instead.
        raise ValueError(f"step() returned reward {reward}; a reward must be finite")
    return observation, reward, bool(done), dict(info or {})
