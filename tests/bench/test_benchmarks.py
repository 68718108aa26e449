"""The benchmarks run in their quick mode and write their JSON: structure, not speed.

Benchmarks measure; they are not tests. This only keeps them from rotting: each
script must run end to end with one command and write a result file whose
shape the README and the people reading it rely on.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sim

ROOT = Path(__file__).resolve().parents[2]
STAT_KEYS = {"n", "median", "min", "max", "spread", "iqr", "values"}
MACHINE_KEYS = {"platform", "python", "ray", "cpu_physical", "cpu_logical", "memory_gib",
                "loadavg_start", "loadavg_end", "git_commit"}


def run_quick(name: str, out: Path, timeout: float = 300) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)  # the benchmarks start their own local cluster
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "targets" in proc.stdout, "the script prints its tables"
    assert "still running after shutdown" not in proc.stderr, "the script left Ray processes behind"
    path = out / f"{name}.json"
    assert path.is_file(), f"{name} did not write {path}"
    result = json.loads(path.read_text())
    assert result["benchmark"] == name
    assert MACHINE_KEYS <= set(result["machine"])
    assert result["params"]["quick"] is True
    return result


def is_stat(x) -> bool:
    return isinstance(x, dict) and STAT_KEYS <= set(x) and x["n"] >= 1 and x["median"] is not None


def test_overlap_quick(tmp_path):
    result = run_quick("overlap", tmp_path)
    params = result["params"]
    assert set(params["max_ages"]) == {0, 1, 2} and 1.0 in params["ratios_G_over_T"]
    figures = result["figures"]
    seen = {(f["mode"], f["G_over_T"], f["max_age"]) for f in figures}
    assert seen == {(m, r, a) for m in params["modes"] for r in params["ratios_G_over_T"] for a in (0, 1, 2)}
    for f in figures:
        for key in ("step_s", "efficiency", "speedup_over_sync", "overhead_ms"):
            assert is_stat(f[key]), (key, f)
        assert f["ideal_async_step_s"] == pytest.approx(max(f["G_s"], f["T_s"]) + f["R_s"])
    for t in result["targets"]:
        assert {"mode", "max_age", "efficiency", "efficiency_met", "speedup", "speedup_target",
                "speedup_met"} <= set(t)
    assert {t["max_age"] for t in result["targets"]} == {1, 2}


def test_inflight_quick(tmp_path):
    result = run_quick("inflight", tmp_path)
    figures = result["throughput"]
    assert [(f["tail_ratio"], f["max_age"]) for f in figures] == [(10.0, 2)]
    for key in ("drain_tokens_per_s", "inflight_tokens_per_s", "drain_busy", "inflight_busy", "tokens_per_s_ratio"):
        assert is_stat(figures[0][key]), key
    assert result["learning"] == "not run under --quick"
    assert [t["target"] for t in result["targets"]] == ["tokens/s inflight / drain >= 1.5 (tail 10.0, max_age 2)"]


def test_soak_quick(tmp_path):
    """The short soak: one schedule per fault kind, a generator's death on the first
    batch among them; this one is behaviour, so it asserts zeros."""
    from benchmarks.soak import FAULTS
    result = run_quick("soak", tmp_path, timeout=600)
    runs = result["runs"]
    assert {(r["fault"], r["phase"]) for r in runs} == set(FAULTS[:5])
    assert {r["fault"] for r in runs} == {fault for fault, _ in FAULTS}
    totals = result["totals"]
    assert totals["violations"] == 0 and totals["hangs"] == 0, runs
    assert totals["lost"] == 0 and totals["duplicated"] == 0 and totals["unexpected_outcomes"] == 0, runs
    assert totals["restarts"] >= 3 and totals["reward_failures"] > 0


def test_vs_trl_scale_efficiency_is_the_longer_side_plus_the_refit_over_the_step():
    """benchmarks.vs_trl_scale's reading of a dagrl run, on made-up metrics: step 0
    is left out; efficiency = (max(generation, training) + refit) / step time."""
    from benchmarks.vs_trl_scale import dagrl_figures
    m = [{"step": 0, "step_time_s": 9.0, "generator_idle": 0.0, "train_s": 1.0, "refit_s": 0.1, "wait_s": 8.0,
          "response_tokens": 100},
         {"step": 1, "step_time_s": 2.0, "generator_idle": 0.5, "train_s": 1.8, "refit_s": 0.1, "wait_s": 0.0,
          "response_tokens": 100},   # generation 1.0 s: training is the longer side, (1.8 + 0.1) / 2
         {"step": 2, "step_time_s": 2.0, "generator_idle": 0.0, "train_s": 1.0, "refit_s": 0.2, "wait_s": 0.3,
          "response_tokens": 100}]   # generation 2.0 s: (2.0 + 0.2) / 2
    f = dagrl_figures(m)
    assert f["step_time_s"] == 2.0 and f["tokens_per_s"] == 50.0 and f["generation_s"] == 1.5
    assert f["efficiency"] == round((0.95 + 1.1) / 2, 3)


def test_vs_trl_figures_from_step_times():
    """benchmarks.vs_trl's reading of a run, on made-up step times: start-up is
    launch to the first step, time to 0.7 runs from the first step's start to the
    end of the first step whose 3-step mean reaches 0.7, and ratios are per seed."""
    from benchmarks import vs_trl
    begin = [10.0 + 0.1 * k for k in range(8)]
    end = [b + 0.08 for b in begin]
    rewards = [0.1, 0.2, 0.6, 0.7, 0.9, 0.9, 1.0, 1.0]
    fig = vs_trl.curve(begin, end, rewards)
    assert fig["startup_s"] == 10.0 and fig["step_time_s"] == pytest.approx(0.08)
    assert fig["steps_to_threshold"] == 5 and fig["time_to_threshold_s"] == pytest.approx(0.48)
    never = vs_trl.curve(begin, end, [0.1] * 8)
    assert never["steps_to_threshold"] is None and never["time_to_threshold_s"] is None
    runs = {"dagrl_async": [dict(fig, seed=0)], "dagrl_sync": [dict(never, seed=0)],
            "trl": [dict(fig, startup_s=5.0, step_time_s=0.1, time_to_threshold_s=0.6, seed=0)]}
    summary = vs_trl.summarise(runs)
    assert summary["dagrl_async_over_trl"] == {"step_time_s": 0.8, "time_to_threshold_s": 0.8, "startup_s": 2.0}
    assert summary["dagrl_sync_over_trl"]["time_to_threshold_s"] is None
    assert [t["met"] for t in summary["targets"]] == [True, True, True]


def test_startup_phases_split_launch_to_first_step_by_driver_phase_and_worker():
    """benchmarks.harness.startup_phases, shared by step_profile, vs_trl and vs_trl_scale:
    the driver's phases as summary.json has them, and each worker's set-up spans."""
    from benchmarks.harness import startup_phases
    startup = {"preflight_s": 0.1, "ray_init_s": 6.0, "workers_s": 9.0, "to_first_step_s": 15.5}
    events = [{"t": 7.0, "ev": "worker_start", "worker": "gen0"},
              {"t": 15.0, "ev": "worker_ready", "worker": "gen0", "spans": {"import vllm": 5.0, "vllm.start": 2.5}},
              {"t": 16.0, "ev": "startup", "worker": "driver", **startup}]
    assert startup_phases(events, {"train_entered_at": 1002.0, "startup": startup}, 1000.0) == {
        "launch to first step": 17.5, "launch to train() (interpreter, imports, config)": 2.0,
        "driver: preflight": 0.1, "driver: ray_init": 6.0, "driver: workers": 9.0,
        "gen0: process up": 7.0, "gen0: import vllm": 5.0, "gen0: vllm.start": 2.5, "gen0: ready": 15.0,
        "prologue and first dispatch": 1.0}


def test_the_event_logs_epoch_is_read_back_from_a_run(tmp_path, sim_pool, monkeypatch):
    """benchmarks.harness.event_log_epoch gives the epoch the driver's event log
    counts `t` from, to the millisecond the summary's start-up phases are rounded to."""
    from benchmarks.harness import event_log_epoch
    from tests.support.pooled_run import train_on
    from pipeline.config import load_config
    from pipeline.core.events import EventLog, load_events
    from pipeline.run import driver
    epochs = []

    class Recorded(EventLog):
        def __init__(self, run_dir, worker, t0):
            epochs.append(t0)
            super().__init__(run_dir, worker, t0)
    monkeypatch.setattr(driver, "EventLog", Recorded)
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=epoch", "run.steps=2", "run.deadline_s=30"])
    summary = train_on(cfg, sim_pool, quiet=True)
    assert len(epochs) == 1
    assert event_log_epoch(summary, load_events(tmp_path / "epoch")) == pytest.approx(epochs[0], abs=2e-3)


