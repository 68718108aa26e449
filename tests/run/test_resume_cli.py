"""`python -m pipeline train --resume runs/X` on a run killed at step 3 of 6 that
named its own data (data.train, data.val): alone it continues with the run's
config; a config or data that changes what the run trained on is refused by
name, exit non-zero, the run directory untouched; --allow-change lets a change
through and records it. The rule itself: tests/run/test_resume_check.py; that
a resume continues bit for bit: tests/run/test_resume.py."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from pipeline.__main__ import main
from pipeline.config import load_config
from pipeline.core.events import load_events
from pipeline.run.driver import train
from pipeline.run.runner import PipelineError
from tests.support._procs import ROOT

pytestmark = pytest.mark.sim

RUN = ["run.steps=6", "run.checkpoint_every=2", "run.dag_mode=classic", "run.deadline_s=20", "validation.period=0",
       "sim.jitter=0", "metrics.tensorboard=false", "metrics.progress=false"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, ray_session):
    """The run directory of a sim run on its own data files, its trainer dead at step 3; step_2 its checkpoint."""
    tmp = tmp_path_factory.mktemp("resume_cli")
    (tmp / "train.jsonl").write_text("".join(f'{{"prompt": "p{i}", "answer": "{i}"}}\n' for i in range(12)))
    (tmp / "val.jsonl").write_text('{"prompt": "v", "answer": "0"}\n')
    cfg = load_config("examples/sim_grpo.yaml", [f"run.output_dir={tmp}", "run.name=k", *RUN,
                                                  f"data.train={tmp / 'train.jsonl'}", f"data.val={tmp / 'val.jsonl'}",
                                                  "inject.fault=train_exit", "inject.after=3"])
    with pytest.raises(PipelineError, match="worker trainer died"):
        train(cfg, quiet=True)
    assert sorted(p.name for p in (tmp / "k" / "checkpoints").iterdir()) == ["step_2"]
    return tmp / "k"


def copy_of(run_dir, tmp_path):
    return shutil.copytree(run_dir, tmp_path / run_dir.name)


def snapshot(run_dir) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(run_dir.rglob("*"))}


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "pipeline", "train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


class edited:
    """The file with `extra` appended (same path, other content), put back afterwards."""

    def __init__(self, path, extra: str):
        self.path, self.extra, self.was = path, extra, path.read_bytes()

    def __enter__(self):
        self.path.write_bytes(self.was + self.extra.encode())

    def __exit__(self, *exc):
        self.path.write_bytes(self.was)


def test_train_needs_a_config_or_a_run_to_resume(killed):
    done = cli()
    assert done.returncode == 2 and "error: --config is required unless --resume names a run directory" in done.stderr
    done = cli("--config", "examples/sim_grpo.yaml", "--allow-change", "data.train")
    assert done.returncode == 2 and "error: --allow-change applies to --resume only" in done.stderr
    done = cli("--resume", str(killed), "--allow-change", "data.trian")
    assert done.returncode == 2, done.stderr
    assert "error: --allow-change: unknown key 'data.trian'; did you mean 'data.train'?" in done.stderr


def test_a_changed_data_path_is_refused_by_name_and_nothing_is_moved(killed, tmp_path):
    before = snapshot(killed)
    data = killed.parent
    done = cli("--resume", str(killed), f"data.train={data / 'other.jsonl'}")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"error: cannot resume {killed / 'checkpoints' / 'step_2'}: the config or data change what the run " \
           f"trained on or with:\n  data.train was '{data / 'train.jsonl'}' in the run, the config says " \
           f"'{data / 'other.jsonl'}'\nleave the changed keys out (--resume {killed} alone continues with the run's " \
           "own config), or let it change with --allow-change data.train (docs/checkpoints-and-faults.md#resume)" \
           in done.stderr
    # The recipe without the run's data overrides (the run trained on its own files, not the recipe's default).
    done = cli("--config", "examples/sim_grpo.yaml", "--resume", str(killed))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"  data.train was '{data / 'train.jsonl'}' in the run, the config says ''\n" \
           f"  data.val was '{data / 'val.jsonl'}' in the run, the config says ''\n" in done.stderr
    assert "--allow-change data.train,data.val (" in done.stderr
    assert snapshot(killed) == before


def test_a_data_file_edited_in_place_is_refused_and_nothing_is_moved(killed):
    before = snapshot(killed)
    with edited(killed.parent / "train.jsonl", '{"prompt": "new", "answer": "1"}\n'):
        done = cli("--resume", str(killed))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "\n  data.train: its file changed since the run read it (sha256 " in done.stderr
    assert "put back the data the run read, or let it change with --allow-change data.train (" in done.stderr
    assert snapshot(killed) == before


def test_resume_alone_continues_with_the_runs_own_config(killed, tmp_path, capsys):
    run_dir = copy_of(killed, tmp_path)
    ran = yaml.safe_load((killed / "config.yaml").read_text())
    assert main(["train", "--resume", str(run_dir)]) == 0, capsys.readouterr().err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["error"], summary["start_step"], summary["steps"], summary["resume_changes"]) == (None, 2, 6, [])
    # Each attempt's config is what it ran: the killed one's with its injected fault, this one's without.
    assert yaml.safe_load((run_dir / "attempts" / "1" / "config.yaml").read_text()) == ran
    assert yaml.safe_load((run_dir / "config.yaml").read_text()) == {**ran, "inject": {**ran["inject"], "fault": "",
                                                                                      "after": 0}}
    meta = json.loads((run_dir / "checkpoints" / "step_6" / "meta.json").read_text())
    assert meta["inputs"] == json.loads((killed / "checkpoints" / "step_2" / "meta.json").read_text())["inputs"]
    assert sorted(meta["inputs"]) == ["data.train", "data.val"]


def test_allow_change_lets_an_edited_data_file_through_and_records_it(killed, tmp_path, capsys):
    run_dir = copy_of(killed, tmp_path)
    was = json.loads((killed / "checkpoints" / "step_2" / "meta.json").read_text())["inputs"]["data.train"]["sha256"]
    train_file = killed.parent / "train.jsonl"
    with edited(train_file, '{"prompt": "new", "answer": "1"}\n'):
        now = hashlib.sha256(train_file.read_bytes()).hexdigest()
        assert main(["train", "--resume", str(run_dir), "run.steps=8", "--allow-change", "data.train"]) == 0
    out = capsys.readouterr().out
    change = {"key": "data.train", "was": was, "now": now, "content": True}
    assert f"dagrl: resuming with a change (--allow-change): data.train: its file changed since the run read it " \
           f"(sha256 {was[:12]} in the run, {now[:12]} now)" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["error"], summary["start_step"], summary["steps"]) == (None, 2, 8)
    assert summary["resume_changes"] == [change]
    assert [e["resume_changes"] for e in load_events(run_dir) if e["ev"] == "run_start"] == [[change]]
    # The checkpoints after the resume record the data as this attempt read it: the next resume compares with that.
    meta = json.loads((run_dir / "checkpoints" / "step_8" / "meta.json").read_text())
    assert meta["inputs"]["data.train"]["sha256"] == now
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["steps"] == 8
    assert yaml.safe_load((run_dir / "attempts" / "1" / "config.yaml").read_text())["run"]["steps"] == 6
