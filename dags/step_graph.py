"""The step graph: the one place that states the order of a training step.

    plan -> sample -> [train sub-graph] -> validation_gate -> refit[g] -> validate[g] -> resume -> collect[g]

A node runs only once the nodes whose tokens it takes have returned, so:
rollouts start only in `collect`, which waits for `resume`, which waits for
every generator's validation, which waits for that generator's refit, which
waits for training. GRPO and PPO differ only in the train sub-graph; the rest
is `ordering_subgraph`, shared by both and by the recovery graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ray.dag import InputNode, MultiOutputNode

Named = list[tuple[str, Any]]   # (node name, DAG node) in topological order


class Workers(Protocol):
    """The actor handles a graph binds (pipeline/run/pool.py holds the live ones)."""
    controller: Any          # sample, validation_gate, resume, train_done, relaunch
    trainer: Any             # train
    generators: tuple        # refit, validate, collect
    critic: Any              # PPO only: critic_values, critic_train


@dataclass(frozen=True)
class StepGraph:
    dag: Any                 # MultiOutputNode over every node, in topological order
    node_names: tuple[str, ...]


def grpo_train_subgraph(workers: Workers, batch) -> Named:
    return [("train", workers.trainer.train.bind(batch))]


def ppo_train_subgraph(workers: Workers, batch) -> Named:
    """Old critic's values -> GAE; then policy and critic update side by side;
    train_done joins them so nothing downstream runs before both are done."""
    advantages = workers.critic.critic_values.bind(batch)
    policy = workers.trainer.train.bind(batch, advantages)
    critic = workers.critic.critic_train.bind(advantages)
    return [("critic_values", advantages), ("train", policy), ("critic_train", critic),
            ("train_done", workers.controller.train_done.bind(policy, critic))]


TRAIN_SUBGRAPHS: dict[str, Callable[[Workers, Any], Named]] = {
    "grpo": grpo_train_subgraph, "ppo": ppo_train_subgraph}


def ordering_subgraph(workers: Workers, plan, trained) -> Named:
    """Everything after training: the part that keeps rollouts away from refits
    and validations. `trained` is the node (or input) carrying the TrainOut."""
    gate = workers.controller.validation_gate.bind(plan, trained)
    refits = [g.refit.bind(trained, gate) for g in workers.generators]
    vals = [g.validate.bind(r) for g, r in zip(workers.generators, refits)]
    resume = workers.controller.resume.bind(*vals)
    collects = [g.collect.bind(resume) for g in workers.generators]
    return [("validation_gate", gate), *[(f"refit[{i}]", r) for i, r in enumerate(refits)],
            *[(f"validate[{i}]", v) for i, v in enumerate(vals)], ("resume", resume),
            *[(f"collect[{i}]", c) for i, c in enumerate(collects)]]


def graph_of(named: Named) -> StepGraph:
    """A StepGraph whose outputs are the named nodes, in this order."""
    return StepGraph(MultiOutputNode([n for _, n in named]), tuple(name for name, _ in named))


def build_step_graph(workers: Workers, train_subgraph: Callable = grpo_train_subgraph) -> StepGraph:
    with InputNode() as plan:
        batch = workers.controller.sample.bind(plan)
        train = train_subgraph(workers, batch)
        return graph_of([("sample", batch), *train, *ordering_subgraph(workers, plan, train[-1][1])])


def build_finish_graph(workers: Workers) -> StepGraph:
    """The rest of a step whose training is done, after a generator was
    replaced: input (plan, TrainOut). Refit, resume and collect are idempotent
    per step, so the generators that got this far are not disturbed."""
    with InputNode() as inputs:
        return graph_of(ordering_subgraph(workers, inputs[0], inputs[1]))


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
