"""The fitted tiny models come out the same bytes on every x86 CPU
(pipeline/inputs/portable_fit.py): other CPUs are imitated here by capping the
instruction sets the kernels may use and by the thread count."""
from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What `make` builds, as model_digest reads it: models/tiny and models/tiny_chat (random, so plain RNG:
# the chat template is not in the digest's files), models/tiny_rm, models/tiny_tool and models/tiny_game.
TINY_DIGEST = "2bed0ac384fe274256d303218e4aeba1e4f8606cfd19b71b302c2fd92bd43772"
TINY_RM_DIGEST = "2fe6f041d0b6036dfaec0da959d4b3e2dc99a68369dd3a729320bc9e7dbe788c"
# The warmed-up models `make` builds (pipeline/trainer/warmup.py), by task: the env, the digest.
WARMUP_MODELS = {
    "tool": ("pipeline.envs.calculator:CalculatorEnv",
             "162a816b6693976077f4ed1097c906c54dd12cb071262b86ab6d8aa8935217df"),
    "game": ("pipeline.envs.digit_game:DigitGuessEnv",
             "d006d7a492a50d845a692703cfc0db115d5db8d30d2f52aa99114b71d8d3df72"),
}
# Each imitates another x86 CPU: ATen's kernels at AVX2 (where this one's are AVX-512), oneDNN's and MKL's at
# AVX2, two threads. Not ATen's scalar kernels (ATEN_CPU_CAPABILITY=default, a CPU without AVX2): see portable_fit.
SETTINGS = {
    "this CPU": ({}, 1),
    "ATen AVX2": ({"ATEN_CPU_CAPABILITY": "avx2"}, 1),
    "oneDNN AVX2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, 1),
    "MKL AVX2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, 1),
    "two threads": ({}, 2),
}
# A short fit in a fresh process: the digest of what it saves, and the bytes of one float32
# forward pass of it, which shows that the setting reached the kernels.
SHORT_FIT = """
import hashlib, random, sys, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from pipeline.inputs.tiny import model_digest
from pipeline.inputs.tiny_reward_model import build_tiny_reward_model, made_up_sample
out, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
build_tiny_reward_model(out, steps=24)
tokenizer = AutoTokenizer.from_pretrained(out)
rng = random.Random(5)
enc = tokenizer([made_up_sample(rng, tokenizer)[0] for _ in range(64)], padding=True, return_tensors="pt")
with torch.no_grad():
    scores = AutoModelForSequenceClassification.from_pretrained(out)(**enc).logits
print(model_digest(out), hashlib.sha256(scores.numpy().tobytes()).hexdigest())
"""


def _short_fit(out: Path, env: dict, threads: int) -> tuple[str, str]:
    run = subprocess.run([sys.executable, "-c", SHORT_FIT, str(out), str(threads)], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    digest, scores = run.stdout.split()[-2:]
    return digest, scores


@pytest.mark.unit
def test_every_step_rounds_away_tiny_differences_and_the_fit_ends_in_float32():
    import torch

    from pipeline.inputs.portable_fit import GRID, STATE_BITS, portable_fit
    torch.manual_seed(0)
    inputs, targets = torch.randn(32, 16, dtype=torch.float64), torch.randn(32, 1, dtype=torch.float64)
    fitted = []
    for nudge in (0.0, 1e-13, -1e-13):  # a gradient as another CPU's kernels might round it
        torch.manual_seed(1)
        model = torch.nn.Linear(16, 1)
        threads = torch.get_num_threads()
        with portable_fit(model, lambda params: torch.optim.AdamW(params, lr=1e-2)) as optimizer:
            assert torch.get_num_threads() == 1 and model.weight.dtype == torch.float64
            for _ in range(20):
                optimizer.zero_grad()
                ((model(inputs) - targets) ** 2).mean().backward()
                for p in model.parameters():
                    p.grad.add_(p.grad.flip(-1) * nudge)
                optimizer.step()
            moments = optimizer.state[model.weight]["exp_avg_sq"].clone()
        assert torch.get_num_threads() == threads and model.weight.dtype == torch.float32
        fitted.append((model.weight.detach().clone(), moments))
    assert all(torch.equal(w, fitted[0][0]) and torch.equal(m, fitted[0][1]) for w, m in fitted)
    weight, moments = fitted[0]
    assert torch.equal(weight.double() / GRID, torch.round(weight.double() / GRID))
    mantissa, _ = torch.frexp(moments)
    assert torch.equal(mantissa * 2 ** STATE_BITS, torch.round(mantissa * 2 ** STATE_BITS))


@pytest.mark.unit
@pytest.mark.parametrize("chat_template", [None, "plain", "tools"])
def test_the_random_tiny_models_make_builds_have_the_pinned_digest(tmp_path, chat_template):
    from pipeline.inputs.tiny import build_tiny_model, model_digest
    assert model_digest(build_tiny_model(tmp_path / "tiny", chat_template=chat_template)) == TINY_DIGEST


@pytest.mark.real
def test_a_fit_saves_the_same_bytes_whatever_kernels_and_threads_compute_it(tmp_path):
    # Two fits at a time: each is its own process, so a neighbour cannot change its arithmetic.
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_short_fit, tmp_path / name.replace(" ", "_"), env, threads)
                   for name, (env, threads) in SETTINGS.items()}
        results = {name: future.result() for name, future in futures.items()}
    assert len({digest for digest, _ in results.values()}) == 1, results
    if _beyond_avx2():
        # The settings do change the arithmetic: a float32 forward pass is not the same bytes under all
        # of them. On a CPU whose best is AVX2 the caps change nothing (seen with two threads too).
        assert len({scores for _, scores in results.values()}) > 1, results


def _beyond_avx2() -> bool:
    with open("/proc/cpuinfo") as f:
        return "avx512f" in f.read().split()


def _pipeline(*args: str) -> None:
    run = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.real
def test_the_tiny_reward_model_make_builds_has_the_pinned_digest(tmp_path):
    from pipeline.inputs.tiny import model_digest
    out = tmp_path / "tiny_rm"
    _pipeline("build-tiny", "--out", str(out), "--reward-model")
    assert model_digest(out) == TINY_RM_DIGEST


@pytest.mark.real
def test_the_warmed_up_tool_model_make_builds_has_the_pinned_digest(tool_model):
    """tests/conftest.py builds it with the Makefile's command; the multi-turn tests train it."""
    from pipeline.inputs.tiny import model_digest
    assert model_digest(tool_model) == WARMUP_MODELS["tool"][1]


@pytest.mark.real
def test_the_warmed_up_game_model_make_builds_has_the_pinned_digest(tmp_path, tiny_model):
    from pipeline.inputs.tiny import model_digest
    env_class, digest = WARMUP_MODELS["game"]
    out = tmp_path / "tiny_game"
    # The Makefile's command for models/tiny_game.
    _pipeline("warmup", "--model", str(tiny_model), "--env", env_class, "--data", "data/game_train.jsonl",
              "--val", "data/game_val.jsonl", "--out", str(out), "--seed", "0")
    assert model_digest(out) == digest
