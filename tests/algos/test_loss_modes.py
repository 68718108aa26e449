"""Hand-computed checks of verl's policy-loss modes (pipeline/algos/loss_modes.py:
sapo, gmpo, clip_cov, kl_cov), the token-sum aggregation, the product form of
the sequence IS weight and IS rejection (pipeline/algos/policy_loss.py).

Every expected number is derived in the comments, not by calling the code under test.
"""
from __future__ import annotations

import math

import pytest
import torch
from tests.support.training_helpers import policy_loss

pytestmark = pytest.mark.unit

LN = math.log


def _sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_sapo_gates_the_ratio_softly():
    # seq 0: A = +1, ratio 1.5, tau_pos 1:     gate = sigmoid(0.5) x 4,          pg = -gate
    # seq 1: A = -1, ratio 0.5, tau_neg 1.05:  gate = sigmoid(-0.525) x 4 / 1.05, pg = +gate
    # d pg / d lp = -A x 4 s (1 - s) x ratio (the tau cancels); token-mean over 2 tokens.
    old = torch.zeros(2, 1)
    lp = torch.tensor([[LN(1.5)], [LN(0.5)]], requires_grad=True)
    loss, m = policy_loss(lp, old, old.clone(), torch.tensor([1.0, -1.0]), torch.ones(2, 1), mode="sapo")
    s0, s1 = _sig(0.5), _sig(-0.525)
    assert loss.item() == pytest.approx((-4 * s0 + 4 * s1 / 1.05) / 2, abs=1e-6)
    assert m["clip_frac"] == 0.0
    loss.backward()
    want = [[-4 * s0 * (1 - s0) * 1.5 / 2], [4 * s1 * (1 - s1) * 0.5 / 2]]
    torch.testing.assert_close(lp.grad, torch.tensor(want), atol=1e-6, rtol=0)


def test_gmpo_clips_in_log_space_then_takes_the_geometric_mean():
    # clip_eps 0.4 both sides, in log space.
    # seq 0, A = +1, log-ratios [0.6, -0.6]: min(x, clip(x)) = [0.4, -0.6] -> ratio exp(-0.1), pg = -exp(-0.1)
    # seq 1, A = -1, log-ratio [-0.6, pad]: -min(0.6, 0.4) = -0.4 -> ratio exp(-0.4), pg = +exp(-0.4)
    # seq-mean-token-mean: (-exp(-0.1) + exp(-0.4)) / 2.
    # grad: seq 0's second token only, -exp(-0.1) x 1/2 (its mean) x 1/2 (sequences); clipped ones 0.
    old = torch.zeros(2, 2)
    lp = torch.tensor([[0.6, -0.6], [-0.6, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, m = policy_loss(lp, old, old.clone(), torch.tensor([1.0, -1.0]), mask, mode="gmpo", clip_eps=0.4,
                          aggregation="seq-mean-token-mean", is_level="sequence")
    assert loss.item() == pytest.approx((-math.exp(-0.1) + math.exp(-0.4)) / 2, abs=1e-6)
    assert m["clip_frac_high"] == pytest.approx(1 / 3) and m["clip_frac_low"] == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -math.exp(-0.1) / 4], [0.0, 0.0]]), atol=1e-6, rtol=0)


# One row of four tokens, per-token advantages [2, -2, 0, 0], logprobs [-1, -3, -2, -2]:
# mean A 0, mean lp -2, covariance (A - 0)(lp + 2) = [2, 2, 0, 0].
COV_ADV = torch.tensor([[2.0, -2.0, 0.0, 0.0]])
COV_LP = [[-1.0, -3.0, -2.0, -2.0]]


@pytest.mark.parametrize("ratio0, options, detached, clip_high", [
    (1.0, dict(clip_cov_ratio=1.0), [0, 1], 0.0),                  # both in (1, 5): both detached
    (1.5, dict(clip_cov_ratio=1.0), [1], 0.25),                    # token 0 clipped by the band: not a candidate
    (1.0, dict(clip_cov_ratio=1.0, clip_cov_ub=1.5), [], 0.0),     # covariance 2 above the bound: none
])
def test_clip_cov_detaches_the_high_covariance_tokens(ratio0, options, detached, clip_high):
    # Undetached, token 0: -2 x ratio0 (clipped at 1.2 when 1.5, gradient 0), token 1: +2 x 1.
    lp = torch.tensor(COV_LP, requires_grad=True)
    old = lp.detach() - torch.tensor([[LN(ratio0), 0.0, 0.0, 0.0]])
    loss, m = policy_loss(lp, old, old.clone(), COV_ADV, torch.ones(1, 4), mode="clip_cov", **options)
    terms = [-2.0 * min(ratio0, 1.2), 2.0, 0.0, 0.0]
    assert loss.item() == pytest.approx(sum(t for i, t in enumerate(terms) if i not in detached) / 4, abs=1e-6)
    assert m["clip_cov_frac"] == len(detached) / 4 and m["clip_frac_high"] == clip_high
    loss.backward()
    grads = [-2.0 * ratio0 * (ratio0 < 1.2) / 4, 2.0 / 4, 0.0, 0.0]
    want = [[0.0 if i in detached else g for i, g in enumerate(grads)]]
    torch.testing.assert_close(lp.grad, torch.tensor(want), atol=1e-6, rtol=0)


