"""Datasets and the tiny task (no vLLM, no Ray); the rewards are tests/rewards/."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.core.types import Prompt
from pipeline.inputs.datasets import GSM8K_TEMPLATE, DataError, load_prompts
from pipeline.inputs.tiny import TINY_ALPHABET, tiny_prompt
from pipeline.rewards.rules import gsm8k_reward, tiny_reward

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[2] / "data"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- loading ---------------------------------------------------------------

def test_jsonl_and_parquet_load_the_same(tmp_path):
    rows = [{"id": "a", "prompt": "p0", "answer": "x"}, {"id": "b", "prompt": "p1", "answer": "y"}]
    j = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    p = load_prompts(tmp_path / "d.parquet")
    assert j == p == [Prompt("a", "p0", "x"), Prompt("b", "p1", "y")]


def test_ids_are_generated_from_kind_when_absent(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "a"}] * 2)
    assert [p.id for p in load_prompts(path, kind="val")] == ["val-0", "val-1"]


@pytest.mark.parametrize("name, rows, expected", [
    ("missing_col.jsonl", [{"prompt": "p"}], "missing required field 'answer'"),
    ("null_row.jsonl", [{"prompt": "p", "answer": "a"}, {"prompt": None, "answer": "a"}],
     "line 2: field 'prompt' is null"),
    ("missing_in_row.jsonl", [{"prompt": "p", "answer": "a"}, {"answer": "a"}], "line 2: field 'prompt' is missing"),
    ("empty_row.jsonl", [{"prompt": "p", "answer": "a"}] * 2 + [{"prompt": "p", "answer": " "}],
     "line 3: field 'answer' is empty"),
    # A number with no one text is refused; numbers that have one are read (test_numbers_are_read_as_their_text).
    ("bool_answer.jsonl", [{"prompt": "p", "answer": True}],
     "line 1: field 'answer' is a boolean, not a number; store the answer as text$"),
    ("nan_answer.jsonl", [{"prompt": "p", "answer": float("nan")}],
     "line 1: field 'answer' is the float nan, which no answer equals; store the answer as text"),
    ("big_float_answer.jsonl", [{"prompt": "p", "answer": 1e20}],
     r"line 1: field 'answer' is the float 1e\+20, which has lost the digits past 2\*\*53"),
    ("tiny_float_answer.jsonl", [{"prompt": "p", "answer": 1.5e-7}],
     "line 1: field 'answer' is the float 1.5e-07, which has no plain decimal text"),
    ("object_answer.jsonl", [{"prompt": "p", "answer": {"a": 1}}],
     "line 1: field 'answer' is an object, not a string or a number"),
    ("int_id.jsonl", [{"id": 7, "prompt": "p", "answer": "a"}], "line 1: field 'id' is a number, not a string"),
    # A list is read as chat messages (issue: chat-format data), so its items must be messages.
    ("list_prompt.jsonl", [{"prompt": ["p"], "answer": "a"}],
     "line 1: field 'prompt': message 0 must be an object with string 'role' and 'content'"),
    ("dup_id.jsonl", [{"id": "x", "prompt": "p", "answer": "a"}] * 2, "line 2: field 'id' repeats 'x' from line 1"),
    ("some_ids.jsonl", [{"id": "x", "prompt": "p", "answer": "a"}, {"prompt": "p", "answer": "a"}],
     "line 2: field 'id' is missing"),
    ("gsm_no_final.jsonl", [{"question": "q?", "answer": "it is 4"}], "line 1: field 'answer' has no final '####"),
    ("gsm_word.jsonl", [{"question": "q?", "answer": "4\n#### 4"}, {"question": "q?", "answer": "#### four"}],
     "line 2: field 'answer' ends in '#### four', which is not a number"),
    ("neither.jsonl", [{"text": "q?", "answer": "4"}], "missing required field 'prompt' or 'question'"),
])
def test_bad_rows_and_fields_are_named(tmp_path, name, rows, expected):
    path = write_jsonl(tmp_path / name, rows)
    with pytest.raises(DataError, match=expected) as err:
        load_prompts(path)
    assert str(err.value).startswith(f"{path}: ")


def test_jsonl_lines_are_the_files_lines(tmp_path):
    """Line numbers count blank lines and only real newlines, so they match an editor's."""
    path = tmp_path / "d.jsonl"
    # U+2028 is a line break to str.splitlines() but plain text inside a JSON string.
    path.write_text('\n{"prompt": "a\u2028b", "answer": "1"}\n\n{"prompt": "c", "answer": null}\n',
                    encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.jsonl: line 4: field 'answer' is null"):
        load_prompts(path)
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": "1"}\r\n')  # BOM and CRLF, as Windows writes
    assert load_prompts(path) == [Prompt("train-0", "a", "1")]


@pytest.mark.parametrize("columns, expected", [
    ({"prompt": ["a", "b", None], "answer": ["1", "2", "3"]}, "row 2: column 'prompt' is null"),
    ({"prompt": ["a", ""], "answer": ["1", "2"]}, "row 1: column 'prompt' is empty"),
    ({"prompt": ["a"], "answer": [True]}, "column 'answer' has type bool; an answer must be a string or a number"),
    ({"prompt": ["a", "b"], "answer": [2.0, float("nan")]}, "row 1: column 'answer' is the float nan"),
    ({"prompt": ["a"], "answer": ["1"], "id": [3]}, "column 'id' has type int64; it must be a string"),
    ({"prompt": ["a"]}, "missing required column 'answer'"),
])
def test_bad_parquet_rows_and_columns_are_named(tmp_path, columns, expected):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(DataError, match=expected) as err:
        load_prompts(path)
    assert str(err.value).startswith(f"{path}: ")


def test_numbers_are_read_as_their_text(tmp_path):
    """An answer stored as a number has one text; text answers stay as written ("007")."""
    answers = [72, 72.0, -3, 0.5, 12345678901234567890, "007", " 7 "]
    texts = ["72", "72", "-3", "0.5", "12345678901234567890", "007", " 7 "]
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "p", "answer": a} for a in answers])
    assert [p.answer for p in load_prompts(path)] == texts
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": pa.array([72, -3], pa.int64())}), tmp_path / "i.parquet")
    assert [p.answer for p in load_prompts(tmp_path / "i.parquet")] == ["72", "-3"]
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [2.5, 3.0]}), tmp_path / "f.parquet")
    assert [p.answer for p in load_prompts(tmp_path / "f.parquet")] == ["2.5", "3"]


