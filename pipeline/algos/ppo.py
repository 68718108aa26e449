"""PPO's advantages (GAE) of a trajectory table and the clipped value loss.

No engine state, so every number can be checked by hand
(tests/algos/test_algos_ppo.py). The policy loss is the one GRPO uses
(pipeline/algos/policy_loss.py), fed these per-token advantages.

Shapes: B sequences of response tokens, right-padded to T positions. Every
per-token tensor is [B, T]; `mask` marks the real tokens, which must be a
prefix of each row (right padding). Token t of a row is the action a_t taken
in state s_t = (prompt, response[:t]); V_t is the critic's value of s_t.
"""
from __future__ import annotations

import math

import pyarrow as pa
import torch
from torch import Tensor

# The critic's answer for a trajectory table, row i for row i, one float per
# response token: what the policy update reads (`advantages`) and the value
# update's targets (`returns`, around the `values` they were computed with).
ADVANTAGE_SCHEMA = pa.schema([
    ("advantages", pa.list_(pa.float32())),
    ("returns", pa.list_(pa.float32())),
    ("values", pa.list_(pa.float32())),
])


def _check_right_padded(mask: Tensor) -> Tensor:
    valid = mask.bool()
    if valid.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(valid.shape)}")
    # A hole inside a row would make "the next token" ambiguous for the recursion.
    if valid.shape[1] > 1 and (valid[:, 1:] & ~valid[:, :-1]).any():
        raise ValueError("mask must be right-padded: each row's real tokens come first")
    return valid


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float,
        lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over right-padded response tokens.

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                       (the critic's regression target)

    The episode ends after a row's last real token: V and A there are 0 (the
    terminal state has no future), whatever the padded positions of `values`
    hold. With gamma = lam = 1, A_t = sum of rewards from t on - V_t, i.e.
    R_t is the Monte-Carlo return. Padded positions get A = R = 0.
    Returns (advantages, returns), both [B, T], no gradient.
    """
    valid = _check_right_padded(mask)
    if token_rewards.shape != valid.shape or values.shape != valid.shape:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)} and values {tuple(values.shape)} "
                         f"must match mask {tuple(valid.shape)}")
    with torch.no_grad():
        zero = torch.zeros((), dtype=torch.float32, device=values.device)
        r = torch.where(valid, token_rewards.float(), zero)
        v = torch.where(valid, values.float(), zero)
        T = valid.shape[1]
        adv = torch.zeros_like(v)
        next_adv = torch.zeros_like(v[:, 0])
        next_value = torch.zeros_like(v[:, 0])
        for t in reversed(range(T)):
            # next_value / next_adv are 0 past a row's end: padded v is 0 and
            # padded adv is never written, so the terminal needs no special case.
            delta = r[:, t] + gamma * next_value - v[:, t]
            a = torch.where(valid[:, t], delta + gamma * lam * next_adv, zero)
            adv[:, t] = a
            next_adv, next_value = a, v[:, t]
        returns = torch.where(valid, adv + v, zero)
    return adv, returns


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    valid = mask.bool()
    return torch.where(valid, x.float(), torch.zeros((), device=x.device)).sum() / valid.sum().clamp(min=1)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance over the valid tokens."""
    mean = masked_mean(x, mask)
    return masked_mean((x.float() - mean) ** 2, mask)


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the valid tokens of the whole batch
    (population variance); padded positions stay 0. One batch-wide scale keeps
    the policy step size independent of the reward scale."""
    valid = mask.bool()
    mean, var = masked_mean(x, valid), masked_var(x, valid)
    out = (x.float() - mean) * torch.rsqrt(var + eps)
    return torch.where(valid, out, torch.zeros((), device=x.device))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over valid tokens: 1 is a perfect critic, 0 is
    no better than a constant, negative is worse. nan if the returns are
    constant: R = A + V carries float32 round-off (~1e-7), so a variance
    below 1e-12 is no variance, and dividing by it would report -1e16."""
    var_r = masked_var(returns, mask)
    if float(var_r) < 1e-12:
        return float("nan")
    return float(1.0 - masked_var(returns.float() - values.float(), mask) / var_r)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float,
               num_tokens: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss.

        V_clip = V_old + clamp(V - V_old, -clip, clip)
        loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)
        loss   = sum over valid tokens / number of valid tokens

    The max makes the loss pessimistic: moving V more than `clip` away from
    V_old cannot lower it, so one batch cannot drag the critic far. Where the
    clipped term wins and V is outside the band, the gradient is 0.
    `num_tokens` overrides the divisor, as in PolicyLoss: micro-batch losses
    then add up to the batch's token mean.

    Metrics (valid-token means): clip_frac = share of tokens where the clipped
    term is strictly larger, value_mean, tokens.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    v = values.float()
    old = old_values.detach().float()
    ret = returns.detach().float()
    v_clip = old + torch.clamp(v - old, -clip, clip)
    unclipped = (v - ret) ** 2
    clipped = (v_clip - ret) ** 2
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    n_valid = valid.sum()
    denom = float(num_tokens) if num_tokens is not None else n_valid.clamp(min=1)
    loss = torch.where(valid, per_token, zero).sum() / denom
    with torch.no_grad():
        n = n_valid.clamp(min=1).float()
        metrics = {
            "clip_frac": float(torch.where(valid, (clipped > unclipped).float(), zero).sum() / n),
            "value_mean": float(torch.where(valid, v, zero).sum() / n),
            "tokens": float(n_valid),
        }
    return loss, metrics


