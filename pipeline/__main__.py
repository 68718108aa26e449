"""Command line: `python -m pipeline {train,check-events,samples,viz,timeline,build-tiny,warmup,export,eval,config-table} ...`."""
from __future__ import annotations

import argparse
import sys


def _train(args: argparse.Namespace) -> int:
    from pipeline.config import load_config
    from pipeline.run.driver import train
    from pipeline.run.resume_check import allowed_keys, run_config
    allow = allowed_keys(args.allow_change)
    if args.config is None:
        cfg = run_config(args.resume, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
    train(cfg, restore_from=args.resume, allow_change=allow)
    return 0


def _check_events(args: argparse.Namespace) -> int:
    from pipeline.tools.check import main
    return main(args.run_dir)


def _samples(args: argparse.Namespace) -> int:
    from pipeline.tools.samples import samples_main
    return samples_main(args.run_dir, args.step, args.kind, args.limit)


def _viz(args: argparse.Namespace) -> int:
    from pipeline.tools.render import viz_main
    return viz_main(args.config, args.overrides, args.out)


def _timeline(args: argparse.Namespace) -> int:
    from pipeline.tools.timeline import timeline_main
    return timeline_main(args.run_dir, args.out)


def _build_tiny(args: argparse.Namespace) -> int:
    from pipeline.inputs.tiny import main, model_digest
    if args.vlm:
        import torch
        from pipeline.inputs.tiny_vlm import build_tiny_vlm
        torch.set_num_threads(1)
        build_tiny_vlm(args.out, seed=args.seed)
        print(f"built the tiny vision-language model in {args.out} (sha256 {model_digest(args.out)[:12]})")
        return 0
    if args.reward_model:
        import torch
        from pipeline.inputs.tiny_reward_model import build_tiny_reward_model
        torch.set_num_threads(1)
        fit = build_tiny_reward_model(args.out, seed=args.seed)
        print(f"built the tiny reward model in {args.out}: held-out squared error {fit['held_out_mse']:.4f} "
              f"(reward variance {fit['reward_var']:.3f}), correlation {fit['correlation']:.3f} "
              f"(sha256 {model_digest(args.out)[:12]})")
        return 0
    return main(["--out", args.out, "--seed", str(args.seed), "--architecture", args.architecture,
                 *(["--chat-template", args.chat_template] if args.chat_template else [])])


def _warmup(args: argparse.Namespace) -> int:
    from pipeline.trainer.warmup_cli import run
    return run(args)


def _export(args: argparse.Namespace) -> int:
    from pipeline.tools.export import export_main
    return export_main(args.source, args.out)


def _eval(args: argparse.Namespace) -> int:
    from pipeline.tools.evaluate import eval_main
    names = [n.strip() for n in args.sets.split(",") if n.strip()] if args.sets else []
    return eval_main(args.config, args.overrides, args.model, args.out, names, not args.quiet)


def _config_table(args: argparse.Namespace) -> int:
    from pipeline.tools.config_table import reference_table
    print(reference_table(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser; each subcommand's `func` runs it."""
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run a training job from a YAML recipe")
    p.add_argument("--config", default=None, help="YAML recipe, e.g. examples/sim_grpo.yaml; with --resume, "
                   "default: the run's own config.yaml")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue runs/<name> from its latest complete checkpoint")
    p.add_argument("--allow-change", metavar="KEYS", action="append", default=[],
                   help="with --resume: comma-separated keys the resume may change although they change what "
                   "the run trains on or with (data.train,data.val, ...)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. schedule.max_age=2 run.name=x")
    p.set_defaults(func=_train)
    p = sub.add_parser("check-events", help="verify the ordering invariants of a run's event log")
    p.add_argument("run_dir", help="runs/<name>")
    p.set_defaults(func=_check_events)
    p = sub.add_parser("samples", help="print the prompts and completions a run wrote (metrics.samples)")
    p.add_argument("run_dir", help="runs/<name>")
    p.add_argument("--step", type=int, default=None, help="only this step's (-1: validation before training)")
    p.add_argument("--kind", choices=("train", "val"), default=None, help="only training or validation samples")
    p.add_argument("--limit", type=int, default=None, metavar="M", help="at most the first M samples")
    p.set_defaults(func=_samples)
    p = sub.add_parser("viz", help="draw the step graph: .dot .mmd .png .svg")
    p.add_argument("--config", required=True)
    p.add_argument("--out", action="append", default=[], help="output file; repeat for several formats")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_viz)
    p = sub.add_parser("timeline", help="draw a run's Gantt chart from its event log")
    p.add_argument("run_dir", help="runs/<name>")
    p.add_argument("--out", default=None, help="PNG path (default runs/<name>/timeline.png)")
    p.set_defaults(func=_timeline)
    p = sub.add_parser("build-tiny", help="build the tiny model and tokenizer into a local HF directory")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    from pipeline.inputs.tiny import CHAT_TEMPLATES
    p.add_argument("--chat-template", nargs="?", const="plain", choices=sorted(CHAT_TEMPLATES),
                   help="give the tokenizer a chat template: plain (the default; for chat-format datasets: "
                   "examples/gsm8k_chat.yaml) or tools (for agents that call tools)")
    from pipeline.inputs.tiny import ARCHITECTURES
    p.add_argument("--architecture", default="llama", choices=sorted(ARCHITECTURES),
                   help="the model family (qwen3_moe: a mixture of experts, for examples/tiny_moe_grpo.yaml)")
    p.add_argument("--reward-model", action="store_true", help="build a classifier fitted to the tiny task's reward "
                   "(examples/tiny_reward_model.yaml)")
    p.add_argument("--vlm", action="store_true", help="build a tiny Qwen2-VL with its image processor "
                   "(examples/tiny_vlm_grpo.yaml)")
    p.set_defaults(func=_build_tiny)
    p = sub.add_parser("warmup", help="supervised warm-up of a model on an environment's expert transcripts")
    from pipeline.trainer.warmup_cli import add_arguments
    add_arguments(p)
    p.set_defaults(func=_warmup)
    p = sub.add_parser("export", help="write a checkpoint's policy as a plain HF model (a LoRA adapter merged in)")
    p.add_argument("source", help="runs/<name> (its latest checkpoint), a checkpoint step_<n>, or its policy/")
    p.add_argument("--out", required=True, help="directory for the HF model")
    p.set_defaults(func=_export)
    p = sub.add_parser("eval", help="a recipe's validation sets on a checkpoint or HF model directory, without a "
                       "trainer (docs/evaluation.md)")
    p.add_argument("--config", required=True, help="the recipe whose validation.sets (or data.val) to evaluate")
    p.add_argument("--model", required=True, help="runs/<name> (its latest checkpoint), runs/<name>/checkpoints/"
                   "step_<k>, an HF model directory or a peft adapter directory")
    p.add_argument("--out", required=True, help="the JSON file the metrics go to")
    p.add_argument("--sets", default="", metavar="NAMES", help="comma-separated set names (default: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the recipe, e.g. run.seed=1")
    p.set_defaults(func=_eval)
    p = sub.add_parser("config-table", help="print every config key with its default as a Markdown table")
    p.set_defaults(func=_config_table)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train" and args.resume is None:
        if args.config is None:
            parser.error("--config is required unless --resume names a run directory")
        if args.allow_change:
            parser.error("--allow-change applies to --resume only")
    from pipeline.config import ConfigError
    from pipeline.run.runner import PipelineError
    from pipeline.run.stopping import Stopped, StopNow
    try:
        return args.func(args)
    except (Stopped, StopNow) as exc:
        print(_with_notes(f"dagrl: {exc}", exc), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("dagrl: interrupted before the run started", file=sys.stderr)
        return 130
    except (ConfigError, PipelineError, FileNotFoundError, ValueError) as exc:
        print(_with_notes(f"error: {exc}", exc), file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1


def _with_notes(message: str, exc: BaseException) -> str:
    """The driver adds what to do next to an error as a note (pipeline/run/driver.py)."""
    return "\n".join([message, *(f"  {note}" for note in getattr(exc, "__notes__", ()))])


if __name__ == "__main__":
    sys.exit(main())
