"""agent.* in a recipe: what is refused before any worker starts, naming the key."""
from __future__ import annotations

import pytest

from pipeline.agents.gateway import Gateway
from pipeline.config import ConfigError, load_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("overrides, needle", [
    (["agent.function=nomodule"], "agent.function: 'nomodule': expected 'module:function'"),
    (["agent.function=no_such_module_x:f"], "cannot import module 'no_such_module_x'"),
    (["agent.function=tests.agents.agents_for_tests:missing"], "has no attribute 'missing'"),
    (["agent.function=tests.agents.agents_for_tests:OPEN_SESSIONS"], "is a Queue, not a function"),
    (["agent.function=json:dumps"], None),
    (["agent.function=tests.agents.agents_for_tests:two_turns", "env.class=pipeline.sim.env:SimToolEnv"],
     "both drive the samples"),
    (["agent.tool_parser=pythonic"], "agent.tool_parser: 'pythonic' needs an agent"),
    (["agent.function=tests.agents.agents_for_tests:two_turns", "agent.tool_parser=pythonic"],
     "backend 'sim' has none"),
    (["agent.function=tests.agents.agents_for_tests:two_turns", "agent.timeout_s=0"], "agent.timeout_s"),
])
def test_bad_agent_settings_are_refused_naming_the_key(overrides, needle):
    if needle is None:  # json.dumps(obj, *, ...) takes one positional argument: not (client, prompt)
        needle = "cannot be called as dumps(client, prompt)"
    with pytest.raises(ConfigError, match="agent|env") as caught:
        load_config(None, overrides)
    assert needle in str(caught.value)


def test_a_gateway_whose_server_died_says_so_when_checked():
    gateway = Gateway("127.0.0.1", "m", 60)

    def crash(sockets):
        raise OSError("port gone")
    gateway._server.run = crash
    gateway.start(lambda session, request: None)
    gateway._thread.join(timeout=10)
    with pytest.raises(RuntimeError, match="stopped serving: OSError: port gone"):
        gateway.check()
    gateway.stop(5)
