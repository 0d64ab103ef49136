"""Row normalisations on the Vector unit, over the last dim H, statistics in fp32.

    npu.run("layer_norm", x, weight=None, bias=None, eps=1e-5)        -> (y,)  [+ mean, rstd: return_stats]
    npu.run("rms_norm", x, weight, eps=1e-6)                          -> (y, rstd)
    npu.run("add_rms_norm", x, residual, weight, eps=1e-6)            -> (y, rstd, x + residual)

``rstd`` (and ``mean``) are fp32 of shape ``x.shape[:-1] + (1,)``, as CANN's RmsNorm / LayerNorm return
them. ``add_rms_norm`` normalises the sum rounded to x's dtype, which is what the unfused graph (an add,
then RMSNorm) computes, and writes that sum out as its third output.

Schedule: rows split evenly over the vector cores, ``rows`` rows per tile, double-buffered; weight and
bias are loaded and cast to fp32 once per core. When a whole row fits UB only that way, the outputs
reuse dead inputs' tiles (the sum is written over x, y over the residual or x; see :func:`_specs`): rows
of 8192 bf16 values then stay whole on a 192 KB UB instead of being chunked.
Per tile, Vector (fp16/bf16 input; fp32 skips the casts):

    rms_norm    cast x->fp32 | mul x*x | reduce sum | (small: muls 1/H, adds eps, rsqrt) |
                mul x*rstd | mul *gamma | cast y
    layer_norm  cast x->fp32 | reduce sum | (muls 1/H) | sub mean | mul d*d | reduce sum |
                (muls 1/H, adds eps, rsqrt) | mul d*rstd | mul *gamma | add beta | cast y
    add_rms     add x+residual (fp16 natively; bf16 via fp32 and a cast back) | then rms_norm's passes

A row longer than UB is chunked (``chunk`` < H): pass 1 walks the chunks accumulating the statistics
(layer_norm merges per-chunk mean and squared deviations with Chan's formula, so no E[x²]-E[x]²
cancellation), pass 2 walks them again backwards: the last chunk is still in UB, the others are
reloaded (L2 hits while the rows in flight fit L2), weight chunks with them.

``tiling``: ``{"rows": rows per tile, "chunk": elements of H per tile}``; ``None`` picks the largest
tile that fits UB, capped so each core has at least four tiles.
"""
from __future__ import annotations

import math

import numpy as np

from autofuse.npu.kernels.tiles import (VEC_FLOATS, active_mask, ceil_div, check_dtype, extents, fits, lanes,
                                        largest, lockstep, pad, pipeline, rnd, split_blocks, view)
from autofuse.npu.run import kernel

STAT = 8
F32 = "float32"


def _specs(kind, dtype, wdt, has_w, has_b, R, cc, H, tight=False):
    """UB tiles, in allocation order.

    ``tight`` (only for whole rows that do not fit otherwise): the outputs reuse dead inputs' tiles (the
    sum of add_rms is written over x, y over the residual or x) and weight and bias share one staging tile.
    Otherwise the sum and y have double-buffered tiles of their own, so a store never holds up the next
    load into the same tile.
    """
    cp = pad(cc, "float16")
    tile = (R, cp)
    sp = [(tile, dtype)] * 2                                        # x
    if kind == "add_rms":
        sp += [(tile, dtype)] * (2 if tight else 4)                 # residual, x + residual (double-buffered)
    if dtype != F32:
        sp.append((tile, F32))                                      # w: x in fp32
    sp.append((tile, F32))                                          # t: work
    nbuf = 1 if cc >= H else 2                                      # chunked: weight chunks double-buffered
    shared = _shared_stage(tight, wdt, has_w, has_b)
    for j, (present, dt) in enumerate(((has_w, wdt[0]), (has_b, wdt[1]))):
        if present:
            sp += [((1, cp), F32)] * nbuf
            if dt != F32 and not (shared and j == 1):
                sp += [((1, cp), dt)] * nbuf                        # staging for the cast to fp32
    if not tight:
        sp += [(tile, dtype)] * 2                                   # y
    return sp + [((R, STAT), F32)] * 10                             # statistics, two sets


def _shared_stage(tight, wdt, has_w, has_b):
    """Weight and bias share one staging tile (tight layout, both present, same dtype)."""
    return tight and has_w and has_b and wdt[0] == wdt[1]


