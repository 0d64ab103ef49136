"""The softmax family: softmax or log-softmax with its scale, mask and casts, as one Vector kernel.

Target: ``scaled_masked_softmax(x, mask, dim, scale, fill, log, empty_rows, inf_rows, out_dtype)`` (CANN
ScaledMaskedSoftmax, plus the log form): ``z = scale · x``, then a bool keep-mask (a masked score becomes
``fill``) or an additive float mask, broadcast to x; ``softmax(z, dim)`` or ``log_softmax(z, dim)`` in fp32;
one rounding to ``out_dtype``.

The template (canonical form, :mod:`autofuse.canonicalize`), from the kernel's input x down::

    x -> [cast | mul(number) | add(float tensor) | sub(·, float tensor) | where(keep, ·, fill)]{0..6} -> softmax(dim)
      -> [cast]

with the anchor also ``log_softmax`` / ``_log_softmax`` (which the canonical form leaves as they are; a
``dtype=`` or ``half_to_float`` is the output dtype, the kernel computing in fp32 anyway), and a second
template for ``z - logsumexp(z, dim, keepdim=True)``. ``log(softmax(z))`` fuses its softmax and keeps the
``log`` as captured: it is not ``log_softmax``, whose kernel gives the finite log-probability where eager's
probability underflows (a score 104 below its row's max in fp32, a masked -1e9) and ``log`` gives ``-inf`` (and
its gradient NaN). ``_safe_softmax`` (``meta["autofuse_safe_softmax"]``) sets ``empty_rows="zero"``. The logsumexp
spellings, ``z - logsumexp(z)`` and ``exp(z - logsumexp(z))`` (a softmax with
``meta["autofuse_lse_softmax"]`` in the canonical form), set ``inf_rows="lse"``: on a row whose max is +inf,
``logsumexp`` is +inf, so they give ``z - inf`` (-inf, NaN at the +inf score) and ``exp(z - inf)`` (0, NaN
there) where ``softmax`` and ``log_softmax`` give NaN over the row; on a row whose every score is a fill
``logsumexp`` absorbs (``finfo.min``: ``max + log C`` rounds to the max in the scores' dtype) they give 0 and 1
where ``log_softmax`` and ``softmax`` give ``-log C`` and ``1/C``. The kernel rounds its ``logsumexp`` to x's
dtype, so such a block whose scores are wider than x (a cast up, a wider mask added) is not matched from x.
A 16-bit softmax cast to another dtype (``softmax(x16).float()``) ends before the cast: eager rounds the
probabilities to x's dtype first, which the kernel, writing the cast's dtype from fp32, would skip.

Constraints (named functions below): the chain is walked from the softmax up to x, as attention walks its
score chain, with :class:`patterns.attention._Below` computing the fill as it reaches the softmax through
the later scales and casts; a ``where`` must mask (fill ``-inf``, or at or below ``-1e4`` as it reaches
the softmax) and its keep-mask be bool; an additive mask is a float tensor that does not broadcast the
chain up (an ``add`` whose other operand has the full shape is read as x, the smaller one as the mask; a
subtraction ``s - m`` is the mask ``m`` with its factor negated, ``m - s`` no mask: it negates the scores);
an additive mask after a finite-fill ``where``, bool masks with different fills, or a finite fill with
an additive mask anywhere are rejected (no single fill describes them); ``params["mask_add_dtype"]``: the 16-bit
dtype eager adds an additive mask in (scores and mask of that dtype, reaching the softmax unscaled or scaled by a
power of two: :func:`patterns.attention._mask_add_dtype`), which the kernel then adds it in too, so that a score
the mask absorbs (``finfo(float16).min`` + a score below 16 is ``-65504``) takes the mask's value and a row whose
every key is so masked is uniform, as eager's is; None: an fp32 add (an fp32 model, a mask of another dtype than
the add's); every node but the output is
used only inside the block; a captured softmax alone, with nothing around it, is no candidate (its fused
call would be the same kernel; a softmax the canonical form assembled from several ops is one).

Rejected (each a near-miss test): a scale that is a tensor (``mul`` by a per-element tensor ends the
chain); a fill that does not mask (``0.5``); a mask after the softmax; masks that would broadcast x itself
(both operands of an ``add`` smaller than its result, a keep-mask larger than the scores: the kernel
reads x as it is and broadcasts the mask only). A softmax inside an attention block or a MoE router is
also matched here; the planner keeps the attention / gating candidate, which saves more.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from autofuse.graph import arg, is_call, is_number, shape, val
from autofuse.match import Match, register
from patterns.attention import (NEG_FILL, SUBTRACTIONS, _added, _Below, _is_cast, _mask_add_dtype, _members,
                                narrowing_casts, rounds_and_widens)
from patterns.template import Template, graph_view

aten = torch.ops.aten

PRE_OPS = {aten._to_copy.default, aten.mul.Tensor, aten.add.Tensor, *SUBTRACTIONS, aten.where.ScalarOther}
LOG_SOFTMAX = (aten.log_softmax.int, aten._log_softmax.default)
MAX_CHAIN = 6


def _tensor(n: fx.Node) -> bool:
    v = val(n)
    return v is not None and v.is_floating_point()


def _pre_op(n: fx.Node) -> bool:
    """A cast, a scale by a Python number, an add (or a subtraction, ``alpha`` 1) of two float tensors, a ``where``
    with a number fill."""
    if _is_cast(n):
        return True
    if is_call(n, aten.mul.Tensor):
        return is_number(n.args[1]) and not n.kwargs
    if is_call(n, aten.add.Tensor, *SUBTRACTIONS):
        return bool(_added(n)) and _tensor(n)
    return is_call(n, aten.where.ScalarOther) and is_number(n.args[2])


def _lse_of_input(n: fx.Node) -> bool:
    """``z - logsumexp(z, [d], keepdim=True)``."""
    if not is_call(n, aten.sub.Tensor) or n.kwargs or len(n.args) != 2:
        return False
    z, lse = n.args
    return (is_call(lse, aten.logsumexp.default) and lse.args[0] is z and len(lse.args[1]) == 1
            and bool(arg(lse, 2, "keepdim", False)))


def _template(anchor_targets, anchor_where=None, lse=False) -> Template:
    """x -> [pre ops] -> anchor -> [cast]; with ``lse`` the anchor is ``sub(z, logsumexp(z))``."""
    t = (Template("softmax", anchor="softmax")
         .node("x", where=_tensor)
         .node("softmax", *anchor_targets, where=anchor_where)
         .chain("pre", PRE_OPS, "x", "softmax", max_len=MAX_CHAIN, where=_pre_op, arg=0))
    if lse:
        t.node("lse", aten.logsumexp.default).edge("lse", "softmax", 1)
    return t.node("cast", aten._to_copy.default, where=_is_cast, optional=True).edge("softmax", "cast", 0)


_SOFTMAX = _template((aten.softmax.int,) + LOG_SOFTMAX)
_LSE = _template((aten.sub.Tensor,), _lse_of_input, lse=True)
TEMPLATES = (_SOFTMAX, _LSE)


def _walk(z: fx.Node, x: fx.Node, members: set):
    """From the softmax input ``z`` up to ``x`` through ``members``: ``(scale, masks, visited, adds)`` with masks
    as ``(node, kind, factor at the softmax input, fill at the softmax input)`` and ``adds`` each additive mask
    with the dtype of the add that adds it to the scores; None if a step is not allowed."""
    below, masks, scale, visited, adds = _Below(), [], 1.0, [], []
    node = z
    while node is not x:
        if node not in members:
            return None
        visited.append(node)
        if _is_cast(node):
            below.ops.append(("cast", node.kwargs.get("dtype")))
            node = node.args[0]
        elif is_call(node, aten.mul.Tensor):
            c = node.args[1]
            scale *= c
            below.factor *= c
            below.ops.append(("scale", c))
            node = node.args[0]
        elif is_call(node, aten.where.ScalarOther):
            keep, y, fill = node.args
            f = _masking_fill(node, keep, y, fill, below)
            if f is None:
                return None
            masks.append((keep, "bool", below.factor, f))
            node = y
        else:                                   # add: the operand of the full shape is the scores
            got = _scores_operand(node, members | {x})
            if got is None:
                return None
            up, m, sign = got
            masks.append((m, "additive", sign * below.factor, None))
            adds.append((m, val(node).dtype))
            below.additive = True
            node = up
    return scale, masks, visited, adds


def _masking_fill(node, keep, y, fill, below: _Below) -> float | None:
    """The fill as it reaches the softmax when this ``where`` masks (a bool keep-mask no larger than the scores,
    a fill at or below -1e4 there, or -inf), else None."""
    if val(keep) is None or val(keep).dtype != torch.bool or shape(node) != shape(y):
        return None
    dt = val(node).dtype
    f = below.fill_at_softmax(fill, dt)
    if math.isnan(f) or not (f == -math.inf or f <= below.fill_at_softmax(NEG_FILL, dt)):
        return None                     # a fill that does not mask is not a mask (-1e4 as the dtype rounds it)
    if f != -math.inf and below.additive:
        return None                     # fill + an additive mask below it: no single fill describes it
    return f


def _scores_operand(add: fx.Node, allowed: set) -> tuple | None:
    """``(scores, mask, sign)`` of ``add``: the operand that carries the scores, of the add's own shape and on the
    chain (or x); the other, a float tensor, is the mask, added (sign 1) or subtracted (sign -1: ``s - m``, the
    scores the minuend, :func:`patterns.attention._added`). Both of the full shape: the first that is on the
    chain."""
    for up, m, sign in _added(add):
        if up in allowed and shape(up) == shape(add) and _tensor(m) and m not in allowed - {add}:
            return up, m, sign
    return None


def _outputs(m: dict, sm: fx.Node):
    """The block's output; None when an intermediate value is used outside (the shorter variant without it is
    tried instead)."""
    out = sm
    if "cast" in m:
        if list(out.users) != [m["cast"]]:
            return None
        if val(out).dtype != val(m["cast"]).dtype and torch.finfo(val(out).dtype).bits < 32:
            return None                 # a 16-bit softmax cast to another dtype: eager rounds the probabilities to
            #                             the softmax's dtype first, which the kernel, writing the cast's dtype
            #                             from fp32, would skip; the block without the cast (tried next) keeps it
        out = m["cast"]
    return out


def _dim(sm: fx.Node) -> int:
    if is_call(sm, aten.sub.Tensor):
        d = sm.args[1].args[1][0]
    else:
        d = sm.args[1]
    return d - len(shape(sm)) if d >= 0 else d


def _decide(m: dict) -> Match | None:
    """The constraints of a matched softmax block (see the module docstring)."""
    sm, x = m["softmax"], m["x"]
    lse = "lse" in m
    log = lse or is_call(sm, *LOG_SOFTMAX)
    if not _tensor(x) or val(x).dtype not in (torch.float16, torch.bfloat16, torch.float32) or not shape(sm):
        return None
    if x.meta.get("autofuse_origin") is None:
        return None                     # a value the canonical form made (a matmul moved above a scale): the
        #                                 captured graph has no such tensor for the fused call to read
    out = _outputs(m, sm)
    if out is None:
        return None
    members = {m[k] for k in m if k.startswith("pre")}
    walked = _walk(sm.args[0], x, members)
    if walked is None:
        return None
    scale, masks, visited, adds = walked
    if set(visited) != members:
        return None
    if rounds_and_widens([x, *_members(m, "pre"), sm, *([m["cast"]] if "cast" in m else [])]):
        return None                     # rounded to 16 bits and back on the way: eager keeps the rounding
    if narrowing_casts(_members(m, "pre")):
        return None                     # the model rounds the scores on the way: a block starting after the
        #                                 cast (tried next) reads them rounded, as eager's softmax does
    inner = members | {sm} | ({m["lse"]} if lse else set()) | ({m["cast"]} if "cast" in m else set())
    if any(u not in inner for n in inner - {out} for u in n.users):
        return None                     # an intermediate is used outside: it cannot be fused away
    if len(inner) == 1 and val(out).dtype == val(x).dtype and sm.meta.get("autofuse_origin") == sm.name:
        return None                     # one captured softmax as it is: the fused call would be the same kernel
    fills = {f for _, kind, _, f in masks if kind == "bool"}
    kinds = {kind for _, kind, _, _ in masks}
    if len(fills) > 1 or (fills and fills != {-math.inf} and kinds == {"bool", "additive"}):
        return None                     # no single fill describes the masks
    fill = fills.pop() if fills else -math.inf
    empty = "zero" if sm.meta.get("autofuse_safe_softmax") and not log else "nan"
    inf_rows = "lse" if lse or sm.meta.get("autofuse_lse_softmax") else "nan"
    if inf_rows == "lse" and val(sm.args[0]).dtype != val(x).dtype:
        return None                     # the kernel rounds logsumexp to x's dtype, eager to the scores' (widened)
    inputs = {"x": x.name}
    terms = []
    for i, (mk, kind, factor, _) in enumerate(masks):
        role = "mask" if i == 0 else f"mask_{i}"
        inputs[role] = mk.name
        terms.append((role, kind, float(factor)))
    order = [n.name for n in sm.graph.nodes if n in inner]
    params = dict(dim=_dim(sm), scale=None if scale == 1.0 else float(scale), log=log,
                  fill=None if fill == -math.inf else float(fill), empty_rows=empty, inf_rows=inf_rows,
                  mask_kind=None if not kinds else ("bool" if kinds == {"bool"} else "additive"),
                  mask_terms=tuple(terms), x_shape=shape(x), dtype=val(x).dtype, out_dtype=val(out).dtype,
                  out_like=val(out), guards=(), mask_add_dtype=_mask_add_dtype(masks, adds))
    return Match("softmax", tuple(order), out.name, inputs, params)


@register("softmax")
def find_softmax(gm: fx.GraphModule) -> list[Match]:
    """Every softmax block of ``gm`` (canonical form), in graph order (a node of one block is never another's:
    the chain ends at x and only the block's output leaves it)."""
    view = graph_view(gm)
    found = _SOFTMAX.match(view, _decide) + _LSE.match(view, _decide)
    return sorted(found, key=lambda mt: view.order[mt.anchor])
