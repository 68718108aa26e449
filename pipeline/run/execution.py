"""The graphs of a run over its workers, and what a generator's death costs a
step: the dead generator is replaced, its batches relaunched, and the step
finishes from where the graph stopped (pipeline/run/pool.py replace_generator).
Any other dead worker stops the run with the checkpoint to resume from."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import ray

from dags.step_graph import (TRAIN_SUBGRAPHS, StepGraph, Workers, build_finish_graph, build_prologue_graph,
                             build_step_graph)
from dags.tokens import StepPlan, TrainOut
from pipeline.config import Config
from pipeline.core.events import EventLog
from pipeline.core.worker_names import REWARD_MODEL, TEACHER, actor_names, generator_index, generator_name
from pipeline.run.pool import replace_generator
from pipeline.run.runner import GraphRunner, PipelineError, WorkerDied, step_label


def step_graph_for(cfg: Config, workers: Workers) -> StepGraph:
    """The recipe's step graph: its train sub-graph, weight sync and top-up rounds."""
    return build_step_graph(workers, TRAIN_SUBGRAPHS[cfg.train_graph],
                            collective=cfg.generation.weight_sync == "collective",
                            top_up_rounds=cfg.dynamic_sampling.max_rounds)


class Execution:
    """The run's workers and the graph runners over them. A replaced generator
    is a new actor handle, so the graphs are rebuilt around it."""

    def __init__(self, cfg: Config, workers: Workers, mode: str, run_dir: Path, t0: float, log: EventLog,
                 step_runner: GraphRunner | None, say=print):
        self.cfg, self.workers, self.mode, self.run_dir, self.t0, self.log = cfg, workers, mode, run_dir, t0, log
        self.say = say
        self.incarnations: dict[int, int] = {}
        self.step_runner = step_runner
        self._build(new_step_runner=step_runner is None)

    def _build(self, new_step_runner: bool = True) -> None:
        actors = actor_names(self.workers, self.incarnations)
        graph = step_graph_for(self.cfg, self.workers)
        self.trained_node = graph.trained
        if new_step_runner:
            if self.step_runner is not None:
                self.step_runner.close()
            self.step_runner = GraphRunner(graph, self.mode, self.cfg.run.startup_deadline_s, actors)
        self.step_runner.actors = actors
        self.finish_runner = GraphRunner(build_finish_graph(self.workers), "classic", self.cfg.run.deadline_s, actors)
        self.prologue_runner = GraphRunner(build_prologue_graph(self.workers), "classic",
                                           self.cfg.run.deadline_s, actors)

    def prologue(self, plan: StepPlan) -> dict:
        return self._recovering(lambda: self.prologue_runner, plan)

    def step(self, plan: StepPlan) -> dict:
        return self._recovering(lambda: self.step_runner, plan)

    def _absorb(self, out: dict) -> dict:
        """The driver has seen what these tokens carry: what it runs next is after it."""
        self.log.merge(*(getattr(token, "clock", ()) for token in out.values()))
        return out

    def _recovering(self, runner_now: Callable[[], GraphRunner], plan: StepPlan) -> dict:
        """One execution of a graph, recovering from generator deaths. `runner_now`:
        the graph's runner, which a recovery rebuilds around the new generator."""
        deadline_s = self.cfg.run.deadline_s
        while True:
            runner = runner_now()
            try:
                return self._absorb(runner.run(replace(plan, clock=self.log.now()), deadline_s, self.run_dir))
            except WorkerDied as died:
                done = self._recover(died, runner)
            # What the interrupted execution finished decides what is left to run.
            if "resume" in done:
                return done
            trained = done.get(self.trained_node)
            if trained is not None:
                return {**done, **self._finish(plan, trained)}

    def _recover(self, died: WorkerDied, runner: GraphRunner) -> dict:
        """Replace a dead generator; what the interrupted graph finished is returned.
        A replacement that dies while it takes over is replaced in turn, within
        fault.max_restarts, as a death mid-step is."""
        deadline_s = self.cfg.run.deadline_s
        index = generator_index(died.worker, len(self.workers.generators), self.incarnations)
        self._refuse_recovery(died, index, runner.mode)
        # A sample waiting for the dead generator's batches would wait out its deadline.
        ray.get(self.workers.controller.interrupt.remote(str(died)), timeout=deadline_s)
        done = self._absorb(runner.settle(deadline_s))
        while True:
            try:
                self._replace(died, index)
                break
            except WorkerDied as again:
                died = again
                index = generator_index(died.worker, len(self.workers.generators), self.incarnations)
                self._refuse_recovery(died, index, runner.mode)
        ray.get(self.workers.controller.clear_interrupt.remote(), timeout=deadline_s)
        self._build()
        return done

    def _refuse_recovery(self, died: WorkerDied, index: int | None, mode: str) -> None:
        """Stop the run, saying why, where a dead worker cannot be replaced."""
        if index is not None and mode != "compiled" and self.cfg.generation.weight_sync != "collective":
            return
        why = (f"Ray restarted it up to fault.max_restarts ({self.cfg.fault.max_restarts}) times"
               if died.worker.startswith((REWARD_MODEL, TEACHER)) else
               "the run cannot go on without it" if index is None
               else "generator restarts need run.dag_mode classic" if mode == "compiled"
               else "generator restarts need generation.weight_sync object_store (a collective "
                    "sync's process group cannot take a new member)")
        raise PipelineError(f"{died}; {why}") from None

    def _replace(self, died: WorkerDied, index: int) -> None:
        restart = self.incarnations.get(index, 0) + 1
        if restart <= self.cfg.fault.max_restarts:  # past it, replace_generator stops the run, saying why
            self.say(f"dagrl: {step_label(died.step)}: generator {died.worker} died ({died.detail}); "
                     f"starting restart {restart} of {self.cfg.fault.max_restarts}")
        self.workers, relaunched = replace_generator(self.workers, index, died, self.incarnations,
                                                     self.cfg, self.run_dir, self.t0, self.log)
        self.say(f"dagrl: {step_label(died.step)}: {generator_name(index, self.incarnations[index])} replaced "
                 f"{died.worker} and relaunched {len(relaunched)} unfinished batches "
                 f"{list(relaunched)}; the step goes on")

    def _finish(self, plan: StepPlan, trained: TrainOut) -> dict:
        try:
            return self._absorb(self.finish_runner.run((replace(plan, clock=self.log.now()), trained),
                                                       self.cfg.run.deadline_s, self.run_dir))
        except WorkerDied as died:
            raise PipelineError(f"{died} while recovering from an earlier death") from None

    def close(self, external_runner: GraphRunner | None, failed: bool) -> None:
        if self.step_runner is not None and (self.step_runner is not external_runner or failed):
            self.step_runner.close()
