"""One C heap for the threads of every worker but the reward model's
(pipeline/core/memory.py one_heap_arena): with a heap per thread, the
driver's, the controller's and the generators' RSS crept up for thousands of
steps while what they had allocated stayed flat, and a trainer's floor after
malloc_trim held whatever the top of its step thread's heap kept
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


# A thread frees a 24 MB buffer (glibc then keeps blocks up to that size on a
# heap and lets up to twice it sit at a heap's top), then 40 MB in 1 MB blocks,
# last first, so they merge into its heap's top; the heap cap trims. Prints
# the MB the trim handed back.
THREAD_TOP = r"""
import ctypes, sys, threading
from pipeline.core.memory import MB, HeapCap, one_heap_arena
if sys.argv[1] == "one":
    assert one_heap_arena()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def step():
    libc.free(libc.malloc(24 * MB))
    blocks = [libc.malloc(MB) for _ in range(40)]
    for b in blocks:
        ctypes.memset(b, 1, MB)
    for b in reversed(blocks):
        libc.free(b)
thread = threading.Thread(target=step)
thread.start()
thread.join()
before, after = HeapCap().check()
print((before - after) // MB)
"""


def _run(script: str, mode: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MALLOC_ARENA_MAX", None)
    out = subprocess.run([sys.executable, "-c", script, mode], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.unit
@glibc
def test_one_heap_arena_keeps_every_thread_on_one_heap():
    assert _run(THREADS, "many") > 1   # glibc's default: the threads got heaps of their own
    assert _run(THREADS, "one") == 1


@pytest.mark.unit
@glibc
def test_the_heap_cap_hands_back_the_top_of_a_threads_heap_only_with_one_heap():
    assert _run(THREAD_TOP, "many") < 8     # malloc_trim leaves a thread heap's top resident
    assert _run(THREAD_TOP, "one") >= 36


@pytest.mark.sim
@glibc
def test_the_controller_the_trainer_and_the_generators_start_with_one_heap(sim_pool):
    # A critic rank starts as a trainer rank does (pool._rank).
    import ray
    for actor in (sim_pool.controller, *sim_pool.trainers, *sim_pool.generators):
        env = ray.get(actor.__ray_call__.remote(lambda self: os.environ.get("MALLOC_ARENA_MAX")), timeout=60)
        assert env == "1", actor


@pytest.mark.sim
def test_a_ranks_steps_run_on_its_one_step_thread(sim_pool):
    """The first training step on a new thread leaves that thread's torch state
    allocated (pipeline/core/node.py on_step_thread): every node of a trainer
    or critic rank, and the set-up that builds its engine, runs on one thread,
    while calls outside the step still spread over the rank's spare threads."""
    import threading
    import time

    import ray

    from pipeline.core.node import STEP_THREAD
    from pipeline.trainer.critic_worker import CriticWorker
    from pipeline.trainer.worker import TrainerWorker
    for cls in (TrainerWorker, CriticWorker):
        # Every node (node() wraps it) and the set-up, in the table Ray routes each call by.
        steps = {name for name, f in vars(cls).items() if hasattr(f, "__wrapped__")} | {"begin_run", "end_run"}
        routed = ray.remote(cls).__ray_metadata__.method_meta.concurrency_group_for_methods
        assert len(steps) > 2 and routed == dict.fromkeys(steps, STEP_THREAD), (cls, routed)

    def busy_thread(self):
        started = time.monotonic()
        while time.monotonic() - started < 0.2:  # holds its thread, so the calls overlap
            pass
        return threading.get_ident()

    trainer = sim_pool.trainers[0]
    on_step = ray.get([trainer.__ray_call__.options(concurrency_group=STEP_THREAD).remote(busy_thread)
                       for _ in range(6)], timeout=60)
    spread = ray.get([trainer.__ray_call__.remote(busy_thread) for _ in range(6)], timeout=60)
    assert len(set(on_step)) == 1 and len(set(spread)) == 2
