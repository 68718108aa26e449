"""Invariant 6, every wait has a deadline: no `ray.get`, `ray.wait` or
`Future.result` in the product waits without a timeout (read from the code)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def unbounded_waits(source: str) -> list[tuple[int, str]]:
    """(line, call) of every wait in `source` that has no timeout."""
    out = []
    for call in ast.walk(ast.parse(source)):
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            continue
        keywords = {k.arg for k in call.keywords}
        name, owner = call.func.attr, ast.unparse(call.func.value)
        ray_wait = owner == "ray" and name in ("get", "wait")
        # Future.result(timeout) takes it by position too.
        future_result = name == "result" and not call.args
        if (ray_wait or future_result) and "timeout" not in keywords:
            out.append((call.lineno, ast.unparse(call)))
    return out


def test_the_check_sees_an_unbounded_wait():
    assert [line for line, _ in unbounded_waits(
        "ray.get(ref)\nray.get(ref, timeout=1)\nf.result()\nf.result(3)\nray.wait(refs)\n")] == [1, 3, 5]


def test_no_wait_in_the_product_lacks_a_deadline():
    found = [f"{path.relative_to(ROOT)}:{line}: {call}"
             for folder in ("pipeline", "dags") for path in sorted((ROOT / folder).rglob("*.py"))
             for line, call in unbounded_waits(path.read_text())]
    assert not found, "waits without a timeout:\n" + "\n".join(found)
