"""Shared helpers for the benchmarks: machine info, statistics over repeats,
CPU accounting of this process tree, tables and the JSON result file.

Benchmarks measure; they do not assert. Ratios are taken within one repeat
(the compared variants run back to back), so a slow moment of the shared
machine moves both sides of a ratio together.
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

# The repository root must be importable when a script runs as `python benchmarks/x.py`.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


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


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - machine info is best effort
        return ""


def machine_info() -> dict:
    import ray
    mem = psutil.virtual_memory()
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "cpu_physical": psutil.cpu_count(logical=False),
        "cpu_logical": psutil.cpu_count(logical=True),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(mem.total / 2**30, 1),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain")),
    }


def tree_cpu() -> dict:
    """{(pid, start time): user + system CPU seconds} of this process and every
    descendant alive now: the driver, Ray's gcs_server and raylet, and every
    worker process of this local cluster. Other users' processes are not in it."""
    me = psutil.Process()
    out = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                out[(proc.pid, proc.create_time())] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


class CpuWindow:
    """Wall time and process-tree CPU time over a `with` block.

    CPU is summed per process: the change for a process alive at both ends, the
    whole CPU time of one started inside the window. A process that exits inside
    the window (an actor of an earlier measurement being killed) is left out,
    since its final CPU time cannot be read; `exited` counts them."""

    def __enter__(self) -> "CpuWindow":
        self.before, self.t0 = tree_cpu(), time.perf_counter()
        self.wall_start = time.time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.t0
        self.wall_end = time.time()
        after = tree_cpu()
        self.cpu = sum(v - self.before.get(k, 0.0) for k, v in after.items())
        self.exited = len(set(self.before) - set(after))
        self.started = len(set(after) - set(self.before))


def start_ray(num_cpus: int = 8) -> None:
    import ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # address="local": always a fresh cluster of our own, never one a `ray start` left running.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def shutdown_ray(wait_s: float = 20.0) -> list[int]:
    """ray.shutdown(), then wait for every process this cluster started to exit, so
    that the script leaves nothing behind; returns the pids still alive (none, normally)."""
    import ray
    procs = psutil.Process().children(recursive=True)
    ray.shutdown()
    _, alive = psutil.wait_procs(procs, timeout=wait_s)
    return [p.pid for p in alive]


def print_table(headers: list[str], rows: list[list], title: str = "") -> None:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if title:
        print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) >= 0.01 or x == 0 else f"{x:.2e}"
    return str(x)


def sample_load(info: dict) -> None:
    """Note the 1-minute load average now (called once per measured block)."""
    info.setdefault("loadavg_1min_samples", []).append(round(os.getloadavg()[0], 2))


def write_result(name: str, result: dict, out_dir: Path | None = None) -> Path:
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
