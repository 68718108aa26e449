"""Token in, token out: the context of a session's next request.

A segment is one context as the engine saw it: the tokens of its first
request's rendering, then, request by request, the tokens the engine sampled
(loss mask 1) and the tokens of the messages that came after them, rendered
by the chat template (mask 0). When a request's messages repeat the
segment's history (the messages sent before and the assistant messages
returned, compared by role, content and tool calls) and the template renders
that history as a prefix of the new conversation, the request continues the
segment: only the text after that prefix is encoded. The model's own turns are
never re-encoded, so the trainer scores exactly the tokens that were sampled.

Any other request (an edited or dropped turn, other tools, a template that
renders earlier turns differently once more follow) starts a new segment from
its full rendering. docs/agents.md says which segment is trained.

Between a sampled turn and the next messages the template puts its own
closing text (TINY_CHAT_TEMPLATE's "</s>\\n"): the part after the end-of-turn
token the model sampled, or, when the turn stopped without one (max_tokens, a
stop string), the end-of-turn token and what follows it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from pipeline.core.stitched_routes import StitchedRoutes

Render = Callable[[list[dict], tuple[dict, ...], bool], str]


@dataclass
class Segment:
    messages: list[dict]           # the history its tokens hold: requests' messages and the turns returned
    tools: tuple[dict, ...]
    prompt_ids: tuple[int, ...]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    closed: bool = True            # its last model turn ended with the end-of-turn token
    routes: StitchedRoutes = field(default_factory=StitchedRoutes)  # training.routing_replay

    def context(self) -> tuple[int, ...]:
        return self.prompt_ids + tuple(self.response)

    def append(self, ids: list[int], logprobs: list[float], versions: list[int], sampled: bool) -> None:
        self.response += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [int(sampled)] * len(ids)


def canonical(message: dict) -> tuple:
    """What makes two messages the same turn: tool call ids and argument
    spacing may differ between what was returned and what comes back."""
    calls = tuple((c["function"]["name"], _canonical_json(c["function"]["arguments"]))
                  for c in message.get("tool_calls", ()))
    return message["role"], message.get("content") or "", calls, message.get("tool_call_id")


def _canonical_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True)
    except (TypeError, ValueError):
        return text


class History:
    """`render(messages, tools, add_generation_prompt)`: the chat template's
    text; `encode(text)`: its tokens, nothing added (the template writes the
    BOS); `eos_text`: the end-of-turn token as the template writes it."""

    def __init__(self, render: Render, encode: Callable[[str], list[int]], eos_text: str):
        self.render, self.encode, self.eos_text = render, encode, eos_text

    def start(self, messages: list[dict], tools: tuple[dict, ...]) -> Segment:
        """A new segment: the conversation rendered whole, with the assistant's header."""
        ids = self.encode(self.render(messages, tools, True))
        return Segment(list(messages), tools, tuple(ids))

    def continuation(self, segment: Segment, messages: list[dict], tools: tuple[dict, ...]) -> list[int] | None:
        """The tokens that take `segment` to `messages` (ending with the
        assistant's header), or None when the messages do not continue it."""
        known = segment.messages
        if tools != segment.tools or len(messages) <= len(known):
            return None
        if any(canonical(a) != canonical(b) for a, b in zip(messages, known)):
            return None
        before = self.render(known, tools, False)
        after = self.render(messages, tools, True)
        if not after.startswith(before):
            return None
        return self.encode(self._closing(before, segment.closed) + after[len(before):])

    def _closing(self, rendered: str, closed: bool) -> str:
        """The template's text after the last sampled token: what follows the
        end-of-turn token (sampled, or not: then the token too)."""
        at = rendered.rfind(self.eos_text) if self.eos_text else -1
        if at < 0:
            return ""
        return rendered[at + len(self.eos_text):] if closed else rendered[at:]
