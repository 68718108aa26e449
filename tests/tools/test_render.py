"""Drawing the step graph: DOT, Mermaid, PNG, SVG, without starting Ray."""
from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pydot
import pytest

from pipeline.config import load_config
from pipeline.tools.render import FORMATS, RenderError, describe, graph_for_config, render, to_mermaid, viz_main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
STEP_TOKENS = {"StepPlan", "Batch", "TrainOut", "Gate", "Refitted", "ValOut", "Resume"}
PROLOGUE_TOKENS = {"StepPlan", "Gate", "ValOut", "Resume"}


def cfg_for(generators: int):
    return load_config(REPO / "examples/sim_grpo.yaml", [f"generation.num_generators={generators}"])


def dot_graph(path: Path) -> pydot.Dot:
    graphs = pydot.graph_from_dot_data(path.read_text())
    assert graphs and len(graphs) == 1, f"{path} is not one DOT graph"
    return graphs[0]


def _strip(label: str | None) -> str:
    return (label or "").strip('"').strip()


@pytest.mark.parametrize("generators", [1, 2])
@pytest.mark.parametrize("prologue", [False, True])
def test_dot_names_every_node_worker_and_token(tmp_path, generators, prologue):
    graph = graph_for_config(cfg_for(generators), prologue=prologue)
    dot = dot_graph(render(graph, tmp_path / "g.dot"))
    labels = {n.get_name(): _strip(n.get("label")) for n in dot.get_nodes() if n.get("label")}
    for name in graph.node_names:
        assert sum(f"<B>{name}</B>" in label for label in labels.values()) == 1, (name, labels)
    edge_tokens = {_strip(e.get("label")) for e in dot.get_edges()}
    assert edge_tokens == (PROLOGUE_TOKENS if prologue else STEP_TOKENS)
    nodes, edges = describe(graph)
    assert len(dot.get_edges()) == len(edges)
    assert all(src in labels and dst in labels
               for src, dst in ((e.get_source(), e.get_destination()) for e in dot.get_edges()))


def test_nodes_name_their_worker_and_edges_their_token():
    nodes, edges = describe(graph_for_config(cfg_for(2)))
    by_name = {n.name: n for n in nodes}
    assert by_name["sample"].worker == "Controller"
    assert by_name["train"].worker == "TrainerWorker"
    assert by_name["refit[1]"].worker == "GeneratorWorker[1]"
    assert by_name["collect[0]"].worker == "GeneratorWorker[0]"
    assert by_name["input"].is_input
    name_of = {n.id: n.name for n in nodes}
    labelled = {(name_of[e.src], name_of[e.dst]): e.token for e in edges}
    assert labelled[("input", "sample")] == "StepPlan"
    assert labelled[("sample", "train")] == "Batch"
    assert labelled[("train", "refit[1]")] == "TrainOut"
    assert labelled[("validation_gate", "refit[0]")] == "Gate"
    assert labelled[("refit[0]", "validate[0]")] == "Refitted"
    assert labelled[("validate[1]", "resume")] == "ValOut"
    assert labelled[("resume", "collect[1]")] == "Resume"
    # Same generator class, same colour; different classes, different colours.
    assert by_name["refit[0]"].color == by_name["collect[1]"].color != by_name["train"].color


def test_data_parallel_ranks_fan_out_and_join():
    """Two policy and two critic ranks (PPO): every rank's node takes the batch
    (the critics') or the advantages (the policy's), and train_done joins them all."""
    cfg = load_config(REPO / "examples/sim_ppo.yaml", ["training.ranks=2", "ppo.critic_ranks=2"])
    nodes, edges = describe(graph_for_config(cfg))
    by_name = {n.name: n for n in nodes}
    name_of = {n.id: n.name for n in nodes}
    labelled = {(name_of[e.src], name_of[e.dst]): e.token for e in edges}
    assert by_name["train[1]"].worker == "TrainerWorker[1]" and by_name["critic_values[1]"].worker == "CriticWorker[1]"
    for r in (0, 1):
        assert labelled[("sample", f"critic_values[{r}]")] == "Batch"
        assert labelled[(f"critic_values[{r}]", "advantages")] == "Values"
        assert labelled[("advantages", f"train[{r}]")] == "Advantages"
        assert labelled[("advantages", f"critic_train[{r}]")] == "Advantages"
        assert labelled[(f"train[{r}]", "train_done")] == "TrainOut"
        assert labelled[(f"critic_train[{r}]", "train_done")] == "CriticOut"
    assert by_name["advantages"].worker == "CriticWorker[0]"
    assert labelled[("train_done", "refit[0]")] == "TrainOut"


