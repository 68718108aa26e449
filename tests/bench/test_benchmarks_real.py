"""The real-stack benchmarks keep running: e2e_tiny in its quick mode (vLLM-CPU +
DeepSpeed-CPU, sync and async) and gpu_trainer's guards (no GPU: a clear
error; never Ray or vLLM). Structure, not speed: benchmarks measure, they do
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
BREAKDOWN = {"sample_s", "train_s", "validation_gate_s", "drain_s", "load_s", "validate_s", "resume_s",
             "collect_s", "other_s", "validation_s", "exposed_generation_s", "hidden_generation_s"}
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


def test_e2e_tiny_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.e2e_tiny", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"e2e_tiny --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "targets" in proc.stdout and "per-step time breakdown" in proc.stdout, "the script prints its tables"
    result = json.loads((tmp_path / "e2e_tiny.json").read_text())
    assert result["benchmark"] == "e2e_tiny"
    assert MACHINE_KEYS <= set(result["machine"])
    params = result["params"]
    assert params["quick"] is True and params["steps_per_run"] == 3 and params["repeats"] == 1
    assert params["max_ages"] == {"sync": 0, "async": 1}
    figures = result["figures"]
    for mode in ("sync", "async"):
        f = figures[mode]
        for key in ("steady_step_time_s", "steps_wall_s", "startup_s", "generated_tokens_per_s_engine",
                    "generated_tokens_per_s_pipeline", "trainer_tokens_per_s", "reward_last_window"):
            assert is_stat(f[key]), (mode, key)
        assert f["generated_tokens_per_s_engine"]["median"] > 0 and f["trainer_tokens_per_s"]["median"] > 0
        assert BREAKDOWN <= set(f["breakdown_s"]) and all(is_stat(v) for v in f["breakdown_s"].values())
        assert {"time_to_threshold_s", "steps_to_threshold", "reached_threshold"} <= set(f)
    for key in ("steady_step_time", "steps_wall", "trainer_tokens_per_s"):
        assert is_stat(figures["async_over_sync"][key]), key
    assert "time_to_threshold" in figures["async_over_sync"]
    (target,) = result["targets"]
    assert target["limit"] == 0.7 and isinstance(target["met"], bool)
    for mode, max_age in (("sync", 0), ("async", 1)):
        (run,) = result["runs"][mode]
        steps = run["per_step"]
        assert [s["step"] for s in steps] == [0, 1, 2] and len(run["rewards"]) == 3
        # The two modes really differ: after step 0, async trains on batches one version old.
        assert [s["age_mean"] for s in steps[1:]] == [float(max_age)] * 2, (mode, steps)
        for s in steps:
            # The step's parts (a chain of nodes with one generator) account for its span.
            parts = sum(s[k] for k in ("sample_s", "train_s", "validation_gate_s", "drain_s", "load_s",
                                       "validate_s", "resume_s", "collect_s", "other_s"))
            assert parts == pytest.approx(s["span_s"], abs=0.05), s
            assert 0 < s["span_s"] <= s["step_time_s"] + 0.05, s   # inside the driver's window for the step
            assert s["response_tokens"] > 0 and s["train_s"] > 0
        assert run["failed_rollouts"] == 0


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
