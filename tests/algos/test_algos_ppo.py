"""Hand-computed checks of pipeline/algos/ppo.py: GAE,
whitening, explained variance, the clipped value loss, and the advantages
table of a trajectory table (compute_advantages).

Every expected number is derived in the comments, not by calling the code under test.
"""
from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch
from tests.support.training_helpers import make_table

from pipeline.algos.ppo import (
    ADVANTAGE_SCHEMA,
    compute_advantages,
    explained_variance,
    gae,
    value_loss,
    whiten,
)
from pipeline.core.types import TRAJECTORY_SCHEMA

pytestmark = pytest.mark.unit

# ------------------------------------------------------------------ GAE by hand

def test_gae_gamma_lam_one_is_return_minus_value():
    # r = [0, 0, 1], V = [0.5, 0.2, 0.7], V after the end = 0:
    #   t=2: delta = 1 + 0 - 0.7 = 0.3,             A = 0.3
    #   t=1: delta = 0 + 0.7 - 0.2 = 0.5,           A = 0.5 + 0.3 = 0.8
    #   t=0: delta = 0 + 0.2 - 0.5 = -0.3,          A = -0.3 + 0.8 = 0.5
    # i.e. A = R - V with the Monte-Carlo return R = 1 at every token.
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.2, 0.7]]), mask,
                   gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.3]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.ones(1, 3), atol=1e-6, rtol=0)


def test_gae_gamma_and_lam_below_one_with_padding():
    # gamma 0.9, lam 0.8, gamma * lam = 0.72.
    # row A: 3 tokens, reward 2, V = [1.0, 0.5, 0.25]
    #   t=2: delta = 2 + 0.9 * 0 - 0.25 = 1.75                   A2 = 1.75
    #   t=1: delta = 0 + 0.9 * 0.25 - 0.5 = -0.275               A1 = -0.275 + 0.72 * 1.75 = 0.985
    #   t=0: delta = 0 + 0.9 * 0.5 - 1.0 = -0.55                 A0 = -0.55 + 0.72 * 0.985 = 0.1592
    #   R = A + V = [1.1592, 1.485, 2.0]
    # row B: 1 token, reward -1, V = [0.4]; its padded values (9) must not leak in:
    #   t=0 is the last token: delta = -1 + 0 - 0.4 = -1.4 = A0, R0 = -1.0; padding: A = R = 0
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    values = torch.tensor([[1.0, 0.5, 0.25], [0.4, 9.0, 9.0]])
    adv, ret = gae(torch.tensor([[0.0, 0.0, 2.0], [-1.0, 0.0, 0.0]]), values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.1592, 0.985, 1.75], [-1.4, 0.0, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[1.1592, 1.485, 2.0], [-1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_gae_lam_one_gives_discounted_returns():
    # gamma 0.9, lam 1: R_t = 0.9^(T-1-t) * 2 = [1.62, 1.8, 2.0] whatever V is;
    # A = R - V = [1.62 - 1.0, 1.8 - 0.5, 2.0 - 0.25] = [0.62, 1.3, 1.75]
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(torch.tensor([[0.0, 0.0, 2.0]]), torch.tensor([[1.0, 0.5, 0.25]]), mask,
                   gamma=0.9, lam=1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.62, 1.8, 2.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv, torch.tensor([[0.62, 1.3, 1.75]]), atol=1e-6, rtol=0)


def test_gae_lam_zero_is_one_step_td():
    # lam 0: A_t = delta_t only. r = [0, 3], V = [1, 2], gamma 0.5:
    #   A1 = 3 + 0 - 2 = 1;  A0 = 0 + 0.5 * 2 - 1 = 0
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv, _ = gae(torch.tensor([[0.0, 3.0]]), torch.tensor([[1.0, 2.0]]), mask, gamma=0.5, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 1.0]]), atol=1e-6, rtol=0)


def test_gae_refuses_a_mask_with_holes():
    with pytest.raises(ValueError, match="right-padded"):
        gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[1, 0, 1]]), gamma=1.0, lam=1.0)


def test_whiten_over_valid_tokens_only():
    # valid x = [1, 2, 3, 4]: mean 2.5, population var (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    #   -> (x - 2.5) / sqrt(1.25) = [-1.3416408, -0.4472136, 0.4472136, 1.3416408]; padding stays 0
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    expected = torch.tensor([[-1.3416408, -0.4472136, 0.4472136], [1.3416408, 0.0, 0.0]])
    torch.testing.assert_close(whiten(x, mask), expected, atol=1e-6, rtol=0)


def test_explained_variance():
    # R = [0, 2] (var 1); V = [0, 1]: R - V = [0, 1] (var 0.25) -> 1 - 0.25 = 0.75
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert explained_variance(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 2.0]]), mask) == pytest.approx(0.75)
    assert math.isnan(explained_variance(torch.zeros(1, 2), torch.ones(1, 2), mask))


# ------------------------------------------------------------ value loss by hand

