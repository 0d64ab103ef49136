"""Pictures of a graph before and after fusion: Graphviz DOT (rendered by ``dot``), a built-in SVG when
Graphviz is missing, and Google Model Explorer's graph JSON with node-data overlays.

**DOT** (:func:`graph_dot`). Nodes are grouped in nested clusters by the model's module hierarchy
(:func:`autofuse.hierarchy.module_paths`); a module with a single drawn node gets no cluster of its own (its
name goes on the node). Of identical sibling layers (``layers.1`` ... ``layers.31`` like ``layers.1``) the
first is drawn expanded and the others as one folded box, "×30 identical to layers.1" with their cycles
(``expand_all`` draws every layer). In the graph before fusion each candidate is a cluster: filled in its
family's colour when applied, dashed orange when not, labelled with the numbers or the reason code; in the
graph after, a fused op is one node in its family's colour. A fused block that crosses a layer boundary (a
projection whose epilogue is the next layer's norm) is drawn in the last layer it covers, labelled "spans
layers.0 → layers.1", so it folds with its layer. Each kernel node carries its shape and dtype, cycles, HBM
bytes and bound unit (from a simulation, or the cost model's prices: :func:`autofuse.report.node_costs`);
views (no kernel) are small and grey; parameters are left out unless ``show_params``. A legend explains the
colours. :func:`draw` lays the DOT out with Graphviz within :data:`RENDER_TIMEOUT` seconds, else (Graphviz
missing or out of time) with the built-in layout, and says which.

**Model Explorer** (:func:`model_explorer`). One ``GraphCollection`` (``{"label", "graphs"}``, the format
its JSON loader reads, schema in ``model_explorer.graph_builder``) with the fused and the original graph;
each node has the module path as its namespace (``model/layers.0/self_attn``; a candidate's nodes sit in a
``attention (fused)`` / ``attention (not fused: reason)`` group below it), attributes (operation, arguments,
cycles, HBM bytes, bound, fusion), its incoming edges and its output shape as ``tensor_shape``.
:func:`model_explorer_node_data` gives the overlays (``ModelNodeData``: graph id -> results per node id):
cycles, HBM bytes, bound unit, fused or not.
"""
from __future__ import annotations

import html
import operator
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx as fx

from autofuse import hierarchy
from autofuse.graph import target_name, to_networkx
from autofuse.lower import lower
from autofuse.report import family_colour

APPLIED, REJECTED, FUSED_OP, VIEW, PLAIN = "#7fd17f", "#f5b86b", "#2e9e4f", "#e4e4e4", "#cfe0f7"
REJECTED_EDGE = "#e07b00"


def _short(n: fx.Node) -> str:
    t = target_name(n)
    return t.split(".")[1] if t.count(".") >= 2 else t


_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int64": "i64", "int32": "i32"}


def _shape(n: fx.Node) -> str:
    v = n.meta.get("val")
    if v is None and n.users:                       # a multi-output call: its first getitem knows
        v = next(iter(n.users)).meta.get("val")
    if isinstance(v, (tuple, list)) and v and isinstance(v[0], torch.Tensor):
        v = v[0]
    if isinstance(v, torch.Tensor):
        dtype = str(v.dtype).replace("torch.", "")
        return "×".join(map(str, v.shape)) + " " + _DTYPES.get(dtype, dtype)
    return ""


def _is_view(n: fx.Node) -> bool:
    return n.op == "call_function" and not hierarchy.fused_lead(n) and lower(n).free


def colours(gm: fx.GraphModule, report=None) -> dict:
    """Node name -> fill colour of the built-in SVG, from a :class:`~autofuse.decision.FusionReport` (or none)."""
    col = {}
    for n in gm.graph.nodes:
        if _is_view(n):
            col[n.name] = VIEW
        elif hierarchy.fused_match(n) is not None or (n.op == "call_function" and str(n.target).startswith("autofuse.")):
            col[n.name] = FUSED_OP
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


