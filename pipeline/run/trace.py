"""A run's events as trace.json for Perfetto / chrome://tracing, written at the
end of every run (the Gantt chart of the same spans: pipeline/tools/timeline.py).

It reads only the event log (pipeline.core.events.load_events), so it works on a
finished run, a killed one, or one that is still going.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.events import load_events
from pipeline.core.worker_names import CONTROLLER, DRIVER, TRAINER

# start event -> (end event, kind, key fields that pair them). A generator's
# rollouts run on their own thread, so their spans overlap its node spans
# without nesting: they get a track of their own, as a thread would.
SPANS = {
    "node_start": ("node_end", "node", ("worker", "node", "step")),
    "rollout_start": ("rollout_end", "generation", ("worker", "batch")),
    "refit_start": ("refit_end", "refit", ("worker", "step")),
    "validation_start": ("validation_end", "validation", ("worker", "step")),
    "train_start": ("train_end", "training", ("worker", "step")),
}
ENDS = {end: start for start, (end, _, _) in SPANS.items()}
COLORS = {"generation": "#59a14f", "training": "#4e79a7", "refit": "#f28e2b",
          "validation": "#b07aa1", "node": "#9d9d9d"}
WORKER_ORDER = (DRIVER, CONTROLLER, TRAINER)


@dataclass
class Span:
    kind: str
    worker: str
    start: dict
    end: dict | None = None            # None: never ended (killed run, failed node)
    extra: dict = field(default_factory=dict)
    lane: int = 0                      # batches generated together overlap: one lane each

    @property
    def track(self) -> str:
        if self.kind != "generation":
            return self.worker
        return f"{self.worker} rollouts" + (f" {self.lane + 1}" if self.lane else "")

    @property
    def name(self) -> str:
        s = self.start
        return {"node": str(s.get("node")), "generation": f"rollout {s.get('batch')}",
                "refit": "refit", "validation": "validation", "training": "train"}[self.kind]


def spans_and_instants(events: list[dict]) -> tuple[list[Span], list[dict]]:
    """Pair start/end events per key, first in first out; everything else is an instant."""
    spans: list[Span] = []
    open_: dict[tuple, list[Span]] = {}
    instants = []
    for e in events:
        ev = e.get("ev")
        if ev in SPANS:
            _, kind, key = SPANS[ev]
            spans.append(Span(kind, str(e.get("worker")), e))
            open_.setdefault((ev,) + tuple(e.get(k) for k in key), []).append(spans[-1])
        elif ev in ENDS or ev == "node_error":
            start = ENDS.get(ev, "node_start")  # a failed node logs node_error, never node_end
            waiting = open_.get((start,) + tuple(e.get(k) for k in SPANS[start][2]))
            if not waiting:  # an end without a start stays visible as a mark
                instants.append(e)
                continue
            span = waiting.pop(0)
            span.end = e
            if ev == "node_error" or e.get("failed"):
                span.extra["error"] = e.get("error") or "failed"
        else:
            instants.append(e)
    _assign_lanes([s for s in spans if s.kind == "generation"], end_of_log=max(
        (e["t"] for e in events), default=0.0))
    return spans, instants


def _assign_lanes(rollouts: list[Span], end_of_log: float) -> None:
    """Per worker, the first lane free at a rollout's start, so spans on a track never cross."""
    lane_ends: dict[str, list[float]] = {}
    for span in sorted(rollouts, key=lambda s: s.start["t"]):
        ends = lane_ends.setdefault(span.worker, [])
        end = span.end["t"] if span.end is not None else end_of_log
        free = next((i for i, e in enumerate(ends) if e <= span.start["t"]), len(ends))
        if free == len(ends):
            ends.append(end)
        ends[free] = end
        span.lane = free


def _tracks(spans: list[Span], instants: list[dict]) -> list[str]:
    workers = {s.worker for s in spans} | {str(e.get("worker")) for e in instants}
    def rank(w: str) -> tuple:
        return (WORKER_ORDER.index(w) if w in WORKER_ORDER else len(WORKER_ORDER), w)
    tracks = []
    for w in sorted(workers, key=rank):
        tracks.append(w)
        lanes = sorted({s.lane for s in spans if s.worker == w and s.kind == "generation"})
        tracks += [Span("generation", w, {}, lane=lane).track for lane in lanes]
    return tracks


def _us(t: float) -> int:
    # `t` is logged to the microsecond: whole microseconds lose nothing, and
    # integer ends make a child that ends with its parent nest exactly.
    return round(t * 1e6)


def _args(e: dict) -> dict:
    return {k: v for k, v in e.items() if k not in ("t", "ev", "worker") and v is not None}


def trace_events(events: list[dict], run_name: str) -> list[dict]:
    spans, instants = spans_and_instants(events)
    tracks = _tracks(spans, instants)
    tid = {t: i + 1 for i, t in enumerate(tracks)}
    end_of_log = max((e["t"] for e in events), default=0.0)
    out = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "ts": 0, "args": {"name": run_name}}]
    for track, i in tid.items():
        out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": i, "ts": 0, "args": {"name": track}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": i, "ts": 0,
                    "args": {"sort_index": i}})
    body = []
    for s in spans:
        end_t = s.end["t"] if s.end is not None else end_of_log
        args = {**_args(s.start), **s.extra}
        if s.end is not None and s.end.get("version") is not None:
            args["version_end"] = s.end["version"]
        if s.end is None:
            args["unfinished"] = True
        body.append({"ph": "X", "name": s.name, "cat": s.kind, "pid": 1, "tid": tid[s.track],
                     "ts": _us(s.start["t"]), "dur": _us(end_t) - _us(s.start["t"]), "args": args})
    for e in instants:
        name = f"{e['ev']} {e['batch']}" if e.get("batch") is not None else str(e.get("ev"))
        body.append({"ph": "i", "s": "t", "name": name, "cat": str(e.get("ev")), "pid": 1,
                     "tid": tid[str(e.get("worker"))], "ts": _us(e["t"]), "args": _args(e)})
    # Enclosing spans first on a tie, so viewers nest a node around its work.
    body.sort(key=lambda x: (x["ts"], -x.get("dur", 0)))
    return out + body


def write_trace(run_dir: str | Path) -> Path:
    """runs/<name>/trace.json from the event log; safe to call again (it rewrites the file)."""
    run_dir = Path(run_dir)
    events = load_events(run_dir)
    doc = {"traceEvents": trace_events(events, run_dir.name), "displayTimeUnit": "ms",
           "otherData": {"run": run_dir.name, "source": "events.jsonl", "time_origin": "run start"}}
    out = run_dir / "trace.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")))
    tmp.replace(out)   # a viewer never sees half a file
    return out
