"""math-verify as a reward (`data.reward: pipeline.rewards.math_verifier:math_verify_reward`):
1.0 when the completion's final answer is mathematically equal to the
prompt's (GSM8K's "#### 72" against "72", MATH's "\\frac{1}{2}" against "0.5"),
else 0.0. The regex reward (pipeline.rewards.rules:gsm8k_reward) stays for
numbers only, without the dependency's cost.

math-verify parses with sympy, which can run for minutes on a pathological
expression, and its own timeouts use SIGALRM, which works only on a process's
main thread (a generator scores on its engine loop's). So each process scores
in a child process of its own, with a deadline: a call past it kills the
child, raises, and so counts as that sample's reward failure
(fault.max_reward_failures) instead of a stuck generator; the next call starts
a new child.
"""
from __future__ import annotations

import multiprocessing
import threading

from pipeline.core.types import Prompt


def _serve(conn) -> None:
    """The child: (gold, completion) in, ("ok", score) or ("error", why) out, until None."""
    from math_verify import parse, verify
    while True:
        message = conn.recv()
        if message is None:
            return
        gold, text = message
        try:
            # A bare gold answer ("72") reads as an expression; the completion's last
            # answer is math-verify's to find (\\boxed{}, "#### 72", a last number).
            conn.send(("ok", 1.0 if verify(parse(f"${gold}$"), parse(text)) else 0.0))
        except Exception as exc:  # math-verify and sympy raise all kinds; each is this sample's failure
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


STARTUP_S = 60.0   # a new child imports sympy and math-verify first (seconds on a loaded machine)


class MathVerifier:
    """A reward function backed by a math-verify child process (see the module).
    `serve`: the child's loop, _serve unless a test gives one that never answers."""

    def __init__(self, timeout_s: float = 5.0, serve=_serve):
        self.timeout_s, self.serve = timeout_s, serve
        self._child = self._conn = None
        self._fresh = False
        self._lock = threading.Lock()   # one question at a time on the pipe

    def _start(self) -> None:
        # spawn, not fork: the parent is a threaded Ray actor.
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        self._child = ctx.Process(target=self.serve, args=(child_end,), daemon=True, name="math-verify")
        self._child.start()
        child_end.close()
        self._fresh = True

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.join(timeout=5)
            self._conn.close()
        self._child = self._conn = None

    def __call__(self, prompt: Prompt, completion_text: str) -> float:
        with self._lock:
            if self._child is None or not self._child.is_alive():
                self._start()
            self._conn.send((prompt.answer, completion_text))
            if not self._conn.poll(self.timeout_s + (STARTUP_S if self._fresh else 0.0)):
                self._stop()
                raise TimeoutError(f"math-verify took more than {self.timeout_s:g} s on prompt {prompt.id!r}; "
                                   "scored as a reward failure")
            self._fresh = False
            status, value = self._conn.recv()
        if status != "ok":
            raise ValueError(f"math-verify failed on prompt {prompt.id!r}: {value}")
        return value

    def close(self) -> None:
        with self._lock:
            if self._child is not None and self._child.is_alive():
                self._conn.send(None)
            self._stop()


math_verify_reward = MathVerifier()
