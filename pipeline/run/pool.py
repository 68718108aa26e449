"""The actors of a run: start them, set them up for a run, replace a dead generator.

A replaced generator is a new actor (a new process): it loads the trainer's
current weights before anything else, then takes over its predecessor's
unfinished batches through the relaunch graph, with the same ids and prompts.

The driver's event log (`log`) merges the clock each call returns: the set-up,
the trainer's weights and the relaunch are then before the graphs it runs next.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import ray

from dags.step_graph import Workers, build_relaunch_graph
from dags.tokens import RelaunchPlan
from pipeline.controller.controller import Controller
from pipeline.trainer.critic_worker import CriticWorker
from pipeline.generator.worker import GeneratorWorker
from pipeline.trainer.worker import TrainerWorker
from pipeline.config import Config
from pipeline.inputs.models import ModelError
from pipeline.core.events import EventLog
from pipeline.core.memory import ONE_ARENA_ENV
from pipeline.core.node import rank_actor
from pipeline.core.worker_names import actor_names, generator_name
from pipeline.distill.worker import start_teacher
from pipeline.reward_model.worker import start_reward_model
from pipeline.run.runner import GraphRunner, PipelineError, WorkerDied, task_error


def _options(placement, role: str, index: int = 0) -> dict:
    """Ray options of one actor: its bundle in the run's placement group, or half a CPU."""
    return placement.options(role, index) if placement is not None else {"num_cpus": 0.5}


def _one_heap(options: dict) -> dict:
    """`options` with one C heap for all the actor's threads, set before its
    first allocation (pipeline/core/memory.py one_heap_arena)."""
    env = options.setdefault("runtime_env", {})
    env["env_vars"] = {**env.get("env_vars", {}), **ONE_ARENA_ENV}
    return options


def _generator(index: int, placement=None):
    return ray.remote(GeneratorWorker).options(**_one_heap(_options(placement, "generator", index)),
                                               max_concurrency=4).remote(index)


def start_workers(num_generators: int, critics: int = 0, trainers: int = 1, placement=None) -> Workers:
    """The actors of a run; `placement` (pipeline.run.placement.place) puts each
    in its bundle, else each asks half a CPU of wherever Ray puts it."""
    # Generators first: vLLM's import and engine start are the longest of any worker's.
    generators = tuple(_generator(i, placement) for i in range(num_generators))
    # Threaded actors: nodes of a step, the engine loops' puts and the driver's pings reach them concurrently.
    controller = ray.remote(Controller).options(**_one_heap(_options(placement, "controller")),
                                                max_concurrency=8).remote()
    ranks = tuple(_rank(TrainerWorker, placement, "trainer", r) for r in range(trainers))
    critic_ranks = tuple(_rank(CriticWorker, placement, "critic", r) for r in range(critics))
    return Workers(controller, ranks, generators, critic_ranks, placement)


def _rank(worker: type, placement, role: str, rank: int):
    """A trainer or critic rank (pipeline/core/node.py rank_actor). One heap: a
    step runs on one of Ray's threads, and malloc_trim leaves the top of a
    thread's own heap alone, so the heap cap's floor would hold whatever that
    top kept of the last step."""
    return rank_actor(worker, **_one_heap(_options(placement, role, rank))).remote(rank)


def stop_workers(workers: Workers) -> None:
    for actor in actor_names(workers).values():
        ray.kill(actor)
    if workers.placement is not None:
        workers.placement.remove()


def end_run(workers: Workers, deadline_s: float) -> None:
    """A run that ended well: each worker closes what its begin_run opened."""
    closing = [a.end_run.remote(deadline_s) for a in (workers.controller, *workers.trainers, *workers.critics,
                                                       *workers.generators)]
    try:
        ray.get(closing, timeout=deadline_s)
    finally:
        stop_per_run_actors(workers)


def stop_per_run_actors(workers: Workers) -> None:
    """What begin_run started for one run alone: the reward model and the teacher."""
    for actor in (workers.reward_model, workers.teacher):
        if actor is not None:
            ray.kill(actor, no_restart=True)


