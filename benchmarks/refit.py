"""Refit wall time: the trainer's new weights, from its export to loaded in a
real vLLM engine (CPU) in every generator process, by three paths:

  object_store         the trainer's refit today: export (a CPU copy of the state
                       dict), pack into one flat buffer, ray.put; each generator
                       ray.get's it (a view of shared memory) and loads it with
                       VllmGenerationEngine.load_weights (RefitPlan: a copy per tensor)
  collective           weight_sync as a run on one node uses it: the trainer copies its
                       live parameters into a /dev/shm arena that every generator maps,
                       signalling each chunk over gloo; each generator loads the chunks
                       from the arena as they are signalled (pipeline/weights/arena.py)
  collective_socket    weight_sync as across nodes: the trainer broadcasts the bytes
                       over gloo's sockets in buckets, loaded as they arrive
  lora_object_store    training.lora (rank --lora-rank, every linear layer and lm_head):
                       the adapter alone through the object store, served by the
                       engine's vLLM LoRA path (written, then reloaded in place)
  lora_collective      the adapter alone over the /dev/shm arena, served the same way

for Llama models built in code (the tiny one, and about 1M, 25M, 100M and 400M
parameters, fp32), with 1 and 2 generators. A refit is timed at the driver,
from the first call to the last generator done, several times after a warm-up
(whose load records the plan), median. Rates are model bytes per second of that
wall time and their fraction of this machine's memory-copy bandwidth
(torch copy_ of 256 MiB, one thread, measured in the same run).

    .venv/bin/python -m benchmarks.refit            # full: several minutes
    .venv/bin/python -m benchmarks.refit --quick    # smoke run: tiny model, one generator
"""
from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import ray
import ray.cloudpickle

from benchmarks.harness import machine_info, print_table, sample_load, shutdown_ray, start_ray, stats, write_result
from benchmarks.workloads import MODEL_SIZES, build_sized_model

# Ray's workers cannot import this script by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

FULL_PATHS = ("object_store", "collective", "collective_socket")
LORA_PATHS = ("lora_object_store", "lora_collective")
PATHS = FULL_PATHS + LORA_PATHS
TRANSPORTS = {"collective": "shared", "collective_socket": "socket", "lora_collective": "shared"}
TIMEOUT_S = 600.0


@ray.remote(num_cpus=1)
class Trainer:
    """The trainer's side: an HF model on CPU, exported as the trainer actor does."""

    def __init__(self, model_dir: str, lora_rank: int = 0):
        import torch
        torch.set_num_threads(1)
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.lora = lora_rank > 0
        if self.lora:
            from pipeline.weights import lora
            from pipeline.config import LoraConfig
            self.model = lora.wrap(self.model, LoraConfig(rank=lora_rank), model_dir)
            with torch.no_grad():   # a trained adapter: B away from its zero start
                for name, p in self.model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0.0, 0.01)
        self.groups: dict = {}   # transport -> its weight-sync group

    def _state(self) -> dict:
        """What the policy engine exports: every tensor, or the adapter's (deepspeed_policy)."""
        from pipeline.weights import lora
        return lora.adapter_state(self.model) if self.lora else self.model.state_dict()

    def sync_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._state().values())

    def export_put(self, version: int) -> tuple[list, dict]:
        """pipeline/trainer/worker.py's train tail: export_weights (DeepSpeedEngine.export_weights), pack, put."""
        from pipeline.weights import packing
        t0 = time.perf_counter()
        state = {name: t.detach().to("cpu", copy=True) for name, t in self._state().items()}
        t1 = time.perf_counter()
        packed = packing.pack(state)
        t2 = time.perf_counter()
        ref = ray.put((version, packed))
        t3 = time.perf_counter()
        return [ref], {"export_s": t1 - t0, "pack_s": t2 - t1, "put_s": t3 - t2}

    def address(self) -> tuple[str, int]:
        from pipeline.weights import collective as ws
        return ws.sync_address(ws.node_ip())

    def join(self, host: str, port: int, world: int, transport: str) -> None:
        from pipeline.weights import collective as ws
        if transport in self.groups:
            ws.leave(self.groups.pop(transport))
        self.groups[transport] = ws.join(host, port, 0, world, timeout_s=TIMEOUT_S, transport=transport)

    def send(self, version: int, bucket_bytes: int, transport: str) -> dict:
        from pipeline.weights import collective as ws
        t0 = time.perf_counter()
        ws.send(self.groups[transport], self._state().items(), version, bucket_bytes)
        return {"send_s": time.perf_counter() - t0}


