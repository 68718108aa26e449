"""Invariant 9: with a reward model, every batch trained was scored by it
after its rollout ended and before the buffer took it, and the model's
weights never changed.

The evidence is the reward model's own events: `score_start` (after the
rollout's clock, which the delivery graph hands it) and `score_end` for each
batch; the scored batch's clock goes on to the controller's put, so a sample
that took it, and the training after it, are after its score_end. Its weights'
digest is logged at load (`worker_ready`) and at the run's end
(`weights_checked`), for every incarnation: all must be one. A batch restored
from a checkpoint was scored in the attempt before, whose log is archived.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterator

from pipeline.core.worker_names import REWARD_MODEL
from pipeline.tools.check_order import Violation, has_clock, of, t_
from pipeline.tools.check_chain import happened_before



def _before(a: dict, b: dict) -> bool:
    if has_clock(a) and has_clock(b):
        return happened_before(a, b)
    return a["t"] < b["t"]  # a log from before vector clocks: one host's times


def batches_scored_before_training(events: list[dict], run_start: dict | None) -> Iterator[Violation]:
    if not (run_start or {}).get("reward_model"):
        return
    yield from _weights_never_changed(events)
    restored = {e.get("batch") for e in of(events, "restore")}
    ends: dict[str, list[dict]] = defaultdict(list)
    for e in of(events, "rollout_end"):
        if not e.get("failed") and not e.get("abandoned"):
            ends[e.get("batch")].append(e)
    starts: dict[tuple, list[dict]] = defaultdict(list)   # (worker, batch) -> score_starts
    for e in of(events, "score_start"):
        starts[(e.get("worker"), e.get("batch"))].append(e)
    scored: dict[str, list[tuple[dict, dict]]] = defaultdict(list)  # batch -> (score_start, score_end)
    for end in of(events, "score_end"):
        begun = [s for s in starts[(end.get("worker"), end.get("batch"))] if _before(s, end)]
        if begun:
            scored[end.get("batch")].append((begun[-1], end))
    seen_steps = set()
    for ts in of(events, "train_start"):
        if ts.get("step") in seen_steps:   # the data-parallel ranks of one step share its batch
            continue
        seen_steps.add(ts.get("step"))
        for batch in ts.get("batches") or []:
            if batch in restored:
                continue
            before_training = [(s, e) for s, e in scored[batch] if _before(e, ts)]
            if not before_training:
                yield Violation(9, f"batch {batch} trained at step {ts.get('step')} ({t_(ts['t'])}) was not scored "
                                   "by the reward model before its training started", (ts, *ends[batch]))
                continue
            if not any(_before(rollout, s) for s, _ in before_training for rollout in ends[batch]):
                s, e = before_training[0]
                yield Violation(9, f"batch {batch}: the reward model's score on {s.get('worker')} "
                                   f"({t_(s['t'])}) is not after the rollout's end", (s, e, *ends[batch]))


def _weights_never_changed(events: list[dict]) -> Iterator[Violation]:
    mine = [e for e in events if str(e.get("worker", "")).startswith(REWARD_MODEL)
            and e.get("ev") in ("worker_ready", "weights_checked")]
    seen: dict[str, dict] = {}
    for e in mine:
        for digest in {e.get("weights"), e.get("loaded")} - {None}:
            seen.setdefault(digest, e)
    if len(seen) > 1:
        yield Violation(9, f"the reward model's weights changed during the run: {len(seen)} digests ("
                           + ", ".join(f"{d} on {e.get('worker')} at {t_(e['t'])}" for d, e in seen.items()) + ")",
                        tuple(seen.values()))
