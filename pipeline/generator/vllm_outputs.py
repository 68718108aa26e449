"""A finished vLLM request as a Completion: its sampled tokens, their logprobs and weight versions."""
from __future__ import annotations

from typing import Any, Callable

from pipeline.core.types import Completion, Prompt


def completion_of(prompt: Prompt, out: Any, decode: Callable) -> Completion:
    comp = out.outputs[0]
    ids = tuple(comp.token_ids)
    return Completion(prompt_ids=tuple(out.prompt_token_ids), response_ids=ids,
                      logprobs=tuple(_sampled_logprobs(comp.logprobs, ids, prompt.id)),
                      text=decode(ids), versions=_token_versions(comp.weight_versions, len(ids)),
                      truncated=comp.finish_reason == "length")


def _token_versions(spans: Any, n: int) -> tuple[int, ...]:
    """vLLM's weight-version spans of a completion ([start, end) each) as one version per token."""
    versions = [int(span.version) for span in spans or () for _ in range(span.start, span.end)]
    if len(versions) != n:
        raise RuntimeError(f"vLLM labelled {len(versions)} of {n} tokens with a weight version")
    return tuple(versions)


def _sampled_logprobs(logprobs: Any, ids: tuple[int, ...], prompt_id: str) -> list[float]:
    if logprobs is None or len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if logprobs is None else len(logprobs)} logprobs for "
                           f"{len(ids)} tokens of prompt {prompt_id!r}")
    return [float(step[tok].logprob) for step, tok in zip(logprobs, ids)]
