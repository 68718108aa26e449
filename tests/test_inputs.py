"""Bad input to `python -m pipeline train` on the real backend: a clear error
naming the path, column or spec, a non-zero exit, and no run directory."""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline.__main__ import main


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from pipeline.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def run_cli(tmp_path, capsys, *overrides):
    out = tmp_path / "runs"
    code = main(["train", "--config", "examples/tiny_grpo.yaml", f"run.output_dir={out}", *overrides])
    err = capsys.readouterr().err
    assert not out.exists(), "a failed preflight must not leave a run directory"
    return code, err


def test_missing_model_directory(tmp_path, capsys):
    code, err = run_cli(tmp_path, capsys, f"model.path={tmp_path}/nope")
    assert code == 1 and f"model directory '{tmp_path}/nope' does not exist" in err


def test_model_directory_without_config(tmp_path, capsys, tiny_model):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "config.json").unlink()
    code, err = run_cli(tmp_path, capsys, f"model.path={broken}")
    assert code == 1 and "has no config.json" in err and str(broken) in err


def test_tokenizer_that_does_not_match_the_model(tmp_path, capsys, tiny_model):
    small = tmp_path / "small_vocab"
    shutil.copytree(tiny_model, small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 100
    (small / "config.json").write_text(json.dumps(config))
    code, err = run_cli(tmp_path, capsys, f"model.path={small}")
    assert code == 1 and "the tokenizer has" in err and "vocab_size is 100" in err and str(small) in err


def test_dataset_missing_a_column(tmp_path, capsys, tiny_model):
    data = tmp_path / "no_answer.jsonl"
    data.write_text('{"prompt": "repeat:1"}\n{"prompt": "repeat:2"}\n')
    code, err = run_cli(tmp_path, capsys, f"model.path={tiny_model}", f"data.train={data}")
    assert code == 1 and str(data) in err and "missing required column 'answer'" in err


def test_dataset_with_a_null_field(tmp_path, capsys, tiny_model):
    data = tmp_path / "null.jsonl"
    data.write_text('{"prompt": "repeat:1", "answer": "1"}\n{"prompt": null, "answer": "2"}\n')
    code, err = run_cli(tmp_path, capsys, f"model.path={tiny_model}", f"data.val={data}")
    assert code == 1 and str(data) in err and "row 1: column 'prompt' is null" in err


def test_reward_function_that_cannot_be_imported(tmp_path, capsys, tiny_model):
    code, err = run_cli(tmp_path, capsys, f"model.path={tiny_model}", "data.reward=no_such_module:score")
    assert code == 1 and "reward spec 'no_such_module:score': cannot import module 'no_such_module'" in err
    code, err = run_cli(tmp_path, capsys, f"model.path={tiny_model}", "data.reward=pipeline.rewards:nope")
    assert code == 1 and "has no attribute 'nope'" in err
