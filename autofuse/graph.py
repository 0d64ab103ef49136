"""Graph view: a ``networkx.DiGraph`` over an fx graph, plus small node helpers shared by passes.

The view has one networkx node per fx node, keyed by the fx node name, with attributes
``op`` (placeholder/get_attr/call_function/output), ``target`` (string such as
``"aten.matmul.default"``), ``shape`` (tuple of ints, or None for non-tensors), ``dtype``
(string such as ``"torch.float32"``, or None). An edge ``u -> v`` means v reads u.
The view is a snapshot: it is not updated when the fx graph changes.
"""
from __future__ import annotations

import contextlib
import numbers
import operator

import networkx as nx
import torch
import torch.fx as fx

try:
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GRAPH_MODULE
except ImportError:                 # another torch: every graph module generates its code at once
    _GRAPH_MODULE = fx.GraphModule

aten = torch.ops.aten


def target_name(node: fx.Node) -> str:
    """A stable string name for the node's target: ``aten.bmm.default``, ``getitem``, ``output``."""
    t = node.target
    if isinstance(t, str):
        return t
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}.{t._overloadname}"
    return getattr(t, "__name__", str(t))


def val(node) -> torch.Tensor | None:
    """The node's example value (FakeTensor) if it is a tensor, else None."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def shape(node) -> tuple[int, ...] | None:
    v = val(node)
    return tuple(int(s) for s in v.shape) if v is not None else None


def dtype(node) -> torch.dtype | None:
    v = val(node)
    return v.dtype if v is not None else None


def is_call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def is_number(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, bool)


def arg(node: fx.Node, i: int, name: str, default=None):
    """Positional-or-keyword argument ``i``/``name`` of a call node."""
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def draw_order(x: torch.Tensor) -> list | None:
    """The order eager's dropout draws its keep-mask in, for an input laid out as ``x`` (a real or fake tensor):
    its dims from outermost to innermost in the memory of ``empty_like(x)``, which ``F.dropout`` (and
    ``native_dropout``) fills with ``bernoulli_``, and torch fills a tensor in memory order. ``empty_like`` keeps a
    dense input's strides (a transposed or permuted one: the draws follow its memory) and lays out any other
    (sliced, expanded) densely in the order of its strides. None where that is row-major (the draws are in
    logical order)."""
    like = torch.empty_like(torch.empty_strided(tuple(x.shape), tuple(x.stride()), device="meta"))
    if like.is_contiguous():
        return None
    return sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))


#: Ops whose CPU kernel lays its output out in the input's suggested memory format (dense row-major, or channels-last
#: for a 4-D or 5-D channels-last input) where torch's meta kernel keeps the input's strides: BatchNorm1d over a
#: transposed [B, C, T] input is contiguous in eager and transposed in the captured graph.
_LAID_OUT_AS_SUGGESTED = tuple(getattr(aten, name).default for name in (
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional") if hasattr(aten, name))


def _suggested_layout(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor like ``x`` in ``x``'s suggested memory format (as ``empty_like(x, x.suggest_memory_format())``)."""
    for rank, fmt in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        if x.dim() == rank and not x.is_contiguous() and x.is_contiguous(memory_format=fmt):
            return torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=fmt)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def relayout_as_eager(gm: fx.GraphModule) -> int:
    """Give the captured values eager's memory layouts where torch's meta kernels lay them out otherwise
    (:data:`_LAID_OUT_AS_SUGGESTED`), and every value computed from them its layout again from its op's own
    meta kernel: a dropout draws its keep-mask in its input's memory order, so a plan that read the captured
    layout drew another mask than eager (a transposed BatchNorm1d's GELU, then dropout). Returns how many values
    changed. A value whose op does not run again on the new layout keeps the captured one."""
    if not any(n.op == "call_function" and n.target in _LAID_OUT_AS_SUGGESTED for n in gm.graph.nodes):
        return 0
    changed = set()

    def layout(v):
        return (tuple(v.shape), tuple(v.stride())) if isinstance(v, torch.Tensor) else \
            tuple(layout(x) for x in v) if isinstance(v, (tuple, list)) else None

    from torch._guards import detect_fake_mode
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    fake = detect_fake_mode([v for v in (n.meta.get("val") for n in gm.graph.nodes) if isinstance(v, torch.Tensor)])
    mode = fake if fake is not None else contextlib.nullcontext()
    for n in gm.graph.nodes:
        old = n.meta.get("val")
        if n.op != "call_function" or old is None or free_unbacked_symbols(old):
            # a size read from data (masked_select, nonzero): run again it would be a new unknown size
            continue
        try:
            if n.target in _LAID_OUT_AS_SUGGESTED:
                with mode:
                    out = _suggested_layout(old if isinstance(old, torch.Tensor) else old[0])
                new = out if isinstance(old, torch.Tensor) else type(old)((out, *old[1:]))
            elif any(isinstance(a, fx.Node) and a in changed for a in n.all_input_nodes):
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
                with mode:
                    new = n.target(*args, **kwargs)
            else:
                continue
            if layout(new) == layout(old):
                continue
        except Exception:  # noqa: BLE001 - an op that does not run again here keeps its captured layout
            continue
        n.meta["val"] = new
        changed.add(n)
    return len(changed)


