"""Invariant 8 on hand-made events: a trained flat group, and a launch round
beyond the bound, are violations; dropped flat groups are not."""
from __future__ import annotations

import pytest

from pipeline.tools.check_sampling import flat_groups_never_trained

pytestmark = pytest.mark.unit


def ev(kind: str, **fields) -> dict:
    return {"t": 0.0, "ev": kind, "worker": fields.pop("worker", "controller"), **fields}


RUN = ev("run_start", worker="driver", max_age=1, top_up_rounds=1)


def log(dropped: list[int], rounds: int = 1) -> list[dict]:
    return [ev("launch", worker="gen0", batch="t0.g0", target=0, step=0),
            ev("launch", worker="gen0", batch="t0.r1.g0", target=0, step=0, round=rounds),
            ev("rollout_end", worker="gen0", batch="t0.g0", step=0, flat_groups=[0, 2]),
            ev("rollout_end", worker="gen0", batch="t0.r1.g0", step=0, flat_groups=[]),
            *([ev("group_drop", step=0, batch="t0.g0", groups=dropped, reason="flat")] if dropped else []),
            # Two data-parallel ranks: one step, one use.
            ev("train_start", worker="trainer0", step=0, batches=["t0.g0", "t0.r1.g0"]),
            ev("train_start", worker="trainer1", step=0, batches=["t0.g0", "t0.r1.g0"])]


def test_dropped_flat_groups_pass():
    assert list(flat_groups_never_trained(log([0, 2]), RUN)) == []


def test_a_flat_group_trained_is_caught_once_per_step():
    found = list(flat_groups_never_trained(log([0]), RUN))
    assert [v.invariant for v in found] == [8]
    assert "step 0 trained flat groups [2] of batch t0.g0" in found[0].message


def test_a_round_beyond_the_bound_is_caught_and_no_rounds_means_no_flat_check():
    found = list(flat_groups_never_trained(log([0, 2], rounds=2), RUN))
    assert [v.invariant for v in found] == [8] and "round 2" in found[0].message
    off = {**RUN, "top_up_rounds": 0}
    # Without dynamic sampling flat groups train as they are, but no top-up round may happen.
    assert [v.invariant for v in flat_groups_never_trained(log([]), off)] == [8]
    assert list(flat_groups_never_trained(log([])[:1] + log([])[2:], off)) == []
