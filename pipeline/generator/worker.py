"""The generator actor: refit, validate and collect, with the engine driven
by its engine loop (pipeline/generator/engine_loop.py), so generation overlaps
training.

refit_mode drain: a refit waits until no rollout is in flight, then loads.
refit_mode inflight: a refit loads between two engine steps and the rollouts
in flight go on with the new weights.

Each node is a small method that takes upstream tokens and returns one; the
work is done by the generation engine (pipeline/generator/vllm_engine.py, or the simulator). No method here
waits on another node except through its arguments.
"""
from __future__ import annotations

import time

import pyarrow as pa
import ray

from dags.step_graph import build_delivery_graph
from dags.tokens import (Clock, Gate, Launch, Refitted, Relaunch, Resume, Rollout, Stored, Ticket, TopUp, TrainOut,
                         ValOut)
from pipeline.algos.groups import flat_group_indices
from pipeline.generator.engine_loop import EngineLoop, InFlight
from pipeline.core.events import EventLog
from pipeline.core.node import Actor, node, one_thread, whereabouts
from pipeline.weights import sync
from pipeline.evaluation.sets import EvalSet, load_sets
from pipeline.generator.engines import generation_engine, reward_function
from pipeline.core.samples import shard_count, val_samples
from pipeline.core.specs import version_runs
from pipeline.core.types import TRAJECTORY_SCHEMA, Completion, sample_seeds
from pipeline.config import Config
from pipeline.core import spans
from pipeline.core.graph_calls import submit
from pipeline.core.worker_names import generator_name
from pipeline.rewards.mix import combine
from pipeline.rewards.scoring import fill_failed_rewards, score_sample


