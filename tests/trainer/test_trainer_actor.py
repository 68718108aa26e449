"""The trainer actor's train node on the simulated engine: it computes GRPO's
group advantages from the table (pipeline/algos/advantages.py) and hands them to the
engine, refuses a table that is not in prompt groups, and reports the rewards.
"""
from __future__ import annotations

import time

import pyarrow as pa
import pytest
from tests.support.training_helpers import make_table

from dags.tokens import Batch, Stored
from pipeline.core.node import NodeError
from pipeline.trainer.worker import TrainerWorker
from pipeline.core.types import TRAJECTORY_SCHEMA
from pipeline.config import load_config

pytestmark = pytest.mark.sim


def trainer(tmp_path) -> TrainerWorker:
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "backend=sim", "schedule.group_size=2",
                             "sim.train_s=0"])
    worker = TrainerWorker()
    worker.begin_run(cfg, str(tmp_path), time.time())
    return worker


def test_grpo_train_passes_group_advantages_and_reports_the_rewards(tmp_path, ray_session):
    worker = trainer(tmp_path)
    passed = []
    train_step = worker.engine.train_step
    worker.engine.train_step = lambda table, advantages: passed.append(advantages) or train_step(table, advantages)
    table = make_table()  # rewards [0, 1] in each of 3 groups of 2
    out = worker.train(Batch(0, ("b0",), (0,), Stored(ray_session.put(table))))
    metrics = dict(out.metrics)
    # mean 0.5; population std 0.5: every reward is 0.5 from the mean
    assert metrics["reward_mean"] == 0.5 and metrics["reward_std"] == 0.5
    # -+0.5 / (0.5 + 1e-6) on each token of the rows of reward 0 and 1
    a = 0.5 / (0.5 + 1e-6)
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    got = passed[0].column("advantages").to_pylist()
    assert [len(row) for row in got] == lengths
    assert [row[0] for row in got] == pytest.approx([-a, a] * 3) and all(len(set(row)) == 1 for row in got)
    worker.log.close()


def test_grpo_train_refuses_misordered_groups(tmp_path, ray_session):
    worker = trainer(tmp_path)
    rows = make_table().to_pylist()
    rows[1], rows[2] = rows[2], rows[1]
    table = pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)
    with pytest.raises(NodeError, match="must be one prompt group"):
        worker.train(Batch(0, ("b0",), (0,), Stored(ray_session.put(table))))
    assert worker.engine.updates == 0 and worker.version == 0  # nothing trained
    worker.log.close()


def test_train_lets_its_weight_copy_go_before_the_heap_check(tmp_path, ray_session):
    """Once the step's weights are in the object store the trainer's own copy
    must be gone when the heap cap takes its floor, or a floor holds a whole
    weight copy as the allocator happened to place it (pipeline/core/memory.py)."""
    import weakref

    import torch
    worker = trainer(tmp_path)
    copies, alive_at_check = [], []

    def export_weights():
        weights = torch.ones(1024)
        copies.append(weakref.ref(weights))
        return {"w": weights}

    worker.engine.export_weights = export_weights
    worker.heap.check_logged = lambda log, step: alive_at_check.append(copies[-1]() is not None)
    out = worker.train(Batch(0, ("b0",), (0,), Stored(ray_session.put(make_table()))))
    assert out.weights_ref and alive_at_check == [False]
    worker.log.close()
