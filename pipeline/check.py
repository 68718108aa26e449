"""Check a run's event log against invariants 1-5 of DESIGN.md.

The log is the only evidence that the step graph's ordering held at run time,
so this checker knows the event schema and nothing of the driver: a bug in the
orchestration cannot hide a matching bug here.
"""
from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

NOT_WORKERS = {"driver", "trainer"}


@dataclass(frozen=True)
class Violation:
    invariant: int
    message: str
    events: tuple[dict, ...] = ()


def load_events(run_dir: str | Path) -> list[dict]:
    """The run's events sorted by t: events.jsonl, or the per-worker files of a
    run that is still going or was killed before merging them."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    merged = run_dir / "events.jsonl"
    files = [merged] if merged.is_file() else sorted((run_dir / "events").glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no events.jsonl or events/*.jsonl in {run_dir}")
    events = []
    for path in files:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(event, dict) or not isinstance(event.get("t"), (int, float)):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object with a numeric 't'")
                events.append(event)
    events.sort(key=lambda e: e["t"])  # stable: equal times keep file order
    return events


def _t(t: float) -> str:
    return "end of log" if t == math.inf else f"{t:.3f}s"


def _end_t(end: dict | None) -> float:
    # An interval whose end was never logged (killed run, hung worker) is
    # treated as still open: that is the pessimistic reading.
    return math.inf if end is None else end["t"]


def _pair(events: list[dict], start: str, end: str,
          key: Callable[[dict], object]) -> tuple[list[tuple[dict, dict | None]], list[dict]]:
    """(start, end or None) pairs in start order, and the ends with no start."""
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
    return [(s, e) for s, e in pairs], orphans


def _of(events: Iterable[dict], kind: str) -> list[dict]:
    return [e for e in events if e.get("ev") == kind]


def _by_worker_step(e: dict) -> tuple:
    return e.get("worker"), e.get("step")


def _by_worker_batch(e: dict) -> tuple:
    return e.get("worker"), e.get("batch")


def _inv1(events: list[dict]) -> Iterator[Violation]:
    validations, _ = _pair(events, "validation_start", "validation_end", _by_worker_step)
    for rs in _of(events, "rollout_start"):
        for vs, ve in validations:
            if vs["t"] <= rs["t"] <= _end_t(ve):
                yield Violation(1, (
                    f"batch {rs.get('batch')} started on {rs.get('worker')} at {_t(rs['t'])} while "
                    f"validation of step {vs.get('step')} ran on {vs.get('worker')} "
                    f"({_t(vs['t'])} to {_t(_end_t(ve))})"), tuple(x for x in (vs, rs, ve) if x))


def _relaunches(events: list[dict]) -> dict[str, int]:
    """A batch whose generator died (or whose run was resumed) is relaunched: one more start is allowed."""
    count: dict[str, int] = defaultdict(int)
    for e in _of(events, "relaunch"):
        count[e.get("batch")] += 1
    return count


def _with_abandoned_ends(events: list[dict]) -> list[dict]:
    """A relaunch ends the dead worker's rollout of that batch: no data came of it."""
    out = []
    for e in events:
        out.append(e)
        if e.get("ev") == "relaunch" and e.get("of"):
            out.append({**e, "ev": "rollout_end", "worker": e["of"], "abandoned": True})
    return out


