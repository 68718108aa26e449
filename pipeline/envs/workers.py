"""env.actors > 0: environments in a pool of Ray actors beside a generator.

For environments too slow or too heavy for the generator's process (a sandbox,
a code executor). Each worker holds the environments of the samples assigned
to it and takes one call at a time, so the pool bounds how many environment
steps run at once. A worker whose step timed out is killed and replaced: a
stuck sandbox would hold up every later step queued for it. The other samples
it held rebuild their environments on the new one by replaying their actions
(an environment is a function of its prompt and the actions so far).
The generator (pipeline/generator/episodes.py) queues each worker's calls and
starts one when the worker is free, so a timeout counts from a call's start.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import ray

from pipeline.envs.interface import load_env_class


class EnvWorker:
    def __init__(self, spec: str, args: dict):
        self._cls, self._args = load_env_class(spec, args), args
        self._envs: dict[str, Any] = {}

    def call(self, key: str, method: str, arg: Any) -> Any:
        """reset(prompt), step(action), or replay((prompt, earlier actions, action)):
        the environment of a sample whose worker was replaced, rebuilt here."""
        if method == "replay":
            prompt, earlier, arg = arg
            self.call(key, "reset", prompt)
            for action in earlier:
                self._envs[key].step(action)
            method = "step"
        if method == "reset":
            self._envs[key] = self._cls(**self._args)
        return getattr(self._envs[key], method)(arg)

    def forget(self, key: str) -> None:
        self._envs.pop(key, None)

    def ping(self) -> bool:
        return True


class EnvWorkers:
    """The pool, seen from the generator that owns it (its actors die with it)."""

    def __init__(self, env_cfg, owner: str):
        self.cfg, self.owner = env_cfg, owner
        self._remote = ray.remote(EnvWorker)
        self._actors = [self._start() for _ in range(env_cfg.actors)]
        self._members: list[set[str]] = [set() for _ in self._actors]
        self._next = 0
        self.replaced = 0

    def _start(self):
        return self._remote.options(num_cpus=self.cfg.worker_cpus, max_restarts=0,
                                    name=None).remote(self.cfg.class_, self.cfg.args)

    def wait_ready(self, timeout_s: float) -> None:
        """Started before the first step's clock runs: a worker's start-up is not a slow step."""
        ray.get([actor.ping.remote() for actor in self._actors], timeout=timeout_s)

    def ready(self, index: int) -> Future:
        """Done once worker `index` answers."""
        return self._actors[index].ping.remote().future()

    def assign(self, key: str) -> int:
        """A worker for a new sample, in turn: the pool's load stays even."""
        index, self._next = self._next, (self._next + 1) % len(self._actors)
        self._members[index].add(key)
        return index

    def call(self, index: int, key: str, method: str, arg: Any) -> Future:
        out: Future = Future()

        def done(f: Future) -> None:
            exc = f.exception()
            if exc is None:
                out.set_result(f.result(timeout=0))  # done: it waits for nothing
            else:
                # The user's exception, not Ray's wrapper with the remote traceback in its text.
                out.set_exception(getattr(exc, "cause", None) or exc)
        self._actors[index].call.remote(key, method, arg).future().add_done_callback(done)
        return out

    def forget(self, index: int, key: str) -> None:
        if key in self._members[index]:
            self._members[index].discard(key)
            self._actors[index].forget.remote(key)

    def replace(self, index: int) -> list[str]:
        """Kill worker `index` and start a new one in its place; the samples it
        held (they stay with the new one, their environments to be rebuilt)."""
        ray.kill(self._actors[index], no_restart=True)
        self._actors[index] = self._start()
        self.replaced += 1
        return sorted(self._members[index])

    def close(self) -> None:
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
