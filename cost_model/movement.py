"""Data movement (``autofuse/npu/kernels/movement.py``): copy, cat, permute, gather, as task streams.

Tilings are searched (the kernel's default among the candidates, ties kept): row tiles of about 1, 2, 4
or 8 per core (none under 8 KB) or the largest that fits; transpose tiles of 64..256 a side; gather index
blocks of 64 or 256.

*copy / cat / permute keeping the last dim*: row tiles ``rows x cols`` streamed GM -> UB -> GM on all
vector cores (flat along the columns when there are fewer rows than cores); jobs (the tensors of a cat)
run one after another. No Vector work: a task is one load and one store, double-buffered.

*permute moving the last dim*: tiles ``a x l`` loaded, transposed on the Vector unit (512 B per repeat;
two passes for 4-byte and 1-byte elements), stored; the items are split in contiguous runs over cores.

*gather*: per core, blocks of 64 indices; every index is one row copy in (MTE2, after the index block
arrives) and out (MTE3) through a ring of four row buffers. Repeated indices hit L2; the model has only
shapes, so it assumes indices drawn uniformly from the table (``V·(1 - exp(-T/V))`` distinct rows).
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import MIN_TILE_BYTES, ceil_div, itemsize, round_up
from cost_model.devices import get_device
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.stream import port, stream
from cost_model.vecutil import block_elems, coalesce_perm, copy_tile, fits, largest, transpose_default, transpose_tiles
from cost_model.vector import _rows_cut


GATHER_RING = 4                # row buffers the gather kernel cycles through


def _rows_geometry(dev, jobs, dtype):
    cblk = block_elems(dtype)
    units = max(NR if NR >= dev.vector_cores else NR * ceil_div(Dc, cblk) for NR, _, Dc in jobs)
    n = max(1, min(dev.vector_cores, units))
    maxc = max(Dc for _, _, Dc in jobs)
    total = sum(NR * Dc for NR, _, Dc in jobs)
    return n, maxc, total


def _rows_plan(dev, jobs, dtype, tiling):
    n, maxc, total = _rows_geometry(dev, jobs, dtype)
    if tiling:
        r, c = int(tiling.get("rows", 1)), int(tiling.get("cols", maxc))
    else:       # the kernel's default: about four tiles per core, at least 8 KB
        r, c = copy_tile(dev, dtype, maxc, max(ceil_div(total, n * 4), MIN_TILE_BYTES // itemsize(dtype)))
    return n, r, c


def _rows_model(dev, jobs, dtype, tiling):
    isz = itemsize(dtype)
    n, r, c = _rows_plan(dev, jobs, dtype, tiling)
    cblk = block_elems(dtype)
    worst, tot = [], []
    for NR, D, Dc in jobs:
        if NR >= n:
            re, rt, _ = _rows_cut(NR, n, r, D)
            cws = np.array([min(c, Dc - c0) for c0 in range(0, Dc, c)], dtype=float)
            worst.append(np.outer(re, cws).reshape(-1))
            tot.append(np.outer(rt, cws).reshape(-1))
        else:
            ce, ct, _ = _rows_cut(NR * Dc, n, c, Dc, align=cblk)
            worst.append(ce)
            tot.append(ct)
    worst = np.concatenate(worst) * isz
    tot = np.concatenate(tot) * isz
    core, busy = stream(dev, worst, port(dev, 0 * tot, tot), np.zeros_like(worst), worst,
                        tot / dev.hbm_bytes_per_cycle, np.full(len(worst), 2.0))
    hbm = 2 * float(tot.sum())
    return core, hbm, {"GM->UB": float(tot.sum()), "UB->GM": float(tot.sum())}, busy, {"rows": r, "cols": c}


@cached
def _rows_search(device, jobs, dtype):
    """Tiles of 1, 2, 4, 8 per core (none under 8 KB) and the largest that fits: the cheapest, ties to the
    kernel's default."""
    dev = get_device(device)
    n, maxc, total = _rows_geometry(dev, jobs, dtype)
    floor = MIN_TILE_BYTES // itemsize(dtype)
    best = _rows_model(dev, jobs, dtype, None)
    tried = {(best[4]["rows"], best[4]["cols"])}
    for target in [max(ceil_div(total, n * k), floor) for k in (1, 2, 8)] + [1 << 30]:
        r, c = copy_tile(dev, dtype, maxc, target)
        if (r, c) in tried:
            continue
        tried.add((r, c))
        res = _rows_model(dev, jobs, dtype, {"rows": r, "cols": c})
        if kernel_cycles(dev, *res[:3]) < kernel_cycles(dev, *best[:3]):
            best = res
    return best


