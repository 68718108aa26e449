"""A process's own memory, and the cap on what its C heap keeps of memory
freed: what every worker reports each step (pipeline/run/resources.py) and what
a trainer keeps in bounds."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import gc

from pipeline.core import spans

MB = 2 ** 20


def process_rss() -> int:
    """This process's own resident memory in bytes: VmRSS less RssShmem (Linux
    /proc; 0 where it has none). The object store's pages that a worker wrote
    or read are shared memory and would count in its VmRSS as it touches more
    of the store, one put or get a step, however few objects it holds; they
    are the store's, counted in store_mb."""
    fields = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "RssShmem"):
                    fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return fields.get("VmRSS", 0) - fields.get("RssShmem", 0)


@contextlib.contextmanager
def frozen_imports():
    """Import torch, vLLM or DeepSpeed inside this: with the cyclic collector off
    it does not walk again and again the objects the import makes, which live as
    long as the process; frozen after, no later full collection walks them."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc: its allocator keeps its own counsel


# glibc's M_ARENA_MAX (mallopt), and the variable that sets it when a process starts.
M_ARENA_MAX = -8
ONE_ARENA_ENV = {"MALLOC_ARENA_MAX": "1"}


def one_heap_arena() -> bool:
    """Every thread of this process that has not allocated yet shares the main
    heap (glibc's M_ARENA_MAX = 1); True if the C library took it.

    For the processes whose threads take turns: glibc gives each thread a
    heap of its own (up to 8 per core), a buffer freed in one is reused only
    by the same thread, and each heap's touched pages creep up as the threads
    take turns. The driver and the controller (its 8 threads) do little but
    pass small objects between threads (the controller's RSS rose 141 -> 160
    MB over 2000 steps of the 4.2M model while the bytes it had allocated
    stayed flat). A generator computes on one thread, its engine loop
    (vLLM's kernels run in OpenMP's threads, which allocate little, or on a
    GPU), beside Ray's threads that pass its batches and weights: over 2000
    steps of the 4.2M model its RSS after each trim went 973 -> 981 MB with a
    heap per thread, and held at 970.9-971.1 MB with one. A trainer or
    critic rank computes a step on one of Ray's threads, and malloc_trim
    leaves the top of a thread's own heap alone (glibc trims the main heap's
    top only), where up to twice the largest buffer freed (a weight copy)
    stays resident: over 500 steps of the collective sync the trainer's RSS
    after each trim wandered 531-587 MB with a heap per thread, and held at
    527-528 MB with one, at the same speed (train_s 0.6 % longer, within the
    runs' own spread). A CPU trainer runs torch on one thread
    (start_deepspeed): with two intra-op threads one heap made a step of
    the 4.2M model 4-9 % slower."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):
        return False


class HeapCap:
    """Keeps what glibc holds of freed memory within a slack of what the process
    uses, handing the rest back (malloc_trim) when it is over.

    A training step frees its activations and, with the object-store sync, a
    whole weight copy; glibc keeps freed memory for reuse, and because the
    sizes change from step to step what it keeps creeps up in jumps: on the
    4.2M model the trainer's RSS went 727 -> 897 MB within 150 steps. Without a
    cap rss_mb shows the allocator's high-water mark and a real leak hides
    under it. Trimming every step kept the trainer at 604-614 MB but made the
    next forward pass 50 % slower (its pages faulted back in), so the slack
    leaves a step's own working set alone: half the floor (the RSS after the
    last trim), at least `min_slack_bytes`. Within the slack the allocator
    may still creep for thousands of steps, so it also trims every
    `every_steps` steps (one slower step in that many): the floor after each
    trim is what the process really holds, and a leak shows as a rising floor.
    """

    def __init__(self, min_slack_bytes: int = 256 * MB, every_steps: int = 100) -> None:
        self.min_slack_bytes = min_slack_bytes
        self.every_steps = every_steps
        self.floor: int | None = None
        self._checks = 0

    def check(self) -> tuple[int, int] | None:
        """(RSS before, after) if it trimmed; the first call always does, to set the floor."""
        trim = _malloc_trim()
        if trim is None:
            return None
        self._checks += 1
        before = process_rss()
        due = self.every_steps and (self._checks - 1) % self.every_steps == 0
        if self.floor is not None and not due and before <= self.floor + max(self.min_slack_bytes,
                                                                              self.floor // 2):
            return None
        trim(0)
        self.floor = process_rss()
        return before, self.floor

    def check_logged(self, log, step: int) -> None:
        """check(), and a heap_trimmed event (the RSS before, the floor after) when it trimmed."""
        with spans.span("heap_cap"):
            trimmed = self.check()
        if trimmed:
            log.emit("heap_trimmed", step=step, rss_mb=round(trimmed[0] / MB, 1), floor_mb=round(trimmed[1] / MB, 1))
