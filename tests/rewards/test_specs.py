"""A reward a recipe names (pipeline/rewards/specs.py): a spec resolves to its
function or is refused naming it, and a spec of a module that moved still loads."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from pipeline.rewards.math_verifier import math_verify_reward
from pipeline.rewards.rules import gsm8k_reward, tiny_reward
from pipeline.rewards.specs import MOVED, RewardError, load_reward

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_load_reward_resolves_and_names_the_spec():
    assert load_reward("pipeline.rewards.rules:tiny_reward") is tiny_reward
    cases = [
        ("pipeline.rewards.rules.tiny_reward", "expected 'module:function'"),
        ("pipeline.rewards.rules:", "both parts non-empty"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("pipeline.rewards.rules:no_such_fn", "has no attribute 'no_such_fn'"),
        ("math:pi", "'pi' is a float, not callable"),
        ("os.path:basename", r"basename\(p\) cannot be called as basename\(prompt, completion_text\)"),
        ("pipeline.rewards.rules:extract_last_number", "cannot be called as extract_last_number"),
    ]
    for spec, expected in cases:
        with pytest.raises(RewardError, match=expected) as err:
            load_reward(spec)
        assert repr(spec) in str(err.value)


def test_a_reward_spec_of_a_module_that_moved_loads_the_same_function():
    for old in ("pipeline.inputs.rewards", "pipeline.rewards", "pipeline.io.rewards"):
        assert load_reward(f"{old}:tiny_reward") is tiny_reward
        assert load_reward(f"{old}:gsm8k_reward") is gsm8k_reward
    assert load_reward("pipeline.inputs.math_reward:math_verify_reward") is math_verify_reward
    # What a moved module did not have is still refused, naming where the spec was looked up.
    with pytest.raises(RewardError, match="'pipeline.inputs.rewards:nope': module 'pipeline.rewards.rules' has no"):
        load_reward("pipeline.inputs.rewards:nope")
    # Every old name leads to a module that is there now, and to no other old name.
    for new in MOVED.values():
        assert new not in MOVED and importlib.util.find_spec(new) is not None, new


def test_the_recipes_and_guides_name_rewards_where_they_are():
    pages = [*sorted((ROOT / "examples").glob("*.yaml")), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    specs = {spec for page in pages for spec in re.findall(r"\b(pipeline\.[\w.]+:\w+)", page.read_text())}
    assert "pipeline.rewards.rules:tiny_reward" in specs
    for spec in specs:
        module = spec.split(":")[0]
        assert module not in MOVED, spec
        if module.startswith("pipeline.rewards."):
            load_reward(spec)
