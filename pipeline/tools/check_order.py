"""The ordering half of the event-log checker (pipeline/tools/check.py).

Invariants 1 and 2 are about order: no rollout starts while a validation
runs; no rollout runs on an engine while its weights change. Event times come
from different processes, and across hosts their clocks disagree, so this
module proves order from each event's vector clock (`vc`, pipeline/core/events.py):
A happened before B when A's clock is <= B's entry by entry and not equal. A
clock grows only along the graph's edges, the drains of engine loops, the
batches `sample` takes and what the driver hands on, so a pair that no clock
orders is a pair the run did not order, however the timing fell.

Wall-clock times still give a second opinion. Where an event has no vector
clock (a log from before them) the wall clock decides, and `Judge.fallbacks`
counts those decisions. Where both exist and only the wall clock objects, the
finding is a note, not a violation: a clock skew, or a log from several hosts.
"""
from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

from pipeline.core.worker_names import TRAINER, first_rank_names
from pipeline.tools.check_chain import Candidates, chain_of, happened_before, has_clock


@dataclass(frozen=True)
class Violation:
    invariant: int
    message: str
    events: tuple[dict, ...] = ()


class Judge:
    """Collects the ordering findings: `violations` (the verdict), `notes`
    (the wall clock's objections to pairs the vector clocks order) and
    `fallbacks` (decisions taken by wall clock for lack of a vector clock)."""

    def __init__(self, events: list[dict]):
        self.violations: list[Violation] = []
        self.notes: list[Violation] = []
        self.fallbacks = 0
        # A dead worker logs nothing more: all its events are before the
        # driver's generator_died for it (logged once Ray reported it dead),
        # though the messages that would have carried its clock were lost.
        self.deaths = {e.get("dead"): e for e in of(events, "generator_died") if has_clock(e)}

    def ended_by_death(self, start: dict, end: dict | None, kind: str) -> dict | None:
        """`end`, or for an interval its dead worker never ended, its death."""
        death = self.deaths.get(start.get("worker"))
        if end is not None or death is None:
            return end
        return {**death, "ev": kind, "worker": start.get("worker"), "abandoned": True}

    def before(self, a: dict, b: dict) -> bool:
        """A happened before B: by their clocks, or A is a dead worker's and B is after its death."""
        if happened_before(a, b):
            return True
        death = None if a.get("abandoned") else self.deaths.get(a.get("worker"))
        return death is not None and (death is b or happened_before(death, b))

    def order(self, invariant: int, events: Iterable[dict | None], causal_ok: Callable[[], bool],
              wall_ok: bool, message: str, wall_message: str) -> None:
        """`causal_ok` says the clocks order the events as the invariant needs;
        `wall_ok` whether their times do. `message` explains a causal failure,
        `wall_message` a wall-clock one; both end with the events' times."""
        evs = tuple(sorted((e for e in events if e is not None), key=lambda e: e["t"]))
        if all(has_clock(e) for e in evs):
            if not causal_ok():
                self.violations.append(Violation(invariant, message, evs))
            elif not wall_ok:
                self.notes.append(Violation(invariant, f"{wall_message}; the vector clocks order them, "
                                                       "so the times are skewed, not the run", evs))
        else:
            self.fallbacks += 1
            if not wall_ok:
                self.violations.append(Violation(invariant, f"{wall_message} (by wall clock: an event "
                                                            "has no vector clock)", evs))

    def fail(self, invariant: int, message: str, events: Iterable[dict | None]) -> None:
        self.violations.append(Violation(invariant, message, tuple(e for e in events if e is not None)))


# ----------------------------------------------------------------- helpers

def t_(t: float) -> str:
    return "end of log" if t == math.inf else f"{t:.3f}s"


def end_t(end: dict | None) -> float:
    # An interval whose end was never logged (killed run, hung worker) is
    # treated as still open: that is the pessimistic reading.
    return math.inf if end is None else end["t"]


def of(events: Iterable[dict], kind: str) -> list[dict]:
    return [e for e in events if e.get("ev") == kind]


