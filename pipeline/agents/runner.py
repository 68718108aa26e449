"""Where agents run: the generator's process, or Ray actors beside it (agent.actors).

In the generator's process a coroutine agent runs on one event loop in a
thread of its own, so a thousand sessions are a thousand tasks, not threads;
a plain `def` agent runs on a daemon thread (agent.threads at most at once;
pipeline/envs/threads.py says why daemons). On actors (pipeline/agents/actors.py)
each actor does the same, and samples go to the actors in turn.

Each sample gets its own client, bound to its session, with its own
connection pool: an agent that closes its client closes nothing of another's.
The clients ignore proxy settings (trust_env off): the gateway is on this
node, and a proxy would see the run's key.

When a sample ends early (agent.timeout_s, an aborted rollout), its task is
cancelled; a thread cannot be, and its later requests get 404.
"""
from __future__ import annotations

import asyncio
import threading
import traceback
from concurrent.futures import Future
from typing import Any, Callable

import httpx
import openai

from pipeline.agents.contract import is_async, load_agent_function
from pipeline.core.types import Prompt
from pipeline.envs.threads import DaemonThreads


async def run_async_agent(function: Callable, base_url: str, api_key: str, timeout_s: float, prompt: Prompt,
                          app: Any = None) -> Any:
    """`app`: the gateway's ASGI app, when it lives in this process: the client's
    requests go to it directly instead of through a socket (the same handlers)."""
    transport = None if app is None else httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, trust_env=False, verify=False) as http:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s,
                                    http_client=http)
        return await function(client, prompt)


def run_agent(function: Callable, base_url: str, api_key: str, timeout_s: float, prompt: Prompt) -> Any:
    with httpx.Client(trust_env=False, verify=False) as http:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s,
                               http_client=http)
        return function(client, prompt)


class AgentRunner:
    """`url(session_id)`: the session's base URL; `done(key, outcome)`: an agent
    returned (("ok", value)) or raised (("error", reason)), on the runner's thread.
    `actors`: pipeline/agents/actors.AgentActors, or None: in this process, where
    coroutine agents reach the gateway's `app` without a socket."""

    def __init__(self, agent_cfg, url: Callable[[str], str], api_key: str, done: Callable[[str, tuple], None],
                 actors=None, app: Any = None):
        self._timeout_s = agent_cfg.timeout_s
        self._url, self._key, self._done = url, api_key, done
        self._actors, self._app = actors, app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: DaemonThreads | None = None
        if actors is not None:
            return
        self.function = load_agent_function(agent_cfg.function)
        if is_async(self.function):
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="agents", daemon=True)
            self._thread.start()
        else:
            self._threads = DaemonThreads(agent_cfg.threads, "agent")

    def launch(self, key: str, session_id: str, prompt: Prompt) -> Future:
        args = (self._url(session_id), self._key, self._timeout_s, prompt)
        if self._actors is not None:
            future = self._actors.run(*args)
        elif self._loop is not None:
            future = asyncio.run_coroutine_threadsafe(run_async_agent(self.function, *args, app=self._app), self._loop)
        else:
            future = self._threads.submit(run_agent, self.function, *args)
        future.add_done_callback(lambda f: self._finished(key, f))
        return future

    def cancel(self, future: Future | None) -> None:
        if future is None:
            return
        if self._actors is not None:
            self._actors.cancel(future)
        future.cancel()

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel every agent still running and end the event loop (or the actors)."""
        if self._actors is not None:
            self._actors.close()
        elif self._threads is not None:
            self._threads.shutdown()
        elif self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(timeout=timeout_s)
            except TimeoutError:
                pass  # an agent that blocks its event loop: the daemon thread ends with the process
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout_s)

    def _finished(self, key: str, future: Future) -> None:
        if future.cancelled():
            return  # its sample already ended
        exc = future.exception()
        if exc is None:
            self._done(key, ("ok", future.result(timeout=0)))  # done: it waits for nothing
        else:
            # The user's exception, not Ray's wrapper with the remote traceback in its text.
            exc = getattr(exc, "cause", None) or exc
            self._done(key, ("error", "".join(traceback.format_exception_only(exc)).strip()))


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
