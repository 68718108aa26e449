"""Structured event log: one JSONL file per worker, merged at the end of a run.

Each process appends to its own file so that no actor call is spent on
logging; `t` is seconds since the run's start, taken from one shared epoch.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class EventLog:
    def __init__(self, run_dir: str | Path, worker: str, t0: float):
        self.worker = worker
        self.t0 = t0
        path = Path(run_dir) / "events" / f"{worker}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)
        # A generator's rollout thread and its graph-node calls both log.
        self._lock = threading.Lock()

    def emit(self, ev: str, step: int | None = None, version: int | None = None, **extra) -> float:
        t = time.time() - self.t0
        record = {"t": round(t, 6), "ev": ev, "step": step, "version": version, "worker": self.worker, **extra}
        line = json.dumps(record)
        with self._lock:
            self._file.write(line + "\n")
        return t

    def close(self) -> None:
        with self._lock:
            self._file.close()


def merge_events(run_dir: str | Path) -> Path:
    """Merge events/*.jsonl into events.jsonl, ordered by time."""
    run_dir = Path(run_dir)
    records = []
    for part in sorted((run_dir / "events").glob("*.jsonl")):
        with open(part) as f:
            for line in f:
                if line.strip():
                    records.append(json.loads(line))
    records.sort(key=lambda r: r["t"])
    out = run_dir / "events.jsonl"
    tmp = out.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
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
