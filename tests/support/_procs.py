"""Run the CLI as a separate driver process, watch its files, kill it hard."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


# SIGINT as a terminal's foreground job has it, even where the suite itself runs
# in the background (a non-interactive shell starts background jobs ignoring SIGINT).
_CLI = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from pipeline.__main__ import main; sys.exit(main(sys.argv[1:]))")


def start_driver(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)  # its own local Ray, not the test session's
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-c", _CLI, "train", *args], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def wait_for(predicate, timeout_s: float, proc: subprocess.Popen, what: str, log: Path) -> None:
    """Poll the run's files (written by another process) until `predicate` holds."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"driver exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)  # polling another process's files; this orders nothing of ours
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}:\n{log.read_text()[-3000:]}")


def sigkill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the driver, then the local Ray it started (its descendants, by PID)."""
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=30)


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=-1) + 1


def events_of(path: Path, kind: str) -> list[dict]:
    if not path.is_file():
        return []
    return [r for r in map(json.loads, filter(str.strip, path.read_text().splitlines())) if r["ev"] == kind]


def run_driver(args: list[str], log: Path, timeout_s: float) -> int:
    """`python -m pipeline train *args` to its end (its output in `log`): the exit status.
    One still running at the timeout is killed with the Ray it started."""
    proc = start_driver(args, log)
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            sigkill_tree(proc)
