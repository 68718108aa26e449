"""A multi-request sample's routes (training.routing_replay): a multi-turn
episode's or an agent's, whose requests each run the whole context so far.

Each request's routes (Completion.routes, pipeline/moe/routes.py) cover every
position of its context and response but the last, so they cover the earlier
requests' tokens too; a position keeps the routes of the first request that
computed it, which are what the prefix cache served the later requests. The
sample has routes only where they cover every token but its last: one that
ends with tokens no forward ran (an observation whose turn could not start)
has none, and the trainer routes it itself.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.core.types import Completion


@dataclass
class StitchedRoutes:
    data: bytes = b""
    token_bytes: int = 0

    def add(self, completion: Completion) -> None:
        """A request's completion (its prompt ids are its whole context)."""
        if completion.routes:
            self.token_bytes = len(completion.routes) // (len(completion.prompt_ids) + len(completion.response_ids) - 1)
            self.data += completion.routes[len(self.data):]

    def whole(self, tokens: int) -> bytes:
        """The routes of a sample of `tokens` tokens, prompt and response; b"" unless they cover all but the last."""
        return self.data if self.data and len(self.data) == (tokens - 1) * self.token_bytes else b""
