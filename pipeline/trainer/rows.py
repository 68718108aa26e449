"""A trajectory table as the trainers read it: its rows, checked, and their
collation into micro-batches over the response window: right-padded, or
packed into one sequence without padding (training.packing)."""
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
    if "routed_experts" in table.column_names:  # routing replay's (pipeline/moe/replay.py)
        for row, routes in zip(rows, table.column("routed_experts").to_pylist()):
            row["routed_experts"] = routes
    if "images" in table.column_names:
        for row, images in zip(rows, table.column("images").to_pylist()):
            row["images"] = images or []
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


def teacher_topk(table: pa.Table, rows: list[dict]) -> None:
    """Put each row's teacher top-k (distill.loss topk_kl) in it, as `topk_ids` and
    `topk_logprobs`: [response tokens, k] each, refused unless every row has them."""
    ids = table.column("teacher_topk_ids").to_pylist()
    lps = table.column("teacher_topk_logprobs").to_pylist()
    for i, (row, a, b) in enumerate(zip(rows, ids, lps, strict=True)):
        n = len(row["response_ids"])
        if a is None or b is None or len(a) != n or len(b) != n:
            raise ValueError(f"row {i} has no teacher top-k for each of its {n} response tokens "
                             f"(ids: {None if a is None else len(a)}, logprobs: {None if b is None else len(b)}): "
                             "the teacher did not score its batch with distill.loss topk_kl")
        row["topk_ids"], row["topk_logprobs"] = a, b


def collate(rows: list[dict], device, token_keys: dict[str, str], packed: bool = False) -> dict:
    """Right-padded ids plus a response window starting at the shortest prompt.

    Right padding keeps the implicit positions 0..len-1 of every sequence
    correct. Response token t of a row with prompt length P sits at position
    P + t and is predicted by the logits at P + t - 1; the window covers
    positions [start, L - 1) with start = min(P) - 1, so only those logits
    are computed (logits_to_keep). `token_keys` maps an output name to a row
    key holding one float per response token (logprobs, advantages, returns),
    laid out in the window like `mask`. `train_mask` is `mask` where the
    row's loss_mask is 1: the tokens a loss counts. Rows holding a teacher's
    top-k (teacher_topk) add `topk_ids` and `topk_logprobs`, [rows, window, k].

    `packed`: the rows' ids one after another in a single sequence ([1, T]),
    `positions` restarting at 0 for each row (attention keeps rows apart where
    the model supports it: DeepSpeedEngine checks at start), `keep` the
    positions whose logits predict a response token, `targets` those tokens
    and `slots` where each lands in the window; the window tensors are laid
    out as padded ones are (pack_window puts a forward's outputs there), so a
    loss reads both alike. `forward_positions` and `pad_positions` count what
    the forward runs on. `routed_experts`, where a row has routes: each row's
    (or None), for routing replay (pipeline/moe/replay.py).

    `images`, where a row has pictures: each row's, as bytes, for the model's
    image processor (pipeline/trainer/vision.py).
    """
    lens = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    routes = {"routed_experts": [r.get("routed_experts") for r in rows]} \
        if any(r.get("routed_experts") for r in rows) else {}
    images = {"images": [r.get("images") or [] for r in rows]} if any(r.get("images") for r in rows) else {}
    extra = {**routes, **images}
    if packed:
        return {**_window(rows, device, token_keys), **_packed(rows, lens, device), **extra}
    return {**_window(rows, device, token_keys), **_padded(rows, lens, device), **extra}


def _window(rows: list[dict], device, token_keys: dict[str, str]) -> dict:
    """The response window's masks and per-token values: rows x (longest - 1 - start)."""
    lens = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    width = max(lens)
    start = min(len(r["prompt_ids"]) for r in rows) - 1
    mask = torch.zeros(len(rows), width - 1 - start, dtype=torch.bool)
    train_mask = torch.zeros_like(mask)
    per_token = {k: torch.zeros(len(rows), width - 1 - start) for k in token_keys}
    for i, r in enumerate(rows):
        p, n = len(r["prompt_ids"]), len(r["response_ids"])
        lo = p - 1 - start
        mask[i, lo:lo + n] = True
        train_mask[i, lo:lo + n] = torch.tensor(r.get("loss_mask") or [1] * n, dtype=torch.bool)
        for out_key, row_key in token_keys.items():
            per_token[out_key][i, lo:lo + n] = torch.tensor(r[row_key], dtype=torch.float32)
    out = {"start": start, "mask": mask.to(device), "train_mask": train_mask.to(device),
           **{k: v.to(device) for k, v in per_token.items()}}
    return {**out, **_topk_window(rows, start, mask.shape[1], device)} if "topk_ids" in rows[0] else out


