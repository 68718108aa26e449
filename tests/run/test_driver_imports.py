"""The driver process does not import torch: the worker modules it imports
for their actor classes load torch in the workers, where it is used. A real
backend's model check reads a tiny model's files with transformers' tokenizer
alone (pipeline/inputs/models.py); only a model those files do not settle
loads torch in the driver, on the preflight thread beside Ray's start."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _driver_modules_after(code: str, tmp_path: Path) -> list[str]:
    """Run `code` in a fresh interpreter; the heavy modules it then holds."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in ('torch', 'deepspeed', 'vllm', 'transformers') if m in sys.modules))"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.unit
def test_importing_the_cli_and_driver_loads_no_torch(tmp_path):
    assert _driver_modules_after("import pipeline.__main__, pipeline.run.driver", tmp_path) == []


@pytest.mark.sim
def test_a_simulated_run_loads_no_torch_in_the_driver(tmp_path):
    code = ("from pipeline.config import load_config\nfrom pipeline.run.driver import train\n"
            f"train(load_config({str(ROOT / 'examples/sim_grpo.yaml')!r}, ['run.steps=3', "
            f"'run.output_dir={tmp_path}', 'sim.generate_s=0', 'sim.train_s=0']), quiet=True)")
    assert _driver_modules_after(code, tmp_path) == []


@pytest.mark.unit
def test_checking_a_real_recipe_on_the_tiny_chat_model_loads_no_torch(tmp_path):
    """The whole preflight: the model's type and tokenizer, and every chat prompt rendered and counted."""
    from pipeline.inputs.tiny import build_tiny_model
    model = build_tiny_model(tmp_path / "tiny_chat", chat_template="plain")
    data = ROOT / "data/gsm8k_chat.jsonl"
    code = ("from pipeline.config import load_config\nfrom pipeline.inputs.preflight import preflight\n"
            f"cfg = load_config({str(ROOT / 'examples/gsm8k_chat.yaml')!r}, "
            f"['model.path={model}', 'data.train={data}', 'data.val={data}'])\n"
            "fitted = preflight(cfg).result(timeout=300)\n"
            "assert fitted['train'].prompts[0].token_ids, 'the chat prompts are rendered to token ids'")
    assert _driver_modules_after(code, tmp_path) == ["transformers"]
