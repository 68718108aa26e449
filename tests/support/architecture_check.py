"""One model family through vLLM and the trainer, in a process of its own
(tests/trainer/test_architectures.py): vLLM's engine, closed, takes the
process's torch.distributed group with it, which the other trainer tests of a
pytest process share. Writes what it measured as JSON.

    python -m tests.support.architecture_check FAMILY OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import torch

from benchmarks.harness import sample_all
from pipeline.algos.advantages import critic_free_advantages
from pipeline.core.types import TRAJECTORY_SCHEMA, Prompt, sample_seeds
from pipeline.inputs.tiny import build_tiny_model, tiny_prompt
from tests.support.training_helpers import engine_config, sequence_logprobs

FAMILIES = {
    "llama_gqa": dict(architecture="llama", heads=4, kv_heads=2),
    # Qwen2's head size is hidden / heads in vLLM: 64 / 2 = 32, a size vLLM's CPU attention has.
    "qwen2_tied": dict(architecture="qwen2", heads=2, kv_heads=1, tie_embeddings=True),
    "qwen3": dict(architecture="qwen3", heads=4, kv_heads=2),
    # Its refit goes through vLLM's reload_weights, which repacks the CPU experts (vllm_engine.py).
    "qwen3_moe": dict(architecture="qwen3_moe", heads=4, kv_heads=2),
}
PROMPTS = [Prompt("a", tiny_prompt("a"), "a"), Prompt("b", tiny_prompt("7"), "7")]


def table_of(groups) -> pa.Table:
    rows = [dict(batch_id="b", target=0, version=0, prompt_id=PROMPTS[g].id, prompt_ids=list(c.prompt_ids),
                 response_ids=list(c.response_ids), logprobs=list(c.logprobs), text=c.text,
                 reward=float(j))   # two samples a group, rewards 0 and 1: every group teaches
            for g, group in enumerate(groups) for j, c in enumerate(group)]
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def gap(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def hf_logprobs(model, table: pa.Table) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for row in table.select(["prompt_ids", "response_ids"]).to_pylist():
            logp = torch.log_softmax(model(torch.tensor([row["prompt_ids"] + row["response_ids"]])).logits[0].float(),
                                     dim=-1)
            start = len(row["prompt_ids"]) - 1
            out.append([logp[start + i, t].item() for i, t in enumerate(row["response_ids"])])
    return out


def measure(family: str, out_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from pipeline.generator.vllm_engine import VllmGenerationEngine
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    torch.set_num_threads(1)
    model_dir = build_tiny_model(out_dir / family, **FAMILIES[family])
    # The trainer first: DeepSpeed refuses a process group that vLLM set up without LOCAL_RANK;
    # vLLM runs in the one DeepSpeed made (world size 1). In a run they are processes apart.
    trainer = DeepSpeedPolicyEngine(engine_config(model_dir, "training.lr=1e-2"))
    engine = VllmGenerationEngine(model_dir, seed=0, max_new_tokens=8, temperature=1.0, top_p=1.0, max_model_len=128)
    try:
        before = table_of(sample_all(engine, PROMPTS, sample_seeds(0, "before", PROMPTS, 2)))
        initial = sequence_logprobs(trainer, before)
        m = trainer.train_step(before, critic_free_advantages(before, 2))
        engine.load_weights(trainer.export_weights())
        after = table_of(sample_all(engine, PROMPTS, sample_seeds(0, "after", PROMPTS, 2)))
        trained = sequence_logprobs(trainer, after)
        trainer.save(str(out_dir / "ckpt"))
        hf = AutoModelForCausalLM.from_pretrained(out_dir / "ckpt", dtype=torch.float32).eval()
        return {"before": gap(initial, before.column("logprobs").to_pylist()),
                "is_weight": m["is_weight"], "nonfinite_skipped": m["nonfinite_skipped"],
                "moved": gap(sequence_logprobs(trainer, before), initial),
                "after_refit": gap(trained, after.column("logprobs").to_pylist()),
                "checkpoint": gap(hf_logprobs(hf, after), trained)}
    finally:
        trainer.close()
        engine.close()


if __name__ == "__main__":
    family, out = sys.argv[1], Path(sys.argv[2])
    (out / "measured.json").write_text(json.dumps(measure(family, out)))
