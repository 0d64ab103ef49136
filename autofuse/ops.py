"""Fused operators as ``torch.library`` custom ops: ``torch.ops.autofuse.<kernel>``.

Each op's CPU implementation runs the fused kernel on the NPU simulator (``autofuse.npu``) with the
tiling the planner chose; each has a fake (meta) implementation, so graphs that call them can be traced,
exported and shape-propagated again without data.

    out, probs, stats = torch.ops.autofuse.flash_attention(q, k, v, mask, scale=None, causal=False)
    out = autofuse.ops.flash_attention(q, k, v)            # the same, returning ``out`` only

``probs`` is empty unless ``return_probs``; ``stats`` is empty unless ``return_stats``: then ``[2, B, N, Sq]``
fp32, each row's softmax max and sum (CANN's softmax_max / softmax_sum), which the backward hands to
``flash_attention_grad`` so that it skips recomputing them.

``device`` names the simulated target; ``tiling`` is a JSON object (``""`` = the kernel's default).
Every call's simulator statistics are appended to the active :func:`recording` list, if any.

With ``causal_value`` (a proven causal mask whose masked entries take a finite value) the op launches two
kernels: ``score_bound`` (the largest row norms of q and k) and then flash_attention, causal without the mask
where the bound proves the skipped weights are exactly 0, with the mask otherwise. With ``causal_bias`` as well
(the mask is a learned bias plus a proven causal mask, T5's decoder) a third, ``bias_bound`` (max |bias|), runs
too, and the causal kernel reads the bias alone where both bounds prove it exact.

With ``drop_mask`` (training-mode dropout on the probabilities) the op reads a keep-mask made by
``torch.ops.autofuse.dropout_gen_mask``, which draws it with torch's generator exactly as eager's dropout
does (same seed, same elements dropped) and runs the NPU's mask generator for its cost:

    bits = torch.ops.autofuse.dropout_gen_mask([B, N, Sq, Skv], 0.1, torch.float16)
    out, _, _ = torch.ops.autofuse.flash_attention(q, k, v, drop_mask=bits, dropout_p=0.1)

The op is differentiable: its backward runs ``torch.ops.autofuse.flash_attention_grad`` (the simulated
FlashAttentionScoreGrad kernel, :mod:`autofuse.ops_attention_grad`) for dq, dk, dv, with the same keep-mask
and, when the forward saved them (``return_stats``), its row statistics; gradients the kernel does not compute
(a learnable scale, an additive mask's, a gradient of the returned probabilities) are recomputed in fp32 on
the host (see ``_backward``).
"""
from __future__ import annotations

import contextlib
import json
import math
from typing import Optional

import numpy as np
import torch

from autofuse import npu
from autofuse.graph import empty_in_order, in_order
from autofuse.npu.kernels import dropout as _bits

_recorders: list[list] = []

#: op name -> its torch twin with the kernel's numerics, ``fn(*op_args, **op_kwargs)`` returning the op's outputs
#: (whole-graph simulation takes a repeated launch's values from it; the statistics of the first are reused)
REFERENCES: dict = {}

#: op name -> ``fn(*op_args, **op_kwargs)`` returning ``[(kernel, Stats)]``: the op's launches run timing only
#: (inputs may be meta tensors), for a simulation that needs the op's cost and not its values
TIMING: dict = {}

#: op name -> the simulator kernel it launches, for an op that passes that kernel's steering inputs
#: (``@kernel(steer=...)``: a group list, row indices, router logits) through under the same argument names:
#: whole-graph simulation computes those arguments' values, keys repeated launches by them, and never reuses
#: one launch's statistics for another with other values
STEERED: dict = {}


@contextlib.contextmanager
def recording():
    """Collect ``(kernel, Stats)`` of every fused-op call made inside the block."""
    log: list = []
    _recorders.append(log)
    try:
        yield log
    finally:
        _recorders.remove(log)


def _record(name, stats):
    for log in _recorders:
        log.append((name, stats))


def run_kernel(name: str, *inputs, **params) -> npu.Result:
    """The one place the fused ops call the simulator (tests replace it to inject a faulty kernel)."""
    return npu.run(name, *inputs, **params)


def _to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