@ray.remote(num_cpus=1)
class Generator:
    """A generator's side: the engine the generator actor runs, nothing else."""

    def __init__(self, model_dir: str, lora_rank: int = 0):
        import torch

        from pipeline.weights import lora
        from pipeline.generator.vllm_engine import VllmGenerationEngine
        from pipeline.config import LoraConfig
        adapter = lora.adapter_config(LoraConfig(rank=lora_rank), model_dir) if lora_rank else None
        self.engine = VllmGenerationEngine(model_dir, max_model_len=128, kv_cache_seqs=4, adapter_config=adapter)
        torch.set_num_threads(1)
        self.groups: dict = {}

    def load_from_store(self, refs: list, version: int) -> dict:
        from pipeline.weights import packing
        t0 = time.perf_counter()
        stored_version, stored = ray.get(refs[0])
        assert stored_version == version
        tensors = packing.unpack(stored)
        t1 = time.perf_counter()
        self.engine.load_weights(tensors)
        return {"get_s": t1 - t0, "load_s": time.perf_counter() - t1, **self._repack()}

    def join(self, host: str, port: int, rank: int, world: int, transport: str) -> None:
        from pipeline.weights import collective as ws
        if transport in self.groups:
            ws.leave(self.groups.pop(transport))
        self.groups[transport] = ws.join(host, port, rank, world, timeout_s=TIMEOUT_S, transport=transport)

    def receive(self, version: int, bucket_bytes: int, transport: str) -> dict:
        from pipeline.weights import collective as ws
        t0 = time.perf_counter()
        ws.receive_into(self.groups[transport], self.engine, version, bucket_bytes)
        return {"receive_load_s": time.perf_counter() - t0, **self._repack()}

    def _repack(self) -> dict:
        plan = self.engine.weights.plan
        return {"repack_s": plan.repack_s} if plan else {}

    def fast(self) -> str:
        if self.engine.weights.adapter_config is not None:
            return "vllm LoRA (adapter reloaded in place)"
        plan = self.engine.weights.plan
        return type(plan).__name__ if plan is not False else f"off: {self.engine.weights.plan_off}"

    def close(self) -> None:
        self.engine.close()


