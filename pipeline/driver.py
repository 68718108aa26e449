"""The driver: start the workers, build the step graph, run it once per step.

    prologue: validate v0 if asked; launch the first max_age + 1 batches
    for step in steps: run the step graph with StepPlan(step, validate?)
    finish: account for every batch, write the summary
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import ray
from ray.dag import DAGContext
import yaml

from dags.step_graph import StepGraph, Workers, build_prologue_graph, build_step_graph
from dags.tokens import Resume, StepPlan, TrainOut
from pipeline import backends
from pipeline.config import Config
from pipeline.timeline import write_trace
from pipeline.events import EventLog, merge_events, unfinished_nodes
from pipeline.workers import Controller, GeneratorWorker, TrainerWorker


class PipelineError(RuntimeError):
    """A run stopped: the message names the node, worker and step where known."""


def validation_due(step: int, cfg: Config) -> bool:
    """NeMo-RL's meaning: after step s when (s + 1) % val_period == 0, and after the last step if val_at_end."""
    g = cfg.grpo
    return (g.val_period > 0 and (step + 1) % g.val_period == 0) or (g.val_at_end and step == cfg.run.steps - 1)


def graph_actor_count(cfg: Config) -> int:
    return 2 + cfg.generation.num_generators


def resolve_dag_mode(cfg: Config, cores: float) -> str:
    """auto picks compiled graphs only where each graph actor and the driver own
    two cores: one to work, one for the compiled channel's busy-wait. Measured
    (benchmarks/README.md): compiled saves 11-20 ms of dispatch per step but
    burns about a core per waiting actor; on 2 cores with busy workers it cost
    3.6-4.3x the CPU of classic and was the slowest mode."""
    if cfg.run.dag_mode != "auto":
        return cfg.run.dag_mode
    return "compiled" if cores >= 2 * (graph_actor_count(cfg) + 1) else "classic"


def _cores(joined_cluster: bool) -> float:
    """Real cores: a local Ray is started with more logical CPUs than the machine has."""
    if joined_cluster:
        return ray.cluster_resources().get("CPU", 1)
    return len(os.sched_getaffinity(0))


class GraphRunner:
    """Executes a StepGraph in classic or compiled mode; every wait has a deadline.

    A compiled runner may serve several runs on the same workers (tests do)."""

    def __init__(self, graph: StepGraph, mode: str, first_deadline_s: float):
        self.graph, self.mode = graph, mode
        # The first execution also starts the graph's loops on every actor (seconds on a busy machine).
        self.first_deadline_s = first_deadline_s
        self.executions = 0
        self.compiled = None
        if mode == "compiled":
            # Compiled graphs have their own 10 s result timeout; our deadlines are the ones that count.
            DAGContext.get_current().get_timeout = math.ceil(first_deadline_s) + 1
            self.compiled = graph.dag.experimental_compile()

    def run(self, plan: StepPlan, deadline_s: float, run_dir: Path) -> dict:
        if self.executions == 0:
            deadline_s = max(deadline_s, self.first_deadline_s)
        self.executions += 1
        refs = (self.compiled or self.graph.dag).execute(plan)
        out = {}
        for name, ref in zip(self.graph.node_names, refs):
            try:
                out[name] = ray.get(ref, timeout=deadline_s)
            except TimeoutError:  # GetTimeoutError, or RayChannelTimeoutError in compiled mode
                # A compiled graph returns its outputs together, so ask the event log what is stuck.
                stuck = unfinished_nodes(run_dir, plan.step) or [(name, "?")]
                where = ", ".join(f"node {n} on worker {w}" for n, w in stuck)
                raise PipelineError(f"step {plan.step}: {where} did not finish within "
                                    f"{deadline_s:.0f} s (run.deadline_s)") from None
            except ray.exceptions.RayActorError as exc:
                raise PipelineError(f"step {plan.step}: node {name}: its worker died: {_first_line(exc)}") from None
            except ray.exceptions.RayError as exc:
                raise PipelineError(_task_error(exc)) from None
        return out

    def close(self) -> None:
        if self.compiled is not None:
            self.compiled.teardown()
            self.compiled = None


def _first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _task_error(exc: BaseException) -> str:
    """The worker's own message, without Ray's traceback wrapping."""
    cause = getattr(exc, "cause", None)
    text = str(cause) if cause is not None else str(exc)
    return next((line for line in text.splitlines() if "failed at step" in line), _first_line(cause or exc))


