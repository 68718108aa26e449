"""A dataset file's rows as Python values, and the checked reading of one field.

Every error is a DataError naming the file, the field and where it is: "line N"
in JSONL (from 1, as an editor numbers lines; blank lines count) and "row N" in
Parquet (from 0, as pyarrow and pandas number rows). A bad dataset would
otherwise surface inside a remote worker, far from the recipe.

JSONL is parsed line by line with `json` rather than by pyarrow, whose errors
give a row within a read block, not the line of the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.jsonl import JsonLineError, json_lines

# The fields read; any other field or column is ignored, whatever its type.
FIELDS = ("prompt", "question", "answer", "id", "reward_model")
ROLES = ("system", "user", "assistant", "tool")
_TEXT_TYPES = tuple(getattr(pa.types, name) for name in ("is_string", "is_large_string", "is_string_view",
                                                         "is_null") if hasattr(pa.types, name))
JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}


class DataError(ValueError):
    """A dataset that cannot be used; the message names the file, field and line/row."""


@dataclass
class Rows:
    path: Path
    rows: list[dict]
    where: list[str]      # "line 18" / "row 17", one per row
    names: list[str]      # fields seen in any row (JSONL) or the columns (Parquet)
    noun: str             # "field" (JSONL) or "column" (Parquet)

    def error(self, i: int, message: str) -> DataError:
        return DataError(f"{self.path}: {self.where[i]}: {message}")


def _read_jsonl(p: Path) -> Rows:
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise DataError(f"{p}: line {line}: not UTF-8 text") from None
    rows, where, names = [], [], {}
    try:
        # split("\n"), not splitlines(): JSON strings may hold U+2028 and other line breaks.
        decoded = list(json_lines(text.split("\n")))
    except JsonLineError as exc:
        raise DataError(f"{p}: line {exc.line}, column {exc.column}: not valid JSON: {exc.msg}") from None
    for n, row in decoded:
        if not isinstance(row, dict):
            got = JSON_TYPES.get(type(row), type(row).__name__)
            raise DataError(f"{p}: line {n}: expected a JSON object such as "
                            f'{{"prompt": ..., "answer": ...}}, got {got} (JSONL holds one object per line)')
        rows.append(row)
        where.append(f"line {n}")
        names.update(dict.fromkeys(row))
    return Rows(p, rows, where, list(names), "field")


def _read_parquet(p: Path) -> Rows:
    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{p}: cannot read as parquet: {exc}") from None
    used = [name for name in table.column_names if name in FIELDS]
    for name in used:
        typ = table.schema.field(name).type
        if (name == "prompt" and pa.types.is_list(typ)) or (name == "reward_model" and pa.types.is_struct(typ)):
            continue  # chat messages, verl's reward_model: checked row by row with the JSONL rows
        # pandas writes categorical text as a dictionary of strings; it reads back as str.
        value_type = typ.value_type if pa.types.is_dictionary(typ) else typ
        if not any(check(value_type) for check in _TEXT_TYPES):
            hint = " (store it as text, so \"007\" stays \"007\")" if name in ("answer", "id") else ""
            raise DataError(f"{p}: column {name!r} has type {typ}; it must be a string{hint}")
    rows = table.select(used).to_pylist()
    return Rows(p, rows, [f"row {i}" for i in range(len(rows))], table.column_names, "column")


def read_rows(p: Path) -> Rows:
    suffix = p.suffix.lower()
    if suffix not in (".parquet", ".jsonl"):
        raise DataError(f"{p}: unknown data file extension {p.suffix!r}; expected .parquet or .jsonl")
    if not p.exists():
        # Relative paths are read from the working directory, not from the recipe's.
        cwd = "" if p.is_absolute() else f" (relative to the working directory {str(Path.cwd())!r})"
        raise DataError(f"{p}: data file does not exist{cwd}")
    if not p.is_file():
        raise DataError(f"{p}: is not a file")
    try:
        return _read_parquet(p) if suffix == ".parquet" else _read_jsonl(p)
    except OSError as exc:
        raise DataError(f"{p}: cannot read: {exc.strerror or exc}") from None


def text(data: Rows, i: int, name: str) -> str:
    row = data.rows[i]
    if name not in row:
        raise data.error(i, f"{data.noun} {name!r} is missing")
    value = row[name]
    if value is None:
        raise data.error(i, f"{data.noun} {name!r} is null")
    if not isinstance(value, str):
        got = JSON_TYPES.get(type(value), type(value).__name__)
        # Numbers are refused, not converted, so that "007" and "7" stay different answers.
        hint = f' (quote it: "{name}": "{value}")' if type(value) in (int, float) else ""
        raise data.error(i, f"{data.noun} {name!r} is {got}, not a string{hint}")
    if not value.strip():
        raise data.error(i, f"{data.noun} {name!r} is empty")
    return value


def messages(data: Rows, i: int) -> list[dict]:
    """A chat-format prompt: a non-empty list of {role, content} with known roles."""
    listed = data.rows[i]["prompt"]
    if not listed:
        raise data.error(i, f"{data.noun} 'prompt' is an empty list of messages")
    out = []
    for k, m in enumerate(listed):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise data.error(i, f"{data.noun} 'prompt': message {k} must be an object with string 'role' and "
                                f"'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise data.error(i, f"{data.noun} 'prompt': message {k} has role {m['role']!r}; "
                                f"expected one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] == "assistant":
        raise data.error(i, f"{data.noun} 'prompt': the last message is the assistant's; the model would "
                            "continue its turn instead of answering")
    return out


def ground_truth(data: Rows, i: int) -> str:
    """verl's answer: reward_model.ground_truth, a string."""
    rm = data.rows[i].get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise data.error(i, f"{data.noun} 'reward_model' has no 'ground_truth' (verl's layout: "
                            "{\"ground_truth\": \"...\"})")
    truth = rm["ground_truth"]
    if not isinstance(truth, str) or not truth.strip():
        got = "an empty string" if isinstance(truth, str) else JSON_TYPES.get(type(truth), type(truth).__name__)
        raise data.error(i, f"{data.noun} 'reward_model.ground_truth' must be a non-empty string, got {got}")
    return truth
