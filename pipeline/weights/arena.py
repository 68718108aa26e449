"""Shared memory for a weight sync whose ranks all share this node's /dev/shm.

Over loopback gloo every byte is written into a socket by the trainer and read
out by each generator (two copies through the kernel, 1-1.4 GB/s here, a
quarter of a memory copy). When every rank of the group can map the same file,
the trainer instead copies each tensor once into an arena that every generator
maps, and the group carries only a small signal per chunk; a generator loads
each tensor straight from the arena, as vLLM's own `ipc` weight-transfer engine
does with CUDA IPC handles on one GPU node.

The arena holds the manifest's tensors back to back (each at an ALIGN
boundary). A chunk is a run of whole tensors of at least `chunk_bytes`; the
trainer signals each chunk once it is copied in, so generators load chunk k
while the trainer fills k+1. The arena is rewritten only after the next sync's
all-gather, which every generator enters once its last load is done.

The file exists only while a sync sets the arena up: rank 0 creates it, every
rank maps it, and rank 0 unlinks it once all have (the mappings stay), so a
killed process leaves nothing behind in /dev/shm.
"""
from __future__ import annotations

import mmap
import os
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.weights.packing import ALIGN

SHM_DIR = Path("/dev/shm")


@dataclass
class Arena:
    path: Path
    nbytes: int
    data: torch.Tensor      # uint8, a MAP_SHARED view of the file
    _map: Any = None

    @classmethod
    def create(cls, nbytes: int, directory: Path = SHM_DIR) -> Arena:
        path = directory / f"dagrl-weights-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserved now, not at the first write: a /dev/shm too small for the
            # model (a container's 64 MiB default) is ENOSPC here instead of a SIGBUS mid-copy.
            os.posix_fallocate(fd, 0, max(nbytes, 1))
            return cls._mapped(path, fd, nbytes)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    @classmethod
    def open(cls, path: str | Path, nbytes: int) -> Arena:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise RuntimeError(f"weight sync: shared arena {path} holds {size} bytes, not {nbytes}")
            return cls._mapped(Path(path), fd, nbytes)
        finally:
            os.close(fd)

    @classmethod
    def _mapped(cls, path: Path, fd: int, nbytes: int) -> Arena:
        mapping = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        data = torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]
        return cls(path, nbytes, data, mapping)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop the mapping. Views handed out before must be gone by now."""
        self.data = torch.empty(0, dtype=torch.uint8)
        mapping, self._map = self._map, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # a view still exports it: the mapping goes when the last view does


def offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where each tensor starts in the arena, and the arena's length."""
    starts, used = [], 0
    for size in sizes:
        used = -(-used // ALIGN) * ALIGN
        starts.append(used)
        used += size
    return starts, used


def chunks(sizes: list[int], chunk_bytes: int) -> list[list[int]]:
    """Runs of consecutive tensor indices, each closed once it holds at least `chunk_bytes`."""
    runs: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i, size in enumerate(sizes):
        current.append(i)
        held += size
        if held >= chunk_bytes:
            runs.append(current)
            current, held = [], 0
    if current:
        runs.append(current)
    return runs


def probe_path(token: str) -> Path:
    return SHM_DIR / f"dagrl-probe-{token}"


def write_probe() -> str:
    """Rank 0 at join: a file the others must be able to open to share an arena with it."""
    token = uuid.uuid4().hex
    probe_path(token).write_text(token)
    return token


def can_see_probe(token: str) -> bool:
    try:
        return probe_path(token).read_text() == token
    except OSError:
        return False


# -- the steps of a weight_sync.SyncGroup whose `shared` is set ------------------------------------

def all_share_memory(group: Any) -> bool:
    """Whether every rank can open a file rank 0 put in its /dev/shm (one
    all-reduce; rank 0's probe is gone when it returns)."""
    key = "dagrl/weight_sync/probe"
    token = write_probe() if group.rank == 0 else None
    try:
        if group.rank == 0:
            group.store.set(key, token)
        else:
            token = group.store.get(key).decode()
        seen = torch.tensor([int(can_see_probe(token))])
        group.pg.allreduce([seen], _min()).wait()
    finally:
        if group.rank == 0:
            probe_path(token).unlink(missing_ok=True)
    return bool(seen.item())


def _min() -> Any:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    return options


def arena_for(group: Any, sizes: list[int]) -> Arena | None:
    """The group's arena for tensors of `sizes` bytes: made anew (a collective
    step) when the manifest's size changed. None on every rank alike if a rank
    could not make or map it (a full /dev/shm): the group then moves bytes over
    its sockets."""
    nbytes = offsets(sizes)[1]
    if group.arena is not None and group.arena.nbytes == nbytes:
        return group.arena
    if group.arena is not None:
        group.arena.close()
        group.arena = None
    group.arenas_made += 1
    key = f"dagrl/weight_sync/arena/{group.arenas_made}"
    arena, why = None, ""
    try:
        if group.rank == 0:
            try:
                arena = Arena.create(nbytes)
            finally:   # an empty path tells the others at once that there is none to map
                group.store.set(key, str(arena.path) if arena is not None else "")
        else:
            path = group.store.get(key).decode()
            arena = Arena.open(path, nbytes) if path else None
            why = "" if path else "rank 0 made none"
    except (OSError, RuntimeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    try:
        mapped = torch.tensor([int(arena is not None)])
        group.pg.allreduce([mapped], _min()).wait()
    finally:
        if group.rank == 0 and arena is not None:
            arena.unlink()   # every rank that could has mapped it; the mappings outlive the name
    if not mapped.item():
        if arena is not None:
            arena.close()
        group.shared = False
        warnings.warn(f"weight sync: a rank could not map a shared arena of {nbytes} bytes"
                      + (f" (this one: {why})" if why else "") + "; weights go over gloo's sockets from now on",
                      RuntimeWarning, stacklevel=2)
        return None
    group.arena = arena
    return arena


def send(group: Any, items: list[tuple[str, torch.Tensor]], sizes: list[int], chunk_bytes: int) -> int:
    """Rank 0, after `arena_for`: copy each chunk of tensors into the arena and signal it; the
    generators load one chunk while the next is copied in."""
    starts, _ = offsets(sizes)
    data = group.arena.data
    works = []
    for k, run in enumerate(chunks(sizes, chunk_bytes)):
        for i in run:
            flat = items[i][1].contiguous().reshape(-1).view(torch.uint8)
            data[starts[i]:starts[i] + sizes[i]].copy_(flat)
        works.append(group.pg.broadcast(torch.tensor([k]), 0))
    for work in works:
        work.wait()
    return sum(sizes)


def receive(group: Any, entries: tuple, sizes: list[int],
            chunk_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A generator, after `arena_for`: each tensor of `entries` ((name, dtype name, shape)) as a
    view of the arena, as soon as rank 0 has signalled its chunk."""
    starts, _ = offsets(sizes)
    data = group.arena.data
    for run in chunks(sizes, chunk_bytes):
        group.pg.broadcast(torch.zeros(1, dtype=torch.int64), 0).wait()
        for i in run:
            name, dtype, shape = entries[i]
            yield name, data[starts[i]:starts[i] + sizes[i]].view(getattr(torch, dtype)).view(shape)
