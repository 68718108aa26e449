"""Prompt datasets: JSONL or Parquet, schema-checked row by row.

Three schemas are accepted:
- generic: `prompt` (string), `answer` (string), optional `id`;
- chat: `prompt` a list of messages ({role, content}), as verl's Parquet and
  TRL's conversational datasets hold it, rendered once by the model's chat
  template (ChatTemplate) into the token ids vLLM and the trainer both see; the
  answer in `answer` or, verl's layout, `reward_model.ground_truth`;
- GSM8K: `question`, `answer` ending in "#### N"; the question is wrapped in
  GSM8K_TEMPLATE and the answer becomes N (commas removed).
Every error is a DataError naming the file, the field and the line or row
(pipeline/inputs/rows.py reads the files and their fields).

A real run generates from `run_prompts`: the prompts whose tokens (the model's
tokenizer, as the generator encodes them) plus generation.max_new_tokens fit
the engine's context. vLLM refuses a longer prompt only when a step sends it,
minutes into the run; this finds it before any worker starts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.types import Prompt
from pipeline.inputs.images import ImageTokens, image_messages, row_images
from pipeline.inputs.layouts import Columns, Layout, layout
from pipeline.inputs.rows import (DataError, Rows, answer, json_text, messages, optional_text, read_rows,
                                  text as field_text)

GSM8K_TEMPLATE = ("{question}\nLet's think step by step and output the final answer "
                  "after \"####\".\n")


@dataclass(frozen=True)
class ChatTemplate:
    """The model's own chat template (its tokenizer's), with the generation prompt:
    a chat prompt's text, and the token ids that text encodes to without the
    tokenizer adding specials again (the template writes its own BOS, if any)."""
    tokenizer: Any
    system_prompt: str = ""   # data.system_prompt: first, in every chat prompt that has no system message
    model: str = ""           # for the error of a tokenizer without a template

    def conversation(self, messages: list[dict]) -> list[dict]:
        if self.system_prompt and messages[0]["role"] != "system":
            return [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def render(self, messages: list[dict]) -> tuple[str, tuple[int, ...]]:
        text = self.tokenizer.apply_chat_template(self.conversation(messages), add_generation_prompt=True,
                                                  tokenize=False)
        return text, tuple(self.tokenizer(text, add_special_tokens=False).input_ids)


def gsm8k_final_answer(answer: str) -> str | None:
    """The text after the last "####" of a GSM8K answer, commas removed."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "") or None


def load_prompts(path: str | Path, *, kind: str = "train", chat: ChatTemplate | None = None,
                 columns: Columns = Columns()) -> list[Prompt]:
    """Read a prompt dataset; `kind` ("train", "val") only prefixes generated ids;
    `chat` renders chat-format prompts (a dataset of them without one is refused);
    `columns`: data.prompt_key and data.answer_key."""
    return _load(path, kind, columns, chat)[0]


@dataclass(frozen=True)
class Checked:
    """A dataset as check_prompts found it."""
    count: int
    sources: dict[str, str]   # each data_source ("": none) and where it first appears ("row 3")


def check_prompts(path: str | Path, *, kind: str = "train", columns: Columns = Columns()) -> Checked:
    """Every row checked as load_prompts checks it, chat messages too, but none
    rendered (that needs the model's tokenizer): the preflight's quick look."""
    prompts, where = _load(path, kind, columns, check_only=True)
    sources: dict[str, str] = {}
    for prompt, at in zip(prompts, where):
        sources.setdefault(prompt.data_source, at)
    return Checked(len(prompts), sources)


