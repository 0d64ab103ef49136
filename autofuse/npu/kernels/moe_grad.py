"""Backward kernels of the MoE combine and router, on the Vector unit.

    npu.run("moe_finalize_routing_grad", grad, expanded, scales, expanded_row_idx)   -> (d_expanded, d_scales)
    npu.run("moe_gating_topk_grad", x, grad_w, indices, k=2, norm="softmax", renorm=True) -> (dx,)

*moe_finalize_routing_grad* (CANN's MoeFinalizeRoutingV2Grad): the forward ``out[t] = skip[t] + Σ_j
scales[t, j] · expanded[r]`` with ``r = expanded_row_idx[t·k + j]`` gives, for the output gradient
``grad [T, H]``:

* ``d_expanded[r] = scales[t, j] · grad[t]`` (fp32 product, one rounding to expanded's dtype);
* ``d_scales[t, j] = Σ_h grad[t, h] · expanded[r, h]`` (fp32 products and sums, one rounding to scales'
  dtype); ``d_skip = grad`` needs no kernel.

Tokens are split over the vector cores as in the forward; per block of tokens the row indices and scales
are loaded once and the block's dots stored once. Per token and H chunk: the gradient row is loaded (and
cast to fp32), then per j the expanded row is gathered (MTE2, a ring of buffers) and cast, ``mul`` and
``reduce sum`` give the chunk's part of the dot (added to the earlier chunks' in fp32), ``muls`` by the
scale (then the cast) gives the row of ``d_expanded``, stored to row r. Every row of ``d_expanded`` is
written once when the row indices are a permutation of its rows (what ``moe_init_routing`` gives; the
default). ``accumulate=True`` handles any indices: the rows are first set to zero (a zero tile stored per
row, dealt over the cores), all cores wait, and each product is added with the MTE3 atomic add (in
expanded's dtype), so rows referenced twice get the sum and rows never referenced stay zero.

*moe_gating_topk_grad*: the gradient of ``moe_gating_topk``'s weights w.r.t. its logits, the experts fixed
(``indices``, saved by the forward; the selection bias and the group limit only chose them). Per token:
the scores ``s = norm(x)`` are recomputed in fp32 (the forward's instructions), the chosen scores
``y_j = s[idx_j]`` gathered (``compare iota == idx_j``, ``select``, ``reduce sum``), then with ``c`` the
routed scaling factor

* ``renorm``: ``w_j = c·y_j / (Σy + eps)``, so ``dy_j = c·(gw_j - Σ_i gw_i·y_i / (Σy + eps)) / (Σy + eps)``;
  without it ``dy_j = c·gw_j``;
* ``ds`` = the ``dy_j`` scattered to their experts (``compare``, ``select``, ``add`` per j), zero elsewhere;
* ``softmax``: ``dx = s·(ds - Σ s·ds)``; ``sigmoid``: ``dx = ds·s·(1 - s)``; ``none``: ``dx = ds``,

all in fp32, one rounding to x's dtype. Layout as the forward's: a tile of ``lanes`` token rows (logits,
weight gradients, indices: three loads, double-buffered) is transposed (``vnchwconv``) to experts × lanes,
so every step is an elementwise instruction over rows of ``lanes`` values; the gradient is transposed back
and stored. Token rows are split evenly over the vector cores.

``tiling``: finalize ``{"block": tokens per index block, "cols": elements of H per row}``; gating
``{"lanes": token rows per tile}``.
"""
from __future__ import annotations

import numpy as np

from autofuse.npu.dtypes import itemsize
from autofuse.npu.kernels.moe_gating import NORMS, Lanes, _vnchwconv
from autofuse.npu.kernels.moe_routing import RING, _AtomicAdd, _check_index, widest_cols
from autofuse.npu.kernels.tiles import (VEC_FLOATS, active_mask, block_elems, ceil_div, check_dtype, extents, fits,
                                        largest, lockstep, pad, pipeline, rnd, round_up, split_blocks, view)
