"""The DeepSpeed train step against a bare torch loop, on the CPU, at 1 and 2 ranks.

Both sides train the same model (built like the tiny one, wider and deeper:
pipeline.inputs.tiny) on the same GRPO-shaped batch (8 prompts x 8 samples,
16-token prompts, responses of 48-64 tokens) with one torch thread per rank:

  worker  pipeline.trainer.deepspeed_policy.DeepSpeedPolicyEngine.train_step(table,
          advantages[, shard]): the trainer as the pipeline runs it (Arrow rows,
          collation every step, the clipped policy loss with its IS weight and
          metrics, DeepSpeed's backward and step, gradient clipping, the
          non-finite guard, the ranks' all-reduce of the metrics)
  bare    the same weights in a transformers model, torch.optim.AdamW, the
          micro-batches collated once before timing, a token-mean log-likelihood
          loss times the advantages; DistributedDataParallel over gloo at 2 ranks;
          bf16 as torch.autocast over fp32 weights (what DeepSpeed's bf16 keeps as
          its master copy)

Each rank is a process (spawned; 2 ranks share a gloo group, each its own
rows: pipeline.core.data_parallel.table_shard). In one process both sides are
built, warmed up, then timed `--steps` steps at a time, alternating which goes
first over `--repeats`, so each ratio is of one run. Target (issue "Fast at
real sizes"): the worker's step within 10 % of the bare loop's.

    .venv/bin/python -m benchmarks.trainer_efficiency            # 4M and 33M, fp32 and bf16 where the CPU has it
    .venv/bin/python -m benchmarks.trainer_efficiency --quick    # the tiny model, fp32: a smoke run of both paths
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import engine_config, machine_info, print_table, print_targets, write_result

TARGET = 1.10
# name -> pipeline.inputs.tiny arguments: hidden, layers, heads, intermediate
SIZES = {"tiny": (64, 2, 4, 128), "4M": (256, 4, 8, 1024), "33M": (512, 8, 8, 2048)}
PROMPTS, GROUP, PROMPT_LEN, RESPONSE_LEN, MICRO = 8, 8, 16, 64, 8


def build_model(out: Path, size: str) -> Path:
    from pipeline.inputs.tiny import build_tiny_model
    hidden, layers, heads, inter = SIZES[size]
    return build_tiny_model(out / size, hidden=hidden, layers=layers, heads=heads, head_dim=hidden // heads,
                            intermediate=inter)


def batch(seed: int = 0):
    import random

    import pyarrow as pa

    from pipeline.algos.advantages import critic_free_advantages
    from pipeline.core.types import TRAJECTORY_SCHEMA
    rng, rows = random.Random(seed), []
    for p in range(PROMPTS):
        prompt = [rng.randrange(3, 380) for _ in range(PROMPT_LEN)]
        for i in range(GROUP):
            n = rng.randint(RESPONSE_LEN * 3 // 4, RESPONSE_LEN)
            rows.append(dict(batch_id="b", target=1, version=0, prompt_id=f"p{p}", text="", prompt_ids=prompt,
                             response_ids=[rng.randrange(3, 380) for _ in range(n)],
                             logprobs=[-rng.uniform(0.5, 6.0) for _ in range(n)], reward=float(i % 2)))
    table = pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)
    return table, critic_free_advantages(table, GROUP)


class Bare:
    """A plain torch loop on this rank's rows."""

    def __init__(self, model_dir: Path, rows: list[dict], dtype: str, world_size: int, device):
        import torch
        from transformers import AutoModelForCausalLM

        from pipeline.trainer.rows import collate
        self.torch, self.dtype = torch, dtype
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.config.use_cache = False
        self.model = torch.nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        self.tokens = sum(len(r["response_ids"]) for r in rows)
        self.micro = [collate(rows[i:i + MICRO], device, {"adv": "advantages"}) for i in range(0, len(rows), MICRO)]

    def train_step(self) -> None:
        torch = self.torch
        for k, b in enumerate(self.micro):
            ids, start = b["ids"], b["start"]
            # DDP all-reduces the gradients in the last micro-batch's backward only.
            sync = self.model.no_sync() if hasattr(self.model, "no_sync") and k < len(self.micro) - 1 \
                else _nothing()
            with sync, torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == "bf16"):
                logits = self.model(input_ids=ids, attention_mask=b["attn"], logits_to_keep=ids.shape[1] - start).logits
                logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, start + 1:].unsqueeze(-1))
                loss = -(logp.squeeze(-1) * b["adv"] * b["mask"]).sum() / self.tokens
                loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def rank_main(rank: int, world_size: int, port: int, model_dir: str, dtype: str, steps: int, repeats: int,
              warmup: int, out: mp.Queue) -> None:
    """One rank: build both sides, time them alternately, put rank 0's step times on `out`."""
    from pipeline.core.data_parallel import Batching, Rendezvous, table_shard
    from pipeline.trainer.rows import trajectory_rows
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    table, advantages = batch()
    rendezvous = Rendezvous("127.0.0.1", port, world_size) if world_size > 1 else None
    cfg = engine_config(model_dir, f"training.dtype={dtype}", f"training.micro_batch_size={MICRO}", "training.lr=1e-6",
                        f"schedule.group_size={GROUP}")
    worker = DeepSpeedPolicyEngine(cfg, rank, rendezvous)
    shard = table_shard(table, GROUP, rank, world_size, Batching(MICRO, 0))
    mine = table if shard is None else table.slice(shard.start, shard.stop - shard.start)
    mine_adv = advantages if shard is None else advantages.slice(shard.start, shard.stop - shard.start)
    rows = [{**r, "advantages": a} for r, a in zip(trajectory_rows(mine), mine_adv.column("advantages").to_pylist())]
    bare = Bare(Path(model_dir), rows, dtype, world_size, worker.device)
    sides = {"worker": lambda: worker.train_step(table, advantages, shard), "bare": bare.train_step}
    for _ in range(warmup):
        for fn in sides.values():
            fn()
    times: dict[str, list[float]] = {"worker": [], "bare": []}
    for rep in range(repeats):
        for name in (("worker", "bare") if rep % 2 == 0 else ("bare", "worker")):
            t0 = time.perf_counter()
            for _ in range(steps):
                sides[name]()
            times[name].append((time.perf_counter() - t0) / steps)
    if rank == 0:
        out.put({"times": times, "tokens": sum(len(r["prompt_ids"]) + len(r["response_ids"])
                                               for r in trajectory_rows(table))})
    worker.close()


