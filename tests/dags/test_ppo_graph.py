"""PPO's step graph: the same ordering as GRPO's, and the same invariants at run time.

(a) Structure: everything after training (validation_gate, refit[g],
    validate[g], resume, collect[g]) is compared edge by edge between the GRPO
    and PPO graphs, read off the Ray DAG's bound arguments. Unstarted
    ClassNodes (pipeline/tools/render.py viz_workers): no cluster needed.
(b) Behaviour: random schedules of async PPO on simulated workers, checked
    by pipeline.tools.check from the event log.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from ray.dag import ClassMethodNode, InputNode

from dags.step_graph import (StepGraph, Workers, actor_critic_train_subgraph, build_step_graph,
                             critic_free_train_subgraph)
from pipeline.core.worker_names import actor_names
from pipeline.tools.render import viz_workers

# The node that hands the TrainOut to the ordering sub-graph: the policy update
# in GRPO; in PPO the join of the policy and critic updates, so nothing
# downstream starts before both are done.
TRAINED = {"grpo": "train", "ppo": "train_done"}
TRAIN_NODES = {"grpo": {"train"}, "ppo": {"critic_values", "advantages", "train", "critic_train", "train_done"}}


def structure(graph: StepGraph, workers: Workers) -> dict[str, tuple]:
    """name -> (actor, method, upstream labels) for every node of the graph.

    An upstream label is the upstream node's name, or "plan" for the graph's
    input; the actor is named as in its event log (actor_names)."""
    outputs = list(graph.dag.get_args())
    assert len(outputs) == len(graph.node_names)
    names = {id(n): name for n, name in zip(outputs, graph.node_names)}
    actors = {id(a): name for name, a in actor_names(workers).items()}

    def label(arg) -> str:
        if isinstance(arg, InputNode):
            return "plan"
        assert id(arg) in names, f"an upstream node that is not among the graph's outputs: {arg}"
        return names[id(arg)]

    out = {}
    for node, name in zip(outputs, graph.node_names):
        assert isinstance(node, ClassMethodNode) and not node.get_kwargs()
        out[name] = (actors[id(node._parent_class_node)], node.get_method_name(),
                     tuple(label(a) for a in node.get_args()))
    return out


def ordering_part(graph: StepGraph, workers: Workers, algorithm: str) -> dict[str, tuple]:
    """The nodes outside sample and the train sub-graph, with the TrainOut
    producer's name replaced by one role label shared by both algorithms."""
    s = structure(graph, workers)
    assert s["sample"] == ("controller", "sample", ("plan",))
    rest = {name: v for name, v in s.items() if name != "sample" and name not in TRAIN_NODES[algorithm]}
    role = {TRAINED[algorithm]: "<TrainOut>"}
    return {name: (actor, method, tuple(role.get(a, a) for a in args))
            for name, (actor, method, args) in rest.items()}


@pytest.mark.parametrize("generators", [1, 2, 3])
def test_ordering_subgraph_is_identical_for_grpo_and_ppo(generators):
    grpo_workers, ppo_workers = viz_workers(generators, "critic_free"), viz_workers(generators, "actor_critic")
    grpo = build_step_graph(grpo_workers, critic_free_train_subgraph)
    ppo = build_step_graph(ppo_workers, actor_critic_train_subgraph)
    a, b = ordering_part(grpo, grpo_workers, "grpo"), ordering_part(ppo, ppo_workers, "ppo")
    assert a == b
    g = range(generators)
    assert set(a) == {"validation_gate", "resume", *(f"{n}[{i}]" for n in ("refit", "validate", "collect") for i in g)}
    # The edges the ordering rests on, spelled out once (the same in both, by the assert above).
    assert a["validation_gate"] == ("controller", "validation_gate", ("plan", "<TrainOut>"))
    for i in g:
        assert a[f"refit[{i}]"] == (f"gen{i}", "refit", ("<TrainOut>", "validation_gate"))
        assert a[f"validate[{i}]"] == (f"gen{i}", "validate", (f"refit[{i}]",))
        assert a[f"collect[{i}]"] == (f"gen{i}", "collect", ("resume",))
    assert a["resume"] == ("controller", "resume", tuple(f"validate[{i}]" for i in g))

    # PPO's train sub-graph: values -> advantages -> (policy, critic) side by side -> join.
    p = structure(ppo, ppo_workers)
    assert p["critic_values"] == ("critic", "critic_values", ("sample",))
    assert p["advantages"] == ("critic", "advantages", ("critic_values",))
    assert p["train"] == ("trainer", "train", ("sample", "advantages"))
    assert p["critic_train"] == ("critic", "critic_train", ("advantages",))
    assert p["train_done"] == ("controller", "train_done", ("train", "critic_train"))
    assert structure(grpo, grpo_workers)["train"] == ("trainer", "train", ("sample",))


@pytest.mark.parametrize("resume_after", ["refit", "gate"])
def test_the_structural_comparison_sees_a_missing_edge(resume_after):
    """resume no longer waits for the validations (or for the refits either):
    tests/support/mutations.py's validate_not_before_resume and refit_not_before_resume edges."""
    import ray
    from tests.support.mutations import MutantController, rewired
    grpo_workers, ppo_workers = viz_workers(2, "critic_free"), viz_workers(2, "actor_critic")
    mutant_workers = replace(grpo_workers, controller=ray.remote(MutantController).bind())
    mutated = ordering_part(rewired(mutant_workers, resume_after=resume_after), mutant_workers, "grpo")
    ppo = build_step_graph(ppo_workers, actor_critic_train_subgraph)
    expected = ordering_part(ppo, ppo_workers, "ppo")
    # The mutant's resume is another method; the comparison must see the edges, not the name.
    assert mutated["resume"][0] == expected["resume"][0] and mutated["resume"][2] != expected["resume"][2]
    assert {k: v for k, v in mutated.items() if k != "resume"} == {k: v for k, v in expected.items() if k != "resume"}
    assert ordering_part(rewired(grpo_workers), grpo_workers, "grpo") == ordering_part(ppo, ppo_workers, "ppo")


