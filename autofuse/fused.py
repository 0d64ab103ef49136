"""Fused calls: for each pattern family, the op it becomes, how that call is emitted and what it costs.

A :class:`Family` ties a family's matches (``patterns/``) to its fused op (``torch.ops.autofuse.*``,
:mod:`autofuse.ops`): ``emit(g, inputs, match, kwargs)`` inserts the call into an fx graph and returns its
outputs by role, each with the value (shape, dtype) of the canonical node it replaces; ``price(match, nodes,
device, search_tiling)`` is the cost model's price of that call (:class:`Price`). The rewrite
(:mod:`autofuse.rewrite`) and the planner (:mod:`autofuse.plan`) read nothing else about a family.
"""
from __future__ import annotations

import itertools
import math
import json
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

import cost_model
from autofuse import ops as _ops  # noqa: F401  (registers torch.ops.autofuse.*)
from autofuse.graph import call, shape, val
from cost_model.devices import get_device

aten = torch.ops.aten

#: the device profiles every region's implementations are priced on (the report's "Implementation choices")
DEVICES = ("ascend910", "ascend910b", "ascend310p")


def per_device(price_on) -> dict:
    """``{device: price_on(device)}`` over :data:`DEVICES`, leaving out a device where it cannot be priced (no
    tiling fits, an unsupported instance)."""
    out = {}
    for d in DEVICES:
        try:
            out[d] = price_on(d)
        except (NotImplementedError, ValueError, TypeError, KeyError):
            continue
    return out


@dataclass
class Price:
    cycles: int = 0
    hbm_bytes: int = 0
    kernels: list = field(default_factory=list)
    bound: str = ""
    tiling: dict = field(default_factory=dict)
    workspace: int = 0
    alternatives: dict = field(default_factory=dict)   # device -> [(implementation, cycles, runnable)]
    options: dict = field(default_factory=dict)        # the chosen implementation's op keywords (besides tiling)

    def add(self, other: "Price") -> "Price":
        return Price(self.cycles + other.cycles, self.hbm_bytes + other.hbm_bytes, self.kernels + other.kernels,
                     self.bound or other.bound, self.tiling or other.tiling, max(self.workspace, other.workspace),
                     self.alternatives or other.alternatives, {**other.options, **self.options})


@dataclass(frozen=True)
class Family:
    name: str
    op: object                 # the OpOverload the family's call uses
    kernel: str                # the simulator/cost-model kernel it runs
    emit: Callable
    price: Callable
    op_kwargs: Callable        # (device, price, level) -> extra keywords of the call (device, tiling)
    shrink: Callable | None = None   # match -> {dim size: reduced size} for verifying a block too large to run
    resize: Callable | None = None   # (match, sizes) -> the match for those reduced shapes (when params hold shapes)
    # (verdict, match) -> the verdict every process planning this graph agrees on (families whose call
    # communicates: each rank verifies on its own data, and all must apply the same fusions); None: local
    agree: Callable | None = None
    # (match, output roles in order) -> (outputs -> outputs with what the captured ops leave unspecified fixed),
    # for verification (see ``verify.check``); None: compared as they are
    canonical: Callable | None = None
    # (match, nodes, device, search_tiling) -> {(tiles, algorithm, traffic): Price}: the ways the ranks may agree on
    # (families whose call communicates, see ``autofuse.agreement``)
    options: Callable | None = None


