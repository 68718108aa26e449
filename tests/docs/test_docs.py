"""The documentation: README.md stays a short first page, docs/results.md is
what the results files say now, and every relative link in README.md,
DESIGN.md and docs/*.md leads to a file that exists (and, into a Markdown
page, to one of its headings)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", ROOT / "DESIGN.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 300

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`+[^`\n]*`+")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The text with code blocks and code spans taken out: a link there is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """The heading anchors GitHub makes for a page: lower case, punctuation
    dropped, spaces to hyphens, a repeated one numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(FENCE.sub("", page.read_text())):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_readme_is_a_short_first_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}: move detail to docs/"
    # CI runs the README's own test command, and a newcomer's first look is these two commands.
    assert lines[:6] == ["# dagrl", "", "```",
                         "make train   # creates .venv, installs, runs the main job on the tiny CPU default",
                         "make test    # creates/updates .venv, runs the test suite", "```"]


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / target.split("#")[0]).resolve()
              for target in LINK.findall(prose((ROOT / "README.md").read_text())) if target.startswith("docs/")}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md's 'where to go next' does not link {missing}"


def test_every_relative_link_leads_somewhere():
    broken = []
    for page in PAGES:
        for target in LINK.findall(prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no file {path}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_results_page_is_what_the_results_files_say():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.tables"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = (DOCS / "results.md").read_text()
    assert page == proc.stdout, ("docs/results.md differs from benchmarks/results/*.json: "
                                 "run `.venv/bin/python -m benchmarks.tables --write`")