def by_worker_step(e: dict) -> tuple:
    return e.get("worker"), e.get("step")


def by_worker_batch(e: dict) -> tuple:
    return e.get("worker"), e.get("batch")


def pair(events: list[dict], start: str, end: str,
         key: Callable[[dict], object]) -> tuple[list[list], list[dict]]:
    """[start, end or None] pairs in start order, and the ends with no start.
    A key names one worker, so this order is one process's, never a comparison
    of two hosts' clocks."""
    pairs: list[list] = []
    open_by_key: dict[object, list[list]] = defaultdict(list)
    orphans = []
    for e in events:
        if e.get("ev") == start:
            pairs.append([e, None])
            open_by_key[key(e)].append(pairs[-1])
        elif e.get("ev") == end:
            waiting = open_by_key[key(e)]
            if waiting:
                waiting.pop(0)[1] = e
            else:
                orphans.append(e)
    return pairs, orphans


def rollouts(events: list[dict]) -> tuple[list[list], list[dict]]:
    """[rollout_start, rollout_end or None] pairs and orphan ends. A relaunch
    ends the dead worker's open rollout of that batch: no data came of it (the
    end is marked abandoned, with the relaunch's time and clock)."""
    pairs, orphans = pair(events, "rollout_start", "rollout_end", by_worker_batch)
    for e in of(events, "relaunch"):
        dead = next((p for p in pairs if p[1] is None and by_worker_batch(p[0]) == (e.get("of"), e.get("batch"))),
                    None)
        if e.get("of") and dead is not None:
            dead[1] = {**e, "ev": "rollout_end", "worker": e["of"], "abandoned": True}
    return pairs, orphans


def _step_key(e: dict) -> tuple:
    step = e.get("step")
    return (step if isinstance(step, int) else -math.inf, e["t"])


# ------------------------------------------------------------ invariant 1

def rollouts_clear_of_validations(events: list[dict], judge: Judge) -> None:
    """Invariant 1: for each rollout_start R and each validation (start S, end
    E) on any worker, E happened before R or R before S."""
    validations = [(vs, judge.ended_by_death(vs, ve, "validation_end"))
                   for vs, ve in pair(events, "validation_start", "validation_end", by_worker_step)[0]]
    index = Candidates(validations)
    for rs in of(events, "rollout_start"):
        for vs, ve in (validations[i] for i in index.against(rs, rs)):
            wall = (f"(wall clock: batch started {t_(rs['t'])}, validation {t_(vs['t'])} "
                    f"to {t_(end_t(ve))})")
            what = (f"batch {rs.get('batch')} started on {rs.get('worker')} and the validation of step "
                    f"{vs.get('step')} on {vs.get('worker')}")
            judge.order(
                1, (vs, rs, ve),
                lambda: judge.before(rs, vs) or (ve is not None and judge.before(ve, rs)),
                wall_ok=not vs["t"] <= rs["t"] <= end_t(ve),
                message=(f"{what} are not ordered: the batch started neither after the validation "
                         f"ended{'' if ve else ' (it never ended)'} nor before it began {wall}"),
                wall_message=(f"batch {rs.get('batch')} started on {rs.get('worker')} at {t_(rs['t'])} while "
                              f"validation of step {vs.get('step')} ran on {vs.get('worker')} "
                              f"({t_(vs['t'])} to {t_(end_t(ve))})"))


# ------------------------------------------------------------ invariant 2

