"""The Controller (pipeline/controller/controller.py) as a plain object in this
process, driven as the step graph drives it: the launch schedule, the prompt
stream, its graph nodes (validation_gate, resume, sample, relaunch), the
rollouts' put and rollout_failed, the reward failure limit, finish, and the
checkpoint round trip. Only `sample` needs Ray (it puts its table in the
object store).

What a resume carries over across whole (simulated) runs: tests/run/test_resume.py."""
from __future__ import annotations

import json
import time

import pyarrow as pa
import pytest

from dags.tokens import Gate, RelaunchPlan, Rollout, StepPlan, TrainOut, ValOut
from pipeline.controller.controller import Controller
from pipeline.core.node import NodeError
from pipeline.core.types import TRAJECTORY_SCHEMA
from pipeline.config import load_config

pytestmark = pytest.mark.sim


def put(controller, batch_id: str, version: int, table, clock=()) -> None:
    """A finished batch as a generator's delivery graph hands it to the controller's put."""
    controller.put(Rollout(table.column("target")[0].as_py(), batch_id, version, table, (), clock))


def trajectories(launch, version: int, reward_errors: int = 0) -> pa.Table:
    """A batch's rollout: one row per prompt; the first `reward_errors` rows' rewards raised."""
    n = len(launch.prompts)
    given = {"batch_id": launch.batch_id, "target": launch.target, "version": version}
    blank = {pa.types.is_string: "", pa.types.is_integer: 0, pa.types.is_floating: 0.0, pa.types.is_list: [],
             pa.types.is_boolean: False, pa.types.is_large_binary: b""}
    cols = {f.name: pa.array([given.get(f.name, next(v for is_, v in blank.items() if is_(f.type)))] * n, f.type)
            for f in TRAJECTORY_SCHEMA}
    cols["prompt_id"] = pa.array([p.id for p in launch.prompts])
    cols["reward_error"] = pa.array([f"ValueError: bad answer {i}" if i < reward_errors else "" for i in range(n)])
    return pa.table(cols, schema=TRAJECTORY_SCHEMA)


def vals(step: int, version: int, generators: int = 2, **scores) -> list[ValOut]:
    """Every generator's validate token; `scores` (per generator) marks them validated."""
    return [ValOut(f"gen{g}", step, version, bool(scores), tuple(scores.get(f"gen{g}", {}).items()))
            for g in range(generators)]


def events(run_dir, kind: str) -> list[dict]:
    """The controller's events of one kind, from its log in `run_dir`."""
    lines = (run_dir / "events" / "controller.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["ev"] == kind]


@pytest.fixture
def start(tmp_path):
    """start(*overrides, start_step=0, restore_dir=None, name="run"): a Controller after begin_run."""
    made = []

    def start(*overrides: str, start_step: int = 0, restore_dir=None, name: str = "run") -> Controller:
        cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.steps=20", "schedule.max_age=1",
                                 "schedule.prompts_per_step=8", "generation.num_generators=2", *overrides])
        controller = Controller()
        made.append(controller)
        clock = controller.begin_run(cfg, str(tmp_path / name), time.time(), start_step,
                                     None if restore_dir is None else str(restore_dir))
        logged = (tmp_path / name / "events" / "controller.jsonl").read_text().splitlines()
        assert clock == (("controller", len(logged)),)   # after its own events: worker_start, restores
        return controller
    try:
        yield start
    finally:
        for controller in made:
            controller.log.close()


def ids(launches) -> list[str]:
    return [launch.batch_id for launch in launches]


def prompt_ids(launches) -> list[str]:
    return [p.id for launch in launches for p in launch.prompts]


# ------------------------------------------------------------------ launch schedule

