"""verl's and TRL's datasets and rewards as they are (no Ray): a verl GSM8K-style
Parquet scored by a verl `compute_score` given by file path and routed by
`data_source`, a TRL conversational JSONL whose answer is in `solution`, and
each misconfiguration caught by the preflight, naming the key and the file."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.inputs.datasets import ChatTemplate, DataError, load_prompts
from pipeline.inputs.layouts import Columns
from pipeline.inputs.tiny import build_tokenizer

pytestmark = pytest.mark.unit

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
QUESTIONS = ["Natalia sold 48 clips in April and half as many in May. How many in all?",
             "Weng earns $12 an hour. She did 50 minutes of babysitting. How much did she earn?"]
SOLUTIONS = ["48/2 = 24 in May.\n48+24 = 72\n#### 72", "12/60 = 0.2 per minute.\n0.2*50 = 10\n#### 10"]


@pytest.fixture(scope="module")
def chat():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return ChatTemplate(tok)


def verl_gsm8k_parquet(path: Path, sources=("openai/gsm8k", "openai/gsm8k")) -> Path:
    """The layout of verl's examples/data_preprocess/gsm8k.py."""
    pq.write_table(pa.table({
        "data_source": list(sources),
        "prompt": [[{"role": "user", "content": f"{q} {INSTRUCTION}"}] for q in QUESTIONS],
        "ability": ["math", "math"],
        "reward_model": [{"style": "rule", "ground_truth": t} for t in ("72", "10")],
        "extra_info": [{"split": "train", "index": i, "answer": s, "question": q}
                       for i, (q, s) in enumerate(zip(QUESTIONS, SOLUTIONS))]}), path)
    return path