def _load(path: str | Path, kind: str, columns: Columns, chat: ChatTemplate | None = None,
          check_only: bool = False) -> tuple[list[Prompt], list[str]]:
    """load_prompts, and where each prompt is in the file ("line 7", "row 6")."""
    data = read_rows(Path(path))
    if not data.where:
        raise DataError(f"{data.path}: the dataset is empty (0 rows)")
    fields = layout(data, columns)
    data.use(fields.kinds())
    first_of: dict[str, int] = {}
    prompts = []
    for i in range(len(data.rows)):
        images = row_images(data, i, fields.images) if fields.images else ()
        text, token_ids, conversation = _prompt(data, i, fields, chat, check_only, images)
        truth = answer(data, i, fields.answer)
        if fields.gsm8k:
            text, truth = GSM8K_TEMPLATE.format(question=text.strip()), _gsm8k_answer(data, i, truth)
        pid = f"{kind}-{i}"
        if "id" in fields.optional:
            pid = field_text(data, i, "id")
            if pid in first_of:
                raise data.error(i, f"{data.noun} 'id' repeats {pid!r} from {data.where[first_of[pid]]}")
            first_of[pid] = i
        prompts.append(Prompt(id=pid, text=text, answer=truth, token_ids=token_ids, messages=conversation,
                              data_source=optional_text(data, i, "data_source"),
                              extra_info=json_text(data, i, "extra_info"), images=images))
    return prompts, data.where


def _prompt(data: Rows, i: int, fields: Layout, chat: ChatTemplate | None,
            check_only: bool, images: tuple[bytes, ...] = ()) -> tuple[str, tuple[int, ...], str]:
    """A row's prompt: (text, token ids, the conversation as JSON); the ids and
    conversation are those of a chat prompt, rendered by `chat` (none when `check_only`).
    A row with `images` is a chat prompt whose messages mark where each goes."""
    name = fields.prompt
    if images and not isinstance(data.rows[i].get(name), list):
        raise data.error(i, f"{data.noun} {name!r}: a row with images needs its prompt as chat messages that "
                            "mark where each picture goes (verl's '<image>' in the text, or TRL's image parts)")
    if fields.gsm8k or not isinstance(data.rows[i].get(name), list):
        return field_text(data, i, name), (), ""
    listed = image_messages(data, i, name, len(images)) if images else messages(data, i, name)
    if check_only:
        return "", (), ""
    if chat is None:
        raise data.error(i, f"{data.noun} {name!r} is a list of chat messages; they are rendered by the "
                            "model's chat template, so they are read with the model (backend real)")
    if not getattr(chat.tokenizer, "chat_template", None):
        raise data.error(i, f"{data.noun} {name!r} is a list of chat messages, but the tokenizer of "
                            f"{chat.model or 'the model'} has no chat template (tokenizer_config.json "
                            "'chat_template'); give the prompts as text, or a model that has one")
    text, token_ids = chat.render(listed)
    return text, token_ids, json.dumps(chat.conversation(listed))


def _gsm8k_answer(data: Rows, i: int, solution: str) -> str:
    final = gsm8k_final_answer(solution)
    if not final:
        raise data.error(i, f"{data.noun} 'answer' has no final '#### <number>' (GSM8K format)")
    try:
        float(final)
    except ValueError:
        raise data.error(i, f"{data.noun} 'answer' ends in '#### {final}', which is not a number") from None
    return final


@dataclass(frozen=True)
class Fitted:
    """The prompts of one dataset that leave generation.max_new_tokens of room
    in the generator's context, in file order with their ids unchanged (so a
    dataset with nothing to drop gives the run load_prompts' list)."""
    prompts: tuple[Prompt, ...]
    total: int           # prompts in the file
    context: int         # the engine's max_model_len (models.context_length)
    max_new_tokens: int

    @property
    def filtered(self) -> int:
        return self.total - len(self.prompts)

    @property
    def limit(self) -> int:
        """The most prompt tokens that leave room for a whole completion."""
        return self.context - self.max_new_tokens

    def note(self, key: str) -> str:
        return (f"{key}: filtered {self.filtered} of {self.total} prompts longer than {self.limit} tokens "
                f"(context {self.context} - max_new_tokens {self.max_new_tokens}); data.filter_overlong")


def prompt_lengths(prompts: list[Prompt], tokenizer, image_tokens=None) -> list[int]:
    """Each prompt's tokens as the generator sends them to vLLM; `image_tokens`
    (images.ImageTokens) counts a picture's, whose one placeholder vLLM widens."""
    # VllmGenerationEngine.encode: tokenizer(text).input_ids, one text per call and the
    # special tokens (the BOS) included; anything else could count fewer than vLLM gets.
    # A chat prompt is sent as its rendered ids, the template's tokens among them.
    return [(len(p.token_ids) if p.token_ids else len(tokenizer(p.text).input_ids)) +
            (sum(image_tokens(image) - 1 for image in p.images) if image_tokens else 0) for p in prompts]


