"""PPO: GAE and the value loss by hand, per-token advantages in the policy loss,
the DeepSpeed critic and policy engines (values, updates, exact resume) and
the critic actor's two nodes.

Every expected number is derived in the comments, not by calling the code under test.
"""
from __future__ import annotations

import math
import time

import pyarrow as pa
import pytest
import torch

# The GRPO engine tests' tiny model and prompt-group tables; model_dir is a fixture.
from test_deepspeed_engine import make_table, max_diff, model_dir, weights  # noqa: F401

from pipeline.actors.critic import ADVANTAGE_SCHEMA, compute_advantages
from pipeline.algos.grpo import grpo_loss
from pipeline.algos.ppo import explained_variance, gae, last_token_rewards, value_loss, whiten
from pipeline.engines.deepspeed_policy import DeepSpeedTrainingEngine
from pipeline.engines.interface import TRAJECTORY_SCHEMA
from pipeline.engines.sim import SimCriticEngine, SimTrainingEngine

torch.set_num_threads(1)
LN = math.log


# ------------------------------------------------------------------ GAE by hand

def test_last_token_rewards_sit_on_each_rows_last_real_token():
    # lengths 3, 1, 0: the empty row has no action and gets no reward anywhere
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    r = last_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert torch.equal(r, torch.tensor([[0.0, 0.0, 2.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_gae_gamma_lam_one_is_return_minus_value():
    # r = [0, 0, 1], V = [0.5, 0.2, 0.7], V after the end = 0:
    #   t=2: delta = 1 + 0 - 0.7 = 0.3,             A = 0.3
    #   t=1: delta = 0 + 0.7 - 0.2 = 0.5,           A = 0.5 + 0.3 = 0.8
    #   t=0: delta = 0 + 0.2 - 0.5 = -0.3,          A = -0.3 + 0.8 = 0.5
    # i.e. A = R - V with the Monte-Carlo return R = 1 at every token.
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(last_token_rewards(torch.tensor([1.0]), mask), torch.tensor([[0.5, 0.2, 0.7]]), mask,
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
    adv, ret = gae(last_token_rewards(torch.tensor([2.0, -1.0]), mask), values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.1592, 0.985, 1.75], [-1.4, 0.0, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[1.1592, 1.485, 2.0], [-1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_gae_lam_one_gives_discounted_returns():
    # gamma 0.9, lam 1: R_t = 0.9^(T-1-t) * 2 = [1.62, 1.8, 2.0] whatever V is;
    # A = R - V = [1.62 - 1.0, 1.8 - 0.5, 2.0 - 0.25] = [0.62, 1.3, 1.75]
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(last_token_rewards(torch.tensor([2.0]), mask), torch.tensor([[1.0, 0.5, 0.25]]), mask,
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


# ------------------------------------------------- per-token advantages in grpo_loss

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
    loss, m = grpo_loss(lp, old, old.clone(), adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.425, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(0.25)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.75, -0.75], [-0.125, 0.0, 0.0]]),
                               atol=1e-6, rtol=0)


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


def per_token(table, values_per_row) -> pa.Table:
    """An advantage table whose `advantages` column repeats one value per row."""
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    cols = [[float(v)] * n for v, n in zip(values_per_row, lengths)]
    return pa.table({"advantages": cols, "returns": cols, "values": [[0.0] * n for n in lengths]},
                    schema=ADVANTAGE_SCHEMA)


# ----------------------------------------------------------- DeepSpeed engines

def policy(model_dir, **kw):
    args = dict(zero_stage=0, dtype="fp32", micro_batch_size=4, lr=1e-3, group_size=2, seed=0)
    return DeepSpeedTrainingEngine(str(model_dir), **{**args, **kw})


def critic(model_dir, **kw):
    from pipeline.engines.deepspeed_critic import DeepSpeedCriticEngine
    args = dict(zero_stage=0, dtype="fp32", micro_batch_size=4, lr=1e-2, value_clip=0.2, seed=0)
    return DeepSpeedCriticEngine(str(model_dir), **{**args, **kw})


def test_ppo_step_with_group_advantages_per_token_equals_grpo(model_dir):
    # GRPO rewards per group [0, 1] -> group advantages -+0.5 / (0.5 + 1e-6); the
    # same numbers repeated on every token must give the same update.
    table = make_table()
    a = 0.5 / (0.5 + 1e-6)
    g, p = policy(model_dir), policy(model_dir)
    mg = g.train_step(table)
    mp = p.train_step(table, advantages=per_token(table, [-a, a] * 3))
    assert mp["loss"] == pytest.approx(mg["loss"], abs=1e-7)
    assert mp["grad_norm"] == pytest.approx(mg["grad_norm"], rel=1e-5)
    assert p.steps == 1 and max_diff(weights(g), weights(p)) < 1e-7
    g.close(), p.close()


def test_per_token_advantages_move_their_own_tokens(model_dir):
    # One response [7, 8, 9] with advantages [+1, 0, -1]: on-policy steps must raise
    # token 7's logprob and lower token 9's. A shifted alignment would move others.
    e = policy(model_dir, lr=3e-3)
    probe = make_table(groups=1, group_size=1, responses=[[7, 8, 9]], rewards=[0.0])
    adv = pa.table({"advantages": [[1.0, 0.0, -1.0]], "returns": [[0.0] * 3], "values": [[0.0] * 3]},
                   schema=ADVANTAGE_SCHEMA)
    start = e.sequence_logprobs(probe)[0]
    for _ in range(4):
        lp = e.sequence_logprobs(probe)
        table = probe.set_column(probe.schema.get_field_index("logprobs"), "logprobs",
                                 pa.array(lp, pa.list_(pa.float32())))
        e.train_step(table, advantages=adv)
    end = e.sequence_logprobs(probe)[0]
    assert end[0] > start[0] + 0.3 and end[2] < start[2] - 0.3, (start, end)
    e.close()


def test_ppo_rows_need_no_groups_but_must_align(model_dir):
    e = policy(model_dir)
    table = make_table().slice(0, 5)  # 5 rows: not groups of 2, fine for PPO
    bad = per_token(make_table(), [1.0] * 6).slice(0, 5)
    rows = bad.to_pylist()
    rows[3]["advantages"] = rows[3]["advantages"][:-1]
    with pytest.raises(ValueError, match="advantages: row 3 has"):
        e.train_step(table, advantages=pa.Table.from_pylist(rows, schema=ADVANTAGE_SCHEMA))
    with pytest.raises(ValueError, match="4 rows for a batch of 5"):
        e.train_step(table, advantages=bad.slice(0, 4))
    assert e.steps == 0
    m = e.train_step(table, advantages=bad)
    assert e.steps == 1 and math.isfinite(m["loss"])
    e.close()


def continue_after_resume(make, train, tmp_path, steps_before=2):
    """Train `steps_before` steps, save, take one more step; a fresh engine that
    loads the state must take the very same step."""
    a = make()
    for _ in range(steps_before):
        train(a)
    a.save_state(str(tmp_path / "state"))
    rng_after_save = torch.rand(4)
    ma, wa = train(a), weights(a)
    b = make()
    assert b.steps == 0
    b.load_state(str(tmp_path / "state"))
    assert b.steps == steps_before
    assert torch.equal(torch.rand(4), rng_after_save)  # the RNG came back too
    mb, wb = train(b), weights(b)
    assert b.steps == a.steps == steps_before + 1
    return ma, mb, wa, wb, a, b


def test_policy_save_state_continues_identically(model_dir, tmp_path):
    table = make_table()
    ma, mb, wa, wb, a, b = continue_after_resume(lambda: policy(model_dir), lambda e: e.train_step(table),
                                                 tmp_path)
    assert mb["loss"] == ma["loss"] and mb["grad_norm"] == ma["grad_norm"]
    assert max_diff(wa, wb) == 0.0
    with pytest.raises(FileNotFoundError, match="no engine state"):
        b.load_state(str(tmp_path / "missing"))
    a.close(), b.close()


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_critic_save_state_continues_identically(model_dir, tmp_path, zero_stage):
    table = make_table(rewards=[0.0, 1.0, 1.0, 0.0, 0.5, 1.0])

    def step(e):
        targets, _ = compute_advantages(table, e.values(table), gamma=1.0, lam=0.95, whiten_advantages=True)
        return e.train_step(table, targets)

    ma, mb, wa, wb, a, b = continue_after_resume(lambda: critic(model_dir, zero_stage=zero_stage), step, tmp_path)
    assert "value_head.weight" in wa and wa["value_head.weight"].abs().sum() > 0  # the head trained
    assert mb["value_loss"] == ma["value_loss"] and mb["grad_norm"] == ma["grad_norm"]
    assert max_diff(wa, wb) == 0.0
    assert a.values(table) == b.values(table)
    a.close(), b.close()


def test_critic_value_alignment(model_dir):
    e = critic(model_dir)
    with torch.no_grad():  # a random head: the zero init would make every value 0
        e.engine.module.value_head.weight.normal_(std=0.1)
    # Rows 0 and 1 share the prompt and the first response token, then differ.
    # V_0 is the state before token 0 (the prompt only), V_1 the state after
    # token 0: both equal across the rows. V_2 sees token 1, which differs.
    rows = make_table(groups=1, responses=[[7, 8, 9], [7, 20, 21]], rewards=[1.0, 0.0])
    v = e.values(rows)
    assert v[0][0] == pytest.approx(v[1][0], abs=1e-6) and v[0][1] == pytest.approx(v[1][1], abs=1e-6)
    assert abs(v[0][2] - v[1][2]) > 1e-4
    # Right padding and the shared window: a row's values do not depend on its batch mates.
    alone = e.values(make_table(groups=1, group_size=1, responses=[[7, 8, 9]], rewards=[1.0]))
    mixed = e.values(make_table(groups=2, responses=[[7, 8, 9], [5], [6, 6, 6, 6, 6], [4]], rewards=[0.0] * 4))
    assert mixed[0] == pytest.approx(alone[0], abs=1e-5)
    e.close()


def test_critic_learns_fixed_returns(model_dir):
    e = critic(model_dir, lr=3e-3)
    rows = make_table(groups=1, responses=[[7, 8, 9], [20, 21, 22]], rewards=[1.0, 0.0])
    losses = []
    for _ in range(10):
        targets = pa.table({"advantages": [[0.0] * 3] * 2, "returns": [[1.0] * 3, [0.0] * 3],
                            "values": e.values(rows)}, schema=ADVANTAGE_SCHEMA)
        losses.append(e.train_step(rows, targets)["value_loss"])
    # At V = 0: 0.5 * mean(R^2) = 0.5 * 3 / 6 = 0.25
    assert losses[0] == pytest.approx(0.25, abs=1e-6)
    assert losses[-1] < 0.35 * losses[0], losses  # measured: 0.25 -> 0.069 in 10 steps
    e.close()


# ---------------------------------------------------------------- sim engines

def test_sim_engines_save_and_load_state(tmp_path):
    from pipeline.io.config import SimConfig
    cfg = SimConfig(train_s=0.0)
    table = make_table()
    t = SimTrainingEngine(cfg, seed=0)
    t.train_step(table, advantages=per_token(table, [1.0] * 6))
    t.save_state(str(tmp_path / "t"))
    u = SimTrainingEngine(cfg, seed=0)
    u.load_state(str(tmp_path / "t"))
    assert u.export_weights() == t.export_weights() == {"sim_updates": 1}
    with pytest.raises(ValueError, match="advantages"):
        t.train_step(table, advantages=per_token(table, [1.0] * 6).slice(0, 5))

    c = SimCriticEngine(cfg, seed=0)
    targets, _ = compute_advantages(table, c.values(table), gamma=1.0, lam=1.0, whiten_advantages=True)
    c.train_step(table, targets)
    assert c.values(table)[0][0] > 0  # moved towards the mean return
    c.save_state(str(tmp_path / "c"))
    d = SimCriticEngine(cfg, seed=0)
    d.load_state(str(tmp_path / "c"))
    assert d.values(table) == c.values(table) and d.updates == c.updates == 1
    assert d.train_step(table, targets) == c.train_step(table, targets)


# ------------------------------------------------------------- the critic actor

@pytest.mark.parametrize("backend", ["sim", "real"])
def test_critic_worker_nodes(tmp_path, ray_session, model_dir, backend):
    from dags.tokens import Advantages, Batch, CriticOut
    from pipeline.actors.critic import CriticWorker
    from pipeline.actors.node import NodeError
    from pipeline.io.config import load_config
    ray = ray_session
    cfg = load_config(None, [f"backend={backend}", "algorithm=ppo", f"model.path={model_dir}",
                             "data.train=x", "data.reward=x", "sim.train_s=0", "ppo.gamma=1.0",
                             "ppo.lam=1.0", "ppo.whiten_advantages=false"])
    table = make_table()
    w = CriticWorker()
    w.begin_run(cfg, str(tmp_path / "run"), time.time())
    adv = w.advantages(Batch(3, ("b0",), (2,), (ray.put(table),)))
    assert isinstance(adv, Advantages) and adv.step == 3
    got = ray.get(adv.table_ref[0])
    # values start at 0 for both engines, so A = R = the row's reward on every token
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    rewards = table.column("reward").to_pylist()
    assert got.column("advantages").to_pylist() == [[r] * n for r, n in zip(rewards, lengths)]
    out = w.train(adv)
    metrics = dict(out.metrics)
    assert isinstance(out, CriticOut) and out.step == 3
    assert {"value_loss", "explained_var", "returns_mean", "values_mean"} <= metrics.keys()
    # value loss at V = 0: 0.5 * mean(R^2) over tokens; R in {0, 1} -> 0.5 * share of reward-1 tokens
    ones = sum(n for r, n in zip(rewards, lengths) if r == 1.0)
    assert metrics["value_loss"] == pytest.approx(0.5 * ones / sum(lengths), abs=1e-6)
    with pytest.raises(NodeError, match="critic_train of step 3 without its critic_values"):
        w.train(adv)
    w.save_state(str(tmp_path / "state"))
    v = CriticWorker()
    v.begin_run(cfg, str(tmp_path / "run2"), time.time(), resume_dir=str(tmp_path / "state"))
    assert v.engine.values(table) == w.engine.values(table) != [[0.0] * n for n in lengths]
    w.log.close(), v.log.close()