def trl_conversational_jsonl(path: Path) -> Path:
    """TRL's conversational prompt-only rows, the reference in `solution` (as trl-lib's math sets hold it)."""
    rows = [{"prompt": [{"role": "user", "content": "What is 6 x 7?"}], "solution": "42"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
             "solution": "4"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- columns ---------------------------------------------------------------

def test_a_trl_conversational_file_is_read_with_its_answer_key(tmp_path, chat):
    path = trl_conversational_jsonl(tmp_path / "trl.jsonl")
    with pytest.raises(DataError, match="missing required field 'answer'.*; name another with data.answer_key "
                                        r"\(fields found: prompt, solution\)"):
        load_prompts(path, chat=chat)
    got = load_prompts(path, chat=chat, columns=Columns(answer="solution"))
    assert [(p.text, p.answer) for p in got] == [("user: What is 6 x 7?\nassistant:", "42"),
                                                 ("system: Be brief.\nuser: 2 + 2?\nassistant:", "4")]


def test_a_configured_key_missing_from_the_file_names_the_key_the_file_and_its_fields(tmp_path, chat):
    path = trl_conversational_jsonl(tmp_path / "trl.jsonl")
    with pytest.raises(DataError, match=f"^{path}: data.answer_key 'label': no field of that name "
                                        r"\(fields found: prompt, solution\)$"):
        load_prompts(path, chat=chat, columns=Columns(answer="label"))
    parquet = verl_gsm8k_parquet(tmp_path / "verl.parquet")
    with pytest.raises(DataError, match=f"^{parquet}: data.prompt_key 'input': no column of that name "
                                        r"\(columns found: data_source, prompt, ability, reward_model, extra_info\)$"):
        load_prompts(parquet, chat=chat, columns=Columns(prompt="input"))


def test_keys_name_any_column_and_a_key_inside_an_object_column(tmp_path, chat):
    path = tmp_path / "own.jsonl"
    path.write_text(json.dumps({"input": "2 + 3 =", "label": {"value": 5}, "question": "unused"}) + "\n")
    [p] = load_prompts(path, columns=Columns(prompt="input", answer="label.value"))
    assert (p.text, p.answer) == ("2 + 3 =", "5")
    # verl's own answer, named as verl's reward manager reads it
    parquet = verl_gsm8k_parquet(tmp_path / "verl.parquet")
    named = load_prompts(parquet, chat=chat, columns=Columns(prompt="prompt", answer="reward_model.ground_truth"))
    assert named == load_prompts(parquet, chat=chat)


def test_a_gsm8k_file_with_keys_set_is_read_as_it_is(tmp_path):
    """The GSM8K layout (template, '#### N') is detected only when no key is set."""
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    assert load_prompts(path)[0].answer == "2"
    [p] = load_prompts(path, columns=Columns(prompt="question"))
    assert (p.text, p.answer) == ("1 + 1?", "1 + 1 = 2\n#### 2")


# -- verl's per-row fields ---------------------------------------------------

def test_data_source_and_extra_info_are_kept_per_prompt(tmp_path, chat):
    path = verl_gsm8k_parquet(tmp_path / "verl.parquet", sources=("openai/gsm8k", "lighteval/MATH"))
    first, second = load_prompts(path, chat=chat)
    assert (first.data_source, second.data_source) == ("openai/gsm8k", "lighteval/MATH")
    assert json.loads(first.extra_info) == {"split": "train", "index": 0, "answer": SOLUTIONS[0],
                                            "question": QUESTIONS[0]}
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    assert (load_prompts(plain)[0].data_source, load_prompts(plain)[0].extra_info) == ("", "")


@pytest.mark.parametrize("row, needle", [
    ({"prompt": "p", "answer": "a", "data_source": 3}, "line 1: field 'data_source' is a number, not a string"),
])
def test_a_bad_verl_field_is_named(tmp_path, row, needle):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=needle):
        load_prompts(path)


# -- verl's rewards, by file path, routed by data_source --------------------

# As verl's verl/utils/reward_score/gsm8k.py and a custom_reward_function file write them.
VERL_REWARDS = '''
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None, method="strict", format_score=0.0,
                  score=1.0):
    solutions = re.findall("#### (\\\\-?[0-9\\\\.\\\\,]+)", solution_str)
    if not solutions:
        return 0.0
    return score if solutions[-1].replace(",", "") == ground_truth else format_score


def boxed_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "lighteval/MATH" and extra_info["split"] in ("train", "val"), (data_source, extra_info)
    boxed = re.findall(r"\\\\boxed\\{([^}]*)\\}", solution_str)
    correct = bool(boxed) and boxed[-1] == ground_truth
    return {"score": float(correct), "acc": correct, "index": extra_info["index"]}


def no_extra_info(data_source, solution_str, ground_truth):
    return 1.0
'''
ROUTES = {"openai/gsm8k": "rewards/my_verl_rewards.py:compute_score",
          "lighteval/MATH": "rewards/my_verl_rewards.py:boxed_score"}


def write_verl_rewards(root: Path) -> Path:
    (root / "rewards").mkdir(exist_ok=True)
    path = root / "rewards" / "my_verl_rewards.py"
    path.write_text(VERL_REWARDS)
    return path


def completion(text: str):
    from pipeline.core.types import Completion
    return Completion(prompt_ids=(1,), response_ids=(2,), logprobs=(0.0,), text=text)


def test_a_verl_parquet_is_scored_by_verl_rewards_by_path_routed_by_data_source(tmp_path, chat, monkeypatch):
    from pipeline.rewards.scoring import score_sample
    from pipeline.rewards.specs import load_reward
    monkeypatch.chdir(tmp_path)  # the paths are relative to the working directory, as verl's are
    write_verl_rewards(tmp_path)
    gsm8k, math = load_prompts(verl_gsm8k_parquet(tmp_path / "verl.parquet",
                                                  sources=("openai/gsm8k", "lighteval/MATH")), chat=chat)
    reward = load_reward(ROUTES)
    assert reward(gsm8k, "48 + 24 = 72\n#### 72") == 1.0 and reward(gsm8k, "#### 71") == 0.0
    # The dict's "score" is the reward; extra_info arrives as verl gives it, an object.
    assert reward(math, "so \\boxed{10}") == 1.0 and reward(math, "\\boxed{12}") == 0.0
    assert score_sample(gsm8k, completion("#### 72"), reward) == (1.0, "")
    # A source with no route and no default fails its sample, naming the source.
    other = load_prompts(verl_gsm8k_parquet(tmp_path / "other.parquet", sources=("other", "other")), chat=chat)[0]
    assert score_sample(other, completion("#### 72"), reward)[1] == (
        "prompt train-0: RewardError: data_source 'other' has no reward: the map names 'openai/gsm8k', "
        "'lighteval/MATH' and has no 'default' entry")
    assert load_reward({**ROUTES, "default": ROUTES["openai/gsm8k"]})(other, "#### 72") == 1.0


def test_integer_ground_truths_reach_a_verl_reward_as_their_text(tmp_path, chat, monkeypatch):
    from pipeline.rewards.specs import load_reward
    monkeypatch.chdir(tmp_path)
    write_verl_rewards(tmp_path)
    path = tmp_path / "int.parquet"
    pq.write_table(pa.table({"data_source": ["openai/gsm8k"], "prompt": [[{"role": "user", "content": "6 x 12?"}]],
                             "reward_model": [{"style": "rule", "ground_truth": 72}]}), path)
    [prompt] = load_prompts(path, chat=chat)
    assert prompt.answer == "72" and prompt.extra_info == ""
    assert load_reward(ROUTES["openai/gsm8k"])(prompt, "#### 72") == 1.0


# -- the preflight catches each misconfiguration before Ray ------------------

@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from pipeline.inputs.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_chat", chat_template="plain")


@pytest.fixture
def verl_recipe(tmp_path, chat_model, monkeypatch) -> dict:
    """A verl GSM8K recipe as a dagrl one: its Parquet files and its reward file, as they are."""
    monkeypatch.chdir(tmp_path)
    write_verl_rewards(tmp_path)
    two = ("openai/gsm8k", "lighteval/MATH")
    return {"backend": "real", "run": {"output_dir": str(tmp_path / "runs"), "steps": 2},
            "model": {"path": str(chat_model)},
            "data": {"train": str(verl_gsm8k_parquet(tmp_path / "train.parquet", sources=two)),
                     "val": str(verl_gsm8k_parquet(tmp_path / "val.parquet", sources=two)), "reward": dict(ROUTES)},
            "schedule": {"prompts_per_step": 2, "group_size": 2}}


def preflight_of(tmp_path: Path, recipe: dict):
    import yaml

    from pipeline.config import load_config
    from pipeline.inputs.preflight import preflight
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return preflight(load_config(path))


def test_a_verl_recipe_and_a_trl_recipe_pass_the_preflight(tmp_path, verl_recipe):
    """Without this, each refusal below could come from some other fault."""
    fitted = preflight_of(tmp_path, verl_recipe).result(timeout=120)
    assert [p.data_source for p in fitted["train"].prompts] == ["openai/gsm8k", "lighteval/MATH"]
    trl = trl_conversational_jsonl(tmp_path / "trl.jsonl")
    verl_recipe["data"] = {"train": str(trl), "answer_key": "solution", "reward": "pipeline.rewards.rules:gsm8k_reward"}
    fitted = preflight_of(tmp_path, verl_recipe).result(timeout=120)
    assert [p.answer for p in fitted["train"].prompts] == ["42", "4"]


def _val_bad_ground_truth(recipe):
    path = Path(recipe["data"]["val"])
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "q"}]],
                             "reward_model": [{"style": "rule", "ground_truth": 1e20}]}), path)


