"""Chat-format datasets (pipeline/inputs/datasets.py): messages rendered by the
model's own chat template into the ids vLLM is sent, verl's Parquet layout and
TRL's conversational rows read as they are, and each bad row named."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.inputs.datasets import ChatTemplate, DataError, fit_prompts, load_prompts
from pipeline.inputs.tiny import build_tokenizer

pytestmark = pytest.mark.unit

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def jsonl(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_messages_are_rendered_once_by_the_template_into_the_ids_sent(tmp_path, tokenizer):
    path = jsonl(tmp_path, [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"},
                            {"prompt": "plain text", "answer": "x"}])
    chat, plain = load_prompts(path, chat=ChatTemplate(tokenizer, system_prompt="Be brief."))
    assert chat.text == "system: Be brief.\nuser: 2+2?\nassistant:" and chat.answer == "4"
    assert list(chat.token_ids) == tokenizer(chat.text, add_special_tokens=False).input_ids
    assert tokenizer.decode(chat.token_ids) == chat.text
    assert (plain.text, plain.token_ids) == ("plain text", ())   # text prompts stay as they were
    # A prompt that brings its own system message keeps it.
    own = load_prompts(jsonl(tmp_path, [{"prompt": [{"role": "system", "content": "S"},
                                                    {"role": "user", "content": "q"}], "answer": "a"}], "own.jsonl"),
                       chat=ChatTemplate(tokenizer, system_prompt="Be brief."))[0]
    assert own.text == "system: S\nuser: q\nassistant:"


def test_verl_parquet_and_trl_conversational_rows_are_read_as_they_are(tmp_path, tokenizer):
    verl = tmp_path / "verl.parquet"
    pq.write_table(pa.table({
        "data_source": ["openai/gsm8k"] * 2,
        "prompt": [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "3*3?"}]],
        "ability": ["math"] * 2,
        "reward_model": [{"style": "rule", "ground_truth": "2"}, {"style": "rule", "ground_truth": "9"}],
        "extra_info": [{"split": "train", "index": 0}, {"split": "train", "index": 1}]}), verl)
    got = load_prompts(verl, chat=ChatTemplate(tokenizer))
    assert [(p.id, p.text, p.answer) for p in got] == [("train-0", "user: 1+1?\nassistant:", "2"),
                                                       ("train-1", "user: 3*3?\nassistant:", "9")]
    trl = jsonl(tmp_path, [{"prompt": [{"role": "user", "content": "hi"}], "answer": "yo", "id": "a"}], "trl.jsonl")
    assert load_prompts(trl, chat=ChatTemplate(tokenizer))[0].id == "a"


def test_the_template_tokens_count_against_the_context(tmp_path, tokenizer):
    path = jsonl(tmp_path, [{"prompt": [{"role": "user", "content": "hello"}], "answer": "a"}])
    ids = load_prompts(path, chat=ChatTemplate(tokenizer))[0].token_ids
    fits = fit_prompts(path, "train", tokenizer, context=len(ids) + 4, max_new_tokens=4, drop=False)
    assert fits.filtered == 0
    with pytest.raises(DataError, match=f"line 1: the prompt is {len(ids)} tokens, more than the {len(ids) - 1}"):
        fit_prompts(path, "train", tokenizer, context=len(ids) + 3, max_new_tokens=4, drop=False)


@pytest.mark.parametrize("row,needle", [
    ({"prompt": [], "answer": "a"}, "line 1: field 'prompt' is an empty list of messages"),
    ({"prompt": [{"role": "bot", "content": "x"}], "answer": "a"},
     "line 1: field 'prompt': message 0 has role 'bot'; expected one of system, user, assistant, tool"),
    ({"prompt": [{"role": "user"}], "answer": "a"}, "message 0 must be an object with string 'role' and 'content'"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "a"},
     "the last message is the assistant's"),
    ({"prompt": [{"role": "user", "content": "q"}], "reward_model": {"style": "rule"}},
     "line 1: field 'reward_model' has no 'ground_truth'"),
    ({"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": " "}},
     "line 1: field 'reward_model.ground_truth' is empty"),
    ({"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": [1, 2]}},
     "line 1: field 'reward_model.ground_truth' is a list, not a string or a number"),
])
def test_a_bad_chat_row_is_named(tmp_path, tokenizer, row, needle):
    with pytest.raises(DataError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_prompts(jsonl(tmp_path, [row]), chat=ChatTemplate(tokenizer))


def test_messages_need_a_template_and_the_model(tmp_path, tokenizer):
    path = jsonl(tmp_path, [{"prompt": [{"role": "user", "content": "q"}], "answer": "a"}])
    with pytest.raises(DataError, match="they are rendered by the model's chat template"):
        load_prompts(path)
    bare = build_tokenizer()
    with pytest.raises(DataError, match="the tokenizer of models/x has no chat template"):
        load_prompts(path, chat=ChatTemplate(bare, model="models/x"))
    missing = jsonl(tmp_path, [{"prompt": [{"role": "user", "content": "q"}]}], "missing.jsonl")
    with pytest.raises(DataError, match="missing required field 'answer' or 'reward_model' with a 'ground_truth'"):
        load_prompts(missing, chat=ChatTemplate(tokenizer))
