"""Every worker's name: in its event log's file name and `worker` field, its
clock lane, metrics and errors, and the checker's reading of them. One rule:
the role, its index where there are several, and `_r<k>` for the k-th
replacement of a worker that died.

    driver, controller                 one of each
    trainer, critic                    alone; trainer0, trainer1, ... with several ranks
    gen0, gen1, ...                    generators; gen0_r1 is gen0's first replacement
    reward_model, reward_model_r1      the reward model; _r1 after Ray's first restart
    teacher, teacher_r1                the distillation teacher; _r1 after Ray's first restart
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dags.step_graph import Workers

DRIVER = "driver"
CONTROLLER = "controller"
TRAINER = "trainer"
CRITIC = "critic"
GENERATOR = "gen"
REWARD_MODEL = "reward_model"
TEACHER = "teacher"


def rank_name(role: str, rank: int, ranks: int) -> str:
    """A data-parallel rank of `role` (TRAINER, CRITIC) among `ranks`."""
    return role if ranks == 1 else f"{role}{rank}"


def first_rank_names(role: str) -> tuple[str, str]:
    """Rank 0 of `role`, alone or among several: what a checker looks it up by."""
    return rank_name(role, 0, 1), rank_name(role, 0, 2)


def generator_name(index: int, incarnation: int = 0) -> str:
    """Generator `index`, or its `incarnation`-th replacement."""
    return f"{GENERATOR}{index}" + (f"_r{incarnation}" if incarnation else "")


def reward_model_name(incarnation: int = 0) -> str:
    return REWARD_MODEL + (f"_r{incarnation}" if incarnation else "")


def teacher_name(incarnation: int = 0) -> str:
    return TEACHER + (f"_r{incarnation}" if incarnation else "")


def logged_incarnations(run_dir: str | Path, role: str) -> int:
    """How many incarnations of a worker that Ray restarts in place (REWARD_MODEL,
    TEACHER) have started in the run so far: each logs to its own file."""
    return sum(1 for _ in (Path(run_dir) / "events").glob(f"{role}*.jsonl"))


def actor_names(workers: Workers, incarnations: dict[int, int] | None = None) -> dict[str, Any]:
    """The actors by the names their event logs use;
    `incarnations`: generator index -> how many times it was replaced."""
    incarnations = incarnations or {}
    return {CONTROLLER: workers.controller,
            **{rank_name(TRAINER, r, len(workers.trainers)): t for r, t in enumerate(workers.trainers)},
            **{generator_name(i, incarnations.get(i, 0)): g for i, g in enumerate(workers.generators)},
            **{rank_name(CRITIC, r, len(workers.critics)): c for r, c in enumerate(workers.critics)},
            **({reward_model_name(): workers.reward_model} if workers.reward_model is not None else {}),
            **({teacher_name(): workers.teacher} if workers.teacher is not None else {})}


def generator_index(name: str, generators: int, incarnations: dict[int, int]) -> int | None:
    """Which of `generators` generators the worker `name` is, or None for any other worker."""
    return next((i for i in range(generators) if generator_name(i, incarnations.get(i, 0)) == name), None)
