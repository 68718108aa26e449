"""env.actors 0: the threads that run environment calls in a generator's process.

Not a concurrent.futures.ThreadPoolExecutor: the interpreter joins that pool's
threads at exit, so one call that never returns (a stuck tool; its sample
already failed at env.step_timeout_s, but a Python thread cannot be killed)
would hold the process's exit for as long as the call hangs. These threads are
daemons: an abandoned call ends with the process.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class DaemonThreads:
    """Up to `max_threads` daemon threads, started as calls need them."""

    def __init__(self, max_threads: int, name: str):
        self._max, self._name = max_threads, name
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: submit after shutdown")
            self._calls.put((future, fn, args))
            if self._idle:
                self._idle -= 1
            elif self._started < self._max:
                self._started += 1
                threading.Thread(target=self._work, name=f"{self._name}_{self._started}", daemon=True).start()
        return future

    def shutdown(self) -> None:
        """Cancel the calls not yet started; idle threads end, a running call is left to finish or hang."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    item = self._calls.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
            for _ in range(self._started):
                self._calls.put(None)

    def _work(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # the caller reads it from the future, as from an executor's
                    future.set_exception(exc)
            with self._lock:
                self._idle += 1