from autofuse.npu.run import kernel

F32 = "float32"


# ------------------------------------------------------------------------------------------ finalize
def finalize_grad_specs(k, block, hc, dtype, sdt):
    """UB allocations of moe_finalize_routing_grad besides the row ring, in allocation order (the cost model
    mirrors this list)."""
    lowp = dtype != F32
    specs = [((pad(block * k, "int32"),), "int32")] * 2 + [((block, pad(k, sdt)), sdt)] * 2   # indices, scales
    specs += [((block, pad(k, F32)), F32)] * 2                                                # dots
    if sdt != F32:
        specs += [((block, pad(k, F32)), F32), ((block, pad(k, sdt)), sdt)]                   # scales fp32, dots out
    specs += [((1, pad(hc, dtype)), dtype)] * 2                                               # gradient rows
    specs += [((1, pad(hc, F32)), F32)] * (3 if lowp else 1)        # product (+ gradient fp32, row fp32)
    specs += [((1, 8), F32)]                                        # a chunk's part of a dot
    specs += [((1, pad(hc, dtype)), dtype)] * 2                     # d_expanded rows, double-buffered
    return specs


def finalize_grad_cols(device, H, k, block, dtype, sdt):
    """Elements of H per row: all of H when every tile fits UB, else the widest whole blocks that do."""
    cblk = max(block_elems(dtype), 8)
    return widest_cols(device, H, dtype, lambda h: finalize_grad_specs(k, block, h, dtype, sdt)
                       + [((1, round_up(h, cblk)), dtype)] * RING, "moe_finalize_routing_grad")


@kernel("moe_finalize_routing_grad", steer=("expanded_row_idx",))      # which rows are loaded and written
def moe_finalize_routing_grad(launch, grad, expanded, scales, expanded_row_idx, accumulate=False, tiling=None):
    """``(d_expanded [R, H], d_scales [T, k])`` of ``moe_finalize_routing`` (see the module docstring)."""
    for what, t in (("grad", grad), ("expanded", expanded), ("scales", scales)):
        check_dtype("moe_finalize_routing_grad", what, t)
    _check_index("moe_finalize_routing_grad: expanded_row_idx", expanded_row_idx)
    if grad.data.ndim != 2 or expanded.data.ndim != 2 or scales.data.ndim != 2:
        raise ValueError(f"moe_finalize_routing_grad: grad must be [T, H], expanded [rows, H] and scales [T, k], got "
                         f"{list(grad.shape)}, {list(expanded.shape)} and {list(scales.shape)}")
    T, k = scales.shape
    R, H = expanded.shape
    if tuple(grad.shape) != (T, H):
        raise ValueError(f"moe_finalize_routing_grad: grad has shape {list(grad.shape)}, the output was {[T, H]}")
    if grad.dtype != expanded.dtype:
        raise TypeError(f"moe_finalize_routing_grad: grad is {grad.dtype}, expanded {expanded.dtype}; cast grad to "
                        f"expanded's dtype (the forward's output dtype)")
    if expanded_row_idx.data.size != T * k:
        raise ValueError(f"moe_finalize_routing_grad: expanded_row_idx has {expanded_row_idx.data.size} entries, "
                         f"scales [T, k] = {[T, k]} needs {T * k}")
    ridx = np.asarray(expanded_row_idx.data).reshape(-1).astype(np.int64)
    bad = (ridx < 0) | (ridx >= R)
    if bad.any():
        raise IndexError(f"moe_finalize_routing_grad: row {int(ridx[bad][0])} out of range for {R} expanded rows")
    if not accumulate and (R != T * k or (np.bincount(ridx, minlength=R) != 1).any()):
        raise ValueError("moe_finalize_routing_grad: the row indices are not a permutation of expanded's rows (a row "
                         "is referenced twice or never); pass accumulate=True (rows zeroed, then atomic adds)")
    dtype, sdt = expanded.dtype, scales.dtype
    d_exp = launch.empty((R, H), dtype, "d_expanded")
    d_sc = launch.empty((T, k), sdt, "d_scales")
    if T == 0 or H == 0:
        launch.group("aiv", 1)
        return d_exp, d_sc
    return _FinalizeGrad(launch, grad, expanded, scales, view(expanded_row_idx, (T * k,)), ridx, accumulate,
                         tiling, d_exp, d_sc).run()