def rollouts_clear_of_refits(events: list[dict], pairs: list[list], judge: Judge) -> None:
    """Invariant 2, drain mode: on one generator, every rollout (start, end)
    and refit (start, end) are ordered: the rollout ended before the refit
    started, or started after it ended."""
    refits = [(fs, judge.ended_by_death(fs, fe, "refit_end"))
              for fs, fe in pair(events, "refit_start", "refit_end", by_worker_step)[0]]
    index = Candidates(refits)
    for rs, re_ in pairs:
        for fs, fe in (refits[i] for i in index.against(rs, re_, rs.get("worker"))):
            times = (f"(wall clock: rollout {t_(rs['t'])} to {t_(end_t(re_))}, refit {t_(fs['t'])} "
                     f"to {t_(end_t(fe))})")
            judge.order(
                2, (rs, re_, fs, fe),
                lambda: (re_ is not None and judge.before(re_, fs)) or (fe is not None and judge.before(fe, rs)),
                # Strict: a refit may begin at the instant the drained rollout ends.
                wall_ok=not (rs["t"] < end_t(fe) and fs["t"] < end_t(re_)),
                message=(f"rollout of batch {rs.get('batch')} on {rs.get('worker')} and its refit for step "
                         f"{fs.get('step')} are not ordered: the rollout neither ended before the refit "
                         f"began nor started after it ended {times}"),
                wall_message=(f"rollout of batch {rs.get('batch')} on {rs.get('worker')} ({t_(rs['t'])} to "
                              f"{t_(end_t(re_))}) overlaps its refit for step {fs.get('step')} "
                              f"({t_(fs['t'])} to {t_(end_t(fe))})"))


def rollouts_run_the_loaded_version(events: list[dict], judge: Judge) -> None:
    """Invariant 2: a rollout carries the version its engine held: the last
    refit (in step order) before its start, on its worker, loaded that version.
    A rollout with no refit before it holds the run's first weights: unchecked."""
    loads: dict[str, list[dict]] = defaultdict(list)
    for e in of(events, "refit_end"):
        loads[e.get("worker")].append(e)
    latest = {worker: Loads(mine, worker in judge.deaths) for worker, mine in loads.items()}

    def mismatch(rs: dict, last: dict | None) -> dict | None:
        return last if last is not None and last.get("version") != rs.get("version") else None

    def claim(rs: dict, load: dict) -> str:
        return (f"batch {rs.get('batch')} started on {rs.get('worker')} at {t_(rs['t'])} with version "
                f"{rs.get('version')}, but the last refit before it there (step {load.get('step')}, "
                f"{t_(load['t'])}) loaded version {load.get('version')}")
    for rs in of(events, "rollout_start"):
        mine = latest.get(rs.get("worker")) or Loads([], False)
        wrong_by_wall = mismatch(rs, mine.latest_by_time(rs["t"]))
        if has_clock(rs) and mine.clocked:
            wrong = mismatch(rs, mine.latest_before(rs, judge))
            if wrong is not None:
                judge.fail(2, claim(rs, wrong) + " (by vector clock: the refits that are before it)", (wrong, rs))
            elif wrong_by_wall is not None:
                judge.notes.append(Violation(2, f"{claim(rs, wrong_by_wall)} by wall clock; the vector "
                                                "clocks disagree, so the times are skewed, not the run",
                                             (wrong_by_wall, rs)))
        else:
            judge.fallbacks += 1
            if wrong_by_wall is not None:
                judge.fail(2, claim(rs, wrong_by_wall) + " (by wall clock: an event has no vector clock)",
                           (wrong_by_wall, rs))


class Loads:
    """One worker's refit_ends in time order, and the latest (by step) of any
    first n of them: the last load before a rollout, by time or by clock,
    without a pass over all of them for each rollout."""

    def __init__(self, loads: list[dict], died: bool):
        self.loads = sorted(loads, key=lambda e: e["t"])
        self.times = [e["t"] for e in self.loads]
        self.clocked = all(has_clock(e) for e in self.loads)
        # A death orders the dead worker's loads before more than their clocks do.
        self.chain = None if died else chain_of([(e, e) for e in self.loads])
        self._latest: list[dict] = []
        for e in self.loads:
            best = self._latest[-1] if self._latest else None
            self._latest.append(e if best is None or _step_key(e) > _step_key(best) else best)

    def _first(self, n: int) -> dict | None:
        return self._latest[n - 1] if n else None

    def latest_by_time(self, t: float) -> dict | None:
        return self._first(bisect.bisect_right(self.times, t))

    def latest_before(self, rs: dict, judge: Judge) -> dict | None:
        if self.chain is not None:
            return self._first(self.chain.ends_before(rs))
        return max((e for e in self.loads if judge.before(e, rs)), key=_step_key, default=None)


