"""The policy loss that GRPO, its variants and PPO share.

Pure torch, no engine state, so the math can be checked by hand
(tests/algos/test_policy_loss.py, test_policy_loss_variants.py). GRPO feeds it
each sequence's outcome advantage, PPO the critic's per-token GAE advantages
(pipeline/algos/advantages.py, ppo.py).

A PolicyLoss is built once from a recipe's policy_loss section; each variant
the section names (mode, is_mode, aggregation) is one function registered
below under that name. The section's keys are checked where the recipe is
loaded (pipeline/config), not here.

Shapes: a batch of B sequences padded to T response positions. Every per-token
tensor is [B, T]; `mask` marks the real response tokens. Padded positions may
hold anything (the engine pads with 0; a generator may report -inf): they are
replaced by 0 *before* any exp(), so they can give neither NaN values nor NaN
gradients (a masked multiply after exp() would give inf * 0 = NaN).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from pipeline.algos.kl import kl_estimate
from pipeline.algos.loss_modes import clip_cov_objective, gmpo_objective, kl_cov_objective, sapo_objective

# mode -> the ratio's log (token: each token's own; sequence: GSPO's).
LOG_RATIOS: dict[str, Callable] = {}
# mode -> (pg, below, above, extra): the policy-gradient term, which tokens were clipped,
# and {metric: token mask} of the mode's own shares (dual_clip_frac, clip_cov_frac, ...).
OBJECTIVES: dict[str, Callable] = {}
# is_mode -> (is_weight, is_masked) from the raw staleness weight.
IS_WEIGHTS: dict[str, Callable] = {}
# aggregation (verl's loss_agg_mode names, so that a recipe translates) -> the batch's loss.
AGGREGATIONS: dict[str, Callable] = {}


def _registered(registry: dict[str, Callable], *names: str):
    def register(fn: Callable) -> Callable:
        registry.update(dict.fromkeys(names, fn))
        return fn
    return register


class PolicyLoss:
    """Clipped policy-gradient loss with an IS correction for stale samples and optional KL.

    `options` is a recipe's policy_loss section (pipeline.config.PolicyLossConfig;
    read by name, since the algorithms sit below the config). `horizon` is the
    longest response a sample can have, Dr. GRPO's constant normaliser.

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
    modes "sapo", "gmpo", "clip_cov", "kl_cov": verl's, pipeline/algos/loss_modes.py.
    Then        w     = exp(old - gen), no gradient: per token, or with
                        is_level "sequence" the sequence's, the geometric mean
                        of its token weights or (is_sequence_form "product")
                        their product; is_mode "truncate" caps it at is_clip,
                        "mask" drops the tokens (sequences) above it
                loss  = w * pg + kl_coef * kl - entropy_coef * entropy
    kl is each token's kl_estimator estimate (k1, k2 or k3, bounded by kl_clamp;
    pipeline/algos/kl.py, verl's kl_penalty as its actor's use_kl_loss reads it).
    The IS weight corrects for sampling from the engine's (possibly stale)
    weights rather than from `old`. It scales the policy term only: the KL term
    is an expectation under the current policy. A sequence whose weight (in
    is_sequence_form, before truncation) leaves [is_reject_low, is_reject_high]
    is rejected: its tokens' loss is 0, every term of it (verl's rollout_rs).

    Aggregation (verl's names): token-mean: sum over valid tokens / their
    count (every token weighs the same); token-sum: the sum, undivided;
    seq-mean-token-mean: each sequence's
    token mean, averaged over sequences; seq-mean-token-sum: each sequence's
    sum, averaged over sequences; seq-mean-token-sum-norm: the sum over tokens
    / (sequences x horizon).
    """

    def __init__(self, options, horizon: int):
        self.options, self.horizon = options, horizon
        self.low, self.high = options.clip_eps, options.clip_eps_high or options.clip_eps
        self.log_ratio = LOG_RATIOS[options.mode]
        self.objective = OBJECTIVES[options.mode]
        self.is_weight = IS_WEIGHTS[options.is_mode]
        self.aggregate = AGGREGATIONS[options.aggregation]

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, gen_logprobs: Tensor, advantages: Tensor,
                 mask: Tensor, *, ref_logprobs: Tensor | None = None, entropy: Tensor | None = None,
                 num_tokens: float | None = None, num_seqs: float | None = None) -> tuple[Tensor, dict[str, float]]:
        """The loss of a (micro-)batch and its metrics.

        logprobs      current policy, requires grad.
        old_logprobs  policy at the start of this train step (detached). With one
                      update per batch it equals logprobs.detach(), so the ratio is 1.
        gen_logprobs  what the generating engine reported for the sampled tokens.
        advantages    [B] (one per sequence, broadcast over its tokens) or [B, T].
        ref_logprobs  the KL reference's (read when kl_coef > 0); entropy, each
                      position's (reported when given, trained when entropy_coef > 0).
        `num_tokens` and `num_seqs` override the counts the aggregation divides
        by: a micro-batch passes the whole batch's, so the micro-batch losses add
        up to the batch's loss. Sequences without a valid token count for none.

        Metrics (means over valid tokens): clip_frac = share of tokens whose
        clipped term is the active one (their gradient is cut), split into
        clip_frac_low (ratio below the band) and clip_frac_high (above it);
        dual_clip_frac, clip_cov_frac, kl_cov_frac (the modes'); is_weight
        (after truncation or masking), is_masked_frac (is_mode mask);
        is_rejected_frac (share of sequences, with is_reject_*); kl; ratio;
        entropy (when given).
        """
        o = self.options
        valid = mask.bool()
        zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
        lp = logprobs.float()
        old = old_logprobs.detach().float()
        gen = gen_logprobs.detach().float()
        adv = advantages.detach().float()
        if adv.dim() == 1:
            adv = adv.unsqueeze(-1)
        adv = adv.expand_as(lp)
        seq_tokens = valid.sum(dim=-1, keepdim=True)

        log_ratio = self.log_ratio(torch.where(valid, lp - old, zero), valid, seq_tokens, zero)
        ratio = torch.exp(log_ratio)
        clipped_ratio = torch.clamp(ratio, 1.0 - self.low, 1.0 + self.high)
        pg, below, above, extra = self.objective(self, adv, log_ratio, ratio, clipped_ratio, lp, valid, seq_tokens,
                                                 zero)

        log_w = torch.where(valid, old - gen, zero)
        seq_log_w = log_w.sum(dim=-1, keepdim=True)
        if o.is_sequence_form == "geometric_mean":
            seq_log_w = seq_log_w / seq_tokens.clamp(min=1)
        if o.is_level == "sequence":
            log_w = torch.where(valid, seq_log_w, zero)
        is_weight, is_masked = self.is_weight(torch.exp(log_w), o.is_clip, valid, zero)
        per_token = is_weight * pg

        if o.kl_coef > 0.0 and ref_logprobs is not None:
            # Padding gets lp = ref = 0, hence a KL of 0 under every estimator (and no exp() of garbage).
            ref = torch.where(valid, ref_logprobs.detach().float(), zero)
            kl = kl_estimate(torch.where(valid, lp, zero), ref, o.kl_estimator, o.kl_clamp)
            per_token = per_token + o.kl_coef * kl
        else:
            kl = torch.zeros_like(lp)
        if entropy is not None and o.entropy_coef > 0.0:
            per_token = per_token - o.entropy_coef * torch.where(valid, entropy.float(), zero)

        rejected = self._rejected(seq_log_w) & (seq_tokens > 0)
        per_token = torch.where(rejected, zero, per_token)

        n_valid = valid.sum()
        loss = self.aggregate(torch.where(valid, per_token, zero), n_valid, seq_tokens, num_tokens, num_seqs,
                              self.horizon)

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
            metrics.update({name: mean(marks) for name, marks in extra.items()})
            if o.is_mode == "mask":
                metrics["is_masked_frac"] = mean(is_masked)
            if o.is_reject_low or o.is_reject_high:
                metrics["is_rejected_frac"] = float(rejected.sum() / (seq_tokens > 0).sum().clamp(min=1))
            if entropy is not None:
                metrics["entropy"] = mean(entropy)
        return loss, metrics

    def aggregated(self, per_token: Tensor, mask: Tensor, num_tokens: float | None = None,
                   num_seqs: float | None = None) -> Tensor:
        """A per-token loss term beside the policy's (distill.loss topk_kl), aggregated as the policy loss is."""
        valid = mask.bool()
        masked = torch.where(valid, per_token.float(), torch.zeros((), dtype=torch.float32, device=per_token.device))
        return self.aggregate(masked, valid.sum(), valid.sum(dim=-1, keepdim=True), num_tokens, num_seqs,
                              self.horizon)

    def _rejected(self, seq_log_w: Tensor) -> Tensor:
        """[B, 1]: the sequences whose IS weight leaves [is_reject_low, is_reject_high] (a bound of 0 is none)."""
        o = self.options
        out = torch.zeros_like(seq_log_w, dtype=torch.bool)
        if o.is_reject_low:
            out |= seq_log_w < math.log(o.is_reject_low)
        if o.is_reject_high:
            out |= seq_log_w > math.log(o.is_reject_high)
        return out


@_registered(LOG_RATIOS, "clip", "cispo", "gmpo", "clip_cov", "kl_cov")
def _token_log_ratio(log_ratio: Tensor, valid: Tensor, seq_tokens: Tensor, zero: Tensor) -> Tensor:
    return log_ratio


@_registered(LOG_RATIOS, "gspo")
def _sequence_log_ratio(log_ratio: Tensor, valid: Tensor, seq_tokens: Tensor, zero: Tensor) -> Tensor:
    seq_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / seq_tokens.clamp(min=1)
    # The value is the sequence's ratio on every token; the gradient is each token's own.
    return torch.where(valid, seq_log_ratio.detach() + log_ratio - log_ratio.detach(), zero)


@_registered(LOG_RATIOS, "sapo")
def _bounded_log_ratio(log_ratio: Tensor, valid: Tensor, seq_tokens: Tensor, zero: Tensor) -> Tensor:
    # verl's bound: the gate's gradient is ratio x s(1 - s), 0 x inf past exp(88).
    return log_ratio.clamp(-20.0, 20.0)


@_registered(OBJECTIVES, "clip", "gspo")
def _clipped_objective(loss: PolicyLoss, adv: Tensor, log_ratio: Tensor, ratio: Tensor, clipped_ratio: Tensor,
                       lp: Tensor, valid: Tensor, seq_tokens: Tensor, zero: Tensor):
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * clipped_ratio
    pg = torch.maximum(pg_unclipped, pg_clipped)
    cut = pg_clipped > pg_unclipped
    below, above = cut & (ratio < 1.0), cut & (ratio > 1.0)
    dual_clip = loss.options.dual_clip
    if not dual_clip:
        return pg, below, above, {}
    cap = -adv * dual_clip
    dual = (adv < 0) & (pg > cap)
    return torch.where(dual, cap, pg), below, above, {"dual_clip_frac": dual}


@_registered(OBJECTIVES, "cispo")
def _cispo_objective(loss: PolicyLoss, adv: Tensor, log_ratio: Tensor, ratio: Tensor, clipped_ratio: Tensor,
                     lp: Tensor, valid: Tensor, seq_tokens: Tensor, zero: Tensor):
    pg = -adv * clipped_ratio.detach() * torch.where(valid, lp, zero)
    return pg, ratio < 1.0 - loss.low, ratio > 1.0 + loss.high, {}


OBJECTIVES.update(sapo=sapo_objective, gmpo=gmpo_objective, clip_cov=clip_cov_objective, kl_cov=kl_cov_objective)


@_registered(IS_WEIGHTS, "truncate")
def _truncated_weight(raw_w: Tensor, is_clip: float, valid: Tensor, zero: Tensor) -> tuple[Tensor, Tensor]:
    return raw_w.clamp(max=is_clip), torch.zeros_like(valid)


@_registered(IS_WEIGHTS, "mask")
def _masked_weight(raw_w: Tensor, is_clip: float, valid: Tensor, zero: Tensor) -> tuple[Tensor, Tensor]:
    is_masked = raw_w > is_clip
    return torch.where(is_masked, zero, raw_w), is_masked


def _sequences(seq_tokens: Tensor, num_seqs: float | None):
    return float(num_seqs) if num_seqs is not None else (seq_tokens > 0).sum().clamp(min=1)


@_registered(AGGREGATIONS, "token-mean")
def _token_mean(masked: Tensor, n_valid: Tensor, seq_tokens: Tensor, num_tokens, num_seqs, horizon) -> Tensor:
    return masked.sum() / (float(num_tokens) if num_tokens is not None else n_valid.clamp(min=1))


@_registered(AGGREGATIONS, "token-sum")
def _token_sum(masked: Tensor, n_valid: Tensor, seq_tokens: Tensor, num_tokens, num_seqs, horizon) -> Tensor:
    return masked.sum()


@_registered(AGGREGATIONS, "seq-mean-token-mean")
def _seq_mean_token_mean(masked: Tensor, n_valid: Tensor, seq_tokens: Tensor, num_tokens, num_seqs,
                         horizon) -> Tensor:
    return (masked.sum(dim=-1, keepdim=True) / seq_tokens.clamp(min=1)).sum() / _sequences(seq_tokens, num_seqs)


@_registered(AGGREGATIONS, "seq-mean-token-sum")
def _seq_mean_token_sum(masked: Tensor, n_valid: Tensor, seq_tokens: Tensor, num_tokens, num_seqs,
                        horizon) -> Tensor:
    return masked.sum() / _sequences(seq_tokens, num_seqs)


@_registered(AGGREGATIONS, "seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(masked: Tensor, n_valid: Tensor, seq_tokens: Tensor, num_tokens, num_seqs,
                             horizon) -> Tensor:
    return masked.sum() / (_sequences(seq_tokens, num_seqs) * horizon)
