"""Invariant 7 on hand-made logs: the weight copies in the object store stay
within the bound, and a holder that never lets go is a violation."""
from __future__ import annotations

from pipeline.tools.check import check_events
from pipeline.tools.check_bounds import WEIGHT_COPIES
import pytest

pytestmark = pytest.mark.unit


class Clocks:
    """Vector clocks for a trainer lane and one generator lane per name."""

    def __init__(self) -> None:
        self.vc: dict[str, dict[str, int]] = {}
        self.t = 0.0

    def emit(self, lane: str, ev: str, version: int, after: dict | None = None, **extra) -> dict:
        vc = self.vc.setdefault(lane, {})
        for k, v in (after or {}).items():
            vc[k] = max(vc.get(k, 0), v)
        vc[lane] = vc.get(lane, 0) + 1
        self.t += 0.01
        return {"t": self.t, "ev": ev, "version": version, "step": version - 1, "worker": lane.split("/")[0],
                "lane": lane, "vc": dict(vc), **extra}


def weight_log(steps: int, generators=("gen0", "gen1")) -> list[dict]:
    """Each step: trainer puts v and releases v-1; every generator fetches v and
    drops it before the next step's train (the graph orders them so)."""
    c, events, last_drops = Clocks(), [], {}
    for v in range(1, steps + 1):
        after = {}
        for drop in last_drops.values():
            after = {k: max(after.get(k, 0), x) for k, x in {**after, **drop["vc"]}.items()}
        put = c.emit("trainer/train", "weights_put", v, after, bytes=100)
        events.append(put)
        if v > 1:
            events.append(c.emit("trainer/train", "weights_released", v - 1))
        last_drops = {}
        for g in generators:
            events.append(c.emit(f"{g}/refit", "weights_fetched", v, put["vc"]))
            last_drops[g] = c.emit(f"{g}/refit", "weights_dropped", v)
            events.append(last_drops[g])
    return events


def sevens(events: list[dict]) -> list:
    return [v for v in check_events(events) if v.invariant == 7]


def test_each_step_keeps_at_most_two_versions():
    assert WEIGHT_COPIES == 2
    assert sevens(weight_log(6)) == []


def test_a_trainer_that_never_lets_a_version_go_is_caught():
    events = [e for e in weight_log(6) if not (e["ev"] == "weights_released" and e["version"] == 2)]
    found = sevens(events)
    assert len(found) == 1
    assert "[2, 3, 4]" in found[0].message and "version 4 was put" in found[0].message


def test_a_generator_that_keeps_what_it_fetched_is_caught():
    events = [e for e in weight_log(5) if not (e["ev"] == "weights_dropped" and e["worker"] == "gen1"
                                                and e["version"] == 1)]
    found = sevens(events)
    assert len(found) == 1 and "[1, 2, 3]" in found[0].message


def test_a_drop_the_clocks_do_not_order_before_the_put_counts_as_alive():
    events = weight_log(4)
    # gen0's drop of version 1 loses its link to the step after: its clock is unknown to the trainer.
    late = next(e for e in events if e["ev"] == "weights_dropped" and e["version"] == 1 and e["worker"] == "gen0")
    late["vc"] = {**late["vc"], "gen0/refit": 10 ** 6}
    assert len(sevens(events)) == 1

