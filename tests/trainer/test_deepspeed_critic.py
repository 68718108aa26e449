"""DeepSpeedCriticEngine on a tiny random Llama: which state each value belongs
to, learning fixed returns, and exact resume under ZeRO 0 and 3.
"""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from tests.support.training_helpers import (  # noqa: F401  (model_dir is a fixture)
    continue_after_resume,
    engine_config,
    make_table,
    max_diff,
    model_dir,
)

from pipeline.algos.ppo import ADVANTAGE_SCHEMA, compute_advantages
from pipeline.trainer.deepspeed_critic import DeepSpeedCriticEngine

pytestmark = pytest.mark.real

torch.set_num_threads(1)


def critic(model_dir, *overrides):
    return DeepSpeedCriticEngine(engine_config(model_dir, "algorithm=ppo", "training.micro_batch_size=4",
                                               "ppo.critic_lr=1e-2", *overrides))


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_critic_save_state_continues_identically(model_dir, tmp_path, zero_stage):
    table = make_table(rewards=[0.0, 1.0, 1.0, 0.0, 0.5, 1.0])

    def step(e):
        targets, _ = compute_advantages(table, e.values(table), gamma=1.0, lam=0.95, whiten_advantages=True)
        return e.train_step(table, targets)

    ma, mb, wa, wb, a, b = continue_after_resume(lambda: critic(model_dir, f"training.zero_stage={zero_stage}"), step,
                                                 tmp_path)
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


@pytest.mark.parametrize("batching", ["training.max_tokens_per_micro_batch=24", "training.packing=true"])
def test_critic_values_and_step_under_a_token_budget_or_packing_match_row_micro_batches(model_dir, batching):
    # The budget runs the rows longest first, packing as one sequence; each row's values must come back in its place.
    table = make_table(responses=[[5] * n for n in (2, 12, 3, 11, 4, 10)])
    rows_engine, engine = critic(model_dir, "training.micro_batch_size=2"), critic(model_dir, batching)
    assert engine.batching.packed == (batching == "training.packing=true")
    for e in (rows_engine, engine):
        with torch.no_grad():
            torch.manual_seed(1)
            e.engine.module.value_head.weight.normal_(std=0.1)
    by_rows, other = rows_engine.values(table), engine.values(table)
    assert [len(v) for v in other] == [2, 12, 3, 11, 4, 10]
    assert max(abs(a - b) for r, q in zip(by_rows, other) for a, b in zip(r, q)) < 1e-5
    targets = pa.table({"advantages": [[0.0] * len(v) for v in by_rows], "returns": [[1.0] * len(v) for v in by_rows],
                        "values": by_rows}, schema=ADVANTAGE_SCHEMA)
    m_rows, m_other = rows_engine.train_step(table, targets), engine.train_step(table, targets)
    assert m_other["value_loss"] == pytest.approx(m_rows["value_loss"], abs=1e-6)
    assert m_other["grad_norm"] == pytest.approx(m_rows["grad_norm"], rel=1e-5)
    rows_engine.close(), engine.close()


def test_critic_learns_fixed_returns(model_dir):
    e = critic(model_dir, "ppo.critic_lr=3e-3")
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


def test_critic_epochs_are_that_many_updates_on_the_same_targets(model_dir):
    """ppo.critic_epochs 2: one train_step is two updates towards the same returns,
    clipped around the same old values, as two one-epoch steps would be."""
    table = make_table(rewards=[0.0, 1.0, 1.0, 0.0, 0.5, 1.0])
    one, two = critic(model_dir), critic(model_dir, "ppo.critic_epochs=2")
    targets, _ = compute_advantages(table, one.values(table), gamma=1.0, lam=0.95, whiten_advantages=True)
    first, second = one.train_step(table, targets), one.train_step(table, targets)
    both = two.train_step(table, targets)
    assert max_diff(one.export_weights(), two.export_weights()) == 0.0
    assert both["step"] == 2.0 and both["value_loss"] == pytest.approx((first["value_loss"] + second["value_loss"]) / 2)
    one.close(), two.close()
