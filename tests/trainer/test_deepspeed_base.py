"""What both DeepSpeed engines share (pipeline/trainer/deepspeed_base.py), checked
without starting DeepSpeed: the rows they accept, per-token columns, the
collated response window, the config, and the model-directory check.
"""
from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from tests.support.training_helpers import engine_config, make_table

from pipeline.trainer.deepspeed_base import ds_config
from pipeline.trainer.rows import collate, token_column, trajectory_rows
from pipeline.trainer.deepspeed_critic import DeepSpeedCriticEngine
from pipeline.trainer.deepspeed_policy import DeepSpeedPolicyEngine
from pipeline.trainer.optim import Optimizer
from pipeline.core.types import TRAJECTORY_SCHEMA
from pipeline.inputs.models import ModelError

pytestmark = pytest.mark.real


def edited(row: int, **changes) -> pa.Table:
    rows = make_table().to_pylist()
    rows[row].update(changes)
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


@pytest.mark.parametrize("table, message", [
    (make_table().drop_columns(["reward"]), r"lacks columns \['reward'\]"),
    (TRAJECTORY_SCHEMA.empty_table(), "has no rows"),
    (edited(2, reward=None), "row 2 has no reward"),
    (edited(1, prompt_ids=[]), "row 1 has an empty prompt"),
    (edited(3, logprobs=[-1.0]), "row 3: 1 logprobs for 4 response tokens"),
])
def test_trajectory_rows_refuses_what_cannot_be_trained_on(table, message):
    with pytest.raises(ValueError, match=message):
        trajectory_rows(table)


def test_trajectory_rows_need_no_groups():
    # A slice of 5 rows of groups of 2: the engines never look at groups.
    assert len(trajectory_rows(make_table().slice(0, 5))) == 5


def test_token_column_must_align_with_the_rows():
    table = make_table(groups=1, responses=[[5, 6], [7]])
    rows = trajectory_rows(table)
    good = pa.table({"returns": [[1.0, 2.0], [3.0]]})
    assert token_column(good, "returns", rows) == [[1.0, 2.0], [3.0]]
    with pytest.raises(ValueError, match="lacks the per-token column 'values'"):
        token_column(good, "values", rows)
    with pytest.raises(ValueError, match="returns: 1 rows for a batch of 2"):
        token_column(good.slice(0, 1), "returns", rows)
    with pytest.raises(ValueError, match="returns: row 1 has 2 values for 1 response tokens"):
        token_column(pa.table({"returns": [[1.0, 2.0], [3.0, 4.0]]}), "returns", rows)


def test_collate_lays_every_row_out_in_one_response_window():
    # Prompts of 3 and 2 tokens: the window starts at min(P) - 1 = 1 and covers
    # positions 1..3 of the width-5 batch, whose logits predict tokens 2..4.
    # Row 0's response [6, 7] sits at 3, 4 -> window slots 1, 2; row 1's [8] at 2 -> slot 0.
    rows = [{"prompt_ids": [1, 2, 3], "response_ids": [6, 7], "lp": [-1.0, -2.0]},
            {"prompt_ids": [4, 5], "response_ids": [8], "lp": [-3.0]}]
    b = collate(rows, "cpu", {"gen": "lp"})
    assert b["start"] == 1
    assert b["ids"].tolist() == [[1, 2, 3, 6, 7], [4, 5, 8, 0, 0]]
    assert b["attn"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert b["mask"].tolist() == [[False, True, True], [True, False, False]]
    assert torch.equal(b["gen"], torch.tensor([[0.0, -1.0, -2.0], [-3.0, 0.0, 0.0]]))
    # The targets the window's logits predict: exactly the response tokens where mask is set.
    targets = b["ids"][:, b["start"] + 1:]
    assert targets[b["mask"]].tolist() == [6, 7, 8]


def test_ds_config_carries_the_training_sections_values():
    # The values are checked where the recipe is loaded (tests/config): training.dtype fp16, zero_stage 4.
    config = ds_config(micro_batch_size=4, lr=1e-3, optimizer=Optimizer(grad_clip=0.5, weight_decay=0.1),
                       zero_stage=3, dtype="bf16")
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["zero_optimization"] == {"stage": 3}
    assert config["bf16"] == {"enabled": True} and config["gradient_clipping"] == 0.5
    assert config["optimizer"]["params"]["lr"] == 1e-3 and config["optimizer"]["params"]["weight_decay"] == 0.1
    assert "gradient_accumulation_steps" not in config  # each step sets its own boundary


@pytest.mark.parametrize("engine", [DeepSpeedPolicyEngine, DeepSpeedCriticEngine])
def test_missing_model_dir_and_config(tmp_path, engine):
    with pytest.raises(ModelError, match="does not exist") as err:
        engine(engine_config(tmp_path / "nope"))
    assert str(tmp_path / "nope") in str(err.value) and isinstance(err.value, ValueError)
    with pytest.raises(ModelError, match="no config.json") as err:
        engine(engine_config(tmp_path))
    assert str(tmp_path) in str(err.value)


FLIGHT_RECORDER_PROBE = """
import pickle
import torch
from pipeline.trainer.deepspeed_base import start_deepspeed
start_deepspeed(1)
for _ in range(5):
    torch.distributed.all_reduce(torch.zeros(2))
trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
print(len(trace.get("entries", [])))
torch.distributed.destroy_process_group()  # its threads joined before the interpreter exits
"""


@pytest.mark.parametrize("env, kept", [({}, 0), ({"TORCH_FR_BUFFER_SIZE": "100"}, 5)])
def test_the_trainers_process_group_keeps_no_flight_record_unless_asked(env, kept):
    """torch's flight recorder would keep a trainer's last 2000 collectives, each with
    its Python stack (pipeline.core.data_parallel.without_flight_recorder). Its own
    process: the recorder reads its size once, at the process's first group."""
    import os
    import subprocess
    import sys
    base = {k: v for k, v in os.environ.items() if k not in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    proc = subprocess.run([sys.executable, "-c", FLIGHT_RECORDER_PROBE], capture_output=True, text=True,
                          timeout=300, env={**base, "OMP_NUM_THREADS": "1", **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.strip().splitlines()[-1]) == kept
