"""A simulated tool environment for backend sim: latency and turns without a tool.

Each step stands for a tool call: it takes `latency_s` (fixed, or lognormal
with p99 / p50 = tail_ratio, drawn from the prompt and the turn, so a run
replays exactly), answers with `observation_tokens` bytes, and ends the
episode after `turns` model turns (a number, or "random": 1 to max_turns,
drawn from the prompt). The reward at the end is sim_reward of the last turn's
text, so it rises with the weights as the single-turn sim's does.

Faults, for the tests: `fail` "raise" or "hang" on the step of turn
`fail_turn` of every `fail_every`-th prompt (by the number in its id).
"""
from __future__ import annotations

import math
import random
import re
import time

from pipeline.core.types import Prompt
from pipeline.sim.engines import sim_reward


class SimToolEnv:
    def __init__(self, latency_s: float = 0.05, latency: str = "fixed", tail_ratio: float = 4.0,
                 turns: int | str = 2, max_turns: int = 4, observation_tokens: int = 8,
                 fail: str = "", fail_every: int = 0, fail_turn: int = 1):
        if latency not in ("fixed", "lognormal"):
            raise ValueError(f"SimToolEnv: latency {latency!r} must be 'fixed' or 'lognormal'")
        if fail not in ("", "raise", "hang"):
            raise ValueError(f"SimToolEnv: fail {fail!r} must be '', 'raise' or 'hang'")
        self.latency_s, self.latency, self.tail_ratio = latency_s, latency, tail_ratio
        self.turns, self.max_turns, self.observation_tokens = turns, max_turns, observation_tokens
        self.fail, self.fail_every, self.fail_turn = fail, fail_every, fail_turn
        self.turn = 0

    def reset(self, prompt: Prompt) -> str:
        self.prompt = prompt
        self.rng = random.Random(f"simenv|{prompt.id}")
        self.length = self.rng.randint(1, self.max_turns) if self.turns == "random" else int(self.turns)
        number = re.findall(r"\d+", prompt.id)
        self.faulty = bool(self.fail and self.fail_every and number and int(number[-1]) % self.fail_every == 0)
        return prompt.text

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        self.turn += 1
        if self.faulty and self.turn == self.fail_turn:
            if self.fail == "raise":
                raise RuntimeError(f"injected tool failure on {self.prompt.id}, turn {self.turn}")
            time.sleep(3600)  # a stuck tool: only env.step_timeout_s ends this sample
        # Simulated tool latency: this sleep stands for the tool's work, it orders nothing.
        time.sleep(self._latency())
        done = self.turn >= self.length
        return "o" * self.observation_tokens, (sim_reward(self.prompt, action) if done else 0.0), done, {}

    def _latency(self) -> float:
        if self.latency == "fixed":
            return self.latency_s
        sigma = math.log(self.tail_ratio) / 2.3263
        return self.latency_s * math.exp(self.rng.gauss(0.0, sigma))
