"""The fused attention's backward as a fused op: ``torch.ops.autofuse.flash_attention_grad`` (CANN's
FlashAttentionScoreGrad).

    dq, dk, dv = torch.ops.autofuse.flash_attention_grad(q, k, v, out, dout, mask, drop_mask, softmax_max=None,
                                                         softmax_sum=None,
                                                         scale=None, causal=False, dropout_p=0.0, fill=None,
                                                         empty_rows="zero", scale_tensor=None,
                                                         device="ascend910", tiling="")

takes the forward's inputs (BNSD, GQA), its output ``out`` and the output's gradient ``dout`` and returns the
gradients of q, k and v, computed by the simulator's ``flash_attention_grad`` kernel
(``autofuse/npu/kernels/flash_attention_grad.py``), whose launch is recorded for whole-graph simulation.
``softmax_max``, ``softmax_sum`` (optional, ``[B, N, Sq]`` fp32): each row's max of its scaled, masked scores and
its sum of ``exp(score - max)``, as the forward op hands them over with ``return_stats`` (CANN's names); without
them the kernel recomputes them. ``scale_tensor`` (a 0-d tensor multiplying ``scale``) is read when the op runs.
``softcap``: the forward's logit soft-capping (Gemma 2), its derivative applied to dS. ``window`` (with ``causal``):
the forward's sliding window; the kernel walks only the band's blocks. ``mask_add_dtype``: the forward's (an
additive 16-bit mask added in its dtype, as eager adds it). ``fill_in_mask``: the additive mask's entries equal to
``fill`` are scores a bool mask filled (a bool and an additive mask combined), constants: their dS is 0. The op has
a fake implementation (traceable by ``make_fx``), a torch twin with the kernel's numerics
(:func:`reference_flash_attention_grad`, in ``autofuse.ops.REFERENCES``) and a shapes-only timing function
(``autofuse.ops.TIMING``). ``autofuse.ops.flash_attention``'s backward calls it.
"""
from __future__ import annotations

import json
from typing import Optional

import torch

from autofuse import ops as _ops
from autofuse.grad_ops import no_double_backward
from autofuse.ops import REFERENCES, TIMING, _effective_scale, _fill, _record, _to_torch, dtype_name, unpack_keep


def _kernel_args(q, k, v, out, dout, mask, drop_mask, softmax_max, softmax_sum, scale, causal, dropout_p, fill, empty_rows,
                 scale_tensor, device, tiling, softcap=None, window=0, mask_add_dtype=None, fill_in_mask=False):
    kw = dict(mask=mask, softmax_max=softmax_max, softmax_sum=softmax_sum, scale=_effective_scale(q, scale, scale_tensor), causal=causal, fill=_fill(fill),
              empty_rows=empty_rows, device=device, tiling=json.loads(tiling) if tiling else None)
    if softcap is not None:
        kw["softcap"] = float(softcap)
    if window:
        kw["window"] = int(window)
    if mask_add_dtype is not None:
        kw["mask_add_dtype"] = dtype_name(mask_add_dtype)
    if fill_in_mask and mask is not None and mask.dtype != torch.bool:
        kw["fill_in_mask"] = True
    if drop_mask is not None:
        kw.update(drop_mask=drop_mask, keep_prob=1.0 - dropout_p)
    return (q, k, v, out, dout), kw


@torch.library.custom_op("autofuse::flash_attention_grad", mutates_args=())
def _flash_attention_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                          mask: Optional[torch.Tensor] = None, drop_mask: Optional[torch.Tensor] = None,
                          softmax_max: Optional[torch.Tensor] = None,
                          softmax_sum: Optional[torch.Tensor] = None, scale: Optional[float] = None, causal: bool = False,
                          dropout_p: float = 0.0, fill: Optional[float] = None, empty_rows: str = "zero",
                          scale_tensor: Optional[torch.Tensor] = None, device: str = "ascend910",
                          tiling: str = "", softcap: Optional[float] = None, window: int = 0,
                          mask_add_dtype: Optional[torch.dtype] = None, fill_in_mask: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inputs, kw = _kernel_args(q, k, v, out.contiguous(), dout.contiguous(), mask, drop_mask, softmax_max, softmax_sum, scale, causal,
                              dropout_p, fill, empty_rows, scale_tensor, device, tiling, softcap, window,
                              mask_add_dtype, fill_in_mask)
    r = _ops.run_kernel("flash_attention_grad", *inputs, **kw)
    _record("flash_attention_grad", r.stats)
    return tuple(_to_torch(a, t.dtype) for a, t in zip(r.outputs, (q, k, v)))