def begin_run(workers: Workers, cfg: Config, run_dir: Path, t0: float, start_step: int,
              ckpt: Path | None, log: EventLog, train_prompts: list | None = None) -> Workers:
    """Set up every worker for this run; a pool may hold more generators than it uses.
    `train_prompts`: the controller's prompts, as preflight fitted them (None: it reads data.train)."""
    used = workers.first(cfg.generation.num_generators)
    critics = cfg.critic_actors
    if (len(used.trainers), len(used.critics)) != (cfg.training.ranks, critics):
        raise ValueError(f"the pool has {len(used.trainers)} trainer and {len(used.critics)} critic ranks; the "
                         f"recipe asks {cfg.training.ranks} (training.ranks) and {critics} "
                         "(ppo.critic_ranks with algorithm ppo)")
    restore = (lambda part: str(ckpt / part)) if ckpt is not None else (lambda part: None)
    if cfg.reward_model.kind:
        # Per run: its model is the recipe's. It loads beside the other workers; generators only hold its handle.
        rm = start_reward_model(cfg, str(run_dir), t0, _options(used.placement, "reward_model"))
        used = replace(used, reward_model=rm)
    if cfg.distill.teacher:
        used = replace(used, teacher=start_teacher(cfg, str(run_dir), t0, _options(used.placement, "teacher")))
    try:
        setup = [used.controller.begin_run.remote(cfg, str(run_dir), t0, start_step, restore("controller"),
                                                  train_prompts),
                 *(t.begin_run.remote(cfg, str(run_dir), t0, restore("trainer_state"), start_step, meet)
                   for t, meet in zip(used.trainers, _meeting(used.trainers, cfg))),
                 *(c.begin_run.remote(cfg, str(run_dir), t0, restore("critic_state"), meet)
                   for c, meet in zip(used.critics, _meeting(used.critics, cfg))),
                 *(a.ready.remote() for a in (used.reward_model, used.teacher) if a is not None)]
        if ckpt is None:
            # A fresh run's generators start from the model directory, as the trainer does: all start at once.
            setup += [g.begin_run.remote(cfg, str(run_dir), t0, used.controller, 0, None, log.now(), used.reward_model,
                                         used.teacher)
                      for g in used.generators]
            log.merge(*_wait(setup, cfg))
        else:
            log.merge(*_wait(setup, cfg))
            [(_, weights, clock)] = _wait([used.trainers[0].current_weights.remote()], cfg)
            log.merge(clock)
            log.merge(*_wait([g.begin_run.remote(cfg, str(run_dir), t0, used.controller, 0, weights, log.now(),
                                                 used.reward_model, used.teacher)
                              for g in used.generators], cfg))
        if cfg.generation.weight_sync == "collective":
            _form_weight_sync(used, cfg)
    except BaseException:
        stop_per_run_actors(used)
        raise
    return used


def _form_weight_sync(used: Workers, cfg: Config) -> None:
    """Trainer rank 0 and every generator join one process group, rank 0's:
    NCCL when both sides have GPUs, else gloo."""
    r = cfg.resources
    backend = "nccl" if r.trainer.num_gpus > 0 and r.generator.num_gpus > 0 else "gloo"
    host, port = ray.get(used.trainers[0].weight_sync_address.remote(), timeout=cfg.run.startup_deadline_s)
    world = 1 + len(used.generators)
    _wait([used.trainers[0].join_weight_sync.remote(host, port, world, backend, cfg.run.deadline_s),
           *(g.join_weight_sync.remote(host, port, i + 1, world, backend, cfg.run.deadline_s)
             for i, g in enumerate(used.generators))], cfg)


def _meeting(ranks: tuple, cfg: Config) -> list:
    """Each rank's Rendezvous: rank 0's address; alone, a rank makes its own group (None)."""
    if len(ranks) <= 1:
        return [None] * len(ranks)
    meet = ray.get(ranks[0].rendezvous.remote(len(ranks), cfg.run.startup_deadline_s),
                   timeout=cfg.run.startup_deadline_s)
    return [meet] * len(ranks)


def _wait(calls: list, cfg: Config) -> list:
    """The calls' results: a begin_run returns its worker's clock (None: logs nothing)."""
    try:
        return [c or () for c in ray.get(calls, timeout=cfg.run.startup_deadline_s)]
    except ray.exceptions.GetTimeoutError:
        raise PipelineError(f"workers did not start within {cfg.run.startup_deadline_s:.0f} s "
                            "(run.startup_deadline_s)") from None
    except ray.exceptions.RayError as exc:
        if isinstance(getattr(exc, "cause", None), ModelError):
            # Bad input found by an engine at start-up (vLLM's probe): name the recipe key.
            raise ModelError(f"model.path: {exc.cause}") from None
        raise PipelineError(f"a worker failed to start: {task_error(exc)}") from None


def replace_generator(workers: Workers, index: int, died: WorkerDied, incarnations: dict[int, int],
                      cfg: Config, run_dir: Path, t0: float, log: EventLog) -> tuple[Workers, tuple[str, ...]]:
    """Start a new generator in place of a dead one, load the current weights,
    and relaunch the dead one's unfinished batches on it; returns the workers
    and the ids of the relaunched batches."""
    incarnation = incarnations.get(index, 0) + 1
    log.emit("generator_died", step=died.step, dead=died.worker, detail=died.detail, restart=incarnation)
    if incarnation > cfg.fault.max_restarts:
        raise PipelineError(f"{died}; restarts so far: {incarnation - 1}, and fault.max_restarts is "
                            f"{cfg.fault.max_restarts}")
    ray.kill(workers.generators[index])
    actor = _generator(index, workers.placement)  # into the dead one's bundle, now free
    version, weights, clock = ray.get(workers.trainers[0].current_weights.remote(), timeout=cfg.run.deadline_s)
    log.merge(clock)
    log.merge(*_wait([actor.begin_run.remote(cfg, str(run_dir), t0, workers.controller, incarnation, weights,
                                             log.now(), workers.reward_model, workers.teacher)], cfg))
    incarnations[index] = incarnation
    workers = workers.replace_generator(index, actor)
    relaunch = GraphRunner(build_relaunch_graph(workers, index), "classic", cfg.run.deadline_s,
                           actor_names(workers, incarnations))
    out = relaunch.run(RelaunchPlan(index, version, died.worker, log.now()), cfg.run.deadline_s, run_dir)
    log.merge(*(token.clock for token in out.values()))
    log.emit("generator_restarted", step=died.step, new=generator_name(index, incarnation), version=version)
    return workers, tuple(sorted(launch.batch_id for launch in out["relaunch"].launches))