def _row_estimate(kernel, dev, jobs, dtype, tiling, roof):
    if tiling is None:
        core, hbm, nbytes, busy, t = _rows_search(dev.name, tuple(jobs), dtype)
    else:
        core, hbm, nbytes, busy, t = _rows_model(dev, jobs, dtype, tiling)
    return make(kernel, dev, core, hbm, nbytes, busy, dict(t), roof, 0.0)


def _io_roof(dev, nbytes):
    return 2 * nbytes / dev.hbm_bytes_per_cycle


@register("copy", lambda dev, specs, **p: _io_roof(dev, math.prod(specs[0][0]) * itemsize(specs[0][1])))
def estimate_copy(dev, specs, tiling=None):
    shape, dtype = specs[0]
    N = math.prod(shape)
    return _row_estimate("copy", dev, [(1, 1, N)], dtype, tiling, _io_roof(dev, N * itemsize(dtype)))


def _cat_roof(dev, specs, dim=0, tiling=None):
    return _io_roof(dev, sum(math.prod(s) * itemsize(d) for s, d in specs if s is not None))


@register("cat", _cat_roof)
def estimate_cat(dev, specs, dim=0, tiling=None):
    ts = [s for s in specs if s is not None]
    shape0, dtype = ts[0]
    nd = len(shape0)
    dim %= nd
    outer = math.prod(shape0[:dim])
    inners = [math.prod(s[dim:]) for s, _ in ts]
    jobs = [(outer, outer, i) for i in inners if i > 0]
    return _row_estimate("cat", dev, jobs, dtype, tiling, _cat_roof(dev, specs))


@cached
def _transpose_search(device, s, q, dtype):
    """The default tile and the square and oblong tiles of 32..256 that fit UB: the cheapest."""
    dev = get_device(device)
    best = _transpose_model(dev, s, q, dtype, None)
    SA, SL = s[q[-1]], s[len(s) - 1]
    tried = {(best[4]["a"], best[4]["l"])}
    for a, l_ in ((64, 64), (256, 128), (128, 256), (256, 256), (64, 256), (256, 64)):
        a, l_ = min(a, SA), min(l_, SL)
        if (a, l_) in tried or not fits(dev, transpose_tiles(a, l_, dtype)):
            continue
        tried.add((a, l_))
        res = _transpose_model(dev, s, q, dtype, {"a": a, "l": l_})
        if kernel_cycles(dev, *res[:3]) < kernel_cycles(dev, *best[:3]):
            best = res
    return best


def _transpose_model(dev, s, q, dtype, tiling):
    isz = itemsize(dtype)
    m = len(s)
    A, L = q[-1], m - 1
    SA, SL = s[A], s[L]
    if tiling:
        a, l_ = int(tiling.get("a", 128)), int(tiling.get("l", 128))
    else:
        a, l_ = transpose_default(dev, SA, SL, dtype)
    others = math.prod(s[d] for d in range(m) if d not in (A, L))
    na, nl = ceil_div(SA, a), ceil_div(SL, l_)
    items = others * na * nl
    n = min(dev.vector_cores, items)
    steps = ceil_div(items, n)
    avg = SA * SL / (na * nl)                                # mean elements of an item
    full = a * l_
    passes = 1 if isz == 2 else 2
    vec = passes * ceil_div(round_up(a, 16) * round_up(l_, 16) * isz, 512)
    act = np.array([min(n, items - w * n) for w in range(steps)], dtype=float)
    worst = np.full(steps, float(full * isz))
    tot = act * avg * isz
    core, busy = stream(dev, worst, port(dev, 0 * tot, tot), np.full(steps, float(vec)), worst,
                        tot / dev.hbm_bytes_per_cycle, np.full(steps, 3.0))
    N = math.prod(s)
    return core, 2.0 * N * isz, {"GM->UB": N * isz, "UB->GM": N * isz}, busy, {"a": a, "l": l_}