def _topk_window(rows: list[dict], start: int, width: int, device) -> dict:
    k = max((len(t) for r in rows for t in r["topk_ids"]), default=1)
    ids = torch.zeros(len(rows), width, k, dtype=torch.long)
    lps = torch.zeros(len(rows), width, k)
    for i, r in enumerate(rows):
        lo, n = len(r["prompt_ids"]) - 1 - start, len(r["response_ids"])
        if n:
            ids[i, lo:lo + n] = torch.tensor(r["topk_ids"], dtype=torch.long)
            lps[i, lo:lo + n] = torch.tensor(r["topk_logprobs"], dtype=torch.float32)
    return {"topk_ids": ids.to(device), "topk_logprobs": lps.to(device)}


def _padded(rows: list[dict], lens: list[int], device) -> dict:
    ids = torch.zeros(len(rows), max(lens), dtype=torch.long)
    attn = torch.zeros(len(rows), max(lens), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :lens[i]] = torch.tensor(r["prompt_ids"] + r["response_ids"])
        attn[i, :lens[i]] = 1
    return {"ids": ids.to(device), "attn": attn.to(device), "forward_positions": ids.numel(),
            "pad_positions": ids.numel() - sum(lens)}


def _packed(rows: list[dict], lens: list[int], device) -> dict:
    start = min(len(r["prompt_ids"]) for r in rows) - 1
    width = max(lens) - 1 - start
    ids, positions, keep, slots = [], [], [], []
    for i, r in enumerate(rows):
        p, n = len(r["prompt_ids"]), len(r["response_ids"])
        offset = len(ids)
        ids += r["prompt_ids"] + r["response_ids"]
        positions += range(p + n)
        # Response token t (at p + t) is predicted by the logits at p + t - 1.
        keep += range(offset + p - 1, offset + p - 1 + n)
        slots += range(i * width + p - 1 - start, i * width + p - 1 - start + n)
    ids_t = torch.tensor([ids], dtype=torch.long)
    keep_t = torch.tensor(keep, dtype=torch.long)
    return {"ids": ids_t.to(device), "positions": torch.tensor([positions], dtype=torch.long).to(device),
            "keep": keep_t.to(device), "targets": ids_t[0, keep_t + 1].to(device),
            "slots": torch.tensor(slots, dtype=torch.long).to(device), "forward_positions": len(ids),
            "pad_positions": 0}


def pack_window(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """A packed forward's values, one (or one [k]) per kept position (collate's `keep`),
    in the [rows, window(, k)] layout of the batch's masks; zero where a row has no token."""
    rows, width = batch["mask"].shape
    inner = values.shape[1:]
    return values.new_zeros(rows * width, *inner).index_put((batch["slots"],), values).view(rows, width, *inner)


@torch.no_grad()
def packing_gap(window_outputs, device, vocab_size: int) -> tuple[float, float]:
    """(how far a forward over packed rows strays from the same rows padded,
    how far it strays when the rows see each other): the largest gaps of
    `window_outputs(batch)` (logprobs, or a critic's hidden states, in the
    window) over the probe's response tokens. Where the model's attention keeps
    packed rows apart (transformers builds a block-diagonal mask from position
    ids that restart, given no attention mask) the first is float noise and far
    below the second; where it does not, they are alike. On the tiny random
    model: 5e-7 (fp32) and 5e-4 (bf16) against 0.18 for logprobs."""
    # The second row is scored alone and behind the first, which is long so that
    # attention across the rows would move it far.
    probe = ([1, *(k % vocab_size for k in range(40, 72))], [1, *(k % vocab_size for k in range(10, 13))])
    rows = [{"prompt_ids": ids[:2], "response_ids": ids[2:], "loss_mask": [1] * (len(ids) - 2)} for ids in probe]
    padded, packed = collate(rows, device, {}), collate(rows, device, {}, packed=True)
    seen = {**packed, "positions": torch.arange(packed["ids"].shape[1], device=device).unsqueeze(0)}
    reference = window_outputs(padded).float()
    return tuple(float((reference - window_outputs(b).float())[padded["mask"]].abs().max()) for b in (packed, seen))
