"""Hand-computed learning-rate schedules of pipeline/trainer/optim.py."""
from __future__ import annotations

import math

import pytest

from pipeline.trainer.optim import Optimizer, lr_factor

pytestmark = pytest.mark.unit


def test_warmup_then_constant():
    opt = Optimizer(warmup_steps=3)
    # Ramp (s + 1) / 4 for s = 0, 1, 2, then 1 for good.
    assert [lr_factor(opt, s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_linear_and_cosine_reach_zero_at_the_last_step():
    lin = Optimizer(schedule="linear", warmup_steps=1, total_steps=5)
    # After one warm-up step (1/2): 1 - (s - 1) / 4.
    assert [lr_factor(lin, s) for s in range(6)] == [0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    cos = Optimizer(schedule="cosine", total_steps=4)
    # (1 + cos(pi s / 4)) / 2 for s = 0..4, and 0 after the end.
    expected = [(1 + math.cos(math.pi * s / 4)) / 2 for s in range(5)] + [0.0]
    assert [lr_factor(cos, s) for s in range(6)] == pytest.approx(expected)

