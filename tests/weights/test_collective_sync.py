"""Collective weight sync (pipeline/weights/collective.py) and the engine's
fast load (pipeline/weights/packing.py RefitPlan).

The trainer side and the generators run in separate processes (multiprocessing,
spawned): the trainer, which already holds a default torch.distributed group as
DeepSpeed's would be, broadcasts the tiny model's state dict over gloo in small
buckets. Checked: the receivers get it bit for bit; a version mismatch stops
every rank before any bytes move; a dead or silent sender makes the receiver
raise within the group timeout; and a real vLLM engine that received the
weights gives the logprobs transformers gives with them (TOL as in
tests/generator/test_vllm_generator.py), on both of the engine's load paths (oneDNN
layers repacked, small layers kept plain).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
from pathlib import Path

import pytest
import torch

from pipeline.weights import collective as ws

pytestmark = pytest.mark.real

torch.set_num_threads(1)

BUCKET = 64 << 10   # the tiny model is 656 KB: 12 buckets, the embeddings and lm_head (98 KB) split in two
WAIT_S = 180        # for a child's result: spawning, imports, a vLLM engine start


# -- the processes ------------------------------------------------------------------------------

def _child(fn, out, *args):
    torch.set_num_threads(1)
    try:
        fn(out, *args)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def _state(model_dir, seed: int | None):
    """The HF model, its weights moved by 0.02 * N(0, 1) from generator `seed` (None: as built)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return model


def _trainer(out, addrs, world, model_dir, rounds, store_file, die_at=None, bucket=BUCKET, transport="auto",
             no_room=False):
    """Rank 0: a default process group first (DeepSpeed's stand-in), then one
    send per round. `no_room`: its /dev/shm cannot hold an arena (ENOSPC)."""
    import errno

    import torch.distributed as dist
    if no_room:
        def full(nbytes, directory=None):
            raise OSError(errno.ENOSPC, "No space left on device")
        ws.arena.Arena.create = full
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=0, world_size=1)
    host, port = ws.sync_address("127.0.0.1")
    for _ in range(world - 1):
        addrs.put((host, port))
    # A receiver may be starting a vLLM engine.
    group = ws.join(host, port, 0, world, timeout_s=120, transport=transport)
    if die_at is not None:
        group.pg = _DiesAt(group.pg, die_at)
    for version, seed in rounds:
        try:
            sent = ws.send(group, _state(model_dir, seed).state_dict().items(), version, bucket)
            out.put(("sent", version, sent))
        except RuntimeError as exc:
            out.put(("refused", version, str(exc)))
    dist.destroy_process_group()


class _DiesAt:
    """The trainer's gloo group, whose owner exits (as if killed) at its n-th broadcast."""

    def __init__(self, pg, n: int):
        self.pg, self.n = pg, n

    def broadcast(self, *args):
        self.n -= 1
        if self.n == 0:
            os._exit(3)
        return self.pg.broadcast(*args)

    def __getattr__(self, name):
        return getattr(self.pg, name)


def _silent_trainer(out, addrs, world, release):
    host, port = ws.sync_address("127.0.0.1")
    for _ in range(world - 1):
        addrs.put((host, port))
    group = ws.join(host, port, 0, world, timeout_s=30)
    out.put(("joined",))
    release.get(timeout=WAIT_S)   # holds the group open, sending nothing, until the test is done
    ws.leave(group)


def _receiver(out, addrs, rank, world, expected, timeout_s=30, transport="auto"):
    host, port = addrs.get(timeout=WAIT_S)
    group = ws.join(host, port, rank, world, timeout_s=timeout_s, transport=transport)
    for version in expected:
        started = time.monotonic()
        try:
            manifest = ws.receive_manifest(group, version)
            got = {name: t.clone() for name, t in ws.receive(group, manifest, BUCKET)}
            # Pickled here: a tensor put on the queue as it is would be shared memory this process frees.
            out.put(("received", rank, version, pickle.dumps(got), group.shared))
        except RuntimeError as exc:
            out.put(("refused", rank, version, str(exc), time.monotonic() - started))


