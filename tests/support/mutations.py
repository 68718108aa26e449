"""Mutations of the step graph, for tests that prove the checker can fail.

Each mutation removes one ordering guarantee: an edge of the graph, the
drain a generator does before it loads new weights, or the engine's labelling
of each token with the weights that sampled it; or the one resource bound the
log proves, the weight copies in the object store (a trainer that keeps them all); or dynamic
sampling's filter (a sample that trains flat groups); or the reward model's
edge (a generator that puts its batches unscored); or the teacher's (a
generator that puts its batches untaught, its own logprobs in the teacher's
column, so the trainer has what it reads); or, in runs with agents,
the sessions' bounds (a sample delivered while its agent goes on, a session
kept across batches) and the engine's labels (a version not yet loaded). They are built here, in
the tests, from the public pieces of dags/step_graph.py; production code
builds none of them. Some need a generator without one of its own guards
(collect refuses a version it does not hold, or rollouts still in flight):
otherwise that guard, not the checker, would stop the run. `MutantGenerator`
is that worker; with nothing configured it is the production GeneratorWorker.

`expect` is the invariant (pipeline/tools/check.py) the mutation breaks. Its
checker must find that violation in the log of a run that went to its end.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import ray
import ray.cloudpickle
from ray.dag import InputNode

from dags.step_graph import StepGraph, Workers, build_delivery_graph, build_step_graph, graph_of
from dags.tokens import Gate, Refitted, Resume, StepPlan, Ticket, ValOut
from pipeline.controller.controller import Controller
from pipeline.generator.worker import GeneratorWorker
from pipeline.core.node import node, on_step_thread, rank_actor
from pipeline.trainer.worker import TrainerWorker
from pipeline.run.runner import GraphRunner
from pipeline.weights.sync import StorePublisher

# The actors below are defined in a test module that Ray's workers cannot
# import by name: ship the classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class MutantGenerator(GeneratorWorker):
    """GeneratorWorker plus the faulty nodes the mutations bind instead of its own."""

    skip_drain = False
    trainer = None
    late_label = False
    early_delivery = False
    skip_scoring = False
    skip_teaching = False
    label_ahead = False
    stale_sessions = False

    def configure(self, skip_drain: bool = False, trainer=None, late_label: bool = False,
                  early_delivery: bool = False, skip_scoring: bool = False, skip_teaching: bool = False,
                  label_ahead: bool = False, stale_sessions: bool = False) -> None:
        self.skip_drain, self.trainer, self.late_label = skip_drain, trainer, late_label
        self.early_delivery, self.skip_scoring, self.skip_teaching = early_delivery, skip_scoring, skip_teaching
        self.label_ahead, self.stale_sessions = label_ahead, stale_sessions

    def begin_run(self, *args, **kwargs):
        clock = super().begin_run(*args, **kwargs)
        if self.skip_scoring:  # deliver_unscored: the delivery graph without its score node
            self.delivery = build_delivery_graph(self.controller)
        if self.skip_teaching:  # deliver_untaught: the delivery graph without its teach node
            self.delivery = build_delivery_graph(self.controller, self.reward_model)
        if self.late_label:
            label_a_step_late(self.engine)
        if self.label_ahead:
            label_a_version_ahead(self.engine)
        agents = self.cfg.agent.function
        if self.early_delivery:
            (deliver_after_the_first_request if agents else deliver_after_the_first_turn)(self._loop)
        if self.stale_sessions:
            keep_sessions_across_batches(self._loop.episodes, self.cfg.schedule.group_size)
        return clock

    def _table(self, *args):
        table = super()._table(*args)
        if not self.skip_teaching:
            return table
        column = table.schema.get_field_index("teacher_logprobs")
        return table.set_column(column, table.schema.field(column), table.column("logprobs"))

    def _drain(self, step: int) -> None:
        if not self.skip_drain:  # refit_without_drain: load new weights under running rollouts
            super()._drain(step)

    @node("collect")
    def collect_trusting(self, resume: Resume) -> Ticket:
        """collect without its guards: rolls out with the version its token names,
        whatever the engine holds and whether or not rollouts are still running."""
        return self._start_rollouts(resume, resume.version)

    @node("refit")
    def refit_polling(self, plan: StepPlan) -> Refitted:
        """A refit bound to the plan, not to training: it polls the trainer until
        the step's weights are there, a channel the graph knows nothing of."""
        self._drain(plan.step)
        deadline = time.monotonic() + self.cfg.run.deadline_s
        while True:
            _, stored, _ = ray.get(self.trainer.current_weights.remote())
            version, weights = stored.fetch(self.cfg.run.deadline_s)
            if version == plan.step + 1:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the trainer never had the weights of step {plan.step}")
            time.sleep(0.005)  # polling the trainer is the mutation under test
        self._loop.call("install", (lambda: self.engine.load_weights(weights), plan.step, version),
                        self.cfg.run.deadline_s, "refit_polling")
        self.version, self._loaded_step = version, plan.step
        return Refitted(self.log.worker, plan.step, self.version, plan.validate)


