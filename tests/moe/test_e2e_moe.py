"""examples/tiny_moe_grpo.yaml end to end on the real CPU stack: routing
replay through the actors (the routes ride each rollout to the controller's
buffer and on to the trainer, which reports route_flips every step), clean
events, and a resume from a checkpoint whose buffer holds routed batches goes
on exactly as the first run went; with two data-parallel ranks each replays
the routes of its shard; a multi-turn episode and an agent's session replay
their requests' routes, stitched (pipeline/core/stitched_routes.py)."""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline.config import load_config
from pipeline.core.events import load_events
from pipeline.run.driver import train
from pipeline.tools.check import check_events

pytestmark = pytest.mark.real

STEPS, RESUME_AT = 6, 4


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from pipeline.inputs.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_moe", architecture="qwen3_moe")


def metrics(run_dir) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines) if m["step"] >= 0}


def test_the_moe_recipe_replays_routes_through_the_run_and_a_resume(tmp_path, ray_session, tiny_moe):
    overrides = [f"model.path={tiny_moe}", f"run.output_dir={tmp_path}", "run.name=moe", f"run.steps={STEPS}",
                 f"run.checkpoint_every={RESUME_AT}", "run.dag_mode=classic", "validation.period=0",
                 "validation.at_end=false"]
    summary = train(load_config("examples/tiny_moe_grpo.yaml", overrides), quiet=True)
    run_dir = tmp_path / "moe"
    assert summary["error"] is None and summary["steps"] == STEPS, summary
    assert check_events(load_events(run_dir)) == []
    first = metrics(run_dir)
    # Step 0 trains on batches of the initial weights (age 0): the engine's function exactly. Later
    # batches are one update old, and the trainer's routers would route many of their tokens elsewhere.
    assert first[0]["is_weight"] == pytest.approx(1.0, abs=1e-5) and first[0]["route_flips"] == 0
    assert all(0.05 < first[s]["route_flips"] <= 1 for s in range(1, STEPS)), first

    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS}", ignore_errors=True)
    summary = train(load_config("examples/tiny_moe_grpo.yaml", overrides), quiet=True, restore_from=str(run_dir))
    assert summary["error"] is None
    resumed = metrics(run_dir)
    for key in ("reward_mean", "route_flips", "loss"):
        assert [resumed[s][key] for s in range(RESUME_AT, STEPS)] == [first[s][key] for s in range(RESUME_AT, STEPS)]
    assert check_events(load_events(run_dir)) == []


def test_data_parallel_ranks_replay_their_shards_routes(tmp_path, ray_session, tiny_moe):
    overrides = [f"model.path={tiny_moe}", f"run.output_dir={tmp_path}", "run.name=dp", "run.steps=3",
                 "run.checkpoint_every=0", "run.dag_mode=classic", "validation.period=0", "validation.at_end=false",
                 "training.ranks=2"]
    summary = train(load_config("examples/tiny_moe_grpo.yaml", overrides), quiet=True)
    assert summary["error"] is None and summary["steps"] == 3, summary
    assert check_events(load_events(tmp_path / "dp")) == []
    steps = metrics(tmp_path / "dp")
    assert steps[0]["is_weight"] == pytest.approx(1.0, abs=1e-5) and steps[0]["route_flips"] == 0
    assert all(steps[s]["route_flips"] > 0.05 for s in (1, 2)), steps


def test_multi_turn_episodes_replay_their_turns_routes(tmp_path, ray_session, tiny_moe):
    """Two-turn episodes: each row's routes cover its prompt, both turns and the observation
    between them (a row of another length fails the trainer's forward), age 0 is the
    engine's function, and one update later the trainer's own routers would differ."""
    overrides = [f"model.path={tiny_moe}", f"run.output_dir={tmp_path}", "run.name=game", "run.steps=3",
                 "run.checkpoint_every=0", "run.dag_mode=classic", "validation.period=0", "validation.at_end=false",
                 "data.val=", "data.reward=", "env.class=tests.support.two_turn_env:TwoTurnEnv", "env.max_turns=2"]
    summary = train(load_config("examples/tiny_moe_grpo.yaml", overrides), quiet=True)
    assert summary["error"] is None and summary["steps"] == 3, summary
    assert check_events(load_events(tmp_path / "game")) == []
    steps = metrics(tmp_path / "game")
    samples = [json.loads(line) for line in (tmp_path / "game" / "samples.jsonl").read_text().splitlines()]
    turns = [sum(t["role"] == "model" for t in c["turns"]) for s in samples for c in s["completions"]]
    assert max(turns) == 2, turns
    assert steps[0]["is_weight"] == pytest.approx(1.0, abs=1e-5) and steps[0]["route_flips"] == 0
    assert all(steps[s]["route_flips"] > 0.05 for s in (1, 2)), steps


def test_an_agents_requests_replay_their_routes(tmp_path, ray_session, tmp_path_factory):
    """An agent on the OpenAI SDK makes two requests through the gateway, the second
    repeating the first's answer: the session's row replays both requests' routes."""
    from pipeline.inputs.tiny import build_tiny_model
    model = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_moe_chat", architecture="qwen3_moe",
                             chat_template="plain")
    overrides = [f"model.path={model}", f"run.output_dir={tmp_path}", "run.name=agent", "run.steps=3",
                 "run.checkpoint_every=0", "run.dag_mode=classic", "validation.period=0", "validation.at_end=false",
                 "data.val=", "agent.function=tests.agents.agents_for_tests:two_turns", "generation.max_new_tokens=8"]
    summary = train(load_config("examples/tiny_moe_grpo.yaml", overrides), quiet=True)
    assert summary["error"] is None and summary["steps"] == 3, summary
    assert check_events(load_events(tmp_path / "agent")) == []
    steps = metrics(tmp_path / "agent")
    assert steps[0]["is_weight"] == pytest.approx(1.0, abs=1e-5) and steps[0]["route_flips"] == 0
    assert all(steps[s]["route_flips"] > 0.05 for s in (1, 2)), steps
