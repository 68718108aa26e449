"""Multi-turn episodes with a picture prompt on the tiny Qwen2-VL, through the
engine loop on vLLM and then the trainer, in a process of its own
(tests/trainer/test_vlm.py; why a process: tests/support/architecture_check.py).
Writes what it measured as JSON.

    python -m tests.support.vlm_episodes_check OUT_DIR
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.core.types import TRAJECTORY_SCHEMA, Prompt
from pipeline.inputs.datasets import ChatTemplate, load_prompts
from pipeline.inputs.tiny_vlm import build_tiny_vlm, write_digit_data
from pipeline.rewards.rules import digit_reward
from tests.support.architecture_check import gap
from tests.support.training_helpers import engine_config, sequence_logprobs

OBSERVATION = "\nLook again:"


class LookAgain:
    """The picture's digit, asked up to three times: the first observation is the
    prompt as it is (its picture's placeholder with it); each wrong answer gets
    `observation`, and the answer is scored by digit_reward."""

    def __init__(self, observation: str = OBSERVATION, turns: int = 3):
        self.observation, self.turns = observation, turns

    def reset(self, prompt: Prompt) -> str:
        self.prompt, self.turn = prompt, 0
        return prompt.text

    def step(self, action: str):
        self.turn += 1
        reward = digit_reward(self.prompt, action)
        return self.observation, reward, reward == 1.0 or self.turn == self.turns, {}


def roll(engine, out_dir: Path, prompts: list[Prompt], *env_args: str) -> list:
    """One batch of two samples a prompt through an engine loop with LookAgain."""
    from dags.tokens import Launch
    from pipeline.config import load_config
    from pipeline.core.events import EventLog
    from pipeline.generator.engine_loop import EngineLoop
    cfg = load_config(None, [f"env.class={__name__}:LookAgain", "env.max_turns=3", *env_args])
    out, finished = {}, threading.Event()
    loop = EngineLoop(engine, EventLog(out_dir, "gen0", time.time()),
                      lambda batch, completions, spans: (out.update(c=completions), finished.set()),
                      lambda batch, reason: (out.update(failed=reason), finished.set()), 0, 2, cfg.env)
    try:
        seeds = list(range(11, 11 + 2 * len(prompts)))
        loop.call("submit", (0, [(Launch("mt", 0, 0, tuple(prompts)), seeds)]), 120, "submit")
        assert finished.wait(300) and "failed" not in out, out.get("failed")
    finally:
        loop.stop(30)
    assert loop.died is None, loop.died
    return out["c"]


def table_of(prompts: list[Prompt], completions) -> pa.Table:
    rows = [dict(batch_id="b", target=0, version=0, prompt_id=p.id, prompt_ids=list(c.prompt_ids),
                 response_ids=list(c.response_ids), logprobs=list(c.logprobs), text=c.text, reward=c.reward,
                 loss_mask=list(c.loss_mask), images=list(p.images))
            for p, c in zip([p for p in prompts for _ in range(2)], completions)]
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def model_tokens(values: list[list[float]], table: pa.Table) -> list[list[float]]:
    return [[v for v, m in zip(row, mask) if m] for row, mask in zip(values, table.column("loss_mask").to_pylist())]


def measure(out_dir: Path) -> dict:
    from transformers import AutoTokenizer

    from pipeline.generator.vllm_engine import VllmGenerationEngine
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    torch.set_num_threads(1)
    model_dir = build_tiny_vlm(out_dir / "model", warmup_steps=0)
    train_path, _ = write_digit_data(out_dir / "data", n_train=4, n_val=1)
    prompts = load_prompts(train_path, chat=ChatTemplate(AutoTokenizer.from_pretrained(model_dir)))[:3]
    engine = VllmGenerationEngine(model_dir, seed=0, max_new_tokens=8, temperature=1.0, top_p=1.0, max_model_len=256)
    try:
        completions = roll(engine, out_dir / "ok", prompts)
        placeholder = f"<|image_pad|>{OBSERVATION}"
        refused = roll(engine, out_dir / "refused", prompts[:1], f"env.args={{observation: {json.dumps(placeholder)}}}")
        placeholders = engine.placeholders
    finally:
        engine.close()
    table = table_of(prompts, completions)
    trainer = DeepSpeedPolicyEngine(engine_config(model_dir))
    try:
        scored = sequence_logprobs(trainer, table)
        blind = sequence_logprobs(trainer, table.drop_columns(["images"]))
    finally:
        trainer.close()
    sampled = table.column("logprobs").to_pylist()
    observation = [lp for row, mask in zip(sampled, table.column("loss_mask").to_pylist())
                   for lp, m in zip(row, mask) if not m]
    return {"turns": [c.turns for c in completions], "errors": [c.error for c in completions],
            "placeholders": [sum(t in placeholders for t in c.prompt_ids) for c in completions],
            "in_responses": sum(t in placeholders for c in completions for t in c.response_ids),
            "observation_logprobs": observation,
            "gap": gap(model_tokens(scored, table), model_tokens(sampled, table)),
            "pictures_matter": gap(model_tokens(scored, table), model_tokens(blind, table)),
            "refused": [c.error for c in refused], "refused_turns": [c.turns for c in refused]}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    (out / "measured.json").write_text(json.dumps(measure(out)))
