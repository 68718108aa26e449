"""RolloutQueue (pipeline/controller/rollout_queue.py) on its own, without Ray.

The stale drop (invariants 3 and 4): at `take(step)` every entry whose weight
version is more than max_age behind the step is dropped with reason "stale",
counted, and logged; the rest of the step trains. Around it: what `take` hands
out and when, failures and relaunches, the driver's interrupt, a fatal error,
the drops at the end, and the conservation of batches through all of it (every
launched batch is trained, dropped or still held, exactly once) and through a
checkpoint (snapshot, restore, restore_counters).

The stale drop in a whole simulated run, with the checker: tests/controller/test_stale_drop.py."""
from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dags.tokens import Launch
from pipeline.controller.rollout_queue import Interrupted, RolloutQueue
from pipeline.core.types import TRAJECTORY_SCHEMA
from pipeline.core.events import EventLog

pytestmark = pytest.mark.unit


def rows(batch_id: str, target: int, version: int, n: int = 2) -> pa.Table:
    """A batch's trajectories: only batch_id, target and version matter to the queue."""
    given = {"batch_id": batch_id, "target": target, "version": version}
    blank = {pa.types.is_string: "", pa.types.is_integer: 0, pa.types.is_floating: 0.0, pa.types.is_list: [],
             pa.types.is_boolean: False, pa.types.is_large_binary: b""}
    return pa.table({f.name: pa.array([given.get(f.name, next(v for is_, v in blank.items() if is_(f.type)))] * n,
                                      f.type) for f in TRAJECTORY_SCHEMA}, schema=TRAJECTORY_SCHEMA)


def events(run_dir, worker: str = "controller") -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "events" / f"{worker}.jsonl").read_text().splitlines()]


def drops(run_dir) -> list[tuple[str, str]]:
    return [(e["batch"], e["reason"]) for e in events(run_dir) if e["ev"] == "drop"]


@pytest.fixture
def queue(tmp_path):
    log = EventLog(tmp_path, "controller", time.time())
    try:
        yield RolloutQueue(max_age=1, log=log)
    finally:
        log.close()


def arrive(queue: RolloutQueue, batch_id: str, target: int, version: int) -> None:
    queue.expect(batch_id, target, version)
    queue.put(batch_id, version, rows(batch_id, target, version))


def launch(batch_id: str, target: int, generator: int) -> Launch:
    return Launch(batch_id, target, generator, ())


# ------------------------------------------------------------------ stale drops

def test_a_batch_older_than_max_age_is_dropped_as_stale(tmp_path, queue):
    arrive(queue, "fresh", target=3, version=2)   # age 1 at step 3: trains
    arrive(queue, "old", target=3, version=1)     # age 2 > max_age 1: stale
    arrive(queue, "edge", target=3, version=2)    # age exactly max_age: trains
    ids, versions, table = queue.take(3, deadline_s=5)
    assert ids == ["edge", "fresh"] and versions == [2, 2]
    assert set(table.column("batch_id").to_pylist()) == {"edge", "fresh"} and table.num_rows == 4
    acc = queue.accounting()
    assert acc == {"launched": 3, "trained": 2, "buffered": 0, "in_flight": 0, "dropped": 1,
                   "dropped_by_reason": {"stale": 1}, "balanced": True}
    drop_events = [e for e in events(tmp_path) if e["ev"] == "drop"]
    assert [(e["batch"], e["reason"], e["step"], e["version"], e["worker"]) for e in drop_events] == [
        ("old", "stale", 3, 1, "controller")]


def test_stale_is_judged_against_the_step_taken_not_the_target(tmp_path, queue):
    """An entry for a later step that is already too old now is dropped now,
    whether it has arrived or is still in flight; its late arrival is refused."""
    arrive(queue, "now", target=4, version=3)
    arrive(queue, "later_arrived", target=6, version=2)
    queue.expect("later_in_flight", target=6, version=2)
    arrive(queue, "later_ok", target=6, version=3)
    ids, _, _ = queue.take(4, deadline_s=5)
    assert ids == ["now"]
    acc = queue.accounting()
    assert acc["dropped_by_reason"] == {"stale": 2} and acc["buffered"] == 1 and acc["in_flight"] == 0
    assert acc["balanced"]
    assert sorted(e["batch"] for e in events(tmp_path) if e["ev"] == "drop") == ["later_arrived", "later_in_flight"]
    with pytest.raises(ValueError, match="batch later_in_flight arrived but was not in flight"):
        queue.put("later_in_flight", 2, rows("later_in_flight", 6, 2))


