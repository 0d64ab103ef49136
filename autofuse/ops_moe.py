"""Fused MoE operators as ``torch.library`` custom ops, running the simulator's MoE kernels.

    w, idx = torch.ops.autofuse.moe_gating_topk(logits, bias, k, "softmax", renorm, eps, scale, n_group,
                                                topk_group, "max", "float32", device, tiling, group_fill,
                                                weights_from)
    xs, row_idx, counts = torch.ops.autofuse.moe_init_routing(x, idx, num_experts, "count", device, tiling)
    y = torch.ops.autofuse.grouped_matmul(xs, w, counts, bias, trans_w, "count", "swiglu", "gate_up", device, tiling)
    y, p = torch.ops.autofuse.grouped_matmul_with_product(xs, w, counts, ...)   # training: the product kept
    y = torch.ops.autofuse.grouped_matmul_list(xs, gates, counts, ups, biases, up_biases, ...)  # weight lists
    y, p = torch.ops.autofuse.grouped_matmul_list_with_product(xs, gates, counts, ...)   # training, weight lists
    out = torch.ops.autofuse.moe_finalize_routing(y, w, row_idx, skip, device, tiling)

``norm`` is ``"softmax"``, ``"sigmoid"``, ``"none"`` or ``"topk_softmax"`` (the top k of the logits, then the
softmax over the k chosen: GraniteMoE's and GPT-OSS's routers; its backward is the renormalised softmax's, the
same function of the logits once the experts are fixed).
(``autofuse.ops_moe.moe_gating_topk(...)`` etc. are the keyword-friendly wrappers.) Each op runs its kernel
on the NPU simulator (``device`` names the target, ``tiling`` is a JSON object or ``""``), records the
launch for whole-graph simulation, has a fake implementation, a backward, and a pure-torch twin
``reference_<op>`` that gives the kernel's values where only values are needed.

Index outputs are int64 (torch's convention); the kernels work in int32. Gradients:

* grouped_matmul (and grouped_matmul_list, on its lists stacked: each group's gradient its block of the stacked
  one): fused launches (:func:`_gmm_backward`): dx by ``grouped_matmul`` with the weight transposed,
  dw (and dbias) by ``grouped_matmul_weight_grad`` (``torch.ops.autofuse.grouped_matmul_weight_grad``, CANN
  GroupedMatmul's split-K grouping), an epilogue's gradient by its derived Vector program over the product,
  which one ``grouped_matmul`` launch recomputes (the op returns only the activation), or which
  ``grouped_matmul_with_product`` (the same launch, also storing the pre-activation product: what a training
  forward runs) saved, so its backward launches no recompute;
* moe_init_routing: one ``moe_finalize_routing`` launch with unit weights (the un-permute sums each token's k
  rows);
* moe_finalize_routing: one ``moe_finalize_routing_grad`` launch (CANN MoeFinalizeRoutingV2Grad):
  ``d_expanded[r] = scales[t, j]·g[t]`` (gather-and-scale) and ``d_scales[t, j] = g[t]·expanded[r]`` (fp32
  row dots); ``d_skip = g`` passes through, no launch;
* moe_gating_topk: one ``moe_gating_topk_grad`` launch: the scores recomputed from the logits and the
  closed-form derivative of the renormalise/scale chain and of the softmax or sigmoid, through the chosen
  experts (the saved indices; they and the selection bias get no gradient).

The two backward ops are ops of their own (``torch.ops.autofuse.moe_finalize_routing_grad``,
``torch.ops.autofuse.moe_gating_topk_grad``, with fakes and twins), so a training step's joint graph holds
them as launches.
"""
from __future__ import annotations

import json
from typing import Optional

import torch

import cost_model
from autofuse.grad_ops import no_double_backward
from autofuse.ops import REFERENCES, STEERED, TIMING, _record, _to_torch, run_kernel
from autofuse.npu.kernels.grouped_matmul import GLU
from autofuse.ops_vector import _grad_launch, run_grad_program
from cost_model.program import Builder

_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _tiling(tiling: str):
    return json.loads(tiling) if tiling else None


# ------------------------------------------------------------------------------------------ gating
@torch.library.custom_op("autofuse::moe_gating_topk", mutates_args=())
def _moe_gating_topk(x: torch.Tensor, bias: Optional[torch.Tensor] = None, k: int = 1, norm: str = "softmax",
                     renorm: bool = False, eps: float = 1e-20, routed_scaling_factor: float = 1.0, n_group: int = 1,
                     topk_group: int = 1, group_score: str = "max", out_dtype: str = "float32",
                     device: str = "ascend910", tiling: str = "", group_fill: Optional[float] = None,
                     weights_from: str = "scores") -> tuple[torch.Tensor, torch.Tensor]:
    od = out_dtype or str(x.dtype).replace("torch.", "")
    lead = x.shape[:-1]
    r = run_kernel("moe_gating_topk", x.reshape(-1, x.shape[-1]), bias, k=k, norm=norm, renorm=renorm, eps=eps,
                   routed_scaling_factor=routed_scaling_factor, n_group=n_group, topk_group=topk_group,
                   group_score=group_score, out_dtype=od, device=device, tiling=_tiling(tiling), group_fill=group_fill,
                   weights_from=weights_from)
    _record("moe_gating_topk", r.stats)
    return (_to_torch(r.outputs[0], _DT[od]).reshape(*lead, k),
            torch.from_numpy(r.outputs[1].astype("int64")).reshape(*lead, k))


@_moe_gating_topk.register_fake
def _(x, bias=None, k=1, norm="softmax", renorm=False, eps=1e-20, routed_scaling_factor=1.0, n_group=1,
      topk_group=1, group_score="max", out_dtype="float32", device="ascend910", tiling="", group_fill=None,
      weights_from="scores"):
    dt = _DT[out_dtype] if out_dtype else x.dtype
    return x.new_empty((*x.shape[:-1], k), dtype=dt), x.new_empty((*x.shape[:-1], k), dtype=torch.int64)


def reference_moe_gating_topk(x, bias=None, k=1, norm="softmax", renorm=False, eps=1e-20, routed_scaling_factor=1.0,
                              n_group=1, topk_group=1, group_score="max", out_dtype="float32", upcast=False,
                              indices=None, group_fill=None, weights_from="scores", **_):
    """The kernel's computation in torch: fp32 normalisation, selection on ``scores + bias`` (group limit by
    ``torch.topk`` over the group scores), ``torch.topk`` over the choices (so ties fall as torch orders
    them, which the kernel reproduces), the unbiased scores gathered, renormalised, scaled, cast.
    ``indices``: differentiate with these experts fixed (the backward)."""
    s = x.float()
    if norm == "softmax":
        s = torch.softmax(s, -1)
    elif norm == "sigmoid":
        s = torch.sigmoid(s)
    chosen = None
    if indices is None:
        with torch.no_grad():
            choice = s.detach() + (bias.detach().float() if bias is not None else 0.0)
            E = choice.shape[-1]
            if n_group > 1:
                g = choice.reshape(*choice.shape[:-1], n_group, E // n_group)
                gs = g.amax(-1) if group_score == "max" else g.topk(2, dim=-1).values.sum(-1)
                keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(-1, torch.topk(gs, topk_group, -1,
                                                                                      sorted=False).indices, True)
                choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, -1),
                                            float("-inf") if group_fill is None else group_fill)
            indices = torch.topk(choice, k, dim=-1).indices
            chosen = choice.gather(-1, indices)
    y = s.gather(-1, indices)
    if weights_from == "choices" and chosen is not None:     # the chosen choices as filled (no bias: the scores)
        y = torch.where(chosen == y, y, chosen)             # a pick of a group not kept weighs the fill
    if norm == "topk_softmax":                # softmax over the chosen logits (largest first)
        y = torch.exp(y - y[..., :1])
        y = y / y.sum(-1, keepdim=True)
    if renorm:
        y = y / (y.sum(-1, keepdim=True) + eps) if eps else y / y.sum(-1, keepdim=True)
    y = y * routed_scaling_factor
    if not upcast:
        y = y.to(_DT[out_dtype] if out_dtype else x.dtype)
    return y, indices


