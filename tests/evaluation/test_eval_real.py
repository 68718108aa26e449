"""`python -m pipeline eval` on a real run's last checkpoint gives the numbers
the run's own validation gave after its last step: the same sets, seeds,
rewards and weights, one engine instead of the generator."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from pipeline.config import load_config
from pipeline.core.events import load_events
from pipeline.run.driver import train
from pipeline.tools.check import check_events

pytestmark = pytest.mark.real



def sets(data) -> str:
    return (f"validation.sets=[{{name: greedy, data: '{data}'}}, {{name: sampled, data: '{data}', n: 4, "
            "temperature: 1.0, k: [1, 2, 4], vote_on: text, correct_at: 0.01}]")


# With LoRA, eval loads the checkpoint's adapter directory over the base model it names.
@pytest.mark.parametrize("recipe", ["tiny_grpo", "tiny_grpo_lora"])
def test_eval_cli_matches_the_runs_last_validation(tmp_path, ray_session, tiny_model, recipe):
    data = tmp_path / "val.jsonl"
    data.write_text("".join(open("data/tiny_val.jsonl").readlines()[::4]))   # 16 prompts, both answers
    cfg = load_config(f"examples/{recipe}.yaml", [
        f"model.path={tiny_model}", f"run.output_dir={tmp_path}", "run.name=eval", "run.steps=1",
        "run.dag_mode=classic", "validation.period=0", "validation.at_end=true", sets(data), "run.seed=3"])
    summary = train(cfg, quiet=True)
    run_dir = tmp_path / "eval"
    assert summary["error"] is None
    violations = check_events(load_events(run_dir))
    assert violations == [], "\n".join(v.message for v in violations)
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    in_run = {k: v for k, v in last.items() if k.startswith("val/")}
    assert {"val/greedy/mean@1", "val/sampled/mean@4", "val/sampled/pass@1", "val/sampled/pass@2",
            "val/sampled/pass@4", "val/sampled/maj@4"} <= set(in_run)

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(cfg.to_dict()))
    out = tmp_path / "eval.json"
    done = subprocess.run([sys.executable, "-m", "pipeline", "eval", "--config", str(recipe), "--model",
                           str(run_dir / "checkpoints" / "step_1"), "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    offline = json.loads(out.read_text())["metrics"]
    assert offline.keys() == in_run.keys()
    assert offline == pytest.approx(in_run, abs=1e-9)
    assert 0 < in_run["val/sampled/pass@1"] < in_run["val/sampled/pass@4"], in_run   # the equality says something
    assert "val/sampled/pass@4" in done.stdout
