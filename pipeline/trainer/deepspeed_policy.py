"""The DeepSpeed policy engine: one clipped policy update per trajectory table.

The advantages come with the table (GRPO's from the trainer actor, PPO's from
the critic); DeepSpeed's set-up and the micro-batch update are
pipeline/trainer/deepspeed_base.py's.
"""
from __future__ import annotations

import contextlib
import copy
import shutil
import time
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.algos.distill_topk import topk_kl
from pipeline.algos.policy_loss import PolicyLoss
from pipeline.config import Config
from pipeline.weights import lora as adapters
from pipeline.core.data_parallel import Rendezvous, Shard, batch_shards, row_lengths, trained_tokens
from pipeline.trainer.deepspeed_base import DeepSpeedEngine, full_params
from pipeline.trainer.rows import collate, pack_window, teacher_topk, trajectory_rows
from pipeline.trainer.vision import PROCESSOR_FILES, Pixels, freeze_vision, load_policy_model
from pipeline.inputs.models import TOKENIZER_FILES, is_vision_model
from pipeline.core.spans import span
from pipeline.moe.replay import install_replay, replaying
from pipeline.moe.routes import route_layout


ENTROPY_CHUNK = 64   # positions per slice of the entropy metric


class DeepSpeedPolicyEngine(DeepSpeedEngine):
    """TrainingEngine (pipeline/core/types.py) on a DeepSpeed-wrapped HF causal LM:
    model.path trained as the recipe's training and policy_loss sections say.

    It scores at generation.temperature, the generator's. With a KL (policy_loss's
    in the loss, or reward_kl's in the rewards) a frozen copy of the initial
    weights is the KL reference. With training.lora only peft adapters are
    trained, and the weights it exports, saves and restores are the adapter's;
    the KL reference is then the base model itself, adapters switched off.
    A vision-language model scores its samples with their pictures
    (pipeline/trainer/vision.py); with model.freeze_vision its vision tower and
    projector are not trained, and neither exported nor sent to the generators.
    """

    def __init__(self, cfg: Config, rank: int = 0, rendezvous: Rendezvous | None = None):
        t = cfg.training
        # horizon: the longest response a sample can have.
        self.loss = PolicyLoss(cfg.policy_loss, horizon=cfg.generation.max_new_tokens * cfg.env.max_turns)
        self.reference = cfg.policy_loss.kl_coef > 0 or cfg.reward_kl.coef > 0
        self.epochs, self.mini_batches, self.group_size = t.epochs, t.mini_batches, cfg.schedule.group_size
        self.updates_per_batch = t.epochs * t.mini_batches
        self.lora = t.lora if t.lora.rank else None
        # distill.loss topk_kl: a loss term beside the policy's (pipeline/algos/distill_topk.py).
        self.distill = cfg.distill if cfg.distill.teacher and cfg.distill.loss == "topk_kl" else None
        self.trainable_only = self.lora is not None
        # vLLM reports logprobs of the temperature-scaled distribution; ours must match.
        self.temperature = cfg.generation.temperature
        self.routes = route_layout(cfg.model.path) if t.routing_replay else None
        self.freeze_vision = cfg.model.freeze_vision
        # Of a vision-language model (set by _build_model, once the directory is checked): its pictures'
        # pixels, the tokens the engine never samples (VllmGenerationEngine._params), the weights frozen.
        self.pixels: Pixels | None = None
        self.unsampled: list[int] = []
        self.frozen: frozenset[str] = frozenset()
        super().__init__(cfg, cfg.model.path, t.lr, rank, rendezvous)
        if self.ref is not None:
            self.ref.to(self.device)

    def _build_model(self) -> torch.nn.Module:
        model = load_policy_model(self.model_path)
        model.config.use_cache = False
        if is_vision_model(self.model_path):
            self.pixels = Pixels(self.model_path)
            self.unsampled = list(self.pixels.placeholders)
            if self.freeze_vision:
                self.frozen = freeze_vision(model)
        # eval(): no dropout, so the logprobs match the generator's and `old` is exact.
        model.eval()
        if self.routes is not None:
            install_replay(model, self.routes)
        compute_dtype = torch.bfloat16 if self.dtype == "bf16" else torch.float32
        self.ref = None
        if self.lora is not None:
            model = adapters.wrap(model, self.lora, self.model_path)
            model.eval()
            if self.lora.dropout > 0:
                for name, module in model.named_modules():
                    if name.endswith("lora_dropout.default"):
                        module.train()
            return model
        if self.reference:
            # Copied before deepspeed.initialize, which partitions parameters under ZeRO-3.
            self.ref = copy.deepcopy(model).to(compute_dtype).requires_grad_(False)
            if self.routes is not None:
                install_replay(self.ref, self.routes)
        return model

    def token_logprobs(self, model, batch: dict, entropy: bool = False):
        """`model`'s logprob of each token in a collated batch's response window
        (pipeline.trainer.rows.collate, padded or packed), at the sampling
        temperature; with `entropy`, (logprobs, each position's entropy), the
        entropy with a gradient only when the loss has an entropy bonus."""
        scores = self._scores(model, batch, entropy)
        return (scores["lp"], scores["entropy"]) if entropy else scores["lp"]

    def _scores(self, model, batch: dict, entropy: bool) -> dict[str, torch.Tensor]:
        """token_logprobs' as {"lp", "entropy"}, and where the batch holds a teacher's
        top-k ids, "topk": the model's logprobs at them, [rows, window, k]."""
        ids = batch["ids"]
        with self.replaying(batch):
            if "positions" in batch:
                # Packed: the logits of the kept positions only, [K, V]; laid out in the window below.
                out = model(input_ids=ids, position_ids=batch["positions"], use_cache=False,
                            logits_to_keep=batch["keep"])
                logits, targets = out.logits[0].float() / self.temperature, batch["targets"]
            else:
                start = batch["start"]
                pictures = self.pixels.inputs(batch["images"], ids) if "images" in batch else {}
                out = model(input_ids=ids, attention_mask=batch["attn"], use_cache=False,
                            logits_to_keep=ids.shape[1] - start, **pictures)
                logits, targets = out.logits[:, :-1].float() / self.temperature, ids[:, start + 1:]
        if self.unsampled:
            # The float's lowest, not -inf: its probability is 0 all the same, and p log p stays 0 for the entropy.
            logits = logits.index_fill(-1, torch.tensor(self.unsampled, device=logits.device),
                                       torch.finfo(logits.dtype).min)
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        out = {"lp": self._in_window(lp, batch)}
        if "topk_ids" in batch:
            top = batch["topk_ids"]
            if "positions" in batch:  # the kept positions' ids, in the order of logp's rows
                top = top.view(-1, top.shape[-1])[batch["slots"]]
            out["topk"] = self._in_window(logp.gather(-1, top), batch)
        if not entropy:
            return out
        if torch.is_grad_enabled() and self.loss.options.entropy_coef > 0:
            ent = -(logp.exp() * logp).sum(dim=-1)
        else:
            # Only a metric: a few positions at a time, so that p * log p never holds a
            # second (batch, length, vocabulary) tensor beside logp (150k-token vocabularies).
            with torch.no_grad():
                dim = logp.dim() - 2
                ent = torch.cat([-(part.exp() * part).sum(dim=-1) for part in logp.split(ENTROPY_CHUNK, dim=dim)],
                                dim=dim)
        return {**out, "entropy": self._in_window(ent, batch)}

    def replaying(self, batch: dict, apply: bool = True):
        """With training.routing_replay, forwards inside replay the batch's routes
        (pipeline/moe/replay.py; `apply` False: only count the flips); yields the Replay or None."""
        return replaying(self.routes, batch, apply) if self.routes is not None else contextlib.nullcontext()

    def _window_outputs(self, batch: dict) -> torch.Tensor:
        return self.token_logprobs(self.engine, batch)

    @staticmethod
    def _in_window(values: torch.Tensor, batch: dict) -> torch.Tensor:
        return pack_window(values, batch) if "positions" in batch else values

    def _loss(self, batch: dict, shard: Shard) -> tuple[torch.Tensor, dict[str, float]]:
        with span("train.forward"), self.replaying(batch) as replay:
            scores = self._scores(self.engine, batch, entropy=True)
        lp = scores["lp"]
        options = self.loss.options
        ref = self._reference(batch) if options.kl_coef > 0 else None
        # Decoupled (AReaL): the proximal policy is the one before this step's first update: lp
        # itself with one update per batch, else scored before it; classic PPO clips against
        # the behaviour policy.
        proximal = batch["gen"] if not options.decoupled else batch["old"] if "old" in batch else lp.detach()
        counts = {"num_tokens": max(shard.batch_tokens, 1), "num_seqs": max(shard.batch_seqs, 1)}
        loss, metrics = self.loss(lp, proximal, batch["gen"], batch["adv"], batch["train_mask"], ref_logprobs=ref,
                                  entropy=scores["entropy"], **counts)
        if replay is not None:
            metrics["route_flips"] = replay.flip_share
        if self.distill is None:
            return loss, metrics
        d, mask = self.distill, batch["train_mask"]
        kl = topk_kl(scores["topk"], batch["topk_logprobs"], mask, d.kl_type, d.mixed_kl_weight)
        with torch.no_grad():
            metrics["distill/topk_kl"] = float(kl.sum() / mask.sum().clamp(min=1))
        return loss + d.coef * self.loss.aggregated(kl, mask, **counts), metrics

    @torch.no_grad()
    def _reference(self, batch: dict) -> torch.Tensor:
        """The KL reference's logprobs: the frozen initial weights, or with LoRA the base model (adapters off)."""
        if self.ref is not None:
            return self.token_logprobs(self.ref, batch)
        if self.lora is None or not self.reference:
            raise RuntimeError("this engine was built without a KL reference")
        with self.engine.module.disable_adapter():
            return self.token_logprobs(self.engine, batch)

    def reference_logprobs(self, table: pa.Table) -> list[list[float]]:
        """Each row's response-token logprobs under the KL reference, micro-batch
        by micro-batch (REINFORCE++'s KL in the reward: pipeline/algos/advantages.py)."""
        rows = trajectory_rows(table)
        out: list[list[float]] = [[] for _ in rows]
        for idx in self._chunks(rows):
            batch = collate([rows[i] for i in idx], self.device, {}, self.batching.packed)
            lp = self._reference(batch)
            for j, i in enumerate(idx):  # a token budget takes rows out of table order
                out[i] = lp[j][batch["mask"][j]].float().tolist()
        return out

    def _rows(self, table: pa.Table, per_token: pa.Table, columns: tuple[str, ...],
              shard: Shard | None) -> list[dict]:
        """The base's rows, each with its teacher's top-k under distill.loss topk_kl."""
        rows = super()._rows(table, per_token, columns, shard)
        if self.distill is not None:
            teacher_topk(table if shard is None else table.slice(shard.start, shard.stop - shard.start), rows)
        return rows

    def train_step(self, table: pa.Table, advantages: pa.Table, shard: Shard | None = None) -> dict[str, float]:
        """The policy's updates on the table: clipped ratio plus the IS
        correction (pipeline.algos.policy_loss.PolicyLoss); one, or
        `epochs` passes over `mini_batches` mini-batches of whole prompt groups
        (updates_per_batch optimizer steps).

        `advantages` is aligned row by row with `table`; its `advantages`
        column holds one float per response token (pipeline.algos.advantages or the
        critic's pipeline.algos.ppo table). `shard` is this rank's part of the
        table for one update; several updates shard each mini-batch themselves.

        Metrics: loss (token mean over the table), grad_norm (before clipping),
        tokens (response tokens), clip_frac / is_weight / kl / ratio (token
        means, see PolicyLoss), micro_batches, step (optimizer steps
        so far), time_s; with several updates, the means over them, and
        `updates`.
        """
        t0 = time.perf_counter()
        keys = {"gen": "logprobs", "adv": "advantages"}
        if self.updates_per_batch == 1:
            rows = self._rows(table, advantages, ("advantages",), shard)
            metrics = self._update(rows, keys, shard)
        else:
            plans = [(self._rows(t, a, ("advantages",), s), s) for t, a, s in self._mini_batches(table, advantages)]
            with span("train.old_logprobs"):
                for rows, s in plans:
                    self._score_old(rows, s)
            results = [self._update(rows, {**keys, "old": "old"}, s)
                       for _ in range(self.epochs) for rows, s in plans]
            metrics = _over_updates(results, self.epochs)
        return {**metrics, "step": float(self.steps), "time_s": time.perf_counter() - t0}

    def _mini_batches(self, table: pa.Table, advantages: pa.Table):
        """(table, advantages, this rank's Shard) of each mini-batch: contiguous
        runs of whole groups, as even as groups allow, each sharded over the ranks."""
        groups = table.num_rows // self.group_size
        if table.num_rows % self.group_size or groups < self.mini_batches * self.world_size:
            raise ValueError(f"{table.num_rows} rows in groups of {self.group_size} cannot make "
                             f"{self.mini_batches} mini-batches of whole groups for {self.world_size} rank(s)")
        start = 0
        for k in range(self.mini_batches):
            stop = start + (groups // self.mini_batches + (k < groups % self.mini_batches)) * self.group_size
            part, adv = table.slice(start, stop - start), advantages.slice(start, stop - start)
            yield part, adv, batch_shards(trained_tokens(part), self.group_size, self.world_size,
                                          self.batching, row_lengths(part))[self.rank]
            start = stop

    @torch.no_grad()
    def _score_old(self, rows: list[dict], shard: Shard) -> None:
        """Each row's logprobs under the weights before the first update, as row["old"]:
        micro-batch by micro-batch as the update will run, so that the ranks' gathers
        (ZeRO-3) pair up."""
        for idx in self._lockstep_chunks(rows, shard):
            chunk = [rows[i] for i in idx] if idx is not None else rows[:1]
            batch = collate(chunk, self.device, {}, self.batching.packed)
            lp = self.token_logprobs(self.engine, batch)
            if idx is None:
                continue
            for j, row in enumerate(chunk):
                row["old"] = lp[j][batch["mask"][j]].float().tolist()

    def _synced(self) -> dict[str, torch.Tensor]:
        """With LoRA the adapter's tensors, under peft's saved names; else every weight
        but a frozen vision tower's, which the generators already hold."""
        if self.lora is not None:
            return adapters.adapter_state(self.engine.module)
        return {name: t for name, t in super()._synced().items() if name not in self.frozen}

    def save(self, path: str) -> None:
        """An HF checkpoint of the current weights (with LoRA: the peft adapter
        directory, naming its base model), with the model directory's tokenizer
        files, written by rank 0; every rank calls it (ZeRO-3 gathers). Refused,
        on every rank and before anything is written, when a weight holds a NaN or inf."""
        out = Path(path)
        self.refuse_nonfinite(f"the policy checkpoint {path}")
        state = self.export_weights()
        if self.lora is not None:
            if self.rank == 0:
                adapters.write_adapter(out, state, adapters.adapter_config(self.lora, self.model_path))
        else:
            with full_params(self.deepspeed, self.engine.module, self.zero_stage):
                if self.rank == 0:
                    out.mkdir(parents=True, exist_ok=True)
                    # The frozen vision tower is not exported, but a checkpoint holds the whole model.
                    whole = {name: t for name, t in self.engine.module.state_dict().items() if name in self.frozen}
                    self.engine.module.save_pretrained(out, state_dict={**whole, **state})
        if self.rank != 0:
            return
        for name in (*TOKENIZER_FILES, *PROCESSOR_FILES):
            if (self.model_path / name).is_file():
                shutil.copy2(self.model_path / name, out / name)


def _over_updates(results: list[dict[str, float]], epochs: int) -> dict[str, float]:
    """One step's metrics from its updates: their means; the batch's tokens,
    micro-batches summed, a skip if any update skipped, the last update's rate."""
    out = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
    out.update(micro_batches=sum(r["micro_batches"] for r in results), updates=float(len(results)),
               nonfinite_skipped=max(r["nonfinite_skipped"] for r in results), lr=results[-1]["lr"],
               tokens=sum(r["tokens"] for r in results) / epochs)
    return out
