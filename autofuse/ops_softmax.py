"""The softmax family's fused op: ``torch.ops.autofuse.scaled_masked_softmax`` (CANN ScaledMaskedSoftmax,
with LogSoftmax's form and the casts around it).

    y = torch.ops.autofuse.scaled_masked_softmax(x, mask, dim=-1, scale=None, fill=None, log=False,
                                                 empty_rows="nan", inf_rows="nan", out_dtype="",
                                                 device="ascend910", tiling="", mask_add_dtype=None)
    y = autofuse.ops_softmax.scaled_masked_softmax(x, mask, scale=0.125)   # keyword-friendly wrapper

computes ``z = scale · x`` (fp32), then the mask — bool, True = keep, a masked score becomes ``fill``
(``None`` = ``-inf``; a finite fill such as ``finfo.min`` or ``-1e4`` is reproduced exactly), or an
additive float tensor — broadcast to x (``mask_add_dtype``, ``torch.float16`` or ``torch.bfloat16`` with a mask of
that dtype: added as eager adds a 16-bit mask to 16-bit scores, ``z`` cast down, the sum rounded to that dtype and
cast back up, so a score the mask absorbs takes the mask's value; the gradient passes through both casts, as
through eager's add); then ``softmax(z, dim)`` (``log=True``: ``log_softmax``), with fp32
statistics, written in ``out_dtype`` (``""``: x's dtype). ``empty_rows``: a row whose scores are all
``-inf`` gives ``"nan"`` (``softmax``) or ``"zero"`` (``_safe_softmax``). ``inf_rows``: a row whose max is
``+inf`` gives ``"nan"`` over the row (``softmax``, ``log_softmax``) or ``"lse"``, what the logsumexp spellings
give there (``torch.logsumexp`` is +inf): ``z − inf`` (log: -inf at finite scores, NaN at +inf ones) or
``exp(z − inf)`` (0 and NaN), with eager's gradients of those spellings. The op runs the simulator's
``softmax`` kernel (``autofuse/npu/kernels/softmax.py``) and records the launch for whole-graph simulation;
it has a fake implementation, a torch twin with the kernel's numerics (:func:`reference_scaled_masked_softmax`,
``autofuse.ops.REFERENCES["scaled_masked_softmax"]``) and a backward for x and for an additive mask that
requires grad: the op as a Vector program (:func:`softmax_program`) differentiated by
:mod:`cost_model.program_grad`, one ``vector_program`` launch (plus a torch ``sum`` for a mask broadcast along
leading dims); softmax along another dim than the last recomputes the op in fp32 on the host with the twin
and differentiates it (not simulated).
"""
from __future__ import annotations

import json
from typing import Optional

import torch

from autofuse import ops as _ops
from autofuse import ops_vector as _ops_vector
from autofuse.ops import REFERENCES, _fill, _record, _to_torch, dtype_name
from cost_model.program import Builder, Program

_DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _out_dtype(x: torch.Tensor, out_dtype: str) -> torch.dtype:
    if out_dtype and out_dtype not in _DT:
        raise ValueError(f"scaled_masked_softmax: out_dtype={out_dtype!r}; use one of {', '.join(_DT)} or '' "
                         f"(x's dtype)")
    return _DT[out_dtype] if out_dtype else x.dtype


@torch.library.custom_op("autofuse::scaled_masked_softmax", mutates_args=())
def _scaled_masked_softmax(x: torch.Tensor, mask: Optional[torch.Tensor] = None, dim: int = -1,
                           scale: Optional[float] = None, fill: Optional[float] = None, log: bool = False,
                           empty_rows: str = "nan", inf_rows: str = "nan", out_dtype: str = "",
                           device: str = "ascend910", tiling: str = "",
                           mask_add_dtype: Optional[torch.dtype] = None, fill_in_mask: bool = False) -> torch.Tensor:
    od = _out_dtype(x, out_dtype)       # fill_in_mask: the backward's (see reference_scaled_masked_softmax)
    kw = {} if mask_add_dtype is None else {"mask_add_dtype": dtype_name(mask_add_dtype)}
    # through the module attribute: tests replace autofuse.ops.run_kernel to inject a faulty kernel
    r = _ops.run_kernel("softmax", x, dim=dim, mask=mask, scale=scale, fill=_fill(fill), log=log,
                        empty_rows=empty_rows, inf_rows=inf_rows, out_dtype=str(od).replace("torch.", ""),
                        device=device,
                        tiling=json.loads(tiling) if tiling else None, **kw)
    _record("softmax", r.stats)
    return _to_torch(r.outputs[0], od)


