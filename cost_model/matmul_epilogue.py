"""``matmul_epilogue`` (``autofuse/npu/kernels/matmul_epilogue.py``): a matmul whose tiles run a Vector program.

The Cube side is the matmul model (:func:`cost_model.matmul._model`) of the product the epilogue reads:
``M x (W * pieces) x K`` with tiles ``m0 x (n0 * pieces)`` (the gate and up blocks of SwiGLU are loaded
and multiplied as one wider tile would be). Its write-out is replaced by the epilogue's (the ``epi`` hook):

* coupled: FixPipe L0C -> UB (the plain formula), then the program over the staged tile in sub-blocks on
  the same core's Vector unit, overlapping the next tile's K loop; the step lasts at least the previous
  tile's epilogue. Its Vector time per tile is the program's ops (passes x repeats, as the
  ``vector_program`` model counts them) over the sub-blocks; its loads (a residual, a weight) and the
  output stores take the GM port in the next step; the launch ends with the last tile's epilogue.
* split: FixPipe writes the product to an L2 workspace (port time at the L2 bandwidth); each AIV loads
  half the tile's rows from it (L2 hits), runs the program and stores; the AIVs' stream for a tile
  overlaps the AIC's next tile. The workspace's last contents are written back to HBM at the end.

The tiling is the plain matmul's searched tile for that product (its default if the searched one cannot
serve), as the epilogue needs it (UB staging on coupled cores, whole rows for reductions and shuffles),
with the most sub-block rows that fit UB.
"""
from __future__ import annotations

import math

import numpy as np

from cost_model import matmul as mm
from cost_model.common import ceil_div, itemsize
from cost_model.devices import get_device
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.lowering import (bits_aligned, col_bytes, epilogue_default_tiling, epilogue_fits, epilogue_plan,
                                 epilogue_ub_specs, reg_shape)
from cost_model.program import BIT, as_program
from cost_model.vector_program import n_passes, repeats, temps
from cost_model.vecutil import largest, ub_need


def _dims(specs, prog, trans_b):
    (sa, dt), (sb, dtb) = specs[0], specs[1]
    if dt != dtb or dt not in mm.CUBE_DTYPES:
        raise TypeError(f"matmul_epilogue: operands {dt} and {dtb}; the Cube takes two equal of {mm.CUBE_DTYPES}")
    K = sa[-1]
    N = sb[0] if trans_b else sb[1]
    return math.prod(sa[:-1]), N, K, dt


def _tile_vec(low, sub, rows, cols):
    """Vector cycles of the program over one tile of ``rows`` x ``cols`` in sub-blocks of ``sub`` rows; ops on
    hoisted values (a weight's cast) once per tile."""
    ops = low.passes[0].ops
    full, rem = divmod(int(rows), sub)
    total = 0.0
    for r, count in ((sub, full), (rem, 1 if rem else 0)):
        if not count:
            continue
        for op in ops:
            cyc = n_passes(op) * float(repeats(op, r, cols))
            total += cyc * (1 if op.slow else count)
    return total


