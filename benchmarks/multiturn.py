"""Multi-turn rollouts with a simulated tool: async against sync, step time and generated tokens/s.

Simulated workers (backend sim) play the simulated tool environment
`pipeline.sim.env:SimToolEnv` (pipeline/sim/env.py). Each sample alternates
model turns and tool calls (pipeline/generator/episodes.py): a turn's length is
lognormal (sim.response_len, p99 / p50 = --len-tail, capped at max_new_tokens),
a tool call sleeps its latency (fixed at --latency-s, or lognormal with median
--latency-s and p99 / p50 = --tool-tail), answers 8 observation tokens (masked
out of the loss, not counted as generated), and the episode ends after `turns`
model turns: 1, 2, 4, or "random" (1 to 4, drawn from the prompt);
env.max_turns is 4 everywhere. An engine step gives every running request one
token in the same time, however many run (a memory-bound decode), and a sample
waiting for its tool holds up only itself, never the engine.

The two schedules, on the same generators, trainer and batch sizes (equal
workers), differ only in these two keys:

  sync   schedule.max_age=0, generation.refit_mode=drain: generation and
         training never overlap; a step waits for its batch's slowest sample,
         turn after turn and tool call after tool call, then trains.
  async  schedule.max_age=2, generation.refit_mode=inflight: batches are
         launched up to two steps ahead and refits land between engine steps,
         so the tool waits and long tails of one batch run beside the next
         batches' turns and beside training.

Why max_age 2 and not 1: a multi-turn batch's time is the longest chain of
turns and tool calls among its samples, several times its mean, and the tool
waits leave the engine idle. With max_age 1 a batch must be done by the step
after its launch, so at most two batches share the engine and tokens/s can at
best double, less whatever the tail leaves idle: no room over a 1.6x target
(inflight.py measured 1.40-1.45x at max_age 1 on single-turn tails, against
1.92-2.03x at max_age 2). max_age 2 lets three batches overlap (a 3x
ceiling). inflight.py part 2 found learning at max_age 2 with in-flight
refits as fast in steps as draining (the tiny GRPO recipe, 3 seeds).

Grid: tool latency fixed or lognormal (tail 10), x turns 1, 2, 4, random;
with --pool-workers N one more cell, lognormal / random turns with the
environments in a pool of N Ray actors per generator (env.actors N, each
taking one call at a time), run beside the same cell with env.threads N (the
same bound on calls at once, in the generator's threads): the pair shows what
the actor hop costs, apart from the bound. For each cell, sync and async run
back to back on one set of actors, the order rotated per repeat. Per run, over
the steady steps (the first 3 and the last 2 left out): median and mean step
time, generated tokens/s (sum of model_tokens / sum of step times), the
generators' busy fraction (1 - generator_idle) and the observation tokens'
share of the response tokens. Ratios async / sync are taken within a repeat.
Both schedules train the same batches (same seeds: the same model tokens step
by step), so tokens/s and mean step time give the same ratio. The median step
misleads under async: where a batch takes longer than two training steps, the
steps come in cycles of max_age + 1 (two quick ones that find their batch
ready, one that waits for it), so the steady window is 9 steps, a whole number
of cycles. Every run's event log goes through check-events
(pipeline.tools.check), and environment failures (reward_failures) are
counted: both must be 0.

Settings (full): 2 generators, 16 prompts x 4 samples per step, max_new_tokens
32 per turn, sim.generate_s 0.2 (6.25 ms per engine step), turn lengths
lognormal with p99 / p50 4 (median 8 tokens, 50 ms; the longest of a batch
near 32, 0.2 s), tool latency median 0.1 s (fixed: every call; lognormal:
p99 1 s, mean 0.16 s), every model turn followed by one tool call (the last
one scores the episode), sim.train_s 0.15, refit 0.01 s, no jitter, 14 steps
per run (9 measured), 3 repeats, runs with env.actors 0 (the
environments in the generator's threads, env.threads 64).

Target (the issue): async >= 1.6x sync's generated tokens/s at equal workers,
reported per (latency, turns) cell.

    .venv/bin/python -m benchmarks.multiturn            # full: about 11 minutes on 2 cores
    .venv/bin/python -m benchmarks.multiturn --quick    # CI smoke: one cell, seconds; not a measurement
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import machine_info, print_table, print_targets, sample_load, shutdown_ray, start_ray
from benchmarks.harness import stats, write_result
from benchmarks.workloads import sim_run

SIM_ENV = "pipeline.sim.env:SimToolEnv"
ASYNC_MAX_AGE = 2
MODES = {"sync": ["schedule.max_age=0", "generation.refit_mode=drain"],
         "async": [f"schedule.max_age={ASYNC_MAX_AGE}", "generation.refit_mode=inflight"]}
MAX_TURNS = 4
SKIP_FIRST = 3            # the prologue's batches and the first refits
SKIP_LAST = ASYNC_MAX_AGE  # async's last steps train batches launched before the end: no new ones beside them
TARGET = 1.6
FIGURES = ("step_s", "step_mean_s", "tokens_per_s", "busy", "observation_share")


def steady_figures(overrides: list[str], pool, runner, out_dir: Path, name: str) -> dict:
    """One run (workloads.sim_run, its event log checked) and its figures over the steady steps."""
    summary, steps, violations = sim_run(overrides, pool, runner, out_dir, name, check=True)
    steady = steps[SKIP_FIRST:len(steps) - SKIP_LAST]
    elapsed = sum(r["step_time_s"] for r in steady)
    model = sum(r.get("model_tokens", r["response_tokens"]) for r in steady)
    response = sum(r["response_tokens"] for r in steady)
    return {"step_s": statistics.median(r["step_time_s"] for r in steady),
            "step_mean_s": elapsed / len(steady),
            "tokens_per_s": model / elapsed,
            "busy": statistics.mean(1.0 - r["generator_idle"] for r in steady),
            "observation_share": 1.0 - model / response,
            "env_failures": int(summary["accounting"].get("reward_failures", 0)),
            "violations": [str(getattr(v, "message", v)) for v in violations],
            "reward_end": steady[-1]["reward_mean"]}


def cells(args) -> list[dict]:
    out = [{"latency": lat, "turns": turns, "env": "threads"} for lat in args.latencies for turns in args.turns]
    if args.pool_workers:
        out += [{"latency": "lognormal", "turns": "random", "env": f"threads={args.pool_workers}"},
                {"latency": "lognormal", "turns": "random", "env": f"pool={args.pool_workers}"}]
    return out


def cell_overrides(args, cell: dict) -> list[str]:
    env_args = (f"{{turns: {cell['turns']}, max_turns: {MAX_TURNS}, latency_s: {args.latency_s}, "
                f"latency: {cell['latency']}, tail_ratio: {args.tool_tail}, observation_tokens: 8}}")
    kind, _, n = cell["env"].partition("=")
    pool = [f"env.actors={n}"] if kind == "pool" else [f"env.threads={n}"] if n else []
    return [f"env.class={SIM_ENV}", f"env.args={env_args}", f"env.max_turns={MAX_TURNS}", *pool]


def cell_name(cell: dict) -> str:
    return f"{cell['latency']}_{cell['turns']}_{cell['env'].replace('=', '')}"


def throughput(args, info: dict, tmp: Path) -> list[dict]:
    from dags.step_graph import build_step_graph
    from pipeline.run.pool import start_workers, stop_workers
    from pipeline.run.runner import GraphRunner
    steps = SKIP_FIRST + args.steps + SKIP_LAST
    grid = cells(args)
    raw: dict = {(cell_name(c), m): [] for c in grid for m in MODES}
    pool = start_workers(args.generators)
    runner = GraphRunner(build_step_graph(pool), "classic", first_deadline_s=120)
    try:
        for rep in range(args.repeats):
            for cell in grid:
                for mode in (list(MODES) if rep % 2 == 0 else list(MODES)[::-1]):
                    sample_load(info)
                    started = time.time()
                    run = steady_figures([
                        "backend=sim", f"run.steps={steps}", "run.dag_mode=classic", "validation.period=0",
                        "metrics.tensorboard=false", f"generation.num_generators={args.generators}",
                        *MODES[mode], f"generation.max_new_tokens={args.max_new_tokens}",
                        f"schedule.prompts_per_step={args.prompts}", f"schedule.group_size={args.group}",
                        "sim.response_len=lognormal", f"sim.tail_ratio={args.len_tail}",
                        f"sim.generate_s={args.generate_s}", f"sim.train_s={args.train_s}",
                        f"sim.refit_s={args.refit_s}", "sim.jitter=0", f"run.seed={rep}",
                        *cell_overrides(args, cell)], pool, runner, tmp, f"{cell_name(cell)}_{mode}_{rep}")
                    run["wall_s"] = time.time() - started
                    raw[cell_name(cell), mode].append(run)
                    print(f"  {cell['latency']:9s} turns {cell['turns']:>6} {cell['env']:9s} {mode:5s} rep {rep}: "
                          f"step {run['step_s'] * 1e3:6.1f} ms, busy {run['busy']:.2f}, "
                          f"{run['tokens_per_s']:6.0f} tokens/s, obs {run['observation_share']:.2f}, "
                          f"env failures {run['env_failures']}, violations {len(run['violations'])}, "
                          f"run {run['wall_s']:.1f} s", flush=True)
    finally:
        runner.close()
        stop_workers(pool)
    figures = []
    for cell in grid:
        sync, asyn = raw[cell_name(cell), "sync"], raw[cell_name(cell), "async"]
        figures.append({
            **cell,
            **{f"{m}_{k}": stats([r[k] for r in raw[cell_name(cell), m]]) for m in MODES for k in FIGURES},
            "tokens_per_s_ratio": stats([a["tokens_per_s"] / s["tokens_per_s"] for s, a in zip(sync, asyn)]),
            "median_step_ratio": stats([s["step_s"] / a["step_s"] for s, a in zip(sync, asyn)]),
            "mean_step_ratio": stats([s["step_mean_s"] / a["step_mean_s"] for s, a in zip(sync, asyn)]),
            "env_failures": sum(r["env_failures"] for r in sync + asyn),
            "violations": sorted({v for r in sync + asyn for v in r["violations"]}),
            "run_wall_s": stats([r["wall_s"] for r in sync + asyn]),
        })
    return figures


def targets(figures: list[dict]) -> list[dict]:
    """async >= 1.6x sync's tokens/s per cell; and every run clean (no violation, no environment failure)."""
    out = [{"target": f"tokens/s async / sync >= {TARGET} ({f['latency']}, turns {f['turns']}, env {f['env']})",
            "value": round(f["tokens_per_s_ratio"]["median"], 3), "met": f["tokens_per_s_ratio"]["median"] >= TARGET}
           for f in figures]
    bad = sum(len(f["violations"]) + f["env_failures"] for f in figures)
    out.append({"target": "check-events violations + environment failures == 0", "value": bad, "met": bad == 0})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI smoke size: seconds, not a measurement")
    ap.add_argument("--latencies", nargs="+", choices=("fixed", "lognormal"),
                    help="tool latency kinds (full fixed lognormal, quick lognormal)")
    ap.add_argument("--turns", nargs="+", help="model turns per episode: numbers up to 4, or random (full 1 2 4 "
                    "random, quick 2)")
    ap.add_argument("--pool-workers", type=int, help="add the pool cell: env.actors N against env.threads N "
                    "(full 0: left out, quick 0)")
    ap.add_argument("--repeats", type=int, help="repeats of the sweep (full 3, quick 1)")
    ap.add_argument("--steps", type=int, help="steady steps measured per run (full 9, quick 2)")
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--prompts", type=int, help="schedule.prompts_per_step (full 16, quick 8)")
    ap.add_argument("--group", type=int, default=4, help="schedule.group_size")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="per turn")
    ap.add_argument("--len-tail", type=float, default=4.0, help="sim.tail_ratio: p99/p50 of a turn's length")
    ap.add_argument("--generate-s", type=float, help="sim: time to decode max_new_tokens tokens (full 0.2, "
                    "quick 0.05)")
    ap.add_argument("--latency-s", type=float, help="tool call latency, the median (full 0.1, quick 0.04)")
    ap.add_argument("--tool-tail", type=float, default=10.0, help="lognormal tool latency: p99/p50")
    ap.add_argument("--train-s", type=float, help="sim: one train step (full 0.15, quick 0.04)")
    ap.add_argument("--refit-s", type=float, default=0.01)
    ap.add_argument("--out", type=Path, help="directory for multiturn.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    q = args.quick
    args.latencies = args.latencies or (["lognormal"] if q else ["fixed", "lognormal"])
    args.turns = [t if t == "random" else int(t) for t in (args.turns or (["2"] if q else ["1", "2", "4", "random"]))]
    if any(t != "random" and not 1 <= t <= MAX_TURNS for t in args.turns):
        ap.error(f"--turns: numbers from 1 to {MAX_TURNS}, or random")
    args.pool_workers = args.pool_workers or 0
    args.repeats = args.repeats or (1 if q else 3)
    args.prompts = args.prompts or (8 if q else 16)
    args.steps = args.steps or (2 if q else 9)
    args.generate_s = args.generate_s or (0.05 if q else 0.2)
    args.latency_s = args.latency_s or (0.04 if q else 0.1)
    args.train_s = args.train_s or (0.04 if q else 0.15)

    info = machine_info()
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="dagrl_multiturn_"))
    start_ray()
    try:
        figures = throughput(args, info, tmp)
    finally:
        shutdown_ray()
        shutil.rmtree(tmp, ignore_errors=True)
    params = {k: v for k, v in vars(args).items() if k != "out"}
    params.update({"async_max_age": ASYNC_MAX_AGE, "env_max_turns": MAX_TURNS, "skip_first": SKIP_FIRST,
                   "skip_last": SKIP_LAST, "modes": MODES})
    tgts = targets(figures)
    result = {"benchmark": "multiturn", "params": params, "machine": info, "wall_s": round(time.time() - t0, 1),
              "figures": figures, "targets": tgts}
    path = write_result("multiturn", result, args.out)
    print_table(["latency", "turns", "env", "step ms sync", "async (median)", "async (mean)", "tok/s sync",
                 "async", "ratio", "min", "max", "busy sync", "busy async"],
                [[f["latency"], f["turns"], f["env"], round(f["sync_step_s"]["median"] * 1e3),
                  round(f["async_step_s"]["median"] * 1e3), round(f["async_step_mean_s"]["median"] * 1e3),
                  round(f["sync_tokens_per_s"]["median"]),
                  round(f["async_tokens_per_s"]["median"]), f["tokens_per_s_ratio"]["median"],
                  f["tokens_per_s_ratio"]["min"], f["tokens_per_s_ratio"]["max"], f["sync_busy"]["median"],
                  f["async_busy"]["median"]] for f in figures],
                title="generated (model) tokens/s, simulated workers and tool (ratio: async / sync, within a repeat)")
    print_targets(tgts)
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
