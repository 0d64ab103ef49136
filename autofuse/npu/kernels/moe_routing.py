"""MoE token routing through UB: ``moe_init_routing``, ``moe_finalize_routing`` and the plain ``index_add``.

    npu.run("moe_init_routing", x, expert_idx, num_experts=8)  -> (expanded_x, expanded_row_idx, group_list)
    npu.run("moe_finalize_routing", expanded, scales, expanded_row_idx, skip)            -> (out,)
    npu.run("index_add", x, index, src, alpha=1.0)                                      -> (out,)

*moe_init_routing* (CANN's MoeInitRouting, dropless): ``x [T, H]``, ``expert_idx [T, k]`` (int32) → the k
copies of every token sorted by expert, stable in the flattened order ``i = t·k + j`` (what
``torch.sort(expert_idx.flatten(), stable=True)`` gives): ``expanded_x[p] = x[perm[p] // k]``;
``expanded_row_idx[i]`` = the row ``p`` that entry ``i`` went to (the inverse of ``perm``, what the finalize
step reads); ``group_list [E]``: tokens per expert (``group_list_type="count"``) or their running sum
(``"cumsum"``). A counting sort, in two phases on all vector cores (each owns a contiguous run of tokens):

1. each core loads its expert ids (MTE2) and counts them per expert on the Scalar unit (one cycle per id
   [A]); the counts go to a GM workspace ``[cores, E]`` (MTE3). All cores wait for all counts (a barrier).
2. each core loads the workspace (L2 hits), sums the columns on the Vector unit (its own base per expert:
   experts before, then cores before), and the Scalar unit walks its ids once more to give each entry
   its row (one cycle per id [A]); ``expanded_row_idx`` is stored (MTE3); core 0 stores ``group_list``.
   Then every token is loaded once (MTE2) into a ring of row buffers and stored k times (MTE3), once per
   copy, to its rows of ``expanded_x``.

*moe_finalize_routing* (CANN's MoeFinalizeRouting): ``out[t] = skip[t] + Σ_j scales[t, j] ·
expanded[expanded_row_idx[t·k + j]]`` in fp32, rounded once to expanded's dtype. Tokens are split over the
vector cores; per block of tokens the row indices and scales are loaded once; per token the k rows are
gathered (MTE2, a ring of buffers), cast to fp32, and accumulated (``axpy``), the sum cast and stored.

*index_add* (``x.index_add(0, index, src, alpha=alpha)``): the rows of x are copied to the output (streamed,
double-buffered), all cores wait, then each core takes a run of indices: src row i is loaded, scaled by
``alpha`` if not 1, and stored to ``out[index[i]]`` with the MTE3 atomic add (accumulated in out's dtype).

``tiling``: ``{"block": indices (tokens) per index block, "cols": elements of H per row copy}``.
"""
from __future__ import annotations

import math

import numpy as np

from autofuse.npu.dtypes import itemsize
from autofuse.npu.kernels.tiles import (VEC_FLOATS, active_mask, block_elems, ceil_div, check_dtype, extents, fits,
                                        largest, lockstep, pad, rnd, round_up, split_blocks, view)
from autofuse.npu.machine import GMTensor, _extent
from autofuse.npu.run import kernel

RING = 4                     # row buffers in flight
_INDEX = ("int32",)


def _int_tensor(launch, shape, name):
    t = GMTensor(launch.zeros(shape, np.int32), "int32", name)
    launch.allocated.append((t, math.prod(shape) * 4))
    return t


def row_cols(device, H, dtype, fixed_specs, rows=RING):
    """Elements of H per row copy: all of H if ``rows`` row buffers fit UB beside ``fixed_specs``, else the
    widest whole 32 B blocks that do."""
    cblk = block_elems(dtype)
    spec = lambda h: list(fixed_specs) + [((1, round_up(h, cblk)), dtype)] * rows      # noqa: E731
    if fits(device, spec(H)):
        return H
    top = largest(lambda v: fits(device, spec(v * cblk)), 1, ceil_div(H, cblk))
    if top < 1:
        raise ValueError(f"no row buffer of {dtype} fits UB on {device.name}")
    return cblk * top