def test_a_step_whose_every_batch_is_stale_is_an_error_and_still_balanced(tmp_path, queue):
    arrive(queue, "a", target=5, version=2)
    arrive(queue, "b", target=5, version=3)
    with pytest.raises(RuntimeError, match=r"step 5: no trajectories to train on") as err:
        queue.take(5, deadline_s=5)
    assert "stale" in str(err.value)
    acc = queue.accounting()
    assert acc["dropped_by_reason"] == {"stale": 2} and acc["trained"] == 0 and acc["balanced"]


def test_a_step_that_lost_every_batch_names_the_first_cause(tmp_path, queue):
    """The engine's reason for a failed rollout must reach the run's error, not
    only a drop event (a model vLLM could not run once stopped a run with just
    "every batch failed or was stale")."""
    for batch_id in ("t0.g0", "t0.g1"):
        queue.expect(batch_id, 0, 0)
    queue.fail("t0.g0", "failed: RuntimeError: Unsupported CPU attention configuration: head_dim=16")
    queue.fail("t0.g1", "failed: RuntimeError: engine died")
    with pytest.raises(RuntimeError) as err:
        queue.take(0, deadline_s=5)
    assert str(err.value) == ("step 0: no trajectories to train on: every batch for this step failed or was "
                              "stale; the first: batch t0.g0 failed: RuntimeError: Unsupported CPU attention "
                              "configuration: head_dim=16 (1 more dropped)")


def test_max_age_zero_keeps_only_the_current_version(tmp_path):
    log = EventLog(tmp_path, "controller", time.time())
    try:
        queue = RolloutQueue(max_age=0, log=log)
        arrive(queue, "sync", target=2, version=2)
        arrive(queue, "one_behind", target=2, version=1)
        assert queue.take(2, deadline_s=5)[0] == ["sync"]
        assert queue.accounting()["dropped_by_reason"] == {"stale": 1}
    finally:
        log.close()


def test_counters_with_a_stale_drop_survive_a_checkpoint(tmp_path, queue):
    arrive(queue, "old", target=3, version=1)
    arrive(queue, "new", target=3, version=3)
    queue.take(3, deadline_s=5)
    _, counters = queue.snapshot()
    log = EventLog(tmp_path, "restored", time.time())
    try:
        restored = RolloutQueue(max_age=1, log=log)
        restored.restore_counters(json.loads(json.dumps(counters)))
        assert restored.accounting() == queue.accounting()
        assert restored.accounting()["dropped_by_reason"] == {"stale": 1}
    finally:
        log.close()


def test_a_stale_batch_in_flight_is_no_longer_relaunchable(queue):
    queue.expect("t3.g0", 3, 0, launch("t3.g0", 3, 0))
    arrive(queue, "t2.g0", 2, 2)
    assert [e.batch_id for e in queue.in_flight(0)] == ["t3.g0"]
    queue.take(2, deadline_s=5)   # 2 - 0 > max_age: dropped here, before its own step
    assert queue.in_flight(0) == []
    assert queue.accounting()["dropped_by_reason"] == {"stale": 1}


# ------------------------------------------------------------------ take

def test_expecting_a_batch_twice_is_refused(queue):
    queue.expect("t0.g0", 0, 0)
    with pytest.raises(ValueError, match="batch t0.g0 launched twice"):
        queue.expect("t0.g0", 1, 0)
    assert queue.accounting()["launched"] == 1


