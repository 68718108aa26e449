"""The reward model's place in the run, on simulated workers: every batch is
scored between its rollout and the buffer, by one actor whose dead process
Ray restarts (the unfinished score runs again), and whose death past
fault.max_restarts stops the run naming it."""
from __future__ import annotations

import json

import pytest

from pipeline.run.driver import train
from pipeline.run.runner import PipelineError
from tests.run.test_faults import sim_config, trained_batches
from tests.support.scorer_runs import checked_scorer_run

pytestmark = pytest.mark.sim


def run(tmp_path, name: str, **overrides):
    return checked_scorer_run(tmp_path, name, 6, **{"reward_model__kind": "classifier", **overrides})


def test_every_trained_batch_is_scored_and_its_score_is_the_reward(tmp_path, ray_session):
    summary, events = run(tmp_path, "rm", schedule__max_age=1)
    scored = {e["batch"] for e in events if e["ev"] == "score_end"}
    assert set(trained_batches(events)) <= scored
    assert summary["reward_model_restarts"] == 0 and summary["accounting"]["balanced"]
    # The simulated model scores sim_reward again, weight 1: the reward doubles.
    metrics = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["reward_mean"] > 0.4
    # The generators' rollout_ends leave the final rewards' flat groups to the model's score_end.
    assert all("flat_groups" not in e for e in events if e["ev"] == "rollout_end")
    digests = {e.get("weights") for e in events if e["ev"] in ("worker_ready", "weights_checked")
               and e["worker"].startswith("reward_model")}
    assert digests == {"sim"}


def test_a_dead_reward_model_is_restarted_and_its_batch_scored_again(tmp_path, ray_session):
    summary, events = run(tmp_path, "restart", inject__fault="score_exit", inject__after=3)
    assert summary["error"] is None and summary["reward_model_restarts"] == 1
    started = [e for e in events if e["ev"] == "worker_start" and e["worker"].startswith("reward_model")]
    assert [(e["worker"], e["incarnation"]) for e in started] == [("reward_model", 0), ("reward_model_r1", 1)]
    # The batch whose score died with the first process was scored by the second.
    unfinished = {e["batch"] for e in events if e["ev"] == "score_start" and e["worker"] == "reward_model"} - \
        {e["batch"] for e in events if e["ev"] == "score_end" and e["worker"] == "reward_model"}
    assert len(unfinished) == 1
    assert unfinished <= {e["batch"] for e in events if e["ev"] == "score_end" and e["worker"] == "reward_model_r1"}
    assert summary["accounting"]["balanced"] and summary["accounting"]["dropped"] == 0


def test_a_reward_model_dead_past_its_restarts_stops_the_run_by_name(tmp_path, ray_session):
    cfg = sim_config(tmp_path, "dead", run__steps=6, reward_model__kind="judge", inject__fault="score_exit",
                     inject__after=2, inject__incarnations=5, fault__max_restarts=1)
    with pytest.raises(PipelineError, match=r"(?s)worker reward_model died: .*Ray restarted it up to "
                                            r"fault.max_restarts \(1\) times\n(resume from|no checkpoint)"):
        train(cfg, quiet=True)
