"""The policy loss that GRPO, its variants and PPO share.

Pure torch, no engine state, so the math can be checked by hand
(tests/algos/test_policy_loss.py, test_policy_loss_variants.py). GRPO feeds it
each sequence's outcome advantage, PPO the critic's per-token GAE advantages
(pipeline/algos/advantages.py, ppo.py).

Shapes: a batch of B sequences padded to T response positions. Every per-token
tensor is [B, T]; `mask` marks the real response tokens. Padded positions may
hold anything (the engine pads with 0; a generator may report -inf): they are
replaced by 0 *before* any exp(), so they can give neither NaN values nor NaN
gradients (a masked multiply after exp() would give inf * 0 = NaN).
"""
from __future__ import annotations

import torch
from torch import Tensor

MODES = ("clip", "gspo", "cispo")
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
# verl's names (actor.loss_agg_mode), so that a recipe translates.
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    gen_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    kl_coef: float = 0.0,
    ref_logprobs: Tensor | None = None,
    is_clip: float = 2.0,
    num_tokens: float | None = None,
    clip_eps_high: float | None = None,
    dual_clip: float = 0.0,
    mode: str = "clip",
    is_level: str = "token",
    is_mode: str = "truncate",
    aggregation: str = "token-mean",
    num_seqs: float | None = None,
    horizon: int | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with an IS correction for stale samples and optional KL.

    logprobs      current policy, requires grad.
    old_logprobs  policy at the start of this train step (detached). With one
                  update per batch it equals logprobs.detach(), so the ratio is 1.
    gen_logprobs  what the generating engine reported for the sampled tokens.
    advantages    [B] (one per sequence, broadcast over its tokens) or [B, T].

    Per token, mode "clip" (PPO's, with DAPO's clip-higher: the band is
    [1 - clip_eps, 1 + clip_eps_high]):
                ratio = exp(lp - old)
                pg    = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high))
                pg    = min(pg, -A * dual_clip)   where A < 0 and dual_clip > 1
    mode "gspo": ratio is the sequence's, exp(mean over its tokens of lp - old),
                clipped as one number per sequence (GSPO, Zheng et al. 2025; the
                per-token form whose gradient flows through each token's lp).
    mode "cispo": pg = -A * sg(clip(ratio, 1 - eps, 1 + eps_high)) * lp: every
                token keeps a gradient, only its weight is clipped (MiniMax-M1).
    Then        w     = exp(old - gen), no gradient: per token, or with
                        is_level "sequence" the geometric mean over the sequence;
                        is_mode "truncate" caps it at is_clip, "mask" drops the
                        tokens (sequences) above it
                loss  = w * pg + kl_coef * (exp(ref - lp) - (ref - lp) - 1)
                        - entropy_coef * entropy
    The IS weight corrects for sampling from the engine's (possibly stale)
    weights rather than from `old`. It scales the policy term only: the KL term
    is an expectation under the current policy.

    Aggregation (verl's names): token-mean: sum over valid tokens / their
    count (every token weighs the same); seq-mean-token-mean: each sequence's
    token mean, averaged over sequences; seq-mean-token-sum: each sequence's
    sum, averaged over sequences; seq-mean-token-sum-norm: the sum over tokens
    / (sequences x horizon), Dr. GRPO's constant normaliser (horizon = the
    longest possible response). `num_tokens` and `num_seqs` override the
    counts: a micro-batch passes the whole batch's, so the micro-batch losses
    add up to the batch's loss. Sequences without a valid token count for none.

    Metrics (means over valid tokens): clip_frac = share of tokens whose
    clipped term is the active one (their gradient is cut), split into
    clip_frac_low (ratio below the band) and clip_frac_high (above it);
    dual_clip_frac; is_weight (after truncation or masking), is_masked_frac
    (is_mode mask); kl; ratio; entropy (when given).
    """
    _check_options(mode, is_level, is_mode, aggregation, dual_clip, horizon)
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    lp = logprobs.float()
    old = old_logprobs.detach().float()
    gen = gen_logprobs.detach().float()
    adv = advantages.detach().float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = adv.expand_as(lp)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    seq_tokens = valid.sum(dim=-1, keepdim=True)

    log_ratio = torch.where(valid, lp - old, zero)
    if mode == "gspo":
        seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / seq_tokens.clamp(min=1)
        # The value is the sequence's ratio on every token; the gradient is each token's own.
        log_ratio = torch.where(valid, seq_log_ratio.detach() + log_ratio - log_ratio.detach(), zero)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    if mode == "cispo":
        pg = -adv * clipped_ratio.detach() * torch.where(valid, lp, zero)
        below, above = ratio < 1.0 - clip_eps, ratio > 1.0 + high
        dual = torch.zeros_like(valid)
    else:
        pg_unclipped = -adv * ratio
        pg_clipped = -adv * clipped_ratio
        pg = torch.maximum(pg_unclipped, pg_clipped)
        cut = pg_clipped > pg_unclipped
        below, above = cut & (ratio < 1.0), cut & (ratio > 1.0)
        if dual_clip:
            cap = -adv * dual_clip
            dual = (adv < 0) & (pg > cap)
            pg = torch.where(dual, cap, pg)
        else:
            dual = torch.zeros_like(valid)

    log_w = torch.where(valid, old - gen, zero)
    if is_level == "sequence":
        log_w = torch.where(valid, log_w.sum(dim=-1, keepdim=True) / seq_tokens.clamp(min=1), zero)
    raw_w = torch.exp(log_w)
    if is_mode == "truncate":
        is_weight = raw_w.clamp(max=is_clip)
        is_masked = torch.zeros_like(valid)
    else:
        is_masked = raw_w > is_clip
        is_weight = torch.where(is_masked, zero, raw_w)
    per_token = is_weight * pg

    if kl_coef > 0.0 and ref_logprobs is not None:
        d = torch.where(valid, ref_logprobs.detach().float() - lp, zero)
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
    else:
        kl = torch.zeros_like(lp)
    if entropy is not None and entropy_coef > 0.0:
        per_token = per_token - entropy_coef * torch.where(valid, entropy.float(), zero)

    n_valid = valid.sum()
    masked = torch.where(valid, per_token, zero)
    if aggregation == "token-mean":
        denom = float(num_tokens) if num_tokens is not None else n_valid.clamp(min=1)
        loss = masked.sum() / denom
    else:
        seqs = float(num_seqs) if num_seqs is not None else (seq_tokens > 0).sum().clamp(min=1)
        if aggregation == "seq-mean-token-mean":
            loss = (masked.sum(dim=-1, keepdim=True) / seq_tokens.clamp(min=1)).sum() / seqs
        elif aggregation == "seq-mean-token-sum":
            loss = masked.sum() / seqs
        else:
            loss = masked.sum() / (seqs * horizon)

    with torch.no_grad():
        n = n_valid.clamp(min=1).float()

        def mean(x: Tensor) -> float:
            return float(torch.where(valid, x.float(), zero).sum() / n)

        metrics = {
            "clip_frac": mean(below | above),
            "clip_frac_low": mean(below),
            "clip_frac_high": mean(above),
            "is_weight": mean(is_weight),
            "kl": mean(kl),
            "ratio": mean(ratio),
            "tokens": float(n_valid),
        }
        if dual_clip:
            metrics["dual_clip_frac"] = mean(dual)
        if is_mode == "mask":
            metrics["is_masked_frac"] = mean(is_masked)
        if entropy is not None:
            metrics["entropy"] = mean(entropy)
    return loss, metrics


def _check_options(mode: str, is_level: str, is_mode: str, aggregation: str, dual_clip: float,
                   horizon: int | None) -> None:
    for name, value, allowed in (("mode", mode, MODES), ("is_level", is_level, IS_LEVELS),
                                 ("is_mode", is_mode, IS_MODES), ("aggregation", aggregation, AGGREGATIONS)):
        if value not in allowed:
            raise ValueError(f"policy loss {name} {value!r}: one of {', '.join(allowed)}")
    if dual_clip and (dual_clip <= 1.0 or mode == "cispo"):
        raise ValueError(f"dual_clip {dual_clip}: 0 (off) or > 1, and only with mode clip or gspo")
    if aggregation == "seq-mean-token-sum-norm" and not horizon:
        raise ValueError("aggregation seq-mean-token-sum-norm needs the horizon (the longest response)")
