"""The engine loop hands its first failure to the next refit (FirstError): the
loop's thread records, a refit's thread takes, and no failure is lost between."""
from __future__ import annotations

import threading

import pytest

from pipeline.generator.engine_loop import FirstError

pytestmark = pytest.mark.unit


def test_keeps_the_first_until_taken():
    errors = FirstError()
    assert errors.take() is None
    assert errors.record("a") and not errors.record("b")
    assert errors.take() == "a" and errors.take() is None
    assert errors.record("c") and errors.take() == "c"


class RecordsWhileTaken(FirstError):
    """The loop's thread records a failure at the worst moment: after take()
    has read the slot, before it clears it."""

    def __init__(self) -> None:
        super().__init__()
        self.slot: str | None = None
        self.recorder: threading.Thread | None = None

    @property
    def _error(self) -> str | None:
        value = self.slot
        if self.recorder is None:
            self.recorder = threading.Thread(target=self.record, args=("engine step failed",))
            self.recorder.start()
            self.recorder.join(timeout=0.5)  # with the lock it waits for take(); without, it lands now
        return value

    @_error.setter
    def _error(self, value: str | None) -> None:
        self.slot = value


def test_a_failure_recorded_while_a_refit_takes_reaches_the_next_refit():
    """Without the lock (the old read-then-clear across threads) this failure was lost: checked."""
    errors = RecordsWhileTaken()
    assert errors.take() is None
    errors.recorder.join(timeout=10)
    assert not errors.recorder.is_alive()
    assert errors.take() == "engine step failed"
