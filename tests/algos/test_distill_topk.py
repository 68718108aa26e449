"""Distillation's top-k KL (pipeline/algos/distill_topk.py) by hand: the teacher's
k likeliest tokens plus the tail as one more outcome, forward, reverse and
mixed; padding counts for nothing; the term is aggregated as the policy loss;
and collate lays the teacher's top-k out in the response window, padded or packed."""
from __future__ import annotations

import math

import pytest
import torch

from pipeline.algos.distill_topk import topk_kl
from pipeline.algos.policy_loss import PolicyLoss
from pipeline.config import PolicyLossConfig
from pipeline.trainer.rows import collate, pack_window

pytestmark = pytest.mark.unit

# One position of a 5-token vocabulary; the teacher's top-2 are ids 3 and 1.
TEACHER = [0.05, 0.25, 0.05, 0.6, 0.05]
STUDENT = [0.3, 0.2, 0.2, 0.1, 0.2]
TOP = [3, 1]


def by_hand(p: list[float], q: list[float]) -> float:
    """KL(p || q) over the top-2 and the tail (every other id as one outcome)."""
    p_tail, q_tail = 1 - sum(p[i] for i in TOP), 1 - sum(q[i] for i in TOP)
    return sum(p[i] * math.log(p[i] / q[i]) for i in TOP) + p_tail * math.log(p_tail / q_tail)


def tensors():
    logs = lambda probs: torch.tensor([[[math.log(probs[i]) for i in TOP]]])  # noqa: E731
    return logs(STUDENT), logs(TEACHER), torch.ones(1, 1)


@pytest.mark.parametrize("kl_type,expected", [
    ("forward", by_hand(TEACHER, STUDENT)),
    ("reverse", by_hand(STUDENT, TEACHER)),
    ("mixed", 0.3 * by_hand(TEACHER, STUDENT) + 0.7 * by_hand(STUDENT, TEACHER)),
])
def test_the_kl_over_the_teachers_top_k_and_the_tail_is_the_formula(kl_type, expected):
    student, teacher, mask = tensors()
    assert topk_kl(student, teacher, mask, kl_type, mixed_weight=0.3).item() == pytest.approx(expected, rel=1e-5)


def test_with_the_whole_vocabulary_it_is_the_full_kl_and_with_fewer_tokens_at_most_that():
    torch.manual_seed(0)
    student, teacher = torch.log_softmax(torch.randn(4, 9), -1), torch.log_softmax(3 * torch.randn(4, 9), -1)
    full = (teacher.exp() * (teacher - student)).sum(-1)
    for k in (9, 3):
        top = teacher.topk(k, -1).indices
        got = topk_kl(student.gather(-1, top), teacher.gather(-1, top), torch.ones(4), "forward")
        assert (got == pytest.approx(full.tolist(), abs=1e-5)) if k == 9 else bool((got <= full + 1e-6).all())


def test_the_forward_kls_gradient_raises_the_teachers_tokens_and_padding_gives_nothing():
    student, teacher, _ = tensors()
    student = torch.cat([student, torch.zeros(1, 1, 2)], dim=1).requires_grad_()  # a padded position: ids 0, lp 0
    teacher = torch.cat([teacher, torch.full((1, 1, 2), -50.0)], dim=1)
    kl = topk_kl(student, teacher, torch.tensor([[1.0, 0.0]]), "forward")
    assert kl[0, 1].item() == 0.0
    kl.sum().backward()
    assert torch.isfinite(student.grad).all() and student.grad[0, 1].abs().sum().item() == 0.0
    # The student's top token (id 3: 0.1 against the teacher's 0.6) is the one most pushed up.
    assert student.grad[0, 0, 0].item() < student.grad[0, 0, 1].item() < 0


def test_a_teacher_without_a_tail_gives_a_finite_kl():
    student = torch.log(torch.tensor([[0.5, 0.3]]))
    teacher = torch.log(torch.tensor([[0.7, 0.3]]))
    kl = topk_kl(student, teacher, torch.ones(1), "reverse")
    assert math.isfinite(kl.item()) and kl.item() > 0


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_the_term_is_aggregated_as_the_policy_loss_is(aggregation):
    loss = PolicyLoss(PolicyLossConfig(aggregation=aggregation), horizon=4)
    per_token, mask = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]]), torch.tensor([[1, 1, 1], [1, 0, 0]])
    expected = 10 / 4 if aggregation == "token-mean" else (2.0 + 4.0) / 2
    assert loss.aggregated(per_token, mask).item() == pytest.approx(expected)


def test_collate_lays_the_teachers_top_k_out_in_the_window_padded_and_packed():
    rows = [{"prompt_ids": [1, 2], "response_ids": [5, 6], "loss_mask": [1, 1],
             "topk_ids": [[5, 7], [6, 8]], "topk_logprobs": [[-0.1, -2.0], [-0.2, -3.0]]},
            {"prompt_ids": [1, 2, 3], "response_ids": [9], "loss_mask": [1],
             "topk_ids": [[9, 4]], "topk_logprobs": [[-0.3, -1.5]]}]
    padded, packed = collate(rows, "cpu", {}), collate(rows, "cpu", {}, packed=True)
    for batch in (padded, packed):
        assert batch["topk_ids"][batch["mask"]].tolist() == [[5, 7], [6, 8], [9, 4]]
        assert batch["topk_logprobs"][batch["mask"]].flatten().tolist() == pytest.approx([-0.1, -2.0, -0.2, -3.0,
                                                                                          -0.3, -1.5])
    # A packed forward's per-position top-k values land where the padded ones are.
    kept = torch.arange(6, dtype=torch.float32).view(3, 2)
    assert pack_window(kept, packed)[packed["mask"]].tolist() == kept.tolist()
    assert packed["topk_ids"].view(-1, 2)[packed["slots"]].tolist() == [[5, 7], [6, 8], [9, 4]]
