"""Samples to read (metrics.samples): the records built from a batch table and
a validation, their text, the sinks that write them (samples.jsonl,
TensorBoard read back, W&B through a stand-in module) and the `samples`
command. Whole sim runs: tests/run/test_samples_run.py."""
from __future__ import annotations

import json
import sys
import types

import pyarrow as pa
import pytest

from dags.tokens import Batch, ValOut
from pipeline.config import load_config
from pipeline.config.sections import ValSetConfig
from pipeline.core.samples import format_sample, shard_count, train_samples, unshard, val_samples
from pipeline.core.types import TRAJECTORY_SCHEMA, Completion, Prompt
from pipeline.run.metrics import WANDB_SAMPLE_COLUMNS, MetricSinks, step_samples

pytestmark = pytest.mark.unit

TURNS = [{"role": "env", "text": "What is 3*4?", "reward": None},
         {"role": "model", "text": "CALL 3*4", "reward": 0.0},
         {"role": "env", "text": "RESULT 12", "reward": None},
         {"role": "model", "text": "12", "reward": 1.0}]


def _row(batch: str, prompt: str, text: str, reward: float, versions: list[int], **extra) -> dict:
    return {"batch_id": batch, "target": 5, "version": min(versions), "prompt_id": prompt, "prompt_ids": [1],
            "response_ids": [7] * len(versions), "logprobs": [0.0] * len(versions), "token_versions": versions,
            "text": text, "reward": reward, "reward_error": "", "loss_mask": [1] * len(versions), **extra}


def _table() -> pa.Table:
    """Three groups of two, in the batch's order: t5.g0 (p1, p2), then t5.g1 (p0)."""
    rows = [_row("t5.g0", "p1", "a", 0.5, [4, 4]), _row("t5.g0", "p1", "b", 0.25, [4, 5], truncated=True),
            _row("t5.g0", "p2", "CALL 3*4\n12", 1.0, [4] * 5, loss_mask=[1, 1, 0, 0, 1], transcript=TURNS),
            _row("t5.g0", "p2", "x", 0.0, [4], reward_error="prompt p2: ValueError: no"),
            _row("t5.g1", "p0", "c", 0.75, [3]), _row("t5.g1", "p0", "d", 0.0, [3])]
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


TEXTS = {"p0": "prompt zero", "p1": "prompt one", "p2": "prompt two"}


def test_train_samples_are_the_first_groups_with_versions_age_and_turns():
    samples = train_samples(5, _table(), TEXTS, {"t5.g0": 4, "t5.g1": 3}, 2, 2)
    assert [(s["prompt_id"], s["prompt"], s["batch"], s["version"], s["age"]) for s in samples] == [
        ("p1", "prompt one", "t5.g0", 4, 1), ("p2", "prompt two", "t5.g0", 4, 1)]
    assert samples[0] == {"step": 5, "kind": "train", "prompt_id": "p1", "prompt": "prompt one", "batch": "t5.g0",
                          "version": 4, "age": 1, "completions": [
                              {"text": "a", "reward": 0.5, "versions": [4], "tokens": 2},
                              {"text": "b", "reward": 0.25, "versions": [4, 5], "tokens": 2, "truncated": True}]}
    multi, failed = samples[1]["completions"]
    assert multi["turns"] == TURNS and multi["tokens"] == 3, "the model's tokens, not the observation's"
    assert failed["error"] == "prompt p2: ValueError: no" and "turns" not in failed
    every = train_samples(5, _table(), TEXTS, {"t5.g0": 4, "t5.g1": 3}, 10, 2)
    assert [s["prompt_id"] for s in every] == ["p1", "p2", "p0"] and every[2]["age"] == 2
    assert train_samples(5, _table(), TEXTS, {"t5.g0": 4, "t5.g1": 3}, 0, 2) == ()


def _val(shard: int, shards: int, count: int, step: int = 3) -> tuple[dict, ...]:
    """Generator `shard`'s validation samples, of val0..val9 sharded as the generators shard them."""
    mine = [Prompt(f"val{i}", f"question {i}") for i in range(10)][shard::shards]
    completions = [Completion((1,), (2, 3), (0.0, 0.0), f"answer {p.id}", (step + 1,) * 2) for p in mine]
    shown = shard_count(count, shard, shards)
    return val_samples(step, step + 1, ValSetConfig(name=""), mine[:shown], completions, [(0.5, "")] * len(mine))


