"""Where each node of a captured graph sits in the model's module hierarchy, and which repeated layers are
identical: what the pictures group by and the report's per-layer breakdown adds up.

**Module paths.** ``torch.export`` records, on each node it traces, ``node.meta["nn_module_stack"]``: the
modules the call went through, innermost last, as ``(dotted path, class)``. Capture keeps that meta; nodes
that canonicalization or a rewrite created have none. :func:`module_paths` therefore

1. takes the innermost path of the stack where there is one; a parameter (``get_attr``) sits in the module
   that owns it (its target minus the last name); graph inputs and outputs sit at the top;
2. gives every other node the longest common prefix of the paths of its neighbours (inputs and users) that
   have one, repeating until nothing changes; nodes with two such neighbours are placed first, then nodes
   with one, by their users before their inputs (a reshape between ``q_proj`` and the attention's ``mul``
   serves the attention: it lands in ``self_attn``, not in ``q_proj``); a node whose users all lie in one
   layer while its inputs come from outside it (a reshape the rewrite added between a fused op's output and
   the next layer's projection) goes with its users, into the layer that reads it;
3. puts a fused op where the nodes it replaced were (the common prefix of their paths, from the graph
   before the rewrite); a block that crosses a layer boundary (a projection with the residual add and the
   next layer's norm as its epilogue) sits in the last of the sibling layers it covers, the one that reads
   its result, so each layer after the first holds one such block and identical layers stay identical; a
   ``getitem`` the rewrite added sits with the call whose tuple it unpacks;
4. moves a value that several layers use (``torch.export`` traces the RoPE ``cos``/``sin`` reshapes once, in
   the first layer, and every layer reads them) up to the common prefix of its users: it belongs to no
   single layer, and left in the first it would make that layer look different from the others.

**Identical layers.** Siblings whose last name is a number (``layers.0`` ... ``layers.31``, ``h.0``,
``encoder.layer.3``) are compared by a structural signature: their nodes in graph order, each with its
path relative to the layer, operation, shape, dtype, non-tensor arguments, a status given by the caller
(fused or not) and where its inputs come from (a position inside the layer, or outside). Equal signatures
mean the layer would be drawn the same: :func:`repeated_layers` groups them.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from autofuse.graph import target_name

Path = tuple


def _stack_path(n: fx.Node) -> Path | None:
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    path, _cls = list(stack.values())[-1]
    return tuple(p for p in str(path).split(".") if p)


def common_prefix(paths) -> Path:
    paths = list(paths)
    if not paths:
        return ()
    out = []
    for parts in zip(*paths):
        if any(p != parts[0] for p in parts):
            break
        out.append(parts[0])
    return tuple(out)


def module_classes(*gms: fx.GraphModule) -> dict:
    """Module path -> class name (``LlamaDecoderLayer``), from the module stacks of the graphs' nodes."""
    out = {}
    for gm in gms:
        for n in gm.graph.nodes:
            for path, cls in (n.meta.get("nn_module_stack") or {}).values():
                out.setdefault(tuple(p for p in str(path).split(".") if p), str(cls).rsplit(".", 1)[-1])
    return out


def fused_match(n: fx.Node):
    """The :class:`~autofuse.match.Match` a fused-op call replaced (rewrite tags the call), or None."""
    return n.meta.get("autofuse_match") if n.op == "call_function" else None


def fused_lead(n: fx.Node) -> bool:
    """A fused op's lead call: the one its decision's price is charged to (the other nodes its fusion emitted name
    it in ``meta["autofuse_part_of"]``, :func:`fused_part_of`)."""
    return fused_match(n) is not None and not n.meta.get("autofuse_part_of")


def lead_match(n: fx.Node):
    """The match of a fused op's lead call (:func:`fused_lead`), None for any other node: what a fusion's price,
    workspace and overlap are charged to."""
    return fused_match(n) if fused_lead(n) else None


def fused_part_of(n: fx.Node) -> str:
    """The lead call's name for a node a fusion emitted besides its lead (another launch, a view of an output), or
    ``""``."""
    return n.meta.get("autofuse_part_of", "") if fused_match(n) is not None else ""


def fused_block(n: fx.Node) -> tuple | None:
    """``(anchor, nodes)`` of the block a fused-op call replaced, in the captured graph's names (those of the report's
    decisions and of the graph before the rewrite), or None. The match itself names canonical nodes."""
    m = fused_match(n)
    if m is None:
        return None
    return n.meta.get("autofuse_block") or (m.anchor, tuple(m.nodes))


