"""Every reward spec the guides write (`module:function`, `<dir>/<file>.py:function`,
in inline code or a code block) loads with load_reward, as a reader would
paste it into data.reward; a class the guides name (env.class) imports. What is
not meant to load, a placeholder (`module:function`, `<dir>/...`) or a module of
the reader's own (`my_rewards...`), is listed by name, so none hides there."""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from pipeline.rewards.specs import load_reward

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
# A dotted module or a .py path, a colon, a dotted attribute: not a URL, a port, a YAML key.
SPEC = re.compile(r"(?<![\w./<>:-])((?:[\w<>.-]+/)*[\w<>-]+\.py|[A-Za-z_<][\w<>]*(?:\.[A-Za-z_]\w*)*)"
                  r":([A-Za-z_<][\w<>]*(?:\.\w+)*)(?![\w(/:])")
PLACEHOLDERS = {"module", "package.module", "function", "Class"}
OWN = "my_rewards"


def doc_specs() -> dict[str, str]:
    """Each spec the pages write, and the first page that writes it."""
    found: dict[str, str] = {}
    for page in PAGES:
        for code in CODE.findall(page.read_text()):
            for module, attr in SPEC.findall(code):
                found.setdefault(f"{module}:{attr}", str(page.relative_to(ROOT)))
    return found


def not_loadable(spec: str) -> bool:
    module, attr = spec.split(":")
    return module in PLACEHOLDERS or attr in PLACEHOLDERS or "<" in spec or module.split(".")[0] == OWN


SPECS = doc_specs()
REWARDS = sorted(s for s in SPECS if not not_loadable(s) and not s.split(":")[1][0].isupper())
CLASSES = sorted(s for s in SPECS if not not_loadable(s) and s.split(":")[1][0].isupper())


def test_the_specs_not_meant_to_load_are_these():
    assert sorted(s for s in SPECS if not_loadable(s)) == [
        "<dir>/<file>.py:function", "module:Class", "module:function", "my_rewards.verl_math:compute_score",
        "package.module:function"]


def test_the_extraction_finds_the_built_in_rewards_and_skips_non_specs():
    assert {"pipeline.rewards.rules:tiny_reward", "pipeline.rewards.rules:gsm8k_reward",
            "pipeline.rewards.math_verifier:math_verify_reward"} <= set(SPECS)
    text = ("`https://x.org/a:b` `localhost:8265` `reward: pipeline.rewards.rules:tiny_reward` "
            "`path/to/f.py:score` `f(x):`")
    assert [f"{m}:{a}" for code in CODE.findall(text) for m, a in SPEC.findall(code)] == [
        "pipeline.rewards.rules:tiny_reward", "path/to/f.py:score"]


@pytest.mark.parametrize("spec", REWARDS)
def test_each_reward_spec_in_the_guides_loads(spec):
    assert callable(load_reward(spec)), f"{SPECS[spec]}: {spec}"


@pytest.mark.parametrize("spec", CLASSES)
def test_each_class_the_guides_name_imports(spec):
    module, attr = spec.split(":")
    assert inspect.isclass(getattr(importlib.import_module(module), attr)), f"{SPECS[spec]}: {spec}"
