"""Rewrite: the captured graph, with each applied match replaced by one fused call, and nothing else changed.

Matches are found on the canonical view (:mod:`autofuse.canonicalize`); what runs is the captured graph.
Every canonical node that computes a captured node's value names it in ``meta["autofuse_origin"]``, and
that is how a match is carried over (:func:`lift`):

1. **Outputs.** Each output role of the match (``Match.outputs``) is mapped to the captured node whose
   value it computes: the canonical node's origin, or, for a node the canonical form introduced (a matmul
   moved inside a reshape), the first node with an origin down a chain of views; those views are
   re-emitted after the fused call. A captured output that is only read by a ``clone`` (an inactive
   dropout, a ``.contiguous()`` of a contiguous value) is replaced together with its copy: the fused call's
   fresh result takes the copy's place.
2. **Inputs.** Each input role is the captured node of the same value, or, when the canonical form made
   that value (a ``logical_not`` of a mask, a ``reciprocal`` of a 0-d divisor, a reshape), it is rebuilt
   from captured nodes: the fused call's *preamble*, a few cheap ops, priced with the fused call.
3. **Footprint.** The captured nodes that only fed the replaced outputs (and are not inputs of the fused
   call) become dead when the outputs are redirected: those are the nodes the fusion removes, what the
   unfused side is priced on, and what verification compares the fused call against.

:func:`rewrite` then copies the captured graph, inserts each fused call (built by its family's emitter,
:mod:`autofuse.fused`), redirects the outputs' uses, erases the footprints, re-sorts topologically, lints
and recompiles. Every node outside the footprints is the captured node, unchanged.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.passes.tools_common import legalize_graph

from autofuse.graph import ancestors, copy_graph_module, graph_module, size_checks
from autofuse.match import Match

aten = torch.ops.aten

#: Canonical-only ops that may be rebuilt in front of a fused call (cheap, pure, no reduction over data).
PREAMBLE_OPS = {
    aten.reshape.default, aten.view.default, aten.permute.default, aten.transpose.int, aten.unsqueeze.default,
    aten.squeeze.dim, aten.expand.default, aten.logical_not.default, aten.logical_and.default,
    aten.reciprocal.default, aten.mul.Tensor, aten._to_copy.default, aten.repeat_interleave.self_int,
    aten.eq.Scalar, aten.ne.Scalar, aten.eq.Tensor, aten.ne.Tensor, aten.slice.Tensor, aten.select.int,
}
PREAMBLE_LIMIT = 16
#: Views that may follow a fused output before the node whose value the captured graph holds.
OUTPUT_VIEWS = {aten.reshape.default, aten.view.default, aten.permute.default, aten.transpose.int,
                aten.unsqueeze.default, aten.squeeze.dim, aten._to_copy.default}


class NotLiftable(ValueError):
    """A match whose inputs or outputs have no counterpart in the captured graph (the reason names it)."""


@dataclass(frozen=True)
class Lifted:
    """A match carried over to the captured graph (see the module docstring)."""

    match: Match
    sources: dict            # input role -> canonical node, or a constant's spec ("const:...")
    targets: dict            # output role -> (captured node name, canonical view nodes to re-emit)
    preamble: tuple          # canonical nodes rebuilt in front of the fused call, in graph order
    reads: tuple             # captured node names the fused call reads (inputs and preamble leaves)
    footprint: tuple         # captured node names the fusion removes, in graph order (targets included)
    computes: str = ""       # the captured node the first output computes (its target, or what it copies)
    kept: tuple = ()         # captured nodes the block computes that outside readers keep reading: they stay in
    #                          the graph, computed as captured, while the fused call recomputes them inside

    @property
    def anchor(self) -> str:
        return self.computes or next(iter(self.targets.values()))[0]


def origin(c: fx.Node) -> str | None:
    return c.meta.get("autofuse_origin") if isinstance(c, fx.Node) else None


def lift(match: Match, canonical: dict, captured: dict, order: dict) -> Lifted:
    """Map ``match`` (node names of the canonical graph, ``canonical`` = name -> node) onto the captured graph
    (``captured`` = name -> node, ``order`` = name -> position). Raises :class:`NotLiftable`."""
    targets, computes = {}, ""
    for role, name in match.outputs.items():
        o, views = _target(canonical[name], captured, role)
        targets[role] = (o if views else _through_copies(o, captured), views)
        computes = computes or o
    preamble, reads = [], []
    upstream = _ancestors(captured, [t for t, _ in targets.values()])

    def visit(c):
        o = _source(c, captured, upstream, order)
        if o is not None:
            if o not in reads:
                reads.append(o)
            return
        if c in preamble:
            return
        if c.op != "call_function" or c.target not in PREAMBLE_OPS:
            raise NotLiftable(f"it reads {c.name} ({c.target}), a value only the canonical form computes (a "
                              f"rewrite moved a scale or cast across the region's edge), which the captured graph "
                              f"does not hold")
        for a in c.all_input_nodes:
            visit(a)
        preamble.append(c)
        if len(preamble) > PREAMBLE_LIMIT:
            raise NotLiftable(f"rebuilding the inputs needs more than {PREAMBLE_LIMIT} ops")

    sources = {}
    for role, name in match.inputs.items():
        if isinstance(name, str) and name.startswith("const:"):
            sources[role] = name
            continue
        sources[role] = canonical[name]
        visit(canonical[name])
    out_names = {t for t, _ in targets.values()}
    if out_names & set(reads):
        raise NotLiftable("a fused output is also one of its inputs")
    fp = footprint(captured, order, out_names, set(reads), upstream)
    pos = {n: i for i, n in enumerate(canonical.values())}
    return Lifted(match, sources, targets, tuple(sorted(preamble, key=pos.__getitem__)), tuple(reads), fp, computes,
                  _kept(captured, order, upstream, set(reads), set(fp)))


def _kept(captured: dict, order: dict, upstream: set, reads: set, fp: set) -> tuple:
    """The nodes between the block's reads and its footprint that the footprint leaves out (read outside the
    block, so not removed): computed from a read or from another such node, and read by the footprint or by
    another such node, in graph order."""
    # such a node is reached from a read through nodes upstream and outside the footprint: mostly none, and then
    # the read's ancestors (the graph before the block) need not be walked
    reached, stack = set(), [captured[r] for r in reads]
    while stack:
        for u in stack.pop().users:
            if u.name in upstream and u.name not in fp and u.name not in reached:
                reached.add(u.name)
                stack.append(u)
    if not reached:
        return ()
    before = _ancestors(captured, reads) | reads
    down = set()
    for name in sorted(upstream - fp - before, key=order.__getitem__):
        n = captured[name]
        if n.op == "call_function" and any(a.name in reads or a.name in down for a in n.all_input_nodes):
            down.add(name)
    kept = set()
    for name in sorted(down, key=order.__getitem__, reverse=True):
        if any(u.name in fp or u.name in kept for u in captured[name].users):
            kept.add(name)
    return tuple(sorted(kept, key=order.__getitem__))


_COPY_FORMATS = (None, torch.contiguous_format, torch.preserve_format)


def _through_copies(name: str, captured: dict) -> str:
    """The captured node a fused output replaces, past copies that are its only reader (``clone``: an inactive
    dropout, a ``.contiguous()`` the canonical form dropped): the fused call writes its fresh, contiguous
    result where the copy would, and the copied value, which nothing else reads, dies with the block."""
    n = captured[name]
    while len(n.users) == 1:
        u = next(iter(n.users))
        if not (u.op == "call_function" and u.target == aten.clone.default and u.args[0] is n
                and u.kwargs.get("memory_format") in _COPY_FORMATS):
            break
        val = n.meta.get("val")
        if u.kwargs.get("memory_format") is torch.contiguous_format and not (
                isinstance(val, torch.Tensor) and val.is_contiguous()):
            # a .contiguous() that moves the value's memory (the reshape of a transposed value): the fused call lays
            # its output out as the value is laid out, and the copy, which a view after it relies on, stays
            break
        n = u
    return n.name


def _source(c: fx.Node, captured: dict, upstream, order: dict | None = None) -> str | None:
    """The captured node holding ``c``'s value: among its origin and the nodes merged into it
    (``meta["autofuse_equals"]``), the latest one upstream of the replaced block (the copy the block itself
    reads: layers that each rebuild the same mask read their own), else the origin."""
    names = [n for n in [origin(c)] + list(c.meta.get("autofuse_equals", ())) if n is not None and n in captured]
    near = [n for n in names if n in upstream]
    if near and order is not None:
        return max(near, key=order.__getitem__)
    return near[0] if near else (names[0] if names else None)


def _ancestors(captured: dict, names) -> set:
    """The names of the captured nodes the named ones are computed from."""
    return {a.name for a in ancestors(captured[n] for n in names)}


def _target(c: fx.Node, captured: dict, role: str):
    views = []
    for _ in range(6):
        o = origin(c)
        if o is not None and o in captured:
            return o, tuple(views)
        users = list(c.users)
        if len(users) != 1 or users[0].op != "call_function" or users[0].target not in OUTPUT_VIEWS \
                or users[0].args[0] is not c:
            break
        c = users[0]
        views.append(c)
    raise NotLiftable(f"its output {role!r} ({c.name}) is a value only the canonical form computes (a rewrite moved "
                      f"a scale or cast across the region's edge), which the captured graph does not hold")


def footprint(captured: dict, order: dict, targets: set, keep: set, anc: set | None = None) -> tuple:
    """Captured nodes that die when the ``targets`` are replaced and the ``keep`` nodes stay read: the
    targets, and every ancestor (``anc``, computed if not given) all of whose users die (pure calls only), with the
    checks of its data-dependent size (:func:`autofuse.graph.size_checks`) if those are its other readers."""
    anc = _ancestors(captured, targets) if anc is None else anc
    dead = set(targets)
    for name in sorted(anc - dead, key=order.__getitem__, reverse=True):
        n = captured[name]
        if name in keep or n.op != "call_function" or _impure(n):
            continue
        if n.users and all(u.name in dead for u in n.users):
            dead.add(name)
        elif "autofuse_data_sized" in n.meta and any(u.name in dead for u in n.users):
            checks = size_checks(n, {u for u in n.users if u.name in dead})
            if checks is not None:
                dead.update([name] + [c.name for c in checks])
    return tuple(sorted(dead, key=order.__getitem__))


def _random(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def moved_draw(lifted: Lifted, captured: dict, order: dict) -> str | None:
    """A block whose fused call draws random numbers (dropout) draws them where the call is inserted (before
    its first replaced node, or after its last input), not where the captured block drew them: the name of
    a random node outside the block that its draws would move past (changing which numbers each gets from
    the generator), or None."""
    drawn = [order[n] for n in lifted.footprint if _random(captured[n])]
    if not drawn:
        return None
    first = min(order[t] for t, _ in lifted.targets.values())
    last_read = max((order[r] for r in lifted.reads), default=-1)
    where = first if last_read < first else last_read + 1
    inside = set(lifted.footprint)
    for name, pos in order.items():
        if min(drawn) < pos < where and name not in inside and _random(captured[name]):
            return name
    return None


def _impure(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


# ------------------------------------------------------------------------------------------- emission

def build(g: fx.Graph, lifted: Lifted, env: dict, emit, kwargs: dict) -> dict:
    """Insert ``lifted``'s fused call into ``g``; ``env`` maps captured names to nodes of ``g``. Returns
    output role -> node of ``g`` holding the value of that role's captured target."""
    m = lifted.match
    memo: dict = {}

    def get(c):
        o = _source(c, env, lifted.reads)
        if o is not None:
            return env[o]
        if c not in memo:
            args, kw = fx.map_arg((c.args, c.kwargs), get)
            memo[c] = g.call_function(c.target, args, kw)
            memo[c].meta["val"] = c.meta.get("val")
        return memo[c]

    vals = [src.meta.get("val") for src in lifted.sources.values() if not isinstance(src, str)]
    fake = detect_fake_mode(vals)
    device = next((v.device for v in vals if isinstance(v, torch.Tensor)), None)
    ins = {role: _constant(g, src, fake, device) if isinstance(src, str) else get(src)
           for role, src in lifted.sources.items()}
    before = set(g.nodes)
    outs = emit(g, ins, m, kwargs)
    # every node the emitter made is the fusion's: the call it tagged (the lead, which the decision's price is
    # charged to) and the others (more launches, views of its outputs), each naming the lead; all of them name
    # their block as the captured graph (and the report) do
    emitted = [n for n in g.nodes if n not in before]
    lead = next((n for n in emitted if n.meta.get("autofuse_match") is m), None)
    for n in emitted:
        n.meta["autofuse_match"] = m
        n.meta["autofuse_block"] = (lifted.anchor, tuple(lifted.footprint))
        if lead is not None and n is not lead:
            n.meta["autofuse_part_of"] = lead.name
    result = {}
    for role, (target, views) in lifted.targets.items():
        x = outs[role]
        for view in views:
            args = (x,) + tuple(fx.map_arg(view.args[1:], get))
            x = g.call_function(view.target, args, dict(view.kwargs))
            x.meta["val"] = view.meta.get("val")
        result[role] = x
    return result


