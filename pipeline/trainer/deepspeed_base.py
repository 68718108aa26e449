"""What the DeepSpeed policy and critic engines share: DeepSpeed's set-up, the
micro-batch update, weights and checkpoint state (the table's rows and their
collation: pipeline/trainer/rows.py).

The engines (pipeline/trainer/deepspeed_policy.py, deepspeed_critic.py) are
DeepSpeedEngine subclasses that build their model and compute their loss.

Each rank is one process (a Ray actor): torch.distributed over the ranks
(world size 1 on a free local port when alone), gloo on CPU, nccl on a GPU. Pinned to deepspeed 0.19.8 because of
the private shared-memory hook below (see DESIGN.md, "DeepSpeed").
"""
from __future__ import annotations

import abc
import contextlib
import datetime
import importlib
import json
import math
import os
import random
import warnings
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.config import Config
from pipeline.core.precision import device_dtype
from pipeline.trainer import finite
from pipeline.trainer.optim import Optimizer, recipe_optimizer, set_lr
from pipeline.core.data_parallel import Batching, Rendezvous, Shard, free_port, without_flight_recorder
from pipeline.inputs.models import check_model_files, is_vision_model
from pipeline.core.memory import frozen_imports
from pipeline.core.spans import span
from pipeline.trainer.rows import collate, packing_gap, token_column, trajectory_rows


def _init_distributed(cuda: bool, rank: int, rendezvous: Rendezvous | None):
    """Import deepspeed and join its process group: world size 1 on a free local
    port, or rank `rank` of `rendezvous`."""
    if not cuda:
        # Read when deepspeed first picks its accelerator, so it must precede the import.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with frozen_imports():
        import deepspeed

    if not cuda:
        # deepspeed compiles a shared-memory all-reduce op on the first backend start
        # (30-110 s on a fresh machine); gloo's all-reduce does the same job for the
        # ranks of a Ray job, which need not share a machine. Private hook of
        # deepspeed 0.19.8. `import deepspeed.comm.torch as m` would bind the *torch*
        # package (deepspeed.comm re-exports it), so look the module up by name.
        ds_torch = importlib.import_module("deepspeed.comm.torch")
        if hasattr(ds_torch, "build_shm_op"):
            ds_torch.build_shm_op = lambda: None
        else:
            warnings.warn(f"deepspeed {deepspeed.__version__} has no deepspeed.comm.torch.build_shm_op "
                          "(written for 0.19.8); the first start may compile a shared-memory op")
    if not torch.distributed.is_initialized():
        without_flight_recorder()
        if rendezvous is None:
            rendezvous = Rendezvous("127.0.0.1", free_port("127.0.0.1"), 1)
        # A Ray actor sees only its own GPUs (CUDA_VISIBLE_DEVICES), so its device is 0.
        os.environ.update(MASTER_ADDR=rendezvous.host, MASTER_PORT=str(rendezvous.port), RANK=str(rank),
                          LOCAL_RANK="0", WORLD_SIZE=str(rendezvous.world_size))
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(seconds=rendezvous.timeout_s))
    return deepspeed


def start_deepspeed(num_threads: int | None, rank: int = 0, rendezvous: Rendezvous | None = None):
    """Threads, device and the process group; returns the deepspeed module."""
    cuda = torch.cuda.is_available()
    if not cuda and num_threads:
        torch.set_num_threads(num_threads)  # more threads on a shared 2-core box is slower
    if cuda:
        torch.cuda.set_device(0)
    return _init_distributed(cuda, rank, rendezvous)


