"""Worker faults on simulated workers: a generator that dies is replaced and
its batches relaunched; any other death, or too many, is a named error."""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import load_config
from pipeline.run.driver import train
from tests.support.pooled_run import train_on
from pipeline.run.runner import PipelineError
from pipeline.core.events import load_events
from pipeline.tools.check import check_events

pytestmark = pytest.mark.sim


def sim_config(tmp_path, name: str, **overrides):
    pairs = [f"run.output_dir={tmp_path}", f"run.name={name}", "run.deadline_s=30", "run.dag_mode=classic",
             "run.deadline_s=20", "metrics.tensorboard=false"]
    pairs += [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    return load_config(None, pairs)


def trained_batches(events):
    """Batches trained, as rank 0 saw them (every rank trains a shard of each)."""
    return [b for e in events if e["ev"] == "train_start" and e["worker"] in ("trainer", "trainer0")
            for b in e["batches"]]


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fault_after=st.integers(0, 7), worker=st.integers(0, 1), max_age=st.integers(0, 2),
       val_period=st.integers(0, 3))
def test_generator_dies_mid_rollout_and_is_replaced(tmp_path_factory, ray_session, fault_after, worker,
                                                    max_age, val_period):
    tmp_path = tmp_path_factory.mktemp("gen_exit")
    steps = 8
    cfg = sim_config(tmp_path, "g", run__steps=steps, schedule__max_age=max_age, validation__period=val_period,
                     generation__num_generators=2, inject__fault="generate_exit", inject__after=fault_after,
                     inject__worker=worker, sim__generate_s=0.03, sim__train_s=0.01, sim__jitter=0.5)
    summary = train(cfg, quiet=True)
    events = load_events(tmp_path / "g")
    violations = check_events(events)
    assert violations == [], "\n".join(v.message for v in violations)
    assert summary["generator_restarts"] == {f"gen{worker}": 1}
    died = [e for e in events if e["ev"] == "generator_died"]
    assert [e["dead"] for e in died] == [f"gen{worker}"]
    # Conservation: every launched prompt group trained exactly once, none dropped.
    trained = trained_batches(events)
    assert len(trained) == len(set(trained)) == 2 * steps
    acc = summary["accounting"]
    assert acc["balanced"] and acc["trained"] == 2 * steps and acc["dropped"] == 0
    # The dead generator's unfinished batches restarted on its replacement with the same ids.
    relaunched = {e["batch"] for e in events if e["ev"] == "relaunch"}
    assert relaunched and all(b.endswith(f".g{worker}") for b in relaunched)
    assert {e["batch"] for e in events if e["ev"] == "rollout_start" and e["worker"] == f"gen{worker}_r1"} >= relaunched


def test_a_restart_is_told_on_the_console(tmp_path, ray_session, capsys):
    """Which worker died at which step, restart k of n, which batches were relaunched."""
    cfg = sim_config(tmp_path, "say", run__steps=4, generation__num_generators=2, inject__fault="generate_exit",
                     inject__after=1, inject__worker=1, sim__generate_s=0.03, metrics__progress="false")
    train(cfg)
    out = capsys.readouterr().out
    relaunched = sorted({e["batch"] for e in load_events(tmp_path / "say") if e["ev"] == "relaunch"})
    died = [line for line in out.splitlines() if "generator gen1 died" in line]
    assert len(died) == 1 and "starting restart 1 of 2" in died[0], out
    step = died[0].split("step ")[1].split(":")[0]
    assert (f"dagrl: step {step}: gen1_r1 replaced gen1 and relaunched {len(relaunched)} unfinished batches "
            f"{relaunched}; the step goes on") in out, out


def test_restarts_exhausted_stops_naming_the_worker(tmp_path, ray_session):
    cfg = sim_config(tmp_path, "x", run__steps=8, generation__num_generators=2, inject__fault="generate_exit",
                     inject__after=1, inject__worker=1, inject__incarnations=9, fault__max_restarts=1)
    with pytest.raises(PipelineError, match=r"worker gen1_r1 died.*fault.max_restarts is 1"):
        train(cfg, quiet=True)
    events = load_events(tmp_path / "x")
    deaths = [e for e in events if e["ev"] == "generator_died"]
    assert [e["dead"] for e in deaths] == ["gen1", "gen1_r1"]
    # The error follows the second death within the fault deadline (pings every second).
    end = next(e for e in events if e["ev"] == "run_end")
    assert end["t"] - deaths[-1]["t"] < cfg.run.deadline_s
    assert "fault.max_restarts" in end["error"]


@pytest.mark.parametrize("ranks,dead", [(1, "trainer"), (2, "trainer1")])
def test_trainer_death_is_an_error_and_resume_completes(tmp_path, ray_session, ranks, dead):
    # With two ranks only rank 1 dies: rank 0 lives on, and must not hold the run up.
    cfg = sim_config(tmp_path, "t", run__steps=8, run__checkpoint_every=2, inject__fault="train_exit",
                     inject__after=5, inject__worker=ranks - 1, training__ranks=ranks)
    started = time.monotonic()
    with pytest.raises(PipelineError, match=rf"(?s)worker {dead} died.*--resume"):
        train(cfg, quiet=True)
    assert time.monotonic() - started < 60
    run_dir = tmp_path / "t"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_4"]
    fixed = sim_config(tmp_path, "t", run__steps=8, run__checkpoint_every=2, training__ranks=ranks)
    summary = train(fixed, quiet=True, restore_from=str(run_dir))
    assert summary["error"] is None and summary["start_step"] == 4 and summary["steps"] == 8
    assert check_events(load_events(run_dir)) == []
    first = [b for b in trained_batches(load_events(run_dir / "attempts" / "1"))]
    second = trained_batches(load_events(run_dir))
    # Steps 0-3 from the first attempt, 4-7 from the second: each batch once.
    kept = [b for b in first if int(b.split(".")[0][1:]) < 4]
    assert sorted(kept + second) == sorted(f"t{s}.g0" for s in range(8))