def _constant(g: fx.Graph, spec: str, fake_mode, device=None) -> fx.Node:
    """A constant the rewrite builds, on the block's device (``device``: its other inputs'; a model planned on meta
    tensors gets a meta constant, which the block's other meta values combine with)."""
    kind, *dims = spec.split(":")[1:]
    if kind != "tril":
        raise NotLiftable(f"unknown constant {spec!r}")
    sq, skv = (int(d) for d in dims)
    where = {} if device is None else {"device": device}
    ones = g.call_function(aten.ones.default, ([sq, skv],), {"dtype": torch.bool, **where})
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        v = torch.empty(sq, skv, dtype=torch.bool, **where)
    ones.meta["val"] = v
    tril = g.call_function(aten.tril.default, (ones,))
    tril.meta["val"] = v
    return tril


def rewrite(captured: fx.GraphModule, lifts: list, emit_for, kwargs_for=lambda lifted: {}) -> fx.GraphModule:
    """A new GraphModule: ``captured`` with every lift's fused call in place of its footprint.

    ``emit_for(match) -> emit(g, inputs, match, kwargs) -> {role: node}`` builds a family's fused call;
    ``kwargs_for(lifted)`` gives the op's extra keywords (device, tiling). ``captured`` is left untouched;
    parameters and buffers stay the model's own."""
    new = copy_graph_module(captured)
    g = new.graph
    env = {n.name: n for n in g.nodes}
    reorder = False
    for lifted in lifts:
        pos = _position(g)
        first = min((env[t] for t, _ in lifted.targets.values()), key=pos)
        last_read = max((env[r] for r in lifted.reads), key=pos, default=None)
        # right before the first replaced node, unless an input comes later (then sort the graph afterwards)
        where = first if last_read is None or pos(last_read) < pos(first) else last_read.next
        reorder = reorder or where is not first
        with g.inserting_before(where):
            outs = build(g, lifted, env, emit_for(lifted.match), kwargs_for(lifted))
        replaced = {}
        for role, (target, _) in lifted.targets.items():
            env[target].replace_all_uses_with(outs[role])
            replaced[target] = outs[role]
        # erased here, not left to dead-code elimination, which keeps ops tagged nondeterministic (SDPA)
        for name in reversed(lifted.footprint):
            n = env[name]
            if not n.users:
                g.erase_node(n)
        env.update(replaced)            # a later block reading a replaced value reads the fused output
    if reorder:
        new = legalize_graph(new)
    new.graph.lint()
    new.recompile()
    return new


