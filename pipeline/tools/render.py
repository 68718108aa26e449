"""Draw a StepGraph: DOT and Mermaid as text, PNG and SVG with matplotlib (pipeline/tools/draw.py).

Everything is read off the Ray DAG itself (method names, bound actors, return
annotations), so a new node or token in dags/step_graph.py shows up here
without a table to keep in step. `graph_for_config` binds actor *classes*
(ClassNodes), which needs neither ray.init nor a worker process.
"""
from __future__ import annotations

import html
import importlib
import inspect
import sys
import types
import typing
import zlib
from dataclasses import dataclass
from pathlib import Path

from ray.dag import ClassMethodNode, ClassNode, DAGNode, FunctionNode, InputAttributeNode, InputNode, MultiOutputNode

from dags.step_graph import StepGraph, Workers, build_prologue_graph
from pipeline.run.execution import step_graph_for

FORMATS = (".dot", ".mmd", ".png", ".svg")
# An actor class keeps its colour across graphs (step and prologue): the slot
# comes from a hash of its name, probing on a clash.
PALETTE = ("#dbe9f6", "#f8d7da", "#fff3bf", "#eadcf3", "#fde3c8", "#d6efd2")
INPUT_FILL = "#eeeeee"


class RenderError(RuntimeError):
    """The graph could not be written; the message says what to do."""


@dataclass(frozen=True)
class Node:
    id: str
    name: str           # "refit[0]"
    worker: str         # "GeneratorWorker[0]", or "driver" for the graph's input
    color: str
    is_input: bool = False


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    token: str          # "TrainOut"


# ---------------------------------------------------------------- the DAG walk

def _actor_class(node: ClassMethodNode) -> tuple[type, object]:
    """The user's class behind a method node, and a key naming the actor."""
    parent = node._parent_class_node
    if isinstance(parent, ClassNode):
        cls = parent._body
        # ray.remote subclasses the user's class; the original keeps the real name.
        return getattr(cls, "__ray_actor_class__", cls), id(parent)
    handle = node._get_actor_handle()
    if handle is None:
        raise RenderError(f"cannot tell which actor runs {node.get_method_name()!r}")
    desc = handle._ray_actor_creation_function_descriptor
    cls = getattr(importlib.import_module(desc.module_name), desc.class_name)
    return cls, handle._actor_id


def _hints(fn) -> dict:
    try:
        return typing.get_type_hints(inspect.unwrap(fn))
    except Exception:  # an unresolvable annotation must not stop a drawing
        return {}


def _type_name(t) -> str:
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        return " | ".join(_type_name(a) for a in typing.get_args(t) if a is not type(None))
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def _param_type(fn, skip: int, position: int | None, keyword: str | None) -> str:
    """The annotation of the parameter that receives a positional / keyword argument."""
    hints = _hints(fn)
    params = list(inspect.signature(inspect.unwrap(fn)).parameters.values())[skip:]  # skip: self
    for i, p in enumerate(params):
        if keyword is not None and p.name == keyword:
            return _type_name(hints.get(p.name, "?"))
        if keyword is None and (i == position or p.kind is p.VAR_POSITIONAL) \
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL):
            return _type_name(hints.get(p.name, "?"))
    return "?"


def _upstream(node: DAGNode):
    """(upstream node, position, keyword) for each DAG argument, one level into containers."""
    def scan(value, pos, kw):
        if isinstance(value, DAGNode):
            yield value, pos, kw
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from scan(v, pos, kw)
        elif isinstance(value, dict):
            for v in value.values():
                yield from scan(v, pos, kw)
    for pos, arg in enumerate(node.get_args()):
        yield from scan(arg, pos, None)
    for kw, arg in node.get_kwargs().items():
        yield from scan(arg, None, kw)


def _colors(class_names: list[str]) -> dict[str, str]:
    taken: dict[int, str] = {}
    for name in class_names:
        slot = zlib.crc32(name.encode()) % len(PALETTE)
        for probe in range(len(PALETTE)):
            if (slot + probe) % len(PALETTE) not in taken:
                taken[(slot + probe) % len(PALETTE)] = name
                break
    return {name: PALETTE[slot] for slot, name in taken.items()}


