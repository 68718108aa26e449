"""A dataset file's rows as Python values, and the checked reading of one field.

Every error is a DataError naming the file, the field and where it is: "line N"
in JSONL (from 1, as an editor numbers lines; blank lines count) and "row N" in
Parquet (from 0, as pyarrow and pandas number rows). A bad dataset would
otherwise surface inside a remote worker, far from the recipe.

JSONL is parsed line by line with `json` rather than by pyarrow, whose errors
give a row within a read block, not the line of the file.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.core.jsonl import JsonLineError, json_lines

ROLES = ("system", "user", "assistant", "tool")
_TEXT_TYPES = tuple(getattr(pa.types, name) for name in ("is_string", "is_large_string", "is_string_view",
                                                         "is_null") if hasattr(pa.types, name))
_NUMBER_TYPES = (pa.types.is_integer, pa.types.is_floating)
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
    table: pa.Table | None = None   # Parquet: its rows are made Python values by `use`

    def error(self, i: int, message: str) -> DataError:
        return DataError(f"{self.path}: {self.where[i]}: {message}")

    def use(self, kinds: dict[str, str]) -> None:
        """The rows hold these columns, each checked for its kind: "text",
        "prompt" (text or chat messages), "answer" (text or numbers) or "any"
        (an object, checked row by row). A column not named is not read,
        whatever its type. JSONL rows are checked field by field as they are read."""
        if self.table is None:
            return
        for name, kind in kinds.items():
            _check_column(self.path, name, self.table.schema.field(name).type, kind)
        self.rows = self.table.select(list(kinds)).to_pylist()


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
    return Rows(p, [], [f"row {i}" for i in range(table.num_rows)], table.column_names, "column", table)


def _check_column(p: Path, name: str, typ: pa.DataType, kind: str) -> None:
    if kind == "any" or (kind == "prompt" and pa.types.is_list(typ)):
        return  # an object (verl's reward_model, extra_info) or chat messages: checked row by row
    # pandas writes categorical text as a dictionary of strings; it reads back as str.
    value_type = typ.value_type if pa.types.is_dictionary(typ) else typ
    if any(check(value_type) for check in _TEXT_TYPES):
        return
    if kind == "answer" and any(check(value_type) for check in _NUMBER_TYPES):
        return  # each value's text is checked row by row (number_text)
    if kind == "answer":
        raise DataError(f"{p}: column {name!r} has type {typ}; an answer must be a string or a number")
    hint = " (store it as text, so \"007\" stays \"007\")" if name == "id" else ""
    raise DataError(f"{p}: column {name!r} has type {typ}; it must be a string{hint}")


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
        # An id stays text, so that "007" and "7" stay two rows' ids.
        hint = f' (quote it: "{name}": "{value}")' if type(value) in (int, float) else ""
        raise data.error(i, f"{data.noun} {name!r} is {got}, not a string{hint}")
    if not value.strip():
        raise data.error(i, f"{data.noun} {name!r} is empty")
    return value


def number_text(value: int | float) -> str:
    """An answer stored as a number, as the text it is; a ValueError saying why
    a number has no one text. (A number can never be "007", so text answers
    keep their leading zeros: strings stay strings.)"""
    if isinstance(value, bool):
        raise ValueError("a boolean, not a number")
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise ValueError(f"the float {value!r}, which no answer equals")
    if value.is_integer():
        if abs(value) < 2 ** 53:
            return str(int(value))
        raise ValueError(f"the float {value!r}, which has lost the digits past 2**53 it may have had")
    if "e" in repr(value):
        raise ValueError(f"the float {value!r}, which has no plain decimal text")
    return repr(value)


def answer(data: Rows, i: int, path: tuple[str, ...]) -> str:
    """The answer at `path`: a column, or keys inside one (verl's
    reward_model.ground_truth); text, or a number as its text (number_text)."""
    name = ".".join(path)
    row = data.rows[i]
    if path[0] not in row:
        raise data.error(i, f"{data.noun} {path[0]!r} is missing")
    value = row[path[0]]
    for depth, key in enumerate(path[1:], 1):
        if not isinstance(value, dict) or key not in value:
            raise data.error(i, f"{data.noun} {'.'.join(path[:depth])!r} has no {key!r} (expected an object "
                                f"with {key!r}, got {value!r:.80})")
        value = value[key]
    if value is None:
        raise data.error(i, f"{data.noun} {name!r} is null")
    if isinstance(value, (int, float)):
        try:
            return number_text(value)
        except ValueError as exc:
            raise data.error(i, f"{data.noun} {name!r} is {exc}; store the answer as text") from None
    if not isinstance(value, str):
        got = JSON_TYPES.get(type(value), type(value).__name__)
        raise data.error(i, f"{data.noun} {name!r} is {got}, not a string or a number")
    if not value.strip():
        raise data.error(i, f"{data.noun} {name!r} is empty")
    return value


def optional_text(data: Rows, i: int, name: str) -> str:
    """A string field a row may leave out or null (verl's data_source): "" then."""
    value = data.rows[i].get(name)
    if value is None or isinstance(value, str):
        return value or ""
    got = JSON_TYPES.get(type(value), type(value).__name__)
    raise data.error(i, f"{data.noun} {name!r} is {got}, not a string")


def json_text(data: Rows, i: int, name: str) -> str:
    """Any JSON value a row may hold (verl's extra_info), as JSON text; "" when absent or null."""
    value = data.rows[i].get(name)
    if value is None:
        return ""
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise data.error(i, f"{data.noun} {name!r} holds what JSON cannot ({exc}); a reward is given it as JSON "
                            "values") from None


def messages(data: Rows, i: int, name: str) -> list[dict]:
    """A chat-format prompt: a non-empty list of {role, content} with known roles."""
    listed = data.rows[i][name]
    if not listed:
        raise data.error(i, f"{data.noun} {name!r} is an empty list of messages")
    out = []
    for k, m in enumerate(listed):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise data.error(i, f"{data.noun} {name!r}: message {k} must be an object with string 'role' and "
                                f"'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise data.error(i, f"{data.noun} {name!r}: message {k} has role {m['role']!r}; "
                                f"expected one of {', '.join(ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] == "assistant":
        raise data.error(i, f"{data.noun} {name!r}: the last message is the assistant's; the model would "
                            "continue its turn instead of answering")
    return out
