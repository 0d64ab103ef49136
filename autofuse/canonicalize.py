"""Canonicalize: one spelling per operation, so patterns are written once.

A pass is a table of rules ``(targets, fn)``; ``fn(node)`` returns a node that computes the same
value (built with :func:`autofuse.graph.call` at the insert point just before ``node``) or None.
One driver, :func:`canonicalize`, applies the table to a fixpoint:

1. copy the GraphModule (new graph, parameters shared), so the input is never mutated;
2. merge duplicate pure nodes (CSE), so ``exp(x) / exp(x).sum()`` sees one ``exp``;
3. visit nodes in order; the first rule whose target matches and whose ``fn`` returns a node wins;
   the replacement is accepted only if its FakeTensor has the same shape and dtype as the original
   (a cheap guard against a wrong rule); uses are redirected, dead nodes removed;
4. repeat until nothing changes (at most ``max_iters`` sweeps), then lint and recompile.

Canonical spellings (what patterns may assume):

* matmul family -> ``aten.matmul`` (bmm, mm, two-operand einsum, baddbmm = matmul·alpha + bias·beta)
* a row statistic's inverse root (``y ** -0.5``, ``1 / sqrt(y)``, ``x / sqrt(y)``) -> ``aten.rsqrt`` (times x); a
  population variance over the last dim -> ``mean((x - mean(x)) ** 2)``
* scalar scaling -> ``aten.mul.Tensor(x, c)`` with Python ``c``; divisions become multiplications (marked with
  their divisor, ``meta[DIVISOR]``: a generated kernel divides, as eager does), chained scalars fold (where eager's
  first product cannot overflow alone, :func:`_folds`), and a scalar on a matmul operand (pre-scaled q or k),
  possibly behind views, moves to the matmul output
* softmax -> ``aten.softmax.int(x, dim<0)`` (function/method/module, ``_softmax``, ``_safe_softmax``,
  ``exp(x - max) / sum``, ``exp(x - logsumexp)``, ``exp(log_softmax)``, ``softmax(x - max)``); a ``dtype=`` argument
  becomes an explicit cast
* one-element constants (``torch.sqrt(torch.tensor(d))``, real 0-d buffers) become Python scalars
* batch-dim reshapes around a matmul (heads folded into the batch for ``bmm``) move to its operands,
  so a matmul is always at the highest batch rank available
* casts -> ``aten._to_copy(x, dtype=d)``; casts to the same dtype, clones, detach and ``pass_gradient`` (in a
  graph captured without grad; with grad each routes the gradient and stays), eval-mode
  dropout and same-shape views/expands disappear; every view spelling becomes ``aten.reshape``
* a swap of the last two dims -> ``aten.transpose.int(x, -2, -1)``; any other permutation ->
  ``aten.permute`` (chains composed; a permutation that ends in a last-two swap is split into
  ``transpose(permute(x))``; a reshape of leading dims, and a cast, are moved inside a last-two transpose)
* GQA ``unsqueeze -> expand -> reshape`` (transformers' ``repeat_kv``) -> ``aten.repeat_interleave`` (a cast of
  its result moves inside it)
* masks -> ``aten.where.ScalarOther(keep, x, fill)`` where True = keep (from ``masked_fill``,
  ``where`` with the fill on either side or as a 0-d constant tensor); additive masks stay ``add``
* ``F.scaled_dot_product_attention`` variants -> ``aten.scaled_dot_product_attention``

The canonical graph is a view for matching, never executed. Every canonical node that computes the
value of a captured node records that node's name in ``meta["autofuse_origin"]`` (copied nodes their
own; a rule's replacement inherits the origin of the node it replaces), so a match found here can be
mapped back onto the captured graph (:mod:`autofuse.rewrite`). Values the user owns (parameters and
buffers, ``meta["autofuse_state"]``) are never folded into constants: a 0-d parameter stays a tensor
operand. ``_safe_softmax`` becomes ``softmax`` with ``meta["autofuse_safe_softmax"] = True`` (the two
differ on rows that are entirely ``-inf``: 0 vs NaN); ``exp(x - logsumexp(x))`` becomes ``softmax`` with
``meta["autofuse_lse_softmax"] = True`` (the two differ on rows whose max is ``+inf``: ``logsumexp`` is +inf
there, so ``exp(x - inf)`` is 0 at the finite entries where ``softmax`` is NaN over the row; a family that
matches the softmax gives the logsumexp spelling's values or leaves the node alone). Post-dispatch matmul expansions (``expand -> clone -> _unsafe_view -> bmm``) are not
folded back into one matmul: both capture routes keep ``aten.matmul`` whole.
"""
from __future__ import annotations

import logging
import math
import operator
import string

import torch
import torch.fx as fx

from autofuse.grad_ops import PASS_GRADIENT
from autofuse.graph import (arg, call, copy_graph_module, draw_order, effectful, get_attr_value, is_call, is_number,
                            shape, val)

aten = torch.ops.aten
log = logging.getLogger(__name__)

INT_MAX = 2**63 - 1
STRICT = False  # tests set True: a rule that raises is a bug, not a skipped node
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _rank(n):
    return len(shape(n))


def _swap_last(r):
    return tuple(range(r - 2)) + (r - 1, r - 2)


def _cast(x, d):
    return x if val(x).dtype == d else call(x.graph, aten._to_copy.default, x, dtype=d)


def _permute(x, perm):
    perm = tuple(p % len(perm) for p in perm)
    if perm == tuple(range(len(perm))):
        return x
    return call(x.graph, aten.permute.default, x, list(perm))


def _perm_of(n):
    """The permutation a transpose/permute node applies, or None."""
    if is_call(n, aten.permute.default):
        return tuple(p % _rank(n) for p in n.args[1])
    if is_call(n, aten.transpose.int):
        r, p = _rank(n), list(range(_rank(n)))
        a, b = n.args[1] % r, n.args[2] % r
        p[a], p[b] = p[b], p[a]
        return tuple(p)
    return None


def const_value(n):
    """The Python number a 0-d constant node holds (full([], v), scalar_tensor(v), real 0-d attr), or None."""
    if is_number(n):
        return n
    if is_call(n, aten.full.default) and list(n.args[0]) == []:
        return n.args[1]
    if is_call(n, aten.scalar_tensor.default):
        return n.args[0]
    if is_call(n, aten.full_like.default) or is_call(n, aten.lift_fresh_copy.default):
        return const_value(n.args[1]) if is_call(n, aten.full_like.default) else const_value(n.args[0])
    if isinstance(n, fx.Node) and n.op == "get_attr" and not is_state(n):
        t = get_attr_value(n.graph.owning_module, n.target)
        if isinstance(t, torch.Tensor) and t.numel() == 1 and t.device.type != "meta":
            return t.item()
    return None