def memcpy_bytes_per_s(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """One thread's torch copy_ between two buffers already touched: the physical limit here."""
    import torch
    torch.set_num_threads(1)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def refit_once(path: str, trainer, gens: list, version: int, bucket_bytes: int) -> tuple[float, dict]:
    t0 = time.perf_counter()
    if path in TRANSPORTS:
        transport = TRANSPORTS[path]
        parts = ray.get([trainer.send.remote(version, bucket_bytes, transport)]
                        + [g.receive.remote(version, bucket_bytes, transport) for g in gens], timeout=TIMEOUT_S)
    else:
        refs, exported = ray.get(trainer.export_put.remote(version), timeout=TIMEOUT_S)
        parts = [exported] + ray.get([g.load_from_store.remote(refs, version) for g in gens], timeout=TIMEOUT_S)
        del refs
    wall = time.perf_counter() - t0
    merged: dict = {}
    for part in parts:
        for key, value in part.items():
            merged[key] = max(merged.get(key, 0.0), value)   # the slowest generator's
    return wall, merged


def measure_size(name: str, model_dir: Path, nbytes: int, generators: list[int], repeats: int,
                 bucket_bytes: int, paths: list[str], info: dict, lora_rank: int = 0) -> list[dict]:
    """`paths`' refits of the model in `model_dir` (with lora_rank: of its adapter)."""
    trainer = Trainer.remote(str(model_dir), lora_rank)
    gens = [Generator.remote(str(model_dir), lora_rank) for _ in range(max(generators))]
    sync_bytes = ray.get(trainer.sync_bytes.remote(), timeout=TIMEOUT_S)
    figures = []
    try:
        ray.get([g.fast.remote() for g in gens] + [trainer.address.remote()], timeout=TIMEOUT_S)
        version = 0
        for n in generators:
            for transport in {TRANSPORTS[p] for p in paths if p in TRANSPORTS}:
                host, port = ray.get(trainer.address.remote())
                ray.get([trainer.join.remote(host, port, n + 1, transport)]
                        + [g.join.remote(host, port, rank + 1, n + 1, transport) for rank, g in enumerate(gens[:n])],
                        timeout=TIMEOUT_S)
            walls: dict = {p: [] for p in paths}
            parts: dict = {p: [] for p in paths}
            for rep in range(repeats + 1):   # the first is the warm-up: its load records the plan
                sample_load(info)
                for path in paths:
                    version += 1
                    wall, part = refit_once(path, trainer, gens[:n], version, bucket_bytes)
                    if rep:
                        walls[path].append(wall)
                        parts[path].append(part)
            fast = ray.get([g.fast.remote() for g in gens[:n]])
            for path in paths:
                wall = stats(walls[path])
                rate = (sync_bytes if lora_rank else nbytes) / wall["median"]
                figures.append({
                    "size": name, "generators": n, "path": path, "model_bytes": nbytes, "sync_bytes": sync_bytes,
                    "lora_rank": lora_rank, "wall_s": wall,
                    "bytes_per_s": rate, "parts_s": {k: statistics.median(p[k] for p in parts[path])
                                                     for k in parts[path][0]},
                    "engine_plan": fast})
            print(f"  {name} x{n}: " + ", ".join(f"{p} {1e3 * statistics.median(walls[p]):.1f} ms"
                                               for p in paths), flush=True)
    finally:
        ray.get([g.close.remote() for g in gens], timeout=TIMEOUT_S)
        for actor in (trainer, *gens):
            ray.kill(actor)
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke size: the tiny model, one generator, 2 repeats")
    ap.add_argument("--sizes", help=f"comma-separated, of {','.join(MODEL_SIZES)} (full: all)")
    ap.add_argument("--generators", default=None, help="comma-separated counts (full 1,2; quick 1)")
    ap.add_argument("--repeats", type=int, help="timed refits per path (full 5, 3 at 400M; quick 2)")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="collective bucket size, MiB (default: weight_sync's)")
    ap.add_argument("--lora-rank", type=int, default=8, help="adapter rank of the lora_* paths")
    ap.add_argument("--out", type=Path, help="directory for refit.json (default benchmarks/results)")
    args = ap.parse_args(argv)
    from pipeline.weights import collective as ws
    sizes = args.sizes.split(",") if args.sizes else (["tiny"] if args.quick else list(MODEL_SIZES))
    generators = [int(g) for g in (args.generators or ("1" if args.quick else "1,2")).split(",")]
    bucket_bytes = int(args.bucket_mb * 2**20) if args.bucket_mb else ws.BUCKET_BYTES
    info = machine_info()
    result = {"benchmark": "refit", "machine": info,
              "params": {"quick": args.quick, "sizes": {s: MODEL_SIZES[s] for s in sizes}, "generators": generators,
                         "bucket_bytes": bucket_bytes, "paths": list(PATHS), "dtype": "float32",
                         "lora_rank": args.lora_rank,
                         "size_fields": ["hidden", "layers", "heads", "head_dim", "intermediate"]},
              "figures": [], "memcpy_bytes_per_s": []}
    work = Path(tempfile.mkdtemp(prefix="dagrl_refit_"))
    start_ray(num_cpus=8)
    try:
        for name in sizes:
            model_dir = build_sized_model(work, name)
            nbytes = (model_dir / "model.safetensors").stat().st_size   # within a few KB of the tensors' bytes
            free = psutil.virtual_memory().available
            if 8 * nbytes > free:   # trainer (model, export, pack), the store, two engines, staging
                print(f"  {name}: skipped, {nbytes / 2**30:.1f} GiB of weights needs ~8x, "
                      f"{free / 2**30:.1f} GiB available")
                result.setdefault("skipped", []).append({"size": name, "available_bytes": free})
                continue
            result["memcpy_bytes_per_s"].append(memcpy_bytes_per_s())
            repeats = args.repeats or (2 if args.quick else 3 if name == "400M" else 5)
            result["figures"] += measure_size(name, model_dir, nbytes, generators, repeats, bucket_bytes,
                                              list(FULL_PATHS), info)
            result["figures"] += measure_size(name, model_dir, nbytes, generators, repeats, bucket_bytes,
                                              list(LORA_PATHS), info, args.lora_rank)
            shutil.rmtree(model_dir)
            gc.collect()
    finally:
        shutdown_ray()
        shutil.rmtree(work, ignore_errors=True)
    memcpy = statistics.median(result["memcpy_bytes_per_s"])
    result["memcpy"] = stats(result["memcpy_bytes_per_s"])
    for f in result["figures"]:
        f["fraction_of_memcpy"] = f["bytes_per_s"] / memcpy
    result["targets"] = targets(result["figures"])
    result["lora_vs_full"] = lora_vs_full(result["figures"])
    report(result, memcpy)
    path = write_result("refit", result, args.out)
    print(f"\nwrote {path}")
    return 0


