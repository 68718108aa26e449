"""examples/gsm8k_chat.yaml end to end on a tiny model with a chat template:
chat-format rows, a system prompt, math-verify scoring in the generators, a
checkpoint that transformers loads with its template. (It does not learn GSM8K:
the tiny model is random; the recipe must run, score and checkpoint.)"""
from __future__ import annotations

import json

import pytest

from pipeline.config import load_config
from pipeline.core.events import load_events
from pipeline.inputs.tiny import TINY_CHAT_TEMPLATE, build_tiny_model
from pipeline.run.driver import train
from pipeline.tools.check import check_events

pytestmark = pytest.mark.real


def test_the_gsm8k_chat_recipe_runs_scores_and_checkpoints(tmp_path, ray_session):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = build_tiny_model(tmp_path / "tiny_chat", chat_template="plain")
    cfg = load_config("examples/gsm8k_chat.yaml", [
        f"model.path={model}", f"run.output_dir={tmp_path}", "run.name=chat", "run.steps=3",
        "run.checkpoint_every=3", "validation.period=0", "validation.at_end=false", "metrics.tensorboard=false"])
    summary = train(cfg, quiet=True)
    assert summary["error"] is None and summary["steps"] == 3
    run_dir = tmp_path / "chat"
    assert check_events(load_events(run_dir)) == []
    steps = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["step"] >= 0]
    # Every sample scored by math-verify (none failed or timed out); at age 0 the trainer's
    # logprobs of the template's ids are vLLM's.
    assert [m["reward_failures"] for m in steps] == [0.0, 0.0, 0.0]
    assert steps[0]["age_max"] == 0 and steps[0]["is_weight"] == pytest.approx(1.0, abs=1e-5)
    policy = run_dir / "checkpoints" / "step_3" / "policy"
    assert AutoTokenizer.from_pretrained(policy).chat_template == TINY_CHAT_TEMPLATE
    AutoModelForCausalLM.from_pretrained(policy)
