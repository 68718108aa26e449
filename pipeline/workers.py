"""The actors behind the step graph's nodes: controller, trainer, generators.

`begin_run` sets a worker up for one run (engine, log, version), so a test can
run many short schedules on one set of actors; the driver calls it once.

Each node is a small method that takes upstream tokens and returns one; the
work is done by the engines (pipeline/engines.py). No method here waits on
another node except through its arguments.
"""
from __future__ import annotations

import functools
import os
import random
import threading

import pyarrow as pa
import ray

from dags.tokens import (Advantages, Batch, CriticOut, Gate, Launch, Refitted, Resume, StepPlan, Ticket,
                         TrainOut, ValOut)
from pipeline import backends
from pipeline.buffer import ReplayBuffer
from pipeline.config import Config
from pipeline.engines import TRAJECTORY_SCHEMA, Completion, Prompt
from pipeline.events import EventLog


class NodeError(RuntimeError):
    """A graph node failed; the message names the node, the worker and the step."""


def _one_thread() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass


def node(name: str):
    """Log node_start/node_end and name the node, worker and step in any failure."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *tokens):
            step = next((t.step for t in tokens if hasattr(t, "step")), None)
            self.log.emit("node_start", step=step, node=name)
            try:
                out = method(self, *tokens)
            except Exception as exc:
                self.log.emit("node_error", step=step, node=name, error=f"{type(exc).__name__}: {exc}")
                raise NodeError(f"node {name!r} on worker {self.log.worker!r} failed at step {step}: "
                                f"{type(exc).__name__}: {exc}") from exc
            self.log.emit("node_end", step=step, node=name)
            return out
        return run
    return wrap


def _reopen_log(worker, run_dir: str, name: str, t0: float) -> EventLog:
    """A pooled actor serves many runs: close the last run's log file first."""
    if getattr(worker, "log", None) is not None:
        worker.log.close()
    return EventLog(run_dir, name, t0)


class Controller:
    """Owns the replay buffer, the prompt stream and the launch schedule."""

    def begin_run(self, cfg: Config, run_dir: str, t0: float) -> None:
        self.cfg = cfg
        self.log = _reopen_log(self, run_dir, "controller", t0)
        self.buffer = ReplayBuffer(cfg.grpo.max_age, self.log)
        self.prompts = backends.train_prompts(cfg)
        self.rng = random.Random(cfg.run.seed)
        self.order: list[int] = []
        self.cursor = 0

    def _next_prompts(self, count: int) -> list[Prompt]:
        out = []
        for _ in range(count):
            if self.cursor >= len(self.order):
                self.order = list(range(len(self.prompts)))
                self.rng.shuffle(self.order)
                self.cursor = 0
            out.append(self.prompts[self.order[self.cursor]])
            self.cursor += 1
        return out

    @node("sample")
    def sample(self, plan: StepPlan) -> Batch:
        ids, versions, table = self.buffer.take(plan.step, self.cfg.run.deadline_s)
        # Held until the next sample: a ref sent through a compiled-graph channel is
        # not counted as borrowed, so the owner must keep it alive for the consumer.
        self._live_table = ray.put(table)
        return Batch(plan.step, tuple(ids), tuple(versions), (self._live_table,))

    @node("validation_gate")
    def validation_gate(self, plan: StepPlan, train: TrainOut | None = None) -> Gate:
        return Gate(plan.step, train.version if train is not None else 0, plan.validate)

    @node("resume")
    def resume(self, *vals: ValOut) -> Resume:
        # Mutation tests hand this Refitted or Gate tokens instead; both carry step and version.
        versions = {v.version for v in vals}
        if len(versions) != 1:
            raise RuntimeError(f"generators disagree on the weight version: {sorted(versions)}")
        version, step = versions.pop(), vals[0].step
        max_age, g = self.cfg.grpo.max_age, self.cfg.generation
        # The prologue (step -1) fills the pipeline; each step then tops it up.
        targets = range(0, max_age + 1) if step < 0 else [step + 1 + max_age]
        launches = []
        for target in (t for t in targets if t < self.cfg.run.steps):
            prompts = self._next_prompts(self.cfg.grpo.prompts_per_step)
            for index in range(g.num_generators):
                shard = tuple(prompts[index::g.num_generators])
                if shard:
                    launch = Launch(f"t{target}.g{index}", target, index, shard)
                    self.buffer.expect(launch.batch_id, target, version)
                    launches.append(launch)
        scores = [dict(v.scores) for v in vals if isinstance(v, ValOut) and v.validated]
        val = ()
        if scores:
            count = sum(s["count"] for s in scores)
            val = (("val_reward", sum(s["reward_sum"] for s in scores) / max(count, 1)), ("val_count", count))
        return Resume(step, version, tuple(launches), val)

    @node("train_done")
    def train_done(self, policy: TrainOut, critic: CriticOut) -> TrainOut:
        metrics = dict(policy.metrics) | {f"critic/{k}": v for k, v in critic.metrics}
        return TrainOut(policy.step, policy.version, policy.weights_ref, tuple(sorted(metrics.items())))

    def put(self, batch_id: str, version: int, table: pa.Table) -> None:
        self.buffer.put(batch_id, version, table)

    def rollout_failed(self, batch_id: str, reason: str) -> None:
        self.buffer.fail(batch_id, reason)

    def finish(self) -> dict:
        self.buffer.drop_all("unused_at_end")
        return self.buffer.accounting()