def test_parquet_accepts_categorical_text_and_ignores_other_columns(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": pa.array(["a", "b"]).dictionary_encode(), "answer": ["1", "2"],
                             "score": [0.5, 1.5]}), path)
    assert load_prompts(path) == [Prompt("train-0", "a", "1"), Prompt("train-1", "b", "2")]


def test_file_level_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="does not exist") as err:
        load_prompts(tmp_path / "nope.jsonl")
    assert "nope.jsonl" in str(err.value)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DataError, match=r"dir\.jsonl: is not a file"):
        load_prompts(tmp_path / "dir.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"d\.csv: unknown data file extension '\.csv'"):
        load_prompts(tmp_path / "d.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: the dataset is empty"):
        load_prompts(tmp_path / "empty.jsonl")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"empty\.parquet: the dataset is empty"):
        load_prompts(tmp_path / "empty.parquet")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "p", "answer": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl: line 1, column 27: not valid JSON: Expecting value"):
        load_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "array.jsonl").write_text('[{"prompt": "p", "answer": "a"}]\n')
    with pytest.raises(DataError, match=r"array\.jsonl: line 1: expected a JSON object .* got a list"):
        load_prompts(tmp_path / "array.jsonl")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "p", "answer": "a"}\n{"prompt": "\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl: line 2: not UTF-8 text"):
        load_prompts(tmp_path / "latin1.jsonl")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read as parquet"):
        load_prompts(tmp_path / "bad.parquet")


def test_gsm8k_schema_is_mapped(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [
        {"question": "Ann has 1,000 beads and buys 250 more. How many?",
         "answer": "1000 + 250 = <<1000+250=1250>>1,250\n#### 1,250"}])
    [p] = load_prompts(path)
    assert p.answer == "1250"
    assert p.text == GSM8K_TEMPLATE.format(question="Ann has 1,000 beads and buys 250 more. How many?")
    assert "####" in p.text  # the template asks for the marker the reward reads


def test_shipped_gsm8k_sample_is_consistent():
    prompts = load_prompts(DATA / "gsm8k_sample.jsonl")
    assert len(prompts) >= 20
    raw = [json.loads(line) for line in (DATA / "gsm8k_sample.jsonl").read_text().splitlines()]
    for p, row in zip(prompts, raw):
        float(p.answer)  # a plain number
        # The reference solution itself earns full reward.
        assert gsm8k_reward(p, row["answer"]) == 1.0, row


