"""Agent samples on the simulated engine (pipeline/agents/sessions.py): the tokens
of a session, segments, what an agent's return becomes, and its failures."""
from __future__ import annotations

import threading

import pytest

from benchmarks.agent_rig import AgentLoop, prompts, sim_engine

pytestmark = pytest.mark.sim

AGENTS = "tests.agents.agents_for_tests"


def test_a_session_keeps_the_sampled_tokens_and_renders_only_the_new_messages(tmp_path):
    with AgentLoop(tmp_path, f"{AGENTS}:two_turns", "schedule.group_size=2") as rig:
        completions = rig.roll(prompts(3))
        events = rig.events()
    engine = rig.engine
    delta = engine.encode_continuation("<user>and again\n<assistant>")
    for i, c in enumerate(completions):
        assert not c.error and c.turns == 2 and c.reward is None  # None: data.reward scores c.text
        model = [i for i, m in enumerate(c.loss_mask) if m]
        # Two model turns with the follow-up's rendering between them, masked out.
        n1 = next(e["tokens"] for e in events if e["ev"] == "agent_request_end" and e["request"] == 1
                  and e["sample"] == f"b0/{i}")
        assert list(c.loss_mask) == [1] * n1 + [0] * len(delta) + [1] * (len(c.response_ids) - n1 - len(delta))
        assert list(c.response_ids[n1:n1 + len(delta)]) == delta
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if not m)
        assert len(model) == len(c.response_ids) - len(delta)
        assert c.text.startswith("v0") and [t["role"] for t in c.transcript] == ["user", "model", "user", "model"]
    starts = [e for e in events if e["ev"] == "agent_request_start"]
    assert len(starts) == 12 and {e["segment"] for e in starts} == {1}
    assert all(e["rendered"] == len(delta) for e in starts if e["request"] == 2)


def test_a_rewritten_history_starts_a_new_segment_and_the_last_is_trained(tmp_path):
    with AgentLoop(tmp_path, f"{AGENTS}:rewrites_history", "schedule.group_size=2") as rig:
        completions = rig.roll(prompts(2))
        starts = rig.events("agent_request_start")
    assert [e["segment"] for e in starts if e["request"] == 2] == [2] * 4
    for c in completions:
        assert c.reward == 0.5 and c.turns == 2
        # The trained segment is the second request alone: its prompt is the rewritten history.
        assert rig.engine.decode(c.prompt_ids).startswith("<user>summary: v0")
        assert set(c.loss_mask) == {1}
        assert [t["role"] for t in c.transcript] == ["user", "model", "segment", "user", "model"]


def test_a_refit_during_a_later_segment_logs_its_positions_in_that_segment(tmp_path):
    """A refit that lands while a session is in its second segment names the
    segment (refit_end's `segments`) and counts that segment's tokens: the ones
    before are the old weights', the rest the new ones' (check_order reads them so)."""
    from tests.agents.agents_for_tests import WAITING_FOR_A_REFIT
    rolled: dict = {}

    def roll():
        try:
            rolled["completions"] = rig.roll(prompts(1))
        except Exception as exc:  # asserted on in the test's thread
            rolled["error"] = exc

    with AgentLoop(tmp_path, f"{AGENTS}:rewrites_then_waits", "algorithm=reinforce_pp",
                   "schedule.group_size=1") as rig:
        roller = threading.Thread(target=roll)
        roller.start()
        try:
            refitted = WAITING_FOR_A_REFIT.get(timeout=60)
            rig.loop.call("install", (lambda: None, 1, 1), 30, "the test's refit")
            refitted.set()
        finally:
            roller.join(60)
        assert "error" not in rolled and not roller.is_alive()
        refit, = rig.events("refit_end")
        second = next(e for e in rig.events("agent_request_end") if e["request"] == 2)
    completion, = rolled["completions"]
    assert refit["segments"] == {"b0": [2]} and refit["positions"] == {"b0": [second["tokens"]]}
    assert completion.segments == 2 and completion.versions[0] == 0 and completion.versions[-1] == 1
    assert sum(v < 1 for v in completion.versions) == second["tokens"]


def test_a_plain_def_agent_runs_on_a_thread_and_its_info_is_logged(tmp_path):
    with AgentLoop(tmp_path, f"{AGENTS}:plain_def", "schedule.group_size=2") as rig:
        completions = rig.roll(prompts(2))
        ends = rig.events("agent_end")
    assert [c.reward for c in completions] == [1.0] * 4
    assert all(e["info"]["chars"] >= 2 for e in ends)


