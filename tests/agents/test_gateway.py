"""The gateway over HTTP (pipeline/agents/gateway.py): a live session probed with
the openai SDK and with plain HTTP, every error in OpenAI's shape."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.agents.agents_for_tests import OPEN_SESSIONS
from benchmarks.agent_rig import AgentLoop, prompts

pytestmark = pytest.mark.sim


@pytest.fixture
def live_session(tmp_path):
    """(rig, base_url, key) of a session whose agent waits while the test probes it."""
    import threading
    with AgentLoop(tmp_path, "tests.agents.agents_for_tests:hands_its_session_to_the_test",
                   "algorithm=reinforce_pp", "schedule.group_size=1") as rig:
        result = {}
        roller = threading.Thread(target=lambda: result.update(c=rig.roll(prompts(1))))
        roller.start()
        url, key, loop, done = OPEN_SESSIONS.get(timeout=30)
        try:
            yield rig, url, key
        finally:
            loop.call_soon_threadsafe(done.set)
            roller.join(timeout=60)


def test_a_request_gets_an_openai_completion_with_logprobs_and_usage(live_session):
    rig, url, key = live_session
    client = openai.OpenAI(base_url=url, api_key=key, http_client=httpx.Client(trust_env=False), max_retries=0)
    answer = client.chat.completions.create(model="whatever", messages=[{"role": "user", "content": "hi"}],
                                            logprobs=True, max_tokens=3, temperature=0.7)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.startswith("v0")
    assert answer.usage.completion_tokens == len(choice.logprobs.content) <= 3
    assert answer.usage.prompt_tokens == len(rig.engine.encode_continuation("<user>hi\n<assistant>"))
    assert choice.finish_reason in ("stop", "length")
    assert [m.id for m in client.models.list().data] == ["sim"]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[0]"),
    ({"messages": []}, "messages"),
])
def test_a_bad_field_is_a_400_naming_it(live_session, body, param):
    _, url, key = live_session
    response = httpx.post(f"{url}chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                          trust_env=False, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param) and error["type"] == "invalid_request_error"


def test_malformed_json_no_key_a_wrong_key_and_an_unknown_session(live_session):
    _, url, key = live_session
    post = lambda target, **kw: httpx.post(target, trust_env=False, timeout=30, **kw)  # noqa: E731
    assert post(f"{url}chat/completions", content=b"{nope", headers={"Authorization": f"Bearer {key}"}) \
        .json()["error"]["code"] == "invalid_json"
    assert post(f"{url}chat/completions", json={"messages": []}).status_code == 401
    wrong = openai.OpenAI(base_url=url, api_key="not-the-key", http_client=httpx.Client(trust_env=False),
                          max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    unknown = openai.OpenAI(base_url=url.replace("/sessions/", "/sessions/x"), api_key=key,
                            http_client=httpx.Client(trust_env=False), max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        unknown.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert caught.value.code == "session_not_found"
    assert httpx.get(url.split("/sessions/")[0] + "/v1/models", trust_env=False).status_code == 404