def is_state(n) -> bool:
    """A parameter or buffer of the user's model: its value may change after planning."""
    return isinstance(n, fx.Node) and n.op == "get_attr" and "autofuse_state" in n.meta


def constant_scalar(n):
    """A Python number for a one-element tensor computed only from constants (e.g. ``torch.sqrt(
    torch.tensor(64.))``, a real 0-d buffer), or the number itself; else None. Evaluated on CPU."""
    if is_number(n):
        return n
    v = val(n)
    if v is None or v.numel() != 1 or v.dim() != 0:
        return None
    direct = const_value(n)
    if direct is not None:
        return direct
    t = evaluate_constant(n, max_nodes=20)
    return t.item() if t is not None else None


#: The most elements a constant's value may hold for it to be evaluated to prove what it is (a causal mask, a
#: sliding window's band) and to stand for itself in a reduced-shape check: 2 x 8192^2 fits
LARGEST_CONSTANT = 1 << 28


def _allocated(v) -> int:
    """Elements a value holds in memory: a broadcast (stride-0) dim of an expanded view holds one."""
    try:
        return math.prod(s for s, st in zip(v.shape, v.stride()) if st != 0)
    except Exception:  # noqa: BLE001 - a value without strides: count every element
        return v.numel()


def evaluate_constant(m: fx.Node, max_nodes: int = 500, max_numel: int = 1 << 24, state: list | None = None):
    """Evaluate ``m`` on CPU if it depends only on constants (factory ops, real attributes); else None.
    ``max_numel`` bounds the elements any value of it holds in memory (an expanded view holds its source's); a
    value is dropped once the last node reading it has run.

    ``device=`` arguments are redirected to CPU, so constants built on the meta device (a model
    captured on meta) still evaluate; a meta *attribute* has no data and makes ``m`` non-constant.
    A parameter or buffer makes ``m`` non-constant, unless ``state`` is a list: then its current value is
    used and its dotted name appended to ``state``, so the caller can guard what it concluded. A tensor that
    requires grad (a trainable parameter) always makes ``m`` non-constant: a guard keeps the forward right when
    its value changes, but a conclusion drawn from its value (Swin's relative position bias, all zeros at
    initialisation, proven no mask) would cut the path its gradient takes."""
    order, seen, stack = [], set(), [m]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        v = val(n)
        if n.op == "placeholder" or len(seen) > max_nodes or (v is not None and _allocated(v) > max_numel):
            return None
        if effectful(n):
            return None
        order.append(n)
        stack.extend(n.all_input_nodes)
    pos = {n: i for i, n in enumerate(m.graph.nodes)}
    order.sort(key=pos.__getitem__)
    last = {}                                   # node -> the step of the last node reading it
    for i, n in enumerate(order):
        for x in n.all_input_nodes:
            last[x] = i
    env, reads = {}, []
    try:
        for i, n in enumerate(order):
            if n.op == "get_attr":
                if is_state(n):
                    if state is None:
                        return None
                    reads.append(n.meta["autofuse_state"])
                t = get_attr_value(n.graph.owning_module, n.target)
                if isinstance(t, torch.Tensor) and (t.device.type == "meta" or t.requires_grad):
                    return None
                env[n] = t
            elif n.op == "call_function":
                args, kwargs = fx.map_arg((n.args, n.kwargs), lambda x: env[x])
                if "device" in kwargs:
                    kwargs = dict(kwargs, device="cpu")
                env[n] = n.target(*args, **kwargs)
                for x in n.all_input_nodes:
                    if last[x] == i and x is not m:
                        env.pop(x, None)
            else:
                return None
    except Exception:  # noqa: BLE001 - anything we cannot evaluate is simply not a constant
        return None
    out = env[m]
    if isinstance(out, torch.Tensor) and out.device.type == "meta":
        return None
    if state is not None:
        state.extend(r for r in reads if r not in state)
    return out


# ----------------------------------------------------------------------------------------- identities

def _identity(n):
    return n.args[0]


def _drop_clone(n):
    gm = n.graph.owning_module
    if n.target in (aten.detach.default, PASS_GRADIENT) and gm is not None:
        if gm.meta.get("autofuse_grad", True):
            return None       # a graph autograd may differentiate: detach stops the gradient, it stays
        gm.meta["autofuse_dropped_detach"] = True     # a plan not to run where autograd may differentiate
    return n.args[0]


def _eval_dropout(n):
    p, train = arg(n, 1, "p"), arg(n, 2, "train")
    return n.args[0] if (not train or p == 0) else None


def _eval_native_dropout(n):
    src = n.args[0]
    if n.target is operator.getitem and n.args[1] == 0 and is_call(src, aten.native_dropout.default):
        # in training, native_dropout draws its mask even at p = 0: it stays, so a fusion keeps the draw
        return src.args[0] if not arg(src, 2, "train") else None
    return None


def _to_copy(n):
    extra = {k: v for k, v in n.kwargs.items() if k != "dtype"}
    if extra or len(n.args) > 1:
        return None
    d = n.kwargs.get("dtype")
    return n.args[0] if d is None or d == val(n.args[0]).dtype else None


def _to_dtype(n):
    return _cast(n.args[0], n.args[1])


def _type_as(n):
    return _cast(n.args[0], val(n.args[1]).dtype)


def _view_to_reshape(n):
    x = n.args[0]
    if shape(x) == shape(n):
        return x
    if is_call(x, *VIEWS):
        x = x.args[0]
    return call(n.graph, aten.reshape.default, x, list(shape(n)))


def _reshape(n):
    x = n.args[0]
    if shape(x) == shape(n):
        return x
    if is_call(x, aten.reshape.default):
        return call(n.graph, aten.reshape.default, x.args[0], list(shape(n)))
    return None


def _expand(n):
    return n.args[0] if shape(n.args[0]) == shape(n) else None


def _slice(n):
    x, dim = n.args[0], arg(n, 1, "dim", 0)
    start, end, step = arg(n, 2, "start", None), arg(n, 3, "end", None), arg(n, 4, "step", 1)
    full = (start in (None, 0)) and (end is None or end >= shape(x)[dim]) and step == 1
    return x if full else None


# --------------------------------------------------------------------------------------- matmul family

def _bmm(n):
    return call(n.graph, aten.matmul.default, n.args[0], n.args[1])


def _baddbmm(n):
    bias, a, b = n.args[:3]
    beta, alpha = n.kwargs.get("beta", 1), n.kwargs.get("alpha", 1)
    out = call(n.graph, aten.matmul.default, a, b)
    if alpha != 1:
        out = call(n.graph, aten.mul.Tensor, out, alpha)
    if beta == 0:
        return out
    if beta != 1:
        bias = call(n.graph, aten.mul.Tensor, bias, beta)
    return call(n.graph, aten.add.Tensor, out, bias)