def run_case(model_dir: Path, dtype: str, world_size: int, steps: int, repeats: int, warmup: int) -> dict:
    from pipeline.core.data_parallel import free_port
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=rank_main, args=(r, world_size, port, str(model_dir), dtype, steps, repeats,
                                                  warmup, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        got = out.get(timeout=3600)
    finally:
        for p in procs:
            p.join(timeout=120)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"trainer_efficiency: a rank exited with {[p.exitcode for p in procs]}")
    worker, bare = got["times"]["worker"], got["times"]["bare"]
    ratios = [w / b for w, b in zip(worker, bare)]
    return {"dtype": dtype, "ranks": world_size, "worker_step_s": round(statistics.median(worker), 4),
            "bare_step_s": round(statistics.median(bare), 4), "worker_over_bare": round(statistics.median(ratios), 3),
            "ratios": [round(r, 3) for r in ratios], "tokens_per_step": got["tokens"],
            "worker_tokens_per_s": round(got["tokens"] / statistics.median(worker), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny model, fp32, 1 step x 2 repeats")
    ap.add_argument("--sizes", nargs="*", choices=list(SIZES), default=None)
    ap.add_argument("--steps", type=int, default=None, help="steps per timing (full 3)")
    ap.add_argument("--repeats", type=int, default=None, help="timings per side (full 4)")
    ap.add_argument("--out", type=Path, help="directory for trainer_efficiency.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    from pipeline.core.precision import cpu_bf16_flags
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = args.sizes or (["tiny"] if args.quick else ["4M", "33M"])
    dtypes = ["fp32"] if args.quick or not cpu_bf16_flags() else ["fp32", "bf16"]
    ranks = [1, 2]
    steps, repeats = args.steps or (1 if args.quick else 3), args.repeats or (2 if args.quick else 4)
    cases = []
    with tempfile.TemporaryDirectory(prefix="dagrl-trainer-eff-") as tmp:
        for size in sizes:
            model = build_model(Path(tmp), size)
            for dtype in dtypes:
                for world_size in ranks:
                    print(f"trainer_efficiency: {size} {dtype} {world_size} rank(s) ...", flush=True)
                    cases.append({"size": size, **run_case(model, dtype, world_size, steps, repeats, 1)})
    targets = [{"target": f"{c['size']} {c['dtype']} {c['ranks']} rank(s): worker step <= {TARGET} x bare",
                "value": c["worker_over_bare"], "met": c["worker_over_bare"] <= TARGET} for c in cases]
    result = {"benchmark": "trainer_efficiency", "quick": args.quick, "machine": machine_info(ray=False),
              "params": {"sizes": {s: SIZES[s] for s in sizes}, "prompts": PROMPTS, "group_size": GROUP,
                         "prompt_len": PROMPT_LEN, "response_len": RESPONSE_LEN, "micro_batch_size": MICRO,
                         "steps": steps, "repeats": repeats, "threads_per_rank": 1, "cpu_bf16": list(cpu_bf16_flags())},
              "cases": cases, "targets": targets}
    print_table(["size", "dtype", "ranks", "worker s", "bare s", "worker/bare"],
                [[c["size"], c["dtype"], c["ranks"], c["worker_step_s"], c["bare_step_s"], c["worker_over_bare"]]
                 for c in cases], title="trainer_efficiency (median of repeats)")
    print_targets(targets)
    print(f"wrote {write_result('trainer_efficiency_quick' if args.quick else 'trainer_efficiency', result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
