"""A clean stop on SIGINT (Ctrl-C) and SIGTERM (SLURM preemption, `ray job stop`):
the step in progress finishes, the last finished step is checkpointed, and the
run ends with the command that resumes it. A second signal, or the step still
running `run.stop_grace_s` after the first, stops at once; the last checkpoint
written stays the one to resume from."""
from __future__ import annotations

import signal
from pathlib import Path

from pipeline.run.checkpoint import CheckpointError, latest
from pipeline.run.runner import PipelineError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def resume_command(run_dir: Path) -> str:
    return f"python -m pipeline train --resume {run_dir}"


def resume_hint(run_dir: Path) -> str:
    """What a user does after a run stopped early: its newest complete checkpoint, or none."""
    try:
        return f"resume from {latest(run_dir).name} with: {resume_command(run_dir)}"
    except CheckpointError:
        return "no checkpoint was written: start the run again (run.checkpoint_every writes them)"


class Stopped(PipelineError):
    """The run stopped on a signal after a finished step, checkpointed."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signal = signal.Signals(signum).name
        self.exit_code = 128 + signum


class StopNow(KeyboardInterrupt):
    """A second signal, or the grace period out: unwind now, whatever runs. A
    KeyboardInterrupt: no `except Exception` holds it up, and Ray's waits, which
    check for signals, raise it as it is (any other exception comes out of them
    as a SystemError)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signal = signal.Signals(signum).name
        self.exit_code = 128 + signum


class StopOnSignal:
    """SIGINT and SIGTERM, while entered, ask for a stop instead of raising:
    `requested` says which came first. A SIGINT the process was started to
    ignore (a background job of a script) stays ignored."""

    def __init__(self, grace_s: float, say=print):
        self.grace_s, self.say = grace_s, say
        self.requested: int | None = None
        self.now: StopNow | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopOnSignal":
        for signum in SIGNALS:
            if signal.getsignal(signum) is not signal.SIG_IGN:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self.reason(exc) is not exc:
            raise self.now from None
        return False

    def reason(self, exc: BaseException) -> BaseException:
        """What stopped the run: Ray's waits hand a plain KeyboardInterrupt back for a StopNow."""
        return self.now if isinstance(exc, KeyboardInterrupt) and self.now is not None else exc

    @property
    def name(self) -> str:
        return signal.Signals(self.requested).name if self.requested else ""

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            self.now = StopNow(f"stopped at once by a second signal ({name})", self.requested)
            raise self.now
        self.requested = signum
        self.say(f"\ndagrl: {name}: stopping after the step in progress, with a checkpoint of it "
                 f"(within {self.grace_s:.0f} s, run.stop_grace_s); a second signal stops at once", flush=True)
        signal.signal(signal.SIGALRM, self._on_grace_out)
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def _on_grace_out(self, signum: int, frame) -> None:
        self.now = StopNow(f"stopped at once: the step in progress ran past run.stop_grace_s "
                           f"({self.grace_s:.0f} s) after {self.name}", self.requested)
        raise self.now
