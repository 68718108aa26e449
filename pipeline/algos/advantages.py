"""Advantages from outcome rewards, one per sample, for the graphs without a
critic: GRPO's and its variants (`algorithm` in the recipe).

  grpo          (r - group mean) / (group std + eps), the std over G samples
                (population) or G - 1 (sample: verl's, TRL's): grpo_std
  dr_grpo       r - group mean: no std division, which favours groups whose
                rewards barely differ (Dr. GRPO, Liu et al. 2025)
  rloo          r - mean of the *other* samples of the group (leave-one-out);
                = G / (G - 1) x (r - group mean)
  reinforce_pp  REINFORCE++ with outcome rewards: r normalised over the whole
                batch, (r - batch mean) / (batch std + eps); no group baseline.

With reward_kl.coef the KL to the initial policy is in the reward
(kl_penalised_advantages): per token for reinforce_pp, summed into each
sample's reward for the group estimators.

No engine state, so the math can be checked by hand (tests/algos/test_advantages.py).
The trainer actor turns a trajectory table into an advantages table here, and
the policy update reads it as it reads PPO's (pipeline/algos/policy_loss.py).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import Tensor

from pipeline.algos.groups import flat_group_indices
from pipeline.algos.kl import kl_estimate
from pipeline.algos.ppo import ADVANTAGE_SCHEMA

# The policy update reads only the advantages: PPO's column, on its own.
CRITIC_FREE_ADVANTAGE_SCHEMA = pa.schema([ADVANTAGE_SCHEMA.field("advantages")])
GROUP_KEYS = ("batch_id", "prompt_id")


ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")


def outcome_advantages(rewards: Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6,
                       std: str = "population") -> Tensor:
    """One advantage per reward by `estimator` (the module's table), for
    consecutive groups of `group_size`; `std` is grpo's (group_advantages). A
    group whose rewards are all equal gets exact zeros under every group
    estimator: it carries no signal."""
    if estimator == "grpo":
        return group_advantages(rewards, group_size, eps, std)
    _check_shape(rewards, group_size)
    r = rewards.float().view(-1, group_size)
    if estimator == "reinforce_pp":
        flat_batch = rewards.numel() < 2 or bool(r.amax() == r.amin())
        if flat_batch:
            return torch.zeros(rewards.numel())
        return ((r - r.mean()) / (r.std(unbiased=False) + eps)).view(-1)
    centred = r - r.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs groups of at least 2 samples: a sample's baseline is the others' mean")
        centred = centred * (group_size / (group_size - 1))
    elif estimator != "dr_grpo":
        raise ValueError(f"unknown advantage estimator {estimator!r}; one of {', '.join(ESTIMATORS)}")
    flat = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(centred), centred).view(-1)


def flat_groups(rewards, group_size: int) -> int:
    """Groups whose rewards (a tensor or a list) are all equal: no group estimator learns from them."""
    return len(flat_group_indices([float(r) for r in rewards], group_size))


def _check_shape(rewards: Tensor, group_size: int) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6, std: str = "population") -> Tensor:
    """(r - group mean) / (group std + eps) for consecutive groups of `group_size`.

    std "population" divides the squared deviations by G: a group is the whole
    population of samples for its prompt, and a group of 2 then gives exactly
    +-1. "sample" divides by G - 1 (verl's compute_grpo_outcome_advantage,
    torch.std; TRL's GRPOTrainer): sqrt(G / (G - 1)) larger.
    A group whose rewards are all equal carries no signal and gets exact zeros;
    computing it would give round-off / (tiny std + eps), which is not always 0.
    """
    _check_shape(rewards, group_size)
    r = rewards.float().view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    if std not in ("population", "sample"):
        raise ValueError(f"unknown std {std!r}; population or sample")
    spread = r.std(dim=1, unbiased=std == "sample", keepdim=True)
    adv = (r - mean) / (spread + eps)
    flat = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.view(-1)


def critic_free_advantages(table: pa.Table, group_size: int, estimator: str = "grpo",
                           std: str = "population") -> pa.Table:
    """Each row's advantage (outcome_advantages of the `reward` column) on
    every one of its response tokens: a CRITIC_FREE_ADVANTAGE_SCHEMA table, row i for
    row i of `table`, whose rows must be consecutive groups of `group_size`
    samples of one prompt.
    """
    if group_size < 1 or table.num_rows % group_size:
        raise ValueError(f"{table.num_rows} rows do not split into groups of {group_size}")
    rewards = table.column("reward")
    _check_rewards(rewards)
    _check_groups(table.select(list(GROUP_KEYS)).to_pylist(), group_size)
    if not table.num_rows:  # torch warns about the std of no samples
        return CRITIC_FREE_ADVANTAGE_SCHEMA.empty_table()
    adv = outcome_advantages(torch.from_numpy(rewards.to_numpy().astype(np.float32)), group_size, estimator,
                             std=std).numpy()
    # Built from offsets, not per-token Python lists: a long response costs one repeat, not a list.
    lengths = pc.fill_null(pc.list_value_length(table.column("response_ids")), 0).to_numpy()
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
    tokens = pa.ListArray.from_arrays(offsets, pa.array(np.repeat(adv, lengths), pa.float32()))
    return pa.Table.from_arrays([tokens], schema=CRITIC_FREE_ADVANTAGE_SCHEMA)


def kl_reward_advantages(table: pa.Table, ref_logprobs: list[list[float]], kl_coef: float, estimator: str = "k1",
                         eps: float = 1e-6) -> tuple[pa.Table, dict[str, float]]:
    """REINFORCE++ with the KL in the reward (verl's reinforce_plus_plus with
    use_kl_in_reward, its apply_kl_penalty): each model token t of a row earns
        r_t = -kl_coef x kl_t   (+ the row's reward on its last token)
    kl_t the `estimator`'s estimate (pipeline/algos/kl.py; verl's kl_penalty)
    from the rollout's logprob (the behaviour policy) and the reference's;
    its advantage is the return-to-go sum_{s >= t} r_s (no discount), whitened
    over every model token of the batch (loss_mask 1; the others get 0).
    Returns the CRITIC_FREE_ADVANTAGE_SCHEMA table and the batch's KL (reward_kl_metrics)."""
    rewards = table.column("reward").to_pylist()
    kls, masks = token_kls(table, ref_logprobs, estimator)
    returns = []
    for kl, reward in zip(kls, rewards):
        r = -kl_coef * kl
        if len(r):
            r[-1] += reward
        returns.append(np.cumsum(r[::-1])[::-1])
    every = np.concatenate([g[m > 0] for g, m in zip(returns, masks)]) if returns else np.zeros(0)
    if every.size < 2 or every.max() == every.min():
        scaled = [np.zeros_like(g) for g in returns]
    else:
        mean, std = every.mean(), every.std()
        scaled = [(g - mean) / (std + eps) * m for g, m in zip(returns, masks)]
    tokens = pa.array([a.astype(np.float32).tolist() for a in scaled], pa.list_(pa.float32()))
    return pa.Table.from_arrays([tokens], schema=CRITIC_FREE_ADVANTAGE_SCHEMA), reward_kl_metrics(kls, masks)


def kl_penalised_advantages(table: pa.Table, ref_logprobs: list[list[float]], kl_coef: float, group_size: int,
                            estimator: str = "grpo", kl_estimator: str = "k1",
                            std: str = "population") -> tuple[pa.Table, dict[str, float]]:
    """The KL in the reward for any critic-free `estimator` (reward_kl.coef;
    verl's use_kl_in_reward): reinforce_pp's per-token returns
    (kl_reward_advantages); the group estimators, as verl's grpo and rloo sum
    the penalised token rewards, each sample's reward less kl_coef x the sum of
    its model tokens' KL, then their outcome advantage (critic_free_advantages).
    Returns the advantages table and the batch's KL (reward_kl_metrics)."""
    if estimator == "reinforce_pp":
        return kl_reward_advantages(table, ref_logprobs, kl_coef, kl_estimator)
    _check_rewards(table.column("reward"))
    kls, masks = token_kls(table, ref_logprobs, kl_estimator)
    rewards = table.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)
    penalised = rewards - kl_coef * np.array([kl.sum() for kl in kls])
    column = table.schema.get_field_index("reward")
    shaped = table.set_column(column, table.schema.field(column), pa.array(penalised, table.schema.field(column).type))
    return critic_free_advantages(shaped, group_size, estimator, std), reward_kl_metrics(kls, masks)


def token_kls(table: pa.Table, ref_logprobs: list[list[float]], estimator: str) -> tuple[list, list]:
    """Each row's per-token KL estimate (0 where loss_mask is 0: an environment's
    tokens have no policy logprob) and its mask, as numpy arrays."""
    rows = table.select(["logprobs", "loss_mask"]).to_pylist()
    if len(ref_logprobs) != len(rows):
        raise ValueError(f"{len(ref_logprobs)} reference rows for a table of {len(rows)}")
    kls, masks = [], []
    for i, (row, ref) in enumerate(zip(rows, ref_logprobs)):
        lp = np.asarray(row["logprobs"], np.float64)
        mask = np.asarray(row["loss_mask"] or [1] * len(lp), np.float64)
        if len(ref) != len(lp) or len(mask) != len(lp):
            raise ValueError(f"row {i}: {len(lp)} logprobs, {len(ref)} reference logprobs, {len(mask)} mask values")
        kls.append(kl_estimate(torch.from_numpy(lp), torch.from_numpy(np.asarray(ref, np.float64)),
                               estimator).numpy() * mask)
        masks.append(mask)
    return kls, masks


def reward_kl_metrics(kls: list, masks: list) -> dict[str, float]:
    """reward_kl, the batch's mean KL per model token, and reward_kl_sample_mean,
    the mean over rows of each row's token mean (verl's current_kl, which its
    adaptive controller reads)."""
    model = [kl[m > 0] for kl, m in zip(kls, masks)]
    every = np.concatenate(model) if model else np.zeros(0)
    sample_means = [k.mean() for k in model if k.size]
    return {"reward_kl": float(every.mean()) if every.size else 0.0,
            "reward_kl_sample_mean": float(np.mean(sample_means)) if sample_means else 0.0}


def _check_rewards(rewards: pa.ChunkedArray) -> None:
    if rewards.null_count:
        raise ValueError(f"row {pc.index(pc.is_null(rewards), True).as_py()} has no reward")


def _check_groups(rows: list[dict], group_size: int) -> None:
    # Advantages are normalised per group of consecutive rows, so a misordered
    # table would silently mix prompts; refuse it.
    for g in range(0, len(rows), group_size):
        head = rows[g]
        for row in rows[g + 1:g + group_size]:
            if tuple(row[k] for k in GROUP_KEYS) != tuple(head[k] for k in GROUP_KEYS):
                raise ValueError(f"rows {g}..{g + group_size - 1} must be one prompt group; found "
                                 f"{(head['batch_id'], head['prompt_id'])} and "
                                 f"{(row['batch_id'], row['prompt_id'])}")
