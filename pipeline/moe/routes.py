"""Routing replay's record: which experts each token of a sample was routed to.

A sample's routes are one row per token whose forward the engine ran (the
prompt's and the response's, all but the last sampled token, which no forward
reads), each row the top-k expert ids of every MoE layer in order: an array
[tokens, moe_layers, top_k] of uint8 (uint16 past 256 experts), stored as its
bytes in the trajectory's `routed_experts` column. Both sides read the layout
from the model's config.json.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

class RoutingError(ValueError):
    """A model whose routing cannot be replayed; the message names its directory."""


# Model types whose trainer-side router pipeline/moe/replay.py replays.
REPLAYABLE = ("qwen3_moe",)


@dataclass(frozen=True)
class RouteLayout:
    layers: tuple[int, ...]   # the decoder layers with a router, in order
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.num_experts <= 256 else np.uint16)

    @property
    def bytes_per_token(self) -> int:
        return len(self.layers) * self.top_k * self.dtype.itemsize

    def encode(self, routes: np.ndarray) -> bytes:
        if routes.ndim != 3 or routes.shape[1:] != (len(self.layers), self.top_k):
            raise ValueError(f"routes of shape {routes.shape}; this model's are [tokens, {len(self.layers)}, "
                             f"{self.top_k}]")
        return routes.astype(self.dtype, copy=False).tobytes()

    def decode(self, data: bytes) -> np.ndarray:
        routes = np.frombuffer(data, dtype=self.dtype)
        if routes.size % (len(self.layers) * self.top_k):
            raise ValueError(f"{len(data)} bytes of routes are not whole tokens of {self.bytes_per_token} bytes")
        return routes.reshape(-1, len(self.layers), self.top_k)


def route_layout(model_path: str | Path) -> RouteLayout:
    """The layout of the routes of the model in `model_path`; RoutingError where
    its routing cannot be replayed (not a mixture of experts, or a family whose
    router the trainer does not replay)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    model_type = config.get("model_type", "")
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not experts:
        raise RoutingError(f"model directory {str(model_path)!r} ({model_type or 'no model_type'}) is not a "
                         "mixture of experts: it has no routing to replay")
    if model_type not in REPLAYABLE:
        raise RoutingError(f"model directory {str(model_path)!r}: routing replay is built for "
                         f"{', '.join(REPLAYABLE)}, not {model_type!r}")
    step, dense = int(config.get("decoder_sparse_step", 1)), set(config.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(int(config["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0)
    return RouteLayout(layers, int(config["num_experts_per_tok"]), experts)
