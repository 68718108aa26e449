"""Every repository path a page names (`dir/file.py`, `.yaml`, `.md` or
`.json`, in prose or in a command) exists: a file that moved or went leaves
no page pointing at it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "DESIGN.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path with at least one folder; not the tail of a URL, an absolute path, `~/...`, `$VAR/...` or `<name>/...`.
PATH = re.compile(r"(?<![\w/.:~<>$-])((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]+\.(?:py|yaml|md|json))(?![\w/])")
# A URL, or a Markdown link to one: the path it names is another repository's.
URL = re.compile(r"\[[^\]]*\]\([a-z][a-z0-9+.-]*://[^)\s]*\)|[a-z][a-z0-9+.-]*://\S+")
# What commands make in a checkout (git-ignored): a run's files, the models `make` builds.
MADE_BY_A_RUN = ("runs/", "models/")


def named_paths(text: str) -> set[str]:
    return {p for p in PATH.findall(URL.sub("", text)) if not p.startswith(MADE_BY_A_RUN)}


def missing_paths(page: Path) -> list[str]:
    """The paths `page` names that exist neither from the repository root nor from the page's folder."""
    return sorted(p for p in named_paths(page.read_text())
                  if not (ROOT / p).exists() and not (page.parent / p).exists())


def test_the_path_pattern_finds_repository_paths_and_skips_urls_and_run_files():
    text = ("`pipeline/run/driver.py` and examples/tiny_grpo.yaml, see https://github.com/org/repo/blob/main/x/y.py, "
            "[`trl/grpo_config.py`](https://github.com/org/trl/blob/main/trl/grpo_config.py), "
            "/shared/models/a.json, runs/tiny_grpo/summary.json, summary.json, benchmarks/results/<name>.json.")
    assert named_paths(text) == {"pipeline/run/driver.py", "examples/tiny_grpo.yaml"}


def test_a_missing_path_is_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("The trainer is in `pipeline/trainer/worker.py`; the old one was `pipeline/trainer.py`.\n")
    assert missing_paths(page) == ["pipeline/trainer.py"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_page_names_exists(page):
    missing = missing_paths(page)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"
