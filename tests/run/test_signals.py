"""A run stopped by a signal, as a practitioner's runs are (Ctrl-C, SLURM
preemption, `ray job stop`): a clean stop checkpoints the last finished step
and names the command that resumes it, and the resumed run is the run that was
never stopped; a second signal stops at once; a SIGKILLed driver leaves no
process of its Ray behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.run.driver import train
from pipeline.run.reaper import MARK
from tests.support._procs import ROOT, sigkill_tree, start_driver, steps_logged, wait_for

pytestmark = pytest.mark.sim

SIM = ["--config", "examples/sim_grpo.yaml", "metrics.progress=false", "metrics.tensorboard=false",
       "run.dag_mode=classic", "validation.period=0", "validation.at_start=false", "validation.at_end=false"]


def _sim_run(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return [*SIM, f"run.output_dir={tmp_path}", f"run.name={name}", *extra]


def _curve(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["reward_mean"], r["loss"]) for r in rows if r["step"] >= 0]


def _ray_of(driver_pid: int) -> list[str]:
    """The processes of the local Ray a driver started (pipeline/run/reaper.py's mark)."""
    needle = f"{MARK}={driver_pid}-".encode()
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and any(v.startswith(needle) for v in (entry / "environ").read_bytes().split(b"\0")):
                left.append(f"{entry.name} {(entry / 'cmdline').read_bytes()[:60]!r}")
        except OSError:
            continue
    return left


def _no_ray_left_within(driver_pid: int, seconds: float) -> list[str]:
    end = time.monotonic() + seconds
    while (left := _ray_of(driver_pid)) and time.monotonic() < end:
        time.sleep(0.2)  # polling other processes' exits; this orders nothing of ours
    return left


@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_a_signal_checkpoints_the_last_step_and_the_resumed_run_is_the_unstopped_one(tmp_path, signum,
                                                                                      ray_session):
    steps = 10
    run_dir = tmp_path / "stopped"
    log = tmp_path / "stopped.log"
    launched = time.time()
    proc = start_driver(_sim_run(tmp_path, "stopped", f"run.steps={steps}", "run.checkpoint_every=0"), log)
    try:
        wait_for(lambda: steps_logged(run_dir) >= 3, 300, proc, "step 3", log)
        proc.send_signal(signum)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            sigkill_tree(proc)
    out = log.read_text()
    assert rc == 128 + signum, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    done = summary["steps"]
    name = signal.Signals(signum).name
    assert summary["stopped_by"] == name and 3 <= done < steps
    assert f"resume with: python -m pipeline train --resume {run_dir}" in summary["error"]
    assert f"stopped by {name} after {done} of {steps} steps" in out
    assert (run_dir / "checkpoints" / f"step_{done}" / "meta.json").is_file()
    # The run's time by the user's clock: from the process's start, Ray's start and imports included.
    assert abs(summary["process_started_at"] - launched) < 2
    assert _no_ray_left_within(proc.pid, 10) == []

    resumed = subprocess.run([sys.executable, "-m", "pipeline", "train", *_sim_run(tmp_path, "stopped",
                              f"run.steps={steps}", "run.checkpoint_every=0"), "--resume", str(run_dir)],
                             cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = _sim_run(tmp_path, "whole", f"run.steps={steps}", "run.checkpoint_every=0")
    assert train(load_config(whole[1], whole[2:]), quiet=True)["error"] is None
    assert _curve(run_dir) == _curve(tmp_path / "whole")


def test_a_second_signal_stops_at_once_and_says_what_to_resume_from(tmp_path):
    run_dir = tmp_path / "twice"
    log = tmp_path / "twice.log"
    # Each step takes 10 s: a stop that waited for the step would take that long.
    proc = start_driver(_sim_run(tmp_path, "twice", "run.steps=50", "run.checkpoint_every=1", "sim.train_s=10",
                                 "run.deadline_s=120"), log)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step_1" / "meta.json").is_file(), 300, proc, "step 1", log)
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "a second signal stops at once" in log.read_text(), 30, proc, "the first stop", log)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            sigkill_tree(proc)
    out = log.read_text()
    assert rc == 130, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and summary["steps"] == 1
    assert summary["error"].startswith("stopped at once by a second signal (SIGINT); resume from step_1 with: ")
    assert _no_ray_left_within(proc.pid, 10) == []


def test_a_second_signal_while_the_workers_stop_still_stops_at_once(tmp_path, ray_session, monkeypatch):
    """The first signal comes between two steps, so the run stops cleanly; the second
    comes while the stopped run's workers are being stopped (sent here by that stop
    itself). It is still the second signal: the run says so, with its resume hint."""
    import pipeline.run.driver as driver
    from pipeline.run.stopping import StopNow
    step, stop_workers = driver.Run.step, driver.stop_workers

    def step_then_signal(run, index):
        step(run, index)
        if index == 1:
            os.kill(os.getpid(), signal.SIGINT)

    def stop_then_signal(workers):
        stop_workers(workers)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(driver.Run, "step", step_then_signal)
    monkeypatch.setattr(driver, "stop_workers", stop_then_signal)
    # The suite may run as a background job, which starts with SIGINT ignored: start from Python's handler.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    args = _sim_run(tmp_path, "twice", "run.steps=10", "run.checkpoint_every=1")
    try:
        with pytest.raises(StopNow, match=r"stopped at once by a second signal \(SIGINT\)"):
            train(load_config(args[1], args[2:]), quiet=True)
    finally:
        signal.signal(signal.SIGINT, before)
    summary = json.loads((tmp_path / "twice" / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and summary["steps"] == 2
    assert summary["error"].startswith("stopped at once by a second signal (SIGINT); resume from step_2 with: ")


def test_a_sigkilled_driver_takes_its_local_ray_with_it(tmp_path):
    run_dir = tmp_path / "killed"
    log = tmp_path / "killed.log"
    proc = start_driver(_sim_run(tmp_path, "killed", "run.steps=200"), log)
    try:
        wait_for(lambda: steps_logged(run_dir) >= 1, 300, proc, "step 1", log)
        assert _ray_of(proc.pid), "the run's Ray processes carry the mark"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # Ray's own fate-sharing ends the GCS and raylet; its agents stayed over a minute.
        assert _no_ray_left_within(proc.pid, 10) == []
    finally:
        if proc.poll() is None:
            sigkill_tree(proc)
