"""The PPO critic actor: values -> GAE advantages, then the value update.

Three nodes per step (dags/step_graph.py actor_critic_train_subgraph), on each of the
critic's data-parallel ranks (ppo.critic_ranks):

    critic_values  critic_values(Batch) -> Values   this rank's shard's values under
                   the weights that trained up to the previous step
    advantages     advantages(*Values) -> Advantages   rank 0 only: GAE
                   (pipeline/algos/ppo.py) over the whole batch, so whitening
                   and statistics are the batch's; the policy reads them
    critic_train   critic_train(Advantages) -> CriticOut   this rank's shard,
                   beside the policy update

The driver starts it as a trainer rank is started (pipeline/core/node.py
rank_actor): its nodes on one step thread, save_state on a spare one, so it
never waits behind a compiled graph's loop. The engine
(pipeline/trainer/deepspeed_critic.py or pipeline/sim/engines.py
SimCriticEngine) does the work.
"""
from __future__ import annotations

import threading

import pyarrow as pa

from dags.tokens import Advantages, Batch, CriticOut, Values
from pipeline.core.events import EventLog
from pipeline.core.node import Actor, node, on_step_thread, one_thread, whereabouts
from pipeline.trainer.skipped_steps import SkippedSteps
from pipeline.trainer.engines import critic_engine
from pipeline.core.data_parallel import Batching, Rendezvous, Shard, table_shard
from pipeline.core.worker_names import CRITIC, rank_name
from pipeline.config import Config
from pipeline.core import spans


class CriticWorker(Actor):
    def __init__(self, rank: int = 0):
        super().__init__()
        one_thread()
        self.rank = rank

    @on_step_thread
    def begin_run(self, cfg: Config, run_dir: str, t0: float, restore_dir: str | None = None,
                  rendezvous: Rendezvous | None = None) -> None:
        self.cfg = cfg
        self.world_size = cfg.ppo.critic_ranks
        self.log = EventLog(run_dir, rank_name(CRITIC, self.rank, self.world_size), t0)
        self.log.emit("worker_start", **whereabouts(), rank=self.rank)
        spans.take()
        self.engine = critic_engine(cfg, self.rank, rendezvous)
        self.batching = getattr(self.engine, "batching", Batching(cfg.training.micro_batch_size,
                                                                   cfg.training.max_tokens_per_micro_batch))
        if restore_dir is not None:
            self.engine.load_state(restore_dir)
        # One step's batch, from critic_values to critic_train of that step.
        self._pending: dict[int, pa.Table] = {}
        # save_state arrives on a spare thread; it must not see half an update.
        self._lock = threading.Lock()
        self.skipped = SkippedSteps(self.log, "critic", cfg.fault.max_nonfinite_steps, loss_key="value_loss")
        self.log.emit("worker_ready", spans=spans.take(), dtype=getattr(self.engine, "dtype", None))

    @on_step_thread
    def end_run(self, deadline_s: float) -> None:
        self.engine.close()
        super().end_run(deadline_s)

    def _shard(self, table: pa.Table) -> Shard | None:
        return table_shard(table, self.cfg.schedule.group_size, self.rank, self.world_size,
                           self.batching)

    @on_step_thread
    @node("critic_values")
    def critic_values(self, batch: Batch) -> Values:
        table = batch.table_ref.fetch(self.cfg.run.deadline_s)
        with self._lock:
            values = self.engine.values(table, self._shard(table))
        # Only this step's entry: its critic_train comes before the next critic_values.
        self._pending = {batch.step: table}
        return Values(batch.step, self.rank, self.put_for_step("values", values))

    @on_step_thread
    @node("advantages")
    def advantages(self, *shards: Values) -> Advantages:
        """Rank 0: the shards' values in rank order are the batch's, row by row."""
        step = shards[0].step
        if sorted(v.rank for v in shards) != list(range(self.world_size)) or {v.step for v in shards} != {step}:
            raise RuntimeError(f"advantages: values of ranks {[v.rank for v in shards]} for steps "
                               f"{sorted({v.step for v in shards})}; expected every rank's of step {step}")
        values = [row for v in sorted(shards, key=lambda v: v.rank)
                  for row in v.values_ref.fetch(self.cfg.run.deadline_s)]
        p = self.cfg.ppo
        from pipeline.algos.ppo import compute_advantages  # torch: the driver imports this module
        targets, stats = compute_advantages(self._pending[step], values, gamma=p.gamma, lam=p.lam,
                                            whiten_advantages=p.whiten_advantages)
        return Advantages(step, self.put_for_step("advantages", targets), tuple(sorted(stats.items())))

    @on_step_thread
    @node("critic_train", trim_heap=True)
    def critic_train(self, adv: Advantages) -> CriticOut:
        table = self._pending.pop(adv.step, None)
        if table is None:
            raise RuntimeError(f"critic_train of step {adv.step} without its critic_values "
                               f"(pending: {sorted(self._pending)})")
        targets = adv.table_ref.fetch(self.cfg.run.deadline_s)
        with self._lock:
            metrics = self.engine.train_step(table, targets, self._shard(table))
        self.skipped.check(adv.step, None, metrics)
        return CriticOut(adv.step, tuple(sorted({**dict(adv.metrics), **metrics}.items())))

    def save_state(self, path: str) -> None:
        """Every rank: each writes its own optimizer partition into the same directory."""
        with self._lock:
            self.engine.save_state(path)
