"""Where the run's actors go: one Ray placement group, one bundle per actor.

Bundle order is fixed, so an actor's bundle index follows from its role alone:

    controller | trainer ranks | critic ranks (PPO) | generator 0: T bundles | generator 1: T ... | reward model

with T = generation.tensor_parallel_size. A generator actor sits in the first of
its T bundles; vLLM's tensor-parallel workers (one per bundle, T > 1 only) take
the GPUs of all T (see Placement.vllm_placement).

check_capacity refuses, with the numbers, a recipe the cluster cannot hold, before
any group or actor exists. Its checks are necessary, not sufficient (packing
bundles onto nodes in general is a bin-packing search): what they miss, or what
other jobs hold, shows up as place()'s timeout, which names the bundles.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config import Config
from pipeline.generator.engines import vllm_llm_kwargs

# A custom resource a bundle asks only to be pinned to the nodes that have it.
NODE_TOKEN = 0.001
_EPS = 1e-9  # Ray keeps resources as fixed-point; sums of 0.1s must not fail by rounding


class PlacementError(ValueError):
    """The recipe's bundles cannot be placed; the message has the numbers."""


@dataclass(frozen=True)
class Bundle:
    role: str        # controller, trainer, critic, generator, reward_model, teacher
    index: int       # rank or generator index within the role
    tp_rank: int     # a generator's tensor-parallel rank; 0 for the other roles
    resources: dict  # what the bundle reserves, as Ray's placement_group takes it

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]" + (f".tp{self.tp_rank}" if self.tp_rank else "")


def _counts(cfg: Config) -> dict[str, int]:
    """Actors per role, in bundle order."""
    return {"controller": 1, "trainer": cfg.training.ranks,
            "critic": cfg.critic_actors,
            "generator": cfg.generation.num_generators,
            "reward_model": 1 if cfg.reward_model.kind else 0,
            "teacher": 1 if cfg.distill.teacher else 0}


def bundles(cfg: Config) -> list[Bundle]:
    """Every bundle of the run's placement group, in the fixed order above."""
    out = []
    tp = cfg.generation.tensor_parallel_size
    for role, count in _counts(cfg).items():
        res = getattr(cfg.resources, role)
        for index in range(count):
            for tp_rank in range(tp if role == "generator" else 1):
                # CPUs go to the actor's bundle only: vLLM's TP workers ask 0 CPUs.
                spec = {"CPU": res.num_cpus if tp_rank == 0 else 0.0, "GPU": res.num_gpus}
                if res.node_resource:
                    spec[res.node_resource] = NODE_TOKEN
                spec = {k: v for k, v in spec.items() if v > 0}
                # Ray refuses an all-zero bundle; a role asking nothing still needs one.
                out.append(Bundle(role, index, tp_rank, spec or {"CPU": NODE_TOKEN}))
    return out


def _num(x: float) -> str:
    return f"{x:g}"


def _spec(resources: dict) -> str:
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in resources.items()) + "}"


def _node_name(node: dict) -> str:
    return f"node {node.get('NodeManagerAddress', '?')} ({str(node.get('NodeID', '?'))[:8]})"


def _fits(ask: dict, have: dict) -> bool:
    return all(have.get(k, 0.0) + _EPS >= v for k, v in ask.items())


def _sum(specs: list[dict]) -> dict:
    total: dict = {}
    for spec in specs:
        for k, v in spec.items():
            total[k] = total.get(k, 0.0) + v
    return total


def totals(cfg: Config) -> dict:
    """What the whole recipe reserves, per resource: e.g. a local Ray's num_cpus must cover totals(cfg)["CPU"]."""
    return _sum([b.resources for b in bundles(cfg)])


