"""Which pairs the ordering checks must look at, found without comparing every pair.

Invariants 1 and 2 compare each rollout with each validation or refit. A day's
run logs tens of thousands of each, and comparing them all took longer than
the run. Most of those pairs follow from a few: one worker's refits (and its
validations) run one after another, start -> end -> next start, and the
vector clocks prove it link by link. Along such a chain "the end of interval j
happened before x" holds for a prefix of the chain and "y happened before the
start of j" for a suffix, by transitivity, so a binary search finds, for a
query (x, y), the only intervals the clocks may leave unordered with it.
The wall clock's objections (the checker's notes) come from the intervals
whose times overlap the query's, found by bisection where a chain's times rise.

Both sets are candidates, judged in full by the caller as before, so the
verdict and the notes are those of comparing every pair: a pair left out is
ordered by the clocks alone (a death only orders more) and apart in time.
Where the intervals are no chain (an event without a clock, an end missing
mid-chain, one interval not before the next), every interval is a candidate.
"""
from __future__ import annotations

import bisect
import math
from typing import Sequence


def happened_before(a: dict, b: dict) -> bool:
    """A's vector clock is <= B's entry by entry, and they differ."""
    va, vb = a["vc"], b["vc"]
    return va != vb and all(vb.get(lane, 0) >= count for lane, count in va.items())


def has_clock(e: dict) -> bool:
    return isinstance(e.get("vc"), dict)


def _end_t(end: dict | None) -> float:
    return math.inf if end is None else end["t"]


class Chain:
    """Intervals (start, end), each ordered before the next by the clocks."""

    def __init__(self, intervals: Sequence[tuple[dict, dict | None]]):
        self.starts = [s for s, _ in intervals]
        self.ends = [e for _, e in intervals]
        times = [t for s, e in intervals for t in (s["t"], _end_t(e))]
        self.times_rise = all(a <= b for a, b in zip(times, times[1:]))
        self._end_times = [_end_t(e) for e in self.ends]
        self._start_times = [s["t"] for s in self.starts]

    def __len__(self) -> int:
        return len(self.starts)

    def ends_before(self, x: dict) -> int:
        """How many intervals ended before x, by the clocks: they are the first ones."""
        lo, hi = 0, len(self)   # ends[:lo] happened before x; ends[hi:] did not
        while lo < hi:
            mid = (lo + hi) // 2
            if self.ends[mid] is not None and happened_before(self.ends[mid], x):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _first_start_after(self, y: dict | None) -> int:
        if y is None:
            return len(self)
        lo, hi = 0, len(self)   # y happened before starts[hi:], not before starts[:lo]
        while lo < hi:
            mid = (lo + hi) // 2
            if happened_before(y, self.starts[mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def candidates(self, x: dict, y: dict | None) -> set[int]:
        """The intervals that the clocks leave unordered with the query (x, y),
        or whose times overlap [x.t, y.t]: every other one ended before x and
        began after nothing of it, or began after y, by clock and by time."""
        unordered = set(range(self.ends_before(x), self._first_start_after(y)))
        lo_t, hi_t = x["t"], _end_t(y)
        if not self.times_rise:
            return unordered | {j for j in range(len(self))
                                if self.starts[j]["t"] <= hi_t and lo_t <= _end_t(self.ends[j])}
        first = bisect.bisect_left(self._end_times, lo_t)
        last = bisect.bisect_right(self._start_times, hi_t)
        return unordered | set(range(first, last))


def chain_of(intervals: Sequence[tuple[dict, dict | None]]) -> Chain | None:
    """The intervals as a Chain, or None where their clocks do not prove one."""
    if not all(has_clock(x) for s, e in intervals for x in (s, e) if x is not None):
        return None
    for i, (s, e) in enumerate(intervals):
        if e is None:
            if i != len(intervals) - 1:
                return None
        elif e is not s and not happened_before(s, e) \
                or i + 1 < len(intervals) and not happened_before(e, intervals[i + 1][0]):
            return None
    return Chain(intervals)



class Candidates:
    """Intervals grouped by a key (a worker) into chains, for finding the ones to judge against a query."""

    def __init__(self, intervals: Sequence[tuple[dict, dict | None]], key=lambda start: start.get("worker")):
        groups: dict = {}
        for i, (start, _) in enumerate(intervals):
            groups.setdefault(key(start), []).append(i)
        self._groups = {k: (idxs, chain_of([intervals[i] for i in idxs])) for k, idxs in groups.items()}

    def against(self, x: dict, y: dict | None, *keys) -> list[int]:
        """Indices, in the intervals' order, of those to judge against (x, y): of the groups `keys`, or all."""
        found: list[int] = []
        fast = has_clock(x) and (y is None or has_clock(y))
        for key in keys or self._groups:
            idxs, chain = self._groups.get(key, ((), None))
            if chain is None or not fast:
                found.extend(idxs)
            else:
                found.extend(idxs[j] for j in chain.candidates(x, y))
        return sorted(found)