def test_take_hands_out_only_its_steps_batches_sorted_by_id(queue):
    for batch_id, target in [("t2.g1", 2), ("t1.g1", 1), ("t1.g0", 1), ("t2.g0", 2), ("t1.g2", 1)]:
        queue.expect(batch_id, target, target)
    for batch_id in ("t2.g0", "t1.g2", "t2.g1", "t1.g0", "t1.g1"):   # they arrive out of order
        target = int(batch_id[1])
        queue.put(batch_id, target, rows(batch_id, target, target, n=1 + int(batch_id[-1])))
    ids, versions, table = queue.take(1, deadline_s=5)
    assert ids == ["t1.g0", "t1.g1", "t1.g2"] and versions == [1, 1, 1]
    assert table.schema == TRAJECTORY_SCHEMA
    assert table.column("batch_id").to_pylist() == ["t1.g0", "t1.g1", "t1.g1", "t1.g2", "t1.g2", "t1.g2"]
    assert queue.accounting()["buffered"] == 2
    ids, _, table = queue.take(2, deadline_s=5)
    assert ids == ["t2.g0", "t2.g1"] and set(table.column("target").to_pylist()) == {2}
    assert queue.accounting() == {"launched": 5, "trained": 5, "buffered": 0, "in_flight": 0, "dropped": 0,
                                   "dropped_by_reason": {}, "balanced": True}


def test_take_does_not_hand_out_part_of_a_step(queue):
    """A batch of the step still in flight holds the step back until the deadline; one
    of a later step does not."""
    arrive(queue, "t0.g0", 0, 0)
    queue.expect("t0.g1", 0, 0)
    queue.expect("t1.g0", 1, 0)
    with pytest.raises(TimeoutError, match=r"step 0: batches \['t0.g1'\] still in flight after 0 s"):
        queue.take(0, deadline_s=0.05)
    assert queue.accounting()["trained"] == 0 and queue.accounting()["buffered"] == 1
    queue.put("t0.g1", 0, rows("t0.g1", 0, 0))
    assert queue.take(0, deadline_s=5)[0] == ["t0.g0", "t0.g1"]   # t1.g0 still in flight


def test_a_put_from_another_thread_completes_a_waiting_take(queue):
    queue.expect("t0.g0", 0, 0)
    put = threading.Thread(target=queue.put, args=("t0.g0", 0, rows("t0.g0", 0, 0)))
    put.start()
    try:
        assert queue.take(0, deadline_s=60)[0] == ["t0.g0"]
    finally:
        put.join()


def test_put_refuses_a_batch_not_in_flight_or_of_another_version(queue):
    with pytest.raises(ValueError, match="batch nope arrived but was not in flight"):
        queue.put("nope", 0, rows("nope", 0, 0))
    queue.expect("t1.g0", 1, 1)
    with pytest.raises(ValueError, match="launched for version 1 but generated with version 0"):
        queue.put("t1.g0", 0, rows("t1.g0", 1, 0))
    queue.put("t1.g0", 1, rows("t1.g0", 1, 1))
    with pytest.raises(ValueError, match="batch t1.g0 arrived but was not in flight"):
        queue.put("t1.g0", 1, rows("t1.g0", 1, 1))   # twice
    assert queue.accounting()["buffered"] == 1


# ------------------------------------------------------------------ failures and relaunches

def test_a_failed_rollout_is_dropped_by_its_reasons_first_word(tmp_path, queue):
    queue.expect("t0.g0", 0, 0)
    arrive(queue, "t0.g1", 0, 0)
    queue.fail("t0.g0", "failed: RuntimeError: engine died", clock=(("gen0/rollouts", 7),))
    queue.fail("unknown", "failed: nothing")   # not launched here: nothing to drop
    acc = queue.accounting()
    assert acc["dropped_by_reason"] == {"failed": 1} and acc["in_flight"] == 0 and acc["balanced"]
    (drop,) = [e for e in events(tmp_path) if e["ev"] == "drop"]
    assert (drop["batch"], drop["reason"], drop["step"]) == ("t0.g0", "failed: RuntimeError: engine died", 0)
    assert drop["vc"]["gen0/rollouts"] == 7   # after the failed rollout's end
    assert queue.take(0, deadline_s=5)[0] == ["t0.g1"]   # the failed batch no longer holds the step


