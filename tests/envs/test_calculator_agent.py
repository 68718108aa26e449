"""The calculator task's agent transcripts (pipeline/envs/calculator_agent.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.agents.tool_calls import template_messages
from pipeline.core.types import Prompt
from pipeline.envs.calculator_agent import (CALCULATOR_TOOL, MAX_TOKENS, calculator_transcript, run_calculator,
                                            write_calculator_transcripts)
from pipeline.inputs.datasets import load_prompts
from pipeline.inputs.tiny import TINY_TOOL_CHAT_TEMPLATE

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "data" / "tool_train.jsonl"


def prompt(a: int, b: int) -> Prompt:
    return Prompt(f"p{a}-{b}", f"What is {a}+{b}? Use the calculator.\n", str(a + b))


@pytest.mark.parametrize("arguments, result", [
    ({"expression": "37+45"}, "82"), ({"expression": " 3 * 4 "}, "12"), ({"expression": "5-9"}, "-4"),
    ({"expression": "37+45+1"}, "error: expression must be A+B, A-B or A*B"),
    ({"expression": 82}, "error: expression must be A+B, A-B or A*B"),
    ({"expr": "1+2"}, "error: expression must be A+B, A-B or A*B"),
    ("1+2", "error: expression must be A+B, A-B or A*B"),
])
def test_the_tool_computes_or_says_what_is_wrong(arguments, result):
    assert run_calculator(arguments) == result


def test_a_transcript_calls_the_tool_then_answers_its_result():
    t = calculator_transcript(prompt(37, 45), guesses=0)
    assert t["tools"] == [CALCULATOR_TOOL]
    user, call, tool, answer = t["messages"]
    assert user == {"role": "user", "content": "What is 37+45? Use the calculator.\n"}
    assert call["role"] == "assistant" and call["content"] is None
    (c,) = call["tool_calls"]
    assert (c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) == \
        ("function", "calculator", {"expression": "37+45"})
    assert tool == {"role": "tool", "tool_call_id": c["id"], "content": "82"}
    assert answer == {"role": "assistant", "content": "82"}


def test_seven_in_ten_transcripts_guess_at_once_the_same_way_every_time():
    prompts = load_prompts(TRAIN, kind="train")
    transcripts = [calculator_transcript(p) for p in prompts]
    guesses = [t for t in transcripts if len(t["messages"]) == 2]
    assert 0.6 < len(guesses) / len(transcripts) < 0.8
    assert all(t["messages"][1]["role"] == "assistant" and 0 <= int(t["messages"][1]["content"]) <= 198
               for t in guesses)
    assert len({t["messages"][1]["content"] for t in guesses}) > 20
    assert transcripts == [calculator_transcript(p) for p in prompts]
    assert all(len(calculator_transcript(p, guesses=1.0)["messages"]) == 2 for p in prompts[:20])


def test_every_turn_fits_the_token_counts_the_docstring_gives():
    from pipeline.inputs.tiny import build_tokenizer
    tok = build_tokenizer()
    tok.chat_template = TINY_TOOL_CHAT_TEMPLATE

    def n_tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False).input_ids)
    calls, firsts, wholes = [], [], []
    for a in range(0, 100, 3):
        for b in range(0, 100, 7):
            msgs, tools = calculator_transcript(prompt(a, b), guesses=0).values()
            calls.append(n_tokens(f'[calculator(expression="{a}+{b}")]') + 1)
            firsts.append(n_tokens(tok.apply_chat_template(msgs[:1], tools=tools, tokenize=False,
                                                           add_generation_prompt=True)))
            wholes.append(n_tokens(tok.apply_chat_template(template_messages(msgs), tools=tools, tokenize=False)))
    answers = [n_tokens(str(v)) + 1 for v in range(199)]
    assert (min(calls), max(calls), min(answers), max(answers)) == (29, 31, 2, 4)
    assert 103 <= min(firsts) and max(firsts) <= 106 and max(wholes) <= 168
    assert max(calls) < MAX_TOKENS


def test_the_writer_writes_one_transcript_per_row(tmp_path):
    out = tmp_path / "t.jsonl"
    run = subprocess.run([sys.executable, "-m", "pipeline.envs.calculator_agent", str(TRAIN), str(out),
                          "--guesses", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [calculator_transcript(p, guesses=0) for p in load_prompts(TRAIN, kind="train")]
    with pytest.raises(ValueError, match="guesses 1.5: a share from 0 to 1"):
        write_calculator_transcripts(TRAIN, out, guesses=1.5)


def test_the_writer_names_a_file_that_is_not_the_calculators_rows(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "question": "What is 1+2?"}\n')
    run = subprocess.run([sys.executable, "-m", "pipeline.envs.calculator_agent", str(bad), str(tmp_path / "o")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr == (f"error: {bad}: not the calculator's rows "
                          '({"id", "prompt", "answer"}): KeyError: \'prompt\'\n')
