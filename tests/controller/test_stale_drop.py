"""The rollout queue's stale drop in a whole simulated run (invariants 3 and 4).

The launch schedule never produces a stale batch (a batch launched at version v
targets v + max_age, and relaunches and resumes only raise its version), so a
run reaches the stale drop only through a controller that launches too far
ahead: this test plants one in a simulated run and checks that the checker and
the run's accounting take the drop as a recorded use, not a loss.

The queue's own unit tests, the stale drop included: tests/controller/test_rollout_queue.py."""
from __future__ import annotations

import sys

from pipeline.controller.controller import Controller
import pytest

pytestmark = pytest.mark.sim


class LaunchesOneTooFarAhead(Controller):
    """At step 1 also launches a batch two steps further ahead than the schedule
    (target 5 instead of 3 with max_age 1) at the current version, 2: at step 4
    it is max_age + 1 behind and dropped. A bug in the launch schedule of
    exactly the kind the stale drop guards against."""

    def _new_launches(self, step, version):
        launches = super()._new_launches(step, version)
        if step == 1:
            from dags.tokens import Launch
            target = step + 2 + self.cfg.schedule.max_age + 1
            extra = Launch(f"x{target}.g0", target, 0, tuple(self._next_prompts(2)))
            self.queue.expect(extra.batch_id, target, version, extra)
            launches.append(extra)
        return launches


def test_a_stale_drop_in_a_simulated_run_passes_the_checker(tmp_path, ray_session):
    import ray
    from ray import cloudpickle

    from pipeline.config import load_config
    from tests.support.pooled_run import train_on
    from dags.step_graph import Workers
    from pipeline.run.pool import start_workers, stop_workers
    from pipeline.core.events import load_events
    from pipeline.tools.check import check_events

    # The subclass lives in this test module, which Ray's workers cannot import by name.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=stale", "run.steps=6", "run.dag_mode=classic",
                             "run.deadline_s=30", "schedule.max_age=1", "generation.num_generators=1",
                             "sim.generate_s=0.01", "sim.train_s=0.01", "metrics.tensorboard=false"])
    pool = start_workers(1)
    controller = ray.remote(LaunchesOneTooFarAhead).options(num_cpus=0.5, max_concurrency=8).remote()
    workers = Workers(controller, pool.trainers, pool.generators)
    try:
        summary = train_on(cfg, workers, quiet=True)
    finally:
        stop_workers(Workers(pool.controller, pool.trainers, pool.generators))
        ray.kill(controller)
    # Launched at step 1's resume with version 2 for step 5; at step 4, 4 - 2 > max_age: dropped there.
    run_events = load_events(tmp_path / "stale")
    drops = [e for e in run_events if e["ev"] == "drop"]
    assert [(e["batch"], e["reason"], e["version"]) for e in drops] == [("x5.g0", "stale", 2)]
    take = next(e for e in run_events if e["ev"] == "train_start" and e["step"] == 4)
    assert drops[0]["t"] <= take["t"] and "x5.g0" not in take["batches"]
    assert all("x5.g0" not in e["batches"] for e in run_events if e["ev"] == "train_start")
    violations = check_events(run_events)
    assert violations == [], "\n".join(v.message for v in violations)
    acc = summary["accounting"]
    assert acc["balanced"] and acc["dropped_by_reason"] == {"stale": 1}
    assert acc["launched"] == 6 + 1 and acc["trained"] == 6
