"""The DeepSpeed training engine: one GRPO or PPO policy update per trajectory table.

The helpers at module level (process group, DeepSpeed config and init, collation,
ZeRO-3 gathering, checkpoint state) are shared with the PPO critic
(pipeline/engines/deepspeed_critic.py), so both engines set DeepSpeed up the same way.

Runs in one process (a Ray actor): torch.distributed with world size 1 on a
free port, gloo on CPU, nccl on a GPU. Pinned to deepspeed 0.19.8 because of
the private shared-memory hook below (see DESIGN.md, "DeepSpeed").
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import os
import random
import shutil
import socket
import time
import warnings
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.algos.grpo import group_advantages, grpo_loss
from pipeline.run.spans import span

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
    "chat_template.json",
)
REQUIRED_COLUMNS = ("batch_id", "prompt_id", "prompt_ids", "response_ids", "logprobs", "reward")


class ModelPathError(ValueError):
    """The model directory is missing or is not an HF model directory."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_single_process(cuda: bool):
    """Import deepspeed and bring up its comm backend with world size 1."""
    if not cuda:
        # Read when deepspeed first picks its accelerator, so it must precede the import.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise RuntimeError("the DeepSpeed engines run one process; WORLD_SIZE="
                           f"{os.environ['WORLD_SIZE']} (a multi-process launch) is not supported")
    if not cuda:
        # deepspeed compiles a shared-memory all-reduce op on the first backend start
        # (30-110 s on a fresh machine); one process never uses it. Private hook of
        # deepspeed 0.19.8. `import deepspeed.comm.torch as m` would bind the *torch*
        # package (deepspeed.comm re-exports it), so look the module up by name.
        ds_torch = importlib.import_module("deepspeed.comm.torch")
        if hasattr(ds_torch, "build_shm_op"):
            ds_torch.build_shm_op = lambda: None
        else:
            warnings.warn(f"deepspeed {deepspeed.__version__} has no deepspeed.comm.torch.build_shm_op "
                          "(written for 0.19.8); the first start may compile a shared-memory op")
    if not torch.distributed.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                          RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False)
    return deepspeed


def _check_model_dir(model_path: str) -> Path:
    path = Path(model_path)
    if not path.is_dir():
        raise ModelPathError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelPathError(f"model directory {str(path)!r} has no config.json "
                             "(expected a directory written by save_pretrained)")
    return path


def _rows(table: pa.Table, group_size: int) -> list[dict]:
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"trajectory table lacks columns {missing}")
    rows = table.select(list(REQUIRED_COLUMNS)).to_pylist()
    if not rows or len(rows) % group_size:
        raise ValueError(f"{len(rows)} rows do not split into groups of {group_size}")
    for i, row in enumerate(rows):
        if row["reward"] is None:
            raise ValueError(f"row {i} has no reward")
        if not row["prompt_ids"]:
            raise ValueError(f"row {i} has an empty prompt")
        if len(row["logprobs"]) != len(row["response_ids"]):
            raise ValueError(f"row {i}: {len(row['logprobs'])} logprobs for "
                             f"{len(row['response_ids'])} response tokens")
    # Advantages are normalised per group of consecutive rows, so a misordered
    # table would silently mix prompts; refuse it.
    for g in range(0, len(rows), group_size):
        head = rows[g]
        for row in rows[g + 1:g + group_size]:
            if (row["batch_id"], row["prompt_id"], row["prompt_ids"]) != (
                    head["batch_id"], head["prompt_id"], head["prompt_ids"]):
                raise ValueError(f"rows {g}..{g + group_size - 1} must be one prompt group; found "
                                 f"{(head['batch_id'], head['prompt_id'])} and "
                                 f"{(row['batch_id'], row['prompt_id'])}")
    return rows


