"""The weight-version checks of the refit and train nodes (invariant 5): a
generator refuses weights that are not exactly one version above its own, or
whose object-store copy is not the version the trainer announced; the trainer
refuses trajectories generated with weights newer than its own. Each refusal is
a NodeError naming the node, the worker and the step, and is logged as a
node_error event; nothing is loaded or trained.

The workers are the plain classes on the simulated backend, called directly in
the test process (the object store needs the session's Ray); the last test
checks that the same error reaches a driver from an actor."""
from __future__ import annotations

import json
import time

import pytest
import ray

from dags.tokens import Batch, Gate, Stored, TrainOut
from pipeline.controller.controller import Controller
from pipeline.generator.worker import GeneratorWorker
from pipeline.core.node import NodeError, rank_actor
from pipeline.trainer.worker import TrainerWorker
from tests.support.training_helpers import make_table
from pipeline.config import load_config
from pipeline.run.runner import task_error

pytestmark = pytest.mark.sim


def sim_cfg(tmp_path):
    return load_config(None, [f"run.output_dir={tmp_path}", "backend=sim", "run.deadline_s=10",
                              "sim.generate_s=0", "sim.train_s=0", "sim.refit_s=0", "sim.validate_s=0"])


def worker_events(run_dir, worker: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events" / f"{worker}.jsonl").read_text().splitlines()]


def generator(tmp_path) -> GeneratorWorker:
    gen = GeneratorWorker(0)
    # A controller to deliver to (its delivery graph binds one), though these refits deliver nothing.
    controller = ray.remote(Controller).options(num_cpus=0.1).remote()
    gen.begin_run(sim_cfg(tmp_path), str(tmp_path), time.time(), controller=controller)
    return gen


def trainer(tmp_path, start_version: int = 0) -> TrainerWorker:
    worker = TrainerWorker()
    worker.begin_run(sim_cfg(tmp_path), str(tmp_path), time.time(), start_version=start_version)
    return worker


def weights(version: int, updates: int | None = None) -> Stored:
    """A TrainOut's weights_ref: the stored (version, sim weights)."""
    return Stored(ray.put((version, {"sim_updates": version if updates is None else updates})))


def refit(gen: GeneratorWorker, step: int, version: int, ref: Stored | None = None):
    return gen.refit(TrainOut(step, version, ref), Gate(step, version, False))


def assert_node_error(err: pytest.ExceptionInfo, node: str, worker: str, step: int, detail: str) -> None:
    assert isinstance(err.value, NodeError)
    assert str(err.value) == f"node {node!r} on worker {worker!r} failed at step {step}: RuntimeError: {detail}"


def test_refit_refuses_a_version_that_is_not_one_above_the_generators(tmp_path, ray_session):
    gen = generator(tmp_path)
    # The good path first: version 1 after step 0 loads and is what the engine now serves.
    assert refit(gen, 0, 1, weights(1)).version == 1
    assert gen.version == 1 and gen.engine.weights_version == 1

    # The same version again at the next step: the trainer did not advance.
    with pytest.raises(NodeError) as err:
        refit(gen, 1, 1, weights(1))
    assert_node_error(err, "refit", "gen0", 1,
                      "weight sync: trainer sent version 1, generator holds 1; expected 2")
    # A version skipped: the generator missed a refit.
    with pytest.raises(NodeError) as err:
        refit(gen, 2, 3, weights(3))
    assert_node_error(err, "refit", "gen0", 2,
                      "weight sync: trainer sent version 3, generator holds 1; expected 2")
    # Refused before anything was loaded: the engine still serves version 1.
    assert gen.version == 1 and gen.engine.weights_version == 1

    events = worker_events(tmp_path, "gen0")
    errors = [e for e in events if e["ev"] == "node_error"]
    assert [(e["node"], e["step"]) for e in errors] == [("refit", 1), ("refit", 2)]
    assert "trainer sent version 3, generator holds 1" in errors[1]["error"]
    assert [(e["ev"], e["step"], e["version"]) for e in events if e["ev"].startswith("refit_")] == [
        ("refit_start", 0, 0), ("refit_end", 0, 1)]


def test_refit_refuses_object_store_weights_of_another_version(tmp_path, ray_session):
    gen = generator(tmp_path)
    # Announced as version 1, but the object holds version 2 (another step's export).
    with pytest.raises(NodeError) as err:
        refit(gen, 0, 1, weights(2))
    assert_node_error(err, "refit", "gen0", 0, "weight sync: the weights in the object store are version 2, "
                                               "the trainer announced 1")
    assert gen.version == 0 and gen.engine.weights_version == 0   # nothing loaded
    events = worker_events(tmp_path, "gen0")
    # Refused before the load was handed to the engine loop: no refit_start.
    # Fetched (the version inside is what is checked), refused, nothing loaded.
    assert [e["ev"] for e in events if e["ev"] not in ("worker_start", "worker_ready")] == [
        "node_start", "weights_fetched", "node_error"]
    # The refit that then gets the right object loads it: the check is on the version, not a stuck state.
    assert refit(gen, 0, 1, weights(1)).version == 1 and gen.engine.weights_version == 1


def test_train_refuses_batches_newer_than_its_weights(tmp_path, ray_session):
    worker = trainer(tmp_path)
    with pytest.raises(NodeError) as err:
        worker.train(Batch(0, ("t0.g0", "t0.g1"), (0, 1)))
    assert_node_error(err, "train", "trainer", 0,
                      "weight sync: batch versions (0, 1) are newer than the trainer's weights (version 0)")
    assert worker.version == 0 and worker.engine.updates == 0
    events = worker_events(tmp_path, "trainer")
    assert [e["ev"] for e in events if e["ev"] not in ("worker_start", "worker_ready")] == ["node_start", "node_error"]  # no train_start

    # A resumed trainer starts at the checkpoint's version: the bound moves with it.
    resumed = trainer(tmp_path / "resumed", start_version=4)
    with pytest.raises(NodeError) as err:
        resumed.train(Batch(4, ("t4.g0",), (5,)))
    assert_node_error(err, "train", "trainer", 4,
                      "weight sync: batch versions (5,) are newer than the trainer's weights (version 4)")


def test_train_accepts_batches_of_its_own_version(tmp_path, ray_session):
    """The bound is inclusive: a batch generated with the trainer's current weights
    (synchronous RL, max_age 0) trains, and the version rises by one."""
    worker = trainer(tmp_path)
    # One prompt group (an empty batch would skip the update: dynamic sampling's case).
    table = make_table(groups=1, group_size=worker.cfg.schedule.group_size)
    out = worker.train(Batch(0, ("t0.g0",), (0,), Stored(ray.put(table))))
    assert out.version == 1 and worker.version == 1
    assert out.weights_ref.fetch(60) == (1, {"sim_updates": 1})


def test_the_refusal_reaches_the_driver_as_a_node_error(tmp_path, ray_session):
    """From an actor the NodeError arrives as Ray's task error, still a NodeError;
    the driver's one-line message (task_error) names node, worker and step."""
    actor = rank_actor(TrainerWorker, num_cpus=0.1).remote()
    try:
        ray.get(actor.begin_run.remote(sim_cfg(tmp_path), str(tmp_path), time.time(), None, 2))
        with pytest.raises(NodeError) as err:
            ray.get(actor.train.remote(Batch(2, ("t2.g0",), (3,))), timeout=60)
        assert task_error(err.value) == (
            "node 'train' on worker 'trainer' failed at step 2: RuntimeError: weight sync: batch versions "
            "(3,) are newer than the trainer's weights (version 2)")
    finally:
        ray.kill(actor)


def test_flat_weights_come_back_equal_through_the_object_store(ray_session):
    """pipeline/weights/packing.py: fp32, bf16 and integer tensors, a scalar and an empty
    one survive put and get bit for bit, as read-only views; the sim's dict of
    numbers is stored as it is."""
    import torch

    from pipeline.weights.packing import FlatWeights, pack, unpack
    state = {"a.weight": torch.randn(3, 5), "b.weight": torch.randn(4, 2).to(torch.bfloat16),
             "steps": torch.tensor(7), "empty": torch.zeros(0, 3), "ids": torch.arange(6).view(2, 3)}
    stored = ray.get(ray.put((3, pack(state))))
    assert stored[0] == 3 and isinstance(stored[1], FlatWeights)
    back = unpack(stored[1])
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor), name
    assert unpack(ray.get(ray.put(pack({"sim_updates": 2})))) == {"sim_updates": 2}
