"""Where agents run: the generator's process, on an event loop or on threads.

A coroutine agent runs on one event loop in a thread of its own, so a
thousand sessions are a thousand tasks, not threads; a plain `def` agent runs
on a daemon thread (agent.threads at most at once; pipeline/envs/threads.py
says why daemons). Each sample gets its own client, bound to its session,
with its own connection pool: an agent that closes its client closes nothing
of another's. The clients ignore proxy settings (trust_env off): the gateway
is on this node, and a proxy would see the run's key.

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


class AgentRunner:
    """`url(session_id)`: the session's base URL; `done(key, outcome)`: an agent
    returned (("ok", value)) or raised (("error", reason)), on the runner's thread."""

    def __init__(self, agent_cfg, url: Callable[[str], str], api_key: str, done: Callable[[str, tuple], None]):
        self.function = load_agent_function(agent_cfg.function)
        self._timeout_s = agent_cfg.timeout_s
        self._url, self._key, self._done = url, api_key, done
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: DaemonThreads | None = None
        if is_async(self.function):
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="agents", daemon=True)
            self._thread.start()
        else:
            self._threads = DaemonThreads(agent_cfg.threads, "agent")

    def launch(self, key: str, session_id: str, prompt: Prompt) -> Future:
        if self._loop is not None:
            future = asyncio.run_coroutine_threadsafe(self._run_async(session_id, prompt), self._loop)
        else:
            future = self._threads.submit(self._run_sync, session_id, prompt)
        future.add_done_callback(lambda f: self._finished(key, f))
        return future

    def cancel(self, future: Future | None) -> None:
        if future is not None:
            future.cancel()

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel every agent still running and end the event loop."""
        if self._threads is not None:
            self._threads.shutdown()
            return
        if self._loop is None or not self._loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(timeout=timeout_s)
        except TimeoutError:
            pass  # an agent that blocks its event loop: the daemon thread ends with the process
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout_s)

    async def _run_async(self, session_id: str, prompt: Prompt) -> Any:
        async with httpx.AsyncClient(trust_env=False, verify=False) as http:
            client = openai.AsyncOpenAI(base_url=self._url(session_id), api_key=self._key, max_retries=0,
                                        timeout=self._timeout_s, http_client=http)
            return await self.function(client, prompt)

    def _run_sync(self, session_id: str, prompt: Prompt) -> Any:
        with httpx.Client(trust_env=False, verify=False) as http:
            client = openai.OpenAI(base_url=self._url(session_id), api_key=self._key, max_retries=0,
                                   timeout=self._timeout_s, http_client=http)
            return self.function(client, prompt)

    def _finished(self, key: str, future: Future) -> None:
        if future.cancelled():
            return  # its sample already ended
        exc = future.exception()
        if exc is None:
            self._done(key, ("ok", future.result(timeout=0)))  # done: it waits for nothing
        else:
            self._done(key, ("error", "".join(traceback.format_exception_only(exc)).strip()))


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
