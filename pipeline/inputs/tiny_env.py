"""The tiny repeat task (pipeline/inputs/tiny.py) as a one-turn environment,
so that `python -m pipeline warmup` can demonstrate it: the distillation
teacher of examples/tiny_distill.yaml (`make models/tiny_teacher/config.json`).

The reward is data.reward's, pipeline.rewards.rules:tiny_reward, so a model
warmed up here is measured on the task as a run validates it.

Why 32-48 characters and 80 steps (measured by pure distillation of the fresh
tiny model, lr 0.005, seed 0; benchmarks/distill.py has the rest):
- runs of 1-16 characters taught the teacher a </s> after one token, which
  the student copied everywhere: its greedy answer was empty on every prompt;
- after 40 steps the other digit's run ("1111" for a 0 prompt) is at -4.1
  nats under the teacher, likelier than under the fresh student (-5.9): the
  student is paid for it, and its greedy answer ignored the prompt for 20
  steps;
- after 80 steps it is at -5.7 to -6.2, the right run at -0.01, greedy 1.0,
  sampled 0.99; every other token is at -12, a reverse KL of 6 at the start,
  which the recipe's kl_clip keeps from drowning the rest.
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