def delivering_rollout(batch: str, ts: dict, starts: list[list], judge: Judge) -> list[dict] | None:
    """The rollout_start (or restore) of `batch` whose data train_start `ts`
    trained on: its end (a restore is its own end) happened before `ts`. Of
    several, the latest; an abandoned rollout delivered nothing. None when an
    event has no vector clock: then `by_wall_clock` is the answer."""
    done = [(s, e) for s, e in starts if e is not None and not e.get("abandoned")]
    if not (all(has_clock(x) for s, e in done for x in (s, e)) and has_clock(ts)):
        judge.fallbacks += 1
        return None
    before = [(s, e) for s, e in done if judge.before(e, ts)]
    return [s for s, e in before if not any(judge.before(e, e2) for _, e2 in before)]


def by_wall_clock(ts: dict, starts: list[list]) -> list[dict]:
    """The wall clock's answer: the last start of the batch at or before `ts`'s time."""
    return [s for s, _ in starts if s["t"] <= ts["t"]][-1:]


# ------------------------------------------------------------ invariant 5

def weights_come_from_the_trainer(events: list[dict], judge: Judge, generators: Iterable[str]) -> None:
    """Invariant 5: a generator's version v is the trainer's v: each refit_end
    for step s happened after the train_end of step s of the trainer (of its
    rank 0, which exports the weights, when there are several)."""
    train_end = {e.get("step"): e for e in of(events, "train_end") if e.get("worker") in first_rank_names(TRAINER)}
    gens = set(generators)
    for fe in of(events, "refit_end"):
        te = train_end.get(fe.get("step"))
        if te is None or fe.get("worker") not in gens:
            continue  # a resumed run's first weights were made by an earlier attempt
        judge.order(
            5, (te, fe), lambda: judge.before(te, fe), wall_ok=te["t"] <= fe["t"],
            message=(f"{fe.get('worker')} loaded the weights of step {fe.get('step')} (version "
                     f"{fe.get('version')}) without the trainer's train_end of that step before it: the "
                     f"weights did not come along the graph's edges (wall clock: trained {t_(te['t'])}, "
                     f"loaded {t_(fe['t'])})"),
            wall_message=(f"{fe.get('worker')} finished loading the weights of step {fe.get('step')} at "
                          f"{t_(fe['t'])}, before the trainer made them ({t_(te['t'])})"))


def tokens_follow_the_refits(events: list[dict], pairs: list[list], judge: Judge) -> None:
    """Invariant 2, per token (both refit modes; under drain each sample is one run
    of its launch version). rollout_end logs each sample's token versions as runs
    ([[version, tokens], ...]); an engine loop's refit_end logs, for each batch in
    flight, how many tokens each of its samples had when the load landed. Then:
    versions along a sample never decrease and none is older than the weights the
    batch started with; and of a refit installing V, the tokens before its
    position are older than V and those after are not. An agent's sample whose
    trained segment (rollout_end's `segments`) began after the refit (the
    refit's `segments` name an earlier one) has none older than V."""
    installs: dict[tuple, list[dict]] = defaultdict(list)   # (worker, batch) -> the refits it was in flight for
    for e in of(events, "refit_end"):
        if isinstance(e.get("positions"), dict):
            for batch in e["positions"]:
                installs[(e.get("worker"), batch)].append(e)
    for rs, re_ in pairs:
        runs = None if re_ is None or re_.get("failed") or re_.get("abandoned") else re_.get("token_versions")
        if not isinstance(runs, list):
            continue
        batch, worker, start = rs.get("batch"), rs.get("worker"), rs.get("version")
        where = f"batch {batch} on {worker}"
        for i, sample in enumerate(runs):
            versions = [v for v, _ in sample]
            if versions != sorted(set(versions)):
                judge.fail(2, f"{where}, sample {i}: token versions go {versions} along the sample; they may "
                              "only rise", (rs, re_))
            elif versions and isinstance(start, int) and versions[0] < start:
                judge.fail(2, f"{where}, sample {i}: its first token has version {versions[0]}, older than the "
                              f"version {start} the batch started with", (rs, re_))
        trained = re_.get("segments") or [1] * len(runs)
        for fe in installs.get((worker, batch), []):
            at = fe["positions"].get(batch)
            if not isinstance(at, list) or len(at) != len(runs):
                continue
            current = (fe.get("segments") or {}).get(batch) or [1] * len(runs)
            at = [p if then == last else 0 for p, then, last in zip(at, current, trained)]
            for i, (sample, position) in enumerate(zip(runs, at)):
                older = sum(n for v, n in sample if v < fe.get("version"))
                if older != position:
                    judge.fail(2, (f"{where}, sample {i}: version {fe.get('version')} was installed (refit of "
                                   f"step {fe.get('step')}, {t_(fe['t'])}) after its token {position}, but "
                                   f"{older} of its tokens carry older versions (runs {sample})"), (rs, fe, re_))


