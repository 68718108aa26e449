"""Resume from the latest checkpoint: after a trainer death in the test's own
process, and the controller's checkpoint round trip on the plain class. A
resumed run must be the uninterrupted run: the same batches, prompts, data
position and weights. (A SIGKILLed driver, resumed: tests/run/test_faults_real.py,
on the real stack.)"""
from __future__ import annotations

import json
import time

import pytest
import ray
from tests.controller.test_controller import trajectories

from dags.tokens import Relaunch, Resume, Rollout, TopUp, ValOut
from pipeline.controller.controller import Controller
from pipeline.trainer.worker import TrainerWorker
from pipeline.config import load_config
from pipeline.run import checkpoint
from pipeline.run.driver import train
from pipeline.run.resume_check import run_config
from tests.support.pooled_run import train_on
from pipeline.run.runner import GraphRunner, PipelineError
from pipeline.core.events import load_events
from pipeline.tools.check import check_events

pytestmark = pytest.mark.sim


def test_resume_refuses_what_it_cannot_use(tmp_path, capsys):
    from pipeline.__main__ import main

    def resume(run_dir, *overrides) -> str:
        assert main(["train", "--config", "examples/sim_grpo.yaml", "--resume", str(run_dir), *overrides]) == 1
        return capsys.readouterr().err

    assert "no such run directory" in resume(tmp_path / "nope")
    run_dir = tmp_path / "r"
    # Half-written: never picked, even with a plausible meta.json inside.
    (run_dir / "checkpoints" / "step_4.partial").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_4.partial" / "meta.json").write_text("{}")
    assert "no complete checkpoint" in resume(run_dir)
    bad = run_dir / "checkpoints" / "step_2"
    bad.mkdir()
    (bad / "meta.json").write_text("{not json")
    assert f"checkpoint {bad / 'meta.json'} is unreadable" in resume(run_dir)
    cfg = {"algorithm": "grpo", "backend": "sim", "schedule": {"max_age": 1, "prompts_per_step": 8, "group_size": 4},
           "generation": {"num_generators": 2}}
    (bad / "meta.json").write_text(json.dumps({"steps_done": 2, "config": cfg}))
    assert "is incomplete: missing controller/controller.json, trainer_state, policy" in resume(run_dir)
    for part in ("controller", "trainer_state", "policy"):
        (bad / part).mkdir()
    (bad / "controller" / "controller.json").write_text("[")
    assert "controller/controller.json is unreadable" in resume(run_dir)
    (bad / "controller" / "controller.json").write_text("{}")
    assert "schedule.max_age was 1 in the run, the config says 3" in resume(run_dir, "schedule.max_age=3")
    assert not (run_dir / "attempts").exists()  # nothing was moved for a resume that did not start


# ------------------------------------------------- what a resume restores, in the process
#
# The tests above compare batch ids, which the step number fixes. These compare
# what a resume must carry over to be the same run: the prompts each batch was
# launched with, the controller's data position (shuffled order, cursor, RNG),
# and the trainer's weights. The simulated trainer's weights are its update
# count; that the real stack's checkpointed policy and trainer state load to
# equal weights is tests/run/test_faults_real.py's last check.

STEPS, EVERY, KILLED_AT, RESUMED_AT = 10, 2, 5, 4
# 8 prompts a step from the simulator's 64: the data order is reshuffled after
# step 7, so the resumed half of the run also depends on the restored RNG.
RUN = [f"run.steps={STEPS}", f"run.checkpoint_every={EVERY}", "run.dag_mode=classic", "run.deadline_s=30",
       "run.deadline_s=20", "schedule.max_age=1", "schedule.prompts_per_step=8", "generation.num_generators=2",
       "sim.generate_s=0.3", "sim.train_s=0.01", "sim.refit_s=0", "metrics.tensorboard=false"]


def in_process_config(tmp_path, name: str, *overrides: str):
    return load_config(None, [f"run.output_dir={tmp_path}", f"run.name={name}", *RUN, *overrides])


