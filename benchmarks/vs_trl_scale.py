"""dagrl against TRL's GRPOTrainer at real sizes: where the overlap should pay.

Per model size (the 4M and 33M Llamas of benchmarks.trainer_efficiency, built
like the tiny one, wider and deeper) and dtype (fp32, and bf16 where the CPU
has bf16 units), back to back in one run: TRL 1.16's GRPOTrainer
(benchmarks.trl_grpo, in `make trl-venv`'s environment), then dagrl's tiny
GRPO recipe async (max_age 1) and sync (max_age 0) on one trainer rank, and
async on two (training.ranks 2: both cores train, one also generates), each as
a user runs it. The
same model folder, prompts (the tiny task's), reward and settings: 8 prompts x
8 samples, 64-token completions, one update per batch, one torch thread a
process. bf16 is TRL's bf16 mixed precision against dagrl's training.dtype
bf16 (generation.dtype bf16 too, where vLLM's CPU build runs it).

  step time    median over steps 1.. (step 0 waits for the first batch or compiles)
  start-up     process launch to the first step; dagrl's split into startup_phases_s
               (benchmarks.harness.startup_phases)
  tokens/s     completion tokens of a step / its time
  efficiency   dagrl: (max(generation, training) + refit) / step time, per step,
               median; generation is the generator's busy time in the step
               (1 - generator_idle), training the trainer's train_s

Targets (issue "Fast at real sizes"), each within one size and dtype: at 33M
async <= 0.5x TRL's step, sync <= 0.9x; at 4M async <= 0.6x, and (issue "First
contact as fast as the simplest peer") sync <= 1.0x; async efficiency >= 0.95.
The async ones are listed for both async runs.

    make trl-venv && .venv/bin/python -m benchmarks.vs_trl_scale          # 4M and 33M, 6 steps: ~12 minutes
    .venv/bin/python -m benchmarks.vs_trl_scale --quick                    # the tiny model, fp32, 3 steps: a smoke run
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, machine_info, print_table, print_targets, read_jsonl, sample_load
from benchmarks.harness import startup_phases, write_result
from benchmarks.trainer_efficiency import SIZES, build_model
from benchmarks.workloads import run_recipe

PROMPTS, GROUP, NEW_TOKENS, LR = 8, 8, 64, 0.005
TARGETS = {"33M": {"async": 0.5, "sync": 0.9}, "4M": {"async": 0.6, "sync": 1.0}}
# dagrl's runs per case: name -> (schedule.max_age, training.ranks). async_2ranks trains
# on both cores, data-parallel, beside the generator: at these sizes the generator
# idles most of an async step on a core of its own.
MODES = {"async": (1, 1), "sync": (0, 1), "async_2ranks": (1, 2)}
STEPS = {"4M": 12, "33M": 6}
EFFICIENCY_TARGET = 0.95


def run_trl(python: Path, model: Path, out: Path, steps: int, dtype: str) -> dict:
    cmd = [str(python), "-m", "benchmarks.trl_grpo", "--model", str(model), "--train", "data/tiny_train.jsonl",
           "--steps", str(steps), "--out", str(out), "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP),
           "--max-new-tokens", str(NEW_TOKENS), "--lr", str(LR), "--dtype", dtype]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL {model.name} {dtype} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    run = json.loads(out.read_text())
    step = statistics.median(run["step_times_s"][1:])
    return {"step_time_s": round(step, 4), "startup_s": round(run["startup_s"], 2),
            "tokens_per_s": round(PROMPTS * GROUP * NEW_TOKENS / step, 1), "versions": run["versions"]}


def run_dagrl(tmp: Path, model: Path, name: str, max_age: int, ranks: int, steps: int, dtype: str,
              gen_dtype: str) -> dict:
    run = run_recipe(tmp, name, max_age, steps, 0, [f"training.ranks={ranks}",
        f"schedule.prompts_per_step={PROMPTS}", f"schedule.group_size={GROUP}",
        f"generation.max_new_tokens={NEW_TOKENS}", f"training.lr={LR}", f"training.micro_batch_size={PROMPTS * GROUP}",
        f"training.dtype={dtype}", f"generation.dtype={gen_dtype}"], model=model)
    run_dir = run["run_dir"]
    phases = startup_phases(read_jsonl(run_dir / "events.jsonl"), json.loads((run_dir / "summary.json").read_text()),
                            run["launched"])
    return {**dagrl_figures(read_jsonl(run_dir / "metrics.jsonl")), "generation_dtype": gen_dtype,
            "startup_s": phases["launch to first step"], "startup_phases_s": phases}


def dagrl_figures(metrics: list[dict]) -> dict:
    """A dagrl run's figures from its metrics records, steps 1.. (step 0 waits for the first batch)."""
    steps = [m for m in metrics if m["step"] >= 1]

    def med(values) -> float:
        return round(statistics.median(values), 4)
    generation = [(1 - m["generator_idle"]) * m["step_time_s"] for m in steps]
    step = med(m["step_time_s"] for m in steps)
    return {"step_time_s": step, "tokens_per_s": round(med(m["response_tokens"] for m in steps) / step, 1),
            "train_s": med(m["train_s"] for m in steps), "generation_s": med(generation),
            "refit_s": med(m["refit_s"] for m in steps), "wait_s": med(m["wait_s"] for m in steps),
            "efficiency": round(statistics.median((max(g, m["train_s"]) + m["refit_s"]) / m["step_time_s"]
                                                  for g, m in zip(generation, steps)), 3)}


