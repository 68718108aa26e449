"""The rules between the verl-porting keys of policy_loss and reward_kl
and grpo_std (pipeline/config/checks.py): a bad combination is refused, naming the key."""
from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("recipe, overrides, needle", [
    ("examples/sim_grpo.yaml", ["policy_loss.kl_estimator=k1"],
     "policy_loss.kl_estimator: shapes the KL in the loss, which is off"),
    ("examples/sim_grpo.yaml", ["policy_loss.kl_clamp=10"], "policy_loss.kl_clamp: shapes the KL in the loss"),
    ("examples/sim_grpo.yaml", ["policy_loss.kl_estimator=abs"], "policy_loss.kl_estimator: 'abs' is not allowed"),
    ("examples/sim_grpo.yaml", ["reward_kl.ctrl=adaptive"],
     "reward_kl.ctrl: shapes the KL in the reward, which is off"),
    ("examples/tiny_reinforce_pp.yaml", ["reward_kl.target=0.2"],
     "reward_kl.target: steers an adaptive coefficient; set reward_kl.ctrl: adaptive"),
    ("examples/tiny_reinforce_pp.yaml", ["reward_kl.ctrl=adaptive", "reward_kl.horizon=0"],
     "reward_kl.horizon: 0"),
    ("examples/tiny_grpo.yaml", ["reward_kl.coef=0.01", "distill.teacher=models/tiny", "distill.task_reward=false"],
     "reward_kl.coef: shapes the task reward's advantage, which distill.task_reward false leaves out"),
    ("examples/tiny_reinforce_pp.yaml", ["reinforce_pp.kl_coef=0.01"],
     "section 'reinforce_pp' is gone; its keys moved: kl_coef -> reward_kl.coef, kl_ctrl -> reward_kl.ctrl"),
    ("examples/sim_grpo.yaml", ["policy_loss.sapo_tau_neg=2"],
     "policy_loss.sapo_tau_neg: is mode sapo's setting; policy_loss.mode is 'clip'"),
    ("examples/sim_grpo.yaml", ["policy_loss.mode=gspo", "policy_loss.kl_cov_coef=1"],
     "policy_loss.kl_cov_coef: is mode kl_cov's setting; policy_loss.mode is 'gspo'"),
    ("examples/sim_grpo.yaml", ["policy_loss.mode=sapo", "policy_loss.dual_clip=3"],
     "policy_loss.dual_clip: mode sapo has no dual-clip"),
    ("examples/sim_grpo.yaml", ["policy_loss.mode=kl_cov", "policy_loss.clip_eps_high=0.28"],
     "policy_loss.clip_eps_high: mode kl_cov has no clip band"),
    ("examples/sim_grpo.yaml", ["policy_loss.mode=clip_cov", "policy_loss.clip_cov_lb=6"],
     "policy_loss.clip_cov_lb: 6.0 must be below clip_cov_ub (5.0)"),
    ("examples/sim_grpo.yaml", ["policy_loss.mode=gmpo", "policy_loss.is_level=sequence"],
     "policy_loss.aggregation: 'token-mean': gmpo's loss is one term per sequence"),
    ("examples/sim_grpo.yaml", ["policy_loss.mode=gmpo", "policy_loss.aggregation=seq-mean-token-mean"],
     "policy_loss.is_level: 'token': gmpo weighs each sequence by one IS weight"),
    ("examples/sim_grpo.yaml", ["policy_loss.is_sequence_form=product"],
     "policy_loss.is_sequence_form: forms a sequence's IS weight, which only is_level sequence"),
    ("examples/sim_grpo.yaml", ["policy_loss.is_reject_high=0.9"], "policy_loss.is_reject_high: 0.9 must be above 1"),
    ("examples/sim_grpo.yaml", ["policy_loss.is_reject_low=1"], "policy_loss.is_reject_low: 1 rejects every"),
    ("examples/sim_grpo.yaml", ["policy_loss.is_reject_low=2"], "policy_loss.is_reject_low: 2"),
])
def test_a_bad_combination_is_refused_naming_the_key(recipe, overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(recipe, overrides)
    assert needle in str(err.value)


@pytest.mark.parametrize("recipe, overrides", [
    ("examples/sim_grpo.yaml", ["policy_loss.kl_coef=0.01", "policy_loss.kl_estimator=k2", "policy_loss.kl_clamp=10"]),
    ("examples/tiny_reinforce_pp.yaml", ["reward_kl.ctrl=adaptive", "reward_kl.target=0.05",
                                         "reward_kl.horizon=500", "reward_kl.estimator=abs"]),
    ("examples/tiny_grpo.yaml", ["reward_kl.coef=0.01", "reward_kl.estimator=k3"]),
    ("examples/tiny_rloo.yaml", ["reward_kl.coef=0.01", "reward_kl.ctrl=adaptive"]),
    ("examples/sim_grpo.yaml", ["policy_loss.mode=gmpo", "policy_loss.is_level=sequence", "policy_loss.clip_eps=0.4",
                                "policy_loss.aggregation=seq-mean-token-mean"]),
    ("examples/sim_grpo.yaml", ["policy_loss.mode=sapo", "policy_loss.sapo_tau_neg=1.1"]),
    ("examples/sim_grpo.yaml", ["policy_loss.mode=clip_cov", "policy_loss.clip_cov_ratio=0.001"]),
    ("examples/sim_grpo.yaml", ["policy_loss.mode=kl_cov", "policy_loss.kl_cov_coef=1",
                                "policy_loss.aggregation=token-sum"]),
    ("examples/sim_grpo.yaml", ["policy_loss.is_sequence_form=product", "policy_loss.is_reject_low=0.1",
                                "policy_loss.is_reject_high=10"]),
])
def test_the_combinations_a_verl_recipe_uses_load(recipe, overrides):
    load_config(recipe, overrides)


def test_grpo_std_is_grpos_only():
    assert load_config("examples/sim_grpo.yaml", ["grpo_std=sample"]).grpo_std == "sample"
    with pytest.raises(ConfigError, match="grpo_std: divides GRPO's advantages; algorithm 'rloo' does not read it"):
        load_config("examples/sim_grpo.yaml", ["grpo_std=sample", "algorithm=rloo"])
