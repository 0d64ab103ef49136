"""Patterns as small networkx templates, matched by subgraph monomorphism.

A :class:`Template` declares a pattern once: its nodes (each a predicate: the aten targets it may be, plus an
optional named check), its edges (``src -> dst`` means ``dst`` reads ``src``, at argument position ``arg`` or,
for commutative inputs, at any position), which nodes are optional, and *chains* (up to ``n`` interchangeable
ops on the path between two nodes, e.g. the casts, scales and masks between Q·Kᵀ and the softmax). The
variants — every choice of optional nodes and every chain length — are generated from that one declaration:
an optional node left out is bypassed (its input feeds its consumer directly).

Matching (:meth:`Template.match`) runs over the networkx view of a graph (:func:`graph_view`):

1. *seeds*: the view's nodes the anchor's predicate accepts;
2. *neighbourhood*: from each seed, the host nodes a typed walk reaches along the template's edges (a host
   node playing template node t steps to the neighbours, in the edge's direction, that t's neighbour in the
   template accepts); nothing else can take part in a match at this seed;
3. for each variant, largest first, ``networkx.algorithms.isomorphism.DiGraphMatcher(neighbourhood, variant)``
   enumerates monomorphisms with the anchor pinned to the seed (node predicates, edge argument positions);
4. the family's *constraint* function decides each mapping (shapes, dims, semantics) and builds the
   :class:`~autofuse.match.Match`; the first accepted mapping of a seed wins.

Monomorphism lets the host graph have more edges than the template among the matched nodes (a mask read
by an ``add`` is a side input, not a template node). Limits: VF2 is exponential in the worst case; the typed
neighbourhood keeps the host side to the block around the seed (tens of nodes), and variants are tried
largest first, so a block is matched by the most specific spelling that fits.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import networkx as nx
import torch.fx as fx
from networkx.algorithms.isomorphism import DiGraphMatcher


@dataclass(frozen=True)
class Pred:
    """A template node: the targets it accepts (empty = any call) and an extra named check on the fx node."""

    name: str
    targets: frozenset = frozenset()
    where: Callable | None = None
    optional: bool | str = False      # True, or the name of an optional group kept or left out together
    chain: str | None = None          # the chain this node belongs to (its position is in ``name``)

    def accepts(self, n: fx.Node) -> bool:
        if n.op != "call_function" and (self.targets or self.where is None):
            return False
        if self.targets and n.target not in self.targets:
            return False
        return self.where is None or bool(self.where(n))


@dataclass
class Template:
    """One pattern family's structure (see the module docstring)."""

    name: str
    anchor: str
    nodes: dict = field(default_factory=dict)
    edges: list = field(default_factory=list)          # (src, dst, arg)
    chains: dict = field(default_factory=dict)         # chain name -> (member names in order, src, dst, arg)
    _variants: list | None = None

    # ----------------------------------------------------------------------------------- declaration
    def node(self, name: str, *targets, where: Callable | None = None, optional: bool | str = False) -> "Template":
        """``optional``: True (this node alone may be left out) or a group name (the nodes of a group are kept or
        left out together: an optional sub-block)."""
        self.nodes[name] = Pred(name, frozenset(targets), where, optional)
        self._variants = None
        return self

    def edge(self, src: str, dst: str, arg: int | None = None) -> "Template":
        self.edges.append((src, dst, arg))
        self._variants = None
        return self

    def chain(self, name: str, targets, src: str, dst: str, max_len: int, where: Callable | None = None,
              arg: int | None = None) -> "Template":
        """Up to ``max_len`` nodes, each one of ``targets`` (and ``where``), on the path ``src -> ... -> dst``;
        ``dst`` reads the last at argument position ``arg`` (each member reads the one before at any position)."""
        members = [f"{name}{i}" for i in range(max_len)]
        for m in members:
            self.nodes[m] = Pred(m, frozenset(targets), where, True, name)
        self.chains[name] = (members, src, dst, arg)
        self._variants = None
        return self

    # -------------------------------------------------------------------------------------- variants
    def variants(self) -> list:
        """Every variant as a ``networkx.DiGraph`` (node attribute ``pred``, edge attribute ``arg``), largest first:
        each subset of the optional nodes and each length of each chain, the left-out nodes bypassed."""
        if self._variants is not None:
            return self._variants
        edges = nx.DiGraph()
        for members, src, dst, arg in self.chains.values():
            path = [src] + members + [dst]
            for a, b in zip(path, path[1:]):
                edges.add_edge(a, b, arg=arg if b == dst else None)
        for src, dst, arg in self.edges:
            edges.add_edge(src, dst, arg=arg)
        # nodes in breadth-first order from the anchor: VF2 extends its mapping in node order, so it starts at
        # the pinned anchor and grows along the template's edges (a seeded search), never from a loose end
        order = list(nx.bfs_tree(edges.to_undirected(), self.anchor)) if self.anchor in edges else [self.anchor]
        order += [n for n in self.nodes if n not in order]
        full = nx.DiGraph()
        for n in order:
            full.add_node(n, pred=self.nodes[n])
        full.add_edges_from(edges.edges(data=True))
        units: dict = {}              # an optional node alone, or an optional group: kept or left out as one
        for n, p in self.nodes.items():
            if p.optional and p.chain is None:
                units.setdefault(n if p.optional is True else p.optional, []).append(n)
        lengths = [range(len(m) + 1) for m, _, _, _ in self.chains.values()]
        out = []
        for keep in itertools.product((True, False), repeat=len(units)):
            for ks in itertools.product(*lengths):
                drop = [n for unit, k in zip(units.values(), keep) if not k for n in unit]
                for (members, _, _, _), k in zip(self.chains.values(), ks):
                    drop += list(reversed(members[k:]))
                out.append(_without(full, drop))
        out.sort(key=lambda g: (-g.number_of_nodes(), -g.number_of_edges()))
        self._variants = out
        return out

    @property
    def radius(self) -> int:
        """Undirected distance from the anchor to the farthest node of the largest variant."""
        g = self.variants()[0].to_undirected()
        return max(nx.single_source_shortest_path_length(g, self.anchor).values())

    # -------------------------------------------------------------------------------------- matching
    def match(self, view: "GraphView", decide: Callable, seeds=None) -> list:
        """``decide(mapping: name -> fx.Node) -> Match | None`` on each monomorphism; the first accepted per
        seed, seeds in graph order. Returns the accepted results."""
        anchor = self.nodes[self.anchor]
        variants = self.variants()
        out = []
        for seed in (seeds if seeds is not None else view.seeds(anchor)):
            lengths = self._chain_lengths(view, seed)
            done = False
            for g in variants:
                if not self._fits(g, lengths):
                    continue
                host = view.neighbourhood(seed, self.anchor, g, _walk(g, self.anchor))
                if host is None:
                    continue
                gm = DiGraphMatcher(host, g, node_match=_node_match(seed, self.anchor),
                                    edge_match=_edge_match)
                for m in gm.subgraph_monomorphisms_iter():
                    mapping = {t: view.fx[h] for h, t in m.items()}
                    res = decide(mapping)
                    if res is not None:
                        out.append(res)
                        done = True
                        break
                if done:
                    break
        return out

    def _chain_lengths(self, view, seed) -> dict:
        """For each chain that starts or ends at the anchor: the lengths a host path from the seed allows (through
        nodes the members accept, ending at a node the far end accepts); None where not known. A variant whose
        chain length is not among them cannot match and is not tried."""
        out = {}
        for name, (members, src, dst, _) in self.chains.items():
            if self.anchor not in (src, dst):
                out[name] = None
                continue
            up = dst == self.anchor
            member, end = self.nodes[members[0]], self.nodes[src if up else dst]
            ok, frontier = set(), {seed}
            for k in range(len(members) + 1):
                nxt = set()
                for h in frontier:
                    for nb in (view.g.predecessors(h) if up else view.g.successors(h)):
                        n = view.fx[nb]
                        if end.accepts(n):
                            ok.add(k)
                        if k < len(members) and member.accepts(n):
                            nxt.add(nb)
                frontier = nxt
            out[name] = ok
        return out

    def _fits(self, g, lengths) -> bool:
        for name, allowed in lengths.items():
            if allowed is not None and sum(1 for m in self.chains[name][0] if m in g) not in allowed:
                return False
        return True

    # ------------------------------------------------------------------------------------------ draw
    def to_dot(self) -> str:
        """The largest variant as Graphviz DOT (optional nodes dashed, chains grey, the anchor bold)."""
        g = self.variants()[0]
        lines = [f'digraph "{self.name}" {{', "  rankdir=TB; node [shape=box, fontname=Helvetica, fontsize=10];"]
        for n, d in g.nodes(data=True):
            p = d["pred"]
            label = "|".join(sorted(_short(t) for t in p.targets)) or "any"
            if p.where is not None:
                label += f"\\n[{getattr(p.where, '__name__', 'check')}]"
            style = ["bold"] if n == self.anchor else []
            if p.optional:
                style.append("dashed")
            colour = ', color=grey50' if p.chain else ''
            lines.append(f'  "{n}" [label="{n}\\n{label}", style="{",".join(style) or "solid"}"{colour}];')
        for a, b, d in g.edges(data=True):
            lab = "" if d["arg"] is None else f' [label="arg {d["arg"]}"]'
            lines.append(f'  "{a}" -> "{b}"{lab};')
        lines.append("}")
        return "\n".join(lines)