class _FinalizeGrad:
    """One launch: the tiles, the optional zero fill, then token by token the gathers, dots and scaled rows."""

    def __init__(self, launch, grad, expanded, scales, iv, ridx, accumulate, tiling, d_exp, d_sc):
        dev = launch.device
        self.grad, self.expanded, self.scales, self.iv, self.ridx = grad, expanded, scales, iv, ridx
        self.accumulate, self.d_exp, self.d_sc, self.launch = accumulate, d_exp, d_sc, launch
        T, k = scales.shape
        R, H = expanded.shape
        self.T, self.k, self.R, self.H = T, k, R, H
        dtype, sdt = expanded.dtype, scales.dtype
        self.dtype, self.sdt = dtype, sdt
        self.block = block = int((tiling or {}).get("block", 0)) or 64
        self.hc = hc = min(int((tiling or {}).get("cols", 0)) or finalize_grad_cols(dev, H, k, block, dtype, sdt), H)
        self.n = n = min(dev.vector_cores, max(T, R if accumulate else 0))
        g = self.g = launch.group("aiv", n)
        self.Idx = [g.alloc("UB", (pad(block * k, "int32"),), "int32", f"idx{i}") for i in range(2)]
        self.Sc = [g.alloc("UB", (block, pad(k, sdt)), sdt, f"scales{i}") for i in range(2)]
        self.D = [g.alloc("UB", (block, pad(k, F32)), F32, f"dots{i}") for i in range(2)]
        if sdt != F32:
            self.Sc32 = g.alloc("UB", (block, pad(k, F32)), F32, "scales fp32")
            self.Do = g.alloc("UB", (block, pad(k, sdt)), sdt, "dots out")
        self.G = [g.alloc("UB", (1, pad(hc, dtype)), dtype, f"grad{i}") for i in range(2)]
        self.P = g.alloc("UB", (1, pad(hc, F32)), F32, "product")
        self.lowp = dtype != F32
        if self.lowp:
            self.G32 = g.alloc("UB", (1, pad(hc, F32)), F32, "grad fp32")
            self.Row32 = g.alloc("UB", (1, pad(hc, F32)), F32, "row fp32")
        self.Part = g.alloc("UB", (1, 8), F32, "dot part")
        self.Out = [g.alloc("UB", (1, pad(hc, dtype)), dtype, f"d_row{i}") for i in range(2)]
        self.Rows = [g.alloc("UB", (1, round_up(hc, max(block_elems(dtype), 8))), dtype, f"row{i}")
                     for i in range(RING)]
        self.ctr = {"b": 0, "r": 0, "o": 0, "g": 0}

    def run(self):
        deps = self.zero_fill() if self.accumulate else ()
        for items in lockstep(split_blocks(self.T, self.n, self.block)):
            self.block_step(items, deps)
        return self.d_exp, self.d_sc

    def zero_fill(self):
        """Every row of d_expanded set to zero: a zero tile (one Vector pass), stored once per row and chunk, rows
        dealt over the cores; all cores wait for every store (the atomic adds land on zeros)."""
        g, H, hc, dtype = self.g, self.H, self.hc, self.dtype
        Z = self.Out[0]
        g.vector("dup 0", (Z,), (), g.repeats(pad(hc, dtype), dtype), compute=lambda: Z.data.fill(0))
        ends = np.zeros(self.n)
        for items in lockstep(split_blocks(self.R, self.n, 1)):
            act = active_mask(items)
            for h0 in range(0, H, hc):
                he = min(hc, H - h0)
                e = g.store(Z, self.d_exp, [None if it is None else (slice(it[0], it[0] + 1), slice(h0, h0 + he))
                                            for it in items], active=act, name="store zero row")
                ends = np.maximum(ends, e if act is None else np.where(act, e, 0))
        return (np.full(self.n, float(ends.max())),)

    def block_step(self, items, deps):
        g, k, n, sdt = self.g, self.k, self.n, self.sdt
        act = active_mask(items)
        b = self.ctr["b"] % 2
        self.ctr["b"] += 1
        ie = g.load(self.Idx[b], self.iv, [None if it is None else (slice(it[0] * k, (it[0] + it[1]) * k),)
                                           for it in items], active=act, name="load row indices")
        se = g.load(self.Sc[b], self.scales, [None if it is None else (slice(it[0], it[0] + it[1]), slice(0, k))
                                              for it in items], active=act, name="load scales")
        sc = self.Sc[b]
        ntok = extents(items, lambda it: it[1])
        if sdt != F32:
            sc = self.Sc32
            g.vector("cast scales->fp32", (sc,), (self.Sc[b],), ceil_div(ntok * pad(k, F32), 64), active=act,
                     compute=lambda: np.copyto(sc.data[:, :, :k], self.Sc[b].data[:, :, :k]))
        D = self.D[b]
        for j in range(int(ntok.max())):
            a_j = ntok > j
            self.token(j, a_j, [items[c][0] + j if a_j[c] else None for c in range(n)], sc, D, (ie, se) + deps)
        regs = [None if it is None else (slice(it[0], it[0] + it[1]), slice(0, k)) for it in items]
        out = D
        if sdt != F32:
            out = self.Do
            g.vector(f"cast dots->{sdt}", (out,), (D,), ceil_div(ntok * pad(k, F32), 64), active=act,
                     compute=lambda: np.copyto(out.data[:, :, :k], rnd(D.data[:, :, :k], sdt)))
        g.store(out, self.d_sc, regs, active=act, name="store d_scales")

    def token(self, j, a_j, toks, sc, D, deps):
        """One token per core: its gradient row, then per expert slot the gathered row's dot and scaled row."""
        g, k, H, hc, dtype = self.g, self.k, self.H, self.hc, self.dtype
        aj = None if a_j.all() else a_j
        ridx = self.ridx
        for h0 in range(0, H, hc):
            he = min(hc, H - h0)
            first_chunk = h0 == 0
            rep = ceil_div(np.where(a_j, he, 0), 64)
            Gt = self.G[self.ctr["g"] % 2]
            self.ctr["g"] += 1
            g.load(Gt, self.grad, [(slice(t, t + 1), slice(h0, h0 + he)) if t is not None else None for t in toks],
                   active=aj, name="load grad row")
            gv = Gt
            if self.lowp:
                gv = self.G32
                g.vector("cast grad->fp32", (gv,), (Gt,), rep, active=aj,
                         compute=lambda Gt=Gt: self.G32.data[:, :, :he].__setitem__(Ellipsis, Gt.data[:, :, :he]))
            for q in range(k):
                buf = self.Rows[self.ctr["r"] % RING]
                self.ctr["r"] += 1
                rows = [None if t is None else int(ridx[t * k + q]) for t in toks]
                g.load(buf, self.expanded, [(slice(r, r + 1), slice(h0, h0 + he)) if r is not None else None
                                            for r in rows], active=aj, deps=deps, name="load expert row")
                row = buf
                if self.lowp:
                    row = self.Row32
                    g.vector("cast row->fp32", (row,), (buf,), rep, active=aj,
                             compute=lambda buf=buf: self.Row32.data[:, :, :he].__setitem__(Ellipsis,
                                                                                             buf.data[:, :, :he]))
                P = self.P
                g.vector("mul grad*row", (P,), (gv, row), rep, active=aj,
                         compute=lambda gv=gv, row=row: np.multiply(gv.data[:, :, :he], row.data[:, :, :he],
                                                                    out=P.data[:, :, :he]))
                dots = (slice(None), j, q)

                def dot(first=first_chunk, dots=dots):
                    part = P.data[:, 0, :he].sum(axis=1, dtype=np.float32)
                    D.data[dots] = part if first else D.data[dots] + part
                if first_chunk:
                    g.vector("reduce sum (dot)", (D,), (P,), rep, active=aj, compute=dot)
                else:
                    g.vector("reduce sum (dot part)", (self.Part,), (P,), rep, active=aj)
                    g.vector("add dot part", (D,), (D, self.Part), 1, active=aj, compute=dot)
                o = self.Out[self.ctr["o"] % 2]
                self.ctr["o"] += 1

                def scaled(o=o, gv=gv, q=q):
                    s = sc.data[:, j, q].astype(np.float32)[:, None, None]
                    v = gv.data[:, :, :he] * s
                    o.data[:, :, :he] = rnd(v, dtype) if self.lowp else v
                if self.lowp:
                    g.vector("muls grad*scale", (self.Row32,), (gv, sc), rep, active=aj)
                    g.vector(f"cast ->{dtype}", (o,), (self.Row32,), rep, active=aj, compute=scaled)
                else:
                    g.vector("muls grad*scale", (o,), (gv, sc), rep, active=aj, compute=scaled)
                dst = [(slice(r, r + 1), slice(h0, h0 + he)) if r is not None else None for r in rows]
                if self.accumulate:
                    g.store(o, self.d_exp, dst, active=aj, deps=deps, fn=_AtomicAdd(self.d_exp, dst),
                            name="atomic add d_row")
                else:
                    g.store(o, self.d_exp, dst, active=aj, name="store d_row")