def test_reward_failures_are_counted_then_stop_the_run(tmp_path, ray_session):
    cfg = sim_config(tmp_path, "r", run__steps=4, inject__fault="reward_raise", inject__after=7,
                     fault__max_reward_failures=100)
    summary = train(cfg, quiet=True)
    events = load_events(tmp_path / "r")
    failed = [e for e in events if e["ev"] == "reward_failed"]
    assert failed and all("injected fault: reward_raise" in e["reason"] for e in failed)
    assert summary["accounting"]["reward_failures"] == len(failed)
    assert check_events(events) == []
    import json
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert sum(m.get("reward_failures", 0) for m in metrics if m["step"] >= 0) == len(failed)

    strict = sim_config(tmp_path, "s", run__steps=4, inject__fault="reward_raise", inject__after=7,
                        fault__max_reward_failures=2)
    with pytest.raises(PipelineError, match=r"reward failed on \d+ samples, more than "
                                             r"fault.max_reward_failures \(2\)"):
        train(strict, quiet=True)


def test_controller_death_is_an_error_not_a_hang(tmp_path, ray_session):
    """The controller owns the rollout queue: killing it mid-run must end the run with its name."""
    import threading

    import ray

    from pipeline.run.pool import start_workers, stop_workers
    from tests.support._procs import steps_logged

    cfg = sim_config(tmp_path, "c", run__steps=30, sim__generate_s=0.05)
    workers = start_workers(1)
    stop = threading.Event()

    def kill_when_running():
        while not stop.is_set() and steps_logged(tmp_path / "c") < 3:
            stop.wait(0.1)  # polling the run's files from outside; orders nothing in the run
        if not stop.is_set():
            ray.kill(workers.controller)

    killer = threading.Thread(target=kill_when_running, daemon=True)
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(PipelineError,
                           match=r"(?s)worker controller died.*cannot go on without it.*(--resume|start the run again)"):
            train_on(cfg, workers, quiet=True)
        assert time.monotonic() - started < cfg.run.deadline_s + 30
    finally:
        stop.set()
        killer.join(timeout=10)
        stop_workers(workers)


def test_compiled_mode_names_the_dead_generator_instead_of_hanging(tmp_path, ray_session):
    """Compiled graphs do not replace a generator (their channels bind the dead actor);
    the run must still stop at once, naming it and the way on."""
    cfg = sim_config(tmp_path, "cg", run__dag_mode="compiled", run__steps=10, inject__fault="generate_exit",
                     inject__after=4)
    started = time.monotonic()
    with pytest.raises(PipelineError,
                       match=r"(?s)worker gen0 died.*need run.dag_mode classic.*(--resume|start the run again)"):
        train(cfg, quiet=True)
    assert time.monotonic() - started < cfg.run.deadline_s + 30


def test_nonfinite_steps_in_a_row_stop_the_run(tmp_path, ray_session, capsys):
    """Every step's loss NaN from step 2 on (inject.fault train_nonfinite, on both ranks): two
    skipped steps are warned of, told in the events and metrics, and the second stops the run."""
    import json
    cfg = sim_config(tmp_path, "nf", run__steps=8, inject__fault="train_nonfinite", inject__after=2,
                     fault__max_nonfinite_steps=2, training__ranks=2, metrics__progress="false")
    with pytest.raises(PipelineError, match=r"node 'train' .* the policy skipped 2 optimizer steps in a row "
                                            r"for a non-finite loss or gradient norm \(step 3: loss nan and "
                                            r"gradient norm nan\), fault.max_nonfinite_steps is 2"):
        train(cfg)
    events = load_events(tmp_path / "nf")
    skips = [(e["worker"], e["step"], e["in_a_row"], e["loss"]) for e in events if e["ev"] == "nonfinite_skip"]
    assert sorted(skips) == [(w, s, s - 1, "nan") for w in ("trainer0", "trainer1") for s in (2, 3)]
    metrics = [json.loads(line) for line in (tmp_path / "nf" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m.get("nonfinite_skipped")) for m in metrics if m["step"] >= 0] == [(0, 0.0), (1, 0.0),
                                                                                           (2, 1.0)]
    out = capsys.readouterr().out
    assert "dagrl: warning: step 2: the policy's loss nan and gradient norm nan: optimizer step skipped" in out
    assert "fault.max_nonfinite_steps is 2" in json.loads((tmp_path / "nf" / "summary.json").read_text())["error"]


def test_the_command_line_exits_non_zero_when_nonfinite_steps_stop_the_run(tmp_path):
    from tests.support._procs import run_driver
    log = tmp_path / "cli.log"
    status = run_driver(["--config", "examples/sim_grpo.yaml", f"run.output_dir={tmp_path}", "run.name=cli",
                         "run.steps=4", "validation.period=0", "inject.fault=train_nonfinite", "inject.after=1",
                         "fault.max_nonfinite_steps=1", "metrics.tensorboard=false", "metrics.progress=false"],
                        log, timeout_s=300)
    out = log.read_text()
    assert status == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert errors and "fault.max_nonfinite_steps is 1" in errors[-1], out[-3000:]
