"""A hash of a model's weights, for the models whose weights must never change
(the reward model, the distillation teacher)."""
from __future__ import annotations

import hashlib


def state_digest(state: dict) -> str:
    """A hash of a model's weights (name and bytes of each): a reward model or a teacher
    logs it at load and at the run's end, and the checker requires them equal."""
    import torch
    h = hashlib.blake2b(digest_size=12)
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
