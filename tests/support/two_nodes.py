"""A two-node Ray cluster on this machine, for tests/run/test_two_nodes.py, run in
a process of its own (a driver joins one cluster at a time; the test session
holds its local Ray). Ray's own ray.cluster_utils.Cluster starts the head and
a second node, each with its raylet and a custom resource that names it; the
real CPU stack runs `steps` steps with the trainer ranks pinned to the head
and the generator to the second node. Prints one JSON line: the summary, the
node each worker ran on, and the processes of the cluster left alive after
its shutdown (killed here by PID, and reported so the test fails)."""
from __future__ import annotations

import json
import sys

import psutil
from ray.cluster_utils import Cluster

from pipeline.config import load_config
from pipeline.run.driver import train
from pipeline.core.events import load_events


def cluster_pids(cluster: Cluster) -> set[int]:
    """Every process of the cluster: each node's daemons and whatever they forked (workers)."""
    pids = set()
    for node in cluster.list_all_nodes():
        for _, proc in node.live_processes():
            pids.add(proc.pid)
            try:
                pids.update(child.pid for child in psutil.Process(proc.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
    return pids


def main(model: str, out_dir: str, steps: int) -> dict:
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 3, "resources": {"dagrl_trainer": 4}, "include_dashboard": False})
    pids: set[int] = set()
    report: dict = {}
    try:
        worker = cluster.add_node(num_cpus=3, resources={"dagrl_generator": 4})
        report["nodes"] = {"head": cluster.head_node.node_id, "second": worker.node_id}
        cfg = load_config("examples/tiny_grpo.yaml", [
            f"model.path={model}", f"run.output_dir={out_dir}", "run.name=two_nodes", f"run.steps={steps}",
            "run.dag_mode=classic", f"run.ray_address={cluster.address}", "training.ranks=2",
            "resources.trainer.node_resource=dagrl_trainer", "resources.generator.node_resource=dagrl_generator",
            "metrics.tensorboard=false"])
        pids |= cluster_pids(cluster)
        report["summary"] = train(cfg, quiet=True)
        report["ran_on"] = {e["worker"]: e.get("node") for e in load_events(f"{out_dir}/two_nodes")
                            if e["ev"] == "worker_start"}
    finally:
        pids |= cluster_pids(cluster)
        cluster.shutdown()
        left = [p for p in psutil.Process().children(recursive=True)] + [
            psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
        alive = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in alive:
            p.kill()
        report["left_alive"] = sorted({p.pid for p in alive})
    return report


if __name__ == "__main__":
    print("TWO_NODES " + json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3])), default=str))
