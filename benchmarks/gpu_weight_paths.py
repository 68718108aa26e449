"""The trainer's weight paths on one GPU: the per-step export and the bucketed
copy layout of the collective weight sync, checked bit for bit and timed.

A Llama of a few hundred million parameters is built from a config (random
weights, saved to a temporary directory, as benchmarks.gpu_trainer does)
and loaded in pipeline.trainer.deepspeed_policy.DeepSpeedPolicyEngine, bf16,
world size 1, at each ZeRO stage asked for (default 0 and 3); it takes one
GRPO step first, so the weights read are ones the optimizer wrote.

  export   engine.export_weights(), the trainer's per-step export (gathered under
           ZeRO-3, a device-to-host copy per tensor): median wall time over the
           repeats, bytes/s, and its ratio to a raw device-to-host copy of the same
           number of bytes in one tensor (.to("cpu", copy=True), and copy_ into a
           pinned buffer), measured in the same repeat. Every exported tensor must
           be bit-equal to the module's (gathered under ZeRO-3). At ZeRO 0,
           engine.live_weights() must name the same tensors with the same shapes
           and dtypes, and be the module's own tensors (not copies).
  buckets  pipeline/weights/collective.py's layout on the device: the live
           tensors (under ZeRO-3: inside the gather) packed into two bucket
           buffers at collective._layout's offsets and unpacked as
           collective.receive does (a view of the bucket, or a tensor that spans
           buckets put together in one of its own), for buckets of 1 MiB, 64 MiB
           and one larger than the model: bit-equality of every tensor, and the
           pack+unpack bytes/s against one device-to-device copy of the same bytes.
           In one process the sender's packed bucket stands for the receiver's
           (a broadcast would land the same bytes at the same offsets).

Not exercised: the NCCL path itself (weight_sync's "nccl" backend: vLLM's
weight-transfer engine, trainer and generator engines in different processes
on different GPUs) needs vLLM and at least two GPUs.

Needs torch, transformers, deepspeed and pyarrow; never imports Ray or vLLM.
Exits at once with an error where no CUDA GPU is visible. `--cpu-smoke` runs
the same code on CPU tensors at a toy size to check it (it writes
gpu_weight_paths_cpu_smoke.json; its figures are not GPU figures). Exit code 1
when any check fails (after the JSON is written).

    python -m benchmarks.gpu_weight_paths              # ~370M parameters, a few minutes on one GPU
    python -m benchmarks.gpu_weight_paths --quick      # a small model, seconds on one GPU
    python -m benchmarks.gpu_weight_paths --cpu-smoke  # code-path check on CPU, no GPU needed
"""
from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import engine_config, gpu_machine_info, print_table, require_gpu, stats, write_result
from benchmarks.workloads import build_llama, build_rows, to_table

NO_GPU = "gpu_weight_paths needs a CUDA GPU; none is visible"
NOT_EXERCISED = ("the NCCL path itself (weight_sync backend 'nccl': vLLM's weight-transfer engine, trainer and "
                 "generator engines in different processes on different GPUs) needs vLLM and at least two GPUs; "
                 "this script does not exercise it")
CPU_NOTE = ("--cpu-smoke: the same code path on CPU tensors at a toy size; these are not GPU figures "
            "(the 'device' copies are host-memory copies, and there is no pinned copy)")
MIB = 1 << 20
SIZES = {
    "full": dict(hidden=1024, layers=24, heads=16, intermediate=2816, vocab=32000, repeats=5, warmup=1),
    "quick": dict(hidden=256, layers=4, heads=4, intermediate=688, vocab=32000, repeats=3, warmup=1),
    "cpu_smoke": dict(hidden=64, layers=2, heads=2, intermediate=128, vocab=512, repeats=2, warmup=1),
}
# The toy model is ~0.3 MiB: buckets scaled down so tensors still span several,
# and one (64 KiB) exactly the embedding's size.
BUCKETS = {"full": [1 * MIB, 64 * MIB], "quick": [1 * MIB, 64 * MIB], "cpu_smoke": [4096, 64 << 10]}
# One tiny GRPO batch (workloads.build_rows' keys): the weights read are ones the
# optimizer wrote, not the loaded ones.
BATCH = dict(rows=2, group_size=2, prompt_len=8, response_len=8)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a small model: a smoke run on a GPU")
    size.add_argument("--cpu-smoke", action="store_true",
                      help="toy size on the CPU (no GPU needed): checks the code path, measures nothing")
    for key in SIZES["full"]:
        ap.add_argument(f"--{key}", type=int, help=f"default: full {SIZES['full'][key]}, "
                        f"quick {SIZES['quick'][key]}")
    ap.add_argument("--zero-stages", type=int, nargs="+", choices=(0, 3), default=[0, 3],
                    help="ZeRO stages to build the engine at, one after the other (default: 0 3)")
    ap.add_argument("--bucket-bytes", type=int, nargs="+",
                    help="bucket sizes in bytes (default 1 MiB and 64 MiB; --cpu-smoke 4096 and 65536); "
                         "one larger than the model is always added")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="directory for the JSON (default benchmarks/results)")
    return ap.parse_args(argv)


