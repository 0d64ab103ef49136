"""Activation checkpoints kept in a fused plan.

A forward that checkpoints its layers (``torch.utils.checkpoint.checkpoint``, transformers'
``activation_checkpointing_enable()``) keeps only each checkpoint's inputs for the backward, which runs the
checkpointed function again to get the rest. Capture traces through a checkpoint as through a plain call, and
marks the nodes each checkpoint made (:data:`autofuse.graph.CHECKPOINT`). In a plan made with grad a generated
Vector region keeps to one checkpoint (a residual sum at the end of one layer and the next layer's norm are two
regions: fused as one, the layer boundary would keep two values where eager's checkpoints keep one), a fused call
belongs to the checkpoint of the value it gives (:func:`mark_fused_calls`), and :func:`runner` gives the plan's
graph as a call with grad runs it: each checkpoint's nodes, fused calls included, become one submodule that the
forward calls through torch's non-reentrant checkpoint, so its values are dropped after the forward and recomputed
in the backward, as in eager. The plan's graph itself (the report, the pictures, ``simulate``) stays whole; a call
without grad runs it directly. A simulated training step (:func:`autofuse.simulate.simulate_graph`) prices the
recomputation: the forward's kernels of the checkpointed ops again, as a phase of their own.
"""
from __future__ import annotations

import heapq
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from autofuse.graph import CHECKPOINT, checkpoint_of, get_attr_value, graph_module


class Checkpointed(torch.nn.Module):
    """The nodes of one checkpoint, run through ``torch.utils.checkpoint.checkpoint`` (non-reentrant, the random
    generators' state kept for the recomputation, as eager's checkpoint keeps it by default)."""

    def __init__(self, run: fx.GraphModule):
        super().__init__()
        self.run = run

    def forward(self, *args):
        return checkpoint(self.run.forward, *args, use_reentrant=False)


def mark_fused_calls(gm: fx.GraphModule, captured: fx.GraphModule) -> None:
    """Mark each fused call of ``gm`` (a plan's fused graph) and the nodes emitted with it with the checkpoint of the
    captured op whose value it gives (the block's anchor), as captured nodes are marked (:data:`CHECKPOINT`). A block
    may hold ops made outside the checkpoint of its anchor: an attention block builds its mask from ops the model
    runs before its layers' checkpoints; in that checkpoint its call is recomputed in the backward, its inputs
    kept."""
    by_name = {n.name: n for n in captured.graph.nodes}
    for n in gm.graph.nodes:
        block = n.meta.get("autofuse_block")
        if block is None:
            continue
        custom = {k: v for k, v in (n.meta.get("custom") or {}).items() if k != CHECKPOINT}
        anchor = by_name.get(block[0])
        if anchor is not None and checkpoint_of(anchor) is not None:
            custom[CHECKPOINT] = checkpoint_of(anchor)
        n.meta["custom"] = custom
    # an op made after capture for fused calls (an op of the canonical form rebuilt ahead of a kernel, a cast of one
    # kernel's output for the next) has no mark of its own: it runs where its readers do, where they are in one
    # checkpoint (last reader first, so a chain of such ops follows)
    for n in reversed(gm.graph.nodes):
        made = n.op == "call_function" and n.name not in by_name and "autofuse_block" not in n.meta
        if not made or checkpoint_of(n) is not None:
            continue
        marks = {checkpoint_of(u) for u in n.users}
        if len(marks) == 1 and None not in marks:
            n.meta["custom"] = {**(n.meta.get("custom") or {}), CHECKPOINT: marks.pop()}


