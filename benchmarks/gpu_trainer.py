"""The DeepSpeed training worker on one GPU against a bare DeepSpeed loop.

A Llama model of a few hundred million parameters is built from a config
(random weights, saved once to a temporary directory) and loaded by both sides
the same way. On the same synthetic batch, with the same micro-batch size,
ZeRO stage, dtype and DeepSpeed config:

  worker  pipeline.algos.advantages.critic_free_advantages(table) and
          pipeline.trainer.deepspeed_policy.DeepSpeedPolicyEngine.train_step(table, advantages):
          the GRPO trainer as the pipeline runs it (an Arrow table in
          TRAJECTORY_SCHEMA -> group advantages, rows, collation and
          host-to-device copies every step, the policy loss and its metrics)
  bare    deepspeed.initialize + per micro-batch forward (logits over the same
          response window), a token log-likelihood loss, engine.backward,
          engine.step; tensors collated and on the GPU before timing

Both engines live in this process; each repeat times `--steps` optimizer steps
of one, then of the other (the order alternates), so the ratio is taken within
a repeat. Figures: tokens/s (every non-pad token, and response tokens) and
memory (torch.cuda.max_memory_allocated): resident = allocated after warm-up
minus before the engine was built (weights, fp32 master copy, Adam state,
gradients); step peak = the most allocated above that during a timed step.

Target (issue): the worker within 10 % of the bare loop (tokens/s >= 0.9 x,
peak memory <= 1.1 x).

Needs torch, transformers, deepspeed and pyarrow (the worker's table format);
never imports Ray or vLLM. Exits at once with an error where no CUDA GPU is
visible. `--cpu-smoke` runs a toy size on the CPU only to check the code path
(it writes gpu_trainer_cpu_smoke.json, and its figures are not GPU figures).

    python -m benchmarks.gpu_trainer              # ~370M parameters, about 2-4 minutes on one GPU
    python -m benchmarks.gpu_trainer --quick      # a small model, seconds on one GPU
    python -m benchmarks.gpu_trainer --cpu-smoke  # code-path check on CPU, no GPU needed
"""
from __future__ import annotations

import argparse
import copy
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (engine_config, gpu_machine_info, print_table, print_targets, require_gpu, stats,
                                write_result)
from benchmarks.workloads import build_llama, build_rows, to_table

NO_GPU = "gpu_trainer needs a CUDA GPU; none is visible"
TARGET_TPS, TARGET_MEM = 0.9, 1.1

# name: (hidden, layers, heads, intermediate, vocab, rows, group, micro, prompt, response, steps, repeats, warmup)
SIZES = {
    "full": dict(hidden=1024, layers=24, heads=16, intermediate=2816, vocab=32000, rows=64, group_size=8,
                 micro_batch=8, prompt_len=256, response_len=512, steps=8, repeats=5, warmup=3),
    "quick": dict(hidden=256, layers=4, heads=4, intermediate=688, vocab=32000, rows=16, group_size=4,
                  micro_batch=4, prompt_len=64, response_len=64, steps=3, repeats=2, warmup=1),
    "cpu_smoke": dict(hidden=64, layers=2, heads=2, intermediate=128, vocab=512, rows=8, group_size=4,
                      micro_batch=4, prompt_len=12, response_len=8, steps=2, repeats=2, warmup=1),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a small model and batch: a smoke run on a GPU")
    size.add_argument("--cpu-smoke", action="store_true",
                      help="toy size on the CPU (no GPU needed): checks the code path, measures nothing")
    for key in SIZES["full"]:
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"default: full {SIZES['full'][key]}, "
                        f"quick {SIZES['quick'][key]}")
    ap.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=1, help="ZeRO stage (default 1)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="training dtype (default bf16)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--vary", type=float, default=0.25,
                    help="response lengths vary uniformly in [(1 - vary) x, 1 x] --response-len (default 0.25)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="directory for the JSON (default benchmarks/results)")
    return ap.parse_args(argv)


def resolve_sizes(args: argparse.Namespace) -> dict:
    base = SIZES["cpu_smoke" if args.cpu_smoke else "quick" if args.quick else "full"]
    size = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}
    if size["rows"] % size["group_size"] or size["rows"] % size["micro_batch"]:
        raise SystemExit(f"gpu_trainer: --rows {size['rows']} must be a multiple of --group-size "
                         f"{size['group_size']} and of --micro-batch {size['micro_batch']}")
    if size["hidden"] % size["heads"]:
        raise SystemExit(f"gpu_trainer: --hidden {size['hidden']} must be a multiple of --heads {size['heads']}")
    return size