def label_a_step_late(engine) -> None:
    """late_version_label: the engine labels the tokens of a load's version from
    the step after the load on, so the first step's tokens carry the old one."""
    label, step, pending = engine.set_version, engine.step, []

    def stepped():
        out = step()
        while pending:
            label(pending.pop(0))
        return out
    engine.set_version, engine.step = pending.append, stepped


def deliver_after_the_first_turn(loop) -> None:
    """deliver_before_the_env: a multi-turn sample is delivered (scored, put,
    rollout_end logged) when its first turn ends, while its environment goes on
    stepping: the steps after rollout_end belong to no rollout any more."""
    episodes = loop.episodes
    on_turn, on_env, delivered = episodes.on_turn, episodes.on_env, set()

    def turned(request_key, completion):
        key = episodes._requests.get(request_key)
        on_turn(request_key, completion)
        if key is not None and key not in delivered and not key.startswith("val/"):
            delivered.add(key)
            loop._finished(key, dataclasses.replace(completion, reward=0.0))  # scored before its env is done

    def answered(key, call, outcome, version):
        finished = on_env(key, call, outcome, version)
        return None if finished is not None and finished[0] in delivered else finished
    episodes.on_turn, episodes.on_env = turned, answered


def label_a_version_ahead(engine) -> None:
    """label_ahead: the engine labels its tokens with the version after the one
    it holds, one that no refit has loaded yet."""
    label = engine.set_version
    engine.set_version = lambda version: label(version + 1)


def deliver_after_the_first_request(loop) -> None:
    """deliver_before_the_agent: an agent's sample is delivered (scored, put,
    rollout_end logged) once its first request is answered, while its agent
    goes on with its session: the requests after rollout_end belong to no
    rollout any more, and the drain no longer waits for them."""
    sessions = loop.episodes
    on_turn, on_agent_end, delivered = sessions.on_turn, sessions.on_agent_end, set()

    def turned(request_key, completion):
        key = sessions._requests.get(request_key)
        on_turn(request_key, completion)
        if key is not None and key not in delivered and not key.startswith("val/"):
            delivered.add(key)
            loop._finished(key, dataclasses.replace(completion, reward=0.0))

    def ended(key, outcome):
        finished = on_agent_end(key, outcome)
        return None if finished is not None and finished[0] in delivered else finished
    sessions.on_turn, sessions.on_agent_end = turned, ended


def keep_sessions_across_batches(sessions, group_size: int) -> None:
    """session_kept_across_batches: sessions cached by their prompt's place in
    the batch, not by the batch: each sample of a group goes on with the last
    segment of the first sample at that place in an earlier batch (a copy, so
    the group keeps one prompt), and its trained tokens begin with that
    sample's, sampled by older weights."""
    start, end, kept = sessions.start, sessions._end, {}

    def place(key: str) -> int:
        return int(key.rpartition("/")[2]) // group_size

    def started(key, prompt, seed):
        start(key, prompt, seed)
        earlier = kept.get(place(key))
        if earlier is not None and not key.startswith("val/"):
            resumed = copy.deepcopy(earlier)
            resumed.messages = []  # whatever the agent sends continues it
            sessions._live[key].segments.append(resumed)

    def ended(session, *args, **kwargs):
        index = int(session.key.rpartition("/")[2])
        if session.segments and not session.key.startswith("val/") and index % group_size == 0:
            kept[place(session.key)] = copy.deepcopy(session.segments[-1])
        return end(session, *args, **kwargs)
    sessions.start, sessions._end = started, ended


class MutantController(Controller):
    """Controller plus a resume that takes what a rewired graph hands it (refits
    or the gate) in place of the validations, and a sample that can keep the
    flat groups dynamic sampling must leave out (configure keep_flat=True)."""

    keep_flat = False

    def configure(self, keep_flat: bool = False) -> None:
        self.keep_flat = keep_flat

    def _informative_groups(self, step, table):
        return (table, ()) if self.keep_flat else super()._informative_groups(step, table)

    @node("resume")
    def resume_unvalidated(self, *tokens: Refitted | Gate) -> Resume:
        vals = [ValOut(getattr(t, "worker", "gate"), t.step, t.version, False) for t in tokens]
        return Controller.resume.__wrapped__(self, *vals)


