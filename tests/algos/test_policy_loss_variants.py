"""Hand-computed checks of the policy-loss variants of pipeline/algos/policy_loss.py:
clip-higher, dual-clip, GSPO, CISPO, sequence-level and masked IS weights, the
four aggregations and the entropy bonus, with their edge cases (single-token
responses, all-masked rows, extreme ratios).

Every expected number is derived in the comments, not by calling the code under test.
"""
from __future__ import annotations

import math
import typing

import pytest
import torch
from tests.support.training_helpers import policy_loss

from pipeline.algos.policy_loss import AGGREGATIONS, IS_WEIGHTS, LOG_RATIOS, OBJECTIVES
from pipeline.config import PolicyLossConfig


pytestmark = pytest.mark.unit

LN = math.log


def _lp(values):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_clip_higher_widens_only_the_upper_side():
    # clip_eps 0.2 below, 0.28 above. seq 0 A = +1, ratios [1.25, 1.5]; seq 1 A = -1, ratios [0.7, 1.0].
    #   1.25: inside [0.8, 1.28] -> -1.25, grad -1.25/4   (symmetric 0.2 would have clipped it)
    #   1.5 : -> -1.28, clipped high, grad 0
    #   0.7 : A < 0 -> max(0.7, 0.8) = 0.8, clipped low, grad 0
    #   1.0 : -> 1.0, grad +1/4
    # loss = (-1.25 - 1.28 + 0.8 + 1.0) / 4 = -0.1825
    old = torch.tensor([[-1.0, -2.0], [-0.5, -0.3]])
    lp = _lp([[-1.0 + LN(1.25), -2.0 + LN(1.5)], [-0.5 + LN(0.7), -0.3]])
    loss, m = policy_loss(lp, old, old.clone(), torch.tensor([1.0, -1.0]), torch.ones(2, 2),
                                  clip_eps=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-0.1825, abs=1e-6)
    assert m["clip_frac_high"] == 0.25 and m["clip_frac_low"] == 0.25 and m["clip_frac"] == 0.5
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.3125, 0.0], [0.0, 0.25]]), atol=1e-6, rtol=0)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # clip_eps 0.2, dual_clip 3. Tokens: A = -1 ratio 5 -> max(5, 1.2) = 5, capped at 3, grad 0;
    # A = -1 ratio 2 -> 2 (under the cap), grad +2/3; A = +1 ratio 5 -> max(-5, -1.2) = -1.2
    # (the cap is for A < 0 only), grad 0. loss = (3 + 2 - 1.2) / 3
    old = torch.zeros(3, 1)
    lp = _lp([[LN(5.0)], [LN(2.0)], [LN(5.0)]])
    loss, m = policy_loss(lp, old, old.clone(), torch.tensor([-1.0, -1.0, 1.0]), torch.ones(3, 1),
                                  clip_eps=0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.8 / 3, abs=1e-6)
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0], [2 / 3], [0.0]]), atol=1e-6, rtol=0)


def test_gspo_clips_the_sequence_ratio_as_one_number():
    # Log-ratios per token; GSPO's ratio is exp(mean over the sequence), on every token.
    #   seq 0 A = +1, [0.2, -0.1] -> s = e^0.05 = 1.051271, inside [0.8, 1.2]: -1.051271 per token
    #   seq 1 A = +1, [0.5, 0.5]  -> s = e^0.5 = 1.648721 > 1.2: -1.2, clipped (both tokens)
    #   seq 2 A = -1, [-0.4] (one token, one pad) -> s = e^-0.4 = 0.670320 < 0.8: max(0.67, 0.8) = 0.8, clipped
    # seq-mean-token-mean: (-1.051271 - 1.2 + 0.8) / 3 = -0.483757
    # gradient: only seq 0's tokens, each -A * s / (2 tokens x 3 sequences) = -0.175212
    old = torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-0.5, 0.0]])
    lp = _lp([[-0.8, -1.1], [-1.5, -1.5], [-0.9, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    loss, m = policy_loss(lp, old, old.clone(), torch.tensor([1.0, 1.0, -1.0]), mask, clip_eps=0.2,
                                  mode="gspo", aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-0.483757, abs=1e-5)
    assert m["clip_frac_high"] == pytest.approx(2 / 5) and m["clip_frac_low"] == pytest.approx(1 / 5)
    assert m["ratio"] == pytest.approx((2 * 1.051271 + 2 * 1.648721 + 0.670320) / 5, abs=1e-5)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.175212, -0.175212], [0.0, 0.0], [0.0, 0.0]]),
                               atol=1e-5, rtol=0)


