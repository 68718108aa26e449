"""The trainer actor: the policy update (`train`) and the weights it exports.

The work is done by the training engine (pipeline/trainer/); this actor
computes the outcome advantages of the critic-free algorithms (pipeline/algos/advantages.py),
checks versions, logs, and publishes each new version of the weights for the
generators' refits (pipeline/weights/sync.py).
"""
from __future__ import annotations

import time

import pyarrow as pa

from dags.tokens import Advantages, Batch, Clock, Gate, Stored, TrainOut, WeightsSent
from pipeline.core.events import EventLog
from pipeline.core.node import Actor, node, on_step_thread, one_thread, whereabouts
from pipeline.algos.kl_control import KLController
from pipeline.trainer.skipped_steps import SkippedSteps
from pipeline.weights import sync
from pipeline.trainer.engines import training_engine
from pipeline.core.data_parallel import Batching, Rendezvous, table_shard, trained_tokens
from pipeline.core.worker_names import TRAINER, rank_name
from pipeline.config import Config
from pipeline.core import spans


class TrainerWorker(Actor):
    """One data-parallel rank of the policy. Rank 0 also hands the weights it
    makes to the generators (pipeline/weights/sync.py)."""

    def __init__(self, rank: int = 0):
        super().__init__()
        one_thread()
        self.rank = rank
        self.weights = None

    @on_step_thread
    def begin_run(self, cfg: Config, run_dir: str, t0: float, restore_dir: str | None = None,
                  start_version: int = 0, rendezvous: Rendezvous | None = None) -> Clock:
        spans.take()
        self.cfg = cfg
        self.world_size = cfg.training.ranks
        self.log = EventLog(run_dir, rank_name(TRAINER, self.rank, self.world_size), t0)
        self.log.emit("worker_start", **whereabouts(), rank=self.rank)
        self.engine = training_engine(cfg, self.rank, rendezvous)
        # The engine's own: training.packing falls back to padding where its model does not keep rows apart.
        self.batching = getattr(self.engine, "batching", Batching(cfg.training.micro_batch_size,
                                                                   cfg.training.max_tokens_per_micro_batch))
        r = cfg.reward_kl
        self.kl_ctrl = KLController(r.coef, r.target if r.ctrl == "adaptive" else 0.0, r.horizon)
        if restore_dir is not None:
            self.engine.load_state(restore_dir)
            self.kl_ctrl.restore(restore_dir)
        self.version = start_version
        self.skipped = SkippedSteps(self.log, "policy", cfg.fault.max_nonfinite_steps)
        self.weights = sync.publisher(cfg, self.engine, self.log, self.rank, start_version)
        # training.dtype as this rank resolved it (auto: by its own device).
        self.log.emit("worker_ready", spans=spans.take(), dtype=getattr(self.engine, "dtype", None),
                      packing=self.batching.packed, packing_off=getattr(self.engine, "packing_off", "") or None)
        return self.log.now()

    @on_step_thread
    def end_run(self, deadline_s: float) -> None:
        self.weights.close()
        self.engine.close()
        super().end_run(deadline_s)

    def current_weights(self) -> tuple[int, Stored, Clock]:
        """Rank 0: the weights for a generator that starts mid-run (Publisher.current)."""
        return self.weights.current()

    @on_step_thread
    @node("train", trim_heap=True)
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
        weights = self.weights.publish(self.version)
        self.log.emit("train_end", step=batch.step, version=self.version)
        metrics = {**metrics, **self._batch_shape(table), **_batch_metrics(batch, table)}
        return TrainOut(batch.step, self.version, weights, tuple(sorted(metrics.items())))

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

    @on_step_thread
    @node("send_weights")
    def send_weights(self, train: TrainOut, gate: Gate) -> WeightsSent:
        """Rank 0, generation.weight_sync collective: broadcast this step's weights
        to the generators, whose refit nodes receive them at the same time."""
        if train.version != self.version:
            raise RuntimeError(f"weight sync: asked to send version {train.version}, the trainer holds {self.version}")
        started = time.perf_counter()
        self.log.emit("send_start", step=gate.step, version=self.version)
        sent = self.weights.send(self.version)
        self.log.emit("send_end", step=gate.step, version=self.version, bytes=sent)
        return WeightsSent(gate.step, self.version, sent, time.perf_counter() - started)

    def weight_sync_address(self) -> tuple[str, int]:
        """Rank 0: where the weight-sync group (this rank and the generators) meets."""
        return self.weights.address()

    def join_weight_sync(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Rank 0 of the weight-sync group; every generator joins at the same time."""
        self.weights.join(host, port, world_size, backend, timeout_s)

    def _train_shard(self, table: pa.Table, advantages: pa.Table) -> dict[str, float]:
        """This rank's update: its whole prompt groups of the batch (all of it when alone)."""
        shard = table_shard(table, self.cfg.schedule.group_size, self.rank, self.world_size,
                            self.batching)
        if shard is None:
            return self.engine.train_step(table, advantages)
        return {**self.engine.train_step(table, advantages, shard), "shard_rows": float(shard.stop - shard.start)}

    def _advantages(self, table: pa.Table, advantages: Advantages | None) -> tuple[pa.Table, dict[str, float]]:
        """The task's advantages, with distill.teacher the teacher's reverse KL
        mixed in per token (pipeline/algos/distill.py; metric distill/kl). Under
        distill.loss topk_kl the teacher is the engine's loss term instead: the
        advantage is the task's alone (none without task_reward), the KL still logged."""
        task, measured = self._task_advantages(table, advantages)
        d = self.cfg.distill
        if not d.teacher:
            return task, measured
        from pipeline.algos.distill import mix_distillation  # numpy only, but not the driver's business
        with spans.span("train.distill"):
            coef = d.coef if d.loss == "sampled_reverse_kl" else 0.0
            mixed, kl = mix_distillation(table, task, coef, d.kl_clip, d.task_reward)
        return mixed, {**measured, "distill/kl": kl}

    def _task_advantages(self, table: pa.Table, advantages: Advantages | None) -> tuple[pa.Table, dict[str, float]]:
        """The critic's table (PPO); else the algorithm's outcome advantages of the
        table's rewards, with reward_kl.coef less the KL to the initial policy
        (metrics reward_kl, reward_kl_sample_mean and reward_kl_coef, the
        coefficient this batch paid)."""
        if advantages is not None:
            return advantages.table_ref.fetch(self.cfg.run.deadline_s), {}
        # Here, not at the top: the driver imports this module and need not import torch.
        from pipeline.algos.advantages import critic_free_advantages, kl_penalised_advantages
        if self.cfg.reward_kl.coef:
            # Every rank scores the whole batch: the normalisation is over all of it, and
            # every rank's controller sees the same KL, so all hold the same coefficient.
            with spans.span("train.reference"):
                ref = self.engine.reference_logprobs(table)
            coef = self.kl_ctrl.value
            with spans.span("train.advantages"):
                adv, kl = kl_penalised_advantages(table, ref, coef, self.cfg.schedule.group_size, self.cfg.algorithm,
                                                  self.cfg.reward_kl.estimator, self.cfg.grpo_std)
            self.kl_ctrl.update(kl["reward_kl_sample_mean"], table.num_rows)
            return adv, {**kl, "reward_kl_coef": coef}
        with spans.span("train.advantages"):
            return critic_free_advantages(table, self.cfg.schedule.group_size, self.cfg.algorithm,
                                          self.cfg.grpo_std), {}

    def save(self, path: str) -> None:
        """Every rank: rank 0 writes the HF checkpoint, the others join its gather."""
        self.engine.save(path)

    def save_state(self, path: str) -> None:
        """Every rank: each writes its own optimizer partition into the same directory;
        rank 0 the KL controller's coefficient beside them."""
        self.engine.save_state(path)
        if self.rank == 0 and self.cfg.reward_kl.coef:
            self.kl_ctrl.save(path)


def _batch_metrics(batch: Batch, table: pa.Table) -> dict[str, float]:
    """The batch's rewards, ages and token counts, as every rank saw them."""
    rewards = table.column("reward").to_pylist()
    ages = [batch.step - v for v in batch.versions]
    return {"reward_failures": float(sum(1 for e in table.column("reward_error").to_pylist() if e)),
            "reward_mean": _mean(rewards), "reward_std": _std(rewards),
            "age_mean": _mean(ages), "age_max": float(max(ages, default=0)),
            "response_tokens": float(sum(len(r) for r in table.column("response_ids").to_pylist())),
            # The model's own tokens: response_tokens less the environments' observations.
            "model_tokens": float(sum(trained_tokens(table)))}


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def _std(xs: list[float]) -> float:
    m = _mean(xs)
    return float((sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5) if xs else 0.0