def test_relaunch_moves_an_in_flight_batch_to_a_new_version_as_the_same_launch(queue):
    first = launch("t2.g1", 2, 1)
    queue.expect("t2.g1", 2, 1, first)
    queue.expect("t2.g0", 2, 1, launch("t2.g0", 2, 0))
    assert [e.batch_id for e in queue.in_flight(1)] == ["t2.g1"]
    assert queue.relaunch("t2.g1", 2) is first
    with pytest.raises(ValueError, match="launched for version 2 but generated with version 1"):
        queue.put("t2.g1", 1, rows("t2.g1", 2, 1))   # the dead generator's late result
    queue.put("t2.g1", 2, rows("t2.g1", 2, 2))
    assert queue.in_flight(1) == [] and [e.batch_id for e in queue.in_flight(0)] == ["t2.g0"]
    with pytest.raises(ValueError, match="batch t2.g1 already arrived; it cannot be relaunched"):
        queue.relaunch("t2.g1", 3)
    assert queue.accounting()["launched"] == 2   # a relaunch is the same launch


# ------------------------------------------------------------------ interrupt and fatal

def test_an_interrupt_stops_take_until_cleared(queue):
    arrive(queue, "t0.g0", 0, 0)
    queue.interrupt("gen1 died")
    with pytest.raises(Interrupted, match="step 0: gen1 died"):
        queue.take(0, deadline_s=5)
    assert queue.accounting()["buffered"] == 1   # nothing was taken or dropped
    queue.clear_interrupt()
    assert queue.take(0, deadline_s=5)[0] == ["t0.g0"]


def test_an_interrupt_wakes_a_take_waiting_for_a_rollout(queue):
    queue.expect("t0.g0", 0, 0)   # never arrives
    stop = threading.Thread(target=queue.interrupt, args=("trainer died",))
    stop.start()
    try:
        with pytest.raises(Interrupted, match="trainer died"):
            queue.take(0, deadline_s=60)
    finally:
        stop.join()


def test_fatal_stops_every_later_take_and_wins_over_an_interrupt(queue):
    queue.expect("t0.g0", 0, 0)
    stop = threading.Thread(target=queue.fatal, args=("the reward function failed",))
    stop.start()
    try:
        with pytest.raises(RuntimeError, match="the reward function failed") as err:
            queue.take(0, deadline_s=60)
    finally:
        stop.join()
    assert not isinstance(err.value, Interrupted)
    queue.put("t0.g0", 0, rows("t0.g0", 0, 0))
    queue.interrupt("gen0 died")
    with pytest.raises(RuntimeError, match="^the reward function failed$"):
        queue.take(0, deadline_s=5)
    queue.clear_interrupt()
    with pytest.raises(RuntimeError, match="^the reward function failed$"):
        queue.take(0, deadline_s=5)


# ------------------------------------------------------------------ conservation

def test_drop_all_drops_what_is_buffered_and_in_flight(tmp_path, queue):
    arrive(queue, "t3.g0", 3, 2)
    queue.expect("t4.g0", 4, 3)
    queue.drop_all("unused_at_end")
    assert queue.accounting() == {"launched": 2, "trained": 0, "buffered": 0, "in_flight": 0, "dropped": 2,
                                   "dropped_by_reason": {"unused_at_end": 2}, "balanced": True}
    assert sorted(drops(tmp_path)) == [("t3.g0", "unused_at_end"), ("t4.g0", "unused_at_end")]
    assert queue.snapshot()[0] == []


batch_fates = st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["arrive", "fail", "stale", "late"])),
                       min_size=1, max_size=14)