def _engine_receiver(out, addrs, rank, world, model_dir, rounds, bucket, transport):
    """A generator with a real in-process vLLM engine: for each (version, seed),
    the logprob gap to transformers before and after the collective load, and
    how many tensors were received straight into the engine's tensors."""
    from tests.generator.test_vllm_generator import LONG_PROMPT, draw, hf_logprobs, max_gap, prompt_logprobs

    from pipeline.generator.vllm_engine import VllmGenerationEngine
    engine = VllmGenerationEngine(model_dir, seed=0, max_new_tokens=16, max_model_len=256)
    torch.set_num_threads(1)
    engine.weights.PLAIN_LINEAR_MAX = 0   # every linear layer stays packed: the staging and repacking path
    host, port = addrs.get(timeout=WAIT_S)
    group = ws.join(host, port, rank, world, timeout_s=60, transport=transport)
    in_place = [0]
    destinations = engine.destinations

    def counted(names):
        into = destinations(names)
        if into is None:
            return None

        def where(*args):
            target = into(*args)
            in_place[0] += target is not None
            return target
        return where
    engine.destinations = counted
    for version, seed in rounds:
        in_place[0] = 0
        model = _state(model_dir, seed).eval()
        draw(engine, [LONG_PROMPT], 1)   # the prompt's blocks are now cached under the old weights
        stale = max_gap(model, draw(engine, [LONG_PROMPT], 2))
        ws.receive_into(group, engine, version, bucket)
        after = draw(engine, [LONG_PROMPT], 2)
        c = after[0][0]
        scored = max(abs(a - b) for a, b in zip(prompt_logprobs(engine, c.prompt_ids, c.response_ids),
                                                hf_logprobs(model, c.prompt_ids, c.response_ids)))
        out.put(("loaded", version, stale, max_gap(model, after), scored, type(engine.weights.plan).__name__, in_place[0],
                 engine.weights.plan.uncopied))
    engine.close()


class Procs:
    """Spawned children and their one result queue; every child is killed (by PID) at the end."""

    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.out, self.procs = self.ctx.Queue(), []

    def start(self, fn, *args) -> mp.Process:
        proc = self.ctx.Process(target=_child, args=(fn, self.out, *args), daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def results(self, n: int, timeout_s: float = WAIT_S) -> list[tuple]:
        got = []
        for _ in range(n):
            try:
                got.append(self.out.get(timeout=timeout_s))
            except queue.Empty:
                raise AssertionError(f"got {len(got)} of {n} results: {[r[:3] for r in got]}") from None
        errors = [r for r in got if r[0] == "error"]
        assert not errors, errors
        return got

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=30)


@pytest.fixture
def procs():
    p = Procs()
    try:
        yield p
    finally:
        p.close()


# -- the tests ----------------------------------------------------------------------------------

def test_layout_splits_only_tensors_larger_than_a_bucket():
    """64-byte aligned starts, at most a bucket each; the 200-byte tensor starts a
    bucket of its own (sent unpacked) and its tail starts the next."""
    sizes = [10, 100, 0, 30, 200, 64]
    buckets = ws._layout(sizes, 128)
    assert all(ws._length(b) <= 128 for b in buckets)
    assert all(offset % ws.ALIGN == 0 for b in buckets for _, _, _, offset in b)
    pieces = {}
    for b in buckets:
        for i, start, size, _ in b:
            pieces.setdefault(i, []).append((start, size))
    for i, size in enumerate(sizes):   # every byte once, in order
        assert sum(n for _, n in pieces[i]) == size
        assert [s for s, _ in pieces[i]] == [sum(n for _, n in pieces[i][:k]) for k in range(len(pieces[i]))]
    assert [len(pieces[i]) for i in range(len(sizes))] == [1, 1, 1, 1, 2, 1]
    assert [[i for i, *_ in b] for b in buckets] == [[0], [1, 2], [3], [4], [4], [5]]


@pytest.mark.parametrize("transport", ["shared", "socket"])
def test_two_receivers_get_the_state_dict_bit_for_bit(procs, tiny_model, tmp_path, transport):
    """Over /dev/shm and over gloo's sockets; and the shared arena's file is gone
    once the processes have mapped it."""
    before = set(Path("/dev/shm").glob("dagrl-*"))
    addrs = procs.ctx.Queue()
    procs.start(_trainer, addrs, 3, str(tiny_model), [(1, None), (2, 5)], str(tmp_path / "store"), None, BUCKET,
                transport)
    for rank in (1, 2):
        procs.start(_receiver, addrs, rank, 3, [1, 2], 30, transport)
    results = procs.results(6)
    assert {r[4] for r in results if r[0] == "received"} == {transport == "shared"}
    assert set(Path("/dev/shm").glob("dagrl-*")) <= before
    for version, seed in ((1, None), (2, 5)):
        state = _state(tiny_model, seed).state_dict()
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        assert ("sent", version, nbytes) in results
        assert nbytes > 8 * BUCKET and state["model.embed_tokens.weight"].nbytes > BUCKET
        for rank in (1, 2):
            (got,) = [pickle.loads(r[3]) for r in results if r[:3] == ("received", rank, version)]
            assert list(got) == list(state)
            for name, tensor in state.items():
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (rank, version, name)