def layout(dev, kind, dtype, wdt, has_w, has_b, H):
    """``(spec_fn, tight)``: ``spec_fn(rows, chunk)`` gives the UB tiles; whole rows (chunk = H) use the
    tight layout when ``tight``, which is when they fit UB only that way (see :func:`_specs`)."""
    tight = not fits(dev, _specs(kind, dtype, wdt, has_w, has_b, 1, H, H)) and \
        fits(dev, _specs(kind, dtype, wdt, has_w, has_b, 1, H, H, True))
    return (lambda r, c: _specs(kind, dtype, wdt, has_w, has_b, r, c, H, tight and c >= H)), tight


def _default(dev, spec_fn, H, per_core):
    step = lanes(dev, F32)
    if fits(dev, spec_fn(1, H)):
        cc = H
    else:
        cc = step * largest(lambda k: fits(dev, spec_fn(1, k * step)), 1, ceil_div(H, step))
    if cc < 1:
        raise ValueError(f"norm: not even one row chunk of {step} values fits UB on {dev.name}")
    R = largest(lambda r: fits(dev, spec_fn(r, cc)), 1, per_core)
    if cc == H:
        R = min(R, max(1, ceil_div(per_core, 4)))
    return R, cc


def _norm(launch, kind, x, residual, weight, bias, eps, tiling, return_stats):
    name = kind if kind != "add_rms" else "add_rms_norm"
    check_dtype(name, "x", x)
    if x.data.ndim < 1:
        raise ValueError(f"{name}: x is 0-d; it needs a last dim to normalise")
    dtype = x.dtype
    shape = tuple(x.shape)
    H = shape[-1]
    rows = math.prod(shape[:-1])
    for nm, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_dtype(name, nm, t, VEC_FLOATS)
            if math.prod(t.shape) != H:
                raise ValueError(f"{name}: {nm} has shape {list(t.shape)}; expected {H} values (x is {list(shape)})")
    if residual is not None:
        check_dtype(name, "residual", residual)
        if tuple(residual.shape) != shape or residual.dtype != dtype:
            raise ValueError(f"{name}: residual is {list(residual.shape)} {residual.dtype}, "
                             f"x is {list(shape)} {dtype}; they must match")
    dev = launch.device
    y = launch.empty(shape, dtype, "y")
    stat_shape = shape[:-1] + (1,)
    rstd_t = launch.empty(stat_shape, F32, "rstd") if (kind != "layer" or return_stats) else None
    mean_t = launch.empty(stat_shape, F32, "mean") if (kind == "layer" and return_stats) else None
    sum_t = launch.empty(shape, dtype, "x_sum") if kind == "add_rms" else None
    outs = (y,) + ((mean_t,) if mean_t is not None else ()) + ((rstd_t,) if rstd_t is not None else ()) + \
        ((sum_t,) if sum_t is not None else ())
    if rows * H == 0:
        return outs
    has_w, has_b = weight is not None, bias is not None
    wdt = (weight.dtype if has_w else F32, bias.dtype if has_b else F32)
    spec_fn, tight = layout(dev, kind, dtype, wdt, has_w, has_b, H)
    n = min(dev.vector_cores, rows)
    per_core = ceil_div(rows, n)
    if tiling:
        R, cc = int(tiling.get("rows", 1)), min(int(tiling.get("chunk", H)), H)
    else:
        R, cc = _default(dev, spec_fn, H, per_core)
    if R < 1 or cc < 1:
        raise ValueError(f"{name}: tiling rows={R}, chunk={cc} must be positive")
    nch = ceil_div(H, cc)
    cp = pad(cc, "float16")
    lowp = dtype != F32
    tight = tight and cc >= H

    g = launch.group("aiv", n)
    X = [g.alloc("UB", (R, cp), dtype, f"x{i}") for i in range(2)]
    Rs = [g.alloc("UB", (R, cp), dtype, f"res{i}") for i in range(2)] if kind == "add_rms" else None
    S = [g.alloc("UB", (R, cp), dtype, f"sum{i}") for i in range(2)] if kind == "add_rms" and not tight else None
    W = g.alloc("UB", (R, cp), F32, "w") if lowp else None
    T = g.alloc("UB", (R, cp), F32, "t")
    par = {}                 # name -> (GM view, fp32 tiles, staging tiles); two of each when H is chunked
    nbuf = 1 if nch == 1 else 2
    shared = _shared_stage(tight, wdt, has_w, has_b)
    for nm, t, present, dt in (("gamma", weight, has_w, wdt[0]), ("beta", bias, has_b, wdt[1])):
        if present:
            stages = par["gamma"][2] if (shared and nm == "beta") else \
                [g.alloc("UB", (1, cp), dt, f"{nm}_in{i}") if dt != F32 else None for i in range(nbuf)]
            par[nm] = (view(t, (1, H)), [g.alloc("UB", (1, cp), F32, f"{nm}{i}") for i in range(nbuf)], stages)
    Y = None if tight else [g.alloc("UB", (R, cp), dtype, f"y{i}") for i in range(2)]
    # two sets of statistics: the rstd/mean stores of one row block overlap the next block's statistics
    st_sets = [[g.alloc("UB", (R, STAT), F32, f"stat{j}_{i}") for i in range(5)] for j in range(2)]
    xv = view(x, (rows, H))
    rv = view(residual, (rows, H)) if residual is not None else None
    yv = view(y, (rows, H))
    sv = view(sum_t, (rows, H)) if sum_t is not None else None
    rstd_v = view(rstd_t, (rows, 1)) if rstd_t is not None else None
    mean_v = view(mean_t, (rows, 1)) if mean_t is not None else None
    ctr = {"x": 0, "y": 0, "s": 0, "p": 0}

    def col(k):
        return slice(k * cc, min(H, (k + 1) * cc))

    def load_params(k, act=None):
        """Weight/bias chunk k -> fp32 tiles (MTE2 and a cast); once per core when H fits one chunk."""
        i = ctr["p"] % nbuf
        ctr["p"] += 1
        cv = col(k).stop - col(k).start
        out = {}
        for nm, (gm, t32s, stages) in par.items():
            t32, stage = t32s[i], stages[i]
            regs = [(slice(0, 1), col(k))] * n
            if stage is None:
                g.load(t32, gm, regs, active=act, name=f"load {nm}")
            else:
                g.load(stage, gm, regs, active=act, name=f"load {nm}")
                g.vector(f"cast {nm}->fp32", (t32,), (stage,), g.repeats(pad(cv, "float16"), F32), active=act,
                         compute=lambda t32=t32, stage=stage: np.copyto(t32.data, stage.data))
            out[nm] = t32
        return out

    params0 = load_params(0) if nch == 1 else None

    def stat(t):
        return t.data[:, :, :1]

    class Block:
        """One lockstep row block: which rows each core has, and its statistics tiles."""

        def __init__(self, blk, items):
            self.items, self.st = items, st_sets[blk % 2]
            self.act = active_mask(items)
            self.re = extents(items, lambda it: it[1])
            self.small = g.repeats(self.re * STAT, F32)
            self.sum_end = {}

        def regions(self, k):
            return [None if it is None else (slice(it[0], it[0] + it[1]), col(k)) for it in self.items]

        def counts(self, k):
            cv = col(k).stop - col(k).start
            return g.repeats(self.re * pad(cv, "float16"), F32), g.row_repeats(self.re, cv, F32), cv

    def load1(b, k):
        """Pass 1 loads: chunk k of x (and of the residual)."""
        i = ctr["x"] % 2
        ctr["x"] += 1
        g.load(X[i], xv, b.regions(k), active=b.act, name="load x")
        if kind == "add_rms":
            g.load(Rs[i], rv, b.regions(k), active=b.act, name="load residual")
        return i

    def to_f32(b, k, src):
        """Cast a chunk to fp32 (fp16/bf16); fp32 input is used in place."""
        if not lowp:
            return src
        g.vector("cast x->fp32", (W,), (src,), b.counts(k)[0], active=b.act,
                 compute=lambda: np.copyto(W.data, src.data))
        return W

    def add_residual(b, k, i):
        """add_rms: s = x + residual in x's dtype (written over x in the tight layout), stored as the third
        output; returns the sum tile."""
        xb, rb = X[i], Rs[i]
        if tight:
            sb = xb
        else:
            sb = S[ctr["s"] % 2]
            ctr["s"] += 1
        ew = b.counts(k)[0]
        if dtype != "bfloat16":
            g.vector("add x+residual", (sb,), (xb, rb), g.repeats(b.re * pad(col(k).stop - col(k).start,
                                                                               "float16"), dtype),
                     active=b.act, compute=lambda: np.copyto(sb.data, rnd(xb.data + rb.data, dtype)))
        else:       # bf16: both up to fp32, add, round back to bf16
            g.vector("cast x->fp32", (W,), (xb,), ew, active=b.act)
            g.vector("cast residual->fp32", (T,), (rb,), ew, active=b.act)
            g.vector("add x+residual", (T,), (T, W), ew, active=b.act)
            g.vector("cast sum->bf16", (sb,), (T,), ew, active=b.act,
                     compute=lambda: np.copyto(sb.data, rnd(xb.data + rb.data, dtype)))
        b.sum_end[k] = g.store(sb, sv, b.regions(k), active=b.act, name="store x_sum")
        return sb

    def brcb(b, t):
        """Spread each row's reduced value over one 32 B block, the layout per-row operands are read in."""
        g.vector("brcb", (t,), (t,), ceil_div(b.re, 8), active=b.act)

    def stats(b, k, i):
        """Pass 1 work on chunk k: accumulate the statistics; after the last chunk, rstd (and normalise
        at once when the row is one chunk)."""
        st, act, small = b.st, b.act, b.small
        src = add_residual(b, k, i) if kind == "add_rms" else X[i]
        if k == nch - 1:
            b.last = src              # pass 2 starts with this chunk, still in UB
        w = to_f32(b, k, src)
        ew, row, cv = b.counts(k)
        v = (slice(None), slice(None), slice(0, cv))
        if kind in ("rms", "add_rms"):
            # st0 = sum of x²
            g.vector("mul x*x", (T,), (w,), ew, active=act, compute=lambda: np.multiply(w.data, w.data, out=T.data))
            tgt = st[0] if k == 0 else st[3]
            g.vector("reduce sum", (tgt,), (T,), row, active=act,
                     compute=lambda: np.copyto(stat(tgt), T.data[v].sum(axis=2, keepdims=True)))
            brcb(b, tgt)
            if k:
                g.vector("add acc", (st[0],), (st[0], st[3]), small, active=act,
                         compute=lambda: np.add(stat(st[0]), stat(st[3]), out=stat(st[0])))
        else:
            # st0 = mean, st1 = M2 (sum of squared deviations); chunk k>0 in st3, st4, merged by Chan
            mt = st[0] if k == 0 else st[3]
            m2 = st[1] if k == 0 else st[4]
            g.vector("reduce sum", (mt,), (w,), row, active=act,
                     compute=lambda: np.copyto(stat(mt), w.data[v].sum(axis=2, keepdims=True)))
            brcb(b, mt)
            g.vector(f"muls 1/{cv}", (mt,), (mt,), small, active=act,
                     compute=lambda: np.multiply(stat(mt), np.float32(1.0 / cv), out=stat(mt)))
            g.vector("sub mean", (T,), (w, mt), row, active=act,
                     compute=lambda: np.subtract(w.data, stat(mt), out=T.data))
            # one chunk: d*d overwrites x (no longer needed) and d stays in T for the normalisation
            sq = (W if lowp else X[i]) if nch == 1 else T
            g.vector("mul d*d", (sq,), (T,), ew, active=act, compute=lambda: np.multiply(T.data, T.data, out=sq.data))
            g.vector("reduce sum", (m2,), (sq,), row, active=act,
                     compute=lambda: np.copyto(stat(m2), sq.data[v].sum(axis=2, keepdims=True)))
            brcb(b, m2)
            if k:
                na, nb = np.float32(k * cc), np.float32(cv)

                def chan():
                    delta = stat(st[3]) - stat(st[0])
                    tot = na + nb
                    stat(st[0])[...] = stat(st[0]) + delta * (nb / tot)
                    stat(st[1])[...] = stat(st[1]) + stat(st[4]) + delta * delta * (na * nb / tot)
                # Chan's merge: delta, mean += delta*nb/n, M2 += M2_b + delta²·na·nb/n (six small passes)
                for nm_ in ("sub delta", "muls nb/n", "add mean", "mul delta²", "muls na·nb/n", "add M2"):
                    g.vector(nm_, (st[0], st[1]), (st[0], st[1], st[3], st[4]), small, active=act,
                             compute=chan if nm_ == "add M2" else None)
        if k < nch - 1:
            return
        # rstd = rsqrt(stat / H + eps)
        s_src = st[0] if kind != "layer" else st[1]
        b.rstd = rstd = st[2] if kind != "layer" else (st[4] if nch == 1 else st[3])
        g.vector(f"muls 1/{H}", (rstd,), (s_src,), small, active=act,
                 compute=lambda: np.multiply(stat(s_src), np.float32(1.0 / H), out=stat(rstd)))
        g.vector("adds eps", (rstd,), (rstd,), small, active=act,
                 compute=lambda: np.add(stat(rstd), np.float32(eps), out=stat(rstd)))
        g.vector("rsqrt", (rstd,), (rstd,), small, active=act,
                 compute=lambda: np.divide(np.float32(1), np.sqrt(stat(rstd)), out=stat(rstd)))
        if nch == 1:
            normalise(b, 0, (w, params0, Rs[i] if kind == "add_rms" else X[i]))

    def load2(b, k):
        """Pass 2 loads (H chunked): chunk k of x, or of the sum written in pass 1 (the last chunk, which
        pass 2 takes first, is still in UB); weight chunks."""
        if k == nch - 1:              # normalise finds it in b.last (pass 1 has not issued it yet)
            return None, load_params(k, b.act), None
        i = ctr["x"] % 2
        ctr["x"] += 1
        src = X[i]
        if kind == "add_rms":     # read the sum back once its store has completed (an L2 hit)
            g.load(src, sv, b.regions(k), active=b.act, deps=(b.sum_end[k],), name="load x_sum")
        else:
            g.load(src, xv, b.regions(k), active=b.act, name="load x")
        return src, load_params(k, b.act), None        # chunked rows never use the tight layout

    def normalise(b, k, h):
        """Pass 2 work on chunk k: (x - mean) * rstd * gamma + beta, cast, store; stats after the last."""
        w, params, yb = h           # yb (tight): a tile whose input is dead by the time y is cast into it
        w = b.last if w is None else w
        if not tight:
            yb = Y[ctr["y"] % 2]
            ctr["y"] += 1
        st, act = b.st, b.act
        ew, row, cv = b.counts(k)
        if nch > 1:
            w = to_f32(b, k, w)
        rstd, mean = b.rstd, st[0]
        if kind == "layer":
            if nch > 1:
                g.vector("sub mean", (T,), (w, mean), row, active=act,
                         compute=lambda: np.subtract(w.data, stat(mean), out=T.data))
            g.vector("mul d*rstd", (T,), (T, rstd), row, active=act,
                     compute=lambda: np.multiply(T.data, stat(rstd), out=T.data))
        else:
            g.vector("mul x*rstd", (T,), (w, rstd), row, active=act,
                     compute=lambda: np.multiply(w.data, stat(rstd), out=T.data))
        for nm, op in (("gamma", np.multiply), ("beta", np.add)):
            if nm in params:
                p32 = params[nm]
                g.vector(f"{'mul' if nm == 'gamma' else 'add'} {nm}", (T,), (T, p32), row, active=act,
                         compute=lambda p32=p32, op=op: op(T.data, p32.data, out=T.data))
        g.vector("cast y" if lowp else "copy y", (yb,), (T,), ew, active=act,
                 compute=lambda: np.copyto(yb.data, rnd(T.data, dtype)))
        g.store(yb, yv, b.regions(k), active=act, name="store y")
        if k < nch - 1:
            return
        sregs = [None if it is None else (slice(it[0], it[0] + it[1]), slice(0, 1)) for it in b.items]
        if mean_v is not None:
            g.store(mean, mean_v, sregs, active=act, name="store mean")
        if rstd_v is not None:
            g.store(rstd, rstd_v, sregs, active=act, name="store rstd")

    def tasks():
        for blk, items in enumerate(lockstep(split_blocks(rows, n, R))):
            b = Block(blk, items)
            for k in range(nch):
                yield (lambda b=b, k=k: load1(b, k)), (lambda h, b=b, k=k: stats(b, k, h))
            if nch > 1:               # backwards: the last chunk of pass 1 is the first of pass 2
                for k in reversed(range(nch)):
                    yield (lambda b=b, k=k: load2(b, k)), (lambda h, b=b, k=k: normalise(b, k, h))

    with np.errstate(all="ignore"):
        pipeline(tasks())
    return outs


