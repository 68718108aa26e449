"""GraphRunner, dead_actors and WorkerDied (pipeline/run/runner.py) on tiny Ray
DAGs of test actors: what a run returns, and how a failing, stuck or killed
node ends it. The step graph itself on simulated workers: tests/dags/test_step_graph.py;
the driver's recovery from a WorkerDied: tests/run/test_faults.py."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import ray
from ray import cloudpickle
from ray.dag import InputNode

from dags.step_graph import graph_of
from dags.tokens import Clock, StepPlan
from pipeline.core.node import node
from pipeline.core.events import EventLog
from pipeline.run.runner import GraphRunner, PipelineError, WorkerDied, dead_actors

pytestmark = pytest.mark.sim

# The actors below live in this test module, which Ray's workers cannot import by name.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass(frozen=True)
class Out:
    step: int
    value: int
    clock: Clock = ()


class Stage:
    """A graph actor as the workers are: its nodes log (and name themselves in
    errors) through the node decorator, and a spare thread answers ping and release."""

    def __init__(self, name: str, run_dir: str):
        self.log = EventLog(run_dir, name, time.time())
        self.released = threading.Event()

    def ping(self) -> bool:
        return True

    def release(self) -> None:
        self.released.set()

    @node("double")
    def double(self, plan: StepPlan) -> Out:
        return Out(plan.step, 2 * plan.step)

    @node("add")
    def add(self, a: Out, b: Out) -> Out:
        return Out(a.step, a.value + b.value)

    @node("fail")
    def fail(self, plan: StepPlan) -> Out:
        raise ValueError(f"bad input at {plan.step}")

    @node("wait")
    def wait(self, plan: StepPlan) -> Out:
        """Until released: a node that hangs, or one still running when another dies."""
        if not self.released.wait(timeout=120):
            raise TimeoutError("never released")
        return Out(plan.step, -1)

    @node("die")
    def die(self, plan: StepPlan) -> Out:
        os.kill(os.getpid(), signal.SIGKILL)   # killed as the OOM killer would: no reply, no cleanup
        raise AssertionError("unreachable")


@pytest.fixture
def stages(ray_session, tmp_path):
    """Two Stage actors, "left" and "right", logging into tmp_path; killed afterwards."""
    made = {name: ray.remote(Stage).options(num_cpus=0, max_concurrency=4).remote(name, str(tmp_path))
            for name in ("left", "right")}
    try:
        ray.get([actor.ping.remote() for actor in made.values()], timeout=120)   # started: deadlines count from here
        yield made
    finally:
        for actor in made.values():
            ray.kill(actor)


def values(out: dict) -> dict:
    return {name: (token.step, token.value) for name, token in out.items()}


def bound(build) -> object:
    """A StepGraph of graph_of(build(plan)) over one input."""
    with InputNode() as plan:
        return graph_of(build(plan))


def diamond(stages):
    left, right = stages["left"], stages["right"]

    def build(plan):
        a, b = left.double.bind(plan), right.double.bind(plan)
        return [("left", a), ("right", b), ("sum", left.add.bind(a, b))]
    return bound(build)


def test_outputs_are_returned_by_node_name_execution_after_execution(stages, tmp_path):
    runner = GraphRunner(diamond(stages), "classic", first_deadline_s=60, actors=stages, poll_s=0.2)
    try:
        for step in (3, 4):
            out = runner.run(StepPlan(step, False), deadline_s=60, run_dir=tmp_path)
            assert values(out) == {"left": (step, 2 * step), "right": (step, 2 * step), "sum": (step, 4 * step)}
            # The join's clock is after both nodes it took.
            assert dict(out["sum"].clock)["right/double"] == dict(out["right"].clock)["right/double"]
        assert runner.executions == 2 and runner.pending == []
    finally:
        runner.close()


def test_the_compiled_mode_returns_the_same_outputs(stages, tmp_path):
    runner = GraphRunner(diamond(stages), "compiled", first_deadline_s=60, actors=stages)
    try:
        for step in (1, 2):
            out = runner.run(StepPlan(step, False), deadline_s=60, run_dir=tmp_path)
            assert values(out) == {"left": (step, 2 * step), "right": (step, 2 * step), "sum": (step, 4 * step)}
    finally:
        runner.close()
    assert runner.compiled is None


def test_a_node_error_stops_the_run_naming_the_node_worker_and_step(stages, tmp_path):
    graph = bound(lambda plan: [("ok", stages["left"].double.bind(plan)), ("broken", stages["right"].fail.bind(plan))])
    runner = GraphRunner(graph, "classic", first_deadline_s=60, actors=stages, poll_s=0.2)
    try:
        with pytest.raises(PipelineError) as err:
            runner.run(StepPlan(7, False), deadline_s=60, run_dir=tmp_path)
    finally:
        runner.close()
    assert not isinstance(err.value, WorkerDied)
    assert str(err.value) == "node 'fail' on worker 'right' failed at step 7: ValueError: bad input at 7"


def test_a_node_that_does_not_finish_within_the_deadline_is_named(stages, tmp_path):
    graph = bound(lambda plan: [("quick", stages["right"].double.bind(plan)),
                                ("stuck", stages["left"].wait.bind(plan))])
    runner = GraphRunner(graph, "classic", first_deadline_s=2, actors=stages, poll_s=0.2)
    try:
        with pytest.raises(PipelineError, match=r"^step 5: node wait on worker left did not finish within 2 s "
                                                r"\(run.deadline_s\)$") as err:
            runner.run(StepPlan(5, False), deadline_s=2, run_dir=tmp_path)
        assert not isinstance(err.value, WorkerDied)   # stuck, not dead: it still answers pings
    finally:
        ray.get(stages["left"].release.remote())
        runner.close()


def test_a_killed_worker_becomes_worker_died_and_settle_keeps_the_rest(stages, tmp_path):
    """The death is noticed while another node still runs; once that one ends,
    settle returns what succeeded of the interrupted execution."""
    graph = bound(lambda plan: [("survivor", stages["left"].wait.bind(plan)),
                                ("quick", stages["left"].double.bind(plan)),
                                ("victim", stages["right"].die.bind(plan))])
    runner = GraphRunner(graph, "classic", first_deadline_s=60, actors=stages, poll_s=0.2)
    try:
        with pytest.raises(WorkerDied) as err:
            runner.run(StepPlan(2, False), deadline_s=60, run_dir=tmp_path)
        assert (err.value.worker, err.value.step) == ("right", 2)
        assert str(err.value).startswith("step 2: worker right died: ") and err.value.detail
        assert isinstance(err.value, PipelineError)
        ray.get(stages["left"].release.remote())
        assert values(runner.settle(deadline_s=60)) == {"survivor": (2, -1), "quick": (2, 4)}
        assert runner.pending == []
    finally:
        ray.get(stages["left"].release.remote())
        runner.close()


def test_without_actors_to_ping_a_death_is_still_an_error_naming_the_node(stages, tmp_path):
    runner = GraphRunner(bound(lambda plan: [("victim", stages["right"].die.bind(plan))]), "classic",
                         first_deadline_s=60, poll_s=0.2)
    try:
        with pytest.raises(PipelineError, match=r"^step 1: node victim: its worker died: ") as err:
            runner.run(StepPlan(1, False), deadline_s=60, run_dir=tmp_path)
        assert not isinstance(err.value, WorkerDied)
    finally:
        runner.close()


def test_dead_actors_names_the_dead_not_the_busy(stages, tmp_path):
    busy = stages["left"].wait.remote(StepPlan(0, False))
    dying = stages["right"].die.remote(StepPlan(0, False))
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(dying, timeout=60)
    try:
        dead = dead_actors(stages, timeout_s=60)
        assert list(dead) == ["right"] and dead["right"].strip()
        assert dead_actors({"left": stages["left"]}, timeout_s=60) == {}
    finally:
        ray.get(stages["left"].release.remote())
    assert ray.get(busy, timeout=60).value == -1
