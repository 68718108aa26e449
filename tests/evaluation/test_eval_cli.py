"""`python -m pipeline eval`'s refusals: each names what to fix, and comes before any engine starts."""
from __future__ import annotations

import pytest
import yaml

from pipeline.__main__ import main

pytestmark = pytest.mark.unit


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("an engine started")
    monkeypatch.setattr("pipeline.generator.engines.vllm_engine", refuse)


def recipe(tmp_path, sets: list[dict]) -> str:
    (tmp_path / "val.jsonl").write_text('{"prompt": "repeat: 1", "answer": "1"}\n')
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "backend": "real", "model": {"path": str(tmp_path)}, "data": {
            "train": "data/tiny_train.jsonl", "reward": "pipeline.rewards.rules:tiny_reward"},
        "validation": {"sets": sets}}))
    return str(path)


def run(tmp_path, capsys, sets: list[dict], *extra: str) -> tuple[int, str]:
    code = main(["eval", "--config", recipe(tmp_path, sets), "--model", str(tmp_path), "--out",
                 str(tmp_path / "out.json"), "--quiet", *extra])
    return code, capsys.readouterr().err


def test_an_unknown_set_name(tmp_path, capsys, no_engine):
    code, err = run(tmp_path, capsys, [{"name": "greedy", "data": str(tmp_path / "val.jsonl")}], "--sets", "gredy")
    assert code == 2 and "eval --sets: 'gredy' is not a set of" in err and "(its validation.sets: greedy)" in err


def test_a_missing_file_names_the_set_and_key(tmp_path, capsys, no_engine):
    code, err = run(tmp_path, capsys, [{"name": "gsm", "data": str(tmp_path / "gone.jsonl")}])
    assert code == 1 and err.startswith("error: validation.sets[gsm].data: ") and "gone.jsonl" in err


def test_an_unknown_reward_names_the_set_and_key(tmp_path, capsys, no_engine):
    code, err = run(tmp_path, capsys, [{"name": "v", "data": str(tmp_path / "val.jsonl"),
                                        "reward": "pipeline.rewards.rules:no_such_reward"}])
    assert code == 1 and err.startswith("error: validation.sets[v].reward: ") and "no_such_reward" in err


def test_k_above_n_is_refused_at_load(tmp_path, capsys, no_engine):
    code, err = run(tmp_path, capsys, [{"name": "s", "data": str(tmp_path / "val.jsonl"), "n": 2,
                                        "temperature": 1.0, "k": [4]}])
    assert code == 2 and "validation.sets[s].k: 4 is more than the set's n (2)" in err


def test_a_model_directory_that_is_not_one(tmp_path, capsys, no_engine):
    code, err = run(tmp_path, capsys, [{"name": "v", "data": str(tmp_path / "val.jsonl")}])
    assert code == 1 and "config.json" in err