class LaunchLog:
    """Every launch the driver's graph executions returned (the Resume, TopUp and
    Relaunch tokens that the collect nodes started), recorded in the driver process."""

    def __init__(self, monkeypatch):
        self.launches = []
        original = GraphRunner.run

        def run(runner, plan, deadline_s, run_dir):
            out = original(runner, plan, deadline_s, run_dir)
            self.launches += [launch for token in out.values() if isinstance(token, (Resume, TopUp, Relaunch))
                              for launch in token.launches]
            return out
        monkeypatch.setattr(GraphRunner, "run", run)

    def take(self) -> list:
        out, self.launches = self.launches, []
        return out


def prompts_by_batch(*attempts) -> dict[str, tuple[str, ...]]:
    """batch id -> prompt ids; a batch launched again (relaunch) must carry the same prompts."""
    out: dict[str, tuple[str, ...]] = {}
    for launch in (launch for attempt in attempts for launch in attempt):
        ids = tuple(p.id for p in launch.prompts)
        assert out.setdefault(launch.batch_id, ids) == ids, f"{launch.batch_id} relaunched with other prompts"
    return out


def data_position(ckpt) -> dict:
    state = json.loads((ckpt / "controller" / "controller.json").read_text())
    return {k: state[k] for k in ("order", "cursor", "rng", "counters", "reward_failures")}


