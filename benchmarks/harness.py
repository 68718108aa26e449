"""What every benchmark shares to run and to record: a local Ray started and
stopped, an engine's config and a generation engine's requests run to the
end (the engine tests use both too), machine info (platform, versions,
cores, memory, commit, a dirty tree, load average), statistics over
repeats, tables, and the JSON result file in benchmarks/results.

Benchmarks measure; they do not assert. Ratios are taken within one repeat
(the compared variants run back to back), so a slow moment of the shared
machine moves both sides of a ratio together.

Nothing here imports Ray, torch or vLLM at import time: the GPU benchmarks
must start without Ray or vLLM.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


def engine_config(model_dir, *overrides: str):
    """A real run's config for a DeepSpeed engine built on `model_dir` alone, with
    `overrides` (dotted keys, as on the command line); an engine reads no data, so
    the data keys hold placeholders."""
    from pipeline.config import load_config
    return load_config(None, [f"model.path={model_dir}", "data.train=unread.jsonl", "data.reward=unread:reward",
                              *overrides])


def sample_all(engine, prompts: list, seeds: list[list[int]]) -> list[list]:
    """len(seeds[i]) completions of prompt i, sample j drawn with seeds[i][j], on an idle
    generation engine (pipeline/core/types.py). One request per sample, each with its own
    seed: vLLM seeds a request of n samples with seed, seed + 1, ..., so n > 1 would let
    the streams of two requests overlap (the shared prompt is computed once anyway)."""
    if len(seeds) != len(prompts):
        raise ValueError(f"sample: {len(seeds)} seed lists for {len(prompts)} prompts")
    flat = _run_all(engine, [(f"s{i}.{j}", p, seed) for i, (p, group) in enumerate(zip(prompts, seeds))
                             for j, seed in enumerate(group)])
    it = iter(flat)
    return [[next(it) for _ in group] for group in seeds]


def greedy_all(engine, prompts: list) -> list:
    """One greedy completion per prompt, on an idle generation engine."""
    return _run_all(engine, [(f"g{i}", p, None) for i, p in enumerate(prompts)])


def _run_all(engine, requests: list[tuple]) -> list:
    """Add the (key, prompt, seed) requests, step until all are done; completions in request order."""
    if engine.busy():
        raise RuntimeError("the engine must be idle: requests of another caller are in flight")
    for key, prompt, seed in requests:
        engine.add(key, prompt, seed)
    done = {}
    try:
        while engine.busy():
            done.update(engine.step())
    finally:
        engine.abort_all()
    return [done[key] for key, _, _ in requests]


# --- reading runs and summarising repeats ---------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def event_log_epoch(summary: dict, events: list[dict]) -> float:
    """The epoch seconds at which a run's event-log `t` is 0 (to a millisecond): the
    driver's `startup` event holds to_first_step_s, counted from the summary's
    train_entered_at, and was logged at that moment."""
    startup = next(e for e in events if e["ev"] == "startup")
    return summary["train_entered_at"] + startup["to_first_step_s"] - startup["t"]


def startup_phases(events: list[dict], summary: dict, launched: float) -> dict:
    """Seconds from process launch (`launched`, epoch) to a run's first step, the
    driver's phases, and what each worker spent starting (its set-up spans)."""
    phases = dict(summary["startup"])
    out = {"launch to first step": round(summary["train_entered_at"] + phases["to_first_step_s"] - launched, 3),
           "launch to train() (interpreter, imports, config)": round(summary["train_entered_at"] - launched, 3),
           **{f"driver: {k[:-2]}": v for k, v in phases.items() if k != "to_first_step_s"}}
    # Worker times count from the event log's start: Ray is up and the run directory made.
    for e in events:
        if e["ev"] == "worker_start":
            out[f"{e['worker']}: process up"] = round(e["t"], 3)
        if e["ev"] == "worker_ready":
            for name, seconds in e["spans"].items():
                out[f"{e['worker']}: {name}"] = round(seconds, 3)
            out[f"{e['worker']}: ready"] = round(e["t"], 3)
    out["prologue and first dispatch"] = round(next(e["t"] for e in events if e["ev"] == "startup") - max(
        e["t"] for e in events if e["ev"] == "worker_ready"), 3)
    return out


def first_crossing(rewards: list[float], threshold: float, window: int) -> int | None:
    """The first step k >= window - 1 whose mean of rewards[k - window + 1 .. k] is >= threshold."""
    for k in range(window - 1, len(rewards)):
        if sum(rewards[k - window + 1:k + 1]) / window >= threshold:
            return k
    return None


