"""The MoE backward kernels (``autofuse/npu/kernels/moe_grad.py``) in closed form.

*moe_finalize_routing_grad*: tokens dealt evenly over the vector cores in lockstep, as the forward's model
(:func:`cost_model.moe._rows_cost`): per token and H chunk, one gradient row and k expanded rows loaded, k
rows of ``d_expanded`` stored, and the Vector's passes (casts, ``mul``, ``reduce sum``, ``muls``, the cast
out; ``ceil(chunk / 64)`` repeats each): the busiest of MTE2, MTE3, the Vector unit and the GM port sets the
pace of a token. Per block of tokens the row indices and scales are loaded and the dots stored. With
``accumulate`` every row of ``d_expanded`` is first stored as zeros (rows dealt over the cores) before the
adds, which cost as stores. Every expanded row named is taken to be read from HBM once (a row named twice
is an L2 hit the second time, which the specs do not tell).

*moe_gating_topk_grad*: lockstep tasks of ``lanes`` token rows per core (:func:`cost_model.stream.stream`),
three loads (logits, weight gradients, indices) and one store per task. Per task the Vector repeats are the
kernel's instruction list with tokens on lanes (``R = ceil(lanes / 64)``; a pass over ``r`` expert rows
``r·R``, a reduction over them ``(r - 1)·R``; the transposes ``ceil(16-rounded tile bytes / 512)``, twice
for 4-byte types): the transposes in, the casts, the normalisation (the forward's), with ``renorm`` k
gathers of the chosen scores (compare, select, reduce) and the renormalisation's short rows, the scatter
(compare, select, add per j), the softmax or sigmoid derivative, the cast and transpose out. The iota runs
once, under the first task's load.
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import ceil_div, itemsize, round_up
from cost_model.devices import get_device
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.moe import RING, _rows_cost, _vnch, norm_repeats
from cost_model.stream import block_steps, port, stream
from cost_model.vecutil import block_elems, fits, largest, pad

F32 = "float32"


# ------------------------------------------------------------------------------------------ finalize
def _finalize_specs(k, block, hc, dtype, sdt):
    s = [((pad(block * k, "int32"),), "int32")] * 2 + [((block, pad(k, sdt)), sdt)] * 2
    s += [((block, pad(k, F32)), F32)] * 2
    if sdt != F32:
        s += [((block, pad(k, F32)), F32), ((block, pad(k, sdt)), sdt)]
    s += [((1, pad(hc, dtype)), dtype)] * 2 + [((1, pad(hc, F32)), F32)] * (3 if dtype != F32 else 1)
    s += [((1, 8), F32)] + [((1, pad(hc, dtype)), dtype)] * 2
    return s


def _finalize_cols(dev, H, k, block, dtype, sdt):
    cblk = max(block_elems(dtype), 8)
    ring = lambda h: [((1, round_up(h, cblk)), dtype)] * RING                                # noqa: E731
    ok = lambda h: fits(dev, _finalize_specs(k, block, h, dtype, sdt) + ring(h))              # noqa: E731
    return H if ok(H) else cblk * largest(lambda v: ok(v * cblk), 1, ceil_div(H, cblk))


def _finalize_roof(dev, specs, **_):
    (T, H), dtype = specs[0]
    (R, _), _ = specs[1]
    return (T * H + 2 * R * H) * itemsize(dtype) / dev.hbm_bytes_per_cycle


@register("moe_finalize_routing_grad", _finalize_roof)
def estimate_moe_finalize_routing_grad(dev, specs, accumulate=False, tiling=None):
    (T, H), dtype = specs[0]
    (R, _), _ = specs[1]
    (_, k), sdt = specs[2]
    isz, ssz = itemsize(dtype), itemsize(sdt)
    if T * H == 0:
        return make("moe_finalize_routing_grad", dev, 0.0, 0.0, {}, {}, None, 0.0)
    block = int((tiling or {}).get("block", 0)) or 64
    hc = min(int((tiling or {}).get("cols", 0)) or _finalize_cols(dev, H, k, block, dtype, sdt), H)
    n = min(dev.vector_cores, max(T, R if accumulate else 0))
    nt = min(n, T)
    ntok = ceil_div(T, nt)
    lowp = dtype != F32
    core = 0.0
    busy = {"mte2": 0.0, "mte3": 0.0, "vector": 0.0}
    for c0 in range(0, H, hc):
        he = min(hc, H - c0)
        rep = ceil_div(he, 64)
        # per j: (cast row) mul, reduce, muls (+ cast out); the gradient row's cast; later chunks add their part
        per_j = 5 if lowp else 3
        vec = rep * (k * per_j + (1 if lowp else 0)) + (k if c0 else 0)
        instr = k * (per_j + (1 if c0 else 0)) + (1 if lowp else 0)
        t, l_, s_ = _rows_cost(dev, T, nt, he * isz, 1 + k, k, vec=vec, instr=instr)
        core += t
        busy["mte2"] += l_
        busy["mte3"] += s_
        busy["vector"] += ntok * vec
        if accumulate:
            zt, _, zs = _rows_cost(dev, R, n, he * isz, 0, 1)
            core += zt
            busy["mte3"] += zs
    if accumulate:
        dup = ceil_div(pad(hc, dtype) * isz, 256)
        core += dup
        busy["vector"] += dup
    nblk = ceil_div(ntok, block)
    idx_b = min(block, ntok) * k * (4 + ssz)
    out_b = min(block, ntok) * k * ssz
    core += nblk * (max(idx_b / dev.rates["GM->UB"], nt * idx_b / dev.hbm_bytes_per_cycle)
                    + max(out_b / dev.rates["UB->GM"], nt * out_b / dev.hbm_bytes_per_cycle))
    if sdt != F32:
        cast = 2 * nblk * ceil_div(min(block, ntok) * pad(k, F32), 64)
        core += cast
        busy["vector"] += cast
    zero_b = R * H * isz if accumulate else 0
    rows_in = T * k * H * isz + T * H * isz
    hbm = rows_in + T * k * (4 + ssz) + T * k * H * isz + T * k * ssz + zero_b
    nbytes = {"GM->UB": rows_in + T * k * (4 + ssz), "UB->GM": T * k * H * isz + T * k * ssz + zero_b}
    return make("moe_finalize_routing_grad", dev, core, hbm, nbytes, busy, {"block": block, "cols": hc},
                _finalize_roof(dev, specs))


# ------------------------------------------------------------------------------------------ gating
def _gating_specs(E, k, lanes, dtype, gdt):
    L = pad(lanes, F32)
    s = [((lanes, pad(E, dtype)), dtype)] * 2 + [((lanes, pad(k, gdt)), gdt)] * 2
    s += [((lanes, pad(k, "int32")), "int32")] * 2 + [((E, L), F32)] * 4 + [((k, L), F32)] * 3 + [((2, L), F32)]
    return s + [((lanes, pad(E, dtype)), dtype)] * 2


def _lanes(dev, T, E, k, dtype, gdt):
    n = max(1, min(dev.vector_cores, T))
    per_core = ceil_div(T, n)
    top = largest(lambda v: fits(dev, _gating_specs(E, k, 8 * v, dtype, gdt)), 1, 1 << 12)
    if top < 1:
        raise ValueError(f"moe_gating_topk_grad: {E} experts do not fit UB on {dev.name}")
    return int(min(8 * top, max(8, round_up(ceil_div(per_core, 4), 8)), round_up(per_core, 8))), 8 * top


def _gating_task(ke, E, k, dtype, gdt, norm, renorm, eps, scale):
    """(Vector repeats, instructions) of one task of ``ke`` lanes."""
    R = np.ceil(ke / 64)
    ew = lambda r: r * R                                    # noqa: E731
    isz = itemsize(dtype)
    v, ins = _vnch(ke, E, isz) + _vnch(ke, k, itemsize(gdt)) + _vnch(ke, k, 4) + ew(k), 4
    if dtype != F32:
        v, ins = v + ew(E), ins + 1
    if gdt != F32:
        v, ins = v + ew(k), ins + 1
    nv, ni = norm_repeats(norm, E, ew)
    v, ins = v + nv, ins + ni
    if renorm:
        v = v + k * ew(3 * E - 1) + 2 * ew(k - 1) + 3 * ew(k) + ew(1) * (3 if eps != 0 else 2)
        ins += 3 * k + 6 + (eps != 0)
    if scale != 1:
        v, ins = v + ew(k), ins + 1
    v, ins = v + ew(E) + 3 * k * ew(E), ins + 1 + 3 * k          # scatter
    if norm == "softmax":
        v, ins = v + ew(4 * E - 1), ins + 4
    elif norm == "sigmoid":
        v, ins = v + ew(4 * E), ins + 4
    if dtype != F32:
        v, ins = v + ew(E), ins + 1
    v = v + _vnch(E, ke, isz)
    return v, ins + 1 + 4                                   # + the transpose out, three loads and the store


def _gating_model(dev, T, E, k, dtype, gdt, norm, renorm, eps, scale, lanes):
    isz, gsz = itemsize(dtype), itemsize(gdt)
    n = max(1, min(dev.vector_cores, T))
    worst, tot, _ = block_steps(T, n, lanes)
    vec, ins = _gating_task(worst, E, k, dtype, gdt, norm, renorm, eps, scale)
    row_in = E * isz + k * (gsz + 4)
    load_b = worst * row_in
    store_b = worst * E * isz
    core, busy = stream(dev, load_b, port(dev, 0 * tot, tot * row_in), vec, store_b,
                        tot * E * isz / dev.hbm_bytes_per_cycle, np.full(worst.shape, float(ins)))
    pro = np.ceil(round_up(lanes, 8) / 64) * E + 1          # the iota, under the first task's load
    first_load = max(load_b[0] / dev.rates["GM->UB"], float(tot[0] * row_in / dev.hbm_bytes_per_cycle))
    core += max(0.0, float(pro) - first_load)
    busy["vector"] += pro
    hbm = float(tot.sum() * (row_in + E * isz))
    nbytes = {"GM->UB": float(tot.sum() * row_in), "UB->GM": float(tot.sum() * E * isz)}
    return core, hbm, nbytes, busy


@cached
def _gating_search(device, T, E, k, dtype, gdt, norm, renorm, eps, scale):
    dev = get_device(device)
    default, top = _lanes(dev, T, E, k, dtype, gdt)
    per_core = ceil_div(T, max(1, min(dev.vector_cores, T)))
    best = None
    for lanes in dict.fromkeys([default] + [v for v in (round_up(ceil_div(per_core, j), 8) for j in (1, 2, 8))
                                            if v <= top]):
        res = _gating_model(dev, T, E, k, dtype, gdt, norm, renorm, eps, scale, lanes)
        if best is None or kernel_cycles(dev, *res[:3]) < kernel_cycles(dev, *best[0][:3]):
            best = (res, lanes)
    return best


def _gating_roof(dev, specs, **_):
    (shape, dtype) = specs[0]
    (_, gdt) = specs[1]
    T, E = math.prod(shape[:-1]), shape[-1]
    k = specs[1][0][-1]
    return (2 * T * E * itemsize(dtype) + T * k * (itemsize(gdt) + 4)) / dev.hbm_bytes_per_cycle


@register("moe_gating_topk_grad", _gating_roof)
def estimate_moe_gating_topk_grad(dev, specs, k=None, norm="softmax", renorm=False, eps=1e-20,
                                  routed_scaling_factor=1.0, tiling=None):
    (shape, dtype), (gshape, gdt) = specs[0], specs[1]
    E, T = shape[-1], math.prod(shape[:-1])
    k = int(k if k is not None else gshape[-1])
    if T == 0:
        return make("moe_gating_topk_grad", dev, 0.0, 0.0, {}, {}, None, 0.0)
    args = (T, E, k, dtype, gdt, norm, bool(renorm), float(eps), float(routed_scaling_factor))
    if tiling:
        lanes = int(tiling["lanes"])
        res = _gating_model(dev, *args, lanes)
    else:
        res, lanes = _gating_search(dev.name, *args)
    return make("moe_gating_topk_grad", dev, *res, {"lanes": lanes}, _gating_roof(dev, specs))


__all__ = ["estimate_moe_finalize_routing_grad", "estimate_moe_gating_topk_grad"]
