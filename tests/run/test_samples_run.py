"""Whole simulated runs write the samples their steps trained on and their
validations scored (metrics.samples): what samples.jsonl holds must agree
with the run's metrics, the sim's reward of each text and the run's versions,
and a recipe and seed must write the same samples whatever the timing."""
from __future__ import annotations

import json
import statistics

import pytest

from pipeline.config import load_config
from pipeline.core.events import load_events
from pipeline.core.types import Prompt
from pipeline.sim.engines import sim_reward
from pipeline.tools.check import check_events
from tests.support.pooled_run import train_on

pytestmark = pytest.mark.sim

STEPS, PROMPTS, GROUP, MAX_AGE = 6, 8, 4, 1
RUN = [f"run.steps={STEPS}", "run.dag_mode=classic", "run.deadline_s=30", f"schedule.max_age={MAX_AGE}",
       f"schedule.prompts_per_step={PROMPTS}", f"schedule.group_size={GROUP}", "generation.num_generators=2",
       "validation.period=3", "validation.at_start=true", "sim.train_s=0.01", "sim.refit_s=0",
       "sim.flat_share=0.5", "metrics.tensorboard=false"]


def _run(tmp_path, sim_pool, name: str, *overrides: str) -> tuple[list[dict], list[dict]]:
    """The run's samples and metrics records; its event log checked first."""
    cfg = load_config(None, [f"run.output_dir={tmp_path}", f"run.name={name}", *RUN, *overrides])
    summary = train_on(cfg, sim_pool, quiet=True)
    assert summary["error"] is None and summary["steps"] == STEPS
    run_dir = tmp_path / name
    violations = check_events(load_events(run_dir))
    assert violations == [], "\n".join(v.message for v in violations)
    read = [[json.loads(line) for line in (run_dir / f).read_text().splitlines()]
            for f in ("samples.jsonl", "metrics.jsonl")]
    return read[0], read[1]


@pytest.fixture(scope="module")
def every_group(tmp_path_factory, sim_pool):
    """A run that writes every group of every step (metrics.samples = prompts_per_step)."""
    return _run(tmp_path_factory.mktemp("samples"), sim_pool, "all", f"metrics.samples={PROMPTS}",
                "sim.generate_s=0.05")


def test_every_steps_samples_are_its_batch(every_group):
    samples, metrics = every_group
    by_step = {m["step"]: m for m in metrics if "reward_mean" in m}
    assert sorted(by_step) == list(range(STEPS))
    for step, record in by_step.items():
        train = [s for s in samples if s["kind"] == "train" and s["step"] == step]
        assert len(train) == PROMPTS and all(len(s["completions"]) == GROUP for s in train)
        completions = [c for s in train for c in s["completions"]]
        # Every group is written: their rewards are the batch's, whose mean the step's record holds.
        assert statistics.fmean(c["reward"] for c in completions) == pytest.approx(record["reward_mean"], abs=1e-6)
        assert statistics.fmean(s["age"] for s in train) == pytest.approx(record["age_mean"])
        for s in train:
            assert s["age"] == step - s["version"] and 0 <= s["age"] <= MAX_AGE
            assert s["prompt"] == f"simulated prompt {s['prompt_id'].removeprefix('train')}"
            for c in s["completions"]:
                # The simulator's reward of the text written: the text is the one the batch scored.
                assert c["reward"] == pytest.approx(sim_reward(Prompt(s["prompt_id"], s["prompt"]), c["text"]))
                assert s["version"] <= min(c["versions"]) and max(c["versions"]) <= step
                assert c["text"] == f"v{c['versions'][0]}" or c["text"].startswith(f"v{c['versions'][0]}+")


def test_validations_write_their_prompts_after_the_step_they_follow(every_group):
    samples, metrics = every_group
    validated = {m["step"]: m["val_reward"] for m in metrics if "val_reward" in m}
    assert sorted(validated) == [-1, 2, 5]
    val = [s for s in samples if s["kind"] == "val"]
    assert sorted({s["step"] for s in val}) == sorted(validated)
    for step, reward in validated.items():
        mine = [s for s in val if s["step"] == step]
        # All 8 of the simulator's validation prompts, in the set's order, from both generators.
        assert [s["prompt_id"] for s in mine] == [f"val{i}" for i in range(8)]
        assert all(s["version"] == step + 1 and len(s["completions"]) == 1 for s in mine)
        assert statistics.fmean(s["completions"][0]["reward"] for s in mine) == pytest.approx(reward, abs=1e-6)


def test_the_same_recipe_and_seed_write_the_same_first_samples(tmp_path, sim_pool, every_group):
    """Fewer samples a step, in another run at other latencies: the first of the full run's."""
    full, _ = every_group
    few, _ = _run(tmp_path, sim_pool, "few", "metrics.samples=2", "sim.generate_s=0.02", "sim.jitter=0.5")
    for kind in ("train", "val"):
        for step in sorted({s["step"] for s in full if s["kind"] == kind}):
            assert [s for s in few if s["kind"] == kind and s["step"] == step] == \
                   [s for s in full if s["kind"] == kind and s["step"] == step][:2], (kind, step)


def test_with_dynamic_sampling_the_samples_are_groups_it_trained(tmp_path, sim_pool):
    """The flat groups dynamic sampling leaves out are not written: every group shown has a spread."""
    samples, metrics = _run(tmp_path, sim_pool, "dapo", f"metrics.samples={PROMPTS}", "sim.generate_s=0.02",
                            "dynamic_sampling.max_rounds=2", "validation.period=0", "validation.at_start=false")
    informative = {m["step"]: m["informative_groups"] for m in metrics if "informative_groups" in m}
    assert sum(m["flat_groups_dropped"] for m in metrics if "flat_groups_dropped" in m) > 0
    for step, count in informative.items():
        train = [s for s in samples if s["kind"] == "train" and s["step"] == step]
        assert len(train) == count and all(len({c["reward"] for c in s["completions"]}) > 1 for s in train)
