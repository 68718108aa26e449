"""Hand-computed checks of pipeline/algos/grpo.py.

Every expected number below is derived in the comments, not by calling the
code under test.
"""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.algos.grpo import group_advantages, grpo_loss

LN = math.log


def test_group_advantages_population_std():
    # group A = [1, 0, 0, 1]: mean 0.5, deviations +-0.5, population var 0.25, std 0.5
    #   -> [1, -1, -1, 1] (times 0.5 / (0.5 + 1e-6))
    # group B = [0, 0, 0, 4]: mean 1, deviations [-1, -1, -1, 3],
    #   population var (1 + 1 + 1 + 9) / 4 = 3, std sqrt(3) = 1.7320508
    #   -> [-0.5773503, -0.5773503, -0.5773503, 1.7320508]
    #   (the unbiased std sqrt(12 / 3) = 2 would give [-0.5, -0.5, -0.5, 1.5])
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 4.0])
    adv = group_advantages(r, 4)
    s = 0.5 / (0.5 + 1e-6)
    expected = torch.tensor([s, -s, -s, s, -0.5773503, -0.5773503, -0.5773503, 1.7320508])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)


def test_group_advantages_equal_rewards_are_exact_zeros():
    # 0.1 three times: mean 0.1 up to round-off; the result must still be exactly 0,
    # and so must a group of size 1 (std 0).
    r = torch.tensor([0.1, 0.1, 0.1, 3.0, 1.0, 2.0])
    adv = group_advantages(r, 3)
    assert torch.equal(adv[:3], torch.zeros(3))
    # second group [3, 1, 2]: mean 2, deviations [1, -1, 0], var 2/3, std 0.8164966
    torch.testing.assert_close(adv[3:], torch.tensor([1.2247449, -1.2247449, 0.0]), atol=1e-5, rtol=0)
    assert torch.equal(group_advantages(torch.tensor([5.0, -2.0]), 1), torch.zeros(2))


def test_group_advantages_rejects_ragged():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)


def _lp(values, requires_grad=True):
    return torch.tensor(values, dtype=torch.float32, requires_grad=requires_grad)


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
    loss, m = grpo_loss(lp, old, old.clone(), torch.tensor([1.0, -1.0]), mask, clip_eps=0.2)
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
    loss, m = grpo_loss(lp, lp.detach(), lp.detach(), torch.tensor([2.0, -1.0]), mask, clip_eps=0.2)
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
    loss, m = grpo_loss(lp, old, gen, torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2, is_clip=2.0)
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
    loss, m = grpo_loss(lp, old, gen, torch.tensor([1.0]), mask, clip_eps=0.2, is_clip=2.0,
                        kl_coef=0.1, ref_logprobs=ref)
    # ref == lp on the valid tokens: kl = e^0 - 0 - 1 = 0, so the loss is the IS-cap one
    assert loss.item() == pytest.approx(-1.25, abs=1e-6)
    assert m["tokens"] == 2.0 and m["kl"] == 0.0
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -0.25, 0.0]]), atol=1e-6, rtol=0)


def test_equal_reward_group_gives_zero_loss_and_gradient():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0]), 4)
    lp = _lp([[-1.0, -2.0]] * 4)
    loss, _ = grpo_loss(lp, lp.detach(), lp.detach() - 0.3, adv, torch.ones(4, 2), clip_eps=0.2)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(lp.grad, torch.zeros(4, 2))


def test_kl_k3_term():
    # A = 0, so only the KL term is left; kl_coef 0.5, d = ref - lp.
    # token 0: d = ln 2  -> e^d - d - 1 = 2 - ln 2 - 1 = 0.3068528
    # token 1: d = -ln 2 -> 0.5 + ln 2 - 1             = 0.1931472
    # mean kl = (2 - ln 2 - 1 + 0.5 + ln 2 - 1) / 2 = 0.5 / 2 = 0.25
    # loss = 0.5 * 0.25 = 0.125
    # dkl/dlp = 1 - e^d -> [1 - 2, 1 - 0.5] = [-1, 0.5]; times kl_coef / N = 0.25 -> [-0.25, 0.125]
    lp = _lp([[-1.0, -2.0]])
    ref = torch.tensor([[-1.0 + LN(2.0), -2.0 - LN(2.0)]])
    loss, m = grpo_loss(lp, lp.detach(), lp.detach(), torch.tensor([0.0]), torch.ones(1, 2),
                        clip_eps=0.2, kl_coef=0.5, ref_logprobs=ref)
    assert loss.item() == pytest.approx(0.125, abs=1e-6)
    assert m["kl"] == pytest.approx(0.25, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, 0.125]]), atol=1e-6, rtol=0)
    # kl_coef 0 ignores the reference entirely
    loss0, m0 = grpo_loss(lp, lp.detach(), lp.detach(), torch.tensor([0.0]), torch.ones(1, 2),
                          clip_eps=0.2, kl_coef=0.0, ref_logprobs=ref)
    assert loss0.item() == 0.0 and m0["kl"] == 0.0


def test_micro_batches_sum_to_batch_mean():
    # Split the plain-PG batch above (seq lengths 3 and 1, A = [2, -1], 4 tokens)
    # into one micro-batch per sequence, each divided by the batch count 4:
    # -6/4 + 1/4 = -1.25, the same as the whole batch.
    lp = _lp([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    parts = [grpo_loss(lp[i:i + 1], lp[i:i + 1].detach(), lp[i:i + 1].detach(), torch.tensor([a]),
                       mask[i:i + 1], clip_eps=0.2, num_tokens=4)[0] for i, a in enumerate([2.0, -1.0])]
    assert sum(p.item() for p in parts) == pytest.approx(-1.25)
