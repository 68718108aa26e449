"""The local Ray a run starts dies with the run, even when the driver is
SIGKILLed: Ray's own fate-sharing ends its GCS and raylet, but the dashboard
and runtime-env agents outlive them for minutes and ignore SIGTERM.

Every process of that Ray inherits a mark in its environment (the raylet
passes its environment on to agents and workers). A small watcher process
holds the read end of a pipe whose write end only the driver has: when the
driver ends, however it ends, the watcher reads EOF and ends every process
that carries the mark."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

MARK = "DAGRL_RAY_SESSION"
GRACE_S = 2.0


def start_watcher() -> tuple[str, subprocess.Popen]:
    """A new mark, and the watcher that ends its processes once this process has
    ended or closed the watcher's stdin. Put the mark in os.environ while the
    processes to watch start."""
    mark = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    # Its own session: a Ctrl-C meant for the driver must not end the watcher first.
    watcher = subprocess.Popen([sys.executable, "-m", "pipeline.run.reaper", mark], stdin=subprocess.PIPE,
                               start_new_session=True, close_fds=True)
    return mark, watcher


def marked(mark: str) -> list[int]:
    """PIDs of this user's processes whose environment holds MARK=mark."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue  # gone, or another user's
    return found


def end_marked(mark: str, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every marked process, then SIGKILL those left after grace_s; the PIDs found."""
    found = marked(mark)
    _signal_all(found, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := [pid for pid in found if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    _signal_all(left, signal.SIGKILL)
    return found


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; its parent has yet to reap it


def main(mark: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while sys.stdin.buffer.read(65536):
        pass
    end_marked(mark)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
