"""FlashAttention (``autofuse/npu/kernels/flash_attention.py``): per lockstep step, the busiest unit.

The kernel deals work units (batch, head, block of ``q`` query rows; causal pairs blocks i and nq-1-i) to
the least-loaded core; each core walks its (item, KV tile) steps. A step is S = Q·K_jᵀ on the Cube, the
softmax row block by row block on the Vector unit (scale, [mask], [causal compare+select], max, sub,
exp, sum, [cast] — per-row repeats), P out to a workspace that stays in L2 and back into L0A, O_j = P·V_j,
and the O update (two passes over [rows, Dv]); the last tile of an item adds out = O / l and its store.
Split cores (910B) also send S and O_j through L2 workspaces between the AIC and its two AIVs.

The software pipeline overlaps stage A of step s+1 with stage B of step s, so a step lasts as long as its
busiest unit (Cube, MTE1, MTE2 of either side, FixPipe, Vector, MTE3) or the GM port it shares; the
launch adds the first step's Q/K loads and S (fill) and the last step's P·V, update and store (drain).
K/V tiles are read by every core working on the same head at the same step: one HBM miss, L2 hits for
the rest, and re-reads by later rounds hit while the heads in flight fit L2. HBM also receives the
workspaces still dirty in L2 when the kernel ends (written back then, as the simulator does).

A sliding ``window`` (with ``causal``) walks each query block's band of KV tiles only (:func:`_spans`), the
tiles crossing the diagonal or the band's left edge with a compare and a select more (:func:`_band_tiles`).

A launch of at most ``REPLAY_UNITS`` units (head, query block) is priced core by core: the kernel's deal replayed
step by step (:func:`_core_deal`, :func:`_core_tallies`), each step priced by its own query rows and KV extent
(:func:`replay_time`). The cores issue step s of their lists as one instruction, so the replay knows which K/V tiles
each instruction misses and which cores wait for those misses (the others wait for the instruction's L2 hits only),
and how many rows each instruction's Q loads and output stores move to and from HBM. Per core: its steps, each
with its own K/V port wait; the software pipeline's loop over pairs of consecutive steps (a long step then a short
one last at least the long one's loop); each later item's Q load, and on coupled cores the output store before it,
which holds the MTE3 queue ahead of the next P store; and its GM port's busy time as a bound (loads and stores
share the port). Causal blocks differ in length and an edge block may be one row, so the slowest core is not
always the one with the most steps. The tiling search bounds each short candidate from the deal alone (each core's
steps at their least busy units, its fill and its items' ends) and replays only those whose bound is below the best
found.

``return_probs`` adds the kernel's second sweep (``_probs_sweep``): S recomputed, normalised and the
probabilities stored to HBM tile by tile (every KV tile, causal ones above the diagonal as zeros).
``return_stats`` (and ``return_probs``, whose sweep reads them) adds each item's row max and sum, two MTE3
stores of ``rows x 4`` bytes issued after its last softmax, ahead of the next tile's P store and of its own
output stores: they fill the MTE3 queue's idle time (no step and no drain is longer); their bytes go to GM
and, as outputs, to HBM, and they count in MTE3's busy time.
"""
from __future__ import annotations

import heapq
import math
from collections import Counter
from itertools import chain
from typing import NamedTuple

import numpy as np

from cost_model.attention_tiling import l0b_requests, requests as _requests
from cost_model.common import ceil_div, itemsize
from cost_model.devices import ITEMSIZE, get_device
from cost_model.estimate import cached, kernel_cycles, make, register

F32 = "float32"
# launches of at most this many work units (head, query block) are priced core by core, from the kernel's own deal
REPLAY_UNITS = 512