class TrainerWorker:
    def begin_run(self, cfg: Config, run_dir: str, t0: float, start_version: int = 0) -> None:
        _one_thread()
        self.cfg = cfg
        self.log = _reopen_log(self, run_dir, "trainer", t0)
        self.engine = backends.training_engine(cfg)
        self.version = start_version

    @node("train")
    def train(self, batch: Batch, advantages: Advantages | None = None) -> TrainOut:
        """GRPO: group advantages from the rewards. PPO: the critic's GAE advantages;
        during ppo.critic_warmup the policy stays put, but the version still
        rises by one, so every step looks the same to the rest of the graph."""
        if any(v > self.version for v in batch.versions):
            raise RuntimeError(f"weight sync: batch versions {batch.versions} are newer than "
                               f"the trainer's weights (version {self.version})")
        self.log.emit("train_start", step=batch.step, version=self.version,
                      batches=list(batch.batch_ids), batch_versions=list(batch.versions))
        table = ray.get(batch.table_ref[0])
        if advantages is None:
            metrics = self.engine.train_step(table)
        elif batch.step < self.cfg.ppo.critic_warmup:
            metrics = {"policy_frozen": 1.0}
        else:
            metrics = self.engine.train_step(table, advantages=ray.get(advantages.table_ref[0]))
        self.version += 1
        # Kept alive until the next step's refits are done (see Controller.sample).
        self._live_weights = weights_ref = ray.put((self.version, self.engine.export_weights()))
        self.log.emit("train_end", step=batch.step, version=self.version)
        metrics = {**metrics, "reward_mean": _mean(table.column("reward").to_pylist()),
                   "reward_std": _std(table.column("reward").to_pylist()),
                   "age_mean": _mean([batch.step - v for v in batch.versions]),
                   "age_max": float(max(batch.step - v for v in batch.versions)),
                   "response_tokens": float(sum(len(r) for r in table.column("response_ids").to_pylist()))}
        return TrainOut(batch.step, self.version, (weights_ref,), tuple(sorted(metrics.items())))

    def save(self, path: str) -> None:
        self.engine.save(path)