def test_a_full_dev_shm_falls_back_to_the_sockets(procs, tiny_model, tmp_path):
    """Rank 0 cannot make the arena: every rank learns it in the same step,
    and the weights arrive over the sockets, bit for bit, that sync and the next."""
    addrs = procs.ctx.Queue()
    procs.start(_trainer, addrs, 2, str(tiny_model), [(1, None), (2, 5)], str(tmp_path / "store"), None, BUCKET,
                "auto", True)
    procs.start(_receiver, addrs, 1, 2, [1, 2])
    results = procs.results(4)
    for version, seed in ((1, None), (2, 5)):
        (got,) = [r for r in results if r[:2] == ("received", 1) and r[2] == version]
        assert got[4] is False   # the group no longer counts as shared
        state = _state(tiny_model, seed).state_dict()
        assert all(torch.equal(pickle.loads(got[3])[name], t) for name, t in state.items())


def test_a_version_mismatch_stops_every_rank_before_any_bytes(procs, tiny_model, tmp_path):
    """Generator 2 expects version 2 while the trainer sends 1: every rank refuses,
    naming it; the group stays usable and the next sync (all agreeing) goes through."""
    addrs = procs.ctx.Queue()
    procs.start(_trainer, addrs, 3, str(tiny_model), [(1, None), (1, None)], str(tmp_path / "store"))
    procs.start(_receiver, addrs, 1, 3, [1, 1])
    procs.start(_receiver, addrs, 2, 3, [2, 1])
    results = procs.results(6)
    (trainer,) = [r[2] for r in results if r[0] == "refused" and len(r) == 3]
    generators = {r[1]: r[3] for r in results if r[0] == "refused" and len(r) == 5}
    assert trainer == ("weight sync: the trainer sends version 1 but generator rank(s) {2: 2} "
                       "expect another; nothing was sent")
    assert generators == {
        1: "weight sync: version 1 refused by generator rank(s) {2: 2}; nothing was sent",
        2: "weight sync: the trainer sends version 1, this generator (rank 2) expects 2; nothing was loaded"}
    assert ("sent", 1) in [r[:2] for r in results]
    assert sorted(r[1] for r in results if r[0] == "received") == [1, 2]


@pytest.mark.parametrize("transport", ["shared", "socket"])
def test_a_receiver_whose_sender_died_raises_at_once(procs, tiny_model, tmp_path, transport):
    """The trainer process exits (as if killed) at its 4th bucket (shared: its
    4th chunk's signal): the receiver's load raises, well within the group
    timeout, instead of waiting for it."""
    addrs = procs.ctx.Queue()
    trainer = procs.start(_trainer, addrs, 2, str(tiny_model), [(1, None)], str(tmp_path / "store"), 4, BUCKET,
                          transport)
    procs.start(_receiver, addrs, 1, 2, [1], 30, transport)
    (result,) = procs.results(1)
    assert result[0] == "refused" and result[4] < 10, result   # noticed, not waited out
    trainer.join(timeout=30)
    assert trainer.exitcode == 3


def test_a_silent_sender_times_out(procs):
    """A trainer that joined and never sends: the receiver raises after the group timeout, not never."""
    addrs, release = procs.ctx.Queue(), procs.ctx.Queue()
    procs.start(_silent_trainer, addrs, 2, release)
    procs.start(_receiver, addrs, 1, 2, [1], 3)
    try:
        results = procs.results(2)
    finally:
        release.put(True)
    (refused,) = [r for r in results if r[0] == "refused"]
    assert 3 <= refused[4] < 3 + 10, refused


@pytest.mark.parametrize("transport", ["shared", "socket"])
def test_an_engine_loaded_over_the_group_matches_transformers(procs, tiny_model, tmp_path, transport):
    """Three syncs into a real vLLM engine (the first records the plan through
    the model's loaders, the next replay it; over sockets, the tensors that fill
    a 32 KiB bucket alone are received straight into the engine's qkv and MLP
    staging, from /dev/shm each packed weight is repacked where it lies in the
    arena, with no staging copy): each time
    the cached prompt was stale before and every logprob matches transformers
    after."""
    from tests.generator.test_vllm_generator import TOL
    rounds = [(1, 11), (2, 12), (3, 13)]
    addrs = procs.ctx.Queue()
    procs.start(_trainer, addrs, 2, str(tiny_model), rounds, str(tmp_path / "store"), None, 32 << 10, transport)
    procs.start(_engine_receiver, addrs, 1, 2, str(tiny_model), rounds, 32 << 10, transport)
    results = procs.results(6, timeout_s=300)
    loads = sorted(r for r in results if r[0] == "loaded")
    assert [r[1] for r in loads] == [1, 2, 3]
    for _, version, stale, gap, scored, plan, in_place, uncopied in loads:
        assert stale > 100 * TOL, (version, stale)
        assert gap < TOL and scored < TOL, (version, gap, scored)
        assert plan == "RefitPlan"
        if transport == "shared" or version == 1:
            assert in_place == 0, (version, in_place)
        else:
            assert in_place >= 14, (version, in_place)   # 7 per layer
        # From the arena every packed weight is repacked where it lies, fused q/k/v and gate/up
        # included (their slices lie back to back): 4 per layer (the lm_head stays plain: a copy).
        assert uncopied == (8 if transport == "shared" and version > 1 else 0), (version, uncopied)


