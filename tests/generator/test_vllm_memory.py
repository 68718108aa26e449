"""The generator's native memory is bounded from start-up, not filled by a run's batches."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline.inputs.tiny import build_tiny_model

pytestmark = pytest.mark.real

# In its own process: oneDNN's cache and vLLM's matmul caches are process-wide,
# so engines that ran earlier in the suite would have filled them already.
NEW_BATCH_SIZES = """
import ctypes, sys
from pipeline.generator.vllm_engine import VllmGenerationEngine
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
libc = ctypes.CDLL("libc.so.6")
class MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = MallInfo
engine = VllmGenerationEngine(sys.argv[1], max_new_tokens=8, max_model_len=256)
def in_use():
    libc.malloc_trim(0)
    return libc.mallinfo2().uordblks
def walk(sizes):  # the i-th request runs i tokens, so decode meets every batch size from `sizes` down to 1
    engine._generate([TokensPrompt(prompt_token_ids=[0])] * sizes,
                     [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in range(1, sizes + 1)])
walk(8)
before = in_use()
walk(96)
print("grew_mb", (in_use() - before) / 2**20)
engine.close()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's mallinfo2")
def test_batch_sizes_the_engine_has_not_met_do_not_grow_its_heap(tmp_path):
    """vLLM's CPU linear layers build a oneDNN matmul for each batch size they
    meet. Before the bound (pipeline/core/vllm_env.py) and the start-up walk
    (VllmGenerationEngine._probe), 96 new sizes grew the tiny model's heap by
    73 MB, and a long run's generator stepped up whenever its responses'
    lengths began to vary."""
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    proc = subprocess.run([sys.executable, "-c", NEW_BATCH_SIZES, str(model)], capture_output=True, text=True,
                          timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("grew_mb")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stderr[-3000:])
    assert float(lines[0].split()[1]) < 4.0, lines