def _without(full: nx.DiGraph, drop) -> nx.DiGraph:
    """``full`` with the nodes ``drop`` removed in order, each bypassed: its inputs feed its consumers directly,
    at the argument positions it was read at."""
    g = full.copy()
    for o in drop:
        for p in list(g.predecessors(o)):
            for s_, d in g.succ[o].items():
                if not g.has_edge(p, s_):
                    g.add_edge(p, s_, arg=d["arg"])
        g.remove_node(o)
    return g


def _walk(g: nx.DiGraph, anchor: str) -> list:
    """``g``'s edges as steps away from ``anchor`` in breadth-first order: ``(known end, new end, forward)``
    where ``forward`` means the host edge runs from the known end to the new one."""
    steps = g.graph.get("_walk")
    if steps is None:
        steps, seen = [], {anchor}
        for a, b in nx.bfs_edges(g.to_undirected(as_view=True), anchor):
            steps.append((a, b, g.has_edge(a, b)))
            seen.add(b)
        g.graph["_walk"] = steps
    return steps


def _short(t) -> str:
    return getattr(t, "_opname", None) or getattr(t, "__name__", str(t))


def _node_match(seed, anchor):
    def match(h, t):
        if t["pred"].name == anchor:
            return h["name"] == seed
        return t["pred"].accepts(h["node"])
    return match