def _epi(dev, prog, low, pieces, t):
    """The ``epi`` hook of :func:`cost_model.matmul._model` for this program and tiling."""
    P = len(pieces)
    coupled = dev.arch == "coupled"
    sub = t["sub"]
    pdt = prog.inputs[0].dtype
    psz = itemsize(pdt)
    HBM, L2 = dev.hbm_bytes_per_cycle, dev.l2_bytes_per_cycle
    rates = dev.rates
    out_row = [(itemsize(o.dtype), low.program.values[o.value].width > 1) for o in prog.outputs]
    views = [w for w in low.views if w.input != 0]
    cache = {}

    def vec(rows, cols):
        key = (int(rows), int(cols))
        if key not in cache:
            cache[key] = _tile_vec(low, sub, rows, cols) if rows > 0 else 0.0
        return cache[key]

    def out_bytes(rows, cols):
        return sum(rows * (cols if wide else 1) * sz for sz, wide in out_row) + 0 * rows

    def load_bytes(rows, cols):
        return sum((rows if w.rows else 1) * col_bytes(cols if w.width > 1 else 1, w.dtype) for w in views) \
            + 0 * rows

    def hook(m_ext, n_ext, s, S, m_s, n_s):
        cols = n_ext // P
        if coupled:
            rows_core = m_ext
        else:                                   # the busier AIV of the pair: the first half of the rows
            rows_core = np.minimum(m_ext, ceil_div(t["m0"], 2))
        # the Vector time of each item, computed once per distinct (rows, cols) extent
        code = rows_core * (int(cols.max()) + 1) + cols
        _, first, inv = np.unique(code, return_index=True, return_inverse=True)
        v_item = np.array([vec(rows_core[i], cols[i]) for i in first])[inv.reshape(-1)]
        o_item = out_bytes(m_ext, cols).astype(float)
        x_item = load_bytes(m_ext, cols).astype(float)
        o_wave = np.bincount(s, o_item, S)
        x_wave = np.bincount(s, x_item, S)
        o_core = np.zeros(S)                   # the busiest core's output bytes per step
        np.maximum.at(o_core, s, out_bytes(rows_core, cols).astype(float))
        v_s = np.zeros(S)
        np.maximum.at(v_s, s, v_item)
        store = np.maximum(o_core / rates["UB->GM"], o_wave / HBM)
        prod_bytes = m_ext * n_ext * psz
        if coupled:
            fix = m_s * n_s * 4 / rates["L0C->UB"]
            PW = (o_wave + x_wave) / HBM
            # at the step boundary the port holds one sub-block's transfers: the others are issued between
            # the next tile's K chunks (the kernel's schedule), so they queue among its loads, not ahead
            frac = np.minimum(1.0, sub / np.maximum(m_ext, 1))
            edge = np.bincount(s, (o_item + x_item) * frac, S) / HBM
            step = np.maximum(v_s, store)
            ws_back = 0.0
            nbytes = {"L0C->UB": float((m_ext * n_ext).sum() * 4), "UB->GM": float(o_item.sum()),
                      "GM->UB": float(x_item.sum())}
        else:
            ws = np.bincount(s, prod_bytes, S)
            fix = np.maximum(m_s * n_s * psz / rates["L0C->GM"], ws / L2)
            PW = np.zeros(S)
            edge = PW
            # the AIVs: product in from L2, the program, outputs out
            ld = np.maximum(m_s / 2 * n_s * psz / rates["GM->UB"], ws / L2 + x_wave / HBM)
            step = np.maximum.reduce([v_s, ld + store])
            ws_back = _dirty_workspace(m_ext, cols, s, t, P, psz, min(dev.cube_cores, len(s)))
            nbytes = {"L0C->GM": float(prod_bytes.sum()), "GM->UB": float(prod_bytes.sum() + x_item.sum()),
                      "UB->GM": float(o_item.sum())}
        W = o_wave + x_wave
        W[-1] += ws_back
        # after the last product: (coupled) the first piece's FixPipe, the epilogue's Vector work, its last
        # sub-block's store; (split) the FixPipe to the workspace and the AIVs' stream
        last_rows = min(sub, int(rows_core.max()))
        drain = fix[-1] / P + v_s[-1] + float(out_bytes(last_rows, cols.max())) / rates["UB->GM"] if coupled \
            else fix[-1] + step[-1]
        return {"fix": fix, "mte3": store, "PW": PW, "PW_edge": edge, "W": W, "vec": step, "drain": drain,
                "busy": {"vector": float(v_s.sum()), "mte3": float(store.sum())}, "bytes": nbytes}

    return hook