def module_paths(gm: fx.GraphModule, before: dict | None = None) -> dict:
    """Node name -> module path (a tuple of names; ``()`` is the top). ``before``: the paths of the graph a
    rewrite started from, so that kept nodes keep their place and fused ops sit where their nodes were."""
    paths: dict = {}
    for n in gm.graph.nodes:
        p = _stack_path(n)
        if p is None and before is not None and n.name in before and fused_match(n) is None:
            p = before[n.name]
        if p is None and n.op == "get_attr":
            p = tuple(str(n.target).split("."))[:-1]
        if p is None and n.op in ("placeholder", "output"):
            p = ()
        if p is None and fused_match(n) is not None and before is not None:
            inner = [before[x] for x in fused_block(n)[1] if x in before]
            p = _fused_place(inner) if inner else None
        if p is not None:
            paths[n.name] = p
    def placed(nodes):
        return [paths[m.name] for m in nodes if m.name in paths and m.op not in ("get_attr", "placeholder", "output")]

    for n in gm.graph.nodes:                # a tuple's items sit with the call that made them
        if n.name not in paths and n.op == "call_function" and n.target is operator.getitem \
                and isinstance(n.args[0], fx.Node) and n.args[0].name in paths:
            paths[n.name] = paths[n.args[0].name]
    unknown = [n for n in gm.graph.nodes if n.name not in paths]
    while unknown:
        for n in unknown:                   # two placed neighbours agree on where a node belongs
            near = placed(list(n.all_input_nodes) + list(n.users))
            if len(near) >= min(2, len(n.all_input_nodes) + len(n.users)) and near:
                at = common_prefix(near)
                layer = _one_layer(placed(n.users))
                if layer is not None and at[:len(layer)] != layer:
                    at = common_prefix(placed(n.users))     # it feeds one layer from outside: it is that layer's
                paths[n.name] = at
        left = [n for n in unknown if n.name not in paths]
        if len(left) == len(unknown):       # else follow the users (a reshape serves the code that reads it),
            for n in reversed(left):        # last first, so a chain of them follows its consumer
                near = placed(n.users) or placed(n.all_input_nodes)
                if near:
                    paths[n.name] = common_prefix(near)
            left = [n for n in unknown if n.name not in paths]
            if len(left) == len(unknown):   # nothing connects them to a module: the top
                for n in left:
                    paths[n.name] = ()
                break
        unknown = left
    for n in gm.graph.nodes:                # a value shared by several layers belongs to their parent
        users = {layer_of(paths[u.name]) for u in n.users if u.name in paths and u.op != "output"}
        own = paths.get(n.name, ())
        if len(users) > 1 and layer_of(own) in users and any(p.isdigit() for p in layer_of(own)):
            paths[n.name] = common_prefix([own, *(paths[u.name] for u in n.users if u.name in paths)])
    return paths


def _fused_place(inner: list) -> Path:
    """Where a fused op sits, given the paths of the nodes it replaced: their common prefix, or, when they lie in
    two or more sibling layers, the common prefix of those in the last (highest-numbered) of them."""
    layers = layers_covered(inner)
    if len(layers) < 2 or len({layer[:-1] for layer in layers}) > 1:
        return common_prefix(inner)
    return common_prefix(p for p in inner if p[:len(layers[-1])] == layers[-1])


def layers_covered(block_paths) -> list:
    """The numbered layers (``layer_of``) that the paths of a fused block's nodes lie in, lowest first; two or
    more when the block crosses a layer boundary."""
    layers = {layer_of(p) for p in block_paths if any(_is_index(x) for x in p)}
    return sorted(layers, key=lambda layer: tuple(int(x) if _is_index(x) else -1 for x in layer))


def _one_layer(paths) -> Path | None:
    """The numbered layer all of ``paths`` lie in, or None (none given, one outside every layer, or two layers)."""
    layers = {layer_of(p) if any(_is_index(x) for x in p) else None for p in paths}
    return layers.pop() if len(layers) == 1 else None


def _is_index(name: str) -> bool:
    return bool(re.fullmatch(r"\d+", name))


def layer_of(path: Path) -> Path:
    """The layer a path belongs to: up to its first numeric name (``model.layers.3``); paths without one
    keep their first two names (``model.embed_tokens``, ``lm_head``)."""
    for i, p in enumerate(path):
        if _is_index(p):
            return path[:i + 1]
    return path[:2]


@dataclass
class LayerGroup:
    """Sibling layers with one structure: ``shown`` is drawn, ``members`` (``shown`` first) all look alike."""

    parent: Path
    members: list

    @property
    def shown(self) -> Path:
        return self.members[0]

    @property
    def hidden(self) -> list:
        return self.members[1:]

    def label(self) -> str:
        """``layers.1 … layers.31`` for a run of indices, else the indices listed."""
        idx = [int(m[-1]) for m in self.hidden]
        name = self.parent[-1] if self.parent else ""
        if idx == list(range(idx[0], idx[-1] + 1)):
            span = f"{name}.{idx[0]}" if len(idx) == 1 else f"{name}.{idx[0]} … {name}.{idx[-1]}"
        else:
            span = f"{name}.{{{','.join(map(str, idx))}}}"
        return span


def _signature(nodes: list, root: Path, paths: dict, status: dict) -> tuple:
    index = {n: i for i, n in enumerate(nodes)}
    sig = []
    for n in nodes:
        where = paths.get(n.name, ())[len(root):]
        v = n.meta.get("val")
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else None
        dtype = str(v.dtype) if isinstance(v, torch.Tensor) else None
        ins = tuple(index.get(a, "out") for a in n.all_input_nodes)
        consts = repr(fx.map_arg((n.args, n.kwargs), lambda a: None))
        sig.append((where, n.op, target_name(n) if n.op != "get_attr" else "", shape, dtype, consts, ins,
                    status.get(n.name, "")))
    return tuple(sig)


def repeated_layers(gm: fx.GraphModule, paths: dict, status: dict | None = None) -> list[LayerGroup]:
    """Groups of two or more identical sibling layers (see the module docstring), outermost first. ``status``:
    node name -> a string that must also agree (e.g. which fusion covers the node)."""
    status = status or {}
    members: dict = {}
    for n in gm.graph.nodes:
        p = paths.get(n.name, ())
        for i, part in enumerate(p):
            if _is_index(part):
                members.setdefault(p[:i + 1], []).append(n)
    by_parent: dict = {}
    for layer in members:
        by_parent.setdefault(layer[:-1], []).append(layer)
    groups = []
    for parent, layers in sorted(by_parent.items(), key=lambda kv: len(kv[0])):
        layers.sort(key=lambda p: int(p[-1]))
        classes: dict = {}
        for layer in layers:
            key = _signature(members[layer], layer, paths, status)
            classes.setdefault(key, []).append(layer)
        for same in classes.values():
            if len(same) > 1:
                groups.append(LayerGroup(parent, same))
    return groups
