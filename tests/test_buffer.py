"""The replay buffer's stale drop (invariants 3 and 4): at `take(step)` every
entry whose weight version is more than max_age behind the step is dropped with
reason "stale", counted, and logged; the rest of the step trains.

The launch schedule never produces such a batch (a batch launched at version v
targets v + max_age, and relaunches and resumes only raise its version), so a
run reaches this path only through a controller that launches too far ahead:
the last test plants one in a simulated run and checks that the checker and the
run's accounting take the drop as a recorded use, not a loss."""
from __future__ import annotations

import json
import sys
import time

import pyarrow as pa
import pytest

from pipeline.actors.controller import Controller
from pipeline.actors.replay_buffer import ReplayBuffer
from pipeline.engines.interface import TRAJECTORY_SCHEMA
from pipeline.run.events import EventLog


def rows(batch_id: str, target: int, version: int, n: int = 2) -> pa.Table:
    """A batch's trajectories: only batch_id, target and version matter to the buffer."""
    given = {"batch_id": batch_id, "target": target, "version": version}
    blank = {pa.types.is_string: "", pa.types.is_integer: 0, pa.types.is_floating: 0.0, pa.types.is_list: []}
    return pa.table({f.name: pa.array([given.get(f.name, next(v for is_, v in blank.items() if is_(f.type)))] * n,
                                      f.type) for f in TRAJECTORY_SCHEMA}, schema=TRAJECTORY_SCHEMA)


def events(run_dir, worker: str = "controller") -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events" / f"{worker}.jsonl").read_text().splitlines()]


@pytest.fixture
def buffer(tmp_path):
    log = EventLog(tmp_path, "controller", time.time())
    try:
        yield ReplayBuffer(max_age=1, log=log)
    finally:
        log.close()


def arrive(buffer: ReplayBuffer, batch_id: str, target: int, version: int) -> None:
    buffer.expect(batch_id, target, version)
    buffer.put(batch_id, version, rows(batch_id, target, version))


def test_a_batch_older_than_max_age_is_dropped_as_stale(tmp_path, buffer):
    arrive(buffer, "fresh", target=3, version=2)   # age 1 at step 3: trains
    arrive(buffer, "old", target=3, version=1)     # age 2 > max_age 1: stale
    arrive(buffer, "edge", target=3, version=2)    # age exactly max_age: trains
    ids, versions, table = buffer.take(3, deadline_s=5)
    assert ids == ["edge", "fresh"] and versions == [2, 2]
    assert set(table.column("batch_id").to_pylist()) == {"edge", "fresh"} and table.num_rows == 4
    acc = buffer.accounting()
    assert acc == {"launched": 3, "trained": 2, "buffered": 0, "in_flight": 0, "dropped": 1,
                   "dropped_by_reason": {"stale": 1}, "balanced": True}
    drops = [e for e in events(tmp_path) if e["ev"] == "drop"]
    assert [(e["batch"], e["reason"], e["step"], e["version"], e["worker"]) for e in drops] == [
        ("old", "stale", 3, 1, "controller")]


def test_stale_is_judged_against_the_step_taken_not_the_target(tmp_path, buffer):
    """An entry for a later step that is already too old now is dropped now,
    whether it has arrived or is still in flight; its late arrival is refused."""
    arrive(buffer, "now", target=4, version=3)
    arrive(buffer, "later_arrived", target=6, version=2)
    buffer.expect("later_in_flight", target=6, version=2)
    arrive(buffer, "later_ok", target=6, version=3)
    ids, _, _ = buffer.take(4, deadline_s=5)
    assert ids == ["now"]
    acc = buffer.accounting()
    assert acc["dropped_by_reason"] == {"stale": 2} and acc["buffered"] == 1 and acc["in_flight"] == 0
    assert acc["balanced"]
    assert sorted(e["batch"] for e in events(tmp_path) if e["ev"] == "drop") == ["later_arrived", "later_in_flight"]
    with pytest.raises(ValueError, match="batch later_in_flight arrived but was not in flight"):
        buffer.put("later_in_flight", 2, rows("later_in_flight", 6, 2))


