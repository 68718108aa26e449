"""Per-token estimates of KL(policy || reference) from the two logprobs of the
sampled token (J. Schulman, "Approximating KL divergence", 2020; verl's
core_algos.kl_penalty_forward, whose names are accepted beside these):

  k1   lp - ref                       unbiased, high variance, may be negative
  k2   (lp - ref)^2 / 2               verl's "mse"; biased, never negative
  k3   exp(ref - lp) - (ref - lp) - 1 verl's "low_var_kl", TRL's GRPO KL; unbiased, never negative
  abs  |lp - ref|                     (a reward's KL only, as verl allows)

`clamp` c > 0 bounds each estimate to [-c, c]: verl's low_var_kl is k3 with c = 10.
"""
from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, clamp: float = 0.0) -> Tensor:
    """Each token's KL estimate by `estimator` (the module's table); gradients flow through `logprobs`."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d.square()
    elif estimator == "k3":
        kl = torch.exp(-d) + d - 1.0
    elif estimator == "abs":
        kl = d.abs()
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; one of {', '.join(KL_ESTIMATORS)}")
    return kl.clamp(-clamp, clamp) if clamp > 0 else kl
