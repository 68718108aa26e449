"""Check a run's event log against invariants 1-5 and 7-10 of DESIGN.md.

The log is the only evidence that the step graph's ordering held at run time,
so this checker knows the event schema and nothing of the driver: a bug in the
orchestration cannot hide a matching bug here.

Invariants 1 and 2 (order) and invariant 5's weight flow are proven from the
events' vector clocks, not their times (pipeline/tools/check_order.py): the verdict
holds whatever the hosts' clocks say. The wall-clock reading of the same pairs
is kept as a second opinion: `check_report` returns it as notes, which fail
nothing. Invariants 3-5 compare versions and counts, never two hosts' times.
Invariant 7, the bound on weight copies in the object store, is proven from
the clocks too (pipeline/tools/check_bounds.py), and so are agents' requests
inside their rollouts and their tokens' versions (pipeline/tools/check_agents.py).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Iterator

from pipeline.core.events import load_events
from pipeline.core.worker_names import DRIVER, TRAINER, first_rank_names
from pipeline.tools.check_agents import check_agents
from pipeline.tools.check_bounds import weight_copies_bounded
from pipeline.tools.check_sampling import flat_groups_never_trained
from pipeline.tools.check_scoring import batches_scored_before_training, batches_taught_before_sampling
from pipeline.tools.check_validation import validations_at_the_loaded_weights
from pipeline.tools.check_order import (
    Judge,
    Violation,
    by_wall_clock,
    delivering_rollout,
    env_steps_inside_their_rollouts,
    has_clock,
    of,
    rollouts,
    rollouts_clear_of_refits,
    rollouts_clear_of_validations,
    rollouts_run_the_loaded_version,
    t_,
    tokens_follow_the_refits,
    weights_come_from_the_trainer,
)

__all__ = ["Report", "Violation", "check_events", "check_report", "format_violation", "main"]

@dataclass(frozen=True)
class Report:
    violations: tuple[Violation, ...]  # the verdict
    notes: tuple[Violation, ...]       # wall-clock objections to pairs the vector clocks order: not failures
    fallbacks: int                     # ordering decisions taken by wall clock: events without vector clocks
    unclocked: int                     # events without a vector clock


def _relaunches(events: list[dict]) -> dict[str, int]:
    """A batch whose generator died (or whose run was resumed) is relaunched: one more start is allowed."""
    count: dict[str, int] = defaultdict(int)
    for e in of(events, "relaunch"):
        count[e.get("batch")] += 1
    return count


def one_version_per_trajectory(events: list[dict], judge: Judge) -> None:
    """Invariant 2's counts and versions: each rollout_end has its start, a batch
    starts once (plus once per relaunch), a rollout ends with the version it
    started with, and train_start's batch_versions are those of the rollouts
    that delivered the batches (their ends are before it)."""
    pairs, orphan_ends = rollouts(events)
    for e in orphan_ends:
        judge.fail(2, f"rollout_end of batch {e.get('batch')} on {e.get('worker')} at "
                      f"{t_(e['t'])} has no rollout_start", (e,))
    relaunched = _relaunches(events)
    starts: dict[str, list[list]] = defaultdict(list)   # batch -> [start, end or None]
    for rs, re_ in pairs:
        starts[rs.get("batch")].append([rs, re_])
    for e in of(events, "restore"):
        starts[e.get("batch")].append([e, e])            # restored from a checkpoint: arrived
    for batch, ss in starts.items():
        if len(ss) > 1 + relaunched.get(batch, 0):
            where = ", ".join(f"{s.get('worker')} at {t_(s['t'])}" for s, _ in ss)
            judge.fail(2, f"batch {batch} has {len(ss)} rollout_starts ({where})", [s for s, _ in ss])

    # A rollout's version is the one it started with, in both refit modes: an
    # inflight refit changes its tokens' versions (tokens_follow_the_refits), not that.
    for rs, re_ in pairs:
        if re_ is not None and not re_.get("abandoned") and re_.get("version") != rs.get("version"):
            judge.fail(2, (f"batch {rs.get('batch')} on {rs.get('worker')} started with version "
                           f"{rs.get('version')} at {t_(rs['t'])} but ended with version "
                           f"{re_.get('version')} at {t_(re_['t'])}"), (rs, re_))

    for ts in of(events, "train_start"):
        batches, versions = ts.get("batches") or [], ts.get("batch_versions")
        if not isinstance(versions, list) or len(versions) != len(batches):
            judge.fail(2, f"train_start of step {ts.get('step')} lists {len(batches)} batches "
                          f"but batch_versions is {versions!r}", (ts,))
            continue
        for batch, version in zip(batches, versions):
            if not starts.get(batch):
                judge.fail(2, f"batch {batch} trained at step {ts.get('step')} "
                              f"but no rollout of it ever started", (ts,))
                continue
            causal = delivering_rollout(batch, ts, starts[batch], judge)
            by_wall = _delivery_problems(batch, ts, version, by_wall_clock(ts, starts[batch]), starts[batch],
                                         "started")
            if causal is None:
                for message, evs in by_wall:
                    judge.fail(2, f"{message} (by wall clock: an event has no vector clock)", evs)
                continue
            problems = _delivery_problems(batch, ts, version, causal, starts[batch], "ended")
            for message, evs in problems:
                judge.fail(2, message, evs)
            for message, evs in [] if problems else by_wall:
                judge.notes.append(Violation(2, f"{message}; the vector clocks disagree, so the times are "
                                                "skewed, not the run", evs))


def _delivery_problems(batch: str, ts: dict, version, delivered: list[dict], starts: list[list],
                       verb: str) -> list[tuple[str, tuple]]:
    """What is wrong with the rollouts that delivered `batch` to train_start `ts`."""
    if not delivered:
        return [(f"batch {batch} trained at step {ts.get('step')} but no rollout of it {verb} before "
                 f"that training started", (ts, *(s for s, _ in starts)))]
    return [(f"train_start of step {ts.get('step')} says batch {batch} was generated with version "
             f"{version}, but its rollout on {s.get('worker')} ran with version {s.get('version')}", (s, ts))
            for s in delivered if s.get("version") != version]


def batch_ages_within_max_age(events: list[dict], run_start: dict | None) -> Iterator[Violation]:
    """Invariant 3: every batch trained at step s was generated with a version v, s - v <= max_age."""
    if run_start is None:
        yield Violation(3, "no run_start event: max_age unknown, batch ages not checked")
        return
    max_age = run_start.get("max_age")
    if not isinstance(max_age, int):
        yield Violation(3, f"run_start has max_age {max_age!r}, not an int", (run_start,))
        return
    # A malformed batch_versions is invariant 2's finding; fall back to the
    # newest version any rollout of the batch ran with, so the age is still checked.
    rollout_version: dict[str, int] = {}
    for e in events:
        if e.get("ev") in ("rollout_start", "restore") and isinstance(e.get("version"), int):
            rollout_version[e.get("batch")] = max(e["version"], rollout_version.get(e.get("batch"), e["version"]))
    for ts in of(events, "train_start"):
        step, versions = ts.get("step"), ts.get("batch_versions") or []
        for i, batch in enumerate(ts.get("batches") or []):
            version = versions[i] if i < len(versions) else rollout_version.get(batch)
            if not isinstance(version, int) or not isinstance(step, int):
                yield Violation(3, f"batch {batch} trained at step {step}: "
                                   f"generation version {version!r} unknown", (ts,))
            elif step - version > max_age:
                yield Violation(3, f"batch {batch} trained at step {step} was generated with "
                                   f"version {version}: age {step - version} > max_age {max_age}",
                                (run_start, ts))
            elif version > step:
                yield Violation(3, f"batch {batch} trained at step {step} claims version "
                                   f"{version}, newer than the trainer's weights", (ts,))


def _use(e: dict) -> str:
    if e.get("ev") == "train_start":
        return f"trained at step {e.get('step')} ({t_(e['t'])})"
    if e.get("ev") == "drop":
        return f"dropped as {e.get('reason')} ({t_(e['t'])})"
    return f"started on {e.get('worker')} ({t_(e['t'])})"


def each_batch_trained_once_or_dropped(events: list[dict], finished: bool) -> Iterator[Violation]:
    """Invariant 4, conservation: each launched batch is trained exactly once or dropped with a reason."""
    launches: dict[str, list[dict]] = defaultdict(list)
    uses: dict[str, list[dict]] = defaultdict(list)   # train_start or drop events
    seen: dict[str, list[dict]] = defaultdict(list)   # every event naming the batch
    for e in events:
        kind = e.get("ev")
        if kind in ("launch", "restore"):
            launches[e.get("batch")].append(e)
        elif kind == "train_start":
            for batch in e.get("batches") or []:
                # The data-parallel ranks of one step share its batch: one use.
                if not any(u.get("ev") == "train_start" and u.get("step") == e.get("step") for u in uses[batch]):
                    uses[batch].append(e)
                seen[batch].append(e)
        elif kind in ("drop", "rollout_start"):
            seen[e.get("batch")].append(e)
            if kind == "drop":
                uses[e.get("batch")].append(e)
    relaunched = _relaunches(events)
    for batch, ls in launches.items():
        if len(ls) > 1 + relaunched.get(batch, 0):
            yield Violation(4, f"batch {batch} launched {len(ls)} times ("
                               + ", ".join(f"to {e.get('worker')} at {t_(e['t'])}" for e in ls)
                               + ")", tuple(ls))
    for batch, us in uses.items():
        if len(us) > 1:
            yield Violation(4, f"batch {batch} used {len(us)} times: "
                               + ", ".join(_use(u) for u in us), tuple(us))
    for batch, es in seen.items():
        if batch not in launches:
            yield Violation(4, f"batch {batch} was never launched but was "
                               + ", ".join(_use(e) for e in es), tuple(es))
    # Without run_end, batches may still be in flight: absence proves nothing.
    if finished:
        for batch, ls in launches.items():
            if batch not in uses:
                first = ls[0]
                yield Violation(4, (
                    f"batch {batch} launched to {first.get('worker')} at {t_(first['t'])} for "
                    f"step {first.get('target')} was neither trained nor dropped"), (first,))


def generator_names(events: list[dict]) -> list[str]:
    """The workers that roll out and load weights: neither the driver nor a trainer rank."""
    names = {e.get("worker") for e in events if e.get("ev") in ("launch", "rollout_start", "refit_start", "refit_end")}
    return sorted(w for w in names if w != DRIVER and not str(w).startswith(TRAINER))


def versions_rise_by_one(events: list[dict], finished: bool) -> Iterator[Violation]:
    """Invariant 5: the weight version rises by exactly one per step, in the
    trainer and in every generator. Ends are taken in step order, not time order."""
    for ts in of(events, "train_start"):
        if ts.get("version") != ts.get("step"):
            yield Violation(5, f"train_start of step {ts.get('step')} at {t_(ts['t'])} has version "
                               f"{ts.get('version')}, expected {ts.get('step')}", (ts,))
    ends_by_rank: dict[str, list[dict]] = defaultdict(list)
    for e in of(events, "train_end"):
        ends_by_rank[e.get("worker")].append(e)
    for worker, ends in sorted(ends_by_rank.items()):  # every data-parallel rank
        yield from _rises_by_one(ends, worker)
    # The generators load what rank 0 exports.
    alone, among_several = first_rank_names(TRAINER)
    train_ends = ends_by_rank.get(alone) or ends_by_rank.get(among_several, [])

    refit_ends: dict[str, list[dict]] = defaultdict(list)
    for e in of(events, "refit_end"):
        refit_ends[e.get("worker")].append(e)
    for worker, ends in sorted(refit_ends.items()):
        yield from _rises_by_one(ends, worker)

    # A generator that died owes no refits from the step it died in; its
    # replacement owes them from the step whose weights it started with.
    died_at = {e.get("dead"): e.get("step") for e in of(events, "generator_died")}
    restarted = {e.get("worker") for e in of(events, "worker_start") if (e.get("incarnation") or 0) > 0}
    first_load = {w: min((e.get("step") for e in ends if isinstance(e.get("step"), int)), default=None)
                  for w, ends in refit_ends.items()}
    last_step = max((te.get("step") for te in train_ends if isinstance(te.get("step"), int)),
                    default=None)
    loads_of_step: dict[tuple, list[dict]] = defaultdict(list)
    for worker, ends in refit_ends.items():
        for e in ends:
            loads_of_step[(worker, e.get("step"))].append(e)
    generators = generator_names(events)
    for te in train_ends:
        step = te.get("step")
        for worker in generators:
            if not isinstance(step, int):
                continue
            if worker in died_at and isinstance(died_at[worker], int) and step >= died_at[worker]:
                continue
            if worker in restarted and (first_load.get(worker) is None or step < first_load[worker]):
                continue
            loaded = loads_of_step.get((worker, step), [])
            # The last trained step of an unfinished run may still be refitting.
            if not loaded and (finished or step != last_step):
                yield Violation(5, f"{worker} never loaded the weights of step {step} "
                                   f"(trainer version {te.get('version')} at {t_(te['t'])})", (te,))
            for e in loaded:
                if e.get("version") != te.get("version"):
                    yield Violation(5, (
                        f"{worker} loaded version {e.get('version')} for step {step} at "
                        f"{t_(e['t'])}, but the trainer produced version {te.get('version')}"),
                        (te, e))


def _rises_by_one(ends: list[dict], who: str) -> Iterator[Violation]:
    """Each end event has version step + 1, and each is one above the one before (in step order)."""
    prev = None
    for e in sorted(ends, key=lambda e: e.get("step") if isinstance(e.get("step"), int) else -1):
        step, version = e.get("step"), e.get("version")
        if not isinstance(step, int) or version != step + 1:
            yield Violation(5, f"{who}: {e.get('ev')} of step {step} at {t_(e['t'])} has version "
                               f"{version}, expected step + 1", (e,))
        if prev is not None and (not isinstance(version, int)
                                 or not isinstance(prev.get("version"), int)
                                 or version != prev["version"] + 1):
            yield Violation(5, (
                f"{who}: version went from {prev.get('version')} (step {prev.get('step')}, "
                f"{t_(prev['t'])}) to {version} (step {step}, {t_(e['t'])}), not up by one"),
                (prev, e))
        prev = e


def check_report(events: Iterable[dict]) -> Report:
    """The verdict on invariants 1-5 and 7-10, the wall clock's notes, and how much of
    the ordering had to be judged by wall clock."""
    events = sorted(events, key=lambda e: e["t"])
    run_start = next(iter(of(events, "run_start")), None)
    # A run that stopped on an error leaves batches in flight (they are in its
    # last checkpoint for --resume); only a clean end proves none was lost.
    finished = any(e.get("error") is None for e in of(events, "run_end"))
    drain = run_start is None or run_start.get("refit_mode", "drain") == "drain"
    judge = Judge(events)
    rollouts_clear_of_validations(events, judge)
    pairs = rollouts(events)[0]
    if drain:
        rollouts_clear_of_refits(events, pairs, judge)
    tokens_follow_the_refits(events, pairs, judge)
    env_steps_inside_their_rollouts(events, pairs, judge, drain,
                                    None if run_start is None else run_start.get("env_max_turns"))
    check_agents(events, pairs, judge, drain)
    rollouts_run_the_loaded_version(events, judge)
    validations_at_the_loaded_weights(events, judge)
    one_version_per_trajectory(events, judge)
    weights_come_from_the_trainer(events, judge, generator_names(events))
    weight_copies_bounded(events, judge)
    violations = [*judge.violations, *batch_ages_within_max_age(events, run_start),
                  *each_batch_trained_once_or_dropped(events, finished), *versions_rise_by_one(events, finished),
                  *flat_groups_never_trained(events, run_start),
                  *batches_scored_before_training(events, run_start),
                  *batches_taught_before_sampling(events, run_start)]
    return Report(tuple(sorted(violations, key=lambda v: v.invariant)), tuple(judge.notes), judge.fallbacks,
                  sum(1 for e in events if not has_clock(e)))


def check_events(events: Iterable[dict]) -> list[Violation]:
    """The verdict: every violation of invariants 1-5 and 7-10 (wall-clock notes left out)."""
    return list(check_report(events).violations)


def format_violation(v: Violation) -> str:
    lines = [f"invariant {v.invariant}: {v.message}"]
    lines += ["    " + json.dumps(e, separators=(",", ":")) for e in v.events]
    return "\n".join(lines)


MAX_NOTES = 10


def main(run_dir: str) -> int:
    try:
        events = load_events(run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"check-events: {e}", file=sys.stderr)
        return 2
    report = check_report(events)
    for v in report.violations:
        print(format_violation(v))
    for v in report.notes[:MAX_NOTES]:
        print(f"note (wall clock, invariant {v.invariant}): {v.message}")
    if len(report.notes) > MAX_NOTES:
        print(f"note: {len(report.notes) - MAX_NOTES} more wall-clock notes like these")
    if report.fallbacks:
        print(f"note: {report.unclocked} events have no vector clock (a log from before them?), so "
              f"{report.fallbacks} ordering checks fell back to wall-clock time, which holds on one host only")
    if not any(e.get("ev") == "run_end" and e.get("error") is None for e in events):
        print("note: the run did not finish cleanly (no run_end, or it ended on an error), so launched "
              "batches never trained or dropped are not counted as lost")
    print(f"{len(report.violations)} violations (invariants 1-5, 7-10) in {len(events)} events")
    return 1 if report.violations else 0
