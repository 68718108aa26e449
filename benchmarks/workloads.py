"""What more than one benchmark runs: the tiny recipes trained in this process
(seeds, inflight, tool_seeds) or as a user runs them (step_profile,
vs_trl), runs on a started pool of simulated workers (overlap, inflight,
multiturn), the model sizes refit and lora_trainer build, and the random Llama
and synthetic GRPO rows of the GPU benchmarks. Not a benchmark itself.

Every heavy import (Ray, torch, vLLM, the pipeline) is inside the function that
needs it: the GPU benchmarks import this module without Ray or vLLM.
"""
from __future__ import annotations

import gc
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks.harness import ROOT, first_crossing, read_jsonl

RECIPES = {"grpo": ROOT / "examples" / "tiny_grpo.yaml", "ppo": ROOT / "examples" / "tiny_ppo.yaml",
           "grpo_lora": ROOT / "examples" / "tiny_grpo_lora.yaml", "ppo_lora": ROOT / "examples" / "tiny_ppo_lora.yaml"}
# The algorithm presets (docs/algorithms.md), for `benchmarks.seeds --result seeds_algos`.
PRESETS = ("dr_grpo", "rloo", "reinforce_pp", "dapo", "gspo", "cispo", "ppo_epochs")
RECIPES.update({name: ROOT / "examples" / f"tiny_{name}.yaml" for name in PRESETS})
# A reward model's score as the whole reward (benchmarks.seeds builds the classifier it names).
RECIPES["reward_model"] = ROOT / "examples" / "tiny_reward_model.yaml"
MODES = {0: "sync", 1: "async"}           # schedule.max_age -> name
# A learning run's figures (benchmarks.seeds): steps until the 3-step running mean of
# the training reward reaches 0.7, and the first greedy validation >= 0.9.
REWARD_BAR, WINDOW, VAL_BAR = 0.7, 3, 0.9
# hidden, layers, heads, head_dim, intermediate of the models refit and lora_trainer build
# (pipeline.inputs.tiny.build_tiny_model's arguments; vocabulary: the tiny tokenizer's 384)
MODEL_SIZES = {
    "tiny": (64, 2, 4, 32, 128),
    "1M": (128, 4, 4, 32, 512),
    "25M": (512, 6, 8, 64, 2048),
    "100M": (1024, 6, 16, 64, 4096),
    "400M": (1024, 24, 16, 64, 4096),
}


def build_sized_model(out_dir: Path, size: str) -> Path:
    """The Llama of MODEL_SIZES[size] (random weights, the tiny tokenizer), in out_dir/size."""
    from pipeline.inputs.tiny import build_tiny_model
    hidden, layers, heads, head_dim, inter = MODEL_SIZES[size]
    return build_tiny_model(out_dir / size, hidden=hidden, layers=layers, heads=heads, head_dim=head_dim,
                            intermediate=inter)


# --- training runs in this process ---------------------------------------------------------

def run_train(cfg, name: str, pool=None, runner=None) -> dict:
    """pipeline.run.driver.train on cfg, or on a started pool and step runner (tests/support/pooled_run.py),
    quiet; its summary, or RuntimeError unless it finished with every batch accounted for."""
    if pool is None:
        from pipeline.run.driver import train
        summary = train(cfg, quiet=True)
    else:
        from tests.support.pooled_run import train_on
        summary = train_on(cfg, pool, step_runner=runner, quiet=True)
    if summary["error"] or not summary["accounting"]["balanced"]:
        raise RuntimeError(f"run {name} failed: {summary['error'] or summary['accounting']}")
    return summary


def steps_to(rewards: list[float], bar: float = REWARD_BAR, window: int = WINDOW) -> int | None:
    """Steps taken (1-based) until the running mean of the last `window` rewards reaches `bar`."""
    k = first_crossing(rewards, bar, window)
    return None if k is None else k + 1


def read_learning(run_dir: Path) -> dict:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    val = [(r["step"], r["val_reward"]) for r in rows if "val_reward" in r]
    first_val_ok = next((step + 1 for step, v in val if v >= VAL_BAR), None)
    return {"rewards": [round(r, 6) for r in rewards], "val": [[s, round(v, 6)] for s, v in val],
            "final_val": val[-1][1] if val else None, "steps_to_0.7": steps_to(rewards),
            "steps_to_val_0.9": first_val_ok,
            "step_time_s": statistics.median(r["step_time_s"] for r in rows if "step_time_s" in r)}


