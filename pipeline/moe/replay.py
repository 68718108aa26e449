"""Routing replay in the trainer's forward (training.routing_replay).

Each MoE layer's router takes the experts the engine routed the token to
(pipeline/moe/capture.py) instead of its own top-k, and weighs them with its
own softmax at those experts (renormalised where the model does): the
variant of verl's and Megatron's R3, which replays the indices and recomputes
the gates from the current router, so the router keeps its gradient and the
gates follow the weights being trained. Tokens without a route (a sample's
last token, whose output no loss reads; padding) route as the model would.
"""
from __future__ import annotations

import contextlib
import contextvars
import types
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.moe.routes import RouteLayout



@dataclass
class Replay:
    """The routes of the forwards running now, and how many of them the routers would have changed."""
    ids: torch.Tensor        # expert ids [moe_layers, positions, top_k]
    use: torch.Tensor        # the positions that have a route [positions]
    apply: bool              # replay them (else only count the flips)
    flipped: torch.Tensor    # positions where some layer's own top-k differs from the route [positions]
    batch: dict              # the collated micro-batch whose routes these are

    @property
    def routed(self) -> int:
        return int(self.use.sum())

    @property
    def flip_share(self) -> float:
        """The share of routed positions whose own routing differs in some layer."""
        return float(self.flipped[self.use].float().mean()) if self.routed else 0.0


_ACTIVE: contextvars.ContextVar[Replay | None] = contextvars.ContextVar("dagrl_replayed_routes", default=None)


def install_replay(model: torch.nn.Module, layout: RouteLayout) -> int:
    """Make `model`'s routers (Qwen3-MoE's) replay the routes `replaying` sets; returns how many.
    Only this model's routers change: another model of the family in the process routes as before."""
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    if len(routers) != len(layout.layers):
        raise RuntimeError(f"routing replay: the model has {len(routers)} routers, config.json says "
                           f"{len(layout.layers)} MoE layers")
    for slot, router in enumerate(routers):
        router.replay_slot = slot
        router.forward = types.MethodType(_replayed_forward, router)
    return len(routers)


def _replayed_forward(self, hidden_states: torch.Tensor):
    """Qwen3MoeTopKRouter.forward, its top-k replaced where a route is replayed."""
    logits = F.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, indices = torch.topk(probs, self.top_k, dim=-1)
    active = _ACTIVE.get()
    if active is not None:
        if active.ids.shape[1] != indices.shape[0]:
            raise RuntimeError(f"routing replay: routes for {active.ids.shape[1]} positions, the router sees "
                               f"{indices.shape[0]}")
        route = active.ids[self.replay_slot]
        with torch.no_grad():
            active.flipped |= (indices.sort(dim=-1).values != route.sort(dim=-1).values).any(dim=-1)
        if active.apply:
            indices = torch.where(active.use[:, None], route, indices)
            top = probs.gather(-1, indices)
    if self.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), indices


@contextlib.contextmanager
def replaying(layout: RouteLayout, batch: dict, apply: bool = True):
    """Forwards of a collated micro-batch (pipeline/trainer/rows.collate) inside
    this replay its rows' routes (`apply` False: only count how many the routers
    would change). Yields the Replay, None for a batch without routes (which
    routes as the model does)."""
    routes = batch.get("routed_experts")
    active = _ACTIVE.get()
    if routes is None or (active is not None and active.batch is batch):
        yield active  # a forward inside a caller's replay of the same batch
        return
    if active is not None:
        raise RuntimeError("routing replay: a forward of another micro-batch inside a replay")
    ids = batch["ids"]
    expert_ids, use = route_tensors(layout, routes, _row_spans(batch), ids.numel(), ids.device)
    replay = Replay(expert_ids, use, apply, torch.zeros_like(use), batch)
    token = _ACTIVE.set(replay)
    try:
        yield replay
    finally:
        _ACTIVE.reset(token)


def route_tensors(layout: RouteLayout, routes: list[bytes | None], spans: list[tuple[int, int]], total: int,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """The routers' view of a micro-batch of `total` positions: expert ids
    [moe_layers, total, top_k] and a mask of the positions replayed, from each
    row's routes and its (first position, tokens) in the flattened forward."""
    ids = np.zeros((len(layout.layers), total, layout.top_k), dtype=np.int64)
    use = np.zeros(total, dtype=bool)
    for i, (data, (start, n)) in enumerate(zip(routes, spans, strict=True)):
        if data is None:
            continue
        row = layout.decode(data)
        if len(row) != n - 1:
            raise ValueError(f"routed_experts: row {i} of the micro-batch has routes for {len(row)} tokens; its "
                             f"{n} tokens need {n - 1} (all but the last)")
        ids[:, start:start + len(row)] = row.transpose(1, 0, 2)
        use[start:start + len(row)] = True
    return torch.from_numpy(ids).to(device), torch.from_numpy(use).to(device)


def _row_spans(batch: dict) -> list[tuple[int, int]]:
    """(first position, tokens) of each row in the forward's flattened positions."""
    if "positions" in batch:  # packed: each row's positions restart at 0
        starts = torch.nonzero(batch["positions"][0] == 0).flatten().tolist()
        ends = starts[1:] + [batch["ids"].shape[1]]
        return [(s, e - s) for s, e in zip(starts, ends)]
    width = batch["ids"].shape[1]
    return [(i * width, int(n)) for i, n in enumerate(batch["attn"].sum(dim=1).tolist())]
