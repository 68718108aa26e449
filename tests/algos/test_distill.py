"""On-policy distillation's advantage (pipeline/algos/distill.py), by hand:
A_distill = -(student logprob - teacher logprob) per model token, clipped,
mixed as A_task + coef x A_distill."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.algos.distill import distill_advantages, mix_distillation
from pipeline.algos.ppo import ADVANTAGE_SCHEMA
from pipeline.core.types import TRAJECTORY_SCHEMA

pytestmark = pytest.mark.unit


def table(rows: list[tuple[list[float], list[float] | None, list[int] | None]]) -> pa.Table:
    """(student logprobs, teacher logprobs, loss mask) per row."""
    return pa.Table.from_pylist([
        {"batch_id": "b", "prompt_id": "p", "prompt_ids": [1], "response_ids": list(range(len(lp))),
         "logprobs": lp, "teacher_logprobs": teacher, "loss_mask": mask, "reward": 0.0}
        for lp, teacher, mask in rows], schema=TRAJECTORY_SCHEMA)


def task(rows: list[list[float]]) -> pa.Table:
    return pa.Table.from_arrays([pa.array(rows, pa.list_(pa.float32()))], names=["advantages"])


def test_each_model_token_earns_minus_its_reverse_kl_and_the_kl_is_the_mean_over_model_tokens():
    t = table([([-1.0, -0.5, -2.0], [-0.5, -0.5, -3.0], None), ([-0.2, -4.0], [-1.2, -1.0], [1, 0])])
    adv, kl = distill_advantages(t)
    np.testing.assert_allclose(adv[0], [0.5, 0.0, -1.0])
    # The environment's token (mask 0) gets no advantage and is left out of the KL.
    np.testing.assert_allclose(adv[1], [-1.0, 0.0])
    assert kl == pytest.approx((-0.5 + 0.0 + 1.0 + 1.0) / 4)


def test_kl_clip_bounds_each_tokens_kl_before_it_becomes_an_advantage_but_not_the_metric():
    t = table([([-0.1, -5.0], [-6.0, -0.2], None)])
    adv, kl = distill_advantages(t, kl_clip=2.0)
    np.testing.assert_allclose(adv[0], [-2.0, 2.0])
    assert kl == pytest.approx((5.9 - 4.8) / 2)


def test_the_mix_adds_coef_times_the_distillation_advantage_or_replaces_the_task_one():
    t = table([([-1.0, -1.0], [-0.5, -2.0], None)])
    mixed, _ = mix_distillation(t, task([[0.3, 0.3]]), coef=0.5)
    np.testing.assert_allclose(mixed.column("advantages").to_pylist()[0], [0.3 + 0.25, 0.3 - 0.5], rtol=1e-6)
    pure, _ = mix_distillation(t, task([[0.3, 0.3]]), coef=1.0, task_reward=False)
    np.testing.assert_allclose(pure.column("advantages").to_pylist()[0], [0.5, -1.0], rtol=1e-6)


def test_ppos_returns_and_values_pass_through_the_mix():
    t = table([([-1.0], [-1.5], None)])
    gae = pa.Table.from_pylist([{"advantages": [0.1], "returns": [2.0], "values": [1.5]}], schema=ADVANTAGE_SCHEMA)
    mixed, _ = mix_distillation(t, gae, coef=1.0)
    assert mixed.schema == ADVANTAGE_SCHEMA
    assert mixed.column("returns").to_pylist() == [[2.0]] and mixed.column("values").to_pylist() == [[1.5]]
    assert mixed.column("advantages").to_pylist()[0] == pytest.approx([0.1 - 0.5])


def test_a_row_the_teacher_never_scored_is_refused():
    with pytest.raises(ValueError, match="row 1 has no teacher logprobs"):
        distill_advantages(table([([-1.0], [-1.0], None), ([-1.0], None, None)]))
    with pytest.raises(ValueError, match="row 0: 2 logprobs, 1 teacher logprobs"):
        distill_advantages(table([([-1.0, -1.0], [-1.0], None)]))
