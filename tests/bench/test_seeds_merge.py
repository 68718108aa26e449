"""benchmarks/seeds.py --merge: a long benchmark measured in several sittings
is one table, each run tagged with the commit it ran at. The learning runs
are replaced by a stand-in here; what is tested is the bookkeeping."""
from __future__ import annotations

import json

import pytest

from benchmarks import seeds

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_runs(monkeypatch, tmp_path):
    calls = []

    def learning_run(algorithm, max_age, seed, steps, val_period, model, runs_dir, overrides):
        calls.append((algorithm, max_age, seed))
        rewards = [min(1.0, 0.1 * k) for k in range(steps)]
        return {"algorithm": algorithm, "mode": seeds.MODES[max_age], "max_age": max_age, "seed": seed,
                "rewards": rewards, "final_val": 1.0, "steps_to_0.7": 7 + max_age + seed,
                "steps_to_val_0.9": 9, "wall_s": 1.0}

    commit = {"value": "a" * 40}
    monkeypatch.setattr(seeds, "learning_run", learning_run)
    monkeypatch.setattr(seeds, "start_ray", lambda: None)
    monkeypatch.setattr(seeds, "shutdown_ray", lambda: None)
    monkeypatch.setattr(seeds, "machine_info", lambda: {
        "git_commit": commit["value"], "git_dirty": False, "loadavg_start": [0.0, 0.0, 0.0]})
    monkeypatch.setattr("pipeline.inputs.tiny.build_tiny_model", lambda path: path)
    monkeypatch.setattr("pipeline.inputs.tiny.model_digest", lambda path: "digest")
    return calls, commit


def run(tmp_path, *args):
    return seeds.main(["--steps", "12", "--seeds", "0", "1", "--out", str(tmp_path), "--result", "algos", *args])


def test_merge_keeps_earlier_runs_and_replaces_repeated_ones(fake_runs, tmp_path):
    calls, commit = fake_runs
    run(tmp_path, "--algorithms", "dr_grpo", "rloo")
    commit["value"] = "b" * 40
    result = run(tmp_path, "--algorithms", "rloo", "gspo", "--merge")
    on_disk = json.loads((tmp_path / "algos.json").read_text())
    assert on_disk["summary"] == result["summary"]
    assert len(calls) == 8 + 8  # each invocation ran what it was asked, nothing of the earlier one
    keys = sorted((r["algorithm"], r["mode"], r["seed"]) for r in on_disk["runs"])
    assert len(keys) == len(set(keys)) == 12  # dr_grpo from the first sitting, rloo replaced, gspo added
    commits = {r["algorithm"]: r["git_commit"][0] for r in on_disk["runs"]}
    assert commits == {"dr_grpo": "a", "rloo": "b", "gspo": "b"}
    assert on_disk["params"]["algorithms"] == ["dr_grpo", "rloo", "gspo"]
    assert {"dr_grpo_async", "rloo_sync", "gspo_async"} <= set(on_disk["summary"])
    assert on_disk["summary"]["dr_grpo_async_over_sync_steps"] == pytest.approx(8.5 / 7.5)


def test_without_merge_the_file_holds_only_this_invocation(fake_runs, tmp_path):
    run(tmp_path, "--algorithms", "dr_grpo")
    run(tmp_path, "--algorithms", "rloo")
    on_disk = json.loads((tmp_path / "algos.json").read_text())
    assert {r["algorithm"] for r in on_disk["runs"]} == {"rloo"}


def test_merge_refuses_runs_of_another_length(fake_runs, tmp_path):
    run(tmp_path, "--algorithms", "dr_grpo")
    with pytest.raises(SystemExit, match="other steps or another model"):
        seeds.main(["--steps", "30", "--seeds", "0", "--out", str(tmp_path), "--result", "algos",
                    "--algorithms", "rloo", "--merge"])


def test_the_result_is_on_disk_after_every_run(fake_runs, tmp_path, monkeypatch):
    calls, _ = fake_runs
    real = seeds.learning_run

    def dies_on_the_third(*a):
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(seeds, "learning_run", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "--algorithms", "dr_grpo")
    assert len(json.loads((tmp_path / "algos.json").read_text())["runs"]) == 2
