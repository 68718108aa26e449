"""Agent samples in the event log (pipeline/agents/sessions.py): each request of
an agent's session logs agent_request_start (with `loaded`, the version its
engine held as it was added) and agent_request_end (with `token_versions`, runs
of its sampled tokens' versions) on its generator's rollouts lane.

- Invariant 2: every agent event of a batch lies between the batch's
  rollout_start and rollout_end on its worker, and a request ends after it
  starts. Under refit_mode drain each request, from its start to its end (or
  to its sample's end, or its rollout's, when it was aborted), is ordered with
  every refit of its worker.
- Invariant 1, drain: each agent event of a batch is ordered with every
  validation on its worker.
- Invariant 2, versions: a request's `loaded` is one its generator held when
  it started: the last refit before it, or one the clocks leave unordered
  with its start; each token it sampled carries `loaded` or the version of a
  refit of its worker that the clocks put neither before its start nor after
  its end. A LoRA run's refit_end logs the adapter's version the same way.

Invariant 3 needs nothing more for an agent's model tokens: the trained ones
are rollout_end's `token_versions` (the trained table's column), none older
than the version its batch started with (tokens_follow_the_refits), whose
age batch_ages_within_max_age bounds. Validation samples (batch "val") are
checked for versions only: their requests are on the rollouts lane, which
the validate node's clock does not reach.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Iterator

from pipeline.tools.check_chain import Candidates, has_clock
from pipeline.tools.check_order import (
    Judge,
    Loads,
    by_worker_batch,
    by_worker_step,
    end_t,
    of,
    ordered_with_validations,
    pair,
    t_,
)

AGENT_EVENTS = ("agent_start", "agent_request_start", "agent_request_end", "agent_request_refused",
                "agent_failed", "agent_end")


def check_agents(events: list[dict], pairs: list[list], judge: Judge, drain: bool) -> None:
    """Every check of this module, on a log's events and its rollouts (check_order.rollouts)."""
    requests = agent_requests(events, pairs, judge)
    agent_events_inside_their_rollouts(events, pairs, judge, drain)
    if drain:
        agent_requests_clear_of_refits(events, requests, judge)
    agent_tokens_of_loaded_versions(events, requests, judge)


def _request_key(e: dict) -> tuple:
    return e.get("worker"), e.get("sample"), e.get("request")


def _what(e: dict) -> str:
    return (f"request {e.get('request')} of agent sample {e.get('sample')} (batch {e.get('batch')} on "
            f"{e.get('worker')}, {t_(e['t'])})")


def agent_requests(events: list[dict], pairs: list[list], judge: Judge) -> list[tuple[dict, dict | None, dict | None]]:
    """(agent_request_start, its end or None, where it stopped decoding or None) per request.
    An end must follow its own start. A request with no end was aborted when
    its sample ended: it stopped by its sample's next agent_end, or else by its
    rollout's end (a failed engine); None while neither came."""
    found, orphans = pair(events, "agent_request_start", "agent_request_end", _request_key)
    for e in orphans:
        judge.fail(2, f"agent_request_end of {_what(e)} has no agent_request_start before it", (e,))
    sample_ends: dict[tuple, list[dict]] = defaultdict(list)
    for e in of(events, "agent_end"):
        sample_ends[(e.get("worker"), e.get("sample"))].append(e)
    rollout_of = _rollouts_by_batch(pairs)
    out = []
    for start, end in found:
        if end is not None:
            judge.order(2, (start, end), lambda: judge.before(start, end), wall_ok=start["t"] <= end["t"],
                        message=f"agent_request_end of {_what(end)} is not after its agent_request_start "
                                f"({t_(start['t'])})",
                        wall_message=f"agent_request_end of {_what(end)} is before its start ({t_(start['t'])})")
            out.append((start, end, end))
            continue
        ends = sample_ends.get((start.get("worker"), start.get("sample")), [])
        later = ends[bisect.bisect_right([e["t"] for e in ends], start["t"]):]
        stop = later[0] if later else _rollout_containing(rollout_of, start)[1]
        out.append((start, None, stop))
    return out


def _rollouts_by_batch(pairs: list[list]) -> dict[tuple, list[list]]:
    by_batch: dict[tuple, list[list]] = defaultdict(list)
    for p in pairs:
        by_batch[by_worker_batch(p[0])].append(p)
    return by_batch


def _rollout_containing(by_batch: dict[tuple, list[list]], e: dict) -> tuple[dict | None, dict | None]:
    """The rollout of e's batch on e's worker that e belongs to: of several (a
    resumed run rolls a batch out again), the last to start before it."""
    mine = by_batch.get(by_worker_batch(e))
    if not mine:
        return None, None
    return next((p for p in reversed(mine) if p[0]["t"] <= e["t"]), mine[0])


