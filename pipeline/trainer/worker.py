"""The trainer actor: the policy update (`train`) and the weights it exports.

The work is done by the training engine (pipeline/trainer/); this actor
computes the outcome advantages of the critic-free algorithms (pipeline/algos/advantages.py), checks versions, logs,
and puts the new weights in the object store for the generators' refits.
"""
from __future__ import annotations

import time

import pyarrow as pa
import ray

from dags.tokens import Advantages, Batch, Clock, Gate, Stored, TrainOut, WeightsSent
from pipeline.core.node import Actor, node, on_step_thread, one_thread, reopen_log, whereabouts
from pipeline.trainer.skipped_steps import SkippedSteps
from pipeline.weights import packing
from pipeline.trainer.engines import training_engine
from pipeline.core.data_parallel import Batching, Rendezvous, table_shard, trained_tokens
from pipeline.core.worker_names import TRAINER, rank_name
from pipeline.config import Config
from pipeline.core import memory
from pipeline.core import spans


class TrainerWorker(Actor):
    """One data-parallel rank of the policy. Rank 0 also exports the weights
    the generators load."""

    def __init__(self, rank: int = 0):
        self.rank = rank

    @on_step_thread
    def begin_run(self, cfg: Config, run_dir: str, t0: float, restore_dir: str | None = None,
                  start_version: int = 0, rendezvous: Rendezvous | None = None) -> Clock:
        one_thread()
        spans.take()
        self.cfg = cfg
        self.world_size = cfg.training.ranks
        self.log = reopen_log(self, run_dir, rank_name(TRAINER, self.rank, self.world_size), t0)
        self.log.emit("worker_start", **whereabouts(), rank=self.rank)
        self.engine = training_engine(cfg, self.rank, rendezvous)
        # The engine's own: training.packing falls back to padding where its model does not keep rows apart.
        self.batching = getattr(self.engine, "batching", Batching(cfg.training.micro_batch_size,
                                                                   cfg.training.max_tokens_per_micro_batch))
        if restore_dir is not None:
            self.engine.load_state(restore_dir)
        self.version = start_version
        self.skipped = SkippedSteps(self.log, "policy", cfg.fault.max_nonfinite_steps)
        self.heap = memory.HeapCap()
        # (version, ObjectRef of (version, weights) or None, clock of their making): exported
        # on first need, since most runs never replace a generator. One attribute, so a
        # reader on a spare thread never pairs one step's weights with another's clock.
        self._live = (start_version, None, self.log.now())
        if self.world_size > 1 and cfg.training.zero_stage == 3:
            # current_weights runs on rank 0 alone, and a ZeRO-3 gather needs every rank: export
            # the start weights now, all ranks together (a resume or a restart may ask for them).
            exported = self.engine.export_weights()
            if self.rank == 0:
                self._hold(start_version, self._put(start_version, exported))
        # training.dtype as this rank resolved it (auto: by its own device).
        self.log.emit("worker_ready", spans=spans.take(), dtype=getattr(self.engine, "dtype", None),
                      packing=self.batching.packed, packing_off=getattr(self.engine, "packing_off", "") or None)
        return self.log.now()

    def current_weights(self) -> tuple[int, Stored, Clock]:
        """The version, the stored (version, weights) and the clock of the event that
        made them, for a generator that starts mid-run: its load is after that event."""
        version, ref, clock = self._live
        if ref is None:
            # Only rank 0 is asked; with several ZeRO-3 ranks begin_run has exported already.
            ref = self._put(version, self.engine.export_weights())
            self._live = (version, ref, clock)
        return version, Stored(ref), clock

    @on_step_thread
    @node("train")
    def train(self, batch: Batch, advantages: Advantages | None = None) -> TrainOut:
        """Critic-free: outcome advantages from the rewards. PPO: the critic's GAE advantages;
        during ppo.critic_warmup the policy stays put, but the version still
        rises by one, so every step looks the same to the rest of the graph."""
        if any(v > self.version for v in batch.versions):
            raise RuntimeError(f"weight sync: batch versions {batch.versions} are newer than "
                               f"the trainer's weights (version {self.version})")
        self.log.emit("train_start", step=batch.step, version=self.version,
                      batches=list(batch.batch_ids), batch_versions=list(batch.versions))
        with spans.span("batch.get"):
            table = batch.table_ref.fetch(self.cfg.run.deadline_s)
        trained, shaped = self._overlong(table)
        if advantages is not None and batch.step < self.cfg.ppo.critic_warmup:
            metrics = {"policy_frozen": 1.0}
        elif table.num_rows == 0:
            # Dynamic sampling found no informative group to train on (Controller.sample).
            metrics = {"update_skipped_flat": 1.0}
        else:
            adv, measured = self._advantages(trained, advantages)
            metrics = {**shaped, **measured, **self._train_shard(trained, adv)}
            # Every rank sees the same skip (the engine agrees on it), so all raise together.
            self.skipped.check(batch.step, self.version, metrics)
        self.version += 1
        weights_ref, exported = None, None
        collective = self.cfg.generation.weight_sync == "collective"
        if not collective or self.cfg.training.zero_stage == 3:
            # Under ZeRO-3 the gather of the full weights needs every rank, so it happens here
            # even for a collective sync; send_weights then sends this copy.
            with spans.span("export_weights"):
                exported = self.engine.export_weights()
        if self.rank == 0 and not collective:
            with spans.span("weights.put"):
                weights_ref = self._put(self.version, exported)
        self._exported = exported if collective else None
        # The object store has its own copy now; this one (a full weight copy) must
        # not be alive at the heap check below, or the floor it measures holds it.
        del exported
        self.log.emit("train_end", step=batch.step, version=self.version)
        # Kept alive until the next step's refits are done (see Controller.sample).
        self._hold(self.version, weights_ref)
        self.heap.check_logged(self.log, batch.step)
        failed = sum(1 for e in table.column("reward_error").to_pylist() if e)
        metrics = {**metrics, **self._batch_shape(table), "reward_failures": float(failed),
                   "reward_mean": _mean(table.column("reward").to_pylist()),
                   "reward_std": _std(table.column("reward").to_pylist()),
                   "age_mean": _mean([batch.step - v for v in batch.versions]),
                   "age_max": float(max((batch.step - v for v in batch.versions), default=0)),
                   "response_tokens": float(sum(len(r) for r in table.column("response_ids").to_pylist())),
                   # The model's own tokens: response_tokens less the environments' observations.
                   "model_tokens": float(sum(trained_tokens(table)))}
        return TrainOut(batch.step, self.version, Stored(weights_ref) if weights_ref else None,
                        tuple(sorted(metrics.items())))

    def _overlong(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        """The table the policy trains on: with overlong.*, rewards less DAPO's
        soft penalty and truncated responses masked (the metrics keep the raw rewards)."""
        o = self.cfg.overlong
        if not (o.buffer or o.mask_truncated):
            return table, {}
        from pipeline.algos.overlong import shape_batch  # numpy only, but not the driver's business
        return shape_batch(table, self.cfg.generation.max_new_tokens, o.buffer, o.penalty, o.mask_truncated)

    def _batch_shape(self, table: pa.Table) -> dict[str, float]:
        """What peers log of a batch: response lengths, the share cut at
        generation.max_new_tokens (as the engine reports it; absent where it
        does not say), and the share of groups whose rewards are all equal,
        which a critic-free estimator cannot learn from."""
        from pipeline.algos.advantages import flat_groups  # torch: not in the driver, which imports this module
        lengths = [len(r) for r in table.column("response_ids").to_pylist()]
        g = self.cfg.schedule.group_size
        groups = table.num_rows // g
        shape = {"response_len_mean": _mean(lengths), "response_len_max": float(max(lengths, default=0)),
                 "flat_group_share": flat_groups(table.column("reward").to_pylist(), g) / groups if groups else 0.0}
        truncated = table.column("truncated")
        if truncated.null_count == 0:
            shape["response_clip_share"] = _mean([float(t) for t in truncated.to_pylist()])
        return shape

    def _put(self, version: int, exported: dict) -> ray.ObjectRef:
        """One version of the weights into the object store, logged for the bound on copies (invariant 7)."""
        packed = packing.pack(exported)
        ref = ray.put((version, packed))
        self.log.emit("weights_put", version=version, bytes=int(getattr(getattr(packed, "buffer", None), "nbytes", 0)))
        return ref

    def _hold(self, version: int, ref: ray.ObjectRef | None) -> None:
        """Keep this version's weights for a generator that starts mid-run, and
        let the last version go: every refit of it is over once a newer one is
        made (the graph orders the step before this one's train)."""
        old_version, old_ref, _ = self._live
        self._live = (version, ref, self.log.now())
        if old_ref is not None and old_ref != ref:
            del old_ref
            self.log.emit("weights_released", version=old_version)

    @on_step_thread
    @node("send_weights")
    def send_weights(self, train: TrainOut, gate: Gate) -> WeightsSent:
        """Rank 0, generation.weight_sync collective: broadcast this step's weights
        to the generators, whose refit nodes receive them at the same time."""
        if train.version != self.version:
            raise RuntimeError(f"weight sync: asked to send version {train.version}, the trainer holds {self.version}")
        from pipeline.weights import collective  # torch: not in the driver, which imports this module
        started = time.perf_counter()
        self.log.emit("send_start", step=gate.step, version=self.version)
        named = self._exported if self.cfg.training.zero_stage == 3 else self.engine.live_weights()
        with spans.span("weights.broadcast"):
            sent = collective.send(self._sync, named.items(), self.version)
        self.log.emit("send_end", step=gate.step, version=self.version, bytes=sent)
        return WeightsSent(gate.step, self.version, sent, time.perf_counter() - started)

    def weight_sync_address(self) -> tuple[str, int]:
        """Rank 0: where the weight-sync group (this rank and the generators) meets."""
        from pipeline.weights import collective
        return collective.sync_address()

    def join_weight_sync(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Rank 0 of the weight-sync group; every generator joins at the same time."""
        from pipeline.weights import collective
        if getattr(self, "_sync", None) is not None:
            collective.leave(self._sync)  # a pooled actor: the last run's group
        self._sync = collective.join(host, port, 0, world_size, backend, timeout_s,
                                      bucket_bytes=int(self.cfg.generation.sync_bucket_mb * 2**20))

    def _train_shard(self, table: pa.Table, advantages: pa.Table) -> dict[str, float]:
        """This rank's update: its whole prompt groups of the batch (all of it when alone)."""
        shard = table_shard(table, self.cfg.schedule.group_size, self.rank, self.world_size,
                            self.batching)
        if shard is None:
            return self.engine.train_step(table, advantages)
        return {**self.engine.train_step(table, advantages, shard), "shard_rows": float(shard.stop - shard.start)}

    def _advantages(self, table: pa.Table, advantages: Advantages | None) -> tuple[pa.Table, dict[str, float]]:
        """The critic's table (PPO); REINFORCE++'s with the KL in the token rewards
        (reinforce_pp.kl_coef; metric reward_kl); else the algorithm's outcome
        advantages of the table's rewards."""
        if advantages is not None:
            return advantages.table_ref.fetch(self.cfg.run.deadline_s), {}
        # Here, not at the top: the driver imports this module and need not import torch.
        from pipeline.algos.advantages import critic_free_advantages, kl_reward_advantages
        kl_coef = self.cfg.reinforce_pp.kl_coef
        if kl_coef:
            # Every rank scores the whole batch: the whitening is over all of its tokens.
            with spans.span("train.reference"):
                ref = self.engine.reference_logprobs(table)
            with spans.span("train.advantages"):
                adv, kl = kl_reward_advantages(table, ref, kl_coef)
            return adv, {"reward_kl": kl}
        with spans.span("train.advantages"):
            return critic_free_advantages(table, self.cfg.schedule.group_size, self.cfg.algorithm), {}

    def save(self, path: str) -> None:
        """Every rank: rank 0 writes the HF checkpoint, the others join its gather."""
        self.engine.save(path)

    def save_state(self, path: str) -> None:
        """Every rank: each writes its own optimizer partition into the same directory."""
        self.engine.save_state(path)


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def _std(xs: list[float]) -> float:
    m = _mean(xs)
    return float((sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5) if xs else 0.0

