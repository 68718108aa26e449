"""`python -m pipeline samples runs/<name>`: the prompts and completions a run
wrote to samples.jsonl (metrics.samples), as text to read."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from pipeline.core.samples import format_sample

FILE = "samples.jsonl"


def load_samples(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file: the run wrote no samples (metrics.samples 0), "
                                f"or {run_dir} is not a run directory")
    samples = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            samples.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {number}: not JSON ({exc.msg}); a run killed mid-write leaves "
                             "its last line cut: delete that line") from None
    return samples


def select(samples: list[dict], path: Path, step: int | None = None, kind: str | None = None,
           limit: int | None = None) -> list[dict]:
    """The samples of `step` and `kind` (None: every one), the first `limit`;
    an error naming the file and the steps it holds where none matches."""
    chosen = [s for s in samples if (step is None or s["step"] == step) and (kind is None or s["kind"] == kind)]
    if not chosen:
        what = " ".join(filter(None, [kind, "samples"])) + (f" at step {step}" if step is not None else "")
        held = "; ".join(f"{k}: steps {_ranges(sorted({s['step'] for s in samples if s['kind'] == k}))}"
                         for k in dict.fromkeys(s["kind"] for s in samples)) or "nothing"
        raise ValueError(f"{path} has no {what}; it holds {held}")
    return chosen[:limit] if limit is not None else chosen


def _ranges(steps: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def samples_main(run_dir: str, step: int | None = None, kind: str | None = None, limit: int | None = None,
                 out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    chosen = select(load_samples(run_dir), Path(run_dir) / FILE, step, kind, limit)
    print("\n\n".join(format_sample(s) for s in chosen), file=out)
    return 0
