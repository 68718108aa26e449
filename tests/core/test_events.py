"""The event log's files: each process's own, merged into events.jsonl at the end, read back by the tools."""
from __future__ import annotations

import json

import pytest

from pipeline.core.events import EventLog, load_events, merge_events

pytestmark = pytest.mark.unit


def _write(path, records, end="\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in records) + end)


def test_merge_interleaves_the_workers_files_by_time_keeping_ties_in_file_order(tmp_path):
    _write(tmp_path / "events" / "a.jsonl", [{"t": 0.1, "ev": "a1"}, {"t": 0.3, "ev": "a2"}, {"t": 0.5, "ev": "a3"}])
    # No newline after the last line: a file of a process that wrote nothing more.
    _write(tmp_path / "events" / "b.jsonl", [{"t": 0.2, "ev": "b1"}, {"t": 0.3, "ev": "b2"}], end="")
    _write(tmp_path / "events" / "c.jsonl", [])
    merge_events(tmp_path)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(x)["ev"] for x in lines] == ["a1", "b1", "a2", "b2", "a3"]
    assert [e["ev"] for e in load_events(tmp_path)] == ["a1", "b1", "a2", "b2", "a3"]


def test_a_clock_stepping_back_keeps_its_process_order_and_load_sorts(tmp_path):
    _write(tmp_path / "events" / "a.jsonl", [{"t": 0.4, "ev": "a1"}, {"t": 0.1, "ev": "a2"}])
    _write(tmp_path / "events" / "b.jsonl", [{"t": 0.2, "ev": "b1"}])
    merge_events(tmp_path)
    merged = [json.loads(x)["ev"] for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert sorted(merged) == ["a1", "a2", "b1"] and merged.index("a1") < merged.index("a2")
    assert [e["ev"] for e in load_events(tmp_path)] == ["a2", "b1", "a1"]


def test_loaded_events_share_their_keys(tmp_path):
    log = EventLog(tmp_path, "gen0", t0=0.0)
    for step in range(3):
        log.emit("refit_end", step=step, version=step + 1)
    log.close()
    merge_events(tmp_path)
    a, b, _ = load_events(tmp_path)
    key_a, key_b = (next(k for k in e if k == "version") for e in (a, b))
    lane_a, lane_b = (next(iter(e["vc"])) for e in (a, b))
    assert key_a is key_b and lane_a is lane_b
    assert (a["vc"], b["vc"]) == ({"gen0": 1}, {"gen0": 2})