def keep_mask_order(dropout: fx.Node) -> list | None:
    """:func:`draw_order` of a training dropout's input as the captured graph lays it out: canonicalization drops
    copies that change only a layout (``.contiguous()``, a ``clone`` to channels-last), so it records the order
    on the dropout (``meta["autofuse_draw_order"]``) first; a graph that was not canonicalized is read as it is."""
    if "autofuse_draw_order" in dropout.meta:
        return dropout.meta["autofuse_draw_order"]
    return draw_order(val(dropout.args[0]))


def in_order(t: torch.Tensor, order) -> torch.Tensor:
    """``t`` with its memory laid out in dim order ``order`` (outermost first; BSND = [0, 2, 1, 3]; None:
    row-major), as a captured value it stands for was laid out: later views of it rely on that layout, and a
    dropout draws its keep-mask in its input's memory order. A kernel stores each tile to its place in that
    layout (CANN's FlashAttention writes BSND/BSH outputs directly); the simulator charges a store by its bytes,
    so the layout does not change its cost."""
    if not order or list(order) == list(range(t.dim())):
        return t
    inverse = [list(order).index(d) for d in range(t.dim())]
    return t.permute(*order).contiguous().permute(*inverse)


def empty_in_order(like: torch.Tensor, shape, order) -> torch.Tensor:
    """An empty tensor of ``shape`` (``like``'s dtype and device) laid out in dim order ``order``
    (:func:`in_order`)."""
    if not order or list(order) == list(range(len(shape))):
        return like.new_empty(shape)
    inverse = [list(order).index(d) for d in range(len(shape))]
    return like.new_empty([shape[d] for d in order]).permute(*inverse)


def split_part(n):
    """``(source, dim, start, stop)`` of ``getitem(split(x, sizes, dim), i)`` (``chunk``, ``split``,
    ``split_with_sizes``): the part's extent along the split dim (counted from 0); None for anything else."""
    if not is_call(n, operator.getitem) or not is_call(n.args[0], torch.ops.aten.split.Tensor,
                                                        torch.ops.aten.split_with_sizes.default):
        return None
    sp, i = n.args
    src = sp.args[0]
    rank = len(shape(src) or ())
    if not rank or not isinstance(i, int):
        return None
    dim = arg(sp, 2, "dim", 0) % rank
    width, sizes = shape(src)[dim], sp.args[1]
    if isinstance(sizes, int):
        sizes = [min(sizes, width - s) for s in range(0, width, sizes)] if sizes > 0 else []
    if i >= len(sizes):
        return None
    start = sum(sizes[:i])
    return src, dim, start, start + sizes[i]


def last_dim_slice(n):
    """``(source, start, stop, step)`` of an ``aten.slice`` over its source's last dim (the arguments' defaults
    filled in and resolved against the width, as ``slice.indices`` does), or None for anything else."""
    if not is_call(n, torch.ops.aten.slice.Tensor):
        return None
    src = n.args[0]
    rank = len(shape(src) or ())
    if not rank or arg(n, 1, "dim", 0) % rank != rank - 1:
        return None
    return (src, *slice(arg(n, 2, "start"), arg(n, 3, "end"), arg(n, 4, "step")).indices(shape(src)[-1]))