def losses(run_dir) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m["loss"] for m in lines if m["step"] >= 0}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, sim_pool):
    """The reference: the same run (same seed) without a kill."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    with pytest.MonkeyPatch.context() as mp:
        recorder = LaunchLog(mp)
        summary = train_on(in_process_config(tmp_path, "ref"), sim_pool, quiet=True)
    assert summary["error"] is None and summary["steps"] == STEPS
    launches = prompts_by_batch(recorder.take())
    assert sorted(launches) == sorted(f"t{s}.g{g}" for s in range(STEPS) for g in range(2))
    return tmp_path / "ref", launches


def kill_and_resume(tmp_path, monkeypatch, pool) -> tuple:
    """Attempt 1 dies at step KILLED_AT (its trainer's process exits); attempt 2
    resumes from the latest checkpoint on `pool` with the run's own config, as
    `--resume runs/X` alone does. Returns the run dir and each attempt's launches."""
    recorder = LaunchLog(monkeypatch)
    # Which words depend on whether the ping that follows the failed train call has
    # answered yet; either way it is the trainer's death (tests/run/test_faults.py checks the wording).
    with pytest.raises(PipelineError, match=r"worker trainer died|node train: its worker died"):
        train(in_process_config(tmp_path, "k", "inject.fault=train_exit", f"inject.after={KILLED_AT}"), quiet=True)
    first = recorder.take()
    run_dir = tmp_path / "k"
    assert checkpoint.latest(run_dir).name == f"step_{RESUMED_AT}"
    summary = train_on(run_config(run_dir, []), pool, quiet=True, restore_from=str(run_dir))
    assert summary["error"] is None and summary["start_step"] == RESUMED_AT and summary["steps"] == STEPS
    assert summary["resume_changes"] == []
    violations = check_events(load_events(run_dir))
    assert violations == [], "\n".join(v.message for v in violations)
    return run_dir, first, recorder.take()


def test_resumed_run_is_the_uninterrupted_run(tmp_path, monkeypatch, sim_pool, uninterrupted):
    ref_dir, ref_prompts = uninterrupted
    run_dir, first, second = kill_and_resume(tmp_path, monkeypatch, sim_pool)

    # (a) Every batch id was launched with the prompts the uninterrupted run gave it,
    # those relaunched after the resume included.
    assert prompts_by_batch(first, second) == ref_prompts
    relaunched = {e["batch"] for e in load_events(run_dir) if e["ev"] == "relaunch"}
    assert relaunched, "no batch was in flight at the checkpoint: the relaunch path went untested"
    assert relaunched <= {l.batch_id for l in first}

    # (b) The data position after the resume follows the uninterrupted run's exactly:
    # every later checkpoint holds the same shuffled order, cursor, RNG and counters.
    for k in range(EVERY, STEPS + 1, EVERY):
        ckpt = f"checkpoints/step_{k}"
        assert data_position(run_dir / ckpt) == data_position(ref_dir / ckpt), ckpt

    # (c) The trainer resumed with the checkpoint's weights: its loss (1 / updates on the
    # simulator) continues the uninterrupted run's, and each generator loaded version 4.
    assert {s: v for s, v in losses(run_dir).items() if s >= RESUMED_AT} == \
           {s: v for s, v in losses(ref_dir).items() if s >= RESUMED_AT}
    loads = [e for e in load_events(run_dir) if e["ev"] == "refit_end" and e["step"] == RESUMED_AT - 1]
    assert sorted((e["worker"], e["version"]) for e in loads) == [("gen0", RESUMED_AT), ("gen1", RESUMED_AT)]
    # What a trainer resumed from that checkpoint hands the generators (pipeline/run/pool.py:
    # begin_run) is the checkpoint's weights at its version.
    ckpt = run_dir / "checkpoints" / f"step_{RESUMED_AT}"
    trainer = TrainerWorker()
    trainer.begin_run(in_process_config(tmp_path, "probe"), str(tmp_path / "probe"), time.time(),
                      str(ckpt / "trainer_state"), RESUMED_AT)
    version, weights = trainer.current_weights()[:2]
    saved = json.loads((ckpt / "policy" / "sim_weights.json").read_text())
    assert version == RESUMED_AT and weights.fetch(60) == (RESUMED_AT, saved) == (RESUMED_AT, {"sim_updates": 4})

    # (d) Its samples are the uninterrupted run's, each step once: the killed attempt's of the
    # steps run again are dropped, those before the checkpoint kept.
    assert (run_dir / "samples.jsonl").read_text() == (ref_dir / "samples.jsonl").read_text()
    assert (run_dir / "attempts" / "1" / "samples.jsonl").is_file()


def test_resume_when_every_batch_had_arrived_at_the_checkpoint(tmp_path, monkeypatch, sim_pool, uninterrupted):
    """A checkpoint taken once the rollouts in flight had all arrived holds only
    buffered batches: the resume restores them and launches nothing twice."""
    _, ref_prompts = uninterrupted
    save = checkpoint.save

    def save_once_arrived(workers, run_dir, steps_done, cfg, timeout_s, inputs):
        probe = tmp_path / f"probe_{steps_done}"
        end = time.monotonic() + 30
        while True:  # polling the controller's state from the driver; orders nothing in the run
            ray.get(workers.controller.save_state.remote(str(probe)), timeout=timeout_s)
            entries = json.loads((probe / "controller.json").read_text())["entries"]
            if all(e["arrived"] for e in entries) or time.monotonic() > end:
                break
            time.sleep(0.05)
        assert all(e["arrived"] for e in entries), entries
        return save(workers, run_dir, steps_done, cfg, timeout_s, inputs=inputs)

    monkeypatch.setattr(checkpoint, "save", save_once_arrived)
    run_dir, first, second = kill_and_resume(tmp_path, monkeypatch, sim_pool)
    events = load_events(run_dir)
    restored = sorted(e["batch"] for e in events if e["ev"] == "restore")
    assert restored == ["t4.g0", "t4.g1", "t5.g0", "t5.g1"]
    assert not [e for e in events if e["ev"] == "relaunch"]
    assert prompts_by_batch(first, second) == ref_prompts


# --------------------------------------------- the controller's own round trip

class Schedule:
    """A Controller (the plain class) driven as the step graph drives it: the
    prologue's resume, then per step the sample and the resume after training."""

    def __init__(self, tmp_path, name: str, steps: int, start: int = 0, restore_dir=None, max_age: int = 1):
        self.cfg = load_config(None, [f"run.output_dir={tmp_path}", f"run.steps={steps}", f"schedule.max_age={max_age}",
                                      "schedule.prompts_per_step=8", "generation.num_generators=2"])
        self.controller = Controller()
        self.versions: dict[str, int] = {}
        self.controller.begin_run(self.cfg, str(tmp_path / name), time.time(), start,
                                  None if restore_dir is None else str(restore_dir))
        self.launches = self._resume(start - 1, start)

    def _resume(self, step: int, version: int) -> list:
        vals = [ValOut(f"gen{g}", step, version, False) for g in range(2)]
        launches = list(self.controller.resume(*vals).launches)
        self.versions.update({l.batch_id: version for l in launches})
        return launches

    def arrive(self, launches) -> None:
        """Their rollouts end, generated with the version they were (re)launched at."""
        for launch in launches:
            version = self.versions[launch.batch_id]
            self.controller.put(Rollout(launch.target, launch.batch_id, version, trajectories(launch, version)))

    def step(self, step: int) -> list:
        """Train step `step` on what has arrived, then launch as its resume does."""
        self.controller.queue.take(step, deadline_s=5)
        new = self._resume(step, step + 1)
        self.launches += new
        return new


def checkpoint_after_step_4(tmp_path, steps: int, arrived: bool) -> Schedule:
    """Steps 0-4 of a run, then its controller's checkpoint (start step 5). With
    max_age 1 it holds targets 5 and 6 (launched after steps 3 and 4), arrived or
    still in flight, unless run.steps is 5: then it holds nothing."""
    run = Schedule(tmp_path, "run", steps=steps)
    run.arrive(run.launches)
    for s in range(5):
        new = run.step(s)
        if s < 3 or arrived:
            run.arrive(new)
    run.controller.save_state(str(tmp_path / "ckpt"))
    return run


def held(tmp_path) -> dict[str, bool]:
    entries = json.loads((tmp_path / "ckpt" / "controller.json").read_text())["entries"]
    return {e["batch_id"]: e["arrived"] for e in entries}


def test_controller_restores_its_data_position_exactly(tmp_path):
    run = checkpoint_after_step_4(tmp_path, steps=30, arrived=False)
    saved = json.loads((tmp_path / "ckpt" / "controller.json").read_text())
    assert saved["cursor"] == 7 * 8 < len(saved["order"]) == 64   # mid-epoch: the cursor matters

    resumed = Schedule(tmp_path, "resumed", steps=30, start=5, restore_dir=tmp_path / "ckpt")
    c = resumed.controller
    assert c.order == saved["order"] == run.controller.order
    assert c.cursor == saved["cursor"] == run.controller.cursor
    assert c.rng.getstate() == run.controller.rng.getstate()
    assert c.queue.accounting() == run.controller.queue.accounting()
    # The in-flight batches go out again as they were; the draws from here on are
    # the same, across three reshuffles of the 64 prompts.
    assert [(l.batch_id, l.prompts) for l in resumed.launches] == \
           [(l.batch_id, l.prompts) for l in run.launches if l.target in (5, 6)]
    run.arrive([l for l in run.launches if l.target in (5, 6)])
    resumed.arrive(resumed.launches)
    for s in range(5, 25):
        ours, theirs = run.step(s), resumed.step(s)
        assert [(l.batch_id, l.prompts) for l in ours] == [(l.batch_id, l.prompts) for l in theirs], s
        run.arrive(ours)
        resumed.arrive(theirs)
    assert resumed.controller.cursor == run.controller.cursor and resumed.controller.order == run.controller.order


@pytest.mark.parametrize("case,held_at_checkpoint,prologue", [
    ("in_flight", {"t5.g0": False, "t5.g1": False, "t6.g0": False, "t6.g1": False},
     ["t5.g0", "t5.g1", "t6.g0", "t6.g1"]),
    ("arrived", {"t5.g0": True, "t5.g1": True, "t6.g0": True, "t6.g1": True}, []),
    ("final", {}, ["t5.g0", "t5.g1", "t6.g0", "t6.g1"]),
])
def test_resume_prologue_launches_only_what_the_checkpoint_lacks(tmp_path, case, held_at_checkpoint, prologue):
    """in_flight: the checkpoint's unfinished batches are relaunched; arrived: they
    are restored and nothing is launched; final (a finished 5-step run resumed with
    run.steps raised): the checkpoint holds nothing, so the prologue fills the
    pipeline from the saved data position. Either way each batch id goes out with
    the prompts of the uninterrupted 12-step run."""
    ref = Schedule(tmp_path, "ref", steps=12)
    ref.arrive(ref.launches)
    for s in range(12):
        ref.arrive(ref.step(s))

    run = checkpoint_after_step_4(tmp_path, steps=5 if case == "final" else 12, arrived=case == "arrived")
    assert held(tmp_path) == held_at_checkpoint
    resumed = Schedule(tmp_path, "resumed", steps=12, start=5, restore_dir=tmp_path / "ckpt")
    assert [l.batch_id for l in resumed.launches] == prologue
    resumed.arrive(resumed.launches)
    for s in range(5, 12):
        resumed.arrive(resumed.step(s))
    assert prompts_by_batch(run.launches, resumed.launches) == prompts_by_batch(ref.launches)
    acc = resumed.controller.finish()
    assert acc["balanced"] and acc["launched"] == acc["trained"] == 24
