"""The examples in README.md, DESIGN.md and docs/*.md work as written, as far
as can be told without running a job:

- a ```yaml block loads as a recipe; one with `<!-- fragment of RECIPE -->`
  on the line above it loads merged over that recipe;
- a `python -m pipeline ...` command line (a line of a plain or shell code
  block, or a code span with arguments) parses, and the recipe it names loads with its
  overrides; a code span that stops at the subcommand names one that exists;
- a `make ...` command names a Makefile target, and `RECIPE=...` a recipe
  that loads;
- a dotted override in a code span of prose (`schedule.max_age=2`) is a key
  of `python -m pipeline config-table`.

A code block a reader must edit before it runs has `<!-- not checked: why -->`
on the line above it, and footnotes quote other projects' settings: both are
listed one by one with their reason (NOT_CHECKED), never left out silently."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pipeline.__main__ import build_parser
from pipeline.config import ConfigError, load_config
from pipeline.tools.config_table import reference_table

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "DESIGN.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`]+)`")  # a span may wrap onto the next line
MARKER = re.compile(r"^<!--\s*(?:not checked:\s*(?P<skip>.+?)|fragment of\s+(?P<base>\S+))\s*-->\s*$")
FOOTNOTE = re.compile(r"^\[\^[^\]]+\]:")
OVERRIDE = re.compile(r"^[a-z_]\w*(?:\.\w+)+=\S*$")
# A command's start: `make` opening a shell command, or a python running `-m pipeline`.
MAKE = re.compile(r"(?:^|&&|;)\s*(?:[A-Z_]+=\S+\s+)*make\b")
PIPELINE = re.compile(r"\bpython[\d.]*\s+-m\s+pipeline\b")


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    kind: str  # "yaml", "command" (a code block's line), "span" (a code span's command), "override"
    text: str
    skip: str = ""
    base: str = ""  # the recipe a yaml fragment belongs to

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _commands(body: str) -> list[tuple[int, str]]:
    """A code block's command lines (backslash continuations joined) with their offset in the block."""
    out, start, parts = [], 0, []
    for i, line in enumerate(body.splitlines()):
        if not parts:
            start = i
        parts.append(line.rstrip("\\").rstrip())
        if not line.endswith("\\"):
            text = " ".join(parts)
            if MAKE.search(text) or PIPELINE.search(text):
                out.append((start, text))
            parts = []
    return out


def examples(page: Path, text: str | None = None) -> list[Example]:
    """What `page` shows that can be checked; `text` stands in for its contents in tests."""
    text = page.read_text() if text is None else text
    name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name
    lines = text.splitlines()
    found, prose = [], text
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        marker = MARKER.match(lines[line - 2]) if line > 1 else None
        said = marker.groupdict(default="") if marker else {"skip": "", "base": ""}
        skip = said["skip"]
        lang, body = m.group(1), m.group(2)
        if lang == "yaml":
            found.append(Example(name, line, "yaml", body, skip, said["base"]))
        elif lang in ("", "sh", "bash", "shell"):
            found += [Example(name, line + 1 + i, "command", cmd, skip) for i, cmd in _commands(body)]
        prose = prose.replace(m.group(0), "\n" * m.group(0).count("\n"))
    for m in CODE_SPAN.finditer(prose):
        n, span = prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())
        skip = "a footnote quotes another project's settings" if FOOTNOTE.match(lines[n - 1]) else ""
        if OVERRIDE.match(span):
            found.append(Example(name, n, "override", span, skip))
        elif MAKE.search(span) or PIPELINE.search(span):
            found.append(Example(name, n, "span", span, skip))
    return found


def _merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def yaml_problem(block: str, base: str, tmp: Path) -> str:
    """Why the recipe block (merged over the recipe `base`, if any) does not load ('' when it does)."""
    try:
        tree = yaml.safe_load(block)
    except yaml.YAMLError as exc:
        return f"not valid YAML: {exc}"
    if not isinstance(tree, dict):
        return "not a mapping of recipe sections"
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_merged(yaml.safe_load((ROOT / base).read_text()), tree) if base else tree))
    try:
        load_config(recipe)
    except ConfigError as exc:
        hint = "" if base else " (a fragment of a recipe: put `<!-- fragment of examples/NAME.yaml -->` above it)"
        return str(exc).replace(f"{recipe}: ", "") + hint
    return ""


def makefile_targets() -> set[str]:
    rule = re.compile(r"^([^\s#.$][^:=]*?)\s*:(?!=)", re.M)
    return {t for m in rule.finditer((ROOT / "Makefile").read_text()) for t in m.group(1).split()}


def _pipeline_problem(argv: list[str], names_only: bool) -> str:
    parser = build_parser()
    if names_only and len(argv) <= 1:
        commands = next(a.choices for a in parser._subparsers._group_actions)
        return "" if not argv or argv[0] in commands else f"no subcommand {argv[0]!r}; there are {sorted(commands)}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    if getattr(args, "config", None) is None:
        return ""
    return _recipe_problem(args.config, args.overrides)


def _recipe_problem(path: str, overrides: list[str] = ()) -> str:
    try:
        load_config(ROOT / path, overrides)
    except ConfigError as exc:
        return str(exc)
    return ""


