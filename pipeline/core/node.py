"""What every actor behind the step graph shares: the node decorator that logs
and stamps each node (and trims the heap after it, where asked), the liveness
probe, the objects it holds in the store for a step's readers, one torch
thread, the one Ray thread a rank computes on, a log per run.
"""
from __future__ import annotations

import dataclasses
import functools
import os

from dags.tokens import Stored
from pipeline.core.data_parallel import Rendezvous, free_port
from pipeline.core import spans
from pipeline.core.events import EventLog
from pipeline.core.memory import HeapCap


class NodeError(RuntimeError):
    """A graph node failed; the message names the node, the worker and the step."""


def one_thread() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        pass


STEP_THREAD = "step"  # a rank's concurrency group of one thread (rank_actor)


def rank_actor(worker: type, **options):
    """The actor class of a trainer or critic rank, `options` applied. Two
    threads: `save` between steps must not wait behind a compiled graph's
    loop. A third, the step thread, runs every method on_step_thread."""
    import ray
    return ray.remote(concurrency_groups={STEP_THREAD: 1})(worker).options(max_concurrency=2, **options)


def scorer_actor(worker: type, group: str, max_restarts: int, options: dict, *args):
    """A run's scorer (the reward model, the teacher) started with `args`, restarted
    by Ray up to `max_restarts` times, a call left unfinished by a dead process run
    again on the next: a thread for `group`'s methods and one for the driver's pings."""
    import ray
    actor = ray.remote(concurrency_groups={group: 1}, max_concurrency=2)(worker)
    return actor.options(**options, max_restarts=max_restarts, max_task_retries=-1).remote(*args)


def on_step_thread(method):
    """Run `method` on the rank's one step thread, never on a spare one. Ray
    hands a threaded actor's calls to any free thread of its pool, and the
    first training step on a new thread leaves about 3 MB of torch's state
    for that thread allocated while the thread lives (a standalone step of
    the 4.2M model: +3.0 MB, none after). On one thread that happens at
    set-up, not at whichever step Ray first picks another thread."""
    import inspect

    import ray
    # Ray routes a call by the options of the function inspect.unwrap reaches,
    # under any wrapper such as node()'s.
    ray.method(concurrency_group=STEP_THREAD)(inspect.unwrap(method))
    return method


def node(name: str, trim_heap: bool = False):
    """Log node_start/node_end and name the node, worker and step in any failure.

    The node logs on its own lane (`<worker>/<node>`, pipeline/core/events.py),
    after the clocks of the tokens it takes; the token it returns carries the
    clock at its node_end. Two nodes of one actor are ordered only if the graph
    orders them, not because they happened to run one after the other.

    `trim_heap`: a node that frees a lot (a training step its activations, a
    refit a weight copy) checks the actor's HeapCap once its body's objects are
    gone (pipeline/core/memory.py)."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *tokens):
            step = next((t.step for t in tokens if hasattr(t, "step")), None)
            with self.log.lane(f"{self.log.worker}/{name}", *(getattr(t, "clock", ()) for t in tokens)):
                self.log.emit("node_start", step=step, node=name)
                spans.take()  # this thread's spans from before the node are not the node's
                try:
                    out = method(self, *tokens)
                except Exception as exc:
                    self.log.emit("node_error", step=step, node=name, error=f"{type(exc).__name__}: {exc}")
                    raise NodeError(f"node {name!r} on worker {self.log.worker!r} failed at step {step}: "
                                    f"{type(exc).__name__}: {exc}") from exc
                if trim_heap:
                    self.heap.check_logged(self.log, step)
                self.log.emit("node_end", step=step, node=name, spans=spans.take())
                return dataclasses.replace(out, clock=self.log.now())
        return run
    return wrap


def whereabouts() -> dict:
    """The process and the Ray node a worker runs on, for its worker_start event:
    where each rank and engine landed (placement, several nodes)."""
    import ray
    node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    return {"pid": os.getpid(), "node": node_id}


class Actor:
    """The driver's liveness probe (pipeline/run/runner.py dead_actors). It takes
    no lock, so a busy threaded actor still answers on its spare thread."""

    def __init__(self) -> None:
        self.heap = HeapCap()
        self._held: dict[str, object] = {}

    def put_for_step(self, kind: str, value) -> Stored:
        """`value` into the object store for this step's readers, held until this
        actor's next put of `kind`: a ref sent through a compiled graph's channel
        is not borrowed, so its owner must keep it alive until they have read it."""
        import ray
        ref = self._held[kind] = ray.put(value)
        return Stored(ref)

    def end_run(self, deadline_s: float) -> None:
        """Close what begin_run opened: a run that ends well leaves each worker's
        files and groups closed before Ray stops the process."""
        self.log.close()

    def ping(self) -> bool:
        return True

    def rss(self) -> int:
        """This worker's resident memory in bytes (pipeline/core/memory.py), lock-free like ping."""
        from pipeline.core.memory import process_rss
        return process_rss()

    def rendezvous(self, world_size: int, timeout_s: float) -> Rendezvous:
        """Asked of rank 0 of a data-parallel role: where the ranks' process group
        meets (this node's address and a port free on it)."""
        import ray
        host = ray.util.get_node_ip_address()
        return Rendezvous(host, free_port(host), world_size, timeout_s)