def _impure(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def _random(n: fx.Node) -> bool:
    """A draw from a random generator: a seeded op, or a fused call that draws (a dropout it replaces: its keep-mask
    drawn by ``dropout_gen_mask``, or a fused op that draws itself)."""
    t = n.target
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags:
        return True
    match = n.meta.get("autofuse_match")
    return match is not None and bool(match.params.get("draws") or match.params.get("dropout_p"))


def _grouped(gm: fx.GraphModule, marks: dict) -> list:
    """``gm``'s nodes in an order that runs each checkpoint's nodes together wherever the graph allows: the order
    of capture interleaves them with ops outside every checkpoint (the masks a model builds before its layers, put
    where their first reader was traced), and each break would make one more checkpointed call, whose inputs are
    kept. The nodes of the open checkpoint go first, then ops outside any, then the earliest ready node opens the
    next; draws from random generators and in-place updates keep their order among themselves, so the numbers each
    draw gets and what each update sees are eager's. A graph that updates a tensor in place keeps its order."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    if any(_impure(n) for n in nodes):
        return list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    deps = {n: set(n.all_input_nodes) for n in nodes}
    last = None
    for n in nodes:
        if _random(n):
            if last is not None:
                deps[n].add(last)
            last = n
    users: dict = {n: [] for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    waiting = {n: len(ds) for n, ds in deps.items()}
    outside, inside, first = [], {}, []       # ready nodes: outside any checkpoint, by checkpoint, all by position

    def ready(n):
        m = marks[n]
        heapq.heappush(outside if m is None else inside.setdefault(m, []), (pos[n], n.name))
        if m is not None:
            heapq.heappush(first, (pos[n], m))

    by_name = {n.name: n for n in nodes}
    for n in nodes:
        if not waiting[n]:
            ready(n)
    order, current = [], None
    while len(order) < len(nodes):
        if current is not None and inside.get(current):
            _, name = heapq.heappop(inside[current])
        elif outside:
            _, name = heapq.heappop(outside)
        else:
            while not inside.get(first[0][1]):
                heapq.heappop(first)          # a checkpoint whose ready nodes have all run since
            current = first[0][1]
            continue
        n = by_name[name]
        order.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if not waiting[u]:
                ready(u)
    return order + [gm.graph.output_node()]


def runner(gm: fx.GraphModule) -> fx.GraphModule | None:
    """``gm`` (a plan's fused graph) with each checkpoint's consecutive nodes called through :class:`Checkpointed`;
    None where it has none. Parameters and buffers are read in the returned graph, as in ``gm``, and handed to the
    checkpointed parts as inputs (nothing of the model is copied into them). A part that updates a tensor in
    place is left as it is: running it again would update it twice."""
    marks = {n: checkpoint_of(n) if n.op == "call_function" else None for n in gm.graph.nodes}
    if not any(m is not None for m in marks.values()):
        return None
    g = fx.Graph()
    env: dict = {}
    parts: dict = {}
    run: list = []

    def copy(n):
        env[n] = g.node_copy(n, env.__getitem__)

    def flush():
        if not run:
            return
        nodes, inside = list(run), set(run)
        run.clear()
        outs = [n for n in nodes if any(u not in inside for u in n.users)]
        if any(_impure(n) for n in nodes) or not outs:
            for n in nodes:
                copy(n)
            return
        ins = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
        sub = fx.Graph()
        local = {a: sub.placeholder(a.name) for a in ins}
        for n in nodes:
            local[n] = sub.node_copy(n, local.__getitem__)
        sub.output(tuple(local[o] for o in outs))
        name = f"autofuse_checkpoint_{len(parts)}"
        parts[name] = Checkpointed(graph_module(torch.nn.Module(), sub))
        call = g.call_module(name, tuple(env[a] for a in ins))
        for i, o in enumerate(outs):
            env[o] = g.call_function(operator.getitem, (call, i))

    for n in _grouped(gm, marks):
        m = marks[n]
        if m is not None and run and marks[run[0]] != m:
            flush()
        if m is not None:
            run.append(n)
        elif n.op in ("placeholder", "get_attr"):
            copy(n)            # read where the graph reads it; a part takes it as an input
        else:
            flush()
            copy(n)
    attrs = {n.target: get_attr_value(gm, n.target) for n in g.nodes if n.op == "get_attr"}
    out = graph_module({**attrs, **parts}, g)
    out.meta.update(gm.meta)
    return out