@torch.library.custom_op("autofuse::flash_attention", mutates_args=())
def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                     scale: Optional[float] = None, causal: bool = False, return_probs: bool = False,
                     device: str = "ascend910", tiling: str = "", fill: Optional[float] = None,
                     empty_rows: str = "zero", scale_tensor: Optional[torch.Tensor] = None,
                     out_order: Optional[list[int]] = None, mask_keeps_nan: bool = False,
                     causal_value: Optional[float] = None, drop_mask: Optional[torch.Tensor] = None,
                     dropout_p: float = 0.0, return_stats: bool = False, softcap: Optional[float] = None,
                     sinks: Optional[torch.Tensor] = None, window: int = 0,
                     mask_add_dtype: Optional[torch.dtype] = None,
                     head_scale_dtype: Optional[torch.dtype] = None,
                     logits_dtype: Optional[torch.dtype] = None,
                     causal_bias: Optional[torch.Tensor] = None,
                     fallback_tiling: str = "",
                     bias_partials: Optional[torch.Tensor] = None,
                     fill_in_mask: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # fill=None is -inf (a schema default cannot spell infinity); fill_in_mask: the mask's filled entries take the
    # fill (the kernel's select) and pass no gradient (see _backward)
    scale_ = _effective_scale(q, scale, scale_tensor)
    heads = per_head_scale(scale_tensor, q.shape[1])
    tiling_ = json.loads(tiling) if tiling else None
    kw = dict(causal=causal, return_probs=return_probs, device=device, fill=_fill(fill), empty_rows=empty_rows,
              mask_keeps_nan=mask_keeps_nan, return_stats=return_stats, softcap=softcap, window=window,
              mask_add_dtype=dtype_name(mask_add_dtype))
    if fill_in_mask and mask is not None and mask.is_floating_point():
        kw["fill_in_mask"] = True
    if sinks is not None:
        kw["sinks"] = _per_head(sinks, q.shape[1]).detach().contiguous()
    if heads is not None:
        kw["head_scale"] = heads
        kw["head_scale_dtype"] = dtype_name(head_scale_dtype)
    if logits_dtype is not None:
        kw["logits_dtype"] = dtype_name(logits_dtype)
    if drop_mask is not None:
        kw.update(drop_mask=drop_mask, keep_prob=1.0 - dropout_p)
    if causal_value is not None and mask_add_dtype is not None:
        raise ValueError("flash_attention: causal_value with mask_add_dtype; a proven causal mask is added in fp32 "
                         "(the skip above the diagonal then gives the values reading it gives)")
    if causal_value is not None and mask is not None:
        # the mask is a proven causal mask whose masked entries take the finite value ``causal_value`` (bool:
        # the fill; float: added): skip the tiles above the diagonal where the scores' bound proves it exact
        b = run_kernel("score_bound", q, k, device=device)
        _record("score_bound", b.stats)
        bound_scale = scale_ if heads is None else scale_ * float(np.abs(heads).max())
        if causal_bias is not None:
            # the mask is ``causal_bias`` plus a proven causal mask adding ``causal_value`` (T5's decoder): bound the
            # bias too, as the op receives it, and read it alone in the kept tiles where both bounds prove it exact;
            # ``bias_partials``: that bound, computed in this call of the model by a shared ``bias_bound`` call
            if bias_partials is None:
                c = run_kernel("bias_bound", causal_bias.detach(), device=device)
                _record("bias_bound", c.stats)
                bias_partials = c.outputs[0]
            else:
                bias_partials = bias_partials.detach().numpy()
            if causal_bias_skip_is_exact(b.outputs[0], bound_scale, causal_value, bias_partials):
                mask, kw["causal"] = causal_bias, True
            else:                         # the mask read with the tiling the plan prices it with (as without the skip)
                tiling_ = json.loads(fallback_tiling) if fallback_tiling else None
        elif causal_skip_is_exact(b.outputs[0], bound_scale, causal_value, additive=mask.dtype != torch.bool,
                                  softcap=softcap):
            mask, kw["causal"] = None, True
        else:
            tiling_ = None                # the plan's tiling is the causal kernel's; the mask's may differ
    if not kw["causal"]:
        kw["window"] = 0                  # a window proven of a mask read as it is (causal_value): the mask has it
    r = run_kernel("flash_attention", q, k, v, mask=mask, scale=scale_, tiling=tiling_, **kw)
    _record("flash_attention", r.stats)
    out = in_order(_to_torch(r.outputs[0], q.dtype), out_order)
    probs = _to_torch(r.outputs[1], q.dtype) if return_probs else q.new_empty((0,))
    stats = _to_torch(np.stack(r.outputs[-2:]), torch.float32) if return_stats else _no_stats(q)
    return out, probs, stats


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    """The simulator's name of a torch dtype (``torch.float16`` -> ``"float16"``), None for None."""
    return None if dtype is None else str(dtype).replace("torch.", "")


def _per_head(sinks: torch.Tensor, n: int) -> torch.Tensor:
    """The sink logits one per query head, ``[n]`` (a single shared logit expanded): what the kernel takes, and
    what the twin and the sinks' gradient read."""
    if sinks.numel() not in (1, n):
        raise ValueError(f"flash_attention: sinks has {sinks.numel()} values; give one sink logit per query head "
                         f"({n}) or one for all")
    return sinks.reshape(-1).expand(n)


def _no_stats(q):
    return q.new_empty((0,), dtype=torch.float32)


#: fp32 ``exp(x)`` is exactly 0 below ln(2**-150) = -103.97; a skipped weight's exponent must be this far below
#: its row's max (the margin covers the fp32 rounding of the scores and of the bound itself, both far smaller)
SKIP_MARGIN = 110.0


def causal_skip_is_exact(partials, scale: float, value: float, additive: bool, softcap: float | None = None) -> bool:
    """Whether skipping the keys above the diagonal equals computing them: every skipped score
    ``x = value`` (a bool mask's fill) or ``x = value + scale·q_i·k_j`` (an additive mask) has
    ``exp(x - m_i) == 0`` in fp32, where ``m_i >= scale·q_i·k_i`` (each causal row keeps its diagonal key).
    With ``A = |scale|·max|q|·max|k| >= |scale·q·k|`` (Cauchy-Schwarz; ``partials``: the ``score_bound``
    kernel's per-core squared norms) that holds when ``value + A`` (bool) or ``value + 2A`` (additive) is
    at most ``-SKIP_MARGIN``. A NaN or inf anywhere in q or k makes the bound fail: the mask is then read.
    Soft-capped scores (``softcap · tanh(s / softcap)``) are bounded by ``min(A, softcap)``."""
    a = _score_abs_bound(partials, scale)                # NaN or inf stays: the test fails
    if softcap is not None and math.isfinite(a):
        a = min(a, float(softcap))
    return bool(value + (2 * a if additive else a) <= -SKIP_MARGIN)


