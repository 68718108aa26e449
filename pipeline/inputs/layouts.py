"""Which fields of a dataset hold the prompt and the answer.

Named by data.prompt_key and data.answer_key (verl's names; OpenRLHF's
input_key and label_key), or detected:
- `prompt` (text, or a list of chat messages as verl's and TRL's layouts hold it)
  and `answer`, or verl's `reward_model.ground_truth`;
- GSM8K's `question` and `answer` ending in "#### N", when neither key is set.
`id`, and verl's `data_source` and `extra_info`, are read where a file has them,
and so are a row's pictures (`images` or `image`, pipeline/inputs/images.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.inputs.images import image_column
from pipeline.inputs.rows import DataError, Rows

# verl's answer: a column of {style, ground_truth} objects.
VERL_ANSWER = ("reward_model", "ground_truth")
# Read where a file has them: a row's id, and what verl's rewards are given besides the answer.
OPTIONAL = {"id": "text", "data_source": "text", "extra_info": "any"}


@dataclass(frozen=True)
class Columns:
    """data.prompt_key and data.answer_key: "" detects the field. An answer key
    may name a key inside an object field, as "reward_model.ground_truth"."""
    prompt: str = ""
    answer: str = ""


@dataclass(frozen=True)
class Layout:
    prompt: str                  # the prompt's field: text, or a list of chat messages
    answer: tuple[str, ...]      # the answer's field, and the keys down to it inside an object
    gsm8k: bool                  # the prompt is a GSM8K question, the answer ends in "#### N"
    optional: tuple[str, ...]    # of OPTIONAL, the fields the file has
    images: str = ""             # the field of each row's pictures, "" for none

    def kinds(self) -> dict[str, str]:
        """What each field read must hold (pipeline/inputs/rows.py Rows.use)."""
        kinds = {name: OPTIONAL[name] for name in self.optional}
        kinds[self.answer[0]] = "answer" if len(self.answer) == 1 else "any"
        kinds[self.prompt] = "text" if self.gsm8k else "prompt"
        if self.images:
            kinds[self.images] = "any"
        return kinds


def layout(data: Rows, columns: Columns) -> Layout:
    """The fields of `data` that hold what a prompt needs; a DataError naming the
    file and the fields it has where one is missing."""
    found = f"({data.noun}s found: {', '.join(data.names) or 'none'})"
    configured = bool(columns.prompt or columns.answer)
    if columns.prompt:
        if columns.prompt not in data.names:
            raise DataError(f"{data.path}: data.prompt_key {columns.prompt!r}: no {data.noun} of that name {found}")
        prompt = columns.prompt
    else:
        prompt = next((name for name in ("prompt", "question") if name in data.names), "")
        if not prompt:
            raise DataError(f"{data.path}: missing required {data.noun} 'prompt' or 'question' (GSM8K); name "
                            f"another with data.prompt_key {found}")
    gsm8k = prompt == "question" and not configured
    answer = _answer(data, columns.answer, gsm8k, found)
    return Layout(prompt, answer, gsm8k, tuple(name for name in OPTIONAL if name in data.names),
                  image_column(data))


def _answer(data: Rows, key: str, gsm8k: bool, found: str) -> tuple[str, ...]:
    if key:
        if key in data.names:
            return (key,)
        path = tuple(key.split("."))
        if len(path) > 1 and path[0] in data.names and all(path):
            return path
        raise DataError(f"{data.path}: data.answer_key {key!r}: no {data.noun} of that name {found}")
    if "answer" in data.names:
        return ("answer",)
    if "reward_model" in data.names and not gsm8k:
        return VERL_ANSWER
    verl = "" if gsm8k else " or 'reward_model' with a 'ground_truth' (verl)"
    raise DataError(f"{data.path}: missing required {data.noun} 'answer'{verl}; name another with "
                    f"data.answer_key {found}")
