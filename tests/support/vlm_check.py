"""The tiny Qwen2-VL through vLLM and the trainer, in a process of its own
(tests/trainer/test_vlm.py; why a process: tests/support/architecture_check.py).
Writes what it measured as JSON. With `lora` the trainer trains a rank-8
adapter, vLLM serves it, and the checkpoint is the adapter merged by
`python -m pipeline export`.

    python -m tests.support.vlm_check OUT_DIR [freeze_vision] [lora]
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
from pipeline.inputs.datasets import ChatTemplate, load_prompts
from pipeline.inputs.tiny_vlm import build_tiny_vlm, write_digit_data
from tests.support.architecture_check import gap
from tests.support.training_helpers import engine_config, sequence_logprobs


def table_of(prompts: list[Prompt], groups) -> pa.Table:
    rows = [dict(batch_id="b", target=0, version=0, prompt_id=prompts[g].id, prompt_ids=list(c.prompt_ids),
                 response_ids=list(c.response_ids), logprobs=list(c.logprobs), text=c.text,
                 reward=float(j), images=list(prompts[g].images))
            for g, group in enumerate(groups) for j, c in enumerate(group)]
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def hf_logprobs(model, pixels, table: pa.Table) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for row in table.select(["prompt_ids", "response_ids", "images"]).to_pylist():
            ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
            logits = model(input_ids=ids, **pixels.inputs([row["images"]], ids)).logits[0].float()
            logits[:, list(pixels.placeholders)] = float("-inf")   # never sampled (placeholder_token_ids)
            logp = torch.log_softmax(logits, dim=-1)
            start = len(row["prompt_ids"]) - 1
            out.append([logp[start + i, t].item() for i, t in enumerate(row["response_ids"])])
    return out


def vision_state(weights: dict) -> dict:
    return {name: t.clone() for name, t in weights.items() if ".visual." in f".{name}"}


def measure(out_dir: Path, freeze: bool, adapter: bool) -> dict:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from pipeline.config import LoraConfig
    from pipeline.generator.vllm_engine import VllmGenerationEngine
    from pipeline.tools.export import export_merged
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    from pipeline.trainer.vision import Pixels
    from pipeline.weights import lora
    torch.set_num_threads(1)
    model_dir = build_tiny_vlm(out_dir / "model", warmup_steps=0)
    train_path, _ = write_digit_data(out_dir / "data", n_train=4, n_val=1)
    prompts = load_prompts(train_path, chat=ChatTemplate(AutoTokenizer.from_pretrained(model_dir)))[:3]
    lora_cfg = LoraConfig(rank=8 if adapter else 0)  # the default targets, lm_head among them
    trainer = DeepSpeedPolicyEngine(engine_config(model_dir, f"training.lr={5e-2 if adapter else 1e-2}",
                                                  f"model.freeze_vision={freeze}", f"training.lora.rank={lora_cfg.rank}"))
    engine = VllmGenerationEngine(model_dir, seed=0, max_new_tokens=8, temperature=1.0, top_p=1.0, max_model_len=128,
                                  adapter_config=lora.adapter_config(lora_cfg, model_dir) if adapter else None)
    try:
        vision_before = vision_state(trainer.live_weights() if not freeze else dict(trainer.engine.module.state_dict()))
        before = table_of(prompts, sample_all(engine, prompts, sample_seeds(0, "before", prompts, 2)))
        initial = sequence_logprobs(trainer, before)
        # The same prompt ids without their pictures: the pictures must move the logprobs.
        blind = sequence_logprobs(trainer, before.drop_columns(["images"]))
        m = trainer.train_step(before, critic_free_advantages(before, 2))
        exported = trainer.export_weights()
        engine.load_weights(exported)
        after = table_of(prompts, sample_all(engine, prompts, sample_seeds(0, "after", prompts, 2)))
        trained = sequence_logprobs(trainer, after)
        trainer.save(str(out_dir / "ckpt"))
        hf_dir = export_merged(out_dir / "ckpt", out_dir / "merged") if adapter else out_dir / "ckpt"
        hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
        vision_after = vision_state(dict(trainer.engine.module.state_dict()))
        return {"before": gap(initial, before.column("logprobs").to_pylist()),
                "pictures_matter": gap(initial, blind),
                "placeholders": before.column("prompt_ids").to_pylist()[0].count(
                    json.loads((model_dir / "config.json").read_text())["image_token_id"]),
                "is_weight": m["is_weight"], "nonfinite_skipped": m["nonfinite_skipped"],
                "moved": gap(sequence_logprobs(trainer, before), initial),
                "vision_moved": max((vision_after[k] - vision_before[k]).abs().max().item() for k in vision_before),
                "vision_exported": sum(".visual." in f".{name}" for name in exported),
                "exported": len(exported), "adapter_exported": lora.is_adapter(exported),
                "lm_head_exported": sum(".lm_head." in name for name in exported),
                "after_refit": gap(trained, after.column("logprobs").to_pylist()),
                "checkpoint": gap(hf_logprobs(hf, Pixels(hf_dir), after), trained)}
    finally:
        trainer.close()
        engine.close()


if __name__ == "__main__":
    out, freeze = Path(sys.argv[1]), (sys.argv[2:] or ["true"])[0] == "true"
    (out / "measured.json").write_text(json.dumps(measure(out, freeze, adapter="lora" in sys.argv[3:])))