def _einsum(n):
    """Two-operand einsum with one contracted, one free index per operand, rest batch -> matmul."""
    eq, ops = n.args[0].replace(" ", ""), n.args[1]
    if len(ops) != 2 or "->" not in eq:
        return None
    ins, out = eq.split("->")
    sa, sb = ins.split(",")
    a, b = ops
    spare = [c for c in string.ascii_uppercase if c not in eq]
    subs = []
    for s, x in ((sa, a), (sb, b)):
        if "..." in s:
            k = _rank(x) - (len(s) - 3)
            subs.append(k)
    if subs and len(set(subs)) != 1:
        return None
    ell = "".join(spare[: subs[0]]) if subs else ""
    sa, sb, out = (s.replace("...", ell) for s in (sa, sb, out))
    if any(len(set(s)) != len(s) for s in (sa, sb, out)):
        return None
    batch = [c for c in out if c in sa and c in sb]
    contr = [c for c in sa if c in sb and c not in out]
    fa, fb = [c for c in sa if c not in sb], [c for c in sb if c not in sa]
    if len(contr) != 1 or len(fa) != 1 or len(fb) != 1 or set(out) != set(batch + fa + fb):
        return None
    if any(shape(a)[sa.index(c)] != shape(b)[sb.index(c)] for c in batch):
        return None
    A = _permute(a, [sa.index(c) for c in batch + fa + contr])
    B = _permute(b, [sb.index(c) for c in batch + contr + fb])
    mm = call(n.graph, aten.matmul.default, A, B)
    res = batch + fa + fb
    return _permute(mm, [res.index(c) for c in out])


def _regroups_batch(src, dst) -> bool:
    """dst is src with only its leading (batch) dims regrouped; the last two dims unchanged."""
    return (len(src) >= 2 and len(dst) >= 2 and tuple(src[-2:]) == tuple(dst[-2:])
            and math.prod(src[:-2]) == math.prod(dst[:-2]))


def _split_matmul(n):
    """reshape(matmul(a, b)) that splits batch dims -> matmul(reshape(a), reshape(b))."""
    mm, s = n.args[0], shape(n)
    if not (is_call(mm, aten.matmul.default) and len(mm.users) == 1 and len(s) > _rank(mm)):
        return None
    a, b = mm.args
    if not (_rank(a) == _rank(b) == _rank(mm) and shape(a)[:-2] == shape(b)[:-2] and _regroups_batch(shape(mm), s)):
        return None
    ra = call(n.graph, aten.reshape.default, a, [*s[:-2], *shape(a)[-2:]])
    rb = call(n.graph, aten.reshape.default, b, [*s[:-2], *shape(b)[-2:]])
    return call(n.graph, aten.matmul.default, ra, rb)


def _lift_matmul(n):
    """matmul(reshape(x), b) where the reshape merged batch dims of x -> reshape(matmul(x, reshape(b)))."""
    a, b = n.args
    if not (_rank(a) == _rank(b) >= 3 and shape(a)[:-2] == shape(b)[:-2]):
        return None
    for i, x in enumerate((a, b)):
        if (is_call(x, aten.reshape.default) and not is_call(x.args[0], aten.expand.default)  # expand: repeat_kv
                and _rank(x.args[0]) > _rank(x) and _regroups_batch(shape(x.args[0]), shape(x))):
            hi = shape(x.args[0])[:-2]
            other = (b, a)[i]
            other = call(n.graph, aten.reshape.default, other, [*hi, *shape(other)[-2:]])
            ops = (x.args[0], other) if i == 0 else (other, x.args[0])
            return call(n.graph, aten.reshape.default, call(n.graph, aten.matmul.default, *ops), list(shape(n)))
    return None


def _merged(x):
    """The higher-rank source of a reshape that merged batch dims (last two dims kept), else None."""
    if (is_call(x, aten.reshape.default) and not is_call(x.args[0], aten.expand.default)
            and _rank(x.args[0]) > _rank(x) and _regroups_batch(shape(x.args[0]), shape(x))):
        return x.args[0]
    return None


def _sink_merge(n):
    """op(reshape_merge(x)) -> reshape_merge(op(x)) for ops that act per row of the last dim, so
    scores that were folded to 3-D for a bmm are scaled, masked and normalised at full rank."""
    x = n.args[0] if n.target != aten.where.ScalarOther else n.args[1]
    hi = _merged(x) if isinstance(x, fx.Node) else None
    if hi is None:
        return None
    hs = list(shape(hi))
    if n.target == aten.softmax.int and n.args[1] == -1 and len(n.args) == 2:
        new = call(n.graph, aten.softmax.int, hi, -1)
        for k in ("autofuse_safe_softmax", "autofuse_lse_softmax"):     # the softmax keeps what it stands for
            if k in n.meta:
                new.meta[k] = n.meta[k]
    elif n.target == aten.mul.Tensor and is_number(n.args[1]):
        new = call(n.graph, aten.mul.Tensor, hi, n.args[1])
    elif n.target == aten._to_copy.default and set(n.kwargs) == {"dtype"} and len(n.args) == 1:
        new = call(n.graph, aten._to_copy.default, hi, dtype=n.kwargs["dtype"])
    elif n.target in (aten.add.Tensor, aten.where.ScalarOther) and not n.kwargs:
        other = n.args[1] if n.target == aten.add.Tensor else n.args[0]
        if not isinstance(other, fx.Node) or len(shape(other)) > 2 and shape(other) != shape(n):
            return None
        if shape(other) == shape(n) and len(shape(other)) > 2:
            other = call(n.graph, aten.reshape.default, other, hs)
        new = (call(n.graph, aten.add.Tensor, hi, other) if n.target == aten.add.Tensor
               else call(n.graph, aten.where.ScalarOther, other, hi, n.args[2]))
    else:
        return None
    return call(n.graph, aten.reshape.default, new, list(shape(n)))


def _splits(terms, folded, to) -> bool:
    """Whether a sum of terms shaped ``terms`` (the sum shaped ``folded``, batch dims folded into its leading ones)
    is added at full rank when ``to`` splits those dims (see :func:`_split_add`): every term has the sum's rank, the
    sum's batch dims or 1 in all of them (broadcast over the batch), and 1 or the sum's size in each of the last
    two."""
    folded, to = tuple(folded), tuple(to)
    # a batch dim to regroup: [T, C] viewed [1, T, C] (a token-major sum given its batch back) is left as it is
    return (len(to) > len(folded) >= 3 and _regroups_batch(folded, to)
            and all(len(t) == len(folded) and (tuple(t[:-2]) == folded[:-2] or all(d == 1 for d in t[:-2]))
                    and all(d in (1, f) for d, f in zip(t[-2:], folded[-2:])) for t in map(tuple, terms)))