def _gating_setup(ctx, inputs, output):
    names = ("k", "norm", "renorm", "eps", "routed_scaling_factor", "n_group", "topk_group", "group_score",
             "out_dtype")
    ctx.params = dict(zip(names, inputs[2:11]))
    ctx.device = inputs[11] if len(inputs) > 11 else "ascend910"
    ctx.fill = inputs[13] if len(inputs) > 13 else None
    # weights_from="choices": a weight at the fill is constant (an expert of a group not kept); kept to find them
    ctx.filled = len(inputs) > 14 and inputs[14] == "choices" and ctx.fill is not None
    ctx.save_for_backward(inputs[0], output[1], *([output[0]] if ctx.filled else []))
    ctx.set_materialize_grads(False)          # weights unused (only the indices): no launch


def _gating_backward(ctx, grad_w, grad_idx):
    """One ``moe_gating_topk_grad`` launch: dx through the chosen experts (none when the weights were unused)."""
    x, idx, *w = ctx.saved_tensors
    if grad_w is None or not ctx.needs_input_grad[0]:
        return (None,) * 15
    p = ctx.params
    if w:       # no gradient through a weight at the fill (x routed_scaling_factor, rounded as the kernel does)
        at = (torch.tensor(ctx.fill, dtype=torch.float32) * p["routed_scaling_factor"]).to(w[0].dtype)
        grad_w = grad_w.masked_fill(w[0] == at, 0.0)
    norm, renorm, eps = p["norm"], p["renorm"], p["eps"]
    if norm == "topk_softmax":                # with the experts fixed, the softmax over the chosen logits is the
        norm, renorm, eps = "softmax", True, 0.0    # renormalised softmax over all: the same function of x
    gx = torch.ops.autofuse.moe_gating_topk_grad(x, grad_w.contiguous(), idx, p["k"], norm, renorm, eps,
                                                 p["routed_scaling_factor"], ctx.device, "")
    return (gx,) + (None,) * 14


_moe_gating_topk.register_autograd(_gating_backward, setup_context=_gating_setup)


@torch.library.custom_op("autofuse::moe_gating_topk_grad", mutates_args=())
def _moe_gating_topk_grad(x: torch.Tensor, grad_w: torch.Tensor, indices: torch.Tensor, k: int = 1,
                          norm: str = "softmax", renorm: bool = False, eps: float = 1e-20,
                          routed_scaling_factor: float = 1.0, device: str = "ascend910",
                          tiling: str = "") -> torch.Tensor:
    r = _launch_gating_grad(x, grad_w, indices, k, norm, renorm, eps, routed_scaling_factor, device, tiling)
    _record("moe_gating_topk_grad", r.stats)
    return _to_torch(r.outputs[0], x.dtype).reshape(x.shape)


def _launch_gating_grad(x, grad_w, indices, k, norm, renorm, eps, routed_scaling_factor, device, tiling, **kw):
    E = x.shape[-1]
    return run_kernel("moe_gating_topk_grad", x.reshape(-1, E), grad_w.reshape(-1, k), indices.reshape(-1, k).int(),
                      k=k, norm=norm, renorm=renorm, eps=eps, routed_scaling_factor=routed_scaling_factor,
                      device=device, tiling=_tiling(tiling), **kw)


def _timing_gating_grad(x, grad_w, indices, k=1, norm="softmax", renorm=False, eps=1e-20, routed_scaling_factor=1.0,
                        device="ascend910", tiling=""):
    return [("moe_gating_topk_grad", _launch_gating_grad(x, grad_w, indices, k, norm, renorm, eps,
                                                         routed_scaling_factor, device, tiling, timing_only=True).stats)]


@_moe_gating_topk_grad.register_fake
def _(x, grad_w, indices, k=1, norm="softmax", renorm=False, eps=1e-20, routed_scaling_factor=1.0,
      device="ascend910", tiling=""):
    return torch.empty_like(x)


def reference_moe_gating_topk_grad(x, grad_w, indices, k=1, norm="softmax", renorm=False, eps=1e-20,
                                   routed_scaling_factor=1.0, **_):
    """The kernel's closed form in fp32, in its order: ``s = norm(x)``; with ``renorm``, ``r = 1 / (Σy + eps)``
    (y the chosen scores) and ``dy = (gw - Σ(gw·y)·r)·r``, else ``dy = gw``; ``dy·routed_scaling_factor``
    scattered to the chosen experts; then ``(ds - Σ s·ds)·s`` (softmax), ``ds·(s·(1 - s))`` (sigmoid) or ``ds``;
    one cast to x's dtype."""
    s = x.float()
    if norm == "softmax":
        s = s - s.amax(-1, keepdim=True)
        s = s.exp()
        s = s / s.sum(-1, keepdim=True)
    elif norm == "sigmoid":
        s = 1 / (1 + torch.exp(-s))
    idx = indices.long()
    dy = grad_w.float()
    if renorm:
        y = s.gather(-1, idx)
        r = y.sum(-1, keepdim=True)
        r = 1 / (r + eps if eps else r)
        dy = (dy - (dy * y).sum(-1, keepdim=True) * r) * r
    if routed_scaling_factor != 1:
        dy = dy * routed_scaling_factor
    ds = torch.zeros_like(s).scatter_(-1, idx, dy)
    if norm == "softmax":
        dx = (ds - (s * ds).sum(-1, keepdim=True)) * s
    elif norm == "sigmoid":
        dx = ds * ((1 - s) * s)
    else:
        dx = ds
    return dx.to(x.dtype)


def moe_gating_topk_grad(x, grad_w, indices, k=None, norm="softmax", renorm=False, eps=1e-20,
                         routed_scaling_factor=1.0, device="ascend910", tiling=None):
    """The logits' gradient of :func:`moe_gating_topk`'s weights (``grad_w [..., k]``), the chosen experts
    ``indices [..., k]`` fixed (what the forward returned): one launch. ``norm``/``renorm``/``eps``/
    ``routed_scaling_factor`` as the forward's; the selection bias and the group limit only chose the experts."""
    k = int(k if k is not None else indices.shape[-1])
    return torch.ops.autofuse.moe_gating_topk_grad(x, grad_w, indices, k, norm, bool(renorm), float(eps),
                                                   float(routed_scaling_factor), device,
                                                   json.dumps(tiling) if tiling else "")


