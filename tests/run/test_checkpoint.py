"""Checkpoints (pipeline/run/checkpoint.py): save with simulated workers, the
choice of the latest complete one, the checks before a resume, and the old
attempt's logs moved aside.

tests/run/test_resume.py drives the same functions end to end through `--resume`
(a half-written checkpoint, unreadable files, a changed max_age); this file
checks each function's own contract."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import ray
from ray import cloudpickle

from dags.step_graph import Workers
from dags.tokens import ValOut
from pipeline.controller.controller import Controller
from pipeline.core.node import rank_actor
from pipeline.trainer.worker import TrainerWorker
from pipeline.config import load_config
from pipeline.run import checkpoint
from pipeline.run.checkpoint import CheckpointError, archive_attempt, latest, read_meta
from pipeline.run.resume_check import CHECKPOINT_SHAPE, Change, ResumeError
from pipeline.run.runner import PipelineError

pytestmark = pytest.mark.unit

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # Critic below: Ray's workers cannot import it


class Critic:
    """A critic that only saves: writes a marker, or fails as a full disk would."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def save_state(self, path: str) -> None:
        if self.fail:
            raise OSError("No space left on device")
        Path(path).mkdir(parents=True)
        (Path(path) / "critic.json").write_text("{}")


class PoisonedTrainer:
    """A trainer whose weights hold a NaN: its save is refused by the check the DeepSpeed engines run."""

    def save(self, path: str) -> None:
        import torch

        from pipeline.trainer.finite import refuse_nonfinite_weights
        layer = torch.nn.Linear(2, 2)
        with torch.no_grad():
            layer.weight[0, 0] = float("nan")
        refuse_nonfinite_weights(layer, 1, "cpu", f"the policy checkpoint {path}")
        Path(path).mkdir(parents=True)

    def save_state(self, path: str) -> None:
        Path(path).mkdir(parents=True)


def config(tmp_path, *overrides: str):
    return load_config(None, [f"run.output_dir={tmp_path}", "run.name=run", "run.steps=10", *overrides])


@pytest.fixture(scope="module")
def actors(ray_session):
    """A simulated controller and trainer, a critic and a critic that cannot save: one process each."""
    made = {"controller": ray.remote(Controller).options(num_cpus=0).remote(),
            "trainer": rank_actor(TrainerWorker, num_cpus=0).remote(),
            "critic": ray.remote(Critic).options(num_cpus=0).remote(),
            "broken": ray.remote(Critic).options(num_cpus=0).remote(fail=True),
            "poisoned": ray.remote(PoisonedTrainer).options(num_cpus=0).remote()}
    try:
        yield made
    finally:
        for actor in made.values():
            ray.kill(actor)


def begin(actors, cfg, run_dir) -> None:
    """Both workers set up for a run; the controller has launched its prologue."""
    t0 = time.time()
    ray.get([actors["controller"].begin_run.remote(cfg, str(run_dir), t0),
             actors["trainer"].begin_run.remote(cfg, str(run_dir), t0)], timeout=60)
    ray.get(actors["controller"].resume.remote(*[ValOut(f"gen{g}", -1, 0, False) for g in range(2)]), timeout=60)


