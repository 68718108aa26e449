"""The policy-loss modes verl offers beside PPO's clip, GSPO and CISPO, as
objectives of pipeline/algos/policy_loss.py (which registers them under their
mode names; the signature and the masks they return are its OBJECTIVES').

Each takes the token log-ratio (lp - old, 0 on padding) and its exp(), and
returns the per-token policy term, the tokens clipped below and above the
band, and its own metrics' token masks.
"""
from __future__ import annotations

import torch
from torch import Tensor


def sapo_objective(loss, adv: Tensor, log_ratio: Tensor, ratio: Tensor, clipped_ratio: Tensor, lp: Tensor,
                   valid: Tensor, seq_tokens: Tensor, zero: Tensor):
    """SAPO (Gao et al. 2025, arXiv 2511.20347; verl's compute_policy_loss_sapo):
    pg = -A x sigmoid(tau (ratio - 1)) x 4 / tau, tau = sapo_tau_pos where A > 0,
    else sapo_tau_neg: a soft gate in place of the hard clip, whose gradient
    (ratio x A x 4 s (1 - s)) is A's at ratio 1 and fades away from it."""
    o = loss.options
    tau = torch.where(adv > 0, torch.full_like(adv, o.sapo_tau_pos), torch.full_like(adv, o.sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    none = torch.zeros_like(valid)
    return -adv * gate, none, none, {}


def gmpo_objective(loss, adv: Tensor, log_ratio: Tensor, ratio: Tensor, clipped_ratio: Tensor, lp: Tensor,
                   valid: Tensor, seq_tokens: Tensor, zero: Tensor):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673; verl's compute_policy_loss_geo_mean):
    each token's log-ratio x is clipped to [-clip_eps, clip_eps_high] in log
    space on the side its advantage's sign makes pessimistic (sign(A) x
    min(sign(A) x, sign(A) clip(x))), the sequence's ratio is the geometric
    mean exp(mean of those over its tokens), and
        pg = -mean(A over its tokens) x sequence ratio
    on every token of the sequence (aggregation seq-mean-token-mean gives verl's
    mean over sequences)."""
    n = seq_tokens.clamp(min=1)
    sign = torch.sign(adv)
    clamped = log_ratio.clamp(-loss.low, loss.high)
    pessimistic = torch.where(valid, sign * torch.minimum(sign * log_ratio, sign * clamped), zero)
    seq_ratio = torch.exp(pessimistic.sum(dim=-1, keepdim=True) / n)
    seq_adv = torch.where(valid, adv, zero).sum(dim=-1, keepdim=True) / n
    pg = torch.where(valid, -seq_adv * seq_ratio, zero)
    return pg, valid & (adv < 0) & (log_ratio < -loss.low), valid & (adv > 0) & (log_ratio > loss.high), {}


def clip_cov_objective(loss, adv: Tensor, log_ratio: Tensor, ratio: Tensor, clipped_ratio: Tensor, lp: Tensor,
                       valid: Tensor, seq_tokens: Tensor, zero: Tensor):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning
    LMs"; verl's compute_policy_loss_clip_cov): PPO's clipped term, except that
    of the tokens the band left alone whose covariance
        (A - mean A) x (lp - mean lp)      (means over the batch's valid tokens)
    lies in (clip_cov_lb, clip_cov_ub), clip_cov_ratio x (valid tokens) (at
    least one) drawn at random lose their gradient (metric clip_cov_frac)."""
    o = loss.options
    pg_unclipped, pg_clipped = -adv * ratio, -adv * clipped_ratio
    cut = (pg_clipped > pg_unclipped) & valid
    cov = _covariance(adv, lp, valid, zero)
    candidates = (valid & ~cut & (cov > o.clip_cov_lb) & (cov < o.clip_cov_ub)).flatten().nonzero().squeeze(-1)
    count = min(max(int(o.clip_cov_ratio * int(valid.sum())), 1), candidates.numel())
    chosen = candidates[torch.randperm(candidates.numel(), device=candidates.device)[:count]]
    detached = _marked(valid, chosen)
    pg = torch.where(detached, zero, torch.maximum(pg_unclipped, pg_clipped))
    return pg, cut & (ratio < 1.0), cut & (ratio > 1.0), {"clip_cov_frac": detached}


def kl_cov_objective(loss, adv: Tensor, log_ratio: Tensor, ratio: Tensor, clipped_ratio: Tensor, lp: Tensor,
                     valid: Tensor, seq_tokens: Tensor, zero: Tensor):
    """KL-Cov (Cui et al. 2025; verl's compute_policy_loss_kl_cov): the
    unclipped -A x ratio on every token, plus kl_cov_coef x |lp - old| on the
    kl_cov_ratio x (valid tokens) (at least one) whose covariance (as
    clip_cov's) is largest (metric kl_cov_frac)."""
    o = loss.options
    none = torch.zeros_like(valid)
    n_valid = int(valid.sum())
    if not n_valid:
        return -adv * ratio, none, none, {"kl_cov_frac": none}
    where_valid = valid.flatten().nonzero().squeeze(-1)
    cov = _covariance(adv, lp, valid, zero).flatten()[where_valid]
    top = where_valid[torch.topk(cov, max(1, int(n_valid * o.kl_cov_ratio))).indices]
    penalised = _marked(valid, top)
    pg = -adv * ratio + torch.where(penalised, o.kl_cov_coef * log_ratio.abs(), zero)
    return pg, none, none, {"kl_cov_frac": penalised}


def _covariance(adv: Tensor, lp: Tensor, valid: Tensor, zero: Tensor) -> Tensor:
    """Each token's (A - mean A) x (lp - mean lp), means over the valid tokens; no gradient."""
    lp = lp.detach()
    n = valid.sum().clamp(min=1)
    adv_mean = torch.where(valid, adv, zero).sum() / n
    lp_mean = torch.where(valid, lp, zero).sum() / n
    return torch.where(valid, (adv - adv_mean) * (lp - lp_mean), zero)


def _marked(valid: Tensor, flat_indices: Tensor) -> Tensor:
    marks = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    marks[flat_indices] = True
    return marks.view_as(valid)
