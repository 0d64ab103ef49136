"""Grouped GEMM (``autofuse/npu/kernels/grouped_matmul.py``): ``grouped_matmul`` and ``matmul_per_group``.

Group sizes: the model needs the rows of each group. ``group_sizes=(m_0, ..., m_{E-1})`` gives them (the
simulator reads them from the group list); without it the rows are taken as spread evenly over the E
groups, which is all a plan made from shapes knows.

*grouped_matmul*: the kernel's items (group, column block, row block; row blocks innermost) and its deal
by load are replayed. Per item, on its core: MTE2 loads A (``m·K``) and B (``nb·n·K``, nb = 2 with SwiGLU)
through the GM port; MTE1 moves them to L0A/L0B; the Cube does ``ceil(m/16)·ceil(nb·n/16)·ceil(K/k0)``
fractals; the tile leaves by FixPipe (+ the Vector epilogue and MTE3). A block read before hits L2 (B by
the previous row block at once; A of a row block by the cores reading it in the same step, the first one's
miss filling the line for the others, or, a step later, when the group's other A blocks, two B blocks and
the output tiles in between fit the L2), else it comes from HBM; the cores of one lockstep step share the
bandwidth as the simulator shares it (the step's hit bytes over the L2 bandwidth, its missed bytes over
the HBM bandwidth); the AIC's port carries its loads and its stores (the output, or the fp32 workspace on
split cores with an epilogue). The epilogue's fp32 product tiles are double-buffered where UB holds two
sets: the next tile's product comes in (L0C->UB, or the AIV's workspace load) while the Vector unit runs
this one's; with one set the two wait for each other. An item lasts as long as its busiest unit; a core's time is the sum of its items plus
the first chunk's load (fill) and the last tile's write-out (drain). On split cores the epilogue runs on
the AIV pair (the fp32 tile through an L2 workspace), overlapped with the next tile's products. ``return_product=True``: the epilogue also casts the fp32 product
tile(s) (one Vector pass each) and MTE3 stores them (``nb·m·n`` elements of the output dtype per item) after the
output tile, through the same port: more MTE3 bytes, more HBM writes in the step, the drain longer.

*matmul_per_group*: the ``matmul`` model (its tiling search) for each non-empty group's rows, one launch
each, summed; the tiling per row count goes to the kernel as ``{"by_rows": {rows: tiling}}``.
"""
from __future__ import annotations

import heapq

import numpy as np

from cost_model.common import ceil_div, itemsize, round_up
from cost_model.devices import get_device
from cost_model.estimate import cached, estimate, kernel_cycles, make, register
from cost_model.grouped_matmul_tiling import GLU, default_tiling as kernel_default, product_sets, tiling_fits as fits
from cost_model.matmul import choose_tiling, write_out

# fp32 Vector passes per element of each epilogue (the elementwise kernel's op passes: silu 4, gelu 25,
# gelu_tanh 8, relu 1, sigmoid 4; swiglu = silu + the product; clamped_swiglu = GPT-OSS's: mins, maxs + mins,
# muls alpha, sigmoid, mul, adds 1, mul)
EPILOGUE_PASSES = {None: 0, "relu": 1, "silu": 4, "gelu": 25, "gelu_tanh": 8, "swiglu": 5, "clamped_swiglu": 11}
#: per output element, gathering interleaved gate/up pairs apart (even and odd columns) in the epilogue
DEINTERLEAVE_PASSES = 2


def epilogue_passes(activation, order="gate_up"):
    return EPILOGUE_PASSES[activation] + (DEINTERLEAVE_PASSES if activation in GLU and order == "interleaved" else 0)


