"""Routing replay (training.routing_replay) on the tiny Qwen3-MoE: what it
buys and what it costs.

Each arm trains the tiny MoE (2 MoE layers, 4 experts, 2 a token) for --steps
GRPO steps on the tiny repeat task, one process with one vLLM engine that
records every token's routes and one DeepSpeed policy, synchronously in
lockstep: the batch trained at step s was sampled by the engine at version
max(0, s - max_age), and the engine is refit after each step. Before each
update the batch is scored by the trainer as the update sees it, and the
benchmark reports, over the steps whose batch has the arm's full age:

  routing_differs       share of tokens (prompt and response, all but the last)
                        whose experts in the trainer's forward differ from the
                        engine's in some layer
  own_routing_differs   the same for the trainer's own routers' choice (what
                        replay overrides; equal to routing_differs without replay)
  logprob_gap_mean/max  |trainer logprob - engine logprob| over response tokens:
                        at age 0 the numerics' and the routing's part of the IS
                        weight, at age 2 the policy's change on top
  other_logprob_gap_mean  the same batch and weights scored the other way
                        (without replay in the replay arm, with it in the other):
                        the routing's share of the gap, the policy's change alike

Arms: replay on and off at max_age 0 and 2 (off: the same recorded routes,
the table's column dropped before the update, so the trainer routes by
itself), on the tiny MoE and on the same body with every weight drawn with
std 0.2 instead of 0.02 (replay arms only: the other-way scoring gives the
counterfactual). Costs: route bytes per token; and, after the replay arms' steps,
paired timings in one process, alternating so that the machine's load falls
alike: an update with the routes and without, a batch sampled with the engine
recording and not.

    .venv/bin/python -m benchmarks.routing_replay            # -> benchmarks/results/routing_replay.json
    .venv/bin/python -m benchmarks.routing_replay --quick    # 3 steps an arm
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from benchmarks.harness import ROOT, engine_config, machine_info, print_table, sample_all, write_result

PROMPTS, GROUP, NEW_TOKENS, LR = 8, 4, 16, 5e-3
PAIRED = ("train_replayed", "train_plain", "generate_recorded", "generate_unrecorded")
# The tiny model's experts, drawn with std 0.02 like the rest of it, are near-interchangeable: which
# of them a token goes to barely moves its logprobs. Drawn with std 0.2 they differ as trained ones do.
MODELS = {"tiny": 0.02, "tiny_std0.2": 0.2}
ARMS = [("tiny", "replay", 0), ("tiny", "no_replay", 0), ("tiny", "replay", 2), ("tiny", "no_replay", 2),
        ("tiny_std0.2", "replay", 0), ("tiny_std0.2", "replay", 2)]


@contextlib.contextmanager
def experts_used(module):
    """The experts each MoE block of `module` computes in the forwards inside: {layer: top_k_index}."""
    used, handles = {}, []
    blocks = [m for m in module.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    for slot, block in enumerate(blocks):
        handles.append(block.register_forward_hook(
            lambda m, args, out, slot=slot: used.__setitem__(slot, args[1].detach().cpu().numpy())))
    try:
        yield used
    finally:
        for handle in handles:
            handle.remove()


def trainer_view(trainer, table, apply: bool) -> dict:
    """`table` scored row by row by the trainer's current weights, replaying the
    engine's routes (`apply`) or routing by itself: token counts of routes that
    differ from the engine's (used, and the routers' own) and logprob gaps."""
    import torch

    from pipeline.trainer.rows import collate, trajectory_rows
    counts = {"tokens": 0, "routing_differs": 0, "own_routing_differs": 0}
    gaps = []
    with experts_used(trainer.engine.module) as used:
        for row in trajectory_rows(table):
            batch = collate([row], trainer.device, {})
            with torch.no_grad(), trainer.replaying(batch, apply) as replay:
                lp = trainer.token_logprobs(trainer.engine, batch)[0][batch["mask"][0]]
            engine = np.sort(trainer.routes.decode(row["routed_experts"]), axis=-1)
            taken = np.sort(np.stack([used[slot][:len(engine)] for slot in sorted(used)], axis=1), axis=-1)
            counts["tokens"] += len(engine)
            counts["routing_differs"] += int((taken != engine).any(axis=(1, 2)).sum())
            counts["own_routing_differs"] += int(round(replay.flip_share * replay.routed))
            gaps += np.abs(lp.numpy() - np.asarray(row["logprobs"])).tolist()
    return {**counts, "logprob_gap_mean": float(np.mean(gaps)), "logprob_gap_max": float(np.max(gaps))}


def sampled_table(engine, prompts, version: int, step: int):
    """A batch of the tiny task sampled now (seeds by step), scored with tiny_reward."""
    import pyarrow as pa

    from pipeline.core.types import TRAJECTORY_SCHEMA, sample_seeds
    from pipeline.rewards.rules import tiny_reward
    groups = sample_all(engine, prompts, sample_seeds(0, f"b{step}", prompts, GROUP))
    rows = [dict(batch_id=f"b{step}", target=step, version=version, prompt_id=p.id, prompt_ids=list(c.prompt_ids),
                 response_ids=list(c.response_ids), logprobs=list(c.logprobs), text=c.text,
                 reward=tiny_reward(p, c.text), routed_experts=c.routes or None)
            for p, group in zip(prompts, groups) for c in group]
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def arm(model_dir: str, mode: str, max_age: int, steps: int) -> dict:
    """One arm in this process (vLLM after DeepSpeed, which refuses the group vLLM would make)."""
    import torch

    from pipeline.algos.advantages import critic_free_advantages
    from pipeline.core.types import Prompt
    from pipeline.generator.vllm_engine import VllmGenerationEngine
    from pipeline.inputs.tiny import tiny_task_rows
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    torch.set_num_threads(1)
    trainer = DeepSpeedPolicyEngine(engine_config(
        model_dir, "training.routing_replay=true", f"training.lr={LR}",
        f"training.micro_batch_size={PROMPTS * GROUP}", f"schedule.group_size={GROUP}",
        f"generation.max_new_tokens={NEW_TOKENS}"))
    engine = VllmGenerationEngine(model_dir, seed=0, max_new_tokens=NEW_TOKENS, max_model_len=256,
                                  routing_replay=True)
    rows = tiny_task_rows(PROMPTS * (steps + max_age + 1))
    prompts = [Prompt(r["id"], r["prompt"], r["answer"]) for r in rows]
    batch = lambda step: prompts[step * PROMPTS:(step + 1) * PROMPTS]  # noqa: E731
    try:
        queue, gen_s, train_s, views, rewards = deque(), [], [], [], []
        for step in range(max_age + 1):
            queue.append(sampled_table(engine, batch(step), 0, step))
        for step in range(steps):
            table = queue.popleft()
            rewards.append(float(np.mean(table.column("reward").to_pylist())))
            if step >= max_age:
                # The update's view, and the same batch and weights scored the other way.
                views.append({"used": trainer_view(trainer, table, apply=mode == "replay"),
                              "other": trainer_view(trainer, table, apply=mode != "replay")})
            trained = table if mode == "replay" else table.drop_columns(["routed_experts"])
            t0 = time.perf_counter()
            trainer.train_step(trained, critic_free_advantages(trained, GROUP))
            train_s.append(time.perf_counter() - t0)
            engine.load_weights(trainer.export_weights())
            t0 = time.perf_counter()
            queue.append(sampled_table(engine, batch(step + max_age + 1), step + 1, step + max_age + 1))
            gen_s.append(time.perf_counter() - t0)
        paired = paired_times(trainer, engine, table, batch(0)) if mode == "replay" else None
    finally:
        trainer.close()
        engine.close()
    out = {"mode": mode, "max_age": max_age, "steps": steps, "reward_first": rewards[0], "reward_last": rewards[-1],
           "train_s": statistics.median(train_s), "generate_s": statistics.median(gen_s)}
    if paired:
        out["paired_s"] = paired
    if views:
        used = [v["used"] for v in views]
        tokens = sum(v["tokens"] for v in used)
        out.update(tokens=tokens, routing_differs=sum(v["routing_differs"] for v in used) / tokens,
                   own_routing_differs=sum(v["own_routing_differs"] for v in used) / tokens,
                   logprob_gap_mean=statistics.mean(v["logprob_gap_mean"] for v in used),
                   logprob_gap_max=max(v["logprob_gap_max"] for v in used),
                   other_logprob_gap_mean=statistics.mean(v["other"]["logprob_gap_mean"] for v in views),
                   per_step=views)
    return out


def paired_times(trainer, engine, table, prompts, pairs: int = 10) -> dict:
    """Median seconds of an update on `table` with its routes and without, and of
    sampling `prompts` with the engine recording routes and not, alternating in
    one process, so that the machine's load falls alike on both."""
    from pipeline.algos.advantages import critic_free_advantages
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    advantages = critic_free_advantages(table, GROUP)
    plain = table.drop_columns(["routed_experts"])
    runner = engine.llm.llm_engine.model_executor.driver_worker.model_runner
    routers = [m.router for m in runner.model.modules() if isinstance(m, MoERunner)]
    hooks, execute = [r.capture_fn for r in routers], runner.execute_model

    def unrecorded(k: int):
        """A batch with the engine's recorder taken out: no router hook, no split of the forward's rows."""
        recorder, engine._routes = engine._routes, None
        for router in routers:
            router.set_capture_fn(None)
        del runner.execute_model
        try:
            sampled_table(engine, prompts, 0, 1000 + k)
        finally:
            for router, hook in zip(routers, hooks):
                router.set_capture_fn(hook)
            runner.execute_model, engine._routes = execute, recorder

    times = {name: [] for name in PAIRED}
    for k in range(pairs):
        for name, run in (("train_replayed", lambda: trainer.train_step(table, advantages)),
                          ("train_plain", lambda: trainer.train_step(plain, advantages)),
                          ("generate_recorded", lambda: sampled_table(engine, prompts, 0, 1000 + k)),
                          ("generate_unrecorded", lambda: unrecorded(k))):
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 steps an arm")
    ap.add_argument("--steps", type=int, default=None, help="training steps an arm (default 12; quick 3)")
    ap.add_argument("--out", type=Path, help="directory for routing_replay.json (default benchmarks/results)")
    ap.add_argument("--arm", nargs=4, metavar=("MODEL_DIR", "MODE", "MAX_AGE", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.arm:
        print(json.dumps(arm(args.arm[0], args.arm[1], int(args.arm[2]), int(args.arm[3]))))
        return 0
    from pipeline.inputs.tiny import build_tiny_model
    from pipeline.moe.routes import route_layout
    steps = args.steps or (3 if args.quick else 12)
    with tempfile.TemporaryDirectory(prefix="dagrl_routing_replay_") as work:
        dirs = {name: build_tiny_model(Path(work) / name, architecture="qwen3_moe", heads=4, kv_heads=2,
                                       init_std=std) for name, std in MODELS.items()}
        layout = route_layout(dirs["tiny"])
        result = {"benchmark": "routing_replay", "machine": machine_info(),
                  "params": {"steps": steps, "prompts_per_step": PROMPTS, "group_size": GROUP,
                             "max_new_tokens": NEW_TOKENS, "lr": LR, "model": "tiny qwen3_moe, 2 layers, 4 experts, "
                             "2 a token, fp32", "init_std": MODELS, "route_bytes_per_token": layout.bytes_per_token},
                  "arms": []}
        for model, mode, max_age in ARMS:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.routing_replay", "--arm", str(dirs[model]), mode,
                                   str(max_age), str(steps)], cwd=ROOT, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise RuntimeError(f"arm {model} {mode} max_age {max_age} failed:\n{proc.stderr[-3000:]}")
            result["arms"].append({"model": model, **json.loads(proc.stdout.strip().splitlines()[-1])})
            print(f"  {model} {mode} max_age {max_age} done", flush=True)
    print_table(["model", "arm", "max_age", "routing differs", "own differs", "lp gap mean", "other way", "lp gap max"],
                [[a["model"], a["mode"], a["max_age"], a["routing_differs"], a["own_routing_differs"],
                  a["logprob_gap_mean"], a["other_logprob_gap_mean"], a["logprob_gap_max"]] for a in result["arms"]],
                title="routing replay on the tiny MoE")
    print_table(["model", "max_age", *PAIRED], [[a["model"], a["max_age"], *(a["paired_s"][k] for k in PAIRED)]
                                                for a in result["arms"] if "paired_s" in a], title="paired seconds")
    print(f"wrote {write_result('routing_replay', result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
