"""Does GRPO teach a vision-language model to read a picture? (the real CPU stack)

The model is built as `make models/tiny_vlm/config.json` builds it: a random
tiny Qwen2-VL (pipeline/inputs/tiny_vlm.py), its vision tower frozen
(model.freeze_vision, the recipe's default). The task is the recipe's: a
seven-segment digit 0-3 in a bright ink, "Which digit is shown?", the
fraction of the answer's characters that are the digit. Answering one digit
whatever the picture scores 0.25 (`chance`): only a policy that reads the
picture scores more. Validation pictures are drawn in inks training never
showed.

For each seed, examples/tiny_vlm_grpo.yaml async (its max_age 1) and sync
(max_age 0) for --steps steps, greedy validation at the start and every
--val-period steps. Per run: the validation curve, its best and last value,
and check-events' verdict on its event log.

Targets: on every seed and in both modes the last greedy validation is at
least twice chance; no run breaks an invariant.

    .venv/bin/python -m benchmarks.vlm            # 3 seeds x async and sync, 100 steps: about 15 min on 2 cores
    .venv/bin/python -m benchmarks.vlm --quick    # CI smoke: one seed, async, 3 steps; not a measurement
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, machine_info, print_table, print_targets, read_jsonl, shutdown_ray, start_ray
from benchmarks.harness import write_result
from benchmarks.workloads import run_train

CHANCE = 0.25
MODES = {"async": 1, "sync": 0}   # schedule.max_age


def run_once(mode: str, seed: int, args, model: Path, tmp: Path) -> dict:
    from pipeline.config import load_config
    from pipeline.core.events import load_events
    from pipeline.tools.check import check_events
    name = f"{mode}_s{seed}"
    overrides = [f"model.path={model}", f"run.seed={seed}", f"run.steps={args.steps}", f"schedule.max_age={MODES[mode]}",
                 f"validation.period={args.val_period}", "validation.at_start=true", "validation.at_end=true",
                 "run.checkpoint_every=0", f"run.output_dir={tmp / 'runs'}", f"run.name={name}",
                 "metrics.tensorboard=false"]
    started = time.time()
    run_train(load_config(ROOT / "examples" / "tiny_vlm_grpo.yaml", overrides), name)
    rows = read_jsonl(tmp / "runs" / name / "metrics.jsonl")
    violations = check_events(load_events(tmp / "runs" / name))
    val = [[r["step"], round(r["val_reward"], 6)] for r in rows if "val_reward" in r]
    return {"mode": mode, "seed": seed, "wall_s": round(time.time() - started, 1), "val": val,
            "val_start": val[0][1], "val_best": max(v for _, v in val), "val_end": val[-1][1],
            "violations": [v.message for v in violations]}


def targets(runs: list[dict]) -> list[dict]:
    ends = [r["val_end"] for r in runs]
    bad = sum(len(r["violations"]) for r in runs)
    return [{"target": f"last greedy validation >= {2 * CHANCE} (twice chance), every seed and mode",
             "value": ends, "met": all(v >= 2 * CHANCE for v in ends)},
            {"target": "every run's events pass check-events", "value": bad, "met": bad == 0}]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vlm", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: one seed, async, 3 steps; not a measurement")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--val-period", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None, help="folder for vlm.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.modes, args.steps, args.val_period = [0], ["async"], 3, 1
    from pipeline.inputs.tiny_vlm import build_tiny_vlm
    info = machine_info()
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="dagrl_vlm_"))
    runs = []
    try:
        model = build_tiny_vlm(tmp / "tiny_vlm")
        start_ray()
        try:
            for seed in args.seeds:
                for mode in args.modes:
                    run = run_once(mode, seed, args, model, tmp)
                    runs.append(run)
                    print(f"{mode} seed {seed}: greedy val {run['val_start']} -> {run['val_end']} (best "
                          f"{run['val_best']}), {len(run['violations'])} violations ({run['wall_s']} s)", flush=True)
        finally:
            shutdown_ray()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tgts = targets(runs)
    result = {"benchmark": "vlm", "params": {k: v for k, v in vars(args).items() if k != "out"},
              "machine": info, "wall_s": round(time.time() - t0, 1), "chance": CHANCE, "runs": runs,
              "targets": tgts}
    path = write_result("vlm", result, args.out)
    print_table(["mode", "seed", "val start", "val best", "val end", "violations"],
                [[r["mode"], r["seed"], r["val_start"], r["val_best"], r["val_end"], len(r["violations"])]
                 for r in runs], title=f"greedy validation (chance: {CHANCE})")
    print_targets(tgts)
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
