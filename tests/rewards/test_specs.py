"""A reward a recipe names (pipeline/rewards/specs.py): a spec resolves to its
function or is refused naming it, and a spec of a module that moved still loads."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from pipeline.core.types import Prompt
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


def test_a_reward_file_is_imported_by_its_path_once_per_process(tmp_path, monkeypatch):
    (tmp_path / "own.py").write_text("from dataclasses import dataclass\n\n\n@dataclass\nclass Seen:\n    n: int = 0\n\n\n"
                                     "SEEN = Seen()\n\n\ndef score(prompt, completion_text):\n"
                                     "    return float(completion_text == prompt.answer)\n")
    monkeypatch.chdir(tmp_path)
    fn = load_reward("own.py:score")
    assert fn(Prompt("p", "q", "a"), "a") == 1.0
    assert load_reward(f"{tmp_path}/own.py:score") is fn   # relative or absolute: one module
    (tmp_path / "raises.py").write_text("1 / 0\n")
    (tmp_path / "notes.txt").write_text("")
    cases = [("raises.py:score", "cannot import file 'raises.py': ZeroDivisionError: division by zero"),
             ("sub/notes.txt:score", r"'sub/notes.txt' is a path but not a \.py file"),
             ("own.py:nope", "file 'own.py' has no attribute 'nope'"),
             ("gone.py:score", "file 'gone.py' does not exist")]
    for spec, expected in cases:
        with pytest.raises(RewardError, match=expected) as err:
            load_reward(spec)
        assert str(err.value).startswith(f"reward spec {spec!r}: ")


def verl_reward(tmp_path, monkeypatch, returns: str):
    (tmp_path / "verl_style.py").write_text(
        f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {returns}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "verl_style", raising=False)
    return load_reward("verl_style:compute_score")


@pytest.mark.parametrize("returns, expected", [
    ("1", 1.0), ("True", 1.0), ("0.25", 0.25), ('{"score": 0.5, "acc": True}', 0.5),
    ("float(solution_str == ground_truth and extra_info == {} and data_source == 'src')", 1.0),
])
def test_a_verl_compute_score_is_adapted_and_its_score_read(tmp_path, monkeypatch, returns, expected):
    fn = verl_reward(tmp_path, monkeypatch, returns)
    assert fn(Prompt("p", "q", "42", data_source="src"), "42") == expected


@pytest.mark.parametrize("returns, expected", [
    ("'1.0'", "returned str; expected a number, or a dict with the number under 'score'"),
    ('{"acc": 1.0}', "returned a dict without a number under 'score'"),
    ("None", "returned NoneType"),
    ("float('nan')", "returned the score nan"),
])
def test_what_a_verl_compute_score_returns_other_than_a_score_names_the_spec(tmp_path, monkeypatch, returns, expected):
    fn = verl_reward(tmp_path, monkeypatch, returns)
    with pytest.raises(RewardError, match=f"^reward spec 'verl_style:compute_score' {re.escape(expected)}"):
        fn(Prompt("p", "q", "42"), "42")


def test_a_reward_map_needs_an_entry_and_names_each_bad_spec():
    with pytest.raises(RewardError, match="reward map is empty"):
        load_reward({})
    with pytest.raises(RewardError, match="reward spec 'nope:fn': cannot import module 'nope'"):
        load_reward({"a": "pipeline.rewards.rules:tiny_reward", "default": "nope:fn"})
    routed = load_reward({"a": "pipeline.rewards.rules:tiny_reward", "default": "pipeline.rewards.rules:gsm8k_reward"})
    assert routed.route("a") is tiny_reward and routed.route("b") is routed.route("") is gsm8k_reward


def test_an_edited_reward_file_is_imported_again(tmp_path):
    path = tmp_path / "edited.py"
    path.write_text("def score(prompt, completion_text):\n    return 0.0\n")
    assert load_reward(f"{path}:score")(Prompt("p", "q", "a"), "a") == 0.0
    path.write_text("def score(prompt, completion_text):\n    return 1.0  # edited\n")
    assert load_reward(f"{path}:score")(Prompt("p", "q", "a"), "a") == 1.0
