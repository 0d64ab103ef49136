"""Softmax on the Vector unit, with CANN ScaledMaskedSoftmax's prologue and LogSoftmax's epilogue:

    z = scale · x;  z = where(mask, z, fill)  or  z = z + mask;  y = exp(z - max) / sum(exp(z - max))  along dim

(``log=True``: ``y = z - max - log(sum(exp(z - max)))``), fp32 arithmetic and statistics, ``y`` in
``out_dtype`` (default: x's dtype). The tensor is viewed as ``[outer, C, inner]`` with C the softmax dim.

*Last dim* (``inner == 1``): tiles of ``block`` rows x ``chunk`` columns. The rows are split evenly over
the vector cores; each core walks its rows ``block`` at a time, double-buffered.

*Other dims* (``inner > 1``): tiles of ``chunk`` x ``block`` — ``chunk`` steps of C by ``block`` lanes of
``inner`` — and the reductions run down the tile's rows elementwise across lanes (no transpose). Lanes
(``outer * inner`` of them) are split evenly over the cores.

One pass, when a whole softmax vector (C values) fits a tile (``chunk >= C``); per tile, Vector:

    cast  x -> fp32 (fp16/bf16 only)   [mul  x *= scale]   [select/add the mask]
    max   m = max(x)                   sub  x -= m          exp  x = exp(x)        sum  s = sum(x)
    div   x /= s                       cast y = x (fp16/bf16 out only)

as CANN's SoftMax does (statistics and arithmetic in fp32; the per-row m and s are kept one 32 B block
per row, the ``brcb`` layout the broadcast operand of sub/div reads). ``log=True`` keeps ``x - m`` and
writes ``exp`` to a second fp32 tile, then ``s = log(s)`` and ``x -= s`` replace the division.

Two passes, when C is longer than a tile (online softmax): pass 1 walks the chunks keeping a running
max m and sum s (``s = s * exp(m_old - m_new) + sum(exp(x - m_new))``); pass 2 walks them again (the
reloads mostly hit L2), recomputes the prologue and writes ``exp(x - m) / s`` (or ``(x - m) - log s``, the max
subtracted first as in one pass: ``m + log s`` as one statistic loses ``log s`` to the rounding of a max as large
as fp32's or bf16's ``finfo.min``, a row whose every score is that fill, where eager's ``log_softmax`` keeps
it; ``inf_rows="lse"`` rounds that statistic on purpose, as eager's ``logsumexp`` does: below).
The max the exponentials subtract is ``0`` while a row has seen only ``-inf`` (a leading chunk fully
masked must not poison the running sum with ``-inf - -inf``): one select on the statistics per chunk.

**Mask.** ``mask`` broadcasts to x: bool (True = keep; a masked score becomes ``fill``, ``-inf`` or a
finite value such as ``finfo.min`` or ``-1e4``; applied after the scale) or an additive float tensor
(fp16/bf16 ones are cast to fp32 on the Vector unit first). ``mask_add_dtype`` (``"float16"`` or
``"bfloat16"``, an additive mask of that dtype): the mask is added as eager adds a 16-bit mask to 16-bit scores,
the fp32 scores cast down to that dtype, the mask added in it and the sum cast back up (three passes in place of
the mask's cast and the fp32 add), so a score the mask absorbs (``finfo(float16).min`` + a score below 16 is
``-65504``) takes the mask's value and a row whose every key is so masked is uniform, as eager's is; the
fp32 add would keep the scores' differences there. It is read tile by tile *with its broadcast*:
the rows of one tile (lanes, for other dims) are cut so that they map onto one strided block of the mask
(a run of rows the mask broadcasts over, or a run it varies along contiguously), so a ``[B, 1, 1, S]``
padding mask loads one mask row per tile and a ``[S, S]`` causal mask loads the tile's own rows; neither is
materialised at full size. Loads of a mask region other cores or earlier tiles already read hit L2 (the
simulator's L2 decides). A mask tile that is not the work tile's shape is applied with per-row
instructions (broadcast operand), a full one with elementwise ones.

**Empty rows** (every score ``-inf``): ``empty_rows="nan"`` gives NaN as eager ``softmax`` does,
``"zero"`` gives 0 as ``_safe_softmax`` (the max used is 0 and a zero sum becomes ``+inf``: two selects
on the statistics). With a finite fill a fully masked row is uniform, as in eager. NaN propagates.

**Rows whose max is +inf**: ``inf_rows="nan"`` gives NaN over the row, as eager ``softmax``/``log_softmax``
do; ``inf_rows="lse"`` gives what the logsumexp spellings give (``torch.logsumexp`` returns +inf there):
``z - inf`` (``log``: -inf at every finite or -inf score, NaN at a +inf one) or ``exp(z - inf)`` (0 there, NaN
at a +inf score). ``z - m`` is already ``z - inf`` on such a row. With ``inf_rows="lse"`` every row computes
what those spellings compute: the scores ``z`` rounded to x's dtype after the scale and the mask (eager's are in it:
two casts per score, down and up), the statistic ``lse = m + log s`` rounded to x's dtype (eager's ``logsumexp``
returns it in the scores' dtype), then ``z - lse`` or ``exp(z - lse)``, written as ``(z - m) - d`` or
``exp(z - m) / exp(d)`` with ``d = lse - m`` (0 on a row whose max is +inf: one select on the statistics,
``m == +inf``). So a row whose every score is a finite fill that ``lse`` absorbs (``finfo.min``: ``m + log s ==
m``) gives 0 (or 1) at every score as eager's spelling does, where ``log_softmax`` gives ``-log C`` (``1/C``).
Statistics passes: log of the sum, add, the casts down and up (fp16/bf16 x), sub, the select, and ``exp`` (not
log).

``tiling``: ``{"block": rows (last dim) or lanes (other dims) per tile, "chunk": elements of C per tile}``
(``"rows"`` is accepted for ``"block"``). ``None`` picks the largest tile that fits UB double-buffered,
capped so each core has at least four tiles to overlap (and at the mask's run length).
"""
from __future__ import annotations

