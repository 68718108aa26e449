"""Trainer memory and step time, full fine-tuning against LoRA (training.lora),
on the DeepSpeed policy engine (CPU, fp32, ZeRO 0) for the model sizes of
benchmarks.refit.

Each (size, mode) runs in a fresh process, so its peak resident memory is its
own: the process builds the engine, takes `--steps` GRPO updates on a fixed
table (16 rows of 32 prompt and 32 response tokens) and reports its peak RSS,
the bytes of its trainable parameters (their gradients take as many) and
AdamW's state (counted from the tensors), and the median step time. The two modes of a size
run back to back.

    .venv/bin/python -m benchmarks.lora_trainer            # tiny .. 400M
    .venv/bin/python -m benchmarks.lora_trainer --quick    # tiny only
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, engine_config, machine_info, print_table, write_result
from benchmarks.workloads import MODEL_SIZES, build_sized_model

ROWS, PROMPT, RESPONSE = 16, 32, 32


def one(model_dir: str, rank: int, steps: int) -> dict:
    """In this process: the engine, `steps` updates, and what they held."""
    import pyarrow as pa
    import torch
    torch.set_num_threads(1)

    from pipeline.algos.advantages import critic_free_advantages
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    from pipeline.core.types import TRAJECTORY_SCHEMA
    engine = DeepSpeedPolicyEngine(engine_config(model_dir, f"training.micro_batch_size={ROWS}",
                                                 f"training.lora.rank={rank}"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (PROMPT,), generator=gen).tolist() for _ in range(ROWS // 4)]
    rows = [dict(batch_id="b", target=1, version=0, prompt_id=f"p{i // 4}", text="", prompt_ids=prompts[i // 4],
                 response_ids=(r := torch.randint(3, 300, (RESPONSE,), generator=gen).tolist()),
                 logprobs=[-5.0] * len(r), reward=float(i % 4)) for i in range(ROWS)]
    table = pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)
    advantages = critic_free_advantages(table, 4)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.train_step(table, advantages)
        times.append(time.perf_counter() - t0)
    module = engine.engine.module
    trainable = [p for p in module.parameters() if p.requires_grad]
    state = [t for s in engine.engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    exported = engine.export_weights()
    return {"params": sum(p.numel() for p in module.parameters()),
            "trainable_params": sum(p.numel() for p in trainable),
            "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable),
            "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
            "export_bytes": sum(t.numel() * t.element_size() for t in exported.values()),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_s": statistics.median(times[1:] or times), "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny model only, 2 steps")
    ap.add_argument("--sizes", help=f"comma-separated, of {','.join(MODEL_SIZES)} (full: all)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (every linear layer and lm_head)")
    ap.add_argument("--steps", type=int, default=None, help="updates per run (default 4; quick 2)")
    ap.add_argument("--out", type=Path, help="directory for lora_trainer.json (default benchmarks/results)")
    ap.add_argument("--one", nargs=3, metavar=("MODEL_DIR", "RANK", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), int(args.one[2]))))
        return 0
    sizes = args.sizes.split(",") if args.sizes else (["tiny"] if args.quick else list(MODEL_SIZES))
    steps = args.steps or (2 if args.quick else 4)
    result = {"benchmark": "lora_trainer", "machine": machine_info(),
              "params": {"quick": args.quick, "sizes": {s: MODEL_SIZES[s] for s in sizes}, "rank": args.rank,
                         "steps": steps, "rows": ROWS, "prompt_tokens": PROMPT, "response_tokens": RESPONSE,
                         "dtype": "fp32", "zero_stage": 0},
              "figures": []}
    work = Path(tempfile.mkdtemp(prefix="dagrl_lora_trainer_"))
    try:
        for name in sizes:
            model_dir = build_sized_model(work, name)
            pair = {}
            for mode, rank in (("full", 0), ("lora", args.rank)):
                proc = subprocess.run([sys.executable, "-m", "benchmarks.lora_trainer", "--one", str(model_dir),
                                       str(rank), str(steps)], cwd=ROOT, capture_output=True, text=True, timeout=3600)
                if proc.returncode != 0:
                    raise RuntimeError(f"{name} {mode} failed:\n{proc.stderr[-3000:]}")
                pair[mode] = {"size": name, "mode": mode, "rank": rank,
                              **json.loads(proc.stdout.strip().splitlines()[-1])}
                result["figures"].append(pair[mode])
                print(f"  {name} {mode}: peak RSS {pair[mode]['peak_rss_bytes'] / 2**20:.0f} MiB, "
                      f"step {pair[mode]['step_s']:.2f} s", flush=True)
            full, lora = pair["full"], pair["lora"]
            result.setdefault("lora_vs_full", []).append({
                "size": name,
                "peak_rss_ratio": lora["peak_rss_bytes"] / full["peak_rss_bytes"],
                "optimizer_ratio": lora["optimizer_bytes"] / full["optimizer_bytes"],
                "trainable_ratio": lora["trainable_params"] / full["trainable_params"],
                "export_ratio": lora["export_bytes"] / full["export_bytes"],
                "step_time_ratio": lora["step_s"] / full["step_s"]})
            shutil.rmtree(model_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mib = 2**20
    print_table(["size", "mode", "params M", "trainable M", "optimizer MiB", "synced MiB", "peak RSS MiB", "step s"],
                [[f["size"], f["mode"], f["params"] / 1e6, f["trainable_params"] / 1e6, f["optimizer_bytes"] / mib,
                  f["export_bytes"] / mib, f["peak_rss_bytes"] / mib, f["step_s"]]
                 for f in result["figures"]], title=f"trainer, full vs LoRA rank {args.rank}")
    path = write_result("lora_trainer", result, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
