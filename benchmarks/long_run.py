"""Long runs: memory, object store and step time stay flat for thousands of steps.

Each case is `python -m pipeline train` as a user runs it, on a model where
one leaked weight copy a step shows within a minute (4.2M parameters, hidden
256, 4 layers: 17 MB a copy in fp32; built here if missing), or on the
simulated workers for many more steps. Every step's record carries each
role's RSS and the object store's use (pipeline/run/resources.py); from them:

  slope_kb_per_step   least-squares slope of each role's RSS after warm-up
  low_slope_kb_per_step  the slope through each role's lowest RSS in each eighth of
                      the steps after warm-up. RSS between trims also carries what
                      the C heap keeps of memory freed (up to the heap cap's slack)
                      and whatever weight copy or batch is in flight at the sample,
                      which swings a trainer's RSS by tens of MB; a leak lifts every
                      eighth's lowest point as well
  held_slope_kb_per_step  what the target reads: for a role with a heap cap (trainer,
                      critic, generator), the slope of its RSS right after each trim
                      (heap_floor_slope below), since the cap keeps its RSS within a
                      slack of that floor and a trim hands back only memory freed;
                      for the others (driver, controller), low_slope. Over the kept
                      runs a generator's low_slope read -1.9 to 3.3 KB a step on
                      floors that rose 0.04-0.09, while floors that rose 8-22 KB a
                      step (a critic, a LoRA generator, a trainer) read as such
  store_peak_mb       the object store's peak after warm-up, beside the bound
                      (max_age + 3) x one weight copy (the largest weights_put)
  step_time           medians of the first and last 10 % of steps, and their ratio;
                      step_time_tenths_s: the median of each tenth;
                      rising_p: how often the tenths' medians, shuffled, rise as
                      steadily as they do (Kendall's S, a one-sided permutation
                      test): small when step time climbs over the run
  probe_tenths_s      the machine's speed beside the run: the median CPU time of one
                      fixed piece of work that the benchmark times every 2 s, in each
                      tenth; own_tenths_s: the step times at the first tenth's speed
                      (each tenth times probe first / probe tenth), with their
                      own_last_over_first and own_rising_p
  heap_trims          how often each trainer handed freed heap back (HeapCap, every 100
                      steps and whenever its RSS is over its slack)
  heap_floor_slope    the slope of the RSS right after each of those trims, in KB/step
  samples             about 50 points of each role's RSS (and the store's, the floors)
  violations          check-events on the run's log (invariant 7 included)

Targets (issue "Long runs"): no role grows by more than 1 KB a step after
warm-up (held_slope), the store stays under its bound, the last 10 % of steps are
no slower than the first 10 %, read from the step times at one machine speed
(own_tenths_s; the raw tenths for a run kept without probes): a last median
above the first counts as slower where the tenths rise (rising_p < 0.05) or the
last is above the first by more than any two of the first nine tenths differ.
The machine's own speed wanders by minutes (on 2 shared cores the tenths of one
run were 0.291-0.326 s, the ninth the fastest, and a generator's time for the
same work rose 5 % beside a trainer's 7 %); a test that treats steps as
exchangeable reads any such swing between the first and last minute as a
slowdown, while what a leak or a growing cost brings is a climb, or an end
slower than the run's own spread, at the same machine speed. On ten tenths of
noise alone the rule says slower in 5 % of runs (an end merely the slowest of
all would: 12 %); it catches a 5 % end under 1 % noise in 9 runs of 10.

    .venv/bin/python -m benchmarks.long_run                  # every case, 2000 real / 20000 sim steps
    .venv/bin/python -m benchmarks.long_run --quick          # 60 / 300 steps: a smoke run
    .venv/bin/python -m benchmarks.long_run --cases sim grpo_object_store --real-steps 500
    .venv/bin/python -m benchmarks.long_run --runs /tmp/long_runs        # keep each run's logs there
    .venv/bin/python -m benchmarks.long_run --runs /tmp/long_runs --cases sim --reanalyse   # read them again
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness import RESULTS, ROOT, machine_info, print_table, read_jsonl, write_result

MODEL = ROOT / "models" / "long_run_4m"
MODEL_ARGS = ["--hidden", "256", "--layers", "4", "--heads", "8", "--intermediate", "1024"]
SLOPE_TARGET_KB = 1.0
SAMPLES = 50          # points of each role's RSS kept in the results file
WARMUP_SHARE = 0.2    # vLLM's and DeepSpeed's first steps allocate what they keep; the slope starts after
WINDOWS = 8           # spans of the steps after warm-up whose lowest RSS low_slope fits
RISING_P = 0.05       # below it the tenths' step times climb over the run
MAX_AGE = 1           # every recipe here runs async with max_age 1
PROBE_EVERY_S = 2.0   # how often the benchmark times its fixed piece of work beside a run
PROBE_BLOCK = bytes(1 << 20)

# name -> (recipe, overrides); the real cases add the model and the step count.
REAL = ["generation.max_new_tokens=8", "validation.period=0", "validation.at_end=false", "run.checkpoint_every=0"]
CASES = {
    "grpo_object_store": ("examples/tiny_grpo.yaml", REAL),
    "grpo_collective": ("examples/tiny_grpo.yaml", [*REAL, "generation.weight_sync=collective"]),
    "ppo_object_store": ("examples/tiny_ppo.yaml", REAL),
    "grpo_lora": ("examples/tiny_grpo_lora.yaml", REAL),
    "sim": ("examples/sim_grpo.yaml", ["validation.period=100", "sim.generate_s=0.002", "sim.train_s=0.002",
                                       "sim.refit_s=0.001", "sim.validate_s=0.001", "sim.jitter=0.3",
                                       "run.checkpoint_every=0"]),
}


def ensure_model() -> Path:
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "pipeline.inputs.tiny", "--out", str(MODEL), *MODEL_ARGS], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
    return MODEL


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def low_slope(pts: list[tuple[int, float]], windows: int = WINDOWS) -> float:
    """The least-squares slope through the lowest point of each of `windows` equal spans of `pts`."""
    size = max(1, len(pts) // windows)
    lows = [min(pts[i:i + size], key=lambda p: p[1]) for i in range(0, size * windows, size) if pts[i:i + size]]
    return slope([float(x) for x, _ in lows], [y for _, y in lows])


def kb_per_step(pts: list[tuple[int, float]]) -> float:
    """The least-squares slope of (step, MB) points, in KB a step."""
    return slope(*map(list, zip(*pts))) * 1024


def held_slope(low_kb: float, floors: list[tuple[int, float]]) -> float:
    """KB a step that a role holds more: the slope through its RSS right after
    each heap trim where it has a trim for every eighth of the steps, else its low slope."""
    return kb_per_step(floors) if len(floors) >= WINDOWS else low_kb


def kendall_s(xs: list[float]) -> int:
    """Pairs in rising order less pairs in falling order."""
    return sum((b > a) - (b < a) for i, a in enumerate(xs) for b in xs[i + 1:])


def rising_p(xs: list[float], rounds: int = 20000, seed: int = 0) -> float:
    """The share of shuffles of xs whose Kendall S is at least xs's own: small
    when xs climbs more steadily than its values' order gives by chance."""
    observed, pool, rng, hits = kendall_s(xs), list(xs), random.Random(seed), 0
    for _ in range(rounds):
        rng.shuffle(pool)
        hits += kendall_s(pool) >= observed
    return hits / rounds


