"""Invariant 8: with dynamic sampling, no step trains on a flat group, and
the extra launches stay within their bound.

The evidence is the scorers', not the controller's: each rollout_end lists
the groups of its batch whose rewards were all equal (`flat_groups`), as the
generator scored them, or the reward model's score_end does, when the run has
one. The controller's sample logs every group it left out (`group_drop`, with
a reason). A batch trained at step s whose flat group was
not dropped is a violation, as is a launch of round k > the run's
`top_up_rounds` (run_start) or any top-up round in a run without them.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterator

from pipeline.tools.check_order import Violation, of


def flat_groups_never_trained(events: list[dict], run_start: dict | None) -> Iterator[Violation]:
    rounds = (run_start or {}).get("top_up_rounds") or 0
    for e in of(events, "launch"):
        if (e.get("round") or 0) > rounds:
            yield Violation(8, f"batch {e.get('batch')} was launched in top-up round {e.get('round')} "
                               f"of step {e.get('target')}, but the run allows {rounds}", (e,))
    if not rounds:
        return
    flat: dict[str, tuple[dict, set]] = {}
    # A reward model's score_end (after its rollout_end) lists the groups as they were trained.
    for e in [*of(events, "rollout_end"), *of(events, "score_end")]:
        if not e.get("failed") and not e.get("abandoned") and isinstance(e.get("flat_groups"), list):
            flat[e.get("batch")] = (e, set(e["flat_groups"]))
    dropped: dict[tuple, set] = defaultdict(set)   # (step, batch) -> groups left out
    for e in of(events, "group_drop"):
        dropped[(e.get("step"), e.get("batch"))] |= set(e.get("groups") or [])
    seen_steps = set()
    for ts in of(events, "train_start"):
        step = ts.get("step")
        if step in seen_steps:   # the data-parallel ranks of one step share its batch
            continue
        seen_steps.add(step)
        for batch in ts.get("batches") or []:
            end, groups = flat.get(batch, (None, set()))
            trained = sorted(groups - dropped[(step, batch)])
            if trained:
                yield Violation(8, f"step {step} trained flat groups {trained} of batch {batch} (all their "
                                   f"rewards equal, as {end.get('worker')} scored them) with dynamic sampling on",
                                (end, ts))
