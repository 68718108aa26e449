"""The driver: start the workers, build the step graph, run it once per step.

    restore?: load the latest complete checkpoint into every worker (--resume)
    prologue: validate v0 if asked; launch the first max_age + 1 batches
    for step in steps: run the step graph with StepPlan(step, validate?); checkpoint every N
    finish: account for every batch, write the summary

A generator that dies is replaced and its batches relaunched (pipeline/run/pool.py);
any other dead worker stops the run with the checkpoint to resume from.

The driver has a lane of the vector clock too (pipeline/core/events.py): each plan
it feeds a graph carries the driver's clock, and it merges every token a graph
returns, so each step is provably after everything the steps before it did.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import ray
import yaml

from dags.step_graph import TRAIN_SUBGRAPHS, StepGraph, Workers, build_finish_graph, build_prologue_graph, build_step_graph
from dags.tokens import StepPlan, TrainOut
from pipeline.trainer.skipped_steps import console_warnings
from pipeline.config import Config
from pipeline.inputs.preflight import preflight
from pipeline.run import checkpoint
from pipeline.core.events import EventLog, merge_events
from pipeline.core.memory import one_heap_arena
from pipeline.core.worker_names import DRIVER, REWARD_MODEL, actor_names, generator_index, generator_name
from pipeline.core.precision import cpu_bf16_flags, describe_cpu
from pipeline.run.metrics import MetricSinks, Progress, RunTotals, step_metrics
from pipeline.run.placement import place
from pipeline.run.resources import ResourceProbe
from pipeline.run.pool import begin_run, end_run, replace_generator, start_workers, stop_workers
from pipeline.run.runner import GraphRunner, PipelineError, WorkerDied
from pipeline.run.trace import write_trace


def validation_due(step: int, cfg: Config) -> bool:
    """NeMo-RL's meaning: after step s when (s + 1) % validation.period == 0, and after the last one if validation.at_end."""
    v = cfg.validation
    return (v.period > 0 and (step + 1) % v.period == 0) or (v.at_end and step == cfg.run.steps - 1)


def graph_actor_count(cfg: Config) -> int:
    """The run's actors: those of the step graph, and the reward model of the delivery graph."""
    return (1 + cfg.training.ranks + cfg.generation.num_generators + cfg.critic_actors
            + (1 if cfg.reward_model.kind else 0))


def resolve_dag_mode(cfg: Config, cores: float) -> str:
    """auto picks compiled graphs only where each graph actor and the driver own
    two cores: one to work, one for the compiled channel's busy-wait. Measured
    on 2 cores (benchmarks/results/overhead.json): compiled saves 12-18 ms of
    dispatch per step, but with sleeping workers it used 3.2x classic's CPU and
    with busy workers it was the slowest mode."""
    if cfg.run.dag_mode != "auto":
        return cfg.run.dag_mode
    return "compiled" if cores >= 2 * (graph_actor_count(cfg) + 1) else "classic"


def _cores(joined_cluster: bool) -> float:
    """Real cores: a local Ray is started with more logical CPUs than the machine has."""
    if joined_cluster:
        return ray.cluster_resources().get("CPU", 1)
    return len(os.sched_getaffinity(0))


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


FREE_OBJECTS_PERIOD_MS = 100


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
    # A released object waits in the raylet's free cache until its next flush (1 s by
    # default): with sub-second steps two released weight copies would still sit in the
    # store beside the two held (DESIGN.md, invariant 7). A cluster's own raylets take
    # RAY_free_objects_period_milliseconds at `ray start` (docs/clusters.md).
    # address "local": without it Ray joins a `ray start` cluster it finds on this machine
    # (/tmp/ray/ray_current_cluster), and then refuses num_cpus with an error about neither.
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             _system_config={"free_objects_period_milliseconds": FREE_OBJECTS_PERIOD_MS})
    return True


def step_graph_for(cfg: Config, workers: Workers) -> StepGraph:
    """The recipe's step graph: its train sub-graph, weight sync and top-up rounds."""
    return build_step_graph(workers, TRAIN_SUBGRAPHS[cfg.train_graph],
                            collective=cfg.generation.weight_sync == "collective",
                            top_up_rounds=cfg.dynamic_sampling.max_rounds)


