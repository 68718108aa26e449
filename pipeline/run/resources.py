"""Resource telemetry: each role's resident memory and the object store's use, beside a step.

A leak shows first here, as a slope, long before it stops a run: the weights
a refit moves are the largest thing a step makes, and one copy kept per step
grows the store by a model a step (DESIGN.md, invariant 7, states the bound).

Sampled beside the step, not in it: `start` asks every actor for its RSS (each
keeps a thread free for such calls) and a thread of the driver asks the
raylet for the store's totals while the graph runs; `read` collects both once
the step is done. A step that starts within SAMPLE_EVERY_S of the last
sample's start records none. Names in the record: `rss_mb/<worker>` (driver included;
the process's own memory, the store's shared pages left out), `store_mb`,
`store_objects`, `store_spilled_mb`.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import grpc
import ray

from pipeline.core.memory import MB, process_rss

# A sample costs the driver CPU and every actor and the raylet a call, while a
# leak's slope needs no more than one a second, however short the steps.
SAMPLE_EVERY_S = 1.0


class Cadence:
    """Whether a sample is due: at the first call, then at the first call
    `every_s` or more after the last one that was."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self._next: float | None = None

    def due(self) -> bool:
        now = self.clock()
        if self._next is not None and now < self._next:
            return False
        self._next = now + self.every_s
        return True


class ObjectStoreStats:
    """The cluster's object-store totals, as `ray memory --stats-only` reads
    them, from one gRPC channel to a live raylet kept for the run."""

    def __init__(self) -> None:
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc
        node = next(n for n in ray.nodes() if n["Alive"])
        channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
        self._stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        self._request = node_manager_pb2.FormatGlobalMemoryInfoRequest(include_memory_info=False)

    def sample(self, timeout_s: float) -> dict[str, float]:
        stats = self._stub.FormatGlobalMemoryInfo(self._request, timeout=timeout_s).store_stats
        return {"store_mb": stats.object_store_bytes_used / MB, "store_objects": float(stats.num_local_objects),
                "store_spilled_mb": stats.spilled_bytes_total / MB}


class ResourceProbe:
    """A sample beside a step, at most one per `every_s`, of every worker's
    RSS and the store; the peaks of the run."""

    def __init__(self, timeout_s: float, every_s: float = SAMPLE_EVERY_S) -> None:
        self.timeout_s = timeout_s
        self.cadence = Cadence(every_s)
        self.sampling = False
        self.peak: dict[str, float] = {}
        self._store: ObjectStoreStats | None = ObjectStoreStats()
        self._rss: dict[str, Any] = {}
        self._store_sample: dict[str, float] = {}
        self._thread: threading.Thread | None = None

    def start(self, actors: dict[str, Any]) -> None:
        self.sampling = self.cadence.due()
        if not self.sampling:
            return
        self._rss = {name: actor.rss.remote() for name, actor in actors.items()}
        self._thread = threading.Thread(target=self._sample_store, name="resource-probe", daemon=True)
        self._thread.start()

    def _sample_store(self) -> None:
        try:
            self._store_sample = self._store.sample(self.timeout_s) if self._store is not None else {}
        except grpc.RpcError as exc:  # telemetry is not worth a run: say so once and go on without it
            self._store, self._store_sample = None, {}
            print(f"dagrl: object-store telemetry stopped: {type(exc).__name__}: {exc}")

    def read(self) -> dict[str, float]:
        """The step's sample: every actor that answered within the deadline, the
        driver, the store; empty where `start` found none due."""
        if not self.sampling:
            return {}
        record = {"rss_mb/driver": process_rss() / MB}
        names, refs = list(self._rss), list(self._rss.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s) if refs else ([], [])
        for name, ref in zip(names, refs):
            if ref in ready:
                try:
                    record[f"rss_mb/{name}"] = ray.get(ref, timeout=self.timeout_s) / MB
                except ray.exceptions.RayError:
                    pass  # a dead worker: the runner reports it, and the next step's probe asks its successor
        self._rss = {}
        if self._thread is not None:
            self._thread.join(self.timeout_s)
            if not self._thread.is_alive():
                record.update(self._store_sample)
            self._thread = None
        for key, value in record.items():
            self.peak[key] = max(self.peak.get(key, 0.0), value)
        return record