PREFLIGHT_CASES = {
    "answer_key_not_in_the_file": (
        lambda r: r["data"].update(answer_key="label"),
        "data.train: {train}: data.answer_key 'label': no column of that name (columns found: data_source, prompt, "
        "ability, reward_model, extra_info)"),
    "a_source_without_a_route": (
        lambda r: r["data"]["reward"].pop("lighteval/MATH"),
        "data.reward: {train}: row 1: data_source 'lighteval/MATH' has no reward: the map names 'openai/gsm8k' and "
        "has no 'default' entry; add an entry for it, or a 'default' one"),
    "a_val_source_without_a_validation_route": (
        lambda r: r.update(validation={"reward": {"openai/gsm8k": ROUTES["openai/gsm8k"]}}),
        "validation.reward: {val}: row 1: data_source 'lighteval/MATH' has no reward"),
    "the_reward_file_is_missing": (
        lambda r: r["data"].update(reward="rewards/nope.py:compute_score"),
        "data.reward: reward spec 'rewards/nope.py:compute_score': file 'rewards/nope.py' does not exist (relative "
        "to the working directory '{cwd}')"),
    "the_function_is_missing": (
        lambda r: r["data"]["reward"].update({"openai/gsm8k": "rewards/my_verl_rewards.py:nope"}),
        "data.reward: reward spec 'rewards/my_verl_rewards.py:nope': file 'rewards/my_verl_rewards.py' has no "
        "attribute 'nope'"),
    "verl_parameters_without_extra_info": (
        lambda r: r["data"].update(reward="rewards/my_verl_rewards.py:no_extra_info"),
        "data.reward: reward spec 'rewards/my_verl_rewards.py:no_extra_info': no_extra_info(data_source, "
        "solution_str, ground_truth) has verl's parameters, but verl calls it as no_extra_info(data_source=..., "
        "solution_str=..., ground_truth=..., extra_info=...)"),
    "an_answer_with_no_one_text": (
        _val_bad_ground_truth,
        "data.val: {val}: row 0: column 'reward_model.ground_truth' is the float 1e+20, which has lost the digits "
        "past 2**53 it may have had; store the answer as text"),
}


@pytest.mark.parametrize("case", PREFLIGHT_CASES)
def test_the_preflight_refuses_each_misconfiguration_naming_the_key_and_file(tmp_path, verl_recipe, case):
    from pipeline.inputs.datasets import DataError
    from pipeline.rewards.specs import RewardError
    change, needle = PREFLIGHT_CASES[case]
    change(verl_recipe)
    with pytest.raises((DataError, RewardError)) as err:
        preflight_of(tmp_path, verl_recipe)  # before any worker: the quick checks raise here
    expected = needle.format(train=verl_recipe["data"]["train"], val=verl_recipe["data"].get("val"), cwd=tmp_path)
    assert str(err.value).startswith(expected), str(err.value)


def test_a_dedented_reward_section_is_pointed_to_data_reward(tmp_path, verl_recipe):
    from pipeline.config import ConfigError
    verl_recipe["reward"] = verl_recipe["data"].pop("reward")
    with pytest.raises(ConfigError, match="unknown key 'reward': did you mean 'data.reward'?"):
        preflight_of(tmp_path, verl_recipe)
    verl_recipe["reward"] = "pipeline.rewards.rules:gsm8k_reward"
    with pytest.raises(ConfigError, match="unknown key 'reward': did you mean 'data.reward'?"):
        preflight_of(tmp_path, verl_recipe)
    # The old section's own keys still say where they went.
    verl_recipe["reward"] = {"max_failures": 3}
    with pytest.raises(ConfigError, match="section 'reward' is gone; its keys moved: max_failures -> "
                                          "fault.max_reward_failures"):
        preflight_of(tmp_path, verl_recipe)