@pytest.mark.sim
def test_save_writes_every_part_then_renames_it_into_place(actors, tmp_path):
    cfg = config(tmp_path, "generation.num_generators=2")
    run_dir = tmp_path / "run"
    begin(actors, cfg, run_dir)
    workers = Workers(actors["controller"], (actors["trainer"],), ())
    (run_dir / "checkpoints" / "step_3.partial").mkdir(parents=True)   # a save killed halfway, earlier
    (run_dir / "checkpoints" / "step_3.partial" / "junk").write_text("x")

    inputs = {"data.train": {"path": "/data/train.jsonl", "sha256": "ab" * 32}}
    path = checkpoint.save(workers, run_dir, 3, cfg, timeout_s=60, inputs=inputs)
    assert path == run_dir / "checkpoints" / "step_3"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_3"]
    assert sorted(p.name for p in path.iterdir()) == ["controller", "meta.json", "policy", "trainer_state"]
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["steps_done"], meta["version"], meta["config"], meta["inputs"]) == (3, 3, cfg.to_dict(), inputs)
    state = json.loads((path / "controller" / "controller.json").read_text())
    assert [e["batch_id"] for e in state["entries"]] == ["t0.g0", "t0.g1", "t1.g0", "t1.g1"]
    assert json.loads((path / "policy" / "sim_weights.json").read_text()) == {"sim_updates": 0}
    assert latest(run_dir) == path and read_meta(path, cfg).steps_done == 3

    # A resumed run passes the step again: the new checkpoint replaces the old one whole.
    (path / "stale_file").write_text("from the killed attempt")
    resumed_cfg = config(tmp_path, "generation.num_generators=2", "run.steps=12")
    again = checkpoint.save(workers, run_dir, 3, resumed_cfg, timeout_s=60, inputs={})
    assert again == path and not (path / "stale_file").exists()
    assert json.loads((path / "meta.json").read_text())["config"]["run"]["steps"] == 12


@pytest.mark.sim
def test_ppo_saves_the_critic_and_a_failed_save_leaves_no_checkpoint(actors, tmp_path):
    cfg = config(tmp_path, "algorithm=ppo", "generation.num_generators=2")
    run_dir = tmp_path / "run"
    begin(actors, cfg, run_dir)
    good = Workers(actors["controller"], (actors["trainer"],), (), (actors["critic"],))
    first = checkpoint.save(good, run_dir, 2, cfg, timeout_s=60, inputs={})
    assert (first / "critic_state" / "critic.json").is_file() and read_meta(first, cfg).steps_done == 2

    broken = Workers(actors["controller"], (actors["trainer"],), (), (actors["broken"],))
    with pytest.raises(PipelineError, match=r"checkpoint .*step_4 was not written: No space left on device"):
        checkpoint.save(broken, run_dir, 4, cfg, timeout_s=60, inputs={})
    assert not (run_dir / "checkpoints" / "step_4").exists()
    assert latest(run_dir) == first   # the half-written step_4.partial is never picked


@pytest.mark.sim
def test_nonfinite_weights_leave_no_checkpoint_and_the_last_good_one_stays_latest(actors, tmp_path):
    cfg = config(tmp_path, "generation.num_generators=2")
    run_dir = tmp_path / "run"
    begin(actors, cfg, run_dir)
    good = checkpoint.save(Workers(actors["controller"], (actors["trainer"],), ()), run_dir, 2, cfg, timeout_s=60,
                           inputs={})
    poisoned = Workers(actors["controller"], (actors["poisoned"],), ())
    with pytest.raises(PipelineError, match=r"step_4 was not written: refusing to save the policy checkpoint "
                                            r".*non-finite weights \(NaN or inf\) in weight"):
        checkpoint.save(poisoned, run_dir, 4, cfg, timeout_s=60, inputs={})
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2"]   # no step_4.partial either
    assert latest(run_dir) == good and read_meta(good, cfg).steps_done == 2


# ------------------------------------------------------------------ latest

def complete(run_dir, step: int, cfg=None, name: str | None = None):
    """A checkpoint directory that read_meta accepts for `cfg`."""
    path = run_dir / "checkpoints" / (name or f"step_{step}")
    for part in ("policy", "trainer_state", "controller"):
        (path / part).mkdir(parents=True, exist_ok=True)
    (path / "controller" / "controller.json").write_text("{}")
    config = cfg.to_dict() if cfg is not None else {}
    (path / "meta.json").write_text(json.dumps({"steps_done": step, "version": step, "config": config}))
    return path


def test_latest_is_the_highest_complete_step(tmp_path):
    run_dir = tmp_path / "run"
    for step in (2, 9, 10):
        complete(run_dir, step)
    (run_dir / "checkpoints" / "step_12").mkdir()             # no meta.json: not finished
    complete(run_dir, 14, name="step_14.partial")              # meta.json, but never renamed into place
    complete(run_dir, 20, name="step_final")                   # not a step number
    (run_dir / "checkpoints" / "step_30").write_text("a file")
    assert latest(run_dir) == run_dir / "checkpoints" / "step_10"   # 10 after 9: by number, not by name


