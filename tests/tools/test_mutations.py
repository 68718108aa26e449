"""Each mutation of tests/support/mutations.py, run to its end on simulated workers,
is caught by the checker from the event log alone, in runs with opposite
timings: the ordering checks read the vector clocks, so a mutation is caught
whether or not its race happened to show. The unmutated graph on the same
workers passes, with multi-turn environments and with agents too. And a clock
off by a second on one worker moves no verdict."""
from __future__ import annotations

import pytest
import ray
from tests.support.mutations import (
    AGENTS,
    AGENTS_ONLY,
    MULTITURN,
    MUTATIONS,
    ONE_MODE_ONLY,
    UNMUTATED,
    start_mutant_workers,
)

from pipeline.config import load_config
from tests.support.pooled_run import train_on
from pipeline.run.pool import stop_workers
from pipeline.core.events import load_events
from pipeline.tools.check import check_events, check_report

pytestmark = pytest.mark.sim

# Opposite races: validation outlasting generation, and generation outlasting it.
# slow_generation's rollouts take 0.2 s, so that an inflight refit lands inside one even
# when a loaded machine delays the driver: at 0.08 s, in a suite run beside benchmarks
# (load 10 on 2 cores), every rollout had ended before its load and late_version_label
# went uncaught.
PROFILES = {
    "slow_validation": {"sim.generate_s": 0.01, "sim.train_s": 0.005, "sim.refit_s": 0.02, "sim.validate_s": 0.08},
    "slow_generation": {"sim.generate_s": 0.2, "sim.train_s": 0.005, "sim.refit_s": 0.005, "sim.validate_s": 0.01},
    # Two turns around a tool that takes as long as a turn: the environments' steps are part of the rollouts.
    "multiturn": {"sim.generate_s": 0.04, "sim.train_s": 0.005, "sim.refit_s": 0.005, "sim.validate_s": 0.01,
                  "env.class": "pipeline.sim.env:SimToolEnv", "env.max_turns": 2,
                  "env.args": "{turns: 2, latency_s: 0.03, latency: lognormal}"},
    # Agents through the gateway, two requests a sample: the sessions' requests are part of the rollouts.
    "agents": {"sim.generate_s": 0.04, "sim.train_s": 0.005, "sim.refit_s": 0.005, "sim.validate_s": 0.01,
               "agent.function": "tests.agents.agents_for_tests:two_turns"},
}


@pytest.fixture(scope="module")
def mutant_pool(ray_session):
    pool = start_mutant_workers(2)
    try:
        yield pool
    finally:
        stop_workers(pool)


@pytest.fixture(scope="module")
def run_log(mutant_pool, tmp_path_factory):
    """run_log(mutation name or None, profile, refit mode) -> (summary, events), each run once per module."""
    runs: dict[tuple, tuple[dict, list[dict]]] = {}
    out = tmp_path_factory.mktemp("mutations")

    def run(name: str | None, profile: str, refit_mode: str = "drain") -> tuple[dict, list[dict]]:
        if (name, profile, refit_mode) not in runs:
            m = MUTATIONS[name] if name else UNMUTATED
            run_name = f"{name or 'unmutated'}_{profile}_{refit_mode}"
            cfg = load_config(None, [f"run.output_dir={out}", f"run.name={run_name}", "run.deadline_s=30",
                                     f"generation.refit_mode={refit_mode}",
                                     "run.dag_mode=classic", "run.steps=5", "schedule.max_age=1", "validation.period=1",
                                     "generation.num_generators=2", "metrics.tensorboard=false", "sim.jitter=0.3",
                                     *(f"{k}={v}" for k, v in PROFILES[profile].items()), *m.overrides])
            setup = {k: mutant_pool.trainers[0] if k == "trainer" else v for k, v in m.configure.items()}
            ray.get([g.configure.remote(**setup) for g in mutant_pool.generators]
                    + [mutant_pool.trainers[0].configure.remote(**m.trainer_configure),
                       mutant_pool.controller.configure.remote(**m.controller_configure)])
            runner = m.runner(m.build(mutant_pool), "classic", first_deadline_s=60)
            try:
                summary = train_on(cfg, mutant_pool, step_runner=runner, quiet=True)
            finally:
                runner.close()
                ray.get([g.configure.remote() for g in mutant_pool.generators]
                        + [mutant_pool.trainers[0].configure.remote(), mutant_pool.controller.configure.remote()])
            runs[name, profile, refit_mode] = summary, load_events(out / run_name)
        return runs[name, profile, refit_mode]
    return run


# Inflight refits only matter where rollouts outlast the rest of a step.
CASES = [(profile, "drain") for profile in PROFILES if profile not in ("multiturn", "agents")] \
    + [("slow_generation", "inflight")]


@pytest.mark.parametrize("profile,refit_mode", CASES)
def test_the_unmutated_graph_passes_on_the_same_workers(run_log, profile, refit_mode):
    summary, events = run_log(None, profile, refit_mode)
    report = check_report(events)
    assert report.violations == (), "\n".join(v.message for v in report.violations)
    assert report.notes == () and report.fallbacks == 0  # one host: the wall clock agrees
    assert summary["accounting"]["balanced"] and summary["accounting"]["dropped"] == 0


