"""What a resume may change (pipeline/run/resume_check.py): the rule, the data
files' digests, the refusal's message, --allow-change's keys and the run's own
config. End to end through the CLI: tests/run/test_resume_cli.py."""
from __future__ import annotations

import pytest
import yaml

from pipeline.config import ConfigError, load_config
from pipeline.run.resume_check import (
    CHECKPOINT_SHAPE, DATA_FILES, SAFE_TO_CHANGE, Change, ResumeError, allowed_keys, changes, check, config_keys,
    data_digests, run_config,
)

pytestmark = pytest.mark.unit


def config(*overrides: str):
    return load_config(None, ["run.steps=10", *overrides])


def changed(*overrides: str, was=()) -> list[Change]:
    """What `overrides` change in a run started with `was`, its data files as they are now."""
    cfg = config(*overrides)
    return changes(config(*was).to_dict(), data_digests(config(*was)), cfg, data_digests(cfg))


def test_every_key_the_rule_names_is_a_config_key():
    keys = config_keys()
    assert "env.class" in keys and "env.args" in keys and "resources.trainer.num_cpus" in keys
    for prefix in SAFE_TO_CHANGE:
        assert any(k == prefix or k.startswith(prefix + ".") for k in keys), prefix
    assert CHECKPOINT_SHAPE <= set(keys) and set(DATA_FILES) <= set(keys)
    assert not CHECKPOINT_SHAPE & SAFE_TO_CHANGE


def test_how_long_fast_where_and_how_watched_change_freely():
    assert changed("run.steps=30", "run.deadline_s=5", "run.startup_deadline_s=9", "run.dag_mode=compiled",
                   "run.checkpoint_every=3", "run.name=other", "run.output_dir=/elsewhere", "validation.period=2",
                   "validation.at_end=true", "sim.generate_s=1", "sim.jitter=0.5", "fault.max_restarts=0",
                   "metrics.progress=false", "metrics.wandb=true", "resources.trainer.num_cpus=2",
                   "resources.strategy=SPREAD", "env.threads=4", "inject.fault=train_exit") == []


@pytest.mark.parametrize("override,key,was,now", [
    ("data.train=/d/b.parquet", "data.train", "/d/a.parquet", "/d/b.parquet"),
    ("data.val=/d/v2.jsonl", "data.val", "", "/d/v2.jsonl"),
    ("data.reward=mod:other", "data.reward", "mod:score", "mod:other"),
    ("validation.reward=mod:verify", "validation.reward", "", "mod:verify"),
    ("model.path=/m/other", "model.path", "/m/base", "/m/other"),
    ("run.seed=3", "run.seed", 0, 3),
    ("training.lr=0.5", "training.lr", 1e-4, 0.5),
    ("training.micro_batch_size=2", "training.micro_batch_size", 8, 2),
    ("policy_loss.clip_eps=0.3", "policy_loss.clip_eps", 0.2, 0.3),
    ("generation.temperature=0.7", "generation.temperature", 1.0, 0.7),
    ("generation.max_new_tokens=32", "generation.max_new_tokens", 16, 32),
    ("overlong.buffer=4", "overlong.buffer", 0, 4),
    ("sim.flat_share=0.5", "sim.flat_share", 1.0, 0.5),
    ("schedule.max_age=3", "schedule.max_age", 1, 3),
])
def test_what_the_run_trains_on_or_with_is_a_change(override, key, was, now):
    run = ("backend=real", "model.path=/m/base", "data.train=/d/a.parquet", "data.reward=mod:score")
    assert changed(*run, override, was=run) == [Change(key, was, now)]


def test_run_steps_is_a_change_where_the_learning_rate_decays_to_it():
    assert changed("run.steps=30", was=("training.lr_schedule=cosine",)) == \
           [Change("training.lr_schedule", "cosine", "constant")]
    assert changed("training.lr_schedule=cosine", "run.steps=30", was=("training.lr_schedule=cosine",)) == \
           [Change("run.steps", 10, 30)]


def test_a_data_file_edited_in_place_is_a_change_of_its_key(tmp_path):
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text('{"prompt": "a"}\n')
    val.write_text('{"prompt": "v"}\n')
    run = config(f"data.train={train}", f"data.val={val}")
    recorded = data_digests(run)
    assert sorted(recorded) == ["data.train", "data.val"] and recorded["data.train"]["path"] == str(train)

    train.write_text('{"prompt": "b"}\n')   # same path, same size, other rows
    found = changes(run.to_dict(), recorded, run, data_digests(run))
    assert found == [Change("data.train", recorded["data.train"]["sha256"], data_digests(run)["data.train"]["sha256"],
                            content=True)]
    assert str(found[0]) == (f"data.train: its file changed since the run read it (sha256 "
                             f"{found[0].was[:12]} in the run, {found[0].now[:12]} now)")
    val.unlink()
    assert [(c.key, c.now) for c in changes(run.to_dict(), recorded, run, data_digests(run))] == \
           [("data.train", found[0].now), ("data.val", None)]
    assert "data.val: its file changed since the run read it (sha256 " in \
           str(changes(run.to_dict(), recorded, run, data_digests(run))[1])


