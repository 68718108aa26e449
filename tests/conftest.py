"""Shared fixtures: one local Ray and one pool of simulated workers per session,
a final check that the suite leaves no Ray process behind, and the tiers.

Every test is in one tier, its closest mark (a test marked apart from its
module's `pytestmark` is in its own): unit (no Ray, no engines), sim (Ray and
simulated workers), real (vLLM or DeepSpeed), cluster (several Ray nodes or
`ray job submit`). `--tier unit` (make test-fast) runs one tier; with no
--tier every test runs."""
from __future__ import annotations

import faulthandler
import os

import psutil
import pytest

from tests.support.leftover_ray import SUITE_MARK, ray_processes

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every process the suite starts inherits the mark: the leftover check counts
# only the suite's own Ray, not that of a benchmark running beside it.
os.environ[SUITE_MARK] = str(os.getpid())
TIERS = ("unit", "sim", "real", "cluster")


def pytest_addoption(parser):
    parser.addoption("--tier", action="append", choices=TIERS, default=[],
                     help="run only the tests of this tier (repeatable); default: every tier")


def tier_of(item) -> str:
    closest = next((m.name for m in item.iter_markers() if m.name in TIERS), None)
    if closest is None:
        raise pytest.UsageError(f"{item.nodeid}: no tier; mark its module with pytestmark = pytest.mark.<tier> "
                                f"(one of {', '.join(TIERS)})")
    return closest


def pytest_collection_modifyitems(config, items):
    wanted = config.getoption("--tier")
    keep, drop = [], []
    for item in items:
        tier = tier_of(item)  # every test has one, asked for or not
        (keep if not wanted or tier in wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


_SUITE_RAY: dict[str, str] = {}


@pytest.fixture(scope="session")
def ray_session():
    import ray
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    _SUITE_RAY["node"] = ray.get_runtime_context().get_node_id()
    try:
        yield ray
    finally:
        _SUITE_RAY.clear()
        ray.shutdown()


@pytest.fixture(autouse=True)
def _the_suites_ray_stays_up():
    """A test that shuts the suite's Ray down (a real ray.shutdown in a unit test)
    fails itself, not every later test on the session's actors."""
    yield
    if _SUITE_RAY:
        import ray
        assert ray.is_initialized() and ray.get_runtime_context().get_node_id() == _SUITE_RAY["node"], \
            "this test shut down or replaced the suite's Ray, which later tests' actors live in"


@pytest.fixture(scope="session")
def sim_pool(ray_session):
    from pipeline.run.pool import start_workers, stop_workers
    pool = start_workers(3)
    try:
        yield pool
    finally:
        stop_workers(pool)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny Llama and its tokenizer, built in code (no hub), once per session."""
    from pipeline.inputs.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tool_model(tiny_model, tmp_path_factory):
    """The tiny model warmed up on the calculator's call format, by the Makefile's
    command for models/tiny_tool, once per session."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("models") / "tiny_tool"
    run = subprocess.run([sys.executable, "-m", "pipeline", "warmup", "--model", str(tiny_model),
                          "--env", "pipeline.envs.calculator:CalculatorEnv", "--data", "data/tool_train.jsonl",
                          "--val", "data/tool_val.jsonl", "--out", str(out), "--seed", "0"],
                         cwd=root, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def pytest_sessionfinish(session, exitstatus):
    import ray
    if ray.is_initialized():
        ray.shutdown()
    left = ray_processes(os.environ[SUITE_MARK])
    for _ in range(50):  # Ray's processes exit asynchronously after shutdown
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        psutil.wait_procs(left, timeout=0.2)
    if left:
        print("\nRay processes left after the suite:")
        for p in left:
            try:
                print(f"  pid {p.pid}: {' '.join(p.cmdline())[:160]}")
            except psutil.NoSuchProcess:  # it exited while we listed it
                print(f"  pid {p.pid}: (exited meanwhile)")
        session.exitstatus = 1


def pytest_unconfigure(config):
    """After the summary the interpreter joins its non-daemon threads and every
    concurrent.futures worker (daemon or not): one stuck there held a CI run
    until it was killed, with no hint of why. If this process still lives two
    minutes on, every thread's stack goes to stderr and it exits with status 1."""
    faulthandler.dump_traceback_later(120, exit=True)
