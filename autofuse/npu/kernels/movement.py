"""Data movement through UB: copy, permute, cat, gather (embedding lookup).

    npu.run("copy", x)                          -> contiguous copy of x
    npu.run("permute", x, dims=(0, 2, 1, 3))    -> x.permute(dims).contiguous()
    npu.run("cat", a, b, c, dim=1)              -> torch.cat([a, b, c], dim)
    npu.run("gather", table, indices)           -> table[indices]  (table [V, H], int32 indices [...])

These exist so a whole model can be simulated op by op. Every kernel streams GM -> UB -> GM on all vector
cores, double-buffered (MTE2 of tile i+1 while MTE3 writes tile i); only a transpose uses the Vector unit.

*copy / cat / permute keeping the last dim*: the (coalesced) tensor is a set of rows of contiguous
elements; tiles of ``rows x cols`` are copied with strided bursts on the read or the write side. Rows are
split evenly over the cores (columns, when there are fewer rows than cores).

*permute moving the last dim*: the input's last dim L and the dim A that becomes the output's last dim
are tiled ``a x l``; each tile is loaded (rows of L are contiguous), transposed on the Vector unit with
TransDataTo5HD (``vnchwconv``: sixteen 32 B blocks, 512 B, per repeat; 4-byte and 1-byte elements take
two passes), and stored as ``l x a`` (rows of A contiguous in the output). Permutations are first
coalesced: output dims that are neighbours in the input, in order, are merged, size-1 dims dropped.

*gather*: indices are split evenly over the cores; each core loads a block of indices into UB, reads
them with the Scalar unit and issues one MTE2 row copy per index (a repeated index hits L2), then MTE3
writes the rows out. ``tiling``: ``{"rows": indices per block, "cols": elements of H per row copy}``.

``tiling`` for copy/cat/permute: ``{"rows": r, "cols": c}`` (transposes: ``{"a": .., "l": ..}``).
"""
from __future__ import annotations

import math

import numpy as np

from autofuse.npu.dtypes import STORAGE, itemsize
from autofuse.npu.kernels.tiles import (active_mask, block_elems, ceil_div, extents, fits, largest, lockstep,
                                        pipeline, round_up, split_blocks, view)
from autofuse.npu.machine import GMTensor
from autofuse.npu.run import kernel
from cost_model.vecutil import coalesce_perm, copy_tile, transpose_default

_INDEX = ("int32", "int8")


def _empty(launch, shape, dtype, name):
    if dtype in ("float16", "bfloat16", "float32"):
        return launch.empty(shape, dtype, name)
    return GMTensor(launch.zeros(shape, STORAGE[dtype]), dtype, name)


