"""Kill the driver with SIGKILL mid-run and resume from the latest checkpoint."""
from __future__ import annotations

import json
import subprocess
import sys

from pipeline.check import check_events, load_events

from tests._procs import ROOT, sigkill_tree, start_driver, steps_logged, wait_for


def trained(events) -> list[tuple[int, str]]:
    return [(e["step"], b) for e in events if e["ev"] == "train_start" for b in e["batches"]]


def check_halves(run_dir, steps: int, checkpoint_step: int, per_step: int) -> None:
    first = load_events(run_dir / "attempts" / "1")      # the killed attempt: never merged
    second = load_events(run_dir)
    violations = check_events(second)
    assert violations == [], "\n".join(v.message for v in violations)
    start = next(e for e in second if e["ev"] == "run_start")
    assert start["start_step"] == checkpoint_step
    # The first attempt's training past the checkpoint is lost with its weights;
    # the second retrains those steps. Together: every batch once, none lost.
    kept = [(s, b) for s, b in trained(first) if s < checkpoint_step]
    redone = trained(second)
    assert all(s >= checkpoint_step for s, _ in redone)
    batches = [b for _, b in kept + redone]
    assert len(batches) == len(set(batches)) == steps * per_step
    assert sorted({s for s, _ in kept + redone}) == list(range(steps))
    # A batch relaunched after the resume is the same prompt group: its id fixes target and generator.
    assert {b for _, b in kept + redone} == {f"t{s}.g{g}" for s in range(steps) for g in range(per_step)}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["step"] >= 0] == list(range(steps))


def test_sigkill_driver_then_resume_sim(tmp_path):
    run_dir = tmp_path / "k"
    args = ["--config", "examples/sim_grpo.yaml", f"run.output_dir={tmp_path}", "run.name=k", "run.steps=14",
            "run.checkpoint_every=3", "sim.generate_s=0.1", "sim.train_s=0.05", "metrics.progress=false"]
    log = tmp_path / "first.log"
    proc = start_driver(args, log)
    try:
        wait_for(lambda: steps_logged(run_dir) >= 8, 180, proc, "step 8", log)
    finally:
        sigkill_tree(proc)
    assert not (run_dir / "summary.json").exists()  # it died without finishing
    done = subprocess.run([sys.executable, "-m", "pipeline", "train", *args, "--resume", str(run_dir)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["error"] is None and summary["steps"] == 14
    checkpoint_step = summary["start_step"]
    assert checkpoint_step in (6, 9, 12)
    check_halves(run_dir, 14, checkpoint_step, per_step=2)
    # The final checkpoint loads: the simulated trainer's state says 14 updates.
    from pipeline.config import load_config
    from pipeline.sim import SimTrainingEngine
    engine = SimTrainingEngine(load_config("examples/sim_grpo.yaml").sim, seed=0)
    engine.load_state(str(run_dir / "checkpoints" / "step_14" / "trainer_state"))
    assert engine.updates == 14


def test_resume_refuses_what_it_cannot_use(tmp_path, capsys):
    from pipeline.__main__ import main

    def resume(run_dir, *overrides) -> str:
        assert main(["train", "--config", "examples/sim_grpo.yaml", "--resume", str(run_dir), *overrides]) == 1
        return capsys.readouterr().err

    assert "no such run directory" in resume(tmp_path / "nope")
    run_dir = tmp_path / "r"
    # Half-written: never picked, even with a plausible meta.json inside.
    (run_dir / "checkpoints" / "step_4.partial").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_4.partial" / "meta.json").write_text("{}")
    assert "no complete checkpoint" in resume(run_dir)
    bad = run_dir / "checkpoints" / "step_2"
    bad.mkdir()
    (bad / "meta.json").write_text("{not json")
    assert f"checkpoint {bad / 'meta.json'} is unreadable" in resume(run_dir)
    cfg = {"algorithm": "grpo", "backend": "sim", "grpo": {"max_age": 1, "prompts_per_step": 8, "group_size": 4},
           "generation": {"num_generators": 2}}
    (bad / "meta.json").write_text(json.dumps({"steps_done": 2, "config": cfg}))
    assert "is incomplete: missing controller/controller.json, trainer_state, policy" in resume(run_dir)
    for part in ("controller", "trainer_state", "policy"):
        (bad / part).mkdir()
    (bad / "controller" / "controller.json").write_text("[")
    assert "controller/controller.json is unreadable" in resume(run_dir)
    (bad / "controller" / "controller.json").write_text("{}")
    assert "grpo.max_age was 1 in the run, the config says 3" in resume(run_dir, "grpo.max_age=3")
    assert not (run_dir / "attempts").exists()  # nothing was moved for a resume that did not start
