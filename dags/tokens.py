"""The tokens that travel on the step graph's edges.

Small and frozen: a token says what happened upstream, and its presence as an
argument is what orders the downstream node. Bulk data (trajectories, weights)
stays in the object store; tokens carry references to it.

Every token also carries `clock`: the vector clock of the node that returned it
(pipeline/core/events.py). The node that takes the token merges it, so its events
are provably after everything upstream; pipeline/tools/check.py proves the ordering
invariants from these clocks, not from wall-clock times. The node decorator
(pipeline/core/node.py) stamps the tokens nodes return, the driver the plans it
feeds a graph; code that builds a token leaves it empty.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

# A vector clock: (lane, count) pairs, sorted by lane. A lane is one sequence of
# events: a node of one worker, a generator's rollout thread, the driver.
Clock = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Stored:
    """An object in Ray's object store, by reference. Ray fetches a bare ObjectRef
    that is a task's own argument before the task runs; one held here reaches the
    node as a reference, fetched where it decides, within a deadline."""
    ref: Any  # ray.ObjectRef

    def fetch(self, timeout_s: float) -> Any:
        return ray.get(self.ref, timeout=timeout_s)


@dataclass(frozen=True)
class StepPlan:
    step: int
    validate: tuple[str, ...]   # the validation sets due (pipeline/evaluation/sets.py); () = none
    clock: Clock = ()


@dataclass(frozen=True)
class Batch:
    """Trajectories for one step: an Arrow table in the object store."""
    step: int
    batch_ids: tuple[str, ...]
    versions: tuple[int, ...]
    table_ref: Stored | None = None
    wait_s: float = 0.0              # how long sample waited for rollouts: exposed generation
    metrics: tuple[tuple[str, float], ...] = ()  # dynamic sampling's: groups left out, extra launches
    # metrics.samples: the first groups' text for the driver to write (pipeline/core/samples.py);
    # dicts, so out of the hash
    samples: tuple[dict, ...] = field(default=(), hash=False)
    clock: Clock = ()


@dataclass(frozen=True)
class Values:
    """PPO: one critic rank's values of its shard of a step's batch."""
    step: int
    rank: int
    values_ref: Stored | None = None  # list[list[float]]: per response token of each row
    clock: Clock = ()


@dataclass(frozen=True)
class Advantages:
    """PPO: the critic's values, GAE advantages and returns for one step's batch."""
    step: int
    table_ref: Stored | None = None  # an Arrow table: advantages, returns, values per token
    metrics: tuple[tuple[str, float], ...] = ()
    clock: Clock = ()


@dataclass(frozen=True)
class CriticOut:
    step: int
    metrics: tuple[tuple[str, float], ...] = ()
    clock: Clock = ()


@dataclass(frozen=True)
class TrainOut:
    step: int
    version: int
    weights_ref: Stored | None = None  # (version, exported weights); None: rank > 0, or a collective sync
    metrics: tuple[tuple[str, float], ...] = ()
    clock: Clock = ()


@dataclass(frozen=True)
class WeightsSent:
    """generation.weight_sync collective: trainer rank 0 broadcast these weights to every generator."""
    step: int
    version: int
    bytes: int = 0
    send_s: float = 0.0
    clock: Clock = ()


@dataclass(frozen=True)
class Gate:
    step: int
    version: int
    validate: tuple[str, ...]
    clock: Clock = ()


@dataclass(frozen=True)
class Refitted:
    worker: str
    step: int
    version: int
    validate: tuple[str, ...]
    refit_s: float = 0.0
    clock: Clock = ()


@dataclass(frozen=True)
class ValOut:
    worker: str
    step: int
    version: int
    validated: bool
    scores: tuple[tuple[str, float], ...] = ()
    validate_s: float = 0.0
    # metrics.samples: this generator's share (pipeline/core/samples.py)
    samples: tuple[dict, ...] = field(default=(), hash=False)
    clock: Clock = ()


@dataclass(frozen=True)
class Launch:
    batch_id: str
    target: int
    generator: int
    prompts: tuple[Any, ...] = ()  # pipeline.core.types.Prompt: a few short texts
    round: int = 0                 # 0: the step's own launch; k: dynamic sampling's k-th extra round


@dataclass(frozen=True)
class Resume:
    """The resume node's: collection goes on once every generator holds the new
    weights and has validated them; the batches to launch, the validation's scores."""
    step: int
    version: int
    launches: tuple[Launch, ...] = ()
    val_scores: tuple[tuple[str, float], ...] = ()
    clock: Clock = ()


@dataclass(frozen=True)
class TopUp:
    """A dynamic-sampling round's extra launches for the current step, at its weights (the top_up node)."""
    step: int
    version: int
    launches: tuple[Launch, ...] = ()
    clock: Clock = ()


@dataclass(frozen=True)
class Relaunch:
    """A dead generator's unfinished batches, for its replacement (the relaunch graph)."""
    step: int
    version: int
    launches: tuple[Launch, ...] = ()
    clock: Clock = ()


@dataclass(frozen=True)
class Ticket:
    worker: str
    step: int
    version: int
    batch_ids: tuple[str, ...] = field(default=())
    busy_s: float = 0.0  # seconds this generator spent generating since its last ticket
    clock: Clock = ()


@dataclass(frozen=True)
class Rollout:
    """A finished rollout batch on its way to the buffer (the delivery graph):
    as its generator made it, then as the reward model scored it. The table
    goes by value: a batch's trajectories are small, and Ray moves a large
    argument through the object store by itself."""
    step: int                      # the batch's target step
    batch_id: str
    version: int                   # the weights it was launched with
    table: Any                     # pyarrow Table, pipeline.core.types.TRAJECTORY_SCHEMA
    prompts: tuple[Any, ...] = ()  # the launch's Prompts, one per group of table rows
    clock: Clock = ()


@dataclass(frozen=True)
class RelaunchPlan:
    """The relaunch graph's input: a replaced generator takes over its dead predecessor's batches."""
    generator: int
    version: int
    dead_worker: str
    clock: Clock = ()