# ------------------------------------------------------------------------------------------ gating
def gating_grad_specs(E, k, lanes, dtype, gdt):
    """UB allocations of moe_gating_topk_grad, in allocation order (the cost model mirrors this list)."""
    L = pad(lanes, F32)
    specs = [((lanes, pad(E, dtype)), dtype)] * 2                     # logits as loaded
    specs += [((lanes, pad(k, gdt)), gdt)] * 2 + [((lanes, pad(k, "int32")), "int32")] * 2   # weight grads, ids
    specs += [((E, L), F32)] * 4                                      # scores, mask, scattered grads, iota
    specs += [((k, L), F32)] * 3 + [((2, L), F32)]                    # y, gw, ids (fp32), sum and dot rows
    specs += [((lanes, pad(E, dtype)), dtype)] * 2                    # dx as stored
    return specs


def default_grad_lanes(device, T, E, k, dtype, gdt) -> int:
    """Token rows per tile: the most that fit UB, capped so each core has about four tiles (multiples of 8)."""
    n = max(1, min(device.vector_cores, T))
    per_core = ceil_div(T, n)
    top = largest(lambda v: fits(device, gating_grad_specs(E, k, 8 * v, dtype, gdt)), 1, 1 << 12)
    if top < 1:
        raise ValueError(f"moe_gating_topk_grad: {E} experts do not fit UB ({device.buffers['UB']:,} B) on "
                         f"{device.name} even 8 tokens at a time")
    return int(min(8 * top, max(8, round_up(ceil_div(per_core, 4), 8)), round_up(per_core, 8)))


