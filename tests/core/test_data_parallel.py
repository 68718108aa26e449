"""Data-parallel policy ranks: the shards, and the equivalence that makes them
safe to use. Two trainer actors (real DeepSpeed, one gloo group formed through
Ray) with micro-batch m must take the same step as one actor with 2m on the
same batch: gradients of a token-level loss divided by the whole batch's token
count, summed over ranks, are the single process's gradients.

Tolerance, measured (fp32, lr 1e-3): the losses and gradient norms agree to
float round-off and most weights to 4e-8, but one element moved 1.3e-6 apart
at ZeRO 0: AdamW's first step is lr * g / (|g| + eps), so a gradient element
near eps turns the round-off of a different summation order into a visible
share of a step. The test allows 1e-5, a hundredth of one step's lr."""
from __future__ import annotations

import json
import time

import pytest
import ray
import torch

from dags.tokens import Batch, Stored
from pipeline.core.node import rank_actor
from pipeline.trainer.worker import TrainerWorker
from pipeline.weights import packing as flat
from pipeline.core.data_parallel import Batching, batch_shards
from pipeline.config import load_config
from tests.support.training_helpers import make_table, model_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.unit

TOLERANCE = 1e-5


def test_shards_are_whole_groups_as_even_as_groups_allow():
    lengths = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]            # 5 groups of 2
    shards = batch_shards(lengths, 2, 2, Batching(2))
    assert [(s.start, s.stop) for s in shards] == [(0, 6), (6, 10)]
    assert {s.batch_tokens for s in shards} == {55}
    assert {s.micro_batches for s in shards} == {3}      # rank 0's 6 rows in micro-batches of 2
    assert [s.rank for s in shards] == [0, 1] and {s.world_size for s in shards} == {2}


def test_shards_refuse_a_batch_smaller_than_the_ranks_or_split_groups():
    with pytest.raises(ValueError, match="cannot feed 3 data-parallel ranks"):
        batch_shards([1] * 4, 2, 3, Batching(1))
    with pytest.raises(ValueError, match="groups of 4"):
        batch_shards([1] * 6, 4, 1, Batching(1))


def test_a_token_budget_groups_rows_of_like_length_longest_first():
    lengths = [4, 9, 5, 8, 6, 7, 30]
    # Longest first; each micro-batch takes rows while rows x its first (widest) row fit 20.
    assert Batching(2, max_tokens=20).split(lengths) == [[6], [1, 3], [5, 4], [2, 0]]
    assert Batching(2).split(lengths) == [[0, 1], [2, 3], [4, 5], [6]]  # no budget: rows in order
    chunks = Batching(8, max_tokens=64).split(lengths)
    assert sorted(i for c in chunks for i in c) == list(range(7))
    assert all(max(lengths[i] for i in c) * len(c) <= 64 or len(c) == 1 for c in chunks)


def test_packing_takes_rows_in_order_while_their_tokens_fit():
    lengths = [4, 9, 5, 8, 6, 7, 30]
    # Table order; a micro-batch takes rows while their sum fits 20 (a longer row alone).
    assert Batching(2, max_tokens=20, packed=True).split(lengths) == [[0, 1, 2], [3, 4], [5], [6]]
    # No budget: micro_batch_size rows each, as unpacked.
    assert Batching(3, packed=True).split(lengths) == [[0, 1, 2], [3, 4, 5], [6]]
    shards = batch_shards([1] * 10, 2, 2, Batching(2, max_tokens=20, packed=True), [4, 5, 6, 7, 8, 9, 7, 8, 9, 10])
    # Rank 0: 4+5+6 | 7+8 | 9; rank 1: 7+8 | 9+10.
    assert {s.micro_batches for s in shards} == {3}


def test_every_rank_runs_as_many_micro_batches_as_the_busiest_rank_needs_under_a_budget():
    # Rank 0's rows [4, 5, 6, 7, 8, 9] -> [9, 8] [7, 6] [5, 4]; rank 1's [7, 8, 9, 10] -> [10, 9] [8, 7].
    lengths = [4, 5, 6, 7, 8, 9, 7, 8, 9, 10]
    shards = batch_shards([1] * 10, 2, 2, Batching(2, max_tokens=20), lengths)
    assert {s.micro_batches for s in shards} == {3}
    with pytest.raises(ValueError, match="needs the rows' lengths"):
        batch_shards([1] * 10, 2, 2, Batching(2, max_tokens=20))