def token_column(table: pa.Table, column: str, rows: list[dict]) -> list[list[float]]:
    """A per-token column of a table aligned with `rows` (one float per response token)."""
    if column not in table.column_names:
        raise ValueError(f"table lacks the per-token column {column!r}")
    if table.num_rows != len(rows):
        raise ValueError(f"{column}: {table.num_rows} rows for a batch of {len(rows)}")
    values = table.column(column).to_pylist()
    for i, (v, row) in enumerate(zip(values, rows)):
        if v is None or len(v) != len(row["response_ids"]):
            raise ValueError(f"{column}: row {i} has {0 if v is None else len(v)} values for "
                             f"{len(row['response_ids'])} response tokens")
    return values


def collate(rows: list[dict], device, token_keys: dict[str, str] | None = None) -> dict:
    """Right-padded ids plus a response window starting at the shortest prompt.

    Right padding keeps the implicit positions 0..len-1 of every sequence
    correct. Response token t of a row with prompt length P sits at position
    P + t and is predicted by the logits at P + t - 1; the window covers
    positions [start, L - 1) with start = min(P) - 1, so only those logits
    are computed (logits_to_keep). `token_keys` maps an output name to a row
    key holding one float per response token (logprobs, advantages, returns),
    laid out in the window like `mask`.
    """
    token_keys = {"gen": "logprobs"} if token_keys is None else token_keys
    lens = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    width = max(lens)
    start = min(len(r["prompt_ids"]) for r in rows) - 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1 - start, dtype=torch.bool)
    per_token = {k: torch.zeros(len(rows), width - 1 - start) for k in token_keys}
    for i, r in enumerate(rows):
        p, n = len(r["prompt_ids"]), len(r["response_ids"])
        ids[i, :p + n] = torch.tensor(r["prompt_ids"] + r["response_ids"])
        attn[i, :p + n] = 1
        lo = p - 1 - start
        mask[i, lo:lo + n] = True
        for out_key, row_key in token_keys.items():
            per_token[out_key][i, lo:lo + n] = torch.tensor(r[row_key], dtype=torch.float32)
    return {"ids": ids.to(device), "attn": attn.to(device), "start": start, "mask": mask.to(device),
            **{k: v.to(device) for k, v in per_token.items()}}


def start_deepspeed(num_threads: int | None):
    """Threads, device and the world-size-1 process group; returns (deepspeed, cuda)."""
    cuda = torch.cuda.is_available()
    if not cuda and num_threads:
        torch.set_num_threads(num_threads)  # more threads on a shared 2-core box is slower
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return _init_single_process(cuda), cuda


def ds_config(*, micro_batch_size: int, grad_accum: int, lr: float, weight_decay: float,
              zero_stage: int, dtype: str) -> dict:
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0..3, got {zero_stage}")
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        # torch_adam: deepspeed's default FusedAdam / CPUAdam are C++ ops compiled
        # on first use; torch's AdamW needs no build.
        "optimizer": {"type": "AdamW", "params": {
            "lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
            "weight_decay": weight_decay, "torch_adam": True}},
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


def step_with_grad_norm(engine, zero_stage: int, dtype: str) -> float:
    """engine.step(); the gradient norm before clipping."""
    pre_norm = local_grad_norm(engine.module) if zero_stage == 0 and dtype == "fp32" else None
    engine.step()
    grad_norm = engine.get_global_grad_norm()
    if grad_norm is None:  # deepspeed records no norm for plain fp32 without ZeRO
        grad_norm = pre_norm
    return float(grad_norm) if grad_norm is not None else float("nan")


@contextlib.contextmanager
def full_params(deepspeed, module: torch.nn.Module, zero_stage: int):
    """Under ZeRO-3 each parameter is a partition; gather the full tensors."""
    if zero_stage == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            yield
    else:
        yield


def cpu_state_dict(deepspeed, module, zero_stage: int) -> dict[str, torch.Tensor]:
    """Detached CPU copies of every tensor, gathered whole under ZeRO-3."""
    with full_params(deepspeed, module, zero_stage):
        return {name: t.detach().to("cpu", copy=True) for name, t in module.state_dict().items()}


STATE_TAG = "state"


def save_engine_state(engine, path: str | Path) -> None:
    """A DeepSpeed checkpoint in `path`: weights, optimizer moments and step,
    the global step counter, and the torch and Python RNG states."""
    Path(path).mkdir(parents=True, exist_ok=True)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    engine.save_checkpoint(str(path), tag=STATE_TAG, client_state={"dagrl_rng": rng}, save_latest=False)