def test_the_prologue_fills_max_age_plus_one_targets_split_across_generators(start):
    c = start("schedule.max_age=2", "generation.num_generators=3")
    out = c.resume(*vals(-1, 0, generators=3))
    assert (out.step, out.version, out.val_scores) == (-1, 0, ())
    assert ids(out.launches) == [f"t{t}.g{g}" for t in range(3) for g in range(3)]
    assert [(l.target, l.generator, len(l.prompts)) for l in out.launches[:3]] == [(0, 0, 3), (0, 1, 3), (0, 2, 2)]
    # Target t gets the t-th 8 prompts of the shuffled order, dealt round-robin to the generators.
    for t in range(3):
        drawn = [c.prompts[i] for i in c.order[8 * t:8 * t + 8]]
        assert [l.prompts for l in out.launches[3 * t:3 * t + 3]] == [tuple(drawn[g::3]) for g in range(3)]
    entries, counters = c.queue.snapshot()
    assert [(e.batch_id, e.version, e.table) for e in entries] == [(l.batch_id, 0, None) for l in out.launches]
    assert [e.launch for e in entries] == list(out.launches)
    assert counters["launched"] == 9 and c.queue.accounting()["in_flight"] == 9


def test_each_step_tops_up_one_target_and_nothing_past_the_last_step(start):
    c = start("run.steps=5")
    assert ids(c.resume(*vals(-1, 0)).launches) == ["t0.g0", "t0.g1", "t1.g0", "t1.g1"]
    tops = [ids(c.resume(*vals(step, step + 1)).launches) for step in range(5)]
    assert tops == [["t2.g0", "t2.g1"], ["t3.g0", "t3.g1"], ["t4.g0", "t4.g1"], [], []]
    assert [(e.batch_id, e.version) for e in c.queue.snapshot()[0] if e.target >= 2] == [
        ("t2.g0", 1), ("t2.g1", 1), ("t3.g0", 2), ("t3.g1", 2), ("t4.g0", 3), ("t4.g1", 3)]
    assert c.cursor == 5 * 8   # no prompts drawn for targets that are never launched


def test_a_run_that_starts_later_fills_from_its_start_step_and_skips_empty_shards(start):
    c = start("run.steps=4", "schedule.max_age=3", "schedule.prompts_per_step=2", "generation.num_generators=3",
              start_step=2)
    assert ids(c.resume(*vals(1, 2, generators=3)).launches) == ["t2.g0", "t2.g1", "t3.g0", "t3.g1"]
    assert c.validation_gate(StepPlan(1, False)).version == 2   # the prologue's weights are the start step's


# ------------------------------------------------------------------ prompt stream

def epochs_drawn(start, name: str, seed: int, epochs: int = 2) -> list[list[str]]:
    """Prompt ids in launch order over whole passes through the 64 simulated prompts."""
    c = start(f"run.seed={seed}", "run.steps=100", "schedule.max_age=0", "generation.num_generators=1", name=name)
    drawn = prompt_ids(c.resume(*vals(-1, 0, generators=1)).launches)
    for step in range(8 * epochs - 1):
        drawn += prompt_ids(c.resume(*vals(step, step + 1, generators=1)).launches)
    return [drawn[64 * k:64 * k + 64] for k in range(epochs)]


def test_prompt_order_is_a_seeded_shuffle_drawn_afresh_every_epoch(start):
    first, second = epochs_drawn(start, "a", seed=0)
    everything = sorted(f"train{i}" for i in range(64))
    assert sorted(first) == sorted(second) == everything        # every prompt once per epoch
    assert first != sorted(first, key=lambda p: int(p[5:]))     # shuffled, not in file order
    assert first != second                                      # and shuffled again each epoch
    assert epochs_drawn(start, "b", seed=0) == [first, second]       # the seed fixes the stream
    assert epochs_drawn(start, "c", seed=1)[0] != first


# ------------------------------------------------------------------ graph nodes

def test_validation_gate_passes_the_trained_version_and_the_plans_choice(start, tmp_path):
    c = start(start_step=3)
    gate = c.validation_gate(StepPlan(5, ("gsm", "math"), clock=(("driver", 4),)), TrainOut(5, 6))
    assert (gate.step, gate.version, gate.validate) == (5, 6, ("gsm", "math")) and isinstance(gate, Gate)
    assert dict(gate.clock)["driver"] == 4 and dict(gate.clock)["controller/validation_gate"] == 2
    prologue = c.validation_gate(StepPlan(2, ()))
    assert (prologue.step, prologue.version, prologue.validate) == (2, 3, ())
    assert [(e["step"], e["lane"]) for e in events(tmp_path / "run", "node_end")] == [
        (5, "controller/validation_gate"), (2, "controller/validation_gate")]


