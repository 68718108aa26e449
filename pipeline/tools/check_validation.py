"""Invariant 2 for validations: a validation decodes every set it names with
the weights of the version it logs. That version is the one the latest refit
its worker finished before it installed, and no refit of that worker overlaps
it (the gate's weights stay loaded from the first set's decoding to the
last's). Proven from the vector clocks, as the rollouts' order is
(pipeline/tools/check_order.py)."""
from __future__ import annotations

from collections import defaultdict

from pipeline.tools.check_order import Judge, by_worker_step, end_t, has_clock, pair, t_


def validations_at_the_loaded_weights(events: list[dict], judge: Judge) -> None:
    refits = defaultdict(list)
    for fs, fe in pair(events, "refit_start", "refit_end", by_worker_step)[0]:
        refits[fs.get("worker")].append((fs, fe))
    for vs, ve in pair(events, "validation_start", "validation_end", by_worker_step)[0]:
        what = f"the validation of step {vs.get('step')} on {vs.get('worker')} (sets {vs.get('sets')})"
        if ve is not None and (ve.get("version"), ve.get("sets")) != (vs.get("version"), vs.get("sets")):
            judge.fail(2, f"{what} started with version {vs.get('version')} but ended with version "
                          f"{ve.get('version')} (sets {ve.get('sets')})", (vs, ve))
        mine = refits[vs.get("worker")]
        loaded = [fe for _, fe in mine if fe is not None and _before(judge, fe, vs)]
        # Versions rise by one per refit (invariant 5): the highest loaded before is the latest.
        version = max((fe.get("version") for fe in loaded), default=None)
        if version is not None and version != vs.get("version"):
            judge.fail(2, f"{what} is labelled version {vs.get('version')}, but the latest refit its worker "
                          f"finished before it loaded version {version}", (vs, *loaded))
        if ve is None:
            continue  # a validation that never ended is invariant 1's finding, against every rollout after it
        for fs, fe in mine:
            judge.order(
                2, (fs, fe, vs, ve),
                lambda: (fe is not None and judge.before(fe, vs)) or judge.before(ve, fs),
                wall_ok=not (fs["t"] < ve["t"] and vs["t"] < end_t(fe)),
                message=(f"{what} and the refit of step {fs.get('step')} are not ordered: the weights may have "
                         f"changed while it decoded (refit {t_(fs['t'])} to {t_(end_t(fe))}, validation "
                         f"{t_(vs['t'])} to {t_(ve['t'])})"),
                wall_message=(f"{what} ({t_(vs['t'])} to {t_(ve['t'])}) overlaps the refit of step "
                              f"{fs.get('step')} ({t_(fs['t'])} to {t_(end_t(fe))})"))


def _before(judge: Judge, a: dict, b: dict) -> bool:
    """By the clocks; by the times for a log without them (as Judge.order falls back)."""
    return judge.before(a, b) if has_clock(a) and has_clock(b) else a["t"] <= b["t"]