def learning_run(algorithm: str, max_age: int, seed: int, steps: int, val_period: int, model: Path,
                 out_dir: Path, extra: list[str], name: str = "") -> dict:
    """One full run of a tiny recipe (RECIPES) on the real CPU stack, on the tiny data,
    greedy validation every val_period steps and at the end: its learning figures."""
    from pipeline.config import load_config
    mode = MODES.get(max_age, f"async{max_age}")
    name = name or f"{algorithm}_{mode}_s{seed}"
    cfg = load_config(RECIPES[algorithm], [
        f"model.path={model}", f"data.train={ROOT / 'data' / 'tiny_train.jsonl'}",
        f"data.val={ROOT / 'data' / 'tiny_val.jsonl'}", f"schedule.max_age={max_age}", f"run.seed={seed}",
        f"run.steps={steps}", f"validation.period={val_period}", "validation.at_end=true",
        "run.checkpoint_every=0", f"run.output_dir={out_dir}", f"run.name={name}", *extra])
    started = time.time()
    run_train(cfg, name)
    return {"algorithm": algorithm, "mode": mode, "max_age": max_age, "seed": seed,
            "wall_s": round(time.time() - started, 1), **read_learning(out_dir / name)}


class SimRun(NamedTuple):
    summary: dict
    steps: list[dict]           # the run's metrics records of steps >= 0
    violations: list | None     # check-events' findings, where asked for


def sim_run(overrides: list[str], pool, runner, out_dir: Path, name: str, check: bool = False) -> SimRun:
    """One run of the config `overrides` give (no recipe) on a started pool and step
    runner, as the sweeps over simulated workers run them; its directory is removed."""
    from pipeline.config import load_config
    cfg = load_config(None, [*overrides, f"run.output_dir={out_dir}", f"run.name={name}"])
    summary = run_train(cfg, name, pool, runner)
    violations = None
    if check:
        from pipeline.tools.check import check_events
        from pipeline.core.events import load_events
        violations = check_events(load_events(out_dir / name))
    steps = [r for r in read_jsonl(out_dir / name / "metrics.jsonl") if r["step"] >= 0]
    shutil.rmtree(out_dir / name, ignore_errors=True)
    return SimRun(summary, steps, violations)


# --- the tiny recipe as a user runs it -----------------------------------------------------

def build_model(out_dir: Path) -> Path:
    """The recipe's tiny model, built fresh (a clean checkout has no models/tiny until `make train`)."""
    from pipeline.inputs.tiny import build_tiny_model
    return build_tiny_model(out_dir / "model")


def run_recipe(out_dir: Path, name: str, max_age: int, steps: int, seed: int, extra: list[str],
               model: Path | None = None) -> dict:
    """One `python -m pipeline train` process of examples/tiny_grpo.yaml on `model`
    (default out_dir/model), without validation or checkpoints; returns its run
    directory and launch time."""
    cmd = [sys.executable, "-m", "pipeline", "train", "--config", str(RECIPES["grpo"]),
           f"model.path={model or out_dir / 'model'}", f"run.output_dir={out_dir}", f"run.name={name}",
           f"run.steps={steps}", f"run.seed={seed}", f"schedule.max_age={max_age}", "run.checkpoint_every=0",
           "validation.period=0", "validation.at_end=false", "metrics.progress=false", *extra]
    launched = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"run_dir": out_dir / name, "launched": launched, "exit_s": time.time() - launched}


# --- the GPU benchmarks' model and batch ---------------------------------------------------

def build_llama(out: Path, size: dict, seed: int) -> int:
    """A random Llama from a config, saved in bf16; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["intermediate"],
                         num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                         num_key_value_heads=size["heads"], max_position_embeddings=4096, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(out)
    del model
    gc.collect()
    return count


def build_rows(size: dict, vary: float, seed: int) -> list[dict]:
    """Prompt groups in TRAJECTORY_SCHEMA's columns: one prompt per group, responses of varied length."""
    rng = random.Random(seed)
    vocab, rows = size["vocab"], []
    lo = max(1, int(round(size["response_len"] * (1 - vary))))
    for g in range(size["rows"] // size["group_size"]):
        prompt = [rng.randrange(3, vocab) for _ in range(size["prompt_len"])]
        for i in range(size["group_size"]):
            n = rng.randint(lo, size["response_len"])
            rows.append({"batch_id": "b0", "target": 0, "version": 0, "prompt_id": f"p{g}",
                         "prompt_ids": prompt, "response_ids": [rng.randrange(3, vocab) for _ in range(n)],
                         "logprobs": [-rng.uniform(0.01, 3.0) for _ in range(n)], "text": "",
                         "reward": float(i % 2)})   # never a flat group: every advantage is non-zero
    return rows


def to_table(rows: list[dict]):
    import pyarrow as pa

    from pipeline.core.types import TRAJECTORY_SCHEMA
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)