def describe(graph: StepGraph) -> tuple[list[Node], list[Edge]]:
    """Nodes in topological order (inputs first) and their token-labelled edges."""
    outputs = list(graph.dag.get_args()) if isinstance(graph.dag, MultiOutputNode) else [graph.dag]
    names = {id(n): name for n, name in zip(outputs, graph.node_names)}
    order: list[DAGNode] = []
    seen: set[int] = set()

    def visit(n: DAGNode) -> None:
        if id(n) in seen or isinstance(n, ClassNode):
            return
        seen.add(id(n))
        for up, _, _ in _upstream(n):
            visit(up)
        order.append(n)
    for out in outputs:
        visit(out)

    ids = {id(n): f"n{i}" for i, n in enumerate(order)}
    fn_of: dict[int, tuple] = {}           # node -> (the Python function it runs, 1 if it takes self)
    actors: dict[str, list[object]] = {}   # class name -> actor keys, in order of appearance
    info: dict[int, tuple] = {}        # node -> (name, worker: str or (class, index))
    for n in order:
        if isinstance(n, (InputNode, InputAttributeNode)):
            key = vars(n).get("_key")  # getattr would make a new InputAttributeNode
            info[id(n)] = ("input" if key is None else f"input.{key}", "driver")
            continue
        if isinstance(n, ClassMethodNode):
            cls, key = _actor_class(n)
            fn_of[id(n)] = (getattr(cls, n.get_method_name()), 1)
            cname, method = cls.__name__, n.get_method_name()
            keys = actors.setdefault(cname, [])
            if key not in keys:
                keys.append(key)
            worker = (cname, keys.index(key))
        elif isinstance(n, FunctionNode):
            fn = getattr(n._body, "_function", n._body)  # a RemoteFunction wraps the user's function
            fn_of[id(n)] = (fn, 0)
            method = getattr(fn, "__name__", "task")
            worker = ("task", None)
        else:
            continue
        info[id(n)] = (names.get(id(n), method), worker)
    colors = _colors(sorted({w[0] for _, w in info.values() if isinstance(w, tuple)}))

    nodes, edges = [], []
    for n in order:
        if id(n) not in info:
            continue
        name, worker = info[id(n)]
        color = colors.get(worker[0], INPUT_FILL) if isinstance(worker, tuple) else INPUT_FILL
        if isinstance(worker, tuple):
            cname, index = worker
            # Index only where a class has several actors: "GeneratorWorker[1]", "Controller".
            worker = f"{cname}[{index}]" if index is not None and len(actors.get(cname, ())) > 1 else cname
        nodes.append(Node(ids[id(n)], name, worker, color, is_input=id(n) not in fn_of))
        for up, pos, kw in _upstream(n):
            if id(up) not in info:
                continue
            if id(up) in fn_of:
                token = _type_name(_hints(fn_of[id(up)][0]).get("return", "?"))
            else:  # the input has no method: its type is what the consumer declares
                token = _param_type(*fn_of[id(n)], pos, kw) if id(n) in fn_of else "?"
            edges.append(Edge(ids[id(up)], ids[id(n)], token))
    return nodes, edges


# ---------------------------------------------------------------- text formats