def test_multiturn_quick(tmp_path):
    result = run_quick("multiturn", tmp_path)
    figures = result["figures"]
    assert [(f["latency"], f["turns"], f["env"]) for f in figures] == [("lognormal", 2, "threads")]
    for key in ("sync_tokens_per_s", "async_tokens_per_s", "sync_step_s", "async_step_s", "sync_busy",
                "async_busy", "tokens_per_s_ratio", "mean_step_ratio"):
        assert is_stat(figures[0][key]), key
    assert figures[0]["async_observation_share"]["median"] > 0  # two turns: one observation appended
    assert figures[0]["violations"] == [] and figures[0]["env_failures"] == 0
    assert [t["target"] for t in result["targets"]] == [
        "tokens/s async / sync >= 1.6 (lognormal, turns 2, env threads)",
        "check-events violations + environment failures == 0"]


def test_long_run_reads_growth_through_the_lowest_points_and_slowdown_as_a_climb():
    """benchmarks.long_run on made-up series: a weight copy held at some samples
    and not at others, or a heap that fills and empties, is no growth; 2 KB a
    step under the same noise is, and so is 2 KB a step in the RSS after each
    heap trim. Tenths of a run whose speed wanders (the
    last slower than the first, the middle slower still) are not slower, nor
    is an end the slowest of all by less than the tenths' own spread; a 3 %
    climb over the run under 1 % noise is, and so is an end above the start
    by more than that spread."""
    import random
    from benchmarks.long_run import held_slope, low_slope, rising_p, slower
    rng = random.Random(0)
    noise = [(s, 500.0 + 17.0 * rng.randint(0, 1) + (30.0 if s % 100 > 50 else 0.0)) for s in range(400, 2000)]
    assert low_slope(noise) * 1024 == pytest.approx(0.0, abs=0.01)
    leak = [(s, mb + 2.0 * s / 1024) for s, mb in noise]
    assert low_slope(leak) * 1024 == pytest.approx(2.0, abs=0.1)
    # A role with a heap cap is read through its RSS right after each trim, one every 100 steps.
    floors = [(s, 1000.0 + 0.1 * rng.random()) for s in range(400, 2000, 100)]
    assert held_slope(-1.9, floors) == pytest.approx(0.0, abs=0.1)
    assert held_slope(0.0, [(s, mb + 2.0 * s / 1024) for s, mb in floors]) == pytest.approx(2.0, abs=0.1)
    assert held_slope(3.3, floors[:7]) == 3.3  # too few trims to fit: its lowest points
    wander = [0.2966, 0.2963, 0.3256, 0.3003, 0.3152, 0.3143, 0.3113, 0.2974, 0.2906, 0.3113]  # one real run
    assert rising_p(wander) >= 0.05 and not slower(wander)
    climb = [0.3 * (1 + 0.03 * i / 9) + 0.003 * rng.random() for i in range(10)]  # 1 % noise
    assert rising_p(climb) < 0.05 and slower(climb)
    assert not slower([*wander[:-1], 0.33]) and slower([*wander[:-1], 0.34])
    # At one machine speed, a collective run whose last tenth was the slowest by 0.4 ms (91f38cf).
    level = [0.2879, 0.2924, 0.2886, 0.2903, 0.2901, 0.2914, 0.2902, 0.2899, 0.2846, 0.2928]
    assert rising_p(level) >= 0.05 and not slower(level)
    assert slower([*level[:-1], 0.2879 * 1.05])


