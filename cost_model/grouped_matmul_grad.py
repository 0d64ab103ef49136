"""The grouped GEMM's weight gradient (``autofuse/npu/kernels/grouped_matmul_grad.py``):
``grouped_matmul_weight_grad`` and ``matmul_per_group_weight_grad``.

Specs: ``lhs [M, P]``, ``rhs [M, Q]``, ``group_list [E]``; output ``[E, P, Q]``. Group sizes as for
``grouped_matmul``: ``group_sizes=(m_0, ..., m_{E-1})``, else the rows spread evenly over the groups.

*grouped_matmul_weight_grad*: the kernel's output tiles of the non-empty groups (the blocks along the wider
output dim innermost) and its deal by load are replayed. Per tile, on its core: MTE2 loads the
group's lhs block (``rows·p``) and rhs block (``rows·q``); MTE1 moves them to L0A/L0B; the Cube does
``ceil(p/16)·ceil(q/16)`` fractals per k0-slice of rows (``ceil(kv/k0)`` each); the tile leaves by FixPipe
(split) or L0C→UB→MTE3 (coupled). The outer block's operand was read by the previous inner block (an L2
hit for every inner block after the first); the inner operand was read for the previous outer block, a hit
when the group's rows of it and the tiles in between fit the L2. The tiles of one lockstep step share the bandwidth as processors
share one (groups differ in rows, so their tiles differ in bytes): a tile's transfer ends after its own
bytes and, of each other tile of its step, as many bytes as it has (L2 for all bytes, HBM for misses). A
tile lasts as long as its busiest unit (Cube and write-out in series when L0C holds one accumulator); a
core's time is the sum of its tiles plus the first chunk's load, its last tile's products and write-out in
series. Empty groups' zero blocks are MTE3 stores: on the AIVs (split, beside the Cube's work) or on the
cores before their tiles (coupled).

*matmul_per_group_weight_grad*: the ``matmul`` model (``trans_a``, its tiling search) for each non-empty
group's rows, one launch each, summed.
"""
from __future__ import annotations

import numpy as np

from cost_model.common import ceil_div, itemsize, round_up
from cost_model.devices import get_device
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.grouped_matmul import _deal, _sizes, busiest_core, per_group_launches
from cost_model.grouped_matmul_tiling import (weight_grad_default_tiling as kernel_default,
                                              weight_grad_tiling_fits as fits)
from cost_model.matmul import write_out


def _items(sizes, P, Q, m0, n0):
    """Tiles of the non-empty groups, one row each: (group, rows, p extent, q extent, row block, col block), in
    the kernel's order; and the number of empty groups' blocks. Every group has the same blocks: one group's
    block columns, tiled over the non-empty groups."""
    nm, nn = ceil_div(P, m0), ceil_div(Q, n0)
    if P <= Q:                      # row blocks innermost
        mi, ni = np.arange(nm * nn) % nm, np.arange(nn).repeat(nm)
    else:                           # column blocks innermost
        mi, ni = np.arange(nm).repeat(nn), np.arange(nm * nn) % nn
    live = [(g, c) for g, c in enumerate(sizes) if c > 0]
    zeros = (len(sizes) - len(live)) * nm * nn
    out = np.empty((len(live) * nm * nn, 6), dtype=np.int64)
    if live:
        out[:, :2] = np.array(live, dtype=np.int64).repeat(nm * nn, axis=0)
        block = np.stack([np.minimum(m0, P - mi * m0), np.minimum(n0, Q - ni * n0), mi, ni], axis=1)
        out[:, 2:] = block[np.arange(len(out)) % (nm * nn)]          # (np.tile of the rows over the groups)
    return out, zeros


def _slice_fractals(rows, k0, k1, k0f):
    """Cube k-steps of a group's rows: per k1 chunk, per k0 slice, ceil(slice rows / k0f)."""
    full, rest = divmod(rows, k1)
    per_chunk = lambda r: sum(ceil_div(min(k0, r - s), k0f) for s in range(0, r, k0))  # noqa: E731
    return full * per_chunk(k1) + (per_chunk(rest) if rest else 0)