def causal_bias_skip_is_exact(partials, scale: float, value: float, bias_partials) -> bool:
    """Whether skipping the keys above the diagonal and reading only the bias ``b`` in the kept tiles equals reading
    the whole mask ``b + C``, where ``C`` is a proven causal mask adding the absorbing ``value`` v (at most
    ``-1e30``: transformers' fp32 ``finfo.min``) above the diagonal and 0 on and below it, every term fp32.

    Kept entries: ``C`` adds 0 and ``fl(b + 0) == b`` (up to the sign of a zero, which no later ``s + ·`` and
    ``exp`` tells apart), so the kept scores are ``s + b`` whether the mask or the bias is read. Skipped entries:
    eager computes ``x = fl(s + fl(b + v))`` or ``x = fl(fl(s + b) + v)`` (either add order); they weigh
    ``exp(x - m_i)``, which must be exactly 0 in fp32. Let ``A >= |scale·q_i·k_j|`` (the ``score_bound``, as in
    :func:`causal_skip_is_exact`) and ``Bb >= max|b|`` (``bias_partials``: the ``bias_bound`` kernel's per-core
    maxima of ``|b|`` over the elements of the bias the op receives). With ``ε = 2^-24`` (round to nearest:
    ``|fl(y) - y| <= ε|y|``, and rounding is monotone) and ``v + 2(A + Bb) < 0``, the sums with v are negative,
    each rounding moves them up by at most ε of their size, and in either order ``x <= (1 - 2ε)v + A + Bb`` (a
    negative overflow gives ``-inf``, smaller still). Each row keeps its diagonal key, so ``m_i >= fl(s_ii + b_ii)
    >= -(1 + ε)(A + Bb)``. Hence ``x - m_i <= (1 - 2ε)v + (2 + ε)(A + Bb)``, and ``exp`` of its fp32 rounding is 0
    when that is at most ``-SKIP_MARGIN`` (fp32 ``exp`` is 0 below -103.97). The check takes
    ``v·(1 - 1e-3) + 2(A + Bb)(1 + 1e-3) <= -SKIP_MARGIN``, which implies it. Since the skipped weights are exactly
    0, the row max is taken at a kept key and the row sum adds exact zeros: the kernel's causal pass over ``b``
    gives what its full pass over ``b + C`` gives, bit for bit (same tiling), and eager's values as that does.
    A NaN or inf in q, k or the bias makes a bound NaN or inf and the check fail: the mask is then read."""
    a = _score_abs_bound(partials, scale)
    bb = float(np.asarray(bias_partials, dtype=np.float64).max()) * (1 + 1e-3)
    return bool(value * (1 - 1e-3) + 2 * (a + bb) <= -SKIP_MARGIN)


def _score_abs_bound(partials, scale: float) -> float:
    """``|scale|·max|q|·max|k|``, widened by 1e-3 for the fp32 rounding of the scores and of the norms."""
    mq, mk = np.asarray(partials, dtype=np.float64)[:, :, 0].max(axis=0)
    return abs(float(scale)) * math.sqrt(mq) * math.sqrt(mk) * (1 + 1e-3)


def _fill(fill):
    return float("-inf") if fill is None else float(fill)


def _effective_scale(q, scale, scale_tensor):
    """The score scale as a Python float: ``scale`` (default 1/sqrt(D)) times a one-element ``scale_tensor`` read
    now, at call time (a learnable temperature, a scale buffer: never baked into the plan). A per-head
    ``scale_tensor`` is not folded in: the kernel multiplies by it after ``scale`` (:func:`per_head_scale`)."""
    s = q.shape[-1] ** -0.5 if scale is None else scale
    return s if scale_tensor is None or scale_tensor.numel() != 1 else s * float(scale_tensor)


def per_head_scale(scale_tensor, n: int):
    """A ``scale_tensor`` of one factor per query head (shape ``[N, 1, 1]`` or ``[1, N, 1, 1]``: Swin v2's
    ``exp(clamp(logit_scale))``) as the kernel's fp32 ``head_scale`` ``[N]``, read now; None for no tensor or a
    one-element one. Any other shape is refused: the kernel's factor is one per head."""
    if scale_tensor is None or scale_tensor.numel() == 1:
        return None
    s = tuple(scale_tensor.shape)
    if len(s) > 4 or s[-3:] != (n, 1, 1) or any(d != 1 for d in s[:-3]):
        raise ValueError(f"flash_attention: scale_tensor of shape {list(s)}; it must hold one element or one factor "
                         f"per query head ([{n}, 1, 1] or [1, {n}, 1, 1])")
    return scale_tensor.detach().float().reshape(n).numpy()