def test_the_fast_load_matches_transformers_with_tied_embeddings(tmp_path):
    """In process, the default load path: small layers kept plain and the
    lm_head tied to the embeddings; three loads in a row, each matching."""
    from tests.generator.test_vllm_generator import LONG_PROMPT, TOL, draw, max_gap

    from pipeline.generator.vllm_engine import VllmGenerationEngine
    from pipeline.generator.refit_plan import RefitPlan
    from pipeline.inputs.tiny import build_tiny_model
    model_dir = build_tiny_model(tmp_path / "tied", seed=3, tie_embeddings=True)
    engine = VllmGenerationEngine(model_dir, seed=0, max_new_tokens=16, max_model_len=256)
    torch.set_num_threads(1)
    try:
        for seed in (21, 22, 23):
            model = _state(model_dir, seed).eval()
            assert model.lm_head.weight is model.model.embed_tokens.weight
            engine.load_weights(model.state_dict())
            assert isinstance(engine.weights.plan, RefitPlan)
            assert max_gap(model, draw(engine, [LONG_PROMPT], 2)) < TOL, seed
    finally:
        engine.close()


def test_the_refit_benchmark_runs_quick(tmp_path):
    """benchmarks.refit --quick: every path ran, on the plan, and the JSON has its shape."""
    from tests.bench.test_benchmarks import is_stat, run_quick
    result = run_quick("refit", tmp_path, timeout=600)
    figures = result["figures"]
    full = ("object_store", "collective", "collective_socket")
    assert {(f["size"], f["generators"], f["path"]) for f in figures} == {
        ("tiny", 1, path) for path in full + ("lora_object_store", "lora_collective")}
    for f in figures:
        assert is_stat(f["wall_s"]) and f["bytes_per_s"] > 0 and 0 < f["fraction_of_memcpy"] < 1
        assert f["engine_plan"] == (["RefitPlan"] if f["path"] in full else ["vllm LoRA (adapter reloaded in place)"])
    assert is_stat(result["memcpy"]) and result["targets"][0]["size"] == "tiny"
    # The adapter (rank 8 on every linear layer and lm_head) is a fraction of the tiny model's bytes.
    assert {c["path"] for c in result["lora_vs_full"]} == {"lora_object_store", "lora_collective"}
    assert all(0 < c["bytes_ratio"] < 0.5 for c in result["lora_vs_full"]), result["lora_vs_full"]


def test_the_pipeline_trains_the_same_with_either_weight_sync(tmp_path, ray_session, tiny_model):
    """The step graph with generation.weight_sync collective (send_weights on
    trainer rank 0 beside the generators' refits, over gloo) against the object
    store: two generators, bit-equal weights, so the same curve to the last bit;
    the event logs are clean and every step broadcast once."""
    import json

    from pipeline.config import load_config
    from pipeline.run.driver import train
    from pipeline.core.events import load_events
    from pipeline.tools.check import check_events

    runs = {}
    for sync in ("object_store", "collective"):
        cfg = load_config("examples/tiny_grpo.yaml", [
            f"model.path={tiny_model}", f"run.output_dir={tmp_path}", f"run.name={sync}", "run.steps=6",
            "run.dag_mode=classic", "generation.num_generators=2", f"generation.weight_sync={sync}",
            "metrics.tensorboard=false", "validation.period=3"])
        assert train(cfg, quiet=True)["error"] is None
        events = load_events(tmp_path / sync)
        violations = check_events(events)
        assert violations == [], "\n".join(v.message for v in violations)
        runs[sync] = ([json.loads(line) for line in (tmp_path / sync / "metrics.jsonl").read_text().splitlines()],
                      events)
    # Timings and the machine's memory differ from run to run; everything the training computed must not.
    timing = ("time", "_s", "wait", "busy", "per_s", "idle", "rss_mb/", "store_")
    (a, _), (b, events) = runs["object_store"], runs["collective"]
    same = [{k: v for k, v in m.items() if not any(t in k for t in timing)} for m in a]
    assert same == [{k: v for k, v in m.items() if not any(t in k for t in timing)} for m in b]
    sends = [e for e in events if e["ev"] == "send_end"]
    assert [e["step"] for e in sends] == list(range(6)) and all(e["bytes"] > 0 for e in sends)
    assert sorted(e["worker"] for e in events if e["ev"] == "refit_end" and e["step"] == 5) == ["gen0", "gen1"]
