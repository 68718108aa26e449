"""Do the multi-turn recipes learn on every seed? (the real CPU stack)

For each environment a recipe uses, the tiny model is built and warmed up on
the format once (pipeline/trainer/warmup.py, its defaults, seed 0), as `make`
does. Each recipe then runs with run.seed = each --seeds, for --steps steps,
greedy validation every --val-period steps and at the start and the end.
Per run: the greedy validation before RL (the warm-up's) and at the end, the
training reward over the first and the last ten steps.

Targets, per recipe: on every seed the final greedy validation beats the
warm-up's, and the training reward of the last ten steps beats the first ten's.

    .venv/bin/python -m benchmarks.tool_seeds                                  # 3 recipes x 3 seeds: ~20 min
    .venv/bin/python -m benchmarks.tool_seeds --recipes tiny_tool_grpo --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, machine_info, print_table, print_targets, read_jsonl, shutdown_ray
from benchmarks.harness import start_ray, write_result
from benchmarks.workloads import run_train

RECIPES = ("tiny_tool_grpo", "tiny_tool_ppo", "tiny_game_grpo")
DATA = {"pipeline.envs.calculator:CalculatorEnv": "tool", "pipeline.envs.digit_game:DigitGuessEnv": "game"}


def warmed_up(env_class: str, base: Path, tmp: Path) -> Path:
    from pipeline.trainer.warmup import warmup
    stem = DATA[env_class]
    out = tmp / f"warm_{stem}"
    if not (out / "config.json").is_file():
        warmup(base, env_class, ROOT / "data" / f"{stem}_train.jsonl", out,
               val=ROOT / "data" / f"{stem}_val.jsonl", seed=0)
    return out


def run_once(recipe: str, seed: int, args, model: Path, tmp: Path) -> dict:
    from pipeline.config import load_config
    name = f"{recipe}_s{seed}"
    cfg = load_config(ROOT / "examples" / f"{recipe}.yaml", [
        f"model.path={model}", f"run.seed={seed}", f"run.steps={args.steps}", f"validation.period={args.val_period}",
        "validation.at_start=true", "validation.at_end=true", "run.checkpoint_every=0",
        f"run.output_dir={tmp / 'runs'}", f"run.name={name}", "metrics.tensorboard=false"])
    started = time.time()
    summary = run_train(cfg, name)
    rows = read_jsonl(tmp / "runs" / name / "metrics.jsonl")
    steps = [r for r in rows if r["step"] >= 0]
    vals = [(r["step"], r["val_reward"]) for r in rows if "val_reward" in r]
    return {"recipe": recipe, "seed": seed, "wall_s": round(time.time() - started, 1), "val": vals,
            "val_start": vals[0][1], "val_end": vals[-1][1],
            "reward_first10": statistics.mean(r["reward_mean"] for r in steps[:10]),
            "reward_last10": statistics.mean(r["reward_mean"] for r in steps[-10:]),
            "env_failures": summary["accounting"]["reward_failures"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--val-period", type=int, default=10)
    ap.add_argument("--out", type=Path, help="directory for tool_seeds.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    from pipeline.config import load_config
    from pipeline.inputs.tiny import build_tiny_model

    info = machine_info()
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="dagrl_tool_seeds_"))
    runs = []
    start_ray()
    try:
        base = build_tiny_model(tmp / "tiny")
        for recipe in args.recipes:
            model = warmed_up(load_config(ROOT / "examples" / f"{recipe}.yaml").env.class_, base, tmp)
            for seed in args.seeds:
                run = run_once(recipe, seed, args, model, tmp)
                runs.append(run)
                print(f"{recipe} seed {seed}: val {run['val_start']} -> {run['val_end']}, reward "
                      f"{run['reward_first10']:.2f} -> {run['reward_last10']:.2f} ({run['wall_s']} s)", flush=True)
    finally:
        shutdown_ray()
        shutil.rmtree(tmp, ignore_errors=True)
    targets = []
    for recipe in args.recipes:
        rs = [r for r in runs if r["recipe"] == recipe]
        targets.append({"target": f"{recipe}: final greedy val > the warm-up's, every seed",
                        "value": [r["val_end"] for r in rs], "met": all(r["val_end"] > r["val_start"] for r in rs)})
        targets.append({"target": f"{recipe}: reward of the last 10 steps > the first 10's, every seed",
                        "value": [round(r["reward_last10"] - r["reward_first10"], 3) for r in rs],
                        "met": all(r["reward_last10"] > r["reward_first10"] for r in rs)})
    result = {"benchmark": "tool_seeds", "params": {k: v for k, v in vars(args).items() if k != "out"},
              "machine": info, "wall_s": round(time.time() - t0, 1), "runs": runs, "targets": targets}
    path = write_result("tool_seeds", result, args.out)
    print_table(["recipe", "seed", "val start", "val end", "reward first 10", "reward last 10"],
                [[r["recipe"], r["seed"], r["val_start"], r["val_end"], round(r["reward_first10"], 3),
                  round(r["reward_last10"], 3)] for r in runs], title="multi-turn recipes across seeds")
    print_targets(targets)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