@pytest.mark.parametrize("profile,refit_mode", [("multiturn", "drain")])
def test_the_unmutated_graph_passes_with_multiturn_rollouts(run_log, profile, refit_mode):
    test_the_unmutated_graph_passes_on_the_same_workers(run_log, profile, refit_mode)
    assert any(e["ev"] == "env_step" for e in run_log(None, profile, refit_mode)[1])


@pytest.mark.parametrize("refit_mode", ["drain", "inflight"])
def test_the_unmutated_graph_passes_with_agents(run_log, refit_mode):
    test_the_unmutated_graph_passes_on_the_same_workers(run_log, "agents", refit_mode)
    events = [e for e in run_log(None, "agents", refit_mode)[1] if e.get("batch") not in (None, "val")]
    samples = sum(e["ev"] == "agent_start" for e in events)
    assert samples and sum(e["ev"] == "agent_request_end" for e in events) == 2 * samples


@pytest.mark.parametrize("name,profile,refit_mode", [
    (name, profile, mode) for name in MUTATIONS for profile, mode in CASES
    if ONE_MODE_ONLY.get(name, mode) == mode and name not in ("deliver_before_the_env", *AGENTS_ONLY)]
    + [(name, "multiturn", "drain") for name in MULTITURN])
def test_the_checker_catches_the_mutation(run_log, name, profile, refit_mode):
    summary, events = run_log(name, profile, refit_mode)
    # The run went to its end: no guard of its own stopped it, so what is
    # caught below is caught by the checker, from the log.
    assert summary["error"] is None and summary["steps"] == 5
    kinds = {e["ev"] for e in events}
    assert {"rollout_start", "rollout_end", "refit_start", "refit_end", "train_end", "validation_start"} <= kinds
    expect = MUTATIONS[name].expect
    found = {v.invariant for v in check_events(events)}
    assert expect in found, f"{name} ({profile}, {refit_mode}) passed invariant {expect}; found {sorted(found)}"


@pytest.mark.parametrize("name", AGENTS)
def test_the_checker_catches_the_mutation_of_agents(run_log, name):
    """Caught from the log of a run with agents, by a finding of the expected
    invariant that says what the mutation broke (AGENTS)."""
    test_the_checker_catches_the_mutation(run_log, name, "agents", "drain")
    expect, needle = MUTATIONS[name].expect, AGENTS[name]
    found = [v.message for v in check_events(run_log(name, "agents", "drain")[1]) if v.invariant == expect]
    assert any(needle in m for m in found), f"{name}: no finding says {needle!r}: {found[:3]}"


def test_a_kept_session_trains_tokens_older_than_max_age_and_is_caught(run_log):
    """Invariant 3 for an agent's model tokens needs no check of its own: a
    session kept across batches trains tokens more than max_age steps old, and
    each batch that holds them is flagged, by its rollout's token versions."""
    events = run_log("session_kept_across_batches", "agents", "drain")[1]
    max_age = next(e["max_age"] for e in events if e["ev"] == "run_start")
    ends = {e["batch"]: e for e in events if e["ev"] == "rollout_end"}
    too_old = {batch for ts in events if ts["ev"] == "train_start" for batch in ts["batches"]
               if any(ts["step"] - v > max_age for sample in ends[batch]["token_versions"] for v, _ in sample)}
    assert too_old
    flagged = {b for v in check_events(events) if v.invariant == 2 for b in too_old if f"batch {b} " in v.message}
    assert flagged == too_old


def shifted(events: list[dict], worker: str, seconds: float) -> list[dict]:
    """A copy of the log whose `worker` clock runs `seconds` off (all its lanes)."""
    return [{**e, "t": e["t"] + seconds} if e["worker"] == worker else dict(e) for e in events]


def without_clocks(events: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in ("vc", "lane")} for e in events]


@pytest.mark.parametrize("seconds", [1.0, -1.0])
def test_a_clock_off_by_a_second_moves_no_verdict(run_log, seconds):
    _, good = run_log(None, "slow_validation")
    workers = sorted({e["worker"] for e in good})
    assert {"driver", "controller", "trainer", "gen0", "gen1"} <= set(workers)
    fooled = []
    for worker in workers:
        skewed = shifted(good, worker, seconds)
        assert check_events(skewed) == [], f"{worker} {seconds:+} s: a good log failed"
        fooled += check_events(without_clocks(skewed))
    # Without vector clocks, the wall clock alone fails this good log for some worker's skew.
    assert fooled
    for name in ("validate_not_before_resume", "refit_without_drain"):
        _, bad = run_log(name, "slow_validation")
        for worker in workers:
            found = {v.invariant for v in check_events(shifted(bad, worker, seconds))}
            assert MUTATIONS[name].expect in found, f"{name}, {worker} {seconds:+} s: not caught"