def _spec(n: fx.Node):
    v = n.meta.get("val")
    return tuple(v.shape), str(v.dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------- attention

def _as_bnsd(shape_):
    shape_ = tuple(shape_)
    return shape_ if len(shape_) == 4 else (1,) * (4 - len(shape_)) + shape_


def attention_specs(nodes: dict, match, skip: bool = False) -> tuple[list, dict]:
    """The fused kernel's input specs (q, k, v as [B, N, S, D]) and parameters, as the rewrite calls it;
    ``skip``: as it runs when a proven causal mask with a finite value is skipped (causal, the mask not read; with
    ``params["causal_bias"]``, the bias added to that mask read in the kept tiles)."""
    p = match.params
    specs = [_spec(nodes[match.inputs[r]]) for r in ("q", "k", "v")]
    specs = [(_as_bnsd(s), d) for s, d in specs]
    if p.get("v_cast") is not None:                 # v cast up to q's dtype ahead of the kernel
        specs[2] = (specs[2][0], specs[0][1])
    params = {"scale": p.get("scale"), "causal": bool(p.get("causal")), "return_probs": bool(p.get("probs_used"))}
    if p.get("softcap") is not None:
        params["softcap"] = p["softcap"]
    if p.get("scale_round") is not None:            # a per-head scale's 16-bit product: its roundings
        params["head_scale_dtype"] = str(p["scale_round"]).replace("torch.", "")
    if p.get("logits_round") is not None:           # eager's 16-bit scores and logits (softmax's dtype=): rounded
        params["logits_dtype"] = str(p["logits_round"]).replace("torch.", "")
    if "sinks" in match.inputs:                     # one sink logit per query head, as the op passes them
        params["sinks"] = ((specs[0][0][1],), _spec(nodes[match.inputs["sinks"]])[1])
    terms = p.get("mask_terms") or ()
    if p.get("window") and (p.get("causal") or skip):     # a sliding window: the band's tiles
        params["window"] = p["window"]
    if skip:
        params["causal"] = True
        if p.get("causal_bias"):                    # the learned bias, read alone in the kept tiles
            params["mask"] = _spec(nodes[match.inputs[p["causal_bias"]]])
    elif terms:
        role = terms[0][0]
        src = match.inputs[role]
        if isinstance(src, str) and src.startswith("const:"):
            sq, skv = (int(x) for x in src.split(":")[2:])
            params["mask"] = ((sq, skv), "bool")
        else:
            s, d = _spec(nodes[src])
            if p.get("mask_kind") == "bool":
                d = "bool"
            else:                               # the one additive mask the terms make: their broadcast, of the
                #                                 additive terms' dtype (a bool term combined with them: where(keep,
                #                                 add, fill), :func:`_mask`)
                kinds = {r: kind for r, kind, _ in terms}
                read = {r: _spec(nodes[match.inputs[r]]) for r in kinds
                        if not str(match.inputs[r]).startswith("const:")}
                s = tuple(torch.broadcast_shapes(*(shape_ for shape_, _ in read.values())))
                d = next((dt for r, (_, dt) in read.items() if kinds[r] == "additive"), d)
                if widened_terms(p):            # the additive terms scaled or summed in fp32 ahead of the kernel
                    d = "float32"
            params["mask"] = (s, d)
        if p.get("mask_add_dtype") is not None:     # the additive mask added in its 16-bit dtype, as eager adds it
            params["mask_add_dtype"] = str(p["mask_add_dtype"]).replace("torch.", "")
        if _fill_in_mask(p, p.get("fill")):         # the filled entries take the fill: the kernel's select
            params["fill_in_mask"] = True
    if p.get("dropout_draw") is not None:
        (qs, _), (ks, _) = specs[:2]
        params["drop_mask"] = ((*qs[:3], -(-ks[2] // 8)), "uint8")
        params["keep_prob"] = 1.0 - p["dropout_p"]
    return specs, params


def kernel_default_tiling(device: str, specs, mask, drop: bool = False, sink: bool = False) -> dict:
    """The tiling the flash_attention kernel picks by itself for these shapes (what it runs with ``tiling=None``)."""
    from autofuse.npu.kernels.flash_attention import default_tiling, mask_spec
    (qs, dtype), (ks, _), (vs, _) = specs
    spec = None if mask is None else mask_spec(mask[1], mask[0])
    return default_tiling(get_device(device), qs[2], ks[2], qs[3], dtype, spec, vs[3], drop, sink)


def gqa_group(p: dict, mask_shapes) -> int:
    """The query heads per kv head whose single-token rows one work item can take together (a decode step of
    grouped-query attention): q ``[B, N, 1, D]`` viewed as
    ``[B, Nkv, N / Nkv, D]``, every row of a group attending the same keys. 0 when the block is not such a step:
    more than one query row, no kv group, a causal mask, a mask that differs per head, dropout, attention sinks,
    a window, probabilities read outside the block."""
    q, k = _as_bnsd(p["q_shape"]), _as_bnsd(p["k_shape"])
    if len(p["q_shape"]) != 4 or len(p["k_shape"]) != 4 or q[2] != 1 or q[1] <= k[1] or q[1] % k[1]:
        return 0
    if p.get("causal") or p.get("causal_value") is not None or p.get("dropout_draw") is not None or \
            p.get("probs_used") or p.get("window"):
        return 0
    if any(len(s) >= 3 and _as_bnsd(s)[1] != 1 for s in mask_shapes):
        return 0
    return q[1] // k[1]


def _mask_shapes(match, nodes) -> list:
    """The shapes of the block's mask inputs (a constant mask ``const:...:Sq:Skv``: its [Sq, Skv])."""
    out = []
    for role, _, _ in match.params.get("mask_terms") or ():
        src = match.inputs[role]
        if isinstance(src, str):
            out.append(tuple(int(x) for x in src.split(":")[2:]))
        else:
            out.append(tuple(nodes[src].meta["val"].shape))
    return out


def price_attention(match, nodes: dict, device: str, search_tiling: bool) -> Price:
    """The cost model's price of the fused kernel: with the tiling its search finds cheapest
    (``search_tiling``, level O3) or with the kernel's own default tiling (O1, O2). A decode step of grouped-query
    attention is priced both per query head and with each kv group's rows in one work item (:func:`gqa_group`),
    per device, and runs the cheaper."""
    from autofuse.fused_vector import training_graph
    group = 0 if "sinks" in match.inputs or training_graph(nodes[match.inputs["q"]].graph) else \
        gqa_group(match.params, _mask_shapes(match, nodes))
    if group:
        return _cheaper(lambda d, pack: _attention_price(match, nodes, d, search_tiling, False, group if pack else 0),
                        device, GROUPING, "gqa_pack")
    if match.params.get("causal_value") is None:
        return _attention_price(match, nodes, device, search_tiling, False)
    # a proven causal mask with a finite value: skipping the tiles above the diagonal (after the run-time score
    # bound that proves it exact) or reading the mask, whichever the cost model finds cheaper, per device
    bias = bool(match.params.get("causal_bias"))
    priced: dict = {}

    def price(d, skip):
        priced[d, skip] = _attention_price(match, nodes, d, search_tiling, skip)
        return priced[d, skip]
    chosen = _cheaper(price, device, bias_implementations(match) if bias else IMPLEMENTATIONS, "causal_skip")
    if bias and chosen.options.get("causal_skip") and search_tiling:
        # where the bounds fail at run time the mask is read with the tiling the plan reading it would run (the
        # target's mask-read price, which the choice above made), so that the fallback computes what the block
        # computes without the skip, bit for bit
        read = priced[device, False]
        chosen.options = {**chosen.options, "fallback_tiling": json.dumps(read.tiling, sort_keys=True)}
    return chosen


def _cheaper(price_on, device: str, names: dict, option: str) -> Price:
    """Of two implementations of one block, ``price_on(device, True)`` and ``price_on(device, False)``, the target's
    cheaper (the ``False`` one on a tie): its price, with both implementations' prices on every device
    (``alternatives``, by their ``names``) and the choice as the call's ``option``."""
    def both(d):
        return {flag: price_on(d, flag) for flag in (True, False)}
    prices = per_device(both)
    here = prices[device] if device in prices else both(device)     # the target's error, if it cannot be priced
    flag = here[True].cycles < here[False].cycles
    chosen = here[flag]
    chosen.alternatives = {d: sorted([(names[f], p.cycles, True) for f, p in ps.items()], key=lambda a: a[1])
                           for d, ps in prices.items()}
    chosen.options = {**chosen.options, option: flag}
    return chosen


IMPLEMENTATIONS = {True: "causal skip under a score bound", False: "mask read"}
BIAS_IMPLEMENTATIONS = {True: "causal skip under score and bias bounds", False: "mask read"}


def bias_implementations(match) -> dict:
    """:data:`BIAS_IMPLEMENTATIONS`, the skip named with the blocks its bias bound is shared by (more than one)."""
    n = int(match.params.get("bias_readers") or 1)
    return BIAS_IMPLEMENTATIONS if n < 2 else \
        {True: f"{BIAS_IMPLEMENTATIONS[True]}, one bias bound shared by {n} blocks", False: BIAS_IMPLEMENTATIONS[False]}


GROUPING = {True: "a kv group's query heads in one work item", False: "one work item per query head"}


def _attention_price(match, nodes, device, search_tiling, skip, group: int = 0) -> Price:
    """A training plan's kernel also writes each row's softmax max and sum (``return_stats``, priced with it), so
    the backward reads them instead of recomputing them (the emitted call gets the option). ``group``: the kernel
    runs q as ``[B, Nkv, group, D]`` (:func:`gqa_group`)."""
    from autofuse.fused_vector import training_graph        # fused_vector builds on this module
    specs, params = attention_specs(nodes, match, skip)
    if group:
        (B, N, _, D), dtype = specs[0]
        specs[0] = ((B, N // group, group, D), dtype)
    training = training_graph(nodes[match.inputs["q"]].graph)
    if training:
        params["return_stats"] = True
    if not search_tiling:
        params["tiling"] = kernel_default_tiling(device, specs, params.get("mask"), "drop_mask" in params,
                                                 "sinks" in params)
    e = cost_model.estimate("flash_attention", specs, device=device, **params)
    first = []                          # launches ahead of the attention kernel: (kernel, estimate)
    draw = match.params.get("dropout_draw")
    if draw is not None:                # the keep-mask, generated first (DropOutGenMask, then FlashAttentionScore)
        first.append(("dropout_gen_mask", keep_mask_price(draw[0], match.params["dropout_p"], device)))
    if skip:                            # the run-time bounds: the bias's (its own call, shared), the scores'
        if match.params.get("causal_bias"):
            first.append(("bias_bound", bias_bound_share(match.params.get("bias_readers"), params["mask"], device)))
        first.append(("score_bound", cost_model.estimate("score_bound", specs[:2], device=device)))
    if match.params.get("v_cast") is not None:      # v cast up to q's dtype (GPT-J's fp32 q and k, bf16 v)
        vs = _spec(nodes[match.inputs["v"]])
        first.append(("elementwise", cost_model.estimate("elementwise", [vs], device=device, op="cast",
                                                         out_dtype=specs[0][1])))
    price = Price(int(e.cycles + sum(x.cycles for _, x in first)), int(e.hbm_bytes + sum(x.hbm_bytes for _, x in first)),
                  [k for k, _ in first] + ["flash_attention"], e.bound, dict(e.tiling or {}), e.workspace_bytes)
    if training:
        price.options = {"return_stats": True}
    return price


@dataclass
class _Share:
    cycles: int
    hbm_bytes: int


def bias_bound_share(readers, spec, device: str) -> _Share:
    """A block's share of the one ``bias_bound`` launch every block reading the same bias shares (the rewrite emits
    it once, ahead of the first such block, and hands its result to all: :func:`emit_attention`): its cycles and
    bytes divided among the ``n = readers`` blocks the pattern found reading that bias (``params["bias_readers"]``;
    None: one), rounded up.

    The rule: amortised, each of the n blocks pays 1/n. Each block is priced alone, so "the first pays" would make
    the first block's choice depend on the later blocks' (and vice versa); with equal shares, identical layers price
    and choose alike, and when all n take the skip their prices add up to the one launch. Where only some of them
    take it (a block switched off, or not verified) the launch is charged less than it costs, by the shares of the
    blocks that do not; the simulation (:mod:`autofuse.simulate`) counts the launch as it runs, once."""
    n = max(1, int(readers or 1))
    e = cost_model.estimate("bias_bound", [spec], device=device)
    return _Share(-(-int(e.cycles) // n), -(-int(e.hbm_bytes) // n))


def attention_kwargs(device: str, price: Price, level: str) -> dict:
    tiling = price.tiling if level == "O3" else {}
    return {"device": device, "tiling": json.dumps(tiling, sort_keys=True) if tiling else "", **price.options}


def _to_4d(x: fx.Node) -> fx.Node:
    r = len(shape(x))
    if r == 3:
        return call(x.graph, aten.unsqueeze.default, x, 1)
    if r == 2:
        return call(x.graph, aten.reshape.default, x, [1, 1, *shape(x)])
    return x


def widened_terms(p: dict) -> bool:
    """Whether the kernel's mask builds its additive terms in fp32: the graph adds them to the scores in fp32
    (no ``mask_add_dtype``: a 16-bit mask promoted to fp32 scores, or added to 16-bit scores and then scaled by a
    factor that is not a power of two, which the kernel computes in fp32), and a term is scaled or several are
    summed ahead of the kernel.
    Eager adds each term to the fp32 scores and scales the fp32 sum: a 16-bit term scaled or summed in its own
    dtype would be rounded where eager's is not, so it is cast up first."""
    terms = [factor for _, kind, factor in p.get("mask_terms") or () if kind != "bool"]
    return p.get("mask_add_dtype") is None and (len(terms) > 1 or any(f != 1.0 for f in terms))


def term_dtype(p: dict, kind: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a mask term enters the kernel's one mask in (see :func:`widened_terms`)."""
    if kind != "bool" and dtype in (torch.float16, torch.bfloat16) and widened_terms(p):
        return torch.float32
    return dtype


def _mask(g, ins, m, rank: int):
    """The one mask the kernel takes: bool terms AND-ed (True = attend); additive terms scaled by the factor
    recorded at the softmax input and summed (in fp32 where the graph adds them to fp32 scores:
    :func:`widened_terms`); with both kinds bool terms become ``-inf`` (fill -inf), or, with
    ``fill_last`` (the fill applied after the additive masks, and low enough to absorb any finite score added
    to it), the fill itself: ``where(keep, sum, fill)``."""
    keep, add = None, None
    if m.params.get("causal_sum"):             # s + (b + C), C a proven causal mask adding ``fill``: b + C as eager
        bias, tril = (ins[role] for role, _, _ in m.params["mask_terms"])
        return call(g, aten.add.Tensor, bias, call(g, aten.where.Scalar, tril, 0.0, m.params["fill"]))
    for role, kind, factor in m.params["mask_terms"]:
        t = ins[role]
        if rank == 3 and len(shape(t)) == 3:
            t = call(g, aten.unsqueeze.default, t, 1)
        if kind == "bool":
            keep = t if keep is None else call(g, aten.logical_and.default, keep, t)
        else:
            wide = term_dtype(m.params, kind, val(t).dtype)
            if wide != val(t).dtype:
                t = call(g, aten._to_copy.default, t, dtype=wide)
            if factor != 1.0:
                t = call(g, aten.mul.Tensor, t, factor)
            add = t if add is None else call(g, aten.add.Tensor, add, t)
    if keep is not None and add is not None:
        fill = m.params["fill"] if m.params.get("fill_last") else float("-inf")
        return call(g, aten.where.ScalarOther, keep, add, fill)
    return keep if keep is not None else add


def _fill_in_mask(p: dict, fill) -> bool:
    """Whether :func:`_mask` combines bool and additive terms into one additive mask whose entries equal to the op's
    ``fill`` (None: -inf) are exactly the scores the bool terms fill: the backward then gives them no gradient, as
    eager's ``masked_fill`` (``fill_in_mask``). An additive term holding that value too (a second, additive mask of
    ``finfo.min``) is read as filled there: the one case where the two differ, on a row every score of which is so
    masked."""
    kinds = {kind for _, kind, _ in p.get("mask_terms", ())}
    if kinds != {"bool", "additive"} or p.get("causal_sum"):
        return False
    combined = p["fill"] if p.get("fill_last") else float("-inf")
    return combined == (float("-inf") if fill is None else fill)


def _adapt(g, x: fx.Node, like) -> fx.Node:
    if tuple(val(x).shape) != tuple(like.shape):
        x = call(g, aten.reshape.default, x, list(like.shape))
    if val(x).dtype != like.dtype:
        x = call(g, aten._to_copy.default, x, dtype=like.dtype)
    return x


def _as_rank4(like):
    s = tuple(like.shape)
    s = (s[0], 1, *s[1:]) if len(s) == 3 else ((1, 1, *s) if len(s) == 2 else s)
    return like.new_empty(s)


def _physical_order(t) -> list:
    """The dims of ``t`` from outermost to innermost in memory (largest stride first)."""
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))


def emit_attention(g: fx.Graph, ins: dict, m, kwargs: dict, op=None) -> dict:
    """``flash_attention(q, k, v, mask, ...)`` on [B, N, S, D] views of the inputs; outputs reshaped and cast
    back to the values they replace (``m.params["out_like"]`` / ``"probs_like"``)."""
    p = m.params
    rank = len(p["q_shape"])
    q, k, v = (_to_4d(ins[r]) for r in ("q", "k", "v"))
    if p.get("v_cast") is not None:
        v = call(g, aten._to_copy.default, v, dtype=p["v_cast"])
    mask = _mask(g, ins, m, rank)
    kwargs = dict(kwargs)
    skip = kwargs.pop("causal_skip", True)     # the price's choice; without a price (reduced-shape checks): skip
    # the price's choice again; without one (reduced-shape checks) a decode step's kv groups are packed, so that
    # the check runs the less common form
    group = gqa_group(p, [shape(ins[r]) for r, _, _ in p.get("mask_terms") or ()]) \
        if kwargs.pop("gqa_pack", "return_stats" not in kwargs and "sinks" not in ins) and not p.get("scale_per_head") \
        else 0                  # a per-head scale is indexed by the query head, which packing folds into rows
    if group:
        B, N, Sq, D = shape(q)
        q = call(g, aten.reshape.default, q, [B, N // group, group * Sq, D])
    kw = dict(scale=p["scale"], causal=p["causal"], return_probs=p["probs_used"], **kwargs)
    if p.get("fill") is not None:
        kw["fill"] = p["fill"]
    if p.get("causal_value") is not None and skip:
        kw["causal_value"] = p["causal_value"]
        if p.get("causal_bias"):
            kw["causal_bias"] = ins[p["causal_bias"]]
            kw["bias_partials"] = _shared_bias_bound(g, kw["causal_bias"], kwargs.get("device", "ascend910"))
    if p.get("window") and (p["causal"] or kw.get("causal_value") is not None):
        kw["window"] = p["window"]              # a sliding window (with causal_value: the band the skip keeps)
    if p.get("empty_rows", "zero") != "zero":
        kw["empty_rows"] = p["empty_rows"]
    if p.get("softcap") is not None:
        kw["softcap"] = p["softcap"]
    if p.get("mask_keeps_nan"):
        kw["mask_keeps_nan"] = True
    if p.get("mask_add_dtype") is not None:
        kw["mask_add_dtype"] = p["mask_add_dtype"]
    if _fill_in_mask(p, kw.get("fill")):
        kw["fill_in_mask"] = True
    if "scale_tensor" in ins:
        kw["scale_tensor"] = ins["scale_tensor"]
        if p.get("scale_round") is not None:
            kw["head_scale_dtype"] = p["scale_round"]
    if "sinks" in ins:
        kw["sinks"] = ins["sinks"]
    if p.get("logits_round") is not None:
        kw["logits_dtype"] = p["logits_round"]
    if p.get("dropout_draw") is not None:
        kw["drop_mask"], kw["dropout_p"] = _keep_mask(g, ins, m, kwargs.get("device", "ascend910"), q), p["dropout_p"]
    like = p["out_like"]
    if like.dim() == 4 and not like.is_contiguous() and not group:
        kw["out_order"] = _physical_order(like)
    fused = g.call_function(op or torch.ops.autofuse.flash_attention.default, (q, k, v, mask), kw)
    shared = kw.get("bias_partials")
    if shared is not None and shared > fused:           # found after this block (blocks emitted out of order)
        fused.prepend(shared)
    fused.meta["autofuse_match"] = m
    out = g.call_function(operator.getitem, (fused, 0))
    out.meta["val"] = like if like.dim() == 4 else _as_rank4(like)
    if p.get("v_cast") is not None:         # the kernel ran in q's dtype: its output is in it (cast back below)
        base = out.meta["val"]
        out.meta["val"] = base.new_empty_strided(tuple(base.shape), tuple(base.stride()), dtype=p["v_cast"])
    if group:           # the kernel's [B, Nkv, group, Dv] back to [B, N, 1, Dv]: a view (one row per head)
        per_head = out.meta["val"]
        out.meta["val"] = per_head.new_empty([*shape(q)[:3], per_head.shape[-1]])
        out = call(g, aten.reshape.default, out, list(per_head.shape))
    outs = {"out": _adapt(g, out, p["out_like"])}
    if p["probs_used"]:
        probs = g.call_function(operator.getitem, (fused, 1))
        probs.meta["val"] = _as_rank4(p["probs_like"])
        outs["probs"] = _adapt(g, probs, p["probs_like"])
    return outs


def _shared_bias_bound(g: fx.Graph, bias: fx.Node, device: str) -> fx.Node:
    """The ``bias_bound(bias, device)`` call of ``g``: the one an earlier block reading ``bias`` emitted, else a new
    one, inserted here (ahead of this block's call; it is then this block's fusion's other launch). One launch per
    bias value and call of the model, computed from the bias the model produces in that call."""
    op = torch.ops.autofuse.bias_bound.default
    for u in bias.users:
        if u.op == "call_function" and u.target is op and u.args == (bias, device):
            return u
    return call(g, op, bias, device)


def keep_mask_call(g: fx.Graph, dims, p: float, dtype: torch.dtype, device: str, like: torch.Tensor,
                   order=None) -> fx.Node:
    """A ``dropout_gen_mask`` call drawing the keep-mask eager's dropout of ``p`` draws for a ``dims`` tensor of
    ``dtype`` laid out in ``order`` (the same generator call, in the same memory order: see
    :func:`autofuse.graph.draw_order`): uint8 ``[*dims[:-1], ceil(dims[-1] / 8)]``, its value's metadata made like
    ``like``'s (the graph's fake mode)."""
    kw = {"device": device} if order is None else {"device": device, "order": list(order)}
    gen = g.call_function(torch.ops.autofuse.dropout_gen_mask.default, (list(dims), p, dtype), kw)
    gen.meta["val"] = like.new_empty([*dims[:-1], -(-dims[-1] // 8)], dtype=torch.uint8)
    return gen


def keep_mask_price(dims, p: float, device: str):
    """The cost model's estimate of that call (DropOutGenMask): the same launch eager's dropout makes."""
    return cost_model.estimate("dropout_gen_mask", [], device=device, shape=list(dims), keep_prob=1.0 - p)


def _keep_mask(g, ins, m, device: str, q4: fx.Node) -> fx.Node:
    """The dropout keep-mask eager draws for the block's probabilities, drawn here by ``dropout_gen_mask`` over
    the same shape and dtype, in the probabilities' memory order (the same elements of the generator's stream),
    as [B, N, Sq, ceil(Skv / 8)]."""
    p = m.params
    dims = [*shape(ins["q"])[:-1], shape(ins["k"])[-2]]            # the probabilities (reduced shapes included)
    _, dtype, order = p["dropout_draw"]
    gen = keep_mask_call(g, dims, p["dropout_p"], dtype, device, p["out_like"], order)
    want = [*shape(q4)[:-1], -(-dims[-1] // 8)]
    if list(shape(gen)) != want:
        gen = call(g, aten.reshape.default, gen, want)
    return gen


REDUCED = 80       # a reduced sequence or token count: not a tile multiple, so edge tiles are exercised


#: A sliding window's block is first checked on sequences past its window, while their float64 scores stay this small
WINDOW_CHECK_BYTES = 128 << 20


def shrink_attention(match) -> list:
    """The sequence lengths, reduced to ``REDUCED`` (query and key lengths separately). A sliding window (its band
    computed by the graph's own mask, which a sequence within the window makes causal) is first reduced to the
    window plus ``REDUCED`` keys, so the check runs the band's skipped tiles, when those scores fit
    ``WINDOW_CHECK_BYTES`` in float64; a window too wide for that is checked on the causal sequences of 80."""
    p = match.params
    lengths = {p["q_shape"][-2], p["k_shape"][-2]}
    plain = {n: REDUCED for n in lengths if n > REDUCED}
    w = p.get("window") or 0
    if w:
        n = w + REDUCED
        rows = math.prod(p["q_shape"][:-2]) if len(p["q_shape"]) > 2 else 1
        if rows * n * n * 8 <= WINDOW_CHECK_BYTES and all(x > n for x in lengths):
            return [{x: n for x in lengths}, plain]
    return [plain]


ATTENTION = Family("attention", torch.ops.autofuse.flash_attention.default, "flash_attention", emit_attention,
                   price_attention, attention_kwargs, shrink_attention)


# ------------------------------------------------------------------------------------------- MoE


def _device_and_options(device: str, price: Price, level: str) -> dict:
    """The call's keywords: the device and the chosen implementation's options (the kernel's own tiling)."""
    return {"device": device, **price.options}


def _estimate(kernel, specs, device, **params) -> Price:
    e = cost_model.estimate(kernel, specs, device=device, **params)
    return Price(int(e.cycles), int(e.hbm_bytes), [kernel], e.bound, dict(e.tiling or {}), e.workspace_bytes)


def _out_dtype(like, x) -> str:
    return "" if like.dtype == val(x).dtype else str(like.dtype).replace("torch.", "")


def _gating_params(p: dict) -> dict:
    return dict(k=p["k"], norm=p["norm"], renorm=p["renorm"], eps=p["eps"],
                routed_scaling_factor=p["routed_scaling_factor"], n_group=p["n_group"], topk_group=p["topk_group"],
                group_score=p["group_score"], group_fill=p.get("group_fill"),
                weights_from=p.get("weights_from", "scores"))


def _gating_out_dtype(p: dict) -> str:
    """The weights' dtype the emitted call asks for (fp32 where the replaced weights are, else theirs)."""
    like = p["weights_like"].dtype
    return "float32" if like == torch.float32 else str(like).replace("torch.", "")


def price_gating(match, nodes: dict, device: str, search_tiling: bool) -> Price:
    """The router kernel: at O3 with the token lanes the cost model's search finds cheapest (passed to the call), at
    O1 and O2 with the kernel's own (a call without a tiling)."""
    p = match.params
    spec = _spec(nodes[match.inputs["x"]])
    bias = _spec(nodes[match.inputs["bias"]]) if "bias" in match.inputs else None
    out = _gating_out_dtype(p)
    tiling = None
    if not search_tiling:
        from autofuse.npu.kernels.moe_gating import default_lanes
        shape_, dt = spec
        tiling = {"lanes": default_lanes(get_device(device), math.prod(shape_[:-1]), shape_[-1], p["k"], dt, out,
                                         bias is not None, p["n_group"])}
    price = _estimate("moe_gating_topk", [spec], device, bias=bias, out_dtype=out, tiling=tiling, **_gating_params(p))
    if search_tiling:
        price.options = {"tiling": json.dumps(price.tiling, sort_keys=True)}
    return price


def emit_gating(g: fx.Graph, ins: dict, m, kwargs: dict) -> dict:
    """``moe_gating_topk(x, bias, ...)``; the weights reshaped and cast to the value they replace."""
    p = m.params
    x = ins["x"]
    call_ = call(g, torch.ops.autofuse.moe_gating_topk.default, x, ins.get("bias"), **_gating_params(p),
                 out_dtype="float32" if p["weights_like"].dtype == torch.float32 else _out_dtype(p["weights_like"], x),
                 **kwargs)
    call_.meta["autofuse_match"] = m
    w = call(g, operator.getitem, call_, 0)
    i = call(g, operator.getitem, call_, 1)
    return {"weights": _adapt(g, w, p["weights_like"]), "indices": _adapt(g, i, p["indices_like"])}


def _experts_specs(match, nodes):
    """The block's operand specs: x, the two GEMMs' weights and biases (None: none), and its sizes."""
    p, ins = match.params, match.inputs
    T, k, E, H, I = p["tokens"], p["k"], p["num_experts"], p["hidden"], p["intermediate"]
    x = _spec(nodes[ins["x"]])
    if p.get("implementation") == "loop":       # the lists of the experts' weights and biases, read as stacked
        (n1, _), dt = _spec(nodes[ins["w1.0"]])            # (2I: a gate and up projection joined)
        n1 *= 2 if "w3.0" in ins else 1
        w1, w2 = ((E, n1, H), dt), ((E, H, I), dt)
        b1, b2 = (((E, n), dt) if f"{r}.0" in ins else None for r, n in (("b1", n1), ("b2", H)))
    else:
        w1, w2 = (_spec(nodes[ins[r]]) for r in ("w1", "w2"))
        b1, b2 = (_spec(nodes[ins[r]]) if r in ins else None for r in ("b1", "b2"))
    return x, w1, w2, b1, b2, T * k, E, H, I, (T, k)


def price_experts(match, nodes: dict, device: str, search_tiling: bool) -> Price:
    """Routing, the two grouped GEMMs (the first with its SwiGLU epilogue), the combine. The group sizes are not
    known from shapes: the grouped GEMM model spreads the rows evenly over the experts. In a training graph the
    first GEMM also stores its product (``store_product``, priced with it), so the backward reads it instead of
    recomputing it (the emitted call is ``grouped_matmul_with_product``, or ``grouped_matmul_list_with_product``)."""
    from autofuse.fused_vector import training_graph        # fused_vector builds on this module
    x, w1, w2, b1, b2, S, E, H, I, tk = _experts_specs(match, nodes)
    dt = x[1]
    p = match.params
    training = training_graph(nodes[match.inputs["x"]].graph)
    trans_w = p.get("trans_w", True)
    tilings = []            # the two GEMMs': searched at O3 (passed to the calls), the kernel's own at O1 and O2

    def gemm(specs, **kw):
        tiling = None if search_tiling else _grouped_matmul_default(device, specs, **kw)
        price = _estimate("grouped_matmul", specs, device, tiling=tiling, **kw)
        tilings.append(json.dumps(price.tiling, sort_keys=True))
        return price
    total = _estimate("moe_init_routing", [x, (tk, "int64")], device, num_experts=E)
    total = total.add(gemm([((S, H), dt), w1, ((E,), "int64")], trans_w=trans_w, bias=b1, return_product=training,
                           **_glu_options(p)))
    total = total.add(gemm([((S, I), dt), w2, ((E,), "int64")], trans_w=trans_w, bias=b2))
    total = total.add(_estimate("moe_finalize_routing", [((S, H), dt), (tk, "float32"), ((S,), "int64")], device))
    if match.params.get("weights_scale", 1.0) != 1.0:
        total = total.add(_estimate("elementwise", [(tk, "float32")], device, op="mul",
                                    scalar=match.params["weights_scale"]))
    if p.get("weights_at") == "input":
        # the dense form: the router's top-k (in the block), the scores (a sigmoid over [T, k]) put at the routed
        # rows scale the routed tokens
        wdt = _spec(nodes[match.inputs["logits"]])[1]
        total = total.add(_estimate("topk", [((tk[0], E), wdt)], device, k=tk[1]))
        up, down = p["score_casts"]
        if up:
            total = total.add(_estimate("elementwise", [(tk, wdt)], device, op="cast", out_dtype=up))
        total = total.add(_estimate("elementwise", [(tk, up or wdt)], device, op="sigmoid"))
        if down:
            total = total.add(_estimate("elementwise", [(tk, up or wdt)], device, op="cast", out_dtype=down))
        total = total.add(_estimate("elementwise", [((S, H), dt), ((S, 1), dt)], device, op="mul"))
    total.options = {**({"store_product": True} if training else {}),
                     **({"gemm_tilings": tilings} if search_tiling else {})}
    return total


def _grouped_matmul_default(device, specs, trans_w=True, bias=None, return_product=False, activation=None, **_):
    """The grouped GEMM kernel's own tiling for these operands (what a call without a tiling runs)."""
    from cost_model import grouped_matmul as gmm
    M, K, N, E, dtype = gmm._dims(specs[0], specs[1], trans_w, activation)
    nb = 2 if activation in gmm.GLU else 1
    return gmm.kernel_default(get_device(device), dtype, dtype, K, N // nb, activation, bias is not None,
                              bool(return_product))


def _glu_options(p: dict) -> dict:
    """The first GEMM's epilogue options: SwiGLU on halves, or GPT-OSS's clamped SwiGLU on interleaved pairs."""
    act = dict(activation=p.get("activation", "swiglu"), swiglu_order=p["swiglu_order"])
    if act["activation"] == "clamped_swiglu":
        act.update(limit=p["limit"], alpha=p["alpha"])
    return act


def emit_experts(g: fx.Graph, ins: dict, m, kwargs: dict) -> dict:
    """``moe_init_routing`` → ``grouped_matmul`` (SwiGLU) → ``grouped_matmul`` → ``moe_finalize_routing``; with
    ``store_product`` (a training plan) the first GEMM is ``grouped_matmul_with_product`` (or its list form; its
    output 0 feeds the graph, the product only its backward)."""
    p = m.params
    ops = torch.ops.autofuse
    T, k = p["tokens"], p["k"]
    kwargs = dict(kwargs)
    store = kwargs.pop("store_product", False)
    t_up, t_down = ({"tiling": t} for t in kwargs.pop("gemm_tilings", ("", "")))   # O3: each GEMM's searched tiling
    ids, w = ins.get("ids"), ins.get("weights")
    if "topk" in p:                     # the dense form's router top-k, taken again on the same logits
        k_, dim, sorted_ = p["topk"]
        top = call(g, aten.topk.default, ins["logits"], k_, dim, True, sorted_)
        w, ids = call(g, operator.getitem, top, 0), call(g, operator.getitem, top, 1)
    routed = call(g, ops.moe_init_routing.default, ins["x"], ids, p["num_experts"], **kwargs)
    routed.meta["autofuse_match"] = m
    xs, rows, counts = (call(g, operator.getitem, routed, i) for i in range(3))
    if p.get("weights_at") == "input":
        # the dense form's scores scale each routed row before the GEMMs; the combine then sums the k outputs
        up, down = p["score_casts"]             # the sigmoid's: the dtype it runs in, the dtype it returns
        if up:
            w = call(g, aten._to_copy.default, w, dtype=getattr(torch, up))
        w = call(g, aten.sigmoid.default, w)
        if down:
            w = call(g, aten._to_copy.default, w, dtype=getattr(torch, down))
        flat = call(g, aten.reshape.default, w, [T * k])
        at_rows = call(g, aten.index_put.default, call(g, aten.zeros_like.default, flat), [rows], flat)
        xs = call(g, aten.mul.Tensor, xs, call(g, aten.unsqueeze.default, at_rows, -1))
    first = ops.grouped_matmul_with_product.default if store else ops.grouped_matmul.default
    trans_w = p.get("trans_w", True)
    if p.get("implementation") == "loop":       # a hand-written layer's experts: lists of their projections
        w1, w3, w2, b1, b3, b2 = ([ins[f"{r}.{e}"] for e in range(p["num_experts"]) if f"{r}.{e}" in ins]
                                  for r in ("w1", "w3", "w2", "b1", "b3", "b2"))
        lists = ops.grouped_matmul_list_with_product.default if store else ops.grouped_matmul_list.default
        h = call(g, lists, xs, w1, counts, w3, b1, b3, trans_w=True, **_glu_options(p), **kwargs, **t_up)
        if store:
            h = call(g, operator.getitem, h, 0)
        y = call(g, ops.grouped_matmul_list.default, h, w2, counts, [], b2, [], trans_w=True, **kwargs, **t_down)
    else:
        h = call(g, first, xs, ins["w1"], counts, ins.get("b1"), trans_w=trans_w, **_glu_options(p), **kwargs, **t_up)
        if store:
            h = call(g, operator.getitem, h, 0)
        y = call(g, ops.grouped_matmul.default, h, ins["w2"], counts, ins.get("b2"), trans_w=trans_w, **kwargs,
                 **t_down)
    if p.get("weights_at") == "input":
        w = call(g, aten.new_ones.default, xs, [T, k], dtype=torch.float32)
    if tuple(val(w).shape) != (T, k):
        w = call(g, aten.reshape.default, w, [T, k])
    if p.get("weights_scale", 1.0) != 1.0:
        w = call(g, aten.mul.Tensor, w, p["weights_scale"])
    out = call(g, ops.moe_finalize_routing.default, y, w, rows, **kwargs)
    return {"out": _adapt(g, out, p["out_like"])}


def _moe_ops():
    from autofuse import ops_moe  # noqa: F401  (registers torch.ops.autofuse.moe_* / grouped_matmul)
    return torch.ops.autofuse


def shrink_gating(match) -> dict:
    t = match.params["tokens"]
    return {t: REDUCED} if t > REDUCED else {}


def shrink_experts(match) -> list:
    """Tokens (and token-expert pairs), the hidden size and the expert width: the weights shrink with them, so a
    7B-class experts block verifies in megabytes. The reduced sizes keep the block's own coincidences: a size
    that plays two roles (Mixtral's 2048 tokens x top-2 = 4096 = its hidden size; DeepSeek-V3's 4096 tokens =
    twice its expert width) gets one reduced value that serves both, and the expert count and k are left alone
    (held in the map as themselves).
    Several such choices, the verifier takes the first that runs (a size the block's views split, such as a
    sequence length equal to the hidden size, can still make one fail)."""
    p = match.params
    T, k, E, H, I = p["tokens"], p["k"], p["num_experts"], p["hidden"], p["intermediate"]
    out = []
    for t, h, i in itertools.product((24, 16, 32, 40, 48, 56, 64, 80, 96), (64, 48, 80, 96, 128, 32, 40),
                                     (48, 40, 56, 72, 112, 24, 32, 16, 64, 80, 96)):
        roles = [(T, min(T, t)), (T * k, min(T, t) * k), (H, min(H, h)), (I, min(I, i)), (2 * I, 2 * min(I, i)),
                 (E, E), (k, k)]
        if p.get("implementation") == "dense":           # every token once per expert
            roles.append((E * T, E * min(T, t)))
        sizes = {}
        if all(sizes.setdefault(a, b) == b for a, b in roles):
            # the expert count and k stay in the map (a -> a): a view that seems to split a reduced size over one
            # of them (2I = 2048 = 32 tokens x hidden 64, where 64 is also the expert count) must not reduce it
            # (verify.consistent_sizes leaves a size the map holds alone); other sizes left as they are may be
            sizes = {a: b for a, b in sizes.items() if a != b or a in (E, k)}
            if any(a != b for a, b in sizes.items()) and sizes not in out:
                out.append(sizes)
    return out


def unsorted_picks(match, roles: list):
    """A router whose top-k is ``sorted=False`` (DeepSeek-V3's): torch leaves the order of each token's picks
    unspecified (its CPU kernel returns them in another order than sorted from some sizes on), and the experts
    block that reads them sums over them; each token's (weight, index) pairs are compared ordered by index."""
    if match.params.get("sorted", True):
        return None
    w, i = roles.index("weights"), roles.index("indices")

    def canonical(outputs):
        outputs = list(outputs)
        k = outputs[i].shape[-1]
        order = outputs[i].reshape(-1, k).argsort(dim=-1)
        for j in (w, i):
            outputs[j] = outputs[j].reshape(-1, k).gather(-1, order).reshape(outputs[j].shape)
        return outputs
    return canonical


MOE_GATING = Family("moe_gating", _moe_ops().moe_gating_topk.default, "moe_gating_topk", emit_gating,
                    price_gating, _device_and_options, shrink_gating, canonical=unsorted_picks)
MOE_EXPERTS = Family("moe_experts", _moe_ops().grouped_matmul.default, "grouped_matmul", emit_experts,
                     price_experts, _device_and_options, shrink_experts)

FAMILIES = {"attention": ATTENTION, "moe_gating": MOE_GATING, "moe_experts": MOE_EXPERTS}


def register_family(fam: Family) -> Family:
    """Add a family's fused call (its matches come from a ``patterns`` module registered with
    :func:`autofuse.match.register` under the same name)."""
    FAMILIES[fam.name] = fam
    return fam


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"no fused call for pattern family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(match) -> Family:
    """A match's family: its pattern, or, for discovered regions named after what they compute
    (``rms_norm``, ``matmul+swiglu``), the family that found them (``params["family"]``)."""
    return family(match.params.get("family", match.pattern))


def is_fused_call(n: fx.Node) -> bool:
    """A call of a fused op (the ``autofuse`` namespace of ``torch.ops``)."""
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "autofuse"


from autofuse import fused_mc2  # noqa: E402,F401  (registers the MC2 families' fused calls)

__all__ = ["ATTENTION", "DEVICES", "FAMILIES", "Family", "Price", "per_device", "attention_specs", "emit_attention", "family", "family_of",
           "is_fused_call", "kernel_default_tiling", "price_attention", "register_family"]

from autofuse import fused_softmax as _fused_softmax  # noqa: E402,F401  (registers the softmax family)
from autofuse import fused_vector as _fused_vector  # noqa: E402,F401  (registers vector_chain, matmul_epilogue)
