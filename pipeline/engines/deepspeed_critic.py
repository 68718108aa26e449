"""The PPO critic on DeepSpeed: an HF causal LM's backbone plus a linear value head.

Same DeepSpeed set-up as the policy (pipeline/engines/deepspeed_policy.py helpers):
one process, world size 1, gloo on CPU, torch AdamW, one optimizer step per
table however many micro-batches it takes.
"""
from __future__ import annotations

import random
import time

import pyarrow as pa
import torch

from pipeline.algos.ppo import value_loss
from pipeline.engines.deepspeed_policy import (
    _check_model_dir,
    _rows,
    collate,
    cpu_state_dict,
    ds_config,
    initialize,
    load_engine_state,
    save_engine_state,
    start_deepspeed,
    step_with_grad_norm,
    token_column,
)


class ValueModel(torch.nn.Module):
    """backbone (the causal LM without its LM head) -> hidden states -> Linear(hidden, 1).

    The head starts at zero, so the first values are 0 and the first
    advantages are the plain returns: no random critic noise in early steps.
    """

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               use_cache=False).last_hidden_state
        # Positions start .. L-2: the window of pipeline.engines.deepspeed_policy.collate.
        return self.value_head(hidden[:, start:-1]).squeeze(-1).float()


class DeepSpeedCriticEngine:
    """Values of response tokens and the clipped value-loss update.

    Which state a value belongs to: V_t, the value of response token t, is the
    head's output at position P + t - 1 (P = prompt length), the last position
    before token t. That hidden state has seen the prompt and response[:t],
    i.e. the state in which the policy chooses token t, and it is the position
    whose logits give token t's logprob, so values, logprobs and advantages
    share one window. For t = 0 it is the last prompt token. The state after
    the last token is terminal (V = 0, see pipeline.algos.ppo.gae) and gets no value.
    """

    def __init__(self, model_path: str, *, zero_stage: int = 0, dtype: str = "fp32",
                 micro_batch_size: int = 8, grad_accum: int = 1, lr: float = 1e-4,
                 value_clip: float = 0.2, seed: int = 0, weight_decay: float = 0.0,
                 num_threads: int | None = 1):
        self.ds_config = ds_config(micro_batch_size=micro_batch_size, grad_accum=grad_accum, lr=lr,
                                   weight_decay=weight_decay, zero_stage=zero_stage, dtype=dtype)
        self.model_path = _check_model_dir(model_path)
        self.zero_stage, self.dtype = zero_stage, dtype
        self.micro_batch_size, self.value_clip = micro_batch_size, value_clip
        self.deepspeed, _ = start_deepspeed(num_threads)
        random.seed(seed)
        torch.manual_seed(seed)

        from transformers import AutoModelForCausalLM
        lm = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        lm.config.use_cache = False
        # base_model is the decoder stack (Llama: lm.model); the LM head is dropped.
        model = ValueModel(lm.base_model, lm.config.hidden_size)
        del lm
        model.eval()  # no dropout: the old values and the first pass agree exactly
        self.engine = initialize(self.deepspeed, model, self.ds_config)
        self.device = self.engine.device

    @property
    def steps(self) -> int:
        """Optimizer steps taken (one per train_step)."""
        return int(self.engine.global_steps)

    def _chunks(self, n: int) -> list[range]:
        return [range(i, min(i + self.micro_batch_size, n)) for i in range(0, n, self.micro_batch_size)]

    def values(self, table: pa.Table) -> list[list[float]]:
        """V_t for every response token of every row (no update)."""
        rows = table.select(["prompt_ids", "response_ids"]).to_pylist()
        out: list[list[float]] = []
        with torch.no_grad():
            for idx in self._chunks(len(rows)):
                batch = collate([rows[i] for i in idx], self.device, token_keys={})
                v = self.engine(batch["ids"], batch["attn"], batch["start"])
                out += [v[j][batch["mask"][j]].tolist() for j in range(len(idx))]
        return out

    def train_step(self, table: pa.Table, targets: pa.Table) -> dict[str, float]:
        """One clipped value-loss step (pipeline.algos.ppo.value_loss) towards the
        `returns` column of `targets`, clipped around its `values` column (the
        values the advantages were computed with). `targets` is aligned row by
        row with `table`, one float per response token.

        Metrics: value_loss (token mean), value_clip_frac, grad_norm, tokens,
        step, time_s. (The critic worker adds the statistics of the values and
        returns, which it already holds.)
        """
        t0 = time.perf_counter()
        rows = _rows(table, 1)
        for key in ("returns", "values"):
            for row, col in zip(rows, token_column(targets, key, rows)):
                row[key] = col
        tokens = sum(len(r["response_ids"]) for r in rows)
        chunks = self._chunks(len(rows))
        loss_sum = clip_sum = 0.0
        keys = {"returns": "returns", "old": "values"}
        for k, idx in enumerate(chunks):
            self.engine.set_gradient_accumulation_boundary(k == len(chunks) - 1)
            batch = collate([rows[i] for i in idx], self.device, keys)
            v = self.engine(batch["ids"], batch["attn"], batch["start"])
            loss, m = value_loss(v, batch["old"], batch["returns"], batch["mask"], clip=self.value_clip,
                                 num_tokens=max(tokens, 1))
            self.engine.backward(loss, scale_wrt_gas=False)
            loss_sum += loss.item()
            clip_sum += m["clip_frac"] * m["tokens"]
        grad_norm = step_with_grad_norm(self.engine, self.zero_stage, self.dtype)
        return {
            "value_loss": loss_sum,
            "value_clip_frac": clip_sum / max(tokens, 1),
            "grad_norm": grad_norm,
            "tokens": float(tokens),
            "step": float(self.steps),
            "time_s": time.perf_counter() - t0,
        }

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The backbone and head's state dict (backbone.* and value_head.*), CPU copies."""
        return cpu_state_dict(self.deepspeed, self.engine.module, self.zero_stage)

    def save_state(self, path: str) -> None:
        """Weights, value head, optimizer state, step counter and RNG (a DeepSpeed checkpoint)."""
        save_engine_state(self.engine, path)

    def load_state(self, path: str) -> None:
        """Restore save_state's directory into this engine (built with the same config)."""
        load_engine_state(self.engine, path)

    def close(self) -> None:
        self.engine.destroy()
