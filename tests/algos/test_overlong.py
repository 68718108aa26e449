"""Hand-computed checks of pipeline/algos/overlong.py: DAPO's soft overlong
penalty and masking truncated responses out of the loss."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from tests.support.training_helpers import make_table

from pipeline.algos.overlong import overlong_penalty, shape_batch

pytestmark = pytest.mark.unit


def test_the_penalty_is_zero_before_the_buffer_and_linear_inside_it():
    # max_len 16, buffer 4: free up to 12 tokens; 13 -> -1/4, 14 -> -2/4, 16 -> -1 (x penalty 0.5).
    got = overlong_penalty(np.array([1, 12, 13, 14, 16]), 16, 4, 0.5)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.125, -0.25, -0.5])
    with pytest.raises(ValueError, match="overlong buffer 16 must be in 1..15"):
        overlong_penalty(np.array([3]), 16, 16, 1.0)


def _with_truncated(table, flags):
    return table.set_column(table.schema.get_field_index("truncated"), "truncated", pa.array(flags, pa.bool_()))


def test_shape_batch_adds_the_penalty_and_masks_truncated_rows():
    # Responses of 2, 3, 3, 4, 4, 5 tokens (make_table); max_len 5, buffer 2: free up to 3,
    # 4 -> -0.5, 5 -> -1. Rewards 0, 1, 0, 1, 0, 1.
    table = _with_truncated(make_table(), [False, False, False, False, False, True])
    out, m = shape_batch(table, 5, 2, 1.0, mask_truncated=True)
    assert out.column("reward").to_pylist() == [0.0, 1.0, 0.0, 0.5, -0.5, 0.0]
    assert m["overlong_penalty_mean"] == pytest.approx(-2.0 / 6)
    masks = out.column("loss_mask").to_pylist()
    assert masks[5] == [0] * 5 and masks[:5] == [[1] * n for n in (2, 3, 3, 4, 4)]
    assert m["truncated_masked_share"] == pytest.approx(1 / 6)
    # The input is untouched: the run's reward metrics read the raw rewards.
    assert table.column("reward").to_pylist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_masking_needs_the_engine_to_say_what_was_truncated():
    with pytest.raises(ValueError, match="overlong.mask_truncated: row 0 does not say"):
        shape_batch(make_table(), 5, 0, 1.0, mask_truncated=True)
