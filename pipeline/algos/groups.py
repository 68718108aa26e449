"""Which prompt groups a critic-free step learns from (DAPO's dynamic sampling).

A group whose rewards are all equal has a zero advantage under every group
estimator (grpo, dr_grpo, rloo): it costs a forward and a backward and
teaches nothing. With dynamic_sampling on, the controller's sample keeps the
first schedule.prompts_per_step informative groups of the step, in launch
order, and records every other group as dropped: `flat`, or `surplus` when an
extra round brought more informative groups than the step needs.

Pure Python: the controller imports it, and the controller imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass


def flat_group_indices(rewards: list[float], group_size: int) -> list[int]:
    """The indices of the groups (consecutive runs of group_size rewards) whose rewards are all equal."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    groups = (rewards[i:i + group_size] for i in range(0, len(rewards), group_size))
    return [k for k, g in enumerate(groups) if max(g) == min(g)]


@dataclass(frozen=True)
class GroupChoice:
    keep: dict[str, tuple[int, ...]]      # batch id -> the groups trained, in the batch's order
    flat: dict[str, tuple[int, ...]]      # batch id -> the flat groups left out
    surplus: dict[str, tuple[int, ...]]   # batch id -> informative groups beyond the step's need

    @property
    def informative(self) -> int:
        return sum(map(len, self.keep.values()))


def choose_groups(batches: list[tuple[str, list[float]]], group_size: int, wanted: int) -> GroupChoice:
    """`batches`: (batch id, rewards) in launch order. Keeps the first `wanted`
    informative groups; a batch none of whose groups are kept is still listed
    (with nothing kept): it was taken, and its groups are accounted for."""
    keep, flat, surplus = {}, {}, {}
    kept = 0
    for batch_id, rewards in batches:
        flat_here = set(flat_group_indices(rewards, group_size))
        k, s = [], []
        for group in range(len(rewards) // group_size):
            if group in flat_here:
                continue
            if kept < wanted:
                k.append(group)
                kept += 1
            else:
                s.append(group)
        keep[batch_id], flat[batch_id], surplus[batch_id] = tuple(k), tuple(sorted(flat_here)), tuple(s)
    return GroupChoice(keep, flat, surplus)