def reference_flash_attention(q, k, v, mask=None, scale=None, causal=False, return_probs=False, fill=None,
                              empty_rows="zero", scale_tensor=None, mask_keeps_nan=False, out_order=None,
                              drop_mask=None, dropout_p=0.0, return_stats=False, softcap=None, sinks=None, window=0,
                              mask_add_dtype=None, head_scale_dtype=None, logits_dtype=None, fill_in_mask=False,
                              **_):
    """What the kernel computes, in torch, with the kernel's numerics: fp32 scores and softmax statistics,
    P rounded to the operand dtype before P·V, fp32 accumulation, the output rounded to q's dtype. A
    bool-masked score takes ``fill``; a row with no key to attend gives ``0`` or, with ``empty_rows="nan"``,
    NaN; NaN inputs propagate; ``drop_mask`` zeroes the dropped probabilities and scales the kept ones by
    ``1 / (1 - dropout_p)``; ``return_stats``: the rows' fp32 max and sum of ``exp(score - max)`` (before
    dropout; ``-inf`` and 0 for a row with no key to attend), stacked ``[2, B, N, Sq]``; ``sinks`` (one logit per
    query head): a score of its own in every row's softmax, attending no value (in the max and the sum); ``window``
    (with ``causal``): query i sees only keys j > i - window (a sliding window); ``mask_add_dtype`` (a 16-bit
    dtype): the additive mask added as eager adds it in that dtype, the scores cast down to it, the sum rounded to it
    (:func:`add_mask`); ``head_scale_dtype`` (a 16-bit dtype, with a per-head ``scale_tensor``): the product of the
    scores and the factor computed as eager's 16-bit product of its 16-bit scores (both rounded to it);
    ``logits_dtype`` (q's 16-bit dtype): the scores rounded to it as eager's matmul returns them, scaled and masked in
    fp32, and the logits rounded to it once before the softmax (as ``softmax(logits32, -1, dtype=)`` casts them;
    the gradient passes through both casts, as through eager's); ``fill_in_mask`` (an additive mask): its entries
    equal to ``fill`` are scores a bool mask filled, constants (no gradient; or a bool tensor of those entries, taken
    from the mask before a cast). Used where
    only the values are needed (repeated launches in
    :func:`autofuse.simulate`) and, in fp32, by the backward; the fused op itself runs the simulated kernel.
    ``scale_tensor`` (one element, or one factor per query head broadcast over the scores) may require grad (its
    gradient is the temperature's)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q.float() @ k.float().transpose(-2, -1)
    if logits_dtype is not None:
        s = s.to(logits_dtype).float()
    rounded = head_scale_dtype is not None and scale_tensor is not None and scale_tensor.numel() != 1
    if rounded:
        s = s.to(head_scale_dtype).float()
    s = s * scale
    if scale_tensor is not None:
        s = s * scale_tensor.float()
    if rounded:
        s = s.to(head_scale_dtype).float()
    if softcap is not None:
        s = torch.tanh(s * (1.0 / softcap)) * softcap
    if mask is not None:
        if mask.dtype != torch.bool:
            s = constant_where_filled(add_mask(s, mask, mask_add_dtype), mask, fill, fill_in_mask)
        else:
            # SDPA's bool mask adds -inf (a NaN or +inf score gives NaN); masked_fill replaces
            s = torch.where(mask, s, s + _fill(fill)) if mask_keeps_nan else s.masked_fill(~mask, _fill(fill))
    if logits_dtype is not None:
        s = s.to(logits_dtype).float()
    if causal:
        s = s.masked_fill(~band_keep(s.shape[-2], s.shape[-1], window, s.device), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, _per_head(sinks, s.shape[1]).float().reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    m = s.amax(-1, keepdim=True)
    empty = torch.isneginf(m)
    e = torch.exp(s - torch.where(empty, 0.0, m))
    total = e.sum(-1, keepdim=True)
    if sinks is not None:
        e = e[..., :-1]                     # the sink's weight is in the sum; it attends no value
    p = e / torch.where(total == 0, 1.0, total)
    if empty_rows == "zero":
        p = torch.where(total == 0, 0.0, p)
    else:
        # eager's softmax of a row with no key: NaN, and NaN in its backward too (dS, so the row's dq, every dk
        # and an additive mask's gradient there), also where a loss skips the row; a NaN constant put in by a
        # `where` would pass zero gradients there instead. A factor of 1 elsewhere leaves every other value as is.
        p = p * torch.where(total == 0, float("nan"), 1.0)
    pv = p.to(q.dtype).float()
    if drop_mask is not None:
        pv = pv * unpack_keep(drop_mask, s.shape[-1]).to(pv.device) / (1.0 - dropout_p)
    out = in_order((pv @ v.float()).to(q.dtype), out_order)
    stats = torch.stack([m.squeeze(-1), total.squeeze(-1)]).detach() if return_stats else _no_stats(q)
    return out, (p.to(q.dtype) if return_probs else q.new_empty((0,))), stats


REFERENCES["flash_attention"] = reference_flash_attention


def fill_as(fill, dtype: torch.dtype) -> float:
    """``fill`` (None: -inf) as a tensor of ``dtype`` holds it (``finfo(float32).min`` in float16 is -inf)."""
    return float(torch.tensor(_fill(fill), dtype=dtype))


def filled(mask: torch.Tensor, fill) -> torch.Tensor:
    """Where an additive ``mask`` holds ``fill`` (None: -inf) as its dtype rounds it: the scores a bool mask combined
    into it filled (``fill_in_mask``), constants in the backward."""
    return mask == fill_as(fill, mask.dtype)


def constant_where_filled(s: torch.Tensor, mask: torch.Tensor, fill, fill_in_mask) -> torch.Tensor:
    """``s`` (the scores with ``mask`` added) taking the fill, a constant, at the entries a bool mask combined into
    ``mask`` filled (``fill_in_mask``: True, where the mask holds ``fill``; or those entries as a bool tensor, found
    in the mask before a cast), as ``masked_fill`` replaces them (a fill the scores do not vanish into too) and
    passes them no gradient; ``s`` as it is without it (False)."""
    if fill_in_mask is False:
        return s
    return torch.where(filled(mask, fill) if fill_in_mask is True else fill_in_mask, fill_as(fill, mask.dtype), s)


def add_mask(s: torch.Tensor, mask: torch.Tensor, add_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """fp32 scores ``s`` plus an additive ``mask``: in fp32, or with ``add_dtype`` (fp16, bf16) as eager adds a mask of
    that dtype to scores of it, ``s`` cast down and the sum rounded to it (torch's CPU add: computed in fp32, rounded
    once), then cast back up; the gradient passes through both casts, as through eager's add."""
    if add_dtype is None:
        return s + mask.float()
    return (s.to(add_dtype) + mask.to(add_dtype)).float()