class Execution:
    """The run's workers and the graph runners over them. A replaced generator
    is a new actor handle, so the graphs are rebuilt around it."""

    def __init__(self, cfg: Config, workers: Workers, mode: str, run_dir: Path, t0: float, log: EventLog,
                 step_runner: GraphRunner | None, say=print):
        self.cfg, self.workers, self.mode, self.run_dir, self.t0, self.log = cfg, workers, mode, run_dir, t0, log
        self.say = say
        self.incarnations: dict[int, int] = {}
        self.step_runner = step_runner
        self._build(new_step_runner=step_runner is None)

    def _build(self, new_step_runner: bool = True) -> None:
        actors = actor_names(self.workers, self.incarnations)
        graph = step_graph_for(self.cfg, self.workers)
        # The node whose TrainOut the ordering sub-graph takes: train (critic-free, one rank) or train_done.
        self.trained_node = graph.node_names[graph.node_names.index("validation_gate") - 1]
        if new_step_runner:
            if self.step_runner is not None:
                self.step_runner.close()
            self.step_runner = GraphRunner(graph, self.mode, self.cfg.run.startup_deadline_s, actors)
        self.step_runner.actors = actors
        self.finish_runner = GraphRunner(build_finish_graph(self.workers), "classic", self.cfg.run.deadline_s, actors)
        self.prologue_runner = GraphRunner(build_prologue_graph(self.workers), "classic",
                                           self.cfg.run.deadline_s, actors)

    def _absorb(self, out: dict) -> dict:
        """The driver has seen what these tokens carry: what it runs next is after it."""
        self.log.merge(*(getattr(token, "clock", ()) for token in out.values()))
        return out

    def run(self, runner_name: str, plan: StepPlan) -> dict:
        """One execution of the prologue or the step graph, recovering from generator deaths."""
        while True:
            runner = getattr(self, runner_name)
            try:
                return self._absorb(runner.run(replace(plan, clock=self.log.now()), self.cfg.run.deadline_s,
                                               self.run_dir))
            except WorkerDied as died:
                index = generator_index(died.worker, len(self.workers.generators), self.incarnations)
                collective = self.cfg.generation.weight_sync == "collective"
                if index is None or runner.mode == "compiled" or collective:
                    why = (f"Ray restarted it up to fault.max_restarts ({self.cfg.fault.max_restarts}) times"
                           if died.worker.startswith(REWARD_MODEL) else
                           "the run cannot go on without it" if index is None
                           else "generator restarts need run.dag_mode classic" if runner.mode == "compiled"
                           else "generator restarts need generation.weight_sync object_store (a collective "
                                "sync's process group cannot take a new member)")
                    raise PipelineError(f"{died}; {why}. Resume from the last complete checkpoint "
                                        f"with --resume {self.run_dir}") from None
                # A sample waiting for the dead generator's batches would wait out its deadline.
                ray.get(self.workers.controller.interrupt.remote(str(died)), timeout=self.cfg.run.deadline_s)
                done = self._absorb(runner.settle(self.cfg.run.deadline_s))
                self.say(f"dagrl: step {died.step}: generator {died.worker} died ({died.detail}); "
                         f"starting restart {self.incarnations.get(index, 0) + 1} of {self.cfg.fault.max_restarts}")
                self.workers, relaunched = replace_generator(self.workers, index, died, self.incarnations,
                                                             self.cfg, self.run_dir, self.t0, self.log)
                self.say(f"dagrl: step {died.step}: {generator_name(index, self.incarnations[index])} replaced "
                         f"{died.worker} and relaunched {len(relaunched)} unfinished batches "
                         f"{list(relaunched)}; the step goes on")
                ray.get(self.workers.controller.clear_interrupt.remote(), timeout=self.cfg.run.deadline_s)
                self._build()
            # What the interrupted execution finished decides what is left to run.
            if "resume" in done:
                return done
            trained = done.get(self.trained_node) if runner_name == "step_runner" else None
            if trained is not None:
                return {**done, **self.run_finish(plan, trained)}

    def run_finish(self, plan: StepPlan, trained: TrainOut) -> dict:
        try:
            return self._absorb(self.finish_runner.run((replace(plan, clock=self.log.now()), trained),
                                                       self.cfg.run.deadline_s, self.run_dir))
        except WorkerDied as died:
            raise PipelineError(f"{died} while recovering from an earlier death; resume with "
                                f"--resume {self.run_dir}") from None

    def close(self, external_runner: GraphRunner | None, failed: bool) -> None:
        if self.step_runner is not None and (self.step_runner is not external_runner or failed):
            self.step_runner.close()


def train(cfg: Config, *, restore_from: str | None = None, quiet: bool = False) -> dict:
    """Run a whole training job on workers of its own; returns the summary (also
    written to summary.json). `restore_from`: a run directory to continue from
    its latest complete checkpoint (the CLI's --resume)."""
    return _train(cfg, None, None, restore_from, quiet)


