"""A generator's agent serving: its gateway, its agents' runner and its sessions' parts.

Started by the generator with its engine loop (pipeline/generator/worker.py)
and stopped with it: the agents first (no new requests), then the loop, then
the server.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import ray

from pipeline.agents.gateway import Gateway
from pipeline.agents.runner import AgentRunner
from pipeline.agents.sessions import AgentSessions
from pipeline.core.types import GenerationEngine


class AgentServing:
    """`cfg`: the run's Config. `done(key, outcome)`: where an agent's end goes (the engine loop's agent_done);
    `scored`: data.reward or a reward model scores an agent's None;
    `host`: the address to serve on (default: this node's, as Ray knows it)."""

    def __init__(self, cfg, engine: GenerationEngine, scored: bool, done: Callable[[str, tuple], None],
                 host: str | None = None):
        self.cfg, self.engine, self.scored = cfg, engine, scored
        self.model_name = Path(cfg.model.path).name if cfg.model.path else "sim"
        self.gateway = Gateway(host or ray.util.get_node_ip_address(), self.model_name, cfg.agent.timeout_s)
        actors = None
        if cfg.agent.actors:
            from pipeline.agents.actors import AgentActors
            actors = AgentActors(cfg.agent)
            actors.wait_ready(cfg.run.startup_deadline_s)
        self.runner = AgentRunner(cfg.agent, self.gateway.session_url, self.gateway.key, done, actors,
                                  self.gateway.app)
        self.parse = None
        if cfg.agent.tool_parser:
            from pipeline.agents.tool_calls import ToolCallReader
            try:
                self.parse = ToolCallReader(cfg.agent.tool_parser, engine.tokenizer)
            except ValueError as exc:
                raise ValueError(f"agent.tool_parser: {exc}") from None

    def sessions(self, emit: Callable[..., None], version: Callable[[], int]) -> AgentSessions:
        """The engine loop's agents (EngineLoop's `agents`)."""
        return AgentSessions(self.cfg.agent, self.engine, emit, version, self.runner.launch, self.runner.cancel,
                             self.parse, self.cfg.generation.max_new_tokens, self.scored, self.model_name)

    def start(self, submit: Callable) -> None:
        self.gateway.start(submit)

    def stop_agents(self, timeout_s: float) -> None:
        self.runner.close(timeout_s)

    def stop_server(self, timeout_s: float) -> None:
        self.gateway.stop(timeout_s)
