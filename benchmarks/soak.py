"""Soak: many randomized simulated schedules with injected faults.

Each schedule draws generators, max_age, a validation period, latencies and
jitter (a slow generator included), and one fault: none, a generator process
that exits mid-rollout (within or past fault.max_restarts), or a reward
function that raises on some samples; each fault strikes at each phase in turn:
on the first batch (the prologue's; past the limit, every replacement dies while
it takes over) or mid-run. The run must either finish or, where the fault is
past its limit, stop with the error that names the limit and says how to go on. From each run's
event log it counts invariant violations, hangs (a deadline hit), and prompt
groups lost (launched, never trained or dropped) or duplicated (trained twice).

    .venv/bin/python -m benchmarks.soak                # 3 seeds x 27 schedules, about 10 minutes
    .venv/bin/python -m benchmarks.soak --quick        # CI: 5 schedules, one seed
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.harness import machine_info, print_table, print_targets, shutdown_ray, start_ray, write_result

# Every fault kind at every phase, in turn; the first five are --quick's.
FAULTS = (("none", "-"), ("generator_exit", "first_batch"), ("generator_exit_exhausted", "first_batch"),
          ("reward_raise", "mid_run"), ("reward_raise_exhausted", "first_batch"), ("generator_exit", "mid_run"),
          ("generator_exit_exhausted", "mid_run"), ("reward_raise", "first_batch"),
          ("reward_raise_exhausted", "mid_run"))


def draw_schedule(rng: random.Random, index: int, steps: int) -> dict:
    fault, phase = FAULTS[index % len(FAULTS)]  # the rest is random
    gens = rng.randint(1, 3)
    schedule = {
        "fault": fault, "phase": phase, "steps": steps, "num_generators": gens, "max_age": rng.randint(0, 3),
        "val_period": rng.choice([0, 1, 2, 3]), "generate_s": rng.choice([0.01, 0.03, 0.08]),
        "train_s": rng.choice([0.005, 0.02, 0.05]), "jitter": rng.choice([0.0, 0.5, 0.9]),
        "fault_worker": rng.randrange(gens), "fault_after": 0 if phase == "first_batch" else rng.randint(2, 4),
    }
    return schedule


def overrides(s: dict, out_dir: str, name: str) -> list[str]:
    pairs = [f"run.output_dir={out_dir}", f"run.name={name}", f"run.steps={s['steps']}", "run.deadline_s=20",
             "run.dag_mode=classic", "run.deadline_s=20", "metrics.tensorboard=false", "metrics.progress=false",
             f"generation.num_generators={s['num_generators']}", f"schedule.max_age={s['max_age']}",
             f"validation.period={s['val_period']}", f"sim.generate_s={s['generate_s']}",
             f"sim.train_s={s['train_s']}", f"sim.jitter={s['jitter']}"]
    fault = s["fault"]
    if fault.startswith("generator_exit"):
        exhausted = fault.endswith("exhausted")
        # Past the limit every incarnation dies, so the limit is reached.
        pairs += ["inject.fault=generate_exit", f"inject.after={s['fault_after']}",
                  f"inject.worker={s['fault_worker']}", f"inject.incarnations={9 if exhausted else 1}",
                  f"fault.max_restarts={1 if exhausted else 2}"]
    elif fault.startswith("reward_raise"):
        pairs += ["inject.fault=reward_raise", f"inject.after={s['fault_after'] and 5 + s['fault_after']}",
                  f"fault.max_reward_failures={0 if fault.endswith('exhausted') else 10_000}"]
    return pairs


EXPECTED_ERROR = {"generator_exit_exhausted": "fault.max_restarts", "reward_raise_exhausted": "fault.max_reward_failures"}


def run_one(s: dict, out_dir: str, name: str) -> dict:
    from pipeline.config import load_config
    from pipeline.run.driver import train
    from pipeline.tools.check import check_events
    from pipeline.core.events import load_events
    cfg = load_config(None, overrides(s, out_dir, name))
    started = time.perf_counter()
    error = None
    try:
        train(cfg, quiet=True)
    except Exception as exc:  # noqa: BLE001 - the soak records every failure, expected or not
        error = "; ".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", ())])
    wall = time.perf_counter() - started
    events = load_events(Path(out_dir) / name)
    violations = check_events(events)
    launched = {e["batch"] for e in events if e["ev"] == "launch"}
    used = Counter(b for e in events if e["ev"] == "train_start" for b in e["batches"])
    used.update(e["batch"] for e in events if e["ev"] == "drop")
    finished = error is None
    expected = EXPECTED_ERROR.get(s["fault"])
    return {
        **s, "wall_s": round(wall, 3), "error": error,
        "outcome_ok": (finished and expected is None) or (not finished and expected is not None
                                                           and expected in error and _says_how_to_go_on(error)),
        "hang": error is not None and "did not finish within" in error,
        "violations": len(violations), "violation_messages": [v.message for v in violations[:5]],
        "lost": len(launched - set(used)) if finished else 0,
        "duplicated": sum(1 for n in used.values() if n > 1),
        "restarts": sum(1 for e in events if e["ev"] == "generator_died"),
        "reward_failures": sum(1 for e in events if e["ev"] == "reward_failed"),
    }


def _says_how_to_go_on(error: str) -> bool:
    """A fault past its limit: the error names the command that resumes the run, or
    says that none can; never the prologue's internal step number."""
    return ("--resume" in error or "start the run again" in error) and "step -1" not in error


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI size: 5 schedules of 6 steps")
    ap.add_argument("--schedules", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="one soak per seed (default 0 1 2; --quick: 0)")
    ap.add_argument("--out", default=None, help="directory for soak.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    n = args.schedules or (5 if args.quick else 3 * len(FAULTS))
    steps = args.steps or (6 if args.quick else 12)
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    info = machine_info()
    start_ray()
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="dagrl-soak-") as out_dir:
            for seed in seeds:
                rng = random.Random(seed)
                for i in range(n):
                    runs.append({"seed": seed, **run_one(draw_schedule(rng, i, steps), out_dir, f"soak{seed}_{i}")})
    finally:
        shutdown_ray()
    totals = {k: sum(r[k] for r in runs) for k in ("violations", "lost", "duplicated", "restarts",
                                                   "reward_failures")}
    totals.update(hangs=sum(r["hang"] for r in runs), unexpected_outcomes=sum(not r["outcome_ok"] for r in runs))
    targets = [{"target": f"{k} == 0", "value": totals[k], "met": totals[k] == 0}
               for k in ("violations", "hangs", "lost", "duplicated", "unexpected_outcomes")]
    print_table(["#", "seed", "fault", "phase", "gens", "max_age", "val", "wall_s", "ok", "viol", "lost", "dup",
                 "restarts"],
                [[i, r["seed"], r["fault"], r["phase"], r["num_generators"], r["max_age"], r["val_period"], r["wall_s"], r["outcome_ok"],
                  r["violations"], r["lost"], r["duplicated"], r["restarts"]] for i, r in enumerate(runs)],
                title="soak: one row per schedule")
    print_targets(targets)
    result = {"benchmark": "soak", "machine": info, "params": {"quick": args.quick, "schedules": n,
              "steps": steps, "seeds": seeds}, "runs": runs, "totals": totals, "targets": targets}
    path = write_result("soak", result, args.out)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
