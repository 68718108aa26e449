"""Prompt datasets: Parquet or JSONL, read with pyarrow and schema-checked.

Two schemas are accepted:
- generic: `prompt` (string), `answer` (string), optional `id`;
- GSM8K: `question`, `answer` ending in "#### N"; the question is wrapped in
  GSM8K_TEMPLATE and the answer becomes N (commas removed).
Every error is a DataError naming the file and the column or row (rows count
from 0, as in pyarrow's own messages), because a bad dataset would otherwise
surface inside a remote worker, far from the recipe.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq

from pipeline.engines import Prompt

GSM8K_TEMPLATE = ("{question}\nLet's think step by step and output the final answer "
                  "after \"####\".\n")


class DataError(ValueError):
    """A dataset that cannot be used; the message names the file and column/row."""


def _read_table(p: Path) -> pa.Table:
    suffix = p.suffix.lower()
    if suffix not in (".parquet", ".jsonl"):
        raise DataError(f"{p}: unknown data file extension {p.suffix!r}; expected .parquet or .jsonl")
    if not p.is_file():
        raise DataError(f"{p}: data file does not exist")
    try:
        if suffix == ".parquet":
            return pq.read_table(p)
        if not p.read_bytes().strip():
            return pa.table({})  # pyarrow rejects an empty JSON file; report it as empty
        return pajson.read_json(p)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{p}: cannot read as {suffix[1:]}: {exc}") from None


def _column(table: pa.Table, p: Path, name: str, *, required: bool = True) -> list | None:
    if name not in table.column_names:
        if required:
            hint = " or 'question' (GSM8K)" if name == "prompt" else ""
            raise DataError(f"{p}: missing required column {name!r}{hint} "
                            f"(columns: {', '.join(table.column_names) or 'none'})")
        return None
    col = table.column(name)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
            or pa.types.is_null(col.type)):
        # Numbers are accepted as answers/ids only as strings, to keep "007" intact.
        if name in ("answer", "id") and (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            raise DataError(f"{p}: column {name!r} has type {col.type}; it must be a string "
                            f"(quote the values, e.g. \"answer\": \"42\")")
        raise DataError(f"{p}: column {name!r} has type {col.type}; it must be a string")
    return col.to_pylist()


def _check_values(values: list, p: Path, name: str) -> None:
    for i, v in enumerate(values):
        if v is None or (isinstance(v, str) and not v.strip()):
            what = "null" if v is None else "empty"
            raise DataError(f"{p}: row {i}: column {name!r} is {what}")


def gsm8k_final_answer(answer: str) -> str | None:
    """The text after the last "####" of a GSM8K answer, commas removed."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "") or None


def load_prompts(path: str | Path, *, kind: str = "train") -> list[Prompt]:
    """Read a prompt dataset; `kind` ("train", "val") only prefixes generated ids."""
    p = Path(path)
    table = _read_table(p)
    if table.num_rows == 0:
        raise DataError(f"{p}: the dataset is empty (0 rows)")
    is_gsm8k = "prompt" not in table.column_names and "question" in table.column_names
    text_col = "question" if is_gsm8k else "prompt"
    texts = _column(table, p, text_col)
    answers = _column(table, p, "answer")
    ids = _column(table, p, "id", required=False)
    _check_values(texts, p, text_col)
    _check_values(answers, p, "answer")
    if ids is not None:
        _check_values(ids, p, "id")
        seen: dict[str, int] = {}
        for i, v in enumerate(ids):
            if v in seen:
                raise DataError(f"{p}: row {i}: column 'id' repeats {v!r} from row {seen[v]}")
            seen[v] = i
    prompts = []
    for i, (text, answer) in enumerate(zip(texts, answers)):
        if is_gsm8k:
            final = gsm8k_final_answer(answer)
            if not final:
                raise DataError(f"{p}: row {i}: column 'answer' has no final '#### <number>' "
                                "(GSM8K format)")
            try:
                float(final)
            except ValueError:
                raise DataError(f"{p}: row {i}: column 'answer' ends in '#### {final}', "
                                "which is not a number") from None
            text, answer = GSM8K_TEMPLATE.format(question=text.strip()), final
        pid = ids[i] if ids is not None else f"{kind}-{i}"
        prompts.append(Prompt(id=pid, text=text, answer=answer))
    return prompts