def _cfg(model, tmp_path, ranks: int, micro: int, zero: int, budget: int = 0, packing: bool = False):
    return load_config(None, [
        "backend=real", f"model.path={model}", "data.train=data/tiny_train.jsonl",
        "data.reward=pipeline.rewards.rules:tiny_reward", f"run.output_dir={tmp_path}", "schedule.group_size=2",
        f"training.ranks={ranks}", f"training.micro_batch_size={micro}", f"training.zero_stage={zero}",
        f"training.max_tokens_per_micro_batch={budget}", f"training.packing={str(packing).lower()}",
        "training.lr=1e-3"])


def _step(cfg, table, tmp_path) -> tuple[dict, list[dict]]:
    """One train step on `cfg.training.ranks` trainer actors: rank 0's
    weights after it, and every rank's metrics."""
    ranks = cfg.training.ranks
    actors = [rank_actor(TrainerWorker, num_cpus=0.5).remote(r) for r in range(ranks)]
    try:
        meet = ray.get(actors[0].rendezvous.remote(ranks, 60.0))
        ray.get([a.begin_run.remote(cfg, str(tmp_path), time.time(), None, 0, meet) for a in actors], timeout=300)
        batch = Batch(0, ("b0",), (0,), Stored(ray.put(table)))
        outs = ray.get([a.train.remote(batch) for a in actors], timeout=300)
        _, stored = outs[0].weights_ref.fetch(300)
        assert all(out.weights_ref is None for out in outs[1:])  # only rank 0 exports
        return ({k: v.clone() for k, v in flat.unpack(stored).items()}, [dict(out.metrics) for out in outs])
    finally:
        for a in actors:
            ray.kill(a)


# ZeRO-1 is ZeRO-2 less the gradient partitioning: no path of ours differs between them.
# ZeRO-3 runs with a token budget (training.max_tokens_per_micro_batch): its every forward
# gathers with the other rank's, so the ranks' micro-batch counts must pair up, zero-weight
# ones included (ZeRO-3 in row micro-batches: test_two_zero3_ranks_resume_from_a_checkpoint).
# ZeRO-3 with packing: rank 0's 9+8 | 7+6 | 5+4 tokens... in order, 4+5 | 6+7 | 8+9 packed.
@pytest.mark.parametrize("zero,budget,packing", [(0, 0, False), (2, 0, False), (3, 20, False), (3, 20, True)])
@pytest.mark.real
def test_two_ranks_take_the_single_process_step(model_dir, tmp_path, ray_session, zero, budget,  # noqa: F811
                                                packing):
    # 5 groups of 2 with different lengths: rank 0 gets 3 groups (6 rows in micro-batches
    # of 2 = 3), rank 1 gets 2 groups and one zero-weight micro-batch. With the budget of
    # 20 tokens: rank 0's rows of 9, 8 | 7, 6 | 5, 4 tokens, rank 1's 10, 9 | 8, 7 and one zero-weight.
    table = make_table(groups=5, group_size=2)
    one, one_metrics = _step(_cfg(model_dir, tmp_path / "one", 1, 4, zero), table, tmp_path / "one")
    two, two_metrics = _step(_cfg(model_dir, tmp_path / "two", 2, 2, zero, budget, packing), table, tmp_path / "two")
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst <= TOLERANCE, f"2 ranks differ from 1 by {worst:.3g}"
    moved = max((one[k] - v).abs().max().item() for k, v in _initial(model_dir).items())
    assert moved > 50 * TOLERANCE  # the step did move the weights
    for key in ("loss", "tokens", "grad_norm", "clip_frac"):
        assert two_metrics[0][key] == pytest.approx(one_metrics[0][key], rel=1e-5, abs=1e-7), key
        assert two_metrics[1][key] == two_metrics[0][key], key  # every rank reports the batch's figures
    assert [m["shard_rows"] for m in two_metrics] == [6.0, 4.0]


def _initial(model) -> dict:
    from transformers import AutoModelForCausalLM
    return {k: v.float() for k, v in AutoModelForCausalLM.from_pretrained(model).state_dict().items()}