def _split_add(n):
    """reshape(add(a, b)) regrouping batch dims, a and b with the full batch dims or broadcast over them (either
    may broadcast in the last two: Bloom's ALiBi bias ``[B·H, 1, S]`` added by ``baddbmm``; at batch 1 its mask
    ``[1, S, S]`` broadcast over the heads) -> add(reshape(a), reshape(b))."""
    ad, s = n.args[0], shape(n)
    if not (is_call(ad, aten.add.Tensor) and not ad.kwargs and len(ad.users) == 1
            and all(isinstance(t, fx.Node) for t in ad.args) and _splits([shape(t) for t in ad.args], shape(ad), s)):
        return None
    a, b = (call(n.graph, aten.reshape.default, t, [*(s[:-2] if tuple(shape(t)[:-2]) == tuple(shape(ad)[:-2])
                                                      else [1] * (len(s) - 2)), *shape(t)[-2:]])
            for t in ad.args)
    return call(n.graph, aten.add.Tensor, a, b)


def _split_batch_add(n):
    """add(reshape(s, [B1, B2, *rest]), m), the reshape splitting only the leading dim of s (B = B1·B2) and m
    broadcast into the sum -> reshape(add(s, m'), [B1, B2, *rest]), m' the term each of the B rows reads: m
    broadcast over the two split dims and merged into one, ``[B, *m's other dims]`` (``[1, ...]`` when m is 1 on
    both). Swin v2's window mask: scores ``[B, H, N, N]`` viewed ``[B/nW, nW, H, N, N]`` plus ``mask[nW, N, N]``
    unsqueezed to ``[1, nW, 1, N, N]``, i.e. ``mask[b % nW]`` added to row b. Every sum is the same one, in the same
    dtype, so the scores keep their rank and their additive terms are seen as masks."""
    if n.kwargs or len(n.args) != 2 or not all(isinstance(a, fx.Node) for a in n.args):
        return None
    for r, m in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        if not is_call(r, aten.reshape.default) or not isinstance(r.args[0], fx.Node):
            continue
        s = r.args[0]
        ss, rs, ms, ns = tuple(shape(s)), tuple(shape(r)), tuple(shape(m)), tuple(shape(n))
        if not (ns == rs and len(ss) >= 3 and len(rs) == len(ss) + 1 and rs[2:] == ss[1:] and rs[0] * rs[1] == ss[0]
                and len(ms) <= len(rs) and val(m).is_floating_point() and val(n).dtype == val(s).dtype):
            continue
        mp = (1,) * (len(rs) - len(ms)) + ms
        if any(d not in (1, f) for d, f in zip(mp, rs)):
            continue
        folded = [1 if mp[:2] == (1, 1) else ss[0], *mp[2:]]
        if _splits((ss, folded), ss, rs):
            # _split_add would add these at full rank again (a folded term split the same way: Bloom's ALiBi bias,
            # which has the scores' shape at one query): the sum stays at full rank, and the rules do not undo
            # each other until canonicalize gives up
            continue
        g = n.graph
        mm = m if ms == mp else call(g, aten.reshape.default, m, list(mp))
        if mp[:2] != (1, 1) and mp[:2] != rs[:2]:
            mm = call(g, aten.expand.default, mm, [*rs[:2], *mp[2:]])
        mm = call(g, aten.reshape.default, mm, folded)
        return call(g, aten.reshape.default, call(g, aten.add.Tensor, s, mm), list(rs))
    return None


def _add_zero(n):
    """x + zeros (a constant that broadcasts into x's shape) is x."""
    for x, z in ((n.args[0], n.args[1]), (n.args[1], n.args[0])):
        if (isinstance(z, fx.Node) and isinstance(x, fx.Node) and not n.kwargs
                and is_call(z, aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)):
            return x
    return None


# ----------------------------------------------------------------------------------------------- scale

def _div_scalar(n):
    x, c = n.args[0], constant_scalar(n.args[1])
    if is_number(c) and c != 0 and val(x).is_floating_point() and not n.kwargs:
        prod = call(n.graph, aten.mul.Tensor, x, 1.0 / c)
        prod.meta[DIVISOR] = c          # a generated kernel divides, as eager does (1/c is rounded; x/c once)
        return prod
    t = n.args[1]
    if (c is None and n.target == aten.div.Tensor and isinstance(t, fx.Node) and not n.kwargs and val(t) is not None
            and val(t).dim() == 0 and val(t).is_floating_point() and val(x).is_floating_point()):
        return call(n.graph, aten.mul.Tensor, x, call(n.graph, aten.reciprocal.default, t))  # a live 0-d divisor
    return None


def _mul(n):
    x, c = n.args[0], n.args[1]
    if is_number(x) and isinstance(c, fx.Node):
        return call(n.graph, aten.mul.Tensor, c, x)
    if isinstance(c, fx.Node) and constant_scalar(c) is not None:
        return call(n.graph, aten.mul.Tensor, x, constant_scalar(c))
    if isinstance(x, fx.Node) and isinstance(c, fx.Node) and constant_scalar(x) is not None:
        return call(n.graph, aten.mul.Tensor, c, constant_scalar(x))
    if not is_number(c) or not val(x).is_floating_point():
        return None
    if c == 1:
        return x
    if is_call(x, aten.mul.Tensor) and is_number(x.args[1]) and _folds(x.args[0], x.args[1], c):
        return call(n.graph, aten.mul.Tensor, x.args[0], x.args[1] * c)
    return None


def _folds(x, a, b) -> bool:
    """Whether ``(x·a)·b`` is ``x·(ab)`` where eager overflows too: ``x·a`` cannot overflow (``|a| <= 1``, or x a
    ``tanh`` or ``sigmoid``), or ``x·(ab)`` overflows wherever it does (``|b| >= 1``). Not so: a masked score
    filled with ``finfo.min``, doubled and halved, is ``-inf`` in eager."""
    return abs(a) <= 1 or abs(b) >= 1 or is_call(x, aten.tanh.default, aten.sigmoid.default)


def _statistic(y) -> bool:
    """y is a row statistic (a reduction over a dim, possibly plus eps, scaled or cast), whatever its size (one row
    of a decode step too): not a scale (a learnable temperature, whose canonical form a fused call may have to
    rebuild in its preamble, which takes no ``rsqrt``)."""
    while is_call(y, aten.add.Tensor, aten.add.Scalar, aten.mul.Tensor, aten._to_copy.default):
        y = y.args[0]
    return is_call(y, aten.mean.dim, aten.sum.dim_IntList, aten.var.dim, aten.var.correction) and \
        val(y).is_floating_point()


