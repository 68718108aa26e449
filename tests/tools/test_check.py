"""The event-log checker: a valid log passes, each planted bug is caught by
exactly the invariant it breaks, and loading handles merged, per-worker and
broken files.

The hand-written logs (tests/support/hand_logs.py) carry the vector clocks a real run
gives its events. The ordering bugs are planted as a run would have them, by
leaving out one of the waits the clocks record (the drain, resume's wait for
validation, refit's for training); moving an event's time alone is a
wall-clock note, not a violation."""
from __future__ import annotations

import json

import pytest
from tests.support.hand_logs import add, find, log, without_clocks

from pipeline.core.events import load_events
from pipeline.tools.check import Violation, check_events, check_report, format_violation, main
from pipeline.tools.check_order import Judge

pytestmark = pytest.mark.unit


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
    refit = find(events, "refit_end", worker="gen1", step=3)  # gen1 holds version 4 from here
    launch = add(events, end["t"] - 0.5, "launch", "gen1", "gen1/collect", [refit], version=4, batch="x", target=6)
    start = add(events, end["t"] - 0.4, "rollout_start", "gen1", "gen1/rollouts", [launch], version=4, batch="x",
                target=6)
    stop = add(events, end["t"] - 0.3, "rollout_end", "gen1", "gen1/rollouts", [start], version=4, batch="x",
               target=6)
    add(events, end["t"] - 0.2, "drop", "controller", after=[stop], version=4, batch="x", reason="stale")
    assert check_events(events) == []


# --- invariant 1 -----------------------------------------------------------------

def test_rollout_not_ordered_after_validation():
    """resume did not wait for the validation: the next batch's start is not
    after it, though by the times it came later. The clocks catch it."""
    events = log(resume_waits_for_validation=False)
    vs, rs = find(events, "validation_start", step=1), find(events, "rollout_start", batch="b3.0")
    assert rs["t"] > find(events, "validation_end", step=1)["t"]
    vs_ = check_events(events)
    # Nor are the later refits ordered after the validation: its weights could change while it decodes.
    assert [v.invariant for v in vs_] == [1, 2, 2] and all("validation of step 1" in v.message for v in vs_[1:])
    assert "b3.0" in vs_[0].message and "step 1" in vs_[0].message and "not ordered" in vs_[0].message
    assert rs in vs_[0].events and vs in vs_[0].events
    assert check_events(without_clocks(events)) == []  # the wall clock alone sees nothing


def test_rollout_started_during_validation_by_the_times_only_is_a_note():
    events = log()
    vs, ve = find(events, "validation_start", step=1), find(events, "validation_end", step=1)
    rs = find(events, "rollout_start", batch="b3.0")
    rs["t"] = (vs["t"] + ve["t"]) / 2
    report = check_report(events)
    assert report.violations == ()
    assert [n.invariant for n in report.notes] == [1] and "b3.0" in report.notes[0].message
    assert "skewed" in report.notes[0].message
    # Without the clocks the same times are the verdict.
    vs_ = check_events(without_clocks(events))
    assert [v.invariant for v in vs_] == [1] and "by wall clock" in vs_[0].message


def test_unfinished_validation_runs_to_end_of_log():
    events = log()
    events.remove(find(events, "validation_end", step=1))
    vs_ = check_events(events)
    assert {v.invariant for v in vs_} == {1}
    assert "never ended" in vs_[0].message and "end of log" in vs_[0].message


# --- invariant 2 -----------------------------------------------------------------

def test_refit_without_the_drain():
    """The refits did not join the rollouts in flight: by the times they had
    ended (b1.0 on gen1, during step 0's training), but nothing orders them."""
    events = log(drain=False)
    vs_ = check_events(events)
    assert {v.invariant for v in vs_} == {2}
    assert any("b1.0" in v.message and "gen1" in v.message and "refit for step 0" in v.message for v in vs_)
    assert check_events(without_clocks(events)) == []


def test_rollout_overlapping_refit_by_the_times_only_is_a_note():
    events = log()
    re_ = find(events, "rollout_end", batch="b1.0")       # on gen1, in flight during step 0
    fs, fe = find(events, "refit_start", worker="gen1", step=0), find(events, "refit_end", worker="gen1", step=0)
    re_["t"] = (fs["t"] + fe["t"]) / 2
    report = check_report(events)
    assert report.violations == () and [n.invariant for n in report.notes] == [2]
    vs_ = check_events(without_clocks(events))
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


def test_in_flight_mode_keeps_a_rollouts_version():
    """Under inflight refits too, a rollout's version is the one it started
    with: its tokens' versions say what the refits changed."""
    events = log()
    find(events, "run_start")["refit_mode"] = "inflight"
    find(events, "rollout_end", batch="b2.0")["version"] = 2
    assert invariants(events) == [2]


def inflight(runs, positions) -> list[dict]:
    """A log whose batch b2.0 (version 1, on gen0) held tokens `runs` and was in
    flight, at `positions`, when gen0's refit of step 1 installed version 2."""
    events = log()
    find(events, "run_start")["refit_mode"] = "inflight"
    find(events, "rollout_end", batch="b2.0")["token_versions"] = runs
    find(events, "refit_end", worker="gen0", step=1)["positions"] = {"b2.0": positions}
    return events


def test_tokens_that_follow_an_inflight_refit_pass():
    assert check_events(inflight([[[1, 3], [2, 2]], [[1, 5]]], [3, 5])) == []