def _dirty_workspace(m_ext, cols, s, t, P, psz, cores) -> float:
    """Workspace bytes still dirty in L2 at the end, written back then: one copy of every distinct region the
    AIC wrote (core, slot, sub-block of a half, piece; a region written again replaces its line)."""
    half, sub = ceil_div(t["m0"], 2), t["sub"]
    nb = ceil_div(half, sub)
    blk = np.arange(2 * nb)
    r0 = (blk // nb) * half + (blk % nb) * sub                            # [blocks]
    lim = np.minimum(m_ext[:, None], (blk // nb + 1)[None, :] * half)       # [items, blocks]
    rr = np.clip(lim - r0[None, :], 0, sub)
    item = np.arange(len(m_ext))
    c_, s_, b_, r_, w_ = (a.ravel() for a in np.broadcast_arrays(
        (item % cores)[:, None], (s % 2)[:, None], blk[None, :], rr, cols[:, None]))
    live = r_ > 0
    code = (((c_ * 2 + s_) * len(blk) + b_) * (sub + 1) + r_) * (int(cols.max()) + 1) + w_
    _, first = np.unique(code[live], return_index=True)
    return float((r_[live][first] * w_[live][first]).sum() * P * psz)


@cached
def _plan(prog, M, N, dtype):
    """The program's :func:`epilogue_plan` (its lowering: the same on every device it is priced for)."""
    return epilogue_plan(prog, M, N, dtype, temps)


def _price(dev, prog, M, N, K, dtype, bias_isz, t, plan=None):
    low, pieces, W, whole = plan or _plan(prog, M, N, dtype)
    P = len(pieces)
    tm = {"m0": t["m0"], "n0": t["n0"] * P, "k0": t["k0"], "k1": t["k1"]}
    return mm._model(dev, M, W * P, K, 1, False, False, dtype, prog.inputs[0].dtype, tm, bias_isz,
                     epi=_epi(dev, prog, low, pieces, t))


def _sub_fits(dev, prog, dtype, t, plan):
    """``ok(sub)``: :func:`cost_model.lowering.epilogue_fits` of tiling ``t`` with ``sub`` rows a sub-block (the
    same checks), for the tilings' binary searches over ``sub``: only the UB tiles depend on it, so the rest is
    checked once, and each UB tile's bytes a row (:func:`cost_model.lowering.epilogue_ub_specs`) taken once."""
    low, pieces, W, whole = plan
    P = len(pieces)
    isz, buf = itemsize(dtype), dev.buffers
    m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
    if not (k1 % k0 == 0 and min(m0, n0, k0, k1) > 0
            and 2 * (m0 * k1 + P * k1 * n0) * isz + n0 * 4 <= buf["L1"] - 64
            and 2 * m0 * k0 * isz <= buf["L0A"] and 2 * P * k0 * n0 * isz <= buf["L0B"]
            and P * m0 * n0 * 4 <= buf["L0C"] and (not whole or n0 >= W) and bits_aligned(low, n0)):
        return lambda sub: False
    # per register in allocation order: whether its tile's rows scale with sub, and its bytes a row
    C = min(n0, low.width)
    regs = [(r.rows, col_bytes(reg_shape(r, 1, C)[1], "uint8" if r.dtype == BIT else r.dtype)) for r in low.regs]
    stage = n0 * itemsize(prog.inputs[0].dtype) if dev.arch == "coupled" else 0    # the product's staging tiles
    align, cap = dev.align["UB"], buf["UB"]

    def ok(sub):
        if sub <= 0:
            return False
        used = 0
        if stage:
            tile = -(-m0 // sub) * sub * stage             # whole sub-blocks of the L0C tile
            for _ in range(P):
                used = -(-used // align) * align + tile
        for rows, row_bytes in regs:
            used = -(-used // align) * align + (sub if rows else 1) * row_bytes
        return used <= cap
    return ok


def _adapt(dev, prog, M, N, K, dtype, t, plan):
    """A plain matmul tile of the product as the epilogue needs it: n0 per piece (the whole row for a
    whole-row program), m0 halved while UB cannot stage it, the most sub-block rows that fit (<= 64)."""
    low, pieces, W, whole = plan
    P = len(pieces)
    k0_, k1_ = t["k0"], t["k1"]
    t = {"m0": t["m0"], "n0": max(16, t["n0"] // P // 16 * 16) if not whole else -(-W // 16) * 16,
         "k0": k0_, "k1": k1_, "sub": 1}
    isz, buf = itemsize(dtype), dev.buffers
    while True:
        # a tile as wide as a whole row may not leave L0B (or L1) room for the plain tile's K depth: the
        # K slices shrink until A and B fit, as the kernel's default tiling does
        m0, n0 = t["m0"], t["n0"]
        t["k0"] = next((k for k in (k0_, 64, 32, 16) if k <= k0_ and 2 * m0 * k * isz <= buf["L0A"]
                        and 2 * P * k * n0 * isz <= buf["L0B"]), 16)
        k1 = max(t["k0"], k1_ // t["k0"] * t["k0"])
        while k1 > t["k0"] and 2 * (m0 * k1 + P * k1 * n0) * isz + n0 * 4 > buf["L1"] - 64:
            k1 -= t["k0"]
        t["k1"] = k1
        rows = t["m0"] if dev.arch == "coupled" else max(1, ceil_div(t["m0"], 2))
        best = largest(_sub_fits(dev, prog, dtype, t, plan), 1, min(rows, 64))
        if best >= 1:
            return {**t, "sub": best}
        if t["m0"] <= 16:
            return None
        t["m0"] //= 2


def kernel_default(dev, prog, M, N, K, dtype, plan=None) -> dict:
    """The kernel's own default tiling (:func:`cost_model.lowering.epilogue_default_tiling`, which the kernel
    runs too) from this model's plain matmul default tile."""
    plan = plan or _plan(prog, M, N, dtype)
    _, pieces, W, _ = plan
    mm_tile = mm.kernel_default(dev, M, W * len(pieces), K, 1, dtype, dtype)
    return epilogue_default_tiling(dev, plan, K, dtype, mm_tile, lambda t: _sub_fits(dev, prog, dtype, t, plan))


@cached
def _search(device, prog, M, N, K, dtype, bias_isz):
    dev = get_device(device)
    plan = _plan(prog, M, N, dtype)
    _, pieces, W, _ = plan
    P = len(pieces)
    pdt = prog.inputs[0].dtype
    def adapted(t0):
        return None if t0 is None else _adapt(dev, prog, M, N, K, dtype, t0, plan)

    def own():
        t = kernel_default(dev, prog, M, N, K, dtype, plan)
        return t if epilogue_fits(dev, prog, M, N, dtype, t, temps, plan) else None

    best, tried = None, []
    # the plain search's tile and the plain default's, each adapted to the epilogue, and the epilogue kernel's own
    # default: the cheapest that fits
    for candidate in (lambda: adapted(mm._search(device, M, W * P, K, 1, False, False, dtype, pdt, bias_isz)[0]),
                      lambda: adapted(mm.kernel_default(dev, M, W * P, K, 1, dtype, pdt)), own):
        t = candidate()
        if t is None or t in tried:
            continue
        tried.append(t)
        res = _price(dev, prog, M, N, K, dtype, bias_isz, t, plan)
        cycles = kernel_cycles(dev, *res[:3])
        if best is None or cycles < best[0]:      # the plain search's tile adapted need not beat the default's
            best = (cycles, t, res)
    if best is None:
        raise ValueError(f"matmul_epilogue: no tiling fits {dev.name} for this program: "
                         f"{_why_not(dev, prog, plan, dtype)}")
    return best[1], best[2]


def _why_not(dev, prog, plan, dtype) -> str:
    """What the smallest tile (16 rows, one K slice of the Cube's depth, one row per sub-block) asks of each buffer,
    naming the first that overflows (the L1, L0 and UB checks of :func:`cost_model.lowering.epilogue_fits`)."""
    low, pieces, W, whole = plan
    P, isz = len(pieces), itemsize(dtype)
    m0, k0 = 16, dev.cube_k0[dtype]
    n0 = -(-W // 16) * 16 if whole else 16
    needs = [("UB", ub_need(dev, epilogue_ub_specs(dev, prog, low, P, {"m0": m0, "n0": n0, "sub": 1})),
              dev.buffers["UB"]),
             ("L1", 2 * (m0 * k0 + P * k0 * n0) * isz + n0 * 4, dev.buffers["L1"] - 64),
             ("L0A", 2 * m0 * k0 * isz, dev.buffers["L0A"]), ("L0B", 2 * P * k0 * n0 * isz, dev.buffers["L0B"]),
             ("L0C", P * m0 * n0 * 4, dev.buffers["L0C"])]
    over = [f"{need:,} B of {name}, {have:,} B available" for name, need, have in needs if need > have]
    rows = f"whole rows of {W} columns" if whole else f"tiles of {n0} columns"
    if over:
        return f"{rows} in 16-row tiles need " + "; and ".join(over)
    return (f"{rows}: the smallest tile fits every buffer (UB {needs[0][1]:,} of {needs[0][2]:,} B), but none of the "
            f"matmul search's tilings adapts to it")


def _roofline(dev, specs, program=None, bias=None, trans_b=False, tiling=None):
    prog = as_program(program)
    M, N, K, dt = _dims(specs, prog, trans_b)
    fl = 2.0 * M * N * K
    io = sum(math.prod(s[:-1]) * col_bytes((tuple(s) or (1,))[-1], d) for s, d in specs) + \
        sum(math.prod(s) * itemsize(o.dtype) for o, s in zip(prog.outputs, prog.output_shapes()))
    return max(fl / (2.0 * dev.cube_macs[dt] * dev.cube_cores), io / dev.hbm_bytes_per_cycle)


@register("matmul_epilogue", _roofline)
def estimate_matmul_epilogue(dev, specs, program=None, bias=None, trans_b=False, tiling=None):
    prog = as_program(program)
    M, N, K, dt = _dims(specs, prog, trans_b)
    bias_isz = itemsize(bias[1]) if bias is not None else 0
    if tiling is None:
        t, res = _search(dev.name, prog, M, N, K, dt, bias_isz)
    else:
        t = {k: int(v) for k, v in dict(tiling).items()}
        if not epilogue_fits(dev, prog, M, N, dt, t, temps, _plan(prog, M, N, dt)):
            raise ValueError(f"matmul_epilogue tiling {t} does not fit the buffers of {dev.name}")
        res = _price(dev, prog, M, N, K, dt, bias_isz, t)
    core, hbm, nbytes, busy = res
    return make("matmul_epilogue", dev, core, hbm, nbytes, busy, dict(t), _roofline(dev, specs, prog),
                2.0 * M * N * K, workspace=_workspace(dev, prog, M, N, dt, t))


def _workspace(dev, prog, M, N, dtype, t) -> int:
    """GM the kernel allocates besides its outputs: on a split chip each AIC hands its product tile to its two
    AIVs through two slots of ``m0 x n0`` per piece (the kernel's ``ws_acc``); a coupled core keeps it on chip."""
    if dev.arch != "split":
        return 0
    _, pieces, W, _ = _plan(prog, M, N, dtype)
    cores = min(dev.cube_cores, ceil_div(M, t["m0"]) * ceil_div(W, t["n0"]))
    return cores * 2 * t["m0"] * t["n0"] * len(pieces) * itemsize(prog.inputs[0].dtype)


__all__ = ["estimate_matmul_epilogue"]