def _prepare_run_dir(cfg: Config, say) -> Path:
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    if run_dir.exists():
        # Never delete a user's earlier run: move it aside.
        stamp = time.strftime('%Y%m%d-%H%M%S')
        kept = next(p for k in range(1000) if not (p := run_dir.with_name(
            f"{run_dir.name}.{stamp}" + (f"-{k}" if k else ""))).exists())
        run_dir.rename(kept)
        say(f"note: the earlier run in {run_dir} was moved to {kept}")
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return run_dir


def _ray_address(cfg: Config) -> str:
    return cfg.run.ray_address or os.environ.get("RAY_ADDRESS", "")


def _start_ray(cfg: Config) -> bool:
    """Join RAY_ADDRESS / ray.address if given, else start a local cluster. True if we started it."""
    if ray.is_initialized():
        return False
    address = _ray_address(cfg)
    if address:
        ray.init(address=address, log_to_driver=True)
        return True
    cpus = cfg.run.num_cpus or max(os.cpu_count() or 1, graph_actor_count(cfg) + 1)
    # Worker output (vLLM, DeepSpeed banners) stays in Ray's session logs; failures
    # reach the driver as errors naming the node, worker and step.
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    return True


def start_workers(num_generators: int) -> Workers:
    # Threaded actors: nodes of a step and the rollout threads' puts reach them concurrently.
    controller = ray.remote(Controller).options(num_cpus=0.5, max_concurrency=8).remote()
    # Two threads: `save` between steps must not wait behind a compiled graph's loop.
    trainer = ray.remote(TrainerWorker).options(num_cpus=0.5, max_concurrency=2).remote()
    generators = tuple(ray.remote(GeneratorWorker).options(num_cpus=0.5, max_concurrency=4).remote(i)
                       for i in range(num_generators))
    return Workers(controller, trainer, generators)


def stop_workers(workers: Workers) -> None:
    for actor in (workers.controller, workers.trainer, *workers.generators):
        ray.kill(actor)


def _begin_run(workers: Workers, cfg: Config, run_dir: Path, t0: float) -> Workers:
    """Set up every worker for this run; a pool may hold more generators than it uses."""
    used = workers.first(cfg.generation.num_generators)
    calls = [used.controller.begin_run.remote(cfg, str(run_dir), t0),
             used.trainer.begin_run.remote(cfg, str(run_dir), t0),
             *[g.begin_run.remote(cfg, str(run_dir), t0, used.controller) for g in used.generators]]
    try:
        ray.get(calls, timeout=cfg.run.startup_deadline_s)
    except ray.exceptions.GetTimeoutError:
        raise PipelineError(f"workers did not start within {cfg.run.startup_deadline_s:.0f} s "
                            "(run.startup_deadline_s)") from None
    except ray.exceptions.RayError as exc:
        raise PipelineError(f"a worker failed to start: {_task_error(exc)}") from None
    return used


