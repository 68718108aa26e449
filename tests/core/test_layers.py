"""The rooms of pipeline/ stand in layers (DESIGN.md, "Layout"): a module
imports only from its own layer's package or from the layers below, lazy
imports inside functions included, and no modules import each other in a loop.
"""
from __future__ import annotations

import ast
from pathlib import Path
import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# Bottom first. A layer with several packages: they are siblings and import none of each other.
LAYERS = [
    ["dags"],
    ["pipeline.core"],
    ["pipeline.algos", "pipeline.envs"],
    ["pipeline.agents"],
    ["pipeline.config"],
    ["pipeline.moe"],
    ["pipeline.rewards"],
    ["pipeline.inputs"],
    ["pipeline.sim"],
    ["pipeline.weights"],
    ["pipeline.evaluation"],
    ["pipeline.controller", "pipeline.generator", "pipeline.trainer", "pipeline.reward_model", "pipeline.distill"],
    ["pipeline.run"],
    ["pipeline.tools"],
    ["pipeline.__main__"],
]


def modules() -> dict[str, Path]:
    out = {}
    for top in ("pipeline", "dags"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Every module of ours that `path` imports, at the top or inside a function."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            candidates = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                found.add(candidate)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, name, known) for name, path in known.items()}


def room(module: str) -> tuple[int, str]:
    for level, packages in enumerate(LAYERS):
        for package in packages:
            if module == package or module.startswith(package + "."):
                return level, package
    if module == "pipeline":
        return -1, "pipeline"
    raise AssertionError(f"{module} is in no layer of tests/core/test_layers.py")


def test_every_module_has_a_room():
    for module in graph():
        room(module)


def test_imports_run_down_the_layers():
    wrong = []
    for module, deps in graph().items():
        level, package = room(module)
        for dep in deps:
            dep_level, dep_package = room(dep)
            if dep_level > level or (dep_level == level and dep_package != package):
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "imports up or across the layers:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The graph counts a lazy import inside a function: a layer check that missed them would pass anything."""
    lower = tmp_path / "low.py"
    lower.write_text("def f():\n    from pipeline.run.driver import train\n")
    known = {"pipeline.core.low": lower, "pipeline.run.driver": ROOT / "pipeline/run/driver.py"}
    assert imports(lower, "pipeline.core.low", known) == {"pipeline.run.driver"}
