"""Where a run's Ray comes from: the address it is given (RAY_ADDRESS, ray.address),
else a local cluster of its own, even when a `ray start` cluster on this machine
left /tmp/ray/ray_current_cluster behind (plain ray.init() would join that one,
then refuse num_cpus)."""
from __future__ import annotations

import os

import pytest
import ray

from pipeline.config import load_config
from pipeline.run import startup

pytestmark = pytest.mark.unit


@pytest.fixture
def calls(monkeypatch):
    seen: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(kw))
    # Not the suite's own Ray, which later tests in this process use.
    monkeypatch.setattr(ray, "shutdown", lambda: seen.append({"shutdown": True}))
    return seen


def test_without_an_address_the_run_starts_a_local_cluster_of_its_own(monkeypatch, calls):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    stop = startup.start_ray(load_config("examples/sim_grpo.yaml"))
    stop()
    kw, stopped = calls
    assert kw["address"] == "local" and kw["num_cpus"] >= 1 and stopped == {"shutdown": True}


def test_a_local_cluster_prestarts_no_workers(monkeypatch, calls):
    """The step graph's actors have env_vars in their runtime_env, which Ray's prestarted
    plain workers cannot serve: two idled through start-up on the cores the actors needed."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    startup.start_ray(load_config("examples/sim_grpo.yaml"))()
    assert calls[0]["_system_config"]["prestart_worker_first_driver"] is False


def test_an_address_given_is_joined_as_it_is(monkeypatch, calls):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    startup.start_ray(load_config("examples/sim_grpo.yaml"))()
    kw, stopped = calls
    assert stopped == {"shutdown": True}
    assert kw["address"] == "10.0.0.1:6379" and "num_cpus" not in kw


def test_the_process_start_is_read_as_the_kernel_has_it():
    import psutil
    assert startup.process_started_at() == pytest.approx(psutil.Process().create_time(), abs=0.05)


def test_the_optional_head_processes_are_skipped_for_the_call_only():
    """The names are Ray's private ones (pinned Ray): a Ray that renames them fails here."""
    from ray._private.node import Node
    started = {name: getattr(Node, name) for name in startup.OPTIONAL_HEAD_PROCESSES}
    with startup.optional_head_processes_skipped():
        assert all(getattr(Node, name) is startup._skip_process for name in started)
    assert {name: getattr(Node, name) for name in started} == started


@pytest.mark.sim
def test_a_local_cluster_runs_no_dashboard_monitor_or_log_monitor(tmp_path):
    """A real local start (in its own process: the suite has a Ray of its own) runs an actor,
    and no process of Ray's dashboard, autoscaler monitor or log monitor is among the cluster's."""
    import subprocess
    import sys
    script = (
        "import os, psutil, ray\n"
        "from pipeline.config import load_config\n"
        "from pipeline.run import startup\n"
        "stop = startup.start_ray(load_config('examples/sim_grpo.yaml'))\n"
        "try:\n"
        "    assert ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=60) == 42\n"
        "    me = psutil.Process()\n"
        "    procs = me.children(recursive=True)\n"
        "    print('\\n'.join(' '.join(p.cmdline()) for p in procs if p.is_running()))\n"
        "finally:\n"
        "    stop()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_ADDRESS": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    commands = out.stdout
    assert "raylet" in commands and "gcs_server" in commands
    for skipped in ("dashboard/dashboard.py", "autoscaler/_private/monitor.py", "_private/log_monitor.py"):
        assert skipped not in commands, commands
