"""Agent samples on the engine loop: one session per sample, its requests as engine turns.

The engine loop (pipeline/generator/engine_loop.py) owns the engine and calls
this on its own thread only, so a session's tokens, its requests and the
engine change in one order. A sample's session opens when the loop adds the
sample (after the collect that launched it) and its agent starts; the gateway
hands each HTTP request to the loop as a `chat` command; the request's turn
decodes beside every other sample's; its answer goes back to the waiting HTTP
handler. The sample is complete when its agent returns (an `agent_end`
command), and its session closes then: a later request is a 404.

One request of a session decodes at a time; a second one sent meanwhile waits
for the first (its context depends on the first's answer).

Each request's tokens and weight versions are logged (agent_request_start and
agent_request_end, on the loop's lane), which pipeline/tools/check_agents.py reads.
"""
from __future__ import annotations

import json
import math
import secrets
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from jinja2 import TemplateError

from pipeline.agents.history import History, Segment
from pipeline.agents.requests import ChatRequest, GatewayError
from pipeline.agents.responses import chat_response, cut_at_stop
from pipeline.core.specs import version_runs
from pipeline.core.types import Completion, GenerationEngine, Prompt, turn_seed


@dataclass
class Session:
    key: str
    id: str
    prompt: Prompt
    seed: int | None
    deadline: float
    segments: list[Segment] = field(default_factory=list)
    requests: int = 0
    waiting: deque = field(default_factory=deque)          # (ChatRequest, reply) behind the running one
    running: tuple[str, ChatRequest, Future] | None = None  # its engine request's key, the request, its reply
    text: str = ""                  # the last assistant content: what data.reward scores
    transcript: list[dict] = field(default_factory=list)
    truncated: bool = False
    handle: Any = None              # the runner's, to cancel the agent


