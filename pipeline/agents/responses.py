"""What the gateway answers: OpenAI's chat.completion object for one turn."""
from __future__ import annotations

import time
from typing import Callable, Sequence

from pipeline.core.types import Completion


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the first stop string, as OpenAI returns it (the
    sampled tokens, the stop string's included, are what the segment keeps)."""
    cut = min((at for at in (text.find(s) for s in stops) if at >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def chat_response(response_id: str, model: str, message: dict, finish: str, prompt_tokens: int,
                  completion: Completion, decode: Callable[[list[int]], str] | None) -> dict:
    """`decode`: each token's text for `logprobs` (None: not asked for)."""
    logprobs = None
    if decode is not None:
        logprobs = {"content": [_token_logprob(decode([t]), lp) for t, lp in
                                zip(completion.response_ids, completion.logprobs)], "refusal": None}
    n = len(completion.response_ids)
    return {
        "id": response_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n},
    }


def _token_logprob(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
