"""What the teacher puts in a batch (pipeline/distill/worker.with_teacher_scores):
its logprobs, and with distill.loss topk_kl its top-k at every response token,
refused unless each row has them for each of its response tokens, k each."""
from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.config import SimConfig
from pipeline.core.types import TRAJECTORY_SCHEMA, TeacherScores
from pipeline.distill.worker import with_teacher_scores
from pipeline.sim.engines import SimTeacher

pytestmark = pytest.mark.unit


def batch(responses: list[list[int]]) -> pa.Table:
    return pa.Table.from_pylist([{"prompt_ids": [1], "response_ids": r, "reward": 0.0} for r in responses],
                                schema=TRAJECTORY_SCHEMA)


def test_the_teachers_top_k_lands_in_the_batch_k_a_token():
    table = batch([[5, 6], [7]])
    scores = SimTeacher(SimConfig(score_s=0), topk=3).score(table.column("prompt_ids").to_pylist(),
                                                            table.column("response_ids").to_pylist())
    taught = with_teacher_scores(table, scores)
    assert taught.schema == TRAJECTORY_SCHEMA
    assert taught.column("teacher_topk_ids").to_pylist() == [[[0, 1, 2], [0, 1, 2]], [[0, 1, 2]]]
    assert [len(t) for row in taught.column("teacher_topk_logprobs").to_pylist() for t in row] == [3, 3, 3]
    plain = with_teacher_scores(table, TeacherScores(scores.logprobs))
    assert plain.column("teacher_topk_ids").null_count == 2 and plain.column("teacher_logprobs").null_count == 0


@pytest.mark.parametrize("ids,logprobs,message", [
    ([[[1, 2]]], [[[-0.1, -2.0]]], r"row 0: the teacher's top-k has 1 id and 1 logprob lists .* for 2 response"),
    ([[[1, 2], [3]]], [[[-0.1, -2.0], [-0.2]]], r"sizes \[\(1, 1\), \(2, 2\)\]"),
    ([[[1, 2], [3, 4]]], [[[-0.1, -2.0], [-0.2, float("nan")]]], r"all finite: False"),
])
def test_a_top_k_that_does_not_fit_the_batch_is_refused(ids, logprobs, message):
    with pytest.raises(ValueError, match=message):
        with_teacher_scores(batch([[5, 6]]), TeacherScores([[-0.5, -0.5]], ids, logprobs))