import math

import numpy as np

from autofuse.npu.kernels.flash_attention import check_mask_add
from autofuse.npu.kernels.tiles import (VEC_FLOATS, active_mask, ceil_div, check_dtype, dtype_name, extents, fits,
                                        lanes, largest, lockstep, pad, pipeline, rnd, split_blocks, view)
from autofuse.npu.run import kernel

STAT = 8          # fp32 statistics of one row: one 32 B block (the layout Brcb-broadcast operands use)
F32 = "float32"
MASK_DTYPES = ("bool",) + VEC_FLOATS
_NEG_INF = np.float32(-np.inf)


def _specs(dtype: str, rowwise: bool, block: int, chunk: int, out: str | None = None, mask=None, log=False,
           one_pass=True):
    """UB allocations of one softmax configuration, in allocation order.

    ``mask``: ``(dtype, along_block, along_c)`` — whether the mask tile varies along the tile's block axis
    (rows or lanes) and along C — or None; ``(dtype, along_block, along_c, add_dtype)`` for a 16-bit additive
    mask added in its dtype (a work tile of that dtype holds the scores cast down, and the mask needs no fp32
    copy). ``one_pass``: the whole of C in one tile (log keeps a second fp32 tile there)."""
    out = out or dtype
    shape = (block, pad(chunk, dtype)) if rowwise else (chunk, pad(block, dtype))
    stat = (block, STAT) if rowwise else (1, pad(block, dtype))
    specs = [(shape, dtype)] * 2                                   # x, double-buffered
    if dtype != F32:                                               # fp32 work tile (two when it is stored)
        specs += [(shape, F32)] * (1 if out != F32 else 2)
    if out != F32:
        specs += [(shape, out)] * 2                                # y, double-buffered
    if log and one_pass:
        specs += [(shape, F32)]                                    # exp(x - m), kept apart from x - m
    if mask is not None:
        mdt, along_block, along_c = mask[:3]
        ms = mask_tile(rowwise, block, chunk, mdt, along_block, along_c)
        specs += [(ms, mdt)] * 2
        if len(mask) > 3 and mask[3]:
            specs += [(shape, mask[3])]                            # the scores cast down, the sum in the mask's dtype
        elif mdt not in ("bool", F32):
            specs += [(ms, F32)]                                   # the additive mask cast to fp32
    return specs + [(stat, F32)] * 4                               # m, s, a temporary, the max in use