def _sizes(E, M, group_sizes):
    if group_sizes is not None:
        gs = [int(v) for v in group_sizes]
        if len(gs) != E or sum(gs) > M or min(gs, default=0) < 0:
            raise ValueError(f"grouped_matmul: group_sizes {gs[:16]} do not fit {E} groups of {M} rows")
        return gs
    return [M // E + (1 if g < M % E else 0) for g in range(E)]


def _items(sizes, N_out, m0, n0):
    """The work items as columns (group, rows, cols, row block, col block, the group's row blocks), one entry
    per item, in the kernel's order: group by group, column block by column block, row block by row block.
    Built by repeats (no per-group arrays, no integer division): each (group, column block) pair spreads
    over its group's row blocks."""
    nn = ceil_div(N_out, n0)
    c = np.asarray(sizes, dtype=np.int64)
    nm = -(-c // m0)                                        # row blocks per group (0 for an empty group)
    pg = np.arange(len(c), dtype=np.int64).repeat(nn)   # the (group, column block) pairs
    pn = np.arange(nn * len(c), dtype=np.int64) % nn
    cnt = nm[pg]
    g, ni, nmg = pg.repeat(cnt), pn.repeat(cnt), cnt.repeat(cnt)
    mi = np.arange(len(g), dtype=np.int64) - (cnt.cumsum() - cnt).repeat(cnt)
    return g, np.minimum(m0, c[g] - mi * m0), np.minimum(n0, N_out - ni * n0), mi, ni, nmg


def _deal(loads, ncores):
    """Items to the least-loaded core, in order (the kernel's dealer): (cores used, core of each item)."""
    n = min(ncores, len(loads))
    if len(set(loads)) <= 1:              # equal loads: the least-loaded core (ties: the lowest) goes round
        return n, np.arange(len(loads), dtype=np.int64) % max(n, 1)
    heap = [(0.0, c) for c in range(n)]
    core = []
    for ld in loads:
        load, c = heap[0]                 # the least-loaded core (loads and cores are unique pairs)
        core.append(c)
        heapq.heapreplace(heap, (load + ld, c))
    return n, np.array(core, dtype=np.int64)


def _model(dev, M, K, N, E, dtype, out_dtype, activation, bias, sizes, t, product=False, order="gate_up"):
    isz, osz = itemsize(dtype), itemsize(out_dtype)
    nb = 2 if activation in GLU else 1
    N_out = N // nb
    m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
    split = dev.arch == "split"
    sets = product_sets(dev, m0, n0, out_dtype, activation, product) if activation is not None else 1
    rates = dev.rates
    L2bw, HBMbw = dev.l2_bytes_per_cycle, dev.hbm_bytes_per_cycle
    g, mc, nc, mi, ni, nm = _items(sizes, N_out, m0, n0)
    L = len(g)
    sc = dev.scalar_issue_cycles
    pro = E * 4 / rates["GM->L1"] + E * sc
    if not L:
        return pro, float(E * 4), {"GM->L1": float(E * 4)}, {"scalar": E * sc}, 1
    m, n = mc.astype(float), nc.astype(float)
    k0f = dev.cube_k0[dtype]
    cube = np.ceil(m / 16) * nb * np.ceil(n / 16) * ceil_div(K, k0f)
    loads = np.maximum(cube, (m + nb * n) * K * isz / rates["GM->L1"])
    # equal loads deal round (item i on core i % P at step i // P, no list to walk)
    round_robin = bool(loads.min() == loads.max())
    P, core = (min(dev.cube_cores, L), None) if round_robin else _deal(loads.tolist(), dev.cube_cores)
    idx = np.arange(L, dtype=np.int64)
    # the lockstep step of each item: its position in its core's list
    if round_robin:
        S = -(-L // P)
        core = np.arange(L, dtype=np.int64) % P
        step = np.arange(S, dtype=np.int64).repeat(P)[:L]
        per = np.full(P, L // P, dtype=np.int64) + (np.arange(P) < L % P)
        last = np.arange(P, dtype=np.int64) + (per - 1) * P          # each core's last item
    else:
        by_core = core.argsort(kind="stable")              # each core's items, in order
        per = np.bincount(core, minlength=P)
        first = per.cumsum() - per
        step = np.empty(L, dtype=np.int64)
        step[by_core] = idx - first.repeat(per)
        last = by_core[first + per - 1]                         # each core's last item
    S = int(per.max())
    a_b = m * K * isz
    b_b = nb * n * K * isz
    # L2: B hits for every row block after the first; A hits after the first column block when the
    # group's A blocks, two B blocks and the output tiles in between fit the L2
    foot = nm * (m0 * K * isz + m0 * n0 * osz) + 2 * nb * n0 * K * isz
    # an A block read in the same step by the cores holding its other column blocks is one read: the first
    # core's miss fills the line for the others (they wait for it)
    if round_robin:
        # the first item of the block's step: the same block sits nm items back per column block, and the
        # step (i // P) starts at the item i - i % P
        a_head = idx - nm * np.minimum(ni, core // nm)
    else:
        a_head = _head(g * (int(mi.max()) + 1) + mi, step)
    a_hit = (a_head != idx) | (ni > 0) & (foot <= dev.l2_bytes)
    a_wait = (a_head != idx) & ~a_hit[a_head]
    b_hit = mi > 0
    # a B block read first by one core is read in the same step by the cores holding its other row blocks
    A_hit = np.bincount(step, a_b * a_hit, S)
    A_miss = np.bincount(step, a_b * ~a_hit, S)
    B_hit = np.bincount(step, b_b * b_hit, S)
    B_miss = np.bincount(step, b_b * ~b_hit, S)
    # per-step times first, then spread over the step's items
    # (byte counts are never negative: a zero count takes 0.0 cycles)
    pa = (A_hit / L2bw)[step] + np.where(~a_hit | a_wait, (A_miss / HBMbw)[step], 0)
    # the item missing a B block is its row block 0, mi items back: in the same step when dealt round and mi <= i % P
    same = (mi <= core) if round_robin else _same_step_miss(g, mi, ni, step)
    pb = (B_hit / L2bw)[step] + np.where(~b_hit | (B_miss > 0)[step] & b_hit & same,
                                                               (B_miss / HBMbw)[step], 0)
    bias_b = nb * n * 4 if bias else 0.0
    # each K chunk loads its A block, then its B block(s), one after the other on MTE2; a transfer holds the unit
    # for its own time or its port time (the step's L2 hits and, when it waits for a miss, the step's HBM bytes),
    # whichever is longer, and its port starts with it (the previous transfer's port ends by its end): the chunk
    # lasts the A transfer's longer time plus the B transfers'
    mte2 = np.maximum(a_b / rates["GM->L1"], pa) + np.maximum((b_b + bias_b) / rates["GM->L1"], pb)
    mte1 = K * isz * (np.ceil(m / 16) * 16 / rates["L1->L0A"] + nb * np.ceil(n / 16) * 16 / rates["L1->L0B"])
    out_b = m * n * osz
    prod_b = nb * m * n * osz if product else np.zeros_like(m)     # the stored product, both halves
    passes = epilogue_passes(activation, order)
    W = np.bincount(step, out_b + prod_b, S)
    w_t = (W / HBMbw)[step]                                 # the step's HBM writes, per item
    if activation is None:
        fix, mte3 = write_out(dev, out_b, m * n * 4, w_t)
        vec = np.zeros_like(m)
        aiv = np.zeros_like(m)
    else:
        rows = np.ceil(m / 2) if split else m
        rep = np.ceil(rows * (np.ceil(n / 8) * 8) / 64)            # fp32 rows padded to 32 B
        vec = rep * (passes + (1 + (nb if product else 0) if out_dtype != "float32" else 0))
        if split:
            ws_b = nb * m * n * 4
            fix = ws_b / rates["L0C->GM"]
            WS = np.bincount(step, ws_b, S)
            ws_t = (WS / L2bw)[step]
            fix = np.maximum(fix, ws_t)
            ld = np.maximum(nb * rows * n * 4 / rates["GM->UB"], ws_t)
            st = np.maximum(rows * n * osz * (1 + (nb if product else 0)) / rates["UB->GM"], w_t)
            # double-buffered product tiles: the next tile's load and this one's store pass the AIV's port while
            # the Vector unit runs; one set: the load waits for the epilogue, and queues behind the store
            aiv = np.maximum(ld + st, vec) if sets == 2 else vec + ld + st
            mte3 = np.zeros_like(m)
        else:
            fix = nb * m * n * 4 / rates["L0C->UB"]
            mte3 = np.maximum((out_b + prod_b) / rates["UB->GM"], w_t)
            aiv = np.zeros_like(m)
    nk1 = ceil_div(K, k1)
    nsl = sum(ceil_div(min(k1, K - c) , k0) for c in range(0, K, k1))
    instr = (2 + nb) * nk1 + (1 + 2 * nb) * nsl + 3 + (nb if bias else 0)
    # the AIC's port carries its loads and its stores: the output tiles, or on split cores with an epilogue the
    # fp32 workspace tiles (the AIV's loads and stores pass its own port)
    port = pa + pb + (ws_t if split and activation is not None else w_t)
    unit = np.maximum(mte2, cube)
    # coupled: the L0C->UB move of the next tile overlaps this one's epilogue when the product tiles are
    # double-buffered, else it waits for it
    epi = fix if split else np.maximum(fix, vec) if sets == 2 else fix + vec
    for u in (mte1, epi, mte3, aiv, port):
        np.maximum(unit, u, out=unit)
    np.maximum(unit, float(instr * sc), out=unit)
    per_core = np.bincount(core, unit, P)
    first_chunk = min(k1, K) / K
    fill = (a_b[0] + b_b[0]) * first_chunk / rates["GM->L1"] + (m[0] + nb * n[0]) * min(k0, K) * isz / 256
    drain = fix[last] + (vec[last] if not split else aiv[last]) + mte3[last]
    core_t = float((per_core + drain).max()) + fill + pro
    hbm = float(A_miss.sum() + B_miss.sum() + W.sum()) + E * 4 + (float(np.sum(nb * n * 4 * (mi == 0))) if bias else 0)
    if split and activation is not None:
        # the fp32 workspace stays dirty in L2 and is written back at the end: one line per distinct region
        # (core, slot parity, rows, columns) as one integer key: a 1-D unique sorts integers, not rows
        mm, nn = m.astype(np.int64), n.astype(np.int64)
        key = np.unique(((core.astype(np.int64) * 2 + step % 2) * (m0 + 1) + mm) * (n0 + 1) + nn)
        hbm += int((nb * (key // (n0 + 1) % (m0 + 1)) * (key % (n0 + 1)) * 4).sum())
    nbytes = {"GM->L1": float(a_b.sum() + b_b.sum() + (bias_b * 1.0 if not bias else np.sum(nb * n * 4))) + E * 4 * P,
              "L1->L0A": float((np.ceil(m / 16) * 16 * K * isz).sum()),
              "L1->L0B": float((nb * np.ceil(n / 16) * 16 * K * isz).sum())}
    if activation is None:
        nbytes["L0C->GM" if split else "UB->GM"] = float(out_b.sum())
        if not split:
            nbytes["L0C->UB"] = float((m * n * 4).sum())
    elif split:
        nbytes["L0C->GM"] = float((nb * m * n * 4).sum())
        nbytes["GM->UB"] = float((nb * m * n * 4).sum())
        nbytes["UB->GM"] = float(out_b.sum() + prod_b.sum())
    else:
        nbytes["L0C->UB"] = float((nb * m * n * 4).sum())
        nbytes["UB->GM"] = float(out_b.sum() + prod_b.sum())
    busy = busiest_core(core, P, mte2=mte2, cube=cube, mte1=mte1, fixpipe=fix, vector=vec, mte3=mte3)
    return core_t, hbm, nbytes, busy, P


def busiest_core(core, ncores, **per_item) -> dict:
    """Per unit: the busiest core's total of the items' times (``per_item[unit]``, one entry per item; ``core``:
    each item's core)."""
    return {unit: float(np.bincount(core, t, ncores).max()) for unit, t in per_item.items()}


def _head(key, step):
    """For each item, the first item (in the kernel's order) of its step that reads the same block ``key``."""
    _, inv = np.unique(key * (int(step.max()) + 1) + step, return_inverse=True)
    inv = inv.reshape(-1)
    first = np.full(int(inv.max()) + 1, len(key), dtype=np.int64)
    np.minimum.at(first, inv, np.arange(len(key)))
    return first[inv]


def _same_step_miss(g, mi, ni, step):
    """Whether an item shares its step with the item that misses its B block (it then waits for it)."""
    key = g * (int(ni.max()) + 1) + ni
    first = np.full(int(key.max()) + 1, -1)
    first[key[mi == 0]] = step[mi == 0]
    return first[key] == step


def _lower_bound(dev, K, N, dtype, activation, sizes, t):
    """A lower bound on a tiling's modelled kernel time, from the item counts alone: every item lasts at least
    its Cube work and its MTE2 load (its deal load), so the busiest core at least the mean load over the cores
    used. Items come in few shapes (full or last row block by full or last column block): summed by shape."""
    nb = 2 if activation in GLU else 1
    N_out = N // nb
    m0, n0 = t["m0"], t["n0"]
    rows, cols = {}, {}
    for c in sizes:
        for m, k in ((m0, c // m0), (c % m0, 1 if c % m0 else 0)):
            if k:
                rows[m] = rows.get(m, 0) + k
    for n, k in ((n0, N_out // n0), (N_out % n0, 1 if N_out % n0 else 0)):
        if k:
            cols[n] = k
    count = sum(rows.values()) * sum(cols.values())
    if not count:
        return 0.0
    kk, isz, rate = ceil_div(K, dev.cube_k0[dtype]), itemsize(dtype), dev.rates["GM->L1"]
    total = sum(km * kn * max(ceil_div(m, 16) * nb * ceil_div(n, 16) * kk, (m + nb * n) * K * isz / rate)
                for m, km in rows.items() for n, kn in cols.items())
    return total / min(dev.cube_cores, count)


def _dims(x, w, trans_w, activation):
    (M, K), dtype = x
    (E, a, b), _ = w
    N = a if trans_w else b
    Kw = b if trans_w else a
    if Kw != K:
        raise ValueError(f"grouped_matmul: x has K={K}, weight {[E, a, b]} has K={Kw}")
    return M, K, N, E, dtype


@cached
def _search(device, M, K, N, E, dtype, out_dtype, activation, bias, sizes, product=False, order="gate_up"):
    dev = get_device(device)
    nb = 2 if activation in GLU else 1
    default = kernel_default(dev, dtype, out_dtype, K, N // nb, activation, bias, product)
    # and row blocks for short groups, column blocks for narrow outputs; 256-row blocks (L0C single-buffered
    # when it has no room for two) for long groups, which read each weight column block half as often
    cands = [default]
    shapes = [(m0, n0) for m0 in (64, 16) for n0 in (256, 64)]
    if max(sizes, default=0) > 128:
        shapes += [(256, 256), (256, 128), (128, 128)]
    for m0, n0 in shapes:
        for k0 in ((128, 64) if m0 == 256 else (128,)):
            t = {"m0": m0, "n0": min(n0, round_up(N // nb, 16)), "k0": min(k0, round_up(K, 16))}
            t["k1"] = min(2 * t["k0"], round_up(K, t["k0"]))
            if t not in cands and fits(dev, dtype, out_dtype, t, activation, bias, product):
                cands.append(t)
    best = None
    for t in cands:
        # a tiling whose lower bound already reaches the best cost cannot win (it must beat it strictly);
        # the margin covers the float rounding of the two sums (relative ~1e-16 per term)
        if best is not None and _lower_bound(dev, K, N, dtype, activation, sizes, t) * (1 - 1e-9) >= best[0]:
            continue
        res = _model(dev, M, K, N, E, dtype, out_dtype, activation, bias, list(sizes), t, product, order)
        cost = kernel_cycles(dev, *res[:3])
        if best is None or cost < best[0] * (0.97 if t is default else 1.0):
            best = (cost, t, res)
    return best[1], best[2]


def _roofline(dev, specs, bias=None, trans_w=False, activation=None, out_dtype=None, return_product=False, **_):
    M, K, N, E, dtype = _dims(specs[0], specs[1], trans_w, activation)
    nb = 2 if activation in GLU else 1
    out_n = N // nb + (N if return_product and activation else 0)
    io = (M * K + E * K * N) * itemsize(dtype) + M * out_n * itemsize(out_dtype or dtype)
    return max(2.0 * M * N * K / (2.0 * dev.cube_macs[dtype] * dev.cube_cores), io / dev.hbm_bytes_per_cycle)


@register("grouped_matmul", _roofline)
def estimate_grouped_matmul(dev, specs, bias=None, trans_w=False, group_list_type="count", activation=None,
                            swiglu_order="gate_up", out_dtype=None, group_sizes=None, tiling=None,
                            return_product=False, limit=None, alpha=1.0):
    """``limit`` and ``alpha`` (clamped_swiglu's) change values only; ``swiglu_order="interleaved"`` adds the
    epilogue's gather of the pairs."""
    M, K, N, E, dtype = _dims(specs[0], specs[1], trans_w, activation)
    order = swiglu_order if activation in GLU else "gate_up"
    if return_product and activation is None:
        raise ValueError("grouped_matmul: return_product needs an activation (without one the output is the product)")
    product = bool(return_product)
    bias = specs[3] if len(specs) > 3 and specs[3] is not None else bias
    out_dtype = out_dtype or dtype
    sizes = tuple(_sizes(E, M, group_sizes))
    if tiling:
        t = {k: int(tiling[k]) for k in ("m0", "n0", "k0", "k1")}
        res = _model(dev, M, K, N, E, dtype, out_dtype, activation, bias is not None, list(sizes), t, product, order)
    else:
        t, res = _search(dev.name, M, K, N, E, dtype, out_dtype, activation, bias is not None, sizes, product, order)
    core, hbm, nbytes, busy, _ = res
    return make("grouped_matmul", dev, core, hbm, nbytes, busy, dict(t), _roofline(dev, specs, trans_w=trans_w,
                activation=activation, out_dtype=out_dtype, return_product=product), 2.0 * sum(sizes) * N * K)


def per_group_launches(dev, kernel, sizes, operands, tiling, roof, flops, **params):
    """One ``matmul`` launch per non-empty group, summed (their launch overheads included): ``operands(rows)``
    gives a group's two operand specs, ``params`` the matmul's; the tiling per row count, as the kernel takes
    it (``{"by_rows": {rows: tiling}}``)."""
    body = hbm = 0.0
    nbytes, busy, by_rows = {}, {}, {}
    for c in sizes:
        if c == 0:
            continue
        tl = (tiling or {}).get("by_rows", {}).get(c) if tiling else None
        e = estimate("matmul", list(operands(c)), device=dev.name, tiling=tl, **params)
        by_rows[c] = e.tiling if tl is None else tl
        body += e.cycles
        hbm += e.hbm_bytes
        for k, v in e.bytes.items():
            nbytes[k] = nbytes.get(k, 0) + v
        for k, v in e.busy.items():
            busy[k] = busy.get(k, 0) + v
    # make() adds one launch overhead; every launch's own is in its cycles
    return make(kernel, dev, max(0.0, body - dev.launch_cycles), hbm, nbytes, busy, {"by_rows": by_rows}, roof,
                flops)


@register("matmul_per_group", _roofline)
def estimate_matmul_per_group(dev, specs, trans_w=False, group_list_type="cumsum", group_sizes=None, tiling=None):
    M, K, N, E, dtype = _dims(specs[0], specs[1], trans_w, None)
    sizes = _sizes(E, M, group_sizes)
    w = (((N, K) if trans_w else (K, N)), dtype)
    return per_group_launches(dev, "matmul_per_group", sizes, lambda c: (((c, K), dtype), w), tiling,
                              _roofline(dev, specs, trans_w=trans_w), 2.0 * sum(sizes) * N * K, trans_b=trans_w)


__all__ = ["estimate_grouped_matmul", "estimate_matmul_per_group", "per_group_launches", "busiest_core", "EPILOGUE_PASSES",
           "choose_tiling"]
