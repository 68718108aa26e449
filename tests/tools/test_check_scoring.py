"""Invariant 9 on hand-made events: a batch trained without the reward
model's score before it, a score not after the rollout, and weights that
changed are violations; a scored batch, a restored one and a run without a
reward model are not."""
from __future__ import annotations

import pytest

from pipeline.tools.check_scoring import batches_scored_before_training
from tests.support.hand_logs import add

pytestmark = pytest.mark.unit

RUN = {"t": 0.0, "ev": "run_start", "worker": "driver", "max_age": 1, "reward_model": "classifier",
       "lane": "driver", "vc": {"driver": 1}}


def log(score_after_rollout: bool = True, scored: bool = True, digests=("w1", "w1")) -> list[dict]:
    """gen0 rolls out t0.g0; the reward model scores it (after the rollout's end, the
    clock the delivery graph hands it); the controller puts it; the trainer trains."""
    events: list[dict] = [dict(RUN)]
    add(events, 1, "worker_ready", "reward_model", weights=digests[0])
    start = add(events, 2, "rollout_start", "gen0", lane="gen0/rollouts", batch="t0.g0", step=0, version=0)
    end = add(events, 3, "rollout_end", "gen0", lane="gen0/rollouts", after=(start,), batch="t0.g0", step=0,
              version=0)
    put_after = end
    if scored:
        ss = add(events, 4, "score_start", "reward_model", after=(end,) if score_after_rollout else (),
                 batch="t0.g0", step=0, version=0)
        put_after = add(events, 5, "score_end", "reward_model", after=(ss,), batch="t0.g0", step=0, version=0,
                        flat_groups=[])
    sample = add(events, 6, "node_end", "controller", lane="controller/sample", after=(put_after,), node="sample",
                 step=0)
    add(events, 7, "train_start", "trainer", after=(sample,), step=0, version=0, batches=["t0.g0"],
        batch_versions=[0])
    add(events, 8, "weights_checked", "reward_model", weights=digests[1], loaded=digests[0])
    return events


def test_a_batch_scored_between_its_rollout_and_training_passes():
    assert list(batches_scored_before_training(log(), RUN)) == []


def test_a_batch_trained_unscored_is_caught():
    found = list(batches_scored_before_training(log(scored=False), RUN))
    assert [v.invariant for v in found] == [9]
    assert "t0.g0 trained at step 0" in found[0].message and "not scored" in found[0].message


def test_a_score_the_clocks_do_not_put_after_the_rollout_is_caught():
    found = list(batches_scored_before_training(log(score_after_rollout=False), RUN))
    assert [v.invariant for v in found] == [9] and "not after the rollout's end" in found[0].message


def test_weights_that_changed_are_caught():
    found = list(batches_scored_before_training(log(digests=("w1", "w2")), RUN))
    assert [v.invariant for v in found] == [9] and "weights changed" in found[0].message


def test_a_restored_batch_and_a_run_without_a_reward_model_owe_no_score():
    events = log(scored=False)
    events.insert(1, {"t": 0.5, "ev": "restore", "worker": "controller", "batch": "t0.g0", "step": 0,
                      "lane": "controller", "vc": {"controller": 1}})
    assert list(batches_scored_before_training(events, RUN)) == []
    assert list(batches_scored_before_training(log(scored=False), {**RUN, "reward_model": None})) == []