def _dot_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph: StepGraph, title: str | None = None) -> str:
    nodes, edges = describe(graph)
    lines = ["digraph step_graph {",
             '  graph [rankdir=TB, nodesep=0.35, ranksep=0.45, fontname="Helvetica", fontsize=14'
             + (f", label={_dot_str(title)}, labelloc=t" if title else "") + "];",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=12, color="#555555"];',
             '  edge [fontname="Helvetica", fontsize=10, color="#555555", fontcolor="#333333"];']
    for n in nodes:
        shape = ", shape=ellipse" if n.is_input else ""
        # An HTML label so the worker reads as a caption under the node's name.
        label = f'<<B>{html.escape(n.name)}</B><BR/><FONT POINT-SIZE="10" COLOR="#444444">{html.escape(n.worker)}</FONT>>'
        lines.append(f"  {n.id} [label={label}, "
                     f"fillcolor={_dot_str(n.color)}{shape}];")
    for e in edges:
        lines.append(f"  {e.src} -> {e.dst} [label={_dot_str(' ' + e.token + ' ')}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _mmd_str(s: str) -> str:
    return '"' + s.replace('"', "#quot;").replace("\n", "<br/>") + '"'


def to_mermaid(graph: StepGraph, title: str | None = None) -> str:
    nodes, edges = describe(graph)
    lines = ([f"---\ntitle: {title}\n---"] if title else []) + ["flowchart TD"]
    for n in nodes:
        label = _mmd_str(f"{n.name}\n{n.worker}")
        lines.append(f"  {n.id}([{label}])" if n.is_input else f"  {n.id}[{label}]")
    for e in edges:
        lines.append(f"  {e.src} -->|{_mmd_str(e.token)}| {e.dst}")
    for i, color in enumerate(dict.fromkeys(n.color for n in nodes)):
        lines.append(f"  classDef c{i} fill:{color},stroke:#555")
        lines.append(f"  class {','.join(n.id for n in nodes if n.color == color)} c{i}")
    return "\n".join(lines) + "\n"


def render(graph: StepGraph, out_path: str | Path, title: str | None = None) -> Path:
    """Write the graph in the format its suffix names: .dot .mmd .png .svg."""
    out = Path(out_path)
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise RenderError(f"cannot write {out}: unknown suffix {out.suffix or '(none)'!r}; "
                          f"use one of {', '.join(FORMATS)}")
    if suffix == ".mmd":
        data = to_mermaid(graph, title).encode()
    elif suffix == ".dot":
        data = to_dot(graph, title).encode()
    else:
        from pipeline.tools.draw import draw  # matplotlib: only loaded for pictures
        data = draw(*describe(graph), suffix[1:], title)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return out


# ---------------------------------------------------------------- from a config

def viz_workers(num_generators: int, train_graph: str = "critic_free", trainers: int = 1, critics: int = 1) -> Workers:
    """Unstarted actors: ClassNodes only describe an actor, so binding them needs no cluster."""
    import ray

    from pipeline.controller.controller import Controller
    from pipeline.core.node import rank_actor
    from pipeline.generator.worker import GeneratorWorker
    from pipeline.trainer.worker import TrainerWorker
    critic_ranks = ()
    if train_graph == "actor_critic":
        from pipeline.trainer.critic_worker import CriticWorker
        critic_ranks = tuple(rank_actor(CriticWorker).bind(r) for r in range(critics))
    return Workers(ray.remote(Controller).bind(), tuple(rank_actor(TrainerWorker).bind(r) for r in range(trainers)),
                   tuple(ray.remote(GeneratorWorker).bind(i) for i in range(num_generators)), critic_ranks)


def graph_for_config(cfg, prologue: bool = False) -> StepGraph:
    workers = viz_workers(cfg.generation.num_generators, cfg.train_graph, cfg.training.ranks,
                          cfg.ppo.critic_ranks)
    if prologue:
        return build_prologue_graph(workers)
    return step_graph_for(cfg, workers)


def viz_main(config_path: str | Path | None, overrides: list[str] = (), out_paths: list[str] = (),
             prologue: bool = False) -> int:
    """Write the config's step graph (or prologue) to each path; with no path, print DOT."""
    from pipeline.config import ConfigError, load_config
    try:
        cfg = load_config(config_path, list(overrides))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    graph = graph_for_config(cfg, prologue)
    gens, ranks = cfg.generation.num_generators, cfg.training.ranks
    title = (f"{cfg.run.name}: {'prologue' if prologue else 'step graph'}, "
             f"{gens} generator{'s' if gens != 1 else ''}, "
             + (f"{ranks} trainer ranks, " if ranks > 1 else "") + f"max_age {cfg.schedule.max_age}")
    if not out_paths:
        print(to_dot(graph, title), end="")
        return 0
    bad = [p for p in out_paths if Path(p).suffix.lower() not in FORMATS]
    if bad:  # before writing anything: a typo should not leave half the files
        print(f"error: unknown suffix in {', '.join(bad)}; use one of {', '.join(FORMATS)}", file=sys.stderr)
        return 2
    try:
        for p in out_paths:
            print(f"wrote {render(graph, p, title)}")
    except (RenderError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
