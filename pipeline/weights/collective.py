"""Collective weight sync (`weight_sync: collective`): the trainer's rank 0
broadcasts new weights to every generator over a process group of its own,
bucket by bucket, straight into the running engines.

The group is not torch.distributed's default group (the trainer process
already holds DeepSpeed's): it is a ProcessGroupGloo built directly on a
TCPStore that rank 0 serves on a free port of its node, with rank 0 the
trainer and ranks 1..G the generators. Every side calls `join` at the same
time; rank 0 first calls `sync_address` in its own process and hands the
address to the others.

A sync is one all-gather in which every rank gives the version it sends
(rank 0, with the manifest: names, dtypes, shapes) or expects (a generator),
so that a mismatch anywhere stops every rank before any bytes move, with the
same error on each side; then rank 0 broadcasts the tensors' bytes in buckets
of at most `bucket_bytes` (a tensor larger than a bucket spans several, sent
without packing). Two buckets are in flight at once on each side, so packing
one overlaps sending the other. A receiver yields each tensor as a view of its
bucket buffer, valid until the next tensor is asked for, which is what
`VllmGenerationEngine.load_stream` consumes.

When every rank can map rank 0's /dev/shm (one node; checked at join), the
bytes skip the sockets: rank 0 copies the tensors into a shared arena and the
group carries one small broadcast per chunk (pipeline/weights/arena.py).
A generator then loads each tensor from the arena, and repacks a packed layer
straight from it where its slices lie as the layer lays them out.

On GPU (backend "nccl") the control steps stay on gloo and the bytes go
through vLLM's own weight-transfer engine (vllm/distributed/weight_transfer/
nccl_engine.py): rank 0 broadcasts with its packed producer over a
PyNcclCommunicator, and each generator's engine, built with
`weight_transfer_config={"backend": "nccl"}`, receives with the matching
consumer and loads through its layerwise reload. That branch cannot run on
this machine (no GPU) and is kept to the calls vLLM documents; it assumes
engines of tensor-parallel size 1.

A failed sync (a refusal excepted) leaves buckets in flight: the group must
be formed again. Every collective waits at most the group's timeout, and a
peer that died fails the others' next wait at once (the socket closes).
"""
from __future__ import annotations

import datetime
import json
import math
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeline.weights import arena

# Every tensor starts aligned in its bucket, as in the flat buffer, so any dtype can view it.
from pipeline.weights.packing import ALIGN

# 16 MiB moved 100M parameters fastest over loopback gloo here (4 MiB: 0.96 GB/s,
# 16: 1.04, 64: 0.62, one receiver; 0.72, 1.00, 0.82 with two).
BUCKET_BYTES = 16 << 20
HEADER_BYTES = 64 << 10  # the version and the manifest travel in one all-gather of this much per rank
BACKENDS = ("gloo", "nccl")
TRANSPORTS = ("auto", "shared", "socket")   # CPU bytes: an arena in /dev/shm, or the gloo sockets
_MASTERS: dict[tuple[str, int], Any] = {}   # the stores sync_address opened, until rank 0 joins


@dataclass(frozen=True)
class Manifest:
    version: int
    entries: tuple[tuple[str, str, tuple[int, ...]], ...]   # (name, torch dtype name, shape)

    def typed(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(name, getattr(torch, dtype), shape) for name, dtype, shape in self.entries]

    def sizes(self) -> list[int]:
        return [math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape in self.entries]


@dataclass
class SyncGroup:
    pg: Any                 # ProcessGroupGloo: control messages, and the bytes on CPU
    store: Any              # the rendezvous store (rank 0 serves it: it must outlive the group)
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    nccl: Any = None        # rank 0 on GPU: vLLM's PyNcclCommunicator
    bucket_bytes: int = BUCKET_BYTES
    buffers: tuple = ()     # the two bucket buffers, kept: fresh ones page-fault on every sync
    shared: bool = False    # the CPU bytes go through an arena.Arena, not the sockets
    arena: Any = None       # that arena, once a sync has set it up
    arenas_made: int = 0    # how many times it was (re)made: names its rendezvous key

    def bucket_buffers(self, nbytes: int) -> tuple:
        if not self.buffers or self.buffers[0].numel() < nbytes:
            self.buffers = tuple(torch.empty(nbytes, dtype=torch.uint8) for _ in (0, 1))
        return self.buffers


def node_ip() -> str:
    """This node's address as Ray sees it (the one the other nodes reach)."""
    from ray.util import get_node_ip_address
    return get_node_ip_address()


def sync_address(host: str | None = None) -> tuple[str, int]:
    """Rank 0: serve the rendezvous on a free port of this node; returns (host, port)."""
    host = host or node_ip()
    # Port 0: the kernel picks a free port while the store binds it, so no other
    # process can take it between the choice and the bind.
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    _MASTERS[(host, store.port)] = store
    return host, store.port