@_scaled_masked_softmax.register_fake
def _(x, mask=None, dim=-1, scale=None, fill=None, log=False, empty_rows="nan", inf_rows="nan", out_dtype="",
      device="ascend910", tiling="", mask_add_dtype=None, fill_in_mask=False):
    return x.new_empty(x.shape, dtype=_out_dtype(x, out_dtype))


class _LseShift(torch.autograd.Function):
    """``d = lse − m`` (given, with ``m`` the max subtracted), with eager's logsumexp gradient ``exp(z − lse)``:
    on a row whose every score is a fill ``lse`` absorbs it is 1 at every score (not the softmax's ``1/C``),
    on a row whose max is +inf 0 (NaN at the +inf scores)."""

    @staticmethod
    def forward(ctx, z, d, m):
        ctx.save_for_backward(z, d, m)
        return d.clone()

    @staticmethod
    def backward(ctx, g):
        z, d, m = ctx.saved_tensors
        return g * torch.exp((z - m) - d), None, None


def reference_scaled_masked_softmax(x, mask=None, dim=-1, scale=None, fill=None, log=False, empty_rows="nan",
                                    out_dtype="", upcast=False, inf_rows="nan", mask_add_dtype=None,
                                    fill_in_mask=False, **_):
    """What the kernel computes, in torch with its numerics: fp32 throughout (scale, mask, statistics), one
    rounding to ``out_dtype`` at the end (skipped with ``upcast``, for the backward); ``mask_add_dtype``: the
    additive mask added in that 16-bit dtype (:func:`autofuse.ops.add_mask`). ``inf_rows="lse"``: eager's
    logsumexp spelling (``z - logsumexp(z)``, or its ``exp``) as the kernel computes it, ``(z - m) - d`` or
    ``exp(z - m) / exp(d)`` with ``z`` and ``lse = m + log Σ exp(z - m)`` rounded to x's dtype, ``d = lse - m`` (0 on a
    row whose max is +inf), and autograd gives eager's gradient of the spelling (``lse``'s is ``exp(z - lse)``).
    ``fill_in_mask`` (an additive mask that is a bool mask and additive terms combined, ``where(keep, terms, fill)``):
    its entries equal to ``fill`` are scores the bool mask filled, constants as ``masked_fill`` makes them (no
    gradient reaches x there; on a row whose every score is filled eager's softmax is NaN and ``masked_fill`` stops
    that NaN from reaching x); or those entries as a bool tensor (:func:`autofuse.ops.constant_where_filled`)."""
    z = x.float()
    if scale is not None:
        z = z * scale
    if mask is not None:
        z = z.masked_fill(~mask, _fill(fill)) if mask.dtype == torch.bool else \
            _ops.constant_where_filled(_ops.add_mask(z, mask, mask_add_dtype), mask, fill, fill_in_mask)
    if inf_rows == "lse":
        z = z.to(x.dtype).float()          # eager's scores, in x's dtype (the gradient passes the rounding)
        m = z.detach().amax(dim, keepdim=True)
        mm = m.masked_fill(m == float("-inf"), 0.0) if empty_rows == "zero" else m   # the max subtracted
        total = torch.exp(z.detach() - mm).sum(dim, keepdim=True)
        if empty_rows == "zero":
            total = total.masked_fill(total == 0, float("inf"))
        lse = (mm + torch.log(total)).to(x.dtype).float()    # eager's logsumexp, in the scores' dtype
        d = _LseShift.apply(z, torch.where(m == float("inf"), 0.0, lse - mm), mm)
        y = (z - mm) - d if log else torch.exp(z - mm) / torch.exp(d)
    else:
        y = torch.log_softmax(z, dim) if log else torch.softmax(z, dim)
    if empty_rows == "zero":
        y = y.masked_fill(torch.isneginf(z).all(dim, keepdim=True), 0.0)
    return y if upcast else y.to(_out_dtype(x, out_dtype))


REFERENCES["scaled_masked_softmax"] = reference_scaled_masked_softmax


