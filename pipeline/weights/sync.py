"""How each new version of the weights goes from the trainer to the generators,
chosen once from generation.weight_sync:

    object_store  trainer rank 0 puts each version in the object store (one flat
                  buffer, pipeline/weights/packing.py); a generator's refit fetches
                  it while its rollouts still run, then loads it
    collective    trainer rank 0 broadcasts each version in its send_weights node
                  while every generator's refit receives it (pipeline/weights/collective.py)

The trainer's side is a publisher, the generator's a receiver; the actors call
them and never ask which sync the run uses. Either way the trainer can hand the
current version to a generator that starts mid-run, through the object store
(`current`), and such a generator loads it with `StoreReceiver.fetch`.

The events (invariant 7, pipeline/tools/check_bounds.py): weights_put and
weights_released on the trainer, weights_fetched and weights_dropped on a
generator, for every copy of the weights the object store holds.
"""
from __future__ import annotations

from typing import Any, Callable

import ray

from dags.tokens import Clock, Stored, TrainOut
from pipeline.config import Config
from pipeline.core import spans
from pipeline.core.events import EventLog
from pipeline.weights import packing


class Publisher:
    """A trainer rank's side: what `publish` does after each step is the sync's;
    keeping the current version for `current` is common to both."""

    def __init__(self, cfg: Config, engine: Any, log: EventLog, rank: int, start_version: int):
        self.engine, self.log, self.rank = engine, log, rank
        self.gathered = cfg.training.zero_stage == 3  # the full weights exist only in a gather of every rank
        # (version, ObjectRef of (version, weights) or None, clock of their making): put on
        # first need, since most runs never replace a generator. One attribute, so a reader
        # on a spare thread never pairs one step's weights with another's clock.
        self._live = (start_version, None, log.now())
        if cfg.training.ranks > 1 and self.gathered:
            # current() runs on rank 0 alone, and a ZeRO-3 gather needs every rank: export
            # the start weights now, all ranks together (a resume or a restart may ask for them).
            exported = engine.export_weights()
            if rank == 0:
                self._hold(start_version, self._put(start_version, exported))

    def close(self) -> None:
        """Leave what the sync joined (nothing, over the object store)."""

    def current(self) -> tuple[int, Stored, Clock]:
        """Rank 0: the version, its stored (version, weights) and the clock of the
        event that made them, for a generator that starts mid-run."""
        version, ref, clock = self._live
        if ref is None:
            # With several ZeRO-3 ranks the constructor has exported already.
            ref = self._put(version, self.engine.export_weights())
            self._live = (version, ref, clock)
        return version, Stored(ref), clock

    def _put(self, version: int, exported: dict) -> ray.ObjectRef:
        packed = packing.pack(exported)
        ref = ray.put((version, packed))
        self.log.emit("weights_put", version=version, bytes=int(getattr(getattr(packed, "buffer", None), "nbytes", 0)))
        return ref

    def _hold(self, version: int, ref: ray.ObjectRef | None) -> None:
        """Keep this version for a generator that starts mid-run, and let the last
        one go: every refit of it is over once a newer one is made (the graph
        orders the step before this one's train)."""
        old_version, old_ref, _ = self._live
        self._live = (version, ref, self.log.now())
        if old_ref is not None and old_ref != ref:
            del old_ref
            self.log.emit("weights_released", version=old_version)


class StorePublisher(Publisher):
    def publish(self, version: int) -> Stored | None:
        """Every rank, after the step that made `version`: what the refits fetch."""
        with spans.span("export_weights"):
            exported = self.engine.export_weights()
        ref = None
        if self.rank == 0:
            with spans.span("weights.put"):
                ref = self._put(version, exported)
        # The store has its own copy; this one goes with this frame, before the node's
        # heap trim, whose floor would otherwise hold a whole copy.
        self._hold(version, ref)
        return Stored(ref) if ref is not None else None


