"""Weights between trainer and engine: one flat buffer for the object store
(where they land in a running vLLM model: pipeline/generator/refit_plan.py).

In the object store: Ray pickles a dict of torch tensors tensor by tensor, and unpickles it into
fresh copies on the reader's side; a single numpy buffer is written once and
read back as a view of the shared memory, which the generator's load then
copies into its engine. On the tiny model that took the trainer's put from
3.6 to 1.3 ms and the generator's get from 2.2 to 0.5 ms (measured with
benchmarks/step_profile.py's spans). Anything that is not a dict of tensors
(the simulated backend's weights) is stored as it is.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

ALIGN = 64  # bytes


@dataclass(frozen=True)
class FlatWeights:
    buffer: Any                                              # numpy uint8, every tensor's bytes
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]  # (name, torch dtype name, shape, byte offset)

    def tensors(self) -> dict:
        """{name: tensor}, views of the buffer (read-only memory when it came from the object store)."""
        import torch
        with warnings.catch_warnings():
            # The object store's buffer is read-only; nothing here writes to it.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.buffer)
        out = {}
        for name, dtype_name, shape, offset in self.entries:
            dtype = getattr(torch, dtype_name)
            size = math.prod(shape) * dtype.itemsize
            out[name] = raw[offset:offset + size].view(dtype).view(shape)
        return out


def pack(state: Any) -> Any:
    """A FlatWeights of a {name: tensor} dict; anything else unchanged."""
    if not isinstance(state, dict) or not state or not all(hasattr(v, "untyped_storage") for v in state.values()):
        return state
    import numpy as np
    import torch
    entries, offset = [], 0
    for name, tensor in state.items():
        entries.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        # Every tensor starts on an aligned offset, so any dtype can view its bytes.
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    buffer = np.empty(offset, dtype=np.uint8)
    for (name, _, _, start), tensor in zip(entries, state.values()):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[start:start + flat.numel()] = flat.numpy()
    return FlatWeights(buffer, tuple(entries))


def unpack(stored: Any) -> Any:
    return stored.tensors() if isinstance(stored, FlatWeights) else stored
