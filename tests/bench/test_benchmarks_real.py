"""The real-stack benchmarks keep running: batching, step_profile and
trainer_efficiency on the CPU stack, and the GPU benchmarks' guards (no GPU: a
clear error; never Ray or vLLM). Structure, not speed: benchmarks measure, they do
not assert figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
STAT_KEYS = {"n", "median", "min", "max", "spread", "iqr", "values"}
MACHINE_KEYS = {"platform", "python", "ray", "cpu_physical", "cpu_logical", "memory_gib",
                "loadavg_start", "loadavg_end", "git_commit"}
# Runs a module as __main__ (as `python -m` does) with `import ray` and `import vllm` made to fail.
POISONED = ("import runpy, sys; sys.modules['ray'] = None; sys.modules['vllm'] = None; "
            "name = sys.argv[1]; sys.argv = sys.argv[1:]; "
            "runpy.run_module(name, run_name='__main__', alter_sys=True)")


def _env(**extra) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", **extra}
    env.pop("RAY_ADDRESS", None)  # the benchmark starts its own local cluster
    return env


def is_stat(x) -> bool:
    return isinstance(x, dict) and STAT_KEYS <= set(x) and x["n"] >= 1 and x["median"] is not None


def test_batching_quick_a_budget_keeps_the_loss_and_cuts_the_padding(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.batching", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"batching --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "targets" in proc.stdout
    result = json.loads((tmp_path / "batching.json").read_text())
    assert result["benchmark"] == "batching" and result["params"]["quick"] is True
    rows, *budgets = result["cases"]
    assert rows["max_tokens"] == 0 and rows["micro_batches"] == 8 and len(budgets) == 6
    for case in budgets:
        assert case["pad_token_share"] < rows["pad_token_share"] / 2, case
        assert case["loss_diff"] < 1e-6, case  # the batch's token mean, whatever the grouping
    assert [c["pad_token_share"] for c in budgets if c["packing"]] == [0.0] * 3
    assert isinstance(result["targets_met"]["pad_token_share"], bool)


def _gpu_trainer(args: list[str], tmp_path: Path, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", POISONED, "benchmarks.gpu_trainer", *args],
                          cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def test_gpu_trainer_help_needs_neither_ray_nor_vllm(tmp_path):
    proc = _gpu_trainer(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout and "bare DeepSpeed loop" in proc.stdout


def test_gpu_trainer_fails_clearly_without_a_gpu(tmp_path):
    proc = _gpu_trainer(["--quick", "--out", str(tmp_path)], tmp_path, timeout=60, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode != 0
    assert "gpu_trainer needs a CUDA GPU; none is visible" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir()), "nothing is written without a GPU"


def test_gpu_trainer_cpu_smoke_runs_without_ray_or_vllm(tmp_path):
    """The whole code path (model from a config, the worker's train_step, the bare
    loop, the JSON) on a toy size on the CPU, with Ray and vLLM unimportable."""
    proc = _gpu_trainer(["--cpu-smoke", "--out", str(tmp_path)], tmp_path, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "targets" in proc.stdout
    result = json.loads((tmp_path / "gpu_trainer_cpu_smoke.json").read_text())
    assert result["benchmark"] == "gpu_trainer" and result["params"]["cpu_smoke"] is True
    assert MACHINE_KEYS <= set(result["machine"]) and result["machine"]["ray"] is None
    assert result["params"]["imports"] == {"ray": False, "vllm": False}
    for side in ("worker", "bare"):
        f = result["figures"][side]
        assert is_stat(f["step_s"]) and is_stat(f["tokens_per_s"]) and is_stat(f["response_tokens_per_s"])
    assert is_stat(result["figures"]["worker_over_bare"]["tokens_per_s"])
    assert [t["met"] for t in result["targets"]] == [False, False], "a CPU smoke run meets no GPU target"


def _gpu_weight_paths(args: list[str], timeout: float = 60, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", POISONED, "benchmarks.gpu_weight_paths", *args],
                          cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def test_gpu_weight_paths_help_needs_neither_ray_nor_vllm():
    proc = _gpu_weight_paths(["--help"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout and "--cpu-smoke" in proc.stdout and "NCCL path" in proc.stdout


def test_gpu_weight_paths_fails_clearly_without_a_gpu(tmp_path):
    proc = _gpu_weight_paths(["--quick", "--out", str(tmp_path)], CUDA_VISIBLE_DEVICES="")
    assert proc.returncode != 0
    assert "gpu_weight_paths needs a CUDA GPU; none is visible" in proc.stderr
    assert "--cpu-smoke" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir()), "nothing is written without a GPU"


def test_gpu_weight_paths_cpu_smoke_runs_without_ray_or_vllm(tmp_path):
    """Export at ZeRO 0 and 3, live weights, and weight_sync's bucket layout
    packed and unpacked on CPU tensors at a toy size: every check bit-equal.
    The 60 s timeout is the budget (about 12 s on a 2-core machine)."""
    proc = _gpu_weight_paths(["--cpu-smoke", "--out", str(tmp_path)])
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "gpu_weight_paths_cpu_smoke.json").read_text())
    assert result["benchmark"] == "gpu_weight_paths" and result["params"]["cpu_smoke"] is True
    assert "not GPU figures" in result["note"] and "two GPUs" in result["not_exercised"]
    machine = result["machine"]
    assert MACHINE_KEYS <= set(machine) and machine["ray"] is None and machine["device"] == "cpu"
    assert {"torch", "deepspeed", "git_dirty"} <= set(machine)
    assert result["params"]["imports"] == {"ray": False, "vllm": False}
    checks = result["checks"]
    assert checks and all(checks.values()) and result["all_checks_passed"] is True, checks
    stages = result["figures"]
    assert set(stages) == {"zero0", "zero3"}
    for key, stage in stages.items():
        export = stage["export"]
        assert export["bit_equal"] is True and export["dtypes"] == ["torch.bfloat16"], key
        assert is_stat(export["bytes_per_s"]) and is_stat(export["over_raw_d2h_unpinned"]), key
        assert export["over_raw_d2h_pinned"] is None, "no pinned memory without CUDA"
        buckets = stage["buckets"]
        assert len(buckets) == 3 and all(b["bit_equal"] for b in buckets.values()), key
        assert all(is_stat(b["over_raw_d2d"]) for b in buckets.values()), key
        # The layout's cases all ran: tensors split over buckets, and the whole model in one.
        assert buckets["4096"]["spanning_tensors"] > 0 and buckets["4096"]["views"] > 0, key
        (larger,) = [b for b in buckets.values() if b.get("larger_than_model")]
        assert larger["buckets"] == 1 and larger["bucket_bytes"] > export["bytes"], key
    assert all(stages["zero0"]["live_weights"].values()), stages["zero0"]["live_weights"]
    assert stages["zero3"]["live_weights"] == {"refused_under_zero3": True}


def test_step_profile_reads_a_real_run(tmp_path):
    """benchmarks.step_profile on a short real run: the step chain, the spans
    inside the leaves and the start-up phases all come out of the event log.
    (The sync run is the same reading of another schedule: left to the benchmark.)"""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", "--steps", "6", "--modes", "async",
                           "--out", str(tmp_path)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"step_profile failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "step_profile.json").read_text())
    assert result["benchmark"] == "step_profile" and MACHINE_KEYS <= set(result["machine"])
    assert list(result["runs"]) == ["async"]
    run = result["runs"]["async"]
    chain = run["chain_s"]
    for node in ("sample", "train", "validation_gate", "refit", "validate", "resume", "collect"):
        assert chain[node] is not None and chain[f"gap before {node}"] is not None, node
    assert 0 < chain["step (collect to collect)"] and 0 < chain["dispatch total"] < chain["step (collect to collect)"]
    spans = run["spans_s"]
    assert {"vllm.requests", "vllm.step", "vllm.completions", "reward", "table"} <= set(spans["rollout"])
    assert "vllm.reload_weights" not in spans["rollout"]  # the engine loop ran it for the refit
    assert {"weights.get", "drain", "vllm.reload_weights", "vllm.reset_prefix_cache"} <= set(spans["refit"])
    assert {"batch.get", "train.forward", "train.backward", "train.optimizer", "weights.put"} <= set(spans["train"])
    assert {"buffer.take", "batch.put"} <= set(spans["sample"])
    startup = run["startup_s"]
    assert 0 < startup["launch to train() (interpreter, imports, config)"] < startup["launch to first step"]
    assert {"gen0: import vllm", "gen0: vllm.start", "trainer: deepspeed.start", "driver: ray_init"} <= set(startup)


def test_trainer_efficiency_quick_times_both_sides_at_one_and_two_ranks(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.trainer_efficiency", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"trainer_efficiency --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "trainer_efficiency_quick.json").read_text())
    assert result["benchmark"] == "trainer_efficiency" and result["quick"] is True
    assert [(c["size"], c["dtype"], c["ranks"]) for c in result["cases"]] == [("tiny", "fp32", 1), ("tiny", "fp32", 2)]
    for case in result["cases"]:
        assert case["worker_step_s"] > 0 and case["bare_step_s"] > 0 and len(case["ratios"]) == 2, case
    assert [t["met"] for t in result["targets"]] == [c["worker_over_bare"] <= 1.1 for c in result["cases"]]
