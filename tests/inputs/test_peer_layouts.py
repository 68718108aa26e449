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
