"""The PPO critic actor: values -> GAE advantages, then the value update.

Two nodes per step (dags/step_graph.py ppo_train_subgraph):

    critic_values  critic_values(Batch) -> Advantages   values of the weights that
                   trained up to the previous step; GAE (pipeline/algos/ppo.py);
                   the policy reads them
    critic_train   critic_train(Advantages) -> CriticOut   runs beside the policy update

The driver starts it with ray.remote(CriticWorker), threaded
(max_concurrency=2), so save_state between steps never waits behind a
compiled graph's loop. The engine (pipeline/engines/deepspeed_critic.py or
pipeline/engines/sim.py SimCriticEngine) does the work.
"""
from __future__ import annotations

import threading

import pyarrow as pa
import ray

from dags.tokens import Advantages, Batch, CriticOut
from pipeline.actors.node import Actor, node, one_thread, reopen_log
from pipeline.algos.ppo import compute_advantages
from pipeline.engines import backends
from pipeline.io.config import Config
from pipeline.run import spans


class CriticWorker(Actor):
    def begin_run(self, cfg: Config, run_dir: str, t0: float, restore_dir: str | None = None) -> None:
        one_thread()
        old = getattr(self, "engine", None)
        if old is not None and hasattr(old, "close"):
            old.close()  # a pooled actor: free the last run's optimizer state first
        self.cfg = cfg
        self.log = reopen_log(self, run_dir, "critic", t0)
        spans.take()
        self.engine = backends.critic_engine(cfg)
        if restore_dir is not None:
            self.engine.load_state(restore_dir)
        # One step's batch and targets, from critic_values to critic_train of that step.
        self._pending: dict[int, tuple[pa.Table, pa.Table, dict[str, float]]] = {}
        self._live_advantages = None
        # save_state arrives on the second thread; it must not see half an update.
        self._lock = threading.Lock()
        self.log.emit("worker_ready", spans=spans.take())

    @node("critic_values")
    def critic_values(self, batch: Batch) -> Advantages:
        table = ray.get(batch.table_ref[0])
        p = self.cfg.ppo
        with self._lock:
            values = self.engine.values(table)
        targets, stats = compute_advantages(table, values, gamma=p.gamma, lam=p.lam,
                                            whiten_advantages=p.whiten_advantages)
        # Held until the next step's critic_values: a ref sent through a
        # compiled-graph channel is not borrowed, so its owner must keep it alive
        # until the trainer has read it (the trainer's train of this step).
        self._live_advantages = ref = ray.put(targets)
        # Only this step's entry: its critic_train comes before the next critic_values.
        self._pending = {batch.step: (table, targets, stats)}
        return Advantages(batch.step, (ref,), tuple(sorted(stats.items())))

    @node("critic_train")
    def critic_train(self, adv: Advantages) -> CriticOut:
        pending = self._pending.pop(adv.step, None)
        if pending is None:
            raise RuntimeError(f"critic_train of step {adv.step} without its critic_values "
                               f"(pending: {sorted(self._pending)})")
        table, targets, stats = pending
        with self._lock:
            metrics = self.engine.train_step(table, targets)
        return CriticOut(adv.step, tuple(sorted({**stats, **metrics}.items())))

    def save_state(self, path: str) -> None:
        with self._lock:
            self.engine.save_state(path)
