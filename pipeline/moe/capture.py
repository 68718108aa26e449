"""The experts vLLM routes each token to, recorded in the engine's process.

vLLM 0.32 returns routed experts (enable_return_routed_experts) only from its
model runner V2, which needs Triton: the CPU build refuses it at start-up. So
the recorder hooks what both runners have: each MoE layer's router reports its
top-k ids (BaseRouter.set_capture_fn, the hook vLLM's own capturer uses) and
the model runner's execute_model is wrapped to split a forward's rows by
request and position. A prompt's blocks served from the prefix cache run no
forward: the routes of every full block computed are kept by the block's hash
(vLLM's prefix-cache key) until the cache is reset, and a request that starts
from cached blocks takes their routes from there.
"""
from __future__ import annotations

from collections import OrderedDict
from functools import partial
from typing import Any

import numpy as np
import torch

from pipeline.moe.routes import RouteLayout


class _Routes:
    """One request's routes so far, by position."""

    def __init__(self, length: int, layout: RouteLayout):
        self.routes = np.zeros((length, len(layout.layers), layout.top_k), dtype=layout.dtype)
        self.filled = np.zeros(length, dtype=bool)
        self.started = False
        self.saved_blocks = 0   # leading full blocks whose routes are in the recorder's block store


class RouteRecorder:
    """Routes of the requests it tracks, for routing replay (training.routing_replay)."""

    def __init__(self, engine: Any, layout: RouteLayout):
        """`engine`: an in-process vLLM LLMEngine serving a model with `layout`."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
        self.layout = layout
        runner = engine.model_executor.driver_worker.model_runner
        core = engine.engine_core.engine_core
        self._runner, self._scheduler = runner, core.scheduler
        self._block = int(engine.vllm_config.cache_config.block_size)
        self._max_blocks = int(self._scheduler.kv_cache_manager.block_pool.num_gpu_blocks)
        slots = {layer: i for i, layer in enumerate(layout.layers)}
        self._step: list[torch.Tensor | None] = [None] * len(slots)
        bound = set()
        for module in runner.model.modules():
            if isinstance(module, MoERunner):
                module.router.set_capture_fn(partial(self._capture, slots[module.layer_id]))
                bound.add(module.layer_id)
        if bound != set(layout.layers):
            raise RuntimeError(f"routing replay: vLLM's model has routers in layers {sorted(bound)}, "
                               f"config.json says {list(layout.layers)}")
        self._requests: dict[str, _Routes] = {}   # by vLLM's request id
        self._ids: dict[str, str] = {}            # vLLM's request id of each request, by the caller's key
        self._blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()
        execute = runner.execute_model
        runner.execute_model = lambda scheduler_output, *args, **kwargs: self._recorded(
            execute, scheduler_output, *args, **kwargs)

    def track(self, key: str, request_id: str, length: int) -> None:
        """Record the request `key` (vLLM's id for it: `request_id`), of at most `length` tokens."""
        self._requests[request_id] = _Routes(length, self.layout)
        self._ids[key] = request_id

    def take(self, key: str, tokens: int) -> bytes:
        """The first `tokens` positions' routes of a finished request (RouteLayout.encode), no longer tracked."""
        rec = self._requests.pop(self._ids.pop(key))
        missing = np.flatnonzero(~rec.filled[:tokens])
        if missing.size:
            raise RuntimeError(f"routing replay: no routes recorded for {missing.size} of the {tokens} tokens "
                               f"of request {key} (the first at position {missing[0]})")
        return self.layout.encode(rec.routes[:tokens])

    def drop(self, keys) -> None:
        for key in keys:
            self._requests.pop(self._ids.pop(key, None), None)

    def reset_blocks(self) -> None:
        """The prefix cache was reset: its blocks, and so their routes, are gone."""
        self._blocks.clear()

    def _capture(self, slot: int, topk_ids: torch.Tensor) -> None:
        self._step[slot] = topk_ids.detach()

    def _recorded(self, execute, scheduler_output, *args, **kwargs):
        self._step = [None] * len(self._step)
        out = execute(scheduler_output, *args, **kwargs)
        if self._step[0] is not None:
            self._file(scheduler_output)
        return out

    def _file(self, scheduler_output) -> None:
        """Split the forward's rows, laid out request by request in the input batch's order."""
        counts = scheduler_output.num_scheduled_tokens
        total = sum(counts.values())
        rows = torch.stack([ids[:total] for ids in self._step], dim=1).cpu().numpy()
        positions = self._runner.positions[:total].cpu().numpy()
        at = 0
        for request_id in self._runner.input_batch.req_ids:
            n = counts.get(request_id, 0)
            rec = self._requests.get(request_id)
            if rec is not None and n:
                self._file_request(request_id, rec, positions[at:at + n], rows[at:at + n])
            at += n

    def _file_request(self, request_id: str, rec: _Routes, positions: np.ndarray, rows: np.ndarray) -> None:
        hashes = self._scheduler.requests[request_id].block_hashes
        if not rec.started:
            rec.started = True
            self._from_cache(rec, hashes, int(positions[0]))
        keep = positions < len(rec.filled)
        rec.routes[positions[keep]] = rows[keep]
        rec.filled[positions[keep]] = True
        b = self._block
        while rec.saved_blocks < len(hashes) and rec.filled[rec.saved_blocks * b:(rec.saved_blocks + 1) * b].all():
            k = rec.saved_blocks
            self._blocks[hashes[k]] = rec.routes[k * b:(k + 1) * b].copy()
            self._blocks.move_to_end(hashes[k])
            rec.saved_blocks += 1
        while len(self._blocks) > self._max_blocks:
            self._blocks.popitem(last=False)

    def _from_cache(self, rec: _Routes, hashes, start: int) -> None:
        """The routes of the blocks a request's first forward starts after (served from the prefix cache)."""
        b = self._block
        for k in range(start // b):
            block = self._blocks.get(hashes[k])
            if block is not None:
                rec.routes[k * b:(k + 1) * b] = block
                rec.filled[k * b:(k + 1) * b] = True
        rec.saved_blocks = start // b
