"""Hand-computed checks of pipeline/algos/advantages.py: the outcome estimators
(grpo, dr_grpo, rloo, reinforce_pp) and the advantages table the trainer actor
builds from a trajectory table.

Every expected number below is derived in the comments, not by calling the
code under test.
"""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from tests.support.training_helpers import make_table, policy_loss

from pipeline.algos.advantages import (CRITIC_FREE_ADVANTAGE_SCHEMA, flat_groups, group_advantages, critic_free_advantages,
                                       kl_penalised_advantages, kl_reward_advantages, outcome_advantages)
from pipeline.core.types import TRAJECTORY_SCHEMA

pytestmark = pytest.mark.unit


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


def _lp(values):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_equal_reward_group_gives_zero_loss_and_gradient():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0]), 4)
    lp = _lp([[-1.0, -2.0]] * 4)
    loss, _ = policy_loss(lp, lp.detach(), lp.detach() - 0.3, adv, torch.ones(4, 2), clip_eps=0.2)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(lp.grad, torch.zeros(4, 2))


# ------------------------------------------------------- the other estimators

def test_dr_grpo_centres_without_dividing_by_the_std():
    # Group [1, 0, 0, 0]: mean 0.25 -> [0.75, -0.25, -0.25, -0.25]; group [3, 1]: mean 2 -> [1, -1].
    adv = outcome_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0]), 2, "dr_grpo")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 1.0, -1.0, 0.0, 0.0]))
    adv4 = outcome_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "dr_grpo")
    torch.testing.assert_close(adv4, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    # [1, 0, 0, 0]: sample 0's baseline is mean(0, 0, 0) = 0 -> 1; sample 1's is
    # mean(1, 0, 0) = 1/3 -> -1/3 (and so on); [2, 4, 9] -> 2 - 6.5, 4 - 5.5, 9 - 3.
    adv = outcome_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "rloo")
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    adv3 = outcome_advantages(torch.tensor([2.0, 4.0, 9.0]), 3, "rloo")
    torch.testing.assert_close(adv3, torch.tensor([-4.5, -1.5, 6.0]))
    with pytest.raises(ValueError, match="rloo needs groups of at least 2"):
        outcome_advantages(torch.tensor([1.0, 0.0]), 1, "rloo")


def test_reinforce_pp_normalises_over_the_whole_batch_not_the_group():
    # Rewards [1, 1, 0, 0] in groups of 2: both groups are flat (a group baseline
    # gives zeros), but the batch mean 0.5 and population std 0.5 give [1, 1, -1, -1].
    adv = outcome_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2, "reinforce_pp", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, 1.0, -1.0, -1.0]))
    # Group size 1 is allowed: the baseline is the batch's.
    adv1 = outcome_advantages(torch.tensor([3.0, 1.0]), 1, "reinforce_pp", eps=0.0)
    torch.testing.assert_close(adv1, torch.tensor([1.0, -1.0]))
    # A batch whose rewards are all equal carries no signal: exact zeros.
    assert torch.equal(outcome_advantages(torch.full((4,), 0.7), 2, "reinforce_pp"), torch.zeros(4))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_flat_group_gets_exact_zeros_under_every_group_estimator(estimator):
    # 0.1 three times: the mean is 0.1 only up to round-off; the zeros must be exact.
    adv = outcome_advantages(torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.0]), 3, estimator)
    assert torch.equal(adv[:3], torch.zeros(3)) and adv[3] > 0 > adv[4]


def test_flat_groups_are_counted_and_unknown_estimators_refused():
    assert flat_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2) == 2
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'"):
        outcome_advantages(torch.zeros(4), 2, "gae")


def test_advantages_table_uses_the_estimator_it_is_given():
    # Group [1, 0]: rloo gives 1 - 0 = 1 and 0 - 1 = -1 on every token of each row.
    table = make_table(groups=1, responses=[[5, 6], [7]], rewards=[1.0, 0.0])
    got = critic_free_advantages(table, 2, "rloo").column("advantages").to_pylist()
    assert got == [[1.0, 1.0], [-1.0]]


# ------------------------------------------------------- the advantages table

def test_advantages_table_repeats_each_rows_group_advantage_on_its_tokens():
    # Groups [1, 0] and [0, 0]: the first gives +-0.5 / (0.5 + 1e-6), the second
    # is flat and gives exact zeros. Responses of 2, 1, 3 and 1 tokens.
    table = make_table(groups=2, responses=[[5, 6], [7], [8, 8, 8], [9]], rewards=[1.0, 0.0, 0.0, 0.0])
    out = critic_free_advantages(table, 2)
    assert out.schema == CRITIC_FREE_ADVANTAGE_SCHEMA
    assert out.schema.field("advantages").type == pa.list_(pa.float32())
    a = 0.5 / (0.5 + 1e-6)
    got = out.column("advantages").to_pylist()
    assert got[0] == pytest.approx([a, a]) and got[1] == pytest.approx([-a])
    assert got[2:] == [[0.0] * 3, [0.0]]
    # Exactly group_advantages' float32 numbers, through the Arrow column and back.
    expected = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2)
    for row, adv in zip(got, expected):
        assert torch.equal(torch.tensor(row, dtype=torch.float32), adv.repeat(len(row)))