class CollectivePublisher(Publisher):
    def __init__(self, cfg: Config, engine: Any, log: EventLog, rank: int, start_version: int):
        super().__init__(cfg, engine, log, rank, start_version)
        self.bucket_bytes = int(cfg.generation.sync_bucket_mb * 2**20)
        self._group = None
        self._gathered_weights: dict | None = None

    def publish(self, version: int) -> Stored | None:
        """Every rank, after the step that made `version`: the refits receive it from send()."""
        if self.gathered:
            # The gather needs every rank, so it happens in train; send() sends this copy.
            with spans.span("export_weights"):
                self._gathered_weights = self.engine.export_weights()
        self._hold(version, None)
        return None

    def send(self, version: int) -> int:
        """Rank 0, in send_weights: broadcast `version`; the bytes sent."""
        from pipeline.weights import collective  # torch: not in the driver, which imports this module
        named = self._gathered_weights if self.gathered else self.engine.live_weights()
        with spans.span("weights.broadcast"):
            return collective.send(self._group, named.items(), version)

    def address(self) -> tuple[str, int]:
        from pipeline.weights import collective
        return collective.sync_address()

    def join(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        """As rank 0 of the weight-sync group; every generator joins at the same time."""
        from pipeline.weights import collective
        self._group = collective.join(host, port, 0, world_size, backend, timeout_s, bucket_bytes=self.bucket_bytes)

    def close(self) -> None:
        if self._group is not None:
            from pipeline.weights import collective
            collective.leave(self._group)
            self._group = None


def publisher(cfg: Config, engine: Any, log: EventLog, rank: int, start_version: int) -> Publisher:
    kind = CollectivePublisher if cfg.generation.weight_sync == "collective" else StorePublisher
    return kind(cfg, engine, log, rank, start_version)


class StoreReceiver:
    """A generator's side of the object-store sync, and how any generator loads
    the weights it starts with mid-run."""

    def __init__(self, cfg: Config, log: EventLog):
        self.log, self.deadline_s = log, cfg.run.deadline_s
        self._fetched: tuple[int, Any] | None = None

    def fetch(self, stored: Stored, step: int | None = None) -> int:
        """Fetch a stored version, while rollouts may still run; its version.
        `step`: the refit's; None for a start mid-run, after the step that made it."""
        with spans.span("weights.get"):
            self._fetched = stored.fetch(self.deadline_s)
        version = self._fetched[0]
        self.log.emit("weights_fetched", step=version - 1 if step is None else step, version=version)
        return version

    def prefetch(self, train: TrainOut, step: int) -> int | None:
        """The refit's first move, before the drain: the version the store holds for it."""
        return self.fetch(train.weights_ref, step)

    def loader(self, engine: Any, version: int) -> Callable[[], None]:
        """The load, for the engine loop to run between two engine steps."""
        sent_version = self._fetched[0]
        if sent_version != version:
            raise RuntimeError(f"weight sync: the weights in the object store are version {sent_version}, "
                               f"the trainer announced {version}")

        def load() -> None:
            engine.load_weights(packing.unpack(self._fetched[1]))
        return load

    def close(self) -> None:
        """Leave what the sync joined (nothing, over the object store)."""

    def release(self, step: int, version: int) -> None:
        """The engine has its own copy: a view kept of the store's buffer would pin it there."""
        if self._fetched is not None:
            self._fetched = None
            self.log.emit("weights_dropped", step=step, version=version)


class CollectiveReceiver(StoreReceiver):
    def __init__(self, cfg: Config, log: EventLog):
        super().__init__(cfg, log)
        self.bucket_bytes = int(cfg.generation.sync_bucket_mb * 2**20)
        self._group = None

    def prefetch(self, train: TrainOut, step: int) -> int | None:
        return None  # the bytes come with trainer rank 0's broadcast, during the load

    def loader(self, engine: Any, version: int) -> Callable[[], None]:
        from pipeline.weights import collective  # torch: not in the driver, which imports this module

        def load() -> None:
            with spans.span("weights.receive"):
                # send_weights broadcasts at the same time; both sides check the version before any bytes move.
                collective.receive_into(self._group, engine, version)
        return load

    def join(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
             engine: Any) -> None:
        """As `rank` (1..G) of trainer rank 0's weight-sync group."""
        from pipeline.weights import collective
        self._group = collective.join(host, port, rank, world_size, backend, timeout_s, engine=engine,
                                      bucket_bytes=self.bucket_bytes)

    def close(self) -> None:
        if self._group is not None:
            from pipeline.weights import collective
            collective.leave(self._group)
            self._group = None


def receiver(cfg: Config, log: EventLog) -> StoreReceiver:
    kind = CollectiveReceiver if cfg.generation.weight_sync == "collective" else StoreReceiver
    return kind(cfg, log)
