"""The `distill` section: on-policy distillation from a teacher model
(pipeline/distill/, pipeline/algos/distill.py; docs/distillation.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipeline.config.keys import _key


@dataclass(frozen=True)
class DistillConfig:
    """A teacher scores every model token of each finished rollout batch, on an
    actor of its own (resources.teacher), before the buffer takes the batch; the
    policy learns from the per-token reverse KL to it, alone or added to the
    task reward's advantage."""
    teacher: str = _key("", "the teacher's HF model directory, whose tokenizer must be model.path's; empty: no "
                        "distillation (backend sim: a simulated teacher, the path is not read)")
    coef: float = _key(1.0, "weight of the distillation advantage: A = A_task + coef x A_distill per model token",
                       ge=0)
    task_reward: bool = _key(True, "add the algorithm's advantage of the task reward; false: coef x A_distill "
                             "alone (pure distillation: data.reward may then be empty)")
    kl_clip: float = _key(0.0, "clip each token's reverse KL (student - teacher logprob) to [-kl_clip, kl_clip] "
                          "before it becomes an advantage; 0 = no clipping", ge=0)
    batch_size: int = _key(16, "samples per teacher forward (like lengths together)", ge=1)
    dtype: Literal["fp32", "bf16", "auto"] = _key(
        "fp32", "the teacher's dtype; auto: bf16 where its device has it (as training.dtype auto)")
