"""A verl recipe's data and rewards in a real run, as they are: its GSM8K-style
Parquet (chat messages, reward_model.ground_truth, data_source, extra_info) and
its compute_score functions, named by file path and routed by data_source,
imported and called inside the generators (tests/inputs/test_peer_layouts.py
has the same pieces without Ray)."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_config
from pipeline.inputs.tiny import build_tiny_model
from pipeline.run.driver import train
from tests.inputs.test_peer_layouts import VERL_REWARDS

pytestmark = pytest.mark.real

SOURCES = ("openai/gsm8k", "lighteval/MATH")
# Each call says where it ran and what verl's keywords held (the generators are other processes).
CALLS = '''
import json


def logged(data_source, solution_str, ground_truth, extra_info=None):
    with open(CALLS_FILE, "a") as f:
        f.write(json.dumps([data_source, ground_truth, extra_info]) + "\\n")
    return compute_score(data_source, solution_str, ground_truth, extra_info)
'''


def verl_parquet(path, n: int):
    pq.write_table(pa.table({
        "data_source": [SOURCES[i % 2] for i in range(n)],
        "prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(n)],
        "ability": ["math"] * n,
        "reward_model": [{"style": "rule", "ground_truth": str(2 * i)} for i in range(n)],
        "extra_info": [{"split": path.stem, "index": i} for i in range(n)]}), path)
    return path


def test_a_verl_parquet_trains_on_verl_rewards_given_by_path_and_routed_by_data_source(tmp_path, ray_session):
    model = build_tiny_model(tmp_path / "tiny_chat", chat_template="plain")
    calls = tmp_path / "calls.jsonl"
    rewards = tmp_path / "verl_rewards.py"
    rewards.write_text(VERL_REWARDS + f"\nCALLS_FILE = {str(calls)!r}\n" + CALLS)
    cfg = load_config("examples/gsm8k_chat.yaml", [
        f"model.path={model}", f"run.output_dir={tmp_path}", "run.name=verl", "run.steps=2",
        "run.checkpoint_every=2", "validation.period=0", "validation.at_end=true", "metrics.tensorboard=false",
        f"data.train={verl_parquet(tmp_path / 'train.parquet', 8)}",
        f"data.val={verl_parquet(tmp_path / 'val.parquet', 4)}",
        "data.reward={}", f"data.reward.{SOURCES[0]}={rewards}:logged", f"data.reward.{SOURCES[1]}={rewards}:boxed_score"])
    summary = train(cfg, quiet=True)
    assert summary["error"] is None and summary["steps"] == 2
    steps = [m for m in map(json.loads, (tmp_path / "verl" / "metrics.jsonl").read_text().splitlines())
             if m["step"] >= 0 and "reward_failures" in m]
    # boxed_score asserts its source and extra_info: a wrong route or a lost field would fail samples.
    assert [m["reward_failures"] for m in steps] == [0.0, 0.0]
    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    assert {source for source, _, _ in logged} == {SOURCES[0]}
    assert {(truth, extra["split"], extra["index"]) for _, truth, extra in logged} >= {("0", "val", 0)}
    assert all(truth == str(2 * extra["index"]) for _, truth, extra in logged)