def _model(dev, M, P, Q, E, dtype, out_dtype, sizes, t):
    isz, osz = itemsize(dtype), itemsize(out_dtype)
    m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
    split = dev.arch == "split"
    rates, sc = dev.rates, dev.scalar_issue_cycles
    L2bw, HBMbw = dev.l2_bytes_per_cycle, dev.hbm_bytes_per_cycle
    arr, nzero = _items(sizes, P, Q, m0, n0)
    pro = E * 4 / rates["GM->L1"] + E * sc
    zb = m0 * n0 * osz                                  # a zero block's bytes (edge blocks: the region's)
    z_bytes = float(sum(min(m0, P - p) * min(n0, Q - q) for p in range(0, P, m0) for q in range(0, Q, n0))) \
        * sum(1 for c in sizes if c == 0) * osz
    if not len(arr):
        nv = max(1, min(2 * dev.cube_cores if split else dev.cube_cores, nzero))
        zt = ceil_div(nzero, nv) * zb / rates["UB->GM"] + (m0 * n0 * osz) / 256
        return pro + zt, float(E * 4 + z_bytes), {"GM->L1": float(E * 4), "UB->GM": z_bytes}, \
            {"mte3": ceil_div(nzero, nv) * zb / rates["UB->GM"]}, 1
    g, r, p, q, mi, ni = (arr[:, i] for i in range(6))
    rf, pf, qf = r.astype(float), p.astype(float), q.astype(float)
    k0f = dev.cube_k0[dtype]
    ksteps = np.array([_slice_fractals(int(c), k0, k1, k0f) for c in sizes], dtype=float)[g]
    cube = np.ceil(pf / 16) * np.ceil(qf / 16) * ksteps
    loads = np.maximum(np.ceil(pf / 16) * np.ceil(qf / 16) * np.ceil(rf / k0f), (pf + qf) * rf * isz / rates["GM->L1"])
    ncores, core = _deal(loads.tolist(), dev.cube_cores)
    by_core = core.argsort(kind="stable")
    per = np.bincount(core, minlength=ncores)
    first = per.cumsum() - per
    step = np.empty(len(arr), dtype=np.int64)
    step[by_core] = np.arange(len(arr)) - first.repeat(per)
    a_b, b_b = pf * rf * isz, qf * rf * isz
    # L2: the outer block's operand hits for every inner block after the first; the inner operand hits after
    # the first outer block when the group's rows of it, two outer blocks and the output tiles between fit
    if P <= Q:
        foot = rf * P * isz + ceil_div(P, m0) * m0 * n0 * osz + 2 * rf * n0 * isz
        a_hit, b_hit = (ni > 0) & (foot <= dev.l2_bytes), mi > 0
    else:
        foot = rf * Q * isz + ceil_div(Q, n0) * m0 * n0 * osz + 2 * rf * m0 * isz
        a_hit, b_hit = ni > 0, (mi > 0) & (foot <= dev.l2_bytes)
    A_miss, B_miss = a_b * ~a_hit, b_b * ~b_hit
    hit, miss = a_b * a_hit + b_b * b_hit, A_miss + B_miss
    # the cores of a step share the bandwidth as processors share one: an item's transfer ends after its own
    # bytes and, of every other item of its step, as many bytes as it has (a small item finishes early)
    out_b = pf * qf * osz
    # HBM: the step's misses and its tiles' write-outs share it (one port per core for both directions)
    steps = _steps(step)
    in_l2, in_hbm, w_hbm, miss_hbm = _sharing(steps, (hit + miss, hit), (miss + out_b, None), (out_b, None),
                                              (miss, None))
    port_in = in_l2 / L2bw + in_hbm / HBMbw
    mte2 = np.maximum((a_b + b_b) / rates["GM->L1"], port_in)
    mte1 = rf * isz * (np.ceil(pf / 16) * 16 / rates["L1->L0A"] + np.ceil(qf / 16) * 16 / rates["L1->L0B"])
    w_share = w_hbm / HBMbw
    fix, mte3 = write_out(dev, out_b, pf * qf * 4, w_share)
    nch = np.ceil(rf / k1)
    nsl = np.array([sum(ceil_div(min(k1, c - s), k0) for s in range(0, c, k1)) for c in sizes], dtype=float)[g]
    instr = 2 * nch + 3 * nsl + 3
    port = port_in
    nc = 2 if 2 * m0 * n0 * 4 <= dev.buffers["L0C"] else 1
    # one L0C accumulator: the next tile's products wait for this one's write-out
    cube_fix = cube + fix if nc == 1 else cube
    unit = np.maximum.reduce([mte2, cube_fix, mte1, fix, mte3, port, instr * sc])
    per_core = np.bincount(core, unit, ncores)
    fill = (pf[0] + qf[0]) * min(k1, int(r[0])) * isz / rates["GM->L1"] + (pf[0] + qf[0]) * min(k0, int(r[0])) \
        * isz / 256
    last = by_core[first + per - 1]
    # the last tile's write-out overlaps nothing: its products, then its store
    reads = in_l2[last] / L2bw + miss_hbm[last] / HBMbw
    drain = np.maximum.reduce([(a_b + b_b)[last] / rates["GM->L1"], reads, cube[last], mte1[last],
                               instr[last] * sc]) + fix[last] + mte3[last] \
        - unit[last]
    zero_t = 0.0
    if nzero:
        nv = min(2 * dev.cube_cores if split else ncores, nzero)
        zero_t = ceil_div(nzero, nv) * zb / rates["UB->GM"] + (m0 * n0 * osz) / 256
    core_t = (max(float((per_core + drain).max()), zero_t) if split else float((per_core + drain).max()) + zero_t) \
        + fill + pro
    hbm = float(A_miss.sum() + B_miss.sum() + out_b.sum()) + E * 4 + z_bytes
    nbytes = {"GM->L1": float(a_b.sum() + b_b.sum()) + E * 4 * ncores,
              "L1->L0A": float((np.ceil(pf / 16) * 16 * rf * isz).sum()),
              "L1->L0B": float((np.ceil(qf / 16) * 16 * rf * isz).sum()),
              "L0C->GM" if split else "UB->GM": float(out_b.sum())}
    if not split:
        nbytes["L0C->UB"] = float((pf * qf * 4).sum())
    if z_bytes:
        nbytes["UB->GM"] = nbytes.get("UB->GM", 0.0) + z_bytes
    busy = busiest_core(core, ncores, mte2=mte2, cube=cube, mte1=mte1, fixpipe=fix, mte3=mte3)
    return core_t, hbm, nbytes, busy, ncores


