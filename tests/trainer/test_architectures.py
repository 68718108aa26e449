"""The model families users train, each a random tiny model built with
transformers: Llama with grouped-query attention, Qwen2 with tied embeddings
and q/k/v biases, Qwen3 with q/k norms. For each: vLLM's logprobs are the
trainer's at age 0 (the IS weight is 1), before and after a refit with the
weights the trainer exports, and the trainer's checkpoint loads in
transformers with the trainer's logprobs."""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from tests.support.training_helpers import sequence_logprobs

from pipeline.algos.advantages import grpo_advantages
from pipeline.core.types import TRAJECTORY_SCHEMA, Prompt, sample_seeds
from pipeline.inputs.tiny import build_tiny_model, tiny_prompt

pytestmark = pytest.mark.real

torch.set_num_threads(1)
TOL = 2e-5
FAMILIES = {
    "llama_gqa": dict(architecture="llama", heads=4, kv_heads=2),
    # Qwen2's head size is hidden / heads in vLLM: 64 / 2 = 32, a size vLLM's CPU attention has.
    "qwen2_tied": dict(architecture="qwen2", heads=2, kv_heads=1, tie_embeddings=True),
    "qwen3": dict(architecture="qwen3", heads=4, kv_heads=2),
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


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_agrees_with_vllm_at_age_zero_across_a_refit_and_a_checkpoint(tmp_path, family):
    from transformers import AutoModelForCausalLM

    from pipeline.generator.vllm_engine import VllmGenerationEngine
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    model_dir = build_tiny_model(tmp_path / family, **FAMILIES[family])
    # The trainer first: DeepSpeed refuses a process group that vLLM set up without LOCAL_RANK;
    # vLLM runs in the one DeepSpeed made (world size 1). In a run they are processes apart.
    trainer = DeepSpeedPolicyEngine(str(model_dir), micro_batch_size=8, lr=1e-2, seed=0)
    engine = VllmGenerationEngine(model_dir, seed=0, max_new_tokens=8, temperature=1.0, top_p=1.0, max_model_len=128)
    try:
        before = table_of(engine.sample(PROMPTS, sample_seeds(0, "before", PROMPTS, 2)))
        initial = sequence_logprobs(trainer, before)
        assert gap(initial, before.column("logprobs").to_pylist()) < TOL
        m = trainer.train_step(before, grpo_advantages(before, 2))
        assert m["nonfinite_skipped"] == 0.0 and m["is_weight"] == pytest.approx(1.0, abs=1e-5)
        engine.load_weights(trainer.export_weights())
        after = table_of(engine.sample(PROMPTS, sample_seeds(0, "after", PROMPTS, 2)))
        trained = sequence_logprobs(trainer, after)
        assert gap(trained, after.column("logprobs").to_pylist()) < TOL
        assert gap(sequence_logprobs(trainer, before), initial) > 1e-4   # the update moved the policy
        trainer.save(str(tmp_path / "ckpt"))
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
        rows = after.select(["prompt_ids", "response_ids"]).to_pylist()
        with torch.no_grad():
            for row, lp in zip(rows, trained):
                ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
                logp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
                start = len(row["prompt_ids"]) - 1
                got = [logp[start + i, t].item() for i, t in enumerate(row["response_ids"])]
                assert max(abs(a - b) for a, b in zip(got, lp)) < TOL
    finally:
        trainer.close()
        engine.close()