def moe_gating_topk(x, bias=None, k=1, norm="softmax", renorm=False, eps=1e-20, routed_scaling_factor=1.0,
                    n_group=1, topk_group=1, group_score="max", out_dtype="float32", device="ascend910", tiling=None,
                    group_fill=None, weights_from="scores"):
    """MoE router top-k (CANN MoeGatingTopK): ``(weights [..., k], indices [..., k] int64)`` from logits
    ``x [..., E]``.

    ``norm``: "softmax" | "sigmoid" | "none" (fp32); ``bias [E]``: added for the selection only;
    ``n_group``/``topk_group``/``group_score`` ("max" | "top2"): keep the best ``topk_group`` of ``n_group`` expert
    groups, the others' experts given ``group_fill`` (``None``: -inf, never chosen; DeepSeek-V2's and Mistral 4's
    routers fill 0.0) for the selection; ``weights_from``: "scores" (the chosen experts' scores) or "choices" (the
    chosen choices as filled, DeepSeek-V2's top-k values); ``renorm``: ``y / (sum(y) + eps)`` (``eps=0``: ``y /
    sum(y)``); then ``* routed_scaling_factor``. Indices are those of ``torch.topk`` (sorted, largest first; ties as
    torch orders them on the CPU). ``out_dtype``: "float32" or ``None`` (the logits' dtype).
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"moe_gating_topk: x must be a tensor [..., E], got {getattr(x, 'shape', type(x))}")
    return torch.ops.autofuse.moe_gating_topk(x, bias, int(k), norm, bool(renorm), float(eps),
                                              float(routed_scaling_factor), int(n_group), int(topk_group),
                                              group_score, out_dtype or "", device,
                                              json.dumps(tiling) if tiling else "",
                                              None if group_fill is None else float(group_fill), weights_from)


# ------------------------------------------------------------------------------------------ init routing
@torch.library.custom_op("autofuse::moe_init_routing", mutates_args=())
def _moe_init_routing(x: torch.Tensor, expert_idx: torch.Tensor, num_experts: int, group_list_type: str = "count",
                      device: str = "ascend910", tiling: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r = run_kernel("moe_init_routing", x, expert_idx.int(), num_experts=num_experts, group_list_type=group_list_type,
                   device=device, tiling=_tiling(tiling))
    _record("moe_init_routing", r.stats)
    return (_to_torch(r.outputs[0], x.dtype), torch.from_numpy(r.outputs[1].astype("int64")),
            torch.from_numpy(r.outputs[2].astype("int64")))


@_moe_init_routing.register_fake
def _(x, expert_idx, num_experts, group_list_type="count", device="ascend910", tiling=""):
    n = expert_idx.numel()
    return (x.new_empty((n, x.shape[-1])), x.new_empty((n,), dtype=torch.int64),
            x.new_empty((num_experts,), dtype=torch.int64))


def reference_moe_init_routing(x, expert_idx, num_experts, group_list_type="count", **_):
    """Stable sort of the flattened expert ids; ``expanded_x = x[perm // k]``, the inverse permutation, and
    the tokens per expert (or their running sum)."""
    k = expert_idx.shape[-1]
    flat = expert_idx.reshape(-1).long()
    perm = torch.sort(flat, stable=True).indices
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    counts = torch.bincount(flat, minlength=num_experts)
    return x[perm // k], inv, counts.cumsum(0) if group_list_type == "cumsum" else counts


def _init_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.shape, ctx.k = inputs[0].shape, inputs[1].shape[-1]
    ctx.device = inputs[4] if len(inputs) > 4 else "ascend910"


def _init_backward(ctx, grad_x, grad_row, grad_counts):
    """The un-permute: ``dx[t] = Σ_j d_expanded[expanded_row_idx[t·k + j]]``, which is ``moe_finalize_routing``
    with unit weights (its kernel gathers each token's k rows and sums them in fp32): one launch."""
    row_idx, = ctx.saved_tensors
    T, _ = ctx.shape
    ones = torch.ones((T, ctx.k), dtype=torch.float32)
    gx = torch.ops.autofuse.moe_finalize_routing(grad_x.contiguous(), ones, row_idx, None, ctx.device, "")
    return gx, None, None, None, None, None


_moe_init_routing.register_autograd(_init_backward, setup_context=_init_setup)


def moe_init_routing(x, expert_idx, num_experts, group_list_type="count", device="ascend910", tiling=None):
    """Tokens sorted by expert (CANN MoeInitRouting, dropless): ``x [T, H]``, ``expert_idx [T, k]`` →
    ``(expanded_x [T·k, H], expanded_row_idx [T·k], group_list [E])``.

    ``expanded_x[p] = x[perm[p] // k]`` with ``perm = torch.sort(expert_idx.flatten(), stable=True).indices``;
    ``expanded_row_idx[i]`` is the row entry ``i = t·k + j`` went to; ``group_list``: tokens per expert
    (``"count"``) or their running sum (``"cumsum"``).
    """
    return torch.ops.autofuse.moe_init_routing(x, expert_idx, int(num_experts), group_list_type, device,
                                               json.dumps(tiling) if tiling else "")


# ------------------------------------------------------------------------------------------ grouped matmul
@torch.library.custom_op("autofuse::grouped_matmul", mutates_args=())
def _grouped_matmul(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor,
                    bias: Optional[torch.Tensor] = None, trans_w: bool = False, group_list_type: str = "count",
                    activation: str = "", swiglu_order: str = "gate_up", device: str = "ascend910",
                    tiling: str = "", limit: Optional[float] = None, alpha: float = 1.0) -> torch.Tensor:
    r = _launch_gmm(x, weight, group_list, bias, trans_w, group_list_type, activation, swiglu_order, device, tiling,
                    limit=limit, alpha=alpha)
    _record("grouped_matmul", r.stats)
    return _to_torch(r.outputs[0], x.dtype)


def _launch_gmm(x, weight, group_list, bias, trans_w, group_list_type, activation, swiglu_order, device, tiling,
                limit=None, alpha=1.0, **kw):
    if activation == "clamped_swiglu":
        kw.update(limit=limit, alpha=alpha)
    return run_kernel("grouped_matmul", x, weight, group_list.int(), bias, trans_w=trans_w,
                      group_list_type=group_list_type, activation=activation or None, swiglu_order=swiglu_order,
                      device=device, tiling=_tiling(tiling), **kw)


def _timing_gmm(x, weight, group_list, bias=None, trans_w=False, group_list_type="count", activation="",
                swiglu_order="gate_up", device="ascend910", tiling="", limit=None, alpha=1.0):
    return [("grouped_matmul", _launch_gmm(x, weight, group_list, bias, trans_w, group_list_type, activation,
                                           swiglu_order, device, tiling, limit, alpha, timing_only=True).stats)]


def _timing_gmm_with_product(x, weight, group_list, bias=None, trans_w=False, group_list_type="count",
                             activation="swiglu", swiglu_order="gate_up", device="ascend910", tiling="", limit=None,
                             alpha=1.0):
    return [("grouped_matmul", _launch_gmm(x, weight, group_list, bias, trans_w, group_list_type, activation,
                                           swiglu_order, device, tiling, limit, alpha, return_product=True,
                                           timing_only=True).stats)]


@_grouped_matmul.register_fake
def _(x, weight, group_list, bias=None, trans_w=False, group_list_type="count", activation="",
      swiglu_order="gate_up", device="ascend910", tiling="", limit=None, alpha=1.0):
    N = weight.shape[1] if trans_w else weight.shape[2]
    return x.new_empty((x.shape[0], N // 2 if activation in GLU else N))


_ACT = {"relu": torch.relu, "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
        "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


def _group_counts(group_list, group_list_type):
    """Rows per group from a group list of counts or of their running sum (``"cumsum"``)."""
    gl = group_list.long()
    return torch.diff(gl, prepend=gl.new_zeros(1)) if group_list_type == "cumsum" else gl


def _reference_product(x, weight, group_list, bias, trans_w, group_list_type):
    """Per group: ``x_g @ w_g`` in fp32 from the operands' values, + bias; rows past the last group are 0."""
    counts = _group_counts(group_list, group_list_type)
    N = weight.shape[1] if trans_w else weight.shape[2]
    parts, start = [], 0
    for g, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        w = weight[g].float()
        y = x[start:start + c].float() @ (w.t() if trans_w else w)
        parts.append(y + bias[g].float() if bias is not None else y)
        start += c
    parts.append(x.new_zeros((x.shape[0] - start, N), dtype=torch.float32))
    return torch.cat(parts, 0)


def _gate_up(p, swiglu_order):
    if swiglu_order == "interleaved":
        return p[..., 0::2], p[..., 1::2]
    a, u = p.chunk(2, -1)
    return (a, u) if swiglu_order == "gate_up" else (u, a)


def _reference_epilogue(p, activation, swiglu_order, limit=None, alpha=1.0):
    """The epilogue in fp32 on the product (SwiGLU maps a zero row to a zero row; the clamped one, GPT-OSS's
    ``(clamp(up) + 1) · g·sigmoid(alpha·g)``, to zeros as well: g = 0)."""
    if activation in GLU:
        g, u = _gate_up(p, swiglu_order)
        if activation == "swiglu":
            return torch.nn.functional.silu(g) * u
        g = g.clamp(max=limit)
        return (u.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))
    return _ACT[activation](p) if activation else p


def reference_grouped_matmul(x, weight, group_list, bias=None, trans_w=False, group_list_type="count",
                             activation="", swiglu_order="gate_up", upcast=False, limit=None, alpha=1.0, **_):
    """Per group: ``x_g @ w_g`` in fp32 from the operands' values, + bias, the epilogue in fp32, one cast to
    x's dtype; rows past the last group are 0."""
    out = _reference_epilogue(_reference_product(x, weight, group_list, bias, trans_w, group_list_type),
                              activation, swiglu_order, limit, alpha)
    return out if upcast else out.to(x.dtype)


def reference_grouped_matmul_with_product(x, weight, group_list, bias=None, trans_w=False, group_list_type="count",
                                          activation="swiglu", swiglu_order="gate_up", upcast=False, limit=None,
                                          alpha=1.0, **_):
    """``reference_grouped_matmul``'s output and the product it applied the epilogue to, each cast once (the
    defaults are the op's: a traced call leaves out arguments equal to them)."""
    p = _reference_product(x, weight, group_list, bias, trans_w, group_list_type)
    out = _reference_epilogue(p, activation, swiglu_order, limit, alpha)
    return (out, p) if upcast else (out.to(x.dtype), p.to(x.dtype))


def _gmm_setup(ctx, inputs, output):
    """Saves x, w, the group list, the bias and (``grouped_matmul_with_product``) the stored product."""
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2], inputs[3], *output[1:2] if isinstance(output, tuple) else ())
    ctx.set_materialize_grads(False)          # an unused product's gradient stays None (no zeros to add)
    ctx.params = dict(zip(("trans_w", "group_list_type", "activation", "swiglu_order"), inputs[4:8]))
    ctx.device = inputs[8] if len(inputs) > 8 else "ascend910"
    ctx.params["limit"], ctx.params["alpha"] = (inputs[10], inputs[11]) if len(inputs) > 11 else (None, 1.0)


def _searched(kernel, specs, device, **params) -> str:
    """The tiling the cost model's search picks for a backward launch (group sizes unknown: spread evenly),
    as JSON for the op (``""``: the kernel's own)."""
    e = cost_model.estimate(kernel, specs, device=device, **params)
    return json.dumps(e.tiling, sort_keys=True) if e.tiling else ""


def _spec(t):
    return tuple(t.shape), str(t.dtype).replace("torch.", "")


def _epilogue_program(activation, order, M, N, dtype, limit=None, alpha=1.0) -> str:
    """The grouped GEMM's epilogue as a Vector program over its product ``[M, N]`` (SwiGLU: ``silu(gate)·up``
    on the halves, in ``order``, or on the interleaved pairs; the clamped SwiGLU of GPT-OSS), the output in
    ``dtype``: the program whose derived backward gives the product's gradient."""
    b = Builder((M,))
    p = b.input(dtype, (M, N))
    if activation in GLU:
        F = N // 2
        if order == "interleaved":
            gate, up = b.slice(p, start=0, stop=N, step=2), b.slice(p, start=1, stop=N, step=2)
        else:
            first, second = b.slice(p, start=0, stop=F), b.slice(p, start=F, stop=N)
            gate, up = (first, second) if order == "gate_up" else (second, first)
        if activation == "swiglu":
            b.output(b.mul(b.silu(gate), up), dtype)
        else:
            g = b.minimum(gate, float(limit))
            u = b.add(b.minimum(b.maximum(up, -float(limit)), float(limit)), 1.0)
            b.output(b.mul(u, b.mul(g, b.sigmoid(b.mul(g, float(alpha))))), dtype)
    else:
        b.output(getattr(b, activation)(p), dtype)
    return b.build().to_json()


def _gmm_backward(ctx, grad, grad_product=None):
    """The grouped GEMM's gradients as grouped launches (CANN GroupedMatmul as training runs it):

    1. with an epilogue, the product ``P = x·w[g] (+ bias)``: the one ``grouped_matmul_with_product`` stored,
       else recomputed by one ``grouped_matmul`` launch (``grouped_matmul`` returns only the activation; the
       same fp32 accumulation and rounding, so the same values), and ``dP = act'(P) ∘ dy``
       (SwiGLU: ``dgate = dy·up·silu'(gate)``, ``dup = dy·silu(gate)``) is the epilogue's derived backward,
       one ``vector_program`` launch; without one ``dP = dy``;
    2. ``dx = grouped_matmul(dP, w)`` with the weight read transposed (``trans_w`` flipped);
    3. ``dw[g] = x_gᵀ·dP_g`` (``[E, K, N]``; ``dP_gᵀ·x_g`` for ``w`` stored ``[E, N, K]``), one
       ``grouped_matmul_weight_grad`` launch, zero blocks for empty experts;
    4. ``dbias[g]`` = the column sums of ``dP_g``: the same kernel with a column of ones as its lhs.

    ``dP`` is rounded to x's dtype, as eager's activation backward writes it; the GEMMs accumulate in fp32. A
    gradient reaching the stored product itself (``grad_product``, when a graph uses it) adds to ``dP``."""
    x, w, gl, bias, *stored = ctx.saved_tensors
    need = ctx.needs_input_grad
    gx, gw, gb = _gmm_grads(x, w, gl, bias, stored, ctx.params, ctx.device, grad, grad_product,
                            need[0], need[1], bias is not None and need[3])
    return gx, gw, None, gb, None, None, None, None, None, None, None, None


def _gmm_grads(x, w, gl, bias, stored, p, dev, grad, grad_product, need_x, need_w, need_bias):
    """:func:`_gmm_backward`'s gradients (dx, dw, dbias; None where not needed) for the weight ``w [E, ., .]``."""
    trans_w, glt, act = p["trans_w"], p["group_list_type"], p["activation"]
    dt = str(x.dtype).replace("torch.", "")
    N = w.shape[1] if trans_w else w.shape[2]
    if grad is None:                           # only the product was used
        d = torch.zeros((x.shape[0], N), dtype=x.dtype)
    elif act:
        if stored:
            product, = stored
        else:
            tl = _searched("grouped_matmul", [_spec(x), _spec(w), _spec(gl)], dev, trans_w=trans_w,
                           bias=None if bias is None else _spec(bias))
            product = torch.ops.autofuse.grouped_matmul(x, w, gl, bias, trans_w, glt, "", "gate_up", dev, tl)
        prog = _epilogue_program(act, p["swiglu_order"], x.shape[0], product.shape[1], dt, p["limit"], p["alpha"])
        launch = _grad_launch(prog, (0,), (0,), dev)
        if launch is None:
            raise NotImplementedError(f"grouped_matmul backward: the {act} epilogue has no Vector backward")
        d, = run_grad_program(*launch, [product], [grad.contiguous()], dev)
        d = d.to(x.dtype)
    else:
        d = grad.contiguous()
    if grad_product is not None:
        d = (d.float() + grad_product.float()).to(x.dtype)
    gx = gw = gb = None
    E = w.shape[0]
    if need_x:
        tl = _searched("grouped_matmul", [_spec(d), _spec(w), _spec(gl)], dev, trans_w=not trans_w)
        gx = torch.ops.autofuse.grouped_matmul(d, w, gl, None, not trans_w, glt, "", "gate_up", dev, tl)
    if need_w:
        lhs, rhs = (d, x) if trans_w else (x, d)
        gw = grouped_matmul_weight_grad(lhs, rhs, gl, glt, device=dev)
    if need_bias:
        ones = torch.ones((x.shape[0], 1), dtype=x.dtype)
        gb = grouped_matmul_weight_grad(ones, d, gl, glt, out_dtype=bias.dtype, device=dev).reshape(E, -1)
    return gx, gw, gb


_grouped_matmul.register_autograd(_gmm_backward, setup_context=_gmm_setup)


@torch.library.custom_op("autofuse::grouped_matmul_with_product", mutates_args=())
def _grouped_matmul_with_product(x: torch.Tensor, weight: torch.Tensor, group_list: torch.Tensor,
                                 bias: Optional[torch.Tensor] = None, trans_w: bool = False,
                                 group_list_type: str = "count", activation: str = "swiglu",
                                 swiglu_order: str = "gate_up", device: str = "ascend910",
                                 tiling: str = "", limit: Optional[float] = None,
                                 alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    if not activation:
        raise ValueError("grouped_matmul_with_product: needs an activation (without one the output is the product); "
                         "call grouped_matmul")
    r = _launch_gmm(x, weight, group_list, bias, trans_w, group_list_type, activation, swiglu_order, device, tiling,
                    limit, alpha, return_product=True)
    _record("grouped_matmul", r.stats)
    return _to_torch(r.outputs[0], x.dtype), _to_torch(r.outputs[1], x.dtype)


@_grouped_matmul_with_product.register_fake
def _(x, weight, group_list, bias=None, trans_w=False, group_list_type="count", activation="swiglu",
      swiglu_order="gate_up", device="ascend910", tiling="", limit=None, alpha=1.0):
    N = weight.shape[1] if trans_w else weight.shape[2]
    return x.new_empty((x.shape[0], N // 2 if activation in GLU else N)), x.new_empty((x.shape[0], N))


_grouped_matmul_with_product.register_autograd(_gmm_backward, setup_context=_gmm_setup)


def _stacked(parts, parts_up, dim):
    """One ``[E, ...]`` operand from a list of per-group ones (weights, or biases) and, for a SwiGLU whose gate and up
    projections are held apart, the list of up ones, joined after the gate's along ``dim`` (N); None for none."""
    if not parts:
        return None
    w = torch.stack(list(parts))
    return torch.cat([w, torch.stack(list(parts_up))], dim) if parts_up else w


def _operands(weight, weight_up, bias, bias_up, trans_w):
    """The stacked weight and bias of a weight-list call."""
    if not weight or any(len(x) not in (0, len(weight)) for x in (weight_up, bias, bias_up)) or \
            bool(bias_up) and not (weight_up and bias):
        raise ValueError(f"grouped_matmul_list: one weight per group, and as many up projections and biases when "
                         f"given (an up bias with an up projection and a bias); got {len(weight)} weights, "
                         f"{len(weight_up)} up projections, {len(bias)} biases, {len(bias_up)} up biases")
    return _stacked(weight, weight_up, 1 if trans_w else 2), _stacked(bias, bias_up, 1)


@torch.library.custom_op("autofuse::grouped_matmul_list", mutates_args=())
def _grouped_matmul_list(x: torch.Tensor, weight: list[torch.Tensor], group_list: torch.Tensor,
                         weight_up: list[torch.Tensor], bias: list[torch.Tensor], bias_up: list[torch.Tensor],
                         trans_w: bool = False, group_list_type: str = "count", activation: str = "",
                         swiglu_order: str = "gate_up", device: str = "ascend910", tiling: str = "") -> torch.Tensor:
    w, b = _operands(weight, weight_up, bias, bias_up, trans_w)
    r = _launch_gmm(x, w, group_list, b, trans_w, group_list_type, activation, swiglu_order, device, tiling)
    _record("grouped_matmul", r.stats)
    return _to_torch(r.outputs[0], x.dtype)


@_grouped_matmul_list.register_fake
def _(x, weight, group_list, weight_up, bias, bias_up, trans_w=False, group_list_type="count", activation="",
      swiglu_order="gate_up", device="ascend910", tiling=""):
    N = weight[0].shape[0 if trans_w else 1] * (2 if weight_up else 1)
    return x.new_empty((x.shape[0], N // 2 if activation in GLU else N))


def _timing_gmm_list(x, weight, group_list, weight_up, bias, bias_up, trans_w=False, group_list_type="count",
                     activation="", swiglu_order="gate_up", device="ascend910", tiling=""):
    w, b = _operands(weight, weight_up, bias, bias_up, trans_w)
    return _timing_gmm(x, w, group_list, b, trans_w, group_list_type, activation, swiglu_order, device, tiling)


def reference_grouped_matmul_list(x, weight, group_list, weight_up=(), bias=(), bias_up=(), trans_w=False,
                                  group_list_type="count", activation="", swiglu_order="gate_up", upcast=False, **_):
    """:func:`reference_grouped_matmul` on the stacked operands."""
    w, b = _operands(weight, weight_up, bias, bias_up, trans_w)
    return reference_grouped_matmul(x, w, group_list, b, trans_w, group_list_type, activation, swiglu_order, upcast)


@torch.library.custom_op("autofuse::grouped_matmul_list_with_product", mutates_args=())
def _grouped_matmul_list_with_product(x: torch.Tensor, weight: list[torch.Tensor], group_list: torch.Tensor,
                                      weight_up: list[torch.Tensor], bias: list[torch.Tensor],
                                      bias_up: list[torch.Tensor], trans_w: bool = False,
                                      group_list_type: str = "count", activation: str = "swiglu",
                                      swiglu_order: str = "gate_up", device: str = "ascend910",
                                      tiling: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    if not activation:
        raise ValueError("grouped_matmul_list_with_product: needs an activation (without one the output is the "
                         "product); call grouped_matmul_list")
    w, b = _operands(weight, weight_up, bias, bias_up, trans_w)
    r = _launch_gmm(x, w, group_list, b, trans_w, group_list_type, activation, swiglu_order, device, tiling,
                    return_product=True)
    _record("grouped_matmul", r.stats)
    return _to_torch(r.outputs[0], x.dtype), _to_torch(r.outputs[1], x.dtype)


@_grouped_matmul_list_with_product.register_fake
def _(x, weight, group_list, weight_up, bias, bias_up, trans_w=False, group_list_type="count", activation="swiglu",
      swiglu_order="gate_up", device="ascend910", tiling=""):
    N = weight[0].shape[0 if trans_w else 1] * (2 if weight_up else 1)
    return x.new_empty((x.shape[0], N // 2 if activation in GLU else N)), x.new_empty((x.shape[0], N))


def _timing_gmm_list_with_product(x, weight, group_list, weight_up, bias, bias_up, trans_w=False,
                                  group_list_type="count", activation="swiglu", swiglu_order="gate_up",
                                  device="ascend910", tiling=""):
    w, b = _operands(weight, weight_up, bias, bias_up, trans_w)
    return _timing_gmm_with_product(x, w, group_list, b, trans_w, group_list_type, activation, swiglu_order, device,
                                    tiling)


def reference_grouped_matmul_list_with_product(x, weight, group_list, weight_up=(), bias=(), bias_up=(),
                                               trans_w=False, group_list_type="count", activation="swiglu",
                                               swiglu_order="gate_up", upcast=False, **_):
    """:func:`reference_grouped_matmul_with_product` on the stacked operands."""
    w, b = _operands(weight, weight_up, bias, bias_up, trans_w)
    return reference_grouped_matmul_with_product(x, w, group_list, b, trans_w, group_list_type, activation,
                                                 swiglu_order, upcast)


def _gmm_list_setup(ctx, inputs, output):
    """Saves x, the group list, the lists and (``grouped_matmul_list_with_product``) the stored product."""
    x, weight, gl, weight_up, bias, bias_up = inputs[:6]
    ctx.save_for_backward(x, gl, *weight, *weight_up, *bias, *bias_up,
                          *output[1:2] if isinstance(output, tuple) else ())
    ctx.set_materialize_grads(False)
    ctx.counts = tuple(len(v) for v in (weight, weight_up, bias, bias_up))
    ctx.params = dict(zip(("trans_w", "group_list_type", "activation", "swiglu_order"), inputs[6:10]),
                      limit=None, alpha=1.0)
    ctx.device = inputs[10] if len(inputs) > 10 else "ascend910"


def _gmm_list_backward(ctx, grad, grad_product=None):
    """:func:`_gmm_backward`'s launches on the stacked operands (reading the stored product, when the forward kept
    it); each group's weight and bias gradients are its blocks of the stacked gradients (split into the gate's and
    the up projection's when those are held apart)."""
    x, gl, *rest = ctx.saved_tensors
    lists, at = [], 0
    for n in ctx.counts:
        lists.append(rest[at:at + n])
        at += n
    weight, weight_up, bias, bias_up = lists
    stored = tuple(rest[at:])
    trans_w = ctx.params["trans_w"]
    need = ctx.needs_input_grad
    need_w, need_b = any(need[1]) or any(need[3]), bool(bias) and (any(need[4]) or any(need[5]))
    w, b = _operands(weight, weight_up, bias, bias_up, trans_w)
    gx, gw, gb = _gmm_grads(x, w, gl, b, stored, ctx.params, ctx.device, grad, grad_product, need[0], need_w,
                            need_b)

    def blocks(g, n_up, dim):               # a stacked gradient as its per-group blocks: (gate's, up's)
        if g is None:
            return None, None
        if n_up:
            g, g_up = g.chunk(2, dim)
            return list(g.unbind(0)), list(g_up.unbind(0))
        return list(g.unbind(0)), []
    g_w, g_wu = blocks(gw, len(weight_up), 1 if trans_w else 2)
    g_b, g_bu = blocks(gb, len(bias_up), 1)
    got = [g if g is not None else [None] * len(v) for g, v in zip((g_w, g_wu, g_b, g_bu), lists)]
    # the structure of the call's arguments: a list per list
    return (gx, got[0], None, got[1], got[2], got[3]) + (None,) * (len(need) - 6)


_grouped_matmul_list.register_autograd(_gmm_list_backward, setup_context=_gmm_list_setup)
_grouped_matmul_list_with_product.register_autograd(_gmm_list_backward, setup_context=_gmm_list_setup)


def grouped_matmul_list(x, weight, group_list, weight_up=None, bias=None, bias_up=None, trans_w=False,
                        group_list_type="count", activation=None, swiglu_order="gate_up", device="ascend910",
                        tiling=None):
    """:func:`grouped_matmul` with the weights given as a list, one per group (CANN GroupedMatmul's weight
    TensorList: a hand-written MoE layer's experts, each its own ``nn.Linear``), and, for a SwiGLU whose gate and
    up projections are separate layers, the list of up projections (``weight_up``; the gate is ``weight``); a bias
    per group likewise (``bias``, and ``bias_up`` for the up projections). The kernel reads each group's tiles from
    that group's weight, the bytes the stacked form reads; the simulator holds the lists stacked in one buffer
    (bookkeeping, no launch: a device kernel reads the lists in place)."""
    return torch.ops.autofuse.grouped_matmul_list(x, list(weight), group_list, list(weight_up or ()), list(bias or ()),
                                                  list(bias_up or ()), bool(trans_w), group_list_type,
                                                  activation or "", swiglu_order, device,
                                                  json.dumps(tiling) if tiling else "")


def grouped_matmul_list_with_product(x, weight, group_list, weight_up=None, bias=None, bias_up=None, trans_w=False,
                                     group_list_type="count", activation="swiglu", swiglu_order="gate_up",
                                     device="ascend910", tiling=None):
    """:func:`grouped_matmul_list` with an epilogue, also returning the product it applied the epilogue to:
    ``(y, product)``, one launch (a training forward's, as :func:`grouped_matmul_with_product`)."""
    return torch.ops.autofuse.grouped_matmul_list_with_product(
        x, list(weight), group_list, list(weight_up or ()), list(bias or ()), list(bias_up or ()), bool(trans_w),
        group_list_type, activation or "", swiglu_order, device, json.dumps(tiling) if tiling else "")


@torch.library.custom_op("autofuse::grouped_matmul_weight_grad", mutates_args=())
def _grouped_matmul_weight_grad(lhs: torch.Tensor, rhs: torch.Tensor, group_list: torch.Tensor,
                                group_list_type: str = "count", out_dtype: str = "", device: str = "ascend910",
                                tiling: str = "") -> torch.Tensor:
    r = _launch_gmm_weight_grad(lhs, rhs, group_list, group_list_type, out_dtype, device, tiling)
    _record("grouped_matmul_weight_grad", r.stats)
    return _to_torch(r.outputs[0], _DT[out_dtype] if out_dtype else lhs.dtype)


def _launch_gmm_weight_grad(lhs, rhs, group_list, group_list_type, out_dtype, device, tiling, **kw):
    return run_kernel("grouped_matmul_weight_grad", lhs, rhs, group_list.int(), group_list_type=group_list_type,
                      out_dtype=out_dtype or None, device=device, tiling=_tiling(tiling), **kw)


def _timing_gmm_weight_grad(lhs, rhs, group_list, group_list_type="count", out_dtype="", device="ascend910",
                            tiling=""):
    return [("grouped_matmul_weight_grad", _launch_gmm_weight_grad(lhs, rhs, group_list, group_list_type, out_dtype,
                                                                   device, tiling, timing_only=True).stats)]


@_grouped_matmul_weight_grad.register_fake
def _(lhs, rhs, group_list, group_list_type="count", out_dtype="", device="ascend910", tiling=""):
    return lhs.new_empty((group_list.shape[0], lhs.shape[1], rhs.shape[1]),
                         dtype=_DT[out_dtype] if out_dtype else lhs.dtype)


def reference_grouped_matmul_weight_grad(lhs, rhs, group_list, group_list_type="count", out_dtype="", **_):
    """Per group: ``lhs_gᵀ @ rhs_g`` in fp32 from the operands' values, one cast (to ``out_dtype``, else lhs's
    dtype); a group with no rows gives a zero block."""
    counts = _group_counts(group_list, group_list_type)
    out = torch.zeros((counts.numel(), lhs.shape[1], rhs.shape[1]), dtype=torch.float32)
    start = 0
    for g, c in enumerate(counts.tolist()):
        out[g] = lhs[start:start + c].float().t() @ rhs[start:start + c].float()
        start += c
    return out.to(_DT[out_dtype] if out_dtype else lhs.dtype)


def grouped_matmul_weight_grad(lhs, rhs, group_list, group_list_type="count", out_dtype=None, device="ascend910",
                               tiling=None):
    """``out[g] = lhs[rows_g]ᵀ @ rhs[rows_g]`` for every group (``[E, P, Q]``): a grouped GEMM's weight
    gradient, one launch (``lhs = x, rhs = dy`` for ``w [E, K, N]``; ``lhs = dy, rhs = x`` for ``[E, N, K]``).
    Without ``tiling``, the one the cost model's search picks (group sizes spread evenly)."""
    od = "" if out_dtype is None else str(out_dtype).replace("torch.", "")
    if tiling is None:
        tl = _searched("grouped_matmul_weight_grad", [_spec(lhs), _spec(rhs), _spec(group_list)], device,
                       out_dtype=od or None)
    else:
        tl = json.dumps(tiling) if tiling else ""
    return torch.ops.autofuse.grouped_matmul_weight_grad(lhs, rhs, group_list, group_list_type, od, device, tl)


def grouped_matmul(x, weight, group_list, bias=None, trans_w=False, group_list_type="count", activation=None,
                   swiglu_order="gate_up", device="ascend910", tiling=None, limit=None, alpha=1.0):
    """Grouped GEMM (CANN GroupedMatmul): rows of ``x [M, K]`` in groups (``group_list``: counts, or
    ``"cumsum"`` offsets as transformers' ``offs``) times ``weight [E, K, N]`` (``[E, N, K]`` with
    ``trans_w``, transformers' storage), ``+ bias [E, N]``, then ``activation``: None, "relu", "gelu",
    "gelu_tanh", "silu", "swiglu" (``silu(gate) · up`` on the halves of N; ``swiglu_order`` "gate_up" is
    transformers' ``chunk(2)`` order, "up_gate" the other, "interleaved" gate and up alternating, gate first)
    or "clamped_swiglu" (GPT-OSS's experts: ``g = min(gate, limit)``, ``(clamp(up, -limit, limit) + 1) ·
    g · sigmoid(alpha · g)``). One launch for all groups."""
    return torch.ops.autofuse.grouped_matmul(x, weight, group_list, bias, bool(trans_w), group_list_type,
                                             activation or "", swiglu_order, device,
                                             json.dumps(tiling) if tiling else "", limit, float(alpha))


def grouped_matmul_with_product(x, weight, group_list, bias=None, trans_w=False, group_list_type="count",
                                activation="swiglu", swiglu_order="gate_up", device="ascend910", tiling=None,
                                limit=None, alpha=1.0):
    """:func:`grouped_matmul` with an epilogue, also returning the product it applied the epilogue to
    (``[M, N]`` in x's dtype, the weight's column order): ``(y, product)``, one launch. Its backward reads the
    product instead of recomputing it (a training forward's choice: one more write here, one GEMM less there)."""
    return torch.ops.autofuse.grouped_matmul_with_product(x, weight, group_list, bias, bool(trans_w), group_list_type,
                                                          activation or "", swiglu_order, device,
                                                          json.dumps(tiling) if tiling else "", limit, float(alpha))


# ------------------------------------------------------------------------------------------ finalize
@torch.library.custom_op("autofuse::moe_finalize_routing", mutates_args=())
def _moe_finalize_routing(expanded: torch.Tensor, scales: torch.Tensor, expanded_row_idx: torch.Tensor,
                          skip: Optional[torch.Tensor] = None, device: str = "ascend910",
                          tiling: str = "") -> torch.Tensor:
    r = _launch_finalize(expanded, scales, expanded_row_idx, skip, device, tiling)
    _record("moe_finalize_routing", r.stats)
    return _to_torch(r.outputs[0], expanded.dtype)


def _launch_finalize(expanded, scales, expanded_row_idx, skip, device, tiling, **kw):
    return run_kernel("moe_finalize_routing", expanded, scales, expanded_row_idx.int(), skip, device=device,
                      tiling=_tiling(tiling), **kw)


def _timing_finalize(expanded, scales, expanded_row_idx, skip=None, device="ascend910", tiling=""):
    return [("moe_finalize_routing", _launch_finalize(expanded, scales, expanded_row_idx, skip, device, tiling,
                                                      timing_only=True).stats)]


@_moe_finalize_routing.register_fake
def _(expanded, scales, expanded_row_idx, skip=None, device="ascend910", tiling=""):
    return expanded.new_empty((scales.shape[0], expanded.shape[-1]))


def reference_moe_finalize_routing(expanded, scales, expanded_row_idx, skip=None, upcast=False, **_):
    """``skip + Σ_j scales[:, j] · expanded[expanded_row_idx[t·k + j]]`` accumulated in fp32 in the kernel's
    order (skip first, then j = 0..k-1), one cast to expanded's dtype."""
    T, k = scales.shape
    rows = expanded.float()[expanded_row_idx.long()].reshape(T, k, -1)
    acc = skip.float() if skip is not None else None
    for j in range(k):
        term = rows[:, j] * scales[:, j:j + 1].float()
        acc = term if acc is None else acc + term
    return acc if upcast else acc.to(expanded.dtype)


def _fin_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2])
    ctx.skip_dtype = inputs[3].dtype if len(inputs) > 3 and inputs[3] is not None else None
    ctx.device = inputs[4] if len(inputs) > 4 else "ascend910"


def _fin_backward(ctx, g):
    """``d_expanded`` and ``d_scales`` by one ``moe_finalize_routing_grad`` launch; ``d_skip = g``."""
    expanded, scales, row_idx = ctx.saved_tensors
    need = ctx.needs_input_grad
    de = ds = None
    if need[0] or need[1]:
        de, ds = torch.ops.autofuse.moe_finalize_routing_grad(g.contiguous(), expanded, scales, row_idx, ctx.device,
                                                              "")
    gskip = g.to(ctx.skip_dtype) if ctx.skip_dtype is not None and need[3] else None
    return de if need[0] else None, ds if need[1] else None, None, gskip, None, None


_moe_finalize_routing.register_autograd(_fin_backward, setup_context=_fin_setup)


def _distinct_rows(row_idx, rows) -> bool:
    """Whether the row indices name every one of ``rows`` rows exactly once (what moe_init_routing gives)."""
    flat = row_idx.reshape(-1).long()
    return flat.numel() == rows and bool((torch.bincount(flat, minlength=rows) == 1).all())


@torch.library.custom_op("autofuse::moe_finalize_routing_grad", mutates_args=())
def _moe_finalize_routing_grad(grad: torch.Tensor, expanded: torch.Tensor, scales: torch.Tensor,
                               expanded_row_idx: torch.Tensor, device: str = "ascend910",
                               tiling: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    r = _launch_finalize_grad(grad, expanded, scales, expanded_row_idx, device, tiling)
    _record("moe_finalize_routing_grad", r.stats)
    return _to_torch(r.outputs[0], expanded.dtype), _to_torch(r.outputs[1], scales.dtype)


def _launch_finalize_grad(grad, expanded, scales, expanded_row_idx, device, tiling, **kw):
    # rows named twice or never (not moe_init_routing's permutation): the kernel zeroes them, then adds
    acc = not _distinct_rows(expanded_row_idx, expanded.shape[0])
    return run_kernel("moe_finalize_routing_grad", grad.to(expanded.dtype), expanded, scales,
                      expanded_row_idx.reshape(-1).int(), accumulate=acc, device=device, tiling=_tiling(tiling), **kw)


def _timing_finalize_grad(grad, expanded, scales, expanded_row_idx, device="ascend910", tiling=""):
    return [("moe_finalize_routing_grad", _launch_finalize_grad(grad, expanded, scales, expanded_row_idx, device,
                                                                tiling, timing_only=True).stats)]


@_moe_finalize_routing_grad.register_fake
def _(grad, expanded, scales, expanded_row_idx, device="ascend910", tiling=""):
    return torch.empty_like(expanded), torch.empty_like(scales)


def reference_moe_finalize_routing_grad(grad, expanded, scales, expanded_row_idx, **_):
    """``d_expanded[r] = scales[t, j]·grad[t]`` (fp32, one cast; rows named twice summed in expanded's dtype, rows
    never named 0) and ``d_scales[t, j] = Σ grad[t]·expanded[r]`` (fp32), ``r = expanded_row_idx[t·k + j]``."""
    T, k = scales.shape
    flat = expanded_row_idx.reshape(-1).long()
    g = grad.float()
    rows = (g[:, None, :] * scales.float()[:, :, None]).reshape(T * k, -1).to(expanded.dtype)
    d_exp = torch.zeros_like(expanded)
    if _distinct_rows(flat, expanded.shape[0]):
        d_exp[flat] = rows
    else:
        d_exp.index_put_((flat,), rows, accumulate=True)
    d_sc = (g[:, None, :] * expanded.float()[flat].reshape(T, k, -1)).sum(-1)
    return d_exp, d_sc.to(scales.dtype)


def moe_finalize_routing_grad(grad, expanded, scales, expanded_row_idx, device="ascend910", tiling=None):
    """``(d_expanded, d_scales)`` of :func:`moe_finalize_routing` for its output gradient ``grad [T, H]``: one
    launch (``d_skip`` is ``grad`` itself)."""
    return torch.ops.autofuse.moe_finalize_routing_grad(grad, expanded, scales, expanded_row_idx, device,
                                                        json.dumps(tiling) if tiling else "")


def moe_finalize_routing(expanded, scales, expanded_row_idx, skip=None, device="ascend910", tiling=None):
    """Combine the expert outputs (CANN MoeFinalizeRouting): ``out [T, H] = skip + Σ_j scales[:, j] ·
    expanded[expanded_row_idx[t·k + j]]`` with fp32 accumulation; ``skip`` (a shared expert's output or a
    residual) is optional."""
    return torch.ops.autofuse.moe_finalize_routing(expanded, scales, expanded_row_idx, skip, device,
                                                   json.dumps(tiling) if tiling else "")


__all__ = ["moe_gating_topk", "moe_init_routing", "grouped_matmul", "grouped_matmul_list",
           "grouped_matmul_list_with_product", "grouped_matmul_with_product", "grouped_matmul_weight_grad",
           "moe_finalize_routing", "moe_finalize_routing_grad", "moe_gating_topk_grad",
           "reference_grouped_matmul_with_product", "reference_grouped_matmul_list",
           "reference_grouped_matmul_list_with_product", "reference_moe_finalize_routing_grad",
           "reference_moe_gating_topk_grad", "reference_moe_gating_topk", "reference_moe_init_routing",
           "reference_grouped_matmul", "reference_moe_finalize_routing", "reference_grouped_matmul_weight_grad"]

REFERENCES.update(moe_gating_topk=reference_moe_gating_topk, moe_init_routing=reference_moe_init_routing,
                  grouped_matmul=reference_grouped_matmul, moe_finalize_routing=reference_moe_finalize_routing,
                  grouped_matmul_weight_grad=reference_grouped_matmul_weight_grad,
                  grouped_matmul_with_product=reference_grouped_matmul_with_product,
                  grouped_matmul_list=reference_grouped_matmul_list,
                  grouped_matmul_list_with_product=reference_grouped_matmul_list_with_product,
                  moe_finalize_routing_grad=reference_moe_finalize_routing_grad,
                  moe_gating_topk_grad=reference_moe_gating_topk_grad)
# a simulation without values times these on shapes plus their steering values (the group list, the row
# indices); the router and the token sort need their values computed (their outputs steer what follows)
TIMING.update(grouped_matmul=_timing_gmm, grouped_matmul_list=_timing_gmm_list,
              grouped_matmul_list_with_product=_timing_gmm_list_with_product,
              grouped_matmul_with_product=_timing_gmm_with_product,
              grouped_matmul_weight_grad=_timing_gmm_weight_grad, moe_finalize_routing=_timing_finalize,
              moe_finalize_routing_grad=_timing_finalize_grad, moe_gating_topk_grad=_timing_gating_grad)
STEERED.update(moe_gating_topk="moe_gating_topk", moe_init_routing="moe_init_routing", grouped_matmul="grouped_matmul",
               grouped_matmul_with_product="grouped_matmul", grouped_matmul_list="grouped_matmul",
               grouped_matmul_list_with_product="grouped_matmul",
               grouped_matmul_weight_grad="grouped_matmul_weight_grad",
               moe_finalize_routing="moe_finalize_routing", moe_finalize_routing_grad="moe_finalize_routing_grad")


no_double_backward(_moe_gating_topk_grad, "a fused MoE router", "moe_gating")
no_double_backward(_grouped_matmul_weight_grad, "a fused MoE experts block", "moe_experts")
no_double_backward(_moe_finalize_routing_grad, "a fused MoE experts block", "moe_experts")
