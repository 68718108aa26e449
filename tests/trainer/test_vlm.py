"""A vision-language policy (the tiny Qwen2-VL, pipeline/inputs/tiny_vlm.py) through
vLLM and the trainer, each in a process of its own (tests/support/vlm_check.py):
vLLM's logprobs of samples with pictures are the trainer's at age 0, before and
after a refit with the weights the trainer exports, and the trainer's checkpoint
loads in transformers with the trainer's logprobs. With model.freeze_vision the
vision tower does not move and is not exported; without, it is trained and sent."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real

TOL = 2e-5


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen_vision", "trained_vision"])
def test_a_vlm_agrees_with_vllm_at_age_zero_across_a_refit_and_a_checkpoint(tmp_path, freeze):
    proc = subprocess.run([sys.executable, "-m", "tests.support.vlm_check", str(tmp_path), str(freeze).lower()],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "measured.json").read_text())
    assert m["placeholders"] == 4           # vLLM's processor put the picture's 4 tokens in the prompt
    assert m["pictures_matter"] > 1e-3      # the trainer's logprobs depend on the pictures
    assert m["before"] < TOL and m["is_weight"] == pytest.approx(1.0, abs=1e-5) and m["nonfinite_skipped"] == 0
    assert m["moved"] > 1e-4
    assert m["after_refit"] < TOL           # vLLM serves the changed policy exactly (its picture encodings too)
    assert m["checkpoint"] < TOL
    if freeze:
        assert m["vision_moved"] == 0 and m["vision_exported"] == 0
    else:
        assert m["vision_moved"] > 1e-4 and m["vision_exported"] > 0
