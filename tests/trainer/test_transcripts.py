"""The supervised warm-up from chat transcripts (pipeline/trainer/transcripts.py,
`python -m pipeline warmup --transcripts`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.agents.tool_calls import template_messages
from pipeline.core.types import Prompt
from pipeline.envs.calculator_agent import calculator_transcript, write_calculator_transcripts
from pipeline.trainer.transcripts import lay_out, load_transcripts

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[2] / "data"
CALL = calculator_transcript(Prompt("p", "What is 37+45? Use the calculator.\n", "82"), guesses=0)


@pytest.fixture(scope="module")
def agent_base(tmp_path_factory):
    from pipeline.inputs.tiny import build_tiny_model
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_agent_base", chat_template="tools")


@pytest.fixture(scope="module")
def tokenizer(agent_base):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(agent_base))


@pytest.fixture(scope="module")
def transcripts(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("transcripts")
    write_calculator_transcripts(DATA / "tool_train.jsonl", out / "train.jsonl")
    # Calls only, for the tests of the warm-up's fit: a guess teaches a random number.
    write_calculator_transcripts(DATA / "tool_train.jsonl", out / "calls.jsonl", guesses=0)
    write_calculator_transcripts(DATA / "tool_val.jsonl", out / "val.jsonl", guesses=0)
    return {"train": out / "train.jsonl", "calls": out / "calls.jsonl", "val": out / "val.jsonl"}


def test_a_transcript_is_laid_out_as_a_session_renders_and_samples_it(tokenizer):
    t = lay_out(tokenizer, CALL, max_new_tokens=32)

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids
    eos = [tokenizer.eos_token_id]
    first_request = enc(tokenizer.apply_chat_template(CALL["messages"][:1], tools=CALL["tools"], tokenize=False,
                                                      add_generation_prompt=True))
    call, between, answer = enc('[calculator(expression="37+45")]') + eos, enc("\n<|tool|>\n82</s>\n<|assistant|>\n"), \
        enc("82") + eos
    assert first_request[:2] == [tokenizer.bos_token_id, *enc("<")]  # one BOS, the template's
    assert t.ids == first_request + call + between + answer  # nothing after the last </s>
    assert t.mask == [0] * len(first_request) + [1] * len(call) + [0] * len(between) + [1] * len(answer)
    assert (t.first_request, t.first_turn, t.messages, t.tools) == (first_request, call, CALL["messages"][:1],
                                                                    CALL["tools"])


def test_the_pieces_tokenize_as_the_whole_rendering_does(tokenizer, transcripts):
    rows = load_transcripts(transcripts["train"])
    for row in rows:
        full = tokenizer.apply_chat_template(template_messages(row["messages"]), tools=row["tools"], tokenize=False)
        assert lay_out(tokenizer, row, max_new_tokens=32).ids == \
            tokenizer(full.removesuffix("\n"), add_special_tokens=False).input_ids
    assert sum(len(row["messages"]) == 2 for row in rows) > 0.4 * len(rows)  # the guesses are laid out too


def test_a_turn_over_max_new_tokens_or_a_template_that_does_not_extend_is_refused(tokenizer):
    with pytest.raises(ValueError, match=r"here: messages\[1\] is 31 tokens with its EOS, over max_new_tokens 16"):
        lay_out(tokenizer, CALL, max_new_tokens=16, where="here")
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = "{% for m in messages[-1:] %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    with pytest.raises(ValueError, match=r"does not render messages\[1\] after its generation prompt"):
        lay_out(tokenizer, CALL, max_new_tokens=32)


@pytest.mark.parametrize("line, needle", [
    ("{not json", "line 1, column 2"),
    ('{"tools": []}', "line 1: a transcript is"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 1: no assistant message"),
    ('{"messages": [{"content": "hi"}]}', r"line 1: messages\[0\] has no role"),
    ('{"messages": [{"role": "assistant", "content": "hi"}], "tools": {}}', 'line 1: "tools" must be a list'),
])
def test_a_bad_transcripts_file_is_named_with_its_line(tmp_path, line, needle):
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=f"{path}.*{needle}"):
        load_transcripts(path)


def test_warmup_on_transcripts_lowers_the_loss_and_is_reproducible(agent_base, transcripts, tmp_path, capsys):
    from pipeline.__main__ import main
    from pipeline.inputs.models import check_model_dir
    from pipeline.inputs.tiny import TINY_TOOL_CHAT_TEMPLATE, model_digest
    args = ["warmup", "--model", str(agent_base), "--transcripts", str(transcripts["calls"]), "--steps", "20",
            "--prompts", "32", "--max-new-tokens", "32", "--val", str(transcripts["val"])]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert "20 steps on 32 transcripts" in printed and "val first turn, greedy: {" in printed
    meta = json.loads((tmp_path / "a" / "warmup.json").read_text())
    assert meta["loss_last"] < 0.7 * meta["loss_first"] and meta["max_new_tokens"] == 32
    assert set(meta["val_first_turn_greedy"]) == {"stopped", "as_transcript"}  # no parser named
    check_model_dir(tmp_path / "a")
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(str(tmp_path / "a")).chat_template == TINY_TOOL_CHAT_TEMPLATE
    assert main(args[:-2] + ["--out", str(tmp_path / "b")]) == 0
    assert model_digest(tmp_path / "a") == model_digest(tmp_path / "b") != model_digest(agent_base)


@pytest.mark.parametrize("args, needle", [
    (["--transcripts", "{t}", "--env", "pipeline.envs.calculator:CalculatorEnv"],
     "--transcripts takes the place of an env's episodes: drop --env"),
    (["--data", "{t}"], "give --env and --data (an env's expert episodes), or --transcripts FILE"),
    (["--env", "pipeline.envs.calculator:CalculatorEnv", "--data", "{d}", "--tool-parser", "pythonic"],
     "--tool-parser counts tool calls in chat transcripts"),
    (["--transcripts", "{t}"], "messages[1] is 31 tokens with its EOS, over max_new_tokens 16"),
])
def test_warmup_cli_refuses_a_mixed_or_incomplete_command(agent_base, transcripts, tmp_path, capsys, args, needle):
    from pipeline.__main__ import main
    args = [a.replace("{t}", str(transcripts["train"])).replace("{d}", str(DATA / "tool_train.jsonl"))
            for a in args]
    assert main(["warmup", "--model", str(agent_base), "--out", str(tmp_path / "out"), *args]) == 1
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_model_without_a_chat_template_is_refused(tiny_model, transcripts, tmp_path):
    from pipeline.trainer.transcripts import warmup_on_transcripts
    with pytest.raises(ValueError, match="has no chat template .* build-tiny --chat-template tools"):
        warmup_on_transcripts(tiny_model, transcripts["train"], tmp_path / "out", steps=1, lr=1e-3, batch_size=1,
                              max_new_tokens=32)


@pytest.mark.real  # the tool parser is vLLM's
def test_a_short_warmup_makes_the_first_turn_a_call_the_parser_reads(agent_base, transcripts, tmp_path):
    from pipeline.trainer.transcripts import warmup_on_transcripts
    meta = warmup_on_transcripts(agent_base, transcripts["calls"], tmp_path / "out", val=transcripts["val"],
                                 steps=50, lr=2e-3, batch_size=16, tool_parser="pythonic", max_new_tokens=32)
    assert meta["val_first_turn_greedy"]["stopped"] == 1.0
    assert meta["val_first_turn_greedy"]["tool_calls"] >= 0.9