def effectful(n: fx.Node) -> bool:
    """Whether ``n`` calls an aten op that writes in place or draws random numbers: its value is not a function of
    its inputs alone, so it is not merged with its twin, recomputed, nor dropped as a duplicate."""
    t = n.target
    return n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and (
        t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags)


#: nodes of an exported graph that only assert facts about sizes
SIZE_ASSERTS = frozenset({torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default,
                          torch.ops.aten.sym_constrain_range.default})
#: what a data-dependent size leaves hanging off its holder in an exported graph: the size read and its range checks
SIZE_CHECKS = SIZE_ASSERTS | {torch.ops.aten.sym_size.int, operator.ge, operator.le, operator.gt, operator.lt,
                              operator.eq}


def size_checks(n: fx.Node, skip=frozenset()) -> list | None:
    """The nodes checking ``n``'s data-dependent size (a ``sym_size`` read, comparisons, ``_assert_scalar``) that
    read it, other than those in ``skip``; None if something else does: when ``n`` goes, its checks go with it."""
    out, stack = [], [u for u in n.users if u not in skip]
    while stack:
        u = stack.pop()
        if u in out or u in skip:
            continue
        if u.op != "call_function" or u.target not in SIZE_CHECKS:
            return None
        out.append(u)
        stack.extend(u.users)
    return out


def ancestors(nodes) -> set:
    """Every node the values of ``nodes`` are computed from (their inputs, theirs, ...), ``nodes`` not included
    unless one is upstream of another."""
    seen, todo = set(), [a for n in nodes for a in n.all_input_nodes]
    while todo:
        a = todo.pop()
        if a not in seen:
            seen.add(a)
            todo.extend(a.all_input_nodes)
    return seen


def returned(gm: fx.GraphModule) -> set:
    """The nodes whose values ``gm`` returns (its output node's arguments)."""
    return {a for n in gm.graph.nodes if n.op == "output" for a in n.all_input_nodes}


def returned_read(nodes, out: set):
    """The first of ``nodes`` whose value the graph returns (one of ``out``, :func:`returned`) and another of
    ``nodes`` reads, or None: one fused call computing ``nodes`` would both return that value and use it inside.
    A value no gradient can flow through (integer or bool: a router's expert indices) does not count."""
    inside = set(nodes)
    return next((n for n in nodes if n in out and (val(n) is None or floating(val(n)))
                 and any(u in inside for u in n.users)), None)


def floating(v) -> bool:
    """Whether ``v`` is a float or complex tensor: one a gradient can flow through."""
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


#: the matmul family as captured: ops whose output is the product of two tensor operands
PRODUCTS = frozenset({aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default,
                      aten.baddbmm.default})


#: the key of ``node.meta["custom"]`` that numbers the activation checkpoint (one call of
#: ``torch.utils.checkpoint.checkpoint`` in the capture's trace) the node was made in
CHECKPOINT = "autofuse_checkpoint"


def checkpoint_of(n: fx.Node):
    """The number of the activation checkpoint ``n`` was made in (:data:`CHECKPOINT`), or None."""
    return (n.meta.get("custom") or {}).get(CHECKPOINT)


