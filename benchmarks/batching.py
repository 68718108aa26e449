"""Padding and train-step time by micro-batching: `training.micro_batch_size`
rows in table order against a token budget (`training.max_tokens_per_micro_batch`,
rows of like length together; pipeline/core/data_parallel.py `Batching`), and
against packing (`training.packing`: a micro-batch's rows in one sequence,
position ids restarting per row, no padding) under the same budgets.

The batch is GRPO-shaped (16 prompts x 4 samples) with long-tailed lengths:
prompts of 16-48 tokens, responses lognormal (median 48 tokens, sigma 0.7,
4-256), seeded. For each batching it reports the micro-batches, the engine's
own `pad_token_share` and loss, and the median time of a DeepSpeed policy
update (CPU, fp32, one thread, ZeRO 0) on one model, all in one process, so
the ratios are of one run. Target (issue "Fast at real sizes"): a token
budget leaves at most 5 % of the positions to padding; packing leaves none.

    .venv/bin/python -m benchmarks.batching            # the 1M model, 5 updates each
    .venv/bin/python -m benchmarks.batching --quick    # the tiny model, 2 updates each
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import engine_config, machine_info, print_table, write_result
from benchmarks.workloads import build_sized_model

PROMPTS, GROUP = 16, 4
PAD_TARGET = 0.05


def long_tailed_table(seed: int = 0):
    import numpy as np
    import pyarrow as pa

    from pipeline.core.types import TRAJECTORY_SCHEMA
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(PROMPTS):
        prompt = rng.integers(3, 300, int(rng.integers(16, 49))).tolist()
        for j in range(GROUP):
            n = int(np.clip(round(48 * float(np.exp(0.7 * rng.standard_normal()))), 4, 256))
            rows.append(dict(batch_id="b", target=1, version=0, prompt_id=f"p{p}", text="", prompt_ids=prompt,
                             response_ids=rng.integers(3, 300, n).tolist(), logprobs=[-5.0] * n,
                             reward=float(j % 2)))
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def measure(model_dir: Path, table, micro_batch_size: int, max_tokens: int, steps: int, packing: bool = False) -> dict:
    import torch

    from pipeline.algos.advantages import critic_free_advantages
    from pipeline.core.data_parallel import Batching, row_lengths
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    torch.set_num_threads(1)
    engine = DeepSpeedPolicyEngine(engine_config(
        model_dir, f"training.micro_batch_size={micro_batch_size}", f"training.max_tokens_per_micro_batch={max_tokens}",
        f"training.packing={str(packing).lower()}", f"schedule.group_size={GROUP}"))
    if packing and not engine.batching.packed:
        raise RuntimeError(f"packing fell back: {engine.packing_off}")
    advantages = critic_free_advantages(table, GROUP)
    times, metrics = [], {}
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            metrics = engine.train_step(table, advantages)
            times.append(time.perf_counter() - t0)
    finally:
        engine.close()
    chunks = Batching(micro_batch_size, max_tokens, packing).split(row_lengths(table))
    return {"micro_batch_size": micro_batch_size, "max_tokens": max_tokens, "packing": packing,
            "micro_batches": len(chunks),
            "pad_token_share": metrics["pad_token_share"], "loss": metrics["loss"],
            "step_s": statistics.median(times[1:] or times), "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny model, 2 updates each: a smoke run")
    ap.add_argument("--size", default=None, help="model size of benchmarks.workloads.MODEL_SIZES (full: 1M)")
    ap.add_argument("--steps", type=int, default=None, help="updates per batching (full 5, quick 2)")
    ap.add_argument("--out", type=Path, help="directory for batching.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    size = args.size or ("tiny" if args.quick else "1M")
    steps = args.steps or (2 if args.quick else 5)
    from pipeline.core.data_parallel import row_lengths
    table = long_tailed_table()
    lengths = row_lengths(table)
    # Budgets of about the tokens 4, 8 and 16 rows of the mean length hold.
    mean = statistics.mean(lengths)
    budgets = [int(k * mean) for k in (4, 8, 16)]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_sized_model(Path(tmp), size)
        cases = ([measure(model, table, 8, 0, steps)] + [measure(model, table, 8, b, steps) for b in budgets]
                 + [measure(model, table, 8, b, steps, packing=True) for b in budgets])
    rows_case = cases[0]
    for c in cases:
        c["step_over_rows"] = c["step_s"] / rows_case["step_s"]
        c["loss_diff"] = abs(c["loss"] - rows_case["loss"])
    best = min(c["pad_token_share"] for c in cases[1:])
    result = {"benchmark": "batching", "quick": args.quick, "machine": machine_info(ray=False),
              "params": {"quick": args.quick, "size": size, "steps": steps, "rows": len(lengths), "group_size": GROUP,
                         "lengths": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
                                     "mean": mean}},
              "cases": cases, "targets": {"pad_token_share_max": PAD_TARGET},
              "targets_met": {"pad_token_share": best <= PAD_TARGET}}
    print_table(["micro_batch_size", "max_tokens", "packing", "micro-batches", "pad share", "step s", "vs rows",
                 "loss diff"],
                [[c["micro_batch_size"], c["max_tokens"] or "-", c["packing"], c["micro_batches"], c["pad_token_share"],
                  c["step_s"], c["step_over_rows"], c["loss_diff"]] for c in cases],
                title=f"batching ({size} model, {len(lengths)} rows of {min(lengths)}-{max(lengths)} tokens)")
    print(f"targets: pad_token_share <= {PAD_TARGET} under a budget: {result['targets_met']['pad_token_share']} "
          f"(best {best:.3f})")
    print(f"wrote {write_result('batching', result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