@pytest.mark.parametrize("count,shards", [(4, 3), (2, 3), (5, 2), (1, 1), (0, 2)])
def test_validation_samples_are_the_first_of_the_set_whatever_the_generators(count, shards):
    merged = unshard([_val(g, shards, count) for g in range(shards)])
    assert [s["prompt_id"] for s in merged] == [f"val{i}" for i in range(count)]
    if count:
        assert merged[0] == {"step": 3, "kind": "val", "prompt_id": "val0", "prompt": "question 0", "version": 4,
                             "completions": [{"text": "answer val0", "reward": 0.5, "versions": [4], "tokens": 2}]}


def test_step_samples_are_the_batchs_then_the_validations_in_set_order():
    train = train_samples(5, _table(), TEXTS, {"t5.g0": 4, "t5.g1": 3}, 1, 2)
    out = {"sample": Batch(5, ("t5.g0",), (4,), samples=train),
           **{f"validate[{g}]": ValOut(f"gen{g}", 5, 6, True, samples=_val(g, 2, 3, step=5)) for g in range(2)}}
    assert [(s["kind"], s["prompt_id"]) for s in step_samples(out)] == [
        ("train", "p1"), ("val", "val0"), ("val", "val1"), ("val", "val2")]
    assert step_samples({"validate[0]": ValOut("gen0", 5, 6, False)}) == []


def test_step_samples_of_several_sets_go_set_by_set():
    """Three prompts of set a and of set b, sharded over two generators: a's
    three first, then b's, though the shards hold unequal shares."""
    def shard(g: int) -> tuple[dict, ...]:
        return tuple({"kind": "val", "set": name, "prompt_id": f"{name}{i}"} for name in "ab" for i in range(g, 3, 2))
    out = {f"validate[{g}]": ValOut(f"gen{g}", 5, 6, True, samples=shard(g)) for g in range(2)}
    assert [s["prompt_id"] for s in step_samples(out)] == ["a0", "a1", "a2", "b0", "b1", "b2"]


def test_a_named_sets_sample_says_its_set():
    prompt = Prompt("p0", "question")
    done = [Completion((1,), (2,), (0.0,), f"answer {i}", (4,)) for i in range(2)]
    sample, = val_samples(3, 4, ValSetConfig(name="gsm", n=2, temperature=1.0), [prompt], done, [(1.0, ""), (0.0, "")])
    assert sample["set"] == "gsm" and [c["text"] for c in sample["completions"]] == ["answer 0", "answer 1"]
    assert format_sample(sample).startswith("step 3 val gsm  prompt p0  version 4\n")


def test_a_sample_reads_as_its_prompt_then_each_completion_turns_indented():
    sample = train_samples(5, _table(), TEXTS, {"t5.g0": 4, "t5.g1": 3}, 2, 2)[1]
    assert format_sample(sample) == (
        "step 5 train  prompt p2  batch t5.g0  version 4  age 1\n"
        "prompt:\n"
        "    prompt two\n"
        "completion 1/2  reward 1.000  versions 4  tokens 3\n"
        "    env:\n"
        "        What is 3*4?\n"
        "    model (reward 0.000):\n"
        "        CALL 3*4\n"
        "    env:\n"
        "        RESULT 12\n"
        "    model (reward 1.000):\n"
        "        12\n"
        "completion 2/2  reward 0.000  versions 4  tokens 1  error: prompt p2: ValueError: no\n"
        "    x")
    val = _val(0, 1, 1)[0]
    val["completions"][0]["text"] = "two\nlines\x1b[2J\r\x08"  # a sampled escape must not clear the terminal
    assert format_sample(val) == ("step 3 val  prompt val0  version 4\nprompt:\n    question 0\n"
                                  "completion 1/1  reward 0.500  versions 4  tokens 2\n"
                                  "    two\n    lines\\x1b[2J\\x0d\\x08")


def _two_steps() -> list[list[dict]]:
    table = _table()
    return [[*train_samples(step, table, TEXTS, {"t5.g0": step - 1, "t5.g1": step - 1}, 2, 2),
             *unshard([_val(g, 2, 2, step=step) for g in range(2)])] for step in (0, 1)]


