"""A checkpoint's buffer written before a column was added (transcript, for
multi-turn samples) still restores: the column comes back null, as a
single-turn row's is, and the rest as it was."""
from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.controller.controller import in_trajectory_schema
from pipeline.core.types import TRAJECTORY_SCHEMA

pytestmark = pytest.mark.unit


def test_an_older_buffer_gets_the_columns_added_since_and_keeps_its_own():
    full = pa.table({f.name: pa.nulls(2, f.type) for f in TRAJECTORY_SCHEMA}, schema=TRAJECTORY_SCHEMA)
    full = full.set_column(full.schema.get_field_index("batch_id"), "batch_id", pa.array(["t0.g0", "t0.g0"]))
    older = full.drop_columns(["transcript"])
    older = older.select(list(reversed(older.column_names)))  # column order is not the schema's either
    restored = in_trajectory_schema(older)
    assert restored.schema == TRAJECTORY_SCHEMA
    assert restored.column("transcript").null_count == 2
    assert restored.column("batch_id").to_pylist() == ["t0.g0", "t0.g0"]