def band_keep(sq: int, skv: int, window: int = 0, device=None) -> torch.Tensor:
    """The causal keep-mask ``[sq, skv]`` (query i sees keys j <= i, top-left aligned), with a sliding ``window``
    (> 0) only the keys ``i - window < j <= i``."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(skv, device=device)[None, :]
    keep = j <= i
    return keep & (j > i - window) if window else keep


@_flash_attention.register_fake
def _(q, k, v, mask=None, scale=None, causal=False, return_probs=False, device="ascend910", tiling="",
      fill=None, empty_rows="zero", scale_tensor=None, out_order=None, mask_keeps_nan=False, causal_value=None,
      drop_mask=None, dropout_p=0.0, return_stats=False, softcap=None, sinks=None, window=0, mask_add_dtype=None,
      head_scale_dtype=None, logits_dtype=None, causal_bias=None, fallback_tiling="", bias_partials=None,
      fill_in_mask=False):
    out = empty_in_order(q, (*q.shape[:-1], v.shape[-1]), out_order)
    probs = q.new_empty((*q.shape[:-1], k.shape[-2]) if return_probs else (0,))
    stats = q.new_empty((2, *q.shape[:-1]), dtype=torch.float32) if return_stats else _no_stats(q)
    return out, probs, stats


def _setup_context(ctx, inputs, output):
    q, k, v, mask, scale, causal, return_probs, device, _, fill, empty_rows, scale_tensor, _, keeps_nan, _, drop, dp, \
        _, softcap, sinks, window, add_dtype, hs_dtype, lg_dtype, _, _, _, fill_in_mask = inputs
    # the row statistics, when the forward wrote them (return_stats; else an empty tensor): the backward
    # kernel then skips its recompute sweep
    ctx.save_for_backward(q, k, v, mask, scale_tensor, drop, output[0], output[2], sinks)
    ctx.mark_non_differentiable(output[2])
    ctx.scale, ctx.causal, ctx.return_probs, ctx.fill, ctx.empty_rows = scale, causal, return_probs, fill, empty_rows
    ctx.dropout_p, ctx.device, ctx.keeps_nan, ctx.softcap, ctx.window = dp, device, keeps_nan, softcap, window
    ctx.add_dtype = add_dtype if mask is not None else None
    ctx.hs_dtype = hs_dtype
    ctx.lg_dtype = lg_dtype
    ctx.fill_in_mask = bool(fill_in_mask) and mask is not None and mask.is_floating_point()


def _grad_kernel_fits(device, q, k, v, mask, drop, stats, softcap) -> bool:
    """Whether the backward kernel has a tiling for these operands on ``device`` (as it picks one when launched)."""
    from cost_model.devices import get_device
    from autofuse.npu.dtypes import name_of
    from autofuse.npu.kernels.flash_attention import mask_spec
    from autofuse.npu.kernels.flash_attention_grad import has_tiling
    spec = None if mask is None else mask_spec(name_of(mask), mask.shape)
    return has_tiling(get_device(device), q.shape[2], k.shape[2], q.shape[3], v.shape[3], name_of(q), spec,
                      drop is not None, not stats.numel(), softcap is not None)


def _backward(ctx, grad_out, grad_probs, grad_stats):
    """Gradients of attention. dq, dk, dv come from the fused backward kernel on the simulator
    (``torch.ops.autofuse.flash_attention_grad``, FlashAttentionScoreGrad), given the forward's row statistics
    when it saved them (``return_stats``), otherwise recomputing them. The statistics are not differentiated
    (``grad_stats`` is ignored: they are the backward's input, not a value a loss reads). The host recompute in fp32 (differentiating
    :func:`reference_flash_attention`) remains for what that kernel does not compute: the gradient of a
    learnable ``scale_tensor``, of an additive float ``mask`` that requires grad, and a gradient flowing into
    the probabilities (``return_probs``: it changes dS), and a head too wide for the kernel's buffers (no tiling
    fits: 512 in fp32 on the 910); the whole backward then runs there, so its dq/dk/dv stay consistent.
    ``mask_keeps_nan`` (SDPA's masks) takes the kernel: on finite scores adding -inf and filling -inf give the same
    P, so the same gradients; a NaN score (NaN in q or k) makes the forward's row
    NaN, and the kernel's gradients are NaN where that row's dS reaches (its dq row, the dk and dv of the keys
    it attends), which need not be every place eager's SDPA backward puts NaN. ``fill_in_mask`` (an additive mask
    that is a bool mask and additive terms combined, ``where(keep, terms, fill)``): its entries equal to ``fill`` are
    scores the bool mask filled, constants whose dS is 0, as ``masked_fill``'s backward gives them (on a row whose
    every score is filled, P is not 0 there)."""
    q, k, v, mask, scale_t, drop, out, stats, sinks = ctx.saved_tensors
    need = ctx.needs_input_grad
    host = ((sinks is not None and not stats.numel())     # the backward kernel has no sinks in its statistics' recompute
            or ctx.lg_dtype is not None                     # nor eager's 16-bit scores and logits
            or (scale_t is not None and (need[11] or scale_t.numel() != 1))   # the backward kernel: one scale
            or (mask is not None and mask.is_floating_point() and need[3])
            or (ctx.return_probs and grad_probs is not None and grad_probs.numel() > 0)
            or not _grad_kernel_fits(ctx.device, q, k, v, mask, drop, stats, ctx.softcap))   # no tiling fits
    if not host:
        go = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype).contiguous()
        m, lsum = (stats[0], stats[1]) if stats.numel() else (None, None)
        dq, dk, dv = torch.ops.autofuse.flash_attention_grad(
            q, k, v, out.contiguous(), go, mask, drop, m, lsum, ctx.scale, ctx.causal, float(ctx.dropout_p),
            ctx.fill, ctx.empty_rows, None if scale_t is None else scale_t.detach(), ctx.device, "", ctx.softcap,
            ctx.window, ctx.add_dtype, ctx.fill_in_mask)
        res = [g if need[i] else None for i, g in enumerate((dq, dk, dv))]
        gsink = _sinks_grad(sinks, q.shape[1], m, lsum, go, out) if sinks is not None and need[19] else None
        return tuple(res) + (None,) * 16 + (gsink,) + (None,) * 8
    with torch.enable_grad():
        leaves = [t.detach().float().requires_grad_(bool(need[i])) for i, t in enumerate((q, k, v))]
        m = mask
        if mask is not None and mask.is_floating_point():
            m = mask.detach().float().requires_grad_(bool(need[3]))
        st = None if scale_t is None else scale_t.detach().float().requires_grad_(bool(need[11]))
        sk = None if sinks is None else sinks.detach().float().requires_grad_(bool(need[19]))
        out, probs, _ = reference_flash_attention(*leaves, mask=m, scale=ctx.scale, causal=ctx.causal,
                                               return_probs=ctx.return_probs, fill=ctx.fill,
                                               empty_rows=ctx.empty_rows, scale_tensor=st, drop_mask=drop,
                                               dropout_p=ctx.dropout_p, softcap=ctx.softcap, sinks=sk,
                                               window=ctx.window, mask_add_dtype=ctx.add_dtype,
                                               head_scale_dtype=ctx.hs_dtype, logits_dtype=ctx.lg_dtype,
                                               fill_in_mask=filled(mask, ctx.fill) if ctx.fill_in_mask else False)
        outs, grads = [out], [grad_out.float()]
        if ctx.return_probs and grad_probs is not None and grad_probs.numel():
            outs.append(probs)
            grads.append(grad_probs.float())
        wrt = [t for t in leaves + [m, st, sk] if isinstance(t, torch.Tensor) and t.requires_grad]
        got = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True)) if wrt else iter(())
    res = [next(got).to(orig.dtype) if leaf.requires_grad else None for orig, leaf in zip((q, k, v), leaves)]
    gm = next(got) if (m is not None and m is not mask and m.requires_grad) else None
    res.append(None if gm is None else gm.to(mask.dtype))
    gs = next(got) if (st is not None and st.requires_grad) else None
    gk = next(got) if (sk is not None and sk.requires_grad) else None
    return tuple(res) + (None,) * 7 + (None if gs is None else gs.to(scale_t.dtype),) + (None,) * 7 + \
        (None if gk is None else gk.to(sinks.dtype),) + (None,) * 8


def _sinks_grad(sinks, n, m, lsum, go, out):
    """The sink logits' gradient from the forward's statistics (which count the sink: ``m``, ``l``): the sink's
    score gets ``dS = P_sink · (0 - Dr)`` in every row (it attends no value, so its dP is 0), ``P_sink = exp(sink -
    m) / l``, ``Dr = rowsum(dO ∘ O)``; summed over batch and queries per head (over the heads too for one shared
    logit). Torch ops on ``[B, N, Sq]`` values after the backward kernel (a traced training step prices them as
    the launches they are); a row with nothing to weigh (``l = 0``) gives 0."""
    dr = (go.float() * out.float()).sum(-1)
    s = _per_head(sinks.detach(), n).float().reshape(1, n, 1)
    p = torch.where(lsum > 0, torch.exp(s - m) / torch.where(lsum > 0, lsum, 1.0), 0.0)
    g = -(p * dr).sum((0, 2))
    return (g if sinks.numel() == n else g.sum()).reshape(sinks.shape).to(sinks.dtype)


_flash_attention.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(q, k, v, mask=None, scale=None, causal=False, return_probs=False, device="ascend910",
                    tiling=None, fill=None, empty_rows="zero", scale_tensor=None, causal_value=None, drop_mask=None,
                    dropout_p=0.0, return_stats=False, softcap=None, sinks=None, window=0, mask_add_dtype=None,
                    head_scale_dtype=None, logits_dtype=None, causal_bias=None, bias_partials=None,
                    fill_in_mask=False):
    """Fused attention on the simulated NPU: q [B, N, Sq, D], k/v [B, Nkv, Skv, D] (Nkv divides N).

    ``mask``: bool (True = attend) or additive float, broadcastable to [B, N, Sq, Skv]. ``causal``: query i
    sees keys j <= i. ``fill``: the score a bool-masked entry takes (``None`` = ``-inf``, or finite as
    eager's ``masked_fill(~keep, finfo.min)``). ``empty_rows``: a row with no key to attend gives ``"zero"`` (SDPA) or
    ``"nan"`` (softmax). ``scale_tensor``: a 0-d tensor multiplying the scale, read at call time and
    differentiated. ``causal_value``: ``mask`` is a causal mask whose masked entries take this finite value
    (a bool mask's ``fill``, or the value an additive mask adds); the kernel then skips the keys above the
    diagonal when a bound on the scores, computed first (kernel ``score_bound``), proves their weights are
    exactly 0, and reads the mask otherwise (:func:`causal_skip_is_exact`). ``drop_mask`` / ``dropout_p``:
    dropout on the probabilities with the keep-mask of :func:`dropout_gen_mask`. ``return_stats``: the forward
    also writes each row's softmax max and sum, and its backward reads them instead of recomputing them.
    ``softcap``: the scaled scores become ``softcap · tanh(s / softcap)`` before the mask (Gemma 2); the
    backward kernel caps them too and applies the cap's derivative. ``sinks``: attention sinks, one learnable
    logit per query head ``[N]`` (GPT-OSS), a score of its own in each row's softmax that attends no value; read
    at call time and differentiated (with ``return_stats`` the backward kernel gives dq, dk, dv from the
    statistics, which count the sink, and the sinks' gradient follows from them; without, the backward
    recomputes on the host). ``window`` (with ``causal``): a sliding window, query i sees keys ``i - window < j <= i``;
    the kernel walks only the band's KV tiles (forward and backward). ``mask_add_dtype`` (``torch.float16`` or
    ``torch.bfloat16``, an additive mask of that dtype): the mask added as eager adds it to scores of that dtype, the
    scores cast down and the sum rounded to it (forward and backward). ``scale_tensor`` may also hold one factor per
    query head (``[N, 1, 1]``, ``[1, N, 1, 1]``: Swin v2's), which multiplies each head's scores after ``scale``;
    ``head_scale_dtype`` (a 16-bit dtype) then rounds the scores before that product and the product after it, as
    eager's product of 16-bit scores and a 16-bit factor does (its backward runs on the host). ``logits_dtype`` (q's
    16-bit dtype): the scores rounded to it as eager's matmul returns them, and the scaled, masked logits rounded to it
    once before the softmax, as Falcon's ALiBi path casts them (its backward runs on the host). ``causal_bias`` (with
    ``causal_value``, fp32): ``mask`` is this bias plus a proven causal mask adding the absorbing ``causal_value``
    (T5's decoder: a learned relative position bias and transformers' causal mask); kernel ``bias_bound`` bounds
    the bias at call time and, where that and the score bound prove it exact, the causal kernel reads the bias
    alone in the kept tiles (:func:`causal_bias_skip_is_exact`), otherwise ``mask`` is read (with the tiling
    ``fallback_tiling``, JSON, when given: the one a plan reading the mask would run). ``bias_partials``: that bias
    bound, given by a :func:`bias_bound` call on the same ``causal_bias`` in the same call of the model (one launch
    shared by every block reading that bias); without it the op launches ``bias_bound`` itself. ``fill_in_mask`` (an
    additive ``mask`` that is a bool mask and additive terms combined, ``where(keep, terms, fill)``): its entries equal
    to ``fill`` are scores the bool mask filled, constants in the backward (no gradient reaches q or k through them,
    as through ``masked_fill``), where P is not 0 on a row whose every score is filled. Returns ``out`` or, with
    ``return_probs``, ``(out, probs)``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be a 4-D tensor [B, N, S, D], got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    out, probs, _ = torch.ops.autofuse.flash_attention(q, k, v, mask, scale, causal, return_probs, device,
                                                        json.dumps(tiling) if tiling else "", fill=fill,
                                                        empty_rows=empty_rows, scale_tensor=scale_tensor,
                                                        causal_value=causal_value, drop_mask=drop_mask,
                                                        dropout_p=float(dropout_p), return_stats=return_stats,
                                                        softcap=None if softcap is None else float(softcap),
                                                        sinks=sinks, window=int(window),
                                                        mask_add_dtype=mask_add_dtype,
                                                        head_scale_dtype=head_scale_dtype,
                                                        logits_dtype=logits_dtype, causal_bias=causal_bias,
                                                        bias_partials=bias_partials, fill_in_mask=bool(fill_in_mask))
    return (out, probs) if return_probs else out