def bits(t):
    """Bytes of a tensor, for bit-equality (torch.equal on floats calls -0.0 and 0.0 equal)."""
    import torch
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(ref, t) -> bool:
    import torch
    return ref.dtype == t.dtype and ref.shape == t.shape and torch.equal(bits(ref), bits(t.to(ref.device)))


class Timer:
    def __init__(self, cuda: bool):
        import torch
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def __call__(self, fn):
        """(seconds, result) of fn(), with the device idle at both ends."""
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - t0, out


# --- the bucketed layout ---------------------------------------------------------------------

class Buckets:
    """collective.send's and receive's bucket loops, in one process on the
    tensors' device: the layout and the buffers once, then any number of passes."""

    def __init__(self, items: list, bucket_bytes: int):
        import torch

        from pipeline.weights import collective as ws
        self.manifest = ws.manifest_of(0, items)
        self.sizes = self.manifest.sizes()
        self.layout = ws._layout(self.sizes, bucket_bytes)
        self.flats = [t.contiguous().reshape(-1).view(torch.uint8) for _, t in items]
        device = items[0][1].device
        length = max((ws._length(b) for b in self.layout), default=0)
        # Two, kept across passes, as SyncGroup.bucket_buffers keeps them.
        self.buffers = tuple(torch.empty(length, dtype=torch.uint8, device=device) for _ in (0, 1))
        self.spanning = {i for b in self.layout for i, _, size, _ in b if size != self.sizes[i]}
        self.aligned = all(offset % ws.ALIGN == 0 for b in self.layout for _, _, _, offset in b)

    def stream(self):
        """(name, tensor) in manifest order, each valid until the next is asked for."""
        from pipeline.weights import collective as ws
        whole: dict = {}
        for k, bucket in enumerate(self.layout):
            # send packs a bucket of several pieces; a one-piece bucket goes out from the
            # tensor and lands at offset 0 of the receiver's buffer: one copy either way.
            ws.pack_bucket(self.buffers[k % 2], bucket, self.flats)
            yield from ws.unpack_bucket(self.buffers[k % 2], bucket, self.manifest, whole)

    def drain(self) -> None:
        for _ in self.stream():
            pass

    def verify(self, items: list) -> dict:
        """Every tensor bit-equal to its source, in order; a view of a bucket
        buffer unless it spans buckets."""
        ptrs = {b.untyped_storage().data_ptr() for b in self.buffers}
        stream = self.stream()
        # items first: zip then stops without drawing from the stream, and `next` sees any extra.
        got = [(name, same_bits(src, t), t.untyped_storage().data_ptr() in ptrs)
               for (_, src), (name, t) in zip(items, stream)]
        whole = len(got) == len(items) and next(stream, None) is None
        views = [v for _, _, v in got]
        return {"bit_equal": whole and all(ok for _, ok, _ in got),
                "names_in_order": [n for n, _, _ in got] == [n for n, _ in items],
                "views_where_unsplit": views == [i not in self.spanning for i in range(len(items))],
                "aligned": self.aligned, "buckets": len(self.layout), "spanning_tensors": len(self.spanning),
                "views": sum(views)}