class GeneratorWorker:
    """One generation engine. Rollouts run on a background thread that the
    next refit joins, so generation overlaps training but never a refit."""

    def __init__(self, index: int):
        self.index = index
        self._rollouts: threading.Thread | None = None

    def begin_run(self, cfg: Config, run_dir: str, t0: float, controller, start_version: int = 0) -> None:
        _one_thread()
        if self._rollouts is not None:
            # A previous run on this actor must not leak rollouts into this one.
            self._rollouts.join(timeout=cfg.run.deadline_s)
            self._rollouts = None
        self.cfg = cfg
        self.log = _reopen_log(self, run_dir, f"gen{self.index}", t0)
        self.engine = backends.generation_engine(cfg, self.index)
        self.reward_fn = backends.reward_function(cfg)
        self.val_prompts = backends.val_prompts(cfg)[self.index::cfg.generation.num_generators]
        self.controller = controller
        self.version = start_version
        self._rollout_error: str | None = None

    @node("refit")
    def refit(self, train: TrainOut, gate: Gate) -> Refitted:
        self._drain(gate.step)
        if train.version != self.version + 1:
            raise RuntimeError(f"weight sync: trainer sent version {train.version}, "
                               f"generator holds {self.version}; expected {self.version + 1}")
        self.log.emit("refit_start", step=gate.step, version=self.version)
        sent_version, weights = ray.get(train.weights_ref[0])
        if sent_version != train.version:
            raise RuntimeError(f"weight sync: the weights in the object store are version {sent_version}, "
                               f"the trainer announced {train.version}")
        self.engine.load_weights(weights)
        self.version = train.version
        self.log.emit("refit_end", step=gate.step, version=self.version)
        return Refitted(self.log.worker, gate.step, self.version, gate.validate)

    @node("validate")
    def validate(self, ready: Refitted | Gate) -> ValOut:
        if not ready.validate or not self.val_prompts:
            return ValOut(self.log.worker, ready.step, self.version, False)
        self.log.emit("validation_start", step=ready.step, version=self.version)
        groups = self.engine.generate(self.val_prompts, n=1, greedy=True)
        rewards = [self.reward_fn(p, g[0].text) for p, g in zip(self.val_prompts, groups)]
        self.log.emit("validation_end", step=ready.step, version=self.version)
        return ValOut(self.log.worker, ready.step, self.version, True,
                      (("reward_sum", float(sum(rewards))), ("count", float(len(rewards)))))

    @node("collect")
    def collect(self, resume: Resume) -> Ticket:
        if resume.version != self.version:
            raise RuntimeError(f"asked to roll out with version {resume.version}, engine holds {self.version}")
        if self._rollouts is not None and self._rollouts.is_alive():
            raise RuntimeError("collect while rollouts are still in flight: the graph lost its refit edge")
        mine = [launch for launch in resume.launches if launch.generator == self.index]
        # Every launched batch starts here, inside the node, as one engine call: a
        # rollout can only start where the graph puts `collect`, never later from a
        # queue on the rollout thread (that would let it start during a validation).
        for launch in mine:
            ev = dict(step=launch.target, version=self.version, batch=launch.batch_id, target=launch.target)
            self.log.emit("launch", **ev)
            self.log.emit("rollout_start", **ev)
        if mine:
            self._rollouts = threading.Thread(target=self._run_rollouts, args=(mine, self.version),
                                              name=f"rollouts-{self.log.worker}", daemon=True)
            self._rollouts.start()
        return Ticket(self.log.worker, resume.step, self.version, tuple(l.batch_id for l in mine))

    def _drain(self, step: int) -> None:
        if self._rollouts is not None:
            self._rollouts.join(timeout=self.cfg.run.deadline_s)
            if self._rollouts.is_alive():
                raise TimeoutError(f"rollouts still running after {self.cfg.run.deadline_s:.0f} s "
                                   "(run.deadline_s) while draining for the refit")
            self._rollouts = None
        if self._rollout_error is not None:
            error, self._rollout_error = self._rollout_error, None
            raise RuntimeError(f"a rollout failed before step {step}: {error}")

    def _run_rollouts(self, launches: list[Launch], version: int) -> None:
        prompts = [p for launch in launches for p in launch.prompts]
        try:
            groups = self.engine.generate(prompts, n=self.cfg.grpo.group_size)
            tables, start = [], 0
            for launch in launches:
                tables.append(self._table(launch, version, groups[start:start + len(launch.prompts)]))
                start += len(launch.prompts)
        except Exception as exc:
            self._rollout_error = f"batches {[l.batch_id for l in launches]}: {type(exc).__name__}: {exc}"
            for launch in launches:
                self.log.emit("rollout_end", step=launch.target, version=version, batch=launch.batch_id,
                              target=launch.target, failed=True)
                ray.get(self.controller.rollout_failed.remote(launch.batch_id, f"failed: {exc}"))
            return
        for launch, table in zip(launches, tables):
            self.log.emit("rollout_end", step=launch.target, version=version, batch=launch.batch_id,
                          target=launch.target)
            ray.get(self.controller.put.remote(launch.batch_id, version, table))

    def _table(self, launch: Launch, version: int, groups: list[list[Completion]]) -> pa.Table:
        rows = [(prompt, c) for prompt, group in zip(launch.prompts, groups) for c in group]
        n = len(rows)
        return pa.table({
            "batch_id": [launch.batch_id] * n, "target": [launch.target] * n, "version": [version] * n,
            "prompt_id": [p.id for p, _ in rows],
            "prompt_ids": [list(c.prompt_ids) for _, c in rows],
            "response_ids": [list(c.response_ids) for _, c in rows],
            "logprobs": [list(c.logprobs) for _, c in rows],
            "text": [c.text for _, c in rows],
            "reward": [float(self.reward_fn(p, c.text)) for p, c in rows],
        }, schema=TRAJECTORY_SCHEMA)


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def _std(xs: list[float]) -> float:
    m = _mean(xs)
    return float((sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5) if xs else 0.0