def fit_prompts(path: str | Path, kind: str, tokenizer, *, context: int, max_new_tokens: int,
                drop: bool, system_prompt: str = "", model: str = "", columns: Columns = Columns(),
                image_tokens=None) -> Fitted:
    """The prompts of `path` whose tokens plus max_new_tokens fit `context`.
    An over-long prompt is left out when `drop`, else a DataError naming its
    line or row and its length; a dataset with none left is a DataError too.
    `image_tokens` (images.ImageTokens): a picture's tokens, for a dataset with pictures."""
    prompts, where = _load(path, kind, columns, ChatTemplate(tokenizer, system_prompt, model))
    limit = context - max_new_tokens
    if any(p.images for p in prompts) and image_tokens is None:
        raise DataError(f"{path}: its prompts show pictures, but model.path {model or '?'} has no image processor "
                        "(preprocessor_config.json); give a vision-language model")
    lengths = prompt_lengths(prompts, tokenizer, image_tokens)
    over = [i for i, n in enumerate(lengths) if n > limit]
    fits = f"the {limit} that fit (the model's context {context} - generation.max_new_tokens {max_new_tokens})"
    if over and not drop:
        i = over[0]
        also = f"; {len(over)} of the {len(prompts)} prompts are too long" if len(over) > 1 else ""
        raise DataError(f"{path}: {where[i]}: the prompt is {lengths[i]} tokens, more than {fits}{also}; "
                        "shorten it, or set data.filter_overlong: true to leave such prompts out")
    if len(over) == len(prompts):
        raise DataError(f"{path}: all {len(prompts)} prompts are longer than {fits}; none is left to "
                        "generate from (shorten them or lower generation.max_new_tokens)")
    dropped = set(over)
    return Fitted(tuple(p for i, p in enumerate(prompts) if i not in dropped), len(prompts), context,
                  max_new_tokens)


# Fitted datasets by what decides them, so that a process asked twice (the
# driver's preflight and an in-process worker, or a generator begun for many
# runs) tokenizes once. Bounded: a pool of workers may serve many datasets.
_FITTED: dict[tuple, Fitted] = {}


def _stamp(path: Path) -> tuple:
    st = path.stat()
    return str(path.resolve()), st.st_mtime_ns, st.st_size


def data_columns(cfg) -> Columns:
    return Columns(cfg.data.prompt_key, cfg.data.answer_key)


def run_prompts(cfg, kind: str, path: str | None = None) -> Fitted:
    """The prompts of data.train or data.val (`kind`), or of a validation set's
    `path` (`kind` its name), that a real run generates from: over-long ones
    left out, or refused, per data.filter_overlong. The driver's preflight and
    the workers call this alike, so they agree."""
    from pipeline.inputs.models import TOKENIZER_FILES, context_length, load_tokenizer
    path = Path(path or (cfg.data.train if kind == "train" else cfg.data.val))
    model = Path(cfg.model.path)
    stamps = tuple(_stamp(f) for f in (model / "config.json", *(model / n for n in TOKENIZER_FILES)) if f.is_file())
    columns = data_columns(cfg)
    key = (kind, _stamp(path), stamps, cfg.generation.max_new_tokens, cfg.data.filter_overlong,
           cfg.data.system_prompt, columns)
    if key not in _FITTED:
        # The generator's tokenizer: vLLM loads model.path's with AutoTokenizer.
        tokenizer = load_tokenizer(model)
        fitted = fit_prompts(path, kind, tokenizer, context=context_length(model),
                             max_new_tokens=cfg.generation.max_new_tokens, drop=cfg.data.filter_overlong,
                             system_prompt=cfg.data.system_prompt, model=str(model), columns=columns,
                             image_tokens=ImageTokens(model) if (model / "preprocessor_config.json").is_file()
                             else None)
        while len(_FITTED) >= 8:
            _FITTED.pop(next(iter(_FITTED)))
        _FITTED[key] = fitted
    return _FITTED[key]
