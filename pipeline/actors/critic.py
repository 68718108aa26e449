"""The PPO critic actor: values -> GAE advantages, then the value update.

Two nodes per step (dags/step_graph.py ppo_train_subgraph):

    critic_values  advantages(Batch) -> Advantages   values of the weights that
                   trained up to the previous step; GAE; the policy reads them
    critic_train   train(Advantages) -> CriticOut    runs beside the policy update

The driver starts it with ray.remote(CriticWorker), threaded
(max_concurrency=2), so save_state between steps never waits behind a
compiled graph's loop. The engine (pipeline/engines/deepspeed_critic.py or
pipeline/engines/sim.py SimCriticEngine) does the work.
"""
from __future__ import annotations

import math
import threading

import pyarrow as pa
import ray
import torch

from dags.tokens import Advantages, Batch, CriticOut
from pipeline.actors.node import node, one_thread, reopen_log
from pipeline.algos.ppo import explained_variance, gae, last_token_rewards, masked_mean, masked_var, whiten
from pipeline.engines import backends
from pipeline.io.config import Config
from pipeline.run import spans

ADVANTAGE_SCHEMA = pa.schema([
    ("advantages", pa.list_(pa.float32())),
    ("returns", pa.list_(pa.float32())),
    ("values", pa.list_(pa.float32())),
])


def compute_advantages(table: pa.Table, values: list[list[float]], *, gamma: float, lam: float,
                       whiten_advantages: bool) -> tuple[pa.Table, dict[str, float]]:
    """Per-token GAE for a trajectory table, from the critic's `values`.

    The sequence reward sits on each row's last response token (pipeline.algos.ppo).
    A row whose reward function raised (`reward_error`; the generator filled
    in its group's mean) teaches nothing: advantages 0, and returns equal to
    the values, so the critic's loss there is 0 too.
    Returns an ADVANTAGE_SCHEMA table, row i for row i of `table`, and
    statistics over the other rows, before whitening: adv_mean / adv_std,
    values_mean, returns_mean, explained_var (of these values against the
    returns: how well the critic predicted this batch before learning from it).
    """
    responses = table.column("response_ids").to_pylist()
    if len(values) != len(responses):
        raise ValueError(f"{len(values)} value rows for {len(responses)} trajectories")
    width = max((len(r) for r in responses), default=0)
    mask = torch.zeros(len(responses), width, dtype=torch.bool)
    v = torch.zeros(len(responses), width)
    for i, (resp, vals) in enumerate(zip(responses, values)):
        if len(vals) != len(resp):
            raise ValueError(f"row {i}: {len(vals)} values for {len(resp)} response tokens")
        mask[i, :len(resp)] = True
        v[i, :len(resp)] = torch.tensor(vals, dtype=torch.float32)
    rewards = torch.tensor(table.column("reward").to_pylist(), dtype=torch.float32)
    adv, ret = gae(last_token_rewards(rewards, mask), v, mask, gamma=gamma, lam=lam)
    errors = table.column("reward_error").to_pylist()
    good = mask & torch.tensor([not e for e in errors], dtype=torch.bool).unsqueeze(-1)
    adv = torch.where(good, adv, torch.zeros(()))
    ret = torch.where(good, ret, v)
    stats = {"adv_mean": float(masked_mean(adv, good)), "adv_std": math.sqrt(float(masked_var(adv, good))),
             "values_mean": float(masked_mean(v, good)), "returns_mean": float(masked_mean(ret, good)),
             "explained_var": explained_variance(v, ret, good)}
    if whiten_advantages:
        adv = whiten(adv, good)
    lengths = [len(r) for r in responses]
    out = pa.table({name: [t[i, :n].tolist() for i, n in enumerate(lengths)]
                    for name, t in (("advantages", adv), ("returns", ret), ("values", v))},
                   schema=ADVANTAGE_SCHEMA)
    return out, stats


class CriticWorker:
    def begin_run(self, cfg: Config, run_dir: str, t0: float, resume_dir: str | None = None) -> None:
        one_thread()
        old = getattr(self, "engine", None)
        if old is not None and hasattr(old, "close"):
            old.close()  # a pooled actor: free the last run's optimizer state first
        self.cfg = cfg
        self.log = reopen_log(self, run_dir, "critic", t0)
        spans.take()
        self.engine = backends.critic_engine(cfg)
        if resume_dir is not None:
            self.engine.load_state(resume_dir)
        # One step's batch and targets, from critic_values to critic_train of that step.
        self._pending: dict[int, tuple[pa.Table, pa.Table, dict[str, float]]] = {}
        self._live_advantages = None
        # save_state arrives on the second thread; it must not see half an update.
        self._lock = threading.Lock()
        self.log.emit("worker_ready", spans=spans.take())

    def ping(self) -> bool:
        """The driver's liveness probe (pipeline/run/runner.py dead_actors); takes no lock,
        so a busy critic still answers on its second thread."""
        return True

    @node("critic_values")
    def advantages(self, batch: Batch) -> Advantages:
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
    def train(self, adv: Advantages) -> CriticOut:
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