def mask_tile(rowwise: bool, block: int, chunk: int, mdt: str, along_block: bool, along_c: bool) -> tuple:
    """Shape of the UB tile holding one tile's mask (one row or lane when it broadcasts along them)."""
    rows, cols = (block if along_block else 1), (chunk if along_c else 1)
    return (rows, pad(cols, mdt)) if rowwise else (cols, pad(rows, mdt))


def axis_map(dims, mdims):
    """How flat indices over ``dims`` map to flat indices over the mask's ``mdims`` (each 1 or equal).

    Returns ``(period, step, fn)``: within each run of ``period`` consecutive indices, the mask index
    advances by ``step`` (0: the mask broadcasts over the run; 1: it varies along it contiguously);
    ``fn(i)`` is the mask index of ``i`` (numpy-vectorised). The run is the longest trailing group of dims
    over which the mask is uniformly broadcast or uniformly full (dims of size 1 count as either).
    """
    dims, mdims = tuple(dims), tuple(mdims)
    period, step = 1, None
    for d, md in zip(reversed(dims), reversed(mdims)):
        if d == 1:
            continue
        s = 0 if md == 1 else 1
        if step is not None and s != step:
            break
        step = s
        period *= d
    strides, acc = [], 1
    for md in reversed(mdims):
        strides.append(acc if md != 1 else 0)
        acc *= md
    strides = strides[::-1]

    def fn(i):
        if not dims:
            return np.zeros_like(np.asarray(i))
        idx = np.unravel_index(np.asarray(i), dims)
        return sum(np.asarray(k) * s for k, s in zip(idx, strides))

    return period, (1 if step is None else step), fn


def broadcast_shape(kernel_name: str, xshape, mshape) -> tuple:
    """The mask's shape right-aligned to x's rank; an error names both shapes when it does not broadcast."""
    xshape, mshape = tuple(xshape), tuple(mshape)
    if len(mshape) > len(xshape):
        raise ValueError(f"{kernel_name}: mask has {len(mshape)} dims {list(mshape)}, x only {len(xshape)} "
                         f"{list(xshape)}; the mask must broadcast to x")
    full = (1,) * (len(xshape) - len(mshape)) + mshape
    for i, (m, d) in enumerate(zip(full, xshape)):
        if m not in (1, d):
            raise ValueError(f"{kernel_name}: mask shape {list(mshape)} does not broadcast to x {list(xshape)} "
                             f"(dim {i}: {m} vs {d}); the kernel reads x as it is and broadcasts the mask only")
    return full


def mask_geometry(xshape, dim: int, mshape):
    """``(period, along_block, along_c)`` of a mask on x viewed ``[outer, C, inner]``: the run length of the
    tile's block axis (rows for the last dim, lanes of inner otherwise) and whether the mask varies along
    that axis and along C."""
    full = broadcast_shape("softmax", xshape, mshape)
    rowwise = math.prod(xshape[dim + 1:]) == 1
    axis = slice(0, dim) if rowwise else slice(dim + 1, None)
    period, step, _ = axis_map(xshape[axis], full[axis])
    return period, step == 1, full[dim] != 1


