"""The step graph: the one place that states the order of a training step.

    plan -> [top-up rounds] -> sample -> [train sub-graph] -> validation_gate -> refit[g] -> validate[g]
         -> resume -> collect[g]

and, for each rollout batch that collect started, once it is finished:

    rollout -> [score] -> [teach] -> put   (the delivery graph; sample takes what put buffered)

score: the reward model's (reward_model.kind); teach: the distillation
teacher's logprobs of every response token (distill.teacher).

The train sub-graph fans out to the policy's data-parallel ranks (train[r],
each on its shard of the batch) and joins them in train_done, which passes one
TrainOut on; with one rank and no critic it is the single `train` node.

A node runs only once the nodes whose tokens it takes have returned, so:
rollouts start only in `collect`, which waits for `resume`, which waits for
every generator's validation, which waits for that generator's refit, which
waits for training. Critic-free algorithms and PPO differ only in the train sub-graph; the rest
is `ordering_subgraph`, shared by both and by the recovery graph.

With dynamic_sampling.max_rounds = R (DAPO), R top-up rounds come before
sample: top_up[k] waits for the step's rollouts so far and, if they hold
fewer informative groups than the step needs, launches more at the current
weights; extra_collect[k][g] starts them. The generators hold the step's
version from the last refit until this step's, so an extra rollout is of age 0.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from ray.dag import InputNode, MultiOutputNode

Named = list[tuple[str, Any]]   # (node name, DAG node) in topological order


@dataclass(frozen=True)
class Workers:
    """A run's actor handles, which the graphs bind (pipeline/run/pool.py starts them)."""
    controller: Any          # sample, validation_gate, resume, train_done, top_up, relaunch
    trainers: tuple          # train, one per data-parallel rank; rank 0 exports the weights
    generators: tuple        # refit, validate, collect, extra_collect
    critics: tuple = ()      # PPO only: critic_values, critic_train, one per rank; rank 0 also advantages
    placement: Any = None    # pipeline.run.placement.Placement, or None: plain fractional CPUs
    reward_model: Any = None  # the delivery graph's score (reward_model.kind); begin_run's, per run
    teacher: Any = None       # the delivery graph's teach (distill.teacher); begin_run's, per run

    def first(self, num_generators: int) -> "Workers":
        return replace(self, generators=self.generators[:num_generators])

    def replace_generator(self, index: int, actor: Any) -> "Workers":
        gens = list(self.generators)
        gens[index] = actor
        return replace(self, generators=tuple(gens))


@dataclass(frozen=True)
class StepGraph:
    dag: Any                 # MultiOutputNode over every node, in topological order
    node_names: tuple[str, ...]
    trained: str = ""        # the node whose TrainOut the ordering sub-graph takes (step graphs)


def _ranked(name: str, nodes: list) -> Named:
    return [(name, nodes[0])] if len(nodes) == 1 else [(f"{name}[{r}]", n) for r, n in enumerate(nodes)]


def critic_free_train_subgraph(workers: Workers, batch) -> Named:
    """Every rank trains on its shard; train_done joins them (nothing to join with one rank)."""
    ranks = [t.train.bind(batch) for t in workers.trainers]
    if len(ranks) == 1:
        return _ranked("train", ranks)
    return [*_ranked("train", ranks), ("train_done", workers.controller.train_done.bind(*ranks))]


def actor_critic_train_subgraph(workers: Workers, batch) -> Named:
    """The old critic's values of every shard -> GAE over the whole batch (critic
    rank 0); then the policy and critic ranks update side by side; train_done
    joins them so nothing downstream runs before all are done."""
    values = [c.critic_values.bind(batch) for c in workers.critics]
    advantages = workers.critics[0].advantages.bind(*values)
    ranks = [t.train.bind(batch, advantages) for t in workers.trainers]
    critics = [c.critic_train.bind(advantages) for c in workers.critics]
    return [*_ranked("critic_values", values), ("advantages", advantages), *_ranked("train", ranks),
            *_ranked("critic_train", critics), ("train_done", workers.controller.train_done.bind(*ranks, *critics))]


TRAIN_SUBGRAPHS: dict[str, Callable[[Workers, Any], Named]] = {
    "critic_free": critic_free_train_subgraph, "actor_critic": actor_critic_train_subgraph}


