"""Distillation on two data-parallel ranks (real DeepSpeed, one gloo group):
each rank trains its own rows with the teacher's advantage of those rows, so
two ranks with micro-batch m take the single process's step with 2m, as
without a teacher (tests/core/test_data_parallel.py), and every rank logs the
batch's KL to the teacher."""
from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.config import load_config
from tests.core.test_data_parallel import TOLERANCE, _initial, _step
from tests.support.training_helpers import make_table, model_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.real


def taught_table(groups: int = 5, group_size: int = 2, topk: int = 0) -> pa.Table:
    """Prompt groups with flat rewards (no task advantage), a teacher logprob
    of its own on every token (and with `topk`, its k likeliest ids and their
    logprobs), and an environment's token (mask 0) in every second row: only
    the teacher can move the weights, row by row."""
    table = make_table(groups=groups, group_size=group_size, rewards=[1.0] * groups * group_size)
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    teacher = [[-4.5 - 0.4 * ((i + t) % 7) for t in range(n)] for i, n in enumerate(lengths)]
    masks = [[0 if i % 2 and t == 1 else 1 for t in range(n)] for i, n in enumerate(lengths)]
    columns = [("teacher_logprobs", teacher), ("loss_mask", masks)]
    if topk:
        columns += [("teacher_topk_ids", [[[(7 * i + t + j) % 50 for j in range(topk)] for t in range(n)]
                                          for i, n in enumerate(lengths)]),
                    ("teacher_topk_logprobs", [[[-1.0 - j - 0.1 * ((i + t) % 5) for j in range(topk)]
                                                for t in range(n)] for i, n in enumerate(lengths)])]
    for name, values in columns:
        column = table.schema.get_field_index(name)
        table = table.set_column(column, table.schema.field(column), pa.array(values, table.schema.field(name).type))
    return table


def config(model, tmp_path, ranks: int, micro: int, loss: str):
    return load_config(None, [f"distill.loss={loss}",
        "backend=real", f"model.path={model}", "data.train=data/tiny_train.jsonl", f"run.output_dir={tmp_path}",
        "schedule.group_size=2", f"training.ranks={ranks}", f"training.micro_batch_size={micro}",
        "training.zero_stage=2", "training.lr=1e-3", f"distill.teacher={model}", "distill.task_reward=false"])


@pytest.mark.parametrize("loss,metric", [("sampled_reverse_kl", "distill/kl"), ("topk_kl", "distill/topk_kl")])
def test_two_ranks_take_the_single_process_distillation_step(model_dir, tmp_path, ray_session, loss,  # noqa: F811
                                                             metric):
    table = taught_table(topk=4 if loss == "topk_kl" else 0)
    one, one_metrics = _step(config(model_dir, tmp_path / "one", 1, 4, loss), table, tmp_path / "one")
    two, two_metrics = _step(config(model_dir, tmp_path / "two", 2, 2, loss), table, tmp_path / "two")
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst <= TOLERANCE, f"2 ranks differ from 1 by {worst:.3g}"
    moved = max((one[k] - v).abs().max().item() for k, v in _initial(model_dir).items())
    assert moved > 50 * TOLERANCE  # the teacher's advantage moved the weights
    assert [m["shard_rows"] for m in two_metrics] == [6.0, 4.0]
    kl = one_metrics[0][metric]
    assert kl > 0.5 and [m[metric] for m in two_metrics] == pytest.approx([kl, kl])