@pytest.mark.parametrize("generators", [1, 2])
def test_mermaid_names_every_node_and_token(tmp_path, generators):
    graph = graph_for_config(cfg_for(generators))
    text = render(graph, tmp_path / "g.mmd").read_text()
    assert text.split("\n", 1)[0].startswith(("flowchart", "graph"))
    for name in graph.node_names:
        assert f'"{name}<br/>' in text, name
    for token in STEP_TOKENS:
        assert f'-->|"{token}"|' in text, token
    assert "GeneratorWorker[1]" in text if generators == 2 else "GeneratorWorker" in text
    assert to_mermaid(graph, "my run").startswith("---\ntitle: my run\n---\nflowchart")


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def svg_texts(path: Path) -> list[str]:
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return ["".join(el.itertext()) for el in root.iter("{http://www.w3.org/2000/svg}text")]


@pytest.mark.parametrize("recipe,generators,prologue", [
    ("sim_grpo", 1, False), ("sim_grpo", 2, False), ("sim_grpo", 4, False), ("sim_ppo", 2, False),
    ("sim_grpo", 2, True)])
def test_png_and_svg_are_drawn(tmp_path, recipe, generators, prologue):
    cfg = load_config(REPO / f"examples/{recipe}.yaml", [f"generation.num_generators={generators}"])
    graph = graph_for_config(cfg, prologue=prologue)
    nodes, edges = describe(graph)
    width, height = png_size(render(graph, tmp_path / "out" / "g.png", "a title").read_bytes())
    # 150 dpi, layered top to bottom: these graphs are a few boxes wide and 5 to 10 layers tall.
    assert 300 < width < 3000 and 800 < height < 4000 and height > width, (width, height)
    texts = svg_texts(render(graph, tmp_path / "g.svg", "a title"))
    for n in nodes:  # each node's name and worker, each token, the title: as text, not glyph outlines
        assert n.name in texts and n.worker in texts, n
    assert {e.token for e in edges} <= set(texts) and "a title" in texts
    if not prologue:
        assert "TrainOut" in texts


def test_pictures_need_no_dot_program(tmp_path, monkeypatch):
    """PNG and SVG come from matplotlib alone: no `dot` on PATH, none looked up, none run."""
    import pipeline.tools.draw  # noqa: F401  (matplotlib's font cache is built before PATH goes)
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    looked_up, ran = [], []
    real_which, real_popen = shutil.which, subprocess.Popen
    monkeypatch.setattr(shutil, "which", lambda cmd, *a, **k: looked_up.append(cmd) or real_which(cmd, *a, **k))

    class Popen(real_popen):
        def __init__(self, args, *a, **k):
            ran.append(args)
            super().__init__(args, *a, **k)
    monkeypatch.setattr(subprocess, "Popen", Popen)
    graph = graph_for_config(cfg_for(2))
    assert png_size(render(graph, tmp_path / "g.png").read_bytes())[0] > 300
    assert "refit[1]" in svg_texts(render(graph, tmp_path / "g.svg"))
    assert viz_main(REPO / "examples/sim_grpo.yaml", [], [str(tmp_path / "v.png"), str(tmp_path / "v.svg")]) == 0
    assert (tmp_path / "v.png").stat().st_size > 1000 and (tmp_path / "v.svg").stat().st_size > 1000
    programs = [Path(str(a if isinstance(a, (str, Path)) else a[0]).split()[0]).name for a in ran]
    assert "dot" not in looked_up and "dot" not in programs, (looked_up, ran)


def test_unknown_suffix_names_the_allowed_ones(tmp_path, capsys):
    graph = graph_for_config(cfg_for(1))
    with pytest.raises(RenderError) as info:
        render(graph, tmp_path / "g.jpg")
    assert all(s in str(info.value) for s in FORMATS)
    assert viz_main(REPO / "examples/sim_grpo.yaml", [], [str(tmp_path / "a.dot"), str(tmp_path / "b.pdf")]) == 2
    assert not (tmp_path / "a.dot").exists()
    assert ".mmd" in capsys.readouterr().err


def test_viz_main_writes_each_path(tmp_path, capsys):
    outs = [str(tmp_path / f"step{s}") for s in FORMATS]
    assert viz_main(REPO / "examples/sim_grpo.yaml", ["generation.num_generators=2"], outs) == 0
    printed = capsys.readouterr().out
    for out in outs:
        assert Path(out).stat().st_size > 0 and out in printed
    assert viz_main(REPO / "examples/sim_grpo.yaml", ["generation.nope=1"], outs) == 2


def test_graph_builds_without_starting_ray():
    """A fresh interpreter: binding actor classes must not start Ray or a worker."""
    code = ("import ray; from pipeline.config import load_config; from pipeline.tools.render import graph_for_config, to_dot\n"
            "g = graph_for_config(load_config('examples/sim_grpo.yaml', ['generation.num_generators=3']))\n"
            "assert 'collect[2]' in to_dot(g)\n"
            "print('ray initialized:', ray.is_initialized())")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ray initialized: False" in done.stdout
