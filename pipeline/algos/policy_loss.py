"""The token-level clipped policy loss that GRPO and PPO share.

Pure torch, no engine state, so the math can be checked by hand
(tests/algos/test_policy_loss.py). GRPO feeds it each sequence's group advantage,
PPO the critic's per-token GAE advantages (pipeline/algos/grpo.py, ppo.py).

Shapes: a batch of B sequences padded to T response positions. Every per-token
tensor is [B, T]; `mask` marks the real response tokens. Padded positions may
hold anything (the engine pads with 0; a generator may report -inf): they are
replaced by 0 *before* any exp(), so they can give neither NaN values nor NaN
gradients (a masked multiply after exp() would give inf * 0 = NaN).
"""
from __future__ import annotations

import torch
from torch import Tensor


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
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with a truncated IS correction and optional KL.

    logprobs      current policy, requires grad.
    old_logprobs  policy at the start of this train step (detached). With one
                  update per batch it equals logprobs.detach(), so the ratio is 1.
    gen_logprobs  what the generating engine reported for the sampled tokens.
    advantages    [B] (one per sequence, broadcast over its tokens) or [B, T].

    Per token:  ratio = exp(lp - old)
                pg    = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))
                w     = min(exp(old - gen), is_clip), no gradient
                loss  = w * pg + kl_coef * (exp(ref - lp) - (ref - lp) - 1)
    The IS weight corrects for sampling from the engine's (possibly stale)
    weights rather than from `old`; the cap bounds its variance. It scales the
    policy term only: the KL term is an expectation under the current policy.

    Aggregation: sum over valid tokens / number of valid tokens in the batch
    (every token weighs the same, whatever its sequence length). `num_tokens`
    overrides the divisor: a micro-batch passes the whole batch's count, so the
    micro-batch losses add up to the batch's token mean.

    Metrics (means over valid tokens): clip_frac = share of tokens whose
    clipped term is the active one (their gradient is cut), is_weight, kl,
    ratio.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    lp = logprobs.float()
    old = old_logprobs.detach().float()
    gen = gen_logprobs.detach().float()
    adv = advantages.detach().float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = adv.expand_as(lp)

    log_ratio = torch.where(valid, lp - old, zero)
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg = torch.maximum(pg_unclipped, pg_clipped)

    is_weight = torch.exp(torch.where(valid, old - gen, zero)).clamp(max=is_clip)
    per_token = is_weight * pg

    if kl_coef > 0.0 and ref_logprobs is not None:
        d = torch.where(valid, ref_logprobs.detach().float() - lp, zero)
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
    else:
        kl = torch.zeros_like(lp)

    n_valid = valid.sum()
    denom = float(num_tokens) if num_tokens is not None else n_valid.clamp(min=1)
    loss = torch.where(valid, per_token, zero).sum() / denom

    with torch.no_grad():
        n = n_valid.clamp(min=1).float()

        def mean(x: Tensor) -> float:
            return float(torch.where(valid, x.float(), zero).sum() / n)

        metrics = {
            "clip_frac": mean((pg_clipped > pg_unclipped).float()),
            "is_weight": mean(is_weight),
            "kl": mean(kl),
            "ratio": mean(ratio),
            "tokens": float(n_valid),
        }
    return loss, metrics