def test_shipped_tiny_data():
    train = load_prompts(DATA / "tiny_train.jsonl")
    val = load_prompts(DATA / "tiny_val.jsonl", kind="val")
    for p in train + val:
        assert p.answer in TINY_ALPHABET and p.text == tiny_prompt(p.answer)
    counts = {c: sum(p.answer == c for p in train) for c in TINY_ALPHABET}
    assert max(counts.values()) - min(counts.values()) <= 1  # balanced: no free lunch for collapse
    assert {p.id for p in train}.isdisjoint(p.id for p in val)


# -- the tiny task is learnable ---------------------------------------------

def test_tiny_task_is_learnable_by_plain_grpo(tmp_path):
    """A guard on the task, tokenizer and builder together, without vLLM or the
    pipeline: 20 on-policy GRPO steps of 8 prompts x 4 samples x 16 tokens
    (Adam, lr 1e-2) lift the reward from about 0.01 to well above 0.3."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.inputs.tiny import build_tiny_model
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    path = build_tiny_model(tmp_path / "tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train = load_prompts(DATA / "tiny_train.jsonl")
    torch.manual_seed(0)
    means = []
    for step in range(20):
        batch = [train[(step * 8 + i) % len(train)] for i in range(8)]
        ids = tok([p.text for p in batch], return_tensors="pt", padding=True)
        prompt = ids.input_ids.repeat_interleave(4, 0)
        mask_p = ids.attention_mask.repeat_interleave(4, 0)
        with torch.no_grad():
            out = model.generate(input_ids=prompt, attention_mask=mask_p, max_new_tokens=16, do_sample=True,
                                 temperature=1.0, top_k=len(tok), top_p=1.0, pad_token_id=tok.pad_token_id)
        resp = out[:, prompt.shape[1]:]
        eos = (resp == tok.eos_token_id).int()
        mask = ((torch.cumsum(eos, 1) - eos) == 0).float()  # up to and including the first eos
        texts = [tok.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(resp, mask)]
        r = torch.tensor([tiny_reward(p, t) for p, t in zip([p for p in batch for _ in range(4)], texts)])
        g = r.view(8, 4)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        logits = model(input_ids=out, attention_mask=torch.cat([mask_p, torch.ones_like(resp)], 1)).logits
        logp = torch.log_softmax(logits[:, prompt.shape[1] - 1:-1].float(), -1)
        logp = logp.gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        loss = -(adv * logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        means.append(float(r.mean()))
    start, end = sum(means[:3]) / 3, sum(means[-3:]) / 3
    print("tiny task rewards:", [round(m, 3) for m in means])
    assert start < 0.1 and end > 0.3, [round(m, 3) for m in means]


# -- over-long prompts (data.filter_overlong) --------------------------------

def _tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


SHORT, LONG = tiny_prompt("1"), "repeat: " + " ".join(["1"] * 40)


def test_a_prompt_is_overlong_when_its_tokens_with_the_bos_plus_max_new_tokens_exceed_the_context(
        tmp_path, tiny_model):
    from pipeline.inputs.datasets import fit_prompts
    tok = _tokenizer(tiny_model)
    short, long = len(tok(SHORT).input_ids), len(tok(LONG).input_ids)
    # Counted as the generator encodes: the BOS the tokenizer prepends is a prompt token too.
    assert long == len(tok(LONG, add_special_tokens=False).input_ids) + 1 and short < long
    rows = [{"prompt": t, "answer": "1"} for t in (SHORT, LONG, SHORT, LONG, SHORT)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    # The long prompt fits the context alone (long < context), not with max_new_tokens more.
    cut = fit_prompts(path, "train", tok, context=long + 7, max_new_tokens=8, drop=True)
    assert [p.id for p in cut.prompts] == ["train-0", "train-2", "train-4"]  # order and ids kept
    assert (cut.filtered, cut.total, cut.limit) == (2, 5, long - 1)
    assert cut.note("data.train") == (f"data.train: filtered 2 of 5 prompts longer than {long - 1} tokens "
                                      f"(context {long + 7} - max_new_tokens 8); data.filter_overlong")
    # Exactly at the context it fits, and the list is load_prompts' own.
    whole = fit_prompts(path, "train", tok, context=long + 8, max_new_tokens=8, drop=False)
    assert whole.filtered == 0 and list(whole.prompts) == load_prompts(path)


def test_with_filtering_off_an_overlong_prompt_is_refused_at_its_line_or_row(tmp_path, tiny_model):
    from pipeline.inputs.datasets import fit_prompts
    tok = _tokenizer(tiny_model)
    long = len(tok(LONG).input_ids)
    fits = f"more than the {long - 9} that fit (the model's context {long - 1} - generation.max_new_tokens 8)"
    jsonl = tmp_path / "d.jsonl"
    # Line 4 of the file: the blank line counts, as an editor numbers lines.
    jsonl.write_text("".join(json.dumps({"prompt": t, "answer": "1"}) + "\n" for t in (SHORT, SHORT))
                     + "\n" + json.dumps({"prompt": LONG, "answer": "1"}) + "\n")
    with pytest.raises(DataError) as err:
        fit_prompts(jsonl, "train", tok, context=long - 1, max_new_tokens=8, drop=False)
    assert str(err.value).startswith(f"{jsonl}: line 4: the prompt is {long} tokens, {fits}; shorten it, or set "
                                     "data.filter_overlong: true")
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": [SHORT, LONG, LONG], "answer": ["1", "1", "1"]}), parquet)
    with pytest.raises(DataError) as err:
        fit_prompts(parquet, "val", tok, context=long - 1, max_new_tokens=8, drop=False)
    assert str(err.value).startswith(f"{parquet}: row 1: the prompt is {long} tokens, {fits}; 2 of the 3 "
                                     "prompts are too long")
    # Filtering on, a file with nothing left is an error too.
    only_long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": LONG, "answer": "1"}] * 2)
    with pytest.raises(DataError, match=rf"^{only_long}: all 2 prompts are longer than the {long - 9} that fit"):
        fit_prompts(only_long, "train", tok, context=long - 1, max_new_tokens=8, drop=True)


def test_the_context_is_the_engines_max_model_len_capped_by_the_model(tmp_path, tiny_model):
    import shutil

    from pipeline.inputs.models import DEFAULT_MAX_MODEL_LEN, context_length
    assert json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"] == 512
    assert context_length(tiny_model) == DEFAULT_MAX_MODEL_LEN == 512 and context_length(tiny_model, 256) == 256
    small = tmp_path / "small"
    shutil.copytree(tiny_model, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    assert context_length(small) == 64


def test_run_prompts_fits_what_the_recipe_names_once_per_process(tmp_path, tiny_model):
    """What preflight and the workers call: the model's context and tokenizer,
    generation.max_new_tokens and data.filter_overlong from the recipe; a second
    call with nothing changed is the first's answer, a rewritten file is fitted anew."""
    from pipeline.config import load_config
    from pipeline.inputs.datasets import run_prompts
    tok = _tokenizer(tiny_model)
    gsm8k = GSM8K_TEMPLATE.format(question="2 + 2?")
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": SHORT, "answer": "1"}, {"prompt": gsm8k, "answer": "4"}])
    # max_new_tokens leaves exactly the GSM8K prompt's length: it fits, one token less and it does not.
    new = 512 - len(tok(gsm8k).input_ids)
    real = ["backend=real", f"model.path={tiny_model}", f"data.train={train}", "data.reward=m:f"]
    fitted = run_prompts(load_config(None, [*real, f"generation.max_new_tokens={new}"]), "train")
    assert fitted.filtered == 0 and fitted.context == 512
    assert run_prompts(load_config(None, [*real, f"generation.max_new_tokens={new}"]), "train") is fitted
    cut = run_prompts(load_config(None, [*real, f"generation.max_new_tokens={new + 1}"]), "train")
    assert [p.text for p in cut.prompts] == [SHORT] and cut.filtered == 1
    with pytest.raises(DataError, match=r"line 2: the prompt is"):
        run_prompts(load_config(None, [*real, f"generation.max_new_tokens={new + 1}", "data.filter_overlong=false"]),
                    "train")
    write_jsonl(train, [{"prompt": SHORT, "answer": "1"}] * 3)
    assert run_prompts(load_config(None, [*real, f"generation.max_new_tokens={new}"]), "train").total == 3


@pytest.mark.parametrize("recipe", ["tiny_grpo", "tiny_ppo", "tiny_grpo_lora", "tiny_ppo_lora", "tiny_tool_grpo",
                                    "tiny_tool_ppo", "tiny_game_grpo"])
def test_the_shipped_recipes_lose_no_prompt(tiny_model, recipe):
    """Their data fits whole: the run generates from load_prompts' very list, in
    its order and with its ids, so the seeded replays (results/seeds.json) stand."""
    from pipeline.config import load_config
    from pipeline.inputs.datasets import run_prompts
    cfg = load_config(f"examples/{recipe}.yaml", [f"model.path={tiny_model}"])
    for kind, path in (("train", cfg.data.train), ("val", cfg.data.val)):
        fitted = run_prompts(cfg, kind)
        assert fitted.filtered == 0 and list(fitted.prompts) == load_prompts(path, kind=kind)
