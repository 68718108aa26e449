"""What the gateway accepts: a chat-completions body, checked field by field.

The checks run on the server's thread, before anything reaches the engine
loop, and a bad field is a 400 in OpenAI's error shape naming it (the `param`
the SDK shows). Fields that would change the distribution sampled from
(penalties, a logit bias) are refused rather than ignored: the trainer
computes its logprobs at the run's own sampling settings, so a token sampled
under others would be trained with the wrong probability. `temperature` and
`top_p` are accepted and recorded, and the run's generation.temperature and
top_p decide (docs/agents.md says why).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
# Sent by clients and harmless to ignore: none of them changes what is sampled.
IGNORED = ("model", "user", "metadata", "store", "seed", "parallel_tool_calls", "service_tier", "stream_options")
# Accepted only at the value that leaves the distribution alone.
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None}


class GatewayError(Exception):
    """An HTTP error in OpenAI's shape: `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, f"{param}: {message}", param, code)


@dataclass(frozen=True)
class ChatRequest:
    """A checked request. `messages`: normalised (pipeline/agents/history.py
    compares them); `tools`: as sent, for the chat template and the parser."""
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = ()
    tool_choice: str = "auto"
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    temperature: float | None = None
    top_p: float | None = None


def parse_chat_request(raw: bytes) -> ChatRequest:
    """The request body, checked; raises GatewayError (400) naming the field."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GatewayError(400, f"the request body is not JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, f"the request body must be a JSON object, got {type(body).__name__}", None,
                           "invalid_json")
    known = {"messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens", "max_completion_tokens",
             "stop", "n", "logprobs", "top_logprobs", "stream", *IGNORED, *NEUTRAL}
    for key in body:
        if key not in known:
            raise bad(key, "not served by the dagrl gateway (docs/agents.md lists the fields it serves)",
                      "unsupported_parameter")
    for key, neutral in NEUTRAL.items():
        if body.get(key) not in (neutral, None) and body.get(key) != {}:
            raise bad(key, f"{body[key]!r} would change the distribution the trainer scores; only "
                      f"{neutral!r} is served", "unsupported_value")
    if body.get("stream"):
        raise bad("stream", "streaming is not served; send stream: false", "unsupported_value")
    if body.get("n", 1) != 1:
        raise bad("n", f"{body['n']!r}: one choice per request is served (a sample is one conversation)",
                  "unsupported_value")
    if body.get("top_logprobs") not in (None, 0):
        raise bad("top_logprobs", f"{body['top_logprobs']!r}: only the sampled token's logprob is served (0)",
                  "unsupported_value")
    tools = _tools(body.get("tools"))
    return ChatRequest(
        messages=tuple(_message(m, i) for i, m in enumerate(_list(body, "messages", required=True))),
        tools=tools, tool_choice=_tool_choice(body.get("tool_choice"), tools),
        max_tokens=_max_tokens(body), stop=_stop(body.get("stop")), logprobs=_bool(body, "logprobs"),
        temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0, low_open=True))


def _list(body: dict, key: str, required: bool = False) -> list:
    value = body.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise bad(key, f"must be a non-empty list, got {value!r:.80}" if required else
                  f"must be a list, got {type(value).__name__}")
    return value


def _message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(where, f"must be an object with a role, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"{role!r}; one of {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": role, "content": _content(m.get("content"), f"{where}.content")}
    if role == "assistant" and m.get("tool_calls"):
        if not isinstance(m["tool_calls"], list):
            raise bad(f"{where}.tool_calls", "must be a list")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
    elif role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise bad(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
        out["tool_call_id"] = m["tool_call_id"]
    elif not out["content"] and role != "assistant":
        raise bad(f"{where}.content", "is empty")
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _content(content: Any, where: str) -> str:
    """Text, or a list of text parts joined; other parts (images, audio) are not served."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad(where, f"must be a string or a list of parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(f"{where}[{j}]", f"a {kind!r} part; only text parts are served")
        texts.append(part["text"])
    return "".join(texts)


def _tool_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad(f"{where}.function", "needs a name and arguments")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def _tools(value: Any) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("tools", f"must be a list, got {type(value).__name__}")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str):
            raise bad(f"tools[{i}]", "must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
    return tuple(value)


def _tool_choice(value: Any, tools: tuple[dict, ...]) -> str:
    if value is None:
        return "auto" if tools else "none"
    if value not in ("auto", "none"):
        raise bad("tool_choice", f"{value!r}: 'auto' and 'none' are served (a forced call would need guided "
                  "decoding, which would change the distribution the trainer scores)", "unsupported_value")
    return value


def _max_tokens(body: dict) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise bad(key, f"must be a positive integer, got {value!r}")
        return value
    return None


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"must be a non-empty string or a list of up to 4, got {value!r:.80}")
    return tuple(stops)


def _bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool) and value is not None:
        raise bad(key, f"must be true or false, got {value!r}")
    return bool(value)


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value > high or value < low or (low_open and value == low):
        raise bad(key, f"must be a number in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}")
    return float(value)