def _rows_plan(dev, jobs, dtype, tiling):
    """Tile size and per-core tile lists for row copies.

    ``jobs``: list of (NR rows, D rows per leading index, Dc columns). Returns (n, r, c, [per-core lists
    per job]) where a tile is (job, lead, r0, rows, c0, cols).
    """
    cblk = block_elems(dtype)
    units = max(NR if NR >= dev.vector_cores else NR * ceil_div(Dc, cblk) for NR, _, Dc in jobs)
    n = max(1, min(dev.vector_cores, units))
    maxc = max(Dc for _, _, Dc in jobs)
    total = sum(NR * Dc for NR, _, Dc in jobs)
    if tiling:
        r, c = int(tiling.get("rows", 1)), int(tiling.get("cols", maxc))
    else:
        r, c = copy_tile(dev, dtype, maxc, max(ceil_div(total, n * 4), 8192 // itemsize(dtype)))
    if r < 1 or c < 1:
        raise ValueError(f"copy tiling rows={r}, cols={c} must be positive")
    per = [[] for _ in range(n)]
    for j, (NR, D, Dc) in enumerate(jobs):
        if NR >= n:
            shares = split_blocks(NR, n, r, period=D)
            for cc, blocks in enumerate(shares):
                per[cc].append([(j, b0 // D, b0 % D, be, c0, min(c, Dc - c0)) for b0, be in blocks
                                for c0 in range(0, Dc, c)])
        else:
            shares = split_blocks(NR * Dc, n, c, period=Dc, align=cblk)
            for cc, blocks in enumerate(shares):
                per[cc].append([(j, b0 // Dc // D, b0 // Dc % D, 1, b0 % Dc, be) for b0, be in blocks])
    # jobs run one after another, all cores on job 0, then job 1: pad each core's list to the longest
    aligned = [[] for _ in range(n)]
    for j in range(len(jobs)):
        longest = max(len(per[cc][j]) for cc in range(n))
        for cc in range(n):
            aligned[cc] += per[cc][j] + [None] * (longest - len(per[cc][j]))
    return n, r, c, aligned


def _copy_rows(launch, dtype, jobs, src_reg, dst_reg, srcs, dsts, tiling, name):
    """Stream row tiles GM -> UB -> GM. ``src_reg(job, lead, r0, re, c0, ce)`` gives the source region."""
    dev = launch.device
    n, r, c, per = _rows_plan(dev, jobs, dtype, tiling)
    g = launch.group("aiv", n)
    cp = round_up(c, block_elems(dtype))
    T = [g.alloc("UB", (r, cp), dtype, f"buf{i}") for i in range(2)]
    ctr = [0]

    def load(items):
        act = active_mask(items)
        t = T[ctr[0] % 2]
        ctr[0] += 1
        job = next(it[0] for it in items if it is not None)
        g.load(t, srcs[job], [None if it is None else src_reg(*it) for it in items], active=act,
               name=f"load {name}")
        return items, act, t, job

    def store(h):
        items, act, t, job = h
        g.store(t, dsts[job], [None if it is None else dst_reg(*it) for it in items], active=act,
                name=f"store {name}")

    steps = [s for s in lockstep(per) if any(it is not None for it in s)]
    pipeline(((lambda s=s: load(s)), store) for s in steps)


@kernel("copy")
def copy(launch, x, tiling=None):
    """A contiguous copy of ``x`` (any dtype)."""
    out = _empty(launch, x.shape, x.dtype, "out")
    N = math.prod(x.shape)
    if N == 0:
        return (out,)
    xv, ov = view(x, (1, N)), view(out, (1, N))
    _copy_rows(launch, x.dtype, [(1, 1, N)],
               lambda j, lead, r0, re, c0, ce: (slice(r0, r0 + re), slice(c0, c0 + ce)),
               lambda j, lead, r0, re, c0, ce: (slice(r0, r0 + re), slice(c0, c0 + ce)),
               [xv], [ov], tiling, "x")
    return (out,)


@kernel("cat")
def cat(launch, *tensors, dim=0, tiling=None):
    """``torch.cat(tensors, dim)``: all of one dtype and equal shape outside ``dim``."""
    ts = [t for t in tensors if t is not None]
    if not ts:
        raise ValueError("cat: no tensors")
    nd = ts[0].data.ndim
    if nd == 0:
        raise ValueError("cat: 0-d tensors cannot be concatenated")
    if not -nd <= dim < nd:
        raise ValueError(f"cat: dim {dim} out of range for {nd}-d tensors")
    dim %= nd
    for i, t in enumerate(ts):
        if t.dtype != ts[0].dtype:
            raise TypeError(f"cat: tensor {i} is {t.dtype}, tensor 0 is {ts[0].dtype}; cast first")
        if t.data.ndim != nd or any(t.shape[d] != ts[0].shape[d] for d in range(nd) if d != dim):
            raise ValueError(f"cat: tensor {i} has shape {list(t.shape)}, incompatible with "
                             f"{list(ts[0].shape)} along dims other than {dim}")
    shape = list(ts[0].shape)
    shape[dim] = sum(t.shape[dim] for t in ts)
    out = _empty(launch, tuple(shape), ts[0].dtype, "out")
    outer = math.prod(shape[:dim])
    inners = [math.prod(t.shape[dim:]) for t in ts]
    total_inner = sum(inners)
    keep = [k for k, i in enumerate(inners) if i > 0]
    if outer == 0 or not keep:
        return (out,)
    offs = np.concatenate([[0], np.cumsum(inners)[:-1]])
    ov = view(out, (outer, total_inner))
    srcs = [view(ts[k], (outer, inners[k])) for k in keep]
    _copy_rows(launch, ts[0].dtype, [(outer, outer, inners[k]) for k in keep],
               lambda j, lead, r0, re, c0, ce: (slice(r0, r0 + re), slice(c0, c0 + ce)),
               lambda j, lead, r0, re, c0, ce: (slice(r0, r0 + re),
                                                slice(int(offs[keep[j]]) + c0, int(offs[keep[j]]) + c0 + ce)),
               srcs, [ov] * len(keep), tiling, "cat")
    return (out,)


@kernel("permute")
def permute(launch, x, dims=None, tiling=None):
    """``x.permute(dims).contiguous()``; ``dims=None`` reverses the dims (``x.T``)."""
    nd = x.data.ndim
    dims = tuple(range(nd))[::-1] if dims is None else tuple(int(d) % max(nd, 1) for d in dims)
    if sorted(dims) != list(range(nd)):
        raise ValueError(f"permute: dims {dims} is not a permutation of {nd} dims")
    out_shape = tuple(x.shape[d] for d in dims)
    out = _empty(launch, out_shape, x.dtype, "out")
    if math.prod(out_shape) == 0:
        return (out,)
    s, q = coalesce_perm(tuple(x.shape), dims)
    m = len(s)
    if m <= 1 or q == list(range(m)):                # the data order does not change: a plain copy
        N = math.prod(out_shape)
        _copy_rows(launch, x.dtype, [(1, 1, N)],
                   lambda j, lead, r0, re, c0, ce: (slice(r0, r0 + re), slice(c0, c0 + ce)),
                   lambda j, lead, r0, re, c0, ce: (slice(r0, r0 + re), slice(c0, c0 + ce)),
                   [view(x, (1, N))], [view(out, (1, N))], tiling, "x")
        return (out,)
    xv = view(x, s)
    ov = view(out, [s[d] for d in q])
    if q[-1] == m - 1:
        return (_permute_rows(launch, x, out, xv, ov, s, q, tiling),)
    return (_permute_transpose(launch, x, out, xv, ov, s, q, tiling),)


def _permute_rows(launch, x, out, xv, ov, s, q, tiling):
    """The last dim stays last: copy rows (out dim m-2 = input dim q[m-2]) between strided layouts."""
    m = len(s)
    lead_dims = q[:-2]                                   # input dims indexed one value at a time
    lead_sizes = [s[d] for d in lead_dims]
    D, Dc = s[q[-2]], s[m - 1]
    NR = math.prod(lead_sizes) * D

    def regs(lead, r0, re, c0, ce):
        li = np.unravel_index(lead, lead_sizes) if lead_sizes else ()
        src = [None] * m
        for d, i in zip(lead_dims, li):
            src[d] = int(i)
        src[q[-2]] = slice(r0, r0 + re)
        src[m - 1] = slice(c0, c0 + ce)
        dst = tuple(int(i) for i in li) + (slice(r0, r0 + re), slice(c0, c0 + ce))
        return tuple(src), dst

    _copy_rows(launch, x.dtype, [(NR, D, Dc)],
               lambda j, lead, r0, re, c0, ce: regs(lead, r0, re, c0, ce)[0],
               lambda j, lead, r0, re, c0, ce: regs(lead, r0, re, c0, ce)[1],
               [xv], [ov], tiling, "x")
    return out


def _permute_transpose(launch, x, out, xv, ov, s, q, tiling):
    """The last dim moves: tiles a x l (input dims A = q[-1] and L = m-1), transposed on the Vector unit."""
    dev = launch.device
    dtype = x.dtype
    isz = itemsize(dtype)
    m = len(s)
    A, L = q[-1], m - 1
    others = [d for d in range(m) if d not in (A, L)]     # input dims indexed one value at a time
    SA, SL = s[A], s[L]
    cblk = block_elems(dtype)
    if tiling:
        a, l_ = int(tiling.get("a", 128)), int(tiling.get("l", 128))
    else:
        a, l_ = transpose_default(dev, SA, SL, dtype)
    if a < 1 or l_ < 1:
        raise ValueError(f"permute: tiling a={a}, l={l_} must be positive")
    other_sizes = [s[d] for d in others]
    items = [(o, a0, l0) for o in (np.ndindex(*other_sizes) if other_sizes else [()])
             for a0 in range(0, SA, a) for l0 in range(0, SL, l_)]
    n = min(dev.vector_cores, len(items))
    g = launch.group("aiv", n)
    In = [g.alloc("UB", (a, round_up(l_, cblk)), dtype, f"in{i}") for i in range(2)]
    Out = [g.alloc("UB", (l_, round_up(a, cblk)), dtype, f"out{i}") for i in range(2)]
    passes = 1 if isz == 2 else 2
    per = [[items[i] for i in range(b0, b0 + be)] for blocks in split_blocks(len(items), n, 1 << 30)
           for b0, be in blocks]
    per += [[] for _ in range(n - len(per))]
    ctr = [0]

    def src_reg(it):
        o, a0, l0 = it
        reg = [None] * m
        for d, i in zip(others, o):
            reg[d] = int(i)
        reg[A] = slice(a0, min(SA, a0 + a))
        reg[L] = slice(l0, min(SL, l0 + l_))
        return tuple(reg)

    def dst_reg(it):
        o, a0, l0 = it
        idx = dict(zip(others, o))
        reg = []
        for j in range(m):
            d = q[j]
            reg.append(slice(a0, min(SA, a0 + a)) if d == A else slice(l0, min(SL, l0 + l_)) if d == L
                       else int(idx[d]))
        return tuple(reg)

    def load(items_):
        act = active_mask(items_)
        i = ctr[0] % 2
        ctr[0] += 1
        g.load(In[i], xv, [None if it is None else src_reg(it) for it in items_], active=act, name="load x")
        return items_, act, i

    def work(h):
        items_, act, i = h
        ae = extents(items_, lambda it: min(a, SA - it[1]))
        le = extents(items_, lambda it: min(l_, SL - it[2]))
        nbytes = round_up(ae, 16) * round_up(le, 16) * isz
        src, dst = In[i], Out[i]

        def tr():
            k = min(src.data.shape[2], dst.data.shape[1])
            j = min(src.data.shape[1], dst.data.shape[2])
            dst.data[:, :k, :j] = src.data[:, :j, :k].transpose(0, 2, 1)
        g.vector("transpose (vnchwconv)", (dst,), (src,), passes * ceil_div(nbytes, 512), active=act, compute=tr)
        g.store(dst, ov, [None if it is None else dst_reg(it) for it in items_], active=act, name="store out")

    pipeline(((lambda s_=s_: load(s_)), work) for s_ in lockstep(per))
    return out


@kernel("gather", steer=("indices",))
def gather(launch, table, indices, tiling=None):
    """``table[indices]`` (embedding lookup, ``index_select`` on dim 0): table ``[V, ...]`` (rows of its
    trailing dims), int32 ``indices`` of any shape."""
    if table.data.ndim < 2:
        raise ValueError(f"gather: table must be [V, ...] with at least 2 dims, got shape {list(table.shape)}")
    if indices.dtype not in _INDEX:
        raise TypeError(f"gather: indices are {indices.dtype}; the kernel takes int32 indices "
                        f"(convert int64 token ids with .int())")
    row_shape = tuple(table.shape[1:])
    table = view(table, (table.shape[0], math.prod(row_shape)))      # rows of the trailing dims, contiguous
    V, H = table.shape
    idx = np.asarray(indices.data).astype(np.int64).reshape(-1)
    T = idx.size
    out = _empty(launch, tuple(indices.shape) + row_shape, table.dtype, "out")
    if T == 0 or H == 0:
        return (out,)
    bad = (idx < 0) | (idx >= V)
    if bad.any():
        raise IndexError(f"gather: index {int(idx[bad][0])} out of range for a table of {V} rows")
    dev = launch.device
    dtype = table.dtype
    cblk = block_elems(dtype)
    RING = 4                                         # row buffers in flight
    if tiling:
        k, hc = int(tiling.get("rows", 64)), min(int(tiling.get("cols", H)), H)
    else:
        k = 64
        spec = lambda h: [((k,), "int32")] * 2 + [((1, round_up(h, cblk)), dtype)] * RING   # noqa: E731
        hc = H if fits(dev, spec(H)) else cblk * largest(lambda v: fits(dev, spec(v * cblk)), 1, ceil_div(H, cblk))
    n = min(dev.vector_cores, T)
    g = launch.group("aiv", n)
    Idx = [g.alloc("UB", (k,), "int32", f"idx{i}") for i in range(2)]
    Rows = [g.alloc("UB", (1, round_up(hc, cblk)), dtype, f"row{i}") for i in range(RING)]
    iv = view(indices, (T,))
    ov = view(out, (T, H))
    ctr = {"i": 0, "r": 0}

    def blocks():
        for items in lockstep(split_blocks(T, n, k)):
            yield items

    def load_idx(items):
        act = active_mask(items)
        t = Idx[ctr["i"] % 2]
        ctr["i"] += 1
        end = g.load(t, iv, [None if it is None else (slice(it[0], it[0] + it[1]),) for it in items],
                     active=act, name="load indices")
        return items, act, t, end

    def rows(h):
        items, act, t, end = h
        ke = extents(items, lambda it: it[1])
        for j in range(int(ke.max())):
            a_j = ke > j
            act_j = None if a_j.all() else a_j
            for h0 in range(0, H, hc):
                he = min(hc, H - h0)
                buf = Rows[ctr["r"] % RING]
                ctr["r"] += 1
                src = [None if (it is None or not a_j[c]) else (slice(int(idx[it[0] + j]), int(idx[it[0] + j]) + 1), slice(h0, h0 + he))
                       for c, it in enumerate(items)]
                # the Scalar unit reads the index from UB: the row copy waits for the index block
                g.load(buf, table, src, active=act_j, deps=(end,), name="load row")
                dst = [None if (it is None or not a_j[c]) else (slice(it[0] + j, it[0] + j + 1), slice(h0, h0 + he))
                       for c, it in enumerate(items)]
                g.store(buf, ov, dst, active=act_j, name="store row")

    pipeline(((lambda s=s: load_idx(s)), rows) for s in blocks())
    return (out,)


__all__ = ["copy", "cat", "permute", "gather"]
