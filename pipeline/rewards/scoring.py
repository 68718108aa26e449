"""One sample's reward as the run trains on it, and what a failed one becomes.

A sample's reward is its environment's sum of turn rewards, or the reward
function's. A function that raises, or returns NaN or inf, fails that sample
alone; a failed sample gets its group's mean of the good rewards.
"""
from __future__ import annotations

import math

from pipeline.algos.groups import flat_group_indices
from pipeline.core.types import Completion, Prompt
from pipeline.rewards.specs import RewardFn


def score_sample(prompt: Prompt, completion: Completion, reward_fn: RewardFn | None) -> tuple[float, str]:
    """(reward, why it failed or ""): the environment's sum of turn rewards, or `reward_fn`'s
    (None: 0, the reward model's score is the whole reward)."""
    if completion.reward is not None:
        if completion.error:
            return 0.0, f"prompt {prompt.id}: {completion.error}"
        if not math.isfinite(completion.reward):  # finite turn rewards that overflowed in their sum
            return 0.0, f"prompt {prompt.id}: environment rewards sum to {completion.reward}"
        return completion.reward, ""
    if reward_fn is None:
        return 0.0, ""
    try:
        reward = float(reward_fn(prompt, completion.text))
    except Exception as exc:  # a user's reward function: any error marks this one sample
        return 0.0, f"prompt {prompt.id}: {type(exc).__name__}: {exc}"
    if not math.isfinite(reward):
        # A NaN or inf would reach the loss, and through it every weight.
        return 0.0, f"prompt {prompt.id}: reward function returned {reward}"
    return reward, ""


def fill_failed_rewards(rewards: list[float], failed: list[bool], group_size: int) -> list[float]:
    """A sample whose reward failed gets the mean of its group's good rewards:
    its advantage is then zero, so it teaches nothing, and the rest of the
    group keeps its ranking (0.0 where the whole group failed)."""
    if len(failed) != len(rewards):
        raise ValueError(f"{len(rewards)} rewards but {len(failed)} failure flags")
    flat_group_indices(rewards, group_size)  # the same split check
    out = list(rewards)
    for start in range(0, len(rewards), group_size):
        good = [r for r, bad in zip(rewards[start:start + group_size], failed[start:start + group_size]) if not bad]
        fill = sum(good) / len(good) if good else 0.0
        for i in range(start, start + group_size):
            if failed[i]:
                out[i] = fill
    return out
