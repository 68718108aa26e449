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
    policy learns from the per-token KL to it (loss), alone or added to the task
    reward's advantage."""
    teacher: str = _key("", "the teacher's HF model directory, whose tokenizer must be model.path's; empty: no "
                        "distillation (backend sim: a simulated teacher, the path is not read)")
    loss: Literal["sampled_reverse_kl", "topk_kl"] = _key(
        "sampled_reverse_kl", "sampled_reverse_kl: the reverse KL of each sampled token as its advantage (Tinker); "
        "topk_kl: a loss term, the KL between the teacher's top-k tokens and the student's (NeMo-RL)")
    coef: float = _key(1.0, "weight of the distillation: A = A_task + coef x A_distill per model token "
                       "(sampled_reverse_kl), or loss = policy loss + coef x top-k KL (topk_kl)", ge=0)
    topk: int = _key(16, "loss topk_kl: the teacher's top-k token ids and logprobs kept per model token "
                     "(at most the vocabulary)", ge=1)
    kl_type: Literal["forward", "reverse", "mixed"] = _key(
        "forward", "loss topk_kl: forward KL(teacher || student), reverse KL(student || teacher), or "
        "mixed_kl_weight x forward + (1 - mixed_kl_weight) x reverse")
    mixed_kl_weight: float = _key(0.5, "kl_type mixed: the forward KL's share", ge=0, le=1)
    task_reward: bool = _key(True, "add the algorithm's advantage of the task reward; false: coef x A_distill "
                             "alone (pure distillation: data.reward may then be empty)")
    kl_clip: float = _key(0.0, "sampled_reverse_kl: clip each token's reverse KL (student - teacher logprob) to [-kl_clip, kl_clip] "
                          "before it becomes an advantage; 0 = no clipping", ge=0)
    batch_size: int = _key(16, "samples per teacher forward (like lengths together)", ge=1)
    dtype: Literal["fp32", "bf16", "auto"] = _key(
        "fp32", "the teacher's dtype; auto: bf16 where its device has it (as training.dtype auto)")
