"""Tool calls parsed from a model's text by vLLM's parsers (pipeline/agents/tool_calls.py),
in the format the tiny model's tool template writes them."""
from __future__ import annotations

import json

import pytest

from pipeline.agents.tool_calls import (chat_request, load_tool_parser, parse_tool_calls,
                                        template_messages)
from pipeline.envs.calculator_agent import CALCULATOR_TOOL, TOOL_PARSER
from pipeline.inputs.tiny import TINY_TOOL_CHAT_TEMPLATE

pytestmark = pytest.mark.real  # imports vLLM

NOW_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
USER = {"role": "user", "content": "What is 37+45? Use the calculator.\n"}


@pytest.fixture(scope="module")
def tokenizer():
    from pipeline.inputs.tiny import build_tokenizer
    tok = build_tokenizer()
    tok.chat_template = TINY_TOOL_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def parser(tokenizer):
    return load_tool_parser(TOOL_PARSER, tokenizer)


@pytest.fixture(scope="module")
def request_():
    return chat_request({"model": "tiny", "messages": [USER], "tools": [CALCULATOR_TOOL, NOW_TOOL],
                         "max_tokens": 32, "an_agents_own_key": 1})


def assistant_turn(tokenizer, calls: list[dict]) -> str:
    """What the model samples after the assistant header, without its </s>, for a message of `calls`."""
    msgs = [USER, {"role": "assistant", "content": None, "tool_calls": calls}]
    tools = [CALCULATOR_TOOL, NOW_TOOL]
    before = tokenizer.apply_chat_template(msgs[:1], tools=tools, tokenize=False, add_generation_prompt=True)
    after = tokenizer.apply_chat_template(template_messages(msgs), tools=tools, tokenize=False)
    assert after.startswith(before) and after.endswith("</s>\n")
    return after[len(before):-len("</s>\n")]


def call(name: str, arguments: dict, i: int = 0) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def named_arguments(calls: list[dict]) -> list[tuple]:
    return [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("calls", [
    [call("calculator", {"expression": "37+45"})],
    [call("calculator", {"expression": "1+2"}), call("now", {"tz": "UTC", "n": [1.5, True, None, {"k": 0}]}, 1)],
    [call("now", {})],
    [call("calculator", {"expression": 'say "hi"\n\\ é'})],
], ids=["calculator", "two calls", "no arguments", "escapes"])
def test_a_rendered_call_parses_back_to_its_name_and_arguments(tokenizer, parser, request_, calls):
    content, parsed = parse_tool_calls(parser, assistant_turn(tokenizer, calls), request_)
    assert content is None and named_arguments(parsed) == named_arguments(calls)
    assert all(c["id"].startswith("chatcmpl-tool-") for c in parsed) and len({c["id"] for c in parsed}) == len(parsed)


def test_every_calculator_call_parses_back(tokenizer, parser, request_):
    for a in range(100):
        calls = [call("calculator", {"expression": f"{a}+{(37 * a + 11) % 100}"})]
        content, parsed = parse_tool_calls(parser, assistant_turn(tokenizer, calls), request_)
        assert content is None and named_arguments(parsed) == named_arguments(calls)


@pytest.mark.parametrize("text", [
    "82", "", "The answer is 82.", "[82]", "[]",
    "[calculator(expression=37+45)]",      # an expression, not a literal
    '[calculator(expression="37+45"',      # cut off at the token limit
    '[calculator(expression="37+45")',
    '[calculator("37+45")]',               # positional
    '[calculator(expression="37+45"), 5]',
    '82 [calculator(expression="37+45")]',  # text before the list
    '[calculator(expression=b"37")]',       # not a JSON value
])
def test_text_that_is_not_a_well_formed_call_comes_back_as_content(parser, request_, text, caplog):
    assert parse_tool_calls(parser, text, request_) == (text, [])
    assert not caplog.records  # nor logged: the parsers' traceback for it is silenced


def test_a_parser_that_raises_gives_the_text_back(request_):
    class Broken:
        def extract_tool_calls(self, text, request):
            raise IndexError("a parser's own bug")
    text = '[calculator(expression="1+2")]'
    assert parse_tool_calls(Broken(), text, request_) == (text, [])


@pytest.mark.parametrize("body", [{"messages": [USER]},
                                  {"messages": [USER], "tools": [CALCULATOR_TOOL], "tool_choice": "none"}])
def test_a_request_without_tools_is_not_parsed(parser, body):
    text = '[calculator(expression="1+2")]'
    assert parse_tool_calls(parser, text, chat_request(body)) == (text, [])


def test_an_unknown_or_unusable_parser_is_refused_by_name(tokenizer):
    with pytest.raises(ValueError, match="tool parser 'pythonik' is not one of vLLM's: .*hermes, .*pythonic"):
        load_tool_parser("pythonik", tokenizer)
    with pytest.raises(ValueError, match="tool parser 'llama3_json' cannot parse this model's output: .*python_tag"):
        load_tool_parser("llama3_json", tokenizer)
