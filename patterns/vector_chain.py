"""Automatic discovery: connected regions of Vector ops become one generated kernel; a region after a matmul
becomes its epilogue; regions that compute a known fused op are named after it.

**Regions** (``find_vector_chains``). The canonical graph's nodes are classed as in TVM's FuseOps: *Vector*
ops — elementwise, broadcast, casts, reductions along the last dim, last-dim slices and concatenations,
``layer_norm`` — which one generated kernel can run in one pass over UB tiles
(:func:`autofuse.vector_program.program_from_nodes` says exactly which), views that keep the rows and the
last dim, and *opaque* ops (matmuls, softmax, attention, gathers...). Walking the graph in order, a Vector
node joins the regions of its Vector producers when that creates no cycle: a region may absorb a node only
if none of the node's other inputs depends on the region through nodes outside it (each node carries the
set of regions it depends on). A view of a value outside a region stays outside (it is an input). A region
whose program cannot be built (a reduction over another dim, shapes that do not share one iteration space)
is split at the node the builder names, and the parts are tried again. Regions of fewer than two compute
ops are dropped: a single op gains nothing from fusion.

A training-mode dropout is a Vector op too (``x · where(keep, 1/(1 − p), 0)`` over a ``bit`` input, eager's
``x · mask · scale``, NaN times a dropped 0 NaN): the fused
call draws its keep-mask with ``dropout_gen_mask`` exactly as eager draws it (see
:func:`autofuse.vector_program.draws_keep_mask`), so a residual dropout joins the add and the norm after it,
and a projection's bias, dropout, residual add and norm become one epilogue. The match lists those draws
(``params["draws"]``); the planner refuses a region whose draws would move past another random op.

**Epilogues** (``find_matmul_epilogues``). A region that reads the output of a matmul (``linear``,
``matmul``, ``addmm``) used nowhere else is also offered as that matmul plus its epilogue
(``torch.ops.autofuse.matmul_epilogue``: the product goes from L0C to UB and through the program before one
store). The planner chooses between the region alone and the matmul with it (they conflict) by price.

**Names** (the report speaks the user's vocabulary). Named families are small templates (``TEMPLATES``)
matched inside a region: ``rms_norm`` (``x · rsqrt(mean(x²) + eps) [· w]``), ``add_rms_norm`` (the same of a
residual sum that leaves the region too), ``layer_norm``, ``rope`` (half rotation ``x·cos + cat(−x₂, x₁)·sin``,
interleaved, or partial; or per half, ``cat(x₁·cos − x₂·sin, x₂·cos + x₁·sin)``, of x's halves or of its even and
odd elements (DeepSeek-V3's interleaved RoPE); cos and sin two tables, neither negated), ``swiglu``
(``silu(a) · b``, b not computed from a), ``geglu`` (``gelu(a) · b``). A region's
``FusionDecision.pattern`` is its names joined with ``+`` in graph order (``matmul+swiglu``,
``add_rms_norm``), ``matmul_epilogue`` for a matmul with an unnamed epilogue, ``vector_chain`` otherwise.
Near misses (eps outside the square root, a rotation with the wrong sign) are not named; they are still
fused, and computed exactly as written.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autofuse.graph import (arg, checkpoint_of, is_call, is_number, keep_mask_order, keeps_checkpoints,
                            last_dim_slice, returned, returned_read, shape, split_part, val)
from autofuse.match import Match, register
from autofuse.vector_program import (_ACTIVATION_ATEN, _BINARY_ATEN, _COMBINE_ATEN, _FORMULA_ATEN, _NORM_ATEN,
                                     _PRELU_ATEN, _REDUCE_ATEN, _UNARY_ATEN, _VAR_ATEN, _VIEWS, NotExpressible,
                                     _keepdim, draws_keep_mask, program_from_nodes)
from patterns.template import Template, graph_view

aten = torch.ops.aten

_COMPUTE = set(_UNARY_ATEN) | set(_BINARY_ATEN) | set(_REDUCE_ATEN) | _ACTIVATION_ATEN | _VAR_ATEN | _COMBINE_ATEN | \
    _FORMULA_ATEN | _NORM_ATEN | _PRELU_ATEN | {
    aten.gelu.default, aten.rsub.Scalar, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.masked_fill.Scalar, aten._to_copy.default,
    aten.layer_norm.default, aten.rms_norm.default, aten.slice.Tensor, aten.cat.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.stack.default}
_MOVES = {aten.slice.Tensor, aten.cat.default, aten.split.Tensor, aten.split_with_sizes.default, aten.stack.default,
          operator.getitem}
MATMULS = {aten.linear.default, aten.matmul.default, aten.addmm.default}
_DROPOUTS = (aten.native_dropout.default, aten.dropout.default)     # training mode: see draws_keep_mask
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.bool)


def _vector(n: fx.Node) -> bool:
    """An op one generated Vector kernel may run (the program builder decides the details)."""
    if n.op != "call_function":
        return False
    if n.target in _DROPOUTS:               # not of per-row values (one keep bit per row): those stay as captured
        x = val(n.args[0])
        return draws_keep_mask(n) and x.dtype in _DTYPES[:3] and x.dim() > 0 and x.shape[-1] >= 2
    if n.target is operator.getitem:
        src = n.args[0]
        if isinstance(src, fx.Node) and src.target in (aten.native_dropout.default, aten.log_sigmoid_forward.default):
            return n.args[1] == 0 and _vector(src)
        return isinstance(src, fx.Node) and src.target in (aten.split.Tensor, aten.split_with_sizes.default)
    if n.target == aten.log_sigmoid_forward.default:         # (output, buffer): the buffer unread
        return all(u.target is operator.getitem and u.args[1] == 0 for u in n.users) and \
            val(n.args[0]).dtype in _DTYPES[:3]
    if n.target not in _COMPUTE and n.target not in _VIEWS:
        return False
    v = val(n)
    ins = [val(a) for a in n.all_input_nodes]
    if any(t is not None and t.dtype not in _DTYPES for t in ins):
        return False                  # integer inputs (positions, ids): not Vector-program data
    if n.target in (aten.split.Tensor, aten.split_with_sizes.default):
        return True
    return isinstance(v, torch.Tensor) and v.dtype in _DTYPES and v.dim() >= 1


def _rows(n: fx.Node) -> int:
    """The rows a node's value spans (its leading dims; a split's input's): a region has one row count, the
    iteration space of its program, so values over other rows (RoPE's cos over tokens, read by the queries'
    rotation over heads and tokens) are computed apart and read as broadcast inputs."""
    if n.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.native_dropout.default,
                    aten.log_sigmoid_forward.default) or _row_value(n):
        n = n.args[0]
    v = val(n)
    if n.target == aten.stack.default and isinstance(v, torch.Tensor) and v.dim() >= 2 and \
            (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % v.dim() == v.dim() - 1:
        return math.prod(v.shape[:-2])      # pairs along a new last dim (an interleave once flattened): its inputs' rows
    return math.prod(v.shape[:-1]) if isinstance(v, torch.Tensor) and v.dim() else 1


def _row_value(n: fx.Node) -> bool:
    """A variance or a 2-norm over the last dim without keepdim: one value per row of its input (its rows)."""
    if n.target not in _VAR_ATEN | _NORM_ATEN or _keepdim(n) or not isinstance(val(n.args[0]), torch.Tensor):
        return False
    dim = arg(n, 2 if n.target in _NORM_ATEN else 1, "dim")
    rank = val(n.args[0]).dim()
    return isinstance(dim, (list, tuple)) and len(dim) == 1 and rank > 0 and dim[0] % rank == rank - 1


def _compute(n: fx.Node) -> bool:
    return n.target not in _VIEWS and n.target not in _MOVES


class _Regions:
    """Union-find over nodes with, per node, the regions it depends on (see the module docstring)."""

    def __init__(self, marks=None):
        self.parent: dict = {}
        self.marks = marks            # node -> its activation checkpoint, where regions keep to one (or None)
        self.rows: dict = {}          # region root -> the rows of its iteration space
        self.deps: dict = {}          # node -> set of region roots among its ancestors (stale roots resolved late)

    def find(self, n):
        p = self.parent[n]
        while p is not self.parent[p]:
            self.parent[p] = self.parent[self.parent[p]]
            p = self.parent[p]
        return p

    def depends(self, n) -> set:
        return {self.find(r) for r in self.deps.get(n, ())}

    def add(self, n: fx.Node):
        ins = [a for a in n.all_input_nodes]
        deps = set()
        for a in ins:
            deps |= self.deps.get(a, set())
            if a in self.parent:
                deps.add(self.find(a))
        self.deps[n] = {self.find(r) for r in deps}
        if not _vector(n):
            return
        producers = []
        rows = (_rows(n), self.marks(n)) if self.marks else _rows(n)
        for a in ins:
            if a in self.parent and self.find(a) not in producers and self.rows[self.find(a)] == rows:
                producers.append(self.find(a))
        if n.target in _VIEWS and not producers:
            return                    # a view of an outside value is an input of a region, not part of one
        chosen = []
        for r in producers:
            # n may join r if no input of n outside r depends on r, and r depends on no region chosen before
            ok = all((a in self.parent and self.find(a) == r) or r not in self.depends(a) for a in ins)
            ok = ok and all(c not in self._region_deps(r) and r not in self._region_deps(c) for c in chosen)
            if ok:
                chosen.append(r)
        self.parent[n] = n
        self.rows[n] = rows
        for r in chosen:
            self.parent[r] = n
        self.deps[n] = {self.find(r) for r in self.deps[n]} - {n}

    def _region_deps(self, root) -> set:
        return {self.find(r) for r in self.deps.get(root, ())} - {self.find(root)}

    def groups(self) -> list:
        out: dict = {}
        for n in self.parent:
            out.setdefault(self.find(n), []).append(n)
        return list(out.values())


def regions(gm: fx.GraphModule) -> list:
    """The Vector regions of ``gm`` (lists of nodes in graph order), before programs are built. In a graph whose plan
    keeps activation checkpoints (:func:`autofuse.graph.keeps_checkpoints`) a region keeps to one checkpoint (or to
    the rest of the graph): the backward recomputes each checkpoint's values on their own."""
    rg = _Regions(checkpoint_of if keeps_checkpoints(gm) else None)
    for n in gm.graph.nodes:
        rg.add(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [sorted(g, key=order.__getitem__) for g in rg.groups()]


def _split(nodes: list, bad: fx.Node) -> list:
    """The connected parts of ``nodes`` without ``bad`` (edges between members, either direction), never joining
    a node below ``bad`` with one that is not: a part holding both could reach ``bad`` and be read back by it
    (a path out of the part and in again, a cycle once the part is one call). The region is convex, so each
    side is too."""
    return _parts([n for n in nodes if n is not bad], _below(nodes, [bad]))


def _below(nodes: list, tops: list) -> set:
    """The members of ``nodes`` computed from one of ``tops`` (at any depth through members; tops not included
    unless reached again)."""
    inside = set(nodes)
    below, stack = set(), list(tops)
    while stack:
        for u in stack.pop().users:
            if u in inside and u not in below:
                below.add(u)
                stack.append(u)
    return below


def _parts(rest: list, below: set) -> list:
    """The connected parts of ``rest`` (edges between members, either direction) that never join a node of
    ``below`` with one that is not."""
    left, parts = set(rest), []
    for n in rest:
        if n not in left:
            continue
        part, stack = [], [n]
        left.discard(n)
        while stack:
            x = stack.pop()
            part.append(x)
            for y in list(x.all_input_nodes) + list(x.users):
                if y in left and (y in below) == (x in below):
                    left.discard(y)
                    stack.append(y)
        parts.append(part)
    return parts


def build(nodes: list, first=None, depth: int = 0):
    """``[(nodes, BuiltProgram)]`` for a region: its program, or its parts' after splitting at the node the
    builder refuses. Regions of one compute op are kept (a matmul's epilogue may be one GELU)."""
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    nodes = sorted(nodes, key=order.__getitem__)
    if sum(_compute(n) for n in nodes) < 1 or depth > 12:
        return []
    try:
        return [(nodes, program_from_nodes(nodes, first=first))]
    except NotExpressible as e:
        bad = next((n for n in nodes if f"node {n.name} (" in str(e)), None)
        if bad is None:
            return []
        return [r for part in _split(nodes, bad) for r in build(part, first, depth + 1)]


# ---------------------------------------------------------------------------------------------- names

def _is_square(n):
    return (n.target == aten.pow.Tensor_Scalar and n.args[1] == 2) or \
        (n.target == aten.mul.Tensor and n.args[0] is n.args[1])


def _mean_last_keepdim(n):
    return list(n.args[1]) in ([-1], [len(shape(n.args[0])) - 1]) and (len(n.args) > 2 and n.args[2])


def _add_scalar(n):
    return is_number(n.args[1]) and n.args[1] > 0


RMS = (Template("rms_norm", anchor="rsqrt")
       .node("sq", aten.pow.Tensor_Scalar, aten.mul.Tensor, where=_is_square)
       .node("mean", aten.mean.dim, where=_mean_last_keepdim).edge("sq", "mean", 0)
       .node("eps", aten.add.Tensor, where=_add_scalar)
       .node("rsqrt", aten.rsqrt.default)
       .node("norm", aten.mul.Tensor)
       .edge("mean", "eps", 0).edge("eps", "rsqrt", 0).edge("rsqrt", "norm"))


def _uncast(x):
    while isinstance(x, fx.Node) and x.target == aten._to_copy.default:
        x = x.args[0]
    return x


def _rms(m) -> bool:
    """x · rsqrt(mean(x²) + eps): the x multiplied is the x squared (through casts)."""
    x = m["sq"].args[0]
    other = next(a for a in m["norm"].args if a is not m["rsqrt"])
    return _uncast(other) is _uncast(x)


def _centred(x) -> bool:
    """x is y − mean(y) over the last dim (through casts): the statistic is a variance, the norm a LayerNorm
    (Cohere's, without bias), not an RMSNorm."""
    x = _uncast(x)
    if x.target != aten.sub.Tensor or not isinstance(x.args[1], fx.Node):
        return False
    mean = _uncast(x.args[1])
    return mean.target == aten.mean.dim and _mean_last_keepdim(mean) and _uncast(mean.args[0]) is _uncast(x.args[0])


def _rotation(pairs: bool) -> Template:
    """``x·cos + rotate(x)·sin``: ``rotate`` is ``cat(−x[..., h:], x[..., :h])`` (the halves), or with ``pairs``
    GPT-J's ``rotate_every_two``, ``stack((−x[..., 1::2], x[..., ::2]), −1)`` flattened."""
    t = (Template("rope", anchor="add")
         .node("cos_mul", aten.mul.Tensor).node("sin_mul", aten.mul.Tensor).node("add", aten.add.Tensor)
         .node("rot", aten.stack.default if pairs else aten.cat.default)
         .node("neg", aten.neg.default)
         .node("hi", aten.slice.Tensor, operator.getitem).node("lo", aten.slice.Tensor, operator.getitem)
         .edge("hi", "neg", 0).edge("neg", "rot", 0).edge("lo", "rot", 1)
         .edge("cos_mul", "add").edge("sin_mul", "add"))
    if pairs:
        return t.node("flat", aten.reshape.default).edge("rot", "flat", 0).edge("flat", "sin_mul")
    return t.edge("rot", "sin_mul")


ROPE, ROPE_PAIRS = _rotation(pairs=False), _rotation(pairs=True)


def _rope(m) -> bool:
    """x·cos + rotate(x)·sin with the slices of the same x, x also the factor of cos: the halves at half its last
    dim (x₂ negated), or the pairs (odd elements negated) stacked on a new last dim and flattened back to x's
    shape; cos and sin as :func:`_cos_and_sin` requires."""
    hi, lo = _part(m["hi"]), _part(m["lo"])
    if hi is None or lo is None:
        return False
    x = hi[0]
    if lo[0] is not x or x not in m["cos_mul"].args:
        return False
    w = shape(x)[-1]
    if "flat" in m:
        rot = m["rot"]
        last = len(shape(rot)) - 1
        ok = _even_odd(m["lo"], m["hi"]) is x and arg(rot, 1, "dim", 0) % (last + 1) == last and \
            shape(m["flat"]) == shape(x)
        rotated = m["flat"]
    else:
        h = w // 2
        ok = w % 2 == 0 and lo[1:3] == (0, h) and hi[1] == h
        rotated = m["rot"]
    return ok and _cos_and_sin(_factor(m["cos_mul"], x), _factor(m["sin_mul"], rotated))


def _factor(mul: fx.Node, x) -> fx.Node | None:
    """The other operand of ``mul(x, ·)`` (either order), or None when x is not one of them."""
    a, b = mul.args
    return b if a is x else a if b is x else None


# what leaves a cos or sin table the same values, rearranged: casts, views, slices, GPT-J's repeat per pair
_KEEPS = {aten._to_copy.default, aten.reshape.default, aten.expand.default, aten.unsqueeze.default,
          aten.clone.default, aten.slice.Tensor, aten.repeat_interleave.self_int}


def _trace_table(n) -> tuple:
    """``(sign, function)`` of a cos or sin factor, walked up through ``_KEEPS``, negations and scales by a number
    (Llama's ``attention_scaling``): the sign picked up on the way (0 after a scale by 0), and ``"cos"`` or
    ``"sin"`` when the value reached is ``aten.cos`` or ``aten.sin`` of something, else None."""
    sign = 1
    while isinstance(n, fx.Node) and n.op == "call_function":
        if n.target in _KEEPS:
            n = n.args[0]
        elif n.target == aten.neg.default:
            sign, n = -sign, n.args[0]
        elif n.target == aten.mul.Tensor and is_number(n.args[1]) and isinstance(n.args[0], fx.Node):
            factor = n.args[1]
            sign, n = (sign if factor > 0 else -sign if factor < 0 else 0), n.args[0]
        else:
            break
    return sign, {aten.cos.default: "cos", aten.sin.default: "sin"}.get(getattr(n, "target", None))


def _cos_and_sin(c, s) -> bool:
    """RoPE's factors: two tensors (graph values), neither negated nor scaled by zero in the graph (a negated
    sine is the inverse rotation), not the same table for both, and not a sine where the cosine goes or the
    reverse, as far as the graph shows where they come from."""
    if not isinstance(c, fx.Node) or not isinstance(s, fx.Node):
        return False
    (c_sign, c_fn), (s_sign, s_fn) = _trace_table(c), _trace_table(s)
    if c_sign != 1 or s_sign != 1 or c_fn == "sin" or s_fn == "cos":
        return False
    return _same_values(c) is not _same_values(s)


def _same_values(n):
    """n with the casts and views that keep its values (and their places) taken off."""
    while isinstance(n, fx.Node) and n.target in (aten._to_copy.default, aten.reshape.default, aten.expand.default,
                                                  aten.unsqueeze.default, aten.clone.default):
        n = n.args[0]
    return n


# the rotation written per half (GPT-OSS): cat(x₁·cos − x₂·sin, x₂·cos + x₁·sin), cos and sin half as wide
ROPE_HALVES = (Template("rope", anchor="cat")
               .node("cat", aten.cat.default)
               .node("sub", aten.sub.Tensor).node("add", aten.add.Tensor)
               .node("x1c", aten.mul.Tensor).node("x2s", aten.mul.Tensor)
               .node("x2c", aten.mul.Tensor).node("x1s", aten.mul.Tensor)
               .edge("x1c", "sub", 0).edge("x2s", "sub", 1).edge("x2c", "add").edge("x1s", "add")
               .edge("sub", "cat").edge("add", "cat"))


def _part(n):
    """``(source, start, stop, step)`` of a value that is a part of another along the last dim: a slice, or a part
    of a ``split`` / ``chunk`` there; else None."""
    if is_call(n, aten.slice.Tensor):
        return last_dim_slice(n)
    part = split_part(n)
    if part is None or part[1] != len(shape(part[0])) - 1:
        return None
    return part[0], part[2], part[3], 1


def _even_odd(ev, od):
    """The common source x of ``x[..., 0::2]`` and ``x[..., 1::2]`` in that order (its even and its odd elements
    along the last dim, every pair whole: x's width even), or None. GPT-J's pairs and DeepSeek-V3's interleaved
    halves are read from these two slices."""
    a, b = _part(ev), _part(od)
    if a is None or b is None or a[0] is not b[0]:
        return None
    w = shape(a[0])[-1]
    whole = all(p[1] == first and p[3] == 2 and len(range(*p[1:])) == w // 2 for p, first in ((a, 0), (b, 1)))
    return a[0] if w % 2 == 0 and whole else None


def _halves(x1, x2):
    """The common source of two values that are its first and second half along the last dim, or its even and odd
    elements (:func:`_even_odd`: DeepSeek-V3's interleaved RoPE rotates each pair (x₂ᵢ, x₂ᵢ₊₁) as the halves'
    rotation would, laid out in halves), or None."""
    pairs = _even_odd(x1, x2)
    if pairs is not None:
        return pairs

    def half(n):
        p = _part(n)
        if p is None:
            return None
        src, start, stop, step = p
        w = shape(src)[-1]
        if w % 2 or step != 1:
            return None
        return (src, 0) if (start, stop) == (0, w // 2) else (src, 1) if (start, stop) == (w // 2, w) else None
    a, b = half(x1), half(x2)
    return a[0] if a and b and a[0] is b[0] and (a[1], b[1]) == (0, 1) else None


def _rope_halves(m) -> bool:
    """cat(x₁·c − x₂·s, x₂·c + x₁·s) in that order, x₁ and x₂ the halves of one x, one c and one s."""
    cat = m["cat"]
    if list(cat.args[0]) != [m["sub"], m["add"]] or (len(cat.args) > 1 and cat.args[1] % len(shape(cat)) !=
                                                     len(shape(cat)) - 1):
        return False

    def split(mul, x):
        a, b = mul.args
        return b if a is x else a if b is x else None
    for x1 in m["x1c"].args:
        for x2 in m["x2c"].args:
            if _halves(x1, x2) is None:
                continue
            c, c2 = split(m["x1c"], x1), split(m["x2c"], x2)
            s_, s2 = split(m["x2s"], x2), split(m["x1s"], x1)
            if c is not None and c is c2 and s_ is not None and s_ is s2 and _cos_and_sin(c, s_):
                return True
    return False


GLU = (Template("swiglu", anchor="mul").node("act", aten.silu.default, aten.gelu.default)
       .node("mul", aten.mul.Tensor).edge("act", "mul"))

def _glu(m) -> bool:
    """A gated unit multiplies the activated gate by another tensor of its shape (the up projection, or the other
    half of a fused gate_up), computed without the gate: not by a number, a per-channel scale, the gate's own
    input (``silu(x) · x``) or a value made from it (``silu(x) · (x + 1)``, ``silu(x) · sigmoid(x)``)."""
    act, mul = m["act"], m["mul"]
    others = [a for a in mul.args if a is not act]
    if len(others) != 1 or not isinstance(others[0], fx.Node):
        return False
    gate, gates = act.args[0], set()
    while isinstance(gate, fx.Node):                # the gate and what it is a cast or view of, up to its source
        gates.add(gate)
        gate = gate.args[0] if gate.target in (aten._to_copy.default, aten.reshape.default, aten.expand.default,
                                               aten.unsqueeze.default, aten.clone.default) else None
    return tuple(val(others[0]).shape) == tuple(val(act).shape) and not _reads(others[0], gates)


def _reads(n: fx.Node, values: set) -> bool:
    """Whether n is one of ``values`` or is computed from one (at any depth)."""
    seen, stack = set(), [n]
    while stack:
        x = stack.pop()
        if x in values:
            return True
        if x not in seen:
            seen.add(x)
            stack.extend(x.all_input_nodes)
    return False


TEMPLATES = (RMS, ROPE, ROPE_PAIRS, ROPE_HALVES, GLU)


def _residual(x, inside) -> bool:
    """x, which a norm reads, is a residual sum of the region that leaves it too (AddRmsNorm's two outputs)."""
    return x.target == aten.add.Tensor and x in inside and any(u not in inside for u in x.users) \
        and all(isinstance(a, fx.Node) and val(a).shape == val(x).shape for a in x.args)


def names(nodes: list) -> list:
    """The known fused ops a region computes, in graph order (see the module docstring)."""
    if not nodes:
        return []
    gm = nodes[0].graph.owning_module
    view = graph_view(gm)
    inside = set(nodes)
    found = []                                       # (position, name)
    order = view.order

    def within(m):
        return all(v in inside for v in m.values())

    for m in RMS.match(view, lambda m: m if within(m) and _rms(m) else None,
                       seeds=[n.name for n in nodes if n.target == aten.rsqrt.default]):
        x = _uncast(m["sq"].args[0])
        if _centred(x):
            found.append((order[m["rsqrt"].name], "layer_norm"))
            continue
        found.append((order[m["rsqrt"].name], "add_rms_norm" if _residual(x, inside) else "rms_norm"))
    for n in nodes:
        if n.target == aten.layer_norm.default:
            found.append((order[n.name], "layer_norm"))
        elif n.target == aten.rms_norm.default:              # torch's own (nn.RMSNorm, F.rms_norm)
            found.append((order[n.name], "add_rms_norm" if _residual(n.args[0], inside) else "rms_norm"))
    for rope in (ROPE, ROPE_PAIRS):
        for m in rope.match(view, lambda m: m if within(m) and _rope(m) else None,
                            seeds=[n.name for n in nodes if n.target == aten.add.Tensor]):
            found.append((order[m["add"].name], "rope"))
    for m in ROPE_HALVES.match(view, lambda m: m if within(m) and _rope_halves(m) else None,
                               seeds=[n.name for n in nodes if n.target == aten.cat.default]):
        found.append((order[m["cat"].name], "rope"))
    for m in GLU.match(view, lambda m: m if within(m) and _glu(m) else None,
                       seeds=[n.name for n in nodes if n.target == aten.mul.Tensor]):
        found.append((order[m["mul"].name], "swiglu" if m["act"].target == aten.silu.default else "geglu"))
    out = []
    for _, name in sorted(found):
        if name not in out:
            out.append(name)
    return out


def region_name(nodes: list, matmul: bool = False) -> str:
    ns = names(nodes)
    if matmul:
        return "+".join(["matmul"] + ns) if ns else "matmul_epilogue"
    return "+".join(ns) if ns else "vector_chain"


# ------------------------------------------------------------------------------------------- matches

def _match(family: str, nodes: list, built, matmul=None) -> Match:
    """The match of a region. Its inputs ``in{i}`` are numbered as the program's (the epilogue's from its
    input 1); a keep-mask the fused call draws has no node: ``params["draws"]`` lists those numbers with the
    dropout's p, the dtype eager draws in and the memory order of its draws
    (:func:`autofuse.graph.keep_mask_order`, None for row-major), ``((i, p, dtype, order), ...)``."""
    outs = {f"out{i}": n.name for i, n in enumerate(built.outputs)}
    skip = 0 if matmul is None else 1
    inputs = {f"in{i - skip}": n.name for i, n in enumerate(built.inputs) if i >= skip and n is not None}
    draws = tuple((i - skip, p, str(val(d.args[0]).dtype).replace("torch.", ""), keep_mask_order(d))
                  for i, (d, p) in sorted(built.draws.items()))
    body = nodes if matmul is None else [matmul] + nodes
    params = dict(family=family, program=built.program, input_shapes=tuple(built.input_shapes),
                  output_shapes=tuple(built.output_shapes), out_likes=tuple(val(n) for n in built.outputs),
                  name=region_name(nodes, matmul is not None), draws=draws)
    if matmul is not None:
        a, w, bias, trans_b = _matmul_operands(matmul)
        inputs = {"a": a.name, "b": w.name, **({"bias": bias.name} if bias is not None else {}), **inputs}
        params.update(trans_b=trans_b, extra_shapes=tuple(built.input_shapes[1:]))
    order = [n.name for n in body]
    anchor = built.outputs[0].name
    return Match(params["name"], tuple(order), anchor, inputs, params, outs)


def _matmul_operands(m: fx.Node):
    """(a, b, bias, trans_b) of a linear / matmul / addmm node, b as stored."""
    if m.target == aten.linear.default:
        return m.args[0], m.args[1], (m.args[2] if len(m.args) > 2 else None), True
    if m.target == aten.addmm.default:
        return m.args[1], m.args[2], m.args[0], False
    return m.args[0], m.args[1], None, False


def _epilogue_ok(m: fx.Node) -> bool:
    """A 2-D weight (a projection), operands of one float dtype, no batch on the weight side."""
    if m.op != "call_function" or m.target not in MATMULS or (m.target == aten.addmm.default and m.kwargs):
        return False
    a, b, bias, _ = _matmul_operands(m)
    if not all(isinstance(t, fx.Node) for t in (a, b)) or len(shape(b)) != 2 or len(shape(a)) < 2:
        return False
    if bias is not None and (not isinstance(bias, fx.Node) or len(shape(bias)) != 1):
        return False
    return val(a).dtype == val(b).dtype and val(a).dtype in (torch.float16, torch.bfloat16, torch.float32)


def cut_at_returned(nodes: list, out: set) -> list:
    """``nodes`` cut so that no part both computes a value the graph returns and reads it: the readers of such a
    value (and what they compute, within the region) go to other parts, which read the returned tensor. One
    fused call that also used the value inside would sum that use's gradient straight into its own inputs,
    past the returned tensor: its ``retain_grad()``, its hooks and ``autograd.grad`` with respect to it would
    not see the gradient of the model's later uses, as they do in eager. The region is convex and nothing below
    the value reaches back above it, so each part is convex too."""
    o = returned_read(nodes, out)
    if o is None:
        return [nodes]
    return [q for part in _parts(nodes, _below(nodes, [o])) for q in cut_at_returned(part, out)]


def _candidates(gm: fx.GraphModule) -> list:
    """``(nodes, built)`` of every region that builds (cached on the graph module: both families read them). In a
    graph captured with grad, a region that reads a value the graph returns (a residual stream returned as a
    hidden state, then normed) is offered whole, which the planner refuses and reports, and cut there
    (:func:`cut_at_returned`), its parts offered too."""
    cache = gm.__dict__.get("_autofuse_regions")
    if cache is None or cache[0] != len(gm.graph.nodes):
        out = returned(gm) if gm.meta.get("autofuse_grad", True) else set()
        found = []
        for nodes in regions(gm):
            for part, built in build(nodes):
                found.append((part, built))
                pieces = cut_at_returned(part, out) if out else [part]
                if len(pieces) > 1:
                    found += [r for piece in pieces for r in build(piece)]
        cache = (len(gm.graph.nodes), found)
        gm.__dict__["_autofuse_regions"] = cache
    return cache[1]


@register("vector_chain")
def find_vector_chains(gm: fx.GraphModule) -> list[Match]:
    """Every Vector region of ``gm`` that one generated kernel can run (see the module docstring); a region of a
    single op gains nothing and is not offered (as a matmul's epilogue it may be)."""
    return [_match("vector_chain", nodes, built) for nodes, built in _candidates(gm)
            if sum(_compute(n) for n in nodes) >= 2]


def _scaled_after_a_float16_product(nodes, mm) -> bool:
    """A region that starts by scaling a float16 product by less than 1, where eager scaled the matmul's operand
    (the canonical form moves the scale after the product): the epilogue would take the product unscaled in
    float16, which overflows where eager's (x·0.01) @ W does not."""
    from autofuse.canonicalize import MOVED_SCALE
    return val(mm).dtype == torch.float16 and any(
        MOVED_SCALE in n.meta and mm in n.all_input_nodes and abs(n.meta[MOVED_SCALE]) < 1 for n in nodes)


@register("matmul_epilogue")
def find_matmul_epilogues(gm: fx.GraphModule) -> list[Match]:
    """Each region after a matmul whose output only that region reads (by one op or several), as the matmul's
    epilogue."""
    return _epilogues(_candidates(gm))


def _epilogues(found: list) -> list[Match]:
    """The matmul epilogues of the regions ``found`` (``(nodes, built)``, see :func:`find_matmul_epilogues`)."""
    out = []
    for nodes, _ in found:
        inside = set(nodes)
        feeds = []                     # (matmul, the views between it and the region)
        for n in nodes:
            for a in n.all_input_nodes:
                views = []
                while a not in inside and a.target in _VIEWS and a.all_input_nodes and \
                        all(u in inside or u in views for u in a.users):
                    views.append(a)    # a matmul whose rows the model regroups (GPT-2's addmm on [B*S, H])
                    a = a.args[0]
                if a not in inside and _epilogue_ok(a) and \
                        all(u in inside or u in views for u in a.users) and a not in [f for f, _ in feeds]:
                    # every reader of the product is in the region, once or several times (x·sigmoid(1.702x),
                    # gelu_new's x·(1 + tanh(c(x + 0.044715x³))))
                    feeds.append((a, views))
        for mm, views in feeds:
            if _scaled_after_a_float16_product(nodes, mm):
                continue
            try:
                built = program_from_nodes(nodes + views, outputs=[n for n in nodes if any(
                    u not in inside for u in n.users)], first=mm)
            except NotExpressible:
                continue
            out.append(_match("matmul_epilogue", nodes + views, built, matmul=mm))
    return out


def outside_blocks(gm: fx.GraphModule, blocks: list) -> list[Match]:
    """The regions of ``gm`` that overlap one of ``blocks`` (matches of the pattern families), offered again
    without that block's nodes, as regions and as epilogues: where the block wins the overlap, the rest of the
    region still fuses (Swin v2's relative position bias ``16·sigmoid(table)`` at batch 1, where the bias and the
    scores' sum share one iteration space and so one region, and the attention block takes the sum). A part never
    holds both a node computed from the block (through any path: a block may read the region at one node and give
    it a value back at another, through ops of its own outside the region) and one that is not, which would make a
    cycle of the two calls; each part is convex as the region is. A part of one compute op gains nothing and is
    not offered as a region (as an epilogue it may be)."""
    found = _candidates(gm)
    out_values = returned(gm) if gm.meta.get("autofuse_grad", True) else set()
    by_name = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    seen, parts = set(), []
    for nodes, _ in found:
        names = {n.name for n in nodes}
        for b in blocks:
            taken = names.intersection(b.nodes)
            if not taken or taken == names:
                continue
            rest = [n for n in nodes if n.name not in taken]
            key = tuple(n.name for n in rest)
            if key in seen:
                continue
            seen.add(key)
            below = _reached(rest, [by_name[t] for t in b.nodes if t in by_name], order)
            for part in _parts(rest, below):
                for piece in (cut_at_returned(part, out_values) if out_values else [part]):
                    parts += build(piece)
    return [_match("vector_chain", nodes, built) for nodes, built in parts
            if sum(_compute(n) for n in nodes) >= 2] + _epilogues(parts)


def _reached(nodes: list, tops: list, order: dict) -> set:
    """The members of ``nodes`` computed from one of ``tops`` through any path of the graph (not only through
    members, as :func:`_below`); the walk stops past the last member (``order``: each node's position)."""
    end = max(order[n] for n in nodes)
    seen, stack = set(tops), list(tops)
    while stack:
        for u in stack.pop().users:
            if u not in seen and order[u] <= end:
                seen.add(u)
                stack.append(u)
    return seen.intersection(nodes)