def test_long_run_reads_step_time_at_the_first_tenths_machine_speed():
    """A run whose steps slow 4 % with the machine (the benchmark's fixed piece
    of work slows as much) is read at one speed, and is not slower; the same
    climb beside a steady probe is; a run kept without probes is read raw."""
    from benchmarks.long_run import slower, step_tenths
    wander = [0.2966, 0.2963, 0.3256, 0.3003, 0.3152, 0.3143, 0.3113, 0.2974, 0.2906, 0.3113]
    machine = [1 + 0.04 * i / 9 for i in range(10)]
    records = [{"step": s, "step_time_s": wander[s // 100] * machine[s // 100]} for s in range(1000)]
    slowing = [{"step": s, "cpu_s": 0.007 * machine[s // 100]} for s in range(0, 1000, 7)]
    tenths, speeds, own = step_tenths(records, slowing)
    assert speeds == pytest.approx([0.007 * m for m in machine])
    assert own == pytest.approx(wander) and not slower(own)
    climb = [{"step": s, "step_time_s": 0.3 * machine[s // 100]} for s in range(1000)]
    steady = [{"step": s, "cpu_s": 0.007} for s in range(0, 1000, 7)]
    tenths, _, own = step_tenths(climb, steady)
    assert own == pytest.approx(tenths) and slower(own)
    assert step_tenths(climb, []) == (tenths, None, tenths)
    assert step_tenths(climb, steady[:50])[1] is None  # the last tenths had no probe


@pytest.mark.real
def test_agents_quick(tmp_path):
    result = run_quick("agents", tmp_path)
    figures = result["figures"]
    (throughput,) = figures["throughput"]
    assert throughput["model"] == "tiny" and is_stat(throughput["ratio"])
    run = throughput["repeats"][0]
    # Both paths played the same task on the same engine from the same contexts: equal turns, tokens
    # within a turn's worth (a sampled </s> closes a turn one token shorter in the gateway's rendering).
    assert run["env"]["mean_turns"] == run["gateway"]["mean_turns"] == 3
    assert abs(run["env"]["context_tokens"] - run["gateway"]["context_tokens"]) <= 16
    assert [o["sessions"] for o in figures["overhead"]] == [1, 64] and all(o["p99_ms"] >= o["p50_ms"] > 0
                                                                         for o in figures["overhead"])
    assert figures["concurrency"] == [dict(figures["concurrency"][0], sessions=64, errors=0, first_error="")]


@pytest.mark.real
def test_distill_quick(tmp_path):
    result = run_quick("distill", tmp_path)
    teacher = result["teacher"]
    # The teacher `make` builds (a few steps under --quick) already beats the fresh student it came from.
    assert teacher["val_greedy_after"]["reward"] > teacher["val_greedy_before"]["reward"]
    assert result["bar"] == pytest.approx(0.9 * teacher["val_greedy_after"]["reward"], abs=1e-6)
    distill, grpo = sorted(result["runs"], key=lambda r: r["kind"])
    assert (distill["kind"], grpo["kind"]) == ("distill", "grpo")
    # Validation before training and after each of the 3 steps; only the distilled run has a teacher's KL.
    assert [s for s, _ in distill["val"]] == [s for s, _ in grpo["val"]] == [-1, 0, 1, 2]
    assert len(distill["kl"]) == 3 and all(k > 0 for k in distill["kl"]) and grpo["kl"] == []
    # The recipe's loss is topk_kl: its KL over the teacher's top-k is logged and targeted as well.
    assert result["distill"]["loss"] == "topk_kl" and len(distill["topk_kl"]) == 3 and grpo["topk_kl"] == []
    assert [t["target"].split(",")[0] for t in result["targets"]] == [
        "distill within 10 % of the teacher (reached)", "distill reached in fewer steps than GRPO",
        "distill within 10 % of the teacher (held)", "distill held in fewer steps than GRPO",
        "distill/kl falls (last step < first)", "distill/topk_kl falls (last step < first)",
        "every run's events pass check-events (invariant 10: each batch taught before training)"]
    assert distill["violations"] == grpo["violations"] == []


@pytest.mark.real
def test_vlm_quick(tmp_path):
    result = run_quick("vlm", tmp_path)
    (run,) = result["runs"]
    assert (run["mode"], run["seed"]) == ("async", 0)
    # Validation before training and after each of the 3 steps.
    assert [s for s, _ in run["val"]] == [-1, 0, 1, 2]
    assert [t["target"].split(",")[0] for t in result["targets"]] == [
        "last greedy validation >= 0.5 (twice chance)", "every run's events pass check-events"]
    assert run["violations"] == []
