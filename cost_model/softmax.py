"""Softmax (``autofuse/npu/kernels/softmax.py``): tasks of ``block`` rows (or lanes) x ``chunk`` of C.

Per task, the Vector passes of the kernel (fp32 statistics; fp16/bf16 cast in and out):

* one pass (``chunk >= C``): cast, max + brcb, sub, exp, sum + brcb, div, cast — 3 elementwise passes
  (1 in fp32) and 4 per-row passes;
* online (``chunk < C``): pass 1 per chunk (cast, max, correction of the running statistics, sub, exp,
  sum), pass 2 per chunk (cast, sub, exp, div, cast, store). Pass 2 reloads the chunks; they hit L2 when
  the step's rows (and the outputs written meanwhile) fit in it.

Repeat counts follow ``Group.repeats``/``row_repeats``: an elementwise pass over ``rows x pad(cols)``
costs ``ceil(rows·pad(cols)/64)`` fp32 repeats, a per-row pass ``rows·ceil(cols/64)``. The tasks run
through :func:`cost_model.stream.stream`; the tiling search tries the row blocks that fit UB.
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import ceil_div, itemsize, round_up
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.devices import get_device
from cost_model.stream import block_steps, port, stream
from cost_model.vecutil import fits, largest, pad

STAT = 8


def _specs(dtype, rowwise, block, chunk):
    shape = (block, pad(chunk, dtype)) if rowwise else (chunk, pad(block, dtype))
    stat = (block, STAT) if rowwise else (1, pad(block, dtype))
    specs = [(shape, dtype)] * 2
    if dtype != "float32":
        specs += [(shape, "float32")] + [(shape, dtype)] * 2
    return specs + [(stat, "float32")] * 3


def _split_lanes(kept, n, block, period):
    """Per core: the extents of its blocks (``tiles.split_blocks``: even shares, cut at period boundaries)."""
    base, rem = divmod(kept, n)
    out, u = [], 0
    for c in range(n):
        q = base + (c < rem)
        s, e = u, u + q
        u += q
        ext = []
        b = s
        while b < e:
            stop = min(e, b + block)
            if period:
                stop = min(stop, (b // period + 1) * period)
            ext.append(stop - b)
            b = stop
        out.append(ext)
    return out


def _steps(kept, n, block, rowwise, inner):
    """(worst extent, total extent, active cores) per lockstep step."""
    if rowwise or (inner % block == 0 and (kept // n) % inner == 0 and kept % n == 0):
        return block_steps(kept, n, block)
    per = _split_lanes(kept, n, block, inner)
    S = max(len(p) for p in per)
    ext = np.zeros((n, S))
    for c, p in enumerate(per):
        ext[c, :len(p)] = p
    return ext.max(axis=0), ext.sum(axis=0), (ext > 0).sum(axis=0)


def _model(dev, dtype, outer, C, inner, block, chunk):
    isz = itemsize(dtype)
    rowwise = inner == 1
    kept = outer * inner
    n = min(dev.vector_cores, kept)
    lowp = dtype != "float32"
    worst, tot, act = _steps(kept, n, block, rowwise, inner)
    S = len(worst)
    nchunks = ceil_div(C, chunk)

    def counts(ke, cv):
        if rowwise:
            return (np.ceil(ke * pad(cv, dtype) / 64), ke * ceil_div(cv, 64), np.ceil(ke * STAT / 64),
                    np.ceil(ke / 8))
        pk = round_up(ke, 32 // isz)
        return np.ceil(cv * pk / 64), cv * np.ceil(pk / 64), np.ceil(pk / 64), np.zeros_like(ke)

    L2 = dev.l2_bytes
    tasks = []        # per task kind: arrays over steps (load_b, load_hit, load_miss, vec, store_b, instr)
    step_bytes = tot * C * isz
    nb = 1 if rowwise else 0          # brcb instructions per reduction
    if nchunks == 1:
        ew, row, small, br = counts(worst, C)
        vec = (3 if lowp else 1) * ew + 4 * row + 2 * br
        instr = (2 if lowp else 0) + 5 + 2 * nb + 2
        tasks.append((worst * C * isz, 0 * tot, tot * C * isz, vec, worst * C * isz, tot * C * isz, instr))
    else:
        for k in range(nchunks):                           # pass 1
            cv = min(chunk, C - k * chunk)
            ew, row, small, br = counts(worst, cv)
            vec = (1 if lowp else 0) * ew + ew + 3 * row + 2 * br + (5 * small if k else 0)
            instr = (1 if lowp else 0) + 4 + 2 * nb + (5 if k else 0) + 1
            tasks.append((worst * cv * isz, 0 * tot, tot * cv * isz, vec, 0 * tot, 0 * tot, instr))
        for k in range(nchunks):                           # pass 2: reloads
            cv = min(chunk, C - k * chunk)
            ew, row, small, br = counts(worst, cv)
            vec = (2 if lowp else 0) * ew + ew + 2 * row
            instr = (2 if lowp else 0) + 3 + 2
            resident = step_bytes + tot * k * chunk * isz <= L2
            b = tot * cv * isz
            tasks.append((worst * cv * isz, np.where(resident, b, 0.0), np.where(resident, 0.0, b), vec,
                          worst * cv * isz, b, instr))
    # interleave: step-major, task-minor
    cols = [np.stack([np.broadcast_to(np.asarray(t[i], float), (S,)) for t in tasks], axis=1).reshape(-1)
            for i in range(7)]
    load_b, hit, miss, vec, store_b, store_tot, instr = cols
    core, busy = stream(dev, load_b, port(dev, hit, miss), vec, store_b, store_tot / dev.hbm_bytes_per_cycle,
                        instr)
    hbm = float(miss.sum() + store_tot.sum())
    nbytes = {"GM->UB": float((hit + miss).sum()), "UB->GM": float(store_tot.sum())}
    return core, hbm, nbytes, busy


def _dims(x, dim):
    shape, dtype = x
    nd = len(shape)
    if nd == 0:
        raise ValueError("softmax: x is a 0-d tensor")
    dim %= nd
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:]), dtype


def _candidates(dev, dtype, outer, C, inner):
    rowwise = inner == 1
    kept = outer * inner
    n = min(dev.vector_cores, kept)
    per_core = ceil_div(kept, n)
    step = 64
    out = []
    if rowwise:
        if fits(dev, _specs(dtype, True, 1, C)):
            chunks = [C]
        else:
            top = step * largest(lambda k: fits(dev, _specs(dtype, True, 1, k * step)), 1, ceil_div(C, step))
            chunks = [top] + ([top // 2 // step * step] if top // 2 >= step else [])
        for chunk in chunks:
            bmax = largest(lambda b: fits(dev, _specs(dtype, True, b, chunk)), 1, per_core)
            if bmax < 1:
                continue
            for j in (1, 2, 4):
                b = min(bmax, ceil_div(per_core, j))
                if {"block": b, "chunk": chunk} not in out:
                    out.append({"block": b, "chunk": chunk})
    else:
        for block in sorted({min(inner, per_core, b) for b in (256, 128, 64, 32, 16, 8)}, reverse=True):
            chunk = largest(lambda k: fits(dev, _specs(dtype, False, block, k)), 1, C)
            if chunk >= 1:
                out.append({"block": block, "chunk": chunk})
    if not out:
        raise ValueError(f"softmax: no tile of {dtype} fits UB on {dev.name}")
    return out


@cached
def _search(device, dtype, outer, C, inner):
    dev = get_device(device)
    best = None
    for t in _candidates(dev, dtype, outer, C, inner):
        res = _model(dev, dtype, outer, C, inner, t["block"], t["chunk"])
        cost = kernel_cycles(dev, *res[:3])
        if best is None or cost < best[0]:
            best = (cost, t, res)
    return best[1], best[2]


def _roofline(dev, specs, dim=-1, tiling=None):
    (shape, dtype) = specs[0]
    N = math.prod(shape)
    vec = N * 5 / (dev.vector_bytes_per_cycle / 4) / dev.vector_cores      # five fp32 passes per element
    return max(vec, 2 * N * itemsize(dtype) / dev.hbm_bytes_per_cycle)


@register("softmax", _roofline)
def estimate_softmax(dev, specs, dim=-1, tiling=None):
    outer, C, inner, dtype = _dims(specs[0], dim)
    if tiling is None:
        t, res = _search(dev.name, dtype, outer, C, inner)
    else:
        t = {"block": int(tiling.get("block", tiling.get("rows", 0))), "chunk": min(int(tiling.get("chunk", C)), C)}
        res = _model(dev, dtype, outer, C, inner, t["block"], t["chunk"])
    core, hbm, nbytes, busy = res
    N = outer * C * inner
    return make("softmax", dev, core, hbm, nbytes, busy, dict(t), _roofline(dev, specs, dim), 5.0 * N)


__all__ = ["estimate_softmax"]
