"""Execute a step graph with deadlines, and notice dead workers while waiting.

Classic mode polls the outputs and pings every actor between polls, so a
worker that dies mid-step becomes a `WorkerDied` within about a second instead
of a hang until some deadline; the driver then recovers or stops.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import ray
from ray.dag import DAGContext

from dags.step_graph import StepGraph
from dags.tokens import StepPlan
from pipeline.core.events import unfinished_nodes
from pipeline.core.graph_calls import submit


class PipelineError(RuntimeError):
    """A run stopped: the message names the node, worker and step where known."""


def step_label(step: int) -> str:
    """How a message names a step: the prologue's plan is step -1."""
    return "before the first step" if step < 0 else f"step {step}"


class WorkerDied(PipelineError):
    def __init__(self, worker: str, step: int, detail: str):
        super().__init__(f"{step_label(step)}: worker {worker} died: {detail}")
        self.worker, self.step, self.detail = worker, step, detail


def dead_actors(actors: dict[str, object], timeout_s: float) -> dict[str, str]:
    """{name: why} for the actors that do not answer because their process is gone.
    A busy actor still answers: every actor keeps a thread free for ping."""
    names = list(actors)
    refs = [actors[n].ping.remote() for n in names]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    dead = {}
    for name, ref in zip(names, refs):
        if ref in ready:
            try:
                ray.get(ref, timeout=timeout_s)
            except ray.exceptions.ActorUnavailableError:
                pass  # Ray is restarting it (the reward model's max_restarts): not dead yet
            except ray.exceptions.RayActorError as exc:
                dead[name] = first_line(exc)
    return dead


class GraphRunner:
    """Executes a StepGraph in classic or compiled mode; every wait has a deadline.

    A compiled runner may serve several runs on the same workers (tests do)."""

    def __init__(self, graph: StepGraph, mode: str, first_deadline_s: float,
                 actors: dict[str, object] | None = None, poll_s: float = 1.0):
        self.graph, self.mode = graph, mode
        # The first execution also starts the graph's loops on every actor (seconds on a busy machine).
        self.first_deadline_s = first_deadline_s
        self.actors = actors or {}
        self.poll_s = poll_s
        self.executions = 0
        self.compiled = None
        self.pending: list = []
        if mode == "compiled":
            # Compiled graphs have their own 10 s result timeout; our deadlines are the ones that count.
            DAGContext.get_current().get_timeout = math.ceil(first_deadline_s) + 1
            self.compiled = graph.dag.experimental_compile()

    def run(self, plan, deadline_s: float, run_dir: Path) -> dict:
        """`plan`: the graph's input, or a tuple of its inputs."""
        args = plan if isinstance(plan, tuple) else (plan,)
        step = next((a.step for a in args if isinstance(a, StepPlan)), -1)
        if self.executions == 0:
            deadline_s = max(deadline_s, self.first_deadline_s)
        self.executions += 1
        refs = self.compiled.execute(*args) if self.compiled else submit(self.graph, args)
        self.pending = list(zip(self.graph.node_names, refs))
        if self.compiled is None:
            self._watch(step, [r for _, r in self.pending], deadline_s, run_dir)
        out = {}
        for name, ref in self.pending:
            try:
                out[name] = ray.get(ref, timeout=deadline_s)
            except TimeoutError:  # GetTimeoutError, or RayChannelTimeoutError in compiled mode
                self._raise_dead(step)
                # A compiled graph returns its outputs together, so ask the event log what is stuck.
                stuck = unfinished_nodes(run_dir, step) or [(name, "?")]
                where = ", ".join(f"node {n} on worker {w}" for n, w in stuck)
                raise PipelineError(f"{step_label(step)}: {where} did not finish within "
                                    f"{deadline_s:.0f} s (run.deadline_s)") from None
            except ray.exceptions.RayActorError as exc:
                self._raise_dead(step)
                raise PipelineError(f"{step_label(step)}: node {name}: its worker died: {first_line(exc)}") from None
            except ray.exceptions.RayError as exc:
                self._raise_dead(step)
                raise PipelineError(task_error(exc)) from None
        self.pending = []
        return out

    def _watch(self, step: int, refs: list, deadline_s: float, run_dir: Path) -> None:
        """Until every output is ready or the deadline passes; raise WorkerDied on a death."""
        end = time.monotonic() + deadline_s
        waiting = refs
        while waiting and time.monotonic() < end:
            _, waiting = ray.wait(waiting, num_returns=len(waiting),
                                  timeout=min(self.poll_s, max(end - time.monotonic(), 0)))
            if waiting:
                self._raise_dead(step)

    def _raise_dead(self, step: int) -> None:
        if self.actors:
            dead = dead_actors(self.actors, timeout_s=self.poll_s)
            if dead:
                name, why = sorted(dead.items())[0]
                raise WorkerDied(name, step, why)

    def settle(self, deadline_s: float) -> dict:
        """After a WorkerDied: wait for the other nodes of the interrupted
        execution and return {name: token} of those that succeeded."""
        refs = [r for _, r in self.pending]
        ray.wait(refs, num_returns=len(refs), timeout=deadline_s)
        done = {}
        for name, ref in self.pending:
            try:
                done[name] = ray.get(ref, timeout=0)
            except (ray.exceptions.RayError, TimeoutError):
                pass
        self.pending = []
        return done

    def close(self) -> None:
        if self.compiled is not None:
            self.compiled.teardown()
            self.compiled = None


def first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def task_error(exc: BaseException) -> str:
    """The worker's own message, without Ray's traceback wrapping."""
    cause = getattr(exc, "cause", None)
    text = str(cause) if cause is not None else str(exc)
    return next((line for line in text.splitlines() if "failed at step" in line), first_line(cause or exc))