def command_problem(command: str, names_only: bool = False) -> str:
    """Why a shell command line does not parse ('' when every part does). `names_only`:
    a code span of prose, where `python -m pipeline train` names the subcommand."""
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError as exc:
        return f"not a shell command: {exc}"
    problems, segment = [], []
    for token in [*tokens, "&&"]:
        if token not in ("&&", ";", "||", "|"):
            segment.append(token)
            continue
        env = {}
        while segment and re.match(r"^[A-Z_]+=", segment[0]):
            key, value = segment.pop(0).split("=", 1)
            env[key] = value
        if segment[:1] == ["make"]:
            missing = [t for t in segment[1:] if not t.startswith("-") and t not in makefile_targets()]
            problems += [f"the Makefile has no target {t!r}" for t in missing]
            if "RECIPE" in env:
                problems.append(_recipe_problem(env["RECIPE"]))
        for i in range(len(segment) - 2):
            if re.fullmatch(r"\S*python[\d.]*", segment[i]) and segment[i + 1:i + 3] == ["-m", "pipeline"]:
                problems.append(_pipeline_problem(segment[i + 3:], names_only))
        segment = []
    return "; ".join(p for p in problems if p)


def config_keys() -> set[str]:
    return set(re.findall(r"^\| `([^`]+)`", reference_table(), re.M))


def override_problem(override: str) -> str:
    key = override.split("=", 1)[0]
    return "" if key in config_keys() else f"{key!r} is not a config key (python -m pipeline config-table)"


def problem(example: Example, tmp: Path) -> str:
    if example.kind == "yaml":
        return yaml_problem(example.text, example.base, tmp)
    if example.kind == "override":
        return override_problem(example.text)
    return command_problem(example.text, names_only=example.kind == "span")


EXAMPLES = [e for page in PAGES for e in examples(page)]
_QUOTED = "a footnote quotes another project's settings"
NOT_CHECKED = [("docs/your-model-and-data.md", "actor.optim.lr=1e-6", _QUOTED),
               ("docs/your-model-and-data.md", "data.train_batch_size=1024", _QUOTED),
               ("docs/your-model-and-data.md", "rollout.n=5", _QUOTED),
               ("docs/your-model-and-data.md", "rollout.n=5", _QUOTED)]


def test_the_pages_have_examples_of_every_kind():
    assert {e.kind for e in EXAMPLES} == {"yaml", "command", "span", "override"}


def test_a_broken_example_of_each_kind_is_found(tmp_path):
    page = ROOT / "docs" / "made_up.md"
    text = ("Set `schedule.max_agee=2` or run `python -m pipeline trian`.\n\n"
            "```yaml\nschedule:\n  max_age: -1\n```\n\n"
            "```\n.venv/bin/python -m pipeline train --config examples/tiny_grpo.yaml \\\n"
            "    schedule.max_agee=0   # a comment\nRECIPE=examples/nope.yaml make trian\n"
            ".venv/bin/python -m pipeline viz examples/tiny_grpo.yaml\n```\n")
    found = examples(page, text)
    assert [(e.kind, e.line) for e in found] == [("yaml", 3), ("command", 9), ("command", 11), ("command", 12),
                                                 ("override", 1), ("span", 1)]
    problems = [problem(e, tmp_path) for e in found]
    assert "schedule.max_age: -1 is out of range" in problems[0]
    assert "unknown key 'schedule.max_agee'" in problems[1]
    assert "no target 'trian'" in problems[2] and "examples/nope.yaml' does not exist" in problems[2]
    assert "the following arguments are required: --config" in problems[3]
    assert "'schedule.max_agee' is not a config key" in problems[4]
    assert "no subcommand 'trian'" in problems[5]


def test_the_markers_above_a_block_and_a_footnote_are_read():
    page = ROOT / "docs" / "made_up.md"
    text = ("<!-- not checked: your own recipe -->\n```\npython -m pipeline train --config my.yaml\n```\n\n"
            "<!-- fragment of examples/tiny_grpo.yaml -->\n```yaml\nrun:\n  steps: 2\n```\n\n"
            "[^x]: their script sets `data.train_batch_size=1024`.\n")
    assert [(e.kind, e.skip, e.base) for e in examples(page, text)] == [
        ("command", "your own recipe", ""), ("yaml", "", "examples/tiny_grpo.yaml"),
        ("override", "a footnote quotes another project's settings", "")]


def test_a_fragment_loads_over_its_recipe_and_a_span_may_name_a_subcommand(tmp_path):
    lora = "training:\n  lora:\n    rank: 8\n"
    assert yaml_problem(lora, "examples/tiny_grpo.yaml", tmp_path) == ""
    assert "needs backend 'real'" in yaml_problem(lora, "", tmp_path)
    assert command_problem("python -m pipeline export", names_only=True) == ""
    assert "required" in command_problem("python -m pipeline export")


def test_the_examples_not_checked_are_these():
    """Each with its reason, by page and text: a new one is a decision, not a default."""
    assert sorted((e.id.split(":")[0], e.text, e.skip) for e in EXAMPLES if e.skip) == NOT_CHECKED


@pytest.mark.parametrize("example", [e for e in EXAMPLES if not e.skip], ids=lambda e: f"{e.id}:{e.kind}")
def test_every_example_works_as_written(example, tmp_path):
    why = problem(example, tmp_path)
    assert not why, f"{example.id}: {example.text!r}: {why}"