# ------------------------------------------------------------------------------------------- bias bound

@torch.library.custom_op("autofuse::bias_bound", mutates_args=())
def _bias_bound(bias: torch.Tensor, device: str = "ascend910") -> torch.Tensor:
    r = run_kernel("bias_bound", bias.detach(), device=device)
    _record("bias_bound", r.stats)
    return _to_torch(r.outputs[0], torch.float32)


def _bias_bound_rows(bias, device) -> int:
    """The cores the ``bias_bound`` kernel stores one value each from (:func:`cost_model.vecutil.score_bound_cores`)."""
    from cost_model.devices import get_device
    from cost_model.vecutil import score_bound_cores
    return score_bound_cores(get_device(device), math.prod(bias.shape[:-1]) if bias.dim() else 0)


@_bias_bound.register_fake
def _(bias, device="ascend910"):
    return bias.new_empty((_bias_bound_rows(bias, device), 8), dtype=torch.float32)


def _bias_bound_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output)


def _bias_bound_backward(ctx, grad):
    return None, None


# a bound, not a function of the bias to differentiate: nothing flows back through it (the attention's backward
# reads the bias itself, as without the skip)
_bias_bound.register_autograd(_bias_bound_backward, setup_context=_bias_bound_setup)


def reference_bias_bound(bias, device="ascend910"):
    """The op's values without the simulator (a repeated launch's in :func:`autofuse.simulate`): ``max |bias|`` in
    every core's row (the kernel's per-core maxima differ, their maximum, all a caller reads, does not; NaN stays)."""
    m = bias.detach().abs().float().max() if bias.numel() else torch.tensor(0.0)
    return m.reshape(1, 1).expand(_bias_bound_rows(bias, device), 8).contiguous()


