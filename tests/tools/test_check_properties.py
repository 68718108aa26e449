"""The event-log checker on generated logs (tests/support/hand_logs.py, with and
without agents): every valid log passes, losing any trained batch is caught,
and skewing one worker's clock never moves a verdict."""
from __future__ import annotations

import random
from unittest import mock

from tests.support.hand_logs import log
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.tools.check import check_events, check_report
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
    "agents": st.booleans(),
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


@pytest.mark.parametrize("seed", range(4))
def test_the_chains_find_every_pair_that_comparing_all_pairs_finds(seed):
    """The checker judges a rollout only against the validations and refits its
    chains leave as candidates (pipeline/tools/check_chain.py). On logs with a
    wait left out, one worker's clock skewed, events without clocks and a lost
    end, the report is the one of judging every pair. Seeded draws, not
    hypothesis: the skews that make wall-clock notes are a small share of its
    space and it met too few of them."""
    rnd = random.Random(seed)
    for _ in range(100):
        steps = rnd.randint(1, 8)
        events = log(steps=steps, max_age=rnd.randint(0, 3), generators=("gen0", "gen1", "gen2")[:rnd.randint(1, 3)],
                     validate={s for s in range(steps) if rnd.random() < 0.4} or {0}, groups=rnd.randint(1, 2),
                     start_step=rnd.randrange(steps), finished=rnd.random() < 0.5, agents=rnd.random() < 0.5,
                     **rnd.choice([{}, {"drain": False}, {"resume_waits_for_validation": False},
                                   {"refit_waits_for_train": False}]))
        worker, seconds = rnd.choice(["driver", "controller", "trainer", "gen0", "gen1"]), rnd.uniform(-5, 5)
        events = [{**e, "t": e["t"] + seconds} if e["worker"] == worker else e for e in events]
        for i in rnd.sample(range(len(events)), k=min(len(events), rnd.choice([0, 0, 1, 3]))):
            events[i] = {k: v for k, v in events[i].items() if k != "vc"}
        ends = [i for i, e in enumerate(events) if e["ev"] in ("refit_end", "validation_end", "rollout_end")]
        if ends and rnd.random() < 0.3:
            del events[rnd.choice(ends)]
        with mock.patch("pipeline.tools.check_chain.chain_of", return_value=None), \
                mock.patch("pipeline.tools.check_order.chain_of", return_value=None):
            every_pair = check_report(events)
        assert check_report(events) == every_pair