def test_clipped_value_loss_and_gradient():
    # clip 0.2; per token 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = old + clamp(V - old, +-0.2)
    #   1: V 1.0, old 0.5, R 1.0: V_clip 0.7; max(0, 0.09) = 0.09 clipped   -> 0.045, grad 0
    #   2: V 0.6, old 0.5, R 0.0: inside the band; 0.36 both                -> 0.18,  grad (0.6 - 0) / 4 = 0.15
    #   3: V 0.2, old 0.5, R 1.0: V_clip 0.3; max(0.64, 0.49) unclipped     -> 0.32,  grad (0.2 - 1) / 4 = -0.2
    #   4: V 0.0, old 0.5, R 0.0: V_clip 0.3; max(0, 0.09) = 0.09 clipped   -> 0.045, grad 0
    #   5: padding (V 100): ignored
    # loss = (0.045 + 0.18 + 0.32 + 0.045) / 4 = 0.1475; clip_frac 2 / 4
    v = torch.tensor([[1.0, 0.6, 0.2], [0.0, 100.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.0]])
    ret = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, m = value_loss(v, old, ret, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.1475, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.5) and m["tokens"] == 4.0
    assert m["value_mean"] == pytest.approx((1.0 + 0.6 + 0.2 + 0.0) / 4)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, 0.15, -0.2], [0.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    # num_tokens: the divisor of a micro-batch is the whole table's token count
    half, _ = value_loss(v.detach(), old, ret, mask, clip=0.2, num_tokens=8)
    assert half.item() == pytest.approx(0.1475 / 2, abs=1e-6)


# --------------------------------------------------------------- compute_advantages

def test_compute_advantages_aligns_rows_and_whitens():
    # Two rows: lengths 2 and 1, rewards 1 and 0, values 0, gamma = lam = 1:
    #   A = R - V = [[1, 1], [0]]; returns the same; whitened: mean 2/3,
    #   population var (1/9 + 1/9 + 4/9) / 3 = 2/9 -> [0.7071068, 0.7071068], [-1.4142136]
    table = make_table(groups=1, responses=[[5, 6], [7]], rewards=[1.0, 0.0])
    raw, stats = compute_advantages(table, [[0.0, 0.0], [0.0]], gamma=1.0, lam=1.0, whiten_advantages=False)
    assert raw.schema == ADVANTAGE_SCHEMA
    assert raw.column("advantages").to_pylist() == [[1.0, 1.0], [0.0]]
    assert raw.column("returns").to_pylist() == [[1.0, 1.0], [0.0]]
    assert stats["adv_mean"] == pytest.approx(2 / 3) and stats["returns_mean"] == pytest.approx(2 / 3)
    white, _ = compute_advantages(table, [[0.0, 0.0], [0.0]], gamma=1.0, lam=1.0, whiten_advantages=True)
    got = white.column("advantages").to_pylist()
    assert got[0] == pytest.approx([0.7071068] * 2, abs=1e-5) and got[1] == pytest.approx([-1.4142136], abs=1e-5)
    with pytest.raises(ValueError, match="row 1: 2 values for 1 response tokens"):
        compute_advantages(table, [[0.0, 0.0], [0.0, 0.0]], gamma=1.0, lam=1.0, whiten_advantages=False)


def test_a_sample_whose_reward_failed_teaches_nothing():
    # Row 1's reward raised (filled with 0.5 by the generator): A = 0 and R = V
    # there, and the statistics cover row 0 only (A = R - V = 1 - 0.25 = 0.75).
    rows = make_table(groups=1, responses=[[5, 6], [7]], rewards=[1.0, 0.5]).to_pylist()
    rows[1]["reward_error"] = "prompt p0: ValueError: boom"
    table = pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)
    out, stats = compute_advantages(table, [[0.25, 0.25], [0.3]], gamma=1.0, lam=1.0, whiten_advantages=True)
    assert out.column("advantages").to_pylist()[1] == [0.0]
    assert out.column("returns").to_pylist()[1] == pytest.approx([0.3])
    assert stats["adv_mean"] == pytest.approx(0.75) and stats["returns_mean"] == pytest.approx(1.0)


def test_gae_runs_over_the_model_tokens_with_each_turn_rewarded_at_its_end():
    """Two turns of 2 model tokens around 3 observation tokens: the recursion skips
    the observation (advantage 0, return = value), and turn 1's reward enters at
    its last token."""
    row = dict(batch_id="b", target=0, version=0, prompt_id="p", prompt_ids=[1], response_ids=[5, 6, 9, 9, 9, 7, 8],
               logprobs=[0.0] * 7, text="", reward=1.5, reward_error="", loss_mask=[1, 1, 0, 0, 0, 1, 1],
               token_rewards=[0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0])
    table = pa.Table.from_pylist([row], schema=TRAJECTORY_SCHEMA)
    values = [[0.1, 0.2, 9.0, 9.0, 9.0, 0.3, 0.4]]
    out, _ = compute_advantages(table, values, gamma=1.0, lam=1.0, whiten_advantages=False)
    adv, ret = out.column("advantages").to_pylist()[0], out.column("returns").to_pylist()[0]
    # Monte-Carlo returns over the model tokens: 1.5, 1.5, then 1.0, 1.0.
    assert ret == pytest.approx([1.5, 1.5, 9.0, 9.0, 9.0, 1.0, 1.0])
    assert adv == pytest.approx([1.4, 1.3, 0.0, 0.0, 0.0, 0.7, 0.6])