def _rsqrt(n):
    """``pow(y, -0.5)`` and ``reciprocal(sqrt(y))`` of a row statistic are ``rsqrt(y)`` (a norm's inverse root,
    however spelled)."""
    if n.target == aten.pow.Tensor_Scalar and n.args[1] == -0.5 and _statistic(n.args[0]):
        return call(n.graph, aten.rsqrt.default, n.args[0])
    if n.target == aten.reciprocal.default and is_call(n.args[0], aten.sqrt.default) and \
            _statistic(n.args[0].args[0]):
        return call(n.graph, aten.rsqrt.default, n.args[0].args[0])
    return None


def _div_sqrt(n):
    """``x / sqrt(y)`` of a row statistic y is ``x * rsqrt(y)`` (a norm divided by its root, as LayerNorm is often
    written)."""
    x, s = n.args[0], n.args[1]
    if (n.target == aten.div.Tensor and not n.kwargs and isinstance(x, fx.Node) and is_call(s, aten.sqrt.default)
            and _statistic(s.args[0]) and val(x).is_floating_point()):
        return call(n.graph, aten.mul.Tensor, x, call(n.graph, aten.rsqrt.default, s.args[0]))
    return None


def _var(n):
    """``var(x, -1, correction=0)`` is ``mean((x - mean(x))²)`` over the last dim: a LayerNorm's statistic however
    spelled (an unbiased variance is not one and stays)."""
    x, dims = n.args[0], arg(n, 1, "dim")
    if n.target == aten.var.dim:            # var(x, dim, unbiased=True, keepdim=False)
        population, keep = not arg(n, 2, "unbiased", True), arg(n, 3, "keepdim", False)
    else:                                   # var(x, dim, *, correction=None, keepdim=False)
        population, keep = n.kwargs.get("correction", 1) == 0, n.kwargs.get("keepdim", False)
    if not population or not dims or len(dims) != 1 or dims[0] % _rank(x) != _rank(x) - 1 \
            or not val(x).is_floating_point():
        return None
    d = call(n.graph, aten.sub.Tensor, x, call(n.graph, aten.mean.dim, x, [-1], True))
    return call(n.graph, aten.mean.dim, call(n.graph, aten.pow.Tensor_Scalar, d, 2), [-1], bool(keep))


def inplace_edit(n) -> bool:
    """True if the user wrote this op in place (``p.mul_(2)``); export functionalises it, and
    ``meta["torch_fn"]`` still names the in-place method. Such values are not reassociated."""
    fn = n.meta.get("torch_fn") if isinstance(n, fx.Node) else None
    name = fn[1].rsplit(".", 1)[-1] if fn else ""
    return name.endswith("_") and not name.endswith("__") or name in ("__setitem__", "__iadd__", "__imul__")


def _scalar_of(x):
    """(inner, c) if x = mul(inner, c) with Python scalar c, else None."""
    if inplace_edit(x):
        return None
    if is_call(x, aten.mul.Tensor) and is_number(x.args[1]) and val(x.args[0]).is_floating_point():
        return x.args[0], x.args[1]
    return None


#: node.meta key of a product by ``1/c`` that eager computed as a division by the number ``c`` (the value)
DIVISOR = "autofuse_divisor"

#: node.meta key of a product scaled by a number that eager applied to one of the matmul's operands (the value)
MOVED_SCALE = "autofuse_moved_scale"


def _matmul_scale(n):
    a, b = n.args[0], n.args[1]
    for i, x in enumerate((a, b)):
        sc = _scalar_of(x)
        if sc:
            new = [a, b]
            new[i] = sc[0]
            scaled = call(n.graph, aten.mul.Tensor, call(n.graph, aten.matmul.default, *new), sc[1])
            scaled.meta[MOVED_SCALE] = sc[1]    # eager scaled the operand: an epilogue may not scale the product
            return scaled
    return None


def _view_scale(n):
    sc = _scalar_of(n.args[0])
    if not sc or (n.target == aten.reshape.default and _merged(n) is not None):
        return None  # batch merges sink below scalars instead (_sink_merge)
    moved = call(n.graph, n.target, sc[0], *n.args[1:], **n.kwargs)
    return call(n.graph, aten.mul.Tensor, moved, sc[1])


# --------------------------------------------------------------------------------------------- softmax

def _softmax_int(n):
    x, dim, dt = n.args[0], n.args[1], arg(n, 2, "dtype")
    if dt is not None:
        return call(n.graph, aten.softmax.int, _cast(x, dt), dim if dim < 0 else dim - _rank(x))
    if dim >= 0 or len(n.args) > 2 or n.kwargs:
        return call(n.graph, aten.softmax.int, x, dim if dim < 0 else dim - _rank(x))
    return None


def _softmax_private(n):
    x, dim, third = n.args[0], n.args[1], arg(n, 2, "half_to_float" if n.target == aten._softmax.default else "dtype")
    dt = (torch.float32 if third else None) if n.target == aten._softmax.default else third
    if dt is not None:
        x = _cast(x, dt)
    new = call(n.graph, aten.softmax.int, x, dim if dim < 0 else dim - _rank(x))
    if n.target == aten._safe_softmax.default:
        new.meta["autofuse_safe_softmax"] = True       # a row of -inf gives 0, not NaN
    return new


def _reduce_dim(n, *targets):
    """(x, dim<0) if n = reduction(x, [dim], keepdim=True) of one of targets, else None."""
    if not is_call(n, *targets):
        return None
    dims, keep = arg(n, 1, "dim"), arg(n, 2, "keepdim", False)
    if isinstance(dims, (list, tuple)):
        if len(dims) != 1:
            return None
        dims = dims[0]
    if not keep or arg(n, 3, "dtype") is not None:
        return None
    return n.args[0], dims if dims < 0 else dims - _rank(n.args[0])


def _row_max(m):
    if m.target is operator.getitem and m.args[1] == 0 and is_call(m.args[0], aten.max.dim):
        mx = m.args[0]
        return (mx.args[0], mx.args[1] if mx.args[1] < 0 else mx.args[1] - _rank(mx.args[0])) if arg(mx, 2, "keepdim") else None
    return _reduce_dim(m, aten.amax.default)


def _exp_arg(e):
    """(x, dim or None) for e = exp(x - rowmax(x, dim)) or exp(x)."""
    if not is_call(e, aten.exp.default):
        return None
    y = e.args[0]
    if is_call(y, aten.sub.Tensor) and not y.kwargs and isinstance(y.args[1], fx.Node):
        xm = _row_max(y.args[1])
        if xm and xm[0] is y.args[0]:
            return xm
    return y, None


def _softmax_decomposed(n):
    e, s = n.args[0], n.args[1]
    if n.target == aten.mul.Tensor:
        if not is_call(s, aten.reciprocal.default):
            return None
        s = s.args[0]
    ex = _exp_arg(e)
    sd = _reduce_dim(s, aten.sum.dim_IntList) if isinstance(s, fx.Node) else None
    if not ex or not sd or sd[0] is not e or (ex[1] is not None and ex[1] != sd[1]):
        return None
    return call(n.graph, aten.softmax.int, ex[0], sd[1])


