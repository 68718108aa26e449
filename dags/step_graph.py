"""The step graph: the one place that states the order of a training step.

    plan -> sample -> train -> validation_gate -> refit[g] -> validate[g] -> resume -> collect[g]

A node runs only once the nodes whose tokens it takes have returned, so:
rollouts start only in `collect`, which waits for `resume`, which waits for
every generator's validation, which waits for that generator's refit, which
waits for training. GRPO and PPO differ only in `train_subgraph`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ray.dag import InputNode, MultiOutputNode


@dataclass(frozen=True)
class Workers:
    controller: Any          # sample, validation_gate, resume
    trainer: Any             # train
    generators: tuple        # refit, validate, collect

    def first(self, num_generators: int) -> "Workers":
        return Workers(self.controller, self.trainer, self.generators[:num_generators])


@dataclass(frozen=True)
class StepGraph:
    dag: Any                 # MultiOutputNode over every node, in topological order
    node_names: tuple[str, ...]


def grpo_train_subgraph(workers: Workers, batch):
    return workers.trainer.train.bind(batch)


# Mutations for tests that prove the invariant checks can fail: each removes one
# ordering edge from the graph. Production code never passes one.
MUTATIONS = ("no_validate_before_resume", "no_refit_before_resume")


def build_step_graph(workers: Workers, train_subgraph: Callable = grpo_train_subgraph,
                     mutation: str | None = None) -> StepGraph:
    if mutation is not None and mutation not in MUTATIONS:
        raise ValueError(f"unknown mutation {mutation!r}; known: {MUTATIONS}")
    with InputNode() as plan:
        batch = workers.controller.sample.bind(plan)
        train = train_subgraph(workers, batch)
        gate = workers.controller.validation_gate.bind(plan, train)
        refits = [g.refit.bind(train, gate) for g in workers.generators]
        vals = [g.validate.bind(r) for g, r in zip(workers.generators, refits)]
        resume_inputs = {None: vals, "no_validate_before_resume": refits,
                         "no_refit_before_resume": [gate]}[mutation]
        resume = workers.controller.resume.bind(*resume_inputs)
        collects = [g.collect.bind(resume) for g in workers.generators]
        nodes = [batch, train, gate, *refits, *vals, resume, *collects]
        names = ["sample", "train", "validation_gate",
                 *[f"refit[{i}]" for i in range(len(refits))],
                 *[f"validate[{i}]" for i in range(len(vals))],
                 "resume", *[f"collect[{i}]" for i in range(len(collects))]]
        return StepGraph(MultiOutputNode(nodes), tuple(names))


def build_prologue_graph(workers: Workers) -> StepGraph:
    """Before step 0: validate the initial weights if asked, then fill the
    pipeline with the first max_age + 1 batches at version 0."""
    with InputNode() as plan:
        gate = workers.controller.validation_gate.bind(plan)
        vals = [g.validate.bind(gate) for g in workers.generators]
        resume = workers.controller.resume.bind(*vals)
        collects = [g.collect.bind(resume) for g in workers.generators]
        names = ["validation_gate", *[f"validate[{i}]" for i in range(len(vals))],
                 "resume", *[f"collect[{i}]" for i in range(len(collects))]]
        return StepGraph(MultiOutputNode([gate, *vals, resume, *collects]), tuple(names))
