"""What the per-step telemetry reads: a process's own memory, and the cap on
what the C heap keeps of memory a step has freed."""
from __future__ import annotations

import platform

import pytest

from pipeline.run.resources import MB, HeapCap, process_rss


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_heap_cap_hands_back_freed_memory_past_its_slack():
    cap = HeapCap(slack_bytes=32 * MB)
    assert cap.check() and cap.trims == 1          # the first call sets the floor
    assert not cap.check()                           # nothing freed since: within the slack
    # 64 KB blocks come from the heap (below glibc's mmap threshold); the last one
    # kept stands at the heap's top, so free() alone cannot shrink it.
    blocks = [bytearray(64 * 1024) for _ in range(1600)]
    del blocks[:-1]
    kept = process_rss()
    assert cap.check() and cap.trims == 2
    assert kept - process_rss() > 50 * MB


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_heap_cap_leaves_memory_in_use_alone():
    cap = HeapCap(slack_bytes=32 * MB)
    cap.check()
    blocks = [bytearray(64 * 1024) for _ in range(1600)]  # 100 MB, all of it in use
    used = process_rss()
    cap.check()
    assert used - process_rss() < 8 * MB
    del blocks
