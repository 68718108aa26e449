"""A math-verify child that never answers: the reward's deadline under test
(tests/rewards/test_math_verifier.py). In a module of its own so that a spawned
child can import it by name."""
from __future__ import annotations

import time


def never_answer(conn) -> None:
    conn.recv()
    time.sleep(3600)