def _steps(step):
    """The items grouped by step for :func:`_sharing`: (order, row, column, shape) of a zero-padded matrix
    whose rows are the steps."""
    order = step.argsort(kind="stable")
    starts = np.r_[True, np.diff(step[order]) != 0].nonzero()[0]
    counts = np.diff(np.r_[starts, len(step)])
    row = np.arange(len(starts)).repeat(counts)
    return order, row, np.arange(len(step)) - starts.repeat(counts), (len(starts), int(counts.max()))


def _sharing(steps, *pairs):
    """Per pair ``(nbytes, shared)`` and item: the bytes of ``shared`` (``None``: ``nbytes``) the items of its
    step move until it has moved its own ``nbytes``, ``Σ_j min(s_j, b_i)`` (processor sharing; 0 for an item
    moving nothing). ``steps``: the items' layout by step (:func:`_steps`); a padding entry adds
    ``min(0, b) = 0``, so every step is summed at once, and every pair too (one list of arrays back)."""
    order, row, col, shape = steps
    k = len(pairs)
    b, sh = np.zeros((k,) + shape), np.zeros((k,) + shape)
    nb = np.stack([nbytes[order] for nbytes, _ in pairs])
    b[:, row, col] = nb
    sh[:, row, col] = np.stack([(n if s is None else s)[order] for n, s in pairs])
    within = np.minimum(sh[:, :, None, :], b[:, :, :, None]).sum(axis=3)
    out = np.empty((k, len(order)))
    out[:, order] = within[:, row, col] * (nb > 0)
    return list(out)


def _dims(lhs, rhs):
    (M, P), dtype = lhs
    (M2, Q), _ = rhs
    if M2 != M:
        raise ValueError(f"grouped_matmul_weight_grad: lhs has {M} rows, rhs {M2}")
    return M, P, Q, dtype


