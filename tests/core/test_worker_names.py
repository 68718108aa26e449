"""pipeline/core/worker_names.py: the names the event logs, the checker and the
driver's restarts share; old runs' logs carry the same names."""
from __future__ import annotations

import pytest

from dags.step_graph import Workers
from pipeline.core.worker_names import (
    CRITIC,
    TRAINER,
    actor_names,
    first_rank_names,
    generator_index,
    generator_name,
    rank_name,
    reward_model_name,
)

pytestmark = pytest.mark.unit


def test_the_names_of_every_kind_of_worker():
    assert [rank_name(TRAINER, 0, 1), rank_name(TRAINER, 1, 2), rank_name(CRITIC, 0, 1)] == \
        ["trainer", "trainer1", "critic"]
    assert [generator_name(0), generator_name(2, 1)] == ["gen0", "gen2_r1"]
    assert [reward_model_name(), reward_model_name(2)] == ["reward_model", "reward_model_r2"]
    assert first_rank_names(TRAINER) == ("trainer", "trainer0")


def test_actor_names_follow_each_generators_incarnation():
    workers = Workers("c", ("t0", "t1"), ("g0", "g1"), ("k",), reward_model="rm")
    assert actor_names(workers, {1: 2}) == {"controller": "c", "trainer0": "t0", "trainer1": "t1", "gen0": "g0",
                                            "gen1_r2": "g1", "critic": "k", "reward_model": "rm"}
    assert generator_index("gen1_r2", 2, {1: 2}) == 1
    assert generator_index("gen1", 2, {1: 2}) is None   # the dead predecessor is no generator of the run
    assert generator_index("trainer0", 2, {}) is None
