"""A reward a recipe names (data.reward, validation.reward), resolved by
`load_reward` into `fn(prompt: Prompt, completion_text: str) -> float`.

A spec is "package.module:function", or "path/to/file.py:function" (verl's
custom_reward_function.path; relative to the working directory), or a map
from a prompt's `data_source` to a spec, with a "default" entry for the other
sources (verl's default_compute_score routes so). The function is dagrl's
`fn(prompt, completion_text)` or verl's `compute_score(data_source,
solution_str, ground_truth, extra_info)`, adapted here and nowhere else.
Rewards are pure functions of the prompt (its `answer`) and the completion
text, so any worker can score without shared state.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Mapping

from pipeline.core.types import Prompt

RewardFn = Callable[[Prompt, str], float]
RewardSpec = str | Mapping[str, str]
DEFAULT = "default"
# The keywords verl's reward managers call compute_score with.
VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")

# Modules of earlier releases that a recipe's spec may still name, and where their rewards are now.
MOVED = {
    "pipeline.inputs.rewards": "pipeline.rewards.rules",
    "pipeline.inputs.math_reward": "pipeline.rewards.math_verifier",
    "pipeline.io.rewards": "pipeline.rewards.rules",
    "pipeline.rewards": "pipeline.rewards.rules",
}


class RewardError(ValueError):
    """A reward spec that cannot be used; the message names the spec."""


def load_reward(spec: RewardSpec) -> RewardFn:
    """Resolve a spec, or a map of them by data_source, to one reward function."""
    if isinstance(spec, Mapping):
        return RoutedReward.load(spec)
    return _load_one(spec)


def _load_one(spec: str) -> RewardFn:
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise RewardError(f"reward spec {spec!r}: expected 'module:function' or 'path/to/file.py:function', "
                          "e.g. 'pipeline.rewards.rules:tiny_reward'")
    module_name, attr = spec.split(":")
    if not module_name or not attr:
        raise RewardError(f"reward spec {spec!r}: expected 'module:function' with both parts non-empty")
    if module_name.endswith(".py") or "/" in module_name:
        module, named = _import_file(spec, Path(module_name)), f"file {module_name!r}"
    else:
        module_name = MOVED.get(module_name, module_name)
        named = f"module {module_name!r}"
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - a module's import can raise anything
            raise RewardError(f"reward spec {spec!r}: cannot import {named}: {type(exc).__name__}: {exc}") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise RewardError(f"reward spec {spec!r}: {named} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardError(f"reward spec {spec!r}: {attr!r} is a {type(fn).__name__}, not callable")
    return _adapt(spec, attr, fn)


def _import_file(spec: str, path: Path) -> ModuleType:
    """The module of a .py file, imported by its path (as verl imports
    custom_reward_function.path); it need not be on sys.path. Once per process
    and version of the file: a worker that outlives a run sees an edited file."""
    if path.suffix != ".py":
        raise RewardError(f"reward spec {spec!r}: {str(path)!r} is a path but not a .py file")
    if not path.is_file():
        cwd = "" if path.is_absolute() else f" (relative to the working directory {str(Path.cwd())!r})"
        raise RewardError(f"reward spec {spec!r}: file {str(path)!r} does not exist{cwd}")
    resolved = path.resolve()
    stat = resolved.stat()
    version = f"{resolved}|{stat.st_mtime_ns}|{stat.st_size}"
    name = f"dagrl_reward_file_{hashlib.sha1(version.encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, resolved))
    # Registered before it runs: a dataclass or pickle in the file looks its module up by name.
    sys.modules[name] = module
    try:
        module.__spec__.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - a module's import can raise anything
        del sys.modules[name]
        raise RewardError(f"reward spec {spec!r}: cannot import file {str(path)!r}: "
                          f"{type(exc).__name__}: {exc}") from exc
    return module


def _adapt(spec: str, attr: str, fn: Callable) -> RewardFn:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # some builtins have no signature; a wrong one then fails on the first sample
    if set(VERL_PARAMETERS[:3]) <= set(signature.parameters):
        try:
            signature.bind(**dict.fromkeys(VERL_PARAMETERS))
        except TypeError:
            raise RewardError(f"reward spec {spec!r}: {attr}{signature} has verl's parameters, but verl calls it "
                              f"as {attr}({', '.join(f'{p}=...' for p in VERL_PARAMETERS)})") from None
        return VerlScore(spec, fn)
    try:
        signature.bind(Prompt("id", "prompt", "answer"), "completion")
    except TypeError:
        raise RewardError(f"reward spec {spec!r}: {attr}{signature} cannot be called as "
                          f"{attr}(prompt, completion_text), nor as verl's "
                          f"{attr}({', '.join(VERL_PARAMETERS)})") from None
    return fn


@dataclass(frozen=True)
class VerlScore:
    """verl's compute_score as a reward: called with keywords as verl's reward
    managers call it, the prompt's answer its ground truth. It may return a
    number or a dict with the number under "score" (its other keys are verl's
    extra metrics, not kept)."""
    spec: str
    fn: Callable

    def __call__(self, prompt: Prompt, completion_text: str) -> float:
        extra_info = json.loads(prompt.extra_info) if prompt.extra_info else {}
        result = self.fn(data_source=prompt.data_source, solution_str=completion_text, ground_truth=prompt.answer,
                         extra_info=extra_info)
        score = result.get("score") if isinstance(result, dict) else result
        if not isinstance(score, numbers.Real):
            what = "a dict without a number under 'score'" if isinstance(result, dict) else type(result).__name__
            raise RewardError(f"reward spec {self.spec!r} returned {what}; expected a number, or a dict with "
                              "the number under 'score'")
        if not math.isfinite(score):
            raise RewardError(f"reward spec {self.spec!r} returned the score {score}")
        return float(score)


@dataclass(frozen=True)
class RoutedReward:
    """A reward per data_source: each prompt scored by its source's, or by the
    "default" entry's for a source the map does not name."""
    routes: Mapping[str, RewardFn]
    default: RewardFn | None

    @classmethod
    def load(cls, specs: Mapping[str, str]) -> RoutedReward:
        if not specs:
            raise RewardError("reward map is empty; give 'data_source: module:function' entries, or 'default'")
        routes = {source: _load_one(spec) for source, spec in specs.items() if source != DEFAULT}
        return cls(routes, _load_one(specs[DEFAULT]) if DEFAULT in specs else None)

    def route(self, data_source: str) -> RewardFn:
        fn = self.routes.get(data_source, self.default)
        if fn is None:
            source = repr(data_source) if data_source else "'' (no data_source)"
            raise RewardError(f"data_source {source} has no reward: the map names {', '.join(map(repr, self.routes))}"
                              f" and has no {DEFAULT!r} entry")
        return fn

    def __call__(self, prompt: Prompt, completion_text: str) -> float:
        return self.route(prompt.data_source)(prompt, completion_text)


def check_routes(reward: RewardFn, path: str, sources: Mapping[str, str]) -> None:
    """Every data_source of a dataset (`sources`: each one and where it first
    appears, "row 3") has a reward, where `reward` is routed by source."""
    if not isinstance(reward, RoutedReward):
        return
    for source, where in sources.items():
        try:
            reward.route(source)
        except RewardError as exc:
            raise RewardError(f"{path}: {where}: {exc}; add an entry for it, or a {DEFAULT!r} one") from None