def slower(tenths: list[float]) -> bool:
    """The last tenth's step time is above the first's, and the tenths climb or
    the end is above the start by more than the first nine tenths' range."""
    rise, spread = tenths[-1] - tenths[0], max(tenths[:-1]) - min(tenths[:-1])
    return rise > 0 and (rising_p(tenths) < RISING_P or rise > spread)


def probe_cpu_s() -> float:
    """CPU seconds this thread spends on one fixed piece of work (hashing 8 MiB,
    a Python loop): it changes with the machine's speed, not with the run's load
    on it, which only makes the thread wait."""
    start = time.thread_time()
    digest = hashlib.sha256()
    for _ in range(8):
        digest.update(PROBE_BLOCK)
    total = 0
    for i in range(100_000):
        total += i * i
    return time.thread_time() - start


def last_step(metrics: Path) -> int | None:
    """The step of the last whole record in a metrics file being written."""
    with contextlib.suppress(FileNotFoundError), open(metrics, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        for line in reversed(f.read().splitlines()):
            with contextlib.suppress(ValueError):
                step = json.loads(line).get("step")
                if isinstance(step, int) and step >= 0:
                    return step
    return None


def watch_machine(metrics: Path, done: threading.Event, samples: list[dict]) -> None:
    """Times probe_cpu_s every PROBE_EVERY_S beside the run, with the step it had reached."""
    while not done.wait(PROBE_EVERY_S):
        step = last_step(metrics)
        if step is not None:
            samples.append({"step": step, "cpu_s": probe_cpu_s()})


def step_tenths(records: list[dict], probes: list[dict]) -> tuple[list[float], list[float] | None, list[float]]:
    """The median step time of each tenth of the records; the median probe time
    of the probes taken during each tenth's steps (None unless every tenth has
    one); and the step times at the first tenth's machine speed, the raw ones
    without probes."""
    tenth = max(1, len(records) // 10)
    # The last tenth ends on the last step, whatever the remainder of len(records) / 10.
    starts = [i * tenth for i in range(9)] + [len(records) - tenth]
    tenths = [statistics.median(r["step_time_s"] for r in records[i:i + tenth]) for i in starts]
    speeds = []
    for i in starts:
        lo, hi = records[i]["step"], records[i + tenth - 1]["step"]
        during = [p["cpu_s"] for p in probes if lo <= p["step"] <= hi]
        speeds.append(statistics.median(during) if during else None)
    if None in speeds:
        return tenths, None, tenths
    return tenths, speeds, [t * speeds[0] / p for t, p in zip(tenths, speeds)]


def thin(pts: list[tuple[int, float]], n: int = SAMPLES) -> list[list]:
    """About n of the points, evenly spaced: the curve behind a slope."""
    every = max(1, len(pts) // n)
    return [[step, round(v, 1)] for step, v in pts[::every]]


def analyse(run_dir: Path, max_age: int) -> dict:
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step", -1) >= 0 and "step_time_s" in r]
    steps = [r["step"] for r in records]
    after = [r for r in records if r["step"] >= steps[0] + WARMUP_SHARE * len(steps)]
    # Only these two kinds are read here; check-events below reads the whole log itself.
    with open(run_dir / "events.jsonl") as f:
        events = [json.loads(line) for line in f if '"heap_trimmed"' in line or '"weights_put"' in line]
    trims, floors = {}, {}
    for e in events:
        if e.get("ev") == "heap_trimmed":
            trims[e["worker"]] = trims.get(e["worker"], 0) + 1
            if e.get("step") is not None and e["step"] >= steps[0] + WARMUP_SHARE * len(steps):
                floors.setdefault(e["worker"], []).append((e["step"], e["floor_mb"]))
    roles = sorted({k.split("/", 1)[1] for r in records for k in r if k.startswith("rss_mb/")})
    per_role = {}
    for role in roles:
        key = f"rss_mb/{role}"
        pts = [(r["step"], r[key]) for r in after if key in r]
        low = low_slope(pts) * 1024
        per_role[role] = {"start_mb": round(next(r[key] for r in records if key in r), 1),
                          "end_mb": round(pts[-1][1], 1),
                          "slope_kb_per_step": round(kb_per_step(pts), 3),
                          "low_slope_kb_per_step": round(low, 3),
                          "held_slope_kb_per_step": round(held_slope(low, floors.get(role, [])), 3),
                          "samples": thin(pts)}
    copy_mb = max((e.get("bytes", 0) for e in events if e.get("ev") == "weights_put"), default=0) / 2**20
    store = [r["store_mb"] for r in after if "store_mb" in r]
    probes = read_jsonl(run_dir / "machine_probe.jsonl") if (run_dir / "machine_probe.jsonl").is_file() else []
    tenths, probe_tenths, own = step_tenths(records, probes)
    first, last = tenths[0], tenths[-1]
    machine = probe_tenths is not None
    check = subprocess.run([sys.executable, "-m", "pipeline", "check-events", str(run_dir)], cwd=ROOT,
                           capture_output=True, text=True)
    bound = (max_age + 3) * copy_mb
    out = {
        "steps": len(records), "roles": per_role,
        "max_slope_kb_per_step": max(v["slope_kb_per_step"] for v in per_role.values()),
        "max_low_slope_kb_per_step": max(v["low_slope_kb_per_step"] for v in per_role.values()),
        "max_held_slope_kb_per_step": max(v["held_slope_kb_per_step"] for v in per_role.values()),
        "weight_copy_mb": round(copy_mb, 3), "store_peak_mb": round(max(store, default=0.0), 3),
        "store_bound_mb": round(bound, 3),
        "heap_trims": trims,
        # The RSS right after each trim after warm-up: what a trainer holds, the allocator's cache left out.
        "heap_floor_slope_kb_per_step": {w: round(kb_per_step(pts), 3)
                                         for w, pts in floors.items() if len(pts) > 1},  # pipeline/core/memory.py HeapCap: the first one per trainer sets its floor
        "heap_floors": {w: thin(pts) for w, pts in floors.items()},
        "store_samples": thin([(r["step"], r["store_mb"]) for r in after if "store_mb" in r]),
        "store_peak_copies": round(max(store, default=0.0) / copy_mb, 3) if copy_mb else None,
        "store_spilled_mb": max((r.get("store_spilled_mb", 0.0) for r in records), default=0.0),
        "step_time_first10_s": round(first, 4), "step_time_last10_s": round(last, 4),
        "last_over_first": round(last / first, 3), "step_time_tenths_s": [round(t, 4) for t in tenths],
        "rising_p": round(rising_p(tenths), 4),
        "probe_tenths_s": [round(p, 5) for p in probe_tenths] if machine else None,
        "own_tenths_s": [round(t, 4) for t in own] if machine else None,
        "own_last_over_first": round(own[-1] / own[0], 3) if machine else None,
        "own_rising_p": round(rising_p(own), 4) if machine else None,
        "violations": int(check.stdout.strip().splitlines()[-1].split()[0]) if check.stdout.strip() else None,
    }
    out["targets_met"] = {
        "rss_slope": out["max_held_slope_kb_per_step"] <= SLOPE_TARGET_KB,
        # The simulator's weights are not tensors: nothing of size goes through the store.
        "store_bound": copy_mb == 0 or out["store_peak_mb"] <= bound,
        "step_time": not slower(own),
        "no_violations": out["violations"] == 0,
    }
    return out


def run_case(name: str, steps: int, out_dir: Path) -> dict:
    recipe, overrides = CASES[name]
    extra = [] if name == "sim" else [f"model.path={ensure_model()}"]
    args = [sys.executable, "-m", "pipeline", "train", "--config", recipe, *overrides, *extra,
            f"run.steps={steps}", f"run.name={name}", f"run.output_dir={out_dir}", "metrics.progress=false"]
    started = time.time()
    done, samples = threading.Event(), []
    watcher = threading.Thread(target=watch_machine, args=(out_dir / name / "metrics.jsonl", done, samples),
                               daemon=True)
    watcher.start()
    try:
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "RAY_ADDRESS": ""})
    finally:
        done.set()
        watcher.join()
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-5:], "wall_s": round(time.time() - started, 1)}
    (out_dir / name / "machine_probe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    return {"recipe": recipe, "overrides": [*overrides, *extra], "wall_s": round(time.time() - started, 1),
            **analyse(out_dir / name, MAX_AGE)}


