"""Placement (pipeline/run/placement.py): the bundle arithmetic and the capacity
refusals as pure functions, then actors placed on a local Ray with logical GPUs.

The Ray checks run in a child process with a Ray of its own (4 logical GPUs, no
CUDA): the session's Ray (conftest's ray_session) has none and stays untouched.
The child is this file run as a script; it prints one JSON line of what it saw.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.run.placement import Placement, PlacementError, bundles, check_capacity

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def cfg_of(*overrides: str):
    return load_config(None, list(overrides))


def node(cpus: float = 8, gpus: float = 0, node_id: str = "n1", alive: bool = True, **custom: float) -> dict:
    res = {"CPU": float(cpus), "memory": 1e9, "object_store_memory": 1e9, f"node:10.0.0.{len(node_id)}": 1.0,
           **{k: float(v) for k, v in custom.items()}}
    if gpus:
        res["GPU"] = float(gpus)
    return {"NodeID": node_id * 8, "Alive": alive, "NodeManagerAddress": "10.0.0.1", "Resources": res}


GPU_RECIPE = ("training.ranks=2", "generation.num_generators=2", "resources.trainer.num_gpus=1",
              "resources.generator.num_gpus=1")


def test_the_readme_gpu_recipe_fits_one_8_gpu_node_and_is_refused_on_4():
    """examples/gpu8_grpo.yaml (README "Running on a GPU cluster"): 4 trainer ranks
    and 4 engines, one GPU each."""
    cfg = load_config(ROOT / "examples" / "gpu8_grpo.yaml")
    gpus = [b.resources.get("GPU", 0) for b in bundles(cfg)]
    assert sum(gpus) == 8 and gpus.count(1.0) == 8
    check_capacity(cfg, [node(cpus=64, gpus=8)])
    check_capacity(cfg, [node(cpus=32, gpus=4, node_id="a"), node(cpus=32, gpus=4, node_id="b")])
    with pytest.raises(PlacementError, match="8 GPUs.*has 4"):
        check_capacity(cfg, [node(cpus=64, gpus=4)])


def test_the_one_gpu_recipe_shares_one_gpu_between_trainer_and_engine():
    """examples/gpu_1x_grpo.yaml: the trainer and the vLLM engine take half of one GPU each."""
    cfg = load_config(ROOT / "examples" / "gpu_1x_grpo.yaml")
    gpus = {b.name: b.resources.get("GPU", 0) for b in bundles(cfg)}
    assert gpus == {"controller[0]": 0, "trainer[0]": 0.5, "generator[0]": 0.5}
    check_capacity(cfg, [node(cpus=16, gpus=1)])
    with pytest.raises(PlacementError):
        check_capacity(cfg, [node(cpus=16)])


# --- bundles() ---------------------------------------------------------------------------------------------

def test_defaults_are_todays_laptop_run():
    cfg = cfg_of()
    assert cfg.resources.strategy == "PACK"
    assert [(b.role, b.index, b.tp_rank, b.resources) for b in bundles(cfg)] == [
        ("controller", 0, 0, {"CPU": 0.5}), ("trainer", 0, 0, {"CPU": 0.5}), ("generator", 0, 0, {"CPU": 0.5})]
    check_capacity(cfg, [node(cpus=2)])


def test_bundle_order_ppo_and_tensor_parallel():
    cfg = cfg_of("algorithm=ppo", "training.ranks=2", "ppo.critic_ranks=2", "generation.num_generators=2",
                 "generation.tensor_parallel_size=2", "resources.generator.num_gpus=1",
                 "resources.generator.node_resource=gen_node", "resources.trainer.num_gpus=1")
    got = [(b.name, b.resources) for b in bundles(cfg)]
    gen0 = {"CPU": 0.5, "GPU": 1.0, "gen_node": 0.001}
    tp1 = {"GPU": 1.0, "gen_node": 0.001}  # the TP worker's bundle: vLLM's workers ask no CPU
    assert got == [("controller[0]", {"CPU": 0.5}),
                   ("trainer[0]", {"CPU": 0.5, "GPU": 1.0}), ("trainer[1]", {"CPU": 0.5, "GPU": 1.0}),
                   ("critic[0]", {"CPU": 0.5}), ("critic[1]", {"CPU": 0.5}),
                   ("generator[0]", gen0), ("generator[0].tp1", tp1), ("generator[1]", gen0), ("generator[1].tp1", tp1)]


def test_grpo_has_no_critic_bundles_and_an_empty_role_gets_a_token():
    cfg = cfg_of("ppo.critic_ranks=3", "resources.controller.num_cpus=0")
    specs = bundles(cfg)
    assert [b.role for b in specs] == ["controller", "trainer", "generator"]
    assert specs[0].resources == {"CPU": 0.001}  # Ray refuses an all-zero bundle


def test_options_and_vllm_placement_for_tensor_parallel_generators():
    # Bundle arithmetic only: vLLM with T > 1 needs T real GPUs, not on this machine.
    cfg = cfg_of("generation.num_generators=2", "generation.tensor_parallel_size=2", "resources.generator.num_gpus=1",
                 "resources.trainer.num_gpus=1")
    placement = Placement(cfg, None, bundles(cfg))  # controller 0, trainer 1, gen0: 2 3, gen1: 4 5
    assert placement.vllm_placement(1) == {
        "env_vars": {"VLLM_RAY_BUNDLE_INDICES": "4,5", "VLLM_RAY_PER_WORKER_GPUS": "1"},
        "llm_kwargs": {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}}
    gen = placement.options("generator", 1)
    assert (gen["num_cpus"], gen["num_gpus"]) == (0.5, 0)  # the TP workers hold the GPUs
    assert gen["scheduling_strategy"].placement_group_bundle_index == 4
    assert gen["scheduling_strategy"].placement_group_capture_child_tasks is True
    assert gen["runtime_env"] == {"env_vars": {"VLLM_RAY_BUNDLE_INDICES": "4,5", "VLLM_RAY_PER_WORKER_GPUS": "1"}}
    trainer = placement.options("trainer", 0)
    assert (trainer["num_gpus"], trainer["scheduling_strategy"].placement_group_bundle_index) == (1.0, 1)
    assert "runtime_env" not in trainer
    with pytest.raises(PlacementError, match=r"no bundle for critic\[0\].*0 critic actor"):
        placement.options("critic", 0)
    with pytest.raises(PlacementError, match=r"no bundle for generator\[2\] tp rank 0: the recipe has 2 generator"):
        placement.options("generator", 2)
    one = cfg_of()
    assert Placement(one, None, bundles(one)).vllm_placement(0) == {"env_vars": {}, "llm_kwargs": {}}


# --- check_capacity() --------------------------------------------------------------------------------------

def refusal(cfg, nodes) -> str:
    with pytest.raises(PlacementError) as info:
        check_capacity(cfg, nodes)
    return str(info.value)


def test_refuses_more_gpus_than_the_cluster_has():
    cfg = cfg_of("training.ranks=4", "generation.num_generators=4", "resources.trainer.num_gpus=1",
                 "resources.generator.num_gpus=1")
    assert refusal(cfg, [node(gpus=4)]) == ("the recipe asks 8 GPUs (trainer 4 x 1, generator 4 x 1) "
                                            "but the cluster has 4")


def test_refuses_more_cpus_and_counts_only_alive_nodes():
    cfg = cfg_of("generation.num_generators=4", "resources.generator.num_cpus=2")
    assert refusal(cfg, [node(cpus=4), node(cpus=64, node_id="dead", alive=False)]) == (
        "the recipe asks 9 CPUs (controller 1 x 0.5, trainer 1 x 0.5, generator 4 x 2) but the cluster has 4")
    assert refusal(cfg, [node(alive=False)]) == "the cluster has no alive node"


def test_refuses_a_bundle_that_fits_on_no_node():
    cfg = cfg_of("resources.trainer.num_gpus=3")
    message = refusal(cfg, [node(gpus=2, node_id="a"), node(gpus=2, node_id="b")])
    assert message.startswith("a trainer bundle {CPU: 0.5, GPU: 3} fits on no node (the closest, node 10.0.0.1 ")
    assert message.endswith("has {CPU: 8, GPU: 2})")


def test_refuses_strict_pack_beyond_one_node_but_pack_may_span_nodes():
    nodes = [node(gpus=2, node_id="a"), node(gpus=2, node_id="b")]
    check_capacity(cfg_of(*GPU_RECIPE), nodes)
    message = refusal(cfg_of(*GPU_RECIPE, "resources.strategy=STRICT_PACK"), nodes)
    assert message.startswith("STRICT_PACK puts all 5 bundles on one node: they ask {CPU: 2.5, GPU: 4} but no node "
                              "has that much (node 10.0.0.1 (aaaaaaaa): {CPU: 8, GPU: 2}; ")


def test_refuses_strict_spread_with_more_bundles_than_nodes():
    nodes = [node(gpus=2, node_id=c) for c in "abcd"]
    assert refusal(cfg_of(*GPU_RECIPE, "resources.strategy=STRICT_SPREAD"), nodes) == (
        "STRICT_SPREAD puts each of the 5 bundles on a node of its own but the cluster has 4 nodes")
    check_capacity(cfg_of(*GPU_RECIPE, "resources.strategy=STRICT_SPREAD"), nodes + [node(node_id="e")])
    pinned = cfg_of(*GPU_RECIPE, "resources.strategy=STRICT_SPREAD", "resources.trainer.node_resource=tr")
    assert refusal(pinned, [node(gpus=2, node_id=c, **({"tr": 1} if c == "a" else {})) for c in "abcde"]) == (
        "STRICT_SPREAD puts each of the 2 trainer bundles on a node of its own but 'tr' is on 1 node(s)")


def test_refuses_a_node_resource_no_node_has():
    cfg = cfg_of("resources.generator.node_resource=gpu_box")
    assert refusal(cfg, [node(trainer_box=1)]) == (
        "resources.generator.node_resource 'gpu_box': no node of the cluster has it (custom resources: trainer_box; "
        "a node gets it with ray start --resources '{\"gpu_box\": 1}')")
    check_capacity(cfg, [node(node_id="a"), node(node_id="b", gpu_box=1)])
    # Pinned to a node too small for the bundle, though the cluster has room elsewhere.
    big = cfg_of("resources.generator.node_resource=gpu_box", "resources.generator.num_cpus=4")
    assert "a generator bundle {CPU: 4, gpu_box: 0.001} fits on no node" in refusal(
        big, [node(cpus=8, node_id="a"), node(cpus=2, node_id="b", gpu_box=1)])


def test_refuses_multi_gpu_bundles_next_to_vllm_tensor_parallel():
    cfg = cfg_of("generation.tensor_parallel_size=2", "resources.generator.num_gpus=1", "resources.trainer.num_gpus=2")
    assert refusal(cfg, [node(gpus=8)]) == (
        "generation.tensor_parallel_size 2 runs vLLM's ray executor, which refuses a bundle of more than 1 GPU; "
        "the recipe asks trainer 2 GPUs per bundle")


# --- on a local Ray with logical GPUs (child process) --------------------------------------------------------

def _probe_class():
    import ray

    @ray.remote
    class Probe:
        def where(self) -> dict:
            ctx = ray.get_runtime_context()
            # The bundle index is only in the raw resource names ("bundle_group_<i>_<pg id>"); a private
            # API, read by the test only.
            raw = ray._private.worker.global_worker.core_worker.resource_ids()
            index = [int(k.split("_")[2]) for k in raw if k.startswith("bundle_group_") and k.count("_") == 3]
            return {"pg": ctx.get_placement_group_id(), "bundle": index[0] if index else None,
                    "node": ctx.get_node_id(), "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
                    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    return Probe


def _placed(cfg) -> dict:
    """Place the recipe, start a probe actor per role and rank, and report where each landed."""
    import ray
    from pipeline.run.placement import place
    placement = place(cfg, timeout_s=60)
    try:
        probe = _probe_class()
        roles = [(b.role, b.index) for b in placement.bundles if b.tp_rank == 0]
        actors = [probe.options(**placement.options(role, index)).remote() for role, index in roles]
        seen = ray.get([a.where.remote() for a in actors], timeout=60)
        table = ray.util.placement_group_table(placement.group)
        return {"pg": placement.group.id.hex(), "strategy": table["strategy"],
                "bundle_nodes": sorted(set(table["bundles_to_node_id"].values())),
                "actors": {f"{role}[{index}]": where for (role, index), where in zip(roles, seen)}}
    finally:
        placement.remove()


def _ray_checks() -> dict:
    import ray
    from pipeline.run.placement import place
    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        out: dict = {"node": ray.get_runtime_context().get_node_id()}
        too_big = cfg_of("training.ranks=4", "generation.num_generators=4", "resources.trainer.num_gpus=1",
                         "resources.generator.num_gpus=1")
        try:
            place(too_big, timeout_s=60)
            out["refused"] = None
        except PlacementError as exc:
            out["refused"] = str(exc)
        out["groups_after_refusal"] = len(ray.util.placement_group_table())
        for strategy in ("PACK", "SPREAD"):
            out[strategy] = _placed(cfg_of(*GPU_RECIPE, f"resources.strategy={strategy}"))
        # Capacity is there in total but another group holds it: the wait times out, naming the bundles.
        blocker = ray.util.placement_group([{"GPU": 4}])
        ray.get(blocker.ready(), timeout=60)
        try:
            place(cfg_of(*GPU_RECIPE), timeout_s=1)
            out["timed_out"] = None
        except PlacementError as exc:
            out["timed_out"] = str(exc)
        ray.util.remove_placement_group(blocker)
        out["group_states"] = sorted(g["state"] for g in ray.util.placement_group_table().values())
        return out
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def on_ray() -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for var in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES"):  # its own Ray; GPU ids only from Ray's assignment
        env.pop(var, None)
    proc = subprocess.Popen([sys.executable, __file__], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        from tests.support._procs import sigkill_tree  # the child and the Ray it started, by PID
        sigkill_tree(proc)
        raise
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.sim
def test_a_too_big_recipe_is_refused_before_any_group_or_actor(on_ray):
    assert on_ray["refused"] == "the recipe asks 8 GPUs (trainer 4 x 1, generator 4 x 1) but the cluster has 4"
    assert on_ray["groups_after_refusal"] == 0  # place() had made nothing, so no actor could be in one


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD"])
@pytest.mark.sim
def test_each_actor_lands_in_its_bundle_and_sees_its_own_gpu(on_ray, strategy):
    placed = on_ray[strategy]
    assert placed["strategy"] == strategy
    assert placed["bundle_nodes"] == [on_ray["node"]]  # one node: both strategies put everything on it
    actors = placed["actors"]
    assert {name: a["bundle"] for name, a in actors.items()} == {
        "controller[0]": 0, "trainer[0]": 1, "trainer[1]": 2, "generator[0]": 3, "generator[1]": 4}
    assert {a["pg"] for a in actors.values()} == {placed["pg"]}
    controller = actors.pop("controller[0]")
    assert controller["gpu_ids"] == [] and controller["cuda_visible_devices"] is None
    gpus = [a["gpu_ids"] for a in actors.values()]
    assert sorted(g for ids in gpus for g in ids) == [0, 1, 2, 3]  # one each, none shared
    assert all(a["cuda_visible_devices"] == str(a["gpu_ids"][0]) for a in actors.values())


@pytest.mark.sim
def test_a_group_that_cannot_be_ready_times_out_naming_its_bundles(on_ray):
    message = on_ray["timed_out"]
    assert message.startswith("the placement group (PACK) was not ready within 1 s; its bundles: controller[0] "
                              "{CPU: 0.5}, trainer[0] {CPU: 0.5, GPU: 1}, trainer[1] {CPU: 0.5, GPU: 1}, "
                              "generator[0] {CPU: 0.5, GPU: 1}, generator[1] {CPU: 0.5, GPU: 1}; free now: ")
    assert "GPU: 0}" in message
    assert on_ray["group_states"] == ["REMOVED"] * 4  # PACK, SPREAD, the timed-out one and the blocker


if __name__ == "__main__":
    print(json.dumps(_ray_checks()))