def ordering_subgraph(workers: Workers, plan, trained, collective: bool = False) -> Named:
    """Everything after training: the part that keeps rollouts away from refits
    and validations. `trained` is the node (or input) carrying the TrainOut.
    `collective` (generation.weight_sync): trainer rank 0's send_weights runs
    beside the refits, which receive what it broadcasts, and resume waits for it."""
    gate = workers.controller.validation_gate.bind(plan, trained)
    send = [("send_weights", workers.trainers[0].send_weights.bind(trained, gate))] if collective else []
    refits = [g.refit.bind(trained, gate) for g in workers.generators]
    vals = [g.validate.bind(r) for g, r in zip(workers.generators, refits)]
    resume = workers.controller.resume.bind(*vals, *(n for _, n in send))
    collects = [g.collect.bind(resume) for g in workers.generators]
    return [("validation_gate", gate), *send, *[(f"refit[{i}]", r) for i, r in enumerate(refits)],
            *[(f"validate[{i}]", v) for i, v in enumerate(vals)], ("resume", resume),
            *[(f"collect[{i}]", c) for i, c in enumerate(collects)]]


def graph_of(named: Named, trained: str = "") -> StepGraph:
    """A StepGraph whose outputs are the named nodes, in this order."""
    return StepGraph(MultiOutputNode([n for _, n in named]), tuple(name for name, _ in named), trained)


def top_up_subgraph(workers: Workers, plan, rounds: int) -> tuple[Named, list]:
    """Round k's top_up waits for round k-1's extra rollouts to start (and, inside,
    for every rollout of the step to arrive); its launches start in extra_collect.
    Returns the rounds' nodes and the last round's extra_collects, which sample waits for."""
    named, started = [], []
    for k in range(1, rounds + 1):
        top_up = workers.controller.top_up.bind(plan, k, *started)
        started = [g.extra_collect.bind(top_up) for g in workers.generators]
        named += [(f"top_up[{k}]", top_up), *[(f"extra_collect[{k}][{i}]", c) for i, c in enumerate(started)]]
    return named, started


def build_step_graph(workers: Workers, train_subgraph: Callable = critic_free_train_subgraph,
                     collective: bool = False, top_up_rounds: int = 0) -> StepGraph:
    with InputNode() as plan:
        top_ups, started = top_up_subgraph(workers, plan, top_up_rounds)
        batch = workers.controller.sample.bind(plan, *started)
        train = train_subgraph(workers, batch)
        return graph_of([*top_ups, ("sample", batch), *train,
                         *ordering_subgraph(workers, plan, train[-1][1], collective)], trained=train[-1][0])


def build_finish_graph(workers: Workers) -> StepGraph:
    """The rest of a step whose training is done, after a generator was
    replaced: input (plan, TrainOut). Refit, resume and collect are idempotent
    per step, so the generators that got this far are not disturbed. (Object-store
    weight sync only: a collective sync's group cannot take a new member mid-run.)"""
    with InputNode() as inputs:
        return graph_of(ordering_subgraph(workers, inputs[0], inputs[1]))


def build_delivery_graph(controller: Any, reward_model: Any = None, teacher: Any = None) -> StepGraph:
    """A finished rollout batch's way into the buffer, run once per batch by the
    generator that rolled it out: the reward model scores it and the teacher
    puts its logprobs in (each when the run has one), and only what they
    return reaches the controller's put, so no sample can take a batch they
    have not seen."""
    with InputNode() as rollout:
        named, batch = [], rollout
        for name, actor in (("score", reward_model), ("teach", teacher)):
            if actor is not None:
                batch = getattr(actor, name).bind(batch)
                named.append((name, batch))
        return graph_of([*named, ("put", controller.put.bind(batch))])


def build_relaunch_graph(workers: Workers, generator: int) -> StepGraph:
    """A replaced generator takes over its dead predecessor's unfinished batches:
    input a RelaunchPlan (generator index, version, dead worker's name). Run
    between steps, when no validation runs, by a generator that holds the
    current weights."""
    with InputNode() as plan:
        resume = workers.controller.relaunch.bind(plan)
        collect = workers.generators[generator].collect.bind(resume)
        return graph_of([("relaunch", resume), (f"collect[{generator}]", collect)])


def build_prologue_graph(workers: Workers) -> StepGraph:
    """Before the first step: validate the initial weights if asked, then fill
    the pipeline with the first max_age + 1 batches at the current version."""
    with InputNode() as plan:
        gate = workers.controller.validation_gate.bind(plan)
        vals = [g.validate.bind(gate) for g in workers.generators]
        resume = workers.controller.resume.bind(*vals)
        collects = [g.collect.bind(resume) for g in workers.generators]
        return graph_of([("validation_gate", gate), *[(f"validate[{i}]", v) for i, v in enumerate(vals)],
                         ("resume", resume), *[(f"collect[{i}]", c) for i, c in enumerate(collects)]])