def test_resume_refuses_generators_that_disagree_on_the_version(start, tmp_path):
    c = start()
    with pytest.raises(NodeError, match=r"node 'resume' on worker 'controller' failed at step 3: RuntimeError: "
                                        r"generators disagree on the weight version: \[3, 4\]"):
        c.resume(ValOut("gen0", 3, 4, False), ValOut("gen1", 3, 3, False))
    assert c.queue.accounting()["launched"] == 0 and c.cursor == 0   # nothing launched
    assert [e["node"] for e in events(tmp_path / "run", "node_error")] == ["resume"]


def implicit(reward_sum: float, count: float) -> dict:
    """A generator's sums of the implicit validation set (pipeline/evaluation/scores.py)."""
    return {"\t\tprompts": count, "\t\tfailed": 0.0, "\t\tscored": count, "\t\tmean@1": reward_sum}


def test_resume_averages_the_validation_scores_over_every_sample(start):
    c = start("generation.num_generators=3")
    scored = vals(-1, 0, generators=3, gen0=implicit(3.0, 4.0), gen1=implicit(0.0, 2.0), gen2=implicit(1.5, 6.0))
    assert c.resume(*scored).val_scores == (("val_reward", 4.5 / 12), ("val_count", 12.0))
    # Generators that did not validate this step add nothing, whatever their token holds.
    skipped = [ValOut("gen0", 0, 1, True, tuple(implicit(2.0, 2.0).items())),
               ValOut("gen1", 0, 1, False, tuple(implicit(100.0, 1.0).items())), ValOut("gen2", 0, 1, False)]
    assert c.resume(*skipped).val_scores == (("val_reward", 1.0), ("val_count", 2.0))
    assert c.resume(*vals(1, 2, generators=3)).val_scores == ()


def test_resume_adds_up_each_sets_shards(start):
    """Two generators' shards of one named set give the whole set's pass@k: sums travel, not means."""
    from pipeline.config.sections import ValSetConfig
    from pipeline.evaluation.scores import add_sums, prompt_sums
    c = start()
    spec = ValSetConfig(name="math", n=2, temperature=1.0, k=(1, 2))
    p0, p1, p2 = (prompt_sums(spec, "", rewards, [False, False], ["", ""]) for rewards in ([1, 0], [0, 0], [1, 1]))
    out = dict(c.resume(*vals(-1, 0, gen0=add_sums([p0, p2]), gen1=p1)).val_scores)
    assert out["val/math/pass@1"] == pytest.approx(0.5) and out["val/math/pass@2"] == pytest.approx(2 / 3)
    assert out["val/math/mean@2"] == pytest.approx(0.5) and out["val/math/count"] == 3


def test_sample_hands_the_step_its_batches_through_the_object_store(start, ray_session):
    c = start()
    launches = c.resume(*vals(-1, 0)).launches
    for launch in launches:
        put(c, launch.batch_id, 0, trajectories(launch, 0), clock=((f"gen{launch.generator}/rollouts", 3),))
    batch = c.sample(StepPlan(0, False))
    assert (batch.step, batch.batch_ids, batch.versions) == (0, ("t0.g0", "t0.g1"), (0, 0))
    table = batch.table_ref.fetch(60)
    assert table.column("prompt_id").to_pylist() == prompt_ids(launches[:2])
    # After both rollouts it waited for: their clocks are in the token it hands on.
    assert dict(batch.clock)["gen0/rollouts"] == dict(batch.clock)["gen1/rollouts"] == 3
    assert c.queue.accounting()["trained"] == 2