def test_advantages_table_of_no_rows_is_empty():
    assert critic_free_advantages(TRAJECTORY_SCHEMA.empty_table(), 4).num_rows == 0


def test_misordered_groups_are_rejected():
    rows = make_table().to_pylist()
    rows[1], rows[2] = rows[2], rows[1]
    with pytest.raises(ValueError, match="must be one prompt group"):
        critic_free_advantages(pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA), 2)
    with pytest.raises(ValueError, match="groups of 2"):
        critic_free_advantages(make_table().slice(0, 5), 2)
    with pytest.raises(ValueError, match="rows 0..1 must be one prompt group; found"):
        critic_free_advantages(make_table(groups=2, group_size=1), 2)  # two prompts, one sample each


def test_a_row_without_reward_is_refused():
    rows = make_table().to_pylist()
    rows[3]["reward"] = None
    with pytest.raises(ValueError, match="row 3 has no reward"):
        critic_free_advantages(pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA), 2)


# ------------------------------------------------------- REINFORCE++ with the KL in the reward

def test_kl_in_the_reward_by_hand():
    """Row A: logprobs -1, -2 against the reference's -1.5, -2 (KL 0.5, 0), reward 1;
    row B: one token, KL 0, reward 0. kl_coef 0.5: A earns -0.25, then 0 + 1, so
    its returns-to-go are 0.75, 1; B's is 0. Whitened over the three tokens."""
    table = make_table(groups=1, responses=[[5, 6], [7]], rewards=[1.0, 0.0])
    table = table.set_column(table.schema.get_field_index("logprobs"), "logprobs",
                             pa.array([[-1.0, -2.0], [-1.0]], pa.list_(pa.float32())))
    adv, kl = kl_reward_advantages(table, [[-1.5, -2.0], [-1.0]], kl_coef=0.5)
    g = np.array([0.75, 1.0, 0.0])
    want = (g - g.mean()) / (g.std() + 1e-6)
    got = adv.column("advantages").to_pylist()
    assert got[0] == pytest.approx(want[:2].tolist(), abs=1e-6) and got[1] == pytest.approx([want[2]], abs=1e-6)
    assert kl == {"reward_kl": pytest.approx(0.5 / 3), "reward_kl_sample_mean": pytest.approx((0.25 + 0.0) / 2)}


def test_kl_in_the_reward_skips_observation_tokens_and_a_flat_batch_gets_zeros():
    # A multi-turn row: its middle token is the environment's (loss_mask 0): no KL, no advantage.
    table = make_table(groups=1, responses=[[5, 6, 7], [8]], rewards=[1.0, 0.0])
    table = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                             pa.array([[1, 0, 1], [1]], pa.list_(pa.int8())))
    lp = table.column("logprobs").to_pylist()
    adv, kl = kl_reward_advantages(table, [[x - 9.0 if j == 1 else x for j, x in enumerate(row)] for row in lp], 1.0)
    got = adv.column("advantages").to_pylist()
    assert got[0][1] == 0.0 and kl["reward_kl"] == 0.0   # the observation's "KL" of 9 counts nowhere
    assert got[0][0] == got[0][2] > 0 > got[1][0]
    same, _ = kl_reward_advantages(make_table(groups=1, rewards=[1.0, 1.0]), [[-4.0] * 2, [-4.0] * 3], 0.1)
    assert all(a == 0.0 for row in same.column("advantages").to_pylist() for a in row)
    with pytest.raises(ValueError, match="row 0: 2 logprobs, 1 reference logprobs"):
        kl_reward_advantages(make_table(groups=1), [[-4.0], [-4.0] * 3], 0.1)


@pytest.mark.parametrize("estimator, per_token", [
    ("k1", lambda d: d), ("k2", lambda d: 0.5 * d * d), ("k3", lambda d: math.exp(-d) + d - 1.0),
    ("abs", lambda d: abs(d))])
