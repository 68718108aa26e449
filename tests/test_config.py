"""Recipes and overrides: every bad value is an error that names its key."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.io.config import ConfigError, load_config


def test_recipe_and_overrides(tmp_path):
    cfg = load_config("examples/sim_grpo.yaml", ["grpo.max_age=2", "run.name=x", "training.lr=1e-4",
                                                "sim.jitter=0.5", "grpo.val_at_end=false"])
    assert cfg.grpo.max_age == 2 and cfg.run.name == "x" and cfg.training.lr == 1e-4
    assert cfg.sim.jitter == 0.5 and cfg.grpo.val_at_end is False
    assert cfg.grpo.val_period == 5  # from the recipe


@pytest.mark.parametrize("override,needle", [
    ("grpo.max_ag=2", "unknown key 'grpo.max_ag'; allowed keys here: max_age"),
    ("grpo.max_ag=2", "did you mean 'grpo.max_age'?"),
    ("grpo.max_age=-1", "grpo.max_age: -1 is out of range; it must be >= 0"),
    ("grpo.max_age=two", "grpo.max_age: expected an integer, got 'two'"),
    ("grpo.max_age=1.5", "grpo.max_age: expected an integer"),
    ("run.dag_mode=fast", "run.dag_mode: 'fast' is not allowed; choose one of 'auto', 'compiled', 'classic'"),
    ("backend=gpu", "backend: 'gpu' is not allowed"),
    ("grpo.val_at_start=maybe", "grpo.val_at_start: expected true or false"),
    ("generation.top_p=0", "generation.top_p: 0.0 is out of range; it must be > 0"),
    ("training.zero_stage=4", "training.zero_stage: 4 is out of range; it must be <= 3"),
    ("grpo.group_size=0", "grpo.group_size: 0 is out of range; it must be >= 1"),
    ("nosection.x=1", "unknown key 'nosection'"),
    ("grpo=3", "grpo: expected a mapping"),
    ("grpo.max_age", "expected key=value"),
    ("run.name=a/b", "run.name: 'a/b' must be a non-empty name"),
    ("run.name=..", "run.name: '..' must be a non-empty name"),
    ("run.name=' '", "run.name: ' ' must be a non-empty name"),
    ("training.lr=.inf", "training.lr: expected a finite number, got inf"),
    ("run.deadline_s=.nan", "run.deadline_s: expected a finite number, got nan"),
])
def test_bad_override_names_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config("examples/sim_grpo.yaml", [override])
    assert needle in str(err.value)
    if "=" in override:  # the override is blamed, not the recipe it changes
        assert str(err.value).startswith(f"override {override!r}: ")


def test_the_override_that_set_a_key_is_blamed(tmp_path):
    # The last override to touch a key (itself or its whole section) decided its value.
    with pytest.raises(ConfigError, match=r"^override 'grpo=\{max_age: -1\}': grpo.max_age: -1 is out"):
        load_config("examples/sim_grpo.yaml", ["grpo.group_size=2", "grpo={max_age: -1}"])
    with pytest.raises(ConfigError, match=r"^override 'grpo.max_age=-2': grpo.max_age: -2 is out"):
        load_config("examples/sim_grpo.yaml", ["grpo={max_age: -1}", "grpo.max_age=-2"])
    with pytest.raises(ConfigError, match=r"^override 'data.val=': data.val: not set"):
        load_config("examples/tiny_grpo.yaml", ["data.val="])
    # A bad key the file sets is the file's, even when overrides change its neighbours.
    recipe = tmp_path / "r.yaml"
    recipe.write_text("grpo:\n  max_age: -1\n")
    with pytest.raises(ConfigError, match=rf"^{recipe}: grpo.max_age: -1 is out of range"):
        load_config(recipe, ["grpo.group_size=2"])


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml.*not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy)


def test_real_backend_requires_model_data_and_validation_data():
    with pytest.raises(ConfigError, match="model.path: not set; it is required when backend is 'real'"):
        load_config(None, ["backend=real"])
    with pytest.raises(ConfigError, match="data.val: not set, but validation is scheduled"):
        load_config("examples/tiny_grpo.yaml", ["data.val="])
    assert load_config("examples/tiny_grpo.yaml", ["data.val=", "grpo.val_period=0", "grpo.val_at_end=false"])


def test_cli_exits_nonzero_with_the_key_and_writes_no_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--config", "examples/sim_grpo.yaml",
                           "grpo.max_age=-2", f"run.output_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "grpo.max_age: -2 is out of range" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []
