"""The generator actor: refit, validate and collect, with rollouts on a
background thread that the next refit joins, so generation overlaps training
but never a refit or a validation.

Each node is a small method that takes upstream tokens and returns one; the
work is done by the generation engine (pipeline/engines/). No method here
waits on another node except through its arguments.
"""
from __future__ import annotations

import threading
import time

import pyarrow as pa
import ray

from dags.tokens import Clock, Gate, Launch, Refitted, Resume, Ticket, TrainOut, ValOut
from pipeline.actors.node import Actor, node, one_thread, reopen_log, whereabouts
from pipeline.engines import backends, weights
from pipeline.engines.interface import TRAJECTORY_SCHEMA, Completion, Prompt, sample_seeds
from pipeline.io.config import Config
from pipeline.run import spans


def generator_name(index: int, incarnation: int = 0) -> str:
    """gen<i>, and gen<i>r<k> for its k-th replacement: its name in events, metrics and errors."""
    return f"gen{index}" + (f"r{incarnation}" if incarnation else "")


class _Rollouts:
    """A generator's rollout thread and the clocks it hands back: `collect`
    waits for `started` (the thread has logged rollout_start and is calling the
    engine), and the refit's drain joins the thread and merges `end_clock`."""

    def __init__(self, target, args: tuple, name: str):
        # A hand-shake inside the collect node, not an ordering between nodes:
        # collect returns only once its own thread has logged rollout_start.
        self.started = threading.Event()
        self.start_clock: Clock = ()
        self.end_clock: Clock = ()
        self.thread = threading.Thread(target=target, args=(self, *args), name=name, daemon=True)