def join(host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 60.0,
         *, engine: Any = None, bucket_bytes: int = BUCKET_BYTES, transport: str = "auto") -> SyncGroup:
    """Form the group: every rank calls this at the same time, rank 0 in the
    process that called sync_address. Raises if the others are not all there
    within timeout_s. `engine` (a generator's VllmGenerationEngine) matters only
    to "nccl", whose receiving side vLLM sets up. `transport` (gloo): "shared"
    moves the bytes through /dev/shm (every rank must see rank 0's), "socket"
    through gloo, "auto" the first when every rank can."""
    if backend not in BACKENDS:
        raise ValueError(f"weight sync: backend {backend!r} is not one of {BACKENDS}")
    if transport not in TRANSPORTS:
        raise ValueError(f"weight sync: transport {transport!r} is not one of {TRANSPORTS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"weight sync: rank {rank} is outside a group of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = _MASTERS.pop((host, port), None)
        if store is None:
            raise ValueError(f"weight sync: rank 0 must join {host}:{port} from the process that "
                             "called sync_address")
        store.set_timeout(timeout)
    else:
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # Bind to the interface that reaches rank 0, not whatever the hostname resolves to.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_ip(host))]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("dagrl/weight_sync", store), rank, world_size, options)
    group = SyncGroup(pg, store, rank, world_size, backend, timeout_s, bucket_bytes=bucket_bytes)
    if backend == "nccl":
        _join_nccl(group, host, engine)
    elif transport != "socket":
        group.shared = arena.all_share_memory(group)
        if transport == "shared" and not group.shared:
            raise RuntimeError("weight sync: transport 'shared' needs every rank on rank 0's node "
                               "(its /dev/shm), and some are not")
    return group


def send(group: SyncGroup, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
         bucket_bytes: int | None = None) -> int:
    """Rank 0: broadcast `named_tensors` as `version`; returns the bytes sent.
    The tensors are read, not copied first: pass the live parameters (under
    ZeRO-3, inside the gather of the full parameters)."""
    items = [(name, t.detach()) for name, t in named_tensors]
    manifest = manifest_of(version, items)
    bucket_bytes = bucket_bytes or group.bucket_bytes
    if group.backend == "nccl" and bucket_bytes != group.bucket_bytes:
        raise ValueError(f"weight sync: the generators' vLLM engines were set up for buckets of "
                         f"{group.bucket_bytes} bytes at join, not {bucket_bytes}")
    _exchange(group, version, json.dumps([manifest.version, manifest.entries]).encode())
    if group.backend == "nccl":
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer
        packed_nccl_broadcast_producer(iterator=iter(items), group=group.nccl, src=0,
                                       post_iter_func=lambda item: item[1], buffer_size_bytes=bucket_bytes,
                                       num_buffers=2)
        torch.cuda.current_stream().synchronize()
        return sum(manifest.sizes())
    if group.shared and arena.arena_for(group, manifest.sizes()):
        return arena.send(group, items, manifest.sizes(), bucket_bytes)
    flats = [t.contiguous().reshape(-1).view(torch.uint8) for _, t in items]
    buckets = _layout(manifest.sizes(), bucket_bytes)
    buffers = group.bucket_buffers(max((_length(b) for b in buckets), default=0))
    works: list[Any] = [None, None]
    for k, bucket in enumerate(buckets):
        if works[k % 2] is not None:
            works[k % 2].wait()   # its buffer is about to be refilled
        if len(bucket) == 1:   # a bucket of one tensor (or one piece of it) goes out as it is
            i, start, size, _ = bucket[0]
            works[k % 2] = group.pg.broadcast(flats[i][start:start + size], 0)
            continue
        works[k % 2] = group.pg.broadcast(pack_bucket(buffers[k % 2], bucket, flats), 0)
    for work in works:
        if work is not None:
            work.wait()
    return sum(manifest.sizes())


def receive_manifest(group: SyncGroup, version: int) -> Manifest:
    """A generator: agree on `version` (the one this refit expects) with every
    rank, then take the manifest. Raises, on every rank alike, when any generator
    expects another version than the trainer sends; nothing is sent then."""
    version_sent, entries = json.loads(_exchange(group, version, None))
    return Manifest(version_sent, tuple((name, dtype, tuple(shape)) for name, dtype, shape in entries))


def receive(group: SyncGroup, manifest: Manifest, bucket_bytes: int | None = None,
            into: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A generator: the manifest's tensors, in its order, as rank 0 broadcasts
    them (CPU). Each is a view of a bucket buffer, valid until the next is asked
    for; a tensor that spans buckets is put together in a buffer of its own.
    `into(name, dtype, nbytes)`, if given, may name the tensor a bucket holding
    just that one should be received into (VllmGenerationEngine.destinations):
    it is then yielded in place and the engine has nothing to copy."""
    bucket_bytes = bucket_bytes or group.bucket_bytes
    sizes = manifest.sizes()
    if group.shared and arena.arena_for(group, sizes):
        yield from arena.receive(group, manifest.entries, sizes, bucket_bytes)
        return
    buckets = _layout(sizes, bucket_bytes)
    buffers = group.bucket_buffers(max((_length(b) for b in buckets), default=0))
    works: list[Any] = [None, None]
    whole: dict[int, torch.Tensor] = {}   # tensors spanning buckets, being put together
    direct: list[Any] = [None, None]

    def post(k: int) -> None:
        (i, _, size, _), n = buckets[k][0], len(buckets[k])
        name, dtype, _ = manifest.entries[i]
        target = into(name, getattr(torch, dtype), size) if into and n == 1 and size == sizes[i] else None
        direct[k % 2] = target
        if target is not None:
            works[k % 2] = group.pg.broadcast(target.view(-1).view(torch.uint8), 0)
        else:
            works[k % 2] = group.pg.broadcast(buffers[k % 2][:_length(buckets[k])], 0)

    if buckets:
        post(0)
    for k, bucket in enumerate(buckets):
        works[k % 2].wait()
        if k + 1 < len(buckets):
            post(k + 1)   # into the other buffer, whose tensors have all been consumed
        if direct[k % 2] is not None:
            yield manifest.entries[bucket[0][0]][0], direct[k % 2]
            continue
        yield from unpack_bucket(buffers[k % 2], bucket, manifest, whole)


def manifest_of(version: int, items: list[tuple[str, torch.Tensor]]) -> Manifest:
    return Manifest(version, tuple((name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                                   for name, t in items))


def pack_bucket(buffer: torch.Tensor, bucket: list[tuple[int, int, int, int]],
                flats: list[torch.Tensor]) -> torch.Tensor:
    """Copy a bucket's pieces of the tensors' bytes (`flats`, uint8) into
    `buffer`; returns the filled part."""
    for i, start, size, offset in bucket:
        buffer[offset:offset + size].copy_(flats[i][start:start + size])
    return buffer[:_length(bucket)]


def unpack_bucket(buffer: torch.Tensor, bucket: list[tuple[int, int, int, int]], manifest: Manifest,
                  whole: dict[int, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a received bucket completes, as views of `buffer`; a tensor
    spanning buckets is put together in `whole` (kept across a sync's buckets)."""
    sizes = manifest.sizes()
    for i, start, size, offset in bucket:
        name, dtype, shape = manifest.entries[i]
        if size == sizes[i]:
            yield name, buffer[offset:offset + size].view(getattr(torch, dtype)).view(shape)
            continue
        part = whole.setdefault(i, torch.empty(sizes[i], dtype=torch.uint8, device=buffer.device))
        part[start:start + size].copy_(buffer[offset:offset + size])
        if start + size == sizes[i]:
            yield name, whole.pop(i).view(getattr(torch, dtype)).view(shape)


def receive_into(group: SyncGroup, engine: Any, version: int, bucket_bytes: int | None = None) -> Manifest:
    """A generator: receive `version` and load it into `engine` (a
    VllmGenerationEngine), prefix cache dropped; returns the manifest."""
    manifest = receive_manifest(group, version)
    if group.backend == "nccl":
        engine.check_entries(manifest.typed())
        names, dtypes, shapes = zip(*manifest.entries) if manifest.entries else ((), (), ())
        engine.llm.collective_rpc("start_weight_update")
        engine.llm.collective_rpc("update_weights", args=(
            {"names": list(names), "dtype_names": list(dtypes), "shapes": [list(s) for s in shapes]},))
        engine.llm.collective_rpc("finish_weight_update")
        engine.drop_prefix_cache()
        return manifest
    if group.shared and arena.arena_for(group, manifest.sizes()):
        # Views of the arena, valid until the next sync: nothing to hold on to.
        engine.load_stream(manifest.typed(), receive(group, manifest, bucket_bytes), stable=True)
        return manifest
    into = engine.destinations([name for name, _, _ in manifest.entries])
    engine.load_stream(manifest.typed(), receive(group, manifest, bucket_bytes, into))
    return manifest


def leave(group: SyncGroup) -> None:
    """Drop this rank's side of the group (rank 0's store goes with it)."""
    if group.nccl is not None:
        group.nccl.destroy()
    if group.arena is not None:
        group.arena.close()
    group.pg = group.store = group.nccl = group.arena = None
    group.buffers = ()


# -- internals -----------------------------------------------------------------------------------

def _layout(sizes: list[int], bucket_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """Buckets of (tensor index, first byte in the tensor, bytes, offset in the
    bucket): tensors in order, a new bucket when the next one would not fit; a
    tensor larger than a bucket starts a new one and fills as many as it needs
    (the sender sends those pieces without packing them), its tail shared with
    what follows. Both sides compute it from the manifest."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"weight sync: bucket_bytes {bucket_bytes} is smaller than {ALIGN}")
    buckets: list[list[tuple[int, int, int, int]]] = []
    current: list[tuple[int, int, int, int]] = []
    used = 0
    for i, size in enumerate(sizes):
        offset = -(-used // ALIGN) * ALIGN
        if current and (size > bucket_bytes or offset + size > bucket_bytes):
            buckets.append(current)
            current, offset = [], 0
        start = 0
        while True:
            if offset >= bucket_bytes and start < size:   # an empty tensor fits anywhere
                buckets.append(current)
                current, offset = [], 0
            length = min(size - start, bucket_bytes - offset)
            current.append((i, start, length, offset))
            used, start = offset + length, start + length
            if start >= size:
                break
            offset = bucket_bytes   # the rest goes to the next bucket
    if current:
        buckets.append(current)
    return buckets


def _length(bucket: list[tuple[int, int, int, int]]) -> int:
    return max((offset + size for _, _, size, offset in bucket), default=0)


def _exchange(group: SyncGroup, version: int, manifest: bytes | None) -> bytes:
    """One all-gather of a fixed-size slot per rank: its version (rank 0: sent;
    the others: expected) and, from rank 0, the manifest (the rest of a long one
    follows in a broadcast). Raises on every rank alike if any generator expects
    another version than rank 0 sends; returns the manifest otherwise."""
    slot = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    payload = manifest or b""
    slot[:16].view(torch.int64).copy_(torch.tensor([version, len(payload)]))
    head = payload[:HEADER_BYTES - 16]
    if head:
        slot[16:16 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    every = [torch.empty(HEADER_BYTES, dtype=torch.uint8) for _ in range(group.world_size)]
    group.pg.allgather([every], [slot]).wait()
    versions = [int(e[:8].view(torch.int64)) for e in every]
    refused = {rank: v for rank, v in enumerate(versions) if rank and v != versions[0]}
    if refused:
        if group.rank == 0:
            raise RuntimeError(f"weight sync: the trainer sends version {versions[0]} but generator rank(s) "
                               f"{refused} expect another; nothing was sent")
        if group.rank in refused:
            raise RuntimeError(f"weight sync: the trainer sends version {versions[0]}, this generator "
                               f"(rank {group.rank}) expects {version}; nothing was loaded")
        raise RuntimeError(f"weight sync: version {versions[0]} refused by generator rank(s) {refused}; "
                           "nothing was sent")
    length = int(every[0][8:16].view(torch.int64))
    if length <= HEADER_BYTES - 16:
        return every[0][16:16 + length].numpy().tobytes()
    rest = (torch.frombuffer(bytearray(payload[HEADER_BYTES - 16:]), dtype=torch.uint8) if group.rank == 0
            else torch.empty(length - (HEADER_BYTES - 16), dtype=torch.uint8))
    group.pg.broadcast(rest, 0).wait()
    return every[0][16:].numpy().tobytes() + rest.numpy().tobytes()


def _local_ip(toward: str) -> str:
    """The address of this node's interface that routes to `toward` (a UDP
    connect sends nothing; it only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((toward, 9))
        return s.getsockname()[0]


def _join_nccl(group: SyncGroup, host: str, engine: Any) -> None:
    """The NCCL side: rank 0 opens vLLM's trainer endpoint on a second free port,
    published through the store; each generator's vLLM worker joins it as rank
    `rank` (engines of tensor-parallel size 1)."""
    from vllm.distributed.weight_transfer import nccl_common
    if group.rank == 0:
        with socket.socket() as s:   # NCCL's own store needs a port of its own; vLLM binds it at once
            s.bind((host, 0))
            port = s.getsockname()[1]
        group.store.set("dagrl/weight_sync/nccl_port", str(port))
        group.nccl = nccl_common.trainer_init({"master_address": host, "master_port": port,
                                              "world_size": group.world_size})
        return
    if engine is None:
        raise ValueError("weight sync: a generator joining an nccl group must pass its engine")
    if engine.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size != 1:
        raise ValueError("weight sync: the nccl path assumes generator engines of tensor-parallel size 1")
    port = int(group.store.get("dagrl/weight_sync/nccl_port"))
    info = nccl_common.NCCLWeightTransferInitInfo(
        master_address=host, master_port=port, rank_offset=group.rank, world_size=group.world_size,
        packed=True, packed_buffer_size_bytes=group.bucket_bytes, packed_num_buffers=2)
    engine.llm.collective_rpc("init_weight_transfer_engine", args=(nccl_common.worker_init_payload(info),))