def load_engine_state(engine, path: str | Path) -> None:
    """Undo save_engine_state on an engine built with the same config."""
    where = Path(path) / STATE_TAG
    if not where.is_dir():
        raise FileNotFoundError(f"no engine state in {str(path)!r} (expected {str(where)!r}, "
                                "written by save_state)")
    loaded, client = engine.load_checkpoint(str(path), tag=STATE_TAG, load_optimizer_states=True,
                                            load_lr_scheduler_states=True)
    if loaded is None:
        raise RuntimeError(f"deepspeed could not load the engine state in {str(where)!r}")
    rng = client["dagrl_rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


class DeepSpeedTrainingEngine:
    """TrainingEngine (pipeline/engines/interface.py) on a DeepSpeed-wrapped HF causal LM.

    One train_step = one optimizer step over the whole table, in micro-batches
    of `micro_batch_size` rows. `grad_accum` only sets deepspeed's nominal
    train_batch_size (micro * accum); the step boundary is the table's end.
    `temperature` must be the generator's sampling temperature.
    """

    def __init__(self, model_path: str, *, zero_stage: int = 0, dtype: str = "fp32",
                 micro_batch_size: int = 8, grad_accum: int = 1, lr: float = 1e-4,
                 clip_eps: float = 0.2, kl_coef: float = 0.0, is_clip: float = 2.0,
                 group_size: int = 4, seed: int = 0, temperature: float = 1.0,
                 weight_decay: float = 0.0, num_threads: int | None = 1):
        self.ds_config = ds_config(micro_batch_size=micro_batch_size, grad_accum=grad_accum, lr=lr,
                                   weight_decay=weight_decay, zero_stage=zero_stage, dtype=dtype)
        self.model_path = _check_model_dir(model_path)
        self.zero_stage, self.dtype = zero_stage, dtype
        self.micro_batch_size, self.group_size = micro_batch_size, group_size
        self.clip_eps, self.kl_coef, self.is_clip = clip_eps, kl_coef, is_clip
        # vLLM reports logprobs of the temperature-scaled distribution; ours must match.
        self.temperature = temperature
        self.deepspeed, _ = start_deepspeed(num_threads)
        random.seed(seed)
        torch.manual_seed(seed)

        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        model.config.use_cache = False
        # eval(): no dropout, so the logprobs match the generator's and `old` is exact.
        model.eval()
        compute_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        self.ref = None
        if kl_coef > 0:
            # Copied before deepspeed.initialize, which partitions parameters under ZeRO-3.
            self.ref = copy.deepcopy(model).to(compute_dtype).requires_grad_(False)
        self.engine = initialize(self.deepspeed, model, self.ds_config)
        self.device = self.engine.device
        if self.ref is not None:
            self.ref.to(self.device)

    @property
    def steps(self) -> int:
        """Optimizer steps taken (one per train_step)."""
        return int(self.engine.global_steps)

    def _logprobs(self, model, batch: dict) -> torch.Tensor:
        ids, start = batch["ids"], batch["start"]
        out = model(input_ids=ids, attention_mask=batch["attn"], use_cache=False,
                    logits_to_keep=ids.shape[1] - start)
        logits = out.logits[:, :-1].float() / self.temperature
        targets = ids[:, start + 1:]
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def sequence_logprobs(self, table: pa.Table) -> list[list[float]]:
        """The current policy's logprob of each response token (no update)."""
        rows = table.select(["prompt_ids", "response_ids"]).to_pylist()
        batch = collate(rows, self.device, token_keys={})
        with torch.no_grad():
            lp = self._logprobs(self.engine, batch)
        return [lp[i][batch["mask"][i]].tolist() for i in range(len(rows))]

    def train_step(self, table: pa.Table, advantages: pa.Table | None = None) -> dict[str, float]:
        """One policy update on the table.

        GRPO (no `advantages`): rows are consecutive prompt groups of
        `group_size`; each row's advantage is its group-normalised reward,
        the same for all its tokens. PPO: `advantages` is the critic's table,
        row i for row i of `table`, whose `advantages` column holds one float
        per response token; rows need not form groups. Both go through
        grpo_loss: clipped ratio plus the truncated IS correction.

        Metrics: loss (token mean over the table), grad_norm (before clipping),
        reward_mean / reward_std (population std over the table), tokens
        (response tokens), clip_frac / is_weight / kl / ratio (token means, see
        grpo_loss), micro_batches, step (optimizer steps so far), time_s.
        """
        t0 = time.perf_counter()
        ppo = advantages is not None
        with span("train.rows"):
            rows = _rows(table, 1 if ppo else self.group_size)
        rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float32)
        keys = {"gen": "logprobs"}
        if ppo:
            for row, adv_row in zip(rows, token_column(advantages, "advantages", rows)):
                row["advantages"] = adv_row
            keys["adv"] = "advantages"
        else:
            group_adv = group_advantages(rewards, self.group_size)
        tokens = sum(len(r["response_ids"]) for r in rows)
        chunks = [range(i, min(i + self.micro_batch_size, len(rows)))
                  for i in range(0, len(rows), self.micro_batch_size)]
        sums = {"loss": 0.0, "clip_frac": 0.0, "is_weight": 0.0, "kl": 0.0, "ratio": 0.0}
        for k, idx in enumerate(chunks):
            # One optimizer step per table, however many micro-batches it takes
            # (deepspeed's own counter would step every grad_accum micro-batches).
            self.engine.set_gradient_accumulation_boundary(k == len(chunks) - 1)
            with span("train.collate"):
                batch = collate([rows[i] for i in idx], self.device, keys)
            adv = batch["adv"] if ppo else group_adv[idx.start:idx.stop].to(self.device)
            with span("train.forward"):
                lp = self._logprobs(self.engine, batch)
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref = self._logprobs(self.ref, batch)
            # Dividing every micro-batch by the table's token count makes their sum
            # the table's token mean, whatever the split (a short last chunk too).
            loss, m = grpo_loss(lp, lp.detach(), batch["gen"], adv, batch["mask"],
                                clip_eps=self.clip_eps, kl_coef=self.kl_coef, ref_logprobs=ref,
                                is_clip=self.is_clip, num_tokens=max(tokens, 1))
            with span("train.backward"):
                self.engine.backward(loss, scale_wrt_gas=False)
            sums["loss"] += loss.item()
            for key in ("clip_frac", "is_weight", "kl", "ratio"):
                sums[key] += m[key] * m["tokens"]
        with span("train.optimizer"):
            grad_norm = step_with_grad_norm(self.engine, self.zero_stage, self.dtype)
        n = max(tokens, 1)
        return {
            "loss": sums["loss"],
            "grad_norm": grad_norm,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "tokens": float(tokens),
            "clip_frac": sums["clip_frac"] / n,
            "is_weight": sums["is_weight"] / n,
            "kl": sums["kl"] / n,
            "ratio": sums["ratio"] / n,
            "micro_batches": float(len(chunks)),
            "step": float(self.steps),
            "time_s": time.perf_counter() - t0,
        }

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named state dict: detached CPU copies in the training dtype."""
        return cpu_state_dict(self.deepspeed, self.engine.module, self.zero_stage)

    def save(self, path: str) -> None:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        state = self.export_weights()
        with full_params(self.deepspeed, self.engine.module, self.zero_stage):
            self.engine.module.save_pretrained(out, state_dict=state)
        for name in TOKENIZER_FILES:
            if (self.model_path / name).is_file():
                shutil.copy2(self.model_path / name, out / name)

    def save_state(self, path: str) -> None:
        """Everything a resumed run needs to continue exactly: weights, optimizer
        state, step counter and RNG (a DeepSpeed checkpoint in `path`)."""
        save_engine_state(self.engine, path)

    def load_state(self, path: str) -> None:
        """Restore save_state's directory into this engine (built with the same config)."""
        load_engine_state(self.engine, path)

    def close(self) -> None:
        """Release the engine's optimizer state and hooks (the process group stays)."""
        self.engine.destroy()
