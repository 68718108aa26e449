"""An engine loop, with agents and their gateway on 127.0.0.1 or with an
environment, without Ray or training: batches rolled out through real HTTP,
the openai SDK and the sessions (or the episodes). The agent tests and
benchmarks/agents.py use it."""
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


def sim_engine(max_new_tokens: int = 8, generate_s: float = 0.01) -> SimGenerationEngine:
    return SimGenerationEngine(SimConfig(generate_s=generate_s), seed=0, max_new_tokens=max_new_tokens)


class AgentLoop:
    """`with AgentLoop(tmp_path, "module:function") as rig: rig.roll(prompts)`; with
    function "" the recipe's env.class plays the samples instead."""

    def __init__(self, tmp_path, function: str, *overrides: str, engine=None, scored: bool = True):
        self.cfg = load_config(None, [f"agent.function={function}", *overrides])
        self.engine = engine or sim_engine(self.cfg.generation.max_new_tokens)
        self.log = EventLog(tmp_path, "gen0", time.time())
        self.run_dir = tmp_path
        self._delivered: dict = {}
        self._finished = threading.Event()
        self._batches = 0
        self.serving = None
        if function:
            self.serving = AgentServing(self.cfg, self.engine, scored,
                                        lambda key, outcome: self.loop.agent_done(key, outcome), host="127.0.0.1")
        self.loop = EngineLoop(self.engine, self.log, self._deliver, self._fail, 0, self.cfg.schedule.group_size,
                               self.cfg.env if self.cfg.env.class_ else None, None,
                               self.serving.sessions if self.serving else None)
        if self.serving:
            self.serving.start(self.loop.chat)

    def _deliver(self, batch, completions, spans):
        self._delivered["completions"] = completions
        self._finished.set()

    def _fail(self, batch, reason):
        self._delivered["failed"] = reason
        self._finished.set()

    def roll(self, prompts: list[Prompt], timeout_s: float = 60, first_seed: int = 100):
        """One batch of `prompts` x group_size samples (seeds from `first_seed` on);
        their completions, in sample order."""
        group = self.cfg.schedule.group_size
        launch = Launch(f"b{self._batches}", 0, 0, tuple(prompts))
        self._batches += 1
        self._finished.clear()
        seeds = list(range(first_seed, first_seed + len(prompts) * group))
        self.loop.call("submit", (0, [(launch, seeds)]), 30, "submit")
        if not self._finished.wait(timeout_s):
            raise TimeoutError(f"batch {launch.batch_id} did not finish within {timeout_s:g} s")
        if "failed" in self._delivered:
            raise RuntimeError(f"batch {launch.batch_id} failed: {self._delivered['failed']}")
        return self._delivered.pop("completions")

    def events(self, kind: str | None = None) -> list[dict]:
        lines = (self.run_dir / "events" / "gen0.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if kind is None or e["ev"] == kind]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.serving:
            self.serving.stop_agents(10)
        self.loop.stop(10)
        if self.serving:
            self.serving.stop_server(10)
        if self.loop.died is not None:
            raise RuntimeError(f"the engine loop died: {self.loop.died}")


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", f"question {i}", str(i)) for i in range(n)]
