"""A recipe whose model is missing: when it is one of the tiny models the
Makefile builds (models/tiny, tiny_chat, tiny_rm, tiny_tool, tiny_game), the
error says the make command that builds it."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.__main__ import main
from pipeline.inputs.models import ModelError, check_model_files

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """A working directory with the repository's Makefile, recipes and data, and no models/."""
    for name in ("Makefile", "examples", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def train_error(capsys, *argv: str) -> str:
    code = main(["train", "--config", *argv])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert not Path("runs").exists(), "the model is checked before runs/<name> is made"
    return err


def test_a_missing_model_that_make_builds_says_the_make_command(checkout, capsys):
    err = train_error(capsys, "examples/gsm8k_chat.yaml")
    assert ("error: model.path: model directory 'models/tiny_chat' does not exist (relative to the working "
            f"directory '{checkout}'); build it with `make models/tiny_chat/config.json`") in err, err


def test_every_model_the_makefile_builds_gets_its_make_command(checkout):
    for name in ("tiny", "tiny_chat", "tiny_rm", "tiny_tool", "tiny_game"):
        for path in (f"models/{name}", f"./models/{name}/", checkout / "models" / name):
            with pytest.raises(ModelError, match=f"; build it with `make models/{name}/config.json`$"):
                check_model_files(path)


@pytest.mark.parametrize("path", ["models/mine", "/nowhere/models/tiny_chat"])
def test_a_missing_model_the_makefile_does_not_build_has_no_make_command(checkout, capsys, path):
    err = train_error(capsys, "examples/gsm8k_chat.yaml", f"model.path={path}")
    assert "does not exist" in err and "build it" not in err, err