def ds_config(*, micro_batch_size: int, lr: float, optimizer: Optimizer, zero_stage: int, dtype: str) -> dict:
    """DeepSpeed's config for a training section's values (dtype resolved: fp32 or bf16)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_clipping": optimizer.grad_clip,
        # torch_adam: deepspeed's default FusedAdam / CPUAdam are C++ ops compiled
        # on first use; torch's AdamW needs no build.
        "optimizer": {"type": "AdamW", "params": {
            "lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
            "weight_decay": optimizer.weight_decay, "torch_adam": True}},
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def initialize(deepspeed, model: torch.nn.Module, config: dict):
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
    optimizer = engine.optimizer
    if type(optimizer).__name__ == "FP16_UnfusedOptimizer":
        # bf16 without ZeRO: deepspeed's wrapper creates Adam's state by stepping
        # once on zero gradients, so the first real step used step-2 bias
        # correction (0.74x the update). Empty state re-initialises lazily.
        optimizer.optimizer.state.clear()
    return engine


def local_grad_norm(module: torch.nn.Module) -> float:
    sq = [p.grad.detach().float().pow(2).sum() for p in module.parameters() if p.grad is not None]
    return float(torch.stack(sq).sum().sqrt()) if sq else 0.0


def step_with_grad_norm(engine, zero_stage: int, loss_finite: bool = True,
                        world_size: int = 1) -> tuple[float, bool]:
    """engine.step(), unless the loss (`loss_finite`: this rank's) or a gradient is
    non-finite on any rank: then every rank skips the update (finite.step).
    Returns the gradient norm before clipping and whether the update was skipped."""
    pre_norm = local_grad_norm(engine.module) if zero_stage == 0 else None
    grads_finite = finite.gradients_finite(engine, zero_stage, pre_norm)
    skipped = finite.step(engine, skip=not finite.agree(loss_finite and grads_finite, world_size, engine.device))
    grad_norm = engine.get_global_grad_norm()
    if grad_norm is None:  # deepspeed records no norm for plain fp32 without ZeRO
        grad_norm = pre_norm
    grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    if not grads_finite and math.isfinite(grad_norm):
        grad_norm = float("nan")  # a wrapper's stand-in for a norm it would not compute
    return grad_norm, skipped


@contextlib.contextmanager
def full_params(deepspeed, module: torch.nn.Module, zero_stage: int, trainable_only: bool = False):
    """Under ZeRO-3 each parameter is a partition; gather the full tensors (of
    the trainable ones only: `trainable_only`)."""
    if zero_stage == 3:
        params = [p for p in module.parameters() if p.requires_grad or not trainable_only]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
    else:
        yield


STATE_TAG = "state"


def save_engine_state(engine, path: str | Path, trainable_only: bool = False) -> None:
    """A DeepSpeed checkpoint in `path`: weights (the trainable ones only:
    `trainable_only`), optimizer moments and step, the global step counter,
    and the torch and Python RNG states."""
    Path(path).mkdir(parents=True, exist_ok=True)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    engine.save_checkpoint(str(path), tag=STATE_TAG, client_state={"dagrl_rng": rng}, save_latest=False,
                           exclude_frozen_parameters=trainable_only)


def load_engine_state(engine, path: str | Path, trainable_only: bool = False) -> None:
    """Undo save_engine_state on an engine built with the same config."""
    where = Path(path) / STATE_TAG
    if not where.is_dir():
        raise FileNotFoundError(f"no engine state in {str(path)!r} (expected {str(where)!r}, "
                                "written by save_state)")
    # Frozen weights were left out of a trainable_only checkpoint: the model built them already.
    loaded, client = engine.load_checkpoint(str(path), tag=STATE_TAG, load_optimizer_states=True,
                                            load_lr_scheduler_states=True, load_module_strict=not trainable_only)
    if loaded is None:
        raise RuntimeError(f"deepspeed could not load the engine state in {str(where)!r}")
    rng = client["dagrl_rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


class DeepSpeedEngine(abc.ABC):
    """A DeepSpeed-wrapped model that takes one optimizer step per table.

    A step covers the whole table in micro-batches of training.micro_batch_size
    rows (or of at most training.max_tokens_per_micro_batch padded tokens:
    data_parallel.Batching), their gradients summed into one optimizer step. A
    subclass builds its model (_build_model, after seeding) and gives a
    micro-batch's loss (_loss).
    """

    def __init__(self, cfg: Config, model_path: str, lr: float, rank: int = 0,
                 rendezvous: Rendezvous | None = None):
        """Rank `rank` of a data-parallel group (`rendezvous`: where the ranks meet) that trains
        `model_path` at rate `lr` as the recipe's training section says."""
        t = cfg.training
        self.lr, self.optimizer = lr, recipe_optimizer(cfg)
        self.zero_stage, self.micro_batch_size = t.zero_stage, t.micro_batch_size
        self.dtype = device_dtype(t.dtype, "training.dtype")
        self.ds_config = ds_config(micro_batch_size=t.micro_batch_size, lr=lr, optimizer=self.optimizer,
                                   zero_stage=t.zero_stage, dtype=self.dtype)
        self.model_path = check_model_files(model_path, own_tokenizer=False)
        self.batching = Batching(t.micro_batch_size, t.max_tokens_per_micro_batch, t.packing)
        self.deepspeed = start_deepspeed(1, rank, rendezvous)
        self.rank, self.world_size = rank, torch.distributed.get_world_size()
        # Every rank starts from the same weights (DeepSpeed does not broadcast them).
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        self.engine = initialize(self.deepspeed, self._build_model(), self.ds_config)
        self.device = self.engine.device
        self.packing_off = ""   # why training.packing fell back to padded micro-batches, if it did
        if t.packing and is_vision_model(self.model_path):
            self.batching = Batching(t.micro_batch_size, t.max_tokens_per_micro_batch)
            self.packing_off = ("a vision-language model's positions come from its pictures' grids row by row "
                                "(multimodal rotary positions), which a packed sequence's do not give; padded instead")
        elif t.packing:
            vocab = json.loads((self.model_path / "config.json").read_text())["vocab_size"]
            gap, leak = packing_gap(self._window_outputs, self.device, vocab)
            if not gap <= 0.1 * leak:
                self.batching = Batching(t.micro_batch_size, t.max_tokens_per_micro_batch)
                self.packing_off = (f"this model's attention does not keep packed rows apart (a probe {gap:.2g} off "
                                    f"its padded forward, {leak:.2g} when rows see each other); padded instead")

    @abc.abstractmethod
    def _build_model(self) -> torch.nn.Module:
        """The module to train, in eval mode (no dropout), fp32 before deepspeed casts it."""

    @abc.abstractmethod
    def _window_outputs(self, batch: dict) -> torch.Tensor:
        """The model's per-position outputs over a collated batch's response window (logprobs, values)."""

    @abc.abstractmethod
    def _loss(self, batch: dict, shard: Shard) -> tuple[torch.Tensor, dict[str, float]]:
        """A collated micro-batch's share of the batch's loss (divided by the
        batch's counts in `shard`: batch_tokens, batch_seqs), and its metrics:
        token means over the micro-batch plus `tokens`, its count."""

    @property
    def steps(self) -> int:
        """Optimizer steps taken (one per train_step)."""
        return int(self.engine.global_steps)

    def _chunks(self, rows: list[dict]) -> list[list[int]]:
        """Row indices of each micro-batch of `rows` (self.batching)."""
        return self.batching.split([len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows])

    def _lockstep_chunks(self, rows: list[dict], shard: Shard) -> list[list[int] | None]:
        """This rank's micro-batches of its rows, padded with None to the shard's
        count: a rank with fewer runs zero-weight micro-batches, since ZeRO-3
        gathers and reduces in every forward and backward, and each must meet the
        other ranks'."""
        chunks: list[list[int] | None] = list(self._chunks(rows))
        if shard.world_size != self.world_size or len(chunks) > shard.micro_batches:
            raise ValueError(f"shard {shard} does not fit this engine (world size {self.world_size}, "
                             f"{len(chunks)} micro-batches of {self.batching})")
        return chunks + [None] * (shard.micro_batches - len(chunks))

    def _rows(self, table: pa.Table, per_token: pa.Table, columns: tuple[str, ...],
              shard: Shard | None) -> list[dict]:
        """The checked rows of the table (of its shard's rows), each with `columns`
        of `per_token` (aligned row by row with the whole table)."""
        if shard is not None:
            table = table.slice(shard.start, shard.stop - shard.start)
            per_token = per_token.slice(shard.start, shard.stop - shard.start)
        with span("train.rows"):
            rows = trajectory_rows(table)
            for column in columns:
                for row, values in zip(rows, token_column(per_token, column, rows)):
                    row[column] = values
        return rows

    def _update(self, rows: list[dict], token_keys: dict[str, str], shard: Shard | None) -> dict[str, float]:
        """One optimizer step over `rows` (this rank's shard); `token_keys` as in collate.

        Returns loss (the batch's token mean), grad_norm (before clipping),
        tokens, micro_batches (this rank's), nonfinite_skipped (1.0 when a NaN or
        inf loss or gradient left the weights and optimizer as they were),
        pad_token_share (the micro-batches' pad positions over all positions the
        forward passes ran on), and the batch's token mean of each of _loss's
        metrics: over every rank, so all ranks return the same.
        """
        tokens = sum(sum(r["loss_mask"]) for r in rows)
        if shard is None:
            shard = Shard(0, len(rows), 0, 1, tokens, len(self._chunks(rows)),
                          sum(1 in r["loss_mask"] for r in rows))
        chunks = self._lockstep_chunks(rows, shard)
        n = max(shard.batch_tokens, 1)
        loss_sum, sums, positions, pads = 0.0, {}, 0, 0
        for k, idx in enumerate(chunks):
            # One optimizer step per table, however many micro-batches it takes.
            self.engine.set_gradient_accumulation_boundary(k == len(chunks) - 1)
            with span("train.collate"):
                batch = collate([rows[i] for i in idx] if idx is not None else rows[:1], self.device, token_keys,
                                self.batching.packed)
            # Dividing every micro-batch by the batch's token count makes their sum
            # the batch's token mean, whatever the split (a short last chunk too).
            loss, m = self._loss(batch, shard)
            if idx is None:
                loss, m = loss * 0.0, {}
            else:
                positions += batch["forward_positions"]
                pads += batch["pad_positions"]
            with span("train.backward"):
                # DeepSpeed averages gradients over the ranks; the sum is what one process would have.
                self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            loss_sum += loss.item()
            for key, value in m.items():
                if key != "tokens":
                    sums[key] = sums.get(key, 0.0) + value * m["tokens"]
        with span("train.optimizer"):
            # The schedule counts training steps, however many updates each takes.
            lr = set_lr(finite.torch_optimizer(self.engine), self.lr, self.optimizer,
                        self.steps // self.updates_per_batch)
            grad_norm, skipped = step_with_grad_norm(self.engine, self.zero_stage, math.isfinite(loss_sum),
                                                     self.world_size)
        keys = sorted(sums)
        totals = [loss_sum, float(tokens), float(positions), float(pads), *(sums[k] for k in keys)]
        if self.world_size > 1:
            summed = torch.tensor(totals, dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(summed)
            totals = summed.tolist()
        return {"loss": totals[0], "grad_norm": grad_norm, "tokens": totals[1],
                "micro_batches": float(len(chunks)), "nonfinite_skipped": float(skipped), "lr": lr,
                "pad_token_share": totals[3] / max(totals[2], 1.0),
                **{key: s / n for key, s in zip(keys, totals[4:])}}

    # Optimizer steps per train_step (the policy's epochs x mini-batches).
    updates_per_batch = 1

    # Whether only the trainable parameters are synced and saved (LoRA: the
    # adapters; the frozen base is rebuilt from the model directory).
    trainable_only = False

    def _synced(self) -> dict[str, torch.Tensor]:
        """The tensors a refit moves, by name: the module's state dict (a subclass
        with trainable_only names its trainable part)."""
        return self.engine.module.state_dict()

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """_synced's tensors, detached CPU copies in the training dtype, on rank 0;
        None on the other ranks. Under ZeRO-3 every rank must call it: the gather
        is a collective."""
        if self.rank != 0 and self.zero_stage != 3:
            return None
        with full_params(self.deepspeed, self.engine.module, self.zero_stage, self.trainable_only):
            state = {name: t.detach().to("cpu", copy=True) for name, t in self._synced().items()}
        return state if self.rank == 0 else None

    def live_weights(self) -> dict[str, torch.Tensor]:
        """_synced's own tensors, not copied: for a sender that reads them before
        the next update (ZeRO 0-2; under ZeRO-3 each rank holds only a
        partition, see export_weights)."""
        if self.zero_stage == 3:
            raise RuntimeError("live_weights: under ZeRO-3 the full weights exist only inside a gather "
                               "of every rank (export_weights)")
        return {name: t.detach() for name, t in self._synced().items()}

    def save_state(self, path: str) -> None:
        """Everything a resumed run needs to continue exactly: weights, optimizer
        state, step counter and RNG (a DeepSpeed checkpoint in `path`). Refused,
        on every rank, when a weight holds a NaN or inf."""
        self.refuse_nonfinite(f"the engine state {path}")
        save_engine_state(self.engine, path, self.trainable_only)

    def refuse_nonfinite(self, what: str) -> None:
        """Raise NonfiniteWeightsError on every rank if any rank's weights hold a NaN or inf."""
        finite.refuse_nonfinite_weights(self.engine.module, self.world_size, self.device, what)

    def load_state(self, path: str) -> None:
        """Restore save_state's directory into this engine (built with the same config)."""
        load_engine_state(self.engine, path, self.trainable_only)

    def close(self) -> None:
        """Release the engine's optimizer state and hooks (the process group stays)."""
        self.engine.destroy()