def test_a_failed_rollout_is_dropped_and_a_step_without_batches_names_it(start):
    c = start("generation.num_generators=1")
    c.resume(*vals(-1, 0, generators=1))
    c.rollout_failed("t0.g0", "failed: SimFault: injected", clock=(("gen0/rollouts", 2),))
    with pytest.raises(NodeError, match=r"node 'sample' .* failed at step 0: RuntimeError: step 0: no trajectories "
                                        r"to train on: .*the first: batch t0.g0 failed: SimFault: injected$"):
        c.sample(StepPlan(0, False))
    acc = c.finish()
    assert acc["dropped_by_reason"] == {"failed": 1, "unused_at_end": 1} and acc["balanced"]


def test_the_run_stops_at_the_first_reward_failure_past_the_limit(start):
    c = start("fault.max_reward_failures=2", "generation.num_generators=1")
    (t0, t1) = c.resume(*vals(-1, 0, generators=1)).launches
    put(c, t0.batch_id, 0, trajectories(t0, 0, reward_errors=2))   # 2: at the limit, not past it
    assert c.queue.take(0, deadline_s=5)[0] == ["t0.g0"]
    put(c, t1.batch_id, 0, trajectories(t1, 0, reward_errors=1))
    assert c.queue.accounting()["buffered"] == 1   # the batch is kept; the run stops at the next sample
    with pytest.raises(NodeError, match=r"node 'sample' .* failed at step 1: RuntimeError: the reward "
                                        r"failed on 3 samples, more than fault.max_reward_failures \(2\); "
                                        r"the last: ValueError: bad answer 0$"):
        c.sample(StepPlan(1, False))
    assert c.finish()["reward_failures"] == 3


def test_relaunch_gives_the_dead_generators_unfinished_batches_to_its_replacement(start, tmp_path):
    c = start("generation.num_generators=3", "schedule.prompts_per_step=6")
    launches = c.resume(*vals(-1, 0, generators=3)).launches
    put(c, "t0.g1", 0, trajectories(launches[1], 0))   # arrived: stays
    out = c.relaunch(RelaunchPlan(generator=1, version=0, dead_worker="gen1"))
    assert ids(out.launches) == ["t1.g1"] and out.launches[0] == launches[4]   # same id, same prompts
    assert out.version == 0
    (event,) = events(tmp_path / "run", "relaunch")
    assert (event["batch"], event["of"], event["reason"], event["target"]) == ("t1.g1", "gen1", "gen1 died", 1)
    assert c.queue.accounting()["launched"] == 6   # still one launch each


def test_an_interrupt_stops_sample_until_it_is_cleared(start, ray_session):
    c = start("generation.num_generators=1")
    (t0, _) = c.resume(*vals(-1, 0, generators=1)).launches
    put(c, t0.batch_id, 0, trajectories(t0, 0))
    c.interrupt("gen0 died")
    with pytest.raises(NodeError, match=r"failed at step 0: Interrupted: step 0: gen0 died"):
        c.sample(StepPlan(0, False))
    c.clear_interrupt()
    assert c.sample(StepPlan(0, False)).batch_ids == ("t0.g0",)


def test_finish_drops_what_is_left_after_the_drivers_clock(start, tmp_path):
    c = start()
    launches = c.resume(*vals(-1, 0)).launches
    put(c, "t0.g0", 0, trajectories(launches[0], 0, reward_errors=0))
    acc = c.finish(after=(("driver", 41),))
    assert acc == {"launched": 4, "trained": 0, "buffered": 0, "in_flight": 0, "dropped": 4,
                   "dropped_by_reason": {"unused_at_end": 4}, "balanced": True, "reward_failures": 0}
    assert all(e["vc"]["driver"] == 41 for e in events(tmp_path / "run", "drop"))


# ------------------------------------------------------------------ checkpoint round trip