# --- the two sides ----------------------------------------------------------------------------

class Bare:
    """deepspeed.initialize and a plain loop over pre-collated micro-batches."""

    def __init__(self, model_dir: Path, ds_config: dict, rows: list[dict], micro: int, device):
        import deepspeed
        import torch
        from transformers import AutoModelForCausalLM
        self.torch = torch
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.config.use_cache = False
        model.eval()   # as the worker: no dropout
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                               config=copy.deepcopy(ds_config))
        self.tokens = sum(len(r["response_ids"]) for r in rows)
        self.micro = [self._collate(rows[i:i + micro], device) for i in range(0, len(rows), micro)]

    @staticmethod
    def _collate(rows: list[dict], device) -> dict:
        import torch
        width = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
        start = min(len(r["prompt_ids"]) for r in rows) - 1
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros(len(rows), width - 1 - start, dtype=torch.bool)
        for i, r in enumerate(rows):
            p, n = len(r["prompt_ids"]), len(r["response_ids"])
            ids[i, :p + n] = torch.tensor(r["prompt_ids"] + r["response_ids"])
            attn[i, :p + n] = 1
            mask[i, p - 1 - start:p - 1 - start + n] = True
        return {"ids": ids.to(device), "attn": attn.to(device), "start": start, "mask": mask.to(device)}

    def train_step(self) -> None:
        torch = self.torch
        for b in self.micro:
            ids, start = b["ids"], b["start"]
            out = self.engine(input_ids=ids, attention_mask=b["attn"], use_cache=False,
                              logits_to_keep=ids.shape[1] - start)
            logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
            logp = logp.gather(-1, ids[:, start + 1:].unsqueeze(-1)).squeeze(-1)
            loss = -(logp * b["mask"]).sum() / self.tokens
            self.engine.backward(loss)
            self.engine.step()   # deepspeed steps at its gradient-accumulation boundary

    def close(self) -> None:
        self.engine.destroy()


# --- measuring --------------------------------------------------------------------------------

class Meter:
    def __init__(self, cuda: bool):
        import torch
        self.torch, self.cuda = torch, cuda

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def allocated(self) -> int | None:
        return self.torch.cuda.memory_allocated() if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return self.torch.cuda.max_memory_allocated() if self.cuda else None

    def timed(self, fn, steps: int) -> tuple[float, int | None]:
        """Seconds for `steps` calls and the peak allocated above the level at the start."""
        self.sync()
        self.reset_peak()
        base = self.allocated()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        self.sync()
        wall = time.perf_counter() - t0
        return wall, (self.peak() - base if self.cuda else None)