def lora_vs_full(figures: list[dict]) -> list[dict]:
    """Per size and generator count: each LoRA path against the full path it mirrors, bytes and wall time."""
    by = {(f["size"], f["generators"], f["path"]): f for f in figures}
    out = []
    for (size, n, path), f in by.items():
        full = by.get((size, n, path.removeprefix("lora_")))
        if path in LORA_PATHS and full:
            out.append({"size": size, "generators": n, "path": path, "full_bytes": full["sync_bytes"],
                        "lora_bytes": f["sync_bytes"], "bytes_ratio": f["sync_bytes"] / full["sync_bytes"],
                        "full_wall_s": full["wall_s"]["median"], "lora_wall_s": f["wall_s"]["median"],
                        "speedup": full["wall_s"]["median"] / f["wall_s"]["median"]})
    return out


def targets(figures: list[dict]) -> list[dict]:
    """Collective within 3x of the memory-copy limit at 100M and above; faster than the object store everywhere."""
    out = []
    by = {(f["size"], f["generators"], f["path"]): f for f in figures}
    for (size, n, path), f in by.items():
        if path not in TRANSPORTS or path in LORA_PATHS:
            continue
        store = by.get((size, n, "object_store"))
        out.append({"size": size, "generators": n, "path": path, "fraction_of_memcpy": f["fraction_of_memcpy"],
                    "within_3x": f["fraction_of_memcpy"] >= 1 / 3 if size in ("100M", "400M") else None,
                    "speedup_over_object_store": store["wall_s"]["median"] / f["wall_s"]["median"] if store else None,
                    "faster_than_object_store": f["wall_s"]["median"] < store["wall_s"]["median"] if store else None})
    return out


def report(result: dict, memcpy: float) -> None:
    rows = []
    for f in result["figures"]:
        rows.append([f["size"], f["generators"], f["path"], round(f["model_bytes"] / 2**20, 1),
                     1e3 * f["wall_s"]["median"], 1e3 * f["wall_s"]["spread"], f["bytes_per_s"] / 1e9,
                     f["fraction_of_memcpy"], " ".join(f"{k}={1e3 * v:.1f}" for k, v in f["parts_s"].items())])
    print_table(["size", "gens", "path", "MiB", "wall ms", "spread ms", "GB/s", "of memcpy", "parts (ms)"], rows,
                title=f"refit, medians (memcpy {memcpy / 1e9:.2f} GB/s)")
    print_table(["size", "gens", "path", "of memcpy", "within 3x", "x object store", "faster"],
                [[t["size"], t["generators"], t["path"], t["fraction_of_memcpy"], t["within_3x"],
                  t["speedup_over_object_store"], t["faster_than_object_store"]] for t in result["targets"]],
                title="targets: collective within 3x of memcpy (100M and up), faster than the object store")
    print_table(["size", "gens", "path", "full MiB", "LoRA MiB", "bytes ratio", "full ms", "LoRA ms", "speedup"],
                [[c["size"], c["generators"], c["path"], c["full_bytes"] / 2**20, c["lora_bytes"] / 2**20,
                  c["bytes_ratio"], 1e3 * c["full_wall_s"], 1e3 * c["lora_wall_s"], c["speedup"]]
                 for c in result["lora_vs_full"]], title="LoRA (adapter only) against the full refit")


if __name__ == "__main__":
    sys.exit(main())
