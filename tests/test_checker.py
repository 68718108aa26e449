"""The event-log checker: a valid log passes, each planted bug is caught by
exactly the invariant it breaks, and loading handles merged, per-worker and
broken files."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.check import Violation, check_events, format_violation, load_events, main


def run_log(steps=4, max_age=1, generators=("gen0", "gen1"), validate=(1,), start_step=0,
            groups=1, finished=True):
    """Events of a valid drain-mode run, in time order, one time unit apart.

    Batch "b<target>.<i>" goes to generators[(target + i) % n]. Its rollout
    starts right after its launch; it ends before the training step that needs
    it, and at the latest before its generator's next refit (drain).
    """
    t = 0.0

    def ev(kind, worker, step=None, version=None, **extra):
        nonlocal t
        t += 1.0
        return {"t": t, "ev": kind, "step": step, "version": version, "worker": worker, **extra}

    n = len(generators)
    launched = {}      # batch id -> (target, version, worker)
    in_flight = []     # batch ids whose rollout started and has not ended

    def launch(target, version):
        for i in range(groups):
            batch, worker = f"b{target}.{i}", generators[(target + i) % n]
            launched[batch] = (target, version, worker)
            in_flight.append(batch)
            yield ev("launch", worker, version=version, batch=batch, target=target)
            yield ev("rollout_start", worker, version=version, batch=batch, target=target)

    def finish(batches):
        for batch in batches:
            target, version, worker = launched[batch]
            in_flight.remove(batch)
            yield ev("rollout_end", worker, version=version, batch=batch, target=target)

    yield ev("run_start", "driver", max_age=max_age, steps=steps, start_step=start_step)
    for target in range(start_step, min(start_step + max_age + 1, steps)):
        yield from launch(target, start_step)
    for s in range(start_step, steps):
        mine = [b for b in launched if launched[b][0] == s]
        yield ev("node_start", "driver", step=s, node="sample")
        yield from finish([b for b in mine if b in in_flight])
        yield ev("node_end", "driver", step=s, node="sample")
        yield ev("train_start", "trainer", step=s, version=s, batches=mine,
                 batch_versions=[launched[b][1] for b in mine])
        yield from finish(list(in_flight))   # drain: overlaps training, ends before refit
        yield ev("train_end", "trainer", step=s, version=s + 1)
        for g in generators:
            yield ev("refit_start", g, step=s, version=s)
            yield ev("refit_end", g, step=s, version=s + 1)
        if s in validate:
            yield ev("validation_start", generators[0], step=s, version=s + 1)
            yield ev("validation_end", generators[0], step=s, version=s + 1)
        if s + 1 + max_age < steps:
            yield from launch(s + 1 + max_age, s + 1)
    if finished:
        yield ev("run_end", "driver")


def log(**kw) -> list[dict]:
    return list(run_log(**kw))


def find(events, kind, **match) -> dict:
    hits = [e for e in events if e["ev"] == kind and all(e.get(k) == v for k, v in match.items())]
    assert len(hits) == 1, (kind, match, hits)
    return hits[0]


def invariants(events) -> list[int]:
    return sorted({v.invariant for v in check_events(events)})


def test_valid_log_has_no_violations():
    events = log()
    assert check_events(events) == []
    kinds = {e["ev"] for e in events}
    assert {"launch", "rollout_start", "refit_end", "validation_start", "train_start"} <= kinds


@pytest.mark.parametrize("kw", [dict(max_age=0), dict(max_age=3, steps=2), dict(groups=2),
                                dict(start_step=2, steps=5), dict(generators=("g",)),
                                dict(finished=False)])
def test_valid_variants_have_no_violations(kw):
    assert check_events(log(**kw)) == []


def test_dropped_stale_batch_is_fine():
    events = log()
    end = find(events, "run_end")
    extra = [{"t": end["t"] - 0.5 + i * 0.1, "ev": ev, "step": None, "version": 3, "worker": "gen1",
              "batch": "x", "target": 4, **extra}
             for i, (ev, extra) in enumerate([("launch", {}), ("rollout_start", {}),
                                              ("rollout_end", {}), ("drop", {"reason": "stale"})])]
    assert check_events(events + extra) == []


# --- invariant 1 -----------------------------------------------------------------

def test_rollout_started_during_validation():
    events = log()
    vs, ve = find(events, "validation_start", step=1), find(events, "validation_end", step=1)
    rs = find(events, "rollout_start", batch="b3.0")
    rs["t"] = (vs["t"] + ve["t"]) / 2
    vs_ = check_events(events)
    assert [v.invariant for v in vs_] == [1]
    assert "b3.0" in vs_[0].message and "step 1" in vs_[0].message
    assert rs in vs_[0].events and vs in vs_[0].events


def test_unfinished_validation_runs_to_end_of_log():
    events = log()
    events.remove(find(events, "validation_end", step=1))
    vs_ = check_events(events)
    assert {v.invariant for v in vs_} == {1}
    assert "end of log" in vs_[0].message


# --- invariant 2 -----------------------------------------------------------------

def test_rollout_overlapping_refit_on_same_worker():
    events = log()
    re_ = find(events, "rollout_end", batch="b1.0")       # on gen1, in flight during step 0
    fs, fe = find(events, "refit_start", worker="gen1", step=0), find(events, "refit_end", worker="gen1", step=0)
    re_["t"] = (fs["t"] + fe["t"]) / 2
    vs_ = check_events(events)
    assert [v.invariant for v in vs_] == [2]
    assert "b1.0" in vs_[0].message and "gen1" in vs_[0].message and "refit" in vs_[0].message


def test_rollout_on_other_worker_may_overlap_refit():
    events = log()
    re_ = find(events, "rollout_end", batch="b1.0")       # gen1's rollout, gen0's refit
    fs, fe = find(events, "refit_start", worker="gen0", step=0), find(events, "refit_end", worker="gen0", step=0)
    re_["t"] = (fs["t"] + fe["t"]) / 2
    assert check_events(events) == []


def test_version_changed_mid_rollout():
    events = log()
    find(events, "rollout_end", batch="b2.0")["version"] = 2
    vs_ = check_events(events)
    assert [v.invariant for v in vs_] == [2]
    assert "started with version 1" in vs_[0].message and "ended with version 2" in vs_[0].message


def test_in_flight_mode_allows_version_change():
    events = log()
    find(events, "run_start")["refit_mode"] = "in_flight"
    find(events, "rollout_end", batch="b2.0")["version"] = 2
    assert check_events(events) == []


def test_batch_versions_disagree_with_rollout():
    events = log()
    for kind in ("rollout_start", "rollout_end"):
        find(events, kind, batch="b2.0")["version"] = 2
    assert invariants(events) == [2]


def test_batch_with_two_rollout_starts():
    events = log()
    rs = find(events, "rollout_start", batch="b0.0")
    events.insert(events.index(rs) + 1, {**rs, "t": rs["t"] + 0.5, "worker": "gen1"})
    assert invariants(events) == [2]


# --- invariant 3 -----------------------------------------------------------------

def test_batch_trained_too_old():
    events = log()              # b3.0 is generated with version 2 and trained at step 3
    for kind in ("launch", "rollout_start", "rollout_end"):
        find(events, kind, batch="b3.0")["version"] = 1
    find(events, "train_start", step=3)["batch_versions"] = [1]
    vs_ = check_events(events)
    assert [v.invariant for v in vs_] == [3]
    assert "b3.0" in vs_[0].message and "age 2 > max_age 1" in vs_[0].message


def test_missing_run_start():
    events = log()
    events.remove(find(events, "run_start"))
    assert invariants(events) == [3]


# --- invariant 4 -----------------------------------------------------------------

def test_batch_trained_twice():
    events = log()
    ts = find(events, "train_start", step=1)
    ts["batches"] = ["b1.0", "b0.0"]
    ts["batch_versions"] = [0, 0]
    vs_ = check_events(events)
    assert [v.invariant for v in vs_] == [4]
    assert "b0.0 used 2 times" in vs_[0].message and "step 0" in vs_[0].message


def test_batch_lost():
    events = log()
    ts = find(events, "train_start", step=2)
    ts["batches"], ts["batch_versions"] = [], []
    vs_ = check_events(events)
    assert [v.invariant for v in vs_] == [4]
    assert "b2.0" in vs_[0].message and "neither trained nor dropped" in vs_[0].message


def test_missing_batch_not_reported_while_run_unfinished():
    events = log(finished=False)
    ts = find(events, "train_start", step=2)
    ts["batches"], ts["batch_versions"] = [], []
    assert check_events(events) == []


def test_batch_dropped_and_trained():
    events = log()
    ts = find(events, "train_start", step=1)
    events.insert(events.index(ts) + 1, {"t": ts["t"] + 0.5, "ev": "drop", "step": None,
                                         "version": None, "worker": "driver",
                                         "batch": "b1.0", "reason": "stale"})
    vs_ = check_events(events)
    assert [v.invariant for v in vs_] == [4]
    assert "dropped as stale" in vs_[0].message and "trained at step 1" in vs_[0].message


def test_batch_never_launched():
    events = log()
    events.remove(find(events, "launch", batch="b0.0"))
    vs_ = check_events(events)
    assert [v.invariant for v in vs_] == [4]
    assert "never launched" in vs_[0].message


# --- invariant 5 -----------------------------------------------------------------

def test_trainer_version_skips_by_two():
    events = log()
    find(events, "train_end", step=1)["version"] = 3
    vs_ = check_events(events)
    assert {v.invariant for v in vs_} == {5}
    assert any("went from 1" in v.message and "to 3" in v.message for v in vs_)


def test_generator_refit_skips_a_version():
    events = log()
    find(events, "refit_end", worker="gen1", step=1)["version"] = 3
    vs_ = check_events(events)
    assert {v.invariant for v in vs_} == {5}
    assert all("gen1" in v.message for v in vs_)


def test_generator_missing_a_refit():
    events = log()
    events.remove(find(events, "refit_end", worker="gen0", step=2))
    events.remove(find(events, "refit_start", worker="gen0", step=2))
    assert invariants(events) == [5]


# --- loading, formatting, main ---------------------------------------------------

def write_jsonl(path, events):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_load_merged_file(tmp_path):
    events = log()
    write_jsonl(tmp_path / "events.jsonl", events)
    assert load_events(tmp_path) == events


def test_load_merges_worker_files_by_time(tmp_path):
    events = log()
    by_worker = {}
    for e in events:
        by_worker.setdefault(e["worker"], []).append(e)
    for worker, es in by_worker.items():
        write_jsonl(tmp_path / "events" / f"{worker}.jsonl", es)
    assert load_events(tmp_path) == events


def test_load_prefers_merged_file(tmp_path):
    write_jsonl(tmp_path / "events.jsonl", log())
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "gen0.jsonl").write_text("garbage\n")
    assert load_events(tmp_path) == log()


def test_load_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_events(tmp_path / "nope")


def test_load_dir_without_events(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_events(tmp_path)


def test_load_bad_line_names_file_and_line(tmp_path):
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "gen0.jsonl").write_text('{"t": 1, "ev": "x"}\n\n{"t": 2, "ev"\n')
    with pytest.raises(ValueError, match=r"gen0\.jsonl:3"):
        load_events(tmp_path)


def test_format_violation():
    e = {"t": 1.0, "ev": "drop", "batch": "b"}
    text = format_violation(Violation(4, "batch b used 2 times", (e, e)))
    assert text.splitlines() == ["invariant 4: batch b used 2 times",
                                 '    {"t":1.0,"ev":"drop","batch":"b"}',
                                 '    {"t":1.0,"ev":"drop","batch":"b"}']


def test_main_clean_run(tmp_path, capsys):
    events = log()
    write_jsonl(tmp_path / "events.jsonl", events)
    assert main(str(tmp_path)) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"0 violations (invariants 1-5) in {len(events)} events"]


def test_main_reports_violations(tmp_path, capsys):
    events = log()
    find(events, "rollout_end", batch="b2.0")["version"] = 2
    write_jsonl(tmp_path / "events.jsonl", events)
    assert main(str(tmp_path)) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("invariant 2: batch b2.0")
    assert out[1].startswith('    {"t":')
    assert out[-1] == f"1 violations (invariants 1-5) in {len(events)} events"


def test_main_notes_unfinished_run(tmp_path, capsys):
    write_jsonl(tmp_path / "events" / "driver.jsonl", log(finished=False))
    assert main(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "note: the run did not finish cleanly" in out and "0 violations" in out


def test_main_load_error(tmp_path, capsys):
    assert main(str(tmp_path / "missing")) == 2
    assert "missing" in capsys.readouterr().err


# --- properties ------------------------------------------------------------------

run_params = st.integers(1, 8).flatmap(lambda steps: st.fixed_dictionaries({
    "steps": st.just(steps),
    "max_age": st.integers(0, 3),
    "generators": st.integers(1, 3).map(lambda n: tuple(f"gen{i}" for i in range(n))),
    "validate": st.sets(st.integers(0, steps - 1)),
    "start_step": st.integers(0, steps - 1),
    "groups": st.integers(1, 2),
    "finished": st.booleans(),
}))


@settings(max_examples=150, deadline=None)
@given(run_params)
def test_any_generated_log_is_valid(kw):
    assert check_events(log(**kw)) == []


@settings(max_examples=100, deadline=None)
@given(run_params, st.randoms(use_true_random=False))
def test_losing_any_trained_batch_is_caught(kw, rnd: random.Random):
    events = log(**{**kw, "finished": True})
    starts = [e for e in events if e["ev"] == "train_start" and e["batches"]]
    ts = rnd.choice(starts)
    i = rnd.randrange(len(ts["batches"]))
    lost = ts["batches"][i]
    ts["batches"] = ts["batches"][:i] + ts["batches"][i + 1:]
    ts["batch_versions"] = ts["batch_versions"][:i] + ts["batch_versions"][i + 1:]
    vs_ = check_events(events)
    assert [v.invariant for v in vs_] == [4] and lost in vs_[0].message
