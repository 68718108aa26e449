"""The Markdown pieces docs/results.md is built of (benchmarks/tables.py)."""
from __future__ import annotations


def md(headers: list[str], rows: list[list], text_cols: int = 2) -> str:
    align = ["---" if i < text_cols else "---:" for i in range(len(headers))]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def rng(s: dict, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(s['min'] * scale)}–{fmt.format(s['max'] * scale)}"


def g3(x: float) -> str:
    """Three significant digits, no exponent for the sizes on this page."""
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def machine(r: dict) -> str:
    m = r["machine"]
    during = m.get("loadavg_1min_during")
    load = f"load average (1 min) {m['loadavg_start'][0]} at start, {m['loadavg_end'][0]} at end"
    if during:
        load += f", median {during['median']:.2f} / max {during['max']:.2f} during"
    wall = f"; {r['wall_s']:.0f} s" if "wall_s" in r else ""
    return (f"{m['cpu_physical']} cores, {m['memory_gib']} GiB, Ray {m['ray']}, Python {m['python']}; {load}; "
            f"commit {m['git_commit'][:8]}{' (dirty)' if m['git_dirty'] else ''}{wall}")


def targets(r: list[dict]) -> str:
    def value(v):
        if isinstance(v, float):
            return f"{v:.3f}"
        if isinstance(v, list):
            return ", ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in v)
        return str(v)
    return md(["target", "value", ""], [[t["target"], value(t["value"]), "met" if t["met"] else "missed"]
                                       for t in r], text_cols=1)