def test_a_validation_sets_file_edited_in_place_is_named_and_allowed_as_validation_sets(tmp_path):
    math, code = tmp_path / "math.jsonl", tmp_path / "code.jsonl"
    math.write_text('{"prompt": "1+1"}\n')
    code.write_text('{"prompt": "def f"}\n')
    run = config(f"validation.sets=[{{name: math, data: {math}}}, {{name: code, data: {code}}}]")
    recorded = data_digests(run)
    assert sorted(recorded) == ["validation.sets[code].data", "validation.sets[math].data"]
    assert changes(run.to_dict(), recorded, run, data_digests(run)) == []

    math.write_text('{"prompt": "2+2"}\n')
    found = changes(run.to_dict(), recorded, run, data_digests(run))
    assert [(c.key, c.content, c.allow_key) for c in found] == [("validation.sets[math].data", True, "validation.sets")]
    assert str(found[0]).startswith("validation.sets[math].data: its file changed since the run read it (sha256 ")
    ckpt = tmp_path / "runs" / "x" / "checkpoints" / "step_4"
    with pytest.raises(ResumeError, match=r"put back the data the run read, or let it change with --allow-change "
                                          r"validation.sets \("):
        check(ckpt, found, frozenset())
    assert check(ckpt, found, allowed_keys(["validation.sets"])) == found
    # Another file for a set is a change of validation.sets itself, listed once.
    moved = config(f"validation.sets=[{{name: math, data: {code}}}, {{name: code, data: {code}}}]")
    assert [c.key for c in changes(run.to_dict(), recorded, moved, data_digests(moved))] == ["validation.sets"]


def test_a_new_data_path_is_one_change_and_an_old_checkpoint_is_compared_by_path(tmp_path):
    (tmp_path / "a.jsonl").write_text("1\n")
    (tmp_path / "b.jsonl").write_text("2\n")
    run, now = config(f"data.train={tmp_path / 'a.jsonl'}"), config(f"data.train={tmp_path / 'b.jsonl'}")
    assert changes(run.to_dict(), data_digests(run), now, data_digests(now)) == \
           [Change("data.train", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))]
    (tmp_path / "a.jsonl").write_text("edited\n")
    assert changes(run.to_dict(), None, run, data_digests(run)) == []   # meta.json without inputs


def test_check_refuses_every_change_it_is_not_allowed_and_says_how_to_allow_it(tmp_path):
    ckpt = tmp_path / "runs" / "x" / "checkpoints" / "step_4"
    found = [Change("data.train", "/d/a.parquet", "/d/b.parquet"), Change("run.seed", 0, 3),
             Change("data.val", "ab" * 32, "cd" * 32, content=True)]
    with pytest.raises(ResumeError) as err:
        check(ckpt, found, frozenset({"run.seed"}))
    assert str(err.value) == (
        f"cannot resume {ckpt}: the config or data change what the run trained on or with:\n"
        "  data.train was '/d/a.parquet' in the run, the config says '/d/b.parquet'\n"
        "  data.val: its file changed since the run read it (sha256 abababababab in the run, cdcdcdcdcdcd now)\n"
        f"leave the changed keys out (--resume {tmp_path / 'runs' / 'x'} alone continues with the run's own config) "
        "and put back the data the run read, or let them change with --allow-change data.train,data.val "
        "(docs/checkpoints-and-faults.md#resume)")
    assert check(ckpt, found, frozenset({"run.seed", "data.train", "data.val"})) == found
    assert check(ckpt, [], frozenset()) == []


def test_check_never_lets_a_key_that_shapes_the_checkpoint_change(tmp_path):
    ckpt = tmp_path / "step_4"
    with pytest.raises(ResumeError) as err:
        check(ckpt, [Change("schedule.max_age", 1, 3), Change("run.seed", 0, 3)], frozenset({"schedule.max_age"}))
    assert "\n  schedule.max_age was 1 in the run, the config says 3 (it shapes the checkpoint: no resume can " \
           "change it)\n  run.seed was 0 in the run, the config says 3\n" in str(err.value)
    assert str(err.value).endswith("or let it change with --allow-change run.seed (docs/checkpoints-and-faults.md#resume)")


def test_allow_change_takes_known_keys_only():
    assert allowed_keys(["data.train,data.val", " run.seed "]) == {"data.train", "data.val", "run.seed"}
    assert allowed_keys([]) == frozenset()
    with pytest.raises(ConfigError, match=r"^--allow-change: unknown key 'data.trian'; did you mean 'data.train'\?$"):
        allowed_keys(["data.trian"])
    with pytest.raises(ConfigError, match=r"^--allow-change: unknown key 'nothing.like.it'$"):
        allowed_keys(["nothing.like.it"])
    with pytest.raises(ConfigError, match=r"--allow-change: training.ranks shapes the checkpoint, so no resume"):
        allowed_keys(["data.train,training.ranks"])


def test_the_runs_own_config_with_overrides_on_top_and_no_injected_fault(tmp_path):
    run_dir = tmp_path / "x"
    run_dir.mkdir()
    ran = config("run.seed=5", "data.train=/d/a.parquet", "inject.fault=train_exit", "inject.after=3")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(ran.to_dict(), sort_keys=False))
    assert run_config(run_dir, []) == config("run.seed=5", "data.train=/d/a.parquet")
    assert run_config(str(run_dir), ["run.steps=40", "inject.fault=generate_raise"]) == \
           config("run.seed=5", "data.train=/d/a.parquet", "run.steps=40", "inject.fault=generate_raise")


def test_the_runs_own_config_says_why_it_is_missing(tmp_path):
    with pytest.raises(ResumeError, match=r"^--resume .*nope: no such run directory$"):
        run_config(tmp_path / "nope", [])
    with pytest.raises(ResumeError, match=r"^--resume .*: it has no config.yaml; name the run's recipe with --config$"):
        run_config(tmp_path, [])
    (tmp_path / "config.yaml").write_text("run:\n  stpes: 3\n")
    with pytest.raises(ConfigError, match=r"config.yaml: unknown key 'run.stpes'"):
        run_config(tmp_path, [])