def _position(g):
    pos = {n: i for i, n in enumerate(g.nodes)}
    return pos.__getitem__


# ------------------------------------------------------------------------------------- verification

def extract(gm: fx.GraphModule, names, outputs, inputs=()) -> tuple[fx.GraphModule, list[fx.Node]]:
    """A GraphModule computing ``outputs`` from the nodes ``names`` of ``gm``; its placeholders are the
    values flowing in, parameters and buffers included (``inputs`` first, in that order, then the others
    as met). Returns it and the outside nodes, in placeholder order."""
    nodes = {n.name: n for n in gm.graph.nodes}
    inside = {nodes[n] for n in names}
    inside |= _interior(gm, inside)
    g = fx.Graph()
    env, external = {}, []

    def bring(a):
        if a not in env:
            env[a] = g.placeholder(a.name)
            env[a].meta = dict(a.meta)
            external.append(a)

    for name in inputs:
        if nodes[name] not in inside:
            bring(nodes[name])
    for n in gm.graph.nodes:
        if n not in inside:
            continue
        for a in n.all_input_nodes:
            if a not in inside:
                bring(a)
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[nodes[o]] for o in outputs))
    return graph_module(gm, g), external


def _interior(gm: fx.GraphModule, block: set) -> set:
    """Nodes outside ``block`` that lie between its nodes (computed from one, read by another): the copy of a
    residual stream a block reads again (``clone(add)`` feeding a norm of the same block) is kept in the graph,
    but the extracted block recomputes it, so the block's inputs stay independent values."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last = max(order[n] for n in block)
    down, stack = set(), list(block)
    while stack:
        for u in stack.pop().users:
            if u not in block and u not in down and u.op == "call_function" and order[u] < last:
                down.add(u)
                stack.append(u)
    interior = set()
    for n in sorted(down, key=order.__getitem__, reverse=True):
        if any(u in block or u in interior for u in n.users):
            interior.add(n)
    return interior


def fused_block(captured: fx.GraphModule, lifted: Lifted, emit, kwargs: dict, sizes: dict | None = None):
    """``(eager, fused, inputs)``: the block as captured (its footprint) and its fused replacement, two
    GraphModules over the same placeholders (the captured nodes flowing in, listed in ``inputs``). ``sizes``
    (dim size -> reduced size): the fused call is emitted for inputs of the reduced shapes (a family whose match
    holds shapes was resized to them)."""
    outs = [t for t, _ in lifted.targets.values()]
    # the nodes outside readers keep are the block's too: the captured block computes them from its reads
    sub, external = extract(captured, lifted.footprint + lifted.kept, outs, lifted.reads)
    g = fx.Graph()
    env = {}
    for a in external:
        env[a.name] = g.placeholder(a.name)
        env[a.name].meta = dict(a.meta)
        v = a.meta.get("val")
        if sizes and isinstance(v, torch.Tensor):
            env[a.name].meta["val"] = torch.empty([sizes.get(d, d) for d in v.shape], dtype=v.dtype, device="meta")
    result = build(g, lifted, env, emit, kwargs)
    g.output(tuple(result[role] for role in lifted.targets))
    fused = graph_module(captured, g)
    fused.graph.lint()
    return sub, fused, external


__all__ = ["Lifted", "NotLiftable", "build", "extract", "footprint", "fused_block", "lift", "moved_draw", "origin",
           "rewrite"]
