"""A supervised warm-up from OpenAI-format transcripts, for a model that
agents will call through the chat API (`python -m pipeline warmup
--transcripts FILE`).

A transcript is one JSON line, {"messages": [...], "tools": [...]}: the
messages of the chat API (system, user, assistant with content or
tool_calls, tool), the tools as a request offers them ("tools" may be left
out). pipeline/envs/calculator_agent.py writes the calculator task's.

Token layout: the conversation rendered by the model's chat template (with
its tools), as the requests of a session render it: the text before each
assistant message ends with the generation prompt, and what the assistant
message adds up to and including its </s> is the model's turn, what it
samples; the rest (the template's tail after </s>, the next messages, the
next assistant header) is context. Each piece is tokenized on its own,
without added specials (the template writes its own BOS), so a model turn is
exactly the tokens the model would sample, and anything after the last
model turn is left out. The loss mask is 1 on the model turns, 0 elsewhere.
The fit is warmup.train_on's (portable_fit: the same bytes on every x86 CPU).

With `val` (transcripts, the first assistant turn of each being the one
wanted), the first turn of every val transcript is decoded from its first
request, greedy and sampled: the share that stops with </s> within
max_new_tokens, the share the tool parser (if named) finds calls in, and
the share whose tokens are the transcript's own.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.jsonl import JsonLineError, json_lines


@dataclass
class Transcript:
    """One transcript laid out in tokens (train_on reads ids and mask)."""
    ids: list[int]
    mask: list[int]             # 1 on the model's turns
    first_request: list[int]    # the tokens before the first model turn
    first_turn: list[int]       # the first model turn, </s> included
    messages: list[dict]        # the messages of the first request, and the tools it offers
    tools: list[dict] | None


def load_transcripts(path: str | Path) -> list[dict]:
    """The transcripts of a JSONL file, each checked for the shape the layout
    needs; a ValueError names the file and line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: transcripts file does not exist")
    rows = []
    try:
        for n, row in json_lines(p.read_text().splitlines()):
            rows.append(_checked(row, f"{p}, line {n}"))
    except JsonLineError as exc:
        raise ValueError(f"{p}: {exc}") from None
    if not rows:
        raise ValueError(f"{p}: no transcripts")
    return rows


def _checked(row: Any, where: str) -> dict:
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        raise ValueError(f"{where}: a transcript is {{\"messages\": [...], \"tools\": [...]}} with messages")
    if not isinstance(row.get("tools", []), list):
        raise ValueError(f"{where}: \"tools\" must be a list")
    for i, m in enumerate(row["messages"]):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}: messages[{i}] has no role")
    if not any(m["role"] == "assistant" for m in row["messages"]):
        raise ValueError(f"{where}: no assistant message, nothing to learn")
    return row