def run_to_checkpoint(start, tmp_path, **last):
    """Steps 0 and 1 of a run (max_age 1, two generators), then save_state. At the
    checkpoint t1.g1 has failed, t2.g0 has arrived, t2.g1 and t3.* are in flight
    (unless `last` says how t3's batches ended: "arrived" or "failed")."""
    c = start("fault.max_reward_failures=5", "schedule.prompts_per_step=4")
    sent = {l.batch_id: l for l in c.resume(*vals(-1, 0)).launches}
    for batch_id in ("t0.g0", "t0.g1", "t1.g0"):
        put(c, batch_id, 0, trajectories(sent[batch_id], 0, reward_errors=int(batch_id == "t1.g0")))
    c.rollout_failed("t1.g1", "failed: engine died")
    for step in range(2):
        c.queue.take(step, deadline_s=5)
        sent.update({l.batch_id: l for l in c.resume(*vals(step, step + 1)).launches})
    put(c, "t2.g0", 1, trajectories(sent["t2.g0"], 1))
    for batch_id, how in last.items():
        if how == "arrived":   # at the version it was launched with: its target's - max_age
            put(c, batch_id, sent[batch_id].target - 1, trajectories(sent[batch_id], sent[batch_id].target - 1))
        else:
            c.rollout_failed(batch_id, "failed: engine died")
    c.save_state(str(tmp_path / "ckpt"))
    return c, sent


def test_save_state_then_begin_run_restores_the_controller(start, tmp_path):
    run, sent = run_to_checkpoint(start, tmp_path)
    resumed = start("fault.max_reward_failures=5", "schedule.prompts_per_step=4", start_step=2,
                    restore_dir=tmp_path / "ckpt", name="resumed")
    assert (resumed.order, resumed.cursor) == (run.order, run.cursor) and run.cursor == 4 * 4
    assert resumed.rng.getstate() == run.rng.getstate()
    assert resumed.reward_failures == run.reward_failures == 1
    assert resumed.queue.accounting() == run.queue.accounting() == {
        "launched": 8, "trained": 3, "buffered": 1, "in_flight": 3, "dropped": 1,
        "dropped_by_reason": {"failed": 1}, "balanced": True}
    assert [e["batch"] for e in events(tmp_path / "resumed", "restore")] == ["t2.g0"]

    # Its prologue relaunches what had not arrived, as launched, at the weights it resumes with;
    # every target up to start + max_age is held, so it launches nothing new.
    prologue = resumed.resume(*vals(1, 2))
    assert list(prologue.launches) == [sent[b] for b in ("t2.g1", "t3.g0", "t3.g1")]
    assert [(e["batch"], e["version"], e["reason"]) for e in events(tmp_path / "resumed", "relaunch")] == [
        (b, 2, "resumed from a checkpoint") for b in ("t2.g1", "t3.g0", "t3.g1")]
    with pytest.raises(ValueError, match="launched for version 2 but generated with version 1"):
        put(resumed, "t2.g1", 1, trajectories(sent["t2.g1"], 1))
    put(resumed, "t2.g1", 2, trajectories(sent["t2.g1"], 2))
    ids_, versions, table = resumed.queue.take(2, deadline_s=5)
    assert (ids_, versions) == (["t2.g0", "t2.g1"], [1, 2])
    assert table.slice(0, 2).equals(trajectories(sent["t2.g0"], 1))   # the buffered table, as it arrived
    # From here the resumed run draws what the interrupted one would have.
    ours, theirs = resumed.resume(*vals(2, 3)).launches, run.resume(*vals(2, 3)).launches
    assert ids(ours) == ["t4.g0", "t4.g1"] and ours == theirs


def test_a_checkpoint_whose_batches_had_all_arrived_relaunches_nothing(start, tmp_path):
    run, _ = run_to_checkpoint(start, tmp_path, **{"t2.g1": "arrived", "t3.g0": "arrived", "t3.g1": "arrived"})
    resumed = start("fault.max_reward_failures=5", "schedule.prompts_per_step=4", start_step=2,
                    restore_dir=tmp_path / "ckpt", name="resumed")
    assert resumed.resume(*vals(1, 2)).launches == ()
    restored = sorted(e["batch"] for e in events(tmp_path / "resumed", "restore"))
    assert restored == ["t2.g0", "t2.g1", "t3.g0", "t3.g1"]
    assert resumed.queue.accounting() == run.queue.accounting()


