"""Hand-computed checks of the KL estimators (pipeline/algos/kl.py), the loss's
KL by estimator (policy_loss.kl_estimator, kl_clamp) and the reward's adaptive
coefficient (pipeline/algos/kl_control.py).

Every expected number is derived in the comments, not by calling the code under test.
"""
from __future__ import annotations

import math

import pytest
import torch
from tests.support.training_helpers import policy_loss

from pipeline.algos.kl import kl_estimate
from pipeline.algos.kl_control import KLController

pytestmark = pytest.mark.unit


def test_each_estimator_by_hand():
    # d = lp - ref = 0.5 and -2.
    lp, ref = torch.tensor([-1.0, -3.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), torch.tensor([0.5, -2.0]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), torch.tensor([0.125, 2.0]))
    torch.testing.assert_close(kl_estimate(lp, ref, "abs"), torch.tensor([0.5, 2.0]))
    # k3 = exp(ref - lp) - (ref - lp) - 1: exp(-0.5) + 0.5 - 1, exp(2) - 2 - 1
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"),
                               torch.tensor([math.exp(-0.5) - 0.5, math.exp(2.0) - 3.0]))
    # verl's low_var_kl: k3 bounded to [-10, 10]; d = -13 gives exp(13) - 14, far above 10
    torch.testing.assert_close(kl_estimate(torch.tensor([-14.0]), torch.tensor([-1.0]), "k3", clamp=10.0),
                               torch.tensor([10.0]))
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(lp, ref, "k4")


@pytest.mark.parametrize("estimator, value, grad", [
    # one token, lp - ref = d = ln 2, advantage 0 (only the KL term), kl_coef 0.5, token-mean.
    ("k1", math.log(2.0), 1.0),                                # d/dlp d = 1
    ("k2", 0.5 * math.log(2.0) ** 2, math.log(2.0)),           # d/dlp d^2/2 = d
    ("k3", 0.5 + math.log(2.0) - 1.0, 1.0 - 0.5)])             # exp(-d) + d - 1; grad 1 - exp(-d)
def test_the_loss_kl_by_estimator(estimator, value, grad):
    lp = torch.tensor([[math.log(0.5), 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), -7.0]])
    mask = torch.tensor([[1.0, 0.0]])   # the padded position holds a huge "KL" that must count nowhere
    loss, m = policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([0.0]), mask, ref_logprobs=ref,
                          kl_coef=0.5, kl_estimator=estimator)
    assert loss.item() == pytest.approx(0.5 * value, abs=1e-6)
    assert m["kl"] == pytest.approx(value, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.5 * grad, 0.0]]), atol=1e-6, rtol=0)


def test_the_loss_kl_clamp_cuts_value_and_gradient():
    # k1 with d = 3 and d = -0.5, clamp 1: the first is 1 (no gradient), the second -0.5 (gradient 1).
    lp = torch.tensor([[0.0, -1.5]], requires_grad=True)
    ref = torch.tensor([[-3.0, -1.0]])
    loss, m = policy_loss(lp, lp.detach(), lp.detach(), torch.tensor([0.0]), torch.ones(1, 2), ref_logprobs=ref,
                          kl_coef=1.0, kl_estimator="k1", kl_clamp=1.0)
    assert loss.item() == pytest.approx((1.0 - 0.5) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.5]]), atol=1e-6, rtol=0)


def test_adaptive_coefficient_by_hand():
    # target 0.1, horizon 100, batches of 10: error = clip(kl / 0.1 - 1, +-0.2), value *= 1 + error x 10 / 100
    ctrl = KLController(0.05, target=0.1, horizon=100.0)
    ctrl.update(0.11, 10)          # error 0.1   -> x 1.01
    assert ctrl.value == pytest.approx(0.05 * 1.01)
    ctrl.update(1.0, 10)           # error 9 -> 0.2 -> x 1.02
    assert ctrl.value == pytest.approx(0.05 * 1.01 * 1.02)
    ctrl.update(0.0, 10)           # error -1 -> -0.2 -> x 0.98
    assert ctrl.value == pytest.approx(0.05 * 1.01 * 1.02 * 0.98)
    fixed = KLController(0.05)
    fixed.update(1.0, 10)
    assert fixed.value == 0.05


def test_the_coefficient_resumes_exactly(tmp_path):
    ctrl = KLController(0.05, target=0.1, horizon=100.0)
    ctrl.update(0.3, 16)
    ctrl.save(tmp_path)
    resumed = KLController(0.05, target=0.1, horizon=100.0)
    resumed.restore(tmp_path)
    assert resumed.value == ctrl.value          # bit for bit: JSON round-trips a float exactly
    ctrl.update(0.02, 16)
    resumed.update(0.02, 16)
    assert resumed.value == ctrl.value
    fresh = KLController(0.05, target=0.1)
    fresh.restore(tmp_path / "none")            # a checkpoint without the file keeps the start
    assert fresh.value == 0.05