def lay_out(tokenizer: Any, transcript: dict, *, max_new_tokens: int, where: str = "transcript") -> Transcript:
    """`transcript` in tokens (the module docstring's layout); a ValueError
    names `where` when the template cannot render it, does not extend a
    conversation's shorter renderings, or a model turn is over max_new_tokens."""
    from jinja2 import TemplateError

    from pipeline.agents.tool_calls import template_messages
    messages, tools = template_messages(transcript["messages"]), transcript.get("tools") or None
    eos = tokenizer.eos_token

    def render(k: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        except (TemplateError, ValueError) as exc:
            raise ValueError(f"{where}: the chat template cannot render messages[:{k}]: {exc}") from None

    def tokens(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    full = render(len(messages), False)
    ids: list[int] = []
    mask: list[int] = []
    done = 0  # characters of `full` laid out so far
    first = None
    for i in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        before, after = render(i, True), render(i + 1, False)
        if not (full.startswith(after) and after.startswith(before) and eos in after[len(before):]):
            raise ValueError(f"{where}: the chat template does not render messages[{i}] after its generation "
                             "prompt as a turn ending in the EOS token, extending the messages before it")
        end = len(before) + after[len(before):].rindex(eos) + len(eos)
        context, turn = tokens(full[done:len(before)]), tokens(full[len(before):end])
        if len(turn) > max_new_tokens:
            raise ValueError(f"{where}: messages[{i}] is {len(turn)} tokens with its EOS, over max_new_tokens "
                             f"{max_new_tokens}: the model could never sample it")
        if first is None:
            first = Transcript([], [], ids + context, turn, transcript["messages"][:i], tools)
        ids, mask, done = ids + context + turn, mask + [0] * len(context) + [1] * len(turn), end
    assert first is not None  # _checked: every transcript has an assistant message
    first.ids, first.mask = ids, mask
    return first


def first_turns(model: Any, tokenizer: Any, transcripts: list[Transcript], *, parser: Any = None,
                max_new_tokens: int, temperature: float = 0.0, samples: int = 1, seed: int = 0) -> dict:
    """Each transcript's first turn decoded from its first request (greedy at
    temperature 0, else `samples` draws seeded with `seed`): the shares that
    stop with </s>, that `parser` finds tool calls in, and that are the
    transcript's own turn, token for token."""
    import torch

    from pipeline.trainer.warmup import _decode_turns
    asked = [t for t in transcripts for _ in range(samples)]
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    was_training = model.training
    model.eval()
    try:
        turns = _decode_turns(model, [t.first_request for t in asked], eos_id=tokenizer.eos_token_id,
                              pad_id=tokenizer.pad_token_id, max_new_tokens=max_new_tokens,
                              temperature=temperature, generator=generator)
    finally:
        model.train(was_training)
    n = len(asked)
    result = {"stopped": sum(turn[-1:] == [tokenizer.eos_token_id] for turn in turns) / n,
              "as_transcript": sum(turn == t.first_turn for t, turn in zip(asked, turns)) / n}
    if parser is not None:
        from pipeline.agents.tool_calls import chat_request, parse_tool_calls
        called = 0
        for t, turn in zip(asked, turns):
            request = chat_request({"messages": t.messages, "tools": t.tools})
            called += bool(parse_tool_calls(parser, tokenizer.decode(turn, skip_special_tokens=True), request)[1])
        result["tool_calls"] = called / n
    return {k: round(v, 4) for k, v in result.items()}


def warmup_on_transcripts(model_dir: str | Path, transcripts: str | Path, out: str | Path, *,
                          val: str | Path | None = None, steps: int, prompts: int | None = None, lr: float,
                          batch_size: int, seed: int = 0, tool_parser: str | None = None,
                          max_new_tokens: int, samples: int = 4, log: Any = None) -> dict:
    """Warm `model_dir` up on the first `prompts` transcripts of `transcripts`
    and save it to `out` with warmup.json (what this returns): the losses,
    the seconds of the training steps, and with `val` the first-turn shares
    after it, greedy and sampled (`samples` per transcript, temperature 1)."""
    from pipeline.inputs.models import check_model_files
    from pipeline.trainer.warmup import _save, train_on

    model_path, out_path = Path(model_dir), Path(out)
    check_model_files(model_path)
    if out_path.resolve() == model_path.resolve():
        raise ValueError(f"--out {str(out_path)!r} is the input model directory; write the warmed-up model elsewhere")
    train_rows = load_transcripts(transcripts)[:prompts]
    val_rows = load_transcripts(val) if val is not None else None
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {str(model_path)!r}: its tokenizer has no chat template to render transcripts "
                         "with (build one with `python -m pipeline build-tiny --chat-template tools`)")
    parser = None
    if tool_parser is not None:
        from pipeline.agents.tool_calls import load_tool_parser
        parser = load_tool_parser(tool_parser, tokenizer)

    def laid_out(rows: list[dict], path: str | Path) -> list[Transcript]:
        return [lay_out(tokenizer, row, max_new_tokens=max_new_tokens, where=f"{path}, transcript {i + 1}")
                for i, row in enumerate(rows)]
    train = laid_out(train_rows, transcripts)
    held_out = laid_out(val_rows, val) if val_rows is not None else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = LlamaForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        longest = max(len(t.ids) for t in train + (held_out or []))
        if longest + max_new_tokens > model.config.max_position_embeddings:
            raise ValueError(f"a transcript of {longest} tokens (+ max_new_tokens {max_new_tokens}) is over the "
                             f"model's {model.config.max_position_embeddings} positions")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            t0 = time.perf_counter()
            losses = train_on(model, train, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                              pad_id=tokenizer.pad_token_id)
            seconds = time.perf_counter() - t0
        meta: dict[str, Any] = {
            "base_model": str(model_path), "transcripts": str(transcripts), "val": None if val is None else str(val),
            "tool_parser": tool_parser, "max_new_tokens": max_new_tokens, "lr": lr, "batch_size": batch_size,
            "seed": seed, "steps": steps, "prompts": len(train), "seconds": round(seconds, 1),
            "loss_first": round(sum(losses[:10]) / len(losses[:10]), 4),
            "loss_last": round(sum(losses[-10:]) / len(losses[-10:]), 4)}
        if held_out is not None:
            kw = dict(parser=parser, max_new_tokens=max_new_tokens)
            meta["val_first_turn_greedy"] = first_turns(model, tokenizer, held_out, **kw)
            meta["val_first_turn_sampled"] = first_turns(model, tokenizer, held_out, temperature=1.0,
                                                         samples=samples, seed=seed, **kw)
    finally:
        torch.set_num_threads(threads)
    _save(model, model_path, out_path, meta)
    if log:
        log(f"{steps} steps on {len(train)} transcripts in {seconds:.1f} s, loss {meta['loss_first']:.3f} -> "
            f"{meta['loss_last']:.3f}; wrote {out_path}")
        for kind in ("greedy", "sampled"):
            if f"val_first_turn_{kind}" in meta:
                log(f"val first turn, {kind}: {json.dumps(meta[f'val_first_turn_{kind}'])}")
    return meta
