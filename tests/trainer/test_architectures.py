"""The model families users train, each a random tiny model built with
transformers: Llama with grouped-query attention, Qwen2 with tied embeddings
and q/k/v biases, Qwen3 with q/k norms, Qwen3-MoE (4 experts, 2 a token).
For each: vLLM's logprobs are the trainer's at age 0 (the IS weight is 1),
before and after a refit with the weights the trainer exports, and the
trainer's checkpoint loads in transformers with the trainer's logprobs. Each
family runs in a process of its own (tests/support/architecture_check.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.support.architecture_check import FAMILIES

pytestmark = pytest.mark.real

TOL = 2e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_agrees_with_vllm_at_age_zero_across_a_refit_and_a_checkpoint(tmp_path, family):
    proc = subprocess.run([sys.executable, "-m", "tests.support.architecture_check", family, str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "measured.json").read_text())
    assert m["before"] < TOL and m["is_weight"] == pytest.approx(1.0, abs=1e-5) and m["nonfinite_skipped"] == 0
    assert m["moved"] > 1e-4          # the update changed the policy
    assert m["after_refit"] < TOL     # and vLLM serves the changed policy exactly
    assert m["checkpoint"] < TOL      # as does transformers from the checkpoint