@cached
def _search(device, M, P, Q, E, dtype, out_dtype, sizes):
    dev = get_device(device)
    nonempty = [c for c in sizes if c] or [0]
    zeros = 0 in sizes
    default = kernel_default(dev, dtype, out_dtype, P, Q, sum(sizes) // max(E, 1), zeros)
    cands = [default]
    for m0, n0, k0 in ((256, 256, 64), (128, 256, 64), (128, 128, 64), (128, 128, 128), (64, 256, 128),
                       (64, 128, 64)):
        k0e = min(k0, round_up(max(max(nonempty), 1), 16))
        t = {"m0": min(m0, round_up(P, 16)), "n0": min(n0, round_up(Q, 16)), "k0": k0e, "k1": 2 * k0e}
        if t not in cands and fits(dev, dtype, out_dtype, t, zeros):
            cands.append(t)
    best = None
    for t in cands:
        tiles = ceil_div(P, t["m0"]) * ceil_div(Q, t["n0"])
        near_tie = best is not None and tiles > best[3] and best[3] * len(nonempty) < 4 * dev.cube_cores
        if best is not None:
            # a tiling whose lower bound reaches the best cost (past the near-tie band when it could win a near
            # tie) cannot be taken; the margin covers the float rounding of the two sums (~1e-16 per term)
            low = _lower_bound(dev, P, Q, dtype, sizes, t) * (1 - 1e-9)
            if low > best[0] * 1.01 or (not near_tie and low >= best[0]):
                continue
        res = _model(dev, M, P, Q, E, dtype, out_dtype, list(sizes), t)
        cost = kernel_cycles(dev, *res[:3])
        # near ties (a launch at its HBM floor prices every tiling alike): with few waves of tiles, more tiles
        # even out the cores' loads (the last wave's idle cores)
        if best is None or cost < best[0] * (0.97 if t is default else 1.0) or (cost <= best[0] * 1.01 and near_tie):
            best = (cost, t, res, tiles)
    return best[1], best[2]


def _lower_bound(dev, P, Q, dtype, sizes, t):
    """A lower bound on a tiling's modelled kernel time (:func:`_model`), from the tile shapes alone: every
    tile lasts at least its Cube work and its MTE2 load, and so does the last one of a core (its drain), so
    the busiest core at least the mean over the cores used. Tiles come in few shapes per group (full or
    edge row block by full or edge column block): summed by shape."""
    m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
    k0f, isz, rate = dev.cube_k0[dtype], itemsize(dtype), dev.rates["GM->L1"]
    ps = [(m, k) for m, k in ((m0, P // m0), (P % m0, 1 if P % m0 else 0)) if k]
    qs = [(n, k) for n, k in ((n0, Q // n0), (Q % n0, 1 if Q % n0 else 0)) if k]
    per_group = sum(k for _, k in ps) * sum(k for _, k in qs)
    count = per_group * sum(1 for c in sizes if c)
    if not count:
        return 0.0
    total, ksteps = 0.0, {}
    for c in sizes:
        if c:
            if c not in ksteps:
                ksteps[c] = _slice_fractals(c, k0, k1, k0f)
            total += sum(kp * kq * max(ceil_div(p, 16) * ceil_div(q, 16) * ksteps[c], (p + q) * c * isz / rate)
                         for p, kp in ps for q, kq in qs)
    return total / min(dev.cube_cores, count)


def _roofline(dev, specs, out_dtype=None, **_):
    M, P, Q, dtype = _dims(specs[0], specs[1])
    E = specs[2][0][0]
    io = M * (P + Q) * itemsize(dtype) + E * P * Q * itemsize(out_dtype or dtype)
    return max(2.0 * M * P * Q / (2.0 * dev.cube_macs[dtype] * dev.cube_cores), io / dev.hbm_bytes_per_cycle)


@register("grouped_matmul_weight_grad", _roofline)
def estimate_grouped_matmul_weight_grad(dev, specs, group_list_type="count", out_dtype=None, group_sizes=None,
                                        tiling=None):
    M, P, Q, dtype = _dims(specs[0], specs[1])
    E = specs[2][0][0]
    out_dtype = out_dtype or dtype
    sizes = tuple(_sizes(E, M, group_sizes))
    if tiling:
        t = {k: int(tiling[k]) for k in ("m0", "n0", "k0", "k1")}
        res = _model(dev, M, P, Q, E, dtype, out_dtype, list(sizes), t)
    else:
        t, res = _search(dev.name, M, P, Q, E, dtype, out_dtype, sizes)
    core, hbm, nbytes, busy, _ = res
    return make("grouped_matmul_weight_grad", dev, core, hbm, nbytes, busy, dict(t),
                _roofline(dev, specs, out_dtype=out_dtype), 2.0 * sum(sizes) * P * Q)


@register("matmul_per_group_weight_grad", _roofline)
def estimate_matmul_per_group_weight_grad(dev, specs, group_list_type="cumsum", group_sizes=None, tiling=None):
    M, P, Q, dtype = _dims(specs[0], specs[1])
    E = specs[2][0][0]
    sizes = _sizes(E, M, group_sizes)
    return per_group_launches(dev, "matmul_per_group_weight_grad", sizes, lambda c: (((c, P), dtype), ((c, Q), dtype)),
                              tiling, _roofline(dev, specs), 2.0 * sum(sizes) * P * Q, trans_a=True)


__all__ = ["estimate_grouped_matmul_weight_grad", "estimate_matmul_per_group_weight_grad"]
