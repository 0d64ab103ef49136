"""Softmax (``autofuse/npu/kernels/softmax.py``): tasks of ``block`` rows (or lanes) x ``chunk`` of C.

Per task, the Vector passes of the kernel (fp32 statistics; fp16/bf16 cast in and out):

* prologue: cast in (fp16/bf16 x), ``mul`` by the scale, the mask (a cast of an fp16/bf16 additive mask
  over the mask tile, then one select or add: elementwise when the mask tile is the work tile's shape,
  per row when it broadcasts; with ``mask_add_dtype``, a 16-bit mask added in its dtype as eager adds it, no
  cast of the mask but the scores cast down and the sum cast back up, two elementwise passes around the add);
* one pass (``chunk >= C``): prologue, max + brcb, sub, exp, sum + brcb, div (log: log of the sum, sub),
  cast out — plus two selects on the statistics for ``empty_rows="zero"``; for ``inf_rows="lse"``, the
  scores rounded to fp16/bf16 x's dtype after the mask (two elementwise casts in the prologue) and the
  statistic ``lse - m`` (``lse = m + log s`` cast to x's dtype and back: log, add, two casts for fp16/bf16, sub,
  a select of 0 on a row whose max is +inf) and, not log, its ``exp``, which the division reads;
* online (``chunk < C``): pass 1 per chunk (prologue, max, the max in use, correction of the running
  statistics, sub, exp, sum; after the last chunk the empty-sum select, log's log of the sum and the lse
  statistics), pass 2 per chunk (prologue, sub max, exp and div or, log, sub of the log sum, cast, store). Pass 2
  reloads the chunks; they hit L2 when the step's rows (and the outputs written meanwhile) fit in it.

Repeat counts follow ``Group.repeats``/``row_repeats``: an elementwise pass over ``rows x pad(cols)``
costs ``ceil(rows·pad(cols)/64)`` fp32 repeats, a per-row pass ``rows·ceil(cols/64)``. The tasks run
through :func:`cost_model.stream.stream`; the tiling search tries the row blocks that fit UB.

**The mask stream.** Blocks never cross a run of the mask (:func:`_axis_map`), so each core's tile reads
one strided block of it per chunk: its GM→UB bytes are exact. Which of those loads reach HBM is decided
region by region as the simulator's L2 does: the cores of one lockstep load that read the same region
share one miss; a region read by an earlier task hits while the bytes the kernel brought into L2 since
(x and mask misses, y written through) leave room for it. A ``[B, 1, 1, S]`` padding mask thus costs its
size in HBM once, a ``[S, S]`` causal mask under ``[B, N, S, S]`` scores once per group of cores in step.
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import ceil_div, itemsize, round_up, unique
from cost_model.devices import ITEMSIZE, get_device
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.stream import block_steps, port, stream
from cost_model.vecutil import largest, pad

STAT = 8
F32 = "float32"


def _specs(dtype, rowwise, block, chunk, out=None, mask=None, log=False, one_pass=True):
    out = out or dtype
    shape = (block, pad(chunk, dtype)) if rowwise else (chunk, pad(block, dtype))
    stat = (block, STAT) if rowwise else (1, pad(block, dtype))
    specs = [(shape, dtype)] * 2
    if dtype != F32:
        specs += [(shape, F32)] * (1 if out != F32 else 2)
    if out != F32:
        specs += [(shape, out)] * 2
    if log and one_pass:
        specs += [(shape, F32)]
    if mask is not None:
        mdt, along_block, along_c = mask[:3]
        rows, cols = (block if along_block else 1), (chunk if along_c else 1)
        ms = (rows, pad(cols, mdt)) if rowwise else (cols, pad(rows, mdt))
        add = mask[3] if len(mask) > 3 else None
        specs += [(ms, mdt)] * 2 + ([(shape, add)] if add else [(ms, F32)] if mdt not in ("bool", F32) else [])
    return specs + [(stat, F32)] * 4


def _ub_fits(dev, dtype, rowwise, out=None, mask=None, log=False):
    """``ok(block, chunk, one_pass)``: whether :func:`_specs` fits UB, summed as :func:`cost_model.vecutil.fits`
    sums it (each tile at the UB alignment), for the tile searches' many probes: the tiles' item sizes taken once,
    their elements from the same pads, without building the list."""
    out = out or dtype
    f32 = ITEMSIZE[F32]
    main = [ITEMSIZE[dtype]] * 2                       # the item sizes of the [block x chunk] tiles, in order
    if dtype != F32:
        main += [f32] * (1 if out != F32 else 2)
    if out != F32:
        main += [ITEMSIZE[out]] * 2
    if mask is not None:
        mdt, along_block, along_c = mask[:3]
        add = mask[3] if len(mask) > 3 else None      # added in its 16-bit dtype: a work tile of that dtype
        msz = [ITEMSIZE[mdt]] * 2 + ([] if add else [f32] if mdt not in ("bool", F32) else [])
        add_sz = ITEMSIZE[add] if add else 0
    align, cap = dev.align["UB"], dev.buffers["UB"]

    def ok(block, chunk, one_pass):
        used = 0
        tile = block * pad(chunk, dtype) if rowwise else chunk * pad(block, dtype)
        for isz in main:
            used = -(-used // align) * align + tile * isz
        if log and one_pass:
            used = -(-used // align) * align + tile * f32
        if mask is not None:
            rows, cols = (block if along_block else 1), (chunk if along_c else 1)
            mt = rows * pad(cols, mdt) if rowwise else cols * pad(rows, mdt)
            for isz in msz:
                used = -(-used // align) * align + mt * isz
            if add_sz:
                used = -(-used // align) * align + tile * add_sz
        stat = block * STAT if rowwise else pad(block, dtype)
        for _ in range(4):
            used = -(-used // align) * align + stat * f32
        return used <= cap
    return ok


def _axis_map(dims, mdims):
    """(run length, step 0|1, mask strides) of flat indices over ``dims`` into the mask's ``mdims``: within a
    run of consecutive indices the mask index is constant (step 0) or advances by one (step 1)."""
    run, step = 1, None
    for d, md in zip(reversed(dims), reversed(mdims)):
        if d > 1:
            s = int(md != 1)
            if step is not None and s != step:
                break
            step, run = s, run * d
    strides = [int(math.prod(mdims[i + 1:])) if mdims[i] != 1 else 0 for i in range(len(mdims))]
    return run, 1 if step is None else step, strides


def _map(idx, dims, strides):
    if not dims:
        return np.zeros_like(idx)
    return sum(k * s for k, s in zip(np.unravel_index(idx, dims), strides))


def _blocks(kept, n, block, period):
    """Per-core (start, extent) arrays [n, steps] (extent 0: idle), as ``tiles.split_blocks`` cuts them: even
    contiguous shares, each cut into blocks of ``block`` that restart at every multiple of ``period``."""
    sizes = kept // n + (np.arange(n) < kept % n)
    bounds = np.concatenate([[0], sizes.cumsum()])
    cuts = np.arange(0, kept, period) if period else np.zeros(1, dtype=np.int64)
    seg = unique(np.concatenate([bounds[:-1], cuts]))               # segment starts
    seg_end = np.concatenate([seg[1:], [kept]])
    nblk = -(-(seg_end - seg) // block)
    first = (nblk.cumsum() - nblk).repeat(nblk)
    bstart = seg.repeat(nblk) + block * (np.arange(int(nblk.sum())) - first)
    bext = np.minimum(bstart + block, seg_end.repeat(nblk)) - bstart
    core = np.searchsorted(bounds, bstart, side="right") - 1
    step = np.arange(len(core)) - np.searchsorted(core, core, side="left")
    start = np.zeros((n, int(step.max()) + 1), dtype=np.int64)
    ext = np.zeros_like(start)
    start[core, step], ext[core, step] = bstart, bext
    return start, ext


class _Layout:
    """The tensor viewed [outer, C, inner] and, with a mask, where each core's tile reads it."""

    def __init__(self, shape, dim, mshape, mdtype, add_dtype=None):
        nd = len(shape)
        if nd == 0:
            raise ValueError("softmax: x is a 0-d tensor")
        dim %= nd
        self.outer, self.C, self.inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])
        self.rowwise = self.inner == 1
        self.mask = None
        self.period = None
        if mshape is not None:
            full = (1,) * (nd - len(mshape)) + tuple(mshape)
            if len(full) != nd or any(m not in (1, d) for m, d in zip(full, shape)):
                raise ValueError(f"softmax: mask {list(mshape)} does not broadcast to x {list(shape)}")
            self.odims, self.idims = tuple(shape[:dim]), tuple(shape[dim + 1:])
            self.ostr = _axis_map(self.odims, full[:dim])[2]
            run, step, self.istr = _axis_map(self.idims, full[dim + 1:])
            if self.rowwise:
                run, step, _ = _axis_map(self.odims, full[:dim])
            self.period = run
            # a 16-bit mask added in its dtype: the kernel's mask spec carries that dtype
            self.mask = (mdtype, step == 1, full[dim] != 1) + ((add_dtype,) if add_dtype else ())
            self.msz = itemsize(mdtype)