def test_a_raising_or_nonfinite_agent_fails_only_its_sample(tmp_path):
    with AgentLoop(tmp_path, f"{AGENTS}:fails_on_odd_prompts", "algorithm=reinforce_pp", "schedule.group_size=1") as rig:
        completions = rig.roll(prompts(4))
    errors = [c.error for c in completions]
    assert errors[0] == errors[2] == ""
    assert "agent raised ValueError: agent bug on p1" in errors[1]
    assert "reward nan; a reward must be finite" in errors[3]
    assert [c.reward for c in completions] == [1.0, 0.0, 1.0, 0.0]


def test_an_agent_returning_none_without_a_scorer_is_a_sample_failure(tmp_path):
    with AgentLoop(tmp_path, f"{AGENTS}:two_turns", "algorithm=reinforce_pp", "schedule.group_size=1", scored=False) as rig:
        (c,) = rig.roll(prompts(1))
    assert "no data.reward or reward model" in c.error


def test_a_context_over_the_limit_is_a_400_and_the_sample_is_truncated(tmp_path):
    engine = sim_engine()
    engine.max_model_len = 200
    with AgentLoop(tmp_path, f"{AGENTS}:overlong", "algorithm=reinforce_pp", "schedule.group_size=1", engine=engine) as rig:
        (c,) = rig.roll(prompts(1))
        (end,) = rig.events("agent_end")
        (refused,) = rig.events("agent_request_refused")
    assert end["info"] == {"error": "BadRequestError", "code": "context_length_exceeded"}
    assert c.truncated and c.reward == 0.25 and c.turns == 1 and refused["reason"] == "context_length_exceeded"


def test_an_agent_past_its_timeout_fails_its_sample_and_its_session_closes(tmp_path):
    import httpx
    from tests.agents.agents_for_tests import OPEN_SESSIONS
    with AgentLoop(tmp_path, f"{AGENTS}:sleeps_past_its_timeout", "algorithm=reinforce_pp", "schedule.group_size=1",
                   "agent.timeout_s=1") as rig:
        (c,) = rig.roll(prompts(1))
        url, key = OPEN_SESSIONS.get(timeout=5)
        late = httpx.post(f"{url}chat/completions", headers={"Authorization": f"Bearer {key}"}, trust_env=False,
                          json={"model": "m", "messages": [{"role": "user", "content": "late"}]}, timeout=30)
    assert "agent outlived agent.timeout_s (1 s)" in c.error and c.turns == 1
    assert late.status_code == 404 and late.json()["error"]["code"] == "session_not_found"


def test_a_child_process_drives_its_session_over_plain_http(tmp_path):
    with AgentLoop(tmp_path, f"{AGENTS}:child_process", "algorithm=reinforce_pp", "schedule.group_size=1") as rig:
        (c,) = rig.roll(prompts(1))
        (end,) = rig.events("agent_end")
    assert not c.error and c.turns == 1 and end["info"]["content"] == c.text


def test_a_thousand_concurrent_sessions_on_one_generator(tmp_path):
    with AgentLoop(tmp_path, f"{AGENTS}:one_request", "schedule.group_size=4") as rig:
        completions = rig.roll(prompts(250), timeout_s=300)
    assert len(completions) == 1000
    assert [c.error for c in completions if c.error] == [] and all(c.reward == 1.0 for c in completions)


def test_the_key_is_drawn_per_gateway_and_written_nowhere(tmp_path):
    keys = []
    for run in ("a", "b"):
        with AgentLoop(tmp_path / run, f"{AGENTS}:plain_def", "schedule.group_size=2") as rig:
            rig.roll(prompts(2))
            keys.append(rig.serving.gateway.key)
    assert keys[0] != keys[1] and len(keys[0]) >= 32
    for path in (p for p in tmp_path.rglob("*") if p.is_file()):
        assert not any(key in path.read_text(errors="replace") for key in keys), path


def test_a_client_that_gives_up_on_a_request_leaves_the_loop_and_its_session_serving(tmp_path):
    engine = sim_engine(generate_s=2.0)  # a turn takes 2 s; the client waits 0.2
    with AgentLoop(tmp_path, f"{AGENTS}:gives_up_once", "algorithm=reinforce_pp", "schedule.group_size=1",
                   engine=engine) as rig:
        (c,) = rig.roll(prompts(1))
    assert not c.error and c.reward == 1.0 and c.turns == 2
