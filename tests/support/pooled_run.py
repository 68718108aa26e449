"""Training runs on a pool of actors the caller holds across runs: the tests'
shared simulated pool, their mutated graphs, the benchmarks' sweeps. The
product's `pipeline.run.driver.train` starts actors of its own for one run;
this runs the same parts (`Run`) on the caller's, and leaves them ready for
the next run whether this one ends well or not."""
from __future__ import annotations

from contextlib import ExitStack

import ray

from dags.step_graph import Workers
from pipeline.run.driver import Run
from pipeline.run.pool import stop_per_run_actors
from pipeline.run.runner import GraphRunner


def train_on(cfg, workers: Workers, *, step_runner: GraphRunner | None = None,
             restore_from: str | None = None, quiet: bool = True) -> dict:
    """`train` on `workers` (pipeline.run.pool.start_workers), which the caller
    stops. `step_runner`: the caller's runner over those actors, kept across
    runs (a compiled graph compiles once) or wired differently (mutated graphs);
    the caller closes it."""
    run = None
    try:
        with ExitStack() as cleanup:
            run = Run(cfg, cleanup, quiet)
            run.find_start(restore_from)
            run.check_inputs_and_start_ray(own_workers=False)
            run.open_run_dir()
            run.start_workers(workers, step_runner)
            run.prologue()
            for step in range(run.start_step, cfg.run.steps):
                run.step(step)
            run.finish()
    except BaseException:
        if run is not None and run.workers is not None:
            _end_failed_run(run.execution.workers if run.execution is not None else run.workers,
                            cfg.run.deadline_s)
        raise
    run.say_done()
    return run.summary


def _end_failed_run(workers: Workers, deadline_s: float) -> None:
    """After a failure the run's own clean-up leaves the pool alone: close what
    each live worker's begin_run opened, so nothing of this run (a rollout still
    in an engine loop, a late put) reaches the next run on the pool."""
    actors = (workers.controller, *workers.trainers, *workers.critics, *workers.generators)
    closing = [a.end_run.remote(deadline_s) for a in actors]
    ray.wait(closing, num_returns=len(closing), timeout=deadline_s)
    for ref in closing:
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayError:
            pass  # dead, stuck, or failed before its begin_run opened anything: nothing of it runs on
    stop_per_run_actors(workers)
