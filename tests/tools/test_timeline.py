"""trace.json and the Gantt chart from a run's events."""
from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest

from dags.step_graph import build_step_graph
from pipeline.config import load_config
from tests.support.pooled_run import train_on
from pipeline.core.events import load_events
from pipeline.tools.render import describe, graph_for_config
from pipeline.run.trace import write_trace
from pipeline.tools.timeline import timeline_main

pytestmark = pytest.mark.sim

PAIRS = {"node": ("node_start", "node_end"), "generation": ("rollout_start", "rollout_end"),
         "refit": ("refit_start", "refit_end"), "validation": ("validation_start", "validation_end"),
         "training": ("train_start", "train_end")}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory, sim_pool):
    """Four simulated steps on two generators; the session's actors, so Ray starts once."""
    out = tmp_path_factory.mktemp("runs")
    cfg = load_config("examples/sim_grpo.yaml", [f"run.output_dir={out}", "run.name=t", "run.steps=4",
                                                 "generation.num_generators=2"])
    train_on(cfg, sim_pool.first(2), quiet=True)
    return out / "t"


def test_trace_matches_the_event_log(sim_run):
    events = load_events(sim_run)
    doc = json.loads(write_trace(sim_run).read_text())
    trace = doc["traceEvents"]
    assert trace and all({"ph", "ts", "pid", "tid", "name"} <= e.keys() for e in trace)
    names = {e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"controller", "trainer", "gen0", "gen1", "gen0 rollouts", "gen1 rollouts"} <= names
    spans = [e for e in trace if e["ph"] == "X"]
    for cat, (start, end) in PAIRS.items():
        starts = sorted(round(e["t"] * 1e6) for e in events if e["ev"] == start)  # t has 6 decimals
        assert sum(e["ev"] == end for e in events) == len(starts) > 0, cat
        assert sorted(e["ts"] for e in spans if e["cat"] == cat) == starts, cat
    assert all(e["dur"] >= 0 and "unfinished" not in e["args"] for e in spans)
    ends = sorted(round(e["t"] * 1e6) for e in events if e["ev"] in {end for _, end in PAIRS.values()})
    assert sorted(e["ts"] + e["dur"] for e in spans) == ends
    counts = Counter(e["name"] for e in trace if e["ph"] == "i")
    assert counts["run_start"] == counts["run_end"] == 1
    launches = [e for e in events if e["ev"] == "launch"]
    assert sum(n.startswith("launch ") for n in counts.elements()) == len(launches)
    assert {e["name"] for e in spans if e["cat"] == "generation"} == {f"rollout {e['batch']}" for e in launches}
    rollout = next(e for e in spans if e["cat"] == "generation")
    assert {"version", "target", "batch"} <= rollout["args"].keys()
    assert {e["args"]["step"] for e in spans if e["cat"] == "training"} == {0, 1, 2, 3}


def test_spans_nest_on_every_track(sim_run):
    """Viewers draw a track's slices as a stack: two may not overlap without nesting."""
    trace = json.loads(write_trace(sim_run).read_text())["traceEvents"]
    by_tid = defaultdict(list)
    for e in trace:
        if e["ph"] == "X":
            by_tid[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for tid, spans in by_tid.items():
        stack: list[tuple] = []
        for s in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= s[0]:
                stack.pop()
            assert not stack or s[1] <= stack[-1][1], f"tid {tid}: {s} overlaps {stack[-1]}"
            stack.append(s)


def test_write_trace_is_idempotent(sim_run):
    first = write_trace(sim_run).read_bytes()
    assert write_trace(sim_run).read_bytes() == first
    assert not list(sim_run.glob("*.tmp"))


def test_timeline_png(sim_run, tmp_path, capsys):
    out = tmp_path / "tl.png"
    assert timeline_main(sim_run, out) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000
    assert str(out) in capsys.readouterr().out
    assert timeline_main(sim_run, None) == 0 and (sim_run / "timeline.png").stat().st_size > 0


def test_graph_from_live_actors_matches_the_unstarted_one(sim_run, sim_pool):
    """The driver's own graph (actor handles) draws the same as graph_for_config's (ClassNodes)."""
    def shape(graph):
        nodes, edges = describe(graph)
        name = {n.id: n.name for n in nodes}
        return [(n.name, n.worker) for n in nodes], sorted((name[e.src], name[e.dst], e.token) for e in edges)
    cfg = load_config("examples/sim_grpo.yaml", ["generation.num_generators=2"])
    assert shape(build_step_graph(sim_pool.first(2))) == shape(graph_for_config(cfg))


def test_missing_run_dir_is_named(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        write_trace(missing)
    assert timeline_main(missing, tmp_path / "x.png") == 2
    assert str(missing) in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_killed_run_with_errors_and_drops(tmp_path):
    """Unended spans, a failed node, a failed rollout, a drop and a stray end still draw."""
    run = tmp_path / "killed"
    (run / "events").mkdir(parents=True)
    ev = lambda t, ev, worker, **kw: {"t": t, "ev": ev, "step": kw.pop("step", 0), "version": 0,  # noqa: E731
                                      "worker": worker, **kw}
    records = [ev(0.0, "run_start", "driver", max_age=1, dag_mode="classic"),
               ev(0.1, "node_start", "gen0", node="collect"), ev(0.11, "launch", "gen0", batch="t0.g0"),
               ev(0.12, "node_end", "gen0", node="collect"),
               ev(0.13, "rollout_start", "gen0", batch="t0.g0", target=0),
               ev(0.2, "rollout_end", "gen0", batch="t0.g0", target=0, failed=True),
               ev(0.3, "node_start", "trainer", node="train"), ev(0.31, "train_start", "trainer"),
               ev(0.4, "node_error", "trainer", node="train", error="RuntimeError: boom"),
               ev(0.5, "drop", "controller", batch="t1.g0", reason="unused_at_end"),
               ev(0.55, "refit_end", "gen0"),
               ev(0.6, "node_start", "gen0", node="refit")]
    (run / "events" / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    trace = json.loads(write_trace(run).read_text())["traceEvents"]
    spans = {(e["cat"], e["name"]): e for e in trace if e["ph"] == "X"}
    assert spans["node", "train"]["args"]["error"] == "RuntimeError: boom"
    assert spans["generation", "rollout t0.g0"]["args"]["error"] == "failed"
    unfinished = {(e["cat"], e["name"]) for e in trace if e["ph"] == "X" and e["args"].get("unfinished")}
    assert unfinished == {("training", "train"), ("node", "refit")}
    unfinished = [spans[k] for k in unfinished]
    assert all(e["ts"] + e["dur"] == 600_000 for e in unfinished)  # open until the log's end
    instants = {e["name"] for e in trace if e["ph"] == "i"}
    assert {"launch t0.g0", "drop t1.g0", "refit_end", "run_start"} <= instants
    assert timeline_main(run, tmp_path / "k.png") == 0
    assert (tmp_path / "k.png").read_bytes()[:8] == PNG_MAGIC
