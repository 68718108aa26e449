"""The optimiser controls a recipe sets (training.grad_clip, weight_decay,
lr_schedule, lr_warmup_steps): DeepSpeed's AdamW with a learning rate that is
a function of the optimizer step alone.

The rate is set from DeepSpeed's global step before each update, not by a
scheduler object that counts its own calls: that step is in every checkpoint,
so a resumed run continues the schedule exactly, and a step skipped for a
non-finite loss (pipeline/trainer/finite.py) does not advance it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.config import Config

@dataclass(frozen=True)
class Optimizer:
    """The training section's optimiser keys (recipe_optimizer), checked where the recipe is loaded."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0       # max global gradient norm; 0 = no clipping
    schedule: str = "constant"   # after the warm-up: constant, linear to 0, or cosine to 0
    warmup_steps: int = 0        # linear ramp from lr / (warmup_steps + 1) to lr
    total_steps: int = 0         # where linear and cosine reach 0 (the run's steps; > warmup_steps unless constant)


def lr_factor(opt: Optimizer, step: int) -> float:
    """The learning rate of update number `step` (0-based) over the base rate."""
    if step < opt.warmup_steps:
        return (step + 1) / (opt.warmup_steps + 1)
    if opt.schedule == "constant":
        return 1.0
    done = min(1.0, (step - opt.warmup_steps) / (opt.total_steps - opt.warmup_steps))
    if opt.schedule == "linear":
        return 1.0 - done
    return 0.5 * (1.0 + math.cos(math.pi * done))


def set_lr(torch_optimizer, base_lr: float, opt: Optimizer, step: int) -> float:
    """Set every parameter group's rate for update `step`; returns it."""
    lr = base_lr * lr_factor(opt, step)
    for group in torch_optimizer.param_groups:
        group["lr"] = lr
    return lr


def recipe_optimizer(cfg: Config) -> Optimizer:
    """training's optimiser controls, for the policy and the critic alike."""
    t = cfg.training
    return Optimizer(weight_decay=t.weight_decay, grad_clip=t.grad_clip, schedule=t.lr_schedule,
                     warmup_steps=t.lr_warmup_steps, total_steps=cfg.run.steps)
