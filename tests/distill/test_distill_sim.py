"""The teacher's place in the run, on simulated workers: every batch gets the
teacher's logprobs between its rollout (and the reward model's score) and the
buffer, the trainer logs the reverse KL to it, a dead teacher is restarted by
Ray (the unfinished batch taught again), and check-events catches a generator
that puts its batches past the teacher (invariant 10)."""
from __future__ import annotations

import json

import pytest

from tests.run.test_faults import trained_batches
from tests.support.scorer_runs import checked_scorer_run

pytestmark = pytest.mark.sim


def run(tmp_path, name: str, **overrides):
    return checked_scorer_run(tmp_path, name, 5, **{"distill__teacher": "sim", **overrides})


def test_every_trained_batch_is_taught_after_its_score_and_the_kl_is_logged(tmp_path, ray_session):
    summary, events = run(tmp_path, "distill", reward_model__kind="classifier", schedule__max_age=1)
    taught = {e["batch"] for e in events if e["ev"] == "teach_end"}
    assert set(trained_batches(events)) <= taught
    assert summary["teacher_restarts"] == 0 and summary["accounting"]["balanced"]
    metrics = [json.loads(line) for line in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()]
    kls = [m["distill/kl"] for m in metrics if "distill/kl" in m]
    assert len(kls) == 5 and all(k != 0 for k in kls)
    names = {e["worker"] for e in events if e["ev"] == "worker_ready"}
    assert {"teacher", "reward_model"} <= names


def test_a_dead_teacher_is_restarted_and_its_batch_taught_again(tmp_path, ray_session):
    summary, events = run(tmp_path, "restart", inject__fault="teach_exit", inject__after=3)
    assert summary["error"] is None and summary["teacher_restarts"] == 1
    unfinished = {e["batch"] for e in events if e["ev"] == "teach_start" and e["worker"] == "teacher"} - \
        {e["batch"] for e in events if e["ev"] == "teach_end" and e["worker"] == "teacher"}
    assert len(unfinished) == 1
    assert unfinished <= {e["batch"] for e in events if e["ev"] == "teach_end" and e["worker"] == "teacher_r1"}