@kernel("moe_gating_topk_grad")
def moe_gating_topk_grad(launch, x, grad_w, indices, k=1, norm="softmax", renorm=False, eps=1e-20,
                         routed_scaling_factor=1.0, tiling=None):
    """``dx [T, E]`` (x's dtype) of ``moe_gating_topk``'s weights, the experts ``indices`` fixed (module
    docstring)."""
    check_dtype("moe_gating_topk_grad", "x", x)
    check_dtype("moe_gating_topk_grad", "grad_w", grad_w)
    _check_index("moe_gating_topk_grad: indices", indices)
    if x.data.ndim != 2:
        raise ValueError(f"moe_gating_topk_grad: x must be [T, E] router logits, got shape {list(x.shape)}")
    T, E = x.shape
    k = int(k)
    if tuple(grad_w.shape) != (T, k) or tuple(indices.shape) != (T, k):
        raise ValueError(f"moe_gating_topk_grad: grad_w and indices must be [T, k] = {[T, k]}, got "
                         f"{list(grad_w.shape)} and {list(indices.shape)}")
    if norm == "topk_softmax":
        raise ValueError("moe_gating_topk_grad: norm='topk_softmax' is, with the experts fixed, norm='softmax' with "
                         "renorm=True and eps=0: pass those")
    if norm not in NORMS:
        raise ValueError(f"moe_gating_topk_grad: norm={norm!r}; choose one of {', '.join(NORMS)}")
    if not 1 <= k <= E:
        raise ValueError(f"moe_gating_topk_grad: k={k} must be in [1, {E}] (the number of experts)")
    if launch.values and ((np.asarray(indices.data) < 0) | (np.asarray(indices.data) >= E)).any():
        raise IndexError(f"moe_gating_topk_grad: an index is out of range for {E} experts")
    return (_GatingGrad(launch, x, grad_w, indices, k, norm, bool(renorm), float(eps), float(routed_scaling_factor),
                        tiling).run(),)