class GeneratorWorker(Actor):
    """One generation engine. Rollouts run on a background thread that the
    next refit joins, so generation overlaps training but never a refit."""

    def __init__(self, index: int):
        self.index = index
        self._rollouts: _Rollouts | None = None
        self._puts: list = []   # the controller's answers to batches put, not yet checked

    def begin_run(self, cfg: Config, run_dir: str, t0: float, controller, incarnation: int = 0,
                  start_weights: tuple = (), after: Clock = ()) -> Clock:
        """`start_weights`: (ObjectRef of (version, state),) when starting mid-run (a
        restart, a resume); the load is logged as this worker's refit to that version.
        `after`: the caller's clock (it holds the trainer's, from current_weights)."""
        one_thread()
        spans.take()
        if self._rollouts is not None:
            # A previous run on this actor must not leak rollouts into this one.
            self._rollouts.thread.join(timeout=cfg.run.deadline_s)
            self._rollouts = None
        if self._puts:
            # ... nor a late put land in this run's buffer under a batch id the runs share.
            ray.wait(self._puts, num_returns=len(self._puts), timeout=cfg.run.deadline_s)
        self.cfg = cfg
        self.log = reopen_log(self, run_dir, generator_name(self.index, incarnation), t0)
        self.log.merge(after)
        self.log.emit("worker_start", **whereabouts(), incarnation=incarnation, generator=self.index)
        self.engine = backends.generation_engine(cfg, self.index, incarnation)
        self.reward_fn = backends.reward_function(cfg)
        self.val_prompts = backends.val_prompts(cfg)[self.index::cfg.generation.num_generators]
        self.controller = controller
        self.version, self._loaded_step = 0, None
        self._busy_s = 0.0
        self._rollout_error: str | None = None
        self._puts = []
        if start_weights:
            version, stored = ray.get(start_weights[0])
            self.log.emit("refit_start", step=version - 1, version=self.version)
            self.engine.load_weights(weights.unpack(stored))
            self.version, self._loaded_step = version, version - 1
            self.log.emit("refit_end", step=version - 1, version=self.version)
        self.log.emit("worker_ready", spans=spans.take())
        return self.log.now()

    @node("refit")
    def refit(self, train: TrainOut, gate: Gate) -> Refitted:
        started = time.perf_counter()
        collective = self.cfg.generation.weight_sync == "collective"
        fetched = None
        if train.version == self.version + 1 and not collective:
            # Fetched before the drain, while rollouts may still run: only the load changes the engine.
            with spans.span("weights.get"):
                fetched = ray.get(train.weights_ref[0])
        with spans.span("drain"):
            self._drain(gate.step)
        if self._loaded_step == gate.step and train.version == self.version:
            # Recovery re-runs a step's tail after a generator restart; whoever
            # already loaded this step's weights (or started with them) keeps them.
            return Refitted(self.log.worker, gate.step, self.version, gate.validate)
        if train.version != self.version + 1:
            raise RuntimeError(f"weight sync: trainer sent version {train.version}, "
                               f"generator holds {self.version}; expected {self.version + 1}")
        self.log.emit("refit_start", step=gate.step, version=self.version)
        if collective:
            from pipeline.engines import weight_sync  # torch: not in the driver, which imports this module
            with spans.span("weights.receive"):
                # The trainer's send_weights node broadcasts at the same time; both sides
                # check the version before any bytes move.
                weight_sync.receive_into(self._sync, self.engine, train.version)
        else:
            sent_version, stored = fetched
            if sent_version != train.version:
                raise RuntimeError(f"weight sync: the weights in the object store are version {sent_version}, "
                                   f"the trainer announced {train.version}")
            self.engine.load_weights(weights.unpack(stored))
        self.version, self._loaded_step = train.version, gate.step
        self.log.emit("refit_end", step=gate.step, version=self.version)
        return Refitted(self.log.worker, gate.step, self.version, gate.validate,
                        refit_s=time.perf_counter() - started)

    def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str,
                         timeout_s: float) -> None:
        """generation.weight_sync collective: join trainer rank 0's group as `rank` (1..G)."""
        from pipeline.engines import weight_sync
        if getattr(self, "_sync", None) is not None:
            weight_sync.leave(self._sync)  # a pooled actor: the last run's group
        self._sync = weight_sync.join(host, port, rank, world_size, backend, timeout_s, engine=self.engine,
                                      bucket_bytes=int(self.cfg.generation.sync_bucket_mb * 2**20))

    @node("validate")
    def validate(self, ready: Refitted | Gate) -> ValOut:
        if not ready.validate or not self.val_prompts:
            return ValOut(self.log.worker, ready.step, self.version, False)
        started = time.perf_counter()
        self.log.emit("validation_start", step=ready.step, version=self.version)
        completions = self.engine.greedy(self.val_prompts)
        scored = [self._score(p, c.text) for p, c in zip(self.val_prompts, completions)]
        rewards = [r for r, error in scored if not error]
        self.log.emit("validation_end", step=ready.step, version=self.version)
        return ValOut(self.log.worker, ready.step, self.version, True,
                      (("reward_sum", float(sum(rewards))), ("count", float(len(rewards))),
                       ("failed", float(len(scored) - len(rewards)))),
                      validate_s=time.perf_counter() - started)

    @node("collect")
    def collect(self, resume: Resume) -> Ticket:
        if resume.version != self.version:
            raise RuntimeError(f"asked to roll out with version {resume.version}, engine holds {self.version}")
        if self._rollouts is not None and self._rollouts.thread.is_alive():
            raise RuntimeError("collect while rollouts are still in flight: the graph lost its refit edge")
        return self._start_rollouts(resume, self.version)

    def _start_rollouts(self, resume: Resume, version: int) -> Ticket:
        """Every launched batch starts here, inside the node, as one engine call: a
        rollout can only start where the graph puts `collect`, never later from a
        queue on the rollout thread (that would let it start during a validation).
        The thread logs rollout_start right before it calls the engine, and this
        waits for that, so the Ticket's clock is after every rollout_start."""
        mine = [launch for launch in resume.launches if launch.generator == self.index]
        for launch in mine:
            self.log.emit("launch", step=launch.target, version=version, batch=launch.batch_id,
                          target=launch.target)
        if mine:
            rollouts = _Rollouts(self._run_rollouts, (mine, version, self.log.now()),
                                 name=f"rollouts-{self.log.worker}")
            # Started before it is published: a drain that finds it can always join it.
            rollouts.thread.start()
            self._rollouts = rollouts
            if not rollouts.started.wait(timeout=self.cfg.run.deadline_s):
                raise TimeoutError(f"the rollout thread did not start within {self.cfg.run.deadline_s:.0f} s "
                                   "(run.deadline_s)")
            self.log.merge(rollouts.start_clock)
        busy, self._busy_s = self._busy_s, 0.0
        return Ticket(self.log.worker, resume.step, version, tuple(l.batch_id for l in mine), busy)

    def _drain(self, step: int) -> None:
        rollouts = self._rollouts
        if rollouts is not None:
            rollouts.thread.join(timeout=self.cfg.run.deadline_s)
            if rollouts.thread.is_alive():
                raise TimeoutError(f"rollouts still running after {self.cfg.run.deadline_s:.0f} s "
                                   "(run.deadline_s) while draining for the refit")
            self.log.merge(rollouts.end_clock)  # joined: everything it logged is before this refit
            if self._rollouts is rollouts:
                self._rollouts = None
        self._check_puts()
        if self._rollout_error is not None:
            error, self._rollout_error = self._rollout_error, None
            raise RuntimeError(f"a rollout failed before step {step}: {error}")

    def _run_rollouts(self, rollouts: _Rollouts, launches: list[Launch], version: int, fork: Clock) -> None:
        """The rollout thread: its own lane, after the collect that started it. Each
        batch's clock travels with its put (or rollout_failed) to the controller."""
        with self.log.lane(f"{self.log.worker}/rollouts", fork):
            try:
                self._generate(rollouts, launches, version)
            finally:
                rollouts.end_clock = self.log.now()
                rollouts.started.set()  # a thread that failed before its start must not hold collect up

    def _generate(self, rollouts: _Rollouts, launches: list[Launch], version: int) -> None:
        prompts = [p for launch in launches for p in launch.prompts]
        started = time.perf_counter()
        try:
            seeds = [s for launch in launches for s in sample_seeds(
                self.cfg.run.seed, launch.batch_id, list(launch.prompts), self.cfg.schedule.group_size)]
            for launch in launches:  # where the engine really starts generating
                self.log.emit("rollout_start", step=launch.target, version=version, batch=launch.batch_id,
                              target=launch.target)
            rollouts.start_clock = self.log.now()
            rollouts.started.set()
            groups = self.engine.sample(prompts, seeds)
            tables, start = [], 0
            for launch in launches:
                tables.append(self._table(launch, version, groups[start:start + len(launch.prompts)]))
                start += len(launch.prompts)
            self._busy_s += time.perf_counter() - started
            profile = spans.take()
        except Exception as exc:
            self._rollout_error = f"batches {[l.batch_id for l in launches]}: {type(exc).__name__}: {exc}"
            for launch in launches:
                if rollouts.started.is_set():
                    self.log.emit("rollout_end", step=launch.target, version=version, batch=launch.batch_id,
                                  target=launch.target, failed=True)
                ray.get(self.controller.rollout_failed.remote(launch.batch_id, f"failed: {exc}", self.log.now()))
            return
        for launch, table in zip(launches, tables):
            # The engine call's spans go with the first batch: they are one call's, not per batch.
            self.log.emit("rollout_end", step=launch.target, version=version, batch=launch.batch_id,
                          target=launch.target, spans=profile)
            profile = {}
            # Not waited for here: the refit that drains this thread would wait out the
            # round trip too, and sample waits for the batch anyway. _check_puts reads the answers.
            self._puts.append(self.controller.put.remote(launch.batch_id, version, table, self.log.now()))

    def _check_puts(self) -> None:
        """Raise a put the controller refused; keep the ones still on their way for the next drain."""
        done, self._puts = ray.wait(self._puts, num_returns=len(self._puts), timeout=0) if self._puts else ([], [])
        ray.get(done)

    def _score(self, prompt: Prompt, text: str) -> tuple[float, str]:
        try:
            return float(self.reward_fn(prompt, text)), ""
        except Exception as exc:  # a user's reward function: any error marks this one sample
            return 0.0, f"prompt {prompt.id}: {type(exc).__name__}: {exc}"

    def _group_rewards(self, launch: Launch, version: int, prompt: Prompt,
                       group: list[Completion]) -> tuple[list[float], list[str]]:
        """A sample whose reward raised is scored with the mean of its group's
        good rewards: its advantage is then zero, so it teaches nothing, and
        the rest of the group keeps its ranking."""
        scored = [self._score(prompt, c.text) for c in group]
        good = [r for r, error in scored if not error]
        fill = sum(good) / len(good) if good else 0.0
        for _, error in scored:
            if error:
                self.log.emit("reward_failed", step=launch.target, version=version, batch=launch.batch_id,
                              reason=error)
        return [fill if error else r for r, error in scored], [error for _, error in scored]

    def _table(self, launch: Launch, version: int, groups: list[list[Completion]]) -> pa.Table:
        rows = [(prompt, c) for prompt, group in zip(launch.prompts, groups) for c in group]
        rewards, errors = [], []
        with spans.span("reward"):
            for prompt, group in zip(launch.prompts, groups):
                r, e = self._group_rewards(launch, version, prompt, group)
                rewards += r
                errors += e
        n = len(rows)
        with spans.span("table"):
            return pa.table({
                "batch_id": [launch.batch_id] * n, "target": [launch.target] * n, "version": [version] * n,
                "prompt_id": [p.id for p, _ in rows],
                "prompt_ids": [list(c.prompt_ids) for _, c in rows],
                "response_ids": [list(c.response_ids) for _, c in rows],
                "logprobs": [list(c.logprobs) for _, c in rows],
                "text": [c.text for _, c in rows],
                "reward": rewards,
                "reward_error": errors,
            }, schema=TRAJECTORY_SCHEMA)
