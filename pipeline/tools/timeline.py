"""A run's timeline as a Gantt chart PNG that shows generation overlapping
training, from the spans of its trace (pipeline/run/trace.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.core.events import load_events
from pipeline.run.trace import COLORS, _tracks, spans_and_instants


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