def _setup_context(ctx, inputs, output):
    x, mask, dim, scale, fill, log, empty_rows, inf_rows, out_dtype, device, _, add_dtype, fill_in_mask = inputs
    ctx.save_for_backward(x, mask)
    ctx.params = dict(dim=dim, scale=scale, fill=fill, log=log, empty_rows=empty_rows, inf_rows=inf_rows)
    if fill_in_mask and mask is not None and mask.is_floating_point():
        ctx.params["fill_in_mask"] = True
    if add_dtype is not None and mask is not None:     # the backward recomputes z as the forward added the mask
        ctx.params["mask_add_dtype"] = add_dtype
    ctx.out_dtype, ctx.device = str(output.dtype).replace("torch.", ""), device


def softmax_program(x_shape, x_dtype: str, mask_spec, dim=-1, scale=None, fill=None, log=False,
                    empty_rows="nan", out_dtype="float32", inf_rows="nan", mask_add_dtype=None,
                    fill_in_mask=False) -> Optional[Program]:
    """The op as a Vector program over ``x`` (and the mask, ``(shape, dtype)`` or None), computing as the
    kernel does: ``z = scale · x`` (masked: a bool mask selects ``fill``, a float one adds), ``y = exp(z − m) /
    Σ exp(z − m)`` with ``m`` the row's max (``log``: ``z − m − log Σ``), an all-``-inf`` row zero with
    ``empty_rows="zero"``; ``inf_rows="lse"``: ``y = (z − m) − d`` or ``exp(z − m) / exp(d)`` with ``d = lse − m``,
    ``lse = m + log Σ`` cast to x's dtype, ``d`` 0 on a row whose max is +inf (its ``z − m`` is ``z − inf``), as
    the kernel computes it; :mod:`cost_model.program_grad`'s closed form, ``g − exp(y) Σ g`` or ``y (g − Σ g y)``,
    is eager's gradient of ``z − logsumexp(z)`` or its ``exp``. ``mask_add_dtype``: the additive mask added as
    eager adds it in that 16-bit dtype, ``z`` cast down, the sum rounded to it (and widened by the next
    instruction), so the derived gradient passes through the rounding as eager's autograd does. ``fill_in_mask``: the
    mask's entries equal to ``fill`` select it in place of the sum (a select the gradient does not pass: a bool
    mask's filled scores are constants). None when the op
    is no row program: softmax along another dim than the last, or a
    mask with more dims than x."""
    nd = len(x_shape)
    if dim % nd != nd - 1 or (mask_spec is not None and len(mask_spec[0]) > nd):
        return None
    b = Builder(tuple(x_shape[:-1]))
    z = b.input(x_dtype, x_shape)
    m_in = b.input(mask_spec[1], mask_spec[0]) if mask_spec is not None else None
    if scale is not None:
        z = b.mul(z, float(scale))
    if m_in is not None:
        if mask_spec[1] == "bool":
            z = b.where(m_in, z, _fill(fill))
        elif mask_add_dtype is not None:
            add = dtype_name(mask_add_dtype)
            z = b.cast(b.add(b.cast(z, dtype=add), m_in), dtype=add)
        else:
            z = b.add(z, m_in)
        if fill_in_mask and mask_spec[1] != "bool":
            fv = _ops.fill_as(fill, _DT[mask_spec[1]])
            z = b.where(b.eq(m_in, fv), fv, z)
    if inf_rows == "lse" and x_dtype != "float32":
        z = b.cast(z, dtype=x_dtype)            # eager's scores, in x's dtype (widened by the next instruction)
    top = b.reduce(z, kind="max")
    d = b.sub(z, top)
    e = b.exp(d)
    total = b.reduce(e, kind="sum")
    if inf_rows == "lse":                       # lse = m + log Σ in x's dtype; y = (z − m) − d or exp(z − m) / exp(d)
        lse = b.add(top, b.log(total))
        if x_dtype != "float32":
            lse = b.cast(lse, dtype=x_dtype)
        shift = b.where(b.eq(top, float("inf")), 0.0, b.sub(lse, top))
        y = b.sub(d, shift) if log else b.div(e, b.exp(shift))
    else:
        y = b.sub(d, b.log(total)) if log else b.div(e, total)
    if empty_rows == "zero":
        y = b.where(b.eq(top, float("-inf")), 0.0, y)
    b.output(y, out_dtype)
    return b.build()


