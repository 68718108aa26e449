"""On-policy distillation's per-token advantage, and its mix with the task's
(distill.loss sampled_reverse_kl; the top-k loss is pipeline/algos/distill_topk.py).

The student samples; the teacher scores every sampled token (pipeline/distill/).
Each model token t earns the negative reverse KL to the teacher, estimated on
the token sampled:

    A_distill[t] = -(log pi_student(x_t) - log pi_teacher(x_t))

with the student's logprob as it sampled x_t (the rollout's `logprobs`, the
behaviour policy's, so an async batch is scored as it was drawn), no discount
and no whitening: each token is its own return. This follows Thinking
Machines' "On-Policy Distillation" (Lu et al. 2025) and Tinker's cookbook
(tinker_cookbook/distillation: advantages = -coef x mask x (sampled - teacher
logprob)); verl, SkyRL and prime-rl use the same per-token reverse KL.
`kl_clip` bounds each token's KL to [-kl_clip, kl_clip] first, so a token the
teacher finds near-impossible cannot dominate a batch (0: no clipping).

    A = A_task + coef x A_distill      (distill.task_reward true)
    A = coef x A_distill               (false: pure distillation)

Only model tokens (loss_mask 1) get A_distill; an environment's or a tool's
tokens get 0 and are left out of the KL metric, as the loss leaves them out.
No engine state, so the math can be checked by hand (tests/algos/test_distill.py).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa


def distill_advantages(table: pa.Table, kl_clip: float = 0.0) -> tuple[list[np.ndarray], float]:
    """Each row's A_distill per response token, and the batch's mean reverse
    KL per model token (unclipped: what the student is from the teacher)."""
    rows = table.select(["logprobs", "teacher_logprobs", "loss_mask"]).to_pylist()
    out, kls = [], []
    for i, row in enumerate(rows):
        student = np.asarray(row["logprobs"], np.float64)
        if row["teacher_logprobs"] is None:
            raise ValueError(f"row {i} has no teacher logprobs: the teacher did not score its batch")
        teacher = np.asarray(row["teacher_logprobs"], np.float64)
        mask = np.asarray(row["loss_mask"] or [1] * len(student), np.float64)
        if not len(teacher) == len(mask) == len(student):
            raise ValueError(f"row {i}: {len(student)} logprobs, {len(teacher)} teacher logprobs, "
                             f"{len(mask)} mask values")
        kl = student - teacher
        kls.append(kl[mask > 0])
        clipped = np.clip(kl, -kl_clip, kl_clip) if kl_clip > 0 else kl
        out.append(-clipped * mask)
    every = np.concatenate(kls) if kls else np.zeros(0)
    return out, float(every.mean()) if every.size else 0.0


def mix_distillation(table: pa.Table, task: pa.Table, coef: float, kl_clip: float = 0.0,
                     task_reward: bool = True) -> tuple[pa.Table, float]:
    """`task` (an advantages table aligned with `table`, its `advantages` one
    float per response token) with coef x A_distill added, or in its place
    without task_reward; its other columns (PPO's returns, values) unchanged.
    Returns the table and the batch's mean reverse KL per model token."""
    distilled, kl = distill_advantages(table, kl_clip)
    base = task.column("advantages").to_pylist()
    mixed = []
    for i, (a, d) in enumerate(zip(base, distilled, strict=True)):
        if len(a) != len(d):
            raise ValueError(f"row {i}: {len(a)} task advantages for {len(d)} response tokens")
        mixed.append(((np.asarray(a, np.float64) if task_reward else 0.0) + coef * d).astype(np.float32))
    column = task.schema.get_field_index("advantages")
    values = pa.array([m.tolist() for m in mixed], pa.list_(pa.float32()))
    return task.set_column(column, task.schema.field(column), values), kl
