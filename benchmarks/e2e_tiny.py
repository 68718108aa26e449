"""The real CPU stack on the tiny task: synchronous (max_age 0) against async (max_age 1).

Each run is `pipeline.run.driver.train` on examples/tiny_grpo.yaml (vLLM-CPU
generating, DeepSpeed-CPU training, one generator) with a freshly built tiny
model. Sync and async run back to back in one process on one local Ray, with
the same seed within a repeat and the order alternating between repeats, so
that each ratio is taken within one repeat. Per run, from metrics.jsonl and
events.jsonl:

  time to threshold   wall time from the start of step 0 (its `sample` node)
                      to the end of the first step k whose running mean of the
                      last `window` reward_means is >= the threshold
  generated tokens/s  response tokens / seconds during which a rollout ran in
                      vLLM (engine), and / step time (pipeline)
  trainer tokens/s    response tokens / seconds in DeepSpeedPolicyEngine.train_step
  breakdown per step  sample (waiting for the batch), train, drain (refit node
                      waiting for in-flight rollouts), weight load, validation,
                      gate + resume + collect, other (Ray dispatch between nodes);
                      exposed generation = sample + drain; hidden generation =
                      rollout time inside the step that the step did not wait for
  overlap bound       each sync step minus the shorter of its generation wait and
                      its training: the async/sync step ratio that perfect overlap
                      would give if running both at once slowed neither

Target (issue): async reaches the threshold in <= 0.7 x the sync wall time.

On a 2-core machine vLLM and DeepSpeed share the same two cores, so async
overlap gains less than it would where each worker owns its device.

    .venv/bin/python -m benchmarks.e2e_tiny            # full: 4 repeats x 30 steps, 4-10 minutes
    .venv/bin/python -m benchmarks.e2e_tiny --quick    # CI smoke run: 3 steps each, about 1-2 minutes
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, first_crossing, machine_info, print_table, print_targets, read_jsonl
from benchmarks.harness import shutdown_ray, start_ray, stats, write_result
from benchmarks.workloads import MODES, RECIPES, run_train

RECIPE = RECIPES["grpo"]
TARGET_RATIO = 0.7
# Per-step components, in the order the step graph runs them (one generator: a chain).
PARTS = ("sample", "train", "validation_gate", "drain", "load", "validate", "resume", "collect", "other")


# --- reading one run --------------------------------------------------------------------------

def _spans(events: list[dict], start_ev: str, end_ev: str, key) -> dict:
    """{key(event): (start t, end t)} pairing start/end events with the same key."""
    starts, out = {}, {}
    for e in events:
        if e["ev"] == start_ev:
            starts[key(e)] = e["t"]
        elif e["ev"] == end_ev and key(e) in starts:
            out[key(e)] = (starts.pop(key(e)), e["t"])
    return out


def _busy_within(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the union of the intervals."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def analyse_run(run_dir: Path, threshold: float, window: int) -> dict:
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] >= 0]
    events = read_jsonl(run_dir / "events.jsonl")
    nodes = _spans(events, "node_start", "node_end", lambda e: (e["node"], e["step"], e["worker"]))
    loads = _spans(events, "refit_start", "refit_end", lambda e: (e["step"], e["worker"]))
    vals = _spans(events, "validation_start", "validation_end", lambda e: (e["step"], e["worker"]))
    rollouts = list(_spans(events, "rollout_start", "rollout_end", lambda e: e["batch"]).values())
    failed = [e for e in events if e["ev"] == "rollout_end" and e.get("failed")]

    def node_span(name: str, step: int) -> tuple[float, float] | None:
        """Start of the earliest, end of the latest instance (generators run in parallel)."""
        hits = [v for (n, s, _), v in nodes.items() if n == name and s == step]
        return (min(a for a, _ in hits), max(b for _, b in hits)) if hits else None

    steps = []
    for m in metrics:
        s = m["step"]
        sample = node_span("sample", s)
        ends = [b for (n, st, _), (_, b) in nodes.items() if st == s]
        if sample is None or not ends:
            raise RuntimeError(f"{run_dir}: no node events for step {s}")
        lo, hi = sample[0], max(ends)
        part = {name: (lambda sp: sp[1] - sp[0] if sp else 0.0)(node_span(name, s))
                for name in ("sample", "train", "validation_gate", "validate", "resume", "collect")}
        refit = node_span("refit", s)
        load = [v for (st, _), v in loads.items() if st == s]
        load_lo = min((a for a, _ in load), default=refit[1] if refit else 0.0)
        part["drain"] = (load_lo - refit[0]) if refit else 0.0
        part["load"] = ((max(b for _, b in load) - load_lo) if load else 0.0)
        refit_tail = (refit[1] - max(b for _, b in load)) if refit and load else 0.0
        chain = sum(part.values()) + refit_tail
        part["other"] = max(hi - lo - chain, 0.0)
        exposed = part["sample"] + part["drain"]
        gen_in_step = _busy_within(rollouts, lo, hi)
        steps.append({
            "step": s, "t_start": lo, "t_end": hi, "step_time_s": m["step_time_s"],
            "span_s": hi - lo, "reward_mean": m["reward_mean"], "age_mean": m.get("age_mean", 0.0),
            "response_tokens": m["response_tokens"], "train_step_s": m["time_s"],
            **{f"{k}_s": v for k, v in part.items()},
            "validation_s": sum(b - a for (st, _), (a, b) in vals.items() if st == s),
            "exposed_generation_s": exposed,
            "generation_in_step_s": gen_in_step,
            "hidden_generation_s": max(gen_in_step - exposed, 0.0),
        })

    rewards = [m["reward_mean"] for m in metrics]
    k = first_crossing(rewards, threshold, window)
    t0 = steps[0]["t_start"]
    # Seconds vLLM was busy: the union, since batches launched together share one engine call.
    gen_time = _busy_within(rollouts, float("-inf"), float("inf"))
    tokens = sum(m["response_tokens"] for m in metrics)
    step_total = sum(m["step_time_s"] for m in metrics)
    steady = steps[1:] or steps   # step 0 waits for the first batch in both modes
    return {
        "steps": len(metrics),
        "rewards": [round(r, 6) for r in rewards],
        "steps_to_threshold": None if k is None else k + 1,
        "time_to_threshold_s": None if k is None else steps[k]["t_end"] - t0,
        "reward_last_window": sum(rewards[-window:]) / len(rewards[-window:]),
        # train() called (t = 0) to step 0: actors, vLLM and DeepSpeed set-up, the prologue.
        "startup_s": t0,
        "steps_wall_s": steps[-1]["t_end"] - t0,
        "step_time_s": stats([m["step_time_s"] for m in metrics]),
        "steady_step_time_s": stats([s["step_time_s"] for s in steady]),
        "generated_tokens_per_s_engine": tokens / gen_time if gen_time else None,
        "generated_tokens_per_s_pipeline": tokens / step_total if step_total else None,
        "trainer_tokens_per_s": tokens / sum(m["time_s"] for m in metrics),
        "rollout_s": stats([b - a for a, b in rollouts]),
        "failed_rollouts": len(failed),
        # Median over the steady steps of each component of the step.
        "breakdown_s": {key: stats([s[key] for s in steady])["median"] for key in
                        [f"{p}_s" for p in PARTS] + ["validation_s", "exposed_generation_s",
                                                    "hidden_generation_s", "generation_in_step_s",
                                                    "step_time_s", "train_step_s"]},
        "per_step": steps,
    }


# --- running ----------------------------------------------------------------------------------

def run_once(model: Path, out_dir: Path, name: str, max_age: int, steps: int, seed: int,
             dag_mode: str, extra: list[str]) -> Path:
    from pipeline.config import load_config
    cfg = load_config(RECIPE, [
        f"model.path={model}", f"data.train={ROOT / 'data' / 'tiny_train.jsonl'}",
        f"data.val={ROOT / 'data' / 'tiny_val.jsonl'}", f"schedule.max_age={max_age}",
        f"run.output_dir={out_dir}", f"run.name={name}", f"run.steps={steps}", f"run.seed={seed}",
        "run.checkpoint_every=0", "validation.period=0", "validation.at_end=false", "validation.at_start=false",
        f"run.dag_mode={dag_mode}", *extra])
    run_train(cfg, name)
    return out_dir / name


def default_dag_mode() -> str:
    """What `auto` would choose if Ray were told the real core count: Ray is started
    with 8 logical CPUs (so that fractional actors never wait), which alone would
    make `auto` choose compiled graphs, whose channels spin a core each."""
    from pipeline.config import load_config
    from pipeline.run.startup import resolve_dag_mode
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return resolve_dag_mode(load_config(RECIPE, ["run.dag_mode=auto"]), cores)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI smoke size: 3 steps each, one repeat; not a measurement")
    ap.add_argument("--steps", type=int, help="steps per run (full 30, quick 3)")
    ap.add_argument("--repeats", type=int, help="repeats of the sync/async pair (full 4, quick 1)")
    ap.add_argument("--threshold", type=float, default=0.1,
                    help="reward threshold for the running mean of --window steps (default 0.1)")
    ap.add_argument("--window", type=int, default=3, help="running-mean window in steps (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="run.seed of the first repeat; repeat r uses seed + r")
    ap.add_argument("--dag-mode", choices=("classic", "compiled"),
                    help="run.dag_mode (default: what auto picks for this machine's real cores)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for every run (repeatable)")
    ap.add_argument("--keep-runs", type=Path, help="keep every run directory (events, traces) under this folder")
    ap.add_argument("--out", type=Path, help="directory for e2e_tiny.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.quick else 30)
    repeats = args.repeats or (1 if args.quick else 4)
    if steps < args.window:
        ap.error(f"--steps {steps} must be at least --window {args.window}")

    from pipeline.inputs.tiny import build_tiny_model, model_digest

    info = machine_info()
    dag_mode = args.dag_mode or default_dag_mode()
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="dagrl_e2e_tiny_"))
    runs_dir = args.keep_runs or (tmp / "runs")
    runs: dict[int, list[dict]] = {age: [] for age in MODES}
    try:
        model = build_tiny_model(tmp / "model")
        params = {"quick": args.quick, "recipe": str(RECIPE.relative_to(ROOT)), "steps_per_run": steps,
                  "repeats": repeats, "threshold": args.threshold, "window": args.window,
                  "seeds": [args.seed + r for r in range(repeats)], "max_ages": {v: k for k, v in MODES.items()},
                  "dag_mode": dag_mode, "ray_logical_cpus": 8, "overrides": args.set,
                  "model_digest": model_digest(model), "target_ratio": TARGET_RATIO,
                  "validation": "none (val_period=0, val_at_end=false)", "checkpoints": "none"}
        start_ray(num_cpus=8)
        for rep in range(repeats):
            order = list(MODES) if rep % 2 == 0 else list(MODES)[::-1]   # alternate who runs first
            for age in order:
                name = f"{MODES[age]}_r{rep}"
                t = time.time()
                run_dir = run_once(model, runs_dir, name, age, steps, args.seed + rep, dag_mode, args.set)
                r = analyse_run(run_dir, args.threshold, args.window)
                r.update(repeat=rep, seed=args.seed + rep, run_wall_s=round(time.time() - t, 2))
                runs[age].append(r)
                ttt = r["time_to_threshold_s"]
                print(f"  {MODES[age]:5s} rep={rep} seed={args.seed + rep}: step {r['steady_step_time_s']['median']:.3f} s, "
                      f"reward {r['rewards'][0]:.3f} -> {r['reward_last_window']:.3f}, threshold "
                      + (f"at step {r['steps_to_threshold']} after {ttt:.1f} s" if ttt is not None else "not reached")
                      + f" (run {r['run_wall_s']:.0f} s, start-up {r['startup_s']:.0f} s)", flush=True)
                if args.keep_runs is None:
                    shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        shutdown_ray()
        shutil.rmtree(tmp, ignore_errors=True)

    result = summarise(runs, params, info, repeats)
    result["wall_s"] = round(time.time() - t_start, 1)
    report(result)
    path = write_result("e2e_tiny", result, args.out)
    print(f"\nwrote {path} (load average {result['machine']['loadavg_start']} -> "
          f"{result['machine']['loadavg_end']})")
    return result


# --- summary ----------------------------------------------------------------------------------

def _ratio(a, b):
    return a / b if a is not None and b else None


def perfect_overlap_bound(sync_run: dict) -> float:
    steady = sync_run["per_step"][1:] or sync_run["per_step"]
    ideal = [st["step_time_s"] - min(st["sample_s"], st["train_s"]) for st in steady]
    return stats(ideal)["median"] / stats([st["step_time_s"] for st in steady])["median"]


def summarise(runs: dict[int, list[dict]], params: dict, info: dict, repeats: int) -> dict:
    figures: dict = {}
    for age, name in MODES.items():
        rs = runs[age]
        reached = [r["time_to_threshold_s"] for r in rs if r["time_to_threshold_s"] is not None]
        figures[name] = {
            "max_age": age,
            "reached_threshold": f"{len(reached)}/{len(rs)}",
            "time_to_threshold_s": stats(reached),
            "steps_to_threshold": stats([r["steps_to_threshold"] for r in rs if r["steps_to_threshold"]]),
            "steady_step_time_s": stats([r["steady_step_time_s"]["median"] for r in rs]),
            "steps_wall_s": stats([r["steps_wall_s"] for r in rs]),
            "startup_s": stats([r["startup_s"] for r in rs]),
            "reward_last_window": stats([r["reward_last_window"] for r in rs]),
            "generated_tokens_per_s_engine": stats([r["generated_tokens_per_s_engine"] for r in rs
                                                    if r["generated_tokens_per_s_engine"]]),
            "generated_tokens_per_s_pipeline": stats([r["generated_tokens_per_s_pipeline"] for r in rs]),
            "trainer_tokens_per_s": stats([r["trainer_tokens_per_s"] for r in rs]),
            "breakdown_s": {key: stats([r["breakdown_s"][key] for r in rs]) for key in rs[0]["breakdown_s"]},
        }
    pairs = [(next(r for r in runs[0] if r["repeat"] == rep), next(r for r in runs[1] if r["repeat"] == rep))
             for rep in range(repeats)]
    ttt = [_ratio(a["time_to_threshold_s"], s["time_to_threshold_s"]) for s, a in pairs]
    figures["async_over_sync"] = {
        "time_to_threshold": stats([x for x in ttt if x is not None]),
        "time_to_threshold_per_repeat": ttt,
        "steps_to_threshold": stats([x for x in (_ratio(a["steps_to_threshold"], s["steps_to_threshold"])
                                                 for s, a in pairs) if x is not None]),
        "steady_step_time": stats([a["steady_step_time_s"]["median"] / s["steady_step_time_s"]["median"]
                                   for s, a in pairs]),
        "steps_wall": stats([a["steps_wall_s"] / s["steps_wall_s"] for s, a in pairs]),
        # What async could reach per step if overlapping slowed neither side: each sync
        # step minus the shorter of its generation wait and its training.
        "steady_step_time_perfect_overlap_bound": stats([perfect_overlap_bound(s) for s, _ in pairs]),
        "generated_tokens_per_s_engine": stats([x for x in (_ratio(a["generated_tokens_per_s_engine"],
                                                                   s["generated_tokens_per_s_engine"])
                                                            for s, a in pairs) if x is not None]),
        "trainer_tokens_per_s": stats([a["trainer_tokens_per_s"] / s["trainer_tokens_per_s"] for s, a in pairs]),
    }
    med = figures["async_over_sync"]["time_to_threshold"]["median"]
    all_reached = all(x is not None for x in ttt)
    targets = [{
        "target": f"async time to threshold <= {TARGET_RATIO} x sync (median of within-repeat ratios)",
        "value": med, "limit": TARGET_RATIO, "repeats_with_both_reaching": sum(x is not None for x in ttt),
        "met": bool(med is not None and all_reached and med <= TARGET_RATIO),
    }]
    return {"benchmark": "e2e_tiny", "machine": info, "params": params, "figures": figures,
            "targets": targets, "runs": {MODES[age]: runs[age] for age in MODES}}


def report(result: dict) -> None:
    f, p = result["figures"], result["params"]

    def med(x):
        return x["median"] if x["n"] else None

    def rng(x):
        return f"{x['min']:.3f}-{x['max']:.3f}" if x["n"] else "-"

    rows = []
    for name in MODES.values():
        g = f[name]
        rows.append([name, g["reached_threshold"], med(g["time_to_threshold_s"]), rng(g["time_to_threshold_s"]),
                     med(g["steps_to_threshold"]), med(g["steady_step_time_s"]), rng(g["steady_step_time_s"]),
                     med(g["generated_tokens_per_s_engine"]), med(g["generated_tokens_per_s_pipeline"]),
                     med(g["trainer_tokens_per_s"]), med(g["reward_last_window"]), med(g["startup_s"])])
    print_table(["mode", "reached", "time to thr s", "range", "steps", "step s", "range", "gen tok/s engine",
                 "gen tok/s pipeline", "train tok/s", f"reward last {p['window']}", "start-up s"], rows,
                title=f"e2e_tiny: {p['steps_per_run']} steps per run, {p['repeats']} repeats, threshold "
                      f"{p['threshold']} (running mean of {p['window']}), dag_mode {p['dag_mode']}, medians over repeats")
    keys = [f"{x}_s" for x in PARTS] + ["validation_s", "exposed_generation_s", "hidden_generation_s", "step_time_s"]
    print_table(["mode"] + [k[:-2] for k in keys],
                [[name] + [med(f[name]["breakdown_s"][k]) for k in keys] for name in MODES.values()],
                title="per-step time breakdown, seconds (median over repeats of each run's median over steps 1..)")
    r = f["async_over_sync"]
    print_table(["ratio async / sync", "median", "range"],
                [[k, med(r[k]), rng(r[k])] for k in ("time_to_threshold", "steps_to_threshold", "steady_step_time",
                                                     "steady_step_time_perfect_overlap_bound", "steps_wall",
                                                     "generated_tokens_per_s_engine", "trainer_tokens_per_s")],
                title="within-repeat ratios")
    print_targets(result["targets"])


if __name__ == "__main__":
    main()
