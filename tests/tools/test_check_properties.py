"""The event-log checker on generated logs (tests/support/hand_logs.py): every valid
log passes, losing any trained batch is caught, and skewing one worker's
clock never moves a verdict."""
from __future__ import annotations

import random

from tests.support.hand_logs import log
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.tools.check import check_events
import pytest

pytestmark = pytest.mark.unit

run_params = st.integers(1, 8).flatmap(lambda steps: st.fixed_dictionaries({
    "steps": st.just(steps),
    "max_age": st.integers(0, 3),
    "generators": st.integers(1, 3).map(lambda n: tuple(f"gen{i}" for i in range(n))),
    "validate": st.sets(st.integers(0, steps - 1)),
    "start_step": st.integers(0, steps - 1),
    "groups": st.integers(1, 2),
    "finished": st.booleans(),
}))


@settings(max_examples=150, deadline=None)
@given(run_params)
def test_any_generated_log_is_valid(kw):
    assert check_events(log(**kw)) == []


@settings(max_examples=100, deadline=None)
@given(run_params, st.randoms(use_true_random=False))
def test_losing_any_trained_batch_is_caught(kw, rnd: random.Random):
    events = log(**{**kw, "finished": True})
    starts = [e for e in events if e["ev"] == "train_start" and e["batches"]]
    ts = rnd.choice(starts)
    i = rnd.randrange(len(ts["batches"]))
    lost = ts["batches"][i]
    ts["batches"] = ts["batches"][:i] + ts["batches"][i + 1:]
    ts["batch_versions"] = ts["batch_versions"][:i] + ts["batch_versions"][i + 1:]
    vs_ = check_events(events)
    assert [v.invariant for v in vs_] == [4] and lost in vs_[0].message


@settings(max_examples=100, deadline=None)
@given(run_params, st.sampled_from([{}, {"drain": False}, {"resume_waits_for_validation": False},
                                    {"refit_waits_for_train": False}]),
       st.sampled_from(["driver", "controller", "trainer", "gen0", "gen1", "gen2"]), st.floats(-5.0, 5.0))
def test_no_skew_of_one_workers_clock_moves_the_verdict(kw, waits_left_out, worker, seconds):
    """Good logs and logs with a wait left out: shifting one worker's times
    changes the wall clock's notes, never the violations found."""
    events = log(**kw, **waits_left_out)
    skewed = [{**e, "t": e["t"] + seconds} if e["worker"] == worker else e for e in events]
    verdict = sorted((v.invariant, len(v.events)) for v in check_events(events))
    assert sorted((v.invariant, len(v.events)) for v in check_events(skewed)) == verdict
    if not waits_left_out:
        assert verdict == []