REFERENCES["bias_bound"] = reference_bias_bound


def bias_bound(bias: torch.Tensor, device: str = "ascend910") -> torch.Tensor:
    """``max |bias|`` on the simulated NPU, as fp32 per-core partials ``[cores, 8]`` (kernel ``bias_bound``): the bound
    :func:`causal_bias_skip_is_exact` reads. A fused graph computes it once per bias value and call of the model and
    hands it to every attention block reading that bias (``flash_attention(..., bias_partials=)``)."""
    return torch.ops.autofuse.bias_bound(bias, device)


# ------------------------------------------------------------------------------------------- dropout masks

def draw_keep(shape, p: float, dtype: torch.dtype, order=None) -> torch.Tensor:
    """The keep-mask eager's dropout draws for an input of ``shape`` and ``dtype`` whose draws run in ``order``
    (:func:`autofuse.graph.draw_order`; None: row-major), in logical (row-major) order: ``F.dropout`` and
    ``native_dropout`` on the CPU fill ``empty_like(input).bernoulli_(1 - p)``; the same call on a tensor laid out
    the same way, on the same generator state, gives the same elements, and moves the generator as far."""
    shape = [int(s) for s in shape]
    if order is None:
        return torch.empty(shape, dtype=dtype).bernoulli_(1.0 - p).bool()
    if sorted(order) != list(range(len(shape))):
        raise ValueError(f"dropout_gen_mask: order {list(order)} is not a permutation of the dims of {shape}")
    drawn = empty_in_order(torch.empty((), dtype=dtype), shape, order).bernoulli_(1.0 - p)
    return drawn.bool().contiguous()


