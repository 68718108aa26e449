"""The tiny model's tool-calling chat template (pipeline/inputs/tiny.py, "tools"):
what a gateway relies on to extend a conversation's tokens turn by turn."""
from __future__ import annotations

import jinja2
import pytest

from pipeline.agents.tool_calls import template_messages
from pipeline.inputs.tiny import TINY_CHAT_TEMPLATE, TINY_TOOL_CHAT_TEMPLATE

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Computes A+B.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def call(name: str, arguments: str, i: int = 0) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "calculator": [
        {"role": "user", "content": "What is 37+45? Use the calculator.\n"},
        {"role": "assistant", "content": None, "tool_calls": [call("calculator", '{"expression": "37+45"}')]},
        {"role": "tool", "tool_call_id": "call_0", "content": "82"},
        {"role": "assistant", "content": "82"}],
    "guess": [
        {"role": "user", "content": "What is 3+4? Use the calculator.\n"},
        {"role": "assistant", "content": "9"}],
    "system, two calls, content parts": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Sum "}, {"type": "text", "text": "then time."}]},
        {"role": "assistant", "content": "", "tool_calls": [
            call("calculator", '{"expression": "1+2"}'), call("now", '{"tz": "UTC", "n": [1, true, null]}', 1)]},
        {"role": "tool", "tool_call_id": "call_0", "content": "3"},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "noon"}]},
        {"role": "assistant", "content": "3 at noon"},
        {"role": "user", "content": "Thanks."}],
}


@pytest.fixture(scope="module")
def tokenizer():
    from pipeline.inputs.tiny import build_tokenizer
    tok = build_tokenizer()
    tok.chat_template = TINY_TOOL_CHAT_TEMPLATE
    return tok


def render(tok, messages: list[dict], tools=TOOLS, **kwargs) -> str:
    return tok.apply_chat_template(template_messages(messages), tools=tools, tokenize=False, **kwargs)


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("tools", [TOOLS, None])
def test_a_conversation_renders_as_its_shorter_ones_extended(tokenizer, name, tools):
    msgs = CONVERSATIONS[name]
    renders = {k: render(tokenizer, msgs[:k], tools) for k in range(1, len(msgs) + 1)}  # transformers refuses []
    first = renders[1]
    assert first.startswith("<s>") and first.endswith("</s>\n") and first.count("</s>") == 1 + bool(tools)
    for k in range(1, len(msgs)):
        assert renders[k + 1].startswith(renders[k])                   # (a)
        added = renders[k + 1][len(renders[k]):]
        assert added.endswith("</s>\n") and added.count("</s>") == 1  # (c): one turn, one </s>, a fixed tail
    for k in renders:
        prompt = render(tokenizer, msgs[:k], tools, add_generation_prompt=True)
        assert prompt == renders[k] + "<|assistant|>\n"                # (b)


def test_the_calculator_conversation_as_the_model_reads_it(tokenizer):
    assert render(tokenizer, CONVERSATIONS["calculator"], TOOLS[:1]) == (
        "<s><|tools|>\ncalculator(expression): Computes A+B.</s>\n"
        "<|user|>\nWhat is 37+45? Use the calculator.\n</s>\n"
        '<|assistant|>\n[calculator(expression="37+45")]</s>\n'
        "<|tool|>\n82</s>\n"
        "<|assistant|>\n82</s>\n")


def test_two_calls_are_one_pythonic_list(tokenizer):
    text = render(tokenizer, CONVERSATIONS["system, two calls, content parts"][:3])
    assert '<|assistant|>\n[calculator(expression="1+2"), now(tz="UTC", n=[1, true, null])]</s>\n' in text


def test_without_tools_it_renders_as_the_plain_template(tokenizer):
    msgs = CONVERSATIONS["guess"] + [{"role": "user", "content": "No."}]
    plain = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                          chat_template=TINY_CHAT_TEMPLATE)
    assert render(tokenizer, msgs, None, add_generation_prompt=True) == plain


@pytest.mark.parametrize("message, needle", [
    ({"role": "assistant", "content": None, "tool_calls": [call("calculator", '{"expression": "1+2"}')]},
     "tool call arguments must be a dict"),
    ({"role": "assistant", "content": "Let me see.", "tool_calls": [call("calculator", {"expression": "1+2"})]},
     "an assistant message with tool_calls must have no content"),
])
def test_what_it_cannot_render_is_refused_not_dropped(tokenizer, message, needle):
    with pytest.raises(jinja2.TemplateError, match=needle):
        tokenizer.apply_chat_template([message], tools=TOOLS, tokenize=False)


def test_template_messages_parses_arguments_and_keeps_the_input(tokenizer):
    msgs = CONVERSATIONS["calculator"]
    parsed = template_messages(msgs)
    assert parsed[1]["tool_calls"][0]["function"]["arguments"] == {"expression": "37+45"}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"expression": "37+45"}'
    assert "tool_calls" not in template_messages([{"role": "assistant", "content": "x", "tool_calls": []}])[0]
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments is not a JSON object"):
        template_messages([{"role": "assistant", "tool_calls": [call("f", "[1, 2]")]}])


def test_build_tiny_saves_the_tool_template(tmp_path):
    from transformers import AutoTokenizer

    from pipeline.__main__ import main
    assert main(["build-tiny", "--out", str(tmp_path / "m"), "--chat-template", "tools"]) == 0
    assert AutoTokenizer.from_pretrained(str(tmp_path / "m")).chat_template == TINY_TOOL_CHAT_TEMPLATE
    assert main(["build-tiny", "--out", str(tmp_path / "p"), "--chat-template"]) == 0
    assert AutoTokenizer.from_pretrained(str(tmp_path / "p")).chat_template == TINY_CHAT_TEMPLATE


def test_an_unknown_template_name_is_refused(tmp_path):
    from pipeline.inputs.tiny import build_tiny_model
    with pytest.raises(ValueError, match="chat template 'tool': one of plain, tools"):
        build_tiny_model(tmp_path / "m", chat_template="tool")
