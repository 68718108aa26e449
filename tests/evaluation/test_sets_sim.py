"""Several validation sets in one run, on simulated workers: each is decoded on
the steps its period names, with the weights the validation gate says, and
never while a rollout starts (the checker's invariants)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.core.events import load_events
from pipeline.evaluation.sets import due_after
from pipeline.tools.check import check_events
from tests.support.pooled_run import train_on

pytestmark = pytest.mark.sim

SETS = ("validation.sets=[{name: greedy, period: 2}, "
        "{name: sampled, n: 3, temperature: 1.0, k: [1, 3], period: 3, correct_at: 0.1}]")


@pytest.mark.parametrize("refit_mode", ["drain", "inflight"])
def test_each_set_validates_on_its_steps_with_the_gates_weights(tmp_path, sim_pool, refit_mode):
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=sets", "run.deadline_s=30", "run.steps=6",
                             "schedule.max_age=1", "generation.num_generators=2", f"generation.refit_mode={refit_mode}",
                             "validation.at_start=true", "validation.at_end=true", SETS,
                             "sim.generate_s=0.02", "sim.validate_s=0.02", "sim.jitter=0.5", "sim.num_val_prompts=5"])
    train_on(cfg, sim_pool, quiet=True)
    run_dir = Path(tmp_path) / "sets"
    events = load_events(run_dir)
    violations = check_events(events)
    assert violations == [], "\n".join(v.message for v in violations)

    expected = {-1: ("greedy", "sampled"), **{s: due_after(s, cfg) for s in range(6)}}
    expected = {step: sets for step, sets in expected.items() if sets}
    assert expected[1] == ("greedy",) and expected[2] == ("sampled",) and expected[5] == ("greedy", "sampled")
    starts = [e for e in events if e["ev"] == "validation_start"]
    assert {(e["worker"], e["step"]): tuple(e["sets"]) for e in starts} == {
        (g, step): sets for g in ("gen0", "gen1") for step, sets in expected.items()}
    # The gate's weights: after step s every generator holds version s + 1 (the prologue's: 0).
    assert all(e["version"] == e["step"] + 1 for e in starts)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validated = {r["step"]: r for r in records if any(k.startswith("val/") for k in r)}
    assert sorted(validated) == sorted(expected)
    for step, sets in expected.items():
        r, version = validated[step], step + 1
        # sim_reward of a sample decoded with weights v is v / (v + 10), greedy or sampled.
        for name, n in (("greedy", 1), ("sampled", 3)):
            assert (f"val/{name}/mean@{n}" in r) == (name in sets), (step, r)
            if name in sets:
                assert r[f"val/{name}/mean@{n}"] == pytest.approx(version / (version + 10))
                assert r[f"val/{name}/count"] == 5
        if "sampled" in sets:
            passed = float(version / (version + 10) >= 0.1)
            assert r["val/sampled/pass@1"] == pytest.approx(passed) and r["val/sampled/pass@3"] == pytest.approx(passed)
        assert "val_reward" not in r

    # The checker proves the weights: a validation labelled with other weights than its worker loaded is caught.
    wrong = [dict(e, version=e["version"] - 1) if e is starts[-1] else e for e in events]
    assert any(v.invariant == 2 and "is labelled version" in v.message for v in check_events(wrong))
    # ... and so is one whose sets changed between its start and its end.
    end = next(e for e in events if e["ev"] == "validation_end" and (e["worker"], e["step"]) ==
               (starts[-1]["worker"], starts[-1]["step"]))
    changed = [dict(e, sets=["greedy"]) if e is end else e for e in events]
    assert any(v.invariant == 2 and "ended with" in v.message for v in check_events(changed))
