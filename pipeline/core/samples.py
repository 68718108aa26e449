"""Samples to read (metrics.samples): each step, the first N prompt groups of
the batch it trained on, every completion of each with its reward and weight
versions; each validation, its first N prompts of each set with their completions.

They are built where the text is, and ride on tokens the driver already gets:
the controller's `sample` puts the step's on its Batch, a generator's
`validate` its share of the validation's on its ValOut. The driver writes them
(pipeline/run/metrics.py MetricSinks.write_samples). One record per prompt:

    {"step", "kind": "train", "prompt_id", "prompt", "batch", "version", "age", "completions"}
    {"step", "kind": "val", ["set",] "prompt_id", "prompt", "version", "completions"}

`version` is the weights the batch was launched with (train) or validated
(val); `age` is step - version, as the trainer's age_mean counts it. Each
completion is {"text", "reward", "versions", "tokens"} and, where they apply,
"error" (why its reward failed), "truncated" and "turns" (a multi-turn sample's
turns in order: {"role": "env"|"model", "text", "reward"}).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import zip_longest

import pyarrow as pa

from pipeline.core.types import Completion, Prompt

_COLUMNS = ["batch_id", "prompt_id", "text", "reward", "reward_error", "token_versions", "response_ids",
            "loss_mask", "truncated", "transcript"]


def completion_record(text: str, reward: float, versions: Iterable[int], tokens: int, error: str = "",
                      truncated: bool | None = None, transcript: Sequence[dict] | None = None) -> dict:
    """`versions`: every response token's; the record keeps the distinct ones,
    ascending (several only where a refit landed mid-sample: refit_mode inflight).
    `tokens`: the model's own, an environment's observations not counted."""
    record = {"text": text, "reward": float(reward), "versions": sorted(set(versions)), "tokens": int(tokens)}
    if error:
        record["error"] = error
    if truncated is not None:
        record["truncated"] = truncated
    if transcript:
        record["turns"] = [dict(turn) for turn in transcript]
    return record


def train_samples(step: int, table: pa.Table, prompt_texts: Mapping[str, str], batch_versions: Mapping[str, int],
                  count: int, group_size: int) -> tuple[dict, ...]:
    """The first `count` groups of the step's table, in its order (launch order:
    the same for a recipe and seed, whatever the timing)."""
    if count <= 0:
        return ()
    rows = table.slice(0, count * group_size).select(_COLUMNS).to_pylist()
    samples = []
    for start in range(0, len(rows), group_size):
        group = rows[start:start + group_size]
        head = group[0]
        version = batch_versions[head["batch_id"]]
        samples.append({
            "step": step, "kind": "train", "prompt_id": head["prompt_id"],
            "prompt": prompt_texts.get(head["prompt_id"], ""), "batch": head["batch_id"],
            "version": version, "age": step - version,
            "completions": [completion_record(
                r["text"], r["reward"], r["token_versions"],
                sum(r["loss_mask"]) if r["loss_mask"] is not None else len(r["response_ids"]),
                r["reward_error"], r["truncated"], r["transcript"]) for r in group]})
    return tuple(samples)


def val_samples(step: int, version: int, spec, prompts: Sequence[Prompt], completions: Sequence[Completion],
                scored: Sequence[tuple[float, str]]) -> tuple[dict, ...]:
    """One record per validation prompt given, its spec.n completions scored
    (`spec`: its ValSetConfig; completions and scores prompt by prompt); a
    named set's records say which set."""
    n = spec.n
    return tuple({
        "step": step, "kind": "val", **({"set": spec.name} if spec.name else {}), "prompt_id": prompt.id,
        "prompt": prompt.text, "version": version,
        "completions": [completion_record(
            c.text, reward, c.versions or (version,),
            sum(c.loss_mask) if c.loss_mask else len(c.response_ids), error, c.truncated, c.transcript)
            for c, (reward, error) in zip(completions[i * n:(i + 1) * n], scored[i * n:(i + 1) * n])]}
        for i, prompt in enumerate(prompts))


def shard_count(count: int, shard: int, shards: int) -> int:
    """How many of the first `count` prompts a list sharded as prompts[shard::shards] holds."""
    return max(0, -(-(count - shard) // shards))


def unshard(per_shard: Sequence[Sequence[dict]]) -> list[dict]:
    """The shards' samples back in the whole list's order: shard g's i-th is the
    (g + i * shards)-th, so round-robin over the shards in index order."""
    return [s for row in zip_longest(*per_shard) for s in row if s is not None]


def format_sample(sample: dict) -> str:
    """A record as text to read: a header line, the prompt, then each completion
    with its reward, versions and tokens, its text or its turns indented below."""
    head = f"step {sample['step']} {sample['kind']}" + (f" {sample['set']}" if "set" in sample else "") + \
        f"  prompt {sample['prompt_id']}"
    if "batch" in sample:
        head += f"  batch {sample['batch']}"
    head += f"  version {sample['version']}"
    if "age" in sample:
        head += f"  age {sample['age']}"
    lines = [head, "prompt:", _indent(sample["prompt"], 1)]
    completions = sample["completions"]
    for i, c in enumerate(completions, 1):
        lines.append(f"completion {i}/{len(completions)}  reward {c['reward']:.3f}  "
                     f"versions {','.join(map(str, c['versions']))}  tokens {c['tokens']}"
                     + ("  truncated" if c.get("truncated") else "")
                     + (f"  error: {c['error']}" if c.get("error") else ""))
        if "turns" not in c:
            lines.append(_indent(c["text"], 1))
            continue
        for turn in c["turns"]:
            reward = f" (reward {turn['reward']:.3f})" if turn.get("reward") is not None else ""
            lines += [f"    {turn['role']}{reward}:", _indent(turn["text"], 2)]
    return "\n".join(lines)


# A sampled control character (an escape, a backspace) shown as \xNN, never acted on by the terminal.
_VISIBLE = {c: f"\\x{c:02x}" for c in [*range(32), 127] if chr(c) not in "\n\t"}


def _indent(text: str, depth: int) -> str:
    pad = "    " * depth
    text = text.translate(_VISIBLE)
    return "\n".join(pad + line for line in text.split("\n")) if text else pad + "(empty)"
