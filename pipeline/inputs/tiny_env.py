"""The tiny repeat task (pipeline/inputs/tiny.py) as a one-turn environment,
so that `python -m pipeline warmup` can demonstrate it: the distillation
teacher of examples/tiny_distill.yaml (`make models/tiny_teacher/config.json`).

The reward is data.reward's, pipeline.rewards.rules:tiny_reward, so a model
warmed up here is measured on the task as a run validates it.

Runs of 32-48 characters and 80 warm-up steps make a teacher whose wrong
runs are less likely than under a fresh student and that never stops after one
token; docs/distillation.md says why each matters.
"""
from __future__ import annotations

import random

from pipeline.core.types import Prompt
from pipeline.rewards.rules import tiny_reward


class RepeatEnv:
    """One turn: the model answers the prompt and is paid tiny_reward."""

    max_turns = 1
    # `python -m pipeline warmup`'s defaults for this env (the module docstring says why).
    warmup_steps = 80
    warmup_prompts = None

    def __init__(self, shortest: int = 32, longest: int = 48):
        # 48 characters are 12 tokens and </s>: longer runs do not fit the rollout's 16 tokens.
        if not 1 <= shortest <= longest:
            raise ValueError(f"RepeatEnv: shortest {shortest} and longest {longest} must satisfy "
                             "1 <= shortest <= longest")
        self.shortest, self.longest = shortest, longest
        self._prompt: Prompt | None = None

    def reset(self, prompt: Prompt) -> str:
        self._prompt = prompt
        return prompt.text

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self._prompt is None:
            raise RuntimeError("RepeatEnv.step() before reset()")
        prompt, self._prompt = self._prompt, None
        return "", tiny_reward(prompt, action), True, {"valid": True}

    def warmup_action(self, rng: random.Random) -> str:
        """A run of the requested character, of a length drawn from
        [shortest, longest]: the teacher spreads its probability over the run's
        tokens and ends it late, never after nothing."""
        return self.expert_action(rng.randint(self.shortest, self.longest))

    def expert_action(self, length: int = 48) -> str:
        if self._prompt is None:
            raise RuntimeError("RepeatEnv.expert_action() before reset()")
        return self._prompt.answer * length
