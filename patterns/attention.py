"""The attention family: dropout(softmax(scale · Q·Kᵀ + mask)) · V, recognised by meaning.

Target kernel: ``flash_attention(q, k, v, mask=None, scale=None, causal=False, return_probs=False, drop_mask=None,
dropout_p=0.0, softcap=None, sinks=None)``
with q [B, N, Sq, D], k/v [B, Nkv, Skv, D] (N % Nkv == 0, head n reads kv head n // (N/Nkv)),
mask broadcastable to [B, N, Sq, Skv].

**Mask convention** (``params["mask_kind"]``): ``None`` = no mask; ``"bool"`` = True means *attend*
(keep), exactly as ``F.scaled_dot_product_attention``; ``"additive"`` = a float tensor added to the
scaled scores (or subtracted: ``s - m`` is the mask ``m`` with factor -1 in ``params["mask_terms"]``).
``causal=True`` means top-left aligned ``tril(ones(Sq, Skv))`` keep-mask (SDPA's ``is_causal``). A mask
is replaced by ``causal=True`` (or dropped) only when it is *proven*: it depends on no graph input and no
meta tensor, so it is evaluated for the captured shapes and compared entry by entry. A causal mask whose
masked entries take a *finite* value (``masked_fill(~tril,
finfo(float16).min)``, GPT-2's additive ``finfo.min`` mask) stays the explicit mask it is, and
``params["causal_value"]`` records that value: the fused op skips the tiles above the diagonal only when
a bound on the scores, computed at run time, proves every skipped weight ``exp(value + s - max)`` is 0.
A proven causal mask added to a bias that is not a proven mask (T5's decoder self-attention: ``s + position_bias +
causal_mask``, or ``s + (bias + causal_mask)``, either order; fp32, the masked value absorbing, ``finfo.min``) is read
as before (``where(tril, bias, -inf)``; the sum as ``bias + where(tril, 0, value)``, ``params["causal_sum"]``, which
is eager's sum entry for entry), and ``params["causal_value"]`` with ``params["causal_bias"]`` (the role of the bias
input) let the fused op run the causal kernel reading the bias alone in the kept tiles, where run-time bounds on the
scores and on the bias (``score_bound``, ``bias_bound``) prove it exact
(:func:`autofuse.ops.causal_bias_skip_is_exact`).
Additive masks added *before* a ``masked_fill`` with a finite fill (MPT's ALiBi bias, then its causal fill; a bias,
then ``masked_fill(~keep, -1e9)``) are one additive mask ``where(keep, sum, fill)`` (``params["fill_last"]``), whose
entries equal to the fill the kernel selects in place of the score (``fill_in_mask``), as ``masked_fill`` replaces
it.
``params["mask_add_dtype"]``: the 16-bit dtype eager adds the additive mask in (scores and mask of that dtype), which
the kernel then adds it in too, so that a score the mask absorbs takes its value (:func:`_mask_add_dtype`); None: an
fp32 add (fp32 models, SDPA, whose CPU kernel adds in fp32, and a proven causal mask).

One description, many spellings. The family is the table below plus one walker; the spellings
(div vs mul, pre-scaled q/k, einsum/bmm/matmul, transpose/permute/mT, masked_fill/where/additive,
softmax forms, eval dropout, repeat_kv/repeat_interleave) are removed by canonicalization first,
so the walker sees, from the softmax input upwards::

    softmax(-1) <- [cast]* [<- cat([·, sink], -1)]
                <- [cast | mul(scalar) | add(mask) | sub(·, mask) | where(keep, ·, fill<=-1e4)]* [<- mul(tanh(·), c)]
                <- [cast | mul(scalar)]* <- matmul(q, transpose(k, -2, -1))

(the optional ``c·tanh(a·s)`` is logit soft-capping, Gemma 2's: ``params["softcap"] = c``, the kernel's scale
``a·c``; only scales and casts above it, no scale between it and the softmax, the masks after it)

(the optional ``cat`` is attention sinks, GPT-OSS's: one learnable logit per head, ``sinks.reshape(1, -1, 1, 1)``
broadcast over batch and queries, a last score column of each row's softmax; ``inputs["sinks"]``, ``params["sinks"]``;
the probabilities then lose that column, ``[..., :-1]``, before anything but casts; GPT-OSS's ``x - max(x)``
ahead of the softmax is canonicalized away)

and from the softmax output downwards ``[cast]* [-> slice(·, -1, 0, -1)] [cast | dropout]* -> matmul(P, v)``.
``k``/``v`` may each be ``repeat_interleave(x, r, dim=-3)`` (GQA). ``aten.scaled_dot_product_attention`` is matched directly.

Rejected (each a near-miss test): softmax over any dim but the last; kᵀ that is not a transpose of
k's last two dims (``permute(0, 2, 1, 3)``); a tensor-valued scale but a one-element one or one factor per head
(``[N, 1, 1]``, ``[1, N, 1, 1]`` on rank-4 scores: ``params["scale_per_head"]``; one varying per query row, ``[N,
Sq, 1]``, is refused); anything between softmax and
P·V other than casts (in-place edits of the probabilities are functionalised into such ops);
a scores/probability node consumed outside the block, except the probabilities themselves
(``probs_used``); two dropouts on the probabilities; matmul operands that broadcast batch dims (except one k/v
head broadcast over the query heads: multi-query attention, Falcon's eager spelling); q and k of another dtype
than v unless q and k are fp32 and v narrower (GPT-J in bf16: v is cast up, ``params["v_cast"]``); sinks that vary
over batch or queries, a sink column put first, a scale or mask applied after the concatenation, a slice other than
``[..., :-1]`` (or one without sinks), probabilities read with the sink column; scores cast down to 16 bits
before the softmax (``(q @ kᵀ).half()`` of fp32 q and k: the kernel would compute them unrounded; the softmax
family then starts after the cast), the candidate unsupported with a reason naming the cast (the model's, or a
softmax's ``dtype=`` argument, which casts its input before the softmax), but for one spelling the kernel rounds as
eager does: 16-bit scores cast up, scaled and masked in fp32 and cast down to q's dtype right before the softmax
(Falcon's ALiBi path in 16 bits, ``softmax(logits32 + mask, -1, dtype=bf16)``): ``params["logits_round"]``, the
kernel's ``logits_dtype`` (the scores rounded as the matmul returns them, the logits before the softmax);
a Python 0 added to or subtracted from the scores (XLNet's absent segment term) is the scores themselves;
probabilities rounded to a narrower dtype and widened again (``p.half().float()``, a bf16 block's softmax in fp16
cast back), also unsupported with a reason naming the dtypes.

**Dropout.** A training-mode dropout on the probabilities (``native_dropout``, ``dropout``, SDPA's
``dropout_p``) is part of the match: ``params["dropout_p"]``, and ``params["dropout_draw"]`` = ``(shape,
dtype, order)`` of the tensor eager draws its keep-mask for (``order``: the memory order of its draws,
:func:`autofuse.graph.keep_mask_order`), or None when eager draws nothing (``dropout`` with p = 0). The fused
block draws the same mask with torch's generator (``autofuse::dropout_gen_mask``), at the block's place in the
graph, so a seeded run drops the same elements as eager.
``AttentionVariant`` / :func:`build_variant` generate the eager spellings from the same
description, for tests and examples.
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autofuse.canonicalize import LARGEST_CONSTANT, evaluate_constant
from autofuse.graph import arg, is_call, is_number, keep_mask_order, last_dim_slice, shape, val
from autofuse.match import Match, register
from patterns.template import Template, graph_view

aten = torch.ops.aten

NEG_FILL = -1e4  # a finite fill at or below this is "masked": exp(fill - rowmax) underflows to 0 in fp32
ABSORBING_FILL = -1e30  # a fill this low absorbs any finite fp32 score added to it: s + fill == fill
PROOF_CHUNK = 1 << 22      # elements of a mask read at once by the proof

# Ops allowed between the QK matmul and softmax, and what each contributes.
SCORE_OPS = {
    aten._to_copy.default: "cast",
    aten.mul.Tensor: "scale",
    aten.add.Tensor: "additive",
    aten.sub.Tensor: "additive",        # scores - mask: the mask added with its factor negated
    aten.rsub.Tensor: "additive",
    aten.where.ScalarOther: "bool",
    aten.tanh.default: "softcap",       # c·tanh(s / c): logit soft-capping (Gemma 2), the walker checks the form
    aten.cat.default: "sinks",          # cat([scores, sink logits], -1): attention sinks (GPT-OSS)
}
PROB_OPS = {aten._to_copy.default: "cast", aten.slice.Tensor: "sinks"}  # allowed between softmax and P·V
KV_VIEWS = {aten.repeat_interleave.self_int: "gqa"}  # looked through on k and v
SUBTRACTIONS = (aten.sub.Tensor, aten.rsub.Tensor)     # sub(s, m) and rsub(m, s): s - m


@dataclass
class _Scores:
    qk: fx.Node
    scale: float
    masks: list  # (node, kind, factor at softmax input, fill at softmax input or None)
    nodes: list
    scale_tensor: fx.Node | None = None
    softcap: float | None = None
    fill_last: bool = False         # additive masks added before a finite fill (MPT): the fill replaces their sum
    sinks: fx.Node | None = None    # the sink logits concatenated to the scores (before the expand), or None
    adds: tuple = ()                # (additive mask, dtype of the add that adds it to the scores), walking up


class _Below:
    """The ops met so far between a point of the score chain and the softmax (walking up): a fill written
    at that point reaches the softmax through them, so its value there is computed by applying them."""

    def __init__(self):
        self.ops, self.factor, self.additive, self.tensor_scale = [], 1.0, False, False
        self.softcap = None             # met a soft-cap c·tanh(·) on the way up: only scales and casts above it
        self.fill_last = False          # met an additive mask above a finite fill
        self.why = None                 # why the walk stopped, where the block is attention the kernel cannot run

    def copy(self):
        b = _Below()
        b.ops, b.factor, b.additive, b.tensor_scale = list(self.ops), self.factor, self.additive, self.tensor_scale
        b.softcap, b.fill_last = self.softcap, self.fill_last
        return b

    def fill_at_softmax(self, fill: float, dtype: torch.dtype) -> float:
        """``fill`` as the softmax sees it: scaled and cast as eager would (a float32 ``finfo.min`` cast to
        float16 is ``-inf``)."""
        t = torch.tensor(fill, dtype=dtype)
        for kind, arg_ in reversed(self.ops):
            t = t * arg_ if kind == "scale" else t.to(arg_)
        return float(t)


_CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _is_cast(n):
    """A cast between float types the kernels compute in (a round trip through float8 rounds: not a no-op)."""
    return is_call(n, aten._to_copy.default) and set(n.kwargs) <= {"dtype"} and len(n.args) == 1 and \
        n.kwargs.get("dtype", val(n).dtype) in _CAST_DTYPES and val(n.args[0]).dtype in _CAST_DTYPES


def rounds_and_widens(chain) -> bool:
    """Whether a value flowing along ``chain`` (nodes in order, each read by the next) is rounded to a narrower
    float dtype and then widened again: ``s.bfloat16().float()`` in an fp32 model, fake quantisation. The kernels
    compute the chain in fp32 and take its casts as the dtypes of their ends, so such a rounding would be lost;
    a chain only widening (fp16 scores cast up for the softmax) or only narrowing after the softmax (probabilities
    cast down to v's dtype) is what they compute; a cast down before it is :func:`narrowing_casts`'s."""
    dtypes = [val(n).dtype for n in chain if isinstance(val(n), torch.Tensor) and val(n).is_floating_point()]
    return any(any(_narrower(d, a) for a in dtypes[:i]) and any(_narrower(d, b) for b in dtypes[i + 1:])
               for i, d in enumerate(dtypes))


def _narrower(a, b) -> bool:
    """Whether float dtype ``a`` cannot hold every value of ``b``."""
    return a != b and torch.finfo(a).bits <= torch.finfo(b).bits


def narrowing_casts(chain) -> list:
    """The casts in ``chain`` that round their value to a 16-bit dtype it was not in (``x.half()`` of fp32
    scores). The kernels read the value at a chain's start and compute on in fp32, taking its casts only as the
    dtypes of their ends, so such a cast before the softmax would go unrounded: the model wrote that rounding,
    and eager's softmax reads the rounded value. A block that takes one in loses it; one starting after it
    reads the value rounded as the model made it. A cast down to fp32 (from float64) rounds no further than the
    kernels compute."""
    return [n for n in chain if _is_cast(n) and _narrower(val(n).dtype, val(n.args[0]).dtype)
            and torch.finfo(val(n).dtype).bits < 32]


def _zero_dim_factor(x):
    """The tensor operand of ``mul(scores, t)`` read by the kernel as its scale at call time, or None: a
    one-element tensor (a learnable temperature, a scale buffer), or one factor per head of rank-4 scores
    ``[B, N, Sq, Skv]``, of shape ``[N, 1, 1]`` or ``[1, N, 1, 1]`` (Swin v2's ``exp(clamp(logit_scale))``;
    :func:`_per_head_factor`). A factor that varies over batch, queries or keys is not the kernel's scale."""
    t = x.args[1]
    if not isinstance(t, fx.Node) or val(t) is None or not val(t).is_floating_point():
        return None
    if val(t).numel() != 1 and not _per_head_factor(t, shape(x)):
        return None
    return t if shape(x) == shape(x.args[0]) else None


def _per_head_factor(t: fx.Node, scores: tuple) -> bool:
    """Whether ``t`` holds one factor per head of rank-4 ``scores`` (more than one head): shape ``[N, 1, 1]`` or
    ``[1, N, 1, 1]``."""
    s = tuple(shape(t))
    return (len(scores) == 4 and scores[1] > 1 and 3 <= len(s) <= 4 and s[-3:] == (scores[1], 1, 1)
            and all(d == 1 for d in s[:-3]))


def _walk_scores(x, below: _Below, chain: set | None = None) -> _Scores | None:
    """Walk from the softmax input up to the QK matmul; ``below`` holds the ops between x and the softmax.
    ``chain``: the score nodes the template matched (an ``add`` continues through the one among its inputs)."""
    nodes, masks, scale, st, sinks = [], [], 1.0, None, None
    while True:
        if is_call(x, aten.matmul.default):
            return _Scores(x, scale, masks, nodes, st, below.softcap, below.fill_last, sinks)
        if is_call(x, aten.cat.default):
            # attention sinks: one more score per row, the head's sink logit, concatenated last; only casts between
            # it and the softmax (a scale or a mask there would reach the sink too)
            if sinks is not None or masks or nodes and not all(_is_cast(n) for n in nodes) or below.tensor_scale:
                return None
            sinks = _sink_logits(x)
            if sinks is None:
                return None
            nodes.append(x)
            x = x.args[0][0]
            continue
        if below.softcap is not None and not (_is_cast(x) or (is_call(x, aten.mul.Tensor) and is_number(x.args[1]))):
            return None                 # a mask (or anything but a scale) before the cap: not the kernel's order
        if (is_call(x, aten.mul.Tensor) and is_number(x.args[1]) and not x.kwargs and is_call(x.args[0], aten.tanh.default)
                and below.softcap is None and below.factor == 1.0 and not below.tensor_scale and x.args[1] > 0
                and len(x.args[0].users) == 1):
            # logit soft-capping (Gemma 2): c·tanh(a·s) is the kernel's c·tanh(scale·s / c) with scale = a·c
            below.softcap = float(x.args[1])
            scale *= x.args[1]
            nodes += [x, x.args[0]]
            x = x.args[0].args[0]
            continue
        if _is_cast(x):
            nodes.append(x)
            below.ops.append(("cast", x.kwargs.get("dtype")))
            x = x.args[0]
        elif is_call(x, aten.mul.Tensor) and is_number(x.args[1]) and not x.kwargs:
            nodes.append(x)
            scale *= x.args[1]
            below.factor *= x.args[1]
            below.ops.append(("scale", x.args[1]))
            x = x.args[0]
        elif is_call(x, aten.mul.Tensor) and not x.kwargs and _zero_dim_factor(x) is not None and st is None:
            if val(x.args[1]).numel() != 1 and (val(x).dtype != val(x.args[0]).dtype or below.softcap is not None
                                                or not is_call(x.args[0], aten.matmul.default)):
                return None             # a per-head factor: eager's product of QKᵀ itself, in the scores' dtype, is
                #                         what the kernel computes (head_scale_dtype); not a promoted or later one
            st = x.args[1]              # a live 0-d factor: read by the fused op at call time
            nodes.append(x)
            below.tensor_scale = True
            x = x.args[0]
        elif _zero_added(x):
            nodes.append(x)             # s + 0 (XLNet's absent segment term, ``ac + bd + ef`` with ef = 0): the
            x = x.args[0]               # scores themselves, but for a zero's sign, which exp does not see
        elif is_call(x, aten.where.ScalarOther):
            keep, y, fill = x.args
            if val(keep).dtype != torch.bool or below.tensor_scale or not is_number(fill):
                return None             # a mask scaled by a runtime factor has no fixed meaning here
            f = below.fill_at_softmax(fill, val(x).dtype)
            if not (f == -math.inf or f <= below.fill_at_softmax(NEG_FILL, val(x).dtype)) or math.isnan(f):
                return None             # a fill that does not mask is not a mask (-1e4 as the dtype rounds it)
            if f != -math.inf and below.additive:
                # fill + an additive mask below it: no single fill describes it
                below.why = (f"a bool mask's fill {f:g}, then an additive mask: eager's filled scores are fill + "
                             f"mask, so the mask reaches the softmax where the bool mask fills (and, on a row every "
                             f"key of which is filled, takes a gradient there); the kernel reads one mask whose "
                             f"filled entries replace the scores, the other order (a mask, then the fill)")
                return None
            nodes.append(x)
            masks.append((keep, "bool", below.factor, f))
            x = y
        elif _added(x):
            if below.tensor_scale:
                return None
            if any(kind == "bool" and f != -math.inf for _, kind, _, f in masks):
                # an additive mask, then a finite fill (MPT: ALiBi, then masked_fill(causal, finfo.min); a bias, then
                # masked_fill(~keep, -1e9)): one additive mask where(keep, sum, fill), whose entries equal to the fill
                # the kernel selects in place of the score (fill_in_mask), says it exactly, a row the keep-mask
                # masks entirely attending to the filled keys as in eager
                below.fill_last = True
            for up, m, sign in _added(x):
                if not val(m).is_floating_point() or shape(x) != shape(up):
                    continue
                if chain is not None and up not in chain:
                    continue
                b = below.copy()
                b.additive = True
                rest = _walk_scores(up, b, chain)
                below.why = below.why or b.why
                if rest is not None:
                    return _Scores(rest.qk, scale * rest.scale, masks + [(m, "additive", sign * below.factor, None)]
                                   + rest.masks, nodes + [x] + rest.nodes, st if st is not None else rest.scale_tensor,
                                   rest.softcap, rest.fill_last, sinks, ((m, val(x).dtype),) + rest.adds)
            return None
        else:
            return None


def _zero_added(n: fx.Node) -> bool:
    """``s + 0`` or ``s - 0`` (a Python zero, no ``alpha``), of the scores' dtype: the scores themselves."""
    return (is_call(n, aten.add.Tensor, aten.sub.Tensor) and not n.kwargs and len(n.args) == 2
            and is_number(n.args[1]) and n.args[1] == 0 and val(n).dtype == val(n.args[0]).dtype)


def _added(n: fx.Node) -> tuple:
    """How ``n`` adds a tensor to the scores: ``((scores, mask, sign), ...)``, one entry for each operand that may be
    the scores, or ``()``. An ``add`` either way round, sign 1; a subtraction ``s - m`` (``sub(s, m)``, ``rsub(m,
    s)``) with the scores the minuend, sign -1: ``fl(s - m) == fl(s + (-m))`` in IEEE arithmetic, so it adds the
    mask ``m`` times -1 (XLNet's ``score - 65500 * mask``); ``m - s`` negates the scores, no mask. An ``alpha``
    (``s - a·m``) is refused: eager scales m unrounded, in fp32, where a 16-bit term scaled by a may overflow."""
    if len(n.args) != 2 or not all(isinstance(a, fx.Node) for a in n.args):
        return ()
    a, b = n.args
    if is_call(n, aten.add.Tensor) and not n.kwargs:
        return (a, b, 1.0), (b, a, 1.0)
    if is_call(n, *SUBTRACTIONS) and set(n.kwargs) <= {"alpha"} and n.kwargs.get("alpha", 1) == 1:
        return ((a, b, -1.0),) if is_call(n, aten.sub.Tensor) else ((b, a, -1.0),)
    return ()


def _sink_logits(cat: fx.Node) -> fx.Node | None:
    """For ``cat([scores, sink], -1)`` of rank-4 scores: the node of the sink logits before their broadcast, when
    they are one logit per head (a value of shape ``[..., N or 1, 1, 1]``, the same for every batch and query:
    GPT-OSS's ``sinks.reshape(1, -1, 1, 1).expand(B, -1, Sq, -1)``), else None."""
    parts = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if len(parts) != 2 or not all(isinstance(t, fx.Node) for t in parts) or len(shape(cat)) != 4 or dim not in (-1, 3):
        return None
    scores, sink = parts
    if shape(sink) != (*shape(scores)[:-1], 1) or not val(sink).is_floating_point():
        return None
    while is_call(sink, aten.expand.default):
        sink = sink.args[0]
    s = shape(sink)
    s = (1,) * (4 - len(s)) + tuple(s) if len(s) <= 4 else None
    if s is None or s[0] != 1 or s[2:] != (1, 1) or s[1] not in (1, shape(scores)[1]):
        return None
    return sink


def _exclusive(n: fx.Node, inside: set) -> bool:
    return all(u in inside for u in n.users)


def _kv_source(k, v, rank):
    """Look through matching repeat_interleave(·, r, -3) on k and v (GQA); returns (k, v, rep, views)."""
    if rank == 4 and all(is_call(t, *KV_VIEWS) and t.args[2] == -3 for t in (k, v)) and k.args[1] == v.args[1]:
        return k.args[0], v.args[0], k.args[1], [k, v]
    return k, v, 1, []


def _layout(rank):
    return {4: "BNSD", 3: "(BN)SD", 2: "SD"}.get(rank)


def _score_op(n: fx.Node) -> bool:
    """A cast, a scale (a Python number or a one-element tensor), an additive mask (added or subtracted), a
    ``where`` fill, the ``tanh`` of a soft-cap or the ``cat`` of sink logits."""
    if _is_cast(n) or is_call(n, aten.where.ScalarOther, aten.tanh.default):
        return True
    if is_call(n, aten.cat.default):
        return _sink_logits(n) is not None
    if is_call(n, aten.mul.Tensor):
        return is_number(n.args[1]) or _zero_dim_factor(n) is not None
    if _zero_added(n):
        return True
    if is_call(n, *SUBTRACTIONS):
        return bool(_added(n)) and val(n).is_floating_point()
    return is_call(n, aten.add.Tensor) and not n.kwargs and val(n).is_floating_point()


def _prob_op(n: fx.Node) -> bool:
    """A cast, a dropout (``native_dropout`` and its output, or ``dropout``) in training mode, or the slice that drops
    the sink column (``probs[..., :-1]``)."""
    if _is_cast(n):
        return True
    if is_call(n, aten.slice.Tensor):
        return _drops_sink(n)
    if is_call(n, aten.native_dropout.default, aten.dropout.default):
        return bool(arg(n, 2, "train"))
    return n.target is operator.getitem and n.args[1] == 0 and is_call(n.args[0], aten.native_dropout.default)


def _drops_sink(n: fx.Node) -> bool:
    """``x[..., :-1]``: a slice of the last dim from 0 that keeps all but the last column, step 1."""
    sl = last_dim_slice(n)
    return sl is not None and sl[1:] == (0, shape(sl[0])[-1] - 1, 1)


def _last_two(n):
    return tuple(n.args[1:]) == (-2, -1)


def _last_dim(n):
    return n.args[1] == -1 and len(n.args) == 2


def _heads_dim(n):
    return len(n.args) >= 3 and n.args[2] == -3


_ATTENTION = (Template("attention", anchor="softmax")
              .node("qk", aten.matmul.default)
              .node("kt", aten.transpose.int, where=_last_two)            # kᵀ: a transpose of k's last two dims
              .node("krep", aten.repeat_interleave.self_int, where=_heads_dim, optional=True)   # GQA on k
              .node("softmax", aten.softmax.int, where=_last_dim)
              .node("pv", aten.matmul.default)
              .node("vrep", aten.repeat_interleave.self_int, where=_heads_dim, optional=True)   # GQA on v
              .edge("krep", "kt", arg=0).edge("kt", "qk", arg=1)
              .chain("score", SCORE_OPS, "qk", "softmax", max_len=6, where=_score_op, arg=0)
              .chain("prob", set(PROB_OPS) | {aten.native_dropout.default, aten.dropout.default, operator.getitem},
                     "softmax", "pv", max_len=3, where=_prob_op, arg=0)
              .edge("vrep", "pv", arg=1))

_SDPA = (Template("attention", anchor="sdpa")
         .node("sdpa", aten.scaled_dot_product_attention.default)
         .node("krep", aten.repeat_interleave.self_int, where=_heads_dim, optional=True)
         .node("vrep", aten.repeat_interleave.self_int, where=_heads_dim, optional=True)
         .edge("krep", "sdpa", arg=1).edge("vrep", "sdpa", arg=2))

TEMPLATES = (_ATTENTION, _SDPA)


def _decide_softmax(m: dict) -> Match | None:
    """The constraints of a matched softmax block: scores and probabilities semantics, shapes, GQA, uses."""
    sm, qk, pv, b = m["softmax"], m["qk"], m["pv"], m["kt"]
    if sm.meta.get("autofuse_lse_softmax"):
        return None     # exp(s - logsumexp(s)): on a row whose max is +inf its weights are 0 but at the +inf score
        #                 (NaN there), so dV stays finite but at that key; the flash kernel's softmax is NaN over
        #                 the row. Left to the softmax family, which keeps those values
    rank = len(shape(sm))
    if _layout(rank) is None:
        return None
    probs_chain = [m[k] for k in sorted(k for k in m if k.startswith("prob"))]
    pchain = [sm] + probs_chain
    drops = [n for n in probs_chain if is_call(n, aten.native_dropout.default, aten.dropout.default)]
    if len(drops) > 1:
        return None                 # dropout of a dropout: not one FlashAttention dropout
    dropout_p = float(arg(drops[0], 1, "p")) if drops else 0.0
    draw = None
    if drops and (is_call(drops[0], aten.native_dropout.default) or 0.0 < dropout_p < 1.0):
        x = val(drops[0].args[0])           # native_dropout draws even at p = 0; dropout only for 0 < p < 1
        draw = (tuple(x.shape), x.dtype, keep_mask_order(drops[0]))
    score = {m[k] for k in m if k.startswith("score")}
    below = _Below()
    sc = _walk_scores(sm.args[0], below, score | {qk})
    if sc is None and below.why:                # attention the kernel cannot run: reported with the reason
        k, v, _, _ = _kv_source(b.args[0], pv.args[1], rank)
        return _unsupported({"q": qk.args[0].name, "k": k.name, "v": v.name}, score | set(pchain) | {qk, pv}, pv,
                            qk.args[0], below.why)
    if sc is None or sc.qk is not qk or set(sc.nodes) != score:
        return None
    rounded = rounds_and_widens([qk, *_members(m, "score"), *pchain])
    narrowed = narrowing_casts(sc.nodes)   # the model rounds its scores down before the softmax: the kernel,
    #                                       computing them from q and k in fp32, would not (a reason, below)
    slices = [n for n in probs_chain if is_call(n, aten.slice.Tensor)]
    if (sc.sinks is None) != (not slices) or len(slices) > 1 or (sc.sinks is not None and rank != 4):
        return None                 # the sink column is dropped exactly when sinks were concatenated, once
    with_sink = [sm] + probs_chain[:probs_chain.index(slices[0])] if slices else []
    if any(not _is_cast(n) for n in with_sink[1:]):
        return None                 # only casts before the sink column is dropped (dropout would draw for it)
    q, k_rep, v_rep = qk.args[0], b.args[0], pv.args[1]
    if v_rep in pchain or any(len(shape(t)) != rank for t in (q, k_rep, v_rep, pv)):
        return None
    k, v, rep, kv_views = _kv_source(k_rep, v_rep, rank)
    if kv_views and not ("krep" in m and "vrep" in m):
        return None                 # the largest variant takes the GQA views; a smaller one must not
    qs, ks, vs = shape(q), shape(k), shape(v)
    if not (qs[:-3] == ks[:-3] == vs[:-3] and ks[-2] == vs[-2] and qs[-1] == ks[-1]):
        return None
    if rank == 4 and not kv_views and ks[-3] == vs[-3] == 1 < qs[-3]:
        rep = qs[-3]                # one k/v head that both matmuls broadcast over the heads (Falcon's multi-query)
    if rank >= 3 and not (qs[-3] == ks[-3] * rep == vs[-3] * rep):
        return None
    core = set(sc.nodes) | set(pchain) | {sc.qk, pv}
    probs = [n for n in pchain if not _exclusive(n, core)]
    if len(probs) > 1 or any(not _exclusive(n, core) for n in sc.nodes + [sc.qk]):
        return None  # scores consumed outside the block, or probabilities at two points
    if any(n in probs for n in with_sink):
        return None  # probabilities read with the sink's column: the kernel's have none
    if any(u is not pv and is_call(u, aten.matmul.default) for n in pchain for u in n.users):
        return None  # the probabilities feed another matmul too
    optional = [n for n in [b] + kv_views if _exclusive(n, core | {b} | set(kv_views))]
    inputs = {"q": q.name, "k": k.name, "v": v.name}
    if rounded:                     # scores or probabilities rounded to 16 bits and back: eager keeps the rounding
        return _unsupported(inputs, core, pv, q, _narrowed_reason(narrowed[0], sm) if narrowed else
                            _rounded_probs_reason(pchain))
    logits_round = _logits_round(narrowed, sm, sc, q, k, v) if narrowed else None
    if narrowed and logits_round is None:
        return _unsupported(inputs, core, pv, q, _narrowed_reason(narrowed[0], sm))
    v_cast = None
    if len({val(q).dtype, val(k).dtype, val(v).dtype}) > 1:
        # GPT-J and CodeGen upcast q and k to fp32 and leave v in the model's dtype: the kernel takes one dtype, so
        # v is cast up to q's first (an exact widening; eager's P·V in v's dtype is the less precise side)
        widening = val(q).dtype == val(k).dtype == torch.float32 and val(v).dtype in (torch.float16, torch.bfloat16)
        if not widening:
            return _unsupported(inputs, core, pv, q, f"q, k and v of different dtypes ("
                                f"{', '.join(str(val(t).dtype).replace('torch.', '') for t in (q, k, v))})")
        v_cast = val(q).dtype
    if sc.scale_tensor is not None:
        if (val(sc.scale_tensor).numel() != 1 and val(sc.qk).dtype != torch.float32
                and abs(math.frexp(sc.scale)[0]) != 0.5):
            return None                 # 16-bit scores scaled by a per-head factor and a number that is not a power
            #                             of two: the kernel's roundings would come in another order than eager's
        inputs["scale_tensor"] = sc.scale_tensor.name
    if sc.sinks is not None:
        inputs["sinks"] = sc.sinks.name
    empty = "zero" if sm.meta.get("autofuse_safe_softmax") else "nan"
    found = _finish(inputs, sc.masks, core | set(optional), pv, sc.scale, False, q, k, v, rep,
                    probs[0] if probs else None, empty, dropout_p, draw, sc.softcap, sc.fill_last, v_cast,
                    sc.sinks is not None, sc.adds)
    if sc.scale_tensor is not None and val(sc.scale_tensor).numel() != 1 and "unsupported" not in found.params:
        found.params["scale_per_head"] = True       # the kernel's head_scale: one factor per query head
        found.params["scale_round"] = _per_head_rounding(sc)
    if logits_round is not None and "unsupported" not in found.params:
        found.params["logits_round"] = logits_round  # eager's 16-bit scores and logits, rounded as eager rounds them
    return found


def _logits_round(narrowed: list, sm: fx.Node, sc: _Scores, q, k, v) -> torch.dtype | None:
    """The 16-bit dtype of a block whose 16-bit scores are cast up, scaled and masked in fp32 and cast down once,
    right before the softmax (Falcon's ALiBi path: ``softmax(logits32 + mask, -1, dtype=bf16)``), which the kernel
    then reproduces (``logits_dtype``: the scores rounded as the matmul returns them, the logits before the
    softmax); None for any other downcast: to another dtype than q's, k's and v's, with an op between it and the
    softmax, or of scores computed in another dtype on the way (the kernel would not round where eager does)."""
    (cast,) = narrowed if len(narrowed) == 1 else (None,)
    if cast is None or sm.args[0] is not cast:
        return None
    d = val(cast).dtype
    if any(val(t).dtype != d for t in (q, k, v, sc.qk)):
        return None
    if sc.softcap is not None or sc.sinks is not None or sc.scale_tensor is not None:
        return None
    if any(val(n).dtype != torch.float32 for n in sc.nodes if n is not cast):
        return None
    if any(kind == "additive" and val(m).dtype not in (d, torch.float32) for m, kind, _, _ in sc.masks):
        return None
    return d


def _narrowed_reason(cast: fx.Node, sm: fx.Node) -> str:
    """Why a block whose scores are cast down to 16 bits before the softmax is not fused: the kernel computes them
    from q and k in fp32 and has no rounding there. The cast is the model's own (``(q @ kᵀ).half()``) or, with no
    captured node of its own, the softmax's ``dtype=`` argument (Falcon's ALiBi path in 16 bits:
    ``softmax(logits32 + mask, -1, dtype=bfloat16)``, which casts its fp32 input down before the softmax)."""
    to, frm = (str(val(n).dtype).replace("torch.", "") for n in (cast, cast.args[0]))
    if cast.meta.get("autofuse_origin") is None:
        how = f"by the softmax's dtype={to} argument (softmax(x, -1, dtype={to}) of {frm} logits)"
    else:
        how = f"by a cast the model writes ({cast.meta['autofuse_origin']})"
    return (f"the scores are cast down from {frm} to {to} before the softmax, {how}: eager rounds them to {to} "
            f"there, the attention kernel computes them in fp32 and has no such rounding")


def _rounded_probs_reason(pchain: list) -> str:
    """Why a block whose probabilities are rounded to a narrower float dtype and widened again is not fused
    (``p.half().float()`` of an fp32 model's softmax, a softmax's ``dtype=float16`` of bf16 scores cast back to
    bf16): the kernel takes the chain's casts only as the dtypes of its ends and would not round in between."""
    dtypes = [str(val(n).dtype).replace("torch.", "") for n in pchain if isinstance(val(n), torch.Tensor)]
    path = " -> ".join(d for i, d in enumerate(dtypes) if i == 0 or d != dtypes[i - 1])
    return (f"the probabilities are rounded to a narrower dtype and widened again ({path}): eager keeps that "
            f"rounding, the attention kernel computes them in fp32 and casts only at its ends")


def _per_head_rounding(sc: _Scores) -> torch.dtype | None:
    """The 16-bit dtype eager multiplies its scores by a per-head factor in (the product of QKᵀ, rounded to it, and
    the factor, rounded once more), which the kernel then reproduces (``head_scale_dtype``); None for an fp32
    product."""
    mul = next(n for n in sc.nodes if is_call(n, aten.mul.Tensor) and n.args[1] is sc.scale_tensor)
    d = val(mul).dtype
    return d if d in (torch.float16, torch.bfloat16) else None


def _members(m: dict, chain: str) -> list:
    """The matched members of a template chain, in chain order."""
    return [m[k] for k in sorted((k for k in m if k.startswith(chain) and k[len(chain):].isdigit()),
                                 key=lambda k: int(k[len(chain):]))]


def _dropout_after(x):
    """``(p, nodes)`` if x's only use is a training-mode dropout (``native_dropout(x, p, True)[0]`` or
    ``dropout(x, p, True)``); ``nodes`` ends with the dropped-out value. Else None."""
    if len(x.users) != 1:
        return None
    (d,) = x.users
    if is_call(d, aten.native_dropout.default) and arg(d, 2, "train"):
        outs = [u for u in d.users if u.target is operator.getitem and u.args[1] == 0]
        if len(outs) == 1 and all(u.args[1] in (0, 1) for u in d.users):
            return float(arg(d, 1, "p")), [d, outs[0]]
    if is_call(d, aten.dropout.default) and arg(d, 2, "train"):
        return float(arg(d, 1, "p")), [d]
    return None


def _decide_sdpa(m: dict) -> Match | None:
    n = m["sdpa"]
    q, k, v = n.args[:3]
    if ("krep" in m) != ("vrep" in m):
        return None
    mask, dropout_p = arg(n, 3, "attn_mask"), arg(n, 4, "dropout_p", 0.0)
    causal, scale, gqa = arg(n, 5, "is_causal", False), n.kwargs.get("scale"), n.kwargs.get("enable_gqa", False)
    rank = len(shape(q))
    if _layout(rank) is None or any(len(shape(t)) != rank for t in (k, v)):
        return None
    rep = shape(q)[-3] // shape(k)[-3] if (gqa and rank == 4) else 1
    views = []
    if rep == 1:
        k, v, rep, views = _kv_source(k, v, rank)
    scale = 1.0 / math.sqrt(shape(q)[-1]) if scale is None else scale
    masks = []
    if mask is not None:
        is_bool = val(mask).dtype == torch.bool
        masks.append((mask, "bool" if is_bool else "additive", 1.0, -math.inf if is_bool else None))
    core = {n} | {x for x in views if _exclusive(x, {n} | set(views))}
    # SDPA applies dropout_p whatever the module's mode (a nonzero p is random in eval too); on the CPU it
    # draws its keep-mask for the [..., Sq, Skv] weights as dropout does, for 0 < p < 1
    dropout_p = float(dropout_p or 0.0)
    draw = ((*shape(q)[:-1], shape(k)[-2]), val(q).dtype, None) if 0.0 < dropout_p < 1.0 else None
    m = _finish({"q": q.name, "k": k.name, "v": v.name}, masks, core, n, scale, causal, q, k, v, rep, None,
                "zero", dropout_p, draw)
    m.params["mask_keeps_nan"] = True              # SDPA adds -inf for a False entry: NaN scores stay NaN
    return m


def _finish(inputs, masks, core, anchor, scale, causal, q, k, v, rep, probs, empty_rows, dropout_p,
            draw=None, softcap=None, fill_last=False, v_cast=None, sinks=False, adds=(), windows=True) -> Match:
    """The match of an attention block from its parts (``adds``: each additive mask with the dtype of the add
    that adds it to the scores, :class:`_Scores`; SDPA has none, its CPU kernel adds its mask in fp32)."""
    args = (inputs, masks, core, anchor, scale, causal, q, k, v, rep, probs, empty_rows, dropout_p, draw, softcap,
            fill_last, v_cast, sinks, adds)
    qs, ks = shape(q), shape(k)
    guards, terms, causal_fill, guarded, window, band = [], [], -math.inf, None, 0, None
    for m, kind, factor, fill in masks:
        proven, value, width = prove_mask(m, kind, factor, qs[-2], ks[-2], guards)
        if proven == "window" and not windows:
            proven, width = None, 0
        if width and (not window or width < window):
            window = width                  # two proven masks keep their intersection: the narrower band
            band = (m, kind, factor, fill)
        if proven in ("causal", "window") and kind == "additive" and value > ABSORBING_FILL:
            # a causal mask adding a finite value (GPT-2 in fp16 adds finfo(float16).min): kept as the user's
            # additive mask, exactly; the kernel may still skip above the diagonal (and, for a sliding window's
            # band, left of it) where a bound proves it exact
            terms.append((m, kind, factor, fill))
            guarded = value
        elif proven in ("causal", "window"):
            causal, causal_fill = True, fill if kind == "bool" else value
        elif proven != "none":
            terms.append((m, kind, factor, fill))
    fills = {f for _, kind, _, f in terms if kind == "bool"}
    if causal and causal_fill != -math.inf:
        fills.add(causal_fill)
    if len(fills) > 1:
        return _unsupported(inputs, core, anchor, q, "masks with different fill values")
    fill = fills.pop() if fills else -math.inf
    kinds = {kind for _, kind, _, _ in terms}
    if fill != -math.inf and kinds == {"bool", "additive"} and not fill_last:
        return _unsupported(inputs, core, anchor, q, "a finite-fill bool mask combined with an additive mask")
    if fill_last and any(kind == "additive" and float(torch.tensor(fill, dtype=val(m).dtype)) != fill
                         for m, kind, _, _ in terms if isinstance(m, fx.Node)):
        return _unsupported(inputs, core, anchor, q, "a fill the additive mask's dtype cannot hold")
    if fill_last and fill > ABSORBING_FILL:
        # the kernel marks a filled score by the fill's value in the one mask: an additive term that itself holds
        # that value (a padding mask of -1e4 under a causal fill of -1e4) would be read as filled, which eager's
        # s + fill is not on a row every key of which is masked
        held = next((w for m, kind, factor, _ in terms if kind == "additive" and isinstance(m, fx.Node)
                     for w in [_may_hold(m, fill, factor)] if w), None)
        if held:
            return _unsupported(inputs, core, anchor, q, (
                f"an additive mask that may hold the fill {fill:g} itself ({held}), then that fill: the kernel, "
                f"which selects the fill where the one mask holds it, would read such an entry as filled, and on a "
                f"row every key of which is masked eager's softmax weighs s + fill there, not the fill"))
    guarded = guarded if len(terms) == 1 and not causal else None
    if causal and fill != -math.inf and (terms or fill > ABSORBING_FILL):
        # the kernel skips tiles above the diagonal; with a finite fill that is exact only when every row keeps
        # a key and the fill absorbs what is added to it: otherwise the causal mask stays an explicit mask,
        # which the kernel may still skip where a bound on the scores proves the skipped weights vanish (a
        # sliding window's band is then matched as the user's mask, read as it is)
        if window and band[1] != "bool":
            return _finish(*args, windows=False)
        causal = False
        guarded = fill if not terms else None
        # the mask read: the causal one as a constant, a sliding window's band as the user's own mask
        terms.append((_constant_causal(anchor, qs[-2], ks[-2]), "bool", 1.0, fill) if not window else band)
        window = window if guarded is not None else 0
    for i, (m, kind, factor, _) in enumerate(terms):
        inputs["mask" if i == 0 else f"mask_{i}"] = m.name if isinstance(m, fx.Node) else m
    kinds = {kind for _, kind, _, _ in terms}
    mask_kind = None if not kinds else ("bool" if kinds == {"bool"} else "additive")
    # a proven causal mask read or skipped under the run-time bound (guarded) keeps the fp32 add: the skip then
    # gives exactly what reading it gives
    add_dtype = _mask_add_dtype(terms, adds) if guarded is None else None
    rank = len(qs)
    heads = qs[-3] if rank == 4 else 1
    order = [x.name for x in anchor.graph.nodes if x in core]
    params = dict(
        scale=float(scale), causal=bool(causal), mask_kind=mask_kind,
        mask_terms=tuple(("mask" if i == 0 else f"mask_{i}", kind, float(f)) for i, (_, kind, f, _) in enumerate(terms)),
        fill=None if fill == -math.inf else float(fill), empty_rows=empty_rows, dropout_p=float(dropout_p),
        dropout_draw=draw, softcap=softcap, v_cast=v_cast, sinks=bool(sinks), fill_last=bool(fill_last and mask_kind == "additive" and fill != -math.inf),
        causal_value=None if guarded is None else float(guarded), mask_add_dtype=add_dtype,
        window=int(window) if causal or guarded is not None else 0,      # the band the kernel walks (or may skip to)
        num_heads=heads, num_kv_heads=heads // rep, layout=_layout(rank),
        probs_used=probs is not None, probs_node=probs.name if probs is not None else None,
        dtype=val(q).dtype, q_shape=qs, k_shape=ks, v_shape=shape(v), out_shape=shape(anchor),
        guards=tuple(guards), out_like=val(anchor), probs_like=val(probs) if probs is not None else None,
    )
    if not causal and guarded is None and not fill_last and softcap is None and not sinks:
        found = _causal_bias(masks, adds, terms, inputs, q, qs, ks, guards)
        if found is not None:
            bias, value, summed = found
            if summed:
                # s + (b + C): the block reads b and builds b + C itself (C's entries 0 and v, proven), as eager adds
                # them (fl(b + c) == fl(c + b)), so the values stay the user's sum however b is checked or changed
                for r in [r for r in inputs if r.startswith("mask")]:
                    del inputs[r]
                inputs["mask"], inputs["mask_1"] = bias.name, _constant_causal(anchor, qs[-2], ks[-2])
                params.update(mask_terms=(("mask", "additive", 1.0), ("mask_1", "bool", 1.0)), fill=float(value),
                              causal_sum=True)
            role = next(r for r in inputs if r.startswith("mask") and inputs[r] == bias.name)
            params.update(causal_value=float(value), causal_bias=role, guards=tuple(guards))
    outputs = {"out": anchor.name}
    if probs is not None:
        outputs["probs"] = probs.name
    return Match("attention", tuple(order), anchor.name, inputs, params, outputs)


def _causal_bias(masks, adds, terms, inputs, q, qs, ks, guards) -> tuple | None:
    """``(b, v, summed)`` when the additive mask reaching the scores is a bias ``b`` plus a proven causal mask ``C``
    whose masked entries add the absorbing value ``v`` (``-inf < v <= ABSORBING_FILL``: transformers' fp32
    ``finfo.min``), all fp32 and rank 4: ``s + b + C`` (T5's decoder: two adds, either order) or ``s + (b + C)``
    (``summed``: the sum one mask, either order). Without the sum the block reads its mask as it does without
    this (``where(tril, b, -inf)``, the fallback); the fused op may instead run the causal kernel reading ``b``
    alone in the kept tiles, where run-time bounds on the scores and on ``b`` prove it exact
    (:func:`autofuse.ops.causal_bias_skip_is_exact`). ``b`` is not proven or baked in (weights, inputs,
    anything): it is bounded when the op runs. A causal window's band is left as it is read today (its mask is
    the user's, an input a check may vary apart from the bias). Else None."""
    if val(q).dtype != torch.float32 or len(qs) != 4:
        return None
    if any(dt != torch.float32 for _, dt in adds):
        return None
    additive = [(m, f) for m, kind, f, _ in masks if kind == "additive"]
    if len(additive) != len(masks) or any(f != 1.0 or not isinstance(m, fx.Node) for m, f in additive):
        return None
    if len(additive) == 2:
        pair, summed = [m for m, _ in additive], None
    elif len(additive) == 1 and is_call(additive[0][0], aten.add.Tensor) and not additive[0][0].kwargs \
            and all(isinstance(a, fx.Node) for a in additive[0][0].args):
        summed = additive[0][0]
        pair = list(summed.args)
        if val(summed).dtype != torch.float32:
            return None
    else:
        return None
    found = []
    for c, b in (pair, pair[::-1]):
        if val(c).dtype != torch.float32 or val(b).dtype != torch.float32 or len(shape(b)) != 4:
            continue
        trial: list = []
        proven, value, _ = prove_mask(c, "additive", 1.0, qs[-2], ks[-2], trial)
        if proven != "causal" or value is None or not -math.inf < value <= ABSORBING_FILL:
            continue
        if prove_mask(b, "additive", 1.0, qs[-2], ks[-2], [])[0] is not None:
            continue                    # a constant bias that is itself a mask: the proofs say what it is
        found.append((b, value, trial))
    if len(found) != 1:
        return None
    b, value, trial = found[0]
    if summed is None:
        # the walk's reading: b, then the proven causal mask as the constant tril with fill v
        if [(m, kind) for m, kind, _, _ in terms] != [(b, "additive"), (terms[-1][0], "bool")] or \
                not isinstance(terms[-1][0], str):
            return None
    guards.extend(r for r in trial if r not in guards)
    return b, value, summed is not None


def _mask_add_dtype(terms, adds) -> torch.dtype | None:
    """The 16-bit dtype the kernel adds the additive masks in, as eager adds them (``flash_attention``'s
    ``mask_add_dtype``), or None (an fp32 add). Eager adds a 16-bit mask to 16-bit scores in that dtype: a score
    the mask absorbs (``finfo(float16).min`` + a score below 16 is ``-65504``) takes the mask's value, and a row
    whose every key is so masked averages V. The kernel does the same (the scores cast down, the add, the sum
    cast back up) when every additive term is of one 16-bit dtype and added in it, and reaches the softmax
    scaled by plus or minus a power of two (or not scaled; -1: a subtracted mask, ``fl(s - m) == fl(s + (-m))``),
    which commutes with the rounding; otherwise it adds in fp32."""
    additive = [(m, factor) for m, kind, factor, _ in terms if kind == "additive"]
    if not additive:
        return None
    added = dict(adds)
    dtypes = {added.get(m) for m, _ in additive}
    d = dtypes.pop() if len(dtypes) == 1 else None
    if d not in (torch.float16, torch.bfloat16):
        return None
    if not all(isinstance(m, fx.Node) and val(m).dtype == d and abs(math.frexp(factor)[0]) == 0.5
               for m, factor in additive):
        return None
    return d


#: ops whose output is computed from activations (a product over a dimension): a value equal to a fill after them
#: is a coincidence, so :func:`_may_hold` does not look above them
_COMPUTED = (aten.matmul.default, aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default,
             aten.linear.default, aten.einsum.default, aten.convolution.default)
_HOLD_WALK = 2000       # nodes :func:`_may_hold` reads before it says "may" (a term it cannot see the end of)


def _may_hold(m: fx.Node, fill: float, factor: float) -> str | None:
    """Why the additive mask ``m`` (added with ``factor``) may hold ``fill`` at the softmax input, or None: it is
    given as a floating-point input of the model, or built from a constant of that value (``(1 - keep) * -1e4``,
    ``full(..., -1e4)``, ``masked_fill(..., -1e4)``), or reads a parameter or buffer (a value the user may set to it
    after planning: read when planning, it would be baked into the plan). A term computed by a product (ALiBi's
    distances times slopes from ``arange``, ``q·posᵀ``) holds it only by coincidence."""
    targets = {float(fill), float(fill) / factor if factor else float(fill)}

    def close(x) -> bool:
        return is_number(x) and not isinstance(x, bool) and any(
            math.isclose(float(x), t, rel_tol=1e-3) for t in targets)

    seen, todo = set(), [m]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > _HOLD_WALK:
            return f"its computation is longer than {_HOLD_WALK} ops"
        if n.op == "get_attr":
            return f"it reads {n.target}, a parameter or buffer the model may set to it"
        if n.op == "placeholder":
            v = val(n)
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return f"it is the model's input {n.name}"
            continue
        if any(close(a) for a in pytree.tree_leaves((n.args, n.kwargs))):
            return f"{n.name} is built from it"
        if is_call(n, *_COMPUTED):
            continue
        todo.extend(n.all_input_nodes)
    return None


def _unsupported(inputs, core, anchor, q, why) -> Match:
    order = [x.name for x in anchor.graph.nodes if x in core]
    return Match("attention", tuple(order), anchor.name, dict(inputs),
                 dict(unsupported=why, dtype=val(q).dtype, q_shape=shape(q), guards=()), {"out": anchor.name})


def _constant_causal(anchor, sq, skv) -> str:
    """A causal keep-mask as a constant the rewrite builds (``Match.inputs`` value ``"const:tril:Sq:Skv"``)."""
    return f"const:tril:{sq}:{skv}"


def prove_mask(m: fx.Node, kind: str, factor: float, sq: int, skv: int, guards: list) -> tuple:
    """``("causal", masked value, 0)`` / ``("window", masked value, w)`` / ``("none", None, 0)`` if the constant mask
    equals SDPA's causal mask / a causal sliding window of ``w`` keys (query i keeps keys ``i - w < j <= i``:
    transformers' ``sliding_window_causal_mask_function``) / masks nothing, else ``(None, None, 0)``. For an additive mask the masked value is the one value every
    masked entry takes, times ``factor``: ``-inf`` or at most ``NEG_FILL``. The caller decides what the proof
    buys: a value that absorbs any finite score added to it (``<= ABSORBING_FILL``) makes the kernel's causal
    skip exact; a finite one above it keeps the mask and lets the kernel skip under a runtime bound
    (``params["causal_value"]``).

    The mask's ancestors must be graph constants (factory ops) or the user's buffers, read now: they are
    evaluated on CPU for the captured shapes; each buffer read is appended to ``guards`` (the plan is valid
    while it keeps its identity and version). Anything depending on an input or a meta tensor is not
    provable."""
    key = (m, kind, factor, sq, skv)
    if key not in _PROOFS:         # layers share one mask node: evaluate it once per search
        reads: list = []
        _PROOFS[key] = (_prove(m, kind, factor, sq, skv, reads), tuple(reads))
    result, reads = _PROOFS[key]
    if result[0] is not None:
        guards.extend(r for r in reads if r not in guards)
    return result


_PROOFS: dict = {}


def _prove(m: fx.Node, kind: str, factor: float, sq: int, skv: int, reads: list) -> tuple:
    try:
        with torch.no_grad():
            t = evaluate_constant(m, max_numel=LARGEST_CONSTANT, state=reads)
    except Exception:  # noqa: BLE001 - "not provable" is the answer for anything we cannot evaluate
        return None, None, 0
    if t is None:
        return None, None, 0
    t = t.broadcast_to(*t.shape[:-2], sq, skv) if t.dim() >= 2 else t.broadcast_to(sq, skv)
    # every [sq, skv] plane (a broadcast leading dim repeats one), read in row blocks of at most PROOF_CHUNK
    # elements: a long sequence's mask (134 M values at 2 x 8192^2) is checked without a float64 copy of it
    planes = [t[idx] for idx in itertools.product(*(range(1) if st == 0 else range(n)
                                                    for n, st in zip(t.shape[:-2], t.stride()[:-2])))]
    rows = max(1, PROOF_CHUNK // skv)
    blocks = [(p, r0) for p in planes for r0 in range(0, sq, rows)]
    j = torch.arange(skv)[None, :]

    def block(p, r0, check=True):
        """(row indices, keep-mask, masked value or None) of a row block; None when an additive block is not a
        mask (its nonzero entries not one value at or below NEG_FILL once scaled by ``factor``). Read in the
        mask's own dtype: its nonzero entries are one value there exactly when they are one value scaled (in
        float64, by a nonzero factor), and only that value is scaled. ``check=False``: the keep-mask alone, of a
        block already checked."""
        x = p[r0:r0 + rows]
        i = torch.arange(r0, r0 + x.shape[0])[:, None]
        if kind != "additive":
            return i, x, None
        keep = x == 0
        if factor == 0 or not check or bool(keep.all()):
            return i, torch.ones_like(keep) if factor == 0 else keep, None
        lo, hi = x.amin(), x.amax()
        raw = lo if lo != 0 else hi                          # the one nonzero value, if there is one
        if not bool((keep | (x == raw)).all()):
            return None
        v = float(raw) * factor
        if not (v == -math.inf or v <= NEG_FILL):
            return None
        return i, keep, v

    value, every, causal, lost = None, True, True, None
    for p, r0 in blocks:
        got = block(p, r0)
        if got is None:
            return None, None, 0
        i, keep, v = got
        if v is not None:
            if value is not None and v != value:
                return None, None, 0
            value = v
        every = every and bool(keep.all())
        causal = causal and torch.equal(keep, j <= i)
        left = (j <= i) & ~keep                              # keys left of the diagonal that are masked
        hit = left.any(1)
        if hit.any():                                        # the last one (row-major): its row's window edge
            a = int(hit.nonzero()[-1])
            lost = (r0 + a, int(left[a].nonzero()[-1]))
    if every:
        return "none", None, 0
    if causal:
        return "causal", value, 0
    if lost is None or not 0 < lost[0] - lost[1] < sq:
        return None, None, 0
    w = lost[0] - lost[1]                                    # a sliding window's width, checked whole
    for p, r0 in blocks:
        i, keep, _ = block(p, r0, check=False)
        if not torch.equal(keep, (j <= i) & (j > i - w)):
            return None, None, 0
    return "window", value, w


@register("attention")
def find_attention(gm: fx.GraphModule) -> list[Match]:
    """Every non-overlapping attention block in ``gm`` (expects the canonical form): the two templates matched
    on the graph's networkx view, their constraints deciding; blocks taken in graph order."""
    view = graph_view(gm)
    found = []
    try:
        found += _ATTENTION.match(view, _decide_softmax)
        found += _SDPA.match(view, _decide_sdpa)
    finally:
        _PROOFS.clear()
    out, taken = [], set()
    for m in sorted(found, key=lambda m: view.order[m.anchor]):
        if taken.isdisjoint(m.nodes):
            out.append(m)
            taken.update(m.nodes)
    # blocks whose causal skip reads the same bias node (T5's decoder: every layer reads the first's position bias)
    # share one run-time bound of it: each is priced with its share (params["bias_readers"], the number of them)
    readers: dict = {}
    for m in out:
        if m.params.get("causal_bias"):
            readers.setdefault(m.inputs[m.params["causal_bias"]], []).append(m)
    for ms in readers.values():
        for m in ms:
            m.params["bias_readers"] = len(ms)
    return out


# ------------------------------------------------------------------------------- variant generator

AXES = {
    "scale": ("mul", "div", "pre_q", "pre_qk", "one"),
    "qk": ("matmul", "einsum", "bmm3d", "baddbmm3d"),
    "kt": ("transpose(-2,-1)", "transpose(2,3)", "permute(0,1,3,2)", "mT", "bsnd_permute(0,2,3,1)"),
    "mask": (None, "additive", "masked_fill", "where", "causal_tril", "causal_triu", "causal_arange"),
    "softmax": ("function", "method", "module", "decomposed", "_softmax", "fp32_dtype"),
    "dropout": (False, True),
    "gqa": (None, "repeat_kv", "repeat_interleave"),
    "sdpa": (False, True),
}


@dataclass(frozen=True)
class AttentionVariant:
    """One spelling of eager attention; every field ranges over ``AXES[field]``."""

    scale: str = "mul"
    qk: str = "matmul"
    kt: str = "transpose(-2,-1)"
    mask: str | None = None
    softmax: str = "function"
    dropout: bool = False
    gqa: str | None = None
    sdpa: bool = False

    def __post_init__(self):
        for k, allowed in AXES.items():
            if getattr(self, k) not in allowed:
                raise ValueError(f"AttentionVariant.{k}={getattr(self, k)!r} not in {allowed}")


def build_variant(var: AttentionVariant, heads: int = 4, kv_heads: int | None = None) -> torch.nn.Module:
    """An eager module ``forward(q, k, v, mask=None)`` computing attention in the spelling ``var``.

    q: [B, heads, S, D]; k, v: [B, kv_heads, S, D];
    mask: float [B, 1, S, S] added to scores (``"additive"``) or bool [B, 1, S, S] True = keep
    (``"masked_fill"``/``"where"``). Returns [B, S, heads·D]."""
    import torch.nn.functional as F

    kv_heads = kv_heads or heads

    class _Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.softmax = torch.nn.Softmax(dim=-1)
            self.drop = torch.nn.Dropout(0.25)

        def forward(self, q, k, v, mask=None):
            B, N, S, D = q.shape
            rep = N // kv_heads
            if var.gqa == "repeat_kv" and rep > 1:
                k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
            elif var.gqa == "repeat_interleave" and rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), torch.repeat_interleave(v, rep, dim=1)
            c = D ** -0.5
            if var.sdpa:
                am, causal = None, False
                if var.mask == "additive":
                    am = mask
                elif var.mask in ("masked_fill", "where"):
                    am = mask
                elif var.mask is not None:
                    causal = True
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=am, is_causal=causal,
                                                   scale=None if var.scale != "one" else 1.0)
                return o.transpose(1, 2).reshape(B, S, N * D)
            if var.scale == "pre_q":
                q = q * c
            elif var.scale == "pre_qk":
                q, k = q * c ** 0.5, k * c ** 0.5
            kt = {"transpose(-2,-1)": lambda t: t.transpose(-2, -1), "transpose(2,3)": lambda t: t.transpose(2, 3),
                  "permute(0,1,3,2)": lambda t: t.permute(0, 1, 3, 2), "mT": lambda t: t.mT,
                  # k stored as [B, S, N, D] (a projection's output), kᵀ taken straight from it
                  "bsnd_permute(0,2,3,1)": lambda t: t.transpose(1, 2).contiguous().permute(0, 2, 3, 1)}[var.kt](k)
            if var.qk == "matmul":
                s = torch.matmul(q, kt)
            elif var.qk == "einsum":
                s = torch.einsum("bhqd,bhdk->bhqk", q, kt)
            else:
                q3, kt3 = q.reshape(B * N, S, D), kt.reshape(B * N, D, -1)
                s3 = torch.bmm(q3, kt3) if var.qk == "bmm3d" else torch.baddbmm(
                    torch.zeros(B * N, S, kt.shape[-1], dtype=q.dtype, device=q.device), q3, kt3)
                s = s3.view(B, N, S, -1)
            if var.scale == "mul":
                s = s * c
            elif var.scale == "div":
                s = s / math.sqrt(D)
            if var.mask == "additive":
                s = s + mask
            elif var.mask == "masked_fill":
                s = s.masked_fill(~mask, float("-inf"))
            elif var.mask == "where":
                s = torch.where(mask, s, torch.finfo(s.dtype).min)
            elif var.mask == "causal_tril":
                t = torch.tril(torch.ones(S, S, device=q.device))
                s = s.masked_fill(t == 0, float("-inf"))
            elif var.mask == "causal_triu":
                t = torch.triu(torch.ones(S, S, dtype=torch.bool, device=q.device), diagonal=1)
                s = s.masked_fill(t, torch.finfo(s.dtype).min)
            elif var.mask == "causal_arange":
                i = torch.arange(S, device=q.device)
                s = torch.where(i[:, None] >= i[None, :], s, float("-inf"))
            p = {"function": lambda x: F.softmax(x, dim=-1), "method": lambda x: x.softmax(-1),
                 "module": self.softmax, "_softmax": lambda x: torch._softmax(x, -1, False),
                 "fp32_dtype": lambda x: F.softmax(x, dim=-1, dtype=torch.float32).to(q.dtype),
                 "decomposed": lambda x: (x - x.amax(-1, keepdim=True)).exp() / (x - x.amax(-1, keepdim=True)).exp().sum(-1, keepdim=True),
                 }[var.softmax](s)
            if var.dropout:
                p = self.drop(p)
            o = p @ v
            return o.transpose(1, 2).reshape(B, S, N * D)

    return _Attention()


def _repeat_kv(x, n_rep):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)
