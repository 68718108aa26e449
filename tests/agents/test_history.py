"""Token in, token out (pipeline/agents/history.py) with the tiny chat template
and a real tokenizer: what a continuing request adds, and what starts a segment."""
from __future__ import annotations

import pytest

from pipeline.agents.history import History, canonical
from pipeline.agents.requests import GatewayError, parse_chat_request
from pipeline.inputs.tiny import TINY_CHAT_TEMPLATE, build_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def history(tokenizer) -> History:
    def render(messages, tools, add_generation_prompt):
        return tokenizer.apply_chat_template(messages, tools=list(tools) or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    return History(render, lambda text: tokenizer(text, add_special_tokens=False).input_ids, tokenizer.eos_token)


def sampled(tokenizer, text: str, closed: bool = True) -> list[int]:
    """Tokens as a model would sample them: not what encoding the text gives, to show they are kept."""
    ids = [tokenizer.convert_tokens_to_ids(c) for c in text if tokenizer.convert_tokens_to_ids(c) is not None]
    return ids + ([tokenizer.eos_token_id] if closed else [])


def test_a_continuing_request_appends_only_the_new_messages_after_the_sampled_tokens(tokenizer):
    h = history(tokenizer)
    first = [{"role": "user", "content": "What is 3+4?"}]
    segment = h.start(first, ())
    assert tokenizer.decode(segment.prompt_ids) == tokenizer.apply_chat_template(first, tokenize=False,
                                                                                 add_generation_prompt=True)
    turn = sampled(tokenizer, "calc")
    segment.append(turn, [-0.5] * len(turn), [3] * len(turn), sampled=True)
    segment.messages = first + [{"role": "assistant", "content": "calc"}]
    follow = segment.messages + [{"role": "user", "content": "result 7"}]
    added = h.continuation(segment, follow, ())
    # The template's "\n" after the sampled </s>, then the new user turn and the assistant's header.
    assert tokenizer.decode(added) == "\n<|user|>\nresult 7</s>\n<|assistant|>\n"
    assert segment.context() == segment.prompt_ids + tuple(turn)  # the sampled tokens, not a re-encoding


def test_a_turn_that_stopped_without_its_end_token_gets_the_template_closing(tokenizer):
    h = history(tokenizer)
    segment = h.start([{"role": "user", "content": "hi"}], ())
    segment.append(sampled(tokenizer, "abc", closed=False), [0.0] * 3, [0] * 3, sampled=True)
    segment.closed = False
    segment.messages.append({"role": "assistant", "content": "abc"})
    added = h.continuation(segment, segment.messages + [{"role": "user", "content": "go on"}], ())
    assert tokenizer.decode(added).startswith("</s>\n<|user|>\ngo on")


@pytest.mark.parametrize("change", ["edited", "dropped", "tools", "no new message"])
def test_a_history_that_does_not_repeat_the_segment_is_no_continuation(tokenizer, change):
    h = history(tokenizer)
    base = [{"role": "user", "content": "hi"}]
    segment = h.start(base, ())
    segment.messages = base + [{"role": "assistant", "content": "yo"}]
    follow = {"edited": [{"role": "user", "content": "hi!"}, {"role": "assistant", "content": "yo"},
                         {"role": "user", "content": "more"}],
              "dropped": [{"role": "user", "content": "more"}],
              "tools": segment.messages + [{"role": "user", "content": "more"}],
              "no new message": segment.messages}[change]
    tools = ({"type": "function", "function": {"name": "calc"}},) if change == "tools" else ()
    assert h.continuation(segment, follow, tools) is None


def test_tool_calls_compare_by_name_and_arguments_not_ids_or_spacing():
    a = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"a": 1, "b": 2}'}}]}
    b = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "calc", "arguments": '{"b":2,"a":1}'}}]}
    assert canonical(a) == canonical(b)
    b["tool_calls"][0]["function"]["arguments"] = '{"a": 1, "b": 3}'
    assert canonical(a) != canonical(b)


def test_parse_normalises_content_parts_and_tool_calls():
    request = parse_chat_request(b'{"model": "m", "messages": [{"role": "system", "content": [{"type": "text", '
                                 b'"text": "be "}, {"type": "text", "text": "brief"}]}, {"role": "assistant", '
                                 b'"content": null, "tool_calls": [{"id": "c", "type": "function", "function": '
                                 b'{"name": "f", "arguments": {"x": 1}}}]}, {"role": "tool", "tool_call_id": "c",'
                                 b' "content": "2"}], "max_completion_tokens": 5, "stop": "END", "seed": 3}')
    assert request.messages[0] == {"role": "system", "content": "be brief"}
    assert request.messages[1]["content"] == "" and \
        request.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    assert request.max_tokens == 5 and request.stop == ("END",) and request.tool_choice == "none"


@pytest.mark.parametrize("raw, param", [(b"[1]", None), (b"\xff", None), (b'{"messages": "hi"}', "messages"),
                                        (b'{"messages": [{"role": "user", "content": "x"}], "stop": ["", "a"]}',
                                         "stop"),
                                        (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}',
                                         "logprobs")])
def test_parse_errors_name_the_field(raw, param):
    with pytest.raises(GatewayError) as caught:
        parse_chat_request(raw)
    assert caught.value.status == 400 and caught.value.param == param