def train_on(cfg: Config, workers: Workers, *, step_runner: GraphRunner | None = None,
             restore_from: str | None = None, quiet: bool = False) -> dict:
    """`train` on actors the caller holds and keeps (start_workers): one pool
    serves many short runs, as sweeps and benchmarks do. `step_runner`: the
    caller's runner over those actors, kept across runs (a compiled graph
    compiles once) or wired differently (the tests' mutated graphs). The
    caller closes the runner and stops the workers."""
    return _train(cfg, workers, step_runner, restore_from, quiet)


def _train(cfg: Config, workers: Workers | None, step_runner: GraphRunner | None, restore_from: str | None,
           quiet: bool) -> dict:
    say = (lambda *a, **k: None) if quiet else print
    # Before Ray's and the preflight's threads first allocate: one heap for them all.
    one_heap_arena()
    if cfg.backend == "sim":
        # First, before anything else: a recipe meant to train a model must not look like it did.
        say("dagrl: simulated workers (backend: sim): no model is trained", flush=True)
    else:
        # Detected, never assumed: bf16 is twice as fast where the CPU has the units, slower where not.
        say(describe_cpu(cfg.training.dtype, cpu_bf16_flags()), flush=True)
    entered = time.time()
    model_check = preflight(cfg)
    startup = {"preflight_s": time.time() - entered}
    # Ray starts while the model check imports transformers; neither needs the other.
    started_ray = _start_ray(cfg)
    startup["ray_init_s"] = time.time() - entered - startup["preflight_s"]
    placement = None
    fitted: dict = {}  # the datasets as the run uses them (real backend): data.filter_overlong
    try:
        if model_check is not None:
            waited = time.time()
            fitted = model_check.result()
            startup["model_check_wait_s"] = time.time() - waited
            for kind, data in fitted.items():
                if data.filtered:
                    say(f"dagrl: {data.note(f'data.{kind}')}")
        # Refuses a recipe the cluster cannot hold before any actor or run directory exists.
        placement = place(cfg, cfg.run.startup_deadline_s) if workers is None else None
        ckpt, start = None, 0
        if restore_from is not None:
            run_dir = Path(restore_from)
            ckpt = checkpoint.latest(run_dir)
            start = checkpoint.read_meta(ckpt, cfg)
            kept = checkpoint.archive_attempt(run_dir, start)
            say(f"dagrl: resuming {run_dir} from {ckpt.name} (step {start}); "
                f"the earlier attempt's logs are in {kept}")
        else:
            run_dir = _prepare_run_dir(cfg, say)
        sinks = MetricSinks(run_dir, cfg, start)
    except BaseException:
        # Bad input, or a sink that cannot open (W&B missing): leave nothing running.
        if placement is not None:
            placement.remove()
        if started_ray:
            ray.shutdown()
        raise
    progress = Progress(cfg.run.steps, start, enabled=not quiet and cfg.metrics.progress)
    t0 = time.time()
    log = EventLog(run_dir, DRIVER, t0)
    # Epoch seconds, so that a benchmark can relate the event log's `t` to its own clock.
    summary: dict = {"steps": start, "start_step": start, "error": None, "train_entered_at": entered, "t0": t0}
    if fitted:
        summary["filtered_overlong"] = {kind: fitted[kind].filtered if kind in fitted else 0
                                        for kind in ("train", "val")}
    totals = RunTotals()
    own_workers = workers is None
    execution = None
    try:
        if own_workers:
            workers = start_workers(cfg.generation.num_generators, trainers=cfg.training.ranks,
                                    critics=cfg.critic_actors,
                                    placement=placement)
        workers = begin_run(workers, cfg, run_dir, t0, start, ckpt, log,
                            list(fitted["train"].prompts) if fitted else None)
        startup["workers_s"] = time.time() - t0
        mode = summary["dag_mode"] = resolve_dag_mode(cfg, _cores(joined_cluster=bool(_ray_address(cfg))))
        if step_runner is not None and step_runner.mode != mode:
            raise ValueError(f"step_runner is {step_runner.mode} but run.dag_mode resolves to {mode}")
        say(f"dagrl: {cfg.algorithm} backend={cfg.backend} dag_mode={mode} steps={cfg.run.steps} "
            f"max_age={cfg.schedule.max_age} generators={cfg.generation.num_generators} run_dir={run_dir}")
        log.emit("run_start", max_age=cfg.schedule.max_age, steps=cfg.run.steps, start_step=start, dag_mode=mode,
                 refit_mode=cfg.generation.refit_mode, algorithm=cfg.algorithm,
                 top_up_rounds=cfg.dynamic_sampling.max_rounds, reward_model=cfg.reward_model.kind or None,
                 env_max_turns=cfg.env.max_turns if cfg.env.class_ else None)
        execution = Execution(cfg, workers, mode, run_dir, t0, log, step_runner, say)
        prologue = execution.run("prologue_runner", StepPlan(start - 1, cfg.validation.at_start and start == 0))
        startup["to_first_step_s"] = time.time() - entered
        summary["startup"] = {k: round(v, 3) for k, v in startup.items()}
        log.emit("startup", **summary["startup"])
        if prologue["resume"].val_scores:
            sinks.write({"step": start - 1, **dict(prologue["resume"].val_scores)})
        probe = ResourceProbe(cfg.run.deadline_s)
        summary["resources_peak"] = probe.peak
        for step in range(start, cfg.run.steps):
            started = time.time()
            probe.start(execution.step_runner.actors)
            out = execution.run("step_runner", StepPlan(step, validation_due(step, cfg)))
            metrics = {**step_metrics(step, time.time() - started, out), **probe.read()}
            # The train token holds this step's weights; kept through the next step, it would
            # keep a copy alive in the object store beside the next one (invariant 7).
            del out
            sinks.write(metrics)
            progress.update(metrics)
            for line in console_warnings(step, metrics, cfg.fault.max_nonfinite_steps):
                say(line)
            totals.add(metrics)
            summary["steps"] = step + 1
            every = cfg.run.checkpoint_every
            if step == cfg.run.steps - 1 or (every and (step + 1) % every == 0):
                summary["checkpoint"] = str(checkpoint.save(execution.workers, run_dir, step + 1, cfg,
                                                            cfg.run.startup_deadline_s))
        summary["accounting"] = ray.get(execution.workers.controller.finish.remote(log.now()),
                                        timeout=cfg.run.deadline_s)
        if execution.workers.reward_model is not None:
            # After the last batch it scored: its weights' digest again, for invariant 9.
            log.merge(ray.get(execution.workers.reward_model.finish.remote(log.now()),
                              timeout=cfg.run.startup_deadline_s))
        summary["generator_restarts"] = dict(sorted((generator_name(i), n) for i, n in execution.incarnations.items()))
    except BaseException as exc:
        summary["error"] = str(exc) if isinstance(exc, PipelineError) else f"{type(exc).__name__}: {exc}"
        raise
    finally:
        failed = summary["error"] is not None
        if execution is not None:
            workers = execution.workers
        if own_workers and workers is not None and failed:
            stop_workers(workers)  # before teardown: a stuck actor would hold a compiled teardown up
        if execution is not None:
            execution.close(step_runner, failed)
        if own_workers and workers is not None and not failed:
            stop_workers(workers)
        elif workers is not None:
            end_run(workers)
        if own_workers and workers is None and placement is not None:
            placement.remove()  # the actors never started
        progress.close()
        sinks.close()
        log.emit("run_end", error=summary["error"])
        log.close()
        if started_ray:
            ray.shutdown()
        merge_events(run_dir)
        write_trace(run_dir)
        _write_summary(run_dir, summary, t0, totals, cfg)
    say(f"done: {summary['steps']} steps in {summary['wall_s']:.0f} s (start-up included); "
        f"reward {summary['reward_start']:.3f} -> {summary['reward_end']:.3f} (mean of first/last 3 steps); "
        f"step time {summary['step_time_mean_s']:.2f} s; {summary['generated_tokens_per_s']:.0f} generated tokens/s; "
        f"files in {run_dir}")
    return summary


def _write_summary(run_dir: Path, summary: dict, t0: float, totals: RunTotals, cfg: Config) -> None:
    summary.update({
        "wall_s": round(time.time() - t0, 3),
        **totals.summary(),
        "backend": cfg.backend,
        "simulated": cfg.backend == "sim",  # no model was trained: the console's first line said so too
        "generation_backend": "sim" if cfg.backend == "sim" else "vllm",
        "training_backend": "sim" if cfg.backend == "sim" else "deepspeed",
        "cpu_bf16": list(cpu_bf16_flags()),  # the driver's machine
        "training_dtype": _trained_dtype(run_dir),
        # Ray restarts a dead reward model in place; each incarnation logged on its own.
        "reward_model_restarts": max(len(list((run_dir / "events").glob(f"{REWARD_MODEL}*.jsonl"))) - 1, 0),
    })
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def _trained_dtype(run_dir: Path) -> str | None:
    """training.dtype as trainer rank 0 resolved it on its device (its worker_ready event); None on sim."""
    logs = sorted((run_dir / "events").glob("trainer*.jsonl"))
    if not logs:
        return None
    with open(logs[0]) as f:
        for line in f:
            event = json.loads(line)
            if event.get("ev") == "worker_ready":
                return event.get("dtype")
    return None