def _edge_match(h, t):
    return t["arg"] is None or t["arg"] in h["args"]


class GraphView:
    """A networkx view of an fx graph for matching: one node per fx node (attribute ``node``), an edge
    ``u -> v`` per value ``v`` reads, with the argument positions it is read at (``args``)."""

    def __init__(self, gm: fx.GraphModule):
        self.g = nx.DiGraph()
        self.fx = {}
        for n in gm.graph.nodes:
            self.g.add_node(n.name, node=n, name=n.name)
            self.fx[n.name] = n
        for n in gm.graph.nodes:
            for i, a in enumerate(_flat_args(n)):
                if isinstance(a, fx.Node):
                    if self.g.has_edge(a.name, n.name):
                        self.g.edges[a.name, n.name]["args"].add(i)
                    else:
                        self.g.add_edge(a.name, n.name, args={i})
        self.order = {n.name: i for i, n in enumerate(gm.graph.nodes)}

    def seeds(self, pred: Pred) -> list:
        return [name for name, d in self.g.nodes(data=True) if pred.accepts(d["node"])]

    def neighbourhood(self, seed: str, anchor: str, g: nx.DiGraph, steps) -> nx.DiGraph | None:
        """The host nodes a typed walk reaches from ``seed`` playing ``anchor`` in the variant ``g``: along its
        edges in breadth-first order away from the anchor (``steps``: ``(t, u, forward)``), from the host nodes
        that may play t to their neighbours in that direction that u accepts. Induced subgraph, or None when
        some template node has no candidate: only those nodes can take part in a match at this seed."""
        cands = {anchor: {seed}}
        for t, u, forward in steps:
            pred = g.nodes[u]["pred"]
            got = cands.setdefault(u, set())
            for h in cands.get(t, ()):
                for nb in (self.g.successors(h) if forward else self.g.predecessors(h)):
                    if pred.accepts(self.fx[nb]):
                        got.add(nb)
            if not got:
                return None
        return self.g.subgraph(set().union(*cands.values())).copy()


def _flat_args(n: fx.Node) -> list:
    """The node's positional arguments, lists flattened in place (``cat([a, b])`` reads a at 0, b at 1), then
    its keyword arguments in order."""
    out = []
    for a in list(n.args) + list(n.kwargs.values()):
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def graph_view(gm: fx.GraphModule) -> GraphView:
    """The view of ``gm``, built once per graph module and kept on it."""
    v = gm.__dict__.get("_autofuse_view")
    if v is None or v.g.number_of_nodes() != len(gm.graph.nodes):
        v = GraphView(gm)
        gm.__dict__["_autofuse_view"] = v
    return v


__all__ = ["GraphView", "Pred", "Template", "graph_view"]
