"""Per-step metrics from hand-built graph outputs, and the sinks and progress
display read back from what they wrote."""
from __future__ import annotations

import io
import json
import sys

import pytest

from dags.tokens import Batch, Refitted, Resume, Ticket, TrainOut, ValOut
from pipeline.config import ConfigError, load_config
from pipeline.run.metrics import MetricSinks, Progress, step_metrics

pytestmark = pytest.mark.unit


def _train(step: int, **metrics: float) -> TrainOut:
    return TrainOut(step, step + 1, None, tuple(sorted(metrics.items())))


def _grpo_out(step: int = 4) -> dict:
    return {
        "sample": Batch(step, ("a", "b"), (3, 4), wait_s=0.2),
        "train": _train(step, loss=0.75, reward_mean=0.5, reward_std=0.25, age_mean=0.5, age_max=1.0,
                        response_tokens=120.0, time_s=0.5),
        "refit[0]": Refitted("gen0", step, step + 1, ("",), refit_s=0.1),
        "refit[1]": Refitted("gen1", step, step + 1, ("",), refit_s=0.3),
        "validate[0]": ValOut("gen0", step, step + 1, True, (), validate_s=0.05),
        "validate[1]": ValOut("gen1", step, step + 1, True, (), validate_s=0.02),
        "resume": Resume(step, step + 1, (), (("val_reward", 0.625), ("val_count", 16.0))),
        "collect[0]": Ticket("gen0", step, step + 1, ("x",), busy_s=0.8),
        # Busier than the step was long (its previous ticket came earlier): idle clamps to 0.
        "collect[1]": Ticket("gen1", step, step + 1, ("y",), busy_s=1.5),
    }


def test_step_metrics_timings_and_idle_ratios():
    m = step_metrics(4, 1.0, _grpo_out())
    assert m["step"] == 4 and m["step_time_s"] == 1.0
    assert m["wait_s"] == pytest.approx(0.2)
    assert m["train_s"] == pytest.approx(0.5)
    assert m["trainer_idle"] == pytest.approx(0.5)
    assert m["refit_s"] == pytest.approx(0.3), "the slowest generator's refit"
    assert m["validate_s"] == pytest.approx(0.05), "the slowest generator's validation"
    assert m["generator_idle"] == pytest.approx((0.2 + 0.0) / 2)
    assert m["generated_tokens_per_s"] == pytest.approx(120.0)
    assert m["val_reward"] == pytest.approx(0.625) and m["val_count"] == 16
    # Every training metric comes through under its own name.
    for key, value in {"loss": 0.75, "reward_mean": 0.5, "reward_std": 0.25, "age_mean": 0.5,
                       "age_max": 1.0, "response_tokens": 120.0, "time_s": 0.5}.items():
        assert m[key] == pytest.approx(value), key
    json.dumps(m)  # a metrics.jsonl line


def test_step_metrics_trainer_busier_than_the_step_clamps():
    out = _grpo_out()
    out["train"] = _train(4, time_s=2.5, response_tokens=10.0)
    m = step_metrics(4, 2.0, out)
    assert m["trainer_idle"] == 0.0
    assert m["generated_tokens_per_s"] == pytest.approx(5.0)


def test_step_metrics_prefers_ppo_train_done():
    out = _grpo_out()
    out["train_done"] = _train(4, loss=0.75, reward_mean=0.5, time_s=0.5, **{"critic/loss": 0.125,
                                                                           "critic/time_s": 0.25})
    m = step_metrics(4, 1.0, out)
    assert m["critic/loss"] == pytest.approx(0.125) and m["critic/time_s"] == pytest.approx(0.25)
    assert m["trainer_idle"] == pytest.approx(0.5)


def test_step_metrics_on_prologue_outputs():
    """The prologue graph has no sample or train: a validation-only record."""
    out = {"validate[0]": ValOut("gen0", -1, 0, True, (), validate_s=0.25),
           "resume": Resume(-1, 0, (), (("val_reward", 0.25), ("val_count", 8.0))),
           "collect[0]": Ticket("gen0", -1, 0, ("x",), busy_s=0.0)}
    m = step_metrics(-1, 0.5, out)
    assert m["val_reward"] == 0.25 and m["validate_s"] == 0.25 and m["generator_idle"] == 1.0
    assert not {"wait_s", "train_s", "trainer_idle", "loss", "generated_tokens_per_s"} & set(m)


