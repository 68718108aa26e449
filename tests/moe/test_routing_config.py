"""training.routing_replay refused where it cannot work, naming the key: a
model with no routing to replay (before any worker starts, exit 1), and
recipes whose routes are not recorded (the recipe's rules, exit 2)."""
from __future__ import annotations

import json

import pytest
import yaml

from pipeline.__main__ import main
from pipeline.config import ConfigError, load_config
from pipeline.inputs.tiny import tiny_task_rows

pytestmark = pytest.mark.unit


def recipe_file(tmp_path, model) -> str:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in tiny_task_rows(8)))
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "backend": "real", "run": {"name": "moe", "output_dir": str(tmp_path / "runs"), "steps": 1},
        "model": {"path": str(model)}, "data": {"train": str(data), "reward": "pipeline.rewards.rules:tiny_reward"},
        "schedule": {"prompts_per_step": 2, "group_size": 2}, "training": {"routing_replay": True}}))
    return str(path)


def test_a_dense_model_is_refused_before_anything_starts(tmp_path, tiny_model, capsys):
    code = main(["train", "--config", recipe_file(tmp_path, tiny_model)])
    err = capsys.readouterr().err
    assert code == 1 and "error: training.routing_replay: model directory" in err, err
    assert "(llama) is not a mixture of experts: it has no routing to replay" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("overrides, needle", [
    (["backend=sim"], "backend is 'sim'"),
    (["generation.tensor_parallel_size=2", "resources.generator.num_gpus=2"], "generation.tensor_parallel_size > 1"),
])
def test_recipes_whose_routes_are_not_recorded_are_refused(tmp_path, tiny_model, overrides, needle):
    with pytest.raises(ConfigError, match="training.routing_replay: .*" + needle.replace(".", r"\.")):
        load_config(recipe_file(tmp_path, tiny_model), overrides)
