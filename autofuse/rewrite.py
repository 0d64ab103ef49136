"""Rewrite: replace each matched block by one call of a fused op.

:func:`rewrite` works on a copy of the graph (parameters stay shared) and, per attention Match:

1. brings q, k, v to [B, N, S, D] (3-D "(BN)SD" inputs get a unit head dim, 2-D "SD" two unit dims);
2. builds the one mask the kernel takes from the match's mask terms: bool terms are AND-ed
   (True = attend); additive terms are scaled by the factor recorded at the softmax input and summed;
   with both kinds, the bool terms become ``-inf`` entries of the additive mask;
3. inserts ``op(q, k, v, mask, scale=..., causal=..., return_probs=...)`` (``op`` returns
   ``(out, probs)``, e.g. ``torch.ops.autofuse.flash_attention``), reshapes/casts ``out`` to the
   anchor's shape and dtype and redirects the anchor's uses; the same for ``probs`` if the
   probabilities are consumed outside the block;
4. re-sorts the graph topologically (a probabilities consumer may precede the anchor), removes dead
   code, lints and recompiles.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.passes.tools_common import legalize_graph

from autofuse.graph import call, copy_graph_module, shape, val
from autofuse.match import Match

aten = torch.ops.aten


def rewrite(gm: fx.GraphModule, matches: list[Match], op) -> fx.GraphModule:
    """A new GraphModule in which every match is one call of ``op``; ``gm`` is left untouched."""
    new = copy_graph_module(gm)
    g = new.graph
    nodes = {n.name: n for n in g.nodes}  # by original name; a replaced node maps to its replacement
    for m in matches:
        if m.pattern != "attention":
            raise ValueError(f"rewrite: no rewrite for pattern {m.pattern!r}")
        _rewrite_attention(g, nodes, m, op)
    g.eliminate_dead_code()
    new = legalize_graph(new)
    new.graph.lint()
    new.recompile()
    return new


def _to_4d(x: fx.Node) -> fx.Node:
    r = len(shape(x))
    if r == 3:
        return call(x.graph, aten.unsqueeze.default, x, 1)
    if r == 2:
        return call(x.graph, aten.reshape.default, x, [1, 1, *shape(x)])
    return x


def _mask(g, nodes, m: Match, rank: int):
    keep, add = None, None
    for role, kind, factor in m.params["mask_terms"]:
        t = nodes[m.inputs[role]]
        if rank == 3 and len(shape(t)) == 3:
            t = call(g, aten.unsqueeze.default, t, 1)
        if kind == "bool":
            keep = t if keep is None else call(g, aten.logical_and.default, keep, t)
        else:
            if factor != 1.0:
                t = call(g, aten.mul.Tensor, t, factor)
            add = t if add is None else call(g, aten.add.Tensor, add, t)
    if keep is not None and add is not None:
        return call(g, aten.where.ScalarOther, keep, add, float("-inf"))
    return keep if keep is not None else add


def _adapt(g, x: fx.Node, like: fx.Node) -> fx.Node:
    if shape(x) != shape(like):
        x = call(g, aten.reshape.default, x, list(shape(like)))
    if val(x).dtype != val(like).dtype:
        x = call(g, aten._to_copy.default, x, dtype=val(like).dtype)
    return x


def _rewrite_attention(g: fx.Graph, nodes: dict, m: Match, op):
    anchor, p = nodes[m.anchor], m.params
    rank = len(p["q_shape"])
    with g.inserting_before(anchor):
        q, k, v = (_to_4d(nodes[m.inputs[r]]) for r in ("q", "k", "v"))
        mask = _mask(g, nodes, m, rank)
        fused = g.call_function(op, (q, k, v, mask),
                                dict(scale=p["scale"], causal=p["causal"], return_probs=p["probs_used"]))
        fused.meta["autofuse_match"] = m
        out = g.call_function(operator.getitem, (fused, 0))
        _set_val(out, anchor, 4)
        out = _adapt(g, out, anchor)
        probs = None
        if p["probs_used"]:
            pn = nodes[p["probs_node"]]
            probs = g.call_function(operator.getitem, (fused, 1))
            _set_val(probs, pn, 4)
            probs = _adapt(g, probs, pn)
    block = [nodes[name] for name in m.nodes]      # before the anchor's entry points at its replacement
    anchor.replace_all_uses_with(out)
    nodes[m.anchor] = out
    if probs is not None:
        pn.replace_all_uses_with(probs)
        nodes[p["probs_node"]] = probs
    # erased here, not left to dead-code elimination, which keeps ops tagged nondeterministic (SDPA)
    for n in reversed(block):
        if n.graph is g and not n.users and n.op == "call_function":
            g.erase_node(n)


def _set_val(node: fx.Node, like: fx.Node, rank: int):
    """meta['val'] for the fused op's outputs: like's value viewed as rank-4 (the op's own layout)."""
    v = val(like)
    s = tuple(v.shape)
    s = (s[0], 1, *s[1:]) if len(s) == 3 else ((1, 1, *s) if len(s) == 2 else s)
    node.meta["val"] = v.new_empty(s)