def bucket_paths(items: list, bucket_sizes: list[int], size: dict, timer: Timer) -> dict:
    import torch
    total = sum(t.nbytes for _, t in items)
    device = items[0][1].device
    src = torch.empty(total, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out = {}
    for bucket_bytes in bucket_sizes:
        b = Buckets(items, bucket_bytes)
        for _ in range(size["warmup"]):
            b.drain()
        walls, ratios = [], []
        for _ in range(size["repeats"]):
            raw, _ = timer(lambda: dst.copy_(src))
            wall, _ = timer(b.drain)
            walls.append(wall)
            ratios.append(raw / wall)
        out[str(bucket_bytes)] = {"bucket_bytes": bucket_bytes, "bytes": total, **b.verify(items),
                                  "pack_unpack_s": stats(walls), "bytes_per_s": stats([total / w for w in walls]),
                                  "over_raw_d2d": stats(ratios)}
        del b
    return out


# --- one engine ------------------------------------------------------------------------------

def stage_paths(model_dir: Path, stage: int, bucket_sizes: list[int], size: dict, seed: int,
                cuda: bool, timer: Timer) -> dict:
    import torch

    from pipeline.algos.advantages import critic_free_advantages
    from pipeline.trainer.deepspeed_base import full_params
    from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
    from pipeline.weights.collective import ALIGN
    engine = DeepSpeedPolicyEngine(engine_config(model_dir, f"training.zero_stage={stage}", "training.dtype=bf16",
                                                 "training.micro_batch_size=2", f"run.seed={seed}"))
    try:
        batch = {**BATCH, "vocab": size["vocab"]}
        table = to_table(build_rows(batch, 0.25, seed))
        engine.train_step(table, critic_free_advantages(table, batch["group_size"]))
        module = engine.engine.module
        for _ in range(size["warmup"]):
            engine.export_weights()
        state = engine.export_weights()
        total = sum(t.nbytes for t in state.values())
        src = torch.empty(total, dtype=torch.uint8, device=engine.device)
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True) if cuda else None
        walls, unpinned, pin = [], [], []
        for _ in range(size["repeats"]):
            raw, copied = timer(lambda: src.to("cpu", copy=True))   # allocates, as export's copies do
            del copied
            raw_pin = timer(lambda: pinned.copy_(src))[0] if cuda else None
            wall, state = timer(engine.export_weights)
            walls.append(wall)
            unpinned.append(raw / wall)
            if cuda:
                pin.append(raw_pin / wall)
        del src, pinned
        with full_params(engine.deepspeed, module, stage):
            module_state = module.state_dict()
            export = {
                "tensors": len(state), "bytes": total, "dtypes": sorted({str(t.dtype) for t in state.values()}),
                "names_match_module": list(state) == list(module_state),
                "bit_equal": list(state) == list(module_state)
                and all(same_bits(module_state[n], t) for n, t in state.items()),
                "export_s": stats(walls), "bytes_per_s": stats([total / w for w in walls]),
                "over_raw_d2h_unpinned": stats(unpinned), "over_raw_d2h_pinned": stats(pin) if cuda else None}
            items = [(name, t.detach()) for name, t in module_state.items()]
            # Under ZeRO-3 the full tensors exist only inside this gather: sent from here,
            # as collective.send's docstring asks.
            larger = total + ALIGN * (len(items) + 1)
            buckets = bucket_paths(items, [*bucket_sizes, larger], size, timer)
            buckets[str(larger)]["larger_than_model"] = True
            buckets[str(larger)]["one_bucket"] = buckets[str(larger)]["buckets"] == 1
            del items, module_state   # before the gather ends: ZeRO-3 frees the full tensors then
        out = {"zero_stage": stage, "device": str(engine.device), "export": export, "buckets": buckets}
        if stage == 3:
            try:
                engine.live_weights()
                out["live_weights"] = {"refused_under_zero3": False}
            except RuntimeError:
                out["live_weights"] = {"refused_under_zero3": True}
        else:
            live, own = engine.live_weights(), module.state_dict()
            out["live_weights"] = {
                "same_names": list(live) == list(state),
                "same_shapes": all(live[n].shape == t.shape for n, t in state.items() if n in live),
                "same_dtypes": all(live[n].dtype == t.dtype for n, t in state.items() if n in live),
                "on_engine_device": all(t.device == engine.device for t in live.values()),
                "uncopied": all(t.data_ptr() == own[n].data_ptr() for n, t in live.items())}
        return out
    finally:
        engine.close()
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def checks(stages: dict) -> dict[str, bool]:
    """Every pass/fail flag of the run, by a dotted name."""
    flags = {}
    for key, s in stages.items():
        e = s["export"]
        flags[f"{key}.export.bit_equal"] = e["bit_equal"]
        flags[f"{key}.export.names_match_module"] = e["names_match_module"]
        flags[f"{key}.export.bf16"] = e["dtypes"] == ["torch.bfloat16"]
        for name, ok in s["live_weights"].items():
            flags[f"{key}.live_weights.{name}"] = ok
        for b, r in s["buckets"].items():
            for name in ("bit_equal", "names_in_order", "views_where_unsplit", "aligned", "one_bucket"):
                if name in r:
                    flags[f"{key}.buckets.{b}.{name}"] = r[name]
    return flags