def test_clip_cov_draws_its_share_of_the_candidates():
    # clip_cov_ratio 0.25 of 4 tokens: one of the two candidates, either.
    lp = torch.tensor(COV_LP, requires_grad=True)
    loss, m = policy_loss(lp, lp.detach(), lp.detach(), COV_ADV, torch.ones(1, 4), mode="clip_cov",
                          clip_cov_ratio=0.25)
    assert m["clip_cov_frac"] == 0.25
    loss.backward()
    assert sorted(lp.grad[0, :2].tolist()) in ([-0.5, 0.0], [0.0, 0.5])


def test_kl_cov_penalises_the_top_covariance_token_and_clips_nothing():
    # A [2, -2, 1, 0], lp [-1, -3, -2, -2]: mean A 0.25, mean lp -2,
    # covariance [1.75 x 1, -2.25 x -1, 0, 0] = [1.75, 2.25, 0, 0]; ratio 0.25 -> the top 1: token 1.
    # Ratios [2, 2, 1, 1]: pg = -A x ratio = [-4, 4, -1, 0] (no clip: -4, not -2.4), token 1 + 0.1 x ln 2.
    adv = torch.tensor([[2.0, -2.0, 1.0, 0.0]])
    lp = torch.tensor(COV_LP, requires_grad=True)
    old = lp.detach() - torch.tensor([[LN(2.0), LN(2.0), 0.0, 0.0]])
    loss, m = policy_loss(lp, old, old.clone(), adv, torch.ones(1, 4), mode="kl_cov", kl_cov_ratio=0.25)
    assert loss.item() == pytest.approx((-4 + 4 + 0.1 * LN(2.0) - 1 + 0) / 4, abs=1e-6)
    assert m["kl_cov_frac"] == 0.25 and m["clip_frac"] == 0.0
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-4 / 4, (4 + 0.1) / 4, -1 / 4, 0.0]]), atol=1e-6, rtol=0)


def test_token_sum_is_the_undivided_sum():
    # A = [1, -1], ratio 1, three valid tokens: pg = [-1, -1 | +1, pad] -> sum -1; grads -A each.
    lp = torch.zeros(2, 2, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([1.0, -1.0]), mask, aggregation="token-sum",
                          num_tokens=99)
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, -1.0], [1.0, 0.0]]))


@pytest.mark.parametrize("token_weights, form, weight", [
    ([1.5, 1.2], "product", 1.8),
    ([1.5, 1.2], "geometric_mean", math.sqrt(1.8)),
    ([1.5, 1.5], "product", 2.0),                    # 2.25 truncated at is_clip 2
])
def test_the_sequence_weight_as_product_or_geometric_mean(token_weights, form, weight):
    # A = 1, ratio 1: pg = -1 on both tokens, times the sequence's weight; token-mean.
    lp = torch.zeros(1, 2, requires_grad=True)
    gen = -torch.tensor([[LN(w) for w in token_weights]])
    loss, m = policy_loss(lp, lp.detach(), gen, torch.tensor([1.0]), torch.ones(1, 2), is_level="sequence",
                          is_sequence_form=form, is_clip=2.0)
    assert loss.item() == pytest.approx(-weight, abs=1e-6)
    assert m["is_weight"] == pytest.approx(weight, abs=1e-6)


def test_rejected_sequences_leave_every_term_of_the_loss():
    # Three one-token sequences, A = 1, ratio 1, IS weights 0.2, 1, 5 (is_level token); bounds [0.5, 3]:
    # sequences 0 and 2 leave. Sequence 0's reference makes a k1 KL of 1, which must leave with it.
    # A fourth sequence of two tokens with weights 1.5, 1.5: product 2.25 (kept, < 3).
    # token-mean over 5 tokens: (0 + -1 + 0 + -1.5 - 1.5) / 5.
    lp = torch.zeros(4, 2, requires_grad=True)
    gen = -torch.tensor([[LN(0.2), 0.0], [0.0, 0.0], [LN(5.0), 0.0], [LN(1.5), LN(1.5)]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    ref = torch.tensor([[-1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    loss, m = policy_loss(lp, lp.detach(), gen, torch.ones(4), mask, ref_logprobs=ref, kl_coef=0.5,
                          kl_estimator="k1", is_clip=10.0, is_reject_low=0.5, is_reject_high=3.0,
                          is_sequence_form="product")
    assert loss.item() == pytest.approx(-4.0 / 5, abs=1e-6)
    assert m["is_rejected_frac"] == pytest.approx(2 / 4)
    loss.backward()
    # A kept token's gradient: -weight / 5 from the policy term, + 0.5 / 5 from k1's (d/dlp of lp - ref is 1).
    kept = [[0.0, 0.0], [-1 + 0.5, 0.0], [0.0, 0.0], [-1.5 + 0.5, -1.5 + 0.5]]
    torch.testing.assert_close(lp.grad, torch.tensor(kept) / 5, atol=1e-6, rtol=0)
