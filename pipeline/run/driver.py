"""The driver: start the workers, build the step graph, run it once per step.

    find the start                       digest the data; --resume: the checkpoint, and what may change
    check the inputs, start Ray          bad input stops here, before any worker or run directory
    open the run directory               or reopen it at its latest complete checkpoint (--resume)
    start the workers
    prologue                             validate v0 if asked; launch the first max_age + 1 batches
    for step in steps: the step graph    StepPlan(step, sets due); a checkpoint every N steps
    finish                               account for every batch
    clean up                             whatever started, stopped in reverse order, error or not

A generator that dies is replaced and its batches relaunched
(pipeline/run/execution.py); any other dead worker stops the run with the
checkpoint to resume from.

The driver has a lane of the vector clock too (pipeline/core/events.py): each plan
it feeds a graph carries the driver's clock, and it merges every token a graph
returns, so each step is provably after everything the steps before it did.
"""
from __future__ import annotations

import json
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import ray

from dags.step_graph import Workers
from dags.tokens import StepPlan
from pipeline.config import Config
from pipeline.core.events import EventLog, merge_events
from pipeline.core.memory import one_heap_arena
from pipeline.core.worker_names import DRIVER, REWARD_MODEL, TEACHER, generator_name, logged_incarnations
from pipeline.core.precision import cpu_bf16_flags, describe_cpu
from pipeline.evaluation.sets import due_after, due_at_start
from pipeline.inputs.preflight import preflight
from pipeline.run import checkpoint
from pipeline.run.execution import Execution
from pipeline.run.metrics import MetricSinks, Progress, RunTotals, step_metrics, step_samples
from pipeline.run.placement import place
from pipeline.run.pool import begin_run, end_run, start_workers, stop_workers
from pipeline.run.resources import ResourceProbe
from pipeline.run.runner import GraphRunner, PipelineError
from pipeline.run.resume_check import data_digests
from pipeline.run.stopping import Stopped, StopNow, StopOnSignal, resume_command, resume_hint
from pipeline.run.startup import (prepare_run_dir, process_started_at, ray_address, real_cores, resolve_dag_mode,
                                  start_ray, write_config)
from pipeline.run.trace import write_trace
from pipeline.trainer.skipped_steps import console_warnings


def train(cfg: Config, *, restore_from: str | None = None, allow_change: frozenset[str] = frozenset(),
          quiet: bool = False) -> dict:
    """Run a whole training job on workers of its own; returns the summary (also
    written to summary.json). `restore_from`: a run directory to continue from
    its latest complete checkpoint (the CLI's --resume); `allow_change`: keys the
    resume may change although they change what the run trains on or with
    (--allow-change; pipeline/run/resume_check.py)."""
    with ExitStack() as cleanup:
        run = Run(cfg, cleanup, quiet)
        run.find_start(restore_from, allow_change)
        run.check_inputs_and_start_ray(own_workers=True)
        stop = run.stop_on_signals()
        run.open_run_dir()
        run.start_workers()
        run.prologue()
        for step in range(run.start_step, cfg.run.steps):
            if stop.requested:
                run.stop_on(stop.requested)
            run.step(step)
        run.finish()
    run.say_done()
    return run.summary


