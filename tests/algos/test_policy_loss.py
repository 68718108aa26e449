"""Hand-computed checks of pipeline/algos/policy_loss.py, the loss GRPO and PPO share.

Every expected number below is derived in the comments, not by calling the
code under test.
"""
from __future__ import annotations

import math

import pytest
import torch
from tests.support.training_helpers import policy_loss


pytestmark = pytest.mark.unit

LN = math.log


def _lp(values):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_clipping_both_sides_and_gradient():
    # clip_eps 0.2, gen == old (IS weight 1). Ratios are set through lp - old = ln(ratio).
    # seq 0, A = +1, ratios [1.5, 0.5, 1.1]:
    #   1.5: max(-1.5, -1.2) = -1.2  clipped (upper side), grad 0
    #   0.5: max(-0.5, -0.8) = -0.5  unclipped,            dloss/dlp = -A*ratio/N = -0.5/5 = -0.1
    #   1.1: max(-1.1, -1.1) = -1.1  inside the band,      grad -1.1/5 = -0.22
    # seq 1, A = -1, ratios [0.5, 1.5, pad]:
    #   0.5: max(0.5, 0.8) = 0.8     clipped (lower side), grad 0
    #   1.5: max(1.5, 1.2) = 1.5     unclipped,            grad +1.5/5 = 0.3
    # N = 5 valid tokens; loss = (-1.2 - 0.5 - 1.1 + 0.8 + 1.5) / 5 = -0.5 / 5 = -0.1
    # clip_frac 2/5 = 0.4; mean ratio (1.5 + 0.5 + 1.1 + 0.5 + 1.5) / 5 = 1.02
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]])
    lp = _lp([[-1.0 + LN(1.5), -2.0 + LN(0.5), -0.5 + LN(1.1)],
              [-1.5 + LN(0.5), -0.7 + LN(1.5), 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, m = policy_loss(lp, old, old.clone(), torch.tensor([1.0, -1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.1, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.4)
    assert m["ratio"] == pytest.approx(1.02, abs=1e-6)
    assert m["is_weight"] == pytest.approx(1.0)
    assert m["kl"] == 0.0 and m["tokens"] == 5.0
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.1, -0.22], [0.0, 0.3, 0.0]]),
                               atol=1e-6, rtol=0)


def test_one_update_per_batch_is_plain_policy_gradient():
    # old = lp.detach(): ratio 1 everywhere, nothing clipped, loss = -mean(A) over tokens.
    # seq A = [2, -1], lengths [3, 1]: loss = -(2 * 3 - 1 * 1) / 4 = -1.25
    lp = _lp([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, m = policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([2.0, -1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.25)
    assert m["clip_frac"] == 0.0 and m["ratio"] == pytest.approx(1.0)


def test_importance_weight_cap():
    # lp = old (ratio 1), A = +1, is_clip 2.
    # token 0: old - gen = ln 3   -> w = min(3, 2) = 2   -> -2
    # token 1: old - gen = ln 0.5 -> w = 0.5             -> -0.5
    # loss = (-2 - 0.5) / 2 = -1.25; mean IS weight (2 + 0.5) / 2 = 1.25
    # w carries no gradient: dloss/dlp = -A * w * ratio / N = [-1, -0.25]
    old = torch.tensor([[-1.0, -2.0]])
    gen = old - torch.tensor([[LN(3.0), LN(0.5)]])
    lp = _lp([[-1.0, -2.0]])
    loss, m = policy_loss(lp, old, gen, torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2, is_clip=2.0)
    assert loss.item() == pytest.approx(-1.25, abs=1e-6)
    assert m["is_weight"] == pytest.approx(1.25, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -0.25]]), atol=1e-6, rtol=0)


def test_masked_tokens_are_ignored_even_when_not_finite():
    # The valid part is the IS-cap case above (loss -1.25); the padded column holds
    # garbage in every input and must change neither the loss nor any gradient.
    old = torch.tensor([[-1.0, -2.0, 1e4]])
    gen = torch.tensor([[-1.0 - LN(3.0), -2.0 - LN(0.5), -math.inf]])
    lp = _lp([[-1.0, -2.0, math.nan]])
    ref = torch.tensor([[-1.0, -2.0, math.inf]])
    mask = torch.tensor([[True, True, False]])
    loss, m = policy_loss(lp, old, gen, torch.tensor([1.0]), mask, clip_eps=0.2, is_clip=2.0,
                        kl_coef=0.1, ref_logprobs=ref)
    # ref == lp on the valid tokens: kl = e^0 - 0 - 1 = 0, so the loss is the IS-cap one
    assert loss.item() == pytest.approx(-1.25, abs=1e-6)
    assert m["tokens"] == 2.0 and m["kl"] == 0.0
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -0.25, 0.0]]), atol=1e-6, rtol=0)