# ---------------------------------------------------------------- (b) behaviour

from test_step_graph import schedules  # noqa: E402  (the GRPO tests' schedule space, shared)

from pipeline.config import load_config  # noqa: E402
from tests.support.pooled_run import train_on  # noqa: E402
from pipeline.run.pool import start_workers, stop_workers  # noqa: E402
from pipeline.run.runner import GraphRunner  # noqa: E402
from pipeline.core.events import load_events  # noqa: E402
from pipeline.tools.check import check_events  # noqa: E402

pytestmark = pytest.mark.sim

_run_ids = itertools.count()


@pytest.fixture(scope="module")
def ppo_pool(ray_session):
    pool = start_workers(3, critics=1)
    try:
        yield pool
    finally:
        stop_workers(pool)


def node_times(events, step: int) -> dict[str, tuple[float, float]]:
    """(start, end) of each node of one step; a generator's node name carries its worker."""
    out: dict[str, list] = {}
    for e in events:
        if e["ev"] in ("node_start", "node_end") and e["step"] == step:
            key = e["node"] if e["worker"] in ("controller", "trainer", "critic") else f"{e['node']}@{e['worker']}"
            out.setdefault(key, [None, None])[e["ev"] == "node_end"] = e["t"]
    return {k: tuple(v) for k, v in out.items()}


def check_ppo_schedule(tmp_path, pool, runner, s: dict) -> None:
    pairs = [f"run.output_dir={tmp_path}", f"run.name=ppo_{next(_run_ids)}", "run.deadline_s=30",
             "algorithm=ppo", f"run.dag_mode={runner.mode}", f"run.steps={s['steps']}", f"run.seed={s['seed']}",
             f"schedule.max_age={s['max_age']}", f"validation.period={s['val_period']}",
             f"validation.at_start={str(s['val_at_start']).lower()}", f"validation.at_end={str(s['val_at_end']).lower()}",
             f"schedule.prompts_per_step={s['prompts']}", f"generation.num_generators={s['generators']}",
             f"ppo.critic_warmup={s['seed'] % 3}",
             f"sim.generate_s={s['generate_ms'] / 1000}", f"sim.train_s={s['train_ms'] / 1000}",
             f"sim.refit_s={s['refit_ms'] / 1000}", f"sim.validate_s={s['validate_ms'] / 1000}",
             f"sim.jitter={s['jitter']}"]
    cfg = load_config(None, pairs)
    summary = train_on(cfg, pool, step_runner=runner, quiet=True)
    events = load_events(tmp_path / cfg.run.name)
    violations = check_events(events)
    assert violations == [], f"{s}\n" + "\n".join(v.message for v in violations)
    acc = summary["accounting"]
    assert acc["balanced"] and acc["dropped"] == 0 and acc["trained"] == acc["launched"]
    assert summary["steps"] == s["steps"]
    # The train sub-graph's own edges, as they happened: values before both
    # updates, the join after both, and nothing of the ordering part before the join.
    for step in range(s["steps"]):
        t = node_times(events, step)
        values, adv, policy, critic, done = (t["critic_values"], t["advantages"], t["train"], t["critic_train"],
                                             t["train_done"])
        assert values[1] <= adv[0] and adv[1] <= policy[0] and adv[1] <= critic[0], (step, t)
        assert done[0] >= max(policy[1], critic[1]), (step, t)
        later = [v[0] for k, v in t.items() if k.split("@")[0] in ("validation_gate", "refit")]
        assert later and min(later) >= done[1], (step, t)


@pytest.mark.parametrize("generators", [1, 3])
def test_ppo_invariants_hold_over_random_schedules(tmp_path, ppo_pool, generators):
    workers = ppo_pool.first(generators)
    runner = GraphRunner(build_step_graph(workers, actor_critic_train_subgraph), "classic", first_deadline_s=60)
    try:
        @settings(max_examples=16, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(schedules)
        def prop(s):
            check_ppo_schedule(tmp_path, workers, runner, {**s, "generators": generators})
        prop()
    finally:
        runner.close()


def test_critic_warmup_holds_the_policy_but_not_the_versions(tmp_path, ppo_pool):
    """During ppo.critic_warmup only the critic learns; the version still rises by one a step."""
    cfg = load_config("examples/sim_ppo.yaml", [f"run.output_dir={tmp_path}", "run.name=warm", "run.steps=5",
                                                "ppo.critic_warmup=3", "run.dag_mode=classic",
                                                "generation.num_generators=2", "metrics.tensorboard=false"])
    train_on(cfg, ppo_pool, quiet=True)
    metrics = [json.loads(line) for line in (tmp_path / "warm" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] >= 0]
    assert [m.get("policy_frozen") for m in steps] == [1.0, 1.0, 1.0, None, None]
    # The simulated policy's loss is 1 / updates: its first update is step 3's.
    assert "loss" not in steps[2] and steps[3]["loss"] == 1.0 and steps[4]["loss"] == 0.5
    assert all("critic/value_loss" in m for m in steps)
    events = load_events(tmp_path / "warm")
    assert check_events(events) == []
    assert [e["version"] for e in events if e["ev"] == "train_end"] == [1, 2, 3, 4, 5]
