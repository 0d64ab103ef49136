"""Cube matmul (``autofuse/npu/kernels/matmul.py``): closed-form schedule, L2 reuse, tiling search.

The kernel hands base tiles ``m0 × n0`` of the output round-robin to the cores in lockstep; each step
streams K in chunks of ``k1`` (GM→L1, double-buffered) and slices of ``k0`` (L1→L0A/L0B, double-buffered)
into the Cube, then writes the tile out (coupled: FixPipe L0C→UB, MTE3 UB→GM; split: FixPipe L0C→GM).

The model, per *step* (one lockstep wave of tiles over the cores), on the busiest core:

* MTE2 and the GM port: every load of a wave costs the wave's L2-hit bytes over the L2 bandwidth plus its
  missed bytes over the HBM bandwidth (how the simulator shares the chip's bandwidth among the cores of
  one lockstep instruction), and at least the bytes over the MTE2 rate. Whether a block of A (a row block)
  or of B (a column block) hits is decided by its LRU stack distance: a block re-read ``Δ`` steps after its
  last read is still in L2 when the distinct bytes of those ``Δ`` steps (A and B blocks, and the output
  tiles, which are written through L2) fit the L2; re-reads within the same step always hit.
* Cube: ``ceil(m/16)·ceil(k/k0)·ceil(n/16)`` fractals; MTE1: bytes over the L1→L0A/L0B rates; FixPipe and
  MTE3 for the write-out, whose HBM write-through also occupies the port.
* A step lasts as long as its busiest unit (the units overlap through double buffering); the launch adds a
  fill (the first K chunk's loads and first L0 moves) and a drain (the last tile's write-out).

The steps are evaluated as numpy arrays over the work items (no loop over instructions).
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.devices import DEVICES, ITEMSIZE, get_device
from cost_model.common import asum, ceil_div, itemsize, pack, round_up
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.vecutil import largest

CUBE_DTYPES = ("float16", "bfloat16", "float32")
# the model's typical error on small matmuls: a searched tiling must beat the kernel default by more
DEFAULT_MARGIN = 0.05


# ------------------------------------------------------------------------------------------ shapes
def _dims(a, b, trans_a, trans_b):
    (sa, dta), (sb, dtb) = a, b
    if len(sa) < 2 or len(sb) < 2:
        raise ValueError(f"matmul: operands need 2+ dims, got {list(sa)} and {list(sb)}")
    if dta != dtb or dta not in CUBE_DTYPES:
        raise TypeError(f"matmul: operands {dta} and {dtb}; the Cube takes two equal of {CUBE_DTYPES}")
    M = sa[-1] if trans_a else sa[-2]
    K = sa[-2] if trans_a else sa[-1]
    Kb = sb[-1] if trans_b else sb[-2]
    N = sb[-2] if trans_b else sb[-1]
    if K != Kb:
        raise ValueError(f"matmul: inner dims differ: {list(sa)} and {list(sb)}")
    batch = tuple(np.broadcast_shapes(tuple(sa[:-2]), tuple(sb[:-2])))
    fold = len(sb) == 2 and len(sa) > 2 and not trans_a
    if fold:
        return M * math.prod(sa[:-2]), N, K, 1, True, True, batch, M
    nb = math.prod(batch)
    return M, N, K, nb, math.prod(sa[:-2]) > 1, math.prod(sb[:-2]) > 1, batch, M


# ------------------------------------------------------------------------------------------ tiling
def fits(dev, dtype: str, out_dtype: str, t: dict, bias: bool = False, a1_elems=None) -> bool:
    """Whether tiling ``t`` (m0, n0, k0, k1) passes the kernel's check and its aligned allocations. ``a1_elems``:
    the elements of one L1 buffer of A when it is not an ``m0 × k1`` block (a convolution's input band; then
    ``k1`` need not be a multiple of ``k0``)."""
    isz, osz = ITEMSIZE[dtype], ITEMSIZE[out_dtype]
    m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
    buf = dev.buffers
    if m0 < 1 or n0 < 1 or k0 < 1 or k1 < 1 or (k1 % k0 and a1_elems is None):
        return False
    a1 = m0 * k1 if a1_elems is None else a1_elems
    l0c = buf["L0C"]
    nc = 2 if 2 * m0 * n0 * 4 <= l0c else 1
    if not (2 * (a1 + k1 * n0) * isz + n0 * 4 <= buf["L1"] - 64
            and 2 * m0 * k0 * isz <= buf["L0A"] and 2 * k0 * n0 * isz <= buf["L0B"]
            and nc * m0 * n0 * 4 <= l0c
            and (dev.arch == "split" or 2 * m0 * n0 * osz <= buf["UB"])):
        return False
    if not (m0 % 16 or n0 % 16 or k0 % 16 or (a1 * isz) % 32 or (k1 * n0 * isz) % 32):
        return True          # every tile is then a whole number of aligned blocks: the sums above decide
    allocs = [("L1", a1 * isz)] * 2 + [("L1", k1 * n0 * isz)] * 2
    allocs += [("L1", n0 * 4)] if bias else []
    allocs += [("L0A", m0 * k0 * isz)] * 2 + [("L0B", k0 * n0 * isz)] * 2 + [("L0C", m0 * n0 * 4)] * nc
    if dev.arch == "coupled":
        allocs += [("UB", m0 * n0 * osz)] * 2
    return pack(dev, allocs)


def _candidates(dev, Mr, N, K, dtype, out_dtype, bias):
    """Tilings to search: power-of-two tiles and tiles that cover M or N in 1–4 even blocks (those that fit)."""
    return [t for t in _tiles(dev, Mr, N, K, dtype) if fits(dev, dtype, out_dtype, t, bias)]


def _tiles(dev, Mr, N, K, dtype):
    """:func:`_candidates` before their fit is checked, in the same order."""
    def sizes(X):
        X16 = round_up(X, 16)
        s = {min(v, X16) for v in (16, 32, 64, 128, 256)}
        for j in (1, 2, 3, 4):
            x = round_up(ceil_div(X, j), 16)
            if x <= 256:
                s.add(x)
        return sorted(s)
    isz = itemsize(dtype)
    out, seen = [], set()
    ms, ns = sizes(Mr), sizes(N)

    def widest(X, buf):
        """The widest k0 whose two [X, k0] tiles fit ``buf`` (None if none): the fit shrinks with k0."""
        return next((k for k in (256, 128, 64, 32, 16) if 2 * X * k * isz <= dev.buffers[buf]), None)
    ka, kb = {m0: widest(m0, "L0A") for m0 in ms}, {n0: widest(n0, "L0B") for n0 in ns}
    K16 = round_up(K, 16)
    for m0 in ms:
        for n0 in ns:
            # the widest k0 both L0 tiles take
            k0 = 16 if ka[m0] is None or kb[n0] is None else min(ka[m0], kb[n0])
            k0 = min(k0, K16)
            Kk = round_up(K, k0)
            for mult in (2, 4):
                k1 = min(mult * k0, Kk)
                if (m0, n0, k0, k1) in seen:      # (tried: whether it fits does not change)
                    continue
                seen.add((m0, n0, k0, k1))
                out.append({"m0": m0, "n0": n0, "k0": k0, "k1": k1})
    return out


def kernel_default(dev, M, N, K, batch, dtype, out_dtype):
    """The kernel's own default tiling (``default_tiling`` in the kernel, mirrored): always priced too. A fresh
    dict (or None)."""
    if DEVICES.get(dev.name) is not dev:      # a device made for one kernel (MC2's halved UB): not cached
        return _kernel_default(dev, M, N, K, batch, dtype, out_dtype)
    t = _default_cached(dev.name, M, N, K, batch, dtype, out_dtype)
    return None if t is None else dict(t)


@cached
def _default_cached(device, M, N, K, batch, dtype, out_dtype):
    """:func:`kernel_default` of a registered device: the matmul, conv and epilogue searches each ask for the
    default of the same GEMMs."""
    return _kernel_default(get_device(device), M, N, K, batch, dtype, out_dtype)


def _kernel_default(dev, M, N, K, batch, dtype, out_dtype):
    isz = itemsize(dtype)
    k0f = dev.cube_k0[dtype]
    best, seen = None, set()
    M16, N16, K16 = round_up(M, 16), round_up(N, 16), round_up(K, 16)
    l0a, l0b = dev.buffers["L0A"], dev.buffers["L0B"]
    cores, gm, kfr = dev.cube_cores, dev.rates["GM->L1"], ceil_div(K, k0f)
    for m0 in (256, 128, 64, 32, 16):
        for n0 in (256, 128, 64, 32, 16):
            m0e, n0e = min(m0, M16), min(n0, N16)
            if (m0e, n0e) in seen:                # (tried: whether it fits does not change)
                continue
            seen.add((m0e, n0e))
            k0 = 16
            for k in (128, 64, 32, 16):
                if 2 * m0e * k * isz <= l0a and 2 * k * n0e * isz <= l0b:
                    k0 = k
                    break
            k0 = min(k0, K16)
            waves = -(-(batch * -(-M // m0e) * -(-N // n0e)) // cores)          # ceil_div, written out
            score = waves * max((m0e // 16) * (n0e // 16) * kfr, (m0e + n0e) * K * isz / gm)
            if best is not None and not score < best[0]:
                continue                      # it could not replace the best: its fit need not be checked
            t = {"m0": m0e, "n0": n0e, "k0": k0, "k1": min(2 * k0, round_up(K, k0))}
            if fits(dev, dtype, out_dtype, t):
                best = (score, t)
    return None if best is None else best[1]


def _quick_score(dev, Mr, N, K, nbatch, dtype):
    """Cheap ranking of a tiling (the key function of one search): waves × the slower of Cube and GM
    traffic per wave."""
    isz = itemsize(dtype)
    cores, gm, l2, hbm = dev.cube_cores, dev.rates["GM->L1"], dev.l2_bytes_per_cycle, dev.hbm_bytes_per_cycle
    kfr = ceil_div(K, dev.cube_k0[dtype])
    row = K * isz

    def score(t):
        m0, n0 = t["m0"], t["n0"]
        nn = -(-N // n0)
        items = nbatch * -(-Mr // m0) * nn
        P = min(cores, items)
        waves = -(-items // P)
        cube = -(-m0 // 16) * -(-n0 // 16) * kfr
        per_core = (m0 + n0) * row
        # roughly: unique bytes of a wave come from HBM, the rest from L2
        uniq = (min(P, nn) * n0 + -(-P // nn) * m0) * row
        port = max(per_core / gm, (P * per_core - uniq) / l2 + uniq / hbm)
        return waves * max(cube, port) + (m0 + n0) * t["k1"] * isz / gm
    return score


# ------------------------------------------------------------------------------------------ the model
def _footprint(steps, P, I, nn, nm, nbatch, a_batched, b_batched, Ablk, Bblk, Cblk):
    """Distinct bytes (A row blocks, B column blocks, output tiles) touched by ``steps`` waves (a count: it
    never decreases as ``steps`` grows)."""
    w = min(steps * P, I)
    da = min(ceil_div(w - 1, nn) + 1, nbatch * nm if a_batched else nm)
    spanned = min(ceil_div(w - 1, nm * nn) + 1, nbatch)
    db = min(w, nn * (spanned if b_batched else 1))
    return da * Ablk + db * Bblk + w * Cblk


def _boundary_stall(coupled, nc, chunks, c, m, cube, la, lb, pa, pb, fix, pw_prev):
    """Cube stall at the start of each step while the previous step's store holds the GM port.

    ``chunks``: per K chunk (load fraction, cube fraction, slices). Time 0 is the end of the previous
    step's last product. The store holds the port over ``[t0, t1]``; chunk ``j``'s loads start once the L1
    buffer they reuse is released (the last L0 move of the chunk that used it before) and take the port
    before the store as far as they fit there, the rest after it (the simulator's port never idles while a
    transfer waits); the Cube is late by however late they arrive.
    """
    nk1 = len(chunks)
    fix_prev = np.concatenate([[0.0], fix[:-1]])
    t0 = fix_prev if coupled else np.zeros_like(cube)     # coupled: MTE3 stores after the L0C->UB copy
    t1 = t0 + pw_prev
    base = fix_prev if nc == 1 else 0.0                   # one L0C tile: the Cube waits for the copy
    C = {}                                                # the Cube time of chunk kk (those used below)

    def cube_of(kk):
        if kk not in C:
            C[kk] = cube * chunks[kk][1]
        return C[kk]

    # start of the previous step's chunks, back from its end; only the last two are reused below (by the
    # first two chunks of this step)
    start_prev, acc = {}, 0.0
    for kk in range(nk1 - 1, max(nk1 - 3, -1), -1):
        acc = acc + cube_of(kk)
        start_prev[kk] = -acc
    t_prev = -np.inf
    late = np.zeros_like(cube)
    nominal = base
    for j in range(min(nk1, 3)):
        if j >= 2:
            x, sx = j - 2, base + sum(cube_of(kk) for kk in range(j - 2)) if j > 2 else base
        else:
            # the last chunk of the previous step that used this chunk's L1 buffer (same parity)
            x = next((kk for kk in (nk1 - 1, nk1 - 2) if kk >= 0 and kk % 2 == j % 2), None)
            sx = None if x is None else start_prev[x]
        free = -np.inf if x is None else sx + (chunks[x][2] - 2) * c + m
        lf = chunks[j][0]
        for dur, p in ((la * lf, pa * lf), (lb * lf, pb * lf)):
            st = np.maximum(t_prev, free)
            clear = (st + p <= t0) | (st >= t1)
            # a transfer that starts before the store fills the port up to it and finishes after it
            port_end = np.where(clear, st + p, np.where(st < t0, t1 + p - (t0 - st), np.maximum(st, t1) + p))
            t_prev = np.maximum(st + dur, port_end)
        late = np.maximum(late, t_prev + m - nominal)
        nominal = nominal + cube_of(j)
    late[0] = 0.0
    return np.maximum(late, 0.0)


def write_out(dev, tile_bytes, acc_bytes, hbm):
    """(FixPipe, MTE3) cycles of storing output tiles: ``tile_bytes`` in the output dtype from their fp32
    accumulators (``acc_bytes``), ``hbm`` the store's time on the shared HBM. Split cores store from L0C
    straight to GM on FixPipe; coupled cores move L0C→UB on FixPipe and store from UB with MTE3."""
    rates = dev.rates
    if dev.arch == "split":
        return np.maximum(tile_bytes / rates["L0C->GM"], hbm), np.zeros_like(tile_bytes)
    return acc_bytes / rates["L0C->UB"], np.maximum(tile_bytes / rates["UB->GM"], hbm)


def _k_split(dev, dtype, K, k0, k1):
    """K split into chunks of k1 and slices of k0 (every chunk but the last a full one): ``(chunks of k1, the
    k0 slice widths in order, Cube fractal steps over K, per chunk (its share of K, its share of the fractal
    steps, its slices))``."""
    nk1 = ceil_div(K, k1)
    k0f = dev.cube_k0[dtype]
    chunk_w = [k1, K - (nk1 - 1) * k1]                    # a full chunk, the last one
    chunk_sl = [[min(k0, w - x) for x in range(0, w, k0)] for w in chunk_w]
    widths = chunk_sl[0] * (nk1 - 1) + chunk_sl[1]
    kfr = sum(ceil_div(w, k0f) for w in chunk_sl[0]) * (nk1 - 1) + sum(ceil_div(w, k0f) for w in chunk_sl[1])
    full, last = ((w / K, sum(ceil_div(v, k0f) for v in sl) / kfr, len(sl)) for w, sl in zip(chunk_w, chunk_sl))
    return nk1, widths, kfr, [full] * (nk1 - 1) + [last]


def _model(dev, Mr, N, K, nbatch, a_batched, b_batched, dtype, out_dtype, t, bias_isz, epi=None, a_rows=None):
    """The launch's (core cycles, HBM bytes, bytes per path, busy per unit).

    ``a_rows``: row blocks of A that are not ``m0``-row slices of a matrix (a convolution's, see
    :mod:`cost_model.conv`): ``(rows of each block, the GM bytes of its A loads over the whole K, the most of
    those bytes, whether it loads the very regions the block before it loaded)``, arrays per block in the
    kernel's order (``Mr``: their rows in all).

    ``epi``: a tile epilogue replacing the plain write-out (``cost_model.matmul_epilogue``): called as
    ``epi(m_ext, n_ext, s, S, m_s, n_s)`` with the items' extents and steps, it returns the write-out's
    per-step arrays (``fix``, ``mte3``, ``PW`` its GM-port time, ``PW_edge`` the part of it at the step boundary,
    ``W`` its HBM bytes, ``vec`` the Vector
    time of the step's epilogue, which overlaps the next step, ``drain`` what follows the last product) and
    ``bytes``.
    """
    isz, osz = itemsize(dtype), itemsize(out_dtype)
    m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
    coupled = dev.arch == "coupled"
    nm, nn = ceil_div(Mr, m0) if a_rows is None else len(a_rows[0]), ceil_div(N, n0)
    I = nbatch * nm * nn
    if epi is None and a_rows is None and I <= dev.cube_cores:
        return _one_wave(dev, Mr, N, K, nbatch, a_batched, b_batched, dtype, isz, osz, m0, n0, k0, k1, nm, nn, bias_isz)
    P = min(dev.cube_cores, I)
    S = ceil_div(I, P)
    C = dev.l2_bytes
    L2bw, HBMbw = dev.l2_bytes_per_cycle, dev.hbm_bytes_per_cycle

    i = np.arange(I)
    s = i // P
    bi = i // (nm * nn)
    mi = (i // nn) % nm
    ni = i % nn
    m_ext = np.minimum(m0, Mr - mi * m0) if a_rows is None else a_rows[0][mi]
    n_ext = np.minimum(n0, N - ni * n0)

    Ablk, Bblk, Cblk = m0 * K * isz if a_rows is None else a_rows[2], K * n0 * isz, m0 * n0 * osz

    # the footprint never shrinks as the waves between two reads grow: reads that many waves apart or fewer
    # find their block still resident (a binary search over the wave distance, not a footprint per item)
    stay = max(0, largest(lambda d: _footprint(d, P, I, nn, nm, nbatch, a_batched, b_batched, Ablk, Bblk, Cblk) <= C,
                          0, S))

    def hits(prev):
        """Per item: 1 if its read hits L2 (re-read in the same wave, or still resident), else 0."""
        return (prev >= 0) & (s - prev // P <= stay)

    # the previous item reading the same A row block / B column block
    prev_a = np.where((ni > 0) if a_rows is None else (ni > 0) | a_rows[3][mi], i - 1, -1)
    if not a_batched and nbatch > 1:
        prev_a = np.where((ni == 0) & (bi > 0), i - nm * nn, prev_a)
    prev_b = np.where(mi > 0, i - nn, -1)
    if not b_batched and nbatch > 1:
        prev_b = np.where((mi == 0) & (bi > 0), i - nm * nn, prev_b)
    ha, hb = hits(prev_a), hits(prev_b)

    a_bytes = m_ext * K * isz if a_rows is None else a_rows[1][mi]
    b_bytes = n_ext * K * isz
    w_bytes = m_ext * n_ext * osz
    A_hit = np.bincount(s, a_bytes * ha, S)
    A_miss = np.bincount(s, a_bytes * ~ha, S)
    B_hit = np.bincount(s, b_bytes * hb, S)
    B_miss = np.bincount(s, b_bytes * ~hb, S)
    W = np.bincount(s, w_bytes, S)
    starts = np.arange(S) * P

    def most(x):              # per step, the largest over its items
        return np.maximum.reduceat(x, starts).astype(float)

    m_s, n_s = most(m_ext), most(n_ext)
    if bias_isz:
        bias_hit = np.bincount(s, n_ext * bias_isz * (mi > 0), S)
        bias_miss = np.bincount(s, n_ext * bias_isz * (mi == 0), S)
    else:
        bias_hit = bias_miss = np.zeros(S)

    nk1, widths, kfr, chunks = _k_split(dev, dtype, K, k0, k1)
    rates = dev.rates

    def port(hit, miss):          # byte counts are never negative: a zero count takes 0.0 cycles
        return hit / L2bw + miss / HBMbw

    PA, PB = port(A_hit, A_miss), port(B_hit, B_miss)
    PW = W / HBMbw
    Pbias = port(bias_hit, bias_miss) if bias_isz else 0.0
    LA = np.maximum(most(a_bytes) / rates["GM->L1"], PA)
    LB = np.maximum(n_s * K * isz / rates["GM->L1"], PB)
    Lbias = np.maximum(n_s * bias_isz / rates["GM->L1"], Pbias) if bias_isz else 0.0
    m_al, n_al = round_up(m_s, 16), round_up(n_s, 16)
    # each unit's time is its busiest core's: the largest over the step's items (a step of edge tiles, a row edge
    # on one core and a column edge on another, is not its largest rows by its largest columns)
    rate = rates["GM->L1"]
    lb_i = np.maximum(n_ext * bias_isz / rate, Pbias[s]) if bias_isz else 0.0
    mte2 = most(np.maximum(a_bytes / rate, PA[s]) + np.maximum(n_ext * K * isz / rate, PB[s]) + lb_i)
    cube = most(np.ceil(m_ext / 16) * np.ceil(n_ext / 16)) * kfr
    mte1 = K * isz * most(round_up(m_ext, 16) / rates["L1->L0A"] + round_up(n_ext, 16) / rates["L1->L0B"])
    area = most(m_ext * n_ext)
    fix, mte3 = write_out(dev, area * osz, area * 4, PW)
    ep = None
    if epi is not None:
        ep = epi(m_ext, n_ext, s, S, m_s, n_s)
        fix, mte3, PW, W = ep["fix"], ep["mte3"], ep["PW"], ep["W"]
    gm_port = PA + PB + PW + Pbias
    n_instr = 2 * nk1 + 3 * len(widths) + (2 if coupled else 1) + (1 if bias_isz else 0)
    scalar = np.full(S, float(n_instr * dev.scalar_issue_cycles))

    # Write-out of a tile: FixPipe (+ MTE3 on coupled cores). With a single L0C tile the next step's
    # first product waits until the accumulator has been read out (write-after-read on L0C).
    nc = 2 if 2 * m0 * n0 * 4 <= dev.buffers["L0C"] else 1
    cube_chain = cube + np.concatenate([[0.0], fix[:-1]]) if nc == 1 else cube
    # The write-out of the previous step's tiles holds the GM port while this step's first K chunks load.
    # Replay that boundary in closed form (per step, vectorised): time 0 is the end of the previous step's
    # last product; the store holds the port over [t0, t1]; chunk j's loads may start once the L1 buffer
    # they reuse is released (chunk j-2's last L0 move) and take the port before the store as far as they
    # fit there, the rest after it; the Cube stalls by however late the last of them arrives.
    pw_prev = np.concatenate([[0.0], PW[:-1]])
    # an epilogue holds the port at the boundary only for what it issues there (``PW_edge``)
    edge_prev = pw_prev if ep is None or "PW_edge" not in ep else np.concatenate([[0.0], ep["PW_edge"][:-1]])
    move1 = (m_al * widths[0] * isz / rates["L1->L0A"]
             + widths[0] * n_al * isz / rates["L1->L0B"])
    # only where the Cube leads; where loads lead, the store's port time is in the port sum below
    cube_leads = mte2 < cube_chain
    if cube_leads[1:].any():      # the first step has no previous store: it never stalls
        c_slice = cube * chunks[0][1] / chunks[0][2]
        stall = _boundary_stall(coupled, nc, chunks, c_slice, move1, cube, LA, LB, PA, PB, fix, edge_prev)
        cube_done = cube_chain + np.where(cube_leads, stall, 0.0)
    else:
        cube_done = cube_chain
    # the previous step's write-out on the port while this step loads: an epilogue's stores are spread over its
    # sub-blocks, which run while this step's products are made; only what it issues at the boundary delays
    # the loads (the whole of the port's work is the port chain below)
    loads = np.maximum(mte2, PA + PB + Pbias + edge_prev)
    main = np.maximum.reduce([loads, cube_done, mte1, scalar])
    if ep is not None:            # the previous tile's epilogue runs during this step
        main = np.maximum(main, np.concatenate([[0.0], ep["vec"][:-1]]))
    first_k = min(k1, K) / K
    # Fill and drain: the Cube waits for the first K chunk when it leads; when loads lead, the last chunk's
    # products come after the last load.
    fill = (LA[0] + LB[0] + (Lbias[0] if bias_isz else 0.0)) * first_k + move1[0]
    lead = fill if loads[0] <= cube_done[0] else 0.0
    # loads lead: after the load of chunk x ends, the Cube still has chunks x.. to do
    def after_loads(i):
        if loads[i] <= cube_done[i]:
            return 0.0
        return move1[i] + max(sum(cf for _, cf, _ in chunks[x:]) * cube[i]
                              - sum(lf for lf, _, _ in chunks[x + 1:]) * loads[i]
                              for x in range(max(0, nk1 - 3), nk1))
    tail = after_loads(-1)
    # chains of dependent work; the launch lasts as long as the longest
    chain_main = lead + asum(main) + tail + (fix[-1] + mte3[-1] if ep is None else ep["drain"])
    # the write-outs, back to back once the first tile is done
    first_done = lead + main[0] + after_loads(0)
    if ep is None:
        chain_out = first_done + (fix[0] + asum(mte3) if coupled else asum(fix))
    else:
        chain_out = first_done + fix[0] + asum(np.maximum(ep["vec"], mte3))
    chain_port = asum(gm_port)
    core = max(chain_main, chain_out, chain_port)

    hbm = (asum(A_miss) + asum(B_miss) + asum(W) + asum(bias_miss))
    busy = {"mte2": asum(mte2), "mte1": asum(mte1), "cube": asum(cube), "fixpipe": asum(fix),
            "mte3": asum(mte3), "scalar": asum(scalar)}
    if ep is not None:
        busy.update(ep["busy"])
    # the items' extents in closed form: every (batch, column block) covers the M rows once, every (batch, row
    # block) the N columns once (integer sums: the same as summing the items)
    m_sum, n_sum = nbatch * nn * Mr, nbatch * nm * N
    m16_sum = nbatch * nn * ((nm - 1) * round_up(m0, 16) + round_up(Mr - (nm - 1) * m0, 16))
    a_sum = m_sum * K * isz
    if a_rows is not None:
        m16_sum, a_sum = nbatch * nn * int(round_up(a_rows[0], 16).sum()), nbatch * nn * float(a_rows[1].sum())
    n16_sum = nbatch * nm * ((nn - 1) * round_up(n0, 16) + round_up(N - (nn - 1) * n0, 16))
    nbytes = {"GM->L1": (a_sum + n_sum * K * isz) + (n_sum * bias_isz),
              "L1->L0A": float(m16_sum * K * isz),
              "L1->L0B": float(n16_sum * K * isz)}
    if ep is not None:
        nbytes.update(ep["bytes"])
    else:
        _out_paths(nbytes, coupled, nbatch * Mr, N, osz)
    return core, float(hbm), nbytes, busy


def _out_paths(nbytes, coupled, rows, N, osz):
    """The output's bytes by path into ``nbytes``: L0C->UB (fp32) and UB->GM on coupled cores, L0C->GM (FixPipe)
    on split ones."""
    if coupled:
        nbytes["L0C->UB"] = float(rows * N * 4)
        nbytes["UB->GM"] = float(rows * N * osz)
    else:
        nbytes["L0C->GM"] = float(rows * N * osz)


def _one_wave(dev, Mr, N, K, nbatch, a_batched, b_batched, dtype, isz, osz, m0, n0, k0, k1, nm, nn, bias_isz):
    """:func:`_model` (no epilogue) of a launch whose items all run in one wave (a step per core), in plain
    Python: the same operations in the same order on the one step's numbers. One wave has no step boundary
    to stall at, and every re-read of a block is in the same wave, so it hits L2."""
    coupled = dev.arch == "coupled"
    mn = nm * nn
    a_hit = a_miss = b_hit = b_miss = w = bias_hit = bias_miss = 0
    m_s = n_s = 0
    for i in range(nbatch * mn):
        bi, mi, ni = i // mn, (i // nn) % nm, i % nn
        m_ext, n_ext = min(m0, Mr - mi * m0), min(n0, N - ni * n0)
        m_s, n_s = max(m_s, m_ext), max(n_s, n_ext)
        # the previous item reading the same A row block / B column block (in this wave: a hit)
        ha = ni > 0 or (not a_batched and nbatch > 1 and bi > 0)
        hb = mi > 0 or (not b_batched and nbatch > 1 and bi > 0)
        if ha:
            a_hit += m_ext * K * isz
        else:
            a_miss += m_ext * K * isz
        if hb:
            b_hit += n_ext * K * isz
        else:
            b_miss += n_ext * K * isz
        w += m_ext * n_ext * osz
        if mi > 0:
            bias_hit += n_ext * bias_isz
        else:
            bias_miss += n_ext * bias_isz
    # (integer byte counts: the sums the numpy form adds as floats, exactly)
    A_hit, A_miss, B_hit, B_miss, W = float(a_hit), float(a_miss), float(b_hit), float(b_miss), float(w)
    bias_hit, bias_miss = (float(bias_hit), float(bias_miss)) if bias_isz else (0.0, 0.0)
    m_s, n_s = float(m_s), float(n_s)
    L2bw, HBMbw = dev.l2_bytes_per_cycle, dev.hbm_bytes_per_cycle

    nk1, widths, kfr, chunks = _k_split(dev, dtype, K, k0, k1)
    rates = dev.rates

    PA, PB = A_hit / L2bw + A_miss / HBMbw, B_hit / L2bw + B_miss / HBMbw
    PW = W / HBMbw
    Pbias = bias_hit / L2bw + bias_miss / HBMbw if bias_isz else 0.0
    LA = max(m_s * K * isz / rates["GM->L1"], PA)
    LB = max(n_s * K * isz / rates["GM->L1"], PB)
    Lbias = max(n_s * bias_isz / rates["GM->L1"], Pbias) if bias_isz else 0.0
    mte2 = LA + LB + Lbias
    cube = float(math.ceil(m_s / 16)) * float(math.ceil(n_s / 16)) * kfr
    m_al, n_al = round_up(m_s, 16), round_up(n_s, 16)
    mte1 = K * isz * (m_al / rates["L1->L0A"] + n_al / rates["L1->L0B"])
    if dev.arch == "split":                               # write_out of the step's tile
        fix, mte3 = max(m_s * n_s * osz / rates["L0C->GM"], PW), 0.0
    else:
        fix, mte3 = m_s * n_s * 4 / rates["L0C->UB"], max(m_s * n_s * osz / rates["UB->GM"], PW)
    gm_port = PA + PB + PW + Pbias
    n_instr = 2 * nk1 + 3 * len(widths) + (2 if coupled else 1) + (1 if bias_isz else 0)
    scalar = float(n_instr * dev.scalar_issue_cycles)
    nc = 2 if 2 * m0 * n0 * 4 <= dev.buffers["L0C"] else 1
    cube_done = cube + 0.0 if nc == 1 else cube
    move1 = (m_al * widths[0] * isz / rates["L1->L0A"]
             + widths[0] * n_al * isz / rates["L1->L0B"])
    loads = max(mte2, PA + PB + Pbias + 0.0)
    main = max(loads, cube_done, mte1, scalar)
    first_k = min(k1, K) / K
    fill = (LA + LB + (Lbias if bias_isz else 0.0)) * first_k + move1
    lead = fill if loads <= cube_done else 0.0
    if loads <= cube_done:
        after = 0.0
    else:
        after = move1 + max(sum(cf for _, cf, _ in chunks[x:]) * cube - sum(lf for lf, _, _ in chunks[x + 1:]) * loads
                            for x in range(max(0, nk1 - 3), nk1))
    chain_main = lead + main + after + (fix + mte3)
    first_done = lead + main + after
    chain_out = first_done + (fix + mte3 if coupled else fix)
    core = max(chain_main, chain_out, gm_port)

    hbm = A_miss + B_miss + W + bias_miss
    busy = {"mte2": mte2, "mte1": mte1, "cube": cube, "fixpipe": fix, "mte3": mte3, "scalar": scalar}
    m_sum, n_sum = nbatch * nn * Mr, nbatch * nm * N
    m16_sum = nbatch * nn * ((nm - 1) * round_up(m0, 16) + round_up(Mr - (nm - 1) * m0, 16))
    n16_sum = nbatch * nm * ((nn - 1) * round_up(n0, 16) + round_up(N - (nn - 1) * n0, 16))
    nbytes = {"GM->L1": (m_sum * K * isz + n_sum * K * isz) + (n_sum * bias_isz),
              "L1->L0A": float(m16_sum * K * isz),
              "L1->L0B": float(n16_sum * K * isz)}
    _out_paths(nbytes, coupled, nbatch * Mr, N, osz)
    return core, float(hbm), nbytes, busy


def flops(M, N, K, batch=1) -> float:
    return 2.0 * M * N * K * batch


def _roofline(dev, specs, bias=None, trans_a=False, trans_b=False, tiling=None, out_dtype=None):
    a, b = specs[0], specs[1]
    Mr, N, K, nbatch, _, _, batch, M = _dims(a, b, trans_a, trans_b)
    dtype = a[1]
    osz = itemsize(out_dtype or dtype)
    fl = flops(Mr, N, K, nbatch)
    peak = 2.0 * dev.cube_macs[dtype] * dev.cube_cores
    io = math.prod(a[0]) * itemsize(dtype) + math.prod(b[0]) * itemsize(dtype) + Mr * N * nbatch * osz
    if bias is not None:
        io += math.prod(bias[0]) * itemsize(bias[1])
    return max(fl / peak, io / dev.hbm_bytes_per_cycle)


@cached
def _search(device: str, Mr, N, K, nbatch, a_batched, b_batched, dtype, out_dtype, bias_isz):
    """The cheapest tiling that fits: candidates ranked by a quick score; the best two and the kernel's
    default are priced in full.

    Returns ``(tiling, model result)``.
    """
    dev = get_device(device)
    # the candidates ranked by the quick score, then the first two that fit: the same two as ranking only the fitting
    # ones (a stable sort keeps equal scores in candidate order either way), most of the fits left unchecked
    tiles = sorted(_tiles(dev, Mr, N, K, dtype), key=_quick_score(dev, Mr, N, K, nbatch, dtype))
    bias = bool(bias_isz)
    top = []
    for t in tiles:
        if fits(dev, dtype, out_dtype, t, bias):
            top.append(t)
            if len(top) == 2:
                break
    if not top:
        raise ValueError(f"no matmul tiling fits {dev.name} for {dtype}")
    default = kernel_default(dev, Mr, N, K, nbatch, dtype, out_dtype)
    shortlist = top + ([default] if default is not None and default not in top else [])
    return cheapest(dev, shortlist, default,
                    lambda t: _model(dev, Mr, N, K, nbatch, a_batched, b_batched, dtype, out_dtype, t, bias_isz))


def cheapest(dev, shortlist, default, price):
    """``(tiling, model result)`` of the shortlist's cheapest tiling, ``price(t)`` giving a tiling's model result.
    A tiling replaces the kernel's default only if it wins by more than the model's typical error."""
    best = None
    for t in shortlist:
        res = price(t)
        cost = kernel_cycles(dev, *res[:3])
        if t == default:
            cost *= 1 - DEFAULT_MARGIN
        if best is None or cost < best[0]:
            best = (cost, t, res)
    return best[1], best[2]


def choose_tiling(device, a, b, trans_a=False, trans_b=False, out_dtype=None, bias=None) -> dict:
    """The tiling ``estimate`` picks for ``a @ b`` (specs), to hand to the kernel as ``tiling=``."""
    Mr, N, K, nbatch, a_b, b_b, _, _ = _dims(a, b, trans_a, trans_b)
    bias_isz = itemsize(bias[1]) if bias is not None else 0
    return dict(_search(get_device(device).name, Mr, N, K, nbatch, a_b, b_b, a[1], out_dtype or a[1], bias_isz)[0])


@register("matmul", _roofline)
def estimate_matmul(dev, specs, bias=None, trans_a=False, trans_b=False, tiling=None, out_dtype=None):
    a, b = specs[0], specs[1]
    Mr, N, K, nbatch, a_b, b_b, batch, M = _dims(a, b, trans_a, trans_b)
    dtype = a[1]
    out_dtype = out_dtype or dtype
    bias_isz = itemsize(bias[1]) if bias is not None else 0
    if tiling is None:
        t, (core, hbm, nbytes, busy) = _search(dev.name, Mr, N, K, nbatch, a_b, b_b, dtype, out_dtype, bias_isz)
    else:
        t = {k: int(tiling[k]) for k in ("m0", "n0", "k0", "k1")}
        if not fits(dev, dtype, out_dtype, t, bool(bias_isz)):
            raise ValueError(f"matmul tiling {t} does not fit the buffers of {dev.name}")
        core, hbm, nbytes, busy = _model(dev, Mr, N, K, nbatch, a_b, b_b, dtype, out_dtype, t, bias_isz)
    return make("matmul", dev, core, hbm, nbytes, busy, dict(t),
                _roofline(dev, specs, bias, trans_a, trans_b), flops(Mr, N, K, nbatch))


__all__ = ["cheapest", "choose_tiling", "estimate_matmul", "fits", "flops", "write_out"]