@register("permute", lambda dev, specs, **p: _io_roof(dev, math.prod(specs[0][0]) * itemsize(specs[0][1])))
def estimate_permute(dev, specs, dims=None, tiling=None):
    shape, dtype = specs[0]
    nd = len(shape)
    dims = tuple(range(nd))[::-1] if dims is None else tuple(int(d) % max(nd, 1) for d in dims)
    N = math.prod(shape)
    roof = _io_roof(dev, N * itemsize(dtype))
    s, q = coalesce_perm(tuple(shape), dims)
    m = len(s)
    if m <= 1 or q == list(range(m)):
        return _row_estimate("permute", dev, [(1, 1, N)], dtype, tiling, roof)
    if q[-1] == m - 1:
        lead = math.prod(s[d] for d in q[:-2])
        D, Dc = s[q[-2]], s[m - 1]
        return _row_estimate("permute", dev, [(lead * D, D, Dc)], dtype, tiling, roof)
    if tiling is None:
        core, hbm, nbytes, busy, t = _transpose_search(dev.name, tuple(s), tuple(q), dtype)
    else:
        core, hbm, nbytes, busy, t = _transpose_model(dev, s, q, dtype, tiling)
    return make("permute", dev, core, hbm, nbytes, busy, dict(t), roof, 0.0)


def _gather_roof(dev, specs, tiling=None):
    (ts, dt), (ids, idt) = specs[0], specs[1]
    T = math.prod(ids)
    return (2 * T * math.prod(ts[1:]) * itemsize(dt) + T * itemsize(idt)) / dev.hbm_bytes_per_cycle


@register("gather", _gather_roof)
def estimate_gather(dev, specs, tiling=None):
    (tshape, dtype), (ishape, idt) = specs[0], specs[1]
    tshape = (tshape[0], math.prod(tshape[1:]))           # rows of the trailing dims
    if tiling is None:
        res = _gather_search(dev.name, tuple(tshape), dtype, tuple(ishape), idt)
    else:
        t = {"rows": int(tiling.get("rows", 64)), "cols": min(int(tiling.get("cols", tshape[1])), tshape[1])}
        res = _gather_model(dev, tshape, dtype, ishape, idt, t["rows"], t["cols"])
    core, hbm, nbytes, busy, t = res
    return make("gather", dev, core, hbm, nbytes, busy, dict(t), _gather_roof(dev, specs), 0.0)


def _gather_spec(dtype, k, hc):
    return [((k,), "int32")] * 2 + [((1, round_up(hc, block_elems(dtype))), dtype)] * GATHER_RING


@cached
def _gather_search(device, tshape, dtype, ishape, idt):
    """Index blocks of 64 (the kernel's default) or 256, rows whole or in the widest chunks that fit (rows
    are not cut further: the simulator charges no DMA setup, so narrower copies would only look cheaper)."""
    dev = get_device(device)
    H = tshape[1]
    cblk = block_elems(dtype)
    best = None
    for k in (64, 256):
        top = H if fits(dev, _gather_spec(dtype, k, H)) else \
            cblk * largest(lambda v: fits(dev, _gather_spec(dtype, k, v * cblk)), 1, ceil_div(H, cblk))
        if top < 1:
            continue
        res = _gather_model(dev, tshape, dtype, ishape, idt, k, min(top, H))
        if best is None or kernel_cycles(dev, *res[:3]) < kernel_cycles(dev, *best[:3]):
            best = res
    return best


def _gather_model(dev, tshape, dtype, ishape, idt, k, hc):
    V, H = tshape
    isz = itemsize(dtype)
    T = math.prod(ishape)
    n = min(dev.vector_cores, T)
    per_core = ceil_div(T, n)
    nch = ceil_div(H, hc)
    # distinct rows under uniformly drawn indices; the rest of the row reads hit L2
    uniq = V * (1.0 - math.exp(-T / V)) if V else 0.0
    miss_frac = min(1.0, uniq / T)
    row_b = hc * isz
    # one lockstep row copy: n cores load a row each (hits and misses share the port), then store it
    p_load = port(dev, n * row_b * (1 - miss_frac), n * row_b * miss_frac)
    p_store = n * row_b / dev.hbm_bytes_per_cycle
    load = max(row_b / dev.rates["GM->UB"], float(p_load))
    store = max(row_b / dev.rates["UB->GM"], p_store)
    per_row = max(load, store, float(p_load) + p_store, 2.0 * dev.scalar_issue_cycles)
    rows = per_core * nch
    nblocks = ceil_div(per_core, k)
    idx_load = max(k * 4 / dev.rates["GM->UB"], n * k * 4 / dev.hbm_bytes_per_cycle)
    core = rows * per_row + load + store + idx_load
    hbm = uniq * H * isz + T * H * isz + T * itemsize(idt)
    busy = {"mte2": rows * load + nblocks * idx_load, "mte3": rows * store, "scalar": 2 * rows}
    nbytes = {"GM->UB": T * H * isz + T * 4, "UB->GM": T * H * isz}
    return core, hbm, nbytes, busy, {"rows": k, "cols": hc}


__all__ = ["estimate_cat", "estimate_copy", "estimate_gather", "estimate_permute"]
