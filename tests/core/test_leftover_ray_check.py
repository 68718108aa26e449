"""The leftover-Ray check counts the suite's own processes, not a neighbour's."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.leftover_ray import SUITE_MARK, ray_processes

pytestmark = pytest.mark.unit


def _ray_like(mark: str | None) -> subprocess.Popen:
    """A process whose command line looks like a Ray worker's, with or without the suite's mark."""
    env = {k: v for k, v in os.environ.items() if k != SUITE_MARK}
    if mark is not None:
        env[SUITE_MARK] = mark
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print(flush=True); sys.stdin.read()", "ray::IDLE"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    proc.stdout.readline()  # it runs its own command line and environment now, not its parent's
    return proc


def test_only_processes_with_the_suites_mark_count():
    mine, neighbour = _ray_like("check-under-test"), _ray_like(None)
    try:
        found = {p.pid for p in ray_processes("check-under-test")}
        assert mine.pid in found
        assert neighbour.pid not in found
    finally:
        for proc in (mine, neighbour):
            proc.stdin.close()
            proc.wait(timeout=30)
