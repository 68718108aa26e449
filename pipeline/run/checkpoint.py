"""Checkpoints: written whole beside their final name, then renamed into place.

    runs/<name>/checkpoints/step_<n>/
        policy/          HF model + tokenizer (loadable by transformers and vLLM); with
                         training.lora, the peft adapter (`python -m pipeline export` merges it)
        trainer_state/   policy weights, optimizer, step counter, RNG
        critic_state/    PPO only: the same for the critic
        controller/      data position, RNG, counters, buffered batches (Parquet), in-flight launches
        meta.json        step count, version, the config and the data files' digests (what a
                         resume compares: run/resume_check.py); written last, so its presence means complete

A rename is atomic on one filesystem, so a killed run leaves either a complete
`step_<n>` or a `step_<n>.partial` that `latest` never picks. A save that fails
(a worker's error, or weights holding a NaN or inf, which the engines refuse to
save) removes its `.partial`.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import ray

from dags.step_graph import Workers
from typing import NamedTuple

from pipeline.config import Config
from pipeline.run import resume_check
from pipeline.run.resume_check import Change
from pipeline.run.runner import PipelineError, task_error

class CheckpointError(ValueError):
    """No usable checkpoint; the message names the directory or file."""


class Resumable(NamedTuple):
    steps_done: int
    changes: list[Change]   # what the resume changes, as --allow-change let it


def save(workers: Workers, run_dir: Path, steps_done: int, cfg: Config, timeout_s: float, *, inputs: dict) -> Path:
    """`inputs`: the data files' digests as the attempt read them (resume_check.data_digests)."""
    final = run_dir / "checkpoints" / f"step_{steps_done}"
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    calls = [workers.controller.save_state.remote(str(partial / "controller")),
             *(c.save_state.remote(str(partial / "critic_state")) for c in workers.critics)]
    try:
        # Every rank, one call after the other: rank 0 writes the HF model, each rank
        # its optimizer partition, and under ZeRO-3 both gather; two collectives
        # in flight at once could pair one rank's save with another's save_state.
        ray.get([t.save.remote(str(partial / "policy")) for t in workers.trainers], timeout=timeout_s)
        calls += [t.save_state.remote(str(partial / "trainer_state")) for t in workers.trainers]
        ray.get(calls, timeout=timeout_s)
    except BaseException as exc:
        # A refused save (non-finite weights) or a failed one: no half-written directory is
        # left to mistake for a checkpoint; the last complete one stays the newest. The other
        # writers finish first, so none refills it (a hung one is not waited for twice).
        hung = isinstance(exc, ray.exceptions.GetTimeoutError)
        ray.wait(calls, num_returns=len(calls), timeout=0 if hung else timeout_s)
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, ray.exceptions.RayTaskError):
            raise PipelineError(f"checkpoint {final} was not written: {task_error(exc)}") from exc
        raise
    (partial / "meta.json").write_text(json.dumps({
        "steps_done": steps_done, "version": steps_done, "time": time.time(),
        "config": cfg.to_dict(), "inputs": inputs}, indent=2))
    if final.exists():  # a resumed run passes a step it had saved before it was killed
        shutil.rmtree(final)
    partial.rename(final)
    return final


def latest(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run; half-written ones are skipped."""
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume {run_dir}: no such run directory")
    found = []
    for path in (run_dir / "checkpoints").glob("step_*"):
        if path.suffix == ".partial" or not (path / "meta.json").is_file():
            continue
        try:
            found.append((int(path.name.removeprefix("step_")), path))
        except ValueError:
            continue
    if not found:
        raise CheckpointError(f"--resume {run_dir}: no complete checkpoint in {run_dir / 'checkpoints'} "
                              "(set run.checkpoint_every to write them)")
    return max(found)[1]


def policy_dir(source: str | Path, command: str) -> Path:
    """The policy's weights in `source`: a run (its latest checkpoint), a
    checkpoint step_<k>, its policy/, or any model directory."""
    src = Path(source)
    if (src / "checkpoints").is_dir():
        src = latest(src)
    if (src / "policy").is_dir():
        src = src / "policy"
    if not src.is_dir():
        raise FileNotFoundError(f"{command}: {str(source)!r} is not a run, checkpoint or model directory")
    return src


def read_meta(ckpt: Path, cfg: Config, allow: frozenset[str] = frozenset(), inputs: dict | None = None) -> Resumable:
    """Steps done at this checkpoint, after checking it is whole and that `cfg`
    continues its run (resume_check: what a resume may change, and `allow`,
    --allow-change's keys). `inputs`: the data files' digests as this attempt
    reads them (default: as they are now)."""
    meta_path = ckpt / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        steps_done = int(meta["steps_done"])
        saved = meta["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {meta_path} is unreadable: {type(exc).__name__}: {exc}") from None
    # The config first: a changed algorithm also changes which parts a checkpoint needs.
    inputs = resume_check.data_digests(cfg) if inputs is None else inputs
    allowed = resume_check.check(ckpt, resume_check.changes(saved, meta.get("inputs"), cfg, inputs), allow)
    needed = ["controller/controller.json", "trainer_state", "policy"]
    if cfg.algorithm == "ppo":
        needed.append("critic_state")
    missing = [n for n in needed if not (ckpt / n).exists()]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} is incomplete: missing {', '.join(missing)}")
    try:
        json.loads((ckpt / "controller/controller.json").read_text())
    except ValueError as exc:
        raise CheckpointError(f"checkpoint file {ckpt / 'controller/controller.json'} is unreadable: {exc}") from None
    if steps_done >= cfg.run.steps:
        raise CheckpointError(f"cannot resume {ckpt}: it is at step {steps_done} and run.steps is "
                              f"{cfg.run.steps}; raise run.steps to train further")
    return Resumable(steps_done, allowed)


def archive_attempt(run_dir: Path, steps_done: int) -> Path:
    """Move the killed attempt's logs and config aside, so that the resumed run's are whole by themselves."""
    attempts = run_dir / "attempts"
    k = 1 + sum(1 for _ in attempts.glob("*")) if attempts.is_dir() else 1
    dest = attempts / str(k)
    dest.mkdir(parents=True)
    for name in ("events", "events.jsonl", "trace.json", "summary.json", "config.yaml"):
        if (run_dir / name).exists():
            (run_dir / name).rename(dest / name)
    # Copied, not moved: the resumed run keeps the steps before the checkpoint (MetricSinks drops the rest).
    for name in ("metrics.jsonl", "samples.jsonl"):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, dest / name)
    return dest