class MutantTrainer(TrainerWorker):
    """TrainerWorker that can keep every version of the weights it made
    (configure hoard=True) and log none of them released: a leak of one
    weight copy a step, which invariant 7 must catch."""

    hoard = False

    def configure(self, hoard: bool = False) -> None:
        self.hoard = hoard

    @on_step_thread
    def begin_run(self, *args, **kwargs):
        clock = super().begin_run(*args, **kwargs)
        if self.hoard:
            self.weights = HoardingPublisher(self.cfg, self.engine, self.log, self.rank, self.version)
        return clock


class HoardingPublisher(StorePublisher):
    """Keeps every version of the weights it put, and logs none released."""

    def _hold(self, version, ref) -> None:
        self.__dict__.setdefault("hoard", []).append(self._live[1])
        self._live = (version, ref, self.log.now())


def start_mutant_workers(num_generators: int) -> Workers:
    """pipeline.run.pool.start_workers with MutantGenerator actors (the same options)."""
    return Workers(ray.remote(MutantController).options(num_cpus=0.5, max_concurrency=8).remote(),
                   (rank_actor(MutantTrainer, num_cpus=0.5).remote(),),
                   tuple(ray.remote(MutantGenerator).options(num_cpus=0.5, max_concurrency=4).remote(i)
                         for i in range(num_generators)))


def _named(batch, train, gate, refits, vals, resume, collects) -> StepGraph:
    """The GRPO step graph's nodes under their usual names, however they are wired."""
    return graph_of([("sample", batch), ("train", train), ("validation_gate", gate),
                     *[(f"refit[{i}]", r) for i, r in enumerate(refits)],
                     *[(f"validate[{i}]", v) for i, v in enumerate(vals)], ("resume", resume),
                     *[(f"collect[{i}]", c) for i, c in enumerate(collects)]])


def _step(w: Workers, plan, *, refit=None, resume_after: str = "validate", collect: str = "collect",
          collect_from=None) -> StepGraph:
    """The GRPO step graph with the given wiring changes (the defaults are production's)."""
    batch = w.controller.sample.bind(plan)
    train = w.trainers[0].train.bind(batch)
    gate = w.controller.validation_gate.bind(plan, train)
    refits = [refit(g, plan) if refit else g.refit.bind(train, gate) for g in w.generators]
    vals = [g.validate.bind(r) for g, r in zip(w.generators, refits)]
    resume = (w.controller.resume.bind(*vals) if resume_after == "validate" else
              w.controller.resume_unvalidated.bind(*{"refit": refits, "gate": [gate]}[resume_after]))
    collects = [getattr(g, collect).bind(resume if collect_from is None else collect_from) for g in w.generators]
    return _named(batch, train, gate, refits, vals, resume, collects)


def rewired(w: Workers, **changes) -> StepGraph:
    """The GRPO step graph with `changes` to its wiring (keywords of _step)."""
    with InputNode() as plan:
        return _step(w, plan, **changes)


def validate_not_before_resume(w: Workers) -> StepGraph:
    """resume waits for the refits, not the validations: a collect may start
    rollouts while another generator validates."""
    with InputNode() as plan:
        return _step(w, plan, resume_after="refit")


def refit_not_before_resume(w: Workers) -> StepGraph:
    """resume waits for the gate only: a collect may start rollouts before its
    engine loaded the step's weights (or while it loads them)."""
    with InputNode() as plan:
        return _step(w, plan, resume_after="gate", collect="collect_trusting")


def refit_without_drain(w: Workers) -> StepGraph:
    """The production graph on generators that skip the drain (configure
    skip_drain): a refit loads weights under rollouts still running."""
    with InputNode() as plan:
        return _step(w, plan, collect="collect_trusting")


def collect_without_resume(w: Workers) -> StepGraph:
    """collect takes the step before's Resume (input 1, see PipelinedRunner),
    not this step's: the step's rollouts start at once, while it validates."""
    with InputNode() as inputs:
        return _step(w, inputs[0], collect="collect_trusting", collect_from=inputs[1])