def test_a_resume_does_not_launch_again_a_target_whose_batches_all_failed(start, tmp_path):
    run, _ = run_to_checkpoint(start, tmp_path, **{"t3.g0": "failed", "t3.g1": "failed"})
    resumed = start("fault.max_reward_failures=5", "schedule.prompts_per_step=4", start_step=2,
                    restore_dir=tmp_path / "ckpt", name="resumed")
    prologue = resumed.resume(*vals(1, 2))
    assert ids(prologue.launches) == ["t2.g1"]   # t3 was launched once already, before the checkpoint
    assert resumed.cursor == run.cursor


# ------------------------------------------------------------------ dynamic sampling

def put_grouped(c: Controller, launch, rewards: list[float], version: int = 0) -> None:
    """A batch of groups of two: rewards[2k], rewards[2k + 1] for prompt k."""
    table = trajectories(launch, version)
    table = table.take(pa.array([i // 2 for i in range(2 * table.num_rows)]))
    put(c, launch.batch_id, version, table.set_column(table.schema.get_field_index("reward"), "reward",
                                                     pa.array(rewards, pa.float32())))


def test_dynamic_sampling_tops_up_a_short_step_and_trains_its_informative_groups(start, tmp_path, ray_session):
    c = start("schedule.group_size=2", "schedule.prompts_per_step=4", "schedule.max_age=0",
              "dynamic_sampling.max_rounds=2")
    own = c.resume(*vals(-1, 0)).launches
    put_grouped(c, own[0], [1.0, 0.0, 1.0, 1.0])   # informative, flat
    put_grouped(c, own[1], [0.0, 0.0, 1.0, 1.0])   # flat, flat
    extra = c.top_up(StepPlan(0, False), 1)
    # 3 groups missing and 1 of 4 informative so far: 12 prompts would do; at most prompts_per_step.
    assert ids(extra.launches) == ["t0.r1.g0", "t0.r1.g1"] and {l.round for l in extra.launches} == {1}
    assert (extra.step, extra.version, sum(len(l.prompts) for l in extra.launches)) == (0, 0, 4)
    put_grouped(c, extra.launches[0], [0.0, 1.0, 0.5, 0.5])
    put_grouped(c, extra.launches[1], [1.0, 0.0, 0.0, 1.0])
    assert c.top_up(StepPlan(0, False), 2).launches == ()   # 4 informative groups: the step is full
    batch = c.sample(StepPlan(0, False))
    assert batch.batch_ids == ("t0.g0", "t0.g1", "t0.r1.g0", "t0.r1.g1") and batch.versions == (0, 0, 0, 0)
    assert batch.table_ref.fetch(60).column("reward").to_pylist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    # The reward metrics are of all 16 rollouts, the left-out ones among them: 8 scored 1, 2 scored 0.5.
    assert dict(batch.metrics) | {"reward_std": 0} == {
        "flat_groups_dropped": 4.0, "surplus_groups_dropped": 0.0, "informative_groups": 4.0, "extra_prompts": 4.0,
        "reward_mean": 0.5625, "reward_std": 0}
    assert [(e["batch"], e["groups"], e["reason"]) for e in events(tmp_path / "run", "group_drop")] == [
        ("t0.g0", [1], "flat"), ("t0.g1", [0, 1], "flat"), ("t0.r1.g0", [1], "flat")]
    assert c.queue.accounting()["trained"] == 4


def test_a_step_with_no_informative_group_trains_on_none_and_says_so(start, tmp_path, ray_session):
    c = start("schedule.group_size=2", "schedule.prompts_per_step=2", "generation.num_generators=1",
              "dynamic_sampling.max_rounds=1", "dynamic_sampling.max_prompts=1")
    own = c.resume(*vals(-1, 0, generators=1)).launches
    put_grouped(c, own[0], [1.0, 1.0, 0.0, 0.0])
    extra = c.top_up(StepPlan(0, False), 1).launches
    assert [len(l.prompts) for l in extra] == [1]   # dynamic_sampling.max_prompts
    put_grouped(c, extra[0], [1.0, 1.0])
    batch = c.sample(StepPlan(0, False))
    assert batch.table_ref.fetch(60).num_rows == 0
    assert dict(batch.metrics)["informative_groups"] == 0.0 and dict(batch.metrics)["flat_groups_dropped"] == 3.0