@pytest.mark.parametrize("runs,positions,needle", [
    ([[[1, 3], [2, 2]]], [2], "installed (refit of step 1, 24.000s) after its token 2, but 3 of its tokens carry "
                              "older versions"),
    ([[[1, 3], [2, 2]]], [4], "after its token 4, but 3 of its tokens"),
    ([[[2, 2], [1, 3]]], [3], "token versions go [2, 1] along the sample; they may only rise"),
    ([[[0, 5]]], [5], "its first token has version 0, older than the version 1 the batch started with"),
])
def test_a_token_of_the_wrong_version_is_caught(runs, positions, needle):
    found = check_events(inflight(runs, positions))
    assert [v.invariant for v in found] == [2] and needle in found[0].message, found


def test_an_agents_positions_count_the_segment_then_current():
    """An agent's sample trains its last segment. A refit that landed in an
    earlier one says nothing of the trained tokens: all are the new weights'.
    One that landed in the trained segment counts its tokens."""
    events = inflight([[[2, 4]], [[1, 2], [2, 3]]], [3, 2])
    assert [v.invariant for v in check_events(events)] == [2]  # as if both refits counted the trained tokens
    find(events, "rollout_end", batch="b2.0")["segments"] = [2, 2]
    find(events, "refit_end", worker="gen0", step=1)["segments"] = {"b2.0": [1, 2]}
    assert check_events(events) == []
    find(events, "refit_end", worker="gen0", step=1)["positions"] = {"b2.0": [3, 1]}
    found = check_events(events)
    assert [v.invariant for v in found] == [2] and "sample 1: version 2 was installed" in found[0].message \
        and "after its token 1, but 2 of its tokens" in found[0].message


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


def test_a_dead_workers_events_are_before_its_death():
    """A generator killed right after its rollout_start never sent the clock
    of it; the driver's generator_died is still after everything it logged."""
    def e(t, kind, worker, lane, vc, **extra):
        return {"t": t, "ev": kind, "step": 0, "version": 0, "worker": worker, **extra, "lane": lane, "vc": vc}
    rs = e(1.0, "rollout_start", "gen0", "gen0/rollouts", {"gen0/rollouts": 1}, batch="b")
    died = e(2.0, "generator_died", "driver", "driver", {"driver": 1}, dead="gen0")
    vs = e(3.0, "validation_start", "gen0_r1", "gen0_r1/validate", {"driver": 1, "gen0_r1/validate": 1})
    assert Judge([rs, died, vs]).before(rs, vs) and not Judge([rs, vs]).before(rs, vs)
    assert not Judge([rs, died, vs]).before(vs, rs)


# --- invariant 3 -----------------------------------------------------------------

def test_batch_trained_too_old():
    events = log()              # b3.0 is generated with version 2 and trained at step 3: age 1
    find(events, "run_start")["max_age"] = 0
    vs_ = check_events(events)
    assert {v.invariant for v in vs_} == {3}
    assert any("b3.0" in v.message and "age 1 > max_age 0" in v.message for v in vs_)


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
    find(events, "refit_end", worker="gen1", step=3)["version"] = 5   # the last: no rollout runs on it
    vs_ = check_events(events)
    assert {v.invariant for v in vs_} == {5}
    assert all("gen1" in v.message for v in vs_)


def test_rollout_claims_a_version_its_engine_did_not_load():
    events = log()
    find(events, "refit_end", worker="gen1", step=1)["version"] = 3   # b3.0 then runs on gen1 "with 2"
    vs_ = check_events(events)
    assert {v.invariant for v in vs_} == {2, 5}
    assert any("b3.0" in v.message and "loaded version 3" in v.message for v in vs_ if v.invariant == 2)


def test_weights_loaded_without_the_trainer_before_them():
    """refit did not take the TrainOut: the versions add up, the order is unproven."""
    events = log(refit_waits_for_train=False)
    vs_ = check_events(events)
    assert {v.invariant for v in vs_} == {5}
    assert all("train_end of that step before it" in v.message for v in vs_)
    assert check_events(without_clocks(events)) == []


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
        f"0 violations (invariants 1-5, 7-10) in {len(events)} events"]


def test_main_reports_violations(tmp_path, capsys):
    events = log()
    find(events, "rollout_end", batch="b2.0")["version"] = 2
    write_jsonl(tmp_path / "events.jsonl", events)
    assert main(str(tmp_path)) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("invariant 2: batch b2.0")
    assert out[1].startswith('    {"t":')
    assert out[-1] == f"1 violations (invariants 1-5, 7-10) in {len(events)} events"


def test_main_notes_unfinished_run(tmp_path, capsys):
    write_jsonl(tmp_path / "events" / "driver.jsonl", log(finished=False))
    assert main(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "note: the run did not finish cleanly" in out and "0 violations" in out


def test_main_prints_wall_clock_notes_and_passes(tmp_path, capsys):
    events = [{**e, "t": e["t"] + 3.5} if e["worker"] == "trainer" else e for e in log()]  # a skewed host
    report = check_report(events)
    assert report.violations == () and report.notes
    write_jsonl(tmp_path / "events.jsonl", events)
    assert main(str(tmp_path)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("note (wall clock, invariant ") and "the times are skewed" in out[0]
    assert out[-1] == f"0 violations (invariants 1-5, 7-10) in {len(events)} events"


def test_main_says_when_it_fell_back_to_the_wall_clock(tmp_path, capsys):
    events = without_clocks(log())
    write_jsonl(tmp_path / "events.jsonl", events)
    assert main(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert f"{len(events)} events have no vector clock" in out and "fell back to wall-clock time" in out


def test_main_load_error(tmp_path, capsys):
    assert main(str(tmp_path / "missing")) == 2
    assert "missing" in capsys.readouterr().err