@settings(max_examples=60, deadline=None, database=None)
@given(batch_fates, st.integers(0, 2), st.integers(1, 5))
def test_every_launched_batch_is_trained_or_dropped_exactly_once(fates, max_age, steps):
    """Batches for random targets (some past the run's last step), each arriving,
    failing, arriving too old, or never arriving; the run takes every step and
    drops the rest at the end."""
    with tempfile.TemporaryDirectory() as run_dir:
        log = EventLog(run_dir, "controller", time.time())
        try:
            queue = RolloutQueue(max_age=max_age, log=log)
            expected_trained = {}
            for i, (target, fate) in enumerate(fates):
                batch_id, version = f"t{target}.b{i}", max(target - max_age, 0)
                if fate == "stale":
                    version = target - max_age - 1   # may be negative: a batch from before the run
                queue.expect(batch_id, target, version)
                if fate == "fail":
                    queue.fail(batch_id, "failed: injected")
                elif fate in ("arrive", "stale"):
                    queue.put(batch_id, version, rows(batch_id, target, version, n=1))
                    if fate == "arrive" and target < steps:
                        expected_trained[batch_id] = target
                # "late": still in flight at its step (taken only past the run) or dropped at the end
                assert queue.accounting()["balanced"]
            trained = {}
            for step in range(steps):
                if any(t == step and fate == "late" for t, fate in fates):
                    queue.drop_all("interrupted")   # cannot wait for it: end the run here
                    break
                try:
                    ids, _, table = queue.take(step, deadline_s=5)
                except RuntimeError as exc:
                    assert "no trajectories" in str(exc)
                    continue
                assert table.num_rows == len(ids)
                trained.update({batch_id: step for batch_id in ids})
                assert queue.accounting()["balanced"]
            queue.drop_all("unused_at_end")
            acc = queue.accounting()
            dropped = drops(run_dir)
            assert acc["balanced"] and acc["buffered"] == acc["in_flight"] == 0
            assert acc["launched"] == len(fates) == acc["trained"] + acc["dropped"]
            every = list(trained) + [batch_id for batch_id, _ in dropped]
            assert sorted(every) == sorted(f"t{t}.b{i}" for i, (t, _) in enumerate(fates))   # each exactly once
            assert len(dropped) == acc["dropped"] and len(trained) == acc["trained"]
            if not any(fate == "late" for t, fate in fates if t < steps):
                assert trained == expected_trained
            for batch_id, reason in dropped:
                fate = fates[int(batch_id.split(".b")[1])][1]
                assert fate != "arrive" or reason in ("unused_at_end", "interrupted"), (batch_id, reason)
                assert fate != "fail" or reason == "failed: injected"
        finally:
            log.close()


def test_snapshot_and_restore_give_the_same_buffer(tmp_path, queue):
    queue.expect("t3.g0", 3, 2, launch("t3.g0", 3, 0))
    queue.put("t3.g0", 2, rows("t3.g0", 3, 2))
    queue.expect("t3.g1", 3, 2, launch("t3.g1", 3, 1))
    queue.expect("t2.g0", 2, 1, launch("t2.g0", 2, 0))
    queue.fail("t2.g0", "failed: x")
    entries, counters = queue.snapshot()
    queue.put("t3.g1", 2, rows("t3.g1", 3, 2))   # after the snapshot: not in it
    assert [(e.batch_id, e.target, e.version, e.table is not None, e.launch.generator) for e in entries] == [
        ("t3.g0", 3, 2, True, 0), ("t3.g1", 3, 2, False, 1)]
    assert counters == {"launched": 3, "trained": 0, "dropped": {"failed": 1}}

    log = EventLog(tmp_path, "restored", time.time())
    try:
        restored = RolloutQueue(max_age=1, log=log)
        for e in entries:
            restored.restore(e.batch_id, e.target, e.version, e.table, e.launch)
        assert restored.accounting()["launched"] == 0   # counted in the run that launched them
        restored.restore_counters(json.loads(json.dumps(counters)))
        assert restored.accounting() == {"launched": 3, "trained": 0, "buffered": 1, "in_flight": 1, "dropped": 1,
                                         "dropped_by_reason": {"failed": 1}, "balanced": True}
        assert [e.batch_id for e in restored.in_flight(1)] == ["t3.g1"]
        assert restored.relaunch("t3.g1", 3) == launch("t3.g1", 3, 1)
        restored.put("t3.g1", 3, rows("t3.g1", 3, 3))
        ids, versions, table = restored.take(3, deadline_s=5)
        assert ids == ["t3.g0", "t3.g1"] and versions == [2, 3]
        assert table.slice(0, 2).equals(entries[0].table)
        assert restored.accounting()["trained"] == 2 and restored.accounting()["balanced"]
    finally:
        log.close()
