"""One classic execution of a graph (dags/step_graph.py): the driver's step
graphs and a generator's delivery graph of each finished batch."""
from __future__ import annotations

from ray.dag import ClassMethodNode, DAGNode, InputAttributeNode, InputNode

from dags.step_graph import StepGraph


def submit(graph: StepGraph, args: tuple) -> list:
    """One classic execution: every node's actor call, each taking its upstream
    nodes' ObjectRefs, so Ray orders them; the refs of the graph's outputs.

    Not Ray's `DAGNode.execute`: it keeps a reference to every node's output
    for the life of the driver (ray-project/ray#47920; measured here: 3 leaked
    references per execution of a 3-node graph), and the train node's output
    holds the step's weights, so each step pinned one full copy of them in the
    object store. Here the refs live exactly as long as the caller holds them;
    nothing here refers to itself, so no cycle waits for the garbage collector
    to let them go (one did: 27 copies alive at once)."""
    made: dict[int, object] = {}

    def value(arg):
        if isinstance(arg, InputNode):
            return args[0] if len(args) == 1 else args
        if isinstance(arg, InputAttributeNode):
            return args[arg._key]
        if isinstance(arg, DAGNode):
            if id(arg) not in made:
                raise TypeError("step graph: a node's input is not among the outputs listed before it")
            return made[id(arg)]
        return arg

    # The graph's outputs are every node, in topological order (dags/step_graph.py graph_of).
    for node in graph.dag.get_args():
        if not isinstance(node, ClassMethodNode) or not node.is_class_method_call or node.get_kwargs():
            raise TypeError(f"step graph: {node} is not an actor-method node with positional arguments")
        method = getattr(node._get_actor_handle(), node.get_method_name())
        made[id(node)] = method.options(**node.get_options()).remote(*(value(a) for a in node.get_args()))
    return list(made.values())