def test_a_step_whose_every_batch_is_stale_is_an_error_and_still_balanced(tmp_path, buffer):
    arrive(buffer, "a", target=5, version=2)
    arrive(buffer, "b", target=5, version=3)
    with pytest.raises(RuntimeError, match=r"step 5: no trajectories to train on") as err:
        buffer.take(5, deadline_s=5)
    assert "stale" in str(err.value)
    acc = buffer.accounting()
    assert acc["dropped_by_reason"] == {"stale": 2} and acc["trained"] == 0 and acc["balanced"]


def test_a_step_that_lost_every_batch_names_the_first_cause(tmp_path, buffer):
    """The engine's reason for a failed rollout must reach the run's error, not
    only a drop event (a model vLLM could not run once stopped a run with just
    "every batch failed or was stale")."""
    for batch_id in ("t0.g0", "t0.g1"):
        buffer.expect(batch_id, 0, 0)
    buffer.fail("t0.g0", "failed: RuntimeError: Unsupported CPU attention configuration: head_dim=16")
    buffer.fail("t0.g1", "failed: RuntimeError: engine died")
    with pytest.raises(RuntimeError) as err:
        buffer.take(0, deadline_s=5)
    assert str(err.value) == ("step 0: no trajectories to train on: every batch for this step failed or was "
                              "stale; the first: batch t0.g0 failed: RuntimeError: Unsupported CPU attention "
                              "configuration: head_dim=16 (1 more dropped)")


def test_max_age_zero_keeps_only_the_current_version(tmp_path):
    log = EventLog(tmp_path, "controller", time.time())
    try:
        buffer = ReplayBuffer(max_age=0, log=log)
        arrive(buffer, "sync", target=2, version=2)
        arrive(buffer, "one_behind", target=2, version=1)
        assert buffer.take(2, deadline_s=5)[0] == ["sync"]
        assert buffer.accounting()["dropped_by_reason"] == {"stale": 1}
    finally:
        log.close()


def test_counters_with_a_stale_drop_survive_a_checkpoint(tmp_path, buffer):
    arrive(buffer, "old", target=3, version=1)
    arrive(buffer, "new", target=3, version=3)
    buffer.take(3, deadline_s=5)
    _, counters = buffer.snapshot()
    log = EventLog(tmp_path, "restored", time.time())
    try:
        restored = ReplayBuffer(max_age=1, log=log)
        restored.restore_counters(json.loads(json.dumps(counters)))
        assert restored.accounting() == buffer.accounting()
        assert restored.accounting()["dropped_by_reason"] == {"stale": 1}
    finally:
        log.close()


# ------------------------------------------------------------------ in a run

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
            self.buffer.expect(extra.batch_id, target, version, extra)
            launches.append(extra)
        return launches


def test_a_stale_drop_in_a_simulated_run_passes_the_checker(tmp_path, ray_session):
    import ray
    from ray import cloudpickle

    from pipeline.io.config import load_config
    from pipeline.run.driver import start_workers, stop_workers, train
    from pipeline.run.pool import Workers
    from pipeline.tools.check import check_events, load_events

    # The subclass lives in this test module, which Ray's workers cannot import by name.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=stale", "run.steps=6", "run.dag_mode=classic",
                             "run.deadline_s=30", "schedule.max_age=1", "generation.num_generators=1",
                             "sim.generate_s=0.01", "sim.train_s=0.01", "metrics.tensorboard=false"])
    pool = start_workers(1)
    controller = ray.remote(LaunchesOneTooFarAhead).options(num_cpus=0.5, max_concurrency=8).remote()
    workers = Workers(controller, pool.trainer, pool.generators)
    try:
        summary = train(cfg, workers=workers, quiet=True)
    finally:
        stop_workers(Workers(pool.controller, pool.trainer, pool.generators))
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
