"""LoRA end to end on the real CPU stack: examples/tiny_grpo_lora.yaml learns
with adapter-only refits over the collective sync, its checkpoints hold the
adapter, a resume from one continues the same curve, and the export merges
the adapter into an HF model."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import torch

from pipeline.config import load_config
from pipeline.run.driver import train
from pipeline.core.events import load_events
from pipeline.tools.check import check_events
import pytest

pytestmark = pytest.mark.real

STEPS = 30
RESUME_AT = 20  # the last checkpoint before the end; the resumed run redoes the steps after it


def rewards(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["reward_mean"] for m in map(json.loads, lines) if m["step"] >= 0}


def test_lora_learns_syncs_the_adapter_and_resumes_from_it(tmp_path, ray_session, tiny_model):
    overrides = [f"model.path={tiny_model}", f"run.output_dir={tmp_path}", "run.name=lora", f"run.steps={STEPS}",
                 f"run.checkpoint_every={RESUME_AT}", "run.dag_mode=classic", "generation.weight_sync=collective"]
    summary = train(load_config("examples/tiny_grpo_lora.yaml", overrides), quiet=True)
    run_dir = tmp_path / "lora"
    violations = check_events(load_events(run_dir))
    assert violations == [], "\n".join(v.message for v in violations)
    assert summary["error"] is None and summary["steps"] == STEPS
    # A smoke test of the learning benchmarks/seeds.py measures (results/seeds_lora.json, 60 steps,
    # seeds 0-4); 30 steps are about half-way up the curve.
    assert summary["reward_end"] - summary["reward_start"] >= 0.3, summary
    first = rewards(run_dir)

    # Each refit moved the adapter alone: a fraction of the model's bytes.
    model_bytes = (tiny_model / "model.safetensors").stat().st_size
    sent = [e["bytes"] for e in load_events(run_dir) if e["ev"] == "send_end"]
    assert len(sent) == STEPS and all(0 < b < 0.3 * model_bytes for b in sent), (sent[:3], model_bytes)

    # The checkpoint's policy is the adapter, naming its base model; the export merges it.
    policy = run_dir / "checkpoints" / f"step_{STEPS}" / "policy"
    assert json.loads((policy / "adapter_config.json").read_text())["r"] == 8
    assert not (policy / "model.safetensors").exists()
    merged = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "export", str(run_dir), "--out", str(merged)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"step_{STEPS}" in proc.stdout, proc.stdout + proc.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(merged)
    ids = AutoTokenizer.from_pretrained(merged)("repeat: 1 1 1 1 1 1 1 1", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()

    # Resume from the checkpoint before the last (as if the run had died after it): the adapter,
    # its optimizer state and the data position come back, and the curve goes on as it went.
    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS}")
    summary = train(load_config("examples/tiny_grpo_lora.yaml", overrides), quiet=True, restore_from=str(run_dir))
    assert summary["error"] is None
    resumed = rewards(run_dir)
    assert {s: resumed[s] for s in range(RESUME_AT, STEPS)} == {s: first[s] for s in range(RESUME_AT, STEPS)}
    violations = check_events(load_events(run_dir))
    assert violations == [], "\n".join(v.message for v in violations)


VLM_STEPS = 4


def test_the_tiny_vlm_recipe_trains_a_lora_and_resumes_from_it(tmp_path, ray_session):
    """examples/tiny_vlm_grpo.yaml with training.lora.rank=8: clean events,
    adapter-only refits, a checkpoint that holds the adapter and exports to an
    image-text-to-text model, and a resume from the checkpoint before the last
    that takes the same steps."""
    from pipeline.inputs.tiny_vlm import build_tiny_vlm
    model = build_tiny_vlm(tmp_path / "model", warmup_steps=0)
    overrides = [f"model.path={model}", f"run.output_dir={tmp_path}", "run.name=vlm_lora", f"run.steps={VLM_STEPS}",
                 "run.checkpoint_every=2", "schedule.prompts_per_step=8", "schedule.group_size=4",
                 "validation.at_start=false", "validation.at_end=false", "training.micro_batch_size=16",
                 "training.lora.rank=8", "training.lr=0.02"]
    summary = train(load_config("examples/tiny_vlm_grpo.yaml", overrides), quiet=True)
    run_dir = tmp_path / "vlm_lora"
    violations = check_events(load_events(run_dir))
    assert violations == [], "\n".join(v.message for v in violations)
    assert summary["error"] is None and summary["steps"] == VLM_STEPS
    first = rewards(run_dir)
    put = [e["bytes"] for e in load_events(run_dir) if e["ev"] == "weights_put"]
    assert len(put) >= VLM_STEPS - 1 and all(0 < b < 0.3 * (model / "model.safetensors").stat().st_size for b in put)

    policy = run_dir / "checkpoints" / f"step_{VLM_STEPS}" / "policy"
    assert not (policy / "model.safetensors").exists()
    assert not any("visual" in k for k in json.loads((policy / "adapter_config.json").read_text())["target_modules"])
    merged = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "export", str(run_dir), "--out", str(merged)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from transformers import AutoModelForImageTextToText
    assert AutoModelForImageTextToText.from_pretrained(merged) is not None
    assert (merged / "preprocessor_config.json").is_file()

    shutil.rmtree(run_dir / "checkpoints" / f"step_{VLM_STEPS}")
    summary = train(load_config("examples/tiny_vlm_grpo.yaml", overrides), quiet=True, restore_from=str(run_dir))
    assert summary["error"] is None
    resumed = rewards(run_dir)
    assert {s: resumed[s] for s in range(2, VLM_STEPS)} == {s: first[s] for s in range(2, VLM_STEPS)}
    violations = check_events(load_events(run_dir))
    assert violations == [], "\n".join(v.message for v in violations)
