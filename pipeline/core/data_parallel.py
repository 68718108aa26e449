"""Data parallelism without torch: where the ranks meet, and which rows of a
step's batch each rank trains on.

Whole prompt groups go to one rank, so GRPO's group advantages (computed on
the whole table before it is cut) are those of the whole group, and the rows
of a group meet the same optimizer step as in one process. Every rank gets the
whole batch's token count, so that its token losses divide by the batch's
tokens, not its own: DeepSpeed averages gradients over ranks, and a per-rank
mean would weigh a rank's tokens by its share of rows.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"


def without_flight_recorder() -> None:
    """Turn off torch's flight recorder for this process's process groups, unless
    the user set TORCH_FR_BUFFER_SIZE. Before the first group is made: the
    recorder reads it once. It keeps the last 2000 collectives of every gloo
    or NCCL group, each with the Python stack that called it, to debug a
    hang; in a trainer that is a few collectives a step, so RSS grows for the
    first ~1000 steps (about 5 KB a step on the 4.2M model, measured with
    memray) and each collective captures a stack."""
    os.environ.setdefault(FLIGHT_RECORDER_ENV, "0")


def free_port(host: str = "") -> int:
    """A port the OS calls free on `host` (all interfaces by default), for a rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one process group meet: rank 0's address and a port free there."""
    host: str
    port: int
    world_size: int
    timeout_s: float = 1800.0  # a collective waiting on a dead rank fails after this


@dataclass(frozen=True)
class Shard:
    start: int              # this rank's rows of the batch table: [start, stop)
    stop: int
    rank: int
    world_size: int
    batch_tokens: int       # response tokens of the whole batch
    micro_batches: int      # the most any rank needs; every rank runs as many, so their collectives pair up
    batch_seqs: int         # rows of the whole batch with a trained token (the seq-mean losses' divisor)


@dataclass(frozen=True)
class Batching:
    """How a rank cuts its rows into micro-batches: `micro_batch_size` rows in
    table order, or with `max_tokens` (training.max_tokens_per_micro_batch) by
    a token budget: rows longest first, each micro-batch as many as fit
    `max_tokens` once padded to its longest row (a row over the budget alone).
    Rows of like length share a micro-batch, so little of a forward is padding.
    `packed` (training.packing, where the model keeps packed rows apart): a
    micro-batch is rows in table order whose tokens together fit `max_tokens`
    (or `micro_batch_size` rows without a budget), run as one sequence without
    padding. The loss is the batch's token mean either way (each micro-batch
    divides by the batch's tokens), the same up to the order of the float sums."""
    micro_batch_size: int
    max_tokens: int = 0
    packed: bool = False

    def split(self, lengths: list[int]) -> list[list[int]]:
        """Row indices of each micro-batch, for rows of `lengths` tokens (prompt + response)."""
        n = len(lengths)
        if self.packed:
            chunks: list[list[int]] = []
            total = 0
            for i, length in enumerate(lengths):
                fits = (total + length <= self.max_tokens if self.max_tokens
                        else len(chunks[-1]) < self.micro_batch_size) if chunks else False
                if fits:
                    chunks[-1].append(i)
                    total += length
                else:
                    chunks.append([i])
                    total = length
            return chunks
        if not self.max_tokens:
            return [list(range(i, min(i + self.micro_batch_size, n))) for i in range(0, n, self.micro_batch_size)]
        chunks = []
        for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
            # Longest first: a micro-batch's first row is its widest, so width x rows is its padded size.
            if chunks and lengths[chunks[-1][0]] * (len(chunks[-1]) + 1) <= self.max_tokens:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        return chunks


def row_lengths(table) -> list[int]:
    """Each row's tokens as the trainer's forward sees them: prompt plus response."""
    import pyarrow.compute as pc
    prompt = pc.fill_null(pc.list_value_length(table.column("prompt_ids")), 0).to_numpy()
    response = pc.fill_null(pc.list_value_length(table.column("response_ids")), 0).to_numpy()
    return (prompt + response).tolist()


def batch_shards(response_lengths: list[int], group_size: int, world_size: int,
                 batching: Batching, lengths: list[int] | None = None) -> tuple[Shard, ...]:
    """One Shard per rank: contiguous runs of whole groups, as even as groups allow
    (the first `groups % world_size` ranks take one group more). `lengths`, each
    row's prompt plus response tokens, count the micro-batches of a token budget."""
    rows = len(response_lengths)
    if group_size < 1 or rows % group_size:
        raise ValueError(f"{rows} rows do not split into groups of {group_size}")
    groups = rows // group_size
    if groups < world_size:
        raise ValueError(f"a batch of {groups} prompt groups cannot feed {world_size} data-parallel ranks: "
                         "every rank needs at least one group (schedule.prompts_per_step >= training.ranks)")
    bounds, start = [], 0
    for rank in range(world_size):
        stop = start + (groups // world_size + (rank < groups % world_size)) * group_size
        bounds.append((start, stop))
        start = stop
    if (batching.max_tokens or batching.packed) and lengths is None:
        raise ValueError("a token budget (training.max_tokens_per_micro_batch) or packing needs the rows' lengths")
    widths = lengths if lengths is not None else [0] * rows
    micro = max(len(batching.split(widths[start:stop])) for start, stop in bounds)
    tokens, seqs = sum(response_lengths), sum(n > 0 for n in response_lengths)
    return tuple(Shard(start, stop, rank, world_size, tokens, micro, seqs) for rank, (start, stop) in enumerate(bounds))



def table_shard(table, group_size: int, rank: int, world_size: int, batching: Batching) -> Shard | None:
    """Rank `rank`'s Shard of a trajectory table (pyarrow), or None when it is alone."""
    if world_size == 1:
        return None
    lengths = row_lengths(table) if batching.max_tokens or batching.packed else None  # only they read them
    return batch_shards(trained_tokens(table), group_size, world_size, batching, lengths)[rank]


def trained_tokens(table) -> list[int]:
    """Each row's response tokens that the loss counts: its loss_mask's 1s (every
    token where the mask is null; an environment's observation tokens are not trained)."""
    import pyarrow.compute as pc
    lengths = pc.fill_null(pc.list_value_length(table.column("response_ids")), 0).to_pylist()
    if "loss_mask" not in table.column_names:
        return lengths
    return [n if m is None else sum(m) for n, m in zip(lengths, table.column("loss_mask").to_pylist())]
