"""The PPO critic on DeepSpeed: an HF causal LM's backbone plus a linear value head.

DeepSpeed's set-up and the micro-batch update are pipeline/trainer/deepspeed_base.py's,
as for the policy: one process, one optimizer step per table.
"""
from __future__ import annotations

import time

import pyarrow as pa
import torch

from pipeline.algos.ppo import value_loss
from pipeline.config import Config
from pipeline.core.data_parallel import Rendezvous, Shard
from pipeline.trainer.deepspeed_base import DeepSpeedEngine
from pipeline.trainer.rows import collate, pack_window


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

    def forward(self, batch: dict, probe: bool = False) -> torch.Tensor:
        """V of every position of a collated batch's response window (pipeline.trainer.rows.collate).
        `probe`: the hidden state's mean instead, for the packing check (the head starts at zero)."""
        head = (lambda h: h.mean(-1, keepdim=True)) if probe else self.value_head
        if "positions" in batch:
            hidden = self.backbone(input_ids=batch["ids"], position_ids=batch["positions"],
                                   use_cache=False).last_hidden_state
            return pack_window(head(hidden[0, batch["keep"]]).squeeze(-1).float(), batch)
        hidden = self.backbone(input_ids=batch["ids"], attention_mask=batch["attn"], use_cache=False).last_hidden_state
        # Positions start .. L-2: the window.
        return head(hidden[:, batch["start"]:-1]).squeeze(-1).float()


class DeepSpeedCriticEngine(DeepSpeedEngine):
    """Values of response tokens and the clipped value-loss update.

    Which state a value belongs to: V_t, the value of response token t, is the
    head's output at position P + t - 1 (P = prompt length), the last position
    before token t. That hidden state has seen the prompt and response[:t],
    i.e. the state in which the policy chooses token t, and it is the position
    whose logits give token t's logprob, so values, logprobs and advantages
    share one window. For t = 0 it is the last prompt token. The state after
    the last token is terminal (V = 0, see pipeline.algos.ppo.gae) and gets no value.
    """

    def __init__(self, cfg: Config, rank: int = 0, rendezvous: Rendezvous | None = None):
        """Rank `rank` of the critic's data-parallel group: ppo.critic_model (or
        model.path) at ppo.critic_lr, as the recipe's training and ppo sections say."""
        self.value_clip = cfg.ppo.value_clip
        # The learning-rate schedule counts batches: epochs optimizer steps make one.
        self.epochs = self.updates_per_batch = cfg.ppo.critic_epochs
        super().__init__(cfg, cfg.ppo.critic_model or cfg.model.path, cfg.ppo.critic_lr, rank, rendezvous)

    def _build_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM
        lm = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        lm.config.use_cache = False
        # base_model is the decoder stack (Llama: lm.model); the LM head is dropped.
        model = ValueModel(lm.base_model, lm.config.hidden_size)
        del lm
        model.eval()  # no dropout: the old values and the first pass agree exactly
        return model

    def values(self, table: pa.Table, shard: Shard | None = None) -> list[list[float]]:
        """V_t for every response token of every row (no update). With a shard,
        as many forward passes as it says: under ZeRO-3 each gathers parameters
        together with the other ranks' passes. `table` is the whole batch; a shard's
        values are those of its rows."""
        if shard is not None:
            table = table.slice(shard.start, shard.stop - shard.start)
        rows = table.select(["prompt_ids", "response_ids"]).to_pylist()
        chunks = self._chunks(rows)
        extra = 0 if shard is None else shard.micro_batches - len(chunks)
        out: list[list[float]] = [[] for _ in rows]
        with torch.no_grad():
            for idx in chunks:
                batch = collate([rows[i] for i in idx], self.device, {}, self.batching.packed)
                v = self.engine(batch)
                for j, i in enumerate(idx):  # a token budget takes rows out of table order
                    out[i] = v[j][batch["mask"][j]].tolist()
            for _ in range(extra):
                self.engine(collate(rows[:1], self.device, {}, self.batching.packed))
        return out

    def _window_outputs(self, batch: dict) -> torch.Tensor:
        return self.engine(batch, probe=True)

    def _loss(self, batch: dict, shard: Shard) -> tuple[torch.Tensor, dict[str, float]]:
        v = self.engine(batch)
        return value_loss(v, batch["old"], batch["returns"], batch["train_mask"], clip=self.value_clip,
                          num_tokens=max(shard.batch_tokens, 1))

    def train_step(self, table: pa.Table, targets: pa.Table, shard: Shard | None = None) -> dict[str, float]:
        """`epochs` clipped value-loss steps (pipeline.algos.ppo.value_loss) over the
        whole table towards the `returns` column of `targets`, each clipped
        around its `values` column (the values the advantages were computed
        with, so later epochs stay near them too). `targets` is aligned row by
        row with `table`, one float per response token.

        Metrics: value_loss (token mean), value_clip_frac, grad_norm: means over
        the epochs; nonfinite_skipped (1 if any epoch skipped, see
        DeepSpeedEngine._update), tokens, step, time_s. (The critic worker adds
        the statistics of the values and returns, which it already holds.)
        """
        t0 = time.perf_counter()
        rows = self._rows(table, targets, ("returns", "values"), shard)
        runs = [self._update(rows, {"returns": "returns", "old": "values"}, shard) for _ in range(self.epochs)]
        return {
            "value_loss": sum(m["loss"] for m in runs) / len(runs),
            "value_clip_frac": sum(m["clip_frac"] for m in runs) / len(runs),
            "grad_norm": sum(m["grad_norm"] for m in runs) / len(runs),
            "nonfinite_skipped": max(m["nonfinite_skipped"] for m in runs),
            "tokens": runs[0]["tokens"],
            "step": float(self.steps),
            "time_s": time.perf_counter() - t0,
        }