def _texts(log_dir, tag: str) -> list[tuple[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]


def test_sinks_write_samples_jsonl_and_tensorboard_text(tmp_path):
    sinks = MetricSinks(tmp_path, load_config(None, ["metrics.tensorboard=true", "metrics.samples=2"]))
    steps = _two_steps()
    for samples in steps:
        sinks.write_samples(samples)
    sinks.close()
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [s for samples in steps for s in samples]
    for kind in ("train", "val"):
        texts = _texts(tmp_path / "tensorboard", f"samples/{kind}")
        assert [step for step, _ in texts] == [0, 1]
        for (step, text), samples in zip(texts, steps):
            # Indented: Markdown shows the text as written.
            assert text == "\n\n".join("    " + format_sample(s).replace("\n", "\n    ")
                                       for s in samples if s["kind"] == kind)


def test_samples_off_write_nothing(tmp_path):
    sinks = MetricSinks(tmp_path, load_config(None, ["metrics.tensorboard=false", "metrics.samples=0"]))
    sinks.write_samples(_two_steps()[0])
    sinks.close()
    assert not (tmp_path / "samples.jsonl").exists()


def test_a_resume_drops_the_samples_of_the_steps_it_runs_again(tmp_path):
    cfg = load_config(None, ["metrics.tensorboard=false"])
    killed = MetricSinks(tmp_path, cfg)
    for step in range(4):
        killed.write_samples([{"step": step, "kind": "train", "prompt": f"killed {step}"}])
    killed.close()
    resumed = MetricSinks(tmp_path, cfg, start_step=2)
    for step in range(2, 5):
        resumed.write_samples([{"step": step, "kind": "train", "prompt": f"resumed {step}"}])
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in lines] == ["killed 0", "killed 1", "resumed 2", "resumed 3", "resumed 4"]
    # Resumed again from step 3 with the samples off: none of the steps it runs is left over.
    MetricSinks(tmp_path, load_config(None, ["metrics.tensorboard=false", "metrics.samples=0"]), start_step=3).close()
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in lines] == ["killed 0", "killed 1", "resumed 2"]


class _WandbStandIn:
    """What MetricSinks uses of the wandb module, recording what it is given."""

    def __init__(self):
        self.logged: list[dict] = []

    def module(self) -> types.ModuleType:
        wandb = types.ModuleType("wandb")
        run = types.SimpleNamespace(define_metric=lambda *a, **k: None, finish=lambda: None, log=self.logged.append)
        wandb.init = lambda **kw: run
        wandb.Table = lambda columns, data: types.SimpleNamespace(columns=columns, data=data)
        return wandb


def test_wandb_gets_a_table_per_kind_with_a_row_per_completion(tmp_path, monkeypatch):
    stand_in = _WandbStandIn()
    monkeypatch.setitem(sys.modules, "wandb", stand_in.module())
    sinks = MetricSinks(tmp_path, load_config(None, ["metrics.wandb=true", "metrics.tensorboard=false"]))
    train = train_samples(5, _table(), TEXTS, {"t5.g0": 4, "t5.g1": 3}, 2, 2)
    sinks.write_samples([*train, *_val(0, 1, 1, step=5)])
    sinks.close()
    (train_log, val_log) = stand_in.logged
    assert train_log["step"] == val_log["step"] == 5
    table = train_log["samples/train"]
    assert table.columns == list(WANDB_SAMPLE_COLUMNS) == ["step", "kind", "prompt_id", "prompt", "completion",
                                                          "reward", "versions", "age", "tokens", "turns"]
    assert table.data == [
        [5, "train", "p1", "prompt one", "a", 0.5, "4", 1, 2, ""],
        [5, "train", "p1", "prompt one", "b", 0.25, "4,5", 1, 2, ""],
        [5, "train", "p2", "prompt two", "CALL 3*4\n12", 1.0, "4", 1, 3,
         "env: What is 3*4?\nmodel: CALL 3*4\nenv: RESULT 12\nmodel: 12"],
        [5, "train", "p2", "prompt two", "x", 0.0, "4", 1, 1, ""]]
    assert val_log["samples/val"].data == [[5, "val", "val0", "question 0", "answer val0", 0.5, "6", None, 2, ""]]


def test_the_samples_command_prints_a_step_and_names_what_is_missing(tmp_path, capsys):
    from pipeline.__main__ import main
    sinks = MetricSinks(tmp_path, load_config(None, ["metrics.tensorboard=false"]))
    steps = _two_steps()
    for samples in steps:
        sinks.write_samples(samples)
    sinks.close()
    assert main(["samples", str(tmp_path), "--step", "1", "--kind", "train", "--limit", "1"]) == 0
    assert capsys.readouterr().out == format_sample(steps[1][0]) + "\n"
    assert main(["samples", str(tmp_path), "--kind", "val"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("\nprompt:\n") == 4 and "step 1 val  prompt val1" in printed

    assert main(["samples", str(tmp_path), "--step", "7"]) == 1
    assert capsys.readouterr().err == (f"error: {tmp_path / 'samples.jsonl'} has no samples at step 7; "
                                       "it holds train: steps 0-1; val: steps 0-1\n")
    assert main(["samples", str(tmp_path / "none")]) == 1
    assert f"{tmp_path / 'none' / 'samples.jsonl'}: no such file" in capsys.readouterr().err
