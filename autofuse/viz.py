"""Pictures of graphs before and after fusion: Graphviz DOT text and a self-contained SVG.

The SVG needs no external tool: nodes are laid out in layers (networkx topological generations, one
row per generation), edges are straight lines. Colours: nodes covered by an applied fusion are green in
the "before" picture, nodes of a rejected candidate orange; fused-op calls are green in "after".
Views (ops that cost nothing) are drawn small and grey, so the kernels stand out.
"""
from __future__ import annotations

import html

import networkx as nx
import torch.fx as fx

from autofuse.graph import to_networkx
from autofuse.lower import lower

APPLIED, REJECTED, FUSED_OP, VIEW, PLAIN = "#7fd17f", "#f5b86b", "#2e9e4f", "#e4e4e4", "#cfe0f7"


def _label(n: fx.Node) -> str:
    v = n.meta.get("val")
    shape = "x".join(map(str, v.shape)) if hasattr(v, "shape") else ""
    target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    return f"{n.name}\n{str(target).replace('aten.', '')}\n{shape}"


def colours(gm: fx.GraphModule, report=None) -> dict:
    """Node name -> fill colour, from a :class:`~autofuse.decision.FusionReport` (or none)."""
    col = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and str(n.target).startswith("autofuse."):
            col[n.name] = FUSED_OP
        elif n.op == "call_function" and lower(n).free:
            col[n.name] = VIEW
        else:
            col[n.name] = PLAIN
    if report is not None:
        for d in report.rejected:
            for name in d.nodes:
                if name in col:
                    col[name] = REJECTED
        for d in report.applied:
            for name in d.nodes:
                if name in col:
                    col[name] = APPLIED
    return col


def to_dot(gm: fx.GraphModule, report=None, title="") -> str:
    col = colours(gm, report)
    lines = [f'digraph "{title or "graph"}" {{', "  rankdir=TB; node [shape=box, style=filled, fontsize=10];"]
    for n in gm.graph.nodes:
        label = _label(n).replace('"', "'").replace("\n", "\\n")
        lines.append(f'  "{n.name}" [label="{label}", fillcolor="{col.get(n.name, PLAIN)}"];')
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            lines.append(f'  "{a.name}" -> "{n.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_svg(gm: fx.GraphModule, report=None, title="", show_params=False) -> str:
    """The graph as SVG, one row per topological generation. Parameters and buffers (``get_attr``) are left
    out unless ``show_params``: they all sit in the first generation and only add long edges."""
    g = to_networkx(gm)
    if not show_params:
        g.remove_nodes_from([n.name for n in gm.graph.nodes if n.op == "get_attr"])
    col = colours(gm, report)
    nodes = {n.name: n for n in gm.graph.nodes}
    pos, width = {}, 0
    w, h, gap_x, gap_y = 150, 44, 14, 30
    for row, layer in enumerate(nx.topological_generations(g)):
        for i, name in enumerate(sorted(layer, key=lambda x: list(nodes).index(x) if x in nodes else 0)):
            pos[name] = (20 + i * (w + gap_x), 40 + row * (h + gap_y))
            width = max(width, pos[name][0] + w + 20)
    height = max((y for _, y in pos.values()), default=0) + h + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
           f'font-size="9">', f'<text x="20" y="22" font-size="14">{html.escape(title)}</text>']
    for a, b in g.edges:
        if a in pos and b in pos:
            (x1, y1), (x2, y2) = pos[a], pos[b]
            out.append(f'<line x1="{x1 + w / 2}" y1="{y1 + h}" x2="{x2 + w / 2}" y2="{y2}" stroke="#999"/>')
    for name, (x, y) in pos.items():
        n = nodes.get(name)
        fill = col.get(name, PLAIN)
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="4" fill="{fill}" stroke="#555"/>')
        for i, line in enumerate((_label(n) if n is not None else name).split("\n")):
            out.append(f'<text x="{x + 4}" y="{y + 12 + 11 * i}">{html.escape(line[:26])}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def report_html(report, before: fx.GraphModule, after: fx.GraphModule, simulation=None) -> str:
    """One page: the decision table, the simulated totals if given, and both graphs."""
    rows = "".join(
        f"<tr><td>{'fused' if d.applied else 'kept'}</td><td>{d.pattern}</td><td>{html.escape(d.anchor)}</td>"
        f"<td>{d.reason_code}</td><td>{html.escape(d.reason)}</td><td>{d.cycles_unfused:,}</td>"
        f"<td>{d.cycles_fused:,}</td><td>{d.speedup:.2f}x</td><td>{d.hbm_bytes_saved:,}</td>"
        f"<td>{d.working_set_bytes:,}</td><td>{d.workspace_bytes:,}</td></tr>"
        for d in report.decisions)
    sim = f"<pre>{html.escape(simulation.summary())}</pre>" if simulation is not None else ""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>autofuse report</title>"
            f"<style>body{{font-family:sans-serif}} td,th{{border:1px solid #ccc;padding:3px 6px}}"
            f"table{{border-collapse:collapse}}</style></head><body>"
            f"<h1>autofuse: {report.device}, {report.optimization_level}</h1>"
            f"<pre>{html.escape(report.summary())}</pre>"
            f"<table><tr><th></th><th>pattern</th><th>anchor</th><th>code</th><th>reason</th><th>unfused cycles</th>"
            f"<th>fused cycles</th><th>speed-up</th><th>HBM saved (B)</th><th>working set (B)</th>"
            f"<th>of it workspace (B)</th></tr>{rows}</table>{sim}"
            f"<h2>Before</h2>{to_svg(before, report, 'before')}<h2>After</h2>{to_svg(after, None, 'after')}"
            f"</body></html>\n")