def env_steps_inside_their_rollouts(events: list[dict], pairs: list[list], judge: Judge, drain: bool,
                                    max_turns: int | None) -> None:
    """Multi-turn rollouts: an environment's step is part of its sample's rollout.
    Each env_step / env_failed of a batch lies between the batch's rollout_start
    and rollout_end (invariant 2: it is as old as the rollout, and a refit
    ordered with the rollout is ordered with it), no sample takes more than
    env.max_turns turns, and under refit_mode drain each is ordered with every
    validation on its worker (invariant 1: no part of a rollout runs during one)."""
    by_batch = {by_worker_batch(rs): (rs, re_) for rs, re_ in pairs}
    validations = [(vs, judge.ended_by_death(vs, ve, "validation_end"))
                   for vs, ve in pair(events, "validation_start", "validation_end", by_worker_step)[0]]
    index = Candidates(validations)
    for e in events:
        if e.get("ev") not in ("env_step", "env_failed") or e.get("batch") == "val":
            continue
        what = f"{e['ev']} of sample {e.get('sample')} (batch {e.get('batch')} on {e.get('worker')}, {t_(e['t'])})"
        rs, re_ = by_batch.get(by_worker_batch(e), (None, None))
        if rs is None:
            judge.fail(2, f"{what} belongs to no rollout of its worker", (e,))
            continue
        judge.order(2, (rs, e, re_), lambda: judge.before(rs, e) and (re_ is None or judge.before(e, re_)),
                    wall_ok=rs["t"] <= e["t"] <= end_t(re_),
                    message=f"{what} is not inside its rollout (started {t_(rs['t'])}, ended {t_(end_t(re_))})",
                    wall_message=f"{what} falls outside its rollout ({t_(rs['t'])} to {t_(end_t(re_))})")
        if max_turns is not None and e["ev"] == "env_step" and isinstance(e.get("turn"), int) \
                and e["turn"] > max_turns:
            judge.fail(2, f"{what} is turn {e['turn']}, beyond env.max_turns {max_turns}", (e,))
        if not drain:
            continue  # inflight: validation decodes beside the rollouts in flight, by design
        ordered_with_validations(e, what, validations, index, judge)


def ordered_with_validations(e: dict, what: str, validations: list, index: Candidates, judge: Judge) -> None:
    """Invariant 1 for a part of a rollout (an env step, an agent's request):
    before each validation on its worker began, or after it ended."""
    for vs, ve in (validations[i] for i in index.against(e, e, e.get("worker"))):
        judge.order(1, (vs, e, ve), lambda: judge.before(e, vs) or (ve is not None and judge.before(ve, e)),
                    wall_ok=not vs["t"] <= e["t"] <= end_t(ve),
                    message=(f"{what} and the validation of step {vs.get('step')} are not ordered: it came "
                             "neither before the validation began nor after it ended"),
                    wall_message=(f"{what} came during the validation of step {vs.get('step')} "
                                  f"({t_(vs['t'])} to {t_(end_t(ve))})"))