def pack_keep(keep: torch.Tensor) -> torch.Tensor:
    """A bool keep-mask ``[..., S]`` as the kernels' uint8 ``[..., ceil(S / 8)]`` (:mod:`autofuse.npu.kernels.dropout`)."""
    return torch.from_numpy(_bits.pack_keep(keep.numpy()))


def unpack_keep(bits: torch.Tensor, n: int) -> torch.Tensor:
    """The bool keep-mask ``[..., n]`` of packed ``bits`` (:func:`pack_keep`): bit ``c % 8`` (least significant
    first) of byte ``c // 8``. Torch ops only, so a backward that reads a mask traces (``make_fx``, fake tensors)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    unpacked = bits.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and(1).bool()
    return unpacked.reshape(*bits.shape[:-1], bits.shape[-1] * 8)[..., :n]


@torch.library.custom_op("autofuse::dropout_gen_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _dropout_gen_mask(shape: list[int], p: float, dtype: torch.dtype, device: str = "ascend910",
                      order: Optional[list[int]] = None) -> torch.Tensor:
    keep = draw_keep(shape, p, dtype, order)
    r = run_kernel("dropout_gen_mask", shape=list(shape), keep_prob=1.0 - p, draws=_bits.HostDraws(keep.numpy()),
                   device=device)
    _record("dropout_gen_mask", r.stats)
    return torch.from_numpy(np.ascontiguousarray(r.outputs[0]))


@_dropout_gen_mask.register_fake
def _(shape, p, dtype, device="ascend910", order=None):
    return torch.empty([*shape[:-1], -(-shape[-1] // 8)], dtype=torch.uint8)


def reference_dropout_gen_mask(shape, p, dtype, device="ascend910", order=None):
    """The op's values without the simulator: the same draw, packed (a repeated launch's values)."""
    return pack_keep(draw_keep(shape, p, dtype, order))


REFERENCES["dropout_gen_mask"] = reference_dropout_gen_mask


def dropout_gen_mask(shape, p: float, dtype: torch.dtype = torch.float32, device: str = "ascend910",
                     order=None) -> torch.Tensor:
    """The dropout keep-mask of ``shape`` (uint8, one bit per element, rows packed separately, in logical order),
    drawn as eager's dropout of an input of that shape and ``dtype`` draws it; the NPU's mask generator is
    simulated for its cost. ``p``: the drop probability, in [0, 1). ``order``: the order of the draws, for an
    input that is not row-major (:func:`autofuse.graph.draw_order` of it; None: row-major)."""
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dropout_gen_mask: p={p}; a drop probability in [0, 1) is needed")
    return torch.ops.autofuse.dropout_gen_mask(list(shape), float(p), dtype, device,
                                               None if order is None else [int(d) for d in order])


# the backward's op (imported last: it builds on this module's names)
from autofuse import ops_attention_grad as _ops_attention_grad  # noqa: E402,F401


_BATCHED: set = set()
_BATCHED_LIBS: list = []


def refuse_batched_gradients() -> None:
    """Give every fused op (``autofuse::*``, ``autofuse_grad::*``) a kernel for torch's legacy batching, which a
    batched gradient runs the backward under (``torch.autograd.grad(..., is_grads_batched=True)``,
    ``torch.autograd.functional.jacobian(..., vectorize=True)``): the fused ops have no batching rule, and torch's
    own error named the op and no way out. Called once the ops are registered; an op registered since is added at
    the next call."""
    for qualname in torch._C._dispatch_get_all_op_names():
        ns, _, name = qualname.partition("::")
        if ns not in ("autofuse", "autofuse_grad") or qualname in _BATCHED or "." in name:
            continue

        def refuse(*args, _op=qualname, **kwargs):
            raise NotImplementedError(
                f"{_op} (a fused op of autofuse) has no batching rule, so a batched gradient "
                f"(torch.autograd.grad(..., is_grads_batched=True), jacobian(..., vectorize=True)) cannot run through "
                f"it: compute the gradients one grad_output at a time, or run this computation on the model itself "
                f"(fused.model)")
        lib = torch.library.Library(ns, "IMPL")
        lib.impl(name, refuse, "Batched")
        _BATCHED_LIBS.append(lib)        # a Library's registrations last as long as the object
        _BATCHED.add(qualname)
