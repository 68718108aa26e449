"""data.filter_overlong on the real CPU stack: over-long prompts are counted
at load and left out, and neither the controller (training prompts) nor a
generator (validation prompts) ever holds one. The refusals with filtering
off, before any worker starts, are in tests/inputs/test_inputs.py; the counting
itself in tests/inputs/test_data_rewards.py."""
from __future__ import annotations

import json

import pytest
import yaml

from pipeline.inputs.tiny import tiny_task_rows
from tests.support._procs import run_driver

pytestmark = pytest.mark.real

# 703 tokens of the tiny tokenizer: vLLM itself refuses a prompt longer than its context of 512.
LONG = {"id": "long", "prompt": "repeat: " + " ".join(["1"] * 700), "answer": "1"}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_overlong_prompts_are_left_out_counted_and_never_reach_a_worker(tmp_path, tiny_model):
    short = tiny_task_rows(3)
    train = _jsonl(tmp_path / "train.jsonl", [short[0], LONG, short[1], short[2]])
    val = _jsonl(tmp_path / "val.jsonl", [*tiny_task_rows(2, seed=1), LONG])
    # The first two batches draw 4 prompts: every row of the unfiltered file, the long one included.
    recipe = {"backend": "real", "run": {"name": "fit", "output_dir": str(tmp_path / "runs"), "steps": 2},
              "model": {"path": str(tiny_model)},
              "data": {"train": str(train), "val": str(val), "reward": "pipeline.rewards.rules:tiny_reward"},
              "schedule": {"max_age": 1, "prompts_per_step": 2, "group_size": 2}, "validation": {"period": 1},
              "training": {"micro_batch_size": 4}, "metrics": {"progress": False, "tensorboard": False}}
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump(recipe))
    log = tmp_path / "out.log"
    status = run_driver(["--config", str(config)], log, timeout_s=600)
    out = log.read_text()
    assert status == 0, out[-3000:]
    for kind, total in (("train", 4), ("val", 3)):
        assert (f"dagrl: data.{kind}: filtered 1 of {total} prompts longer than 496 tokens (context 512 - "
                "max_new_tokens 16); data.filter_overlong") in out, out[-3000:]
    assert "simulated workers" not in out
    run = tmp_path / "runs" / "fit"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["error"] is None and summary["steps"] == 2
    assert summary["filtered_overlong"] == {"train": 1, "val": 1}
    assert summary["simulated"] is False and summary["backend"] == "real"
    # The controller's prompt order is a permutation of the prompts it holds: the 3 that fit.
    state = json.loads((run / "checkpoints" / "step_2" / "controller" / "controller.json").read_text())
    assert sorted(state["order"]) == [0, 1, 2]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # The generator validated on the 2 validation prompts that fit, at each step.
    assert [(m["step"], m["val_count"]) for m in metrics if "val_count" in m] == [(0, 2), (1, 2)]


def test_max_new_tokens_that_leave_no_room_for_a_prompt_are_refused_at_once(tmp_path, tiny_model):
    from pipeline.config import load_config
    from pipeline.inputs.models import ModelError
    from pipeline.inputs.preflight import preflight
    train = _jsonl(tmp_path / "t.jsonl", tiny_task_rows(2))
    cfg = load_config(None, ["backend=real", f"model.path={tiny_model}", f"data.train={train}",
                             "data.reward=pipeline.rewards.rules:tiny_reward", "generation.max_new_tokens=512"])
    with pytest.raises(ModelError, match=r"^generation.max_new_tokens: 512 leaves no room for a prompt in the "
                                         r"context of 512 tokens"):
        preflight(cfg)  # raised here, not on the tokenizer's thread: nothing else is started