def _mask_keys(L, start, ext, ke_m):
    """Per (core, step): an integer naming the mask region the tile reads (chunks aside), -1 when idle."""
    if L.rowwise:
        row = _map(start, L.odims, L.ostr)
        key = row * (L.outer + 1) + ke_m
    else:
        o, lane = np.divmod(start, L.inner)
        key = (_map(o, L.odims, L.ostr) * (L.inner + 1) + _map(lane, L.idims, L.istr)) * (L.inner + 1) + ke_m
    return np.where(ext > 0, key, -1)


def _model(dev, dtype, L, block, chunk, out, log, zero, scaled, lse=False):
    isz, osz = itemsize(dtype), itemsize(out)
    rowwise, C, inner = L.rowwise, L.C, L.inner
    kept = L.outer * inner
    n = min(dev.vector_cores, kept)
    lowp_in, lowp_out = dtype != F32, out != F32
    period = L.period if rowwise else min(L.period or inner, inner)
    if L.mask is None and (rowwise or (inner % block == 0 and (kept // n) % inner == 0 and kept % n == 0)):
        worst, tot, act = block_steps(kept, n, block)
        start = ext = None
    else:
        start, ext = _blocks(kept, n, block, None if (rowwise and L.mask is None) else period)
        worst, tot = ext.max(axis=0).astype(float), ext.sum(axis=0).astype(float)
    S = len(worst)
    nchunks = ceil_div(C, chunk)
    one = nchunks == 1
    mk = L.mask

    def counts(ke, cv):
        if rowwise:
            return (np.ceil(ke * pad(cv, dtype) / 64), ke * ceil_div(cv, 64), np.ceil(ke * STAT / 64),
                    np.ceil(ke / 8))
        pk = round_up(ke, 32 // isz)
        return np.ceil(cv * pk / 64), cv * np.ceil(pk / 64), np.ceil(pk / 64), np.zeros_like(ke)

    nb = 1 if rowwise else 0          # brcb instructions per reduction
    if mk is not None:
        mdt, along_block, along_c = mk[:3]
        added = len(mk) > 3                 # added in its dtype: scores cast down, the add, the sum cast up
        ke_m = ext if along_block else np.minimum(ext, 1)
        keys = _mask_keys(L, start, ext, ke_m)
        w_m = worst if along_block else np.minimum(worst, 1)

    rounds = bool(lse) and lowp_in     # inf_rows="lse", fp16/bf16 x: the scores rounded to x's dtype (two casts)

    def prologue(ke, cv):
        """(vector repeats, instructions) of cast in, scale, mask (and the lse spellings' rounding)."""
        ew, row, _, _ = counts(ke, cv)
        vec, ins = (lowp_in + scaled + 2 * rounds) * ew, lowp_in + scaled + 2 * rounds
        if mk is not None:
            cm = cv if along_c else 1
            if added:
                vec, ins = vec + 2 * ew, ins + 2
            elif mdt not in ("bool", F32):
                rm = w_m if rowwise else (ke if along_block else np.minimum(ke, 1))
                vec = vec + (np.ceil(rm * pad(cm, mdt) / 64) if rowwise else np.ceil(cm * pad(rm, mdt) / 64))
                ins += 1
            vec = vec + (ew if (along_block and along_c) else row)
            ins += 1
        return vec, ins

    # inf_rows="lse": statistics passes for lse - m (log of the sum, add, casts down and up for fp16/bf16 x,
    # sub, the +inf-max select) and its exp (not log); log's log of the sum is counted with log
    lse = lse * (3 + 2 * (dtype != F32) + 2 * (not log))
    tasks = []        # per task: (chunk k, cv, pass, vec, instr, stores)
    if one:
        ew, row, small, br = counts(worst, C)
        pv, pi = prologue(worst, C)
        vec = pv + ew * (1 + lowp_out) + 4 * row + 2 * br + small * (2 * zero + lse + log)
        instr = pi + lowp_out + 5 + 2 * nb + 2 * zero + lse + log + 2
        tasks.append((0, C, 0, vec, instr, True))
    else:
        per_cv = {}                                        # chunks come in two widths: their counts once

        def chunk_counts(cv):
            if cv not in per_cv:
                per_cv[cv] = counts(worst, cv), prologue(worst, cv)
            return per_cv[cv]

        for k in range(nchunks):                           # pass 1
            cv = min(chunk, C - k * chunk)
            (ew, row, small, br), (pv, pi) = chunk_counts(cv)
            last = k == nchunks - 1
            extra = (5 if k else 0) + 1 + last * (zero + lse + log)
            vec = pv + ew + 3 * row + 2 * br + extra * small
            instr = pi + 4 + 2 * nb + extra + 1
            tasks.append((k, cv, 1, vec, instr, False))
        for k in range(nchunks):                           # pass 2: reloads
            cv = min(chunk, C - k * chunk)
            (ew, row, small, br), (pv, pi) = chunk_counts(cv)
            vec = pv + ew * ((not log) + lowp_out) + row * 2      # sub max; div, or sub log sum
            instr = pi + lowp_out + 2 + (not log) + 2
            tasks.append((k, cv, 2, vec, instr, True))
    T = len(tasks)
    L2, HBMbw, rate = dev.l2_bytes, dev.hbm_bytes_per_cycle, dev.rates["GM->UB"]
    step_bytes = tot * C * isz
    # per (step, task) arrays, step-major
    xb_w = np.zeros((S, T))
    x_hit, x_miss, vec, instr = (np.zeros((S, T)) for _ in range(4))
    st_w, st_tot = np.zeros((S, T)), np.zeros((S, T))
    per_w = {}                                               # a chunk width's per-step bytes, once
    for j, (k, cv, ps, v, ins, stores) in enumerate(tasks):
        got = per_w.get(cv)
        if got is None:
            got = per_w[cv] = (tot * cv * isz, worst * cv * isz, worst * cv * osz, tot * cv * osz)
        b = got[0]
        xb_w[:, j] = got[1]
        if ps == 2:                                          # a reload: a hit while the step's rows stay
            resident = step_bytes + tot * k * chunk * isz <= L2
            x_hit[:, j], x_miss[:, j] = np.where(resident, b, 0.0), np.where(resident, 0.0, b)
        else:
            x_miss[:, j] = b
        vec[:, j], instr[:, j] = v, ins
        if stores:
            st_w[:, j], st_tot[:, j] = got[2], got[3]
    m_w, m_hit, m_miss = np.zeros((S, T)), np.zeros((S, T)), np.zeros((S, T))
    if mk is not None:
        m_w, m_hit, m_miss = _mask_stream(L, tasks, keys, ke_m, w_m, x_miss + st_tot, chunk, L2)
    instr = instr + (mk is not None)
    x_port, m_port = port(dev, x_hit, x_miss), port(dev, m_hit, m_miss)
    load_port = x_port + m_port
    load_cyc = np.maximum(xb_w / rate, x_port) + np.maximum(m_w / rate, m_port)
    flat = lambda a: np.asarray(a, float).reshape(-1)        # noqa: E731
    core, busy = stream(dev, flat(load_cyc * rate), flat(load_port), flat(vec), flat(st_w),
                        flat(st_tot / HBMbw), flat(instr))
    hbm = float(x_miss.sum() + m_miss.sum() + st_tot.sum())
    nbytes = {"GM->UB": float((x_hit + x_miss + m_hit + m_miss).sum()), "UB->GM": float(st_tot.sum())}
    return core, hbm, nbytes, busy


def _mask_stream(L, tasks, keys, ke_m, w_m, other, chunk, L2):
    """Per (step, task): the busiest core's mask bytes and the wave's L2-hit and HBM-miss bytes.

    A region is named by its block key and its chunk (every chunk the same when the mask broadcasts along C).
    The cores of one load that read the same region share one miss. A region read by an earlier task hits
    while the bytes brought into L2 since — ``other`` (x misses, y written through) and the distinct mask
    regions read (an upper bound: a hit brings nothing) — leave room for it (LRU)."""
    mdt, along_block, along_c = L.mask[:3]
    S, T = other.shape
    n = keys.shape[0]
    cm = np.array([cv if along_c else 1 for _, cv, *_ in tasks], dtype=float)
    tag = np.array([k if along_c else -1 for k, *_ in tasks])
    K = np.broadcast_to(keys.T[:, None, :], (S, T, n))
    live = K >= 0
    nbytes = ke_m.T[:, None, :] * cm[None, :, None] * L.msz
    total = np.where(live, nbytes, 0.0).sum(axis=2)
    m_w = np.asarray(w_m, float)[:, None] * cm[None, :] * L.msz
    tt = np.broadcast_to(np.arange(S * T).reshape(S, T, 1), (S, T, n))[live]
    kk, gg = K[live], np.broadcast_to(tag[None, :, None], (S, T, n))[live]
    bb = np.broadcast_to(nbytes, (S, T, n))[live]
    o = np.lexsort((gg, kk, tt))                       # distinct regions per task, in time order
    tt, kk, gg, bb = tt[o], kk[o], gg[o], bb[o]
    first = np.ones(len(tt), dtype=bool)
    first[1:] = (tt[1:] != tt[:-1]) | (kk[1:] != kk[:-1]) | (gg[1:] != gg[:-1])
    tt, kk, gg, bb = tt[first], kk[first], gg[first], bb[first]
    inserted = other.reshape(-1) + np.bincount(tt, weights=bb, minlength=S * T)
    after = inserted.cumsum()
    before = after - inserted
    o = np.lexsort((tt, gg, kk))                       # each region's reads in time order
    tt, kk, gg, bb = tt[o], kk[o], gg[o], bb[o]
    again = np.zeros(len(tt), dtype=bool)
    again[1:] = (kk[1:] == kk[:-1]) & (gg[1:] == gg[:-1])
    prev = np.concatenate([[0], tt[:-1]])
    miss = ~again | (before[tt] - after[prev] + bb > L2)
    m_miss = np.bincount(tt[miss], weights=bb[miss], minlength=S * T).reshape(S, T)
    return m_w, total - m_miss, m_miss


def _candidates(dev, dtype, L, out, log):
    rowwise = L.rowwise
    kept = L.outer * L.inner
    n = min(dev.vector_cores, kept)
    per_core = ceil_div(kept, n)
    step = 64
    C, mask, period = L.C, L.mask, L.period
    res = []

    ok = _ub_fits(dev, dtype, rowwise, out, mask, log)

    if rowwise:
        if ok(1, C, True):
            chunks = [C]
        else:
            top = step * largest(lambda k: ok(1, k * step, False), 1, ceil_div(C, step))
            chunks = [top] + ([top // 2 // step * step] if top // 2 >= step else [])
        for chunk in chunks:
            one = chunk >= C
            bmax = min(largest(lambda b: ok(b, chunk, one), 1, per_core), period or per_core)
            if bmax < 1:
                continue
            for j in (1, 2, 4):
                b = min(bmax, ceil_div(per_core, j))
                if {"block": b, "chunk": chunk} not in res:
                    res.append({"block": b, "chunk": chunk})
    else:
        cap = min(L.inner, per_core, period or L.inner)
        for block in sorted({min(cap, b) for b in (256, 128, 64, 32, 16, 8)}, reverse=True):
            chunk = largest(lambda k: ok(block, k, k >= C), 1, C)
            if chunk >= 1:
                res.append({"block": block, "chunk": chunk})
    if not res:
        raise ValueError(f"softmax: no tile of {dtype} fits UB on {dev.name}")
    return res


@cached
def _search(device, dtype, shape, dim, mask, out, log, zero, scaled, lse=False):
    dev = get_device(device)
    L = _Layout(shape, dim, *(mask or (None, None)))       # mask: (shape, dtype[, add dtype])
    best = None
    for t in _candidates(dev, dtype, L, out, log):
        res = _model(dev, dtype, L, t["block"], t["chunk"], out, log, zero, scaled, lse)
        cost = kernel_cycles(dev, *res[:3])
        if best is None or cost < best[0]:
            best = (cost, t, res)
    return best[1], best[2]


def _passes(specs, mask, scale, log, out_dtype, add_dtype=None):
    """fp32 Vector passes per element (roofline): max, sub, exp, sum, div, + scale, mask, casts (a mask added in
    its 16-bit dtype: two more, the scores cast down and the sum cast back up)."""
    (shape, dtype) = specs[0]
    out = out_dtype or dtype
    return 5 + (dtype != F32) + (out != F32) + (scale not in (None, 1.0)) + (mask is not None) + \
        2 * (mask is not None and add_dtype is not None)


def _roofline(dev, specs, dim=-1, tiling=None, mask=None, scale=None, fill=None, log=False, empty_rows="nan",
              out_dtype=None, inf_rows="nan", mask_add_dtype=None):
    (shape, dtype) = specs[0]
    N = math.prod(shape)
    out = str(out_dtype).replace("torch.", "") if out_dtype else dtype
    vec = N * _passes(specs, mask, scale, log, out, mask_add_dtype) / (dev.vector_bytes_per_cycle / 4) / \
        dev.vector_cores
    mbytes = math.prod(mask[0]) * itemsize(mask[1]) if mask is not None else 0
    return max(vec, (N * (itemsize(dtype) + itemsize(out)) + mbytes) / dev.hbm_bytes_per_cycle)


@register("softmax", _roofline)
def estimate_softmax(dev, specs, dim=-1, tiling=None, mask=None, scale=None, fill=None, log=False,
                     empty_rows="nan", out_dtype=None, inf_rows="nan", mask_add_dtype=None):
    """Predicted cost of ``npu.run("softmax", x, dim=..., mask=..., scale=..., log=..., empty_rows=...,
    inf_rows=..., out_dtype=..., mask_add_dtype=...)``; ``mask`` as a spec ``(shape, dtype)``; ``fill`` does not
    change the cost. ``mask_add_dtype``: a 16-bit additive mask added in its dtype, as eager adds it (the scores
    cast down, the add, the sum cast back up: two elementwise passes more, the mask's own cast fewer)."""
    (shape, dtype) = specs[0]
    shape = tuple(shape)
    out = str(out_dtype).replace("torch.", "") if out_dtype else dtype
    mask_add_dtype = None if mask_add_dtype is None else str(mask_add_dtype).replace("torch.", "")
    if mask_add_dtype is not None and (mask_add_dtype not in ("float16", "bfloat16") or mask is None
                                       or mask[1] != mask_add_dtype):
        raise ValueError(f"softmax: mask_add_dtype={mask_add_dtype!r} needs an additive {mask_add_dtype} mask, "
                         f"got {'no mask' if mask is None else mask[1]}")
    mkey = (tuple(mask[0]), mask[1]) + ((mask_add_dtype,) if mask_add_dtype else ()) if mask is not None else None
    scaled = scale is not None and float(scale) != 1.0
    zero = empty_rows == "zero"
    lse = inf_rows == "lse"
    if tiling is None:
        t, res = _search(dev.name, dtype, shape, dim, mkey, out, bool(log), zero, scaled, lse)
    else:
        L = _Layout(shape, dim, *(mkey or (None, None)))
        t = {"block": int(tiling.get("block", tiling.get("rows", 0))),
             "chunk": min(int(tiling.get("chunk", L.C)), L.C)}
        res = _model(dev, dtype, L, t["block"], t["chunk"], out, bool(log), zero, scaled, lse)
    core, hbm, nbytes, busy = res
    N = math.prod(shape)
    roof = _roofline(dev, specs, dim, mask=mask, scale=scale, log=log, out_dtype=out, mask_add_dtype=mask_add_dtype)
    return make("softmax", dev, core, hbm, nbytes, busy, dict(t), roof,
                _passes(specs, mask, scale, log, out, mask_add_dtype) * N)


__all__ = ["estimate_softmax"]
