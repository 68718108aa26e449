"""The reward_model section: each bad setting is refused naming its key."""
from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config

pytestmark = pytest.mark.unit

REAL = ["model.path=m", "data.train=t.jsonl", "data.reward=pipeline.rewards.rules:tiny_reward"]


def test_a_reward_model_makes_data_reward_optional():
    cfg = load_config(None, ["model.path=m", "data.train=t.jsonl", "reward_model.kind=classifier",
                             "reward_model.path=rm"])
    assert cfg.data.reward == "" and cfg.reward_model.kind == "classifier"
    with pytest.raises(ConfigError, match="data.reward: not set"):
        load_config(None, ["model.path=m", "data.train=t.jsonl"])


@pytest.mark.parametrize("overrides,message", [
    (["reward_model.path=rm"], "reward_model.path: is set, but reward_model.kind is empty"),
    (["reward_model.kind=judge"], "reward_model.path: not set; reward_model.kind 'judge' needs the model's directory"),
    (["reward_model.kind=classifier", "reward_model.path=rm", "reward_model.output_regex=x"],
     "reward_model.output_regex: is a judge's setting; reward_model.kind is 'classifier'"),
    (["reward_model.kind=judge", "reward_model.path=rm", "reward_model.template=rate {answer}"],
     r"reward_model.template: has no \{completion\} field"),
    (["reward_model.kind=judge", "reward_model.path=rm", "reward_model.template='{completion} {question}'"],
     r"reward_model.template: has the field\(s\) \{question\}"),
    (["reward_model.kind=judge", "reward_model.path=rm", "reward_model.template='{completion'"],
     "reward_model.template: .* is not a format string"),
    (["reward_model.kind=judge", "reward_model.path=rm", "reward_model.score_pattern=(["],
     "reward_model.score_pattern: '\\(\\[' is not a regular expression"),
    (["reward_model.kind=judge", "reward_model.path=rm", "reward_model.output_regex=a{"],
     None),   # a{ is a literal in Python's re: allowed
    (["reward_model.kind=classifier", "reward_model.path=rm", "env.class=pipeline.sim.env:SimToolEnv",
      "data.reward="], "reward_model.kind: 'classifier' scores single-turn completions, but env.class"),
])
def test_each_bad_setting_names_its_key(overrides, message):
    if message is None:
        load_config(None, [*REAL, *overrides])
        return
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*REAL, *overrides])


def test_a_validation_reward_of_its_own_needs_the_real_single_turn_stack():
    cfg = load_config(None, [*REAL, "validation.reward=pipeline.rewards.rules:gsm8k_reward"])
    assert cfg.validation.reward == "pipeline.rewards.rules:gsm8k_reward"
    with pytest.raises(ConfigError, match="validation.reward: .*backend is 'sim'"):
        load_config(None, ["validation.reward=pipeline.rewards.rules:gsm8k_reward"])


def test_the_score_exit_fault_needs_a_reward_model():
    with pytest.raises(ConfigError, match="inject.fault: score_exit ends the reward model's process"):
        load_config(None, ["inject.fault=score_exit"])
    assert load_config(None, ["inject.fault=score_exit", "reward_model.kind=judge"]).backend == "sim"