def check_capacity(cfg: Config, nodes: list[dict]) -> None:
    """Raise PlacementError if the recipe asks more than `nodes` (ray.nodes()) hold.

    Pure: it reads only its arguments, so it runs in tests without Ray."""
    alive = [n for n in nodes if n.get("Alive", True)]
    caps = [dict(n.get("Resources", {})) for n in alive]
    specs = bundles(cfg)
    if not alive:
        raise PlacementError("the cluster has no alive node")
    if cfg.generation.tensor_parallel_size > 1:
        # vLLM's ray executor counts a bundle's GPUs and refuses any over 1, in
        # the whole group, not only the generator's bundles.
        big = sorted({f"{b.role} {_num(b.resources['GPU'])}" for b in specs if b.resources.get("GPU", 0) > 1})
        if big:
            raise PlacementError(f"generation.tensor_parallel_size {cfg.generation.tensor_parallel_size} runs vLLM's "
                                 f"ray executor, which refuses a bundle of more than 1 GPU; the recipe asks "
                                 f"{', '.join(big)} GPUs per bundle")
    for role in _counts(cfg):
        token = getattr(cfg.resources, role).node_resource
        if token and not any(token in cap for cap in caps):
            custom = sorted({k for cap in caps for k in cap if k not in ("CPU", "GPU", "memory", "object_store_memory")
                             and not k.startswith(("node:", "accelerator_type:"))})
            raise PlacementError(f"resources.{role}.node_resource {token!r}: no node of the cluster has it (custom "
                                 f"resources: {', '.join(custom) or 'none'}; a node gets it with ray start "
                                 f"--resources '{{\"{token}\": 1}}')")
    asked, have = totals(cfg), _sum(caps)
    for key in ("GPU", "CPU", *sorted(k for k in asked if k not in ("GPU", "CPU"))):
        if asked.get(key, 0) > have.get(key, 0) + _EPS:
            parts: dict = {}  # (role, per-bundle amount) -> bundles, for "trainer 4 x 1"
            for b in specs:
                if key in b.resources:
                    parts[(b.role, b.resources[key])] = parts.get((b.role, b.resources[key]), 0) + 1
            detail = ", ".join(f"{role} {n} x {_num(v)}" for (role, v), n in parts.items())
            unit = key + ("s" if key in ("CPU", "GPU") else "")
            raise PlacementError(f"the recipe asks {_num(asked[key])} {unit} ({detail}) "
                                 f"but the cluster has {_num(have.get(key, 0))}")
    for b in specs:
        if not any(_fits(b.resources, cap) for cap in caps):
            # The closest node: the one that has the largest share of what the bundle asks.
            closest = max(alive, key=lambda n: sum(min(n["Resources"].get(k, 0) / v, 1)
                                                   for k, v in b.resources.items()))
            shown = {k: closest["Resources"].get(k, 0) for k in b.resources}
            raise PlacementError(f"a {b.role} bundle {_spec(b.resources)} fits on no node (the closest, "
                                 f"{_node_name(closest)}, has {_spec(shown)})")
    strategy = cfg.resources.strategy
    if strategy == "STRICT_PACK" and not any(_fits(asked, cap) for cap in caps):
        each = "; ".join(f"{_node_name(n)}: {_spec({k: n['Resources'].get(k, 0) for k in asked})}" for n in alive)
        raise PlacementError(f"STRICT_PACK puts all {len(specs)} bundles on one node: they ask {_spec(asked)} but "
                             f"no node has that much ({each})")
    if strategy == "STRICT_SPREAD":
        if len(specs) > len(alive):
            raise PlacementError(f"STRICT_SPREAD puts each of the {len(specs)} bundles on a node of its own but the "
                                 f"cluster has {len(alive)} nodes")
        for role in _counts(cfg):
            token = getattr(cfg.resources, role).node_resource
            mine = sum(b.role == role for b in specs)
            pinned = sum(token in cap for cap in caps) if token else len(alive)
            if mine > pinned:
                raise PlacementError(f"STRICT_SPREAD puts each of the {mine} {role} bundles on a node of its own but "
                                     f"{token!r} is on {pinned} node(s)")