def _scalars(log_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_sinks_write_jsonl_and_tensorboard(tmp_path):
    cfg = load_config(None, ["metrics.tensorboard=true"])
    sinks = MetricSinks(tmp_path, cfg)
    records = [{"step": -1, "val_reward": 0.25, "val_count": 8.0},
               step_metrics(0, 1.0, _grpo_out(0)),
               step_metrics(1, 0.5, _grpo_out(1))]
    for r in records:
        sinks.write(r)
    sinks.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == records
    assert _scalars(tmp_path / "tensorboard", "val_reward") == [
        (-1, pytest.approx(0.25)), (0, pytest.approx(0.625)), (1, pytest.approx(0.625))]
    assert _scalars(tmp_path / "tensorboard", "trainer_idle") == [(0, pytest.approx(0.5)), (1, pytest.approx(0.0))]
    assert _scalars(tmp_path / "tensorboard", "generated_tokens_per_s") == [
        (0, pytest.approx(120.0)), (1, pytest.approx(240.0))]


def test_tensorboard_off_writes_only_jsonl(tmp_path):
    sinks = MetricSinks(tmp_path, load_config(None, ["metrics.tensorboard=false"]))
    sinks.write({"step": 0, "loss": 1.0})
    sinks.close()
    assert not (tmp_path / "tensorboard").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 0, "loss": 1.0}


def test_resume_replaces_the_killed_tail(tmp_path):
    cfg = load_config(None, [])
    killed = MetricSinks(tmp_path, cfg)
    for step in range(5):
        killed.write({"step": step, "loss": float(step)})
    killed.write({"step": 4, "val_reward": 0.125})
    killed.close()
    # Resumed from the checkpoint after step 2: steps 3.. run again, and this
    # time validation comes at step 5. Without the purge TensorBoard would
    # show steps 3 and 4 twice and keep the killed run's validation at step 4.
    resumed = MetricSinks(tmp_path, cfg, start_step=3)
    for step in range(3, 6):
        resumed.write({"step": step, "loss": 10.0 + step})
    resumed.write({"step": 5, "val_reward": 0.75})
    resumed.close()
    assert _scalars(tmp_path / "tensorboard", "loss") == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert _scalars(tmp_path / "tensorboard", "val_reward") == [(5, 0.75)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("loss", r.get("val_reward"))) for r in lines] == [
        (0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0), (5, 0.75)]


def test_record_without_step_is_an_error(tmp_path):
    sinks = MetricSinks(tmp_path, load_config(None, ["metrics.tensorboard=false"]))
    with pytest.raises(ValueError, match="step"):
        sinks.write({"loss": 1.0})
    sinks.close()


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"metrics\.wandb.*pip install wandb"):
        MetricSinks(tmp_path, load_config(None, ["metrics.wandb=true"]))
    assert list(tmp_path.iterdir()) == [], "nothing is written before the error"


def test_wandb_offline_run_gets_the_records(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["metrics.wandb=true", "metrics.tensorboard=false", "metrics.wandb_project=t",
                             "run.name=wb"])
    sinks = MetricSinks(tmp_path, cfg)
    run = sinks._wandb.run
    sinks.write({"step": -1, "val_reward": 0.25})
    sinks.write({"step": 0, "loss": 1.5, "reward_mean": 0.125})
    sinks.write({"step": 1, "loss": 1.25, "reward_mean": 0.5})
    summary = dict(run.summary)
    run_id = run.id
    sinks.close()
    assert summary["step"] == 1 and summary["loss"] == 1.25 and summary["val_reward"] == 0.25
    assert run.project == "t" and run.name == "wb"
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    # A resumed run in the same directory continues the same W&B run.
    resumed = MetricSinks(tmp_path, cfg, start_step=1)
    assert resumed._wandb.run.id == run_id
    resumed.close()


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_prints_plain_lines_without_a_tty():
    stream = io.StringIO()
    progress = Progress(total=3, start=0, enabled=True, stream=stream)
    progress.update({"step": -1, "val_reward": 0.25})
    progress.update({"step": 0, "reward_mean": 0.125, "age_mean": 0.0, "loss": 0.5, "step_time_s": 0.4})
    progress.update({"step": 1, "reward_mean": 0.5, "age_mean": 1.0, "step_time_s": 0.35, "val_reward": 0.75})
    progress.close()
    assert stream.getvalue().splitlines() == [
        "before training: val_reward=0.250",
        "step 0 (1 of 3 done) reward=0.125 age=0.0 loss=0.5000 time=0.40s",
        "step 1 (2 of 3 done) reward=0.500 age=1.0 loss=- time=0.35s val_reward=0.750",
    ]
    assert "\r" not in stream.getvalue()


def test_progress_bar_on_a_tty_and_silent_when_disabled():
    stream = _Tty()
    progress = Progress(total=4, start=2, enabled=True, stream=stream)
    progress.update({"step": -1, "val_reward": 0.25})
    progress.update({"step": 2, "reward_mean": 0.625, "step_time_s": 0.31})
    progress.close()
    text = stream.getvalue()
    assert "3/4" in text and "reward=0.625" in text and "step_time=0.31s" in text
    assert "before training: val_reward=0.250\n" in text
    quiet = io.StringIO()
    off = Progress(total=4, start=0, enabled=False, stream=quiet)
    off.update({"step": 0, "reward_mean": 0.5})
    off.close()
    assert quiet.getvalue() == ""
