"""Structured event log: one JSONL file per worker, merged at the end of a run.

Each process appends to its own file so that no actor call is spent on
logging; `t` is seconds since the run's start, taken from one shared epoch.

Every event also carries a vector clock, `vc` ({lane: count}), and its `lane`.
A lane is one sequence of events that the code runs one after another: each
node of a worker (`gen0/refit`, `controller/resume`), a generator's rollout
thread (`gen0/rollouts`), and the worker itself for what happens outside nodes
(`gen0`: begin_run; `driver`). An event counts one up on its lane after its
lane has merged the clocks of whatever it waited for: the tokens a node takes,
the rollout thread a refit joins, the batches sample takes. So event A
happened before event B exactly when A's `vc` is <= B's entry by entry, and
that holds across hosts whatever their clocks say; `t` is for people.
Node lanes keep the graph's order honest: two nodes of one actor share nothing
in the clock unless the graph (or a join) orders them.
"""
from __future__ import annotations

import heapq
import json
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from dags.tokens import Clock
from pipeline.core.jsonl import JsonLineError, json_lines, loads_interned


class EventLog:
    def __init__(self, run_dir: str | Path, worker: str, t0: float):
        self.worker = worker
        self.t0 = t0
        path = Path(run_dir) / "events" / f"{worker}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)
        # A generator's rollout thread and its graph-node calls both log.
        self._lock = threading.Lock()
        self._clocks: dict[str, dict[str, int]] = {}   # lane -> its vector clock
        self._here = threading.local()                  # this thread's lane

    def _lane(self) -> str:
        return getattr(self._here, "lane", None) or self.worker

    def current_lane(self) -> str:
        """The lane this thread logs on."""
        return self._lane()

    @contextmanager
    def lane(self, name: str, *after: Clock) -> Iterator[None]:
        """Log this thread's events on lane `name`, after the events `after` carries."""
        outer = getattr(self._here, "lane", None)
        self._here.lane = name
        try:
            self.merge(*after)
            yield
        finally:
            self._here.lane = outer

    def merge(self, *clocks: Clock) -> None:
        """This thread's lane has seen everything these clocks have (a token, a joined thread)."""
        with self._lock:
            _merge_into(self._clocks.setdefault(self._lane(), {}), clocks)

    def now(self) -> Clock:
        """This thread's lane's clock: what a token or message sent from here carries."""
        with self._lock:
            return tuple(sorted(self._clocks.get(self._lane(), {}).items()))

    def emit(self, ev: str, step: int | None = None, version: int | None = None, **extra) -> float:
        with self._lock:
            lane = self._lane()
            vc = self._clocks.setdefault(lane, {})
            vc[lane] = vc.get(lane, 0) + 1
            # Under the lock, so one process's times are in the order of its clocks.
            t = time.time() - self.t0
            record = {"t": round(t, 6), "ev": ev, "step": step, "version": version, "worker": self.worker,
                      **extra, "lane": lane, "vc": dict(vc)}
            self._file.write(json.dumps(record) + "\n")
        return t

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _merge_into(vc: dict[str, int], clocks: Iterable[Clock]) -> None:
    for clock in clocks:
        for lane, count in clock:
            if count > vc.get(lane, 0):
                vc[lane] = count


def merge_events(run_dir: str | Path) -> Path:
    """Merge events/*.jsonl into events.jsonl, ordered by time.

    Streamed, a line at a time from each file: a day's log is gigabytes as
    Python objects. Each process writes its times in order (EventLog.emit), so
    the files are merged, not sorted; were a host's clock to step back, its
    events would keep their own order there, and load_events sorts anyway."""
    run_dir = Path(run_dir)
    out = run_dir / "events.jsonl"
    tmp = out.with_suffix(".jsonl.tmp")
    with ExitStack() as stack:
        parts = [stack.enter_context(open(p)) for p in sorted((run_dir / "events").glob("*.jsonl"))]
        timed = [((json.loads(line)["t"], line if line.endswith("\n") else line + "\n")
                  for line in part if line.strip()) for part in parts]
        with open(tmp, "w") as f:
            for _, line in heapq.merge(*timed, key=lambda pair: pair[0]):
                f.write(line)
    tmp.replace(out)
    return out


def unfinished_nodes(run_dir: str | Path, step: int) -> list[tuple[str, str]]:
    """(node, worker) pairs that started at `step` and have not ended: what a stuck step waits on."""
    started: dict[tuple[str, str], int] = {}
    for part in sorted((Path(run_dir) / "events").glob("*.jsonl")):
        with open(part) as f:
            for line in f:
                if '"node_' not in line:
                    continue
                record = json.loads(line)
                if record["step"] != step:
                    continue
                key = (record["node"], record["worker"])
                started[key] = started.get(key, 0) + (1 if record["ev"] == "node_start" else -1)
    return [key for key, open_count in started.items() if open_count > 0]


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
            try:
                for lineno, event in json_lines(f, loads_interned):
                    if not isinstance(event, dict) or not isinstance(event.get("t"), (int, float)):
                        raise ValueError(f"{path}:{lineno}: expected a JSON object with a numeric 't'")
                    events.append(event)
            except JsonLineError as e:
                raise ValueError(f"{path}:{e.line}: not valid JSON ({e.msg})") from None
    events.sort(key=lambda e: e["t"])  # stable: equal times keep file order
    return events
