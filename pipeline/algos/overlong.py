"""DAPO's overlong handling (Yu et al. 2025), on a trajectory table before its
advantages are computed: a soft penalty on responses that run into the last
`buffer` tokens before the limit, and masking truncated responses out of the
loss (their reward judges an answer that was never finished).

  penalty(L) = 0                                   L <= max_len - buffer
             = -penalty x (L - (max_len - buffer)) / buffer   above it
so a response of max_len tokens loses `penalty` of reward. Pure numpy and
pyarrow: checked by hand in tests/algos/test_overlong.py.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def overlong_penalty(lengths: np.ndarray, max_len: int, buffer: int, penalty: float) -> np.ndarray:
    """The reward each response of `lengths` tokens loses (<= 0)."""
    if not 0 < buffer < max_len:
        raise ValueError(f"overlong buffer {buffer} must be in 1..{max_len - 1} (below the limit {max_len})")
    over = np.clip(np.asarray(lengths, dtype=np.float64) - (max_len - buffer), 0, buffer)
    return -penalty * over / buffer


def shape_batch(table: pa.Table, max_len: int, buffer: int, penalty: float,
                mask_truncated: bool) -> tuple[pa.Table, dict[str, float]]:
    """The table with the penalty added to each `reward` (buffer > 0) and the
    loss_mask of each truncated row zeroed (mask_truncated), and what it did:
    overlong_penalty_mean, truncated_masked_share."""
    metrics: dict[str, float] = {}
    lengths = pc.fill_null(pc.list_value_length(table.column("response_ids")), 0).to_numpy()
    if buffer:
        cut = overlong_penalty(lengths, max_len, buffer, penalty)
        rewards = table.column("reward").to_numpy(zero_copy_only=False).astype(np.float64) + cut
        table = table.set_column(table.schema.get_field_index("reward"), "reward", pa.array(rewards, pa.float32()))
        metrics["overlong_penalty_mean"] = float(cut.mean()) if len(cut) else 0.0
    if mask_truncated:
        truncated = table.column("truncated")
        if truncated.null_count:
            row = pc.index(pc.is_null(truncated), True).as_py()
            raise ValueError(f"overlong.mask_truncated: row {row} does not say whether it was truncated "
                             "(the `truncated` column is null; its engine does not report it)")
        cut_rows = truncated.to_pylist()
        masks = [[0] * n if t else [1] * n if m is None else m
                 for t, n, m in zip(cut_rows, lengths, table.column("loss_mask").to_pylist())]
        table = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask",
                                 pa.array(masks, pa.list_(pa.int8())))
        metrics["truncated_masked_share"] = float(np.mean(cut_rows)) if cut_rows else 0.0
    return table, metrics