def refit_without_train(w: Workers) -> StepGraph:
    """refit takes the plan, not the TrainOut, and polls the trainer for the
    weights (configure trainer=): versions come out right, order unproven."""
    with InputNode() as plan:
        return _step(w, plan, refit=lambda g, p: g.refit_polling.bind(p))


class PipelinedRunner(GraphRunner):
    """Runs collect_without_resume: feeds each step the Resume of the step before
    (for the first, none: the prologue collected its own launches)."""

    earlier: Resume | None = None

    def run(self, plan, deadline_s: float, run_dir) -> dict:
        earlier = self.earlier or Resume(plan.step - 1, 0)
        out = super().run((plan, earlier), deadline_s, run_dir)
        self.earlier = out["resume"]
        return out


@dataclass(frozen=True)
class Mutation:
    build: Callable[[Workers], StepGraph]
    expect: int                                   # the invariant it breaks
    runner: type = GraphRunner
    configure: dict = field(default_factory=dict)  # MutantGenerator.configure; "trainer" means the run's
    trainer_configure: dict = field(default_factory=dict)  # MutantTrainer.configure
    controller_configure: dict = field(default_factory=dict)  # MutantController.configure
    overrides: tuple[str, ...] = ()               # the run's recipe, beyond the test's common one


MUTATIONS: dict[str, Mutation] = {
    "validate_not_before_resume": Mutation(validate_not_before_resume, expect=1),
    "refit_not_before_resume": Mutation(refit_not_before_resume, expect=2),
    "refit_without_drain": Mutation(refit_without_drain, expect=2, configure={"skip_drain": True}),
    "collect_without_resume": Mutation(collect_without_resume, expect=1, runner=PipelinedRunner),
    "refit_without_train": Mutation(refit_without_train, expect=5, configure={"trainer": True}),
    "late_version_label": Mutation(build_step_graph, expect=2, configure={"late_label": True}),
    "deliver_before_the_env": Mutation(build_step_graph, expect=2, configure={"early_delivery": True}),
    "hoard_weights": Mutation(build_step_graph, expect=7, trainer_configure={"hoard": True}),
    # Dynamic sampling's graph, on a controller whose sample trains the flat groups it should leave out.
    "train_flat_groups": Mutation(functools.partial(build_step_graph, top_up_rounds=1), expect=8,
                                  controller_configure={"keep_flat": True},
                                  overrides=("dynamic_sampling.max_rounds=1", "sim.flat_share=0.5")),
    # A run with a reward model whose generators put their batches without it.
    "deliver_unscored": Mutation(build_step_graph, expect=9, configure={"skip_scoring": True},
                                 overrides=("reward_model.kind=classifier",)),
    # A run with a distillation teacher whose generators put their batches without it.
    "deliver_untaught": Mutation(build_step_graph, expect=10, configure={"skip_teaching": True},
                                 overrides=("distill.teacher=sim",)),
    # Runs with agents (the agents profile of tests/tools/test_mutations.py) only.
    "deliver_before_the_agent": Mutation(build_step_graph, expect=2, configure={"early_delivery": True}),
    "label_ahead": Mutation(build_step_graph, expect=2, configure={"label_ahead": True}),
    "session_kept_across_batches": Mutation(build_step_graph, expect=2, configure={"stale_sessions": True}),
}
# Mutations that the multi-turn profile (tests/tools/test_mutations.py) runs too; the
# last one needs environments to mean anything.
MULTITURN = ("refit_without_drain", "validate_not_before_resume", "deliver_before_the_env")
# Mutations that the agents profile runs, each with what its finding says. The
# agents' checks (pipeline/tools/check_agents.py) make all but the last: a kept
# session's stale tokens are the rollout's first tokens, older than its start.
AGENTS = {"deliver_before_the_agent": "is not inside its rollout", "refit_without_drain": "and the refit of step",
          "label_ahead": "which its generator never held while it decoded",
          "session_kept_across_batches": "older than the version"}
AGENTS_ONLY = ("deliver_before_the_agent", "label_ahead", "session_kept_across_batches")
# Skipping the drain is what refit_mode inflight does on purpose. A label a step
# late harms only tokens in flight at a load: under drain none are, and the
# validation after the refit takes the late step before any rollout can.
ONE_MODE_ONLY = {"refit_without_drain": "drain", "late_version_label": "inflight", "hoard_weights": "drain",
                 "train_flat_groups": "drain", "deliver_unscored": "drain", "deliver_untaught": "drain"}

UNMUTATED = Mutation(build_step_graph, expect=0)
