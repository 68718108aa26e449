"""Where a step and the start-up go, on the tiny recipe, from the run's own event log.

Runs `python -m pipeline train --config examples/tiny_grpo.yaml` as a user
does (a fresh process, a local Ray), once async (max_age 1) and once sync
(max_age 0), without validation or checkpoints, and reads back:

  step chain   one generator makes a step a chain of nodes: the driver's hand-off
               (previous execution's last output -> this sample), sample, train,
               validation_gate, refit, validate, resume, collect, and the Ray
               dispatch gap before each; medians over the steady steps
  spans        inside each node and rollout (pipeline/core/spans.py): vLLM request
               set-up, generate, completions; reward and table building; the
               put to the controller; the trainer's rows, collate, forward,
               backward, optimizer, weight export and object-store put; the
               refit's drain, weight get, reload and prefix-cache reset
  start-up     process launch -> train() (interpreter, imports), preflight,
               ray.init, each worker's start (import, engine build), the prologue
  leaves       (--leaves) vLLM's own time per engine call under cProfile, bucketed
               (scheduler, model forward, sampler, output processing, request
               set-up), and the cost of one event-log write

    .venv/bin/python -m benchmarks.step_profile              # 80 steps each, about 2 minutes
    .venv/bin/python -m benchmarks.step_profile --steps 20   # quicker, noisier
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.harness import ROOT, machine_info, print_table, read_jsonl, sample_all, sample_load, startup_phases
from benchmarks.harness import write_result
from benchmarks.workloads import RECIPES, build_model, run_recipe

RECIPE = RECIPES["grpo"]   # as workloads.run_recipe runs it
# The GRPO step graph with one generator, in order, with the node each one waits for last.
CHAIN = ("sample", "train", "validation_gate", "refit", "validate", "resume", "collect")
WARMUP_STEPS = 3


def median(values) -> float | None:
    values = list(values)
    return round(statistics.median(values), 6) if values else None


def step_chain(events: list[dict], steps: range) -> dict:
    """Median seconds of each node of the chain and of the dispatch gap before it."""
    nodes: dict[tuple[str, int], list[float]] = {}
    for e in events:
        if e["ev"] in ("node_start", "node_end") and e.get("step") is not None:
            nodes.setdefault((e["node"], e["step"]), [0.0, 0.0])[e["ev"] == "node_end"] = e["t"]
    parts = defaultdict(list)
    for s in steps:
        if any((n, s) not in nodes for n in CHAIN) or ("collect", s - 1) not in nodes:
            continue
        before = nodes[("collect", s - 1)][1]
        for n in CHAIN:
            start, end = nodes[(n, s)]
            # refit waits for train and for validation_gate; the later of the two is its cause.
            cause = max(nodes[("train", s)][1], nodes[("validation_gate", s)][1]) if n == "refit" else before
            parts[f"gap before {n}"].append(start - cause)
            parts[n].append(end - start)
            before = end
        parts["step (collect to collect)"].append(nodes[("collect", s)][1] - nodes[("collect", s - 1)][1])
    out = {k: median(v) for k, v in parts.items()}
    out["dispatch total"] = round(sum(v for k, v in out.items() if k.startswith("gap")), 6)
    return out


def span_medians(events: list[dict], steps: range) -> dict:
    """{node or 'rollout': {span: median seconds}} over the steady steps."""
    found = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e.get("spans") and e.get("step") in steps:
            where = e["node"] if e["ev"] == "node_end" else e["ev"].split("_")[0]
            for name, seconds in e["spans"].items():
                found[where][name].append(seconds)
    return {where: {name: median(v) for name, v in spans.items()} for where, spans in found.items()}


def profile_run(run: dict) -> dict:
    run_dir = run["run_dir"]
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] >= 0]
    summary = json.loads((run_dir / "summary.json").read_text())
    steady = range(WARMUP_STEPS, len(metrics))
    steps_wall = [m["step_time_s"] for m in metrics[WARMUP_STEPS:]]
    return {
        "step_time_s": median(steps_wall),
        "step_time_all_steps_s": median(m["step_time_s"] for m in metrics),
        "events_per_step": round(sum(1 for e in events if e.get("step") in steady) / max(len(steady), 1), 1),
        "chain_s": step_chain(events, steady),
        "spans_s": span_medians(events, steady),
        "startup_s": startup_phases(events, summary, run["launched"]),
        "process_exit_s": round(run["exit_s"], 3),
        "reward_start_end": [summary["reward_start"], summary["reward_end"]],
    }


# --- leaves ----------------------------------------------------------------------------------

VLLM_BUCKETS = {  # cProfile cumulative time of these vLLM functions, per engine call
    "scheduler": ("scheduler.py", "schedule"),
    "scheduler update": ("scheduler.py", "update_from_output"),
    "model forward": ("gpu_model_runner.py", "_model_forward"),
    "input preparation": ("gpu_model_runner.py", "_prepare_inputs"),
    "sampler": ("gpu_model_runner.py", "_sample"),
    "output processing": ("output_processor.py", "process_outputs"),
    "request set-up": ("llm_engine.py", "add_request"),
}


def leaves(model: Path, calls: int = 20) -> dict:
    """vLLM per-call cost split by cProfile, and one event-log write, in this process."""
    import cProfile
    import pstats

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(1)
    from pipeline.core.types import Prompt, sample_seeds
    from pipeline.generator.vllm_engine import VllmGenerationEngine
    from pipeline.core.events import EventLog

    engine = VllmGenerationEngine(model, max_new_tokens=16)
    prompts = [Prompt(f"p{i}", "repeat: 1 1 1 1 1 1 1 1") for i in range(8)]
    seeds = sample_seeds(0, "profile", prompts, 4)
    for _ in range(3):
        sample_all(engine, prompts, seeds)
    walls = []
    prof = cProfile.Profile()
    for _ in range(calls):
        t = time.perf_counter()
        sample_all(engine, prompts, seeds)
        walls.append(time.perf_counter() - t)
    prof.enable()
    for _ in range(calls):
        sample_all(engine, prompts, seeds)
    prof.disable()
    table = pstats.Stats(prof).stats
    # By its code object, not a spelled file name, which a rename leaves stale.
    call = sample_all.__code__
    total = sum(ct for (f, _, fn), (_, _, _, ct, _) in table.items() if (f, fn) == (call.co_filename, call.co_name))
    buckets = {name: sum(ct for (f, _, fn), (_, _, _, ct, _) in table.items() if f.endswith(file) and fn == func)
               for name, (file, func) in VLLM_BUCKETS.items()}
    engine.close()
    with tempfile.TemporaryDirectory() as tmp:
        log = EventLog(tmp, "bench", time.time())
        n = 5000
        t = time.perf_counter()
        for i in range(n):
            log.emit("node_end", step=i, node="refit", spans={"drain": 0.001, "vllm.reload_weights": 0.01})
        emit_s = (time.perf_counter() - t) / n
        log.close()
    return {
        "vllm_sample_call_s": median(walls),
        "requests_per_call": 32, "max_new_tokens": 16,
        # Shares of the profiled call; cProfile slows Python code, so shares, not seconds.
        "vllm_share_of_call": {k: round(v / total, 3) for k, v in buckets.items()},
        "event_log_write_s": round(emit_s, 7),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--leaves", action="store_true", help="also profile vLLM and the event log in-process")
    ap.add_argument("--modes", nargs="+", choices=("async", "sync"), default=["async", "sync"],
                    help="which runs: async (max_age 1), sync (max_age 0)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra recipe override")
    ap.add_argument("--out", type=Path, help="directory for step_profile.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    info = machine_info()
    started = time.time()
    result = {"benchmark": "step_profile", "machine": info,
              "params": {"recipe": str(RECIPE.relative_to(ROOT)), "steps": args.steps, "seed": args.seed,
                         "warmup_steps_left_out": WARMUP_STEPS, "overrides": args.set, "modes": args.modes,
                         "validation": "none", "checkpoints": "none"},
              "runs": {}}
    with tempfile.TemporaryDirectory(prefix="dagrl_step_profile_") as tmp:
        model = build_model(Path(tmp))
        for name, age in (("async", 1), ("sync", 0)):
            if name not in args.modes:
                continue
            sample_load(info)
            run = run_recipe(Path(tmp), name, age, args.steps, args.seed, args.set)
            result["runs"][name] = profile_run(run)
            r = result["runs"][name]
            print(f"{name}: step {r['step_time_s']:.3f} s, launch to first step "
                  f"{r['startup_s']['launch to first step']:.1f} s", flush=True)
        if args.leaves:
            result["leaves"] = leaves(model)
    result["wall_s"] = round(time.time() - started, 1)
    report(result)
    path = write_result("step_profile", result, args.out)
    print(f"\nwrote {path}")
    return result


def report(result: dict) -> None:
    runs = result["runs"]
    names = list(runs)
    keys = list(runs[names[0]]["chain_s"])
    print_table(["step chain (median s)", *names], [[k, *(runs[n]["chain_s"].get(k) for n in names)] for k in keys])
    rows = [[f"{where}: {span}", *(runs[n]["spans_s"].get(where, {}).get(span) for n in names)]
            for where, spans in runs[names[0]]["spans_s"].items() for span in spans]
    print_table(["span (median s per node call)", *names], rows)
    print_table(["start-up (s)", *names], [[k, *(runs[n]["startup_s"].get(k) for n in names)]
                                          for k in runs[names[0]]["startup_s"]])
    if "leaves" in result:
        print(json.dumps(result["leaves"], indent=2))


if __name__ == "__main__":
    main()
