"""Routing replay through vLLM and the trainer, in a process of its own
(tests/moe/test_routing_real.py; vLLM after DeepSpeed, as in
tests/support/architecture_check.py). Writes what it measured as JSON.

    python -m tests.support.routing_check OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import torch

from benchmarks.routing_replay import GROUP, sampled_table, trainer_view
from pipeline.algos.advantages import critic_free_advantages
from pipeline.core.types import Prompt
from pipeline.inputs.tiny import build_tiny_model, tiny_prompt
from tests.support.training_helpers import engine_config

# Prompts past one 32-token KV block: a group's later samples start from the prefix cache.
PROMPTS = [Prompt(c, " ".join([tiny_prompt(c)] * 3), c) for c in "a7"]


def measure(out_dir: Path) -> dict:
    from pipeline.generator.vllm_engine import VllmGenerationEngine
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    torch.set_num_threads(1)
    model_dir = build_tiny_model(out_dir / "tiny_moe", architecture="qwen3_moe", heads=4, kv_heads=2)
    trainer = DeepSpeedPolicyEngine(engine_config(model_dir, "training.routing_replay=true", "training.lr=1e-2",
                                                  f"schedule.group_size={GROUP}"))
    engine = VllmGenerationEngine(model_dir, seed=0, max_new_tokens=8, max_model_len=256, routing_replay=True)
    try:
        before = sampled_table(engine, PROMPTS, 0, 0)
        lengths = [len(p) + len(r) - 1 for p, r in zip(before.column("prompt_ids").to_pylist(),
                                                       before.column("response_ids").to_pylist())]
        age0 = trainer_view(trainer, before, apply=True)
        # Rewards 0, 1, 0, 1 in every group: every group teaches (the task's are all 0 this early).
        taught = before.set_column(before.schema.get_field_index("reward"), "reward",
                                   pa.array([float(i % 2) for i in range(before.num_rows)], pa.float32()))
        metrics = trainer.train_step(taught, critic_free_advantages(taught, GROUP))
        engine.load_weights(trainer.export_weights())
        after = sampled_table(engine, PROMPTS, 1, 1)
        return {"prompt_tokens": [len(p) for p in before.column("prompt_ids").to_pylist()],
                "route_tokens": lengths, "age0": age0, "metrics": metrics,
                "age0_after_refit": trainer_view(trainer, after, apply=True),
                "age1_replayed": trainer_view(trainer, before, apply=True),
                "age1_own": trainer_view(trainer, before, apply=False)}
    finally:
        trainer.close()
        engine.close()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    (out / "measured.json").write_text(json.dumps(measure(out)))