def train(cfg: Config, *, workers: Workers | None = None, step_runner: GraphRunner | None = None,
          quiet: bool = False) -> dict:
    """Run a whole training job; returns the summary (also written to summary.json).

    Tests pass `workers` (and a `step_runner` over them) to run many short
    schedules on one set of actors; the caller then owns both."""
    say = (lambda *a: None) if quiet else print
    backends.preflight(cfg)
    run_dir = _prepare_run_dir(cfg, say)
    t0 = time.time()
    log = EventLog(run_dir, "driver", t0)
    started_ray = _start_ray(cfg)
    runner = step_runner
    summary: dict = {"steps": 0, "error": None}
    rewards: list[float] = []
    step_times: list[float] = []
    tokens = 0.0
    own_workers = workers is None
    try:
        if own_workers:
            workers = start_workers(cfg.generation.num_generators)
        workers = _begin_run(workers, cfg, run_dir, t0)
        mode = summary["dag_mode"] = resolve_dag_mode(cfg, _cores(joined_cluster=bool(_ray_address(cfg))))
        say(f"dagrl: backend={cfg.backend} dag_mode={mode} steps={cfg.run.steps} "
            f"max_age={cfg.grpo.max_age} generators={cfg.generation.num_generators} run_dir={run_dir}")
        if cfg.backend == "sim":
            say("dagrl: simulated workers (backend: sim): no model is trained")
        log.emit("run_start", max_age=cfg.grpo.max_age, steps=cfg.run.steps, start_step=0, dag_mode=mode,
                 refit_mode=cfg.generation.refit_mode)
        prologue = GraphRunner(build_prologue_graph(workers), "classic", cfg.run.deadline_s)
        prologue_out = prologue.run(StepPlan(-1, cfg.grpo.val_at_start), cfg.run.deadline_s, run_dir)
        _write_val_metrics(run_dir, prologue_out["resume"])
        if runner is None:
            runner = GraphRunner(build_step_graph(workers), mode, cfg.run.startup_deadline_s)
        elif runner.mode != mode:
            raise ValueError(f"step_runner is {runner.mode} but run.dag_mode resolves to {mode}")
        for step in range(cfg.run.steps):
            started = time.time()
            out = runner.run(StepPlan(step, validation_due(step, cfg)), cfg.run.deadline_s, run_dir)
            elapsed = time.time() - started
            metrics = _step_metrics(step, elapsed, out["train"], out["resume"])
            _append_jsonl(run_dir / "metrics.jsonl", metrics)
            rewards.append(metrics["reward_mean"])
            step_times.append(elapsed)
            tokens += metrics["response_tokens"]
            summary["steps"] = step + 1
            val = f" val_reward={metrics['val_reward']:.3f}" if "val_reward" in metrics else ""
            say(f"step {step + 1}/{cfg.run.steps} reward={metrics['reward_mean']:.3f} "
                f"age={metrics['age_mean']:.1f} loss={metrics.get('loss', float('nan')):.4f} "
                f"time={elapsed:.2f}s{val}")
            every = cfg.run.checkpoint_every
            if step == cfg.run.steps - 1 or (every and (step + 1) % every == 0):
                summary["checkpoint"] = _save_checkpoint(workers, run_dir, step, cfg)
        summary["accounting"] = ray.get(workers.controller.finish.remote(), timeout=cfg.run.deadline_s)
    except BaseException as exc:
        summary["error"] = str(exc) if isinstance(exc, PipelineError) else f"{type(exc).__name__}: {exc}"
        raise
    finally:
        failed = summary["error"] is not None
        if own_workers and workers is not None and failed:
            stop_workers(workers)  # before teardown: a stuck actor would hold a compiled teardown up
        if runner is not None and (step_runner is None or failed):
            runner.close()
        if own_workers and workers is not None and not failed:
            stop_workers(workers)
        log.emit("run_end", error=summary["error"])
        log.close()
        if started_ray:
            ray.shutdown()
        merge_events(run_dir)
        write_trace(run_dir)
        wall = time.time() - t0
        head, tail = rewards[:3], rewards[-3:]
        summary.update({
            "wall_s": round(wall, 3),
            "reward_start": sum(head) / len(head) if head else None,
            "reward_end": sum(tail) / len(tail) if tail else None,
            "step_time_mean_s": sum(step_times) / len(step_times) if step_times else None,
            # Over the steps only: worker start-up (vLLM, DeepSpeed) is not generation.
            "generated_tokens_per_s": tokens / sum(step_times) if step_times else None,
            "generation_backend": "sim" if cfg.backend == "sim" else "vllm",
            "training_backend": "sim" if cfg.backend == "sim" else "deepspeed",
        })
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    say(f"done: {summary['steps']} steps in {summary['wall_s']:.0f} s (start-up included); "
        f"reward {summary['reward_start']:.3f} -> {summary['reward_end']:.3f} (mean of first/last 3 steps); "
        f"step time {summary['step_time_mean_s']:.2f} s; {summary['generated_tokens_per_s']:.0f} generated tokens/s; "
        f"files in {run_dir}")
    return summary


def _save_checkpoint(workers: Workers, run_dir: Path, step: int, cfg: Config) -> str:
    """The policy in HF format, written beside its final name and renamed into place."""
    final = run_dir / "checkpoints" / f"step_{step + 1}"
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    ray.get(workers.trainer.save.remote(str(partial)), timeout=cfg.run.startup_deadline_s)
    partial.rename(final)
    return str(final)


def _step_metrics(step: int, elapsed: float, train: TrainOut, resume: Resume) -> dict:
    return {**dict(train.metrics), **dict(resume.val_scores), "step": step, "step_time_s": round(elapsed, 6)}


def _write_val_metrics(run_dir: Path, resume: Resume) -> None:
    if resume.val_scores:
        _append_jsonl(run_dir / "metrics.jsonl", {"step": -1, **dict(resume.val_scores)})


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
