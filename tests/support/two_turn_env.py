"""A two-turn environment for tests on random models: whatever the model writes
gets an observation and a second turn, and the reward (on the last turn) is
the actions' length, so a random policy's samples differ and GRPO moves it."""
from __future__ import annotations

from pipeline.core.types import Prompt


class TwoTurnEnv:
    def reset(self, prompt: Prompt) -> str:
        self.actions: list[str] = []
        return prompt.text

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        self.actions.append(action)
        done = len(self.actions) == 2
        return "next:\n", (min(sum(map(len, self.actions)), 40) / 40 if done else 0.0), done, {}
