"""The suite's check that it leaves no Ray process behind (tests/conftest.py):
which Ray processes are the suite's own."""
from __future__ import annotations

import os

import psutil

# Set in the suite's environment; Ray's raylet passes its environment on to
# its workers and agents, and the tests' subprocesses inherit it.
SUITE_MARK = "DAGRL_TEST_SUITE"
RAY_PROCESS_NAMES = ("raylet", "gcs_server", "ray::", "default_worker.py", "dashboard.py", "log_monitor.py")


def ray_processes(mark: str) -> list[psutil.Process]:
    """Ray's processes whose environment carries SUITE_MARK=`mark`."""
    out = []
    for proc in psutil.process_iter(["pid", "cmdline", "name"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.pid == os.getpid() or not any(n in cmd or n in (proc.info["name"] or "")
                                              for n in RAY_PROCESS_NAMES):
            continue
        try:
            if proc.environ().get(SUITE_MARK) == mark:
                out.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue  # not ours to read, or gone: not one the suite left either way
    return out
