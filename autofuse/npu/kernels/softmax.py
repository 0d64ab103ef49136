"""Softmax on the Vector unit: ``y = exp(x - max) / sum(exp(x - max))`` along ``dim``, fp32 statistics.

The tensor is viewed as ``[outer, C, inner]`` with C the softmax dim.

*Last dim* (``inner == 1``): tiles of ``block`` rows x ``chunk`` columns. The rows are split evenly over
the vector cores; each core walks its rows ``block`` at a time, double-buffered.

*Other dims* (``inner > 1``): tiles of ``chunk`` x ``block`` — ``chunk`` steps of C by ``block`` lanes of
``inner`` — and the reductions run down the tile's rows elementwise across lanes (no transpose). Lanes
(``outer * inner`` of them) are split evenly over the cores.

One pass, when a whole softmax vector (C values) fits a tile (``chunk >= C``); per tile, Vector:

    cast  x -> fp32 (fp16/bf16 only)   max  m = max(x)        sub  x -= m      exp  x = exp(x)
    sum   s = sum(x)                   div  x /= s            cast y = x (fp16/bf16 only)

as CANN's SoftMax does (statistics and arithmetic in fp32; the per-row m and s are kept one 32 B block
per row, the ``brcb`` layout the broadcast operand of sub/div reads).

Two passes, when C is longer than a tile (online softmax): pass 1 walks the chunks keeping a running
max m and sum s (``s = s * exp(m_old - m_new) + sum(exp(x - m_new))``); pass 2 walks them again (the
reloads mostly hit L2) and writes ``exp(x - m) / s``. Ten full passes instead of seven, two loads instead
of one.

``tiling``: ``{"block": rows (last dim) or lanes (other dims) per tile, "chunk": elements of C per tile}``
(``"rows"`` is accepted for ``"block"``). ``None`` picks the largest tile that fits UB double-buffered,
capped so each core has at least four tiles to overlap.
"""
from __future__ import annotations

import math

import numpy as np

from autofuse.npu.kernels.tiles import (active_mask, ceil_div, check_dtype, extents, fits, lanes, largest,
                                        lockstep, pad, pipeline, rnd, split_blocks, view)
from autofuse.npu.run import kernel

STAT = 8          # fp32 statistics of one row: one 32 B block (the layout Brcb-broadcast operands use)


def _specs(dtype: str, rowwise: bool, block: int, chunk: int):
    """UB allocations of one softmax configuration, in allocation order."""
    shape = (block, pad(chunk, dtype)) if rowwise else (chunk, pad(block, dtype))
    stat = (block, STAT) if rowwise else (1, pad(block, dtype))
    specs = [(shape, dtype)] * 2                                   # x, double-buffered
    if dtype != "float32":
        specs += [(shape, "float32")] + [(shape, dtype)] * 2       # fp32 work tile; y, double-buffered
    return specs + [(stat, "float32")] * 3                         # m, s, a temporary statistic


