"""Tool calls in a model's output, parsed by vLLM's own tool parsers (the
`--tool-call-parser` of its OpenAI server), so that an agent written
against the `openai` SDK gets `message.tool_calls` as it would from vLLM.

    parser = load_tool_parser("pythonic", tokenizer)
    request = chat_request(body)             # the chat.completions body, tools included
    content, tool_calls = parse_tool_calls(parser, text, request)

The tiny model's tool template (pipeline/inputs/tiny.py, "tools") writes calls
in the `pythonic` format, `[calculator(expression="37+45")]`: the parsers of
JSON formats need special tokens the tiny vocabulary lacks (hermes'
<tool_call>, llama3_json's <|python_tag|>) or spell more than twice the
tokens. The parsers run as in vLLM's server without streaming, except that
one instance serves every request (the server builds one per request for
streaming's state; pythonic's extract_tool_calls keeps none). Each call gets
vLLM's random id (`chatcmpl-tool-...`), which no template renders, so it
never reaches a token.

Rendering a conversation back goes through template_messages(): OpenAI
gives a call's arguments as a JSON string, HF chat templates take a dict,
and vLLM's server converts one to the other before rendering.
"""
from __future__ import annotations

import copy
import json
import logging
from typing import Any


def available_tool_parsers() -> list[str]:
    from vllm.tool_parsers import ToolParserManager
    return ToolParserManager.list_registered()


def load_tool_parser(name: str, tokenizer: Any) -> Any:
    """vLLM's tool parser `name` (ToolParserManager) for `tokenizer`; a
    ValueError names the parsers there are, or why this one cannot work
    with this tokenizer (most need their model's special tokens). Silences
    the parser's loggers in this process."""
    from vllm.tool_parsers import ToolParserManager
    names = ToolParserManager.list_registered()
    if name not in names:
        raise ValueError(f"tool parser {name!r} is not one of vLLM's: {', '.join(names)}")
    try:
        parser = ToolParserManager.get_tool_parser(name)(tokenizer)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise ValueError(f"tool parser {name!r} cannot parse this model's output: {exc} "
                         "(the tiny model's tool template writes the format of 'pythonic')") from None
    # The parsers log a traceback for every malformed call, which a sampling policy writes by the
    # thousand; parse_tool_calls returns one as content, which is all there is to say about it.
    # Filters, not levels: an engine's start resets the levels of vLLM's loggers (core/vllm_env.py).
    for logger in (logging.getLogger(type(parser).__module__), logging.getLogger("vllm.tool_parsers.utils")):
        if not any(isinstance(f, _Silenced) for f in logger.filters):
            logger.addFilter(_Silenced())
    return parser


class _Silenced(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def chat_request(body: dict) -> Any:
    """The chat.completions request body as vLLM's ChatCompletionRequest, which
    the parsers take (a pydantic ValidationError for a malformed body)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    return ChatCompletionRequest.model_validate(body)


def parse_tool_calls(parser: Any, text: str, request: Any) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a model's finished turn `text` (special tokens
    skipped), the calls in OpenAI's response format ({"id", "type": "function",
    "function": {"name", "arguments": JSON string}}). Text that is no call, a
    malformed call, or a parser that fails gives the text back as content and
    no calls; as in vLLM's server, a request without tools or with
    tool_choice "none" is not parsed."""
    if not request.tools or request.tool_choice == "none":
        return text, []
    try:
        info = parser.extract_tool_calls(text, request)
    except Exception:  # noqa: BLE001 - a parser's bug on odd text must not fail the agent's request
        return text, []
    if not info.tools_called or not info.tool_calls:
        return text, []
    return info.content or None, [call.model_dump() for call in info.tool_calls]


def template_messages(messages: list[dict]) -> list[dict]:
    """`messages` as HF chat templates take them: each assistant tool call's
    arguments parsed from OpenAI's JSON string into a dict, an empty
    tool_calls list dropped (as vLLM's server does); a copy, the input
    untouched. A ValueError names a call whose arguments are not a JSON object."""
    out = []
    for i, message in enumerate(messages):
        message = copy.deepcopy(message)
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls is not None and not calls:
            del message["tool_calls"]
        for j, call in enumerate(calls or []):
            arguments = call.get("function", {}).get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    arguments = None
                if not isinstance(arguments, dict):
                    raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not a JSON object: "
                                     f"{call['function']['arguments']!r:.200}")
                call["function"]["arguments"] = arguments
        out.append(message)
    return out


class ToolCallReader:
    """One run's tool calls: `reader(text, tools, tool_choice) -> (content, tool_calls)`,
    with parser `name` for `tokenizer` and vLLM's request built once per set of tools."""

    def __init__(self, name: str, tokenizer: Any):
        self.parser = load_tool_parser(name, tokenizer)
        self._requests: dict[str, Any] = {}

    def __call__(self, text: str, tools: tuple[dict, ...], tool_choice: str) -> tuple[str | None, list[dict]]:
        key = json.dumps([tools, tool_choice], sort_keys=True)
        request = self._requests.get(key)
        if request is None:
            request = chat_request({"messages": [{"role": "user", "content": ""}], "tools": list(tools) or None,
                                    "tool_choice": tool_choice})
            self._requests[key] = request
        return parse_tool_calls(self.parser, text, request)