def _inv2(events: list[dict], drain: bool) -> Iterator[Violation]:
    rollouts, orphan_ends = _pair(_with_abandoned_ends(events), "rollout_start", "rollout_end", _by_worker_batch)
    for e in orphan_ends:
        if not e.get("abandoned"):
            yield Violation(2, f"rollout_end of batch {e.get('batch')} on {e.get('worker')} at "
                               f"{_t(e['t'])} has no rollout_start", (e,))
    relaunched = _relaunches(events)
    starts: dict[str, list[dict]] = defaultdict(list)
    for rs, _ in rollouts:
        starts[rs.get("batch")].append(rs)
    for e in _of(events, "restore"):
        starts[e.get("batch")].append(e)
    for batch, ss in starts.items():
        if len(ss) > 1 + relaunched.get(batch, 0):
            where = ", ".join(f"{s.get('worker')} at {_t(s['t'])}" for s in ss)
            yield Violation(2, f"batch {batch} has {len(ss)} rollout_starts ({where})", tuple(ss))

    # In-flight weight updates would legitimately break both checks below;
    # only drain mode promises a rollout never sees its engine's weights change.
    if drain:
        refits: dict[str, list[tuple[dict, dict | None]]] = defaultdict(list)
        for fs, fe in _pair(events, "refit_start", "refit_end", _by_worker_step)[0]:
            refits[fs.get("worker")].append((fs, fe))
        for rs, re_ in rollouts:
            if re_ is not None and not re_.get("abandoned") and re_.get("version") != rs.get("version"):
                yield Violation(2, (
                    f"batch {rs.get('batch')} on {rs.get('worker')} started with version "
                    f"{rs.get('version')} at {_t(rs['t'])} but ended with version "
                    f"{re_.get('version')} at {_t(re_['t'])}"), (rs, re_))
            for fs, fe in refits.get(rs.get("worker"), []):
                # Strict: a refit may begin at the instant the drained rollout ends.
                if rs["t"] < _end_t(fe) and fs["t"] < _end_t(re_):
                    yield Violation(2, (
                        f"rollout of batch {rs.get('batch')} on {rs.get('worker')} "
                        f"({_t(rs['t'])} to {_t(_end_t(re_))}) overlaps its refit for step "
                        f"{fs.get('step')} ({_t(fs['t'])} to {_t(_end_t(fe))})"),
                        tuple(sorted((x for x in (rs, re_, fs, fe) if x), key=lambda x: x["t"])))

    for ts in _of(events, "train_start"):
        batches, versions = ts.get("batches") or [], ts.get("batch_versions")
        if not isinstance(versions, list) or len(versions) != len(batches):
            yield Violation(2, f"train_start of step {ts.get('step')} lists {len(batches)} batches "
                               f"but batch_versions is {versions!r}", (ts,))
            continue
        for batch, version in zip(batches, versions):
            ss = [s for s in starts.get(batch, []) if s["t"] <= ts["t"]]
            if not ss:
                yield Violation(2, f"batch {batch} trained at step {ts.get('step')} "
                                   f"but no rollout of it ever started", (ts,))
            for s in ss[-1:]:  # the rollout that delivered it: any earlier one was abandoned
                if s.get("version") != version:
                    yield Violation(2, (
                        f"train_start of step {ts.get('step')} says batch {batch} was generated "
                        f"with version {version}, but its rollout on {s.get('worker')} ran with "
                        f"version {s.get('version')}"), (s, ts))


def _inv3(events: list[dict], run_start: dict | None) -> Iterator[Violation]:
    if run_start is None:
        yield Violation(3, "no run_start event: max_age unknown, batch ages not checked")
        return
    max_age = run_start.get("max_age")
    if not isinstance(max_age, int):
        yield Violation(3, f"run_start has max_age {max_age!r}, not an int", (run_start,))
        return
    rollout_version = {}
    for rs in events:
        if rs.get("ev") in ("rollout_start", "restore"):
            rollout_version[rs.get("batch")] = rs.get("version")
    for ts in _of(events, "train_start"):
        step, versions = ts.get("step"), ts.get("batch_versions") or []
        for i, batch in enumerate(ts.get("batches") or []):
            # A malformed batch_versions is invariant 2's finding; fall back to
            # the rollout's own version so the age is still checked.
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
        return f"trained at step {e.get('step')} ({_t(e['t'])})"
    if e.get("ev") == "drop":
        return f"dropped as {e.get('reason')} ({_t(e['t'])})"
    return f"started on {e.get('worker')} ({_t(e['t'])})"


def _inv4(events: list[dict], finished: bool) -> Iterator[Violation]:
    launches: dict[str, list[dict]] = defaultdict(list)
    uses: dict[str, list[dict]] = defaultdict(list)   # train_start or drop events
    seen: dict[str, list[dict]] = defaultdict(list)   # every event naming the batch
    for e in events:
        kind = e.get("ev")
        if kind in ("launch", "restore"):
            launches[e.get("batch")].append(e)
        elif kind == "train_start":
            for batch in e.get("batches") or []:
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
                               + ", ".join(f"to {e.get('worker')} at {_t(e['t'])}" for e in ls)
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
                    f"batch {batch} launched to {first.get('worker')} at {_t(first['t'])} for "
                    f"step {first.get('target')} was neither trained nor dropped"), (first,))


