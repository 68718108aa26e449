"""JSON Lines, read one way: datasets (pipeline/inputs/datasets.py) and event logs
(pipeline/tools/check.py) each word the error for their own reader."""
from __future__ import annotations

import json
import sys
from typing import Any, Callable, Iterable, Iterator

# Each line's keys are new strings to json.loads; an event log repeats the same
# few dozen (its fields, the vector clocks' lanes) on every line, and sharing
# them halves what a long log takes in memory (a 2000-step sim log: 222 -> 116 MB).
loads_interned: Callable[[str], Any] = json.JSONDecoder(
    object_pairs_hook=lambda pairs: {sys.intern(k): v for k, v in pairs}).decode


class JsonLineError(ValueError):
    def __init__(self, line: int, column: int, msg: str):
        super().__init__(f"line {line}, column {column}: {msg}")
        self.line, self.column, self.msg = line, column, msg


def json_lines(lines: Iterable[str], loads: Callable[[str], Any] = json.loads) -> Iterator[tuple[int, Any]]:
    """(line number, value) for each non-blank line of a JSONL text; a line that
    is not JSON raises JsonLineError with its position."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield n, loads(line)
        except json.JSONDecodeError as exc:
            raise JsonLineError(n, exc.colno, exc.msg) from None


def write_train_val(out_dir, stem: str, make_rows, *, n_train: int, n_val: int) -> list:
    """`<stem>_train.jsonl` (make_rows(n_train, seed=0)) and `<stem>_val.jsonl`
    (seed 1) in `out_dir`: how the shipped datasets in data/ were written."""
    from pathlib import Path
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n, seed in (("train", n_train, 0), ("val", n_val, 1)):
        path = out / f"{stem}_{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in make_rows(n, seed=seed)))
        paths.append(path)
    return paths