class Run:
    """One training run, in the parts `_train` names. Each part that starts
    something puts what stops it on `cleanup`, which runs them in reverse."""

    def __init__(self, cfg: Config, cleanup: ExitStack, quiet: bool):
        self.cfg, self.cleanup, self.quiet = cfg, cleanup, quiet
        self.say = (lambda *a, **k: None) if quiet else print
        self.startup: dict[str, float] = {}
        self.fitted: dict = {}  # the datasets as the run uses them (real backend): data.filter_overlong
        self.placement = None
        self.log: EventLog | None = None
        self.workers: Workers | None = None
        self.execution: Execution | None = None
        self.stop: StopOnSignal | None = None
        self.entered = time.time()
        # Last of all, after Ray is down: the run's files from every worker's events.
        cleanup.callback(self._write_run_files)

    def stop_on_signals(self) -> StopOnSignal:
        """SIGINT and SIGTERM ask for a clean stop from here on, the clean-up included:
        a second signal while the workers stop still stops at once, recorded as such.
        After ray.init, which puts a SIGTERM handler of its own in the driver."""
        self.stop = self.cleanup.enter_context(StopOnSignal(self.cfg.run.stop_grace_s, self.say))
        return self.stop

    def check_inputs_and_start_ray(self, own_workers: bool) -> None:
        cfg, say = self.cfg, self.say
        # Before Ray's and the preflight's threads first allocate: one heap for them all.
        one_heap_arena()
        if cfg.backend == "sim":
            # First, before anything else: a recipe meant to train a model must not look like it did.
            say("dagrl: simulated workers (backend: sim): no model is trained", flush=True)
        else:
            # Detected, never assumed: bf16 is twice as fast where the CPU has the units, slower where not.
            say(describe_cpu(cfg.training.dtype, cpu_bf16_flags()), flush=True)
        model_check = preflight(cfg)
        self.startup["preflight_s"] = time.time() - self.entered
        # Ray starts while the model check imports transformers; neither needs the other.
        stop_ray = start_ray(cfg)
        if stop_ray is not None:
            self.cleanup.callback(stop_ray)
        self.startup["ray_init_s"] = time.time() - self.entered - self.startup["preflight_s"]
        if model_check is not None:
            waited = time.time()
            try:
                self.fitted = model_check.result(timeout=cfg.run.startup_deadline_s)
            except TimeoutError:
                raise PipelineError(f"the model and data check did not finish within "
                                    f"{cfg.run.startup_deadline_s:.0f} s (run.startup_deadline_s)") from None
            self.startup["model_check_wait_s"] = time.time() - waited
            for kind, data in self.fitted.items():
                if data.filtered:
                    say(f"dagrl: {data.note(f'data.{kind}')}")
        if own_workers:
            # Refuses a recipe the cluster cannot hold before any actor or run directory exists.
            self.placement = place(cfg, cfg.run.startup_deadline_s)
            self.cleanup.callback(self._remove_placement_if_unused)

    def find_start(self, restore_from: str | None, allow_change: frozenset[str] = frozenset()) -> None:
        """Before Ray: a resume its checkpoint cannot continue is refused at no cost, its run directory untouched."""
        self.inputs = data_digests(self.cfg)
        self.ckpt, self.start_step, self.resume_changes = None, 0, []
        self.checkpointed = 0  # steps done at the newest checkpoint this attempt wrote
        if restore_from is not None:
            self.ckpt = checkpoint.latest(Path(restore_from))
            self.start_step, self.resume_changes = checkpoint.read_meta(self.ckpt, self.cfg, allow_change, self.inputs)

    def open_run_dir(self) -> None:
        cfg = self.cfg
        if self.ckpt is not None:
            self.run_dir = self.ckpt.parent.parent
            kept = checkpoint.archive_attempt(self.run_dir, self.start_step)
            write_config(self.run_dir, cfg)
            self.say(f"dagrl: resuming {self.run_dir} from {self.ckpt.name} (step {self.start_step}); "
                     f"the earlier attempt's logs and config are in {kept}")
            for change in self.resume_changes:
                self.say(f"dagrl: resuming with a change (--allow-change): {change}")
        else:
            self.run_dir = prepare_run_dir(cfg, self.say)
        self.sinks = MetricSinks(self.run_dir, cfg, self.start_step)
        self.progress = Progress(cfg.run.steps, self.start_step, enabled=not self.quiet and cfg.metrics.progress)
        self.t0 = time.time()
        self.log = EventLog(self.run_dir, DRIVER, self.t0)
        # Epoch seconds, so that a benchmark can relate the run's times to its own clock
        # (with the `startup` event, the event log's `t` too: benchmarks/harness.py).
        self.summary: dict = {"steps": self.start_step, "start_step": self.start_step, "error": None,
                              "train_entered_at": self.entered,
                              "resume_changes": [c.record() for c in self.resume_changes]}
        if self.fitted:
            self.summary["filtered_overlong"] = {kind: self.fitted[kind].filtered if kind in self.fitted else 0
                                                 for kind in ("train", "val")}
        self.totals = RunTotals()
        self.cleanup.callback(self._close_files)
        self.cleanup.push(self._note_error)

    def start_workers(self, workers: Workers | None = None, step_runner: GraphRunner | None = None) -> None:
        """`workers`, `step_runner`: a pool and its runner that the caller keeps
        across runs (tests/support/pooled_run.py); None: this run's own."""
        cfg = self.cfg
        self.own_workers, self.external_runner = workers is None, step_runner
        if self.own_workers:
            workers = start_workers(cfg.generation.num_generators, trainers=cfg.training.ranks,
                                    critics=cfg.critic_actors, placement=self.placement)
        self.workers = workers
        self.cleanup.push(self._stop_workers)
        self.workers = begin_run(workers, cfg, self.run_dir, self.t0, self.start_step, self.ckpt, self.log,
                                 list(self.fitted["train"].prompts) if self.fitted else None)
        self.startup["workers_s"] = time.time() - self.t0
        mode = self.summary["dag_mode"] = resolve_dag_mode(cfg, real_cores(joined_cluster=bool(ray_address(cfg))))
        if step_runner is not None and step_runner.mode != mode:
            raise ValueError(f"step_runner is {step_runner.mode} but run.dag_mode resolves to {mode}")
        self.say(f"dagrl: {cfg.algorithm} backend={cfg.backend} dag_mode={mode} steps={cfg.run.steps} "
                 f"max_age={cfg.schedule.max_age} generators={cfg.generation.num_generators} run_dir={self.run_dir}")
        self.log.emit("run_start", max_age=cfg.schedule.max_age, steps=cfg.run.steps, start_step=self.start_step,
                      dag_mode=mode, refit_mode=cfg.generation.refit_mode, algorithm=cfg.algorithm,
                      top_up_rounds=cfg.dynamic_sampling.max_rounds, reward_model=cfg.reward_model.kind or None,
                      teacher=cfg.distill.teacher or None,
                      env_max_turns=cfg.env.max_turns if cfg.env.class_ else None,
                      resume_changes=self.summary["resume_changes"])
        self.execution = Execution(cfg, self.workers, mode, self.run_dir, self.t0, self.log, step_runner, self.say)

    def prologue(self) -> None:
        cfg = self.cfg
        out = self.execution.prologue(StepPlan(self.start_step - 1, due_at_start(cfg, self.start_step)))
        self.startup["to_first_step_s"] = time.time() - self.entered
        self.summary["startup"] = {k: round(v, 3) for k, v in self.startup.items()}
        self.log.emit("startup", **self.summary["startup"])
        if out["resume"].val_scores:
            self.sinks.write({"step": self.start_step - 1, **dict(out["resume"].val_scores)})
        self.sinks.write_samples(step_samples(out))
        self.probe = ResourceProbe(cfg.run.deadline_s)
        self.summary["resources_peak"] = self.probe.peak

    def step(self, step: int) -> None:
        """One execution of the step graph. Its outputs go with this call: the train
        token holds this step's weights, and kept into the next step it would keep
        a copy alive in the object store beside the next one (invariant 7)."""
        cfg = self.cfg
        started = time.time()
        self.probe.start(self.execution.step_runner.actors)
        out = self.execution.step(StepPlan(step, due_after(step, cfg)))
        metrics = {**step_metrics(step, time.time() - started, out), **self.probe.read()}
        self.sinks.write(metrics)
        self.sinks.write_samples(step_samples(out))
        self.progress.update(metrics)
        for line in console_warnings(step, metrics, cfg.fault.max_nonfinite_steps):
            self.say(line)
        self.totals.add(metrics)
        self.summary["steps"] = step + 1
        every = cfg.run.checkpoint_every
        if step == cfg.run.steps - 1 or (every and (step + 1) % every == 0):
            self._checkpoint(step + 1)

    def _checkpoint(self, steps_done: int) -> None:
        cfg = self.cfg
        self.summary["checkpoint"] = str(checkpoint.save(self.execution.workers, self.run_dir, steps_done, cfg,
                                                         cfg.run.startup_deadline_s, inputs=self.inputs))
        self.checkpointed = steps_done

    def stop_on(self, signum: int) -> None:
        """A signal asked for a stop: the last finished step checkpointed, unless
        it is already, then Stopped with the command that resumes the run."""
        done = self.summary["steps"]
        if done > self.start_step and self.checkpointed != done:
            self._checkpoint(done)
        name = signal.Signals(signum).name
        if done == 0:
            raise Stopped(f"stopped by {name} before the first step; nothing to resume, start the run again", signum)
        raise Stopped(f"stopped by {name} after {done} of {self.cfg.run.steps} steps, checkpoint "
                      f"{self.summary['checkpoint']}; resume with: {resume_command(self.run_dir)}", signum)

    def finish(self) -> None:
        workers, log, cfg = self.execution.workers, self.log, self.cfg
        self.summary["accounting"] = ray.get(workers.controller.finish.remote(log.now()), timeout=cfg.run.deadline_s)
        for scorer in (workers.reward_model, workers.teacher):
            if scorer is not None:
                # After the last batch it scored: its weights' digest again, for invariants 9 and 10.
                log.merge(ray.get(scorer.finish.remote(log.now()), timeout=cfg.run.startup_deadline_s))
        self.summary["generator_restarts"] = dict(sorted((generator_name(i), n)
                                                         for i, n in self.execution.incarnations.items()))

    def say_done(self) -> None:
        s = self.summary
        resumed = f" (resumed at {s['start_step']})" if s["start_step"] else ""
        self.say(f"done: {s['steps']} steps{resumed} in {s['wall_s']:.0f} s since the process started; "
                 f"reward {s['reward_start']:.3f} -> {s['reward_end']:.3f} (mean of first/last 3 steps); "
                 f"step time {s['step_time_mean_s']:.2f} s; {s['generated_tokens_per_s']:.0f} generated tokens/s; "
                 f"files in {self.run_dir}")

    # -- clean-up, in the reverse order of the parts above ---------------------
    def _stop_workers(self, exc_type, exc, tb) -> bool:
        failed = exc is not None
        workers = self.execution.workers if self.execution is not None else self.workers
        if self.own_workers and failed:
            stop_workers(workers)  # before teardown: a stuck actor would hold a compiled teardown up
        try:
            if self.execution is not None:
                self.execution.close(self.external_runner, failed)
            if not failed:
                end_run(workers, self.cfg.run.deadline_s)
        finally:
            if self.own_workers and not failed:
                stop_workers(workers)  # whatever the closing above raised: no actor outlives its run
        return False

    def _note_error(self, exc_type, exc, tb) -> bool:
        """An error after the run directory exists: what to do next goes with it."""
        if exc is None:
            return False
        if self.stop is not None:
            exc = self.stop.reason(exc)
        if isinstance(exc, (Stopped, StopNow)):
            self.summary["stopped_by"] = exc.signal
        if not isinstance(exc, Stopped):
            exc.add_note(resume_hint(self.run_dir))
        said = str(exc) if isinstance(exc, (PipelineError, StopNow)) else f"{exc_type.__name__}: {exc}"
        self.summary["error"] = "; ".join([said, *getattr(exc, "__notes__", ())])
        return False

    def _close_files(self) -> None:
        self.progress.close()
        self.sinks.close()
        self.log.emit("run_end", error=self.summary["error"])
        self.log.close()

    def _remove_placement_if_unused(self) -> None:
        if self.workers is None:
            self.placement.remove()  # the actors never started; stop_workers removes it once they have

    def _write_run_files(self) -> None:
        if self.log is None:
            return  # stopped before the run directory had a log: bad input
        merge_events(self.run_dir)
        write_trace(self.run_dir)
        _write_summary(self.run_dir, self.summary, self.totals, self.cfg)


def _write_summary(run_dir: Path, summary: dict, totals: RunTotals, cfg: Config) -> None:
    started = process_started_at()
    summary.update({
        # By the user's clock: from the process's start, Ray's start and the imports included.
        "wall_s": round(time.time() - started, 3),
        "process_started_at": round(started, 3),
        **totals.summary(),
        "backend": cfg.backend,
        "simulated": cfg.backend == "sim",  # no model was trained: the console's first line said so too
        "generation_backend": "sim" if cfg.backend == "sim" else "vllm",
        "training_backend": "sim" if cfg.backend == "sim" else "deepspeed",
        "cpu_bf16": list(cpu_bf16_flags()),  # the driver's machine
        "training_dtype": _trained_dtype(run_dir),
        # Ray restarts a dead reward model in place; each incarnation logged on its own.
        "reward_model_restarts": max(logged_incarnations(run_dir, REWARD_MODEL) - 1, 0),
        "teacher_restarts": max(logged_incarnations(run_dir, TEACHER) - 1, 0),
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
