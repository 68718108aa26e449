"""What an agent is, and how a recipe names one (agent.function).

    async def agent(client: openai.AsyncOpenAI, prompt: Prompt) -> float | dict | None
    def agent(client: openai.OpenAI, prompt: Prompt) -> float | dict | None

dagrl calls it once for every sample, with a client bound to that sample's
session on the generator's gateway (`client.base_url` and `client.api_key`
work from any HTTP client, a child process included). It returns the sample's
reward, a dict with "reward" and optionally "info" (logged with the sample),
or None: then data.reward or the reward model scores the last assistant
message. A coroutine function runs on the generator's agent event loop; a
plain function on a thread of its own (agent.threads of them at most).
"""
from __future__ import annotations

import inspect
from typing import Callable

from pipeline.core.specs import SpecError, resolve_spec


class AgentError(ValueError):
    """An agent.function that cannot be used; the message names the spec."""


def load_agent_function(spec: str) -> Callable:
    """Resolve "package.module:function" and check it takes (client, prompt); raises AgentError."""
    try:
        attr, function = resolve_spec(spec, "module:function", "pipeline.envs.calculator_agent:solve")
    except SpecError as exc:
        raise AgentError(f"{spec!r}: {exc}") from exc.__cause__
    if inspect.isclass(function) or not callable(function):
        raise AgentError(f"{spec!r}: {attr!r} is a {type(function).__name__}, not a function")
    try:
        inspect.signature(function).bind(None, None)
    except TypeError:
        raise AgentError(f"{spec!r}: {attr}{inspect.signature(function)} cannot be called as "
                         f"{attr}(client, prompt)") from None
    except ValueError:
        pass  # no signature to read (a builtin): the first sample will tell
    return function


def is_async(function: Callable) -> bool:
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None))