def _tint(colour: str, white: float) -> str:
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(c + (255 - c) * white):02x}" for c in (r, g, b))


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 2 ** 30), ("MB", 2 ** 20), ("KB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _cost_line(c) -> str:
    if c is not None and c.part_of:
        return f"priced with {c.part_of}"
    return f"{c.cycles:,} cyc · {_fmt_bytes(c.hbm_bytes)} · {c.bound}" if c is not None else ""


# ---------------------------------------------------------------------------------------------- DOT

class _Cluster:
    def __init__(self, key, label="", attrs=""):
        self.key, self.label, self.attrs = key, label, attrs
        self.children: dict = {}
        self.nodes: list = []

    def count(self) -> int:
        return len(self.nodes) + sum(c.count() for c in self.children.values())


def _q(s: str) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _html_label(lines, bold_first=True, size=None) -> str:
    parts = []
    for i, line in enumerate(lines):
        if not line:
            continue
        text = html.escape(line)
        if i == 0 and bold_first:
            text = f"<B>{text}</B>"
        elif i > 0:
            text = f'<FONT POINT-SIZE="{(size or 10) - 1}">{text}</FONT>'
        parts.append(text)
    return "<" + "<BR/>".join(parts) + ">"


_CAND = "\0candidate"       # cluster key marker: no module is called that


def candidate_of(report) -> dict:
    """Node name -> the decision whose cluster it is drawn in (an applied one wins over rejected overlaps)."""
    out = {}
    if report is None:
        return out
    for d in sorted(report.decisions, key=lambda d: not d.applied):
        for name in d.nodes:
            out.setdefault(name, d)
    return out


def graph_dot(gm: fx.GraphModule, report=None, costs: dict | None = None, title: str = "", *,
              before_paths: dict | None = None, expand_all: bool = False, show_params: bool = False,
              cost_source: str = "") -> str:
    """The graph as Graphviz DOT (see the module docstring). ``report`` draws the candidates of the graph
    before fusion; ``costs``: node name -> :class:`~autofuse.report.Cost`; ``before_paths``: the module paths
    of the graph before the rewrite (places fused ops of the graph after)."""
    costs = costs or {}
    paths = hierarchy.module_paths(gm, before=before_paths)
    classes = hierarchy.module_classes(gm)
    cand = candidate_of(report)
    status = {n: ("applied " if d.applied else "rejected ") + d.pattern for n, d in cand.items()}
    folded: dict = {}                       # node name -> id of the box its layer is folded into
    boxes = {}
    if not expand_all:
        for g in hierarchy.repeated_layers(gm, paths, status):     # outermost first: inner ones may be inside
            box = "fold_" + "_".join(g.hidden[0])
            hidden = set(g.hidden)
            for name, p in paths.items():
                if name not in folded and any(p[:len(h)] == h for h in hidden):
                    folded[name] = box
            if any(v == box for v in folded.values()):
                boxes[box] = g
    drawn = [n for n in gm.graph.nodes if n.name not in folded and not (n.op == "get_attr" and not show_params)
             and not (n.op == "placeholder" and not n.users)]
    root = _Cluster(())

    def cluster_for(path, decision=None):
        c = root
        for i in range(1, len(path) + 1):
            key = path[:i]
            if key not in c.children:
                c.children[key] = _Cluster(key)
            c = c.children[key]
        if decision is not None:
            key = (_CAND, decision.anchor)
            if key not in c.children:
                c.children[key] = _Cluster(key, attrs=decision)
            c = c.children[key]
        return c

    decision_path = {}
    for d in {id(d): d for d in cand.values()}.values():
        decision_path[d.anchor] = hierarchy.common_prefix(paths[x] for x in d.nodes if x in paths)
    for n in drawn:
        d = cand.get(n.name)
        cluster_for(decision_path[d.anchor] if d is not None else paths.get(n.name, ()), d).nodes.append(n)
    for box, g in boxes.items():
        cluster_for(g.parent).nodes.append(box)

    lines = [f"digraph {_q(title or 'graph')} {{",
             '  graph [rankdir=TB, fontname="Helvetica", fontsize=11, nodesep=0.25, ranksep=0.35, newrank=true, '
             'labelloc=t, labeljust=l];',
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, fillcolor="#dbe7f5", '
             'color="#7a8ca5", margin="0.08,0.03"];',
             '  edge [color="#8a8a8a", arrowsize=0.6];']
    if title:
        sub = f"cycles · HBM bytes · bound unit: {cost_source}" if cost_source else ""
        lines.append(f"  label={_html_label([title, sub])};")

    def node_line(n, prefix="") -> str:
        if isinstance(n, str):          # a folded box
            g = boxes[n]
            members = [x for x, b in folded.items() if b == n]
            cyc = sum(costs[x].cycles for x in members if x in costs)
            per = cyc // max(len(g.hidden), 1)
            shown = ".".join(g.shown[-2:])
            lab = [g.label(), f"×{len(g.hidden)} identical to {shown}",
                   f"{len(g.hidden)} × {per:,} cyc = {cyc:,} cyc" if cyc else ""]
            return (f"  {_q(n)} [shape=box3d, style=filled, fillcolor=\"#f4f4f4\", color=\"#555555\", "
                    f"label={_html_label(lab)}];")
        c = costs.get(n.name)
        match = hierarchy.fused_match(n)
        if match is not None and not _is_view(n):
            fill = family_colour(match.pattern)
            lab = [f"{_short(n)} · fused {match.pattern}", _shape(n), _cost_line(c), spans(n)]
            return (f"  {_q(n.name)} [label={_html_label(lab)}, fillcolor=\"{fill}\", fontcolor=white, "
                    f"color=\"#222222\", penwidth=1.5, tooltip={_q(n.name)}];")
        if n.op in ("placeholder", "output"):
            lab = [n.name if n.op == "placeholder" else "output", _shape(n)]
            return f"  {_q(n.name)} [shape=ellipse, style=filled, fillcolor=white, label={_html_label(lab)}];"
        if n.op == "get_attr":
            return (f"  {_q(n.name)} [shape=note, fillcolor=\"#f7f7f7\", fontsize=8, "
                    f"label={_html_label([str(n.target), _shape(n)], size=8)}];")
        if _is_view(n):
            return (f"  {_q(n.name)} [fontsize=8, fillcolor=\"{VIEW}\", color=\"#bbbbbb\", height=0.2, "
                    f"label={_html_label([n.name, _shape(n)], bold_first=False, size=8)}, tooltip={_q(n.name)}];")
        d = cand.get(n.name)
        fill = _tint(family_colour(d.pattern), 0.6) if d is not None and d.applied else "#dbe7f5"
        name = f"{prefix}: {n.name}" if prefix and not prefix.isdigit() else n.name   # its module has no box
        lab = [name, _shape(n), _cost_line(c)]
        return f"  {_q(n.name)} [label={_html_label(lab)}, fillcolor=\"{fill}\", tooltip={_q(target_name(n))}];"

    def spans(n) -> str:            # a block across a layer boundary sits in its last layer: name them all
        covered = hierarchy.layers_covered(before_paths[x] for x in hierarchy.fused_block(n)[1]
                                           if x in (before_paths or {}))
        return "spans " + " → ".join(".".join(layer[-2:]) for layer in covered) if len(covered) > 1 else ""

    ids = iter(range(1, 1 << 30))

    def emit(c: _Cluster, depth: int):
        own_cluster = bool(c.key) and (c.key[0] == _CAND or c.count() > 1)
        ind = "  " * (depth + 1)
        if own_cluster:
            lines.append(f"{ind}subgraph cluster_{next(ids)} {{")
            if c.key[0] == _CAND:
                d = c.attrs
                if d.applied:
                    lab = [f"{d.pattern} · fused", f"{d.cycles_unfused:,} → {d.cycles_fused:,} cyc ({d.speedup:.2f}×)"]
                    lines.append(f'{ind}  style="rounded,filled"; fillcolor="{_tint(family_colour(d.pattern), 0.82)}"; '
                                 f'color="{family_colour(d.pattern)}"; penwidth=2; label={_html_label(lab)};')
                else:
                    lab = [f"{d.pattern} · not fused", d.reason_code]
                    lines.append(f'{ind}  style="rounded,dashed"; color="{REJECTED_EDGE}"; penwidth=2; '
                                 f'fontcolor="{REJECTED_EDGE}"; label={_html_label(lab)};')
            else:
                name = c.key[-1] if not c.key[-1].isdigit() or len(c.key) < 2 else f"{c.key[-2]}.{c.key[-1]}"
                cls = classes.get(c.key, "")
                lines.append(f'{ind}  style="rounded"; color="#b0b0b0"; '
                             f'label={_html_label([name + (" · " + cls if cls else "")])};')
        prefix = c.key[-1] if c.key and not own_cluster and c.key[0] != _CAND else ""
        for n in c.nodes:
            lines.append(ind + node_line(n, prefix).lstrip())
        for child in c.children.values():
            emit(child, depth + 1 if own_cluster else depth)
        if own_cluster:
            lines.append(f"{ind}}}")

    emit(root, 0)
    drawn_ids = {n.name for n in drawn if not isinstance(n, str)}
    seen = set()
    for n in gm.graph.nodes:
        dst = folded.get(n.name, n.name)
        if dst not in drawn_ids and dst not in boxes:
            continue
        for a in n.all_input_nodes:
            src = folded.get(a.name, a.name)
            if src == dst or (src not in drawn_ids and src not in boxes) or (src, dst) in seen:
                continue
            seen.add((src, dst))
            lines.append(f"  {_q(src)} -> {_q(dst)};")
    lines += _legend(gm, report)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _legend(gm, report) -> list:
    fams = sorted({d.pattern for d in (report.decisions if report is not None else ())}
                  | {m.pattern for n in gm.graph.nodes if (m := hierarchy.fused_match(n)) is not None})
    items = [("legend_op", "kernel (unfused op)", 'fillcolor="#dbe7f5"'),
             ("legend_view", "view: no kernel", f'fillcolor="{VIEW}", fontsize=8, color="#bbbbbb"')]
    for f in fams:
        items.append((f"legend_{f}", f"fused {f}", f'fillcolor="{family_colour(f)}", fontcolor=white'))
        if report is not None:
            items.append((f"legend_{f}_region", f"{f} block, fused",
                          f'fillcolor="{_tint(family_colour(f), 0.82)}", color="{family_colour(f)}", penwidth=2'))
    if report is not None and report.rejected:
        items.append(("legend_rejected", "candidate not fused (reason)",
                      f'style="rounded,dashed", fillcolor=white, color="{REJECTED_EDGE}", penwidth=2'))
    out = ['  subgraph cluster_legend {', '    label=<<B>legend</B>>; style="rounded"; color="#cccccc"; fontsize=10;']
    for key, text, attrs in items:
        out.append(f'    {_q(key)} [label={_q(text)}, {attrs}];')
    out.append("    { rank=same; " + "; ".join(_q(k) for k, _, _ in items) + "; }")
    out.append("  }")
    return out


def have_graphviz() -> bool:
    return shutil.which("dot") is not None


#: seconds Graphviz may spend laying out one picture. A folded picture of a deep model takes well under a
#: second; a graph drawn expanded can take Graphviz many minutes (a 48-layer GPT-2 did not finish in 10).
RENDER_TIMEOUT = 60.0


class LayoutTimeout(RuntimeError):
    """Graphviz ``dot`` did not finish laying out a picture in the time allowed (it was stopped)."""

    def __init__(self, seconds: float, nodes: int, edges: int):
        self.seconds, self.nodes, self.edges = seconds, nodes, edges
        super().__init__(f"Graphviz did not finish laying out a graph of {nodes:,} nodes and {edges:,} edges "
                         f"within {seconds:g} s and was stopped")


def _dot_size(dot_text: str) -> tuple[int, int]:
    """``(nodes, edges)`` declared in DOT text written by :func:`graph_dot`."""
    return len(re.findall(r'^\s*"[^"]+" \[', dot_text, re.M)), dot_text.count(" -> ")


def render(dot_text: str, fmt: str = "svg", timeout: float | None = None) -> bytes | None:
    """Graphviz ``dot -T<fmt>`` of the DOT text, or None when Graphviz is not installed. Raises
    :class:`LayoutTimeout` when ``dot`` runs longer than ``timeout`` seconds (default :data:`RENDER_TIMEOUT`;
    it is stopped then)."""
    timeout = RENDER_TIMEOUT if timeout is None else timeout
    exe = shutil.which("dot")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, f"-T{fmt}"], input=dot_text.encode(), capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LayoutTimeout(timeout, *_dot_size(dot_text)) from None
    if r.returncode != 0:
        raise RuntimeError(f"Graphviz dot failed: {r.stderr.decode(errors='replace').strip()[:500]}")
    return r.stdout


