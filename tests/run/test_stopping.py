"""StopOnSignal in this process: the first SIGINT or SIGTERM asks, the second
or the grace period's end stops at once, an ignored SIGINT stays ignored, and
the handlers are put back. (The whole stop of a run: tests/run/test_signals.py.)"""
from __future__ import annotations

import os
import signal
import time

import pytest

from pipeline.run.stopping import StopNow, StopOnSignal

pytestmark = pytest.mark.unit


def _raise(signum: int) -> None:
    os.kill(os.getpid(), signum)


@pytest.fixture(autouse=True)
def _sigint_as_a_terminal_sends_it():
    """The suite may run as a background job, which starts with SIGINT ignored
    (and StopOnSignal leaves an ignored SIGINT alone): these tests start from
    Python's own handler."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_first_signal_asks_and_the_second_stops_at_once_under_the_first_ones_name():
    said = []
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StopNow) as stopped:
        with StopOnSignal(60, lambda *a, **k: said.append(a[0])) as stop:
            _raise(signal.SIGTERM)
            assert stop.requested == signal.SIGTERM and stop.name == "SIGTERM"
            assert "a second signal stops at once" in said[0]
            _raise(signal.SIGINT)
    assert stopped.value.exit_code == 143 and stopped.value.signal == "SIGTERM"
    assert "second signal (SIGINT)" in str(stopped.value)
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_grace_period_running_out_stops_at_once():
    with pytest.raises(StopNow, match=r"ran past run.stop_grace_s \(0 s\) after SIGINT"):
        with StopOnSignal(0.2, lambda *a, **k: None):
            _raise(signal.SIGINT)
            time.sleep(5)  # the step in progress, longer than the grace period
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_plain_keyboard_interrupt_after_a_stop_now_becomes_it():
    """Ray's waits check for signals and raise a KeyboardInterrupt of their own."""
    with pytest.raises(StopNow) as stopped:
        with StopOnSignal(60, lambda *a, **k: None) as stop:
            _raise(signal.SIGTERM)
            try:
                _raise(signal.SIGTERM)
            except StopNow:
                raise KeyboardInterrupt from None
    assert stopped.value is stop.now


def test_a_sigint_the_process_ignores_stays_ignored():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopOnSignal(60, lambda *a, **k: None) as stop:
            _raise(signal.SIGINT)
            assert stop.requested is None
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
