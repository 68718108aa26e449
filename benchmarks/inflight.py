"""In-flight weight updates against draining, with long-tailed response lengths.

Part 1, throughput (simulated workers). Response lengths are lognormal with
p99 / p50 = --tails (capped at max_new_tokens); an engine step gives every
running request one token in the same time, however many run (a memory-bound
decode), so a batch's tail steps are nearly as dear as its bulk. For each tail
ratio, max_age 1 and 2, and refit_mode drain and inflight (run back to back,
the order rotated per repeat), one run per repeat; per run, over the steady
steps: step time, the generators' busy fraction (1 - generator_idle) and
generated tokens/s (response tokens trained on / step time). The ratio
inflight / drain is taken within a repeat.

Part 2, learning (the real CPU stack: vLLM-CPU, DeepSpeed-CPU). The tiny GRPO
recipe, drain against inflight, on the same seeds, with greedy validation
every --val-period steps: the training reward curve, the final validation and
the first validation >= 0.9 (benchmarks.seeds' figures).

Target (issue 15): inflight >= 1.5x drain's generated tokens/s at the heavier
tail, and the same steps to validation 0.9 within seed noise.

    .venv/bin/python -m benchmarks.inflight            # full: about 15 minutes on 2 cores
    .venv/bin/python -m benchmarks.inflight --quick    # CI smoke: part 1 only, seconds; not a measurement
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import machine_info, median_with_never, print_table, print_targets, sample_load
from benchmarks.harness import shutdown_ray, start_ray, stats, write_result
from benchmarks.workloads import learning_run, sim_run

MODES = ("drain", "inflight")
# Seed noise of steps to validation 0.9: one validation period (--val-period 5) either way.
LEARNING_NOISE_STEPS = 5
SKIP_FIRST = 3   # the prologue's batches and the first refits


def steady_figures(steps: list[dict], skip_last: int) -> dict:
    """A run's figures over its steady steps (the first SKIP_FIRST and the last skip_last left out)."""
    steady = steps[SKIP_FIRST:len(steps) - skip_last]
    elapsed = sum(r["step_time_s"] for r in steady)
    return {"step_s": statistics.median(r["step_time_s"] for r in steady),
            "busy": statistics.mean(1.0 - r["generator_idle"] for r in steady),
            "tokens_per_s": sum(r["response_tokens"] for r in steady) / elapsed,
            "reward_end": steady[-1]["reward_mean"]}


def throughput(args, info: dict, tmp: Path) -> list[dict]:
    from dags.step_graph import build_step_graph
    from pipeline.run.pool import start_workers, stop_workers
    from pipeline.run.runner import GraphRunner
    steps = SKIP_FIRST + args.steps + max(args.ages)
    raw: dict = {(t, a, m): [] for t in args.tails for a in args.ages for m in MODES}
    pool = start_workers(args.generators)
    runner = GraphRunner(build_step_graph(pool), "classic", first_deadline_s=120)
    try:
        for rep in range(args.repeats):
            for tail in args.tails:
                for age in args.ages:
                    for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                        sample_load(info)
                        overrides = [
                            "backend=sim", f"run.steps={steps}", "run.dag_mode=classic", "validation.period=0",
                            f"generation.num_generators={args.generators}", f"generation.refit_mode={mode}",
                            f"generation.max_new_tokens={args.max_new_tokens}", f"schedule.max_age={age}",
                            f"schedule.prompts_per_step={args.prompts}", "sim.response_len=lognormal",
                            f"sim.tail_ratio={tail}", f"sim.generate_s={args.generate_s}",
                            f"sim.train_s={args.train_s}", f"sim.refit_s={args.refit_s}", "sim.jitter=0",
                            f"run.seed={rep}"]
                        records = sim_run(overrides, pool, runner, tmp, f"{tail}_{age}_{mode}_{rep}").steps
                        run = steady_figures(records, max(args.ages))
                        raw[tail, age, mode].append(run)
                        print(f"  tail {tail:>4} max_age {age} {mode:8s} rep {rep}: step {run['step_s'] * 1e3:6.1f} ms,"
                              f" busy {run['busy']:.2f}, {run['tokens_per_s']:7.0f} tokens/s", flush=True)
    finally:
        runner.close()
        stop_workers(pool)
    figures = []
    for tail in args.tails:
        for age in args.ages:
            drain, inflight = raw[tail, age, "drain"], raw[tail, age, "inflight"]
            figures.append({
                "tail_ratio": tail, "max_age": age,
                **{f"{m}_{k}": stats([r[k] for r in raw[tail, age, m]]) for m in MODES
                   for k in ("step_s", "busy", "tokens_per_s")},
                "tokens_per_s_ratio": stats([i["tokens_per_s"] / d["tokens_per_s"] for d, i in zip(drain, inflight)]),
                "step_time_ratio": stats([d["step_s"] / i["step_s"] for d, i in zip(drain, inflight)]),
            })
    return figures


