"""What a reward model's scores do to a rollout batch (pipeline/reward_model/):
pure Python and Arrow, tested without a model.

The reward of a sample is data.reward's (its generator scored it; 0 when the
recipe has none) plus reward_model.weight x the model's score. A sample whose
rule reward or model score failed gets its group's mean of the good ones
(pipeline/rewards/scoring.py fill_failed_rewards), as a rule reward's failure
always has.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.rewards.scoring import fill_failed_rewards


@dataclass(frozen=True)
class Scored:
    table: pa.Table              # the batch with reward, reward_error and token_rewards replaced
    failures: tuple[str, ...]    # the model's own failures (a rule reward's were logged by its generator)


def combine(rule: tuple[float, str], model: tuple[float, str], weight: float, scorer: str) -> tuple[float, str]:
    """One sample's reward: (data.reward's, why it failed) and (the model's score, why it failed) ->
    (rule + weight x score, why it failed or ""). A non-finite score or sum is a failure."""
    (r, rule_error), (score, error) = rule, model
    if rule_error:
        return 0.0, rule_error
    if error:
        return 0.0, error
    if not math.isfinite(score):
        return 0.0, f"{scorer} scored {score}"
    total = r + weight * score
    return (total, "") if math.isfinite(total) else (0.0, f"the reward {r} + {weight} x {score} is not finite")


def apply_scores(table: pa.Table, scores: list[tuple[float, str]], weight: float, group_size: int,
                 scorer: str) -> Scored:
    """`scores`: (score, why it failed or "") for each row of the batch."""
    if len(scores) != table.num_rows:
        raise ValueError(f"{len(scores)} scores for {table.num_rows} rows")
    rule_errors = table.column("reward_error").to_pylist()
    rule = zip(table.column("reward").to_pylist(), rule_errors)
    combined = [combine(r, s, weight, scorer) for r, s in zip(rule, scores)]
    failures = tuple(e for (_, e), rule_error in zip(combined, rule_errors) if e and not rule_error)
    errors = [e for _, e in combined]
    rewards = fill_failed_rewards([t for t, _ in combined], [bool(e) for e in errors], group_size)
    lengths = pc.list_value_length(table.column("response_ids")).to_pylist()
    token_rewards = [[0.0] * (n - 1) + [reward] if n else [] for n, reward in zip(lengths, rewards)]
    schema = table.schema
    for name, values in (("reward", rewards), ("reward_error", errors), ("token_rewards", token_rewards)):
        i = schema.get_field_index(name)
        table = table.set_column(i, schema.field(i), pa.array(values, type=schema.field(i).type))
    return Scored(table, failures)
