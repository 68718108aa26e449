"""What a run needs before its workers: Ray (started or joined), the run
directory, and the graph mode the machine suits."""
from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Callable

import ray
import yaml

from pipeline.config import Config
from pipeline.run.reaper import GRACE_S, MARK, start_watcher


def graph_actor_count(cfg: Config) -> int:
    """The run's actors: those of the step graph, and the reward model and teacher of the delivery graph."""
    return (1 + cfg.training.ranks + cfg.generation.num_generators + cfg.critic_actors
            + (1 if cfg.reward_model.kind else 0) + (1 if cfg.distill.teacher else 0))


def resolve_dag_mode(cfg: Config, cores: float) -> str:
    """auto picks compiled graphs only where each graph actor and the driver own
    two cores: one to work, one for the compiled channel's busy-wait, which
    otherwise takes the cores the workers need for far more than the few ms of
    dispatch per step that compiled graphs save."""
    if cfg.run.dag_mode != "auto":
        return cfg.run.dag_mode
    return "compiled" if cores >= 2 * (graph_actor_count(cfg) + 1) else "classic"


def real_cores(joined_cluster: bool) -> float:
    """Real cores: a local Ray is started with more logical CPUs than the machine has."""
    if joined_cluster:
        return ray.cluster_resources().get("CPU", 1)
    return len(os.sched_getaffinity(0))


def process_started_at() -> float:
    """This process's start, in epoch seconds (Linux: /proc), so that a run's times
    include the interpreter's start and imports, as the user's clock does."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def prepare_run_dir(cfg: Config, say) -> Path:
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    if run_dir.exists():
        # Never delete a user's earlier run: move it aside.
        stamp = time.strftime('%Y%m%d-%H%M%S')
        kept = next(p for k in range(1000) if not (p := run_dir.with_name(
            f"{run_dir.name}.{stamp}" + (f"-{k}" if k else ""))).exists())
        run_dir.rename(kept)
        say(f"note: the earlier run in {run_dir} was moved to {kept}")
    run_dir.mkdir(parents=True)
    write_config(run_dir, cfg)
    return run_dir


def write_config(run_dir: Path, cfg: Config) -> None:
    """The attempt's resolved config: what `--resume` without --config continues with."""
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


FREE_OBJECTS_PERIOD_MS = 100


def ray_address(cfg: Config) -> str:
    return cfg.run.ray_address or os.environ.get("RAY_ADDRESS", "")


def start_ray(cfg: Config) -> Callable[[], None] | None:
    """Join RAY_ADDRESS / ray.address if given, else start a local cluster that
    dies with this process (pipeline/run/reaper.py). Returns what stops what it
    started; None where Ray was already up."""
    if ray.is_initialized():
        return None
    address = ray_address(cfg)
    if address:
        # A cluster's Ray ends a driver's actors when the driver ends.
        ray.init(address=address, log_to_driver=True)
        return ray.shutdown
    cpus = cfg.run.num_cpus or max(os.cpu_count() or 1, graph_actor_count(cfg) + 1)
    mark, watcher = start_watcher()
    os.environ[MARK] = mark
    try:
        # Worker output (vLLM, DeepSpeed banners) stays in Ray's session logs; failures
        # reach the driver as errors naming the node, worker and step.
        # A released object waits in the raylet's free cache until its next flush (1 s by
        # default): with sub-second steps two released weight copies would still sit in the
        # store beside the two held (DESIGN.md, invariant 7). A cluster's own raylets take
        # RAY_free_objects_period_milliseconds at `ray start` (docs/clusters.md).
        # address "local": without it Ray joins a `ray start` cluster it finds on this machine
        # (/tmp/ray/ray_current_cluster), and then refuses num_cpus with an error about neither.
        # No prestarted workers: the step graph's actors set env_vars in their runtime_env, which
        # a prestarted plain worker cannot serve, so two idled on the cores those actors start on
        # (environment and agent workers start their own when they are made).
        with optional_head_processes_skipped():
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                     _system_config={"free_objects_period_milliseconds": FREE_OBJECTS_PERIOD_MS,
                                     "prestart_worker_first_driver": False})
    except BaseException:
        _stop_local(watcher)
        raise
    finally:
        del os.environ[MARK]
    return lambda: _stop_local(watcher)


# Head processes a local run has no use for: the dashboard's API server (started
# even with include_dashboard=False, for usage statistics; ray.init waits for it to
# register), the autoscaler's monitor, and the log monitor (log_to_driver is off).
# `ray start` has --no-monitor and --include-log-monitor; ray.init has no switch,
# so their starts are skipped by name for one call (the names are tested).
OPTIONAL_HEAD_PROCESSES = ("start_api_server", "start_monitor", "start_log_monitor")


@contextlib.contextmanager
def optional_head_processes_skipped():
    from ray._private.node import Node
    started = {name: getattr(Node, name) for name in OPTIONAL_HEAD_PROCESSES}
    for name in started:
        setattr(Node, name, _skip_process)
    try:
        yield
    finally:
        for name, start in started.items():
            setattr(Node, name, start)


def _skip_process(node, **_) -> None:
    return None


def _stop_local(watcher: subprocess.Popen) -> None:
    """ray.shutdown, then the watcher ends whatever of that Ray is left (and itself)."""
    try:
        ray.shutdown()
    finally:
        watcher.stdin.close()
        watcher.wait(timeout=2 * GRACE_S + 5)
