"""A checkpoint's buffer written before a column was added (transcript, for
multi-turn samples) still restores: the column comes back null, as a
single-turn row's is, and the rest as it was; the teacher's top-k (distill.loss
topk_kl) comes back as it was written."""
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


def test_the_teachers_top_k_comes_back_from_a_checkpoints_buffer(tmp_path):
    import pyarrow.parquet as pq
    full = pa.table({f.name: pa.nulls(1, f.type) for f in TRAJECTORY_SCHEMA}, schema=TRAJECTORY_SCHEMA)
    top = {"teacher_topk_ids": [[[3, 1], [2, 0]]], "teacher_topk_logprobs": [[[-0.5, -1.5], [-0.25, -3.0]]]}
    for name, values in top.items():
        i = full.schema.get_field_index(name)
        full = full.set_column(i, full.schema.field(i), pa.array(values, full.schema.field(i).type))
    pq.write_table(full, tmp_path / "buffer.parquet")
    restored = in_trajectory_schema(pq.read_table(tmp_path / "buffer.parquet"))
    assert {name: restored.column(name).to_pylist() for name in top} == top