def learning(args, tmp: Path) -> list[dict]:
    from pipeline.inputs.tiny import build_tiny_model
    model = build_tiny_model(tmp / "tiny")
    runs = []
    for age in args.learn_ages:
        for seed in args.seeds:
            for mode in MODES:
                run = learning_run("grpo", age, seed, args.learn_steps, args.val_period, model, tmp / "runs",
                                   [f"generation.refit_mode={mode}"], name=f"grpo_{mode}_a{age}_s{seed}")
                runs.append({**run, "refit_mode": mode})
                print(f"grpo max_age {age} {mode:8s} seed {seed}: final val {run['final_val']}, steps to val 0.9 "
                      f"{run['steps_to_val_0.9']}, step {run['step_time_s'] * 1e3:.0f} ms", flush=True)
    return runs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI smoke size: seconds, not a measurement")
    ap.add_argument("--tails", type=float, nargs="+", help="p99/p50 of the response lengths (full 4 10)")
    ap.add_argument("--ages", type=int, nargs="+", help="schedule.max_age values (full 1 2)")
    ap.add_argument("--repeats", type=int, help="repeats of the throughput sweep (full 3, quick 1)")
    ap.add_argument("--steps", type=int, help="steady steps measured per run (full 10, quick 2)")
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16, help="schedule.prompts_per_step")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--generate-s", type=float, help="sim: time to decode max_new_tokens tokens (full 0.4, quick 0.1)")
    ap.add_argument("--train-s", type=float, help="sim: one train step (full 0.1, quick 0.025)")
    ap.add_argument("--refit-s", type=float, default=0.01)
    ap.add_argument("--seeds", type=int, nargs="+", help="learning: run.seed values (full 0 1 2)")
    ap.add_argument("--learn-ages", type=int, nargs="+", help="learning: max_age values (full 1 2)")
    ap.add_argument("--learn-steps", type=int, help="learning: steps per run (full 60, quick 2)")
    ap.add_argument("--val-period", type=int, help="learning: validation period (full 5, quick 0)")
    ap.add_argument("--out", type=Path, help="directory for inflight.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    q = args.quick
    args.tails = args.tails or ([10.0] if q else [4.0, 10.0])
    args.ages = args.ages or ([2] if q else [1, 2])
    args.repeats = args.repeats or (1 if q else 3)
    args.steps = args.steps or (2 if q else 10)
    args.generate_s = args.generate_s or (0.1 if q else 0.4)
    args.train_s = args.train_s or (0.025 if q else 0.1)
    args.seeds = args.seeds or ([0] if q else [0, 1, 2])
    args.learn_ages = args.learn_ages or ([1] if q else [1, 2])
    args.learn_steps = args.learn_steps or (2 if q else 60)
    args.val_period = args.val_period if args.val_period is not None else (0 if q else 5)

    info = machine_info()
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="dagrl_inflight_"))
    start_ray()
    try:
        figures = throughput(args, info, tmp)
        # --quick: the real stack's start-up would be the whole cost; seeds --quick smoke-tests the same run.
        runs = [] if q else learning(args, tmp)
    finally:
        shutdown_ray()
        shutil.rmtree(tmp, ignore_errors=True)
    params = {k: v for k, v in vars(args).items() if k != "out"}
    targets = throughput_targets(figures) + ([] if q else learning_targets(runs))
    result = {"benchmark": "inflight", "params": params, "machine": info, "wall_s": round(time.time() - t0, 1),
              "throughput": figures, "learning": runs if not q else "not run under --quick", "targets": targets}
    path = write_result("inflight", result, args.out)
    print_table(["tail p99/p50", "max_age", "drain tok/s", "inflight tok/s", "ratio", "busy drain", "busy inflight"],
                [[f["tail_ratio"], f["max_age"], f["drain_tokens_per_s"]["median"],
                  f["inflight_tokens_per_s"]["median"], f["tokens_per_s_ratio"]["median"],
                  f["drain_busy"]["median"], f["inflight_busy"]["median"]] for f in figures],
                title="generated tokens/s, simulated workers (ratio: inflight / drain, within a repeat)")
    print_table(["max_age", "seed", "mode", "final val", "steps to val 0.9", "step ms"],
                [[r["max_age"], r["seed"], r["refit_mode"], r["final_val"], r["steps_to_val_0.9"],
                  round(r["step_time_s"] * 1e3)] for r in runs], title="tiny GRPO on the real CPU stack")
    print_targets(targets)
    print(f"wrote {path}")
    return result


def throughput_targets(figures: list[dict]) -> list[dict]:
    """inflight >= 1.5x drain's tokens/s at the heaviest tail, at each max_age."""
    heaviest = max(f["tail_ratio"] for f in figures)
    return [{"target": f"tokens/s inflight / drain >= 1.5 (tail {heaviest}, max_age {f['max_age']})",
             "value": round(f["tokens_per_s_ratio"]["median"], 3), "met": f["tokens_per_s_ratio"]["median"] >= 1.5}
            for f in figures if f["tail_ratio"] == heaviest]


def learning_targets(runs: list[dict]) -> list[dict]:
    """Median steps to validation 0.9, inflight against drain, per max_age (a seed that never got there: never)."""
    out = []
    for age in sorted({r["max_age"] for r in runs}):
        med = {m: median_with_never([r["steps_to_val_0.9"] for r in runs
                                      if r["max_age"] == age and r["refit_mode"] == m]) for m in MODES}
        out.append({"target": f"median steps to val 0.9, max_age {age}: inflight vs drain",
                    "value": f"{med['inflight']} vs {med['drain']}",
                    "met": med["inflight"] is not None and med["drain"] is not None
                    and med["inflight"] <= med["drain"] + LEARNING_NOISE_STEPS})
    return out


if __name__ == "__main__":
    main()