class GeneratorWorker(Actor):
    """One generation engine, driven by its engine loop."""

    def __init__(self, index: int):
        super().__init__()
        one_thread()
        self.index = index
        self._loop: EngineLoop | None = None
        self._serving = None
        self._puts: list = []   # the controller's answers to batches put, not yet checked (the loop's)
        self.weights = None

    def begin_run(self, cfg: Config, run_dir: str, t0: float, controller, incarnation: int = 0,
                  start_weights: Stored | None = None, after: Clock = (), reward_model=None, teacher=None) -> Clock:
        """`start_weights`: the stored (version, state) when starting mid-run (a
        restart, a resume); the load is logged as this worker's refit to that version.
        `after`: the caller's clock (it holds the trainer's, from current_weights).
        `reward_model`: the run's reward model actor, which scores each batch before the buffer takes it;
        `teacher`: the distillation teacher's, which then puts its logprobs in."""
        spans.take()
        self.cfg = cfg
        self.log = EventLog(run_dir, generator_name(self.index, incarnation), t0)
        self.log.merge(after)
        self.log.emit("worker_start", **whereabouts(), incarnation=incarnation, generator=self.index)
        self.engine = generation_engine(cfg, self.index, incarnation)
        self.reward_fn = reward_function(cfg)
        self.reward_model = reward_model
        self.delivery = build_delivery_graph(controller, reward_model, teacher)
        self.scored_here = reward_model is None
        self.val_sets = load_sets(cfg, self.index, cfg.generation.num_generators)
        self.controller = controller
        self.version, self._loaded_step = 0, None
        self._puts = []
        env = cfg.env if cfg.env.class_ else None
        workers = None
        if env is not None and env.actors:
            from pipeline.envs.workers import EnvWorkers
            workers = EnvWorkers(env, self.log.worker)
            workers.wait_ready(cfg.run.startup_deadline_s)
        self._serving = None
        if cfg.agent.function:
            from pipeline.agents.serving import AgentServing
            self._serving = AgentServing(cfg, self.engine, self.reward_fn is not None or reward_model is not None,
                                         lambda key, outcome: self._loop.agent_done(key, outcome))
        self._loop = EngineLoop(self.engine, self.log, self._deliver, self._fail, self.version,
                                cfg.schedule.group_size, env, workers,
                                self._serving.sessions if self._serving is not None else None)
        if self._serving is not None:
            self._serving.start(self._loop.chat)
        self.weights = sync.receiver(cfg, self.log)
        if start_weights is not None:
            # Logged as a refit to that version, after the step that made it.
            start = sync.StoreReceiver(cfg, self.log)
            version = start.fetch(start_weights)
            self._install(start, version, version - 1)
        self.log.emit("worker_ready", spans=spans.take())
        return self.log.now()

    def end_run(self, deadline_s: float) -> None:
        """The engine loop stopped and the puts it made answered, so that nothing
        of this run reaches the controller after the run's end. Agents stop
        first, so no request reaches a stopped loop."""
        if self._serving is not None:
            self._serving.stop_agents(deadline_s)
        self._loop.stop(deadline_s)
        if self._serving is not None:
            self._serving.stop_server(deadline_s)
        if self._puts:
            ray.wait(self._puts, num_returns=len(self._puts), timeout=deadline_s)
        self.weights.close()
        super().end_run(deadline_s)

    @node("refit", trim_heap=True)
    def refit(self, train: TrainOut, gate: Gate) -> Refitted:
        """Drain: wait until no rollout is in flight, then load. Inflight: hand
        the load to the engine loop, which runs it between two steps; the
        rollouts in flight go on with the new weights. The loop logs both ends."""
        started = time.perf_counter()
        if train.version == self.version + 1:
            # Fetched while rollouts may still run: only the load changes the engine.
            self.weights.prefetch(train, gate.step)
        self._drain(gate.step)
        if self._loaded_step == gate.step and train.version == self.version:
            # Recovery re-runs a step's tail after a generator restart; whoever
            # already loaded this step's weights (or started with them) keeps them.
            return Refitted(self.log.worker, gate.step, self.version, gate.validate)
        if train.version != self.version + 1:
            raise RuntimeError(f"weight sync: trainer sent version {train.version}, "
                               f"generator holds {self.version}; expected {self.version + 1}")
        self._install(self.weights, train.version, gate.step)
        return Refitted(self.log.worker, gate.step, self.version, gate.validate,
                        refit_s=time.perf_counter() - started)

    def _install(self, receiver: sync.StoreReceiver, version: int, step: int) -> None:
        """Every load of new weights, a refit's or a start's: the engine loop runs
        it between two engine steps and logs refit_start and refit_end."""
        load = receiver.loader(self.engine, version)
        spans.add(self._loop.call("install", (load, step, version), self.cfg.run.deadline_s,
                                  f"the refit of step {step}"))
        receiver.release(step, version)
        self.version, self._loaded_step = version, step

    def _drain(self, step: int) -> None:
        """refit_mode drain: wait until no rollout is in flight. Either mode: raise what failed."""
        if self._serving is not None:
            self._serving.gateway.check()  # a drain would wait out agents that cannot reach it
        if self.cfg.generation.refit_mode == "drain":
            with spans.span("drain"):
                self._loop.call("wait_idle", None, self.cfg.run.deadline_s,
                                f"rollouts still running while draining for the refit of step {step}")
        self._check_puts()
        error = self._loop.errors.take()
        if error is not None:
            raise RuntimeError(f"a rollout failed before step {step}: {error}")

    def join_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str,
                         timeout_s: float) -> None:
        """generation.weight_sync collective: join trainer rank 0's group as `rank` (1..G)."""
        self.weights.join(host, port, rank, world_size, backend, timeout_s, self.engine)

    @node("validate")
    def validate(self, ready: Refitted | Gate) -> ValOut:
        """The sets the gate names, all in one engine call beside the rollouts in
        flight (inflight mode): the weights cannot change before this node
        returns, and no rollout starts before resume."""
        due = [s for s in self.val_sets if s.spec.name in ready.validate and s.prompts]
        if not due:
            return ValOut(self.log.worker, ready.step, self.version, False)
        started = time.perf_counter()
        self.log.emit("validation_start", step=ready.step, version=self.version, sets=[s.spec.name for s in due])
        requests = [r for s in due for r in s.requests()]
        completions = self._loop.call("validate", requests, self.cfg.run.deadline_s,
                                      f"the validation of step {ready.step}")
        sums, samples, at = {}, [], 0
        shown = shard_count(self.cfg.metrics.samples, self.index, self.cfg.generation.num_generators)
        for s in due:
            mine, at = completions[at:at + len(s.prompts) * s.spec.n], at + len(s.prompts) * s.spec.n
            scored = self._score_validation(s, mine)
            for key, value in s.sums(mine, scored).items():
                sums[key] = sums.get(key, 0.0) + value
            samples += val_samples(ready.step, self.version, s.spec, s.prompts[:shown], mine, scored)
        self.log.emit("validation_end", step=ready.step, version=self.version, sets=[s.spec.name for s in due])
        return ValOut(self.log.worker, ready.step, self.version, True, tuple(sums.items()),
                      validate_s=time.perf_counter() - started, samples=tuple(samples))

    def _score_validation(self, val_set: EvalSet, completions: list[Completion]) -> list[tuple[float, str]]:
        """(reward, error) per sample: the set's reward, else the training reward
        with the reward model's score, which goes with the weights validated."""
        prompts = [p for p, _, _ in val_set.requests()]
        scored = [score_sample(p, c, val_set.reward_fn or self.reward_fn) for p, c in zip(prompts, completions)]
        if self.reward_model is None or val_set.reward_fn is not None:
            return scored
        model = ray.get(self.reward_model.score_texts.remote(prompts, [c.text for c in completions]),
                        timeout=self.cfg.run.deadline_s)
        return [combine(r, m, self.cfg.reward_model.weight, "the reward model") for r, m in zip(scored, model)]

    @node("collect")
    def collect(self, resume: Resume | Relaunch) -> Ticket:
        """Every launched batch starts here, inside the node: the engine loop adds
        its requests and logs rollout_start before it answers, so a rollout can
        only start where the graph puts `collect`, and the Ticket's clock is
        after every rollout_start."""
        if resume.version != self.version:
            raise RuntimeError(f"asked to roll out with version {resume.version}, engine holds {self.version}")
        if self.cfg.generation.refit_mode == "drain" and self._loop.in_flight():
            raise RuntimeError("collect while rollouts are still in flight: the graph lost its refit edge")
        return self._start_rollouts(resume, self.version)

    @node("extra_collect")
    def extra_collect(self, top_up: TopUp) -> Ticket:
        """Dynamic sampling's extra rollouts for the current step (top_up's launches).
        Rollouts of later steps may still run, under either refit mode: no refit
        comes before this step's training, which waits for these rollouts."""
        if top_up.version != self.version:
            raise RuntimeError(f"asked to roll out with version {top_up.version}, engine holds {self.version}")
        return self._start_rollouts(top_up, self.version)

    def _start_rollouts(self, launched: Resume | Relaunch | TopUp, version: int) -> Ticket:
        mine = [launch for launch in launched.launches if launch.generator == self.index]
        for launch in mine:
            self.log.emit("launch", step=launch.target, version=version, batch=launch.batch_id,
                          target=launch.target, **({"round": launch.round} if launch.round else {}))
        group = self.cfg.schedule.group_size
        requests = [(launch, [s for seeds in sample_seeds(self.cfg.run.seed, launch.batch_id, list(launch.prompts),
                                                          group) for s in seeds]) for launch in mine]
        busy = self._loop.call("submit", (version, requests), self.cfg.run.deadline_s,
                               f"collect of step {launched.step}")
        return Ticket(self.log.worker, launched.step, version, tuple(l.batch_id for l in mine), busy)

    def _deliver(self, batch: InFlight, completions: list[Completion], profile: dict) -> None:
        """The engine loop's: a finished batch, scored and put. Its clock goes with
        the put to the controller."""
        launch, group = batch.launch, self.cfg.schedule.group_size
        groups = [completions[i:i + group] for i in range(0, len(completions), group)]
        try:
            table = self._table(launch, batch.version, groups)
        except Exception as exc:  # a user's reward function beyond one sample, or a malformed completion
            self._loop.errors.record(f"batch {launch.batch_id}: {type(exc).__name__}: {exc}")
            self._fail(batch, f"failed: {type(exc).__name__}: {exc}")
            return
        # The rewards as scored here, for the checker's invariant 8 (dynamic sampling); a
        # reward model's score_end lists them instead.
        flat = {"flat_groups": flat_group_indices(table.column("reward").to_pylist(), group)} if self.scored_here \
            else {}
        # Logged and put with the version it was launched with: its oldest token is no older.
        self.log.emit("rollout_end", step=launch.target, version=batch.version, batch=launch.batch_id,
                      target=launch.target, spans=profile, token_versions=_runs(table),
                      turns=[c.turns for c in completions], **flat, **_segments(completions))
        # Not waited for here: the loop would wait out the round trip, and sample
        # waits for the batch anyway. _check_puts reads the answers of the puts.
        rollout = Rollout(launch.target, launch.batch_id, batch.version, table, tuple(launch.prompts),
                          self.log.now())
        self._puts.append(submit(self.delivery, (rollout,))[-1])

    def _fail(self, batch: InFlight, reason: str) -> None:
        launch = batch.launch
        self.log.emit("rollout_end", step=launch.target, version=batch.version, batch=launch.batch_id,
                      target=launch.target, failed=True)
        ray.get(self.controller.rollout_failed.remote(launch.batch_id, reason, self.log.now()),
                timeout=self.cfg.run.deadline_s)

    def _check_puts(self) -> None:
        """Raise a put the controller refused; keep the ones still on their way for the next refit."""
        puts = list(self._puts)  # the loop appends while this reads: take what is there now
        done, _ = ray.wait(puts, num_returns=len(puts), timeout=0) if puts else ([], [])
        for ref in done:
            self._puts.remove(ref)
        ray.get(done, timeout=self.cfg.run.deadline_s)  # done: raises what failed, waits for nothing

    def _table(self, launch: Launch, version: int, groups: list[list[Completion]]) -> pa.Table:
        """The batch's trajectories, scored: a sample whose reward failed gets its
        group's mean (pipeline/rewards/scoring.py), here or, with a reward model,
        once the model has scored it too (pipeline/rewards/mix.py)."""
        rows = [(prompt, c) for prompt, group in zip(launch.prompts, groups) for c in group]
        with spans.span("reward"):
            scored = [score_sample(prompt, c, self.reward_fn) for prompt, c in rows]
        errors = [error for _, error in scored]
        for error in filter(None, errors):
            self.log.emit("reward_failed", step=launch.target, version=version, batch=launch.batch_id, reason=error)
        rewards = [r for r, _ in scored]
        if self.scored_here:
            rewards = fill_failed_rewards(rewards, [bool(e) for e in errors], self.cfg.schedule.group_size)
        n = len(rows)
        with spans.span("table"):
            return pa.table({
                "batch_id": [launch.batch_id] * n, "target": [launch.target] * n,
                # A sample's age counts from its oldest token (the engine may start it after a later refit).
                "version": [min(c.versions, default=version) for _, c in rows],
                "prompt_id": [p.id for p, _ in rows],
                "prompt_ids": [list(c.prompt_ids) for _, c in rows],
                "response_ids": [list(c.response_ids) for _, c in rows],
                "logprobs": [list(c.logprobs) for _, c in rows],
                "token_versions": [list(c.versions) for _, c in rows],
                "text": [c.text for _, c in rows],
                "reward": rewards,
                "reward_error": errors,
                "loss_mask": [list(c.loss_mask) or [1] * len(c.response_ids) for _, c in rows],
                "token_rewards": [_token_rewards(c, r) for (_, c), r in zip(rows, rewards)],
                "truncated": [c.truncated for _, c in rows],
                "transcript": [list(c.transcript) or None for _, c in rows],
                # The teacher's, on the way to the buffer (pipeline/distill/).
                "teacher_logprobs": [None] * n, "teacher_topk_ids": [None] * n, "teacher_topk_logprobs": [None] * n,
                "routed_experts": [c.routes or None for _, c in rows],
                # A sample without a response (an episode that ended before its first turn) was never
                # shown its pictures: its prompt ids hold no placeholder for them (episodes.py).
                "images": [list(p.images) if p.images and c.response_ids else None for p, c in rows],
            }, schema=TRAJECTORY_SCHEMA)


def _token_rewards(completion: Completion, reward: float) -> list[float]:
    """The environment's per-turn rewards; a single-turn reward on the last token."""
    if completion.token_rewards:
        return list(completion.token_rewards)
    out = [0.0] * len(completion.response_ids)
    if out:
        out[-1] = reward
    return out


def _segments(completions: list[Completion]) -> dict:
    """Each sample's trained segment, where any agent's is past its first (engine_loop.EngineLoop._segments)."""
    segments = [c.segments for c in completions]
    return {"segments": segments} if any(n != 1 for n in segments) else {}


def _runs(table: pa.Table) -> list[list[list[int]]]:
    """Each row's token versions as runs: what rollout_end logs for the checker
    (one run per sample under refit_mode drain)."""
    return [version_runs(versions) for versions in table.column("token_versions").to_pylist()]
