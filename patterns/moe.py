"""Mixture-of-experts families: router gating (softmax or sigmoid → top-k → renormalise → scale) and the
experts block (routing → grouped GEMMs with a gated activation → weighted combine).

Targets (CANN semantics, ``autofuse.ops_moe``):

* ``moe_gating`` → ``moe_gating_topk(x, bias, k, norm, renorm, eps, routed_scaling_factor, n_group,
  topk_group, group_score)``: ``(weights [T, k], indices [T, k])``. Two templates: weights taken from the
  top-k values (Mixtral, Qwen2-MoE, Qwen3-MoE, plain ``topk(softmax(x))``), and weights gathered from the
  unbiased scores at the selected indices (DeepSeek-V3: sigmoid, a selection bias, group-limited top-k by
  the sum of each group's top two); and a third for routers that take the top k of the logits first and the
  softmax over the k chosen (GraniteMoE, GPT-OSS: ``norm="topk_softmax"``, selection on the logits). The groups
  not kept may be filled with a number instead of ``-inf`` (``group_fill``: Mistral 4's and DeepSeek-V2's 0.0);
  DeepSeek-V2's ``group_limited_greedy`` router scores a group by its max and takes the top-k *values* of the filled
  scores as weights (``weights_from="choices"``: 0.0 where a token takes a filled expert), a fourth template.
* ``moe_experts`` → ``moe_init_routing`` + ``grouped_matmul`` (SwiGLU epilogue on the fused gate_up
  projection) + ``grouped_matmul`` + ``moe_finalize_routing``. Templates for the two transformers experts
  implementations that export: ``grouped_mm`` (sort, histc, ``transformers.grouped_mm_fallback``, an
  inverse-permutation gather) and ``batched_mm`` (weights gathered per token, batched matmuls); and GPT-OSS's
  ``grouped_mm`` form: ``[E, in, out]`` weights read as stored (``params["trans_w"] = False``), a bias per expert
  gathered by the sorted expert ids after each GEMM (``inputs["b1"]``, ``["b2"]``), and its clamped SwiGLU on
  interleaved gate/up pairs (``activation="clamped_swiglu"``, ``swiglu_order="interleaved"``, ``limit``,
  ``alpha``); and GPT-OSS's ``batched_mm`` form, the same semantics from the same declarations
  (``_batched(_clamped_glu, ...)``): ``x[:, None] @ w`` with the weights and biases gathered per (token, expert)
  pair by the same flat expert ids, the bias added in place (an add and a no-op unsqueeze/squeeze re-view).
  The third,
  ``eager``, loops over the experts a token hit (``nonzero``): its routing is data-dependent, so
  ``torch.export`` cannot capture it (the capture error says so; ``torch.compile(backend="autofuse")``
  runs it with graph breaks). And Llama 4's dense form (``implementation="dense"``): every token through every
  expert by two batched matmuls, its input scaled by ``sigmoid`` of the top-k logits scattered into ``-inf``,
  summed over the experts; the scores are zero off each token's picks and an expert with zero input outputs
  zero, so it runs sparse, the scores scaling the routed rows (``weights_at="input"``), the combine summing.
  And a hand-written layer looping over a list of experts, each ``nn.Linear``s with or without biases, gated
  (``down(silu(gate(x)) * up(x))``) or plain (``down(act(gate(x)))``, ReLU, GELU or SiLU; ``implementation="loop"``):
  one template per iteration in three spellings
  (``torch.where(ids == e)`` + ``index_add_``; Mixtral's original ``one_hot(ids).permute(2, 1, 0)[e]`` mask with
  ``x[None, tok]``; the dense ``out + (w * (ids == e)).sum(-1, keepdim=True) * expert(x)``), the iterations
  chained through their accumulator (or summed) over every expert 0..E-1 the router's top-k can pick; the block,
  whose sizes depend on data only inside (``torch.where``), is one call reading the lists of the experts' gate, up
  and down weights and biases (``grouped_matmul_list``).

A router selecting on scores rounded to 16 bits (fp16/bf16 scores, a cast down and up on the way; DeepSeek-V3's under
autocast) is matched and refused with the reason (``params["unsupported"]``): eager's rounding ties scores the
kernel's fp32 scores tell apart.

Rejected by the constraints (each a near-miss test): top-k over another dim or ``largest=False``; softmax over
the tokens instead of the experts; a renormalisation by anything but the sum of the selected weights (plus
a scalar eps); a bias added after the selection; an activation other than SiLU on the gate half; halves
taken in another order than the weights were split; in the dense form, scores filled with anything but ``-inf``
off the picks, the bottom k, scores laid out token-major against the expert-major repeated tokens, an expert
bias; in the clamped form, the gate at the odd columns, a gate
clamped from below too, gate and up clamped at different limits, anything but ``up + 1``, a bias gathered by
another index; in a loop, an expert the router can pick but the loop leaves out or one looped over twice, a token's
weights summed instead of its slot's, an accumulator that does not start at zero, expert ids not from a top-k over
the experts (their range unknown), a gated expert with another activation than SiLU (GeGLU), a plain one with another
than ReLU, GELU or SiLU, a gate with a bias and an up projection without.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autofuse.graph import arg, effectful, is_number, last_dim_slice, shape, size_checks, val
from autofuse.match import Match, register
from patterns.template import Template, graph_view

aten = torch.ops.aten


def _item(i):
    def check(n):
        return n.args[1] == i
    check.__name__ = f"output_{i}"
    return check


def _cast(n):
    return set(n.kwargs) <= {"dtype"} and len(n.args) == 1


def _last_dim(n, d):
    return d in (-1, len(shape(n.args[0])) - 1)


def _topk_last_largest(n):
    """top-k over the last dim, largest first."""
    return _last_dim(n, arg(n, 2, "dim", -1)) and arg(n, 3, "largest", True)


def _softmax_last(n):
    """Not the canonical form of ``exp(x - logsumexp(x))`` (on a row whose max is +inf it is 0 but at the +inf
    logit, where the router kernel's softmax is NaN over the row)."""
    return n.target != aten.softmax.int or (_last_dim(n, n.args[1]) and len(n.args) == 2
                                            and not n.meta.get("autofuse_lse_softmax"))


def _sum_last_keepdim(n):
    return list(arg(n, 1, "dim")) in ([-1], [len(shape(n.args[0])) - 1]) and bool(arg(n, 2, "keepdim", False))


def _scalar_operand(n):
    return is_number(n.args[1]) and not n.kwargs


NORM = (aten.softmax.int, aten.sigmoid.default)


def _flatten(n):
    return len(shape(n)) == 1


def _renorm_and_scale(t: Template, after: str) -> Template:
    """The optional tail shared by the gating templates: ``y / (sum(y) [+ eps])``, a flattening view (the
    canonical form moves a scale below views), ``* scale``, a cast."""
    return (t.node("rsum", aten.sum.dim_IntList, where=_sum_last_keepdim, optional="renorm")
             .node("reps", aten.add.Tensor, where=_scalar_operand, optional=True)
             .node("rdiv", aten.div.Tensor, optional="renorm")
             .node("flat", aten.reshape.default, where=_flatten, optional=True)
             .node("scale", aten.mul.Tensor, where=_scalar_operand, optional=True)
             .node("cast", aten._to_copy.default, where=_cast, optional=True)
             .edge(after, "rsum", 0).edge("rsum", "reps", 0).edge("reps", "rdiv", 1).edge(after, "rdiv", 0)
             .edge("rdiv", "flat", 0).edge("flat", "scale", 0).edge("scale", "cast", 0))


_GATING = _renorm_and_scale(
    Template("moe_gating", anchor="topk")
    .node("norm", *NORM, where=_softmax_last)
    .chain("pre", {aten._to_copy.default}, "norm", "topk", max_len=2, where=_cast, arg=0)
    .node("topk", aten.topk.default, where=_topk_last_largest)
    .node("w", operator.getitem, where=_item(0)).node("idx", operator.getitem, where=_item(1))
    .edge("topk", "w", 0).edge("topk", "idx", 0), after="w")

_GATING_GATHER = _renorm_and_scale(
    Template("moe_gating", anchor="topk")
    .node("norm", *NORM, where=_softmax_last)
    .node("bias", aten.add.Tensor, optional=True).edge("norm", "bias")
    # group-limited top-k: score each group by the sum of its two best, keep topk_group groups
    .node("g_view", aten.reshape.default, optional="groups").edge("bias", "g_view", 0)
    .node("g_top2", aten.topk.default, where=_topk_last_largest, optional="groups").edge("g_view", "g_top2", 0)
    .node("g_vals", operator.getitem, where=_item(0), optional="groups").edge("g_top2", "g_vals", 0)
    .node("g_score", aten.sum.dim_IntList, optional="groups").edge("g_vals", "g_score", 0)
    .node("g_sel", aten.topk.default, where=_topk_last_largest, optional="groups").edge("g_score", "g_sel", 0)
    .node("g_idx", operator.getitem, where=_item(1), optional="groups").edge("g_sel", "g_idx", 0)
    .node("g_zero", aten.zeros_like.default, optional="groups").edge("g_score", "g_zero", 0)
    .node("g_mask", aten.scatter.value, optional="groups").edge("g_zero", "g_mask", 0).edge("g_idx", "g_mask", 2)
    .node("g_expand", aten.repeat_interleave.self_int, optional="groups").edge("g_mask", "g_expand", 0)
    .node("g_bool", aten._to_copy.default, where=_cast, optional="groups").edge("g_expand", "g_bool", 0)
    .node("g_where", aten.where.ScalarOther, optional="groups").edge("g_bool", "g_where", 0)
    .edge("bias", "g_where", 1)
    .node("topk", aten.topk.default, where=_topk_last_largest).edge("g_where", "topk", 0)
    .node("idx", operator.getitem, where=_item(1)).edge("topk", "idx", 0)
    .node("w", aten.gather.default).edge("norm", "w", 0).edge("idx", "w", 2), after="w")


# DeepSeek-V2's group-limited greedy router: groups scored by their max, the others filled (0.0), the weights the
# top-k values of the filled scores (no selection bias)
_GATING_GROUP_VALUES = _renorm_and_scale(
    Template("moe_gating", anchor="topk")
    .node("norm", *NORM, where=_softmax_last)
    .node("g_view", aten.reshape.default).edge("norm", "g_view", 0)
    .node("g_max", aten.max.dim).edge("g_view", "g_max", 0)
    .node("g_vals", operator.getitem, where=_item(0)).edge("g_max", "g_vals", 0)
    .node("g_sel", aten.topk.default, where=_topk_last_largest).edge("g_vals", "g_sel", 0)
    .node("g_idx", operator.getitem, where=_item(1)).edge("g_sel", "g_idx", 0)
    .node("g_zero", aten.zeros_like.default).edge("g_vals", "g_zero", 0)
    .node("g_mask", aten.scatter.value).edge("g_zero", "g_mask", 0).edge("g_idx", "g_mask", 2)
    .node("g_expand", aten.repeat_interleave.self_int).edge("g_mask", "g_expand", 0)
    .node("g_bool", aten._to_copy.default, where=_cast).edge("g_expand", "g_bool", 0)
    .node("g_where", aten.where.ScalarOther).edge("g_bool", "g_where", 0).edge("norm", "g_where", 1)
    .node("topk", aten.topk.default, where=_topk_last_largest).edge("g_where", "topk", 0)
    .node("w", operator.getitem, where=_item(0)).node("idx", operator.getitem, where=_item(1))
    .edge("topk", "w", 0).edge("topk", "idx", 0), after="w")


# top-k of the logits first, then the softmax over the k chosen (GraniteMoE, GPT-OSS): no renormalisation
# needed (the weights already sum to one); a scale or a cast may follow
_GATING_TOPK_FIRST = (
    Template("moe_gating", anchor="topk")
    .node("topk", aten.topk.default, where=_topk_last_largest)
    .node("v", operator.getitem, where=_item(0)).node("idx", operator.getitem, where=_item(1))
    .edge("topk", "v", 0).edge("topk", "idx", 0)
    .node("norm", aten.softmax.int, where=_softmax_last).edge("v", "norm", 0)
    .node("flat", aten.reshape.default, where=_flatten, optional=True)
    .node("scale", aten.mul.Tensor, where=_scalar_operand, optional=True)
    .node("cast", aten._to_copy.default, where=_cast, optional=True)
    .edge("norm", "flat", 0).edge("flat", "scale", 0).edge("scale", "cast", 0))


def _decide_topk_first(m: dict) -> Match | None:
    """softmax(topk(x).values) [* scale] [cast]: ``norm="topk_softmax"`` (selection on the logits)."""
    topk, idx = m["topk"], m["idx"]
    x = topk.args[0]
    if not isinstance(x, fx.Node) or val(x) is None or not val(x).is_floating_point() or len(shape(x)) < 1:
        return None
    if "flat" in m and "scale" not in m:
        return None                # a bare view ends the block before it
    weights = next(m[n] for n in ("cast", "scale", "flat", "norm") if n in m)
    return _gating_match(m, x, topk, idx, weights, {"x": x.name}, k=int(topk.args[1]), norm="topk_softmax",
                         renorm=False, eps=0.0, routed_scaling_factor=float(m["scale"].args[1]) if "scale" in m
                         else 1.0, n_group=1, topk_group=1)


def _block_order(m: dict, *outputs) -> tuple | None:
    """The matched block's node names in graph order, or None where an intermediate (any node with inputs but the
    block's ``outputs``) is read outside the block and cannot stay computed as captured for that reader: it, or
    a node of the block it is computed from, draws random numbers or writes in place (a constant the block shares
    may be read on). A pure intermediate read outside (the router's softmax and top-k indices that transformers'
    router aux loss recomputes, merged by the capture with the router's own) stays in the graph, computed as
    captured for its outside readers, while the fused call recomputes it inside, as eager computes it twice."""
    inside = set(m.values())
    shared = [n for n in inside if n not in outputs and n.all_input_nodes and any(u not in inside for u in n.users)]
    if shared:
        seen, stack = set(), list(shared)
        while stack:
            n = stack.pop()
            if n in seen or n not in inside:
                continue
            seen.add(n)
            if not _pure(n):
                return None
            stack.extend(n.all_input_nodes)
    return tuple(n.name for n in outputs[0].graph.nodes if n in inside)


def _pure(n: fx.Node) -> bool:
    """Whether ``n`` computes a value from its inputs alone (no random draw, no in-place write)."""
    if n.op != "call_function":
        return n.op in ("get_attr", "placeholder")
    if isinstance(n.target, torch._ops.OpOverload):
        return not effectful(n)
    return n.target is operator.getitem


def _gating_match(m: dict, x, topk, idx, weights, inputs: dict, **kernel) -> Match | None:
    """A router's Match: an intermediate of the block read outside it only if pure (see ``_block_order``);
    ``kernel``: the op's semantics (k, norm, renorm, eps, routed_scaling_factor, n_group, topk_group), the shapes
    and dtypes added here."""
    order = _block_order(m, weights, idx)
    if order is None:
        return None
    E = shape(x)[-1]
    why = kernel.pop("unsupported", None)
    params = dict({"group_score": "top2", **kernel}, num_experts=E, tokens=int(val(x).numel() // E),
                  weights_like=val(weights), indices_like=val(idx), x_shape=shape(x), dtype=val(x).dtype,
                  sorted=bool(arg(topk, 4, "sorted", True)))
    if why:
        params["unsupported"] = why
    return Match("moe_gating", order, weights.name, inputs, params,
                 {"weights": weights.name, "indices": idx.name})


def _chain_end(m: dict, start: str) -> fx.Node:
    """The last node of the weights tail present in the mapping."""
    for name in ("cast", "scale", "flat", "rdiv"):
        if name in m:
            return m[name]
    return m[start]


def _narrows(cast: fx.Node, *ends: fx.Node) -> bool:
    """Whether ``cast`` rounds its value to a float dtype narrower than both ``ends`` (or to a non-float one):
    a round trip such as ``softmax(x).to(bf16).float()`` keeps fp32 at both ends but selects on 16-bit
    scores."""
    dtype = val(cast).dtype
    if not dtype.is_floating_point:
        return True
    return all(torch.finfo(dtype).bits < torch.finfo(val(e).dtype).bits for e in ends)


_ROUNDED_SCORES = ("{} before the top-k: eager's rounding ties scores that the gating kernel's fp32 scores tell "
                   "apart, and other experts would be chosen; the router is not fused into one gating kernel")


def _decide_gating(m: dict) -> Match | None:
    """Constraints of a router: norm over the experts, top-k of the (biased) scores, weights as CANN computes
    them, renormalisation by exactly their own sum, an intermediate used elsewhere only if pure."""
    norm, topk, idx = m["norm"], m["topk"], m["idx"]
    x = norm.args[0]
    if len(shape(x)) < 1 or val(x) is None or not val(x).is_floating_point():
        return None
    E = shape(x)[-1]
    k = int(topk.args[1])
    if val(topk.args[0]) is None:
        return None
    # eager selects on scores rounded to 16 bits, whose ties the kernel's fp32 scores tell apart: other experts
    # would be chosen. Found, and refused with the reason (the report says why the router stays as captured)
    rounded = next((val(s).dtype for s in (norm, topk.args[0]) if val(s).dtype in (torch.float16, torch.bfloat16)),
                   None)
    why = None
    if rounded is not None:
        why = _ROUNDED_SCORES.format(f"the scores are {str(rounded).replace('torch.', '')}")
    elif any(_narrows(m[p], norm, topk.args[0]) for p in ("pre0", "pre1") if p in m):
        why = _ROUNDED_SCORES.format("the scores are rounded to 16 bits on the way (a cast down and up again)")
    gather = m["w"].target == aten.gather.default
    bias = None
    if "bias" in m:
        add = m["bias"]
        bias = add.args[1] if add.args[0] is norm else add.args[0]
        if not isinstance(bias, fx.Node) or shape(bias) not in ((E,),) or not gather:
            return None            # a selection bias must leave the weights unbiased: only the gather form
    if gather:
        w = m["w"]
        if not (_last_dim(w, w.args[1]) and w.args[0] is norm and w.args[2] is idx):
            return None
    if (gather or "g_max" in m) and \
            topk.args[0] is not (m["g_where"] if "g_where" in m else m["bias"] if "bias" in m else norm):
        return None
    n_group, topk_group, group_fill, group_score = 1, 1, None, "top2"
    if "g_view" in m:
        gv, gw = m["g_view"], m["g_where"]
        n_group = shape(gv)[-2]
        if shape(gv)[-1] * n_group != E or int(m["g_sel"].args[1]) < 1:
            return None
        if "g_max" in m:            # each group's max (DeepSeek-V2)
            if not _last_dim(m["g_max"], m["g_max"].args[1]) or arg(m["g_max"], 2, "keepdim", False):
                return None
            group_score = "max"
        elif int(m["g_top2"].args[1]) != 2 or \
                list(arg(m["g_score"], 1, "dim")) not in ([-1], [len(shape(m["g_vals"])) - 1]):
            return None
        if m["g_mask"].args[1] != 1 or m["g_mask"].args[3] != 1 or m["g_expand"].args[1] != E // n_group:
            return None
        fill = gw.args[2]
        if not is_number(fill) or fill != fill or fill == float("inf") or val(m["g_bool"]).dtype != torch.bool:
            return None            # the groups not kept filled with a number (-inf; 0.0 in DeepSeek-V2, Mistral 4)
        topk_group = int(m["g_sel"].args[1])
        group_fill = None if fill == float("-inf") or n_group == 1 else float(fill)   # one group: all kept
    weights_from = "scores"
    if "g_max" in m:                # the weights are the filled scores' top-k values: a filled pick weighs the fill
        weights_from = "choices"
        if (group_fill or 0.0) > 0.0 or "rdiv" in m:
            return None             # a positive fill could equal a score; renormalised, a filled pick would count
    renorm, eps, scale = "rdiv" in m, 0.0, 1.0
    if "reps" in m and not renorm:
        return None                # "+ eps" without the division is no renormalisation
    if "flat" in m and "scale" not in m:
        return None                # a bare view ends the block before it
    if renorm:
        w0, rs, rd = m["w"], m["rsum"], m["rdiv"]
        denom = m["reps"] if "reps" in m else rs
        if rs.args[0] is not w0 or rd.args[0] is not w0 or rd.args[1] is not denom:
            return None            # another denominator: not the selected weights' own sum
        eps = float(m["reps"].args[1]) if "reps" in m else 0.0
    if "scale" in m:
        scale = float(m["scale"].args[1])
    inputs = {"x": x.name}
    if bias is not None:
        inputs["bias"] = bias.name
    return _gating_match(m, x, topk, idx, _chain_end(m, "w"), inputs, k=k,
                         norm="softmax" if norm.target == aten.softmax.int else "sigmoid", renorm=renorm, eps=eps,
                         routed_scaling_factor=scale, n_group=n_group, topk_group=topk_group, group_fill=group_fill,
                         group_score=group_score, weights_from=weights_from, unsupported=why)


@register("moe_gating")
def find_moe_gating(gm: fx.GraphModule) -> list[Match]:
    view = graph_view(gm)
    found = _GATING_GATHER.match(view, _decide_gating) + _GATING_GROUP_VALUES.match(view, _decide_gating) + \
        _GATING.match(view, _decide_gating) + _GATING_TOPK_FIRST.match(view, _decide_topk_first)
    out, taken = [], set()
    for m in sorted(found, key=lambda m: view.order[m.anchor]):
        if taken.isdisjoint(m.nodes):
            out.append(m)
            taken.update(m.nodes)
    return out


# ------------------------------------------------------------------------------------------------ experts

def _grouped_mm(n):
    """transformers' ``grouped_mm_fallback`` (a custom op registered when transformers is imported; fp32 and
    fp16 weights), or torch's own ``_grouped_mm`` (what transformers calls for bf16 weights), both
    ``(x [S, K], w [E, K, N], offs)`` with ``offs`` the cumulative rows per expert."""
    t = n.target
    if n.op != "call_function":
        return False
    if t == aten._grouped_mm.default:
        return len(n.args) == 3 and not any(v is not None for v in n.kwargs.values()) and \
            len(shape(n.args[0])) == 2 and len(shape(n.args[1])) == 3
    return getattr(t, "namespace", None) == "transformers" and getattr(t, "_opname", None) == "grouped_mm_fallback"


def _glu(t: Template, up: str) -> Template:
    """``split`` of the gate_up projection's output into halves, ``silu(gate) * up``."""
    return (t.node("split", aten.split.Tensor).edge(up, "split", 0)
             .node("gate", operator.getitem, where=_item(0)).node("up", operator.getitem, where=_item(1))
             .edge("split", "gate", 0).edge("split", "up", 0)
             .node("act", aten.silu.default).edge("gate", "act", 0)
             .node("glu", aten.mul.Tensor).edge("act", "glu").edge("up", "glu"))


def _step2(start):
    """A slice of every other column of the last dim, from ``start`` to its end (interleaved gate/up pairs)."""
    def check(n):
        sl = last_dim_slice(n)
        return sl is not None and sl[1:] == (start, shape(sl[0])[-1], 2)
    check.__name__ = f"every_other_from_{start}"
    return check


def _clamped_glu(t: Template, up: str) -> Template:
    """GPT-OSS's gated activation on interleaved pairs: ``g = clamp(x[..., ::2], max=L)``, ``u = clamp(x[..., 1::2],
    -L, L)``, ``(u + 1) * (g * sigmoid(g * alpha))``."""
    return (t.node("even", aten.slice.Tensor, where=_step2(0)).node("odd", aten.slice.Tensor, where=_step2(1))
             .edge(up, "even", 0).edge(up, "odd", 0)
             .node("gclamp", aten.clamp.default).edge("even", "gclamp", 0)
             .node("uclamp", aten.clamp.default).edge("odd", "uclamp", 0)
             .node("gscale", aten.mul.Tensor, where=_scalar_operand).edge("gclamp", "gscale", 0)
             .node("sig", aten.sigmoid.default).edge("gscale", "sig", 0)
             .node("gsig", aten.mul.Tensor).edge("gclamp", "gsig").edge("sig", "gsig")
             .node("up1", aten.add.Tensor, where=_scalar_operand).edge("uclamp", "up1", 0)
             .node("glu", aten.mul.Tensor).edge("up1", "glu").edge("gsig", "glu"))


def _grouped(act, transposed: bool, biased: bool) -> Template:
    """transformers' ``grouped_mm`` experts: sort the (token, expert) pairs by expert, gather the tokens, the group
    offsets by ``histc`` + ``cumsum``, the two grouped GEMMs around the gated activation ``act`` (weights read
    through a transpose when ``transposed``: Mixtral's ``[E, out, in]``; GPT-OSS's ``[E, in, out]`` directly; with a
    per-expert bias gathered by the sorted expert ids and added when ``biased``), the routing weights applied at
    the same permutation, the inverse permutation, the sum over each token's k."""
    t = (Template("moe_experts", anchor="gmm1")
         .node("ids_flat", aten.reshape.default)
         .node("sort", aten.sort.default).edge("ids_flat", "sort", 0)
         .node("sorted", operator.getitem, where=_item(0)).node("perm", operator.getitem, where=_item(1))
         .edge("sort", "sorted", 0).edge("sort", "perm", 0)
         .node("token", aten.floor_divide.default).edge("perm", "token", 0)
         .node("xs", aten.index.Tensor).edge("token", "xs", 1)
         .node("fsorted", aten._to_copy.default).edge("sorted", "fsorted", 0)
         .node("hist", aten.histc.default).edge("fsorted", "hist", 0)
         .node("offs", aten.cumsum.default).edge("hist", "offs", 0)
         .node("gmm1", where=_grouped_mm).edge("xs", "gmm1", 0).edge("offs", "gmm1", 2)
         .node("gmm2", where=_grouped_mm).edge("offs", "gmm2", 2))
    if transposed:
        t.node("w1t", aten.transpose.int).edge("w1t", "gmm1", 1).node("w2t", aten.transpose.int).edge("w2t", "gmm2", 1)
    up, down = "gmm1", "gmm2"
    if biased:
        for i, gmm in ((1, "gmm1"), (2, "gmm2")):
            t.node(f"b{i}", aten.index.Tensor).edge("sorted", f"b{i}", 1)
            t.node(f"add{i}", aten.add.Tensor).edge(gmm, f"add{i}").edge(f"b{i}", f"add{i}")
        up, down = "add1", "add2"
    return (act(t, up).edge("glu", "gmm2", 0)
            .node("wflat", aten.reshape.default, optional=True)
            .node("ws", aten.index.Tensor).edge("wflat", "ws", 0).edge("perm", "ws", 1)
            .node("wcol", aten.unsqueeze.default).edge("ws", "wcol", 0)
            .node("wscale", aten.mul.Tensor, where=_scalar_operand, optional=True).edge("wcol", "wscale", 0)
            .node("wmul", aten.mul.Tensor).edge(down, "wmul").edge("wscale", "wmul")
            .node("empty", aten.empty_like.default).edge("perm", "empty", 0)
            .node("iota", aten.arange.default)
            .node("inv", aten.index_put.default).edge("empty", "inv", 0).edge("perm", "inv", 1).edge("iota", "inv", 2)
            .node("back", aten.index.Tensor).edge("wmul", "back", 0).edge("inv", "back", 1)
            .node("tkh", aten.reshape.default).edge("back", "tkh", 0)
            .node("combine", aten.sum.dim_IntList).edge("tkh", "combine", 0))


_EXPERTS_GROUPED = _grouped(_glu, transposed=True, biased=False)
#: GPT-OSS: [E, in, out] weights, a bias per expert, the clamped SwiGLU on interleaved pairs
_EXPERTS_GROUPED_CLAMPED = _grouped(_clamped_glu, transposed=False, biased=True)

def _batched(act, transposed: bool, biased: bool) -> Template:
    """transformers' ``batched_mm`` experts: each token repeated k times, each (token, expert) pair's weights
    gathered by the flat expert ids, one batched matmul per projection around the gated activation ``act``
    (``transposed``: Mixtral's ``[E, out, in]`` weights, ``w @ x[..., None]``; else GPT-OSS's ``[E, in, out]``,
    ``x[:, None] @ w``; with a per-expert bias gathered by the same ids and added when ``biased``: the in-place
    ``add_`` on the squeezed product, captured as an add and an optional no-op unsqueeze/squeeze that re-views
    it), the outputs scaled by the routing weights, the sum over each token's k."""
    t = (Template("moe_experts", anchor="bmm1")
         .node("xrep", aten.repeat_interleave.self_int)
         .node("ids_flat", aten.reshape.default)
         .node("w1s", aten.index.Tensor).edge("ids_flat", "w1s", 1)
         .node("xcol", aten.unsqueeze.default).edge("xrep", "xcol", 0)
         .node("bmm1", aten.matmul.default)
         .node("sq1", aten.squeeze.dim).edge("bmm1", "sq1", 0)
         .node("w2s", aten.index.Tensor).edge("ids_flat", "w2s", 1)
         .node("hcol", aten.unsqueeze.default)
         .node("bmm2", aten.matmul.default)
         .node("sq2", aten.squeeze.dim).edge("bmm2", "sq2", 0))
    w_at, x_at = (0, 1) if transposed else (1, 0)
    t.edge("w1s", "bmm1", w_at).edge("xcol", "bmm1", x_at).edge("w2s", "bmm2", w_at).edge("hcol", "bmm2", x_at)
    up, down = "sq1", "sq2"
    if biased:
        for i, sq in ((1, "sq1"), (2, "sq2")):
            (t.node(f"b{i}", aten.index.Tensor).edge("ids_flat", f"b{i}", 1)
             .node(f"add{i}", aten.add.Tensor).edge(sq, f"add{i}").edge(f"b{i}", f"add{i}")
             .node(f"uq{i}", aten.unsqueeze.default, optional=f"view{i}").edge(f"add{i}", f"uq{i}", 0)
             .node(f"rv{i}", aten.squeeze.dim, optional=f"view{i}").edge(f"uq{i}", f"rv{i}", 0))
        up, down = "rv1", "rv2"
    return (act(t, up).edge("glu", "hcol", 0)
            .node("wflat", aten.reshape.default, optional=True)
            .node("wcol", aten.unsqueeze.default).edge("wflat", "wcol", 0)
            .node("wscale", aten.mul.Tensor, where=_scalar_operand, optional=True).edge("wcol", "wscale", 0)
            .node("wmul", aten.mul.Tensor).edge(down, "wmul").edge("wscale", "wmul")
            .node("tkh", aten.reshape.default).edge("wmul", "tkh", 0)
            .node("combine", aten.sum.dim_IntList).edge("tkh", "combine", 0))


_EXPERTS_BATCHED = _batched(_glu, transposed=True, biased=False)
#: GPT-OSS's batched form: [E, in, out] weights, a bias per expert gathered by the same ids, the clamped SwiGLU
_EXPERTS_BATCHED_CLAMPED = _batched(_clamped_glu, transposed=False, biased=True)


# Llama 4's dense form: every token through every expert, its input scaled by the router's score, the scores
# the top k logits scattered into -inf and put through a sigmoid (zero for every expert a token did not pick)
_EXPERTS_DENSE = _glu(
    Template("moe_experts", anchor="mm1")
    .node("topk", aten.topk.default, where=_topk_last_largest)
    .node("v", operator.getitem, where=_item(0)).node("idx", operator.getitem, where=_item(1))
    .edge("topk", "v", 0).edge("topk", "idx", 0)
    .node("fill", aten.full_like.default)
    .node("scatter", aten.scatter.src).edge("fill", "scatter", 0).edge("idx", "scatter", 2).edge("v", "scatter", 3)
    .node("up32", aten._to_copy.default, where=_cast, optional=True).edge("scatter", "up32", 0)
    .node("sig", aten.sigmoid.default).edge("up32", "sig", 0)
    .node("down", aten._to_copy.default, where=_cast, optional=True).edge("sig", "down", 0)
    .node("st", aten.transpose.int).edge("down", "st", 0)
    .node("scol", aten.reshape.default, optional=True).edge("st", "scol", 0)     # (none for one token)
    .node("xrep", aten.repeat.default)
    .node("xin", aten.mul.Tensor).edge("xrep", "xin").edge("scol", "xin")
    .node("x3", aten.reshape.default).edge("xin", "x3", 0)
    .node("mm1", aten.matmul.default).edge("x3", "mm1", 0), up="mm1")
(_EXPERTS_DENSE
 .node("mm2", aten.matmul.default).edge("glu", "mm2", 0)
 .node("y3", aten.reshape.default, optional=True).edge("mm2", "y3", 0)
 .node("combine", aten.sum.dim_IntList).edge("y3", "combine", 0))


def _decide_dense_experts(m: dict) -> Match | None:
    """Constraints of the dense form: the scores are ``sigmoid`` of a top-k's values scattered at its own indices
    over the last dim into ``-inf`` (so exactly zero at every other expert), the tokens repeated once per expert
    (expert-major) and scaled by their scores, ``[E, T, H] @ [E, H, 2I]``, SwiGLU on the halves in the split's
    order, ``@ [E, I, H]``, summed over the experts. An expert whose scaled input is zero outputs exactly zero (no
    bias; ``silu(0)·0``), so the sum equals the sum over each token's k picks: the block runs sparse, each token
    through its k experts only, its input scaled by its score (``weights_at="input"``) and the outputs summed
    (where the hidden states and weights are finite; a non-finite value reaches its token's output either way,
    as NaN or infinity)."""
    scatter, fill, topk, v, idx = m["scatter"], m["fill"], m["topk"], m["v"], m["idx"]
    logits = topk.args[0]
    if scatter.args[1] not in (1, -1) or scatter.kwargs or shape(logits) != shape(scatter):
        return None
    if len(fill.args) < 2 or fill.args[1] != float("-inf") or shape(fill) != shape(scatter) or len(shape(fill)) != 2:
        return None
    T, E = shape(scatter)
    k = int(topk.args[1])
    if shape(idx) != (T, k) or val(fill).dtype != val(v).dtype:
        return None
    if "up32" in m and val(m["up32"]).dtype != torch.float32:
        return None
    st, xrep, x3 = m["st"], m["xrep"], m["x3"]
    scol = m.get("scol", st)
    if sorted(d % 2 for d in st.args[1:3]) != [0, 1] or shape(scol) != (E * T, 1):
        return None
    x = xrep.args[0]
    if shape(x) is None or len(shape(x)) != 2 or shape(x)[0] != T or list(xrep.args[1]) != [E, 1]:
        return None
    H = shape(x)[1]
    if shape(x3) != (E, T, H):
        return None
    w1, w2 = _param(m["mm1"].args[1]), _param(m["mm2"].args[1])
    if w1 is None or w2 is None or m["mm1"].args[0] is not x3 or len(shape(w1)) != 3 or shape(w1)[:2] != (E, H):
        return None
    two_i = shape(w1)[2]
    if shape(w2) != (E, two_i // 2, H) or m["split"].args[1] != two_i // 2 or arg(m["split"], 2, "dim") not in (-1, 2):
        return None
    if {m["glu"].args[0], m["glu"].args[1]} != {m["act"], m["up"]}:
        return None
    if "y3" in m and shape(m["y3"]) != (E, T, H):
        return None
    out = m["combine"]
    if list(arg(out, 1, "dim")) not in ([0], [-3]) or arg(out, 2, "keepdim", False) or shape(out) != (T, H):
        return None
    order = _block_order(m, out)
    if order is None:
        return None
    casts = {c: str(val(m[c]).dtype).replace("torch.", "") for c in ("up32", "down") if c in m}
    params = dict(num_experts=E, k=k, tokens=T, hidden=H, intermediate=two_i // 2, weights_scale=1.0,
                  trans_w=False, implementation="dense", out_like=val(out), dtype=val(x).dtype,
                  activation="swiglu", swiglu_order="gate_up", weights_at="input",
                  score_casts=(casts.get("up32", ""), casts.get("down", "")))
    # the router's top-k is part of the block (the fused call takes it again, the same op on the same logits): its
    # picks are distinct per token, as the sparse form needs, whatever values the block is checked on
    params["topk"] = (k, int(arg(topk, 2, "dim", -1)), bool(arg(topk, 4, "sorted", True)))
    inputs = {"x": x.name, "logits": logits.name, "w1": w1.name, "w2": w2.name}
    return Match("moe_experts", order, out.name, inputs, params)


def _is_last(n) -> bool:
    """An unsqueeze/squeeze at the last dim of its result (unsqueeze) or input (squeeze), counted either way."""
    d = n.args[1]
    r = len(shape(n)) if n.target == aten.unsqueeze.default else len(shape(n.args[0]))
    return d in (-1, r - 1)


def _is_row(n) -> bool:
    """An unsqueeze/squeeze at dim 1 of a 3-d result (unsqueeze) or input (squeeze): ``x[:, None]`` of an [S, K]
    row block, counted either way."""
    r = len(shape(n)) if n.target == aten.unsqueeze.default else len(shape(n.args[0]))
    return r == 3 and n.args[1] in (1, -2)


def _param(n) -> fx.Node | None:
    """The [E, N, K] weight a transpose or an index reads: a parameter of the experts module, an attribute of the
    captured graph, or a graph input (Dynamo hands a module's parameters to a backend as inputs); not a tensor the
    graph computes."""
    return n if isinstance(n, fx.Node) and n.op in ("get_attr", "placeholder") else None


def _decide_experts(m: dict) -> Match | None:
    """Constraints of an experts block: one routing (ids, perm, group list) shared by both GEMMs, SwiGLU on the
    halves in the split's order, weights combined by the routing weights at the same permutation."""
    batched = "bmm1" in m
    ids = m["ids_flat"].args[0]
    if shape(ids) is None or len(shape(ids)) != 2:
        return None
    T, k = shape(ids)
    S = T * k
    # the routing weights [T, k], or already flat [S] (the canonical form moves a scale below the view)
    weights = m["wflat"].args[0] if "wflat" in m else (m["wcol"] if batched else m["ws"]).args[0]
    if shape(weights) not in ((T, k), (S,)) or shape(m["ids_flat"]) != (S,):
        return None
    if batched:
        x = m["xrep"].args[0]
        if m["xrep"].args[1] != k or arg(m["xrep"], 2, "dim") not in (0, -2):
            return None
        w1, w2 = _param(m["w1s"].args[0]), _param(m["w2s"].args[0])
        if any(len(m[n].args[1]) != 1 or m[n].args[1][0] is not m["ids_flat"] for n in ("w1s", "w2s")):
            return None
        if m["bmm1"].args[0] is m["w1s"]:       # w @ x[..., None]: [E, out, in] weights
            if not all(_is_last(m[n]) for n in ("xcol", "sq1", "hcol", "sq2")):
                return None
        elif not all(_is_row(m[n]) for n in ("xcol", "sq1", "hcol", "sq2")):
            return None                         # x[:, None] @ w: [E, in, out] weights (GPT-OSS)
        for i in (1, 2):                        # the re-view of an in-place bias add: a no-op
            if f"uq{i}" in m and (m[f"uq{i}"].args[1] != m[f"rv{i}"].args[1] or
                                  shape(m[f"rv{i}"]) != shape(m[f"add{i}"])):
                return None
    else:
        x = m["xs"].args[0]
        if m["token"].args[1] != k or m["xs"].args[1][0] is not m["token"] or m["ws"].args[1][0] is not m["perm"]:
            return None
        if "wflat" not in m and m["ws"].args[0] is not weights:
            return None
        if "w1t" in m:
            w1 = _param(m["w1t"].args[0]) if tuple(m["w1t"].args[1:]) == (-2, -1) else None
            w2 = _param(m["w2t"].args[0]) if tuple(m["w2t"].args[1:]) == (-2, -1) else None
        else:                       # [E, in, out] weights read as they are stored (GPT-OSS)
            w1, w2 = _param(m["gmm1"].args[1]), _param(m["gmm2"].args[1])
        E = shape(w1)[0] if w1 is not None else 0
        hist = m["hist"]
        if tuple(hist.args[1:4]) != (E, 0, E - 1) or m["back"].args[1][0] is not m["inv"]:
            return None
        if m["inv"].args[1][0] is not m["perm"] or m["gmm2"].args[2] is not m["offs"]:
            return None
    if w1 is None or w2 is None or len(shape(w1)) != 3 or len(shape(w2)) != 3:
        return None
    trans_w = m["bmm1"].args[0] is m["w1s"] if batched else "w1t" in m
    if trans_w:
        E, two_i, H = shape(w1)
        if shape(w2) != (E, H, two_i // 2):
            return None
    else:
        E, H, two_i = shape(w1)
        if shape(w2) != (E, two_i // 2, H):
            return None
    if shape(x) != (T, H):
        return None
    if not _is_last(m["wcol"]) or shape(m["tkh"]) != (T, k, H) or list(arg(m["combine"], 1, "dim")) not in ([1], [-2]) \
            or arg(m["combine"], 2, "keepdim", False):
        return None
    extra_inputs, act = {}, dict(activation="swiglu", swiglu_order="gate_up")
    if "gclamp" in m:
        act = _clamped_swiglu(m, m["ids_flat"] if batched else m["sorted"], E, two_i, H)
        if act is None:
            return None
        extra_inputs = {"b1": act.pop("b1"), "b2": act.pop("b2")}
    else:
        if m["split"].args[1] != two_i // 2 or arg(m["split"], 2, "dim") not in (-1, 1):
            return None
        glu = m["glu"]
        if {glu.args[0], glu.args[1]} != {m["act"], m["up"]}:
            return None
    out = m["combine"]
    order = _block_order(m, out)
    if order is None:
        return None
    inputs = {"x": x.name, "ids": ids.name, "weights": weights.name, "w1": w1.name, "w2": w2.name, **extra_inputs}
    scale = float(m["wscale"].args[1]) if "wscale" in m else 1.0    # a routing scale the canonical form sank here
    params = dict(num_experts=E, k=k, tokens=T, hidden=H, intermediate=two_i // 2, weights_scale=scale,
                  trans_w=trans_w, implementation="batched_mm" if batched else "grouped_mm",
                  out_like=val(out), dtype=val(x).dtype, **act)
    return Match("moe_experts", order, out.name, inputs, params)


def _clamped_swiglu(m: dict, sorted_ids, E, two_i, H) -> dict | None:
    """The clamped SwiGLU of GPT-OSS and its biases, checked: each bias a [E, N] parameter gathered by the sorted
    expert ids; gate = the even columns clamped from above at L, up = the odd ones clamped to [-L, L] (one L),
    ``(up + 1) * (gate * sigmoid(gate * alpha))``. Returns the kernel's options and the bias names, or None."""
    biases = []
    for i, n in ((1, two_i), (2, H)):
        b = m[f"b{i}"]
        src = _param(b.args[0])
        if src is None or shape(src) != (E, n) or len(b.args[1]) != 1 or b.args[1][0] is not sorted_ids or \
                m[f"add{i}"].kwargs:
            return None
        biases.append(src.name)
    g, u = m["gclamp"], m["uclamp"]
    if g.args[0] is not m["even"] or u.args[0] is not m["odd"] or g.kwargs or u.kwargs:
        return None
    lo, hi = arg(g, 1, "min", None), arg(g, 2, "max", None)
    ulo, uhi = arg(u, 1, "min", None), arg(u, 2, "max", None)
    if lo is not None or not all(is_number(v) for v in (hi, ulo, uhi)) or not (hi > 0 and ulo == -hi and uhi == hi):
        return None                 # gate clamped from above only, up to [-L, L], one L
    if m["up1"].args[1] != 1 or m["sig"].args[0] is not m["gscale"] or m["gscale"].args[0] is not g:
        return None
    if {m["gsig"].args[0], m["gsig"].args[1]} != {g, m["sig"]} or {m["glu"].args[0], m["glu"].args[1]} != \
            {m["up1"], m["gsig"]}:
        return None
    return dict(activation="clamped_swiglu", swiglu_order="interleaved", limit=float(hi),
                alpha=float(m["gscale"].args[1]), b1=biases[0], b2=biases[1])


# ----------------------------------------------------------------- a hand-written layer looping over its experts
_PLAIN_ACTS = {aten.relu.default: "relu", aten.gelu.default: "gelu", aten.silu.default: "silu"}


def _expert_mlp(t: Template, x_in: str | None, form: str) -> Template:
    """An expert as a hand-written MoE layer holds it: ``nn.Linear``s (with or without biases), either gated,
    ``down(silu(gate(x)) * up(x))``, gated with the gate and up projections as one layer whose output is split in
    halves (``"joined"``: Phi-3's MLP), or plain, ``down(act(gate(x)))`` with ReLU, GELU or SiLU (the projections read
    the same input: ``x_in``, or a value outside the template)."""
    if form == "joined":
        t.node("proj", aten.linear.default)
        if x_in is not None:
            t.edge(x_in, "proj", 0)
        return _glu(t, "proj").node("down", aten.linear.default).edge("glu", "down", 0)
    t.node("gate", aten.linear.default)
    if x_in is not None:
        t.edge(x_in, "gate", 0)
    if form == "plain":
        return (t.node("act", *_PLAIN_ACTS).edge("gate", "act", 0)
                .node("down", aten.linear.default).edge("act", "down", 0))
    t.node("up", aten.linear.default)
    if x_in is not None:
        t.edge(x_in, "up", 0)
    return (t.node("act", aten.silu.default).edge("gate", "act", 0)
            .node("glu", aten.mul.Tensor).edge("act", "glu").edge("up", "glu")
            .node("down", aten.linear.default).edge("glu", "down", 0))


def _loop_body(one_hot: bool, gather: bool, form: str) -> Template:
    """One iteration of a loop over the experts (:func:`_expert_mlp` of that ``form``), expert ``e`` of E: its
    tokens selected by ``ids == e`` (or
    Mixtral's original spelling, ``one_hot(ids, E).permute(2, 1, 0)[e]``), then either gathered (``torch.where`` of
    the selection: the (token, slot) pairs; the tokens' rows, optionally read as ``x[None, tok].reshape(-1, H)``;
    the expert; each row scaled by its routing weight ``w[tok, slot, None]``; optionally cast; ``index_add`` into
    the accumulator at the tokens) or dense (every token through the expert, scaled by ``(w * (ids == e)).sum(-1,
    keepdim=True)``, which is zero off the expert's tokens: the iteration's term of a sum, ``scaled``). The anchor is
    the accumulator's new value (gathered) or the selection (dense); :func:`_loop_blocks` chains the iterations."""
    t = Template("moe_experts", anchor="acc" if gather else "sel")      # (rare targets: few seeds)
    if one_hot:
        (t.node("onehot", aten.one_hot.default).node("perm", aten.permute.default).edge("onehot", "perm", 0)
         .node("sel", aten.select.int).edge("perm", "sel", 0))
    else:
        t.node("sel", aten.eq.Scalar)
    if not gather:
        (_expert_mlp(t, None, form).node("wm", aten.mul.Tensor).edge("sel", "wm")
         .node("we", aten.sum.dim_IntList).edge("wm", "we", 0)
         .node("scaled", aten.mul.Tensor).edge("we", "scaled").edge("down", "scaled"))
        return t
    (t.node("nz", aten.where.default).edge("sel", "nz", 0)
     .node("tok", operator.getitem).node("slot", operator.getitem).edge("nz", "tok", 0).edge("nz", "slot", 0)
     .node("xu", aten.unsqueeze.default, optional="batch")
     .node("xs", aten.index.Tensor).edge("xu", "xs", 0).edge("tok", "xs")
     .node("xr", aten.reshape.default, optional="batch").edge("xs", "xr", 0))
    return (_expert_mlp(t, "xr", form)
            .node("wu", aten.unsqueeze.default)
            .node("wg", aten.index.Tensor).edge("wu", "wg", 0).edge("tok", "wg", 1).edge("slot", "wg", 2)
            .node("scaled", aten.mul.Tensor).edge("down", "scaled").edge("wg", "scaled")
            .node("cast", aten._to_copy.default, where=_cast, optional=True).edge("scaled", "cast", 0)
            .node("acc", aten.index_add.default).edge("tok", "acc", 2).edge("cast", "acc", 3))


_LOOP_BODIES = tuple(_loop_body(one_hot, gather, form) for one_hot, gather in ((False, True), (True, True),
                                                                                (False, False))
                     for form in ("gated", "joined", "plain"))


@dataclass(frozen=True)
class _Body:
    """One matched iteration: its expert, what it reads (the tokens, the expert ids, the routing weights, the
    expert's three weights), the accumulator before and after, its nodes."""

    expert: int
    x: fx.Node
    ids: fx.Node
    weights: fx.Node
    params: dict            # role -> weight or bias: w1, w3, w2 (gate, up, down), b1, b3, b2; None where there is none
    activation: str
    prev: fx.Node
    acc: fx.Node
    nodes: tuple

    def kind(self) -> tuple:
        """What the fused call needs alike in every expert: the activation, which projections and biases exist."""
        return self.activation, tuple(r for r, p in self.params.items() if p is not None)


def _decide_body(m: dict) -> _Body | None:
    """Constraints of one iteration (see :func:`_loop_body`): the expert index a constant, the selection of the
    routed ids ``[T, k]``, the expert's three weights parameters ``[I, H]``, ``[I, H]``, ``[H, I]`` read as
    ``linear`` does, SiLU on the gate, the routing weights ``[T, k]`` read at the selected (token, slot) pairs or
    summed over the slots that selected the expert."""
    sel = m["sel"]
    if "onehot" in m:
        ids, E = m["onehot"].args[0], m["onehot"].args[1]
        if m["perm"].args[1] != [2, 1, 0] or len(shape(m["onehot"])) != 3 or sel.args[1] != 0 or \
                not isinstance(sel.args[2], int) or not 0 <= sel.args[2] < E:
            return None
        e = sel.args[2]
    else:
        ids, e = sel.args[0], sel.args[1]
        if not isinstance(e, int) or isinstance(e, bool):
            return None
    if not isinstance(ids, fx.Node) or shape(ids) is None or len(shape(ids)) != 2 or val(ids).dtype.is_floating_point:
        return None
    T, k = shape(ids)
    expert = _expert(m)
    if expert is None:
        return None
    params, activation, x_in = expert
    H = shape(x_in)[1]
    scaled = m["scaled"]
    if "nz" in m:
        acc = m["acc"]                      # gathered
        tok_at = 1 if "onehot" in m else 0  # where(ids == e): (token, slot); where(one_hot.permute[e]): (slot, token)
        tok, slot, xs = m["tok"], m["slot"], m["xs"]
        if m["nz"].args != (sel,) or tok.args[1] != tok_at or slot.args[1] != 1 - tok_at:
            return None
        if "xu" in m:                       # x[None, tok].reshape(-1, H)
            x = m["xu"].args[0]
            if m["xu"].args[1] != 0 or xs.args[1] != [None, tok] or shape(m["xr"])[-1] != H:
                return None
        else:
            x = xs.args[0]
            if xs.args[1] != [tok]:
                return None
        w = m["wu"].args[0]
        if m["wu"].args[1] not in (2, -1) or m["wg"].args[1] != [tok, slot] or {scaled.args[0], scaled.args[1]} != \
                {m["down"], m["wg"]}:
            return None
        if acc.args[1] != 0 or acc.args[2] is not tok or acc.args[3] is not m.get("cast", scaled) or acc.kwargs:
            return None
        prev = acc.args[0]
        block = set(m.values())
        checks = [size_checks(h, block) for h in (tok, slot)]     # part of the iteration: the fused block has none
        if None in checks or set(m["nz"].users) != {tok, slot}:
            return None
        checks = checks[0] + checks[1]
    else:                                   # dense
        x = x_in
        wm, we = m["wm"], m["we"]
        w = wm.args[0] if wm.args[1] is sel else wm.args[1]
        if {wm.args[0], wm.args[1]} != {w, sel} or list(arg(we, 1, "dim")) not in ([-1], [1]) or \
                not arg(we, 2, "keepdim", False) or we.kwargs.get("dtype") is not None:
            return None
        if {scaled.args[0], scaled.args[1]} != {we, m["down"]}:
            return None
        acc, prev, checks = scaled, None, []
    if shape(x) != (T, H) or shape(w) != (T, k) or shape(acc) != (T, H) or \
            prev is not None and shape(prev) != (T, H) or not val(w).dtype.is_floating_point:
        return None
    return _Body(e, x, ids, w, params, activation, prev, acc, tuple(m.values()) + tuple(checks))


def _expert(m: dict) -> tuple | None:
    """An iteration's expert checked (:func:`_expert_mlp`): every projection an ``nn.Linear`` of a parameter, in
    x's dtype, ``[I, H]`` in, ``[H, I]`` out, a bias ``[N]`` or none (the gate's and up's both or neither); SiLU on
    the gate of a gated one. Returns ({role: parameter or None}, the activation as the grouped GEMM names its
    epilogue, the input), or None."""
    gate, act, down = m["gate"], m["act"], m["down"]
    joined, gated = "proj" in m, "glu" in m and "proj" not in m
    lins = (gate, m["up"], down) if gated else (m["proj"], down) if joined else (gate, down)
    if any(len(n.args) not in (2, 3) or n.kwargs for n in lins) or act.args[0] is not gate or \
            down.args[0] is not (m["glu"] if "glu" in m else act):
        return None
    if joined:                  # proj(x).chunk(2, -1): the gate the first half, the up projection the second
        split, N = m["split"], shape(m["proj"])[-1]
        if N % 2 or split.args[1] != N // 2 or arg(split, 2, "dim", 0) not in (-1, 1) or \
                {m["glu"].args[0], m["glu"].args[1]} != {act, m["up"]}:
            return None
        gate = m["proj"]
        activation = "swiglu"
    elif gated:
        if gate.args[0] is not m["up"].args[0] or {m["glu"].args[0], m["glu"].args[1]} != {act, m["up"]} or \
                len(gate.args) != len(m["up"].args):
            return None
        activation = "swiglu"
    elif act.target is aten.gelu.default:
        if len(act.args) > 1 or set(act.kwargs) - {"approximate"}:
            return None
        activation = "gelu_tanh" if act.kwargs.get("approximate", "none") == "tanh" else "gelu"
    else:
        if len(act.args) > 1 or act.kwargs:
            return None
        activation = _PLAIN_ACTS[act.target]
    x = gate.args[0]
    if shape(x) is None or len(shape(x)) != 2:
        return None
    H = shape(x)[1]
    roles = (("w1", "b1", gate), ("w3", "b3", m["up"]), ("w2", "b2", down)) if gated else \
        (("w1", "b1", gate), ("w2", "b2", down))          # (a joined projection's w1: [2I, H], gate first)
    params = dict.fromkeys(("w1", "w3", "w2", "b1", "b3", "b2"))
    for w, b, n in roles:
        params[w] = _param(n.args[1])
        params[b] = _param(n.args[2]) if len(n.args) == 3 else None
        if params[w] is None or len(n.args) == 3 and params[b] is None:
            return None
    I = shape(params["w1"])[0] // (2 if joined else 1)
    out = {"w1": I * (2 if joined else 1), "w3": I, "w2": H}
    for r, p in params.items():
        want = (out[r], H if r != "w2" else I) if r.startswith("w") else (out["w" + r[1]],)
        if p is not None and (shape(p) != want or val(p).dtype != val(x).dtype):
            return None
    return params, activation, x


_ZEROS = {aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default}


def _routed_experts(ids: fx.Node) -> int | None:
    """How many experts the ids ``[T, k]`` route to: the top-k's indices over the last dim of the router's scores
    ``[T, E]`` (k distinct experts per token, each below E)."""
    if ids.target is not operator.getitem or ids.args[1] != 1 or not isinstance(ids.args[0], fx.Node):
        return None
    topk = ids.args[0]
    if topk.target is not aten.topk.default or not _last_dim(topk, arg(topk, 2, "dim", -1)) or \
            len(shape(topk.args[0])) != 2:
        return None
    return shape(topk.args[0])[-1]


def _sum_terms(n: fx.Node, terms: dict, root: bool = True) -> list | None:
    """The terms ``n`` sums: ``n`` itself if a term, else the terms of the two operands of an ``add`` (read only by
    the sum, below its root) and nothing of a zero tensor; None if anything else takes part."""
    if n in terms:
        return [n]
    if n.target in _ZEROS:
        return []
    if n.target is not aten.add.Tensor or len(n.args) != 2 or n.kwargs or not root and len(n.users) != 1:
        return None
    a, b = (_sum_terms(x, terms, False) if isinstance(x, fx.Node) else None for x in n.args)
    return None if a is None or b is None else a + b


def _loop_blocks(view) -> list[Match]:
    """Hand-written MoE layers: iterations (:data:`_LOOP_BODIES`), one per expert 0..E-1 (each once, any order),
    all reading the same tokens, expert ids and routing weights, E the number of experts the ids route to; the
    gathered ones chained through their accumulator from a zero tensor, the dense ones' terms summed by ``add``s
    (the canonical form drops the ``0 +`` of the first). The block is the whole loop; it computes what
    ``moe_experts`` computes (each token's k routed experts' outputs, weighted, summed), with the experts' weights
    as the lists of their gate, up and down projections."""
    bodies = [b for t in _LOOP_BODIES for b in t.match(view, _decide_body)]
    after, terms = {}, {b.acc: b for b in bodies if b.prev is None}
    for b in bodies:
        if b.prev is not None:
            after.setdefault(b.prev, []).append(b)
    accs = {b.acc for b in bodies}
    chains = []
    for first in bodies:
        if first.prev is None or first.prev in accs or first.prev.target not in _ZEROS or len(after[first.prev]) != 1:
            continue
        chain = [first]
        while len(chain[-1].acc.users) == 1 and len(after.get(chain[-1].acc, ())) == 1:
            chain.append(after[chain[-1].acc][0])
        chains.append((chain, chain[-1].acc, [first.prev]))
    used = set()
    for n in reversed(list(view.fx.values()) if terms else ()):
        if n in used or n.target is not aten.add.Tensor:
            continue
        got = _sum_terms(n, terms)
        if got is not None and len(got) >= 2:
            sums, stack = [], [n]          # the adds and zero tensors of the sum (``_sum_terms`` checked it)
            while stack:
                a = stack.pop()
                if a not in terms:
                    sums.append(a)
                    if a.target is aten.add.Tensor:
                        stack.extend(a.args)
            used.update(sums)
            chains.append(([terms[t] for t in got], n, sums))
    out = []
    for chain, last, extra in chains:
        first, E = chain[0], len(chain)
        if E < 2 or sorted(b.expert for b in chain) != list(range(E)) or _routed_experts(first.ids) != E:
            continue
        if any((b.x, b.ids, b.weights, b.kind()) != (first.x, first.ids, first.weights, first.kind()) for b in chain):
            continue
        nodes = {n for b in chain for n in b.nodes} | {n for n in extra if n.target not in _ZEROS or len(n.users) == 1}
        order = _block_order({n.name: n for n in nodes}, last)
        if order is None:
            continue
        T, k = shape(first.ids)
        H, I = shape(first.params["w2"])
        inputs = {"x": first.x.name, "ids": first.ids.name, "weights": first.weights.name}
        for b in sorted(chain, key=lambda b: b.expert):
            inputs.update({f"{role}.{b.expert}": p.name for role, p in b.params.items() if p is not None})
        params = dict(num_experts=E, k=k, tokens=T, hidden=H, intermediate=I, weights_scale=1.0, trans_w=True,
                      implementation="loop", out_like=val(last), dtype=val(first.x).dtype,
                      activation=first.activation, swiglu_order="gate_up",
                      loop="gather" if first.prev is not None else "dense")
        out.append(Match("moe_experts", order, last.name, inputs, params))
    return out


@register("moe_experts")
def find_moe_experts(gm: fx.GraphModule) -> list[Match]:
    view = graph_view(gm)
    found = _EXPERTS_BATCHED.match(view, _decide_experts) + _EXPERTS_BATCHED_CLAMPED.match(view, _decide_experts) + \
        _EXPERTS_GROUPED.match(view, _decide_experts) + _EXPERTS_GROUPED_CLAMPED.match(view, _decide_experts) + \
        _EXPERTS_DENSE.match(view, _decide_dense_experts) + _loop_blocks(view)
    return sorted(found, key=lambda m: view.order[m.anchor])


TEMPLATES = (_GATING, _GATING_GATHER, _GATING_GROUP_VALUES, _GATING_TOPK_FIRST, _EXPERTS_GROUPED, _EXPERTS_BATCHED,
             _EXPERTS_GROUPED_CLAMPED, _EXPERTS_BATCHED_CLAMPED, _EXPERTS_DENSE) + _LOOP_BODIES
