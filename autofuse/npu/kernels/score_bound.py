"""The largest squared row norm of q and of k: a bound on every attention score, ``|q_i·k_j| <= |q_i| |k_j|``.

    npu.run("score_bound", q, k)      -> (partials,)   fp32 [cores, 2, 8]: per core, max |q_i|² and max |k_j|²
                                                       (each repeated over one 32 B block)

FlashAttention's causal kernel skips the key tiles above the diagonal. With a ``-inf`` mask that is exact;
with a finite one (GPT-2 in fp16 adds ``finfo(float16).min``) a skipped entry still weighs
``exp(fill + s - max)``, which is 0 in fp32 only while the scores cannot offset the fill. This kernel
gives the bound that decides it, at the cost of one read of q and k: the fused attention op
(:mod:`autofuse.ops`) launches it first and skips only when the bound proves every skipped weight
underflows to exactly 0, so the skip is bit-for-bit the full computation.

Schedule: the rows of q, then of k, split evenly over the vector cores, ``rows`` rows per tile,
double-buffered. Per tile (fp16/bf16; fp32 skips the cast): cast -> fp32 | mul x*x | reduce sum per row |
max into a running per-row maximum (one small pass); after each tensor's last tile, one reduce max of
the running maximum and a 32 B store of the core's value. The final maximum over the cores' values (one
per core) is the caller's; on the chip it is an atomic-max store to one GM word (Ascend C
``SetAtomicMax``), which moves the same 32 B per core.

``tiling``: ``{"rows": rows per tile}``; ``None`` picks the largest tile that fits UB, capped so each
core has at least four tiles of each tensor.

``bias_bound`` (below), the same passes over one tensor: ``npu.run("bias_bound", x) -> (partials,)``, fp32 [cores,
8], per core max |x| over the elements of an additive mask (a learned bias added to a causal mask, T5's decoder).
"""
from __future__ import annotations

import math

import numpy as np

from autofuse.npu.kernels.tiles import (VEC_FLOATS, active_mask, ceil_div, check_dtype, extents, lockstep, pad,
                                        pipeline, split_blocks, view)
from autofuse.npu.run import kernel
from cost_model.vecutil import score_bound_cores, score_bound_rows as default_rows, score_bound_tiles as specs

F32 = "float32"
BLOCK = 8                      # fp32 values in one 32 B block: the unit of the per-core store


@kernel("score_bound")
def score_bound(launch, q, k, tiling=None):
    """Per core, the largest squared row norm (over the last dim) of ``q`` and of ``k``; see the module
    docstring. NaN or inf in a row makes its core's value NaN or inf (the bound then proves nothing)."""
    for nm, t in (("q", q), ("k", k)):
        check_dtype("score_bound", nm, t, VEC_FLOATS)
        if t.data.ndim < 1:
            raise ValueError(f"score_bound: {nm} is 0-d; it needs a last dim of head features")
    D = q.shape[-1]
    if k.shape[-1] != D or k.dtype != q.dtype:
        raise ValueError(f"score_bound: q is [..., {D}] {q.dtype}, k is [..., {k.shape[-1]}] {k.dtype}; "
                         f"they must share the last dim and dtype")
    tensors = [view(t, (math.prod(t.shape[:-1]), D)) for t in (q, k)]
    return _row_bound(launch, "score_bound", tensors, q.dtype, tiling, square=True)


@kernel("bias_bound")
def bias_bound(launch, x, tiling=None):
    """The largest magnitude of an additive mask: ``max |x|`` over its elements, a bound on what it adds to a
    score; ``(partials,)``, fp32 ``[cores, 8]``: per core, max |x| (repeated over one 32 B block).

    The causal skip over a mask that is a learned bias plus a proven causal mask (T5's decoder: ``scores +
    position_bias + causal_mask``) is exact only while the bias cannot offset the causal mask's masked value
    (:func:`autofuse.ops.causal_bias_skip_is_exact`). The fused attention op launches this kernel (with
    ``score_bound``) first, on the bias as it receives it, and skips only when both bounds prove it.

    Schedule: the rows of ``x`` (its last dim a row), split evenly over the vector cores, ``rows`` rows per tile,
    double-buffered. Per tile (fp16/bf16; fp32 skips the cast): cast -> fp32 | abs | reduce max per row | max into
    a running per-row maximum (one small pass); after the last tile, one reduce max of the running maximum and a
    32 B store of the core's value. The same passes as ``score_bound`` (``abs`` for ``x*x``, a reduce max for the
    reduce sum) over one tensor, so the cost model shares that kernel's schedule. A NaN anywhere makes its core's
    value NaN (``vmax`` propagates NaN, as numpy's ``maximum``), an inf inf: the bound then proves nothing.

    ``tiling``: as ``score_bound``'s."""
    check_dtype("bias_bound", "x", x, VEC_FLOATS)
    if x.data.ndim < 1:
        raise ValueError("bias_bound: x is 0-d; give the mask as it broadcasts (its last dim a row)")
    D = x.shape[-1]
    return _row_bound(launch, "bias_bound", [view(x, (math.prod(x.shape[:-1]), D))], x.dtype, tiling, square=False)


