"""Routing replay end to end on the tiny Qwen3-MoE: vLLM records each token's
experts (prompt tokens served from the prefix cache too), they ride the
trajectory table into the trainer, whose forward then computes exactly those
experts: its logprobs are the engine's at age 0, before and after a refit,
and a batch one update old still routes as the engine did, where the
trainer's own routers have moved. Runs in a process of its own
(tests/support/routing_check.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real

TOL = 2e-5


def test_the_trainer_replays_the_engines_routes_and_its_logprobs_are_the_engines(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tests.support.routing_check", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "measured.json").read_text())
    assert min(m["prompt_tokens"]) > 32  # past a KV block: the cached prefix's routes are filled in
    assert m["age0"]["tokens"] == sum(m["route_tokens"])  # every token but each sample's last has a route
    for view in ("age0", "age0_after_refit"):
        assert m[view]["routing_differs"] == 0 and m[view]["logprob_gap_max"] < TOL, m[view]
    assert m["metrics"]["is_weight"] == pytest.approx(1.0, abs=1e-5) and "route_flips" in m["metrics"]
    # One update at lr 1e-2 moves the tiny model's near-uniform routers: replay holds the engine's routes.
    assert m["age1_replayed"]["routing_differs"] == 0
    own, replayed = m["age1_own"], m["age1_replayed"]
    assert own["routing_differs"] > 0.05 * own["tokens"] and replayed["own_routing_differs"] > 0.05 * own["tokens"]