def keeps_checkpoints(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` was captured with grad through activation checkpoints: a plan of it recomputes each
    checkpoint's values in the backward (:mod:`autofuse.checkpointing`)."""
    return bool(gm.meta.get("autofuse_checkpoints")) and gm.meta.get("autofuse_grad", True)


def to_networkx(gm: fx.GraphModule | fx.Graph) -> nx.DiGraph:
    """Snapshot ``gm``'s graph as a DiGraph (see module docstring for the attributes)."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    g = nx.DiGraph()
    for n in graph.nodes:
        s, d = shape(n), dtype(n)
        g.add_node(n.name, op=n.op, target=target_name(n), shape=s, dtype=str(d) if d is not None else None)
    for n in graph.nodes:
        for inp in n.all_input_nodes:
            g.add_edge(inp.name, n.name)
    return g


def infer_val(node: fx.Node):
    """Recompute ``node.meta['val']`` by running its target on its inputs' FakeTensors."""
    from torch._guards import detect_fake_mode

    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    flat = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    fake_mode = detect_fake_mode(flat)
    if fake_mode is None:
        out = node.target(*args, **kwargs)
    else:
        with fake_mode:
            out = node.target(*args, **kwargs)
    node.meta["val"] = out
    return out


def call(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's current insert point, with meta['val']."""
    n = graph.call_function(target, args, kwargs)
    infer_val(n)
    return n


def get_attr_value(gm: fx.GraphModule, target: str):
    obj = gm
    for p in target.split("."):
        obj = getattr(obj, p)
    return obj


def program_module(model) -> bool:
    """Whether ``model`` is an exported program's module (``ep.module()``, what ``fuse`` makes of an
    ``ExportedProgram``): it checks its inputs against the export's (``_guards_fn``) and binds them by its spec."""
    return isinstance(model, fx.GraphModule) and hasattr(model, "range_constraints") and \
        isinstance(getattr(model, "_in_spec", None), torch.utils._pytree.TreeSpec)


def graph_module(root, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)`` whose Python code is generated when it is first run or read, not at every
    construction and ``recompile()``: planning builds a graph module for every block it checks and rebuilds the
    whole graph's after each pass, and most are never run (a decode step made about 57, 20 % of its planning
    time). torch's own ``_LazyGraphModule`` (what Inductor's passes use); a plain one where torch has none."""
    return _GRAPH_MODULE(root, graph)


def realised(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its code generated now. A lazy graph module's ``forward`` called directly generates its code and
    then goes through ``__call__``, which fires torch's global module hooks at a module eager never runs."""
    if isinstance(gm, _GRAPH_MODULE) and hasattr(gm, "real_recompile"):
        gm.real_recompile()
    return gm


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of ``gm.graph`` (node meta copied); attributes (parameters,
    buffers, constants) are the same objects as in ``gm``, never copies."""
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    new = graph_module(gm, g)
    new.meta.update(gm.meta)
    return new


class _AllKept(Exception):
    pass


def describe_node(n: fx.Node) -> str:
    """``embedding (aten.embedding.default, in module e: Embedding)``: a captured node as a user can find it in
    the model."""
    stack = n.meta.get("nn_module_stack") or {}
    path, cls = next(reversed(stack.values())) if stack else ("", "")
    where = f", in module {path}: {str(cls).rsplit('.', 1)[-1]}" if path else ""
    return f"{n.name} ({target_name(n)}{where})"


class ExampleRunError(ValueError):
    """The example inputs fail to run the captured graph (an op raised on their values, as the model raises
    eagerly on them): the message names the op."""

    def __init__(self, node: fx.Node, error: Exception):
        said = (str(error).strip().splitlines() or [""])[0]
        super().__init__(f"the example inputs fail to run the model eagerly: {describe_node(node)} raised "
                         f"{type(error).__name__}: {said} (check that the model runs on them as given)")
        self.node = node.name


class NodeValues(fx.Interpreter):
    """Runs the graph and keeps the values of the nodes asked for (by name); stops as soon as it has them all. An op
    that raises on the inputs' values raises :class:`ExampleRunError`, which names it."""

    def __init__(self, gm, wanted):
        super().__init__(gm)
        self.wanted, self.kept = set(wanted), {}
        self.extra_traceback = False        # ExampleRunError names the op; no graph dump appended to it

    def run_node(self, n):
        try:
            r = super().run_node(n)
        except Exception as e:  # noqa: BLE001 - whatever the op raised on these values, named with the op
            raise ExampleRunError(n, e) from e
        if n.name in self.wanted:
            self.kept[n.name] = r
            if len(self.kept) == len(self.wanted):
                raise _AllKept
        return r

    def values(self, *args) -> dict:
        try:
            with torch.no_grad(), torch.random.fork_rng():    # a captured dropout must not move the user's RNG
                self.run(*args)
        except _AllKept:
            pass
        return self.kept
