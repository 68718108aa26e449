"""Draw a described step graph (pipeline.tools.render.describe) as PNG or SVG with matplotlib alone.

A layered drawing, top to bottom: a node's layer is its longest path from the
input. An edge that skips layers runs through one waypoint in each layer it
crosses; the edges leaving a node with the same token share those waypoints, so
a fan-out splits only above its targets. A few barycentre sweeps order each
layer to cut crossings; then each layer's nodes are spread evenly and pulled
towards the nodes they connect to. Every token a node sends leaves through one
port on the box's bottom, labelled there once, however many arrows it feeds.
All lengths are in points (1/72 inch): one data unit is one point.
"""
from __future__ import annotations

import io
from itertools import combinations

from matplotlib import rc_context
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
from matplotlib.path import Path as MPath
from matplotlib.textpath import TextToPath

NAME_FONT = FontProperties(size=11, weight="bold")
WORKER_FONT = FontProperties(size=9)
TOKEN_FONT = FontProperties(size=8.5)
TITLE_FONT = FontProperties(size=12, weight="bold")
LINE, TEXT, WORKER_TEXT = "#555555", "#222222", "#444444"
BOX_H, PAD_X, MIN_W = 36.0, 12.0, 84.0   # node box height, padding either side of its text, least width
WAYPOINT_W = 6.0                         # the room an edge passing through a layer takes
GAP_X, GAP_Y = 26.0, 58.0                # between neighbours in a layer; between layers
STEM = 15.0                              # straight drop under a port, where its token is written
MARGIN, TITLE_H = 18.0, 30.0
DPI = 150
_measure = TextToPath()


def _width(text: str, font: FontProperties) -> float:
    return _measure.get_text_width_height_descent(text, font, ismath=False)[0]