def test_cispo_keeps_every_tokens_gradient_and_clips_its_weight():
    # clip_eps 0.2. A = +1 ratios [1.5, 1.0]; A = -1 ratio [0.5] (one pad).
    # Weights sg(clip(ratio)) = [1.2, 1.0], [0.8]; loss = sum(-A * w * lp) / 3;
    # d/dlp = -A * w / 3 = [-0.4, -1/3], [+0.8/3]: the clipped tokens keep a gradient.
    old = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    lp = _lp([[-1.0 + LN(1.5), -2.0], [-0.5 + LN(0.5), 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, m = policy_loss(lp, old, old.clone(), torch.tensor([1.0, -1.0]), mask, clip_eps=0.2,
                                  mode="cispo")
    expected = (-1.2 * (-1.0 + LN(1.5)) - 1.0 * -2.0 + 0.8 * (-0.5 + LN(0.5))) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["clip_frac_high"] == pytest.approx(1 / 3) and m["clip_frac_low"] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.4, -1 / 3], [0.8 / 3, 0.0]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("level,mode,is_clip,weights", [
    # old - gen per token [ln 1, ln 4]: token weights [1, 4], the sequence's geometric mean 2.
    ("token", "truncate", 3.0, [1.0, 3.0]),
    ("sequence", "truncate", 3.0, [2.0, 2.0]),
    ("token", "mask", 3.0, [1.0, 0.0]),       # 4 > 3: that token leaves the loss
    ("sequence", "mask", 1.5, [0.0, 0.0]),    # 2 > 1.5: the whole sequence leaves it
    ("sequence", "mask", 3.0, [2.0, 2.0]),
])
def test_is_weights_per_token_or_sequence_truncated_or_masked(level, mode, is_clip, weights):
    # ratio 1 (old = lp), A = +1: each token's loss is -w, so loss = -sum(w) / 2 and dloss/dlp = -w / 2.
    lp = _lp([[-1.0, -2.0]])
    gen = torch.tensor([[-1.0, -2.0 - LN(4.0)]])
    loss, m = policy_loss(lp, lp.detach(), gen, torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2,
                                  is_clip=is_clip, is_level=level, is_mode=mode)
    assert loss.item() == pytest.approx(-sum(weights) / 2, abs=1e-6)
    assert m["is_weight"] == pytest.approx(sum(weights) / 2, abs=1e-6)
    if mode == "mask":
        assert m["is_masked_frac"] == pytest.approx(weights.count(0.0) / 2)
    loss.backward()
    torch.testing.assert_close(lp.grad, -torch.tensor([weights]) / 2, atol=1e-6, rtol=0)


@pytest.mark.parametrize("aggregation,expected", [
    ("token-mean", (-6.0 + 1.0) / 4),                 # every token weighs the same
    ("seq-mean-token-mean", (-2.0 + 1.0) / 2),        # each sequence's mean, averaged
    ("seq-mean-token-sum", (-6.0 + 1.0) / 2),         # each sequence's sum, averaged
    ("seq-mean-token-sum-norm", (-6.0 + 1.0) / (2 * 4)),  # sum / (sequences x horizon 4)
])
def test_aggregations_and_an_all_masked_row_that_counts_for_nothing(aggregation, expected):
    # Ratio 1, A = [2, -1, 7]: token losses [-2, -2, -2] and [1]; row 2 has no trained token.
    lp = _lp([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    adv = torch.tensor([2.0, -1.0, 7.0])
    loss, _ = policy_loss(lp, lp.detach(), lp.detach(), adv, mask, clip_eps=0.2,
                                  aggregation=aggregation, horizon=4)
    assert loss.item() == pytest.approx(expected)
    # Split into micro-batches of one row with the batch's counts: the parts add up to the whole.
    parts = [policy_loss(lp[i:i + 1].detach(), lp[i:i + 1].detach(), lp[i:i + 1].detach(), adv[i:i + 1],
                                 mask[i:i + 1], clip_eps=0.2, aggregation=aggregation, horizon=4,
                                 num_tokens=4, num_seqs=2)[0].item() for i in range(3)]
    assert sum(parts) == pytest.approx(expected)


def test_entropy_bonus_is_subtracted_and_reported():
    # Ratio 1, A = 0: the policy term is 0; entropy [1.0, 3.0], coef 0.1 -> loss = -0.1 * 4 / 2 = -0.2,
    # d/d entropy = -0.1 / 2 on each token; the metric is the token mean 2.0.
    lp = _lp([[-1.0, -2.0]])
    ent = torch.tensor([[1.0, 3.0]], requires_grad=True)
    loss, m = policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([0.0]), torch.ones(1, 2),
                                  clip_eps=0.2, entropy=ent, entropy_coef=0.1)
    assert loss.item() == pytest.approx(-0.2) and m["entropy"] == pytest.approx(2.0)
    loss.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.05, -0.05]]))
    # coef 0: reported, not trained.
    _, m0 = policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([0.0]), torch.ones(1, 2),
                                clip_eps=0.2, entropy=ent.detach())
    assert m0["entropy"] == pytest.approx(2.0)


@pytest.mark.parametrize("mode", ["clip", "gspo", "cispo"])
def test_extreme_ratios_and_padding_stay_finite(mode):
    # log-ratios of +-60 (ratios e^60, e^-60), a staleness weight of e^80 and -inf in the padding.
    old = torch.tensor([[-70.0, -1.0, 0.0], [-1.0, 0.0, 0.0]])
    lp = _lp([[-10.0, -61.0, 0.0], [-1.0, 0.0, 0.0]])
    gen = torch.tensor([[-150.0, -1.0, float("-inf")], [-1.0, float("-inf"), float("-inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    for adv in (torch.tensor([1.0, -1.0]), torch.tensor([-1.0, 1.0])):
        loss, m = policy_loss(lp, old, gen, adv, mask, clip_eps=0.2, mode=mode, is_clip=2.0,
                                      dual_clip=3.0 if mode != "cispo" else 0.0)
        loss.backward()
        assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in m.values()), m
        assert torch.isfinite(lp.grad).all()
        assert m["is_weight"] <= 2.0
        lp.grad = None


def test_every_variant_a_recipe_can_name_has_its_function():
    # A recipe's names are checked where it is loaded (pipeline/config); the loss only looks them up.
    hints = typing.get_type_hints(PolicyLossConfig)
    for registry, key in ((LOG_RATIOS, "mode"), (OBJECTIVES, "mode"), (IS_WEIGHTS, "is_mode"),
                          (AGGREGATIONS, "aggregation")):
        assert set(registry) == set(typing.get_args(hints[key])), key
    assert set(typing.get_args(hints["is_level"])) == {"token", "sequence"}