def _softmax_shifted(n):
    """softmax(x - rowmax(x, d), d) -> softmax(x, d): a softmax subtracts its row's max itself (GPT-OSS subtracts
    it first "to prevent overflow"); in the input's dtype the two compute the same ``x - max``. Not for the safe
    softmax (a row of ``-inf`` becomes NaN by the subtraction there)."""
    y, d = n.args[0], n.args[1]
    if n.meta.get("autofuse_safe_softmax") or n.meta.get("autofuse_lse_softmax") or len(n.args) != 2 or n.kwargs:
        return None
    if not (is_call(y, aten.sub.Tensor) and not y.kwargs and isinstance(y.args[1], fx.Node)):
        return None
    xm = _row_max(y.args[1])
    if xm and xm[0] is y.args[0] and xm[1] == d:
        return call(n.graph, aten.softmax.int, y.args[0], d)
    return None


def _softmax_from_logsumexp(n):
    """exp(x - logsumexp(x, d, keepdim=True)) -> softmax(x, d), marked ``autofuse_lse_softmax``: on a row whose max is
    +inf the two differ (logsumexp is +inf: 0 at the finite entries, NaN at the +inf ones, where softmax is NaN
    over the row), and a family that claims it must give the logsumexp spelling's values."""
    y = n.args[0]
    if not (is_call(y, aten.sub.Tensor) and isinstance(y.args[1], fx.Node)):
        return None
    lse = y.args[1]
    if is_call(lse, aten.logsumexp.default) and lse.args[0] is y.args[0] and arg(lse, 2, "keepdim"):
        dims = lse.args[1]
        if len(dims) == 1:
            d = dims[0] if dims[0] < 0 else dims[0] - _rank(y)
            new = call(n.graph, aten.softmax.int, y.args[0], d)
            new.meta["autofuse_lse_softmax"] = True
            return new
    return None


def _exp_log_softmax(n):
    y = n.args[0]
    if is_call(y, aten._log_softmax.default) and not arg(y, 2, "half_to_float"):
        return call(n.graph, aten.softmax.int, y.args[0], y.args[1] if y.args[1] < 0 else y.args[1] - _rank(y))
    if is_call(y, aten.log_softmax.int) and arg(y, 2, "dtype") is None:
        return call(n.graph, aten.softmax.int, y.args[0], y.args[1] if y.args[1] < 0 else y.args[1] - _rank(y))
    return None


def _keepdim(n):
    """unsqueeze(reduce(x, d, keepdim=False), d) -> reduce(x, d, keepdim=True)."""
    r, d = n.args[0], n.args[1]
    if r.target is operator.getitem and r.args[1] == 0 and is_call(r.args[0], aten.max.dim):
        mx = r.args[0]
        if not arg(mx, 2, "keepdim", False) and (mx.args[1] % _rank(mx.args[0])) == d % _rank(n):
            new = call(n.graph, aten.max.dim, mx.args[0], mx.args[1], True)
            return call(n.graph, operator.getitem, new, 0)
        return None
    if not is_call(r, aten.amax.default, aten.sum.dim_IntList, aten.mean.dim) or arg(r, 2, "keepdim", False):
        return None
    dims = arg(r, 1, "dim")
    if not dims or len(dims) != 1 or dims[0] % _rank(r.args[0]) != d % _rank(n) or (len(r.args) > 3 or r.kwargs):
        return None
    return call(n.graph, r.target, r.args[0], list(dims), True)


# ------------------------------------------------------------------------------------------ transposes

def _transpose(n):
    r = _rank(n)
    p = _perm_of(n)
    if p == _swap_last(r) and tuple(n.args[1:]) != (-2, -1):
        return call(n.graph, aten.transpose.int, n.args[0], -2, -1)
    if p != _swap_last(r):
        return _permute(n.args[0], p)
    inner = _perm_of(n.args[0])
    if inner is not None:
        q = tuple(inner[j] for j in p)
        if q[-2] != r - 1:  # else transpose(permute) is the canonical split form already
            return _permute(n.args[0].args[0], q)
    return None


def _permute_rule(n):
    r, p = _rank(n), _perm_of(n)
    if p == tuple(range(r)):
        return n.args[0]
    if p == _swap_last(r):
        return call(n.graph, aten.transpose.int, n.args[0], -2, -1)
    inner = _perm_of(n.args[0])
    if inner is not None:
        return _permute(n.args[0].args[0], [inner[j] for j in p])
    if r >= 2 and p[-2] == r - 1:  # ends in a last-two swap: make it visible as transpose(permute)
        q = p[:-2] + (p[-1], p[-2])
        return call(n.graph, aten.transpose.int, _permute(n.args[0], q), -2, -1)
    return None


def _t(n):
    return call(n.graph, aten.transpose.int, n.args[0], -2, -1) if _rank(n) == 2 else None


def _reshape_through_transpose(n):
    """reshape(transpose_last(x)) that only regroups leading dims -> transpose_last(reshape(x))."""
    t, s = n.args[0], shape(n)
    if not (is_call(t, aten.transpose.int) and _perm_of(t) == _swap_last(_rank(t))):
        return None
    x = t.args[0]
    xs = shape(x)
    if len(s) < 2 or tuple(s[-2:]) != (xs[-1], xs[-2]):
        return None
    inner = call(n.graph, aten.reshape.default, x, list(s[:-2]) + [xs[-2], xs[-1]])
    return call(n.graph, aten.transpose.int, inner, -2, -1)


# ------------------------------------------------------------------------------------------------- GQA

def _repeat_kv(n):
    """reshape(expand(unsqueeze(x, j))) merging the expanded dim j into j-1 -> repeat_interleave(x, r, j-1)."""
    e = n.args[0]
    if not is_call(e, aten.expand.default) or not is_call(e.args[0], aten.unsqueeze.default):
        return None
    u = e.args[0]
    x, j = u.args[0], u.args[1] % _rank(u)
    su, se, sx = shape(u), shape(e), shape(x)
    if j == 0 or any(a != b for i, (a, b) in enumerate(zip(su, se)) if i != j):
        return None
    r = se[j]
    want = list(sx)
    want[j - 1] *= r
    if list(shape(n)) != want:
        return None
    return call(n.graph, aten.repeat_interleave.self_int, x, r, (j - 1) - len(sx))


def _repeat_through_transpose(n):
    """repeat_interleave(transpose_last(x), r, dim) with dim not in the last two -> swap the order."""
    t, r, dim = n.args[0], n.args[1], arg(n, 2, "dim")
    if dim is None or not (is_call(t, aten.transpose.int) and tuple(t.args[1:]) == (-2, -1)):
        return None
    if dim % _rank(n) >= _rank(n) - 2 or len(n.args) > 3 or n.kwargs:
        return None
    inner = call(n.graph, aten.repeat_interleave.self_int, t.args[0], r, dim if dim < 0 else dim - _rank(n))
    return call(n.graph, aten.transpose.int, inner, -2, -1)