@pytest.mark.real
def test_a_dead_rank_is_a_named_error_not_a_hang(tmp_path, ray_session, tiny_model):
    """Rank 1 is killed (SIGKILL, as the OOM killer would) after its first step;
    rank 0 is then waiting in a collective that will never complete. The run
    must stop with an error naming trainer1 and --resume, within the node
    deadline, and leave no actor behind."""
    import os
    import signal
    import threading

    from pipeline.run.driver import train
    from pipeline.run.runner import PipelineError

    cfg = load_config("examples/tiny_grpo.yaml", [
        f"model.path={tiny_model}", f"run.output_dir={tmp_path}", "run.name=dead", "run.steps=40",
        "run.dag_mode=classic", "run.deadline_s=30", "training.ranks=2", "metrics.tensorboard=false"])
    events = tmp_path / "dead" / "events" / "trainer1.jsonl"
    killed: list[int] = []
    done = threading.Event()

    def kill_rank_one():
        # Waits for a condition (rank 1 has trained once), it does not order anything.
        while not done.wait(0.2):
            lines = events.read_text().splitlines() if events.is_file() else []
            if any('"train_end"' in line for line in lines):
                pid = next(json.loads(line)["pid"] for line in lines if '"worker_start"' in line)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return

    killer = threading.Thread(target=kill_rank_one, daemon=True)
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(PipelineError, match=r"(?s)worker trainer1 died.*(--resume|start the run again)"):
            train(cfg, quiet=True)
    finally:
        done.set()
        killer.join()
    assert killed, "rank 1 never trained"
    assert time.monotonic() - started < 240
    # Rank 0, left waiting in the collective, was stopped with the run.
    rank0 = tmp_path / "dead" / "events" / "trainer0.jsonl"
    pid0 = next(json.loads(line)["pid"] for line in rank0.read_text().splitlines() if '"worker_start"' in line)
    end = time.monotonic() + 30
    while _running(pid0) and time.monotonic() < end:
        time.sleep(0.2)  # waits for another process to exit; orders nothing
    assert not _running(pid0), f"rank 0 (pid {pid0}) outlived the run"


def _running(pid: int) -> bool:
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.real
def test_two_zero3_ranks_resume_from_a_checkpoint(tmp_path, ray_session, tiny_model):
    """A resume hands the generators rank 0's weights (current_weights). Under
    ZeRO-3 the gather of those weights needs every rank, so rank 0 alone must
    not be left to do it: the ranks export them together when they start."""
    from pipeline.run.driver import train

    def cfg(steps: int):
        return load_config("examples/tiny_grpo.yaml", [
            f"model.path={tiny_model}", f"run.output_dir={tmp_path}", "run.name=z3", f"run.steps={steps}",
            "run.checkpoint_every=2", "run.dag_mode=classic", "run.deadline_s=60", "run.startup_deadline_s=120",
            "training.ranks=2", "training.zero_stage=3", "metrics.tensorboard=false"])

    assert train(cfg(2), quiet=True)["error"] is None
    summary = train(cfg(4), quiet=True, restore_from=str(tmp_path / "z3"))
    assert summary["error"] is None and summary["start_step"] == 2 and summary["steps"] == 4
    from pipeline.core.events import load_events
    from pipeline.tools.check import check_events
    assert check_events(load_events(tmp_path / "z3")) == []


@pytest.mark.real
def test_a_nan_in_one_ranks_shard_skips_the_step_on_every_rank(model_dir, tmp_path, ray_session):  # noqa: F811
    # Rank 1 holds rows 6-9 (groups 3 and 4); only its group 4 has a NaN reward, so only its
    # loss and gradient partition are NaN. ZeRO-2: each rank reduces its own gradient partition.
    rewards = [float(j % 2) for j in range(10)]
    rewards[8] = float("nan")
    table = make_table(groups=5, group_size=2, rewards=rewards)
    after, metrics = _step(_cfg(model_dir, tmp_path, 2, 2, 2), table, tmp_path)
    assert [(m["nonfinite_skipped"], m["step"]) for m in metrics] == [(1.0, 0.0), (1.0, 0.0)]
    initial = _initial(model_dir)
    assert [k for k in initial if not torch.equal(after[k], initial[k])] == []