def _r16(x):
    return -(-x // 16) * 16                  # round_up(x, 16), written out: called per step kind priced


def launch_dims(specs):
    """``(B, N, Sq, D, Nkv, Skv, Dv, dtype)`` of an attention launch from its q, k, v specs (q ``[B, N, Sq, D]``,
    k ``[B, Nkv, Skv, D]``, v ``[B, Nkv, Skv, Dv]``)."""
    (qs, dtype), (ks, _), (vs, _) = specs[:3]
    B, N, Sq, D = qs
    _, Nkv, Skv, _ = ks
    return B, N, Sq, D, Nkv, Skv, vs[3], dtype


# ------------------------------------------------------------------------------------------ tiling
@cached
def _l0b_overflows(device, D, Dv, dtype, kv) -> bool:
    """Whether L0B overflows with its requests' minimum tile counts (:func:`l0b_requests`): then so does every
    tiling with this ``kv`` (L0B holds nothing else), whatever its q and vq."""
    return _overflows(get_device(device), l0b_requests(D, Dv, dtype, kv))


def _overflows(dev, req) -> bool:
    """Whether the requests' minimum tile counts overflow a buffer (:func:`_placement` is then None). Counted from
    the end of the list, where the L0 requests that overflow most often are: a buffer's use from some request on (its
    tiles' aligned sizes, less the padding of its last tile) only grows as the requests before are counted, so the
    first buffer found over its size decides; at the start of the list each buffer's use is its whole use."""
    split, align, buffers = dev.arch == "split", dev.align, dev.buffers
    used = {}
    for side, buf, _, shape, dt, lo, _ in reversed(req):
        if lo:
            key = (side, buf) if split else ("core", buf)
            size = math.prod(shape) * ITEMSIZE[dt]
            a = align[buf]
            aligned = -(-size // a) * a
            u = used.get(key)
            u = lo * aligned - (aligned - size) if u is None else u + lo * aligned
            if u > buffers[buf]:
                return True
            used[key] = u
    return False


def _placement(dev, req):
    """Where the requests' minimum tile counts leave each buffer, or None when one overflows (:func:`_overflows`):
    per request its (buffer, aligned tile size, alignment padding), and per buffer the sum of its aligned tiles and
    the (index, padding) of its last tile-holding request. A buffer's tiles are placed one after another, each at the
    buffer's alignment: its use is every tile's aligned size but the last one's, plus the last one's size (the sum
    less the last padding)."""
    # (both searches place every candidate tiling's thirty-odd requests, most of which overflow: the loop does no
    # more than it needs)
    if _overflows(dev, req):
        return None
    split, align = dev.arch == "split", dev.align
    total, last, plan = {}, {}, []
    i = 0
    for side, buf, _, shape, dt, lo, _ in req:
        key = (side, buf) if split else ("core", buf)
        size = math.prod(shape) * ITEMSIZE[dt]
        a = align[buf]
        aligned = -(-size // a) * a
        pad = aligned - size
        plan.append((key, aligned, pad))
        if lo:
            total[key] = total.get(key, 0) + lo * aligned
            last[key] = (i, pad)
        elif key not in total:
            total[key] = 0
        i += 1
    return plan, total, last


def _counts(dev, req):
    """Tile counts per request, as the kernel grants them (double buffers in list order while they fit), or
    None: from :func:`_placement` (request names are unique), granting a tile costs one comparison of the
    buffer's running use."""
    placed = _placement(dev, req)
    if placed is None:
        return None
    plan, total, last = placed
    counts = {r[2]: r[5] for r in req}
    if len(counts) != len(req):
        raise ValueError(f"buffer requests need unique names, got {[r[2] for r in req]}")
    for i, ((key, aligned, pad), r) in enumerate(zip(plan, req)):
        name, hi, cap = r[2], r[6], dev.buffers[key[1]]
        tail = last.get(key, (-1, 0))
        if tail[0] < i:                   # its first tile would be the buffer's last
            tail = (i, pad)
        while counts[name] < hi and total[key] + aligned - tail[1] <= cap:
            counts[name] += 1
            total[key] += aligned
            last[key] = tail
    return counts


@cached
def _tile_counts(device, D, Dv, dtype, q, kv, vq, mask_spec, drop, sink=False):
    """:func:`_counts` of tile ``(q, kv, vq)`` as (name, count) pairs, or None: the default and the candidates
    of every shape with these head dims try the same tiles, so they are counted once. Most tiles the searches try
    overflow L0B, which only ``kv`` sets: those are passed over before their requests are made."""
    if _l0b_overflows(device, D, Dv, dtype, kv):
        return None
    dev = get_device(device)
    c = _counts(dev, _requests(dev, D, Dv, dtype, {"q": q, "kv": kv, "vq": vq}, mask_spec, drop, sink))
    return None if c is None else tuple(c.items())


def _granted(dev, D, Dv, dtype, t, mask_spec, drop, sink=False):
    """:func:`_counts` of tiling ``t`` (from :func:`_tile_counts`), a fresh dict the caller may keep."""
    c = _tile_counts(dev.name, D, Dv, dtype, t["q"], t["kv"], t["vq"], mask_spec, bool(drop), bool(sink))
    return None if c is None else dict(c)


def _valid(dev, t):
    q, kv, vq = t["q"], t["kv"], t["vq"]
    rows = q // 2 if dev.arch == "split" else q
    return q % 16 == 0 and kv % 16 == 0 and vq >= 1 and rows % vq == 0


# a searched tiling must beat the kernel's default by more than the model's typical error to replace it
DEFAULT_MARGIN = 0.05
# a bound and the model round differently in their last bits (a few dozen operations of relative error 2^-53 each):
# a candidate is passed over only when its bound is above the best by far more than that (both attention searches)
ROUNDING = 1e-9
#: Vector passes of logit soft-capping per score: muls 1/c, an fp32 tanh (six passes: muls 2, exp, adds 1,
#: reciprocal, muls -2, adds 1), muls c
SOFTCAP_PASSES = 8
#: a per-head scale's 16-bit product (``head_scale_dtype``): the scores and the product each rounded, a cast down and up
HEAD_ROUND_PASSES = 4
#: eager's 16-bit scores cast up and its fp32 logits cast down before the softmax (``logits_dtype``): the scores and
#: the logits each rounded, a cast down and up
LOGITS_ROUND_PASSES = 4


def mask_passes(mask) -> int:
    """Vector passes per score that apply ``mask``, its spec ``(shape, dtype)``, ``(shape, dtype, add dtype)`` or
    ``(shape, dtype, add dtype, fill select)`` (None: no mask), restated from the kernel: a bool select or an fp32
    add, 1; a 16-bit additive mask added in fp32, 2 (its cast up, the add); added in its own dtype
    (``mask_add_dtype``), 3 (the scores cast down, the add, the sum cast back up); an additive mask whose filled
    entries replace the scores (``fill_in_mask``), a compare and a select more."""
    if mask is None:
        return 0
    if mask[1] in ("bool", F32):
        n = 1
    else:
        n = 3 if len(mask) > 2 and mask[2] else 2
    return n + (2 if len(mask) > 3 and mask[3] and mask[1] != "bool" else 0)


def with_add_dtype(mask, add_dtype, kernel: str, fill_select: bool = False):
    """The mask spec the models take: ``(shape, dtype)``, with ``add_dtype`` (a 16-bit additive mask added in its
    dtype) ``(shape, dtype, add_dtype)``; the kernel's check of the pair restated. ``fill_select`` (an additive
    mask, ``fill_in_mask``): ``(shape, dtype, add_dtype or None, True)``."""
    if add_dtype is not None and (add_dtype not in ("float16", "bfloat16") or mask is None or mask[1] != add_dtype):
        raise ValueError(f"{kernel}: mask_add_dtype={add_dtype!r} needs an additive {add_dtype} mask, got "
                         f"{'no mask' if mask is None else mask[1]}")
    if mask is None:
        return None
    if fill_select and mask[1] != "bool":
        return tuple(mask[0]), mask[1], add_dtype, True
    return (tuple(mask[0]), mask[1]) if add_dtype is None else (tuple(mask[0]), mask[1], add_dtype)


@cached
def _candidates_cached(device, Sq, Skv, D, Dv, dtype, mask_spec, drop=False, sink=False):
    return _candidates(get_device(device), Sq, Skv, D, Dv, dtype, mask_spec, drop, sink)


@cached
def kernel_default(device, Sq, Skv, D, Dv, dtype, mask_spec, drop=False, sink=False):
    """The kernel's own default (``_default_tiling``, mirrored): the fitting tile with the largest q·kv,
    then q, with its largest fitting Vector row block."""
    dev = get_device(device)
    qmax, kvmax = _r16(Sq), _r16(Skv)
    qs = sorted({min(x, qmax) for x in (128, 64, 32, 16)}, reverse=True)
    kvs = sorted({min(x, kvmax) for x in (512, 256, 128, 64, 32, 16)}, reverse=True)
    for q, kv in sorted(((q, kv) for q in qs for kv in kvs), key=lambda p: (p[0] * p[1], p[0]), reverse=True):
        rows = q // 2 if dev.arch == "split" else q
        for vq in [v for v in (rows, rows // 2, rows // 4, rows // 8) if v >= 1 and rows % v == 0]:
            t = {"q": q, "kv": kv, "vq": vq}
            c = _granted(dev, D, Dv, dtype, t, mask_spec, drop, sink)
            if c is not None:
                return t, c
    return None


def _candidates(dev, Sq, Skv, D, Dv, dtype, mask_spec, drop=False, sink=False):
    qmax, kvmax = _r16(Sq), _r16(Skv)
    out = []
    # the larger tiles (fewer K/V reloads and O updates per score) are the ones worth pricing
    for q in sorted({min(x, qmax) for x in (128, 64, 32, 16)}, reverse=True)[:2]:
        for kv in sorted({min(x, kvmax) for x in (512, 256, 128, 64, 32, 16)}, reverse=True)[:3]:
            rows = q // 2 if dev.arch == "split" else q
            for vq in [v for v in (rows, rows // 2, rows // 4, rows // 8) if v >= 1 and rows % v == 0]:
                t = {"q": q, "kv": kv, "vq": vq}
                c = _granted(dev, D, Dv, dtype, t, mask_spec, drop, sink)
                if c is not None:
                    out.append((t, c))
                    break
    return out


# ------------------------------------------------------------------------------------------ schedule
@cached
def _spans(qb, kvb, Sq, Skv, causal, window=0):
    """``(lo, hi)`` per query block (int arrays): the KV tiles it attends, as the kernel walks them (causal: up to
    its last row's diagonal; a sliding ``window``: from the tile of its first row's first key; at least one).
    The arrays are shared: callers must not write to them."""
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    qi = np.arange(nq)
    if not causal:
        return np.zeros(nq, dtype=np.int64), np.full(nq, nkv, dtype=np.int64)
    hi = -(-np.minimum(np.minimum((qi + 1) * qb, Sq), Skv) // kvb)
    lo = np.minimum(np.maximum(0, qi * qb - window + 1) // kvb, hi - 1) if window else np.zeros(nq, dtype=np.int64)
    return lo, hi


@cached
def _band_tiles(Sq, Skv, qb, kvb, window):
    """A sliding window's (tiles walked, tiles crossing the diagonal, tiles holding the window's left edge), over
    every query block: the kernel runs a compare and a select on each of the latter two kinds. Per block (first
    row q0, last row r): a tile crosses the diagonal when its last key passes q0, every tile from
    ``(q0 + 1) // kvb`` on (none when the keys end at or before q0); it holds the left edge when its first key is
    at or left of ``r - window``, every tile up to ``(r - window) // kvb``."""
    lo, hi = _spans(qb, kvb, Sq, Skv, True, window)
    q0 = np.arange(len(lo)) * qb
    last = np.minimum(q0 + qb, Sq) - 1
    diag = np.where(Skv - 1 > q0, np.maximum(0, hi - np.maximum(lo, (q0 + 1) // kvb)), 0)
    edge = np.maximum(0, np.minimum(hi, (last - window) // kvb + 1) - lo)
    return int((hi - lo).sum()), int(diag.sum()), int(edge.sum())


def _deal(per_head, BN, ncores):
    """The kernel's dealer: units (lists of per-item tile counts) to the least-loaded core, in order.

    Returns (cores, makespan in tiles, items of the busiest core). With many units per core the greedy
    dealer balances to the average within one unit, so that is used instead of replaying it.
    """
    nunits = BN * len(per_head)
    n = min(ncores, nunits)
    costs = [sum(u) for u in per_head]
    if nunits > 8 * n:
        total = BN * sum(costs)
        T = ceil_div(total, n) + (max(costs) - min(costs))
        return n, T, ceil_div(BN * sum(len(u) for u in per_head), n)
    if all(u == per_head[0] for u in per_head):
        # equal units go round-robin: the busiest cores get ceil(units / cores) of them
        k = ceil_div(nunits, n)
        return n, k * costs[0], k * len(per_head[0])
    # a heap of one integer per core, (tiles·K + items)·n + core (K above any core's items), orders the cores as
    # (tiles, items, core) does; dealing a unit adds its tiles and items to the smallest
    K = BN * sum(len(u) for u in per_head) + 1
    adds = [(sum(u) * K + len(u)) * n for u in per_head]
    heap = list(range(n))
    replace = heapq.heapreplace
    for _ in range(BN):
        for a in adds:
            replace(heap, heap[0] + a)
    T = max(heap) // n // K
    return n, T, max(x // n % K for x in heap if x // n // K == T)


@cached
def _busiest_rows(units_per_qblock, Sq, qb, n):
    """Mean query rows per item of the busiest core when equal units are dealt round-robin (head-major,
    query block fastest), as the kernel deals non-causal work: the core with the most items, and of those
    the most rows."""
    nq = ceil_div(Sq, qb)
    u = np.arange(units_per_qblock * nq)
    ext = np.minimum(qb, Sq - (u % nq) * qb)
    items = np.bincount(u % n, minlength=n)
    rows = np.bincount(u % n, weights=ext, minlength=n)
    top = items == items.max()
    return float(rows[top].max() / items.max())


@cached
def _schedule(B, N, nq, nkv, causal, Sq, Skv, qb, kvb, ncores, window=0):
    """(cores used, tile steps of the busiest core, its items), as the kernel schedules: one query block
    per unit, or (causal) blocks i and nq-1-i paired when that finishes no later."""
    lo, hi = _spans(qb, kvb, Sq, Skv, causal, window)
    counts = (hi - lo).tolist()           # each block's tiles (Python ints: no numpy scalar per block)

    def tiles(qi):
        return counts[qi]

    units = [[tiles(i)] for i in range(nq)]
    best = _deal(units, B * N, ncores)
    is_paired = False
    if causal:
        pairs = [[tiles(i), tiles(nq - 1 - i)] for i in range(nq // 2)] + ([[tiles(nq // 2)]] if nq % 2 else [])
        paired = _deal(pairs, B * N, ncores)
        if paired[1] <= best[1]:
            best, units, is_paired = paired, pairs, True
    # How many cores load their next Q in the same step. Causal items differ in length, so cores whose
    # items differ start their next items at different steps (one wave per distinct length); a pair's
    # second item starts in such a wave, but pairs (about equally long) start together.
    n = best[0]
    q_cores = float(n)
    if causal:
        staggered = ceil_div(n, min(n, len({u[0] for u in units})))
        q_cores = (n + staggered) / 2 if is_paired else float(staggered)
    return best + (q_cores,)


@cached
def _dirty_workspaces(split, n, T, B, N, Sq, Skv, qb, kvb, vq, Dv, isz, causal):
    """Bytes of the workspaces still dirty in L2 at the end (written back then).

    Every distinct region written is its own L2 line: per core, the (slot, query rows, key columns) combos of
    its steps — two slots (step parity), full and edge query blocks, full and edge KV tiles. Split cores
    also keep S per row block (fp32) and O_j per half (fp32).
    """
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    kes = [min(kvb, Skv - j * kvb) for j in range(nkv)]
    nh = 2 if split else 1
    R = qb // nh

    def region_bytes(qe, slot_ke):
        total = 0.0
        for slot, k_ in slot_ke:
            for h in range(nh):
                rl = min(max(qe - h * R, 0), R)
                total += rl * k_ * isz                                   # P
            if split:
                for g in range(ceil_div(qb, vq)):
                    total += min(max(qe - g * vq, 0), vq) * k_ * 4       # S, per row block
        if split:
            slots = {sl for sl, _ in slot_ke}
            total += len(slots) * sum(min(max(qe - h * R, 0), R) for h in range(nh)) * Dv * 4   # O_j
        return total

    units = B * N * nq
    if not causal and units <= 4096:
        # round-robin dealing (equal units): core c gets units c, c + n, ...; item k starts at step k·nkv, so
        # its tile j is in slot (k·nkv + j) % 2: which slots an item's tiles use depends only on k·nkv % 2
        tiles = [{((p + j) % 2, k_) for j, k_ in enumerate(kes)} for p in (0, 1)]
        u = np.arange(units)
        code = np.unique(((u % n) * (qb + 1) + np.minimum(qb, Sq - (u % nq) * qb)) * 2 + (u // n) * nkv % 2)
        seen = {}                                             # (core, query rows) -> parities of its items
        for x in code.tolist():
            rest, p = divmod(x, 2)
            seen.setdefault(divmod(rest, qb + 1), set()).add(p)
        memo = {}
        total = 0.0                                           # whole bytes: exact in any order
        for (_, qe), ps in seen.items():
            key = (qe, frozenset(ps))
            if key not in memo:
                memo[key] = region_bytes(qe, set().union(*(tiles[p] for p in ps)))
            total += memo[key]
        return total
    combos = {(p, k_) for p in ((0, 1) if T > 1 else (0,)) for k_ in (kes if not causal else kes[:1] + kes[-1:])}
    q_full, q_edge = min(qb, Sq), Sq - (nq - 1) * qb
    edge_cores = min(n, B * N) if (q_edge != q_full and nq > 1) else 0
    full = region_bytes(q_full, combos)
    both = full + (region_bytes(q_edge, combos) if edge_cores else 0.0)
    return (n - edge_cores) * full + edge_cores * both


@cached
def _tile_kinds(nq, nkv, Sq, Skv, qb, kvb, causal, window=0):
    """Each query block's rows, each KV tile's keys, and per (query block, KV tile) whether the tile is masked: it
    crosses the diagonal or holds the window's left edge (a compare and a select more). Arrays shared through the
    cache: read only."""
    q0 = np.arange(nq) * qb
    qeb = np.minimum(q0 + qb, Sq) - q0
    j = np.arange(nkv)
    kext = np.minimum(kvb, Skv - j * kvb)
    masked = np.zeros((nq, nkv), dtype=bool)
    if causal:
        masked = ((j + 1) * kvb - 1 > q0[:, None]) & (Skv - 1 > q0[:, None])
        if window:
            masked |= j * kvb <= (q0 + qeb - 1)[:, None] - window
    return qeb, kext, masked


@cached
def _block_items(nq, nkv, Sq, Skv, qb, kvb, causal, probs=False, window=0):
    """Per query block, ``(query extent, tiles)`` as the kernel walks it, each tile ``(KV extent, works, masked)``
    (see :func:`_core_items`)."""
    los, his = _spans(qb, kvb, Sq, Skv, causal, window)
    qeb, kext, masked = (x.tolist() for x in _tile_kinds(nq, nkv, Sq, Skv, qb, kvb, causal, window))
    out = []
    for qi, (lo, hi) in enumerate(zip(los.tolist(), his.tolist())):
        walk = range(nkv) if probs else range(lo, hi)
        out.append((qeb[qi], tuple((kext[j], lo <= j < hi, masked[qi][j]) for j in walk)))
    return tuple(out)


class Deal(NamedTuple):
    """A sweep's units dealt to the cores (:func:`_core_deal`), every core's query blocks in order, core after core:
    ``qi`` the block and ``bh`` its head (``b * N + h``), ``per`` the blocks of each core. Arrays shared through the
    cache: read only."""
    qi: np.ndarray
    bh: np.ndarray
    per: np.ndarray


@cached
def _core_deal(B, N, nq, nkv, Sq, Skv, qb, kvb, causal, ncores, probs=False, window=0) -> Deal:
    """The query blocks of each core's items in order and the head of each, dealt as the kernel's ``_schedule``
    deals them: units in head-major order to the least-loaded core, a unit costing 1 a worked tile and 0.1 a
    skipped one (summed in the kernel's order); causal: blocks i and nq-1-i paired when that finishes no later."""
    los, his = _spans(qb, kvb, Sq, Skv, causal, window)
    if probs:
        cost = [sum(1.0 if lo <= j < hi else 0.1 for j in range(nkv)) for lo, hi in zip(los.tolist(), his.tolist())]
    else:
        cost = (his - los).astype(float).tolist()

    def deal(units):
        """(the core of each unit, in head-major order; the busiest core's load)"""
        K = B * N * len(units)
        n = min(ncores, K)
        ucost = []
        for unit in units:
            u = 0.0
            for qi in unit:
                u += cost[qi]
            ucost.append(u)
        if all(u == ucost[0] for u in ucost):
            # equal units: the least-loaded core (the lowest index among equals) is the next one round the cores,
            # and every core's load is the same sum of equal costs after each round
            load = 0.0
            for _ in range(ceil_div(K, n)):
                load += ucost[0]
            return np.arange(K) % n, load
        replace = heapq.heapreplace          # (loads and cores pair uniquely: the popped order is the heap's minima)
        if all(u.is_integer() for u in ucost):
            # whole costs (every unit's tiles worked): a heap of one integer per core, load·n + core, orders the
            # cores as the (load, core) pairs do, and dealing a unit adds its cost·n to the smallest
            adds = [int(u) * n for u in ucost]
            heap = list(range(n))
            assign = [replace(heap, heap[0] + a) % n for _ in range(B * N) for a in adds]
            return np.array(assign), float(max(heap) // n)
        heap = [(0.0, c) for c in range(n)]
        assign = []
        for _ in range(B * N):
            for u in ucost:
                load, c = heap[0]
                replace(heap, (load + u, c))
                assign.append(c)
        return np.array(assign), max(h[0] for h in heap)

    units = [[i] for i in range(nq)]
    assign, load = deal(units)
    if causal:
        pairs = [[i, nq - 1 - i] for i in range(nq // 2)] + ([[nq // 2]] if nq % 2 else [])
        paired = deal(pairs)
        if paired[1] <= load:
            units, (assign, load) = pairs, paired
    # the units' blocks, head-major, then stably in core order
    # (np.tile's Python-level shape handling costs more than these launches' arrays: the repetitions built by
    # indexing and list repetition give the same arrays)
    nu = len(units)
    blocks = np.fromiter(chain.from_iterable(units), dtype=np.int64)
    nb = len(blocks)
    if nb == nu:                          # one block a unit
        unit = np.arange(B * N * nu)
    else:
        unit = np.arange(B * N * nu).repeat(np.array([len(u) for u in units] * (B * N)))
    qi = blocks[np.arange(B * N * nb) % nb]
    core = assign[unit]
    order = core.argsort(kind="stable")
    return Deal(qi[order], (unit // nu)[order], np.bincount(core, minlength=int(assign.max()) + 1))


def _core_blocks(B, N, nq, nkv, Sq, Skv, qb, kvb, causal, ncores, probs=False, window=0):
    """Per core, the query blocks of its items in order (:func:`_core_deal`), as lists."""
    d = _core_deal(B, N, nq, nkv, Sq, Skv, qb, kvb, causal, ncores, probs, window)
    return [x.tolist() for x in np.split(d.qi, d.per.cumsum()[:-1])]


def _core_items(B, N, nq, nkv, Sq, Skv, qb, kvb, causal, ncores, probs=False, window=0):
    """Per core, its items in order, each ``(query extent, ((KV extent, works, masked), ...))``, dealt as
    :func:`_core_blocks` deals them. ``masked``: the tile crosses the diagonal or holds the window's left edge (a
    compare and a select more). ``probs``: the probabilities sweep, which walks every KV tile (those outside the
    band not worked)."""
    items = _block_items(nq, nkv, Sq, Skv, qb, kvb, causal, probs, window)
    return [[items[qi] for qi in blocks]
            for blocks in _core_blocks(B, N, nq, nkv, Sq, Skv, qb, kvb, causal, ncores, probs, window)]


@cached
def _dirty_exact(split, B, N, Sq, Skv, qb, kvb, vq, Dv, isz, causal, ncores, return_probs, window=0):
    """Bytes of the workspaces dirty at the end, from the kernel's own deal (:func:`_core_blocks`): every distinct
    region key (core, slot, rows, KV extent) of P, and on split cores of S (per row block) and O_j (per half). The
    probabilities sweep continues the slot parity and writes S again on split cores. A block's worked tiles use
    the same (slot, KV extent) pairs wherever it runs, up to its first step's parity: each core is a union of its
    blocks' pairs."""
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    nh = 2 if split else 1
    R = qb // nh
    los, his = _spans(qb, kvb, Sq, Skv, causal, window)
    qeb, kext, _ = _tile_kinds(nq, nkv, Sq, Skv, qb, kvb, causal, window)
    qvals, kvals = (int(qeb[0]), int(qeb[-1])), (int(kext[0]), int(kext[-1]))
    spans = list(zip(los.tolist(), his.tolist()))
    edge_q = (qeb != qeb[0]).tolist()                     # per block: its rows are the edge extent
    kv_edge = nkv - 1 if kvals[1] != kvals[0] else -1     # the KV tile of edge extent, if any (only the last can be)

    def sweep(probs, base):
        """Per dealt core, the (slot, KV extent) pairs its blocks' worked tiles use, per query extent (full, edge), as
        bits ``slot * 2 + (edge KV tile)``, with the first step at ``base``; and each core's step count."""
        steps = [nkv] * nq if probs else [hi - lo for lo, hi in spans]
        # a block's pairs when its first step is at an even slot (its tile j at step j - lo, or at step j in the
        # probabilities sweep, which walks every tile); at an odd one, the same with the slots swapped. Its worked
        # tiles alternate slots and only the last KV tile can be an edge one: its first two worked tiles and its last
        # use every pair it does
        even = []
        for lo, hi in spans:
            step0 = 0 if probs else lo
            b = 0
            for j in {lo, min(lo + 1, hi - 1), hi - 1}:
                b |= 1 << ((j - step0) % 2 * 2 + (j == kv_edge))
            even.append(b)
        odd = [(b & 3) << 2 | b >> 2 for b in even]
        U_qi, _, ulen = _core_deal(B, N, nq, nkv, Sq, Skv, qb, kvb, causal, ncores, probs, window)
        # each core's units in turn, from its first step (at most REPLAY_UNITS units: a walk over them in Python costs
        # less than the arrays for it)
        qis = U_qi.tolist()
        held, per_core, u = [], [], 0
        for n_u in ulen.tolist():
            pairs, step = [0, 0], base
            for qi in qis[u:u + n_u]:
                pairs[edge_q[qi]] |= odd[qi] if step % 2 else even[qi]
                step += steps[qi]
            held.append(tuple(pairs))
            per_core.append(step - base)
            u += n_u
        return held, per_core

    # the main sweep, then on split cores the probabilities sweep from the step after the main one's last
    main, per_core = sweep(False, 0)
    sweeps = [(main, True)]
    if return_probs and split:
        probs = sweep(True, max(per_core))[0]
        sweeps.append((probs + [(0, 0)] * (len(main) - len(probs)), False))      # (a core it deals nothing holds none)
    total = 0
    # over the main sweep's cores only: the probabilities sweep's further ones (split cores, causal, more units than
    # the main sweep's pairs) would add S lines that the simulator's HBM bytes do not show (six such launches on
    # the 910B read 2-4 % from the simulator without them, 3-9 % over with them)
    # cores holding the same pairs (per sweep, per query extent) hold the same regions: each holding is priced once,
    # times its cores (integer bytes: the total does not depend on the order they are added in)
    holdings = Counter(zip(*(h[:len(main)] for h, _ in sweeps)))
    for held, cores in holdings.items():
        combos = {(b >> 1, qvals[x], kvals[b & 1], with_p) for pair, (_, with_p) in zip(held, sweeps) for x in (0, 1)
                  for b in range(4) if pair[x] >> b & 1}
        keys = {}
        for slot, qe, ke, with_p in combos:
            for h in range(nh):
                rl = min(max(qe - h * R, 0), R)
                if rl and with_p:
                    keys[("P", slot, h, rl, ke)] = rl * ke * isz
                    if split:
                        keys[("O", slot, h, rl)] = rl * Dv * 4
            if split:
                for g in range(qb // vq):
                    rg = min(max(qe - g * vq, 0), vq)
                    if rg:
                        keys[("S", slot, g, rg, ke)] = rg * ke * 4
        total += cores * sum(keys.values())
    return total


@cached
def gm_bytes(B, N, Sq, Skv, D, Dv, isz, qb, kvb, causal, split, mask_rc, msz, return_probs, drop=False,
             return_stats=False, window=0):
    """GM traffic per path over the whole launch (all cores), as the kernel moves it: Q once per item, K/V
    per step, P out and back into L0A, the output; split cores also S and O_j through GM (fp32) and back
    to the AIVs; the mask per step (``mask_rc``: whether its rows / columns vary; a broadcast row is
    read once per core side); ``drop``: the dropout keep bits of every attended tile; ``return_probs``: the
    sweep's Q and K reloads, S again (split), the row max and sum out and back, every probabilities tile out;
    ``return_stats``: the row max and sum out."""
    qk, q_, k_, steps = _sweep_sums(Sq, Skv, qb, kvb, causal, window)
    H = B * N
    mk = 0.0
    if mask_rc is not None:       # the mask's rows (a broadcast row: once per core side) over its columns or steps
        mr, mc = mask_rc
        mk = float((qk if mc else q_) if mr else (2 if split else 1) * (k_ if mc else steps))
    qk, q_, k_ = float(qk), float(q_), float(k_)
    b = {"GM->L1": H * (Sq * D + k_ * (D + Dv)) * isz, "GM->L0A": H * qk * isz,
         "UB->GM": H * (qk * isz + Sq * Dv * isz), "GM->UB": H * mk * msz}
    if drop:
        b["GM->UB"] += H * drop_bytes(Sq, Skv, qb, kvb, causal, window)
    if split:
        b["L0C->GM"] = H * (qk + q_ * Dv) * 4
        b["GM->UB"] += H * (qk + q_ * Dv) * 4
    if return_probs or return_stats:
        b["UB->GM"] += H * 2 * Sq * 4
    if return_probs:
        b["GM->L1"] += H * (Sq * D + k_ * D) * isz
        b["UB->GM"] += H * Sq * Skv * isz
        b["GM->UB"] += H * (2 * Sq * 4 + (qk * 4 if split else 0) + mk * msz)
        if split:
            b["L0C->GM"] += H * qk * 4
    return {k: float(v) for k, v in b.items() if v}


@cached
def _sweep_sums(Sq, Skv, qb, kvb, causal, window=0):
    """The main sweep's (score elements, query rows over steps, key columns over steps, steps) of one head, as
    integers: :func:`gm_bytes` of every launch of this geometry scales them."""
    qe, ke, lo, hi = _attended(Sq, Skv, qb, kvb, causal, window)
    cum = np.concatenate([[0], ke.cumsum()])                  # key columns of the first j tiles
    cols, nt = cum[hi] - cum[lo], hi - lo                       # per query block: key columns, tiles
    return int((qe * cols).sum()), int((qe * nt).sum()), int(cols.sum()), int(nt.sum())


def _attended(Sq, Skv, qb, kvb, causal, window=0):
    """Per query block its rows, per KV tile its keys, and per query block the first and one past the last
    KV tile it attends (:func:`_spans`)."""
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    qe = np.minimum(qb, Sq - np.arange(nq) * qb)
    ke = np.minimum(kvb, Skv - np.arange(nkv) * kvb)
    lo, hi = _spans(qb, kvb, Sq, Skv, causal, window)
    return qe, ke, lo, hi


@cached
def drop_bytes(Sq, Skv, qb, kvb, causal, window=0):
    """Dropout keep-mask bytes one head's attended tiles read: ``ceil(kext / 8)`` a row per tile."""
    qe, ke, lo, hi = _attended(Sq, Skv, qb, kvb, causal, window)
    cum8 = np.concatenate([[0], (-(-ke // 8)).cumsum()])
    return float((qe * (cum8[hi] - cum8[lo])).sum())


def _model(dev, specs, mask, causal, t, counts, return_probs, drop=False, return_stats=False, extra_passes=0,
           sinks=None, window=0, bound=False, kinds=None):
    """(core cycles, HBM bytes, bytes per GM path, busy cycles per unit, workspace bytes) of tiling ``t``.
    ``extra_passes``: Vector passes per score beyond the plain ones (the soft-cap's, a per-head scale's 16-bit
    roundings: :func:`estimate_flash_attention` counts them). With
    ``bound``, a lower bound of the cycles (see :func:`_search`): a short launch's replay replaced by each core's fill,
    steps at their kinds' units that no port wait touches and item ends; the dirty workspaces and the probabilities
    sweep left out (busy is None). ``kinds``: a dict the caller keeps for the tiling, where a short launch's step kinds
    priced alone are kept (its bound and its model price the same kinds alike: the search bounds it, then models it)."""
    B, N, Sq, D, Nkv, Skv, Dv, dtype = launch_dims(specs)
    isz = itemsize(dtype)
    split = dev.arch == "split"
    qb, kvb, vq = t["q"], t["kv"], t["vq"]
    nh = 2 if split else 1
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    n, T, items, q_cores = _schedule(B, N, nq, nkv, causal, Sq, Skv, qb, kvb, dev.cube_cores, window)
    k0f = dev.cube_k0[dtype]
    rate = dev.rates
    L2bw, HBMbw = dev.l2_bytes_per_cycle, dev.hbm_bytes_per_cycle

    # average extents of a tile (edges included)
    ke = Skv / nkv
    if causal:
        ke = min(ke, kvb)
    # work of one step: the busiest core's query blocks (causal: full ones; otherwise as dealt, edge
    # blocks included)
    qe = min(qb, Sq) if causal else _busiest_rows(B * N, Sq, qb, n)
    passes = 5 + (1 if dtype != F32 else 0) + extra_passes + mask_passes(mask)
    single_mask = dict(counts).get("mask", 2) < 2 if counts is not None else False
    msz = 0
    if mask is not None:
        msz = itemsize(mask[1])
    if drop:
        passes += 1                                   # select by the keep bits
    part = 0.0
    if window:                                        # a window's tiles crossing the diagonal or its left edge
        total, diag, edge = _band_tiles(Sq, Skv, qb, kvb, window)
        part = (diag + edge) / total
    elif causal:                                      # tiles crossing the diagonal: ceil(q/kv) per item
        part = min(1.0, ceil_div(qb, kvb) / max(1.0, T / max(1, items)))

    # K/V: cores on the same head at the same step share a tile (one miss, the rest hit)
    group = N // Nkv
    same_head = max(1, min(n, nq * group))
    uniq = ceil_div(n, same_head)
    heads_in_flight = uniq
    kv_res = heads_in_flight * Skv * (D + Dv) * isz + n * 2 * qb * kvb * isz * (3 if split else 1) <= dev.l2_bytes
    kv_unique = B * Nkv * Skv * (D + Dv) * isz
    kv_reads = kv_unique if kv_res else kv_unique * max(1, ceil_div(nq, max(1, n // max(1, uniq))))
    miss_per_step = kv_reads / T
    mask_miss = 0.0
    if mask is not None:
        mshape = (1,) * (4 - len(mask[0])) + tuple(mask[0])
        mask_unique = math.prod(mshape) * msz
        reps = B * N / max(1, (mshape[0] if mshape[0] > 1 else 1) * (mshape[1] if mshape[1] > 1 else 1))
        if (causal or window) and mshape[2] != 1 and mshape[3] != 1:
            # a causal walk (or a window's band) loads the mask of its attended tiles only: the rest is never read
            mask_unique *= _sweep_sums(Sq, Skv, qb, kvb, bool(causal), window)[0] / (Sq * Skv)
        mask_miss = mask_unique * (1 if mask_unique <= dev.l2_bytes // 2 else reps) / T

    def price(qe, ke, part, amortized=True, qc=None):
        """One step of ``qe`` query rows over a ``ke``-key tile (``part``: the share of such steps crossing
        the diagonal or the window's edge), as the busiest unit or the software pipeline's loop sets it; and
        the item's end and the launch's fill for items of ``qe`` rows. The cores' transfers in one instruction
        share the chip's bandwidth: each waits for the chip's bytes, ``qc`` rows a core (default ``qe``). The
        units also hold what the replayed deal (:func:`replay_time`) needs to price the step again with a core's
        own K/V port wait."""
        qc = qe if qc is None else qc
        rvc = qc / nh
        rv = qe / nh                                  # rows per vector core
        nsub = max(1, ceil_div(int(rv), vq))
        rr = rv * math.ceil(ke / 64)
        stat = nsub * math.ceil(vq / 64)
        vec = rr * passes + rr * part * 2 + stat * 5 + 2 * rv * math.ceil(Dv / 64)
        vec_last = rv * math.ceil(Dv / 64) * (2 if dtype != F32 else 1)
        cube_s = ceil_div(int(qe), 16) * ceil_div(D, k0f) * ceil_div(int(math.ceil(ke)), 16)
        cube = cube_s + nh * ceil_div(int(rv), 16) * ceil_div(int(math.ceil(ke)), k0f) * ceil_div(Dv, 16)
        mte1 = D * _r16(ke) * isz / rate["L1->L0B"] + _r16(ke) * Dv * isz / rate["L1->L0B"]
        q_move = _r16(qe) * D * isz / rate["L1->L0A"]
        kvt = ke * (D + Dv) * isz
        port_kv = max(0.0, n * kvt - miss_per_step) / L2bw + miss_per_step / HBMbw
        mte2_kv = max(kvt / rate["GM->L1"], port_kv)
        # P round trip through the L2 workspace
        p_b = qe * ke * isz
        port_p = 2 * n * qc * ke * isz / L2bw
        mte2_p = max(p_b / rate["GM->L0A"], port_p / 2)
        mte3 = max(rv * ke * isz / rate["UB->GM"], nh * n * rvc * ke * isz / L2bw)
        port_mask = mte2_mask = 0.0
        if mask is not None:
            mask_b = rv * ke * msz
            port_mask = max(0.0, n * nh * rvc * ke * msz - mask_miss) / L2bw + mask_miss / HBMbw
            mte2_mask = max(mask_b / rate["GM->UB"], port_mask)
        if drop:                                      # keep bits: read once each, from HBM
            drop_b = rv * math.ceil(ke / 8)
            port_drop = n * nh * rvc * math.ceil(ke / 8) / HBMbw
            port_mask += port_drop
            mte2_mask += max(drop_b / rate["GM->UB"], port_drop)
        if split:
            s_b = qe * ke * 4
            fix = max(s_b / rate["L0C->GM"], n * qc * ke * 4 / L2bw) \
                + max(qe * Dv * 4 / rate["L0C->GM"], n * qc * Dv * 4 / L2bw)
            vec_mte2 = (max(rv * ke * 4 / rate["GM->UB"], 2 * n * rvc * ke * 4 / L2bw)
                        + max(rv * Dv * 4 / rate["GM->UB"], 2 * n * rvc * Dv * 4 / L2bw) + mte2_mask)
            cube_mte2 = mte2_kv + mte2_p
            cube_port = port_kv + port_p / 2 + n * qc * (ke + Dv) * 4 / L2bw
            vec_port = port_mask + 2 * n * rvc * (ke + Dv) * 4 / L2bw + nh * n * rvc * ke * isz / L2bw
        else:
            fix = qe * ke * 4 / rate["L0C->UB"] + qe * Dv * 4 / rate["L0C->UB"]
            cube_mte2 = mte2_kv + mte2_p + mte2_mask
            cube_port = port_kv + port_p + port_mask
            vec_mte2 = vec_port = 0.0
        # P has a single UB tile: the next softmax waits until MTE3 has stored P, so on the vector side a step
        # is the softmax, the O update and the P store in series.
        upd = 2 * rv * math.ceil(Dv / 64)
        vec_chain = (vec - upd) + max(upd, mte3)
        if mask is not None and single_mask:
            # one UB tile of the mask (a wide one, fp32 over 16-bit operands): the next step's mask load waits
            # until this step's passes, one instruction, have read it, and those passes wait for the load
            vec_chain += mte2_mask
        # Q of each item, on the same MTE2 queue; the first items' Q (the fill) come from every core at once,
        # later ones from the ``q_cores`` cores starting an item in the same step
        q_load = max(qe * D * isz / rate["GM->L1"], n * qc * D * isz / HBMbw)
        q_next = max(qe * D * isz / rate["GM->L1"], q_cores * qc * D * isz / HBMbw)
        if amortized:                                 # the busiest core's Q loads, spread over its steps
            cube_mte2 += q_next * items / T
            cube_port += q_cores * qc * D * isz / HBMbw * items / T
        # The software pipeline's feedback loop spans two steps: softmax(s) -> P out -> P into L0A -> P·V(s),
        # and the in-order Cube computes S(s+2) only after P·V(s) -> S(s+2) to the vector side -> softmax(s+2).
        if split:
            s_hand = max(vq * ke * 4 / rate["L0C->GM"], n * vq * ke * 4 / L2bw) \
                + max(vq * ke * 4 / rate["GM->UB"], 2 * n * vq * ke * 4 / L2bw)
        else:
            s_hand = vq * ke * 4 / rate["L0C->UB"]
        loop = (vec - upd) + mte3 + mte2_p + cube + s_hand + mte2_mask * (1 if split else 0)
        fixed = max(cube, mte1, vec_mte2, vec_port, fix, vec_chain)      # the units K/V port waits do not touch
        step = max(fixed, cube_mte2, cube_port, loop / 2)
        # per item: the Q load ahead of its first S, and after its last tile out = O / l and the output store
        out_b = rv * Dv * isz
        port_out = n * nh * rvc * Dv * isz / HBMbw
        out_store = nsub * max(out_b / nsub / rate["UB->GM"], port_out / nsub)
        # item end: out = O / l block by block, each block's store before the next block's cast (the last
        # store overlaps the next item); the next item's Q load then holds the GM port ahead of its S
        # (on split cores, when the AIC's GM traffic sets the step, the Q loads are already in its share)
        q_exposed = 0.0 if split and max(cube_mte2, cube_port) >= step else q_next
        # out = O / l runs while the vector side waits for the last P store (the step's MTE3 beyond its O update)
        end = max(0.0, vec_last - max(0.0, mte3 - upd)) + out_store * (nsub - 1) / nsub
        fill = q_load + q_move + mte2_kv + mte1 + cube + fix
        return step, end, q_exposed, fill, {"cube": cube, "mte1": mte1, "mte2": max(cube_mte2, vec_mte2),
                                      "fixpipe": fix, "vector": vec, "mte3": mte3, "out": out_b, "rows": rv,
                                      "loop": loop, "vport": vec_port, "port_kv": port_kv,
                                      "kv_xfer": kvt / rate["GM->L1"], "mte2_rest": cube_mte2 - mte2_kv,
                                      "port_rest": cube_port - port_kv,
                                      "fixed": fixed,
                                      "q_load": q_load, "upd": upd, "q_xfer": qe * D * isz / rate["GM->L1"]}

    def kinds_priced(kk):
        """The main sweep's step kinds (:func:`_launch_kinds`) each priced alone, at the launch's mean query rows per
        step, as :func:`kind_table` (once per tiling when ``kinds`` is given)."""
        if kinds is not None and "priced" in kinds:
            return kinds["priced"]
        per = kind_table([price(qe_, ke_, float(m_), False, qc=kk.qc) for qe_, ke_, m_ in kk.kinds])
        if kinds is not None:
            kinds["priced"] = per
        return per

    short_bound = bound and B * N * nq <= REPLAY_UNITS
    if not short_bound:                               # (a short launch's bound prices its step kinds only)
        step, end, q_exposed, fill, u = price(qe, ke, part)
    if short_bound:
        # each core's time is at least its first item's fill (its Q load at the core's own transfer time), its steps
        # at their kinds' units that no port wait touches and its items' ends (from the deal, without the replay)
        kk = _launch_kinds(nq, nkv, Sq, Skv, qb, kvb, causal, window)
        deal = _core_deal(B, N, nq, nkv, Sq, Skv, qb, kvb, causal, dev.cube_cores, False, window)
        nc, nk = len(deal.per), len(kk.kinds)
        core_of = np.arange(nc).repeat(deal.per)
        steps = np.bincount(core_of * nq + deal.qi, minlength=nc * nq).reshape(nc, nq) @ kk.block
        ends = np.bincount(core_of * nk + kk.last[deal.qi], minlength=nc * nk).reshape(nc, nk)
        per = kinds_priced(kk)
        fill_k = per["fill"] - per["q_load"] + per["q_xfer"]
        core = float((fill_k[kk.first[deal.qi[deal.per.cumsum() - deal.per]]] + (steps * per["fixed"]).sum(1)
                      + (ends * per["end"]).sum(1)).max())
    elif B * N * nq <= REPLAY_UNITS:                  # few units: each core's own steps, priced by their extents
        # (each step kind priced with the launch's mean transfers, then again with each core's own K/V port wait)
        tal = _core_tallies(B, N, nq, nkv, Sq, Skv, qb, kvb, causal, dev.cube_cores, window, group)
        per = kinds_priced(_launch_kinds(nq, nkv, Sq, Skv, qb, kvb, causal, window))     # (tal's kinds and qc)
        kvport = None
        if kv_res:            # each core's own K/V port wait per step, from the instructions it shares
            kvport = np.divide((tal.hit / L2bw + tal.miss / HBMbw) * ((D + Dv) * isz), tal.counts,
                               out=np.zeros(tal.hit.shape), where=tal.counts > 0)
        core = replay_time(tal, per, kvport, D * isz / HBMbw, Dv * isz / HBMbw, split)
    else:
        core = fill + T * step + items * (end + q_exposed)
    stats = return_probs or return_stats
    if return_probs and not bound:
        pc, ph, pbusy = _probs_sweep(dev, B, N, Nkv, Sq, Skv, D, dtype, mask, causal, t, n, kv_unique, group,
                                     extra_passes, window)
        core += pc

    # HBM: q, K/V (unique, re-read when evicted), mask, out, dirty workspaces at the end
    hbm = B * N * Sq * D * isz + kv_reads + B * N * Sq * Dv * isz
    if mask is not None:
        hbm += mask_miss * T
    if drop:
        hbm += B * N * drop_bytes(Sq, Skv, qb, kvb, bool(causal), window)
    if sinks is not None:                              # the sink logits: each read once from HBM
        hbm += math.prod(sinks[0]) * itemsize(sinks[1])
    if bound:
        hbm_ws = 0.0
    elif B * N * nq <= REPLAY_UNITS:                  # few units: replay the deal (cheap enough)
        hbm_ws = _dirty_exact(split, B, N, Sq, Skv, qb, kvb, vq, Dv, isz, causal, dev.cube_cores,
                              bool(return_probs), window)
    else:
        hbm_ws = _dirty_workspaces(split, n, T, B, N, Sq, Skv, qb, kvb, vq, Dv, isz, causal)
    ws = hbm_ws
    hbm += ws
    if return_probs:
        hbm += 0.0 if bound else ph
    elif return_stats:
        hbm += 2 * B * N * Sq * 4
    mask_rc = None
    if mask is not None:
        m4 = (1,) * (4 - len(mask[0])) + tuple(mask[0])
        mask_rc = (m4[2] != 1, m4[3] != 1)
    nbytes = dict(gm_bytes(B, N, Sq, Skv, D, Dv, isz, qb, kvb, bool(causal), split, mask_rc, msz,
                           bool(return_probs), bool(drop), bool(return_stats), window))
    if sinks is not None:
        # each vector core loads its item's sink logit at the item's first step (bytes only: a few per item)
        nbytes["GM->UB"] = nbytes.get("GM->UB", 0.0) + float(B * N * nq * nh * itemsize(sinks[1]))
    if bound:
        return core, float(hbm), nbytes, None, 0
    # GM workspace: two P slots per core (split cores: also S and O_j, fp32); with return_probs the row
    # max and sum of the first sweep
    ws_bytes = n * 2 * qb * kvb * isz + (n * 2 * qb * (kvb + Dv) * 4 if split else 0) \
        + (2 * B * N * Sq * 4 if return_probs else 0)
    busy = {k: T * u[k] for k in ("cube", "mte1", "mte2", "fixpipe", "vector", "mte3")}
    stats_b = u["rows"] * 4                           # one vector core's rows of max (and of sum)
    busy["mte3"] += items * (u["out"] + (2 * stats_b if stats else 0)) / rate["UB->GM"]
    if return_probs:
        for k, c in pbusy.items():
            busy[k] += c
    return core, float(hbm), nbytes, busy, ws_bytes


class Kinds(NamedTuple):
    """The main sweep's step kinds (:func:`_launch_kinds`); arrays shared through the cache: read only. ``kinds[k]`` =
    (query rows, KV extent, masked); ``code[qi, j]`` the kind of block ``qi``'s step on KV tile ``j`` (where it walks
    it); per block, ``block[qi, k]`` its steps of kind k, ``first`` and ``last`` its first and last step's kind;
    ``qc`` the launch's mean query rows per step."""
    kinds: tuple
    code: np.ndarray
    block: np.ndarray
    first: np.ndarray
    last: np.ndarray
    qc: float


@cached
def _launch_kinds(nq, nkv, Sq, Skv, qb, kvb, causal, window=0) -> Kinds:
    """The main sweep's step kinds, per query block, before any deal: a step's kind is its block's query rows (full
    or edge), its KV tile's extent (full or edge) and whether the tile is masked; the kinds present are numbered in
    that order."""
    lo, hi = _spans(qb, kvb, Sq, Skv, causal, window)
    L = hi - lo
    qeb, kext, masked = _tile_kinds(nq, nkv, Sq, Skv, qb, kvb, causal, window)
    j = np.arange(nkv)[None, :]
    kcode = ((qeb != qeb[0])[:, None] * 2 + (kext != kext[0])[None, :]) * 2 + masked
    walked = (lo[:, None] <= j) & (j < hi[:, None])
    present = np.bincount(kcode[walked], minlength=8) > 0
    uniq = present.nonzero()[0]
    tcode = (present.cumsum() - 1)[kcode]
    nk = len(uniq)
    block = np.bincount((np.arange(nq)[:, None] * nk + tcode)[walked], minlength=nq * nk).reshape(nq, nk)
    qi = np.arange(nq)
    qes, kes = (int(qeb[0]), int(qeb[-1])), (int(kext[0]), int(Skv - (nkv - 1) * kvb))
    kinds = tuple((qes[c_ >> 2], kes[(c_ >> 1) & 1], bool(c_ & 1)) for c_ in uniq.tolist())
    return Kinds(kinds, tcode, block, tcode[qi, lo], tcode[qi, hi - 1], float((qeb * L).sum() / L.sum()))


@cached
def kind_steps(nq, nkv, Sq, Skv, qb, kvb, causal, window=0):
    """``(kinds, steps)``: :func:`_launch_kinds`'s ``kinds`` and each one's steps over all query blocks (its
    ``block.sum(0)``, as ints), counted block by block in closed form. The tiling searches' bounds need only these
    totals; ``_launch_kinds`` builds the (blocks x tiles) code arrays for them, which costs more than the bound's
    other work on a launch of few blocks. Per block the masked tiles of its walk ``[lo, hi)`` are two ranges
    (:func:`_tile_kinds`): from the first tile reaching past its first row's diagonal, ``(q0 + 1) // kvb`` (causal,
    unless its first row sees every key), and up to the last one holding the window's left edge,
    ``(q0 + qe - 1 - window) // kvb``; the edge KV tile (when its extent differs) is a kind of its own."""
    lo, hi = _spans(qb, kvb, Sq, Skv, causal, window)
    q_full, k_full, k_last = min(qb, Sq), min(kvb, Skv), Skv - (nkv - 1) * kvb
    j_edge = nkv - 1 if k_last != k_full else -1     # the KV tile of edge extent, if any
    steps = [0] * 8                                  # by code ((query edge · 2 + KV edge) · 2 + masked)
    for qi, (l, h) in enumerate(zip(lo.tolist(), hi.tolist())):
        q0 = qi * qb
        qe = min(q0 + qb, Sq) - q0
        qbit = 4 if qe != q_full else 0
        jc = (q0 + 1) // kvb if causal and Skv - 1 > q0 else h          # masked from jc on
        jw = (q0 + qe - 1 - window) // kvb if causal and window else -1  # and up to jw
        a0, b1 = max(l, jc), min(h, jw + 1)
        masked = max(0, h - a0) + max(0, b1 - l) - max(0, b1 - a0)
        plain = h - l - masked
        if l <= j_edge < h:                          # the edge tile moves to its own kinds
            if j_edge >= jc or j_edge <= jw:
                masked -= 1
                steps[qbit + 2 + 1] += 1
            else:
                plain -= 1
                steps[qbit + 2] += 1
        steps[qbit] += plain
        steps[qbit + 1] += masked
    qes, kes = (q_full, Sq - (nq - 1) * qb), (k_full, k_last)
    codes = [c for c in range(8) if steps[c]]
    return tuple((qes[c >> 2], kes[(c >> 1) & 1], bool(c & 1)) for c in codes), tuple(steps[c] for c in codes)


class Tally(NamedTuple):
    """The main sweep replayed core by core (:func:`_core_tallies`); arrays shared through the cache: read only.
    Per core ``c`` and step kind ``k`` (``kinds[k]`` = (query rows, KV extent, masked)): ``counts`` steps, ``hit`` and
    ``miss`` the K/V rows their loads wait for on the GM port (summed), ``ends`` items ending on such a step;
    ``pairs[c, k1, k2, p]`` consecutive steps (k1 at an even (p = 0) or odd position, then k2); ``first[c]`` its
    first step's kind; ``q0`` the rows of the first Q loads' instruction; ``last_out[c]`` the rows of the instruction
    storing its last output. Each later item's start: its core ``sc``, first step's kind ``sk``, the rows of the
    output store before it ``so`` and of its Q load's instruction ``sq`` (all cores'). ``qc``: the launch's mean
    query rows per step."""
    kinds: tuple
    counts: np.ndarray
    hit: np.ndarray
    miss: np.ndarray
    ends: np.ndarray
    pairs: np.ndarray
    first: np.ndarray
    q0: float
    last_out: np.ndarray
    sc: np.ndarray
    sk: np.ndarray
    so: np.ndarray
    sq: np.ndarray
    qc: float


@cached
def _core_tallies(B, N, nq, nkv, Sq, Skv, qb, kvb, causal, ncores, window=0, group=1) -> Tally:
    """The main sweep's steps as the kernel deals them (:func:`_core_deal`), every core's, step by step. The cores
    issue step s of their lists as one instruction. K/V (with every tile staying in L2 once read): a tile first
    read at step s is missed once, the cores reading it with the first wait for it, the instruction's hits go
    through L2 together; a core waits for the instruction's hits unless it is the one missing its whole tile, and
    for its misses when its tile is one of them. A Q load or an output store waits for all its instruction's
    rows from (to) HBM."""
    U_qi, U_bh, ulen = _core_deal(B, N, nq, nkv, Sq, Skv, qb, kvb, causal, ncores, False, window)
    n = len(ulen)
    # per query block: its tiles and their extents, and its steps' kinds
    lo, hi = _spans(qb, kvb, Sq, Skv, causal, window)
    L = hi - lo
    qeb, kext, _ = _tile_kinds(nq, nkv, Sq, Skv, qb, kvb, causal, window)
    kk = _launch_kinds(nq, nkv, Sq, Skv, qb, kvb, causal, window)
    nk = len(kk.kinds)
    # units (items) in core order, then their steps
    U_core = np.arange(n).repeat(ulen)
    U_L = L[U_qi]
    cum = U_L.cumsum() - U_L
    core_last = ulen.cumsum() - 1
    core_first = core_last + 1 - ulen
    U_s0 = cum - cum[core_first].repeat(ulen)
    U_s1 = U_s0 + U_L - 1
    T = int(U_s1.max()) + 1
    total = int(U_L.sum())
    S_unit = np.arange(len(U_qi)).repeat(U_L)
    S_idx = np.arange(total) - cum.repeat(U_L)
    S_s = U_s0[S_unit] + S_idx
    S_c = U_core[S_unit]
    S_qi = U_qi[S_unit]
    S_j = lo[S_qi] + S_idx                            # the step's KV tile
    S_code = kk.code[S_qi, S_j]
    S_ke = kext.astype(float)[S_j]
    kvh = U_bh if group == 1 else (U_bh // N) * (N // group) + (U_bh % N) // group      # the K/V head
    S_key = kvh[S_unit] * nkv + S_j
    # K/V: the first reading of each tile, in instruction order (step, then core); T * n is after every instruction
    at = S_s * n + S_c
    first = np.full(B * (N // group) * nkv, T * n)
    np.minimum.at(first, S_key, at)
    first = first[S_key]
    whole = first == at                                             # the reading that misses the whole tile
    missed = first // n == S_s                                      # a reading of a tile missed in its instruction
    M = np.bincount(S_s[whole], weights=S_ke[whole], minlength=T)   # rows each instruction misses
    H = np.bincount(S_s, weights=S_ke, minlength=T) - M             # and hits
    slot = S_c * nk + S_code
    size = n * nk
    hit = np.bincount(slot, weights=np.where(whole, 0.0, H[S_s]), minlength=size).reshape(n, nk)
    miss = np.bincount(slot, weights=np.where(missed, M[S_s], 0.0), minlength=size).reshape(n, nk)
    counts = np.bincount(slot, minlength=size).reshape(n, nk).astype(float)
    ends = np.bincount(U_core * nk + kk.last[U_qi], minlength=size).reshape(n, nk).astype(float)
    same = S_c[1:] == S_c[:-1]
    pslot = (slot[:-1] * nk + S_code[1:]) * 2 + S_s[:-1] % 2
    pairs = np.bincount(pslot[same], minlength=size * nk * 2).reshape(n, nk, nk, 2).astype(float)
    # Q loads and output stores: the rows of each instruction
    U_qe = qeb[U_qi].astype(float)
    qrows = np.bincount(U_s0, weights=U_qe, minlength=T)
    orows = np.bincount(U_s1, weights=U_qe, minlength=T)
    idx = U_s0.nonzero()[0]                 # the units after their core's first (each unit takes a step at least)
    return Tally(kk.kinds, counts, hit, miss, ends, pairs, kk.first[U_qi[core_first]], float(qrows[0]),
                 orows[U_s1[core_last]], U_core[idx], kk.first[U_qi[idx]], orows[U_s1[idx - 1]], qrows[U_s0[idx]],
                 kk.qc)


KIND_UNITS = ("port_kv", "kv_xfer", "mte2_rest", "port_rest", "loop", "fixed", "q_load", "q_xfer", "vector", "upd",
              "vport")


def kind_table(priced) -> dict:
    """The step kinds priced with the launch's mean transfers (``priced[k]``: step, item end, next item's Q load,
    fill, units) as arrays over the kinds: their units' :data:`KIND_UNITS`, ``fill`` and ``end``. Read only."""
    table = np.array([[p[4][c_] for c_ in KIND_UNITS] + [p[3], p[1]] for p in priced]).T
    return dict(zip(KIND_UNITS + ("fill", "end"), table))


def replay_time(tal: Tally, per, kvport, q_row, out_row, split) -> float:
    """The slowest core's cycles from the replayed sweep (:func:`_core_tallies`) and each step kind priced with the
    launch's mean transfers (``per``: :func:`kind_table`): per core, the fill of its first item, each step again with
    its own K/V port wait (``kvport[c, k]`` cycles a step, or None for the launch's mean), each item's end and each
    later item's start. A Q load or an output store waits for its instruction's rows from HBM, ``q_row`` and
    ``out_row`` cycles a row."""
    P = per["port_kv"][None, :] if kvport is None else kvport
    cube_mte2 = np.maximum(per["kv_xfer"], P) + per["mte2_rest"]
    cube_port = P + per["port_rest"]
    loop = per["loop"]
    other = np.maximum(per["fixed"], np.maximum(cube_mte2, cube_port))
    step = np.maximum(other, loop / 2)
    counts = tal.counts
    # the software pipeline's loop spans two steps: steps s and s + 1 together last at least loop(s); summed over
    # disjoint windows (s even, or s odd) that bounds the core's steps beyond each step's own busiest unit (what
    # loop / 2 a step takes on average: the two sums differ when long and short steps alternate)
    extra = np.maximum(0.0, loop[None, :, None] - other[:, :, None] - other[:, None, :])
    loops = (tal.pairs * extra[..., None]).sum(axis=(1, 2))
    body = np.maximum((counts * step).sum(1), (counts * other).sum(1) + loops.max(1))
    f = tal.first
    fill = per["fill"][f] - per["q_load"][f] + np.maximum(per["q_xfer"][f], tal.q0 * q_row)
    ends = (tal.ends * per["end"][None, :]).sum(1)
    # a later item's start: its Q load (split cores: hidden when the AIC's GM traffic sets the step); on a coupled
    # core the output store before it holds the MTE3 queue, ahead of the P store after the next softmax
    sc, sk = tal.sc, tal.sk
    q = np.maximum(per["q_xfer"][sk], tal.sq * q_row)
    if split:
        q = np.where(np.maximum(cube_mte2, cube_port)[sc, sk] >= step[sc, sk], 0.0, q)
    else:
        q = q + np.maximum(0.0, tal.so * out_row - (per["vector"] - per["upd"])[sk])
    n = len(counts)
    t = fill + body + ends + np.bincount(sc, weights=q, minlength=n)
    # each side's GM port (one on a coupled core) serves its transfers one after another: its busy time bounds it
    aic = tal.q0 * q_row + (counts * cube_port).sum(1) + np.bincount(sc, weights=tal.sq * q_row, minlength=n)
    out = np.bincount(sc, weights=tal.so * out_row, minlength=n) + tal.last_out * out_row
    aiv = (counts * per["vport"][None, :]).sum(1) + out
    port = np.maximum(aic, aiv) if split else aic + aiv
    return float(np.maximum(t, port).max())


def _probs_sweep(dev, B, N, Nkv, Sq, Skv, D, dtype, mask, causal, t, n, kv_unique, group, extra_passes=0,
                 window=0):
    """The return_probs sweep (``probs_sweep`` in the kernel): once every row's max and sum are final (stored
    at the end of the first sweep), each (item, KV tile) step recomputes S = Q·K_jᵀ, runs scale, [mask],
    [causal], sub, exp, mul 1/l, [cast] over it and stores the normalised P tile to GM (every KV tile of an
    item: tiles above a causal diagonal are a ``dup 0`` and the same store). No V, no P·V, no O update.

    A step lasts as long as its busiest unit; the P tile is single-buffered in UB, so on the vector side a
    step is the vector passes then the MTE3 store in series. The stores go through to HBM: with many cores
    they are bound by the chip's HBM bandwidth. Returns (cycles, HBM bytes, busy cycles per unit).
    """
    isz = itemsize(dtype)
    split = dev.arch == "split"
    qb, kvb, vq = t["q"], t["kv"], t["vq"]
    nh = 2 if split else 1
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    rate = dev.rates
    L2bw, HBMbw = dev.l2_bytes_per_cycle, dev.hbm_bytes_per_cycle
    k0f = dev.cube_k0[dtype]
    # every item walks all nkv tiles (skipped ones included); items are dealt round-robin
    n2, T2, items2 = _deal([[nkv]] * nq, B * N, dev.cube_cores)
    work_frac = 1.0
    if causal:
        lo, hi = _spans(qb, kvb, Sq, Skv, True, window)
        tiles = int((hi - lo).sum())
        work_frac = tiles / (nq * nkv)
    qe = min(qb, Sq)
    rv = qe / nh
    ke = Skv / nkv
    nsub = max(1, ceil_div(int(rv), vq))
    passes = 4 + (1 if dtype != F32 else 0) + extra_passes + mask_passes(mask)
    msz = 0
    if mask is not None:
        msz = itemsize(mask[1])
    rr = rv * math.ceil(ke / 64)
    stat = nsub * math.ceil(vq / 64)
    part = min(1.0, ceil_div(qb, kvb) / max(1.0, nkv * work_frac)) if causal else 0.0
    if window:
        total, diag, edge = _band_tiles(Sq, Skv, qb, kvb, window)
        part = (diag + edge) / total
    vec_work = rr * passes + rr * part * 2 + stat * 3
    vec_skip = rv * math.ceil(ke * isz / 256)                 # dup 0 over the tile, operand dtype
    vec = work_frac * vec_work + (1 - work_frac) * vec_skip
    cube = work_frac * ceil_div(qe, 16) * ceil_div(D, k0f) * ceil_div(int(math.ceil(ke)), 16)
    mte1 = work_frac * D * _r16(ke) * isz / rate["L1->L0B"]
    kt_b = ke * D * isz
    # K: shared by the cores on the same head (one read, the rest L2 hits); re-read from HBM when the
    # first sweep's traffic and the probabilities written so far pushed it out of L2
    probs_b = B * N * Sq * Skv * isz
    resident = kv_unique + probs_b + B * N * Sq * D * isz <= dev.l2_bytes
    k_unique = B * Nkv * Skv * D * isz
    q_bytes = B * N * Sq * D * isz
    same_head = max(1, min(n2, nq * group))
    k_miss = 0.0 if resident else k_unique * max(1, ceil_div(nq, max(1, n2 // max(1, ceil_div(n2, same_head)))))
    q_miss = 0.0 if resident else q_bytes
    port_k = work_frac * (max(0.0, n2 * kt_b - k_miss / T2) / L2bw) + k_miss / T2 / HBMbw
    mte2 = max(work_frac * kt_b / rate["GM->L1"], port_k)
    q_load = max(qe * D * isz / rate["GM->L1"], n2 * qe * D * isz / (L2bw if resident else HBMbw))
    mte2 += q_load * items2 / T2
    # the probabilities tile: UB -> GM, written through to HBM
    p_b = rv * ke * isz
    store = max(p_b / rate["UB->GM"], n2 * nh * p_b / HBMbw)
    mask_b = rv * ke * msz
    mte2_mask = work_frac * max(mask_b / rate["GM->UB"], n2 * nh * mask_b / L2bw) if mask is not None else 0.0
    if split:
        s_b = qe * ke * 4
        fix = work_frac * max(s_b / rate["L0C->GM"], n2 * s_b / L2bw)
        vmte2 = work_frac * max(rv * ke * 4 / rate["GM->UB"], 2 * n2 * rv * ke * 4 / L2bw) + mte2_mask
        s_hand = max(vq * ke * 4 / rate["L0C->GM"], n2 * vq * ke * 4 / L2bw) \
            + max(vq * ke * 4 / rate["GM->UB"], 2 * n2 * vq * ke * 4 / L2bw)
    else:
        fix = work_frac * qe * ke * 4 / rate["L0C->UB"]
        vmte2 = 0.0
        mte2 += mte2_mask
        s_hand = vq * ke * 4 / rate["L0C->UB"]
    vec_chain = vec + store
    step = max(cube, mte1, mte2, vmte2, fix, vec_chain)
    fill = q_load + kt_b / rate["GM->L1"] + cube + s_hand
    core = fill + T2 * step
    hbm = probs_b + k_miss + q_miss + 2 * B * N * Sq * 4        # P, re-reads, row max and sum stored
    busy = {"cube": T2 * cube, "mte1": T2 * mte1, "mte2": T2 * max(mte2, vmte2), "fixpipe": T2 * fix,
            "vector": T2 * vec, "mte3": T2 * p_b / rate["UB->GM"]}
    return core, float(hbm), busy


def attended_pairs(Sq, Skv, causal, window=0) -> int:
    """The (query, key) pairs attended: all of them; causal, Σ min(i + 1, Skv) over the rows i (a triangle, then
    full rows); with a sliding window, the keys max(0, i - window + 1) .. min(i, Skv - 1) of each row."""
    if not causal:
        return Sq * Skv
    if not window:
        m = min(Sq, Skv)
        return m * (m + 1) // 2 + (Sq - m) * Skv
    i = np.arange(Sq)
    return int(np.maximum(0, np.minimum(i + 1, Skv) - np.maximum(0, i - window + 1)).sum())


def flops(B, N, Sq, Skv, D, Dv, causal, window=0):
    return 2.0 * B * N * attended_pairs(Sq, Skv, causal, window) * (D + Dv)


def _roofline(dev, specs, mask=None, scale=None, causal=False, return_probs=False, tiling=None, drop=False,
              return_stats=False, window=0, **_semantics):
    (qs, dtype), (ks, _), (vs, _) = specs[:3]
    B, N, Sq, D = qs
    Skv, Dv = ks[2], vs[3]
    isz = itemsize(dtype)
    fl = flops(B, N, Sq, Skv, D, Dv, causal, window)
    io = (math.prod(qs) + math.prod(ks) + math.prod(vs) + B * N * Sq * Dv) * isz
    if return_probs:
        io += B * N * Sq * Skv * isz
    if return_stats:
        io += 2 * B * N * Sq * 4
    if mask is not None:
        io += math.prod(mask[0]) * itemsize(mask[1])
    if drop:
        io += B * N * Sq * ceil_div(Skv, 8)
    return max(fl / (2.0 * dev.cube_macs[dtype] * dev.cube_cores), io / dev.hbm_bytes_per_cycle)


@cached
def _search(device, specs, mask, causal, return_probs, drop=False, return_stats=False, extra_passes=0, sinks=None,
            window=0):
    dev = get_device(device)
    (qs, dtype), (ks, _), (vs, _) = specs[:3]
    mask_spec = None
    if mask is not None:
        m4 = (1,) * (4 - len(mask[0])) + tuple(mask[0])
        mask_spec = (mask[1], m4[2] != 1, m4[3] != 1)
    best = None
    sink = sinks is not None
    cands = list(_candidates_cached(dev.name, qs[2], ks[2], qs[3], vs[3], dtype, mask_spec, drop, sink))
    default = kernel_default(dev.name, qs[2], ks[2], qs[3], vs[3], dtype, mask_spec, drop, sink)
    if default is not None and default[0] not in [t for t, _ in cands]:
        cands.append(default)
    # each candidate bounded first (a short launch's replay is most of its model's work), then modelled in the order
    # of its bound until the next bound is above the best found: none of the rest can be cheaper
    # (a long launch's model is cheap: it is modelled first, its bound taken as nothing)
    margin = [1 - DEFAULT_MARGIN if default is not None and t == default[0] else 1.0 for t, _ in cands]
    kinds = [{} for _ in cands]             # per candidate, its step kinds priced (by its bound, for its model)

    def bound(i, t, counts):
        if qs[0] * qs[1] * ceil_div(qs[2], t["q"]) > REPLAY_UNITS:
            return 0.0
        return kernel_cycles(dev, *_model(dev, specs, mask, causal, t, counts, return_probs, drop, return_stats,
                                          extra_passes, sinks, window, bound=True, kinds=kinds[i])[:3]) * margin[i]

    bounds = sorted((bound(i, t, counts), i) for i, (t, counts) in enumerate(cands))
    for low, i in bounds:
        if best is not None and low > best[0] * (1 + ROUNDING):
            break
        t, counts = cands[i]
        res = _model(dev, specs, mask, causal, t, counts, return_probs, drop, return_stats, extra_passes, sinks,
                     window, kinds=kinds[i])
        cost = kernel_cycles(dev, *res[:3]) * margin[i]
        if best is None or (cost, i) < best[:2]:
            best = (cost, i, t, res)
    if best is None:
        raise ValueError(f"flash_attention: no tiling fits {dev.name}")
    return best[2], best[3]


@register("flash_attention", _roofline)
def estimate_flash_attention(dev, specs, mask=None, scale=None, causal=False, return_probs=False, tiling=None,
                             fill=float("-inf"), empty_rows="zero", drop_mask=None, keep_prob=1.0, return_stats=False,
                             softcap=None, sinks=None, window=0, mask_add_dtype=None, head_scale=None,
                             head_scale_dtype=None, logits_dtype=None, fill_in_mask=False):
    """``fill`` and ``empty_rows`` change values, not the work: the masked select writes ``fill`` instead of
    ``-inf`` and the final 1/l picks 0 or NaN for empty rows, in the same passes. ``drop_mask`` (its spec):
    dropout on the probabilities, one keep bit per score read and one select pass (``keep_prob`` only
    scales values). ``return_stats``: the row max and sum written out (see the module docstring). ``softcap``:
    eight more Vector passes per score (``1/c``, tanh, ``c``); its value changes values only. ``sinks`` (their
    spec, ``[N]``): attention sinks, one logit per head loaded at each item's first step into a small UB tile;
    the softmax starts from it instead of ``-inf`` (the same passes). ``window`` (with ``causal``): a sliding window
    of that many keys; the tiles wholly outside the band are skipped and those holding its left edge take a
    compare and a select more, as the diagonal's do. ``mask_add_dtype``: a 16-bit additive mask added in its dtype
    (the scores cast down, the add, the sum cast back up: one Vector pass per score more than its fp32 add).
    ``head_scale``: a per-head factor, the same multiply as the scale (N values loaded: not counted);
    ``head_scale_dtype``: that product in 16 bits, the scores and the product rounded (four passes per score more).
    ``logits_dtype``: eager's 16-bit scores and its 16-bit logits before the softmax, each rounded (four passes per
    score more). ``fill_in_mask`` (an additive mask): its filled entries take the fill, a compare and a select per
    score more."""
    window = int(window or 0)
    drop = drop_mask is not None
    extra = (SOFTCAP_PASSES if softcap is not None else 0) + (HEAD_ROUND_PASSES if head_scale_dtype is not None else 0)
    extra += LOGITS_ROUND_PASSES if logits_dtype is not None else 0
    specs = tuple(specs[:3])
    if len(specs) > 3 and mask is None:
        mask = specs[3]
    mask = with_add_dtype(mask, mask_add_dtype, "flash_attention", bool(fill_in_mask))
    if tiling is None:
        sinks = None if sinks is None else (tuple(sinks[0]), sinks[1])
        t, res = _search(dev.name, specs, mask, bool(causal), bool(return_probs), bool(drop), bool(return_stats),
                         extra, sinks, window)
    else:
        t = {k: int(tiling[k]) for k in ("q", "kv", "vq")}
        m4 = None if mask is None else (1,) * (4 - len(mask[0])) + tuple(mask[0])
        mask_spec = None if mask is None else (mask[1], m4[2] != 1, m4[3] != 1)
        counts = _counts(dev, _requests(dev, specs[0][0][3], specs[2][0][3], specs[0][1], t, mask_spec, bool(drop),
                                        sinks is not None))
        if counts is None or not _valid(dev, t):
            raise ValueError(f"flash_attention tiling {t} does not fit {dev.name}")
        res = _model(dev, specs, mask, bool(causal), t, counts, bool(return_probs), bool(drop), bool(return_stats),
                     extra, sinks, window)
    core, hbm, nbytes, busy, ws_bytes = res
    (qs, _), (ks, _), (vs, _) = specs
    return make("flash_attention", dev, core, hbm, nbytes, busy, dict(t),
                _roofline(dev, specs, mask, causal=causal, return_probs=return_probs, drop=drop, return_stats=return_stats,
                          window=window),
                flops(qs[0], qs[1], qs[2], ks[2], qs[3], vs[3], causal, window), workspace=ws_bytes)


__all__ = ["estimate_flash_attention"]
