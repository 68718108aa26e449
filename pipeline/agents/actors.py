"""agent.actors > 0: a generator's agents on Ray actors of their own.

For agents that need isolation from the generator's process (a sandbox, a
heavy import, a crash that must not take the engine with it). Each actor is
an async actor running many agents at once, as the generator's own event loop
would (pipeline/agents/runner.py); samples go to the actors in turn. An actor
that dies fails the samples it ran (their reward failures) and Ray restarts
it for the next ones. The actors reach the gateway at the generator's node
address, and die with the generator that owns them.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import ray

from pipeline.agents.contract import is_async, load_agent_function
from pipeline.core.types import Prompt


class AgentWorker:
    def __init__(self, spec: str, threads: int):
        self.function = load_agent_function(spec)
        self._async = is_async(self.function)
        self._threads = asyncio.Semaphore(threads)

    async def run(self, base_url: str, api_key: str, timeout_s: float, prompt: Prompt) -> Any:
        from pipeline.agents.runner import run_agent, run_async_agent
        if self._async:
            return await run_async_agent(self.function, base_url, api_key, timeout_s, prompt)
        async with self._threads:
            return await asyncio.to_thread(run_agent, self.function, base_url, api_key, timeout_s, prompt)

    def ping(self) -> bool:
        return True


class AgentActors:
    """The pool, seen from the generator that owns it."""

    # An async actor runs this many of its calls at once: more sessions than
    # a generator holds, so the pool never queues an agent behind another.
    CONCURRENCY = 4096

    def __init__(self, agent_cfg):
        remote = ray.remote(AgentWorker).options(num_cpus=agent_cfg.worker_cpus, max_restarts=-1,
                                                 max_task_retries=0, max_concurrency=self.CONCURRENCY)
        self._actors = [remote.remote(agent_cfg.function, agent_cfg.threads) for _ in range(agent_cfg.actors)]
        self._refs: dict[int, ray.ObjectRef] = {}   # id(future) -> its call, to cancel it
        self._next = 0

    def wait_ready(self, timeout_s: float) -> None:
        """Started before the first step's clock runs: an actor's start-up is not a slow agent."""
        ray.get([actor.ping.remote() for actor in self._actors], timeout=timeout_s)

    def run(self, base_url: str, api_key: str, timeout_s: float, prompt: Prompt) -> Future:
        actor, self._next = self._actors[self._next], (self._next + 1) % len(self._actors)
        ref = actor.run.remote(base_url, api_key, timeout_s, prompt)
        future = ref.future()
        self._refs[id(future)] = ref
        future.add_done_callback(lambda f: self._refs.pop(id(f), None))
        return future

    def cancel(self, future: Future) -> None:
        ref = self._refs.pop(id(future), None)
        if ref is not None:
            ray.cancel(ref)

    def close(self) -> None:
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