def gib(x: int | None) -> float | None:
    return None if x is None else x / 2**30


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    require_gpu(NO_GPU, args.cpu_smoke)
    size = resolve_sizes(args)
    import torch
    cuda = not args.cpu_smoke
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    from pipeline.algos.advantages import critic_free_advantages
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine

    info = gpu_machine_info(cuda)
    meter = Meter(cuda)
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="dagrl_gpu_trainer_"))
    worker = bare = None
    try:
        n_params = build_llama(tmp / "model", size, args.seed)
        rows = build_rows(size, args.vary, args.seed)
        table = to_table(rows)
        seq_tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
        resp_tokens = sum(len(r["response_ids"]) for r in rows)
        accum = size["rows"] // size["micro_batch"]
        print(f"gpu_trainer: {n_params / 1e6:.1f}M parameters, {size['rows']} rows in micro-batches of "
              f"{size['micro_batch']}, {seq_tokens} tokens ({resp_tokens} response) per step, ZeRO "
              f"{args.zero_stage}, {args.dtype}, device {info.get('gpu', 'cpu')}", flush=True)

        mem: dict = {}
        before = meter.allocated()
        worker = DeepSpeedPolicyEngine(engine_config(
            tmp / "model", f"training.zero_stage={args.zero_stage}", f"training.dtype={args.dtype}",
            f"training.micro_batch_size={size['micro_batch']}", f"training.lr={args.lr}", f"run.seed={args.seed}"))

        def worker_step() -> None:
            worker.train_step(table, critic_free_advantages(table, size["group_size"]))

        for _ in range(size["warmup"]):
            worker_step()
        meter.sync()
        mem["worker"] = None if before is None else meter.allocated() - before

        before = meter.allocated()
        # The bare loop leaves the step boundary to deepspeed's own micro-batch counter.
        bare = Bare(tmp / "model", {**worker.ds_config, "gradient_accumulation_steps": accum}, rows,
                    size["micro_batch"], worker.device)
        for _ in range(size["warmup"]):
            bare.train_step()
        meter.sync()
        mem["bare"] = None if before is None else meter.allocated() - before

        sides = {"worker": worker_step, "bare": bare.train_step}
        walls: dict = {"worker": [], "bare": []}
        peaks: dict = {"worker": [], "bare": []}
        for rep in range(size["repeats"]):
            for name in (("worker", "bare") if rep % 2 == 0 else ("bare", "worker")):
                wall, peak = meter.timed(sides[name], size["steps"])
                walls[name].append(wall / size["steps"])
                peaks[name].append(peak)
                print(f"  rep {rep} {name:6s}: {wall / size['steps'] * 1e3:8.1f} ms/step, "
                      f"{seq_tokens * size['steps'] / wall:9.0f} tokens/s"
                      + (f", step peak {gib(peak):.2f} GiB above {gib(mem[name]):.2f} GiB resident"
                         if peak is not None else ""), flush=True)
    finally:
        for side in (worker, bare):
            if side is not None:
                side.close()
        shutil.rmtree(tmp, ignore_errors=True)

    figures: dict = {}
    for name in ("worker", "bare"):
        figures[name] = {
            "step_s": stats(walls[name]),
            "tokens_per_s": stats([seq_tokens / w for w in walls[name]]),
            "response_tokens_per_s": stats([resp_tokens / w for w in walls[name]]),
            "resident_gib": gib(mem[name]),
            "step_peak_gib": stats([gib(p) for p in peaks[name]]) if cuda else None,
            "peak_gib": stats([gib(mem[name] + p) for p in peaks[name]]) if cuda else None,
        }
    tps = [b / w for w, b in zip(walls["worker"], walls["bare"])]   # worker tokens/s over bare, per repeat
    memr = [(mem["worker"] + pw) / (mem["bare"] + pb) for pw, pb in zip(peaks["worker"], peaks["bare"])] \
        if cuda else []
    figures["worker_over_bare"] = {"tokens_per_s": stats(tps), "peak_memory": stats(memr) if cuda else None}
    tps_med = figures["worker_over_bare"]["tokens_per_s"]["median"]
    mem_med = figures["worker_over_bare"]["peak_memory"]["median"] if cuda else None
    targets = [
        {"target": f"worker tokens/s >= {TARGET_TPS} x bare loop", "value": tps_med, "limit": TARGET_TPS,
         "met": bool(cuda and tps_med >= TARGET_TPS)},
        {"target": f"worker peak memory <= {TARGET_MEM} x bare loop", "value": mem_med, "limit": TARGET_MEM,
         "met": bool(cuda and mem_med is not None and mem_med <= TARGET_MEM)},
    ]
    params = {"quick": args.quick, "cpu_smoke": args.cpu_smoke, **size, "parameters": n_params,
              "zero_stage": args.zero_stage, "dtype": args.dtype, "lr": args.lr, "vary": args.vary,
              "seed": args.seed, "grad_accum": accum, "tokens_per_step": seq_tokens,
              "response_tokens_per_step": resp_tokens, "ds_config": worker.ds_config,
              "imports": {m: sys.modules.get(m) is not None for m in ("ray", "vllm")}}
    result = {"benchmark": "gpu_trainer", "machine": info, "params": params, "figures": figures,
              "targets": targets, "wall_s": round(time.time() - t_start, 1)}
    if args.cpu_smoke:
        result["note"] = "--cpu-smoke: a code-path check on the CPU; these are not GPU figures"

    rows_out = []
    for name in ("worker", "bare"):
        f = figures[name]
        rows_out.append([name, f["step_s"]["median"] * 1e3, f"{f['step_s']['min'] * 1e3:.1f}-{f['step_s']['max'] * 1e3:.1f}",
                         f["tokens_per_s"]["median"], f["response_tokens_per_s"]["median"],
                         f["resident_gib"], f["peak_gib"]["median"] if cuda else None])
    print_table(["side", "ms/step", "range", "tokens/s", "response tok/s", "resident GiB", "peak GiB"], rows_out,
                title=f"gpu_trainer: {n_params / 1e6:.1f}M parameters, median of {size['repeats']} repeats x "
                      f"{size['steps']} steps" + (" (CPU SMOKE: not a measurement)" if args.cpu_smoke else ""))
    print_targets(targets)
    path = write_result("gpu_trainer_cpu_smoke" if args.cpu_smoke else "gpu_trainer", result, args.out)
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