def stats(values: list[float]) -> dict:
    """Median and spread of one figure over repeats (or over steps)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None, "spread": None, "values": []}
    q = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else [vals[0]] * 3
    return {"n": len(vals), "median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "spread": max(vals) - min(vals), "iqr": q[2] - q[0],
            "values": [round(v, 6) for v in vals]}


def median_with_never(values: list[int | None]) -> float | None:
    """The median, a seed that never got there (None) counting as infinitely many
    steps; None when the median itself is never."""
    if not values:
        return None
    mid = statistics.median(float("inf") if v is None else v for v in values)
    return None if mid == float("inf") else mid


# --- machine info ------------------------------------------------------------------------------

def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - machine info is best effort
        return ""


def machine_info(ray: bool = True) -> dict:
    """The machine and the checkout a result was taken on. ray=False: Ray is not
    imported (its version is None), for the benchmarks that must run without it."""
    version = None
    if ray:
        import ray as ray_module
        version = ray_module.__version__
    mem = psutil.virtual_memory()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "ray": version,
        "cpu_physical": psutil.cpu_count(logical=False),
        "cpu_logical": psutil.cpu_count(logical=True),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(mem.total / 2**30, 1),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain")),
    }


def gpu_machine_info(cuda: bool) -> dict:
    """machine_info without Ray, plus torch, DeepSpeed and transformers and, with
    cuda, the GPU (the GPU benchmarks)."""
    import deepspeed
    import torch
    import transformers
    info = {**machine_info(ray=False),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "device": "cpu"}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device="cuda", gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    gpu_capability=f"{props.major}.{props.minor}", gpu_count=torch.cuda.device_count(),
                    cudnn=torch.backends.cudnn.version())
    return info


def require_gpu(no_gpu: str, cpu_smoke: bool) -> None:
    """A GPU benchmark's start: exit 1 with `no_gpu` and how to go on where no CUDA
    GPU is visible; under --cpu-smoke, the CPU even where a GPU is visible."""
    if not cpu_smoke:
        import torch
        if not torch.cuda.is_available():
            print(f"{no_gpu} (torch {torch.__version__}, CUDA build {torch.version.cuda}, "
                  f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). "
                  "Run it on a machine with an NVIDIA GPU, or use --cpu-smoke to check the code path only.",
                  file=sys.stderr)
            raise SystemExit(1)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""   # the CPU even where a GPU is visible (the engine asks torch)
        os.environ["DS_ACCELERATOR"] = "cpu"   # read when deepspeed picks its accelerator
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def sample_load(info: dict) -> None:
    """Note the 1-minute load average now (called once per measured block)."""
    info.setdefault("loadavg_1min_samples", []).append(round(os.getloadavg()[0], 2))


# --- a local Ray -------------------------------------------------------------------------------

def start_ray(num_cpus: int = 8) -> None:
    import ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # address="local": always a fresh cluster of our own, never one a `ray start` left running.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def shutdown_ray(wait_s: float = 20.0) -> list[int]:
    """ray.shutdown(), then wait for every process this cluster started to exit, so
    that the script leaves nothing behind (called in a finally: an error included);
    returns the pids still alive (none, normally), named in a warning on stderr."""
    import ray
    procs = psutil.Process().children(recursive=True)
    ray.shutdown()
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    left = [p.pid for p in alive]
    if left:
        print(f"warning: Ray processes still running after shutdown: {left}", file=sys.stderr)
    return left


# --- tables and the result file ----------------------------------------------------------------

def print_table(headers: list[str], rows: list[list], title: str = "") -> None:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if title:
        print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def print_targets(targets: list[dict], title: str = "targets") -> None:
    """The targets table: each target's text, its value, and whether it was met."""
    print_table(["target", "value", "met"], [[t["target"], t["value"], t["met"]] for t in targets], title=title)


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) >= 0.01 or x == 0 else f"{x:.2e}"
    return str(x)


def write_result(name: str, result: dict, out_dir: Path | None = None) -> Path:
    """result as out_dir/name.json (default benchmarks/results), written whole or
    not at all; result["machine"] gets the load average at the end and a summary
    of the samples taken during."""
    out_dir = Path(out_dir) if out_dir is not None else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    info = result["machine"]
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    samples = info.get("loadavg_1min_samples", [])
    if samples:
        info["loadavg_1min_during"] = {"median": statistics.median(samples), "max": max(samples)}
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    return path
