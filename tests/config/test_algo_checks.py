"""The rules between the verl-porting keys of policy_loss, reinforce_pp and
grpo (pipeline/config/checks.py): a bad combination is refused, naming the key."""
from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("recipe, overrides, needle", [
    ("examples/sim_grpo.yaml", ["policy_loss.kl_estimator=k1"],
     "policy_loss.kl_estimator: shapes the KL in the loss, which is off"),
    ("examples/sim_grpo.yaml", ["policy_loss.kl_clamp=10"], "policy_loss.kl_clamp: shapes the KL in the loss"),
    ("examples/sim_grpo.yaml", ["policy_loss.kl_estimator=abs"], "policy_loss.kl_estimator: 'abs' is not allowed"),
    ("examples/sim_grpo.yaml", ["reinforce_pp.kl_ctrl=adaptive"],
     "reinforce_pp.kl_ctrl: shapes the KL in the reward, which is off"),
    ("examples/tiny_reinforce_pp.yaml", ["reinforce_pp.kl_target=0.2"],
     "reinforce_pp.kl_target: steers an adaptive coefficient; set reinforce_pp.kl_ctrl: adaptive"),
    ("examples/tiny_reinforce_pp.yaml", ["reinforce_pp.kl_ctrl=adaptive", "reinforce_pp.kl_horizon=0"],
     "reinforce_pp.kl_horizon: 0"),
])
def test_a_bad_combination_is_refused_naming_the_key(recipe, overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(recipe, overrides)
    assert needle in str(err.value)


@pytest.mark.parametrize("recipe, overrides", [
    ("examples/sim_grpo.yaml", ["policy_loss.kl_coef=0.01", "policy_loss.kl_estimator=k2", "policy_loss.kl_clamp=10"]),
    ("examples/tiny_reinforce_pp.yaml", ["reinforce_pp.kl_ctrl=adaptive", "reinforce_pp.kl_target=0.05",
                                         "reinforce_pp.kl_horizon=500", "reinforce_pp.kl_estimator=abs"]),
])
def test_the_combinations_a_verl_recipe_uses_load(recipe, overrides):
    load_config(recipe, overrides)


def test_grpo_std_is_grpos_only():
    assert load_config("examples/sim_grpo.yaml", ["grpo.std=sample"]).grpo.std == "sample"
    with pytest.raises(ConfigError, match="grpo.std: divides GRPO's advantages; algorithm 'rloo' does not read it"):
        load_config("examples/sim_grpo.yaml", ["grpo.std=sample", "algorithm=rloo"])
