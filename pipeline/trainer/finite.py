"""Non-finite values never reach the weights: a step whose loss or gradient holds
a NaN or inf leaves the weights and the optimizer state as they were, and
weights that hold one are never saved.

Every rank decides together: a rank that stepped while another skipped would
part the ranks' weights for good (and, under ZeRO, hang the next gather).
"""
from __future__ import annotations

import math

import torch


class NonfiniteWeightsError(ValueError):
    """Weights holding a NaN or inf, refused by a save; the message names them."""


def agree(ok: bool, world_size: int, device) -> bool:
    """Whether `ok` holds on every rank (a collective when there are several)."""
    if world_size == 1:
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item() == 0.0


def gradients_finite(engine, zero_stage: int, local_norm: float | None) -> bool:
    """Whether every gradient is finite, on every rank, before the step.

    Without ZeRO each rank holds the whole gradient (all-reduced in the last
    backward), so its norm tells. ZeRO 1-3 partition the gradients: DeepSpeed's
    own overflow check reads this rank's partition and agrees with the others."""
    if zero_stage == 0:
        return local_norm is not None and math.isfinite(local_norm)
    return not engine.optimizer.has_overflow(partition_gradients=True)


def torch_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer under DeepSpeed's wrappers (ZeRO, bf16), which alone writes
    the master weights and Adam's moments and step."""
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


def _no_update(*_args, **_kwargs) -> None:
    return None


def step(engine, skip: bool) -> bool:
    """engine.step(); with `skip`, DeepSpeed's step runs whole (it reduces, clears
    its gradient buffers and copies the master weights, unchanged, back into the
    model, on every ZeRO stage and dtype alike) but the torch optimizer does
    nothing. Returns whether no update was applied (skipped here, or dropped by
    DeepSpeed's own overflow check); such a step is not counted in global_steps."""
    inner = torch_optimizer(engine)
    steps, samples = engine.global_steps, engine.global_samples
    if skip:
        inner.step = _no_update  # an instance attribute shadows the method for this one step
    try:
        engine.step()
    finally:
        if skip:
            del inner.step
    skipped = skip or not engine.was_step_applied()
    if skipped:
        engine.global_steps, engine.global_samples = steps, samples
    return skipped


def nonfinite_parameters(module: torch.nn.Module) -> list[str]:
    """Names of the parameters holding a NaN or inf: this rank's partitions under ZeRO-3."""
    bad = []
    for name, p in module.named_parameters():
        held = getattr(p, "ds_tensor", None)
        held = p if held is None else held
        if held.numel() and not bool(torch.isfinite(held.detach()).all()):
            bad.append(name)
    return bad


def refuse_nonfinite_weights(module: torch.nn.Module, world_size: int, device, what: str) -> None:
    """Raise NonfiniteWeightsError, on every rank, if any rank's weights hold a NaN
    or inf: a checkpoint of them would resume into the same broken weights."""
    bad = nonfinite_parameters(module)
    if agree(not bad, world_size, device):
        return
    if not bad:
        names = "a parameter partition of another rank"
    else:
        names = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    raise NonfiniteWeightsError(f"refusing to save {what}: non-finite weights (NaN or inf) in {names}; "
                                "the last complete checkpoint is still the one --resume picks")
