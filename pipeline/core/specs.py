"""A recipe's `module:attribute` spec (env.class, agent.function) resolved to the object it names."""
from __future__ import annotations

import importlib
from typing import Any


class SpecError(ValueError):
    """A spec that names nothing importable; the message says why, without the spec's key."""


def resolve_spec(spec: Any, shape: str, example: str) -> tuple[str, Any]:
    """(attribute name, object) of "package.module:attribute"; `shape` and
    `example` ("module:Class", "pipeline.envs.calculator:CalculatorEnv") go in the error."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise SpecError(f"expected '{shape}', e.g. '{example}'")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a module's import can raise anything
        raise SpecError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    found = getattr(module, attr, None)
    if found is None:
        raise SpecError(f"module {module_name!r} has no attribute {attr!r}")
    return attr, found


def version_runs(versions) -> list[list[int]]:
    """Per-token weight versions as runs, [[version, tokens], ...] (what the event log records)."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs
