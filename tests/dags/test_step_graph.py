"""The step graph on simulated workers: ordering invariants under many schedules."""
from __future__ import annotations

import itertools
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dags.step_graph import build_step_graph
from pipeline.config import load_config
from pipeline.run.driver import train
from tests.support.pooled_run import train_on
from pipeline.run.runner import GraphRunner, PipelineError
from pipeline.core.events import load_events
from pipeline.tools.check import check_events

pytestmark = pytest.mark.sim


def sim_config(tmp_path, name: str, **overrides):
    pairs = [f"run.output_dir={tmp_path}", f"run.name={name}", "run.deadline_s=30"]
    pairs += [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    return load_config(None, pairs)


def run_and_check(cfg, pool, runner=None):
    summary = train_on(cfg, pool, step_runner=runner, quiet=True)
    run_dir = f"{cfg.run.output_dir}/{cfg.run.name}"
    events = load_events(run_dir)
    return summary, events, check_events(events)


def intervals(events, start: str, end: str, key=lambda e: (e["worker"], e["batch"] if "batch" in e else e["step"])):
    open_, out = {}, []
    for e in events:
        if e["ev"] == start:
            open_[key(e)] = e["t"]
        elif e["ev"] == end:
            out.append((open_.pop(key(e)), e["t"]))
    return out


def overlap_s(a, b) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


# The race from DESIGN.md: a slow drain, a slow validation and a fast trainer
# give a collector every chance to start a batch while validation runs.
@pytest.mark.parametrize("mode", ["classic", "compiled"])
@pytest.mark.parametrize("max_age", [0, 1, 2, 3])
@pytest.mark.parametrize("val_period", [1, 2, 3])
def test_no_rollout_starts_during_validation(tmp_path, sim_pool, mode, max_age, val_period):
    cfg = sim_config(tmp_path, f"race_{mode}_{max_age}_{val_period}", run__dag_mode=mode, run__steps=6,
                     schedule__max_age=max_age, validation__period=val_period, validation__at_start="true",
                     generation__num_generators=2, sim__generate_s=0.04, sim__train_s=0.002,
                     sim__refit_s=0.01, sim__validate_s=0.04, sim__jitter=0.5)
    summary, events, violations = run_and_check(cfg, sim_pool)
    assert violations == [], "\n".join(v.message for v in violations)
    validations = intervals(events, "validation_start", "validation_end")
    assert len(validations) == 2 * (1 + 6 // val_period)
    rollout_starts = [e["t"] for e in events if e["ev"] == "rollout_start"]
    assert not [t for t in rollout_starts for s, e in validations if s <= t <= e]
    assert summary["accounting"]["balanced"] and summary["accounting"]["trained"] == 12


schedules = st.fixed_dictionaries({
    "steps": st.integers(1, 6),
    "max_age": st.integers(0, 3),
    "val_period": st.integers(0, 3),
    "val_at_start": st.booleans(),
    "val_at_end": st.booleans(),
    "prompts": st.integers(1, 4),
    "generate_ms": st.integers(0, 30),
    "train_ms": st.integers(0, 30),
    "refit_ms": st.integers(0, 10),
    "validate_ms": st.integers(0, 30),
    "jitter": st.sampled_from([0.0, 0.5, 1.0]),
    "seed": st.integers(0, 10_000),
    "refit_mode": st.sampled_from(["drain", "inflight"]),
    "response_len": st.sampled_from(["fixed", "lognormal"]),
    # Multi-turn rollouts (a simulated tool, pipeline/sim/env.py) in half the schedules.
    "turns": st.sampled_from([None, None, 1, 2, "random"]),
    "tool_ms": st.integers(0, 30),
    "tool_latency": st.sampled_from(["fixed", "lognormal"]),
})


_run_ids = itertools.count()


def check_schedule(tmp_path, pool, runner, s: dict):
    """Runs schedule `s`, checks its log and accounting; returns its run directory."""
    cfg = sim_config(tmp_path, f"prop_{runner.mode}_{next(_run_ids)}", run__dag_mode=runner.mode, run__steps=s["steps"],
                     run__seed=s["seed"],
                     schedule__max_age=s["max_age"], validation__period=s["val_period"],
                     validation__at_start=str(s["val_at_start"]).lower(),
                     validation__at_end=str(s["val_at_end"]).lower(),
                     schedule__prompts_per_step=s["prompts"], generation__num_generators=s["generators"],
                     sim__generate_s=s["generate_ms"] / 1000, sim__train_s=s["train_ms"] / 1000,
                     sim__refit_s=s["refit_ms"] / 1000, sim__validate_s=s["validate_ms"] / 1000,
                     sim__jitter=s["jitter"], generation__refit_mode=s["refit_mode"],
                     sim__response_len=s["response_len"], sim__tail_ratio=10,
                     dynamic_sampling__max_rounds=s.get("rounds", 0), sim__flat_share=s.get("flat_share", 1.0),
                     **({"reward_model__kind": "classifier", "sim__score_s": s["score_ms"] / 1000}
                        if "score_ms" in s else {}),
                     **({} if s["turns"] is None else {
                         "env__class": "pipeline.sim.env:SimToolEnv", "env__max_turns": 3,
                         "env__args": f"{{turns: {s['turns']}, max_turns: 3, latency_s: {s['tool_ms'] / 1000}, "
                                      f"latency: {s['tool_latency']}, observation_tokens: 3}}"}))
    summary, events, violations = run_and_check(cfg, pool, runner)
    assert violations == [], f"{s}\n" + "\n".join(v.message for v in violations)
    if s["turns"] is not None:
        assert any(e["ev"] == "env_step" for e in events), s
    acc = summary["accounting"]
    assert acc["balanced"] and acc["dropped"] == 0 and acc["trained"] == acc["launched"]
    assert summary["steps"] == s["steps"]
    return tmp_path / cfg.run.name


# 3 x 20 = 60 schedules per DAG mode, both refit modes among them (benchmarks/soak.py draws more, with faults). One graph per generator count serves all of
# its schedules: compiling costs about a second per graph on this machine.
@pytest.mark.parametrize("mode", ["classic", "compiled"])
@pytest.mark.parametrize("generators", [1, 2, 3])
def test_invariants_hold_over_random_schedules(tmp_path, sim_pool, mode, generators):
    workers = sim_pool.first(generators)
    runner = GraphRunner(build_step_graph(workers), mode, first_deadline_s=60)
    try:
        @settings(max_examples=20, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(schedules)
        def prop(s):
            check_schedule(tmp_path, workers, runner, {**s, "generators": generators})
        prop()
    finally:
        runner.close()


# Dynamic sampling (DAPO): its top-up rounds in the graph, under the same random schedules,
# with some, most, all or none of the prompts' groups flat. 2 x 2 x 12 schedules.
@pytest.mark.parametrize("mode", ["classic", "compiled"])
@pytest.mark.parametrize("rounds", [1, 2])
def test_dynamic_sampling_holds_the_invariants_over_random_schedules(tmp_path, sim_pool, mode, rounds):
    workers = sim_pool.first(2)
    runner = GraphRunner(build_step_graph(workers, top_up_rounds=rounds), mode, first_deadline_s=60)
    try:
        @settings(max_examples=12, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(schedules, st.sampled_from([0.0, 0.5, 0.9, 1.0]))
        def prop(s, flat_share):
            s = {**s, "generators": 2, "rounds": rounds, "flat_share": flat_share}
            run_dir = check_schedule(tmp_path, workers, runner, s)
            # check_schedule proved invariant 8 from the log; the metrics say the same in numbers.
            for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
                if m["step"] >= 0:
                    assert m["informative_groups"] <= s["prompts"], (s, m)
                    assert m["rows"] if m["informative_groups"] else m.get("update_skipped_flat") == 1.0, (s, m)
        prop()
    finally:
        runner.close()


# A reward model between every rollout and the buffer (invariant 9), single-turn, with and
# without dynamic sampling's rounds (whose flat groups it then decides). 2 x 8 schedules.
@pytest.mark.parametrize("mode", ["classic", "compiled"])
def test_a_reward_model_holds_the_invariants_over_random_schedules(tmp_path, sim_pool, mode):
    workers = sim_pool.first(2)
    runner = GraphRunner(build_step_graph(workers, top_up_rounds=1), mode, first_deadline_s=60)
    try:
        @settings(max_examples=8, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(schedules, st.integers(0, 30), st.sampled_from([0.5, 1.0]))
        def prop(s, score_ms, flat_share):
            run_dir = check_schedule(tmp_path, workers, runner, {**s, "generators": 2, "turns": None, "rounds": 1,
                                                                 "flat_share": flat_share, "score_ms": score_ms})
            events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
            trained = {b for e in events if e["ev"] == "train_start" for b in e["batches"]}
            assert trained <= {e["batch"] for e in events if e["ev"] == "score_end"}
        prop()
    finally:
        runner.close()


def test_dynamic_sampling_makes_the_same_choices_however_the_workers_are_timed(tmp_path, sim_pool):
    keys = ("flat_groups_dropped", "surplus_groups_dropped", "informative_groups", "extra_prompts", "reward_mean")

    def run(name, generate_s, jitter):
        cfg = sim_config(tmp_path, name, run__steps=8, schedule__max_age=1, generation__num_generators=2,
                         dynamic_sampling__max_rounds=2, sim__flat_share=0.6, sim__generate_s=generate_s,
                         sim__train_s=0.01, sim__jitter=jitter, validation__period=0)
        _, events, violations = run_and_check(cfg, sim_pool)
        assert violations == []
        metrics = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        trained = [(e["step"], e["batches"]) for e in events if e["ev"] == "train_start"]
        drops = sorted((e["step"], e["batch"], tuple(e["groups"]), e["reason"]) for e in events
                       if e["ev"] == "group_drop")
        return [[m[k] for k in keys] for m in metrics if m["step"] >= 0], trained, drops

    fast, slow = run("ds_fast", 0.001, 0.0), run("ds_slow", 0.04, 1.0)
    assert fast == slow
    assert sum(m[3] for m in fast[0]) > 0   # some step did launch extra prompts


# Graphs with an ordering edge removed, and generators without the drain, are
# caught by the checker: tests/tools/test_mutations.py.


def test_sync_has_no_overlap_and_async_overlaps(tmp_path, sim_pool):
    def run(max_age):
        cfg = sim_config(tmp_path, f"overlap_{max_age}", run__dag_mode="classic", run__steps=6,
                         schedule__max_age=max_age, sim__generate_s=0.3, sim__train_s=0.05, sim__refit_s=0.0)
        _, events, violations = run_and_check(cfg, sim_pool)
        assert violations == []
        gen = intervals(events, "rollout_start", "rollout_end")
        trn = intervals(events, "train_start", "train_end")
        return overlap_s(gen, trn), sum(e - s for s, e in trn)

    sync_overlap, _ = run(0)
    async_overlap, train_time = run(1)
    assert sync_overlap == 0.0
    # Generation outlasts training, so only orchestration delay can shrink the overlap.
    assert async_overlap > 0.5 * train_time


def test_run_writes_its_files_and_counts_every_batch(tmp_path, sim_pool):
    cfg = sim_config(tmp_path, "files", run__steps=5, schedule__max_age=2, validation__period=2,
                     sim__generate_s=0.0, sim__train_s=0.0)
    summary, events, violations = run_and_check(cfg, sim_pool)
    run_dir = tmp_path / "files"
    assert violations == []
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert [m["age_max"] for m in metrics] == [0, 1, 2, 2, 2]
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["steps"] == 5 and on_disk["accounting"]["launched"] == 5
    for e in events:
        assert {"t", "ev", "step", "version", "worker"} <= e.keys()
    assert (run_dir / "config.yaml").is_file()


@pytest.mark.parametrize("fault,node", [("train_raise", "train"), ("generate_raise", "refit")])
def test_worker_exception_names_node_worker_and_step(tmp_path, ray_session, fault, node):
    cfg = sim_config(tmp_path, f"fault_{fault}", run__steps=6, inject__fault=fault, inject__after=2,
                     sim__generate_s=0.0, sim__train_s=0.0)
    with pytest.raises(PipelineError) as err:
        train(cfg, quiet=True)
    msg = str(err.value)
    assert f"node {node!r}" in msg and "injected fault" in msg and "at step" in msg
    summary = json.loads((tmp_path / f"fault_{fault}" / "summary.json").read_text())
    # The same, and what to do next: no checkpoint was written before step 2.
    assert summary["error"] == (f"{msg}; no checkpoint was written: start the run again "
                                "(run.checkpoint_every writes them)")


@pytest.mark.parametrize("mode", ["classic", "compiled"])
def test_stuck_worker_becomes_an_error_within_the_deadline(tmp_path, ray_session, mode):
    cfg = sim_config(tmp_path, f"hang_{mode}", run__steps=6, run__deadline_s=3, run__dag_mode=mode,
                     inject__fault="train_hang", inject__after=1, sim__generate_s=0.0, sim__train_s=0.0)
    started = time.monotonic()
    with pytest.raises(PipelineError, match=r"step 1: node train on worker trainer did not finish within 3 s"):
        train(cfg, quiet=True)
    summary = json.loads((tmp_path / f"hang_{mode}" / "summary.json").read_text())
    assert summary["steps"] == 1 and time.monotonic() - started < 60
