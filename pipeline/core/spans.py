"""Where a node's time goes: named spans, summed per thread, logged with the node.

`with span("vllm.step"): ...` adds the block's duration to this thread's
running total for that name; `take()` returns the totals and starts afresh.
The `node` decorator (pipeline/core/node.py) takes them at node_end, and a
generator's engine loop at each rollout_end (a load it runs for a refit goes
back to the refit node: `apart`, `add`), so every run's event log holds its own profile
(benchmarks/step_profile.py reads it). A span costs two perf_counter calls and
a dict update: cheap enough to stay on in every run.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

_here = threading.local()


def _totals() -> dict[str, float]:
    totals = getattr(_here, "totals", None)
    if totals is None:
        totals = _here.totals = {}
    return totals


@contextmanager
def span(name: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        totals = _totals()
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - started


def take() -> dict[str, float]:
    """This thread's totals since the last take, in microsecond-rounded seconds."""
    totals, _here.totals = _totals(), {}
    return {name: round(seconds, 6) for name, seconds in totals.items()}


def add(totals: dict[str, float]) -> None:
    """Count another thread's spans as this thread's: work done on its behalf."""
    mine = _totals()
    for name, seconds in totals.items():
        mine[name] = mine.get(name, 0.0) + seconds


@contextmanager
def apart(out: dict[str, float]) -> Iterator[None]:
    """The spans of the block go to `out`, not to this thread's totals."""
    before = take()
    try:
        yield
    finally:
        out.update(take())
        add(before)