def _cast_through_view(n):
    """_to_copy(transpose_last(x)) and _to_copy(repeat_interleave(x, r, dim)) -> the view of _to_copy(x): a cast acts
    on each element alone, so it commutes with moving them; autocast casts kᵀ (and repeated k/v heads) where the
    matmul reads them, which would hide the transpose from it."""
    x = n.args[0]
    if len(n.args) != 1 or set(n.kwargs) != {"dtype"}:
        return None             # a cast that also moves or lays out the value (device=, memory_format=) stays
    if not (val(x).is_floating_point() and n.kwargs["dtype"].is_floating_point):
        return None             # a mask's cast (DeepSeek-V3's group mask, repeated then cast) stays where templates see it
    if is_call(x, aten.transpose.int) and tuple(x.args[1:]) == (-2, -1):
        return call(n.graph, aten.transpose.int, _cast(x.args[0], n.kwargs["dtype"]), -2, -1)
    if is_call(x, aten.repeat_interleave.self_int) and len(x.args) == 3 and not x.kwargs and x.args[2] < 0:
        return call(n.graph, aten.repeat_interleave.self_int, _cast(x.args[0], n.kwargs["dtype"]), *x.args[1:])
    return None


def _repeat_interleave(n):
    x, r, dim = n.args[0], n.args[1], arg(n, 2, "dim")
    if dim is None or r == 1:
        return x if r == 1 else None
    if dim >= 0 or len(n.args) > 3 or n.kwargs:
        return call(n.graph, aten.repeat_interleave.self_int, x, r, dim if dim < 0 else dim - _rank(x))
    return None


# ----------------------------------------------------------------------------------------------- masks

def _not(c):
    if is_call(c, aten.logical_not.default):
        return c.args[0]
    return call(c.graph, aten.logical_not.default, c)


def _masked_fill(n):
    x, m, v = n.args[0], n.args[1], const_value(n.args[2])
    if v is None or not val(x).is_floating_point() or val(m).dtype != torch.bool:
        return None
    return call(n.graph, aten.where.ScalarOther, _not(m), x, v)


def _where_self(n):
    c, x, y = n.args
    if val(c).dtype != torch.bool:
        return None
    if const_value(y) is not None and isinstance(x, fx.Node) and val(x).is_floating_point():
        return call(n.graph, aten.where.ScalarOther, c, x, const_value(y))
    if const_value(x) is not None and isinstance(y, fx.Node) and val(y).is_floating_point():
        return call(n.graph, aten.where.ScalarOther, _not(c), y, const_value(x))
    return None


def _where_scalar_self(n):
    c, v, x = n.args
    return call(n.graph, aten.where.ScalarOther, _not(c), x, v) if val(c).dtype == torch.bool else None


def _logical_not(n):
    x = n.args[0]
    if is_call(x, aten.logical_not.default):
        return x.args[0]
    flip = {aten.eq.Scalar: aten.ne.Scalar, aten.ne.Scalar: aten.eq.Scalar,
            aten.eq.Tensor: aten.ne.Tensor, aten.ne.Tensor: aten.eq.Tensor}
    if is_call(x, *flip):
        return call(n.graph, flip[x.target], *x.args)
    return None


def _bitwise_not(n):
    return call(n.graph, aten.logical_not.default, n.args[0]) if val(n.args[0]).dtype == torch.bool else None


# ------------------------------------------------------------------------------------------------ SDPA

_SDPA_VARIANTS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_attention_math.default,
}


def _sdpa_variant(n):
    v = n.args[0]
    if n.target is not operator.getitem or n.args[1] != 0 or not is_call(v, *_SDPA_VARIANTS):
        return None
    q, k, vv = v.args[:3]
    if v.target == aten._scaled_dot_product_attention_math.default:
        if arg(v, 6, "dropout_mask") is not None:
            return None
        kw = dict(attn_mask=arg(v, 3, "attn_mask"), dropout_p=arg(v, 4, "dropout_p", 0.0),
                  is_causal=arg(v, 5, "is_causal", False), enable_gqa=v.kwargs.get("enable_gqa", False))
    else:  # _scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)
        kw = dict(attn_mask=v.kwargs.get("attn_mask"), dropout_p=arg(v, 3, "dropout_p", 0.0),
                  is_causal=arg(v, 4, "is_causal", False))
    kw["scale"] = v.kwargs.get("scale")
    return call(n.graph, aten.scaled_dot_product_attention.default, q, k, vv, **kw)


# ------------------------------------------------------------------------------------------------ table