def test_kl_k3_term():
    # A = 0, so only the KL term is left; kl_coef 0.5, d = ref - lp.
    # token 0: d = ln 2  -> e^d - d - 1 = 2 - ln 2 - 1 = 0.3068528
    # token 1: d = -ln 2 -> 0.5 + ln 2 - 1             = 0.1931472
    # mean kl = (2 - ln 2 - 1 + 0.5 + ln 2 - 1) / 2 = 0.5 / 2 = 0.25
    # loss = 0.5 * 0.25 = 0.125
    # dkl/dlp = 1 - e^d -> [1 - 2, 1 - 0.5] = [-1, 0.5]; times kl_coef / N = 0.25 -> [-0.25, 0.125]
    lp = _lp([[-1.0, -2.0]])
    ref = torch.tensor([[-1.0 + LN(2.0), -2.0 - LN(2.0)]])
    loss, m = policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([0.0]), torch.ones(1, 2),
                        clip_eps=0.2, kl_coef=0.5, ref_logprobs=ref)
    assert loss.item() == pytest.approx(0.125, abs=1e-6)
    assert m["kl"] == pytest.approx(0.25, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, 0.125]]), atol=1e-6, rtol=0)
    # kl_coef 0 ignores the reference entirely
    loss0, m0 = policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([0.0]), torch.ones(1, 2),
                          clip_eps=0.2, kl_coef=0.0, ref_logprobs=ref)
    assert loss0.item() == 0.0 and m0["kl"] == 0.0


def test_micro_batches_sum_to_batch_mean():
    # Split the plain-PG batch above (seq lengths 3 and 1, A = [2, -1], 4 tokens)
    # into one micro-batch per sequence, each divided by the batch count 4:
    # -6/4 + 1/4 = -1.25, the same as the whole batch.
    lp = _lp([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    parts = [policy_loss(lp[i:i + 1], lp[i:i + 1].detach(), lp[i:i + 1].detach(), torch.tensor([a]),
                       mask[i:i + 1], clip_eps=0.2, num_tokens=4)[0] for i, a in enumerate([2.0, -1.0])]
    assert sum(p.item() for p in parts) == pytest.approx(-1.25)


def test_per_token_advantages_in_the_policy_loss():
    # gen == old (IS weight 1), clip 0.2. Per-token A = [[1, -2, 3], [0.5, pad, pad]].
    # Ratios (lp - old = ln ratio): row 0 = [1.5, 1.5, 1.0], row 1 = [1.0]:
    #   (0,0) A  1, ratio 1.5: max(-1.5, -1.2) = -1.2 clipped,  grad 0
    #   (0,1) A -2, ratio 1.5: max( 3.0,  2.4) =  3.0 unclipped, grad -A * ratio / N = 2 * 1.5 / 4 = 0.75
    #   (0,2) A  3, ratio 1.0: -3,                               grad -3 / 4 = -0.75
    #   (1,0) A 0.5, ratio 1:  -0.5,                             grad -0.5 / 4 = -0.125
    # N = 4, loss = (-1.2 + 3.0 - 3.0 - 0.5) / 4 = -0.425; clip_frac 1/4.
    # One advantage per sequence could not clip token (0,0) and not (0,1).
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, 0.0, 0.0]])
    lp = torch.tensor([[-1.0 + LN(1.5), -2.0 + LN(1.5), -0.5], [-1.5, 0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 3.0], [0.5, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, m = policy_loss(lp, old, old.clone(), adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.425, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.25)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.75, -0.75], [-0.125, 0.0, 0.0]]),
                               atol=1e-6, rtol=0)


def test_advantages_per_sequence_or_per_token_give_the_same_bits():
    # The trainer passes GRPO's one-per-sequence advantages per token, 0 on the
    # padding; broadcasting them gives the same loss, metrics and gradient, and
    # so does any value on the padding (the masked terms are dropped, not scaled).
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]])
    gen = old - torch.tensor([[0.3, -0.2, 0.1], [0.05, 0.0, 0.0]])
    start = [[-1.0 + LN(1.5), -2.0 + LN(0.5), -0.4], [-1.5 + LN(0.9), -0.6, 0.0]]
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    per_seq = torch.tensor([0.9999980, -0.9999980])
    padded_zero = torch.tensor([[0.9999980] * 3, [-0.9999980, -0.9999980, 0.0]])
    padded_junk = torch.tensor([[0.9999980] * 3, [-0.9999980, -0.9999980, 7.0]])
    runs = []
    for adv in (per_seq, padded_zero, padded_junk):
        lp = _lp(start)
        loss, m = policy_loss(lp, old, gen, adv, mask, clip_eps=0.2, kl_coef=0.1,
                                      ref_logprobs=old, num_tokens=5)
        loss.backward()
        runs.append((loss.detach(), m, lp.grad))
    for loss, m, grad in runs[1:]:
        assert torch.equal(loss, runs[0][0]) and m == runs[0][1] and torch.equal(grad, runs[0][2])