def _row_bound(launch, kernel, tensors, dtype, tiling, square):
    """The two bounds' one schedule over 2-D views ``tensors`` (rows of ``D``): per row ``sum(x*x)`` (``square``)
    or ``max |x|``, a running max per core and tensor, and per core one 32 B store per tensor: ``(partials,)``,
    fp32 ``[cores, len(tensors), 8]`` (``[cores, 8]`` for one tensor, ``bias_bound``'s)."""
    dev, D = launch.device, tensors[0].shape[1]
    rows = max(t.shape[0] for t in tensors)
    n = score_bound_cores(dev, rows)
    one = not square                    # bias_bound's one tensor: [cores, 8]
    out = launch.empty((n, BLOCK) if one else (n, len(tensors), BLOCK), F32, "partials")
    if launch.values:
        out.data[...] = 0.0
    if rows == 0 or D == 0:
        return (out,)
    if tiling:
        R = int(tiling.get("rows", 1))
        if R < 1:
            raise ValueError(f"{kernel}: tiling rows={R} must be positive")
    else:
        R = default_rows(dev, dtype, D, ceil_div(rows, n))
    lowp = dtype != F32
    g = launch.group("aiv", n)
    dp = pad(D, "float16")
    X = [g.alloc("UB", (R, dp), dtype, f"x{i}") for i in range(2)]
    W = g.alloc("UB", (R, dp), F32, "w") if lowp else None
    T = g.alloc("UB", (R, dp), F32, "sq" if square else "abs")
    rp = pad(R, F32)
    S = g.alloc("UB", (rp,), F32, "rowsum" if square else "rowmax")
    M = g.alloc("UB", (rp,), F32, "runmax")
    O = g.alloc("UB", (BLOCK,), F32, "out")
    ctr = {"x": 0}

    def load(xv, items):
        xb = X[ctr["x"] % 2]
        ctr["x"] += 1
        g.load(xb, xv, [None if it is None else (slice(it[0], it[0] + it[1]), slice(0, D)) for it in items],
               active=active_mask(items), name="load x")
        return xb

    def work(col, items, first, last, xb):
        act = active_mask(items)
        re = extents(items, lambda it: it[1])
        ew = g.repeats(re * dp, F32)
        src = xb
        if lowp:
            g.vector("cast x->fp32", (W,), (xb,), ew, active=act, compute=lambda: np.copyto(W.data, xb.data))
            src = W
        if square:
            g.vector("mul x*x", (T,), (src,), ew, active=act,
                     compute=lambda: np.multiply(src.data, src.data, out=T.data))
        else:
            g.vector("abs x", (T,), (src,), ew, active=act, compute=lambda: np.abs(src.data, out=T.data))

        def per_row():
            x = T.data[:, :, :D]
            s = x.sum(axis=2) if square else x.max(axis=2)      # a NaN in the row stays NaN
            s[np.arange(R)[None, :] >= re[:, None]] = 0.0        # rows past a core's extent: stale tile data
            S.data[:, :R] = s
        g.vector("reduce sum" if square else "reduce max", (S,), (T,), g.row_repeats(re, D, F32), active=act,
                 compute=per_row)
        if first:
            g.vector("copy", (M,), (S,), g.repeats(re, F32), active=act,
                     compute=lambda: np.copyto(M.data[:, :R], S.data[:, :R]))
        else:
            # vmax propagates NaN, as numpy's maximum does: a NaN row keeps the bound NaN
            g.vector("max acc", (M,), (M, S), g.repeats(re, F32), active=act,
                     compute=lambda: np.maximum(M.data[:, :R], S.data[:, :R], out=M.data[:, :R]))
        if last:
            g.vector("reduce max", (O,), (M,), g.row_repeats(1, R, F32),
                     compute=lambda: np.copyto(O.data, np.max(M.data[:, :R], axis=1)[:, None]))
            where = [(c, slice(0, BLOCK)) if one else (c, col, slice(0, BLOCK)) for c in range(n)]
            g.store(O, out, where, name="store max")

    def tasks():
        for col, xv in enumerate(tensors):
            blocks = split_blocks(xv.shape[0], n, R)
            steps = list(lockstep(blocks))
            for s, items in enumerate(steps):
                yield ((lambda xv=xv, items=items: load(xv, items)),
                       (lambda xb, col=col, items=items, s=s, ns=len(steps): work(col, items, s == 0, s == ns - 1,
                                                                                   xb)))

    with np.errstate(all="ignore"):
        pipeline(tasks())
    return (out,)


__all__ = ["bias_bound", "default_rows", "score_bound", "specs"]