def default_tiling(device, dtype: str, outer: int, C: int, inner: int) -> dict:
    """The largest tile that fits UB double-buffered; rows too long for UB are chunked (multiples of 64)."""
    rowwise = inner == 1
    kept = outer * inner
    n = min(device.vector_cores, kept)
    per_core = ceil_div(kept, n)
    step = lanes(device, "float32")
    if rowwise:
        if fits(device, _specs(dtype, True, 1, C)):
            chunk = C
        else:
            chunk = step * largest(lambda k: fits(device, _specs(dtype, True, 1, k * step)), 1, ceil_div(C, step))
        block = largest(lambda b: fits(device, _specs(dtype, True, b, chunk)), 1, per_core)
        block = min(block, max(1, ceil_div(per_core, 4)))
    else:
        block = min(inner, per_core, 256)
        chunk = largest(lambda k: fits(device, _specs(dtype, False, block, k)), 1, C)
        while chunk < 1 and block > 1:                 # not even one row of the lane block fits
            block = max(1, block // 2)
            chunk = largest(lambda k: fits(device, _specs(dtype, False, block, k)), 1, C)
    if chunk < 1 or block < 1:
        raise ValueError(f"softmax: no tile of {dtype} fits UB ({device.buffers['UB']:,} B) on {device.name}")
    return {"block": int(block), "chunk": int(chunk)}


@kernel("softmax")
def softmax(launch, x, dim=-1, tiling=None):
    """``torch.softmax(x, dim)`` for fp16, bf16 and fp32 ``x``; the output has ``x``'s dtype."""
    check_dtype("softmax", "x", x)
    dev = launch.device
    nd = x.data.ndim
    if nd == 0:
        raise ValueError("softmax: x is a 0-d tensor; give it at least one dimension")
    if not -nd <= dim < nd:
        raise ValueError(f"softmax: dim {dim} out of range for x of shape {list(x.shape)}")
    dim %= nd
    dtype = x.dtype
    outer, C, inner = math.prod(x.shape[:dim]), x.shape[dim], math.prod(x.shape[dim + 1:])
    out = launch.empty(x.shape, dtype, "y")
    if outer * C * inner == 0:
        return (out,)
    rowwise = inner == 1
    t = dict(tiling) if tiling else default_tiling(dev, dtype, outer, C, inner)
    block = int(t.get("block", t.get("rows", 0)))
    chunk = min(int(t.get("chunk", C)), C)
    if block < 1 or chunk < 1:
        raise ValueError(f"softmax: tiling {t} needs positive 'block' and 'chunk'")
    if rowwise:
        xv, yv = view(x, (outer, C)), view(out, (outer, C))
    else:
        xv, yv = view(x, (outer, C, inner)), view(out, (outer, C, inner))
    kept = outer * inner
    n = min(dev.vector_cores, kept)
    g = launch.group("aiv", n)
    shapes = _specs(dtype, rowwise, block, chunk)
    lowp = dtype != "float32"
    X = [g.alloc("UB", shapes[0][0], dtype, f"x{i}") for i in range(2)]
    if lowp:
        W = g.alloc("UB", shapes[2][0], "float32", "w")
        Y = [g.alloc("UB", shapes[3][0], dtype, f"y{i}") for i in range(2)]
    m, s, tmp = (g.alloc("UB", shapes[-1][0], "float32", nm) for nm in ("m", "s", "t"))

    axis = 2 if rowwise else 1               # reduced axis of tile.data ([core, a, b])
    nchunks = ceil_div(C, chunk)
    f32 = "float32"
    # Work split: rows (last dim) or lanes (other dims); lane blocks never cross an outer index.
    per_core = split_blocks(kept, n, block, period=None if rowwise else inner)
    state = {"x": 0, "y": 0}
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

        def counts(self, cv):
            """Repeats of an elementwise pass, a per-row (broadcast or reducing) pass, a statistics pass."""
            ke = self.ke
            if rowwise:
                return (g.repeats(ke * pad(cv, dtype), f32), g.row_repeats(ke, cv, f32), g.repeats(ke * STAT, f32))
            return (g.repeats(cv * pad(ke, dtype), f32), g.row_repeats(cv, pad(ke, dtype), f32),
                    g.repeats(pad(ke, dtype), f32))

    def load(it, k):
        """MTE2: chunk k into the next x buffer."""
        cv = min(chunk, C - k * chunk)
        xb = X[state["x"] % 2]
        state["x"] += 1
        g.load(xb, xv, it.regions(k, cv), active=it.act, name="load x")
        return xb

    def to_f32(it, k, xb):
        """Cast to fp32 (fp16/bf16); fp32 is worked on in place."""
        if not lowp:
            return xb
        cv = min(chunk, C - k * chunk)
        g.vector("cast x->fp32", (W,), (xb,), it.counts(cv)[0], active=it.act,
                 compute=lambda: np.copyto(W.data, xb.data))
        return W

    def reduce(it, name, dst, w, cv, fn):
        """A row (lane) reduction into a statistics tile; rows: Brcb spreads each row's value over a block."""
        v = sl(cv)
        g.vector(name, (dst,), (w,), it.counts(cv)[1], active=it.act,
                 compute=lambda: np.copyto(stat(dst), fn(w.data[v], axis=axis, keepdims=True)))
        if rowwise:
            g.vector("brcb", (dst,), (dst,), ceil_div(it.ke, 8), active=it.act)

    def sub_exp(it, w, cv):
        """x -= m (broadcast per row / lane), x = exp(x)."""
        ew, row, _ = it.counts(cv)
        v, mm = sl(cv), st["m"]
        g.vector("sub max", (w,), (w, mm), row, active=it.act,
                 compute=lambda: np.subtract(w.data[v], stat(mm), out=w.data[v]))
        g.vector("exp", (w,), (w,), ew, active=it.act, compute=lambda: np.exp(w.data, out=w.data))

    def div_store(it, k, w, cv):
        """x /= s; cast back (fp16/bf16); MTE3 the chunk out."""
        v, ss = sl(cv), st["s"]
        g.vector("div sum", (w,), (w, ss), it.counts(cv)[1], active=it.act,
                 compute=lambda: np.divide(w.data[v], stat(ss), out=w.data[v]))
        if lowp:
            yb = Y[state["y"] % 2]
            state["y"] += 1
            g.vector("cast y", (yb,), (w,), it.counts(cv)[0], active=it.act,
                     compute=lambda: np.copyto(yb.data, rnd(w.data, dtype)))
        else:
            yb = w
        g.store(yb, yv, it.regions(k, cv), active=it.act, name="store y")

    def one_pass(it, xb):
        """The whole softmax of a tile: max, sub, exp, sum, div."""
        w = to_f32(it, 0, xb)
        reduce(it, "reduce max", st["m"], w, C, np.max)
        sub_exp(it, w, C)
        reduce(it, "reduce sum", st["s"], w, C, np.sum)
        div_store(it, 0, w, C)

    def online(it, k, xb):
        """Pass 1 on chunk k: m_new = max(m, max(x)); s = s * exp(m - m_new) + sum(exp(x - m_new))."""
        cv = min(chunk, C - k * chunk)
        small = it.counts(cv)[2]
        w = to_f32(it, k, xb)
        if k == 0:
            reduce(it, "reduce max", st["m"], w, cv, np.max)
        else:
            m_, t_, s_ = st["m"], st["t"], st["s"]
            reduce(it, "reduce max", t_, w, cv, np.max)
            g.vector("max m_new", (t_,), (t_, m_), small, active=it.act,
                     compute=lambda: np.maximum(stat(t_), stat(m_), out=stat(t_)))
            g.vector("sub m_old-m_new", (m_,), (m_, t_), small, active=it.act,
                     compute=lambda: np.subtract(stat(m_), stat(t_), out=stat(m_)))
            g.vector("exp correction", (m_,), (m_,), small, active=it.act,
                     compute=lambda: np.exp(stat(m_), out=stat(m_)))
            g.vector("mul s*=correction", (s_,), (s_, m_), small, active=it.act,
                     compute=lambda: np.multiply(stat(s_), stat(m_), out=stat(s_)))
            st["m"], st["t"] = t_, m_                  # the new max becomes m: swap names, no copy
        sub_exp(it, w, cv)
        if k == 0:
            reduce(it, "reduce sum", st["s"], w, cv, np.sum)
        else:
            t_, s_ = st["t"], st["s"]
            reduce(it, "reduce sum", t_, w, cv, np.sum)
            g.vector("add s+=chunk sum", (s_,), (s_, t_), small, active=it.act,
                     compute=lambda: np.add(stat(s_), stat(t_), out=stat(s_)))

    def normalise(it, k, xb):
        """Pass 2 on chunk k: y = exp(x - m) / s."""
        cv = min(chunk, C - k * chunk)
        w = to_f32(it, k, xb)
        sub_exp(it, w, cv)
        div_store(it, k, w, cv)

    def tasks():
        for items in lockstep(per_core):
            it = Item(items)
            if nchunks == 1:
                yield (lambda it=it: load(it, 0)), (lambda xb, it=it: one_pass(it, xb))
                continue
            for k in range(nchunks):            # pass 1: running max and sum
                yield (lambda it=it, k=k: load(it, k)), (lambda xb, it=it, k=k: online(it, k, xb))
            for k in range(nchunks):            # pass 2: reloads hit L2 while the rows stay cached
                yield (lambda it=it, k=k: load(it, k)), (lambda xb, it=it, k=k: normalise(it, k, xb))

    with np.errstate(all="ignore"):
        pipeline(tasks())
    return (out,)


__all__ = ["softmax", "default_tiling"]
