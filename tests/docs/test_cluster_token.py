"""docs/clusters.md's token step, run as written in bash: it writes a token
that Ray reads, to ~/.ray/auth_token or to the file RAY_AUTH_TOKEN_PATH
names, readable by the user alone, and a second run keeps it. (Ray's own
`ray get-auth-token --generate` fails while RAY_AUTH_TOKEN_PATH names a
missing file.) Only Ray's command line runs; no cluster starts."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def token_step() -> str:
    blocks = re.findall(r"^```\n(.*?)^```$", (ROOT / "docs" / "clusters.md").read_text(), re.S | re.M)
    step = [b for b in blocks if "ray get-auth-token" in b]
    assert len(step) == 1, f"docs/clusters.md should have one block with the token step, found {len(step)}"
    return step[0]


def run_step(home: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
    return subprocess.run(["bash", "-e", "-c", token_step()], capture_output=True, text=True, timeout=120,
                          env={**clean, "HOME": str(home), "PATH": f"{BIN}{os.pathsep}{clean['PATH']}", **env})


@pytest.mark.parametrize("where", ["home", "RAY_AUTH_TOKEN_PATH"])
def test_the_token_step_writes_a_private_token_that_ray_reads(tmp_path, where):
    home = tmp_path / "home"
    home.mkdir()
    token_file = home / ".ray" / "auth_token" if where == "home" else tmp_path / "secrets" / "ray_token"
    env = {} if where == "home" else {"RAY_AUTH_TOKEN_PATH": str(token_file)}
    first = run_step(home, **env)
    assert first.returncode == 0, first.stderr
    token = token_file.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token), token
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    again = run_step(home, **env)
    assert again.returncode == 0 and token_file.read_text() == token, again.stderr
    if where != "home":
        assert not (home / ".ray").exists(), "the token went to ~/.ray too"