def human(n: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    require_gpu(NO_GPU, args.cpu_smoke)
    mode = "cpu_smoke" if args.cpu_smoke else "quick" if args.quick else "full"
    size = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in SIZES[mode].items()}
    if size["hidden"] % size["heads"]:
        raise SystemExit(f"gpu_weight_paths: --hidden {size['hidden']} must be a multiple of --heads {size['heads']}")
    bucket_sizes = args.bucket_bytes or BUCKETS[mode]
    from pipeline.weights.collective import ALIGN
    if min(bucket_sizes) < ALIGN:
        raise SystemExit(f"gpu_weight_paths: --bucket-bytes must be at least packing.ALIGN ({ALIGN})")
    import torch
    torch.set_num_threads(1)   # the host side of these copies is one thread; a shared box stays usable
    cuda = not args.cpu_smoke
    info = gpu_machine_info(cuda)
    timer = Timer(cuda)
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="dagrl_gpu_weight_paths_"))
    try:
        n_params = build_llama(tmp / "model", size, args.seed)
        print(f"gpu_weight_paths: {n_params / 1e6:.1f}M parameters, bf16, ZeRO {args.zero_stages}, buckets "
              f"{bucket_sizes} + one larger than the model, device {info.get('gpu', 'cpu')}", flush=True)
        stages = {f"zero{s}": stage_paths(tmp / "model", s, bucket_sizes, size, args.seed, cuda, timer)
                  for s in args.zero_stages}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    flags = checks(stages)
    params = {"quick": args.quick, "cpu_smoke": args.cpu_smoke, **size, "parameters": n_params, "dtype": "bf16",
              "zero_stages": args.zero_stages, "bucket_bytes": bucket_sizes, "seed": args.seed,
              "imports": {m: sys.modules.get(m) is not None for m in ("ray", "vllm")}}
    result = {"benchmark": "gpu_weight_paths", "machine": info, "params": params, "figures": stages,
              "checks": flags, "all_checks_passed": all(flags.values()), "not_exercised": NOT_EXERCISED,
              "wall_s": round(time.time() - t_start, 1)}
    if args.cpu_smoke:
        result["note"] = CPU_NOTE

    rows = []
    for key, s in stages.items():
        e = s["export"]
        rows.append([key, "export", e["bytes"], e["export_s"]["median"] * 1e3, e["bytes_per_s"]["median"] / 1e9,
                     f"{e['over_raw_d2h_unpinned']['median']:.2f} unpinned"
                     + (f", {e['over_raw_d2h_pinned']['median']:.2f} pinned" if cuda else ""), e["bit_equal"]])
        for b, r in s["buckets"].items():
            rows.append([key, f"buckets of {human(int(b))}: {r['buckets']}, {r['spanning_tensors']} tensors split",
                         r["bytes"], r["pack_unpack_s"]["median"] * 1e3, r["bytes_per_s"]["median"] / 1e9,
                         f"{r['over_raw_d2d']['median']:.2f} of d2d", r["bit_equal"]])
    print_table(["stage", "path", "bytes", "ms", "GB/s", "over raw copy", "bit-equal"], rows,
                title=f"gpu_weight_paths: {n_params / 1e6:.1f}M parameters, median of {size['repeats']} repeats"
                      + (" (CPU SMOKE: not GPU figures)" if args.cpu_smoke else ""))
    failed = [k for k, ok in flags.items() if not ok]
    print(f"\nchecks: {len(flags) - len(failed)}/{len(flags)} passed" + (f"; FAILED: {failed}" if failed else ""))
    print(f"not exercised: {NOT_EXERCISED}")
    path = write_result("gpu_weight_paths_cpu_smoke" if args.cpu_smoke else "gpu_weight_paths", result, args.out)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    if not main()["all_checks_passed"]:
        raise SystemExit(1)