def _check_index(what, t, allowed=_INDEX):
    if t.dtype not in allowed:
        raise TypeError(f"{what} is {t.dtype}; the kernel takes int32 indices (convert int64 with .int())")


# ------------------------------------------------------------------------------------------ init routing
def init_specs(E, n, block):
    """UB allocations of moe_init_routing besides the row ring (the cost model mirrors this list)."""
    return [((pad(block, "int32"),), "int32")] * 2 + [((pad(E, "int32"),), "int32")] * 2 + \
        [((n, pad(E, "int32")), "int32")]


@kernel("moe_init_routing", steer=("expert_idx",))       # the ids decide where each token is copied
def moe_init_routing(launch, x, expert_idx, num_experts=None, group_list_type="count", tiling=None):
    """Tokens permuted by expert (see the module docstring): ``(expanded_x, expanded_row_idx, group_list)``."""
    check_dtype("moe_init_routing", "x", x)
    _check_index("moe_init_routing: expert_idx", expert_idx)
    if x.data.ndim != 2 or expert_idx.data.ndim != 2 or expert_idx.shape[0] != x.shape[0]:
        raise ValueError(f"moe_init_routing: x must be [T, H] and expert_idx [T, k], got {list(x.shape)} and "
                         f"{list(expert_idx.shape)}")
    if group_list_type not in ("count", "cumsum"):
        raise ValueError(f"moe_init_routing: group_list_type={group_list_type!r}; choose 'count' or 'cumsum'")
    T, H = x.shape
    k = expert_idx.shape[1]
    ids = np.asarray(expert_idx.data).reshape(-1)
    E = int(num_experts) if num_experts is not None else int(ids.max(initial=-1)) + 1
    if E < 1:
        raise ValueError("moe_init_routing: num_experts must be at least 1")
    bad = (ids < 0) | (ids >= E)
    if bad.any():
        raise IndexError(f"moe_init_routing: expert id {int(ids[bad][0])} out of range for {E} experts")
    dev = launch.device
    out = launch.empty((T * k, H), x.dtype, "expanded_x")
    row_idx = _int_tensor(launch, (T * k,), "expanded_row_idx")
    glist = _int_tensor(launch, (E,), "group_list")
    if T == 0 or k == 0:
        launch.group("aiv", 1)
        return out, row_idx, glist
    n = min(dev.vector_cores, T)
    tok = split_blocks(T, n, T)                               # one run of tokens per core
    runs = [b[0] if b else None for b in tok]
    most = max(r[1] for r in runs if r is not None) * k
    block = int((tiling or {}).get("block", 0)) or min(most, 2048)
    block = max(k, block // k * k)                            # whole tokens per index block
    hc = min(int((tiling or {}).get("cols", 0)) or row_cols(dev, H, x.dtype, init_specs(E, n, block)), H)
    g = launch.group("aiv", n)
    Ids = [g.alloc("UB", (pad(block, "int32"),), "int32", f"ids{i}") for i in range(2)]
    Cnt = g.alloc("UB", (pad(E, "int32"),), "int32", "counts")
    Base = g.alloc("UB", (pad(E, "int32"),), "int32", "base")
    All = g.alloc("UB", (n, pad(E, "int32")), "int32", "all counts")
    Rows = [g.alloc("UB", (1, round_up(hc, block_elems(x.dtype))), x.dtype, f"row{i}") for i in range(RING)]
    ws = launch.empty((n, E), "int32", "counts workspace", scratch=True)
    ws.data = launch.zeros((n, E), np.int32)
    flat = view(expert_idx, (T * k,))
    # per core: its entries [e0, e0 + ne) cut into index blocks
    spans = [None if r is None else (r[0] * k, r[1] * k) for r in runs]
    blocks = [[] if s is None else [(s[0] + b, min(block, s[1] - b)) for b in range(0, s[1], block)] for s in spans]
    scalar = dev.scalar_issue_cycles

    def load_ids(items, i):
        t = Ids[i % 2]
        e = g.load(t, flat, [None if it is None else (slice(it[0], it[0] + it[1]),) for it in items],
                   active=active_mask(items), name="load expert ids")
        return t, e

    # phase 1: counts per core
    local = np.zeros((n, E), dtype=np.int64)
    for i, items in enumerate(lockstep(blocks)):
        t, _ = load_ids(items, i)
        ne = extents(items, lambda it: it[1])
        for c, it in enumerate(items):       # the ids the tile holds (read from GM: also in timing-only launches)
            if it is not None:
                local[c] += np.bincount(ids[it[0]:it[0] + it[1]].astype(np.int64), minlength=E)
        g._exec("scalar", ne.astype(float) * scalar, reads=(t,), writes=(Cnt,), active=active_mask(items),
                name="count ids (scalar)")
    if launch.values:
        Cnt.data[:, :E] = local
    done = g.store(Cnt, ws, [(c, slice(0, E)) for c in range(n)], name="store counts")
    barrier = (np.full(n, float(done.max())),)
    # phase 2: bases, rows, copies
    g.load(All, ws, [(slice(0, n), slice(0, E))] * n, deps=barrier, name="load all counts")
    total = local.sum(axis=0)
    before = np.concatenate([[0], np.cumsum(total)[:-1]])
    bases = before[None] + np.cumsum(local, axis=0) - local
    g.vector("column sums (bases)", (Base,), (All,), 2 * max(n - 1, 1) * ceil_div(E, 64),
             compute=lambda: Base.data.__setitem__((slice(None), slice(0, E)), bases))
    g._exec("scalar", np.full(n, float(E * scalar)), reads=(Base,), writes=(Base,), name="prefix over experts")
    if group_list_type == "cumsum":
        gl = np.cumsum(total)
    else:
        gl = total
    if launch.values:
        Cnt.data[0, :E] = gl
    g.store(Cnt, glist, [(slice(0, E),)] + [None] * (n - 1), name="store group_list")
    pos = np.zeros(T * k, dtype=np.int64)
    running = bases.astype(np.int64)
    rctr = 0
    for i, items in enumerate(lockstep(blocks)):
        act = active_mask(items)
        t, _ = load_ids(items, i)
        ne = extents(items, lambda it: it[1])
        for c, it in enumerate(items):                    # the Scalar unit's walk: each id takes the next row
            if it is None:
                continue
            e = ids[it[0]:it[0] + it[1]].astype(np.int64)
            order = np.argsort(e, kind="stable")
            ranks = np.empty(it[1], dtype=np.int64)
            se = e[order]
            starts = np.searchsorted(se, se, side="left")
            ranks[order] = np.arange(it[1]) - starts
            p = running[c, e] + ranks
            running[c] += np.bincount(e, minlength=E)
            if launch.values:
                t.data[c, :it[1]] = p
            pos[it[0]:it[0] + it[1]] = p
        walk = g._exec("scalar", ne.astype(float) * scalar, reads=(t,), writes=(t,), active=act,
                       name="rows of ids (scalar)")
        g.store(t, row_idx, [None if it is None else (slice(it[0], it[0] + it[1]),) for it in items], active=act,
                name="store expanded_row_idx")
        # the tokens of this block: one load, k stores each
        first = [None if it is None else it[0] // k for it in items]
        ntok = extents(items, lambda it: it[1] // k)
        for j in range(int(ntok.max())):
            a_j = ntok > j
            aj = None if a_j.all() else a_j
            for h0 in range(0, H, hc):
                he = min(hc, H - h0)
                buf = Rows[rctr % RING]
                rctr += 1
                g.load(buf, x, [(slice(first[c] + j, first[c] + j + 1), slice(h0, h0 + he)) if a_j[c] else None
                                for c in range(n)], active=aj, deps=(walk,), name="load token")
                for q in range(k):
                    g.store(buf, out, [(slice(int(pos[(first[c] + j) * k + q]), int(pos[(first[c] + j) * k + q]) + 1),
                                        slice(h0, h0 + he)) if a_j[c] else None for c in range(n)],
                            active=aj, name="store copy")
    return out, row_idx, glist


# ------------------------------------------------------------------------------------------ finalize
def finalize_specs(k, block, H_chunk, dtype, skip_dtype):
    """UB allocations of moe_finalize_routing besides the row ring (mirrored by the cost model)."""
    f32 = "float32"
    specs = [((pad(block * k, "int32"),), "int32")] * 2 + [((block, pad(k, f32)), f32)] * 2
    specs += [((1, pad(H_chunk, f32)), f32)] * 2                    # fp32 accumulator, fp32 row
    specs += [((1, pad(H_chunk, dtype)), dtype)] * 2                # output rows, double-buffered
    if skip_dtype is not None:
        specs += [((1, pad(H_chunk, skip_dtype)), skip_dtype)] * 2
    return specs


def widest_cols(device, H, dtype, specs_of, what):
    """Elements of H per row: all of H when ``specs_of(h)`` (every UB allocation for rows of h elements) fits,
    else the widest whole blocks (of at least 8 elements) that do."""
    cblk = max(block_elems(dtype), 8)
    if fits(device, specs_of(H)):
        return H
    top = largest(lambda v: fits(device, specs_of(v * cblk)), 1, ceil_div(H, cblk))
    if top < 1:
        raise ValueError(f"{what}: no row of {dtype} fits UB on {device.name}")
    return cblk * top


def finalize_cols(device, H, k, block, dtype, skip_dtype):
    cblk = max(block_elems(dtype), 8)
    return widest_cols(device, H, dtype, lambda h: finalize_specs(k, block, h, dtype, skip_dtype)
                       + [((1, round_up(h, cblk)), dtype)] * RING, "moe_finalize_routing")


@kernel("moe_finalize_routing", steer=("expanded_row_idx",))      # which rows are loaded
def moe_finalize_routing(launch, expanded, scales, expanded_row_idx, skip=None, tiling=None):
    """``out [T, H] = skip + Σ_j scales[:, j] · expanded[expanded_row_idx[t·k + j]]`` (fp32 accumulation)."""
    check_dtype("moe_finalize_routing", "expanded", expanded)
    check_dtype("moe_finalize_routing", "scales", scales)
    _check_index("moe_finalize_routing: expanded_row_idx", expanded_row_idx)
    if expanded.data.ndim != 2 or scales.data.ndim != 2:
        raise ValueError(f"moe_finalize_routing: expanded must be [rows, H] and scales [T, k], got "
                         f"{list(expanded.shape)} and {list(scales.shape)}")
    T, k = scales.shape
    R, H = expanded.shape
    if expanded_row_idx.data.size != T * k:
        raise ValueError(f"moe_finalize_routing: expanded_row_idx has {expanded_row_idx.data.size} entries, "
                         f"scales [T, k] = {[T, k]} needs {T * k}")
    if skip is not None:
        check_dtype("moe_finalize_routing", "skip", skip)
        if tuple(skip.shape) != (T, H):
            raise ValueError(f"moe_finalize_routing: skip has shape {list(skip.shape)}, out is {[T, H]}")
    ridx = np.asarray(expanded_row_idx.data).reshape(-1).astype(np.int64)
    bad = (ridx < 0) | (ridx >= R)
    if bad.any():
        raise IndexError(f"moe_finalize_routing: row {int(ridx[bad][0])} out of range for {R} expanded rows")
    dev, dtype = launch.device, expanded.dtype
    out = launch.empty((T, H), dtype, "out")
    if T == 0 or H == 0:
        launch.group("aiv", 1)
        return (out,)
    sd = None if skip is None else skip.dtype
    block = int((tiling or {}).get("block", 0)) or 64
    hc = min(int((tiling or {}).get("cols", 0)) or finalize_cols(dev, H, k, block, dtype, sd), H)
    n = min(dev.vector_cores, T)
    g = launch.group("aiv", n)
    f32 = "float32"
    Idx = [g.alloc("UB", (pad(block * k, "int32"),), "int32", f"idx{i}") for i in range(2)]
    Sc = [g.alloc("UB", (block, pad(k, f32)), f32, f"scales{i}") for i in range(2)]
    Acc = g.alloc("UB", (1, pad(hc, f32)), f32, "acc")
    Row32 = g.alloc("UB", (1, pad(hc, f32)), f32, "row fp32")
    Out = [g.alloc("UB", (1, pad(hc, dtype)), dtype, f"out{i}") for i in range(2)]
    Skip = [g.alloc("UB", (1, pad(hc, sd)), sd, f"skip{i}") for i in range(2)] if sd else None
    Rows = [g.alloc("UB", (1, round_up(hc, max(block_elems(dtype), 8))), dtype, f"row{i}") for i in range(RING)]
    iv = view(expanded_row_idx, (T * k,))
    ctr = {"b": 0, "r": 0, "o": 0, "s": 0}
    lowp = dtype != f32
    for items in lockstep(split_blocks(T, n, block)):
        act = active_mask(items)
        b = ctr["b"] % 2
        ctr["b"] += 1
        ie = g.load(Idx[b], iv, [None if it is None else (slice(it[0] * k, (it[0] + it[1]) * k),) for it in items],
                    active=act, name="load row indices")
        se = g.load(Sc[b], scales, [None if it is None else (slice(it[0], it[0] + it[1]), slice(0, k))
                                    for it in items], active=act, name="load scales")
        ntok = extents(items, lambda it: it[1])
        for j in range(int(ntok.max())):
            a_j = ntok > j
            aj = None if a_j.all() else a_j
            toks = [items[c][0] + j if a_j[c] else None for c in range(n)]
            for h0 in range(0, H, hc):
                he = min(hc, H - h0)
                rep = ceil_div(np.where(a_j, he, 0), 64)
                if Skip is not None:
                    st = Skip[ctr["s"] % 2]
                    ctr["s"] += 1
                    g.load(st, skip, [(slice(t, t + 1), slice(h0, h0 + he)) if t is not None else None for t in toks],
                           active=aj, name="load skip")
                    g.vector("acc = skip (cast)", (Acc,), (st,), rep, active=aj,
                             compute=lambda st=st: Acc.data[:, :, :he].__setitem__(Ellipsis, st.data[:, :, :he]))
                for q in range(k):
                    buf = Rows[ctr["r"] % RING]
                    ctr["r"] += 1
                    src = [(slice(int(ridx[t * k + q]), int(ridx[t * k + q]) + 1), slice(h0, h0 + he))
                           if t is not None else None for t in toks]
                    g.load(buf, expanded, src, active=aj, deps=(ie,), name="load expert row")
                    if lowp:
                        g.vector("cast row->fp32", (Row32,), (buf,), rep, active=aj,
                                 compute=lambda buf=buf: Row32.data.__setitem__((slice(None), slice(None), slice(0, he)),
                                                                                buf.data[:, :, :he]))
                        row = Row32
                    else:
                        row = buf
                    first = q == 0 and Skip is None

                    def axpy(row=row, first=first, b=b, a_j=a_j, j=j, q=q):
                        sv = np.array([float(Sc[b].data[c, j, q]) if a_j[c] else 0.0 for c in range(n)],
                                      dtype=np.float32)
                        contrib = row.data[:, :, :he] * sv[:, None, None]
                        if first:
                            Acc.data[:, :, :he] = contrib
                        else:
                            Acc.data[:, :, :he] += contrib
                    g.vector("muls" if first else "axpy acc += s * row", (Acc,), (Acc, row, Sc[b]), rep, active=aj,
                             deps=(se,), compute=axpy)
                o = Out[ctr["o"] % 2]
                ctr["o"] += 1
                g.vector(f"cast acc->{dtype}" if lowp else "copy acc", (o,), (Acc,), rep, active=aj,
                         compute=lambda o=o: o.data[:, :, :he].__setitem__(Ellipsis, rnd(Acc.data[:, :, :he], dtype)))
                g.store(o, out, [(slice(t, t + 1), slice(h0, h0 + he)) if t is not None else None for t in toks],
                        active=aj, name="store out")
    return (out,)


# ------------------------------------------------------------------------------------------ index_add
class _AtomicAdd:
    """``fn`` for ``Group.store`` that adds the tile to what the region holds (MTE3 atomic add), rounded to
    the tensor's dtype; called once per present region, in core order (the store's in-order path)."""

    def __init__(self, dst, regions):
        self.dst, self.regions = dst, iter([r for r in regions if r is not None])

    def __call__(self, block):
        reg = next(self.regions)
        cur = self.dst.data[reg]
        add = block[tuple(slice(0, e) for e in _extent(reg))].reshape(cur.shape)
        return rnd(cur.astype(np.float32) + add, self.dst.dtype)


@kernel("index_add", steer=("index",))            # which rows are added to
def index_add(launch, x, index, src, alpha=1.0, tiling=None):
    """``x.index_add(0, index, src, alpha=alpha)``: rows of src added to the rows of x that index names."""
    check_dtype("index_add", "x", x)
    _check_index("index_add: index", index, ("int32", "int64"))
    if src.dtype != x.dtype:
        raise TypeError(f"index_add: src is {src.dtype}, x is {x.dtype}; cast src first")
    if x.data.ndim < 1 or src.shape[1:] != x.shape[1:] or index.data.size != (src.shape[0] if src.data.ndim else 1):
        raise ValueError(f"index_add: x {list(x.shape)}, index {list(index.shape)}, src {list(src.shape)} do not "
                         f"agree (src must be [len(index), *x.shape[1:]])")
    dev, dtype = launch.device, x.dtype
    V = x.shape[0]
    H = math.prod(x.shape[1:])
    N = index.data.size
    idx = np.asarray(index.data).reshape(-1).astype(np.int64)
    bad = (idx < 0) | (idx >= V)
    if bad.any():
        raise IndexError(f"index_add: index {int(idx[bad][0])} out of range for {V} rows")
    out = launch.empty(tuple(x.shape), dtype, "out")
    if V * H == 0:
        launch.group("aiv", 1)
        return (out,)
    xv, ov = view(x, (V, H)), view(out, (V, H))
    sv = view(src, (N, H))
    block = int((tiling or {}).get("block", 0)) or 64
    hc = min(int((tiling or {}).get("cols", 0)) or
             row_cols(dev, H, dtype, [((pad(block, index.dtype),), index.dtype)] * 2), H)
    n = min(dev.vector_cores, max(V, N))
    g = launch.group("aiv", n)
    cblk = block_elems(dtype)
    Idx = [g.alloc("UB", (pad(block, index.dtype),), index.dtype, f"idx{i}") for i in range(2)]
    Rows = [g.alloc("UB", (1, round_up(hc, cblk)), dtype, f"row{i}") for i in range(RING)]
    # phase 1: out = x, rows streamed through the ring
    r = 0
    ends = np.zeros(n)
    for items in lockstep(split_blocks(V, n, 1)):
        act = active_mask(items)
        for h0 in range(0, H, hc):
            he = min(hc, H - h0)
            buf = Rows[r % RING]
            r += 1
            regs = [None if it is None else (slice(it[0], it[0] + 1), slice(h0, h0 + he)) for it in items]
            g.load(buf, xv, regs, active=act, name="load x row")
            e = g.store(buf, ov, regs, active=act, name="store out row")
            ends = np.maximum(ends, e if act is None else np.where(act, e, 0))
    barrier = (np.full(n, float(ends.max())),)
    # phase 2: atomic adds of the src rows
    iv = view(index, (N,))
    for i, items in enumerate(lockstep(split_blocks(N, n, block))):
        act = active_mask(items)
        ie = g.load(Idx[i % 2], iv, [None if it is None else (slice(it[0], it[0] + it[1]),) for it in items],
                    active=act, deps=barrier, name="load indices")
        ne = extents(items, lambda it: it[1])
        for j in range(int(ne.max())):
            a_j = ne > j
            aj = None if a_j.all() else a_j
            rows = [items[c][0] + j if a_j[c] else None for c in range(n)]
            for h0 in range(0, H, hc):
                he = min(hc, H - h0)
                buf = Rows[r % RING]
                r += 1
                g.load(buf, sv, [None if q is None else (slice(q, q + 1), slice(h0, h0 + he)) for q in rows],
                       active=aj, deps=barrier, name="load src row")
                if alpha != 1:
                    g.vector("muls alpha", (buf,), (buf,), ceil_div(np.where(a_j, he, 0) * itemsize(dtype), 256),
                             active=aj, compute=lambda buf=buf: np.copyto(buf.data, rnd(buf.data * np.float32(alpha),
                                                                                        dtype)))
                dst = [None if q is None else (slice(int(idx[q]), int(idx[q]) + 1), slice(h0, h0 + he)) for q in rows]
                g.store(buf, ov, dst, active=aj, deps=(ie,), fn=_AtomicAdd(ov, dst), name="atomic add row")
    return (out,)


__all__ = ["moe_init_routing", "moe_finalize_routing", "index_add", "row_cols", "init_specs", "finalize_specs",
           "finalize_cols", "widest_cols", "RING", "VEC_FLOATS"]
