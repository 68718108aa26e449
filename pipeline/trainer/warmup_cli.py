"""`python -m pipeline warmup`: a supervised warm-up before RL, on an env's
expert episodes (pipeline/trainer/warmup.py) or on chat transcripts
(pipeline/trainer/transcripts.py)."""
from __future__ import annotations

import argparse
import json

from pipeline.trainer.warmup import DEFAULT_BATCH, DEFAULT_LR, DEFAULT_STEPS, MAX_NEW_TOKENS, warmup


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True, help="HF directory to start from, e.g. models/tiny")
    ap.add_argument("--env", default=None, help="module:Class, e.g. pipeline.envs.calculator:CalculatorEnv")
    ap.add_argument("--env-args", default=None, help="JSON object of constructor arguments (env.args)")
    ap.add_argument("--data", default=None, help="training prompts (JSONL/Parquet) the env's expert plays")
    ap.add_argument("--transcripts", default=None,
                    help="instead of --env and --data: chat transcripts, JSONL of {messages, tools} "
                         "(pipeline/trainer/transcripts.py), rendered by the model's chat template")
    ap.add_argument("--val", default=None, help="prompts to report the reward on, before and after; with "
                    "--transcripts, transcripts whose first turns to compare the model's with")
    ap.add_argument("--out", required=True, help="directory to write the warmed-up model into")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"default: the env class's warmup_steps, else {DEFAULT_STEPS}")
    ap.add_argument("--prompts", type=int, default=None,
                    help="demonstrate only the first N training prompts or transcripts (default: the env "
                         "class's warmup_prompts, else all)")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR)
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--max-turns", type=int, default=None, help="default: the env's own max_turns")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                    help="the most tokens of one model turn, as generated (a longer demonstrated turn is refused)")
    ap.add_argument("--tool-parser", default=None, help="with --transcripts: vLLM's tool parser to count the "
                    "model's tool calls with in --val's first turns, e.g. pythonic")
    ap.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.transcripts is not None:
        given = [f"--{k.replace('_', '-')}" for k in ("env", "data", "env_args", "max_turns")
                 if getattr(args, k) is not None]
        if given:
            raise ValueError(f"--transcripts takes the place of an env's episodes: drop {', '.join(given)}")
        from pipeline.trainer.transcripts import warmup_on_transcripts
        warmup_on_transcripts(args.model, args.transcripts, args.out, val=args.val,
                              steps=args.steps or DEFAULT_STEPS, prompts=args.prompts, lr=args.lr,
                              batch_size=args.batch_size, seed=args.seed, tool_parser=args.tool_parser,
                              max_new_tokens=args.max_new_tokens, log=print)
        return 0
    if args.env is None or args.data is None:
        raise ValueError("give --env and --data (an env's expert episodes), or --transcripts FILE")
    if args.tool_parser is not None:
        raise ValueError("--tool-parser counts tool calls in chat transcripts: it goes with --transcripts")
    try:
        env_args = json.loads(args.env_args or "{}")
    except ValueError as exc:
        raise ValueError(f"--env-args {args.env_args!r} is not JSON: {exc}") from None
    if not isinstance(env_args, dict):
        raise ValueError(f"--env-args {args.env_args!r} must be a JSON object")
    warmup(args.model, args.env, args.data, args.out, val=args.val, steps=args.steps, prompts=args.prompts,
           lr=args.lr, batch_size=args.batch_size, seed=args.seed, env_args=env_args,
           max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, log=print)
    return 0
