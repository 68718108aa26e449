"""Faults on the real CPU stack (vLLM-CPU, DeepSpeed-CPU): SIGKILL the
generator mid-run (it is replaced, its batches relaunched), then SIGKILL the
driver, then resume from the latest checkpoint and finish."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from pipeline.core.events import load_events
from pipeline.tools.check import check_events
from tests.support._procs import ROOT, events_of, sigkill_tree, start_driver, steps_logged, wait_for
import pytest

pytestmark = pytest.mark.real


def test_generator_kill_then_driver_kill_then_resume(tmp_path, tiny_model):
    run_dir = tmp_path / "real"
    steps = 12
    args = ["--config", "examples/tiny_grpo.yaml", f"model.path={tiny_model}", f"run.output_dir={tmp_path}",
            "run.name=real", f"run.steps={steps}", "run.checkpoint_every=4", "validation.period=0",
            "run.dag_mode=classic", "metrics.progress=false"]
    log = tmp_path / "first.log"
    proc = start_driver(args, log)
    try:
        gen_log = run_dir / "events" / "gen0.jsonl"
        wait_for(lambda: any(e["step"] >= 3 for e in events_of(gen_log, "rollout_start")), 400, proc,
                 "gen0's rollouts for step 3", log)
        os.kill(events_of(gen_log, "worker_start")[0]["pid"], signal.SIGKILL)
        wait_for(lambda: steps_logged(run_dir) >= 9, 400, proc, "step 9 after the generator's restart", log)
    finally:
        sigkill_tree(proc)
    first = load_events(run_dir)  # per-worker files: the killed driver never merged them
    assert [e["dead"] for e in first if e["ev"] == "generator_died"] == ["gen0"]
    assert [e["new"] for e in first if e["ev"] == "generator_restarted"] == ["gen0_r1"]
    assert check_events(first) == []  # an unfinished log: nothing counted as lost, nothing wrong

    done = subprocess.run([sys.executable, "-m", "pipeline", "train", *args, "--resume", str(run_dir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["error"] is None and summary["steps"] == steps and summary["start_step"] == 8
    second = load_events(run_dir)
    violations = check_events(second)
    assert violations == [], "\n".join(v.message for v in violations)
    kept = [b for e in first if e["ev"] == "train_start" and e["step"] < 8 for b in e["batches"]]
    redone = [b for e in second if e["ev"] == "train_start" for b in e["batches"]]
    assert sorted(kept + redone) == sorted(f"t{s}.g0" for s in range(steps))

    # The final checkpoint loads: the HF policy in transformers, the full state in a new trainer.
    from transformers import AutoModelForCausalLM
    final = run_dir / "checkpoints" / f"step_{steps}"
    model = AutoModelForCausalLM.from_pretrained(final / "policy")
    assert sum(p.numel() for p in model.parameters()) > 0
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    from tests.support.training_helpers import engine_config
    engine = DeepSpeedPolicyEngine(engine_config(tiny_model, "training.lr=0.005", "training.micro_batch_size=32"))
    try:
        engine.load_state(str(final / "trainer_state"))
        assert engine.steps == steps
        import torch
        loaded = engine.export_weights()
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded[name], tensor), name
    finally:
        engine.close()
