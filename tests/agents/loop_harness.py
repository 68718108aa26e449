"""An engine loop with agents and a gateway on 127.0.0.1, without Ray: one
batch rolled out through real HTTP, the openai SDK and the sessions."""
from __future__ import annotations

import json
import threading
import time

from dags.tokens import Launch
from pipeline.agents.serving import AgentServing
from pipeline.config import SimConfig, load_config
from pipeline.core.events import EventLog
from pipeline.core.types import Prompt
from pipeline.generator.engine_loop import EngineLoop
from pipeline.sim.engines import SimGenerationEngine


def sim_engine(max_new_tokens: int = 8) -> SimGenerationEngine:
    return SimGenerationEngine(SimConfig(generate_s=0.01), seed=0, max_new_tokens=max_new_tokens)


class AgentLoop:
    """`with AgentLoop(tmp_path, "module:function") as rig: rig.roll(prompts)`."""

    def __init__(self, tmp_path, function: str, *overrides: str, engine=None, scored: bool = True):
        self.cfg = load_config(None, [f"agent.function={function}", *overrides])
        self.engine = engine or sim_engine(self.cfg.generation.max_new_tokens)
        self.log = EventLog(tmp_path, "gen0", time.time())
        self.run_dir = tmp_path
        self._delivered: dict = {}
        self._finished = threading.Event()
        self.serving = AgentServing(self.cfg, self.engine, scored, lambda key, outcome: self.loop.agent_done(key, outcome),
                                    host="127.0.0.1")
        self.loop = EngineLoop(self.engine, self.log, self._deliver, self._fail, 0, self.cfg.schedule.group_size,
                               agents=self.serving.sessions)
        self.serving.start(self.loop.chat)

    def _deliver(self, batch, completions, spans):
        self._delivered["completions"] = completions
        self._finished.set()

    def _fail(self, batch, reason):
        self._delivered["failed"] = reason
        self._finished.set()

    def roll(self, prompts: list[Prompt], timeout_s: float = 60):
        """One batch of `prompts` x group_size samples; their completions, in sample order."""
        group = self.cfg.schedule.group_size
        launch = Launch("b0", 0, 0, tuple(prompts))
        self.loop.call("submit", (0, [(launch, list(range(100, 100 + len(prompts) * group)))]), 30, "submit")
        assert self._finished.wait(timeout_s), "the batch never finished"
        assert "failed" not in self._delivered, self._delivered["failed"]
        return self._delivered["completions"]

    def events(self, kind: str | None = None) -> list[dict]:
        lines = (self.run_dir / "events" / "gen0.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if kind is None or e["ev"] == kind]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.serving.stop_agents(10)
        self.loop.stop(10)
        self.serving.stop_server(10)
        assert self.loop.died is None, self.loop.died


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", f"question {i}", str(i)) for i in range(n)]