def _inv5(events: list[dict], finished: bool) -> Iterator[Violation]:
    for ts in _of(events, "train_start"):
        if ts.get("version") != ts.get("step"):
            yield Violation(5, f"train_start of step {ts.get('step')} at {_t(ts['t'])} has version "
                               f"{ts.get('version')}, expected {ts.get('step')}", (ts,))
    train_ends = _of(events, "train_end")
    yield from _rises_by_one(train_ends, "trainer")

    refit_ends: dict[str, list[dict]] = defaultdict(list)
    for e in _of(events, "refit_end"):
        refit_ends[e.get("worker")].append(e)
    for worker, ends in sorted(refit_ends.items()):
        yield from _rises_by_one(ends, worker)

    generators = sorted({e.get("worker") for e in events if e.get("ev") in (
        "launch", "rollout_start", "refit_start", "refit_end")} - NOT_WORKERS)
    # A generator that died owes no refits from the step it died in; its
    # replacement owes them from the step whose weights it started with.
    died_at = {e.get("dead"): e.get("step") for e in _of(events, "generator_died")}
    restarted = {e.get("worker") for e in _of(events, "worker_start") if (e.get("incarnation") or 0) > 0}
    first_load = {w: min((e.get("step") for e in ends if isinstance(e.get("step"), int)), default=None)
                  for w, ends in refit_ends.items()}
    last_step = max((te.get("step") for te in train_ends if isinstance(te.get("step"), int)),
                    default=None)
    for te in train_ends:
        step = te.get("step")
        for worker in generators:
            if not isinstance(step, int):
                continue
            if worker in died_at and isinstance(died_at[worker], int) and step >= died_at[worker]:
                continue
            if worker in restarted and (first_load.get(worker) is None or step < first_load[worker]):
                continue
            loaded = [e for e in refit_ends.get(worker, []) if e.get("step") == step]
            # The last trained step of an unfinished run may still be refitting.
            if not loaded and (finished or step != last_step):
                yield Violation(5, f"{worker} never loaded the weights of step {step} "
                                   f"(trainer version {te.get('version')} at {_t(te['t'])})", (te,))
            for e in loaded:
                if e.get("version") != te.get("version"):
                    yield Violation(5, (
                        f"{worker} loaded version {e.get('version')} for step {step} at "
                        f"{_t(e['t'])}, but the trainer produced version {te.get('version')}"),
                        (te, e))


def _rises_by_one(ends: list[dict], who: str) -> Iterator[Violation]:
    """Each end event has version step + 1, and each is one above the one before."""
    prev = None
    for e in ends:
        step, version = e.get("step"), e.get("version")
        if not isinstance(step, int) or version != step + 1:
            yield Violation(5, f"{who}: {e.get('ev')} of step {step} at {_t(e['t'])} has version "
                               f"{version}, expected step + 1", (e,))
        if prev is not None and (not isinstance(version, int)
                                 or not isinstance(prev.get("version"), int)
                                 or version != prev["version"] + 1):
            yield Violation(5, (
                f"{who}: version went from {prev.get('version')} (step {prev.get('step')}, "
                f"{_t(prev['t'])}) to {version} (step {step}, {_t(e['t'])}), not up by one"),
                (prev, e))
        prev = e


def check_events(events: Iterable[dict]) -> list[Violation]:
    events = sorted(events, key=lambda e: e["t"])
    run_start = next(iter(_of(events, "run_start")), None)
    # A run that stopped on an error leaves batches in flight (they are in its
    # last checkpoint for --resume); only a clean end proves none was lost.
    finished = any(e.get("error") is None for e in _of(events, "run_end"))
    drain = run_start is None or run_start.get("refit_mode", "drain") == "drain"
    return [*_inv1(events), *_inv2(events, drain), *_inv3(events, run_start),
            *_inv4(events, finished), *_inv5(events, finished)]


def format_violation(v: Violation) -> str:
    lines = [f"invariant {v.invariant}: {v.message}"]
    lines += ["    " + json.dumps(e, separators=(",", ":")) for e in v.events]
    return "\n".join(lines)


def main(run_dir: str) -> int:
    try:
        events = load_events(run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"check-events: {e}", file=sys.stderr)
        return 2
    violations = check_events(events)
    for v in violations:
        print(format_violation(v))
    if not any(e.get("ev") == "run_end" and e.get("error") is None for e in events):
        print("note: the run did not finish cleanly (no run_end, or it ended on an error), so launched "
              "batches never trained or dropped are not counted as lost")
    print(f"{len(violations)} violations (invariants 1-5) in {len(events)} events")
    return 1 if violations else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pipeline.check runs/<name>")
    sys.exit(main(sys.argv[1]))
