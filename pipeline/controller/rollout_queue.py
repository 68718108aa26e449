"""The rollout queue: finished rollout batches wait here, keyed by id with the
weight version they were launched at, until the step they target takes them;
each batch is trained once. With conservation accounting.

Every launched batch ends in exactly one place: trained, dropped with a
reason, or still buffered; `accounting()` says which, and the event log
records each transition.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.core.types import TRAJECTORY_SCHEMA
from pipeline.core.events import EventLog


class Interrupted(RuntimeError):
    """The driver stopped a wait: a worker died and the step will be recovered."""


@dataclass
class _Entry:
    batch_id: str
    target: int
    version: int
    table: pa.Table | None = None  # None while the rollout is in flight
    launch: Any = None             # dags.tokens.Launch: what to relaunch if its generator dies
    clock: tuple = ()              # the rollout_end's vector clock, from put


def _launch_order(e: _Entry) -> tuple:
    """The step's own launch first, then dynamic sampling's extra rounds; by batch id within a round."""
    return (getattr(e.launch, "round", 0), e.batch_id)


class RolloutQueue:
    def __init__(self, max_age: int, log: EventLog):
        self.max_age = max_age
        self.log = log
        self._entries: dict[str, _Entry] = {}
        self.launched = 0
        self.trained = 0
        self.dropped: Counter[str] = Counter()
        # Rollout threads put while the sample node waits; a condition lets
        # sample sleep until the batches it needs have arrived.
        self._cv = threading.Condition()
        self._interrupted: str | None = None
        self._fatal: str | None = None
        # target step -> [(batch id, why dropped)]: a step left with nothing to
        # train on names what became of its batches.
        self._drops: dict[int, list[tuple[str, str]]] = {}

    def expect(self, batch_id: str, target: int, version: int, launch: Any = None) -> None:
        with self._cv:
            if batch_id in self._entries:
                raise ValueError(f"batch {batch_id} launched twice")
            self._entries[batch_id] = _Entry(batch_id, target, version, launch=launch)
            self.launched += 1

    def in_flight(self, generator: int) -> list[_Entry]:
        with self._cv:
            return [e for e in self._entries.values() if e.table is None
                    and e.launch is not None and e.launch.generator == generator]

    def relaunch(self, batch_id: str, version: int) -> Any:
        """A batch whose generator died starts again at `version`; it stays one
        launch. Returns its Launch (ids and prompts unchanged)."""
        with self._cv:
            entry = self._entries[batch_id]
            if entry.table is not None:
                raise ValueError(f"batch {batch_id} already arrived; it cannot be relaunched")
            entry.version = version
            return entry.launch

    def restore(self, batch_id: str, target: int, version: int, table: pa.Table | None, launch: Any) -> None:
        """From a checkpoint: counted as launched in the run that launched it, so not here."""
        with self._cv:
            self._entries[batch_id] = _Entry(batch_id, target, version, table, launch)

    def interrupt(self, reason: str) -> None:
        with self._cv:
            self._interrupted = reason
            self._cv.notify_all()

    def clear_interrupt(self) -> None:
        with self._cv:
            self._interrupted = None

    def fatal(self, reason: str) -> None:
        """Stop the run at the next take: the error reaches the driver through the sample node."""
        with self._cv:
            self._fatal = reason
            self._cv.notify_all()

    def put(self, batch_id: str, version: int, table: pa.Table, clock: tuple = ()) -> None:
        with self._cv:
            entry = self._entries.get(batch_id)
            if entry is None or entry.table is not None:
                raise ValueError(f"batch {batch_id} arrived but was not in flight")
            if version != entry.version:
                raise ValueError(f"batch {batch_id} was launched for version {entry.version} "
                                 f"but generated with version {version}")
            entry.table, entry.clock = table, clock
            self._cv.notify_all()

    def fail(self, batch_id: str, reason: str, clock: tuple = ()) -> None:
        with self._cv:
            entry = self._entries.pop(batch_id, None)
            if entry is not None:
                self.log.merge(clock)  # the drop is after the failed rollout's end
                self._drop(entry, reason)
            self._cv.notify_all()

    def _drop(self, entry: _Entry, reason: str) -> None:
        self.dropped[reason.split(":")[0]] += 1
        self._drops.setdefault(entry.target, []).append((entry.batch_id, reason))
        self.log.emit("drop", step=entry.target, version=entry.version, batch=entry.batch_id, reason=reason)

    def _wait(self, step: int, deadline_s: float) -> None:
        """Until no batch for `step` is in flight (the caller holds the lock)."""
        def ready() -> bool:
            return (self._interrupted is not None or self._fatal is not None
                    or all(e.table is not None for e in self._entries.values() if e.target == step))
        done = self._cv.wait_for(ready, timeout=deadline_s)
        if self._fatal is not None:
            raise RuntimeError(self._fatal)
        if self._interrupted is not None:
            raise Interrupted(f"step {step}: {self._interrupted}")
        if not done:
            pending = sorted(e.batch_id for e in self._entries.values() if e.target == step and e.table is None)
            raise TimeoutError(f"step {step}: batches {pending} still in flight after {deadline_s:.0f} s "
                               "(run.deadline_s); is a generator stuck or dead?")

    def arrived(self, step: int, deadline_s: float) -> list[tuple[str, pa.Table]]:
        """(batch id, table) of every batch for `step`, in launch order, once none is
        in flight; they stay buffered for `take`. The caller's lane is after their rollouts."""
        with self._cv:
            self._wait(step, deadline_s)
            entries = sorted((e for e in self._entries.values() if e.target == step), key=_launch_order)
            self.log.merge(*(e.clock for e in entries))
            return [(e.batch_id, e.table) for e in entries]

    def take(self, step: int, deadline_s: float) -> tuple[list[str], list[int], pa.Table]:
        """The batches for `step` in launch order, once none of them is in flight; stale ones are dropped."""
        with self._cv:
            self._wait(step, deadline_s)
            # The caller's lane (sample's) waited for these batches: its events are
            # after their rollout_ends, and so are the stale drops below.
            self.log.merge(*(e.clock for e in self._entries.values()
                             if e.target == step or step - e.version > self.max_age))
            for entry in [e for e in self._entries.values() if step - e.version > self.max_age]:
                del self._entries[entry.batch_id]
                self._drop(entry, "stale")
            taken = sorted((e for e in self._entries.values() if e.target == step), key=_launch_order)
            drops = self._drops.pop(step, [])
            for old in [t for t in self._drops if t < step]:
                del self._drops[old]
            if not taken:
                first = f"; the first: batch {drops[0][0]} {drops[0][1]}" if drops else ""
                more = f" ({len(drops) - 1} more dropped)" if len(drops) > 1 else ""
                raise RuntimeError(f"step {step}: no trajectories to train on: every batch for this step "
                                   f"failed or was stale{first}{more}")
            for entry in taken:
                del self._entries[entry.batch_id]
            self.trained += len(taken)
        table = pa.concat_tables([e.table for e in taken]) if taken else TRAJECTORY_SCHEMA.empty_table()
        return [e.batch_id for e in taken], [e.version for e in taken], table

    def drop_all(self, reason: str) -> None:
        with self._cv:
            for entry in list(self._entries.values()):
                self._drop(entry, reason)
            self._entries.clear()

    def snapshot(self) -> tuple[list[_Entry], dict]:
        """Every entry (arrived or in flight) and the counters, for a checkpoint."""
        with self._cv:
            entries = [_Entry(e.batch_id, e.target, e.version, e.table, e.launch) for e in self._entries.values()]
            return entries, {"launched": self.launched, "trained": self.trained, "dropped": dict(self.dropped)}

    def restore_counters(self, counters: dict) -> None:
        with self._cv:
            self.launched, self.trained = counters["launched"], counters["trained"]
            self.dropped = Counter(counters["dropped"])

    def accounting(self) -> dict:
        with self._cv:
            buffered = sum(1 for e in self._entries.values() if e.table is not None)
            in_flight = len(self._entries) - buffered
            dropped = sum(self.dropped.values())
            return {"launched": self.launched, "trained": self.trained, "buffered": buffered,
                    "in_flight": in_flight, "dropped": dropped, "dropped_by_reason": dict(self.dropped),
                    "balanced": self.launched == self.trained + buffered + in_flight + dropped}
