"""The softmax family's fused call: ``scaled_masked_softmax`` (:mod:`autofuse.ops_softmax`) for a match of
:mod:`patterns.softmax`, how it is emitted and what it costs.

Emit: the kernel's one mask is built from the match's mask terms as the attention family builds its own
(:func:`autofuse.fused._mask`: bool terms AND-ed, additive ones scaled by the factor met at the softmax
input and summed, in fp32 when the graph adds them to fp32 scores, a bool term with an additive one turned
into ``-inf`` where it masks); the output is reshaped/cast to the value it replaces
(:func:`autofuse.fused._adapt`, a no-op when the match's output dtype is the kernel's ``out_dtype``). Price:
the cost model's ``softmax`` estimate with the mask's shape and dtype, plus the elementwise launches that
combine several mask terms into one (a 16-bit term cast up to fp32 among them).
"""
from __future__ import annotations

import dataclasses
import math

import torch

import cost_model
from autofuse import ops_softmax  # noqa: F401  (registers torch.ops.autofuse.scaled_masked_softmax)
from autofuse.fused import (REDUCED, Family, Price, _adapt, _fill_in_mask, _mask, _spec, attention_kwargs,
                            register_family, term_dtype)
from autofuse.graph import call, val
from cost_model.devices import get_device

OP = torch.ops.autofuse.scaled_masked_softmax.default


def _dt(d) -> str:
    return str(d).replace("torch.", "")


def _combined_mask(match, nodes: dict):
    """The spec of the one mask the kernel reads and the elementwise launches that build it from the terms
    (what :func:`autofuse.fused._mask` emits): ``(spec or None, [(inputs, params), ...])``."""
    keep = add = None
    launches = []
    for role, kind, factor in match.params["mask_terms"]:
        shape, dtype = _spec(nodes[match.inputs[role]])
        if kind == "bool":
            if keep is not None:
                launches.append(([keep, (shape, "bool")], {"op": "logical_and"}))
                shape = tuple(torch.broadcast_shapes(keep[0], shape))
            keep = (shape, "bool")
            continue
        wide = _dt(term_dtype(match.params, kind, getattr(torch, dtype)))
        if wide != dtype:                   # cast up to the fp32 the graph adds it in
            launches.append(([(shape, dtype)], {"op": "cast", "out_dtype": wide}))
            dtype = wide
        if factor != 1.0:
            launches.append(([(shape, dtype)], {"op": "mul", "scalar": factor}))
        if add is not None:
            launches.append(([add, (shape, dtype)], {"op": "add"}))
            shape = tuple(torch.broadcast_shapes(add[0], shape))
            dtype = _dt(torch.promote_types(getattr(torch, add[1]), getattr(torch, dtype)))
        add = (shape, dtype)
    if keep is not None and add is not None:
        launches.append(([keep, add], {"op": "where", "scalar": -math.inf}))
        return (tuple(torch.broadcast_shapes(keep[0], add[0])), add[1]), launches
    return keep or add, launches


def _add_dtype(p: dict, mask):
    """The match's ``mask_add_dtype`` when the one mask the kernel reads is of that dtype (the terms combined by
    a ``where`` with a bool one stay of it), else None (the mask added in fp32)."""
    d = p.get("mask_add_dtype")
    return d if d is not None and mask is not None and mask[1] == _dt(d) else None


def softmax_params(match, nodes: dict) -> tuple[list, dict]:
    """The kernel's input spec and parameters, as the emitted call runs it (``mask`` as a spec)."""
    p = match.params
    mask, _ = _combined_mask(match, nodes)
    params = dict(dim=p["dim"], scale=p["scale"], log=p["log"], empty_rows=p["empty_rows"],
                  out_dtype=_dt(p["out_dtype"]), mask=mask)
    if p.get("inf_rows", "nan") != "nan":
        params["inf_rows"] = p["inf_rows"]
    if _add_dtype(p, mask) is not None:         # the additive mask added in its 16-bit dtype, as eager adds it
        params["mask_add_dtype"] = _dt(p["mask_add_dtype"])
    return [_spec(nodes[match.inputs["x"]])], params