RULES = [
    # value-preserving no-ops hide the op behind them
    ({aten.clone.default, aten.alias.default, aten.detach.default, aten.contiguous.default, PASS_GRADIENT},
     _drop_clone),
    ({aten.dropout.default, aten.feature_dropout.default}, _eval_dropout),  # eval dropout is identity
    ({operator.getitem}, _eval_native_dropout),  # same for native_dropout(train=False)
    ({operator.getitem}, _sdpa_variant),  # backend-specific SDPA -> the one public op
    ({aten._to_copy.default}, _to_copy),  # a cast to the same dtype is a no-op
    ({aten.to.dtype}, _to_dtype),  # one cast spelling
    ({aten.type_as.default}, _type_as),  # one cast spelling
    ({aten.view.default, aten._unsafe_view.default}, _view_to_reshape),  # reshape stays valid once clones go
    ({aten.reshape.default}, _reshape),  # chained / same-shape reshapes collapse
    ({aten.reshape.default}, _repeat_kv),  # transformers' repeat_kv is repeat_interleave over heads
    ({aten.reshape.default}, _reshape_through_transpose),  # keep k^T visible through head merges
    ({aten.expand.default}, _expand),  # same-shape expand is a no-op
    ({aten.slice.Tensor}, _slice),  # a full slice is a no-op
    ({aten.bmm.default, aten.mm.default}, _bmm),  # one matmul spelling
    ({aten.reshape.default}, _split_matmul),  # heads folded into batch (bmm) become a batch dim again
    ({aten.matmul.default}, _lift_matmul),  # same, when only one operand was folded
    ({aten.reshape.default}, _split_add),  # same for a bias added to folded scores (baddbmm)
    ({aten.softmax.int, aten.mul.Tensor, aten._to_copy.default, aten.add.Tensor,
      aten.where.ScalarOther}, _sink_merge),  # same when the scores were folded for a bmm
    ({aten.add.Tensor}, _split_batch_add),  # a term added through a view splitting the batch: added before it
    ({aten.add.Tensor}, _add_zero),  # + zeros is a no-op (the shape/dtype guard rejects broadcasting up)
    ({aten.baddbmm.default}, _baddbmm),  # baddbmm = scaled matmul + bias (MHA's masked scores)
    ({aten.einsum.default}, _einsum),  # einsum contractions are matmuls with permutes
    ({aten.div.Tensor, aten.div.Scalar}, _div_scalar),  # x / c == x * (1/c)
    ({aten.mul.Tensor}, _mul),  # scalars on the right; chained scalars fold; * 1 disappears
    ({aten.pow.Tensor_Scalar, aten.reciprocal.default}, _rsqrt),  # y ** -0.5 and 1 / sqrt(y) are rsqrt(y)
    ({aten.div.Tensor}, _div_sqrt),  # x / sqrt(y) is x * rsqrt(y)
    ({aten.var.correction, aten.var.dim}, _var),  # a population variance over the last dim is mean((x - mean)²)
    ({aten.mul.Tensor, aten.div.Tensor}, _softmax_decomposed),  # exp(x - max) / sum is softmax
    ({aten.matmul.default}, _matmul_scale),  # pre-scaled q or k: scale the matmul output instead
    ({aten.transpose.int, aten.permute.default, aten.reshape.default, aten.expand.default,
      aten.unsqueeze.default, aten.squeeze.dim, aten.repeat_interleave.self_int}, _view_scale),  # scalars sink through views
    ({aten.softmax.int}, _softmax_int),  # dtype= is a cast; dims counted from the end
    ({aten._softmax.default, aten._safe_softmax.default}, _softmax_private),  # one softmax spelling
    ({aten.softmax.int}, _softmax_shifted),  # softmax(x - max(x)) is softmax(x)
    ({aten.exp.default}, _softmax_from_logsumexp),  # exp(x - logsumexp(x)) is softmax
    ({aten.exp.default}, _exp_log_softmax),  # exp(log_softmax(x)) is softmax
    ({aten.unsqueeze.default}, _keepdim),  # reduce-then-unsqueeze is reduce(keepdim=True)
    ({aten.transpose.int}, _transpose),  # a last-two swap is transpose(-2, -1), others permute
    ({aten.permute.default}, _permute_rule),  # compose permutes; expose a trailing last-two swap
    ({aten.t.default}, _t),  # 2-D t() is transpose(-2, -1)
    ({aten.repeat_interleave.self_int}, _repeat_interleave),  # dims counted from the end
    ({aten.repeat_interleave.self_int}, _repeat_through_transpose),  # keep k^T next to the matmul
    ({aten._to_copy.default}, _cast_through_view),  # same, under autocast's cast of k^T (a cast moves up views)
    ({aten.masked_fill.Scalar, aten.masked_fill.Tensor}, _masked_fill),  # masks say True = keep
    ({aten.where.self}, _where_self),  # scalar fill goes last, keep-mask first
    ({aten.where.ScalarSelf}, _where_scalar_self),  # same
    ({aten.logical_not.default}, _logical_not),  # double negation, not(eq) = ne
    ({aten.bitwise_not.default}, _bitwise_not),  # ~bool is logical_not
]


def _cse(graph: fx.Graph) -> bool:
    seen, changed = {}, False
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        t = n.target
        if effectful(n):
            continue
        key = (t, repr(n.args), repr(n.kwargs), n.meta.get("autofuse_safe_softmax"), n.meta.get("autofuse_lse_softmax"))
        if key in seen:
            _same_value(seen[key], n)
            n.replace_all_uses_with(seen[key])
            changed = True
        else:
            seen[key] = n
    return changed


def _same_value(keep: fx.Node, gone: fx.Node):
    """``gone`` is replaced by ``keep``, which computes the same value: ``keep`` inherits ``gone``'s origin if it
    has none, and lists it (with the nodes ``gone`` stood for) in ``meta["autofuse_equals"]`` otherwise, so
    a match can be carried over to the captured node a block really reads (layers that each rebuild the same
    mask share one canonical node)."""
    o = gone.meta.get("autofuse_origin")
    others = [o] + list(gone.meta.get("autofuse_equals", ())) if o is not None else list(gone.meta.get(
        "autofuse_equals", ()))
    if keep.meta.get("autofuse_origin") is None and o is not None:
        keep.meta["autofuse_origin"] = o
        others = others[1:]
    if others:
        eq = keep.meta.setdefault("autofuse_equals", [])
        eq.extend(x for x in others if x not in eq and x != keep.meta.get("autofuse_origin"))


def _same(a, b) -> bool:
    va, vb = val(a), val(b)
    if va is None or vb is None:
        return va is None and vb is None
    return tuple(va.shape) == tuple(vb.shape) and va.dtype == vb.dtype


def canonicalize(gm: fx.GraphModule, rules=None, max_iters: int = 30) -> fx.GraphModule:
    """Return a new GraphModule in canonical form (see module docstring); ``gm`` is not modified."""
    rules = RULES if rules is None else rules
    gm = copy_graph_module(gm)
    graph = gm.graph
    for n in graph.nodes:
        n.meta.setdefault("autofuse_origin", n.name)
        if is_call(n, aten.native_dropout.default, aten.dropout.default) and isinstance(val(n.args[0]), torch.Tensor):
            # the captured layout of its input, which orders its draws (the rules below may drop the copy that
            # lays it out: see graph.keep_mask_order)
            n.meta.setdefault("autofuse_draw_order", draw_order(val(n.args[0])))
    for _ in range(max_iters):
        changed = _cse(graph)
        for node in list(graph.nodes):
            if node.op != "call_function" or not node.users:
                continue
            for targets, fn in rules:
                if node.target not in targets:
                    continue
                try:
                    with graph.inserting_before(node):
                        new = fn(node)
                except Exception as e:  # noqa: BLE001 - one odd node must not stop compilation
                    log.warning("canonicalize: rule %s failed at node %s (%s): %s",
                                fn.__name__, node.name, node.target, e)
                    if STRICT:
                        raise
                    continue
                if new is None or new is node:
                    continue
                if not _same(new, node):
                    log.debug("rule %s rejected at %s: shape/dtype changed", fn.__name__, node.name)
                    continue
                if new.meta.get("autofuse_origin") is None and isinstance(val(node), torch.Tensor):
                    # a node the rule made: it holds node's value, laid out in memory as eager (and the captured
                    # graph) lays node's out, not as its own op's meta kernel would from the canonical operands
                    # (a generated kernel stores its outputs in that order, which a later view may rely on)
                    new.meta["val"] = val(node)
                _same_value(new, node)
                for k in ("autofuse_safe_softmax", "autofuse_lse_softmax"):
                    if k in node.meta:
                        new.meta.setdefault(k, node.meta[k])
                node.replace_all_uses_with(new)
                changed = True
                break
        graph.eliminate_dead_code()
        if not changed:
            break
    graph.lint()
    gm.recompile()
    return gm