def compute_advantages(table: pa.Table, values: list[list[float]], *, gamma: float, lam: float,
                       whiten_advantages: bool) -> tuple[pa.Table, dict[str, float]]:
    """Per-token GAE for a trajectory table, from the critic's `values`.

    Rewards: each model turn's on its last token (`token_rewards`; where it is
    null, the sequence reward on the last response token). GAE runs over the
    model's tokens only (`loss_mask`): an environment's observation tokens are
    not actions, so the recursion steps from a turn's last token to the next
    turn's first, and they get advantage 0 and return = value (no loss).
    A row whose reward function or environment failed (`reward_error`; the
    generator filled in its group's mean) teaches nothing: advantages 0, and
    returns equal to the values, so the critic's loss there is 0 too.
    Returns an ADVANTAGE_SCHEMA table, row i for row i of `table`, and
    statistics over the other rows' model tokens, before whitening: adv_mean /
    adv_std, values_mean, returns_mean, explained_var (of these values against
    the returns: how well the critic predicted this batch before learning from it).
    """
    responses = table.column("response_ids").to_pylist()
    if len(values) != len(responses):
        raise ValueError(f"{len(values)} value rows for {len(responses)} trajectories")
    rewards = table.column("reward").to_pylist()
    masks = _column(table, "loss_mask", len(responses))
    token_rewards = _column(table, "token_rewards", len(responses))
    acted = []  # each row's model-token positions
    for i, (resp, vals) in enumerate(zip(responses, values)):
        if len(vals) != len(resp):
            raise ValueError(f"row {i}: {len(vals)} values for {len(resp)} response tokens")
        for name, column in (("loss_mask", masks), ("token_rewards", token_rewards)):
            if column[i] is not None and len(column[i]) != len(resp):
                raise ValueError(f"row {i}: {len(column[i])} {name} for {len(resp)} response tokens")
        acted.append([t for t in range(len(resp)) if masks[i] is None or masks[i][t]])
    width = max((len(a) for a in acted), default=0)
    mask = torch.zeros(len(responses), width, dtype=torch.bool)
    v = torch.zeros(len(responses), width)
    r = torch.zeros(len(responses), width)
    for i, positions in enumerate(acted):
        n = len(positions)
        mask[i, :n] = True
        v[i, :n] = torch.tensor([values[i][t] for t in positions], dtype=torch.float32)
        if token_rewards[i] is not None:
            r[i, :n] = torch.tensor([token_rewards[i][t] for t in positions], dtype=torch.float32)
        elif n:
            r[i, n - 1] = float(rewards[i])
    adv, ret = gae(r, v, mask, gamma=gamma, lam=lam)
    errors = table.column("reward_error").to_pylist()
    good = mask & torch.tensor([not e for e in errors], dtype=torch.bool).unsqueeze(-1)
    adv = torch.where(good, adv, torch.zeros(()))
    ret = torch.where(good, ret, v)
    stats = {"adv_mean": float(masked_mean(adv, good)), "adv_std": math.sqrt(float(masked_var(adv, good))),
             "values_mean": float(masked_mean(v, good)), "returns_mean": float(masked_mean(ret, good)),
             "explained_var": explained_variance(v, ret, good)}
    if whiten_advantages:
        adv = whiten(adv, good)
    out: dict[str, list] = {"advantages": [], "returns": [], "values": []}
    for i, (resp, positions) in enumerate(zip(responses, acted)):
        row_adv, row_ret = [0.0] * len(resp), list(values[i])
        for j, t in enumerate(positions):
            row_adv[t], row_ret[t] = float(adv[i, j]), float(ret[i, j])
        out["advantages"].append(row_adv)
        out["returns"].append(row_ret)
        out["values"].append(list(values[i]))
    return pa.table(out, schema=ADVANTAGE_SCHEMA), stats


def _column(table: pa.Table, name: str, rows: int) -> list:
    return table.column(name).to_pylist() if name in table.column_names else [None] * rows