def main(argv: list[str] | None = None) -> dict:
    from pipeline.core.precision import cpu_bf16_flags
    from pipeline.inputs.tiny import build_tiny_model
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny model, fp32, 3 steps: a smoke run")
    ap.add_argument("--sizes", nargs="*", choices=list(SIZES), default=None)
    ap.add_argument("--dtypes", nargs="*", choices=["fp32", "bf16"], default=None,
                    help="default: fp32, and bf16 where this CPU has bf16 units")
    ap.add_argument("--generation-dtype", choices=["same", "fp32"], default="same",
                    help="dagrl's generation.dtype in the bf16 cases: the training dtype, or fp32")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (full: 4M 12, 33M 6; quick 3)")
    ap.add_argument("--trl-python", type=Path, default=ROOT / ".venv-trl" / "bin" / "python")
    ap.add_argument("--out", type=Path, help="directory for vs_trl_scale.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    if not args.trl_python.is_file():
        ap.error(f"--trl-python {args.trl_python} does not exist: run `make trl-venv` first")
    sizes = args.sizes or (["tiny"] if args.quick else ["4M", "33M"])
    dtypes = args.dtypes or (["fp32"] if args.quick else ["fp32", *(["bf16"] if cpu_bf16_flags() else [])])
    # A 4M step is 1-3 s and moves 5-10 % from run to run: more of them steady its median.
    steps = {size: args.steps or (3 if args.quick else STEPS.get(size, 6)) for size in sizes}
    info = machine_info()
    started, cases = time.time(), []
    with tempfile.TemporaryDirectory(prefix="dagrl_vs_trl_scale_") as tmp:
        for size in sizes:
            # The tiny model as the recipes build it (head size 32, which vLLM's CPU attention has).
            model = build_tiny_model(Path(tmp) / size) if size == "tiny" else build_model(Path(tmp), size)
            for dtype in dtypes:
                gen_dtype = dtype if args.generation_dtype == "same" else "fp32"
                sample_load(info)
                case = {"size": size, "dtype": dtype,
                        "trl": run_trl(args.trl_python, model, Path(tmp) / f"trl_{size}_{dtype}.json", steps[size],
                                       dtype)}
                for mode, (max_age, ranks) in MODES.items():
                    case[mode] = run_dagrl(Path(tmp), model, f"{mode}_{size}_{dtype}", max_age, ranks, steps[size],
                                           dtype, gen_dtype)
                    case[f"{mode}_over_trl"] = round(case[mode]["step_time_s"] / case["trl"]["step_time_s"], 3)
                cases.append(case)
                print(f"{size} {dtype}: TRL {case['trl']['step_time_s']} s, async {case['async']['step_time_s']} s "
                      f"({case['async_over_trl']}x), sync {case['sync']['step_time_s']} s ({case['sync_over_trl']}x), "
                      f"async on 2 ranks {case['async_2ranks']['step_time_s']} s ({case['async_2ranks_over_trl']}x), "
                      f"async efficiency {case['async']['efficiency']}", flush=True)
    # A bound of "async" is each async run's (one rank, two ranks); each is listed.
    targets = [{"target": f"{c['size']} {c['dtype']}: {mode} step <= {bound}x TRL's", "value": c[f"{mode}_over_trl"],
                "met": c[f"{mode}_over_trl"] <= bound}
               for c in cases for mode in MODES for kind, bound in TARGETS.get(c["size"], {}).items()
               if mode.split("_")[0] == kind]
    targets += [{"target": f"{c['size']} {c['dtype']}: {mode} efficiency >= {EFFICIENCY_TARGET}",
                 "value": c[mode]["efficiency"], "met": c[mode]["efficiency"] >= EFFICIENCY_TARGET}
                for c in cases if c["size"] in TARGETS for mode in MODES if mode.startswith("async")]
    result = {"benchmark": "vs_trl_scale", "quick": args.quick, "machine": info,
              "params": {"sizes": {s: SIZES[s] for s in sizes}, "dtypes": dtypes, "steps": steps, "prompts": PROMPTS,
                         "group_size": GROUP, "max_new_tokens": NEW_TOKENS, "lr": LR,
                         "generation_dtype": args.generation_dtype, "cpu_bf16": list(cpu_bf16_flags()),
                         "recipe": "examples/tiny_grpo.yaml (validation and checkpoints off)"},
              "cases": cases, "targets": targets, "wall_s": round(time.time() - started, 1)}
    print_table(["size", "dtype", "TRL s", "async s", "sync s", "async 2 ranks s", "async/TRL", "sync/TRL",
                 "async 2 ranks/TRL", "async eff", "TRL tok/s", "async tok/s"],
                [[c["size"], c["dtype"], c["trl"]["step_time_s"], c["async"]["step_time_s"], c["sync"]["step_time_s"],
                  c["async_2ranks"]["step_time_s"], c["async_over_trl"], c["sync_over_trl"],
                  c["async_2ranks_over_trl"], c["async"]["efficiency"], c["trl"]["tokens_per_s"],
                  c["async"]["tokens_per_s"]] for c in cases], title="vs_trl_scale")
    print_targets(targets)
    print(f"wrote {write_result('vs_trl_scale', result, args.out)}")
    return result


if __name__ == "__main__":
    main()