class AgentSessions:
    """`launch(key, session_id, prompt) -> handle` starts a sample's agent (pipeline/agents/runner.py),
    `cancel(handle)` stops it; `parse(text, tools, tool_choice) -> (content, tool_calls)`
    reads tool calls (None: the text is the content); `scored`: data.reward or a
    reward model scores an agent's None; `version()`: the weights the engine holds now."""

    def __init__(self, agent_cfg, engine: GenerationEngine, emit: Callable[..., None], version: Callable[[], int],
                 launch: Callable, cancel: Callable, parse: Callable | None, max_new_tokens: int, scored: bool,
                 model_name: str):
        self.cfg, self.engine, self.model_name = agent_cfg, engine, model_name
        self._emit, self._version, self._launch, self._cancel, self._parse = emit, version, launch, cancel, parse
        self.max_new_tokens, self.scored = max_new_tokens, scored
        self.history = History(engine.render_chat, engine.encode_continuation, engine.eos_text)
        self._live: dict[str, Session] = {}      # by sample key
        self._ids: dict[str, str] = {}           # session id -> sample key
        self._requests: dict[str, str] = {}      # engine request key -> sample key

    # -- the loop's side ---------------------------------------------------------
    def start(self, key: str, prompt: Prompt, seed: int | None) -> None:
        session = Session(key, secrets.token_urlsafe(12), prompt, seed, time.monotonic() + self.cfg.timeout_s)
        self._live[key], self._ids[session.id] = session, key
        self._emit("agent_start", batch=_batch(key), sample=key)
        session.handle = self._launch(key, session.id, prompt)

    def owns(self, request_key: str) -> bool:
        return request_key in self._requests

    def on_chat(self, session_id: str, request: ChatRequest, reply: Future) -> None:
        """A request from the gateway: decoded now, or after the session's running one."""
        session = self._live.get(self._ids.get(session_id, ""))
        if session is None:
            _refuse(reply, GatewayError(404, f"session {session_id!r}: no such session, or its sample is "
                                                  "over", None, "session_not_found"))
        elif session.running is not None:
            session.waiting.append((request, reply))
        else:
            self._begin(session, request, reply)

    def on_turn(self, request_key: str, completion: Completion) -> None:
        """The engine finished a request's turn: its tokens join the segment, its answer goes back."""
        session = self._live[self._requests.pop(request_key)]
        (_, request, reply), session.running = session.running, None
        segment = session.segments[-1]
        ids = list(completion.response_ids)
        segment.append(ids, list(completion.logprobs), list(completion.versions), sampled=True)
        segment.routes.add(completion)
        segment.closed = bool(ids) and ids[-1] == self.engine.eos_id
        text = cut_at_stop(completion.text, request.stop)
        content, tool_calls = self._parse(text, request.tools, request.tool_choice) if self._parse else (text, [])
        message = {"role": "assistant", "content": content or ""}
        if tool_calls:
            message["tool_calls"] = tool_calls
        segment.messages.append(message)
        session.text = content or ""
        session.transcript.append({"role": "model", "text": completion.text, "reward": None})
        session.truncated = session.truncated or bool(completion.truncated)
        finish = "tool_calls" if tool_calls else "length" if completion.truncated else "stop"
        self._emit("agent_request_end", batch=_batch(session.key), sample=session.key, request=session.requests,
                   tokens=len(ids), token_versions=version_runs(completion.versions), finish=finish)
        _answer(reply, chat_response(f"chatcmpl-{session.id}-{session.requests}", self.model_name, message, finish,
                                       len(segment.context()) - len(ids), completion,
                                       self.engine.decode if request.logprobs else None))
        self._next(session)

    def on_agent_end(self, key: str, outcome: tuple[str, Any]) -> tuple[str, Completion] | None:
        """The agent returned or raised: the sample is complete."""
        session = self._live.get(key)
        if session is None:
            return None  # timed out, or aborted, before it returned
        status, value = outcome
        reward, error = (None, f"agent raised {value}") if status == "error" else self._reward(value)
        return self._end(session, reward, error, info=value.get("info") if isinstance(value, dict) else None)

    def expire(self, now: float) -> list[tuple[str, Completion]]:
        late = [s for s in self._live.values() if s.deadline <= now]
        return [self._end(s, None, f"agent outlived agent.timeout_s ({self.cfg.timeout_s:g} s)") for s in late]

    def next_deadline(self) -> float | None:
        return min((s.deadline for s in self._live.values()), default=None)

    def tokens_so_far(self, key: str) -> int:
        session = self._live.get(key)
        return len(session.segments[-1].response) if session and session.segments else 0

    def segment_of(self, key: str) -> int:
        """The segment the sample's tokens now go to (0: it has made no request yet)."""
        session = self._live.get(key)
        return len(session.segments) if session else 0

    def current_request(self, key: str) -> str | None:
        session = self._live.get(key)
        return session.running[0] if session and session.running else None

    def abort_all(self) -> None:
        """The engine's requests are gone (a failed step, a stop): every session ends unanswered."""
        for session in list(self._live.values()):
            self._close(session, "the generator aborted its rollouts")
        self._requests.clear()

    def close(self) -> None:
        self.abort_all()

    # -- inside -------------------------------------------------------------------
    def _begin(self, session: Session, request: ChatRequest, reply: Future) -> None:
        messages, current = list(request.messages), session.segments[-1] if session.segments else None
        try:
            added = None if current is None else self.history.continuation(current, messages, request.tools)
            segment = self.history.start(messages, request.tools) if added is None else current
        except (ValueError, TemplateError) as exc:
            _refuse(reply, GatewayError(400, f"messages: the model's chat template cannot render them: {exc}",
                                             "messages", "invalid_messages"))
            return self._next(session)
        if added is None:
            new, context = messages, segment.prompt_ids
        else:
            new, context = messages[len(current.messages):], current.context() + tuple(added)
        limit = self.engine.max_model_len - len(context)
        if limit < 1:
            session.truncated = True
            self._emit("agent_request_refused", batch=_batch(session.key), sample=session.key,
                       reason="context_length_exceeded", context=len(context))
            _refuse(reply, GatewayError(400, f"this conversation is {len(context)} tokens; the model's "
                                                  f"context is {self.engine.max_model_len}", "messages",
                                             "context_length_exceeded"))
            return self._next(session)
        version = self._version()
        if added is None:
            if session.segments:
                session.transcript.append({"role": "segment", "reward": None,
                                           "text": f"segment {len(session.segments) + 1}: the history was rewritten"})
            session.segments.append(segment)
        else:
            segment.append(added, [0.0] * len(added), [version] * len(added), sampled=False)
        segment.messages = messages
        session.transcript += [{"role": m["role"], "text": m["content"], "reward": None} for m in new]
        session.requests += 1
        request_key = f"{session.key}#{session.requests}"
        self.engine.add(request_key, Prompt(session.prompt.id, "", session.prompt.answer, token_ids=context),
                        turn_seed(session.seed, session.requests - 1),
                        max_tokens=min(request.max_tokens or self.max_new_tokens, limit), stop=request.stop)
        self._requests[request_key], session.running = session.key, (request_key, request, reply)
        self._emit("agent_request_start", batch=_batch(session.key), sample=session.key, request=session.requests,
                   segment=len(session.segments), context=len(context), rendered=len(context) if added is None
                   else len(added), loaded=version)

    def _next(self, session: Session) -> None:
        if session.waiting and session.running is None:
            self._begin(session, *session.waiting.popleft())

    def _reward(self, value: Any) -> tuple[float | None, str]:
        reward = value.get("reward") if isinstance(value, dict) else value
        if reward is None:
            if self.scored:
                return None, ""
            return None, "agent returned no reward and the run has no data.reward or reward model to score it"
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            return None, (f"agent returned {type(value).__name__} {value!r:.80}; expected a float, a dict with "
                          "'reward', or None")
        if not math.isfinite(reward):
            return None, f"agent returned reward {reward}; a reward must be finite"
        return float(reward), ""

    def _end(self, session: Session, reward: float | None, error: str, info: Any = None) -> tuple[str, Completion]:
        self._close(session, error or "the sample is complete")
        if not session.segments and not error:
            error = "the agent made no request to the gateway"
        if error:
            self._emit("agent_failed", batch=_batch(session.key), sample=session.key, reason=error)
        self._emit("agent_end", batch=_batch(session.key), sample=session.key, requests=session.requests,
                   segments=len(session.segments), reward=reward, info=_loggable(info))
        segment = session.segments[-1] if session.segments else Segment([], (), tuple(self.engine.encode(
            session.prompt.text)))
        return session.key, Completion(
            prompt_ids=segment.prompt_ids, response_ids=tuple(segment.response), logprobs=tuple(segment.logprobs),
            text=session.text, versions=tuple(segment.versions), loss_mask=tuple(segment.mask),
            reward=0.0 if error else reward, error=error, turns=session.requests, truncated=session.truncated,
            transcript=tuple(session.transcript), segments=max(1, len(session.segments)),
            routes=segment.routes.whole(len(segment.context())))

    def _close(self, session: Session, why: str) -> None:
        """No request of the session runs or waits after this, and its id is forgotten."""
        self._live.pop(session.key, None)
        self._ids.pop(session.id, None)
        replies = [reply for _, reply in session.waiting]
        if session.running is not None:
            request_key, _, reply = session.running
            self.engine.abort([request_key])
            self._requests.pop(request_key, None)
            replies.insert(0, reply)
        session.running, session.waiting = None, deque()
        for reply in replies:
            _refuse(reply, GatewayError(404, f"session {session.id!r} is over: {why}", None,
                                             "session_not_found"))
        self._cancel(session.handle)


def _answer(reply: Future, response: dict) -> None:
    # A client that went away (a timeout, a cancelled agent) cancelled its handler's future.
    if not reply.cancelled():
        reply.set_result(response)


def _refuse(reply: Future, error: GatewayError) -> None:
    if not reply.cancelled():
        reply.set_exception(error)


def _batch(key: str) -> str:
    return key.rpartition("/")[0]


def _loggable(info: Any) -> Any:
    try:
        json.dumps(info)
        return info
    except (TypeError, ValueError):
        return repr(info)[:500]
