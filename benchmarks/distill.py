"""Does on-policy distillation reach the teacher sooner than GRPO? (the real CPU stack)

The teacher is built as `make models/tiny_teacher/config.json` builds it: the
fresh tiny model warmed up on the repeat task (pipeline/inputs/tiny_env.py, its
defaults, seed 0). Its greedy validation is the warm-up's own, on the same
val set and in the rollout's token layout. For each seed, from the same fresh
tiny model (the student):

  distill  examples/tiny_distill.yaml: the student learns from the teacher
  grpo     examples/tiny_grpo.yaml: the student learns from the task reward

both for --steps steps, greedy validation at the start and every --val-period
steps. Per run: the validation curve; the steps taken until the validation is
first within 10 % of the teacher's (`reached`), and until it is so at every
validation to the end (`held`); check-events' verdict on its event log; for
distill, the per-token KL to the teacher (metrics distill/kl and, with loss
topk_kl, distill/topk_kl) of each step.

Targets: on every seed the distilled student reaches the teacher within 10 %,
in fewer steps than GRPO (a run that never does counts as infinitely many),
first and held; its KL falls on every seed (distill/kl, the reverse KL of the
sampled tokens, which either loss logs; and distill/topk_kl with loss topk_kl);
no run breaks an invariant. --distill-set tries other distillation settings
against the same GRPO arm (recorded in params).

    .venv/bin/python -m benchmarks.distill            # 3 seeds, 40 steps: 2-6 min on 2 cores
    .venv/bin/python -m benchmarks.distill --quick    # CI smoke: one seed, 3 steps; not a measurement
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, machine_info, print_table, print_targets, read_jsonl, shutdown_ray, start_ray
from benchmarks.harness import median_with_never, write_result
from benchmarks.workloads import run_train

WITHIN = 0.10
RECIPES = {"distill": "tiny_distill", "grpo": "tiny_grpo"}


def build_models(tmp: Path, teacher_steps: int | None) -> tuple[Path, Path, dict]:
    """The fresh tiny model, the teacher warmed up from it, and the warm-up's report."""
    from pipeline.inputs.tiny import build_tiny_model
    from pipeline.trainer.warmup import warmup
    student = build_tiny_model(tmp / "tiny")
    started = time.time()
    report = warmup(student, "pipeline.inputs.tiny_env:RepeatEnv", ROOT / "data" / "tiny_train.jsonl", tmp / "teacher",
                    val=ROOT / "data" / "tiny_val.jsonl", steps=teacher_steps, seed=0)
    return student, tmp / "teacher", {**report.summary(), "build_s": round(time.time() - started, 1)}


def steps_until(val: list[list], bar: float, held: bool) -> int | None:
    """Steps trained when the validation is first >= bar (held: and stays so to the end)."""
    for i, (step, v) in enumerate(val):
        if v >= bar and (not held or all(w >= bar for _, w in val[i:])):
            return step + 1
    return None


def run_once(kind: str, seed: int, args, student: Path, teacher: Path, bar: float, tmp: Path) -> dict:
    from pipeline.config import load_config
    from pipeline.core.events import load_events
    from pipeline.tools.check import check_events
    name = f"{kind}_s{seed}"
    overrides = [f"model.path={student}", f"run.seed={seed}", f"run.steps={args.steps}",
                 f"validation.period={args.val_period}", "validation.at_start=true", "validation.at_end=true",
                 "run.checkpoint_every=0", f"run.output_dir={tmp / 'runs'}", f"run.name={name}",
                 "metrics.tensorboard=false"]
    if kind == "distill":
        overrides += [f"distill.teacher={teacher}", *args.distill_set]
    started = time.time()
    run_train(load_config(ROOT / "examples" / f"{RECIPES[kind]}.yaml", overrides), name)
    rows = read_jsonl(tmp / "runs" / name / "metrics.jsonl")
    violations = check_events(load_events(tmp / "runs" / name))
    val = [[r["step"], round(r["val_reward"], 6)] for r in rows if "val_reward" in r]
    kl = [round(r["distill/kl"], 6) for r in rows if "distill/kl" in r]
    topk = [round(r["distill/topk_kl"], 6) for r in rows if "distill/topk_kl" in r]
    return {"kind": kind, "seed": seed, "wall_s": round(time.time() - started, 1), "val": val,
            "reached": steps_until(val, bar, held=False), "held": steps_until(val, bar, held=True),
            "val_end": val[-1][1], "kl": kl, "kl_start": kl[0] if kl else None, "kl_end": kl[-1] if kl else None,
            "topk_kl": topk, "violations": [v.message for v in violations]}