def agent_events_inside_their_rollouts(events: list[dict], pairs: list[list], judge: Judge, drain: bool) -> None:
    """Invariant 2: each agent event of a batch is between its rollout's start
    and end (its sample is delivered after its last request). Under drain,
    invariant 1: each is ordered with every validation on its worker."""
    by_batch = _rollouts_by_batch(pairs)
    validations = [(vs, judge.ended_by_death(vs, ve, "validation_end"))
                   for vs, ve in pair(events, "validation_start", "validation_end", by_worker_step)[0]]
    index = Candidates(validations)
    for e in events:
        if e.get("ev") not in AGENT_EVENTS or e.get("batch") == "val":
            continue
        what = f"{e['ev']} of agent sample {e.get('sample')} (batch {e.get('batch')} on {e.get('worker')}, " \
               f"{t_(e['t'])})"
        rs, re_ = _rollout_containing(by_batch, e)
        if rs is None:
            judge.fail(2, f"{what} belongs to no rollout of its worker", (e,))
            continue
        judge.order(2, (rs, e, re_), lambda: judge.before(rs, e) and (re_ is None or judge.before(e, re_)),
                    wall_ok=rs["t"] <= e["t"] <= end_t(re_),
                    message=f"{what} is not inside its rollout (started {t_(rs['t'])}, ended {t_(end_t(re_))}): "
                            "its sample was delivered while its agent was still served",
                    wall_message=f"{what} falls outside its rollout ({t_(rs['t'])} to {t_(end_t(re_))})")
        if not drain:
            continue  # inflight: validation decodes beside the rollouts in flight, by design
        ordered_with_validations(e, what, validations, index, judge)


def _refits(events: list[dict], judge: Judge) -> list[tuple[dict, dict | None]]:
    return [(fs, judge.ended_by_death(fs, fe, "refit_end"))
            for fs, fe in pair(events, "refit_start", "refit_end", by_worker_step)[0]]


def agent_requests_clear_of_refits(events: list[dict], requests: list[tuple], judge: Judge) -> None:
    """Invariant 2, drain: no request of a batch decodes while its engine's
    weights change: it stopped before each refit of its worker began, or
    started after it ended."""
    refits = _refits(events, judge)
    index = Candidates(refits)
    for start, _, stop in requests:
        if start.get("batch") == "val":
            continue
        for fs, fe in (refits[i] for i in index.against(start, stop, start.get("worker"))):
            judge.order(
                2, (start, stop, fs, fe),
                lambda: (stop is not None and judge.before(stop, fs)) or (fe is not None and judge.before(fe, start)),
                wall_ok=not (start["t"] < end_t(fe) and fs["t"] < end_t(stop)),
                message=(f"{_what(start)} and the refit of step {fs.get('step')} are not ordered: the request "
                         f"neither stopped before the refit began nor started after it ended (wall clock: "
                         f"request {t_(start['t'])} to {t_(end_t(stop))}, refit {t_(fs['t'])} to {t_(end_t(fe))})"),
                wall_message=(f"{_what(start)} decoded until {t_(end_t(stop))}, across the refit of step "
                              f"{fs.get('step')} ({t_(fs['t'])} to {t_(end_t(fe))})"))


def agent_tokens_of_loaded_versions(events: list[dict], requests: list[tuple], judge: Judge) -> None:
    """Invariant 2: each request started with weights its generator held, and
    each token it sampled carries a version its generator held while it decoded."""
    refits = _refits(events, judge)
    index = Candidates(refits)
    loads: dict[str, list[dict]] = defaultdict(list)
    for fe in of(events, "refit_end"):
        loads[fe.get("worker")].append(fe)
    latest = {worker: Loads(mine, worker in judge.deaths) for worker, mine in loads.items()}

    def unordered(start: dict, end: dict) -> Iterator[dict]:
        """The refit_ends of start's worker neither before `start` nor after `end`."""
        for _, fe in (refits[i] for i in index.against(start, end, start.get("worker"))):
            if fe is not None and not fe.get("abandoned") \
                    and not _precedes(fe, start, judge) and not _precedes(end, fe, judge):
                yield fe

    for start, end, _ in requests:
        worker, loaded = start.get("worker"), start.get("loaded")
        last = _last_load(latest.get(worker), start, judge)
        held = None if last is None else {last.get("version"), *(fe.get("version") for fe in unordered(start, start))}
        if held is not None and loaded not in held:
            judge.fail(2, f"{_what(start)} says its engine held version {loaded}, but its generator held "
                          f"{sorted(held, key=str)} then (the last refit before it: step {last.get('step')}, "
                          f"{t_(last['t'])})", (last, start))
        if end is None:
            continue
        runs = end.get("token_versions")
        if not isinstance(runs, list) or not all(isinstance(r, list) and len(r) == 2 for r in runs):
            judge.fail(2, f"agent_request_end of {_what(end)} has token_versions {runs!r}, not runs "
                          "[[version, tokens], ...]", (end,))
            continue
        allowed = {loaded, *(fe.get("version") for fe in unordered(start, end))}
        strays = sorted({v for v, _ in runs if v not in allowed}, key=str)
        if strays:
            judge.fail(2, f"{_what(start)} sampled tokens of version {strays} (runs {runs}), which its generator "
                          f"never held while it decoded: it started with version {loaded}, and the refits the "
                          f"clocks leave between its start and end loaded {sorted(allowed - {loaded}, key=str)}",
                       (start, end))


def _precedes(a: dict, b: dict, judge: Judge) -> bool:
    """A before B: by their clocks, or by their times where one has none."""
    if has_clock(a) and has_clock(b):
        return judge.before(a, b)
    judge.fallbacks += 1
    return a["t"] < b["t"]


def _last_load(loads: Loads | None, start: dict, judge: Judge) -> dict | None:
    """The last refit_end of the worker before `start`; None before its first
    (the run's first weights, which the log does not name)."""
    if loads is None:
        return None
    if has_clock(start) and loads.clocked:
        return loads.latest_before(start, judge)
    judge.fallbacks += 1
    return loads.latest_by_time(start["t"])