def reanalyse(path: Path, runs: Path, cases: list[str], machine: dict) -> int:
    """The cases' figures from their kept run directories, read by this commit's
    analyse(); each case keeps the commit it ran at and records the one that read it."""
    result = json.loads(path.read_text())
    for case in cases:
        if not (runs / case / "metrics.jsonl").is_file():
            print(f"long_run: no kept run of {case} in {runs}", file=sys.stderr)
            return 2
        kept = result["cases"].get(case, {})
        result["cases"][case] = {**{k: kept[k] for k in ("git_commit", "git_dirty", "recipe", "overrides", "wall_s")
                                    if k in kept},
                                 **analyse(runs / case, MAX_AGE), "analysed_at": machine["git_commit"]}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    print(f"long_run: {', '.join(cases)} read again into {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60 real / 300 sim steps")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--real-steps", type=int, default=None)
    ap.add_argument("--sim-steps", type=int, default=None)
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--runs", default=None, help="keep each run's directory (logs, metrics) here, not in a temp dir")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other cases of an existing results file (each case records its commit)")
    ap.add_argument("--reanalyse", action="store_true",
                    help="read the --cases runs kept in --runs again with this commit's analysis, "
                         "into the results file; nothing is run")
    args = ap.parse_args(argv)
    if args.reanalyse and not args.runs:
        ap.error("--reanalyse reads the runs that --runs kept: give --runs DIR")
    real_steps = args.real_steps or (60 if args.quick else 2000)
    sim_steps = args.sim_steps or (300 if args.quick else 20000)
    result = {"machine": machine_info(), "model": {"path": str(MODEL.relative_to(ROOT)), "build": MODEL_ARGS},
              "warmup_share": WARMUP_SHARE, "cases": {}}
    name = "long_run_quick" if args.quick else "long_run"
    out_dir = Path(args.out) if args.out else RESULTS
    if args.merge and (out_dir / f"{name}.json").is_file():
        earlier = json.loads((out_dir / f"{name}.json").read_text())
        result["cases"] = {case: {"git_commit": earlier["machine"]["git_commit"],
                                  "git_dirty": earlier["machine"]["git_dirty"], **r}
                           for case, r in earlier["cases"].items() if case not in args.cases}
    if args.reanalyse:
        return reanalyse(out_dir / f"{name}.json", Path(args.runs), args.cases, result["machine"])
    runs = contextlib.nullcontext(args.runs) if args.runs else tempfile.TemporaryDirectory(prefix="dagrl-long-run-")
    with runs as tmp:
        for case in args.cases:
            print(f"long_run: {case} ...", flush=True)
            result["cases"][case] = {"git_commit": result["machine"]["git_commit"],
                                     "git_dirty": result["machine"]["git_dirty"],
                                     **run_case(case, sim_steps if case == "sim" else real_steps, Path(tmp))}
            # Written after every case: a long benchmark stopped half-way keeps what it measured.
            path = write_result(name, result, out_dir)
    rows = [[c, r.get("steps"), r.get("max_held_slope_kb_per_step"), r.get("store_peak_mb"), r.get("store_bound_mb"),
             r.get("last_over_first"), r.get("violations"), r.get("error", "")] for c, r in result["cases"].items()]
    print_table(["case", "steps", "max held KB/step", "store peak MB", "bound MB", "last/first", "violations", "error"],
                rows, title=f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