def fewer(a: int | None, b: int | None) -> bool:
    """a < b, never counting as infinitely many steps (never < never is false)."""
    return a is not None and (b is None or a < b)


def targets(runs: list[dict], seeds: list[int]) -> list[dict]:
    by = {(r["kind"], r["seed"]): r for r in runs}
    out = []
    for when in ("reached", "held"):
        pairs = [(by["distill", s][when], by["grpo", s][when]) for s in seeds]
        out.append({"target": f"distill within 10 % of the teacher ({when}), every seed",
                    "value": [d for d, _ in pairs], "met": all(d is not None for d, _ in pairs)})
        out.append({"target": f"distill {when} in fewer steps than GRPO, every seed",
                    "value": [f"{d} vs {g}" for d, g in pairs], "met": all(fewer(d, g) for d, g in pairs)})
    for metric, key in (("distill/kl", "kl"), ("distill/topk_kl", "topk_kl")):
        kls = [by["distill", s][key] for s in seeds]
        if all(kls):
            out.append({"target": f"{metric} falls (last step < first), every seed",
                        "value": [f"{k[0]:.3f} -> {k[-1]:.3f}" for k in kls], "met": all(k[-1] < k[0] for k in kls)})
    bad = sum(len(r["violations"]) for r in runs)
    out.append({"target": "every run's events pass check-events (invariant 10: each batch taught before training)",
                "value": bad, "met": bad == 0})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.distill", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke: one seed, 3 steps; not a measurement")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--val-period", type=int, default=2)
    ap.add_argument("--teacher-steps", type=int, default=None, help="default: RepeatEnv's warmup_steps, as make")
    ap.add_argument("--distill-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides of the distillation recipe only, to try other settings against the same GRPO")
    ap.add_argument("--out", type=Path, default=None, help="folder for distill.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.val_period, args.teacher_steps = [0], 3, 1, 10
    info = machine_info()
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="dagrl_distill_"))
    runs = []
    try:
        student, teacher, built = build_models(tmp, args.teacher_steps)
        bar = (1 - WITHIN) * built["val_greedy_after"]["reward"]
        print(f"teacher: greedy val {built['val_greedy_after']['reward']:.3f} (fresh "
              f"{built['val_greedy_before']['reward']:.3f}), built in {built['build_s']} s", flush=True)
        start_ray()
        try:
            for seed in args.seeds:
                for kind in RECIPES:
                    run = run_once(kind, seed, args, student, teacher, bar, tmp)
                    runs.append(run)
                    print(f"{kind} seed {seed}: reached {run['reached']}, held {run['held']}, val end "
                          f"{run['val_end']}, kl {run['kl_start']} -> {run['kl_end']} ({run['wall_s']} s)", flush=True)
        finally:
            shutdown_ray()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tgts = targets(runs, args.seeds)
    medians = {kind: {when: median_with_never([r[when] for r in runs if r["kind"] == kind])
                      for when in ("reached", "held")} for kind in RECIPES}
    from pipeline.config import load_config
    recipe = load_config(ROOT / "examples" / f"{RECIPES['distill']}.yaml", args.distill_set).distill
    result = {"benchmark": "distill", "params": {k: v for k, v in vars(args).items() if k != "out"},
              "distill": {"loss": recipe.loss, "coef": recipe.coef, "task_reward": recipe.task_reward,
                          **({"topk": recipe.topk, "kl_type": recipe.kl_type} if recipe.loss == "topk_kl"
                             else {"kl_clip": recipe.kl_clip})},
              "machine": info, "wall_s": round(time.time() - t0, 1), "teacher": built, "bar": round(bar, 6),
              "medians": medians, "runs": runs, "targets": tgts}
    path = write_result("distill", result, args.out)
    print_table(["kind", "seed", "reached", "held", "val end", "kl first", "kl last", "top-k kl first -> last"],
                [[r["kind"], r["seed"], r["reached"], r["held"], r["val_end"], r["kl_start"], r["kl_end"],
                  f"{r['topk_kl'][0]} -> {r['topk_kl'][-1]}" if r["topk_kl"] else ""]
                 for r in runs], title=f"steps until greedy val >= {bar:.3f} (teacher within 10 %)")
    print_table(["kind", "median reached", "median held"], [[k, m["reached"], m["held"]] for k, m in medians.items()],
                title="medians over seeds (a seed that never gets there counts as infinitely many steps)")
    print_targets(tgts)
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
