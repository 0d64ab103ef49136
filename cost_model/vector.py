"""Elementwise and reduce (``autofuse/npu/kernels/vector.py``) as task streams.

``elementwise``: the output shape is coalesced (size-1 dims dropped, neighbours with the same broadcast
pattern merged) into ``lead x rows x cols``; tiles of ``rows x cols`` are split over the vector cores by
rows (or, with fewer rows than cores, flat along the columns). Per task: each input whose region changed
is loaded (full inputs every task; a row vector broadcast over rows only when its column chunk changes —
every core reads the same region, one L2 miss and the rest hits), cast to the compute dtype, Brcb'd
(column vectors), the op's passes (one Vector instruction per pass, per-row repeats when an operand is
broadcast along rows), the cast to the output dtype, the store.

``reduce``: coalesced into kept and reduced groups; lanes of the innermost kept group split over cores,
the innermost reduced group chunked through UB; per chunk a cast and a row reduction (or one elementwise
accumulation per row when the lanes are innermost), then mean, cast and store after the last chunk.
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import ceil_div, itemsize, round_up, tile1d
from cost_model.devices import ITEMSIZE, get_device
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.stream import block_steps, port, stream
from cost_model.vecutil import block_elems, coalesce, fits, largest, pad, promote, reduce_groups, reduce_tiles

FLOATS = ("float16", "bfloat16", "float32")
INTS = ("int32", "int8")
_ERF = 2 + 1 + 16 + 2
_SIN = 7 + 1 + 8 + 1 + 7          # range reduction, z = r*r, degree-9 Horner, r*P, sign (the kernel's _SIN)
_LOG1P = 5 + 2 + 2                 # 1 + x, ln, u - 1, the correction's div and mul; two compare-selects
_EXPM1 = 5 + 2 + 3                 # exp, u - 1, ln, div, mul; a compare-select for u = 1, abs + compare-select
_SOFTPLUS = 3 + 5 + 2 + 2          # -|x|, exp; the log1p correction; a compare-select; relu and add
_ROUNDING = 2 + 3 + 3              # cast to int32 by the mode and back; |x| >= 2^23 keeps x; a zero keeps x's sign

# op -> (kind, native16, temps, scalar rule, passes(has_scalar, scalar))
_fixed = lambda k: (lambda has, s: k)    # noqa: E731


def _pow_passes(has, p):
    if not has:
        return 3
    p = float(p)
    if p in (0.0, 1.0, 0.5, -0.5, -1.0, 2.0):
        return 1
    if p.is_integer() and abs(p) <= 64:
        k = int(abs(p))
        return (k.bit_length() - 1) + (bin(k).count("1") - 1) + (1 if p < 0 else 0)
    return 3


OPS = {
    "neg": ("arith", True, 0, "none", _fixed(1)), "abs": ("arith", True, 0, "none", _fixed(1)),
    "relu": ("arith", True, 0, "none", _fixed(1)), "square": ("arith", True, 0, "none", _fixed(1)),
    "exp": ("float", True, 0, "none", _fixed(1)), "log": ("float", True, 0, "none", _fixed(1)),
    "sqrt": ("float", True, 0, "none", _fixed(1)), "rsqrt": ("float", True, 0, "none", _fixed(1)),
    "reciprocal": ("float", True, 0, "none", _fixed(1)),
    "sigmoid": ("float", False, 0, "none", _fixed(4)), "tanh": ("float", False, 0, "none", _fixed(6)),
    "silu": ("float", False, 1, "none", _fixed(4)), "gelu": ("float", False, 3, "none", _fixed(1 + _ERF + 3)),
    "gelu_tanh": ("float", False, 1, "none", _fixed(8)), "cast": ("cast", True, 0, "none", _fixed(1)),
    "sin": ("float", False, 2, "none", _fixed(_SIN)), "cos": ("float", False, 2, "none", _fixed(1 + _SIN)),
    "erf": ("float", False, 3, "none", _fixed(_ERF)), "softplus": ("float", False, 2, "none", _fixed(_SOFTPLUS)),
    "log1p": ("float", False, 2, "none", _fixed(_LOG1P)), "expm1": ("float", False, 2, "none", _fixed(_EXPM1)),
    **{op: ("float", False, 2, "none", _fixed(_ROUNDING)) for op in ("floor", "ceil", "trunc", "round")},
    "sign": ("float", False, 1, "none", _fixed(5)),        # a duplicated 0, two compare-selects
    "logical_not": ("logic", True, 0, "none", _fixed(1)), "pow": ("float", False, 0, "optional", _pow_passes),
    "add": ("arith", True, 0, "optional", _fixed(1)), "sub": ("arith", True, 0, "optional", _fixed(1)),
    "mul": ("arith", True, 0, "optional", _fixed(1)), "div": ("float", True, 0, "optional", _fixed(1)),
    "rsub": ("arith", True, 0, "required", _fixed(2)), "rdiv": ("float", True, 0, "required", _fixed(1)),
    "maximum": ("arith", True, 0, "optional", _fixed(1)), "minimum": ("arith", True, 0, "optional", _fixed(1)),
    **{c: ("compare", True, 0, "optional", _fixed(1)) for c in ("eq", "ne", "lt", "le", "gt", "ge")},
    "logical_and": ("logic", True, 0, "none", _fixed(1)), "logical_or": ("logic", True, 0, "none", _fixed(1)),
    "where": ("select", True, 0, "optional", _fixed(2)), "masked_fill": ("select", True, 0, "required", _fixed(2)),
    # a Vector program's where on a packed bit mask: the Select alone (not an elementwise kernel op)
    "select_bits": ("select_bits", True, 0, "optional", _fixed(1)),
}


def _wider(a, b):
    return a if itemsize(a) >= itemsize(b) else b


def _plan(specs, op, scalar, out_dtype):
    """Everything the kernel derives from shapes and dtypes (see ``elementwise``)."""
    if op not in OPS or OPS[op][0] == "select_bits":
        raise ValueError(f"elementwise: unknown op {op!r}")
    kind, native16, temps, _, passes_fn = OPS[op]
    has_scalar = scalar is not None
    in_dt = [d for _, d in specs]
    if kind == "select":
        conds = [0] if op == "where" else [1]
        data_idx = [i for i in range(len(specs)) if i not in conds]
    else:
        data_idx = list(range(len(specs)))
    float_scalar = has_scalar and isinstance(scalar, float) and kind != "select"
    if kind == "logic":
        res, cd = "bool", "bool"
    else:
        res = promote([in_dt[i] for i in data_idx], float_scalar)
        if kind == "float" and res not in FLOATS:
            res = "float32"
        if kind == "cast":
            cd = res
        elif res == "float32" or (res == "float16" and native16) or (res in INTS and kind != "float"):
            cd = res
        elif res == "bool":
            cd = "float16"
        else:
            cd = "float32"
        if res == "bfloat16" and kind == "select":
            cd = "bfloat16"
    out_dt = out_dtype or ("bool" if kind == "compare" else res)
    out_shape = tuple(np.broadcast_shapes(*(s for s, _ in specs)))
    return dict(kind=kind, temps=temps, passes=passes_fn(has_scalar, scalar), in_dt=in_dt, data_idx=data_idx,
                cd=cd, out_dt=out_dt, out_shape=out_shape)


def _ew_model(dev, specs, p, r, c):
    shapes = [s for s, _ in specs]
    in_dt, cd, out_dt = p["in_dt"], p["cd"], p["out_dt"]
    dims, flags = coalesce(p["out_shape"], shapes)
    lead, Dr, Dc = dims[:-2], dims[-2], dims[-1]
    nlead = math.prod(lead)
    K = len(specs)
    row_full = [flags[-2][k] for k in range(K)]
    col_full = [flags[-1][k] for k in range(K)]
    lead_var = [any(flags[j][k] for j in range(len(lead))) for k in range(K)]
    scalar_like = [not any(flags[j][k] for j in range(len(dims))) for k in range(K)]
    cast_in = [(k in p["data_idx"]) and in_dt[k] != cd for k in range(K)]
    need_res = out_dt != cd
    cblk = max(block_elems(d) for d in set(in_dt) | {cd, out_dt})
    rowspace = nlead * Dr
    row_mode = rowspace >= dev.vector_cores
    n = min(dev.vector_cores, rowspace) if row_mode else min(dev.vector_cores, rowspace * ceil_div(Dc, cblk))
    if not row_mode:
        r = 1
    r = min(r, Dr)
    c = min(c, Dc)
    rowb = any(not row_full[k] and not scalar_like[k] for k in p["data_idx"]) and r > 1
    osz = itemsize(out_dt)
    lanes_cd = 256 // itemsize(cd)

    if row_mode:
        # tasks per core: its row blocks (cut at Dr) x column chunks of c
        re, tot, act = block_steps(rowspace, n, r) if Dr % r == 0 or nlead == 1 else _rows_cut(rowspace, n, r, Dr)
        ncol = ceil_div(Dc, c)
        cws = np.array([min(c, Dc - c0) for c0 in range(0, Dc, c)], dtype=float)
        S = len(re)
        re = re.repeat(ncol)
        tot = tot.repeat(ncol)
        act = act.repeat(ncol)
        ce = tile1d(cws, S)
        first_task = np.zeros(S * ncol, dtype=bool)
        first_task[0] = True
        col_change = np.ones(S * ncol, dtype=bool) if ncol > 1 else first_task
        revisit = np.arange(S * ncol) >= ncol          # a column chunk seen before
        tot_el = tot * ce
    else:
        ce, tot, act = _rows_cut(rowspace * Dc, n, c, Dc, align=cblk)
        re = np.ones(len(ce))
        first_task = np.zeros(len(ce), dtype=bool)
        first_task[0] = True
        col_change = np.ones(len(ce), dtype=bool)
        revisit = np.zeros(len(ce), dtype=bool)
        tot_el = tot
    T = len(re)
    cpe = np.ceil(ce / cblk) * cblk
    lb = np.zeros(T)
    hit = np.zeros(T)
    miss = np.zeros(T)
    vec = np.zeros(T)
    instr = np.zeros(T)
    for k in range(K):
        isz = itemsize(in_dt[k])
        if row_full[k] and col_full[k]:
            fresh = np.ones(T, dtype=bool)
            b_core, b_tot = re * ce * isz, tot_el * isz
            h, m = 0.0, b_tot
        elif scalar_like[k]:
            fresh = first_task
            b_core, b_tot = isz + 0 * re, act * isz
            h, m = (act - 1) * isz, isz + 0 * re
        elif col_full[k]:                       # a row vector broadcast along rows
            fresh = col_change if not lead_var[k] else np.ones(T, dtype=bool)
            b_core = ce * isz
            if row_mode:                        # every core reads the same column chunk
                b_tot = act * ce * isz
                again = revisit & (Dc * isz <= dev.l2_bytes) & (not lead_var[k])
                h = np.where(again, b_tot, b_tot - ce * isz)
                m = np.where(again, 0.0, ce * isz)
            else:                               # cores on different rows, same columns, share regions
                b_tot = tot_el * isz
                share = ceil_div(ceil_div(rowspace * Dc, cblk), n) * cblk
                uniq = min(1.0, ceil_div(Dc, share) / n) if Dc % min(share, Dc) == 0 else 1.0
                h, m = b_tot * (1 - uniq), b_tot * uniq
        else:                                   # a column vector broadcast along columns
            fresh = np.ones(T, dtype=bool) if ce.size and (not row_mode or True) else first_task
            if row_mode and ceil_div(Dc, c) > 1:
                fresh = np.concatenate([[True], np.diff(re) != 0]) | (np.arange(T) % ceil_div(Dc, c) == 0)
            b_core, b_tot = re * isz, tot * isz
            h, m = 0.0, b_tot
        lb += np.where(fresh, b_core, 0.0)
        hit += np.where(fresh, h, 0.0)
        miss += np.where(fresh, m, 0.0)
        instr += fresh
        if cast_in[k]:
            kr = re if row_full[k] else 1
            kc = cpe if col_full[k] else 1
            vec += np.where(fresh, np.ceil(kr * kc / (256 // itemsize(_wider(in_dt[k], cd)))), 0.0)
            instr += fresh
        if not col_full[k] and row_full[k] and not scalar_like[k]:
            vec += np.where(fresh, np.ceil(re / 8), 0.0)
            instr += fresh
    ew = re * np.ceil(ce / lanes_cd) if rowb else np.ceil(re * cpe / lanes_cd)
    vec += p["passes"] * ew
    instr += p["passes"]
    if need_res:
        vec += np.ceil(re * cpe / (256 // itemsize(_wider(cd, out_dt))))
        instr += 1
    sb = re * ce * osz
    stot = tot_el * osz
    instr += 1
    core, busy = stream(dev, lb, port(dev, hit, miss), vec, sb, stot / dev.hbm_bytes_per_cycle, instr)
    hbm = miss.sum() + stot.sum()
    return core, float(hbm), {"GM->UB": float((hit + miss).sum()), "UB->GM": float(stot.sum())}, busy


def _rows_cut(total, n, r, period, align=1):
    """``tiles.split_blocks``: even shares (in units of ``align``) cut into blocks of ``r`` that never cross a
    multiple of ``period``. Per lockstep step: (worst extent, total extent, active cores). Vectorised over
    the cores' segments and blocks."""
    units = ceil_div(total, align)
    base, rem = divmod(units, n)
    q = base + (np.arange(n) < rem)
    ends_u = q.cumsum()
    s = (ends_u - q) * align
    e = np.minimum(total, ends_u * align)
    live = e > s
    s, e = s[live], e[live]
    p0, p1 = s // period, (e - 1) // period
    nseg = p1 - p0 + 1
    seg_core = np.arange(len(s)).repeat(nseg)
    seg_k = np.arange(nseg.sum()) - (nseg.cumsum() - nseg).repeat(nseg)
    seg_p = p0[seg_core] + seg_k
    seg_s = np.maximum(s[seg_core], seg_p * period)
    seg_e = np.minimum(e[seg_core], (seg_p + 1) * period)
    nblk = -(-(seg_e - seg_s) // r)
    blk_seg = np.arange(len(seg_s)).repeat(nblk)
    blk_k = np.arange(nblk.sum()) - (nblk.cumsum() - nblk).repeat(nblk)
    ext = np.minimum(r, seg_e[blk_seg] - seg_s[blk_seg] - blk_k * r).astype(float)
    blk_core = seg_core[blk_seg]
    per_core = np.bincount(blk_core, minlength=len(s))
    step = np.arange(len(ext)) - (per_core.cumsum() - per_core).repeat(per_core)
    S = int(per_core.max())
    worst = np.zeros(S)
    np.maximum.at(worst, step, ext)
    tot = np.bincount(step, ext, S)
    act = np.bincount(step, None, S).astype(float)
    return worst, tot, act


def _ew_layout(specs, p):
    """The kernel's UB tiles for blocks of ``r`` rows and ``c`` columns, with ``r`` and ``c`` left open: per tile in
    allocation order ((its rows: ``r`` if True else 1, its columns: "c" for ``c`` padded to whole blocks, else a
    count), its dtype), and the block the columns are padded to. The tile-size search probes many (r, c) of one
    layout."""
    shapes = [s for s, _ in specs]
    dims, flags = coalesce(p["out_shape"], shapes)
    in_dt, cd, out_dt = p["in_dt"], p["cd"], p["out_dt"]
    K = len(specs)
    row_full = [flags[-2][k] for k in range(K)]
    col_full = [flags[-1][k] for k in range(K)]
    scalar_like = [not any(flags[j][k] for j in range(len(dims))) for k in range(K)]
    cast_in = [(k in p["data_idx"]) and in_dt[k] != cd for k in range(K)]
    cblk = max(block_elems(d) for d in set(in_dt) | {cd, out_dt})
    lay = []
    for k in range(K):
        shp = (row_full[k], "c" if col_full[k] else 1)
        lay += [(shp, in_dt[k])] * 2
        if cast_in[k]:
            lay.append((shp, cd))
        if not col_full[k] and row_full[k] and not scalar_like[k]:
            lay.append(((True, block_elems(cd)), cd))
    lay += [((True, "c"), cd)] * (p["temps"] + (out_dt != cd))
    return lay + [((True, "c"), out_dt)] * 2, cblk


def _ew_fits(dev, specs, p):
    """``ok(r, c)``: whether the tiles of :func:`_ew_layout` at ``(r, c)`` fit UB, summed as
    :func:`cost_model.vecutil.fits` sums them (each tile at the UB alignment); the layout is derived once for the
    search's many probes."""
    lay, cblk = _ew_layout(specs, p)
    lay = [(rows, cols, ITEMSIZE[dt]) for (rows, cols), dt in lay]
    align, cap = dev.align["UB"], dev.buffers["UB"]

    def ok(r, c):
        cp = round_up(c, cblk)
        used = 0
        for rows, cols, isz in lay:
            used = -(-used // align) * align + (r if rows else 1) * (cp if cols == "c" else cols) * isz
        return used <= cap
    return ok


@cached
def _ew_search(device, specs, op, scalar, out_dtype):
    dev = get_device(device)
    p = _plan(specs, op, scalar, out_dtype)
    dims, _ = coalesce(p["out_shape"], [s for s, _ in specs])
    Dr, Dc = dims[-2], dims[-1]
    rowspace = math.prod(dims[:-1])
    row_mode = rowspace >= dev.vector_cores
    cblk = max(block_elems(d) for d in set(p["in_dt"]) | {p["cd"], p["out_dt"]})
    total = math.prod(p["out_shape"])
    ok = _ew_fits(dev, specs, p)
    cands = []
    if row_mode:
        n = min(dev.vector_cores, rowspace)
        if ok(1, Dc):
            c = Dc
        else:
            c = 128 * largest(lambda k: ok(1, k * 128), 1, ceil_div(Dc, 128))
        if c < 1:
            raise ValueError(f"elementwise {op}: no tile fits UB on {dev.name}")
        rmax = largest(lambda x: ok(x, c), 1, min(Dr, ceil_div(rowspace, n)))
        for j in (1, 2, 4):
            rr = max(1, min(rmax, ceil_div(ceil_div(rowspace, n), j)))
            if Dr % rr and rr > 1 and rr > Dr:
                continue
            if {"rows": rr, "cols": c} not in cands:        # a repeat prices the same: it cannot win
                cands.append({"rows": rr, "cols": c})
    else:
        n = min(dev.vector_cores, rowspace * ceil_div(Dc, cblk))
        cmax = cblk * largest(lambda k: ok(1, k * cblk), 1, ceil_div(Dc, cblk))
        per_core = ceil_div(total, n)
        for j in (1, 2, 4):
            cc = max(cblk, min(cmax, round_up(ceil_div(per_core, j), cblk)))
            if {"rows": 1, "cols": min(cc, Dc)} not in cands:   # a repeat prices the same: it cannot win
                cands.append({"rows": 1, "cols": min(cc, Dc)})
    best = None
    for t in cands:
        res = _ew_model(dev, specs, p, t["rows"], t["cols"])
        cost = kernel_cycles(dev, *res[:3])
        if best is None or cost < best[0]:
            best = (cost, t, res)
    return best[1], best[2]


def _ew_roofline(dev, specs, op=None, scalar=None, out_dtype=None, tiling=None):
    p = _plan(specs, op, scalar, out_dtype)
    N = math.prod(p["out_shape"])
    io = sum(math.prod(s) * itemsize(d) for s, d in specs) + N * itemsize(p["out_dt"])
    vec = N * p["passes"] / (256 / itemsize(p["cd"])) / dev.vector_cores
    return max(vec, io / dev.hbm_bytes_per_cycle)


@register("elementwise", _ew_roofline)
def estimate_elementwise(dev, specs, op=None, scalar=None, out_dtype=None, tiling=None):
    specs = tuple(s for s in specs if s is not None)
    if isinstance(scalar, tuple):            # a one-element tensor given as the scalar
        scalar = 1.0
    if tiling is None:
        t, res = _ew_search(dev.name, specs, op, scalar, out_dtype)
    else:
        p = _plan(specs, op, scalar, out_dtype)
        dims, _ = coalesce(p["out_shape"], [s for s, _ in specs])
        t = {"rows": int(tiling.get("rows", 1)), "cols": min(int(tiling.get("cols", dims[-1])), dims[-1])}
        res = _ew_model(dev, specs, p, t["rows"], t["cols"])
    core, hbm, nbytes, busy = res
    p = _plan(specs, op, scalar, out_dtype)
    N = math.prod(p["out_shape"])
    return make("elementwise", dev, core, hbm, nbytes, busy, dict(t), _ew_roofline(dev, specs, op, scalar, out_dtype),
                float(N * p["passes"]))


# ------------------------------------------------------------------------------------------- reduce
def _red_geometry(shape, dim):
    nd = len(shape)
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        red = set(range(nd))
    else:
        ds = [dim] if isinstance(dim, int) else list(dim)
        red = {d % max(nd, 1) for d in ds}
    groups = reduce_groups(shape, red)
    iA = max(i for i, (_, f) in enumerate(groups) if not f)
    iR = max(i for i, (_, f) in enumerate(groups) if f)
    SA, SR = groups[iA][0], groups[iR][0]
    P = math.prod(s for s, f in groups if not f)
    RO = math.prod(s for i, (s, f) in enumerate(groups) if f and i != iR)
    return iR > iA, SA, SR, P, RO


def _red_model(dev, dtype, out_dt, op, rowmode, SA, SR, P, RO, block, chunk):
    isz = itemsize(dtype)
    n = min(dev.vector_cores, P)
    block = min(block, SA)
    lowp = dtype != "float32"
    if SA % block == 0 or P == SA:
        le, tot, act = block_steps(P, n, block) if P == SA or (P // n) % SA == 0 and P % n == 0 \
            else _rows_cut(P, n, block, SA)
    else:
        le, tot, act = _rows_cut(P, n, block, SA)
    S = len(le)
    nch = ceil_div(SR, chunk)
    steps = RO * nch
    # per column, every core's step of each of its tasks: [S, steps], read out row by row (a task's steps in order)
    cols = {k: np.empty((S, steps)) for k in ("lb", "miss", "vec", "sb", "stot", "instr")}
    for i in range(steps):
        k = i % nch
        rv = min(chunk, SR - k * chunk)
        first, last = i == 0, i == steps - 1
        if rowmode:
            ew = np.ceil(le * pad(rv, dtype) / 64)
            vec = (ew if lowp else 0) + le * ceil_div(rv, 64) + (0 if first else np.ceil(pad(le, "float16") / 64))
            instr = (1 if lowp else 0) + 1 + (0 if first else 1)
        else:
            pl = np.ceil(le / (32 // isz)) * (32 // isz)
            ew = np.ceil(rv * pl / 64)
            vec = (ew if lowp else 0) + rv * np.ceil(pl / 64)
            instr = (1 if lowp else 0) + 1
        sb = stot = 0.0
        if last:
            small = np.ceil(pad(le, "float16") / 64)
            vec = vec + small * (2 if op == "mean" else 1)
            instr += 2 if op == "mean" else 1
            sb, stot = le * itemsize(out_dt), tot * itemsize(out_dt)
            instr += 1
        for key, v in zip(cols, (le * rv * isz, tot * rv * isz, vec, sb, stot, instr + 1)):
            cols[key][:, i] = v
    arr = {k: v.reshape(-1) for k, v in cols.items()}
    core, busy = stream(dev, arr["lb"], port(dev, 0.0 * arr["miss"], arr["miss"]), arr["vec"], arr["sb"],
                        arr["stot"] / dev.hbm_bytes_per_cycle, arr["instr"])
    hbm = arr["miss"].sum() + arr["stot"].sum()
    return core, float(hbm), {"GM->UB": float(arr["miss"].sum()), "UB->GM": float(arr["stot"].sum())}, busy


@cached
def _red_search(device, dtype, out_dt, op, rowmode, SA, SR, P, RO):
    dev = get_device(device)
    n = min(dev.vector_cores, P)
    per_lanes = ceil_div(P, n)
    cands = []
    if rowmode:
        ok1 = lambda ch: fits(dev, reduce_tiles(dtype, out_dt, True, 1, ch))   # noqa: E731
        chunk = SR if ok1(SR) else 64 * largest(lambda k: ok1(k * 64), 1, ceil_div(SR, 64))
        bmax = largest(lambda b: fits(dev, reduce_tiles(dtype, out_dt, True, b, chunk)), 1, min(SA, per_lanes))
        for j in (1, 2, 4):
            t = {"block": max(1, min(bmax, ceil_div(per_lanes, j))), "chunk": chunk}
            if t not in cands:                              # a repeat prices the same: it cannot win
                cands.append(t)
    else:
        for b in (1024, 512, 256, 128, 64):
            block = min(SA, per_lanes, b)
            chunk = largest(lambda ch: fits(dev, reduce_tiles(dtype, out_dt, False, block, ch)), 1, SR)
            if chunk >= 1 and {"block": block, "chunk": chunk} not in cands:
                cands.append({"block": block, "chunk": chunk})
    if not cands or cands[0]["chunk"] < 1:
        raise ValueError(f"reduce: no tile of {dtype} fits UB on {dev.name}")
    best = None
    for t in cands:
        res = _red_model(dev, dtype, out_dt, op, rowmode, SA, SR, P, RO, t["block"], t["chunk"])
        cost = kernel_cycles(dev, *res[:3])
        if best is None or cost < best[0]:
            best = (cost, t, res)
    return best[1], best[2]


def _red_roofline(dev, specs, op="sum", dim=None, keepdim=False, out_dtype=None, tiling=None):
    shape, dtype = specs[0]
    N = math.prod(shape)
    return max(N / (256 / 4) / dev.vector_cores, N * itemsize(dtype) / dev.hbm_bytes_per_cycle)


@register("reduce", _red_roofline)
def estimate_reduce(dev, specs, op="sum", dim=None, keepdim=False, out_dtype=None, tiling=None):
    shape, dtype = specs[0]
    out_dt = out_dtype or dtype
    rowmode, SA, SR, P, RO = _red_geometry(shape, dim)
    if tiling is None:
        t, res = _red_search(dev.name, dtype, out_dt, op, rowmode, SA, SR, P, RO)
    else:
        t = {"block": int(tiling.get("block", 1)), "chunk": min(int(tiling.get("chunk", SR)), SR)}
        res = _red_model(dev, dtype, out_dt, op, rowmode, SA, SR, P, RO, t["block"], t["chunk"])
    core, hbm, nbytes, busy = res
    return make("reduce", dev, core, hbm, nbytes, busy, dict(t), _red_roofline(dev, specs), float(math.prod(shape)))


__all__ = ["estimate_elementwise", "estimate_reduce"]