@_flash_attention_grad.register_fake
def _(q, k, v, out, dout, mask=None, drop_mask=None, softmax_max=None, softmax_sum=None, scale=None, causal=False, dropout_p=0.0, fill=None,
      empty_rows="zero", scale_tensor=None, device="ascend910", tiling="", softcap=None, window=0, mask_add_dtype=None,
      fill_in_mask=False):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _round(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(dtype).float()


def reference_flash_attention_grad(q, k, v, out, dout, mask=None, drop_mask=None, softmax_max=None, softmax_sum=None, scale=None, causal=False,
                                   dropout_p=0.0, fill=None, empty_rows="zero", scale_tensor=None, softcap=None, window=0,
                                   mask_add_dtype=None, fill_in_mask=False, **_):
    """What the kernel computes, in torch with its numerics: fp32 scores, the row max m and sum l (given, or
    computed in fp32), ``P = exp(scale·S + mask - m) / l``, ``Dr = rowsum(dO∘O)`` in fp32, ``Pd = P∘keep/(1-p)``
    and ``dS = scale·P∘(dP∘keep/(1-p) - Dr)`` rounded to the operand dtype, the products in fp32, dq/dk/dv
    rounded to their dtypes (dk, dv summed over the query heads of each kv head). Rows with no key to attend
    (``l = 0``) give zero gradients (NaN with ``empty_rows="nan"``, in dv); a bool-masked score with a finite
    fill passes no gradient, nor with ``empty_rows="nan"`` (as ``masked_fill``'s backward: an empty row's NaN
    reaches dv, not dq or dk). ``softcap``: the scaled scores capped as ``c·tanh(s / c)`` before the mask, and dS times
    the cap's derivative ``1 - tanh²``; ``window`` (with ``causal``): the sliding window's band; ``mask_add_dtype``:
    the additive mask added as the forward adds it (:func:`autofuse.ops.add_mask`); ``fill_in_mask`` (an additive mask):
    its entries equal to ``fill`` are scores a bool mask filled, which pass no gradient either."""
    dt = q.dtype
    B, N, Sq, D = q.shape
    Nkv, Skv = k.shape[1], k.shape[2]
    rep = N // Nkv
    s_ = _effective_scale(q, scale, scale_tensor)
    kf, vf = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    x = (q.float() @ kf.transpose(-2, -1)) * s_
    t = None
    if softcap is not None:
        t = torch.tanh(x * (1.0 / softcap))
        x = t * softcap
    if mask is not None:
        x = _ops.add_mask(x, mask, mask_add_dtype) if mask.dtype != torch.bool else x.masked_fill(~mask, _fill(fill))
    if causal:
        x = x.masked_fill(~_ops.band_keep(Sq, Skv, window, x.device), float("-inf"))
    if softmax_max is None:
        m = x.amax(-1, keepdim=True)
        total = torch.exp(x - torch.where(torch.isneginf(m), 0.0, m)).sum(-1, keepdim=True)
    else:
        m, total = softmax_max.float().unsqueeze(-1), softmax_sum.float().unsqueeze(-1)
    inv = torch.where(total == 0, 0.0 if empty_rows == "zero" else float("nan"), 1.0 / total)
    p = torch.exp(x - torch.where(torch.isneginf(m), 0.0, m)) * inv
    dr = (dout.float() * out.float()).sum(-1, keepdim=True)
    dp = dout.float() @ vf.transpose(-2, -1)
    pd = p
    if drop_mask is not None:
        keep = unpack_keep(drop_mask, Skv).float() / (1.0 - dropout_p)
        dp, pd = dp * keep, p * keep
    ds = p * (dp - dr)
    if t is not None:
        ds = ds * (1 - t * t)
    ds = ds * s_
    if mask is not None and mask.dtype == torch.bool and (_fill(fill) != float("-inf") or empty_rows == "nan"):
        ds = ds.masked_fill(~mask, 0.0)          # a filled score is a constant (an empty row's NaN stops there)
    if fill_in_mask and mask is not None and mask.dtype != torch.bool:
        ds = ds.masked_fill(_ops.filled(mask, fill), 0.0)
    ds = _round(ds, dt)
    pd = _round(pd, dt)
    dq = (ds @ kf).to(dt)
    dk = (ds.transpose(-2, -1) @ q.float()).reshape(B, Nkv, rep, Skv, D).sum(2).to(k.dtype)
    dv = (pd.transpose(-2, -1) @ dout.float()).reshape(B, Nkv, rep, Skv, -1).sum(2).to(v.dtype)
    return dq, dk, dv


def _timing_flash_attention_grad(q, k, v, out, dout, mask=None, drop_mask=None, softmax_max=None, softmax_sum=None, scale=None, causal=False,
                                 dropout_p=0.0, fill=None, empty_rows="zero", scale_tensor=None, device="ascend910",
                                 tiling="", softcap=None, window=0, mask_add_dtype=None, fill_in_mask=False):
    inputs, kw = _kernel_args(q, k, v, out, dout, mask, drop_mask, softmax_max, softmax_sum, scale if scale_tensor is None else 1.0,
                              causal, dropout_p, fill, empty_rows, None, device, tiling, softcap, window,
                              mask_add_dtype, fill_in_mask)
    r = _ops.run_kernel("flash_attention_grad", *inputs, timing_only=True, **kw)
    return [("flash_attention_grad", r.stats)]


REFERENCES["flash_attention_grad"] = reference_flash_attention_grad
TIMING["flash_attention_grad"] = _timing_flash_attention_grad


def flash_attention_grad(q, k, v, out, dout, mask=None, drop_mask=None, softmax_max=None, softmax_sum=None, scale=None, causal=False,
                         dropout_p=0.0, fill=None, empty_rows="zero", scale_tensor=None, device="ascend910",
                         tiling=None, softcap=None, window=0, mask_add_dtype=None, fill_in_mask=False):
    """``(dq, dk, dv)`` of fused attention on the simulated NPU (keyword-friendly wrapper of the op)."""
    return torch.ops.autofuse.flash_attention_grad(q, k, v, out, dout, mask, drop_mask, softmax_max, softmax_sum, scale, causal,
                                                   float(dropout_p), fill, empty_rows, scale_tensor, device,
                                                   json.dumps(tiling) if tiling else "",
                                                   None if softcap is None else float(softcap), int(window),
                                                   mask_add_dtype, bool(fill_in_mask))


__all__ = ["flash_attention_grad", "reference_flash_attention_grad"]


no_double_backward(_flash_attention_grad, "a fused attention block", "attention")