class _GatingGrad(Lanes):
    """One launch: tiles of token rows, each transposed, normalised, differentiated, transposed back."""

    def __init__(self, launch, x, grad_w, indices, k, norm, renorm, eps, scale, tiling):
        dev = launch.device
        self.launch, self.dev, self.x, self.gw, self.ids = launch, dev, x, grad_w, indices
        T, E = x.shape
        self.T, self.E, self.k, self.norm = T, E, k, norm
        self.renorm, self.eps, self.scale = renorm, np.float32(eps), np.float32(scale)
        self.dtype, self.gdt = x.dtype, grad_w.dtype
        self.dx = launch.empty((T, E), x.dtype, "dx")
        if T == 0:
            launch.group("aiv", 1)
            return
        lanes = int((tiling or {}).get("lanes", 0)) or default_grad_lanes(dev, T, E, k, x.dtype, grad_w.dtype)
        if lanes < 1:
            raise ValueError(f"moe_gating_topk_grad: tiling {tiling} needs a positive 'lanes'")
        self.lanes = lanes
        self.n = n = max(1, min(dev.vector_cores, T))
        g = self.g = launch.group("aiv", n)
        L = pad(lanes, F32)
        self.X = [g.alloc("UB", (lanes, pad(E, x.dtype)), x.dtype, f"x{i}") for i in range(2)]
        self.GW = [g.alloc("UB", (lanes, pad(k, self.gdt)), self.gdt, f"gw{i}") for i in range(2)]
        self.IX = [g.alloc("UB", (lanes, pad(k, "int32")), "int32", f"ids{i}") for i in range(2)]
        self.S = g.alloc("UB", (E, L), F32, "scores")
        self.M = g.alloc("UB", (E, L), F32, "mask")
        self.DS = g.alloc("UB", (E, L), F32, "scattered grads")
        self.iota = g.alloc("UB", (E, L), F32, "iota")
        self.Y = g.alloc("UB", (k, L), F32, "chosen scores")
        self.GT = g.alloc("UB", (k, L), F32, "weight grads")
        self.IT = g.alloc("UB", (k, L), F32, "indices")
        self.R = g.alloc("UB", (2, L), F32, "sum, dot")
        self.O = [g.alloc("UB", (lanes, pad(E, x.dtype)), x.dtype, f"dx{i}") for i in range(2)]
        self.per_core = split_blocks(T, n, lanes)
        self.ctr = 0

    def run(self):
        if self.T == 0:
            return self.dx
        E, iota = self.E, self.iota
        self.g.vector("iota (arange over experts)", (iota,), (), ceil_div(pad(self.lanes, F32), 64) * E,
                      compute=lambda: iota.data.__setitem__(Ellipsis, np.arange(E, dtype=np.float32)[None, :, None]))
        pipeline(((lambda s=s: self.load(s)), self.work) for s in lockstep(self.per_core))
        return self.dx

    def load(self, items):
        i = self.ctr % 2
        self.ctr += 1
        act = active_mask(items)
        rows = [None if it is None else slice(it[0], it[0] + it[1]) for it in items]
        for tile, src, w, what in ((self.X[i], self.x, self.E, "logits"), (self.GW[i], self.gw, self.k, "grad_w"),
                                   (self.IX[i], self.ids, self.k, "indices")):
            self.g.load(tile, src, [None if r is None else (r, slice(0, w)) for r in rows], active=act,
                        name=f"load {what}")
        return items, i

    def work(self, h):
        items, i = h
        self.items, self.act = items, active_mask(items)
        self.ke = ke = extents(items, lambda it: it[1])
        E, k = self.E, self.k
        S, M, DS, iota, GT, IT = self.S, self.M, self.DS, self.iota, self.GT, self.IT
        X, GW, IX = self.X[i], self.GW[i], self.IX[i]

        def transposed(dst, src, w):
            def run():
                dst.data.fill(0.0)
                dst.data[:, :w, :src.data.shape[1]] = src.data[:, :, :w].transpose(0, 2, 1)
            return run

        self.vec("transpose x (vnchwconv)", (S,), (X,), _vnchwconv(ke, E, itemsize(self.dtype)), transposed(S, X, E))
        if self.dtype != F32:
            self.vec("cast x->fp32", (S,), (S,), self.ew(E))
        self.normalise()
        self.vec("transpose grad_w (vnchwconv)", (GT,), (GW,), _vnchwconv(ke, k, itemsize(self.gdt)),
                 transposed(GT, GW, k))
        if self.gdt != F32:
            self.vec("cast grad_w->fp32", (GT,), (GT,), self.ew(k))
        self.vec("transpose indices (vnchwconv)", (IT,), (IX,), _vnchwconv(ke, k, 4), transposed(IT, IX, k))
        self.vec("cast indices->fp32", (IT,), (IT,), self.ew(k))

        def mask(j):
            return lambda: np.copyto(M.data, (iota.data == IT.data[:, j:j + 1]).astype(np.float32))

        if self.renorm:
            self.renormalised(mask)
        if self.scale != 1:
            self.vec("muls routed_scaling_factor", (GT,), (GT,), self.ew(k),
                     lambda: np.multiply(GT.data, self.scale, out=GT.data))
        # scatter: ds = Σ_j [expert == idx_j] · dy_j
        self.vec("dup 0", (DS,), (), self.ew(E), lambda: DS.data.fill(0.0))
        for j in range(k):
            self.vec("compare iota == index", (M,), (iota, IT), self.ew(E), mask(j))
            self.vec("select grad", (M,), (M, GT), self.ew(E),
                     lambda j=j: np.copyto(M.data, np.where(M.data > 0, GT.data[:, j:j + 1], np.float32(0))))
            self.vec("add (scatter)", (DS,), (DS, M), self.ew(E), lambda: np.add(DS.data, M.data, out=DS.data))
        self.derivative()
        self.store(i)

    def renormalised(self, mask):
        """dy = (gw - Σ gw·y / (Σy + eps)) / (Σy + eps), the chosen scores y gathered from the scores."""
        E, k = self.E, self.k
        S, M, Y, GT, R = self.S, self.M, self.Y, self.GT, self.R
        for j in range(k):
            self.vec("compare iota == index", (M,), (self.iota, self.IT), self.ew(E), mask(j))
            self.vec("select score", (M,), (M, S), self.ew(E),
                     lambda: np.copyto(M.data, np.where(M.data > 0, S.data, np.float32(0))))
            self.vec("reduce sum (gather)", (Y,), (M,), self.ew(E - 1),
                     lambda j=j: Y.data.__setitem__((slice(None), j), M.data.sum(axis=1)))
        self.vec("reduce sum (chosen)", (R,), (Y,), self.ew(k - 1),
                 lambda: R.data.__setitem__((slice(None), 0), Y.data[:, :k].sum(axis=1)))
        if self.eps != 0:
            self.vec("adds eps", (R,), (R,), self.ew(1), lambda: R.data.__setitem__((slice(None), 0),
                                                                                  R.data[:, 0] + self.eps))
        self.vec("reciprocal", (R,), (R,), self.ew(1),
                 lambda: R.data.__setitem__((slice(None), 0), np.float32(1) / R.data[:, 0]))
        self.vec("mul gw*y", (Y,), (GT, Y), self.ew(k), lambda: np.multiply(GT.data[:, :k], Y.data[:, :k],
                                                                            out=Y.data[:, :k]))
        self.vec("reduce sum (dot)", (R,), (Y,), self.ew(k - 1),
                 lambda: R.data.__setitem__((slice(None), 1), Y.data[:, :k].sum(axis=1)))
        self.vec("mul dot/sum", (R,), (R,), self.ew(1),
                 lambda: R.data.__setitem__((slice(None), 1), R.data[:, 1] * R.data[:, 0]))
        self.vec("sub gw - dot/sum", (GT,), (GT, R), self.ew(k),
                 lambda: np.subtract(GT.data[:, :k], R.data[:, 1:2], out=GT.data[:, :k]))
        self.vec("mul /sum", (GT,), (GT, R), self.ew(k),
                 lambda: np.multiply(GT.data[:, :k], R.data[:, 0:1], out=GT.data[:, :k]))

    def derivative(self):
        """dx from ds through the normalisation (in DS)."""
        E, S, M, DS, R = self.E, self.S, self.M, self.DS, self.R
        if self.norm == "softmax":
            self.vec("mul s*ds", (M,), (S, DS), self.ew(E), lambda: np.multiply(S.data, DS.data, out=M.data))
            self.vec("reduce sum", (R,), (M,), self.ew(E - 1),
                     lambda: R.data.__setitem__((slice(None), 1), M.data.sum(axis=1)))
            self.vec("sub sum", (DS,), (DS, R), self.ew(E), lambda: np.subtract(DS.data, R.data[:, 1:2], out=DS.data))
            self.vec("mul s", (DS,), (DS, S), self.ew(E), lambda: np.multiply(DS.data, S.data, out=DS.data))
        elif self.norm == "sigmoid":
            self.vec("muls -1", (M,), (S,), self.ew(E))
            self.vec("adds 1", (M,), (M,), self.ew(E), lambda: np.subtract(np.float32(1), S.data, out=M.data))
            self.vec("mul s*(1-s)", (M,), (M, S), self.ew(E), lambda: np.multiply(M.data, S.data, out=M.data))
            self.vec("mul ds", (DS,), (DS, M), self.ew(E), lambda: np.multiply(DS.data, M.data, out=DS.data))

    def store(self, i):
        E, ke, items, dt = self.E, self.ke, self.items, self.dtype
        O, DS = self.O[i], self.DS
        if dt != F32:
            self.vec(f"cast dx->{dt}", (DS,), (DS,), self.ew(E))
        self.vec("transpose dx (vnchwconv)", (O,), (DS,), _vnchwconv(E, ke, itemsize(dt)),
                 lambda: O.data[:, :, :E].__setitem__(Ellipsis, rnd(DS.data[:, :E, :O.data.shape[1]]
                                                                    .transpose(0, 2, 1), dt)))
        regs = [None if it is None else (slice(it[0], it[0] + it[1]), slice(0, E)) for it in items]
        self.g.store(O, self.dx, regs, active=self.act, name="store dx")


__all__ = ["moe_finalize_routing_grad", "moe_gating_topk_grad", "finalize_grad_specs", "finalize_grad_cols",
           "gating_grad_specs", "default_grad_lanes", "VEC_FLOATS"]
