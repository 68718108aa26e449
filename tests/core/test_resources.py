"""What the per-step telemetry reads: a process's own memory, and the cap on
what the C heap keeps of memory a step has freed."""
from __future__ import annotations

import platform

import pytest

from pipeline.core.memory import MB, HeapCap, process_rss

pytestmark = pytest.mark.unit

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")


@glibc
def test_heap_cap_hands_back_freed_memory_past_its_slack():
    cap = HeapCap(min_slack_bytes=32 * MB)
    assert cap.check() is not None   # the first call sets the floor
    assert cap.check() is None       # nothing freed since: within the slack (half the floor)
    # 64 KB blocks come from the heap (below glibc's mmap threshold); the last one
    # kept stands at the heap's top, so free() alone cannot shrink it.
    blocks = [bytearray(64 * 1024) for _ in range(2 * cap.floor // (64 * 1024))]
    del blocks[:-1]
    trimmed = cap.check()
    assert trimmed is not None and trimmed[0] - trimmed[1] > cap.floor // 2, (trimmed, cap.floor)


@glibc
def test_heap_cap_leaves_memory_in_use_alone():
    cap = HeapCap(min_slack_bytes=32 * MB)
    cap.check()
    blocks = [bytearray(64 * 1024) for _ in range(2 * cap.floor // (64 * 1024))]  # all of it in use
    used = process_rss()
    cap.check()
    assert used - process_rss() < 8 * MB
    del blocks


@glibc
def test_heap_cap_trims_every_so_many_steps_within_its_slack():
    cap = HeapCap(min_slack_bytes=1 << 40, every_steps=3)  # a slack never reached: only the period trims
    assert [cap.check() is not None for _ in range(7)] == [True, False, False, True, False, False, True]


class Recorder:
    def __init__(self):
        self.events = []

    def emit(self, ev, **fields):
        self.events.append((ev, fields))


@glibc
def test_heap_cap_logs_each_trim_with_its_step_and_floor():
    cap, log = HeapCap(min_slack_bytes=1 << 40, every_steps=2), Recorder()
    for step in range(3):
        cap.check_logged(log, step)
    assert [(ev, f["step"]) for ev, f in log.events] == [("heap_trimmed", 0), ("heap_trimmed", 2)]
    assert all(f["floor_mb"] > 0 and f["rss_mb"] >= f["floor_mb"] - 1 for _, f in log.events), log.events



def test_the_resource_sample_is_taken_at_most_once_per_period():
    from pipeline.run.resources import Cadence
    now = [0.0]
    cadence = Cadence(1.0, clock=lambda: now[0])
    due = []
    for t in (0.0, 0.2, 0.9, 1.0, 1.5, 2.1, 5.0, 5.1):  # steps of the tiny model, then a slow one
        now[0] = t
        due.append(cadence.due())
    assert due == [True, False, False, True, False, True, True, False]
