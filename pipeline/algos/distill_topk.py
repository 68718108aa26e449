"""On-policy distillation's top-k loss term (distill.loss topk_kl).

At each model token's position the teacher gives its k likeliest token ids S
and their logprobs log p_i over the whole vocabulary, at the sampling
temperature (pipeline/distill/forward.py); the student's log q_i are its own
log-softmax at the same ids, with a gradient. Every other token is one more
outcome, the tail, with mass p_tail = 1 - sum_S p_i and q_tail = 1 - sum_S q_i,
so both distributions are over k + 1 outcomes and nothing is renormalised:

    forward[t] = sum_S p_i (log p_i - log q_i) + p_tail (log p_tail - log q_tail)
    reverse[t] = sum_S q_i (log q_i - log p_i) + q_tail (log q_tail - log p_tail)
    mixed[t]   = w x forward[t] + (1 - w) x reverse[t]          (w: distill.mixed_kl_weight)

Both are at most the full-vocabulary KL (lumping the tail into one outcome
loses only its shape) and equal to it when k is the vocabulary. The tail is
kept, not renormalised away as NeMo-RL's default (zero_outside_topk false) does,
because a fresh student spreads nearly all of its mass outside the teacher's
top-k, and a renormalised KL cannot see that mass. Tail masses are floored at
TAIL_FLOOR so that a teacher (or a converged student) with no tail gives 0 x
log 0 = 0, not NaN.

No engine state, so the math can be checked by hand (tests/algos/test_distill_topk.py).
"""
from __future__ import annotations

import torch
from torch import Tensor

TAIL_FLOOR = 1e-8


def _with_tail(logprobs: Tensor) -> Tensor:
    """[..., k] full-vocabulary logprobs -> [..., k + 1] with the tail's log-mass last."""
    tail = (1.0 - logprobs.exp().sum(dim=-1, keepdim=True)).clamp(min=TAIL_FLOOR)
    return torch.cat([logprobs, tail.log()], dim=-1)


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """KL(a || b) over the last dimension, both given as logs."""
    return (log_a.exp() * (log_a - log_b)).sum(dim=-1)


def topk_kl(student: Tensor, teacher: Tensor, mask: Tensor, kl_type: str = "forward",
            mixed_weight: float = 0.5) -> Tensor:
    """Per position [...]: the KL of the module docstring, 0 where `mask` is false.

    student  [..., k] the student's logprobs at the teacher's top-k ids (with a gradient);
    teacher  [..., k] the teacher's logprobs there; mask [...] the positions that count.
    """
    valid = mask.bool().unsqueeze(-1)
    s = student.float()
    # Padding gets the student's own values as the teacher's: a KL of 0 and finite gradients.
    t = torch.where(valid, teacher.detach().float(), s.detach())
    s_full, t_full = _with_tail(s), _with_tail(t)
    if kl_type == "forward":
        kl = _kl(t_full, s_full)
    elif kl_type == "reverse":
        kl = _kl(s_full, t_full)
    elif kl_type == "mixed":
        kl = mixed_weight * _kl(t_full, s_full) + (1.0 - mixed_weight) * _kl(s_full, t_full)
    else:
        raise ValueError(f"unknown kl_type {kl_type!r}: forward, reverse or mixed")
    return torch.where(mask.bool(), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