class Placement:
    """The run's placement group and, per actor, the Ray options that put it in its bundle."""

    def __init__(self, cfg: Config, group: Any, specs: list[Bundle]):
        self.cfg, self.group, self.bundles = cfg, group, specs
        self._index = {(b.role, b.index, b.tp_rank): i for i, b in enumerate(specs)}

    def bundle_index(self, role: str, index: int, tp_rank: int = 0) -> int:
        try:
            return self._index[(role, index, tp_rank)]
        except KeyError:
            raise PlacementError(f"no bundle for {role}[{index}] tp rank {tp_rank}: the recipe has "
                                 f"{_counts(self.cfg).get(role, 0)} {role} actor(s)") from None

    def options(self, role: str, index: int = 0) -> dict:
        """Keyword arguments for ray.remote(Cls).options(...): the actor's
        resources, and its bundle. capture_child_tasks: whatever the actor
        starts (vLLM's TP workers) stays in this group; a child task asking for
        CPUs must then find them free in some bundle.

        An actor without GPUs gets ray.get_gpu_ids() == [], but Ray 2.60 leaves
        its CUDA_VISIBLE_DEVICES as the node's (ray-project/ray#54868): torch in
        it can still see every GPU of the node."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        bundle = self.bundle_index(role, index)
        res = getattr(self.cfg.resources, role)
        tp = self.cfg.generation.tensor_parallel_size if role == "generator" else 1
        out = {"num_cpus": res.num_cpus,
               # With T > 1 the GPUs are the TP workers': rank 0's is in this same bundle.
               "num_gpus": res.num_gpus if tp == 1 else 0,
               "resources": {},
               "scheduling_strategy": PlacementGroupSchedulingStrategy(
                   self.group, placement_group_bundle_index=bundle,
                   placement_group_capture_child_tasks=True)}
        if tp > 1:
            out["runtime_env"] = {"env_vars": self.vllm_placement(index)["env_vars"]}
        return out

    def vllm_placement(self, index: int) -> dict:
        """What generator `index`'s vLLM (0.32) needs to put its T tensor-parallel
        workers in the generator's T bundles: `env_vars` (options() already sets
        them in the actor's runtime_env; vLLM reads them when the engine starts)
        and `llm_kwargs` for vllm.LLM.

        vLLM's ray executor (RayExecutorV2, or the legacy RayDistributedExecutor)
        takes the placement group of the actor it runs in
        (ray.util.get_current_placement_group(): set only with capture_child_tasks),
        the engine running in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as
        pipeline/generator/vllm_engine.py sets). Without VLLM_RAY_BUNDLE_INDICES
        it would take the first T bundles with a GPU in the group: the trainer's.
        Each worker asks VLLM_RAY_PER_WORKER_GPUS (default 1) GPUs of its bundle
        and 0 CPUs, so the generator actor itself asks no GPU (options()).

        Needs T GPUs and vLLM's CUDA build: it cannot run on a CPU machine, and
        the tests check only the bundle arithmetic for T > 1."""
        tp = self.cfg.generation.tensor_parallel_size
        indices = [self.bundle_index("generator", index, r) for r in range(tp)]
        if tp == 1:
            return {"env_vars": {}, "llm_kwargs": {}}  # vLLM's uniprocess executor, in the actor
        return {"env_vars": {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, indices)),
                             "VLLM_RAY_PER_WORKER_GPUS": _num(self.cfg.resources.generator.num_gpus)},
                "llm_kwargs": vllm_llm_kwargs(self.cfg)}

    def remove(self) -> None:
        """Free the group's resources; its actors are killed with it."""
        from ray.util import remove_placement_group
        remove_placement_group(self.group)


def place(cfg: Config, timeout_s: float) -> Placement:
    """Check the recipe against the cluster, then reserve every bundle; raises
    PlacementError before anything is created if the cluster is too small, and
    if the group is not ready within timeout_s (the group is removed again)."""
    import ray
    from ray.util import placement_group, remove_placement_group
    check_capacity(cfg, ray.nodes())
    specs = bundles(cfg)
    group = placement_group([b.resources for b in specs], strategy=cfg.resources.strategy)
    try:
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    except BaseException:  # interrupted: a pending group would still take its resources once they are free
        remove_placement_group(group)
        raise
    if not ready:
        remove_placement_group(group)
        free = ray.available_resources()
        raise PlacementError(
            f"the placement group ({cfg.resources.strategy}) was not ready within {_num(timeout_s)} s; its bundles: "
            + ", ".join(f"{b.name} {_spec(b.resources)}" for b in specs)
            + f"; free now: {_spec({k: free.get(k, 0) for k in totals(cfg)})} "
            "(other jobs or actors may hold the rest)")
    return Placement(cfg, group, specs)