def _backward(ctx, grad):
    """The gradients of x and of an additive mask: the op's program differentiated
    (:mod:`cost_model.program_grad`) and run as one ``vector_program`` launch; recomputed on the host in fp32
    and differentiated with torch autograd (not simulated) when the op is no row program."""
    x, mask = ctx.saved_tensors
    need = ctx.needs_input_grad
    float_mask = mask is not None and mask.is_floating_point()
    wrt = ((0,) if need[0] else ()) + ((1,) if float_mask and need[1] else ())
    rest = (None,) * 11
    launch = None
    if wrt and grad is not None and all(type(d) is int for d in x.shape + (() if mask is None else mask.shape)):
        spec = None if mask is None else (tuple(mask.shape), str(mask.dtype).replace("torch.", ""))
        prog = softmax_program(tuple(x.shape), str(x.dtype).replace("torch.", ""), spec, **ctx.params,
                               out_dtype=ctx.out_dtype)
        launch = prog and _ops_vector._grad_launch(prog.to_json(), wrt, (0,), ctx.device)
    if launch:
        got = dict(zip(wrt, _ops_vector.run_grad_program(*launch, [x] + ([mask] if mask is not None else []),
                                                        [grad], ctx.device)))
        return (got.get(0), got.get(1)) + rest
    return _backward_host(ctx, grad, x, mask) + rest


def _backward_host(ctx, grad, x, mask) -> tuple:
    """Gradients recomputed on the host in fp32 (not simulated): for x, and for an additive mask."""
    need = ctx.needs_input_grad
    with torch.enable_grad():
        xl = x.detach().float().requires_grad_(bool(need[0]))
        ml = mask
        if mask is not None and mask.is_floating_point():
            ml = mask.detach().float().requires_grad_(bool(need[1]))
        params = dict(ctx.params)
        if params.get("fill_in_mask"):           # the filled entries as the mask's own dtype holds them
            params["fill_in_mask"] = _ops.filled(mask, params["fill"])
        y = reference_scaled_masked_softmax(xl, ml, **params, upcast=True)
        wrt = [t for t in (xl, ml) if isinstance(t, torch.Tensor) and t.requires_grad]
        got = iter(torch.autograd.grad(y, wrt, grad.float(), allow_unused=True)) if wrt else iter(())
    gx = next(got).to(x.dtype) if xl.requires_grad else None
    gm = None
    if ml is not None and ml is not mask and ml.requires_grad:
        gm = next(got)
        gm = gm.sum_to_size(mask.shape).to(mask.dtype) if gm is not None else None
    return gx, gm


_scaled_masked_softmax.register_autograd(_backward, setup_context=_setup_context)


def scaled_masked_softmax(x, mask=None, dim=-1, scale=None, fill=None, log=False, empty_rows="nan", out_dtype=None,
                          device="ascend910", tiling=None, inf_rows="nan", mask_add_dtype=None, fill_in_mask=False):
    """Fused ``softmax(scale · x masked, dim)`` (or ``log_softmax``) on the simulated NPU; see the module
    docstring. ``mask``: bool keep-mask or additive float, broadcastable to x. ``out_dtype``: a torch dtype,
    its name, or None (x's dtype). ``tiling``: ``{"block": ..., "chunk": ...}`` or None (the kernel's own).
    ``mask_add_dtype``: ``torch.float16`` or ``torch.bfloat16`` (an additive mask of that dtype added as eager adds
    it), or None (added in fp32). ``fill_in_mask``: an additive mask's entries equal to ``fill`` are scores a bool
    mask combined into it filled, constants in the backward."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"scaled_masked_softmax: x must be a float tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if mask is not None:
        try:
            torch.broadcast_shapes(mask.shape, x.shape)
        except RuntimeError:
            raise ValueError(f"scaled_masked_softmax: mask {list(mask.shape)} does not broadcast to x "
                             f"{list(x.shape)}") from None
        if torch.broadcast_shapes(mask.shape, x.shape) != x.shape:
            raise ValueError(f"scaled_masked_softmax: mask {list(mask.shape)} would broadcast x {list(x.shape)} "
                             f"up; the mask must broadcast to x")
    od = "" if out_dtype is None else str(out_dtype).replace("torch.", "")
    if isinstance(mask_add_dtype, str):
        mask_add_dtype = _DT[mask_add_dtype]
    return torch.ops.autofuse.scaled_masked_softmax(x, mask, dim, scale, fill, log, empty_rows, inf_rows, od, device,
                                                    json.dumps(tiling) if tiling else "", mask_add_dtype,
                                                    bool(fill_in_mask))


__all__ = ["reference_scaled_masked_softmax", "scaled_masked_softmax"]
