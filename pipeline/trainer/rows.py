"""A trajectory table as the trainers read it: its rows, checked, and their
collation into right-padded micro-batches over the response window."""
from __future__ import annotations

import pyarrow as pa
import torch

REQUIRED_COLUMNS = ("batch_id", "prompt_id", "prompt_ids", "response_ids", "logprobs", "reward")


def trajectory_rows(table: pa.Table) -> list[dict]:
    """The table's rows (REQUIRED_COLUMNS only), refused unless every one can be trained on."""
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"trajectory table lacks columns {missing}")
    rows = table.select(list(REQUIRED_COLUMNS)).to_pylist()
    if not rows:
        raise ValueError("the trajectory table has no rows")
    masks = table.column("loss_mask").to_pylist() if "loss_mask" in table.column_names else [None] * len(rows)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        # Only model tokens are trained: an environment's observation is not the policy's action.
        row["loss_mask"] = [1] * len(row["response_ids"]) if mask is None else mask
        if len(row["loss_mask"]) != len(row["response_ids"]) or not set(row["loss_mask"]) <= {0, 1}:
            raise ValueError(f"row {i}: loss_mask must hold a 0 or 1 for each of its "
                             f"{len(row['response_ids'])} response tokens, got {mask!r:.120}")
        if row["reward"] is None:
            raise ValueError(f"row {i} has no reward")
        if not row["prompt_ids"]:
            raise ValueError(f"row {i} has an empty prompt")
        if len(row["logprobs"]) != len(row["response_ids"]):
            raise ValueError(f"row {i}: {len(row['logprobs'])} logprobs for "
                             f"{len(row['response_ids'])} response tokens")
    return rows


def token_column(table: pa.Table, column: str, rows: list[dict]) -> list[list[float]]:
    """A per-token column of a table aligned with `rows` (one float per response token)."""
    if column not in table.column_names:
        raise ValueError(f"table lacks the per-token column {column!r}")
    if table.num_rows != len(rows):
        raise ValueError(f"{column}: {table.num_rows} rows for a batch of {len(rows)}")
    values = table.column(column).to_pylist()
    for i, (v, row) in enumerate(zip(values, rows)):
        if v is None or len(v) != len(row["response_ids"]):
            raise ValueError(f"{column}: row {i} has {0 if v is None else len(v)} values for "
                             f"{len(row['response_ids'])} response tokens")
    return values


def collate(rows: list[dict], device, token_keys: dict[str, str]) -> dict:
    """Right-padded ids plus a response window starting at the shortest prompt.

    Right padding keeps the implicit positions 0..len-1 of every sequence
    correct. Response token t of a row with prompt length P sits at position
    P + t and is predicted by the logits at P + t - 1; the window covers
    positions [start, L - 1) with start = min(P) - 1, so only those logits
    are computed (logits_to_keep). `token_keys` maps an output name to a row
    key holding one float per response token (logprobs, advantages, returns),
    laid out in the window like `mask`. `train_mask` is `mask` where the
    row's loss_mask is 1: the tokens a loss counts.
    """
    lens = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    width = max(lens)
    start = min(len(r["prompt_ids"]) for r in rows) - 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1 - start, dtype=torch.bool)
    train_mask = torch.zeros_like(mask)
    per_token = {k: torch.zeros(len(rows), width - 1 - start) for k in token_keys}
    for i, r in enumerate(rows):
        p, n = len(r["prompt_ids"]), len(r["response_ids"])
        ids[i, :p + n] = torch.tensor(r["prompt_ids"] + r["response_ids"])
        attn[i, :p + n] = 1
        lo = p - 1 - start
        mask[i, lo:lo + n] = True
        train_mask[i, lo:lo + n] = torch.tensor(r.get("loss_mask") or [1] * n, dtype=torch.bool)
        for out_key, row_key in token_keys.items():
            per_token[out_key][i, lo:lo + n] = torch.tensor(r[row_key], dtype=torch.float32)
    return {"ids": ids.to(device), "attn": attn.to(device), "start": start, "mask": mask.to(device),
            "train_mask": train_mask.to(device),
            **{k: v.to(device) for k, v in per_token.items()}}