def default_tiling(device, dtype: str, outer: int, C: int, inner: int, out: str | None = None, mask=None,
                   log=False, period: int | None = None) -> dict:
    """The largest tile that fits UB double-buffered; rows too long for UB are chunked (multiples of 64).
    ``mask``/``period`` as :func:`_specs`/:func:`mask_geometry` (blocks never cross a mask run)."""
    rowwise = inner == 1
    kept = outer * inner
    n = min(device.vector_cores, kept)
    per_core = ceil_div(kept, n)
    step = lanes(device, F32)

    def ok(b, k, one):
        return fits(device, _specs(dtype, rowwise, b, k, out, mask, log, one))

    if rowwise:
        if ok(1, C, True):
            chunk = C
        else:
            chunk = step * largest(lambda k: ok(1, k * step, False), 1, ceil_div(C, step))
        one = chunk >= C
        block = largest(lambda b: ok(b, chunk, one), 1, per_core)
        block = min(block, max(1, ceil_div(per_core, 4)), period or block)
    else:
        block = min(inner, per_core, 256, period or inner)
        chunk = largest(lambda k: ok(block, k, k >= C), 1, C)
        while chunk < 1 and block > 1:                 # not even one row of the lane block fits
            block = max(1, block // 2)
            chunk = largest(lambda k: ok(block, k, k >= C), 1, C)
    if chunk < 1 or block < 1:
        raise ValueError(f"softmax: no tile of {dtype} fits UB ({device.buffers['UB']:,} B) on {device.name}")
    return {"block": int(block), "chunk": int(chunk)}


def _check(x, mask, out_dtype, fill, empty_rows, log, inf_rows="nan"):
    check_dtype("softmax", "x", x)
    if mask is not None and mask.dtype not in MASK_DTYPES:
        raise TypeError(f"softmax: mask is {mask.dtype}; it must be bool (True = keep) or an additive float "
                        f"({', '.join(VEC_FLOATS)})")
    out = dtype_name(out_dtype) or x.dtype
    if out not in VEC_FLOATS:
        raise TypeError(f"softmax: out_dtype {out}; the kernel writes {', '.join(VEC_FLOATS)}")
    if empty_rows not in ("nan", "zero"):
        raise ValueError(f"softmax: empty_rows={empty_rows!r}; use 'nan' (softmax) or 'zero' (_safe_softmax)")
    if inf_rows not in ("nan", "lse"):
        raise ValueError(f"softmax: inf_rows={inf_rows!r}; use 'nan' (softmax, log_softmax) or 'lse' "
                         f"(x - logsumexp(x), exp(x - logsumexp(x)))")
    if log and empty_rows == "zero":
        raise ValueError("softmax: log=True has no safe form (log of a zero probability is -inf, not 0); "
                         "use empty_rows='nan'")
    fill = float(fill)
    if math.isnan(fill) or fill == math.inf:
        raise ValueError(f"softmax: fill={fill}; a masked score must be -inf or a finite value")
    return out, fill


@kernel("softmax")
def softmax(launch, x, dim=-1, tiling=None, mask=None, scale=None, fill=float("-inf"), log=False,
            empty_rows="nan", out_dtype=None, inf_rows="nan", mask_add_dtype=None):
    """``torch.softmax(scale * x masked, dim)`` (or ``log_softmax``) for fp16, bf16 and fp32 ``x``; the
    output has ``out_dtype`` (default x's dtype). ``mask_add_dtype``: an additive 16-bit mask added in its
    dtype, as eager adds it (module docstring). See the module docstring."""
    out_dt, fill = _check(x, mask, out_dtype, fill, empty_rows, log, inf_rows)
    add_dt = check_mask_add("softmax", mask, mask_add_dtype)
    dev = launch.device
    nd = x.data.ndim
    if nd == 0:
        raise ValueError("softmax: x is a 0-d tensor; give it at least one dimension")
    if not -nd <= dim < nd:
        raise ValueError(f"softmax: dim {dim} out of range for x of shape {list(x.shape)}")
    dim %= nd
    dtype = x.dtype
    outer, C, inner = math.prod(x.shape[:dim]), x.shape[dim], math.prod(x.shape[dim + 1:])
    out = launch.empty(x.shape, out_dt, "y")
    if outer * C * inner == 0:
        return (out,)
    rowwise = inner == 1
    scale = None if scale is None or float(scale) == 1.0 else np.float32(scale)
    mspec, period, mv, omap, imap = None, None, None, None, None
    if mask is not None:
        full = broadcast_shape("softmax", x.shape, mask.shape)
        period, along_block, along_c = mask_geometry(x.shape, dim, mask.shape)
        mspec = (mask.dtype, along_block, along_c) + ((add_dt,) if add_dt else ())
        mo, mc, mi = full[:dim], full[dim], full[dim + 1:]
        omap = axis_map(x.shape[:dim], mo)[2]
        if rowwise:
            mv = view(mask, (math.prod(mo), mc), "mask")
        else:
            imap = axis_map(x.shape[dim + 1:], mi)[2]
            mv = view(mask, (math.prod(mo), mc, math.prod(mi)), "mask")
    t = dict(tiling) if tiling else default_tiling(dev, dtype, outer, C, inner, out_dt, mspec, log, period)
    block = int(t.get("block", t.get("rows", 0)))
    chunk = min(int(t.get("chunk", C)), C)
    if block < 1 or chunk < 1:
        raise ValueError(f"softmax: tiling {t} needs positive 'block' and 'chunk'")
    nchunks = ceil_div(C, chunk)
    one_pass = nchunks == 1
    if rowwise:
        xv, yv = view(x, (outer, C)), view(out, (outer, C))
    else:
        xv, yv = view(x, (outer, C, inner)), view(out, (outer, C, inner))
    kept = outer * inner
    n = min(dev.vector_cores, kept)
    g = launch.group("aiv", n)
    shapes = _specs(dtype, rowwise, block, chunk, out_dt, mspec, log, one_pass)
    xshape, stat_shape = shapes[0][0], shapes[-1][0]
    X = [g.alloc("UB", xshape, dtype, f"x{i}") for i in range(2)]
    W = [g.alloc("UB", xshape, F32, f"w{i}") for i in range(1 if out_dt != F32 else 2)] if dtype != F32 else X
    Y = [g.alloc("UB", xshape, out_dt, f"y{i}") for i in range(2)] if out_dt != F32 else None
    E = g.alloc("UB", xshape, F32, "e") if log and one_pass else None
    M, MF, H = None, None, None
    if mspec is not None:
        ms = mask_tile(rowwise, block, chunk, mspec[0], mspec[1], mspec[2])
        M = [g.alloc("UB", ms, mspec[0], f"mask{i}") for i in range(2)]
        if add_dt:
            H = g.alloc("UB", xshape, add_dt, "scores_" + add_dt)
        elif mspec[0] not in ("bool", F32):
            MF = g.alloc("UB", ms, F32, "mask_f32")
    m, s, tmp, use = (g.alloc("UB", stat_shape, F32, nm) for nm in ("m", "s", "t", "u"))
    zero = empty_rows == "zero"
    lse = inf_rows == "lse"

    axis = 2 if rowwise else 1               # reduced axis of tile.data ([core, a, b])
    # Work split: rows (last dim) or lanes (other dims); lane blocks never cross an outer index, and no
    # block crosses a run of the mask (so that its mask is one strided region).
    if rowwise:
        per_core = split_blocks(kept, n, block, period=period)
    else:
        per_core = split_blocks(kept, n, block, period=min(period or inner, inner))
    state = {"x": 0, "y": 0, "w": 0, "m": 0}
    st = {"m": m, "s": s, "t": tmp}          # running max / sum / temporary (names swap, tiles do not move)

    def sl(cv):
        """Index of the valid chunk (cv values along the softmax dim) in tile.data."""
        return (slice(None), slice(None), slice(0, cv)) if rowwise else (slice(None), slice(0, cv))

    def stat(tile):
        return tile.data[:, :, :1] if rowwise else tile.data

    class Item:
        """One lockstep step: each core's block of rows (last dim) or lanes (other dims)."""

        def __init__(self, items):
            self.items = items
            self.act = active_mask(items)
            self.ke = extents(items, lambda it: it[1])

        def regions(self, k, cv):
            c0 = k * chunk
            if rowwise:
                return [None if it is None else (slice(it[0], it[0] + it[1]), slice(c0, c0 + cv))
                        for it in self.items]
            return [None if it is None else (it[0] // inner, slice(c0, c0 + cv),
                                             slice(it[0] % inner, it[0] % inner + it[1])) for it in self.items]

        def mask_regions(self, k, cv):
            """The mask's strided block under each core's tile (one row / lane where it broadcasts)."""
            cols = slice(k * chunk, k * chunk + cv) if mspec[2] else slice(0, 1)
            out_ = []
            for it in self.items:
                if it is None:
                    out_.append(None)
                    continue
                e = it[1] if mspec[1] else 1
                if rowwise:
                    r = int(omap(it[0]))
                    out_.append((slice(r, r + e), cols))
                else:
                    o, lane = divmod(it[0], inner)
                    r = int(imap(lane))
                    out_.append((int(omap(o)), cols, slice(r, r + e)))
            return out_

        def counts(self, cv):
            """Repeats of an elementwise pass, a per-row (broadcast or reducing) pass, a statistics pass."""
            ke = self.ke
            if rowwise:
                return (g.repeats(ke * pad(cv, dtype), F32), g.row_repeats(ke, cv, F32), g.repeats(ke * STAT, F32))
            return (g.repeats(cv * pad(ke, dtype), F32), g.row_repeats(cv, pad(ke, dtype), F32),
                    g.repeats(pad(ke, dtype), F32))

    def load(it, k):
        """MTE2: chunk k (and its mask) into the next buffers."""
        cv = min(chunk, C - k * chunk)
        xb = X[state["x"] % 2]
        state["x"] += 1
        g.load(xb, xv, it.regions(k, cv), active=it.act, name="load x")
        mb = None
        if M is not None:
            mb = M[state["m"] % 2]
            state["m"] += 1
            g.load(mb, mv, it.mask_regions(k, cv), active=it.act, name="load mask")
        return xb, mb

    def prologue(it, k, xb, mb):
        """Cast to fp32 (fp16/bf16; fp32 is worked on in place), scale, mask: the softmax input z."""
        cv = min(chunk, C - k * chunk)
        ew, row, _ = it.counts(cv)
        if dtype == F32:
            w = xb
        else:
            w = W[state["w"] % len(W)]
            state["w"] += 1
            g.vector("cast x->fp32", (w,), (xb,), ew, active=it.act, compute=lambda: np.copyto(w.data, xb.data))
        if scale is not None:
            g.vector("mul scale", (w,), (w,), ew, active=it.act, compute=lambda: np.multiply(w.data, scale, out=w.data))
        if mb is not None:
            apply_mask(it, w, mb, cv, ew, row)
        if lse and dtype != F32:
            # the logsumexp spellings' scores as eager holds them, in x's dtype: the statistic rounded to it below is
            # eager's logsumexp of these, and z - lse their difference (the x tile, read already, takes the cast)
            g.vector("cast scores->" + dtype, (xb,), (w,), ew, active=it.act,
                     compute=lambda: np.copyto(xb.data, rnd(w.data, dtype)))
            g.vector("cast scores->fp32", (w,), (xb,), ew, active=it.act, compute=lambda: np.copyto(w.data, xb.data))
        return w

    def apply_mask(it, w, mb, cv, ew, row):
        """Bool: select ``fill`` where the mask is False; float: add it (cast to fp32 first if fp16/bf16), or
        with ``mask_add_dtype`` add it in its dtype (the scores cast down, the add, the sum cast back up)."""
        mdt, along_block, along_c = mspec[:3]
        cm = cv if along_c else 1
        if rowwise:
            wv = (slice(None), slice(None), slice(0, cv))
            mvw = (slice(None), slice(None), slice(0, cm))
            rm = it.ke if along_block else 1
            mrep = g.repeats(rm * pad(cm, mdt), F32)
        else:
            lanes_m = block if along_block else 1
            wv = (slice(None), slice(0, cv), slice(0, block))
            mvw = (slice(None), slice(0, cm), slice(0, lanes_m))
            mrep = g.repeats(cm * pad(it.ke if along_block else 1, mdt), F32)
        reps = ew if (along_block and along_c) else row          # a broadcast operand: per-row instructions
        if H is not None:
            # eager's 16-bit add: a score the mask absorbs takes the mask's value (the rounded sum; the hardware's
            # 16-bit add rounds it, numpy adds the two 16-bit values in fp32 and rounds once: the same sum)
            g.vector("cast scores->" + add_dt, (H,), (w,), ew, active=it.act,
                     compute=lambda: np.copyto(H.data, rnd(w.data, add_dt)))
            g.vector("add mask", (H,), (H, mb), reps, active=it.act,
                     compute=lambda: np.copyto(H.data[wv], rnd(H.data[wv] + mb.data[mvw], add_dt)))
            g.vector("cast sum->fp32", (w,), (H,), ew, active=it.act, compute=lambda: np.copyto(w.data, H.data))
            return
        src = mb
        if MF is not None:
            g.vector("cast mask->fp32", (MF,), (mb,), mrep, active=it.act, compute=lambda: np.copyto(MF.data, mb.data))
            src = MF
        if mdt == "bool":
            g.vector("select mask", (w,), (w, src), reps, active=it.act,
                     compute=lambda: np.copyto(w.data[wv], np.float32(fill), where=~src.data[mvw]))
        else:
            g.vector("add mask", (w,), (w, src), reps, active=it.act,
                     compute=lambda: np.add(w.data[wv], src.data[mvw], out=w.data[wv]))

    def reduce(it, name, dst, w, cv, fn):
        """A row (lane) reduction into a statistics tile; rows: Brcb spreads each row's value over a block."""
        v = sl(cv)
        g.vector(name, (dst,), (w,), it.counts(cv)[1], active=it.act,
                 compute=lambda: np.copyto(stat(dst), fn(w.data[v], axis=axis, keepdims=True)))
        if rowwise:
            g.vector("brcb", (dst,), (dst,), ceil_div(it.ke, 8), active=it.act)

    def stat_op(it, name, dst, srcs, fn):
        """A pass over the per-row statistics (one 32 B block per row)."""
        g.vector(name, (dst,), srcs, g.repeats(it.ke * STAT, F32) if rowwise else g.repeats(pad(it.ke, dtype), F32),
                 active=it.act, compute=lambda: np.copyto(stat(dst), fn(*(stat(t_) for t_ in srcs))))

    def guard(it, src):
        """u = src, or 0 where src is -inf (a row that has seen nothing but -inf so far)."""
        stat_op(it, "select max in use", use, (src,), lambda a: np.where(a == _NEG_INF, np.float32(0), a))
        return use

    def sub_exp(it, w, cv, mm, dst=None):
        """x -= m (broadcast per row / lane), then exp (into ``dst``, or in place)."""
        ew, row, _ = it.counts(cv)
        v = sl(cv)
        dst = dst or w
        g.vector("sub max", (w,), (w, mm), row, active=it.act,
                 compute=lambda: np.subtract(w.data[v], stat(mm), out=w.data[v]))
        g.vector("exp", (dst,), (w,), ew, active=it.act, compute=lambda: np.exp(w.data, out=dst.data))

    def finish_stats(it, mm):
        """After the sums: a zero sum becomes +inf (empty rows give 0); log: s = log(s). With ``lse`` (``mm``
        the max the exponentials subtracted): ``s = lse - mm`` with ``lse = mm + log s`` rounded to x's dtype, as
        eager's ``logsumexp`` returns it (``d``, 0 on a row whose max is +inf: its ``z - m`` is ``z - inf``
        already), then ``exp(d)`` unless log: the output is ``(z - m) - d`` or ``exp(z - m) / exp(d)``, so a row
        whose every score is a fill ``lse`` absorbs (``finfo.min``) gives 0 or 1 as eager's spelling does."""
        ss = st["s"]
        if zero:
            stat_op(it, "select empty sum", ss, (ss,), lambda a: np.where(a == 0, np.float32(np.inf), a))
        if log or lse:
            stat_op(it, "log sum", ss, (ss,), np.log)
        if lse:
            stat_op(it, "add lse = max + log sum", ss, (ss, mm), np.add)
            if dtype != F32:
                stat_op(it, "cast lse->" + dtype, ss, (ss,), lambda a: rnd(a, dtype))
                stat_op(it, "cast lse->fp32", ss, (ss,), lambda a: a)
            stat_op(it, "sub lse-max", ss, (ss, mm), np.subtract)
            stat_op(it, "select +inf-max", ss, (ss, st["m"]),
                    lambda a, mx: np.where(mx == np.float32(np.inf), np.float32(0), a))
            if not log:
                stat_op(it, "exp lse-max", ss, (ss,), np.exp)

    def store(it, k, w, cv):
        """y = w, cast to out_dtype if it is fp16/bf16; MTE3 the chunk out."""
        if Y is not None:
            yb = Y[state["y"] % 2]
            state["y"] += 1
            g.vector("cast y", (yb,), (w,), it.counts(cv)[0], active=it.act,
                     compute=lambda: np.copyto(yb.data, rnd(w.data, out_dt)))
        else:
            yb = w
        g.store(yb, yv, it.regions(k, cv), active=it.act, name="store y")

    def normalise_store(it, k, w, cv, ll):
        """softmax: x /= s; log: x -= ll (``log s``, the max subtracted already). Then store."""
        v, row = sl(cv), it.counts(cv)[1]
        if log:
            g.vector("sub log sum", (w,), (w, ll), row, active=it.act,
                     compute=lambda: np.subtract(w.data[v], stat(ll), out=w.data[v]))
        else:
            ss = st["s"]
            g.vector("div sum", (w,), (w, ss), row, active=it.act,
                     compute=lambda: np.divide(w.data[v], stat(ss), out=w.data[v]))
        store(it, k, w, cv)

    def single(it, handle):
        """The whole softmax of a tile: prologue, max, sub, exp, sum, div (log: sub log sum)."""
        w = prologue(it, 0, *handle)
        reduce(it, "reduce max", st["m"], w, C, np.max)
        mm = guard(it, st["m"]) if zero else st["m"]
        sub_exp(it, w, C, mm, E)
        reduce(it, "reduce sum", st["s"], w if E is None else E, C, np.sum)
        finish_stats(it, mm)
        normalise_store(it, 0, w, C, st["s"])

    def online(it, k, handle):
        """Pass 1 on chunk k: m_new = max(m, max(x)); s = s * exp(m - use(m_new)) + sum(exp(x - use(m_new)))."""
        cv = min(chunk, C - k * chunk)
        w = prologue(it, k, *handle)
        if k == 0:
            reduce(it, "reduce max", st["m"], w, cv, np.max)
            u = guard(it, st["m"])
        else:
            m_, t_, s_ = st["m"], st["t"], st["s"]
            reduce(it, "reduce max", t_, w, cv, np.max)
            stat_op(it, "max m_new", t_, (t_, m_), np.maximum)
            u = guard(it, t_)
            stat_op(it, "sub m_old-m_new", m_, (m_, u), np.subtract)
            stat_op(it, "exp correction", m_, (m_,), np.exp)
            stat_op(it, "mul s*=correction", s_, (s_, m_), np.multiply)
            st["m"], st["t"] = t_, m_                  # the new max becomes m: swap names, no copy
        sub_exp(it, w, cv, u)
        if k == 0:
            reduce(it, "reduce sum", st["s"], w, cv, np.sum)
        else:
            t_, s_ = st["t"], st["s"]
            reduce(it, "reduce sum", t_, w, cv, np.sum)
            stat_op(it, "add s+=chunk sum", s_, (s_, t_), np.add)
        if k == nchunks - 1:
            finish_stats(it, u)

    def normalise(it, k, handle):
        """Pass 2 on chunk k: y = exp(z - m) / s, or (z - m) - log s. The log form subtracts the max first, as the
        one-pass form and eager do: ``m + log s`` in one statistic would lose ``log s`` to the rounding of a max
        as large as fp32's or bf16's ``finfo.min`` (a row whose every score is that fill gives ``-log C``, as ``log_softmax``
        does); with ``lse`` the statistic subtracted is ``d = lse - m``, ``lse`` rounded (:func:`finish_stats`)."""
        cv = min(chunk, C - k * chunk)
        w = prologue(it, k, *handle)
        if log:
            g.vector("sub max", (w,), (w, use), it.counts(cv)[1], active=it.act,
                     compute=lambda: np.subtract(w.data[sl(cv)], stat(use), out=w.data[sl(cv)]))
        else:
            sub_exp(it, w, cv, use)
        normalise_store(it, k, w, cv, st["s"])

    def tasks():
        for items in lockstep(per_core):
            it = Item(items)
            if one_pass:
                yield (lambda it=it: load(it, 0)), (lambda h, it=it: single(it, h))
                continue
            for k in range(nchunks):            # pass 1: running max and sum
                yield (lambda it=it, k=k: load(it, k)), (lambda h, it=it, k=k: online(it, k, h))
            for k in range(nchunks):            # pass 2: reloads hit L2 while the rows stay cached
                yield (lambda it=it, k=k: load(it, k)), (lambda h, it=it, k=k: normalise(it, k, h))

    with np.errstate(all="ignore"):
        pipeline(tasks())
    return (out,)


__all__ = ["axis_map", "broadcast_shape", "default_tiling", "mask_geometry", "mask_tile", "softmax"]