def svg_inline(svg: bytes | str) -> str:
    """An SVG document as an element to put inside HTML (no XML prolog or DOCTYPE)."""
    text = svg.decode() if isinstance(svg, bytes) else svg
    return text[text.index("<svg"):]


def to_dot(gm: fx.GraphModule, report=None, title="") -> str:
    """Every node and edge of ``gm`` as plain DOT (no clusters, folding or costs): for tools that read DOT."""
    col = colours(gm, report)
    lines = [f'digraph {_q(title or "graph")} {{', "  rankdir=TB; node [shape=box, style=filled, fontsize=10];"]
    for n in gm.graph.nodes:
        label = "\\n".join(_q(x)[1:-1] for x in (n.name, _short(n), _shape(n)))
        lines.append(f'  {_q(n.name)} [label="{label}", fillcolor="{col.get(n.name, PLAIN)}"];')
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            lines.append(f'  {_q(a.name)} -> {_q(n.name)};')
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_svg(gm: fx.GraphModule, report=None, title="", show_params=False) -> str:
    """The graph as SVG without Graphviz: one row per topological generation, straight edges. Parameters
    (``get_attr``) are left out unless ``show_params``: they all sit in the first generation."""
    g = to_networkx(gm)
    if not show_params:
        g.remove_nodes_from([n.name for n in gm.graph.nodes if n.op == "get_attr"])
    col = colours(gm, report)
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {name: i for i, name in enumerate(nodes)}
    pos, width = {}, 0
    w, h, gap_x, gap_y = 150, 44, 14, 30
    for row, layer in enumerate(nx.topological_generations(g)):
        for i, name in enumerate(sorted(layer, key=lambda x: order.get(x, 0))):
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
        n = nodes[name]
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="4" fill="{col.get(name, PLAIN)}" '
                   f'stroke="#555"/>')
        for i, line in enumerate((n.name, _short(n), _shape(n))):
            out.append(f'<text x="{x + 4}" y="{y + 12 + 11 * i}">{html.escape(line[:26])}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


@dataclass
class Drawing:
    """A picture of a graph: its DOT text, its SVG and what laid the SVG out. ``layout`` is ``"Graphviz"`` or
    ``"built-in layout"`` (every node in rows: no module clusters, folded layers or costs); ``timed_out`` is
    the :class:`LayoutTimeout` that made Graphviz give way, None when it did not."""

    dot: str
    svg: str
    layout: str
    timed_out: LayoutTimeout | None = None


def draw(gm, report=None, costs=None, title="", timeout: float | None = None, **kw) -> Drawing:
    """The DOT of :func:`graph_dot` (``kw`` are its options) laid out by Graphviz within ``timeout`` seconds
    (default :data:`RENDER_TIMEOUT`); the built-in SVG when Graphviz is not installed or runs out of time."""
    dot = graph_dot(gm, report, costs, title, **kw)
    try:
        svg = render(dot, timeout=RENDER_TIMEOUT if timeout is None else timeout)
    except LayoutTimeout as e:
        return Drawing(dot, to_svg(gm, report, title, kw.get("show_params", False)), "built-in layout", e)
    if svg is None:
        return Drawing(dot, to_svg(gm, report, title, kw.get("show_params", False)), "built-in layout")
    return Drawing(dot, svg.decode(), "Graphviz")


def picture(gm, report=None, costs=None, title="", **kw) -> tuple[str, str]:
    """``(dot_text, svg_text)`` of :func:`draw`; when Graphviz runs out of time a line on stderr says so and what
    to do."""
    d = draw(gm, report, costs, title, **kw)
    if d.timed_out is not None:
        print(f"autofuse: {title or 'graph'}: {d.timed_out}; the SVG uses the built-in layout instead (every node "
              f"in rows, without module clusters, folded layers or costs). Render the DOT text with `dot -Tsvg`, "
              f"which has no time limit" + ("; without expand_all identical layers are folded" if kw.get("expand_all")
                                            else ""), file=sys.stderr)
    return d.dot, d.svg


# ---------------------------------------------------------------------------------------------- Model Explorer

def _namespace(path: tuple) -> str:
    parts = []
    for p in path:
        if p.isdigit() and parts:
            parts[-1] = f"{parts[-1]}.{p}"
        else:
            parts.append(p)
    return "/".join(parts)


def _me_output_read(n: fx.Node, a: fx.Node) -> int:
    """Which output of ``a`` node ``n`` reads: a ``getitem``'s index of the tuple it takes apart, else output 0."""
    if n.op == "call_function" and n.target is operator.getitem and n.args[0] is a and isinstance(n.args[1], int):
        return n.args[1]
    return 0


def _multi(n: fx.Node) -> bool:
    """A node whose value is a tuple (its outputs are taken apart by ``getitem``)."""
    return isinstance(n.meta.get("val"), (tuple, list)) or \
        any(u.op == "call_function" and u.target is operator.getitem for u in n.users)


def _me_outputs(n: fx.Node) -> dict:
    """Output index -> value (a tensor, or None where nothing records it) of every output ``n`` has or its readers
    read: a tuple-valued call without metadata (a fused call) is known by its ``getitem`` readers' values."""
    v = n.meta.get("val")
    outs = dict(enumerate(v)) if isinstance(v, (tuple, list)) else {0: v} if v is not None else {}
    for u in n.users:
        i = _me_output_read(u, n)
        if outs.get(i) is None:
            outs[i] = u.meta.get("val") if u.op == "call_function" and u.target is operator.getitem else None
    read = {_me_output_read(u, n) for u in n.users}
    return {i: x for i, x in outs.items() if isinstance(x, torch.Tensor) or i in read} if n.op != "output" else {}


def _me_graph(gm: fx.GraphModule, graph_id: str, report, costs: dict, before_paths=None) -> dict:
    paths = hierarchy.module_paths(gm, before=before_paths)
    classes = hierarchy.module_classes(gm)
    cand = candidate_of(report)
    nodes, groups = [], {}
    for n in gm.graph.nodes:
        ns = _namespace(paths.get(n.name, ()))
        d = cand.get(n.name)
        if d is not None:
            group = f"{d.pattern} (fused)" if d.applied else f"{d.pattern} (not fused: {d.reason_code})"
            ns = f"{ns}/{group}" if ns else group
            groups[ns] = {"anchor": d.anchor, "reason": d.reason, "cycles unfused": f"{d.cycles_unfused:,}",
                          "cycles fused": d.shown()["cycles_fused"], "speed-up": d.shown()["speedup"]}
        if n.op == "placeholder":
            ns = "inputs"
        attrs = [{"key": "op", "value": target_name(n)}, {"key": "node", "value": n.name}]
        for i, a in enumerate(n.args):
            if not isinstance(a, fx.Node):
                attrs.append({"key": f"arg{i}", "value": str(fx.map_arg(a, lambda x: x.name))[:200]})
        for k, a in n.kwargs.items():
            attrs.append({"key": k, "value": str(fx.map_arg(a, lambda x: x.name))[:200]})
        c = costs.get(n.name)
        if c is not None and c.part_of:
            attrs += [{"key": "cycles", "value": f"priced with {c.part_of}"}]
        elif c is not None:
            attrs += [{"key": "cycles", "value": f"{c.cycles:,} ({c.source})"},
                      {"key": "HBM bytes", "value": f"{c.hbm_bytes:,}"}, {"key": "bound", "value": c.bound},
                      {"key": "kernels", "value": ", ".join(c.kernels)}]
        match = hierarchy.fused_match(n)
        if match is not None:
            replaced = ", ".join(hierarchy.fused_block(n)[1])
            part = hierarchy.fused_part_of(n)
            attrs.append({"key": "fused", "value": f"{match.pattern}: " + (
                f"part of {part}'s block, which replaces {replaced}" if part else f"replaces {replaced}")})
        outs = []
        for i, x in sorted(_me_outputs(n).items()):
            tag = [{"key": "__tensor_tag", "value": n.name if i == 0 and not _multi(n) else f"{n.name}[{i}]"}]
            shape = [{"key": "tensor_shape", "value": str(x.dtype).replace("torch.", "") + str(list(x.shape))}] \
                if isinstance(x, torch.Tensor) else []
            outs.append({"id": str(i), "attrs": shape + tag})
        edges = [{"sourceNodeId": a.name, "sourceNodeOutputId": str(_me_output_read(n, a)), "targetNodeInputId": str(i)}
                 for i, a in enumerate(n.all_input_nodes)]
        ins = [{"id": str(i), "attrs": [{"key": "__tensor_tag", "value": a.name}]}
               for i, a in enumerate(n.all_input_nodes)]
        nodes.append({"id": n.name, "label": "output" if n.op == "output" else n.name if n.op in (
            "placeholder", "get_attr") else _short(n), "namespace": ns, "attrs": attrs, "incomingEdges": edges,
                      "outputsMetadata": outs, "inputsMetadata": ins})
    group_attrs = {"": {"graph": graph_id, "device": report.device if report is not None else "",
                        "nodes": str(len(nodes))}}
    for path, cls in classes.items():
        group_attrs.setdefault(_namespace(path), {})["class"] = cls
    group_attrs.update(groups)
    configs = []
    for fam in sorted({d.pattern for d in cand.values()}):
        configs.append({"namespaceRegex": f".*{re.escape(fam)} \\(fused\\)$",
                        "backgroundColor": _tint(family_colour(fam), 0.75), "borderColor": family_colour(fam)})
        configs.append({"namespaceRegex": f".*{re.escape(fam)} \\(not fused.*\\)$",
                        "backgroundColor": "#fff3e0", "borderColor": REJECTED_EDGE})
    graph = {"id": graph_id, "nodes": nodes, "groupNodeAttributes": group_attrs}
    if configs:
        graph["groupNodeConfigs"] = configs
    return graph


def model_explorer(before: fx.GraphModule, after: fx.GraphModule, report, before_costs: dict, after_costs: dict,
                   label: str = "autofuse") -> dict:
    """The fused graph (id ``"fused"``) and the original (``"original"``) as a Model Explorer
    ``GraphCollection`` (see the module docstring); ``json.dump`` it to a ``.json`` file."""
    paths = hierarchy.module_paths(before)
    return {"label": label, "graphs": [_me_graph(after, "fused", None, after_costs, paths),
                                       _me_graph(before, "original", report, before_costs)]}


def model_explorer_node_data(before: fx.GraphModule, after: fx.GraphModule, report, before_costs: dict,
                             after_costs: dict) -> dict:
    """Overlay name -> Model Explorer ``ModelNodeData`` (``{graph id: {"results": {node id: {"value": v}},
    ...}}``) for ``cycles``, ``hbm_bytes``, ``bound`` and ``fused``."""
    gradient = [{"stop": 0, "bgColor": "#ffffff"}, {"stop": 1, "bgColor": "#d32f2f"}]
    cand = candidate_of(report)
    out = {"cycles": {}, "hbm_bytes": {}, "bound": {}, "fused": {}}
    for gid, gm, costs in (("fused", after, after_costs), ("original", before, before_costs)):
        out["cycles"][gid] = {"name": "cycles", "results": {k: {"value": c.cycles} for k, c in costs.items()},
                              "gradient": gradient}
        out["hbm_bytes"][gid] = {"name": "HBM bytes", "results": {k: {"value": c.hbm_bytes} for k, c in costs.items()},
                                 "gradient": gradient}
        out["bound"][gid] = {"name": "bound unit", "results": {k: {"value": c.bound} for k, c in costs.items()}}
        fused = {}
        for n in gm.graph.nodes:
            m = hierarchy.fused_match(n)
            d = cand.get(n.name) if gid == "original" else None
            if m is not None:
                fused[n.name] = {"value": f"fused {m.pattern}", "bgColor": family_colour(m.pattern)}
            elif d is not None:
                fused[n.name] = ({"value": f"fused {d.pattern}", "bgColor": _tint(family_colour(d.pattern), 0.5)}
                                 if d.applied else {"value": f"not fused: {d.reason_code}", "bgColor": REJECTED})
            elif n.name in costs:
                fused[n.name] = {"value": "not a candidate"}
        out["fused"][gid] = {"name": "fusion", "results": fused}
    return out