def _pack(desired: list[float], seps: list[float]) -> list[float]:
    """Positions nearest `desired` (least squares) keeping x[i+1] - x[i] >= seps[i]:
    shifted by the running separation the constraint becomes monotone, solved by
    pooling adjacent violators."""
    offsets = [0.0]
    for s in seps:
        offsets.append(offsets[-1] + s)
    blocks: list[list[float]] = []  # [sum, count] of pooled shifted targets
    for d, off in zip(desired, offsets):
        blocks.append([d - off, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    shifted = [total / count for total, count in blocks for _ in range(int(count))]
    return [y + off for y, off in zip(shifted, offsets)]


def _crossings(rows: list[list], preds: dict) -> int:
    total = 0
    for upper, lower in zip(rows, rows[1:]):
        pos_u = {v: i for i, v in enumerate(upper)}
        segs = [(pos_u[u], j) for j, v in enumerate(lower) for u in preds[v]]
        total += sum((a - c) * (b - d) < 0 for (a, b), (c, d) in combinations(segs, 2))
    return total


def _order(rows: list[list], preds: dict, succs: dict) -> list[list]:
    """Barycentre sweeps, down and up; keep the order with the fewest crossings."""
    best, best_n = [r[:] for r in rows], _crossings(rows, preds)
    for sweep in range(8):
        down = sweep % 2 == 0
        for i in (range(1, len(rows)) if down else range(len(rows) - 2, -1, -1)):
            ref = {v: k for k, v in enumerate(rows[i - 1] if down else rows[i + 1])}
            nbrs = preds if down else succs

            def key(item, ref=ref, nbrs=nbrs):
                k, v = item
                ks = [ref[u] for u in nbrs[v]]
                return sum(ks) / len(ks) if ks else k
            rows[i] = [v for _, v in sorted(enumerate(rows[i]), key=key)]
        n = _crossings(rows, preds)
        if n < best_n:
            best, best_n = [r[:] for r in rows], n
    return best


def _place(rows: list[list], preds: dict, succs: dict, left: dict, right: dict) -> dict:
    """x of each item: every row spread evenly about 0, then pulled towards its
    neighbours' mean, down and up in turn, never closer than GAP_X to the next."""
    x: dict = {}
    seps = [[right[a] + left[b] + GAP_X for a, b in zip(row, row[1:])] for row in rows]
    for row, sep in zip(rows, seps):
        x.update(zip(row, _pack([0.0] * len(row), sep)))
    for sweep in range(8):
        down = sweep % 2 == 0
        for i in (range(1, len(rows)) if down else range(len(rows) - 2, -1, -1)):
            nbrs = preds if down else succs
            want = [sum(x[u] for u in nbrs[v]) / len(nbrs[v]) if nbrs[v] else x[v] for v in rows[i]]
            x.update(zip(rows[i], _pack(want, seps[i])))
    return x


def draw(nodes, edges, fmt: str, title: str | None = None) -> bytes:
    """The PNG or SVG bytes of the graph; `fmt` is "png" or "svg"."""
    layer = {n.id: 0 for n in nodes}
    for e in edges:  # describe lists edges by destination in topological order
        layer[e.dst] = max(layer[e.dst], layer[e.src] + 1)

    # Ports: one per (source, token), in order of first use.
    ports: dict[str, list[str]] = {n.id: [] for n in nodes}
    for e in edges:
        if e.token not in ports[e.src]:
            ports[e.src].append(e.token)
    routes = [[e.src, *[("via", e.src, e.token, k) for k in range(layer[e.src] + 1, layer[e.dst])], e.dst]
              for e in edges]
    rows: list[list] = [[] for _ in range(max(layer.values(), default=0) + 1)]
    preds: dict = {n.id: [] for n in nodes}
    succs: dict = {n.id: [] for n in nodes}
    for n in nodes:
        rows[layer[n.id]].append(n.id)
    for route in routes:
        for u, v in zip(route, route[1:]):
            for item in (u, v):
                if item not in preds:
                    preds[item], succs[item] = [], []
                    rows[item[3]].append(item)
            if u not in preds[v]:
                preds[v].append(u)
                succs[u].append(v)
    rows = _order(rows, preds, succs)

    # Extents left and right of each item's centre: a port's label may reach past its box.
    box_w = {n.id: max(MIN_W, 2 * PAD_X + max(_width(n.name, NAME_FONT), _width(n.worker, WORKER_FONT)))
             for n in nodes}
    port_x = {(v, tok): box_w[v] * ((k + 1) / (len(ports[v]) + 1) - 0.5)
              for v in ports for k, tok in enumerate(ports[v])}
    token_w = {tok: _width(tok, TOKEN_FONT) for tok in {e.token for e in edges}}
    left = {v: box_w[v] / 2 if v in box_w else WAYPOINT_W / 2 for v in preds}
    right = dict(left)
    for (v, tok), dx in port_x.items():
        right[v] = max(right[v], dx + 5 + token_w[tok])

    x = _place(rows, preds, succs, left, right)
    lo = min((x[v] - left[v] for v in x), default=0.0)
    hi = max((x[v] + right[v] for v in x), default=0.0)
    title_w = _width(title, TITLE_FONT) if title else 0.0
    width = max(hi - lo, title_w) + 2 * MARGIN
    shift = MARGIN - lo + (width - 2 * MARGIN - (hi - lo)) / 2
    x = {v: px + shift for v, px in x.items()}
    # y: a gap between layers grows with how far its edges reach sideways, so wide fans stay steep.
    reach = [0.0] * len(rows)
    for e, route in zip(edges, routes):
        for u, v in zip(route, route[1:]):
            i = layer[u] if u in layer else u[3]
            reach[i] = max(reach[i], abs(x[u] + port_x.get((u, e.token), 0.0) - x[v]))
    tops = [MARGIN + (TITLE_H if title else 0.0)]
    for i in range(len(rows) - 1):
        tops.append(tops[-1] + BOX_H + min(2 * GAP_Y, max(GAP_Y, STEM + 0.3 * reach[i])))
    height = tops[-1] + BOX_H + MARGIN

    def top(item) -> float:
        return tops[layer[item] if item in layer else item[3]]

    fig = Figure(figsize=(width / 72, height / 72), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)  # y grows downward, as the layers do
    ax.axis("off")
    if title:
        ax.text(width / 2, MARGIN + TITLE_H / 2 - 4, title, fontproperties=TITLE_FONT, color=TEXT,
                ha="center", va="center", parse_math=False)
    for n in nodes:
        cx, y0, w = x[n.id], top(n.id), box_w[n.id]
        ax.add_patch(FancyBboxPatch((cx - w / 2, y0), w, BOX_H,
                                    boxstyle=f"round,pad=0,rounding_size={BOX_H / 2 if n.is_input else 6}",
                                    fc=n.color, ec=LINE, lw=1.0, zorder=2))
        ax.text(cx, y0 + 13, n.name, fontproperties=NAME_FONT, color=TEXT, ha="center", va="center",
                zorder=3, parse_math=False)
        ax.text(cx, y0 + 27, n.worker, fontproperties=WORKER_FONT, color=WORKER_TEXT, ha="center",
                va="center", zorder=3, parse_math=False)
        for tok in ports[n.id]:
            px, py = cx + port_x[(n.id, tok)], y0 + BOX_H
            ax.text(px + 5, py + STEM / 2 + 1, tok, fontproperties=TOKEN_FONT, color=TEXT, ha="left",
                    va="center", zorder=3, parse_math=False)

    # In-ports: the arrows into a box spread along its top, ordered by where they come from.
    incoming: dict[str, list] = {n.id: [] for n in nodes}
    for e, route in zip(edges, routes):
        prev = route[-2]
        from_x = x[prev] + port_x.get((prev, e.token), 0.0)  # a waypoint has no port
        incoming[e.dst].append((from_x, id(route)))
    in_x = {}
    for v, arrivals in incoming.items():
        for k, (_, key) in enumerate(sorted(arrivals)):
            in_x[key] = x[v] + box_w[v] * ((k + 1) / (len(arrivals) + 1) - 0.5)
    for e, route in zip(edges, routes):
        sx, sy = x[e.src] + port_x[(e.src, e.token)], top(e.src) + BOX_H
        verts, codes = [(sx, sy), (sx, sy + STEM)], [MPath.MOVETO, MPath.LINETO]
        points = [(x[v], top(v), top(v) + BOX_H) for v in route[1:-1]] + [(in_x[id(route)], top(e.dst), None)]
        for px, y_in, y_out in points:
            ax0, ay0 = verts[-1]
            mid = (y_in - ay0) / 2
            verts += [(ax0, ay0 + mid), (px, y_in - mid), (px, y_in)]
            codes += [MPath.CURVE4] * 3
            if y_out is not None:  # through a waypoint: straight down its layer
                verts.append((px, y_out))
                codes.append(MPath.LINETO)
        ax.add_patch(FancyArrowPatch(path=MPath(verts, codes), arrowstyle="-|>,head_length=6,head_width=3",
                                     color=LINE, lw=1.0, zorder=1))

    buf = io.BytesIO()
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "dagrl"}):  # SVG text stays text
        fig.savefig(buf, format=fmt, dpi=DPI, metadata={"Date": None} if fmt == "svg" else None)
    return buf.getvalue()
