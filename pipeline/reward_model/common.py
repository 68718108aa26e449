"""What the reward models (the classifier and the judge) share: each row's
prompt and the text they read."""
from __future__ import annotations

import json

from pipeline.core.types import Prompt


def row_prompts(prompts: tuple[Prompt, ...] | list[Prompt], rows: int) -> list[Prompt]:
    """Each row's prompt: the rows are the prompts' groups, in order."""
    if not prompts or rows % len(prompts):
        raise ValueError(f"{rows} rows do not split into groups of {len(prompts)} prompts")
    group = rows // len(prompts)
    return [prompts[i // group] for i in range(rows)]


def conversation(prompt: Prompt, completion: str) -> list[dict] | None:
    """A chat prompt's messages with the completion as the assistant's answer; None for a text prompt."""
    if not prompt.messages:
        return None
    return [*json.loads(prompt.messages), {"role": "assistant", "content": completion}]


def question(prompt: Prompt) -> str:
    """What a judge is told the question was: a chat prompt's last user message, else the prompt's text."""
    if prompt.messages:
        users = [m["content"] for m in json.loads(prompt.messages) if m.get("role") == "user"]
        if users:
            return users[-1]
    return prompt.text
