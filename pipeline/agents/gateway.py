"""The OpenAI-compatible gateway of one generator (Starlette on uvicorn).

    POST /sessions/<session>/v1/chat/completions    one turn of that sample's conversation
    GET  /sessions/<session>/v1/models              the model it serves

A session is one sample's (pipeline/agents/sessions.py); its base URL is
`<gateway>/sessions/<session>/v1`. The server runs on a thread of its own and
only checks what comes in (the key, the body's fields): every request goes to
the generator's engine loop as a command and the handler awaits the loop's
answer, so the engine is driven by one thread whatever the number of
connections. The key is drawn per gateway, never logged; the socket binds to
the node's own address only.
"""
from __future__ import annotations

import asyncio
import hmac
import secrets
import socket
import threading
from concurrent.futures import Future
from typing import Callable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pipeline.agents.requests import ChatRequest, GatewayError, parse_chat_request


class Gateway:
    """`submit(session_id, request) -> Future` of the answer (EngineLoop.chat)."""

    def __init__(self, host: str, model_name: str, deadline_s: float):
        """`deadline_s`: the longest a request waits for its answer (its agent's own limit)."""
        self.key = secrets.token_urlsafe(32)
        self.model_name, self.deadline_s = model_name, deadline_s
        self._submit: Callable[[str, ChatRequest], Future] | None = None
        self._socket = socket.create_server((host, 0), backlog=2048)
        port = self._socket.getsockname()[1]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        self.app = Starlette(routes=[
            Route("/sessions/{session}/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/sessions/{session}/v1/models", self._models, methods=["GET"]),
        ], exception_handlers={GatewayError: _error_response, 404: _not_served, 405: _not_served})
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                                     timeout_keep_alive=60, timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._serve, name="gateway", daemon=True)
        self.died: str | None = None

    def session_url(self, session_id: str) -> str:
        return f"{self.url}/sessions/{session_id}/v1"

    def start(self, submit: Callable[[str, ChatRequest], Future]) -> None:
        """Serve; the socket already listens, so a request sent before the
        server's loop runs waits in the backlog instead of being refused."""
        self._submit = submit
        self._thread.start()

    def check(self) -> None:
        """Raise if the server is gone: its generator fails and is replaced like one whose engine died."""
        if self._submit is not None and not self._thread.is_alive() and not self._server.should_exit:
            raise RuntimeError(f"the agents' gateway at {self.url} stopped serving: {self.died or 'no error'}")

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # uvicorn exits on a failed start-up: check() reports it to the generator
            self.died = f"{type(exc).__name__}: {exc}"

    def stop(self, timeout_s: float) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        self._socket.close()

    async def _chat(self, request: Request) -> JSONResponse:
        self._authorize(request)
        chat = parse_chat_request(await request.body())
        try:
            answer = await asyncio.wait_for(asyncio.wrap_future(self._submit(request.path_params["session"], chat)),
                                            self.deadline_s)
        except GatewayError:
            raise
        except TimeoutError:
            raise GatewayError(504, f"no answer within {self.deadline_s:g} s (agent.timeout_s)", None,
                               "timeout") from None
        except Exception as exc:  # the engine's or the template's: the agent is told, the loop goes on
            raise GatewayError(500, f"{type(exc).__name__}: {exc}", None, "server_error") from exc
        return JSONResponse(answer)

    async def _models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                         "owned_by": "dagrl"}]})

    def _authorize(self, request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key.encode()):
            raise GatewayError(401, "no or wrong API key: send the key of this run's gateway as a Bearer token "
                                    "(the client dagrl hands the agent has it)", None, "invalid_api_key")


async def _error_response(_request: Request, exc: GatewayError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _not_served(request: Request, exc: Exception) -> JSONResponse:
    status = getattr(exc, "status_code", 404)
    error = GatewayError(status, f"{request.method} {request.url.path}: not served; a session's base URL is "
                                 "<gateway>/sessions/<session>/v1", None, "not_found")
    return JSONResponse(error.body(), status_code=status)