def test_latest_says_why_there_is_none(tmp_path):
    with pytest.raises(CheckpointError, match="no such run directory"):
        latest(tmp_path / "missing")
    (tmp_path / "run").mkdir()
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in .*checkpoints \(set run.checkpoint_every"):
        latest(tmp_path / "run")


# ------------------------------------------------------------------ read_meta

REAL = ("model.path=/models/m", "data.train=/data/train.jsonl", "data.reward=my_rewards:score")


@pytest.mark.parametrize("key,was,becomes,now", [
    ("algorithm", "grpo", "ppo", ("algorithm=ppo",)),
    ("backend", "sim", "real", ("backend=real", *REAL)),
    ("schedule.max_age", 2, 1, ("schedule.max_age=1",)),
    ("schedule.prompts_per_step", 8, 4, ("schedule.prompts_per_step=4",)),
    ("schedule.group_size", 4, 2, ("schedule.group_size=2",)),
    ("generation.num_generators", 2, 3, ("generation.num_generators=3",)),
])
def test_read_meta_refuses_a_config_that_changed_a_key_the_schedule_depends_on(tmp_path, key, was, becomes, now):
    saved = config(tmp_path, "schedule.max_age=2", "schedule.prompts_per_step=8", "schedule.group_size=4",
                   "generation.num_generators=2")
    ckpt = complete(tmp_path, 4, saved)
    now = ("schedule.max_age=2", "generation.num_generators=2", *now)
    assert key in CHECKPOINT_SHAPE
    # Not even when --allow-change names it (the CLI refuses to name it, too).
    with pytest.raises(ResumeError) as err:
        read_meta(ckpt, config(tmp_path, *now), allow=frozenset({key}))
    assert f"\n  {key} was {was!r} in the run, the config says {becomes!r} (it shapes the checkpoint: no resume " \
           "can change it)\n" in str(err.value)


def test_read_meta_accepts_changes_that_do_not_touch_what_is_trained(tmp_path):
    ckpt = complete(tmp_path, 4, config(tmp_path))
    changed = config(tmp_path, "run.steps=30", "run.deadline_s=5", "validation.period=2", "sim.generate_s=1",
                     "fault.max_restarts=0", "metrics.progress=false", "resources.trainer.num_cpus=2")
    assert read_meta(ckpt, changed) == (4, [])


def test_read_meta_refuses_changes_to_what_is_trained_unless_allowed(tmp_path):
    ckpt = complete(tmp_path, 4, config(tmp_path))
    changed = config(tmp_path, "run.seed=7", "training.lr=0.5")
    with pytest.raises(ResumeError, match=r"run.seed was 0 in the run, the config says 7\n"
                                          r"  training.lr was 0.0001 in the run, the config says 0.5\n"):
        read_meta(ckpt, changed)
    assert read_meta(ckpt, changed, allow=frozenset({"run.seed", "training.lr"})) == \
           (4, [Change("run.seed", 0, 7), Change("training.lr", 1e-4, 0.5)])


def test_read_meta_reads_a_key_under_the_name_it_had_when_the_checkpoint_was_written(tmp_path):
    """A checkpoint from before training.num_workers became training.ranks keeps its ranks."""
    tree = config(tmp_path, "training.ranks=2", "generation.num_generators=2").to_dict()
    tree["training"]["num_workers"] = tree["training"].pop("ranks")
    ckpt = complete(tmp_path, 4)
    (ckpt / "meta.json").write_text(json.dumps({"steps_done": 4, "version": 4, "config": tree}))
    assert read_meta(ckpt, config(tmp_path, "training.ranks=2", "generation.num_generators=2")).steps_done == 4
    with pytest.raises(ResumeError, match=r"training.ranks was 2 in the run, the config says 1 "):
        read_meta(ckpt, config(tmp_path, "generation.num_generators=2"))


def test_read_meta_refuses_a_checkpoint_at_or_past_the_last_step(tmp_path):
    ckpt = complete(tmp_path, 10, config(tmp_path))
    with pytest.raises(CheckpointError, match=r"it is at step 10 and run.steps is 10; raise run.steps"):
        read_meta(ckpt, config(tmp_path))
    assert read_meta(ckpt, config(tmp_path, "run.steps=11")).steps_done == 10


def test_read_meta_needs_the_critic_for_ppo_and_a_whole_meta(tmp_path):
    cfg = config(tmp_path, "algorithm=ppo")
    ckpt = complete(tmp_path, 4, cfg)
    with pytest.raises(CheckpointError, match=r"is incomplete: missing critic_state$"):
        read_meta(ckpt, cfg)
    (ckpt / "critic_state").mkdir()
    assert read_meta(ckpt, cfg).steps_done == 4
    with pytest.raises(ResumeError, match=r"algorithm was 'ppo' in the run, the config says 'grpo' "):
        read_meta(ckpt, config(tmp_path))
    (ckpt / "meta.json").write_text(json.dumps({"version": 4, "config": cfg.to_dict()}))
    with pytest.raises(CheckpointError, match=r"meta.json is unreadable: KeyError: 'steps_done'"):
        read_meta(ckpt, cfg)


# ------------------------------------------------------------------ archive_attempt

def test_archive_attempt_moves_each_earlier_attempts_logs_aside(tmp_path):
    run_dir = tmp_path / "run"
    complete(run_dir, 4)

    def attempt(n: int) -> None:
        """What a killed attempt leaves: its logs, a partial metrics file."""
        (run_dir / "events").mkdir()
        (run_dir / "events" / "controller.jsonl").write_text(f'{{"attempt": {n}}}\n')
        for name in ("events.jsonl", "trace.json", "summary.json", "config.yaml"):
            (run_dir / name).write_text(f"attempt {n}")
        (run_dir / "metrics.jsonl").write_text(f"metrics of attempts up to {n}\n")

    attempt(1)
    first = archive_attempt(run_dir, 4)
    assert first == run_dir / "attempts" / "1"
    assert sorted(p.name for p in first.iterdir()) == ["config.yaml", "events", "events.jsonl", "metrics.jsonl",
                                                       "summary.json", "trace.json"]
    assert (first / "events" / "controller.jsonl").read_text() == '{"attempt": 1}\n'
    assert (first / "trace.json").read_text() == (first / "config.yaml").read_text() == "attempt 1"
    # Moved, except metrics.jsonl: the resumed run keeps its steps before the checkpoint.
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempts", "checkpoints", "metrics.jsonl"]
    assert (run_dir / "metrics.jsonl").read_text() == (first / "metrics.jsonl").read_text()
    assert latest(run_dir) == run_dir / "checkpoints" / "step_4"   # checkpoints stay

    attempt(2)
    (run_dir / "trace.json").unlink()   # an attempt killed before it wrote its trace
    second = archive_attempt(run_dir, 4)
    assert second == run_dir / "attempts" / "2" and not (second / "trace.json").exists()
    assert (second / "summary.json").read_text() == "attempt 2" and (first / "summary.json").read_text() == "attempt 1"
    assert (second / "config.yaml").read_text() == "attempt 2"


def test_read_meta_refuses_to_resume_a_full_run_with_lora_or_other_targets(tmp_path):
    """A LoRA checkpoint's trainer state holds the adapter alone, of its rank and targets."""
    ckpt = complete(tmp_path, 4, config(tmp_path, "backend=real", *REAL))
    with pytest.raises(ResumeError, match="training.lora.rank was 0 in the run, the config says 8"):
        read_meta(ckpt, config(tmp_path, "backend=real", *REAL, "training.lora.rank=8"))
    lora = config(tmp_path, "backend=real", *REAL, "training.lora.rank=8")
    ckpt = complete(tmp_path / "b", 4, lora)
    assert read_meta(ckpt, lora).steps_done == 4
    with pytest.raises(ResumeError, match=r"training.lora.target_modules was \[.*'lm_head'\] in the run"):
        read_meta(ckpt, config(tmp_path, "backend=real", *REAL, "training.lora.rank=8",
                               "training.lora.target_modules=q_proj,v_proj"))