@kernel("layer_norm")
def layer_norm(launch, x, weight=None, bias=None, eps=1e-5, tiling=None, return_stats=False):
    """``F.layer_norm(x, x.shape[-1:], weight, bias, eps)``; ``return_stats``: also fp32 mean and rstd."""
    return _norm(launch, "layer", x, None, weight, bias, eps, tiling, return_stats)


@kernel("rms_norm")
def rms_norm(launch, x, weight, eps=1e-6, tiling=None):
    """``x * rsqrt(mean(x², -1) + eps) * weight`` -> (y, rstd fp32 [..., 1]), as CANN RmsNorm."""
    if weight is None:
        raise ValueError("rms_norm: weight is required (CANN RmsNorm's gamma)")
    return _norm(launch, "rms", x, None, weight, None, eps, tiling, True)


@kernel("add_rms_norm")
def add_rms_norm(launch, x, residual, weight, eps=1e-6, tiling=None):
    """s = x + residual (in x's dtype); -> (rms_norm(s) * weight, rstd, s), as CANN AddRmsNorm."""
    if weight is None:
        raise ValueError("add_rms_norm: weight is required")
    return _norm(launch, "add_rms", x, residual, weight, None, eps, tiling, True)


__all__ = ["layer_norm", "rms_norm", "add_rms_norm"]