def test_kl_in_the_reward_by_estimator(estimator, per_token):
    """Row A: lp - ref = -0.5, +0.25 (k1 may be negative, the others not); row B: 0. kl_coef 0.5."""
    table = make_table(groups=1, responses=[[5, 6], [7]], rewards=[1.0, 0.0])
    table = table.set_column(table.schema.get_field_index("logprobs"), "logprobs",
                             pa.array([[-1.5, -1.75], [-1.0]], pa.list_(pa.float32())))
    adv, kl = kl_reward_advantages(table, [[-1.0, -2.0], [-1.0]], kl_coef=0.5, estimator=estimator)
    k = [per_token(-0.5), per_token(0.25)]
    g = np.array([-0.5 * k[0] - 0.5 * k[1] + 1.0, -0.5 * k[1] + 1.0, 0.0])
    want = (g - g.mean()) / (g.std() + 1e-6)
    got = adv.column("advantages").to_pylist()
    assert got[0] + got[1] == pytest.approx(want.tolist(), abs=1e-5)
    assert kl["reward_kl"] == pytest.approx(sum(k) / 3, abs=1e-6)
    assert kl["reward_kl_sample_mean"] == pytest.approx((sum(k) / 2 + 0.0) / 2, abs=1e-6)


# ------------------------------------------------ the KL in the reward of the group estimators

def kl_table():
    """One group of 2: row A has logprobs -1, -2 against the reference's -1.5, -2.5
    (k1 0.5, 0.5) and an environment's token between them (mask 0, a "KL" of 9);
    row B one token at KL 0. Both rewards 1: without the KL the group is flat."""
    table = make_table(groups=1, responses=[[5, 6, 7], [8]], rewards=[1.0, 1.0])
    table = table.set_column(table.schema.get_field_index("logprobs"), "logprobs",
                             pa.array([[-1.0, -3.0, -2.0], [-1.0]], pa.list_(pa.float32())))
    table = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                             pa.array([[1, 0, 1], [1]], pa.list_(pa.int8())))
    return table, [[-1.5, 6.0, -2.5], [-1.0]]


@pytest.mark.parametrize("estimator, want", [
    # Rewards less 0.5 x the summed KL: A 1 - 0.5 x 1 = 0.5, B 1; mean 0.75.
    ("grpo", [-1.0, 1.0]),                  # deviations -+0.25 over the population std 0.25
    ("dr_grpo", [-0.25, 0.25]),
    ("rloo", [-0.5, 0.5]),                  # G / (G - 1) = 2 times the deviations
])
def test_kl_in_the_reward_of_a_group_estimator_is_its_summed_kl_off_each_reward(estimator, want):
    table, ref = kl_table()
    adv, kl = kl_penalised_advantages(table, ref, 0.5, 2, estimator)
    rows = adv.column("advantages").to_pylist()
    assert [len(r) for r in rows] == [3, 1]
    assert [r[0] for r in rows] == pytest.approx(want, abs=1e-5)
    assert len(set(rows[0])) == 1  # a sample's advantage sits on every token, as without the KL
    assert kl == {"reward_kl": pytest.approx(1.0 / 3), "reward_kl_sample_mean": pytest.approx((0.5 + 0.0) / 2)}
    flat, _ = kl_penalised_advantages(table, ref, 0.0, 2, estimator)
    assert all(a == 0.0 for row in flat.column("advantages").to_pylist() for a in row)
    rows = table.to_pylist()
    rows[1]["reward"] = None
    with pytest.raises(ValueError, match="row 1 has no reward"):
        kl_penalised_advantages(pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA), ref, 0.5, 2, estimator)


def test_kl_in_the_reward_of_reinforce_pp_is_per_token():
    table, ref = kl_table()
    got, kl = kl_penalised_advantages(table, ref, 0.5, 2, "reinforce_pp")
    want, want_kl = kl_reward_advantages(table, ref, 0.5)
    assert got.equals(want) and kl == want_kl
    assert got.column("advantages").to_pylist()[0][1] == 0.0


def test_grpo_sample_std_is_verls_and_trls():
    # Group [0, 1, 1, 1]: mean 0.75, squared deviations 0.5625 + 3 x 0.0625 = 0.75.
    # population std sqrt(0.75 / 4) = 0.4330127, sample std sqrt(0.75 / 3) = 0.5.
    # A second group is flat: zeros under both.
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    pop = math.sqrt(0.75 / 4)
    want_pop = [-0.75 / (pop + 1e-6)] + [0.25 / (pop + 1e-6)] * 3 + [0.0] * 4
    want_sample = [-0.75 / (0.5 + 1e-6)] + [0.25 / (0.5 + 1e-6)] * 3 + [0.0] * 4
    assert outcome_advantages(rewards, 4).tolist() == pytest.approx(want_pop, abs=1e-6)
    assert outcome_advantages(rewards, 4, std="sample").tolist() == pytest.approx(want_sample, abs=1e-6)
    table = make_table(groups=2, group_size=4, rewards=rewards.tolist())
    got = [row[0] for row in critic_free_advantages(table, 4, "grpo", std="sample").column("advantages").to_pylist()]
    assert got == pytest.approx(want_sample, abs=1e-6)
