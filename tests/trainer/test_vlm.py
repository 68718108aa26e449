"""A vision-language policy (the tiny Qwen2-VL, pipeline/inputs/tiny_vlm.py) through
vLLM and the trainer, each in a process of its own (tests/support/vlm_check.py):
vLLM's logprobs of samples with pictures are the trainer's at age 0, before and
after a refit with the weights the trainer exports, and the trainer's checkpoint
loads in transformers with the trainer's logprobs. With model.freeze_vision the
vision tower does not move and is not exported; without, it is trained and sent."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real

TOL = 2e-5


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen_vision", "trained_vision"])
def test_a_vlm_agrees_with_vllm_at_age_zero_across_a_refit_and_a_checkpoint(tmp_path, freeze):
    proc = subprocess.run([sys.executable, "-m", "tests.support.vlm_check", str(tmp_path), str(freeze).lower()],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "measured.json").read_text())
    assert m["placeholders"] == 4           # vLLM's processor put the picture's 4 tokens in the prompt
    assert m["pictures_matter"] > 1e-3      # the trainer's logprobs depend on the pictures
    assert m["before"] < TOL and m["is_weight"] == pytest.approx(1.0, abs=1e-5) and m["nonfinite_skipped"] == 0
    assert m["moved"] > 1e-4
    assert m["after_refit"] < TOL           # vLLM serves the changed policy exactly (its picture encodings too)
    assert m["checkpoint"] < TOL
    if freeze:
        assert m["vision_moved"] == 0 and m["vision_exported"] == 0
    else:
        assert m["vision_moved"] > 1e-4 and m["vision_exported"] > 0


def test_multi_turn_episodes_with_a_picture_agree_with_vllm_at_age_zero(tmp_path):
    """Every turn's request re-sends the prompt's picture; the trainer scores the
    stitched episode (the picture widened as vLLM widened it at turn 1) with its
    pixels and gets vLLM's logprobs on the model's tokens; an observation holding
    a picture's placeholder ends its sample before it reaches the context."""
    proc = subprocess.run([sys.executable, "-m", "tests.support.vlm_episodes_check", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "measured.json").read_text())
    assert not any(m["errors"]) and max(m["turns"]) == 3, m["errors"]
    assert set(m["placeholders"]) == {4} and m["in_responses"] == 0
    assert m["observation_logprobs"] and set(m["observation_logprobs"]) == {0.0}
    assert m["gap"] < TOL
    assert m["pictures_matter"] > 1e-3
    assert m["refused_turns"] == [1, 1] and all("holds a picture's placeholder token" in e for e in m["refused"])


def test_a_few_steps_of_multi_turn_episodes_with_pictures_run_clean(tmp_path, ray_session):
    """examples/tiny_vlm_grpo.yaml with LookAgain as env.class (tests/support/vlm_episodes_check.py):
    two-turn episodes on the pictures train and validate, every event log clean, only the model's tokens
    trained."""
    from pipeline.config import load_config
    from pipeline.core.events import load_events
    from pipeline.inputs.tiny_vlm import build_tiny_vlm, write_digit_data
    from pipeline.run.driver import train
    from pipeline.tools.check import check_events
    model = build_tiny_vlm(tmp_path / "model", warmup_steps=0)
    train_path, val_path = write_digit_data(tmp_path / "data", n_train=16, n_val=4)
    cfg = load_config("examples/tiny_vlm_grpo.yaml", [
        f"model.path={model}", f"data.train={train_path}", f"data.val={val_path}", "data.reward=",
        "env.class=tests.support.vlm_episodes_check:LookAgain", "env.max_turns=2", "env.args={turns: 2}",
        f"run.output_dir={tmp_path}", "run.name=mt", "run.steps=3", "run.checkpoint_every=0",
        "schedule.prompts_per_step=4", "schedule.group_size=2", "validation.period=2", "validation.at_start=false",
        "metrics.progress=false", "metrics.tensorboard=false"])
    summary = train(cfg, quiet=True)
    assert summary["steps"] == 3 and summary["error"] is None
    assert summary["accounting"]["reward_failures"] == 0
    events = load_events(tmp_path / "mt")
    violations = check_events(events)
    assert violations == [], "\n".join(v.message for v in violations)
    metrics = [json.loads(line) for line in (tmp_path / "mt" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] >= 0]
    assert len(steps) == 3 and all(m["tokens"] == m["model_tokens"] < m["response_tokens"] for m in steps)
    assert any("val_reward" in m for m in metrics)


def test_a_vlm_lora_adapter_agrees_with_vllm_at_age_zero_across_a_refit_and_an_export(tmp_path):
    """training.lora on the VLM, default targets: vLLM serves the zero adapter, then the
    trained one (its names mapped onto vLLM's Qwen2-VL), with the trainer's logprobs; only
    adapter tensors move, none on the vision tower, and the merged export loads in
    transformers with the trainer's logprobs."""
    proc = subprocess.run([sys.executable, "-m", "tests.support.vlm_check", str(tmp_path), "true", "lora"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "measured.json").read_text())
    assert m["pictures_matter"] > 1e-3 and m["before"] < TOL
    assert m["adapter_exported"] and m["vision_exported"] == 0 and m["vision_moved"] == 0
    assert m["lm_head_exported"] == 2       # vLLM serves lm_head's adapter too (pipeline/generator/lora_compat.py)
    assert m["moved"] > 1e-4 and m["after_refit"] < TOL and m["checkpoint"] < TOL
