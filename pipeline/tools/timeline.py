"""A run's events as a timeline: trace.json for Perfetto / chrome://tracing,
and a Gantt chart PNG that shows generation overlapping training.

Both read only the event log (pipeline.tools.check.load_events), so they work on a
finished run, a killed one, or one that is still going.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.tools.check import load_events

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
WORKER_ORDER = ("driver", "controller", "trainer")


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


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time covered by both interval sets (each merged first)."""
    def merge(xs):
        out: list[list[float]] = []
        for s, e in sorted(xs):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out
    total, ma, mb, i, j = 0.0, merge(a), merge(b), 0, 0
    while i < len(ma) and j < len(mb):
        total += max(0.0, min(ma[i][1], mb[j][1]) - max(ma[i][0], mb[j][0]))
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    return total


def plot_timeline(events: list[dict], out_png: Path, run_name: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    spans, instants = spans_and_instants(events)
    end_of_log = max((e["t"] for e in events), default=0.0)
    # The clock starts before Ray does (tens of seconds on a busy machine): show the run, not the wait.
    first = min((s.start["t"] for s in spans), default=0.0)
    width = max(end_of_log - first, 1e-3)
    drops = [e for e in instants if e.get("ev") == "drop"]
    rows = [w for w in _tracks(spans, drops) if " rollouts" not in w]
    rows = [w for w in rows if any(s.worker == w for s in spans) or any(e.get("worker") == w for e in drops)]
    y = {w: len(rows) - 1 - i for i, w in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(14, 1.4 + 0.75 * len(rows)), dpi=120)
    ivals: dict[str, list[tuple[float, float]]] = {k: [] for k in COLORS}
    for s in spans:
        t0, t1 = s.start["t"], (s.end["t"] if s.end is not None else end_of_log)
        ivals[s.kind].append((t0, t1))
        if s.kind == "node":  # thin, under the row: what the graph was doing
            ax.broken_barh([(t0, t1 - t0)], (y[s.worker] - 0.42, 0.12), color=COLORS["node"], linewidth=0)
            continue
        failed = s.end is None or "error" in s.extra
        ax.broken_barh([(t0, t1 - t0)], (y[s.worker] - 0.26, 0.6), facecolor=COLORS[s.kind],
                       edgecolor="black" if failed else "none", linewidth=0.8 if failed else 0,
                       hatch="///" if failed else None)
        label = {"generation": s.start.get("target"), "training": s.start.get("step")}.get(s.kind)
        if label is not None and (t1 - t0) > width / 80:
            ax.text((t0 + t1) / 2, y[s.worker] + 0.04, str(label), ha="center", va="center",
                    fontsize=7, color="white")
    if drops:  # a dropped batch is wasted generation: mark it where the buffer logged it
        ax.scatter([e["t"] for e in drops], [y[e["worker"]] + 0.04 for e in drops], marker="x",
                   color="#e15759", s=30, zorder=3)
    step_starts = {}
    for s in spans:  # a step begins when its graph's first node (sample) starts
        step = s.start.get("step")
        if s.kind == "node" and isinstance(step, int) and step >= 0:
            step_starts[step] = min(step_starts.get(step, s.start["t"]), s.start["t"])
    last_label = -float("inf")
    for step, t in sorted(step_starts.items()):
        ax.axvline(t, color="#555555", linestyle=":", linewidth=0.8, zorder=0)
        if t - last_label > width / 40:  # dense steps: label only as many as fit
            ax.text(t, len(rows) - 0.45, f"s{step}", fontsize=7, color="#555555", ha="left", va="bottom")
            last_label = t
    ax.set_yticks(list(y.values()), list(y.keys()))
    ax.set_ylim(-0.6, len(rows) - 0.1)
    ax.set_xlim(first - width * 0.01, end_of_log + width * 0.01)
    hidden = f" (start-up until {first:.1f} s not shown)" if first > width * 0.05 else ""
    ax.set_xlabel("seconds since run start" + hidden)
    ax.grid(axis="x", alpha=0.2)
    run_start = next((e for e in events if e.get("ev") == "run_start"), {})
    train_time = sum(b - a for a, b in ivals["training"])
    overlap = _overlap(ivals["generation"], ivals["training"])
    facts = [f"max_age {run_start['max_age']}" if "max_age" in run_start else "",
             f"{run_start['dag_mode']} DAG" if "dag_mode" in run_start else "",
             f"generation overlapped {100 * overlap / train_time:.0f}% of training time" if train_time else ""]
    ax.set_title(f"{run_name}: " + ", ".join(f for f in facts if f) + "\n"
                 "bars labelled with the step a batch is for (generation) or trains (training); "
                 "dotted lines: step starts", fontsize=10)
    legend = [Patch(color=COLORS[k], label=k if k != "node" else "graph node (thin)") for k in COLORS]
    if any(s.end is None or "error" in s.extra for s in spans):
        legend.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="failed / unfinished"))
    if drops:
        legend.append(Line2D([], [], marker="x", color="#e15759", linestyle="", label="dropped batch"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def timeline_main(run_dir: str | Path, out_png: str | Path | None = None) -> int:
    """Write the Gantt chart (default runs/<name>/timeline.png); 2 if the run cannot be read."""
    run_dir = Path(run_dir)
    try:
        events = load_events(run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"timeline: {e}", file=sys.stderr)
        return 2
    try:
        out = plot_timeline(events, Path(out_png) if out_png else run_dir / "timeline.png", run_dir.name)
    except ImportError as e:
        print(f"timeline: needs matplotlib ({e}): pip install matplotlib", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
