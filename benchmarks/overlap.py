"""Overlap of generation and training: sync (max_age 0) against async (max_age 1, 2).

Simulated workers sleep for a set generation time G (one rollout batch per
generator per step), training time T and refit time R; a sleeping worker frees
its core, as a GPU worker does from the host's view. For each G/T ratio and
each graph mode the script runs the same schedule with max_age 0, 1 and 2 back
to back on one set of actors, and reports per run the steady-state step time,

    efficiency = ideal / measured,   ideal = max(G, T) + R
    speedup    = sync step time / async step time   (both from the same repeat)

Target (issue): efficiency >= 0.95 and speedup >= 0.95 * (G + T) / max(G, T)
at G = T.

    .venv/bin/python -m benchmarks.overlap            # full: about 5 minutes
    .venv/bin/python -m benchmarks.overlap --quick    # CI smoke run: seconds
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.harness import machine_info, print_table, sample_load, shutdown_ray, start_ray, stats, write_result
from benchmarks.workloads import sim_run

AGES = (0, 1, 2)
RATIOS = (0.5, 1.0, 2.0)   # G / T
SKIP_FIRST = max(AGES) + 1  # pipeline fill: the prologue's batches and the first refits
SKIP_LAST = max(AGES)       # pipeline drain: the last max_age steps have nothing in flight to wait for


def times_for(ratio: float, scale: float) -> tuple[float, float]:
    """(G, T) with the longer of the two equal to `scale`, so that every ratio has the same ideal step."""
    return (scale * ratio, scale) if ratio <= 1 else (scale, scale / ratio)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI smoke size: seconds, not a measurement")
    ap.add_argument("--scale", type=float, help="the longer of G and T, seconds (full 0.2, quick 0.05)")
    ap.add_argument("--refit", type=float, help="R, seconds (default scale / 20)")
    ap.add_argument("--steps", type=int, help="steady-state steps measured per run (full 8, quick 3)")
    ap.add_argument("--repeats", type=int, help="repeats of the whole sweep (full 3, quick 1)")
    ap.add_argument("--generators", type=int, default=2)
    ap.add_argument("--modes", default="classic,compiled", help="graph modes, comma-separated")
    ap.add_argument("--ratios", help="G/T ratios, comma-separated (full 0.5,1,2; quick 1)")
    ap.add_argument("--jitter", type=float, default=0.0, help="sim.jitter")
    ap.add_argument("--out", type=Path, help="directory for overlap.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    scale = args.scale or (0.05 if args.quick else 0.2)
    refit = args.refit if args.refit is not None else scale / 20
    measured = args.steps or (3 if args.quick else 8)
    repeats = args.repeats or (1 if args.quick else 3)
    modes = [m for m in args.modes.split(",") if m]
    ratios = [float(r) for r in args.ratios.split(",")] if args.ratios else ([1.0] if args.quick else list(RATIOS))
    steps = SKIP_FIRST + measured + SKIP_LAST

    from dags.step_graph import build_step_graph
    from pipeline.run.pool import start_workers, stop_workers
    from pipeline.run.runner import GraphRunner

    info = machine_info()
    params = {"quick": args.quick, "scale_s": scale, "refit_s": refit, "ratios_G_over_T": ratios,
              "max_ages": list(AGES), "modes": modes, "generators": args.generators, "repeats": repeats,
              "steps_per_run": steps, "steps_skipped_first": SKIP_FIRST, "steps_skipped_last": SKIP_LAST,
              "jitter": args.jitter, "validation": "none (validation.period=0)"}
    # raw[mode][ratio][age] -> per repeat: median steady-state step time of that run
    raw: dict = {m: {r: {a: [] for a in AGES} for r in ratios} for m in modes}
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="dagrl_overlap_"))
    start_ray()
    pool = runner = None
    try:
        pool = start_workers(args.generators)
        for mode in modes:
            # One runner per mode, alive only during that mode's runs: a compiled
            # graph's actor loops spin even between executions.
            runner = GraphRunner(build_step_graph(pool), mode, first_deadline_s=120)
            try:
                for rep in range(repeats):
                    for ratio in ratios:
                        g, t = times_for(ratio, scale)
                        order = AGES[rep % len(AGES):] + AGES[:rep % len(AGES)]  # rotate who runs first
                        for age in order:
                            overrides = [f"sim.generate_s={g}", f"sim.train_s={t}", f"sim.refit_s={refit}",
                                         "sim.validate_s=0", f"sim.jitter={args.jitter}", f"schedule.max_age={age}",
                                         "validation.period=0", f"run.steps={steps}", f"run.dag_mode={mode}",
                                         f"generation.num_generators={args.generators}", "run.deadline_s=60"]
                            sample_load(info)
                            run = sim_run(overrides, pool, runner, tmp, f"{mode}_{ratio}_{age}_{rep}")
                            times = [r["step_time_s"] for r in run.steps]
                            steady = times[SKIP_FIRST:len(times) - SKIP_LAST]
                            raw[mode][ratio][age].append(stats(steady)["median"])
                            print(f"  {mode:8s} G/T={ratio:<4} max_age={age} rep={rep}: "
                                  f"step {stats(steady)['median'] * 1e3:7.1f} ms", flush=True)
            finally:
                runner.close()
                runner = None
    finally:
        if runner is not None:
            runner.close()
        if pool is not None:
            stop_workers(pool)
        shutdown_ray()
        shutil.rmtree(tmp, ignore_errors=True)

    figures, rows = [], []
    for mode in modes:
        for ratio in ratios:
            g, t = times_for(ratio, scale)
            ideal_async, ideal_sync = max(g, t) + refit, g + t + refit
            sync = raw[mode][ratio][0]
            for age in AGES:
                meas = raw[mode][ratio][age]
                ideal = ideal_sync if age == 0 else ideal_async
                eff = [ideal_async / m for m in meas]              # the efficiency: against max(G, T) + R
                eff_own = [ideal / m for m in meas]                # against this schedule's own ideal
                speed = [s / m for s, m in zip(sync, meas)]        # within one repeat
                fig = {"mode": mode, "G_over_T": ratio, "G_s": g, "T_s": t, "R_s": refit, "max_age": age,
                       "ideal_step_s": ideal, "ideal_async_step_s": ideal_async,
                       "step_s": stats(meas), "overhead_ms": stats([(m - ideal) * 1e3 for m in meas]),
                       "efficiency": stats(eff), "efficiency_vs_own_ideal": stats(eff_own),
                       "speedup_over_sync": stats(speed),
                       "ideal_speedup": ideal_sync / ideal, "target_speedup": 0.95 * (g + t) / max(g, t)}
                figures.append(fig)
                rows.append([mode, ratio, age, ideal * 1e3, fig["step_s"]["median"] * 1e3,
                             f"{fig['step_s']['spread'] * 1e3:.1f}", fig["efficiency"]["median"],
                             fig["efficiency_vs_own_ideal"]["median"], fig["speedup_over_sync"]["median"],
                             f"{fig['speedup_over_sync']['min']:.3f}-{fig['speedup_over_sync']['max']:.3f}",
                             fig["ideal_speedup"]])
    targets = []
    for mode in modes:
        for age in AGES[1:]:
            f = next(x for x in figures if x["mode"] == mode and x["G_over_T"] == 1.0 and x["max_age"] == age) \
                if 1.0 in ratios else None
            if f is None:
                continue
            ovh = f["overhead_ms"]["median"] / 1e3
            targets.append({"mode": mode, "max_age": age, "overhead_ms_per_step": ovh * 1e3,
                            # With this fixed per-step overhead, efficiency >= 0.95 needs an ideal step of 19 x it.
                            "ideal_step_s_for_efficiency_0.95": 19 * max(ovh, 0.0),
                            "efficiency": f["efficiency"]["median"], "efficiency_target": 0.95,
                            "efficiency_met": f["efficiency"]["median"] >= 0.95,
                            "speedup": f["speedup_over_sync"]["median"], "speedup_target": f["target_speedup"],
                            "speedup_met": f["speedup_over_sync"]["median"] >= f["target_speedup"]})
    print_table(["mode", "G/T", "max_age", "ideal ms", "step ms", "spread ms", "eff", "eff(own)",
                 "speedup", "speedup range", "ideal speedup"], rows,
                title=f"overlap: longer of G,T = {scale * 1e3:.0f} ms, R = {refit * 1e3:.0f} ms, "
                      f"{args.generators} generators, median of {repeats} repeats x {measured} steady steps")
    print_table(["mode", "max_age", "efficiency", ">= 0.95", "speedup", "target", "met", "overhead ms",
                 "step s for eff 0.95"],
                [[x["mode"], x["max_age"], x["efficiency"], x["efficiency_met"], x["speedup"],
                  x["speedup_target"], x["speedup_met"], x["overhead_ms_per_step"],
                  x["ideal_step_s_for_efficiency_0.95"]] for x in targets], title="targets at G = T")
    result = {"benchmark": "overlap", "machine": info, "params": params, "figures": figures,
              "targets": targets, "wall_s": round(time.time() - t_start, 1)}
    path = write_result("overlap", result, args.out)
    print(f"\nwrote {path} (load average {result['machine']['loadavg_start']} -> "
          f"{result['machine']['loadavg_end']}, during {result['machine'].get('loadavg_1min_during')})")
    return result


if __name__ == "__main__":
    main()
