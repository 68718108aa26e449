"""One C heap for the threads of the driver, the controller and the generators
(pipeline/core/memory.py one_heap_arena): with a heap per thread, their RSS
crept up for thousands of steps while what they had allocated stayed flat
(benchmarks/long_run.py)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="M_ARENA_MAX is glibc's")

ROOT = Path(__file__).resolve().parents[2]

# Four threads allocate at once, then glibc lists its heaps (malloc_info: one <heap> per arena).
THREADS = r"""
import ctypes, sys, tempfile, threading
from pipeline.core.memory import one_heap_arena
if sys.argv[1] == "one":
    assert one_heap_arena()
barrier = threading.Barrier(4)
def work():
    barrier.wait()
    kept = [bytearray(4000) for _ in range(200)]
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile(suffix=".xml") as out:
    f = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(f))
    libc.fclose(ctypes.c_void_p(f))
    print(open(out.name).read().count("<heap nr="))
"""


def _heaps(mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MALLOC_ARENA_MAX", None)
    out = subprocess.run([sys.executable, "-c", THREADS, mode], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.unit
@glibc
def test_one_heap_arena_keeps_every_thread_on_one_heap():
    assert _heaps("many") > 1   # glibc's default: the threads got heaps of their own
    assert _heaps("one") == 1


@pytest.mark.sim
@glibc
def test_the_controller_and_the_generators_start_with_one_heap(sim_pool):
    import ray
    for actor in (sim_pool.controller, *sim_pool.generators):
        env = ray.get(actor.__ray_call__.remote(lambda self: os.environ.get("MALLOC_ARENA_MAX")), timeout=60)
        assert env == "1", actor
