"""Invariant 7: at most WEIGHT_COPIES versions of the weights are in the object store at once.

generation.weight_sync object_store: trainer rank 0 puts each new version
(`weights_put`) and holds it for a generator that may start mid-run until the
next version replaces it (`weights_released`); a generator holds what it
fetched (`weights_fetched`) until its engine has its own copy
(`weights_dropped`). A version is alive from its put until every one of those
ends. The design needs two: the version the generators loaded in the last step
(the trainer still holds it while it trains) and the one it has just made. A
third alive at a put is a leak: one copy more per step, until the store
spills and the run slows, then stops (DESIGN.md).

Decided by vector clocks: a version counts as gone at a put only if each of
its ends happened before that put; what the clocks leave unordered is
counted as alive, the pessimistic reading.
"""
from __future__ import annotations

from collections import defaultdict

from pipeline.tools.check_order import Judge, has_clock, of

WEIGHT_COPIES = 2


def _before(judge: Judge, a: dict, b: dict) -> bool:
    if has_clock(a) and has_clock(b):
        return judge.before(a, b)
    return a["t"] < b["t"]  # a log from before vector clocks: one host's times


def weight_copies_bounded(events: list[dict], judge: Judge) -> None:
    puts = of(events, "weights_put")
    if not puts:
        return   # a collective weight sync, or a log from before these events
    releases = {e["version"]: e for e in of(events, "weights_released")}
    drops: dict[tuple, list[dict]] = defaultdict(list)
    for e in of(events, "weights_dropped"):
        drops[(e["worker"], e["version"])].append(e)
    ends: dict[int, list[dict | None]] = defaultdict(list)   # None: an end never logged, alive to the end
    for fetch in of(events, "weights_fetched"):
        mine = drops.get((fetch["worker"], fetch["version"]))
        ends[fetch["version"]].append(judge.ended_by_death(fetch, mine.pop(0) if mine else None, "weights_dropped"))
    alive: dict[int, dict] = {}   # version -> its first put, for the versions not yet known to be gone
    for put in puts:
        version = put["version"]
        gone = [v for v in alive if v != version and _all_before(judge, [releases.get(v), *ends[v]], put)]
        for v in gone:
            del alive[v]
        alive.setdefault(version, put)
        if len(alive) > WEIGHT_COPIES:
            held = sorted(alive)
            judge.fail(7, f"{len(held)} versions of the weights {held} were in the object store when version "
                          f"{version} was put; at most {WEIGHT_COPIES} may be (each one's holders: the trainer "
                          "until it makes the next, a generator until its load is done)",
                       [*(alive[v] for v in held[:-1]), put])
            for v in held[:-1]:
                del alive[v]   # one violation per leak found, not one for every later put


def _all_before(judge: Judge, ends: list[dict | None], put: dict) -> bool:
    return all(end is not None and _before(judge, end, put) for end in ends)