def kernel_default_tiling(device: str, spec, params) -> dict:
    """The tiling the softmax kernel picks by itself for this launch (what it runs with ``tiling=None``)."""
    from autofuse.npu.kernels.softmax import default_tiling, mask_geometry
    shape, dtype = spec
    dim = params["dim"] % len(shape)
    outer, C, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])
    mask, mspec, period = params.get("mask"), None, None
    if mask is not None:
        period, along_block, along_c = mask_geometry(shape, dim, mask[0])
        mspec = (mask[1], along_block, along_c) + ((params["mask_add_dtype"],) if params.get("mask_add_dtype")
                                                   else ())
    return default_tiling(get_device(device), dtype, outer, C, inner, params["out_dtype"], mspec, params["log"],
                          period)


def price_softmax(match, nodes: dict, device: str, search_tiling: bool) -> Price:
    """The fused kernel (with the tiling the cost model's search finds cheapest at O3, the kernel's own
    otherwise), plus the launches that combine several mask terms."""
    specs, params = softmax_params(match, nodes)
    if not search_tiling:
        params["tiling"] = kernel_default_tiling(device, specs[0], params)
    e = cost_model.estimate("softmax", specs, device=device, **params)
    total = Price(int(e.cycles), int(e.hbm_bytes), ["softmax"], e.bound, dict(e.tiling or {}), e.workspace_bytes)
    for ins, op in _combined_mask(match, nodes)[1]:
        c = cost_model.estimate("elementwise", ins, device=device, **op)
        total = total.add(Price(int(c.cycles), int(c.hbm_bytes), ["elementwise"]))
    return total


def emit_softmax(g, ins: dict, m, kwargs: dict) -> dict:
    """``scaled_masked_softmax(x, mask, ...)``; its output adapted to the value it replaces."""
    p = m.params
    mask = _mask(g, ins, m, 0) if p["mask_terms"] else None
    kw = dict(dim=p["dim"], log=p["log"], empty_rows=p["empty_rows"], inf_rows=p.get("inf_rows", "nan"),
              out_dtype=_dt(p["out_dtype"]), **kwargs)
    if p["scale"] is not None:
        kw["scale"] = p["scale"]
    if p["fill"] is not None:
        kw["fill"] = p["fill"]
    if mask is not None and p.get("mask_add_dtype") is not None and val(mask).dtype == p["mask_add_dtype"]:
        kw["mask_add_dtype"] = p["mask_add_dtype"]      # added in its 16-bit dtype, as eager adds it
    if _fill_in_mask(p, kw.get("fill")):
        kw["fill_in_mask"] = True                       # a bool mask's filled scores in it: constants
    fused = call(g, OP, ins["x"], mask, **kw)
    fused.meta["autofuse_match"] = m
    return {"out": _adapt(g, fused, p["out_like"])}


def shrink_softmax(match) -> dict:
    """Every dim of the scores above 256, reduced to ``REDUCED`` (the masks, views of the same sizes, with them):
    a block too large to run at its size (a [B, N, 4096, 4096] softmax) is checked on the same computation over
    fewer rows and columns."""
    return {d: REDUCED for d in sorted(set(match.params["x_shape"])) if d > 256}


def resize_softmax(match, sizes: dict):
    """The same match for shapes reduced by ``sizes`` (its scores' shape and the output it replaces)."""
    p = match.params
    sub = lambda s: tuple(sizes.get(d, d) for d in s)  # noqa: E731
    return dataclasses.replace(match, params=dict(p, x_shape=sub(p["x_shape"]),
                                                  out_like=p["out_like"].new_empty(sub(p["out_like"].shape))))


SOFTMAX = register_family(Family("softmax", OP, "softmax", emit_softmax, price_softmax, attention_kwargs,
                                 shrink_softmax, resize_softmax))

__all__ = ["SOFTMAX", "emit_softmax", "kernel_default_tiling", "price_softmax", "softmax_params"]
