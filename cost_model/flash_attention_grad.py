"""FlashAttention backward (``autofuse/npu/kernels/flash_attention_grad.py``): phase by phase, per lockstep step,
the busiest unit or GM port.

The kernel runs four phases one after another (each waits for every core): Dr = rowsum(dO∘O) and the zeroing
of the fp32 dq workspace (vector cores, row blocks round-robin); without saved statistics the row max and
sum recomputed (the forward's first sweep: S = Q·K_jᵀ on the Cube, online max/sum on the Vector); the main
phase, one unit per (batch, kv head, KV block) dealt to the least-loaded core (causal: blocks j and nkv-1-j
paired), each step S and dP on the Cube, P and dS on the Vector, Pd/dS through an L2 workspace back to the
Cube, dV, dK accumulated in L0C, dQ atomically added into the workspace; and the cast of dq (fp16/bf16).

A launch of few items whose Q and K stay in L2 prices the statistics sweep core by core from the forward's deal,
replayed step by step (:func:`_stats_replay`). In the main phase, where the kernel's L0 rings hold one tile, the
Cube and MTE1 run in series (:func:`_l0_period`); where a sequence leaves an edge block, each core's steps are
priced by their own extents (:func:`_core_extents`: dealt round-robin, one core may hold only full KV blocks and
another only the edge one), the port they share at the chip's mean extents.

A step lasts as long as its busiest unit (Cube, MTE1, MTE2, FixPipe, Vector, MTE3) or the core's GM port,
which every transfer of the core shares: a lockstep transfer of ``n`` cores takes ``n·bytes / L2 bandwidth``
on hits and ``n·bytes / HBM bandwidth`` on misses. A transfer holds the port for its hits and then for all
the HBM bytes of that transfer (the first reader's miss of a line other cores share, write-throughs, the
dirty lines its allocations evict), so a phase lasts at least its ports' hit cycles plus the phase's HBM
bytes at HBM bandwidth; but the statistics sweep of a causal launch, whose cores read K tiles at steps of their
own (some hit while others miss, each core waiting for one or the other), lasts at least the larger. On a
coupled core a unit's dK and dV stores take the port at the unit's end, beyond the slack of the steps around it.
A phase adds the latency of its first step (fill). HBM bytes: every input read once (the mask too: its query
heads share its lines), the outputs written through, the Q/dO/K/mask re-reads that miss when the phases' working
sets exceed L2, the dirty lines each phase evicts (L2 is LRU: the oldest lines go first), and the workspaces still
dirty in L2 at the end (written back then, as the simulator does; L2 keeps one line per region written, so the
hand-off slots count every block extent a core wrote into them).
"""
from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import numpy as np

from cost_model.common import ceil_div, itemsize
from cost_model.devices import get_device
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.flash_attention import (REPLAY_UNITS, ROUNDING, SOFTCAP_PASSES, _band_tiles, _core_tallies, _counts,
                                       _overflows, _r16, _spans, attended_pairs, kind_steps, launch_dims, mask_passes,
                                       with_add_dtype)

F32 = "float32"
# the share of the MTE1 moves that the two-step pipeline loop waits for (the rest overlaps the Cube: the
# L0A/L0B rings are double-buffered)
LOOP_MTE1 = 0.5
# the steps whose GM-port slack hides part of a unit's dK and dV stores on a coupled core (calibrated on drawn
# launches: 3 to 6 give the same worst cases, 1 and 2 price 910 launches of short steps over)
STORE_SLACK_STEPS = 4


# ------------------------------------------------------------------------------------------ tiling
def _rings(buf, shapes, dtype):
    out, seen = [], set()
    for sh in shapes:
        if sh not in seen:
            seen.add(sh)
            out.append(("cube", buf, f"{buf}:{sh[0]}x{sh[1]}", sh, dtype, 1, 2))
    return out


def _requests(dev, D, Dv, dtype, t, mask_spec, drop, stats, cap=False):
    """The kernel's buffer requests (restated from it: the model imports nothing from the simulator)."""
    q, kv = t["q"], t["kv"]
    split = dev.arch == "split"
    rows = q // 2 if split else q
    v = [("s", (rows, kv), F32, 1, 2), ("dp", (rows, kv), F32, 1, 2), ("p", (rows, kv), dtype, 1, 2),
         ("ds", (rows, kv), dtype, 1, 2)]
    if mask_spec is not None:
        mdt, mr, mc = mask_spec
        v.append(("mask", (rows if mr else 1, kv if mc else 1), mdt, 1, 2))
    if drop:
        v.append(("drop", (rows, kv // 8), "uint8", 1, 2))
    v += [(x, (rows,), F32, 1, 2) for x in ("m", "l", "dr")]
    if cap:                    # soft-capping: the tanh of each score, kept for its derivative
        v.append(("tcap", (rows, kv), F32, 1, 1))
    if stats:
        v += [(x, (rows,), F32, 1, 1) for x in ("rm", "rl")]
    v += [("pre_do", (q, Dv), dtype, 1, 2), ("pre_o", (q, Dv), dtype, 1, 2), ("pre_d", (q,), F32, 1, 2),
          ("dq32", (rows, D), F32, 1, 2)]
    if dtype != F32:
        v.append(("dqc", (rows, D), dtype, 1, 2))
    if not split:
        v += [("dqs", (q, D), F32, 1, 2), ("dks", (kv, D), dtype, 1, 1), ("dvs", (kv, Dv), dtype, 1, 1)]
    req = [("vec", "UB", name, sh, dt, lo, hi) for name, sh, dt, lo, hi in v]
    req += [("cube", "L1", "k1", (kv, D), dtype, 1, 2), ("cube", "L1", "v1", (kv, Dv), dtype, 1, 1),
            ("cube", "L1", "q1", (q, D), dtype, 2, 2), ("cube", "L1", "do1", (q, Dv), dtype, 2, 2),
            ("cube", "L1", "p1", (rows, kv), dtype, 1, 2), ("cube", "L1", "ds1", (rows, kv), dtype, 1, 2)]
    req += [("cube", "L0C", "dk0", (kv, D), F32, 1, 1), ("cube", "L0C", "dv0", (kv, Dv), F32, 1, 1),
            ("cube", "L0C", "sdp0", (q, kv), F32, 2, 4), ("cube", "L0C", "dq0", (rows, D), F32, 1, 2),
            ("cube", "L0B", "kb0", (kv, D), dtype, 1, 1)]
    req += _rings("L0A", [(q, D), (q, Dv), (kv, rows), (rows, kv)], dtype)
    req += _rings("L0B", [(D, kv), (Dv, kv), (rows, Dv), (rows, D), (kv, D)], dtype)
    return req


@cached
def _tile_counts(device, D, Dv, dtype, q, kv, mask_spec, drop, stats, cap=False):
    """Tiles per buffer request as the kernel grants them, or None when the tiling does not fit."""
    dev = get_device(device)
    return _counts(dev, _requests(dev, D, Dv, dtype, {"q": q, "kv": kv}, mask_spec, drop, stats, cap))


@cached
def _fits(device, D, Dv, dtype, q, kv, mask_spec, drop, stats, cap=False):
    """Whether the tiling's buffers hold its requests' minimum tile counts (as :func:`_tile_counts` checks
    first, without granting the double buffers)."""
    dev = get_device(device)
    return not _overflows(dev, _requests(dev, D, Dv, dtype, {"q": q, "kv": kv}, mask_spec, drop, stats, cap))


@cached
def _tilings(Sq, Skv):
    """The search's tilings, in its order: every (q, kv) block of the kernel's sizes, clamped to the
    sequences (whether they fit is checked by the search)."""
    return [{"q": q, "kv": kv} for q in sorted({min(x, _r16(Sq)) for x in (128, 64, 32, 16)}, reverse=True)
            for kv in sorted({min(x, _r16(Skv)) for x in (256, 128, 64, 32, 16)}, reverse=True)]


# ------------------------------------------------------------------------------------------ schedule
def _deal(base, reps, ncores, owners=False):
    """The kernel's dealer over the units ``base`` (each a list of step counts) repeated ``reps`` times: each
    unit in turn to the least-loaded core (ties: fewer blocks, then the lower index). Returns (cores, steps
    and blocks of the busiest core) and, with ``owners``, each unit's core.

    Equal units go round-robin. Otherwise a heap of one integer per core, ``(steps·K + blocks)·n + core``
    (K above any block count), orders the cores as the tie rule does, and dealing a unit adds its steps and
    blocks to the smallest."""
    units = len(base) * reps
    n = min(ncores, units)
    cost = [(sum(u), len(u)) for u in base]
    if len(set(cost)) == 1:
        per = ceil_div(units, n)
        owner = list(range(n)) * (units // n) + list(range(units % n)) if owners else None
        return (n, per * cost[0][0], per * cost[0][1]), owner
    K = units * max(k for _, k in cost) + 1
    adds = [(w * K + k) * n for w, k in cost]
    heap = list(range(n))
    replace = heapq.heapreplace
    owner = None
    if owners:
        owner = [replace(heap, heap[0] + a) % n for _ in range(reps) for a in adds]
    else:
        for _ in range(reps):
            for a in adds:
                replace(heap, heap[0] + a)
    top = max(heap) // n
    return (n, top // K, max(x // n % K for x in heap)), owner


def _round_robin(nb, equal, causal):
    """Whether ``nb`` blocks of ``equal`` steps are dealt round-robin whichever dealing the kernel takes: single
    blocks always, and causal pairs when there is no middle block (the dealing is then known without dealing)."""
    return equal and (not causal or nb % 2 == 0 or nb == 1)


@cached
def _core_extents(BN, per_block, causal, ncores, edge_rows, edge_keys, mean=False):
    """The main phase's steps on each dealt core by extent, ``[cores, 4]``: (full rows, full keys), (edge rows,
    full keys), (full rows, edge keys), (edge rows, edge keys). Each KV block's unit of ``per_block[j]`` steps
    holds ``edge_rows`` steps of the edge query block (one per query head; 0: none) and the last block's are
    the edge keys' (``edge_keys``). ``mean`` (the search's bound, which does not deal): where the dealing is not
    round-robin (:func:`_schedule_floor`), one row, a lower bound of the dealt cores' mean (the steps over as many
    cores as there are blocks, at most ``ncores``). None, in either mode, for more than REPLAY_UNITS blocks of
    unequal steps, which the dealer would walk one by one (the launch's shares stand in)."""
    nb = len(per_block)
    equal = len(set(per_block)) == 1
    if BN * nb > REPLAY_UNITS and not equal:
        return None
    last = nb - 1 if edge_keys else -1
    if mean and not _round_robin(nb, equal, causal):
        edge = per_block[last] if last >= 0 else 0
        full_blocks = nb - (last >= 0)
        row = [sum(per_block) - edge - edge_rows * full_blocks, edge_rows * full_blocks,
               edge - edge_rows * (last >= 0), edge_rows * (last >= 0)]
        return np.array([row], dtype=float) * (BN / min(ncores, BN * nb))
    (n, _, _), paired = _dealing(BN, per_block, causal, ncores)
    ids = _pair_units(list(range(nb))) if paired else [[j] for j in range(nb)]
    kind = []
    for blocks in ids:
        k = [0, 0, 0, 0]
        for j in blocks:
            e = 2 if j == last else 0
            k[e] += per_block[j] - edge_rows
            k[e + 1] += edge_rows
        kind.append(k)
    units = [[per_block[j] for j in blocks] for blocks in ids]
    # the units in dealing order: the blocks' kinds repeated for each of the BN heads (indexed, not built from a
    # list BN times as long: the same array)
    rows = np.array(kind, dtype=float)[np.arange(len(kind) * BN) % len(kind)]
    if len({(sum(u), len(u)) for u in units}) == 1:     # equal units: round-robin (:func:`_deal`)
        pad = (-len(rows)) % n
        return (np.concatenate([rows, np.zeros((pad, 4))]) if pad else rows).reshape(-1, n, 4).sum(axis=0)
    out = np.zeros((n, 4))
    np.add.at(out, _deal(units, BN, ncores, owners=True)[1], rows)
    return out


def _pair_units(per_block):
    nb = len(per_block)
    return [[per_block[i], per_block[nb - 1 - i]] for i in range(nb // 2)] + ([[per_block[nb // 2]]] if nb % 2 else [])


def _units(per_block, paired):
    """The dealt units: one per block, or blocks i and nb-1-i paired."""
    return _pair_units(per_block) if paired else [[c] for c in per_block]


@cached
def _dealing(BN, per_block, causal, ncores):
    """(cores, lockstep steps, blocks on the busiest core) of units ``per_block`` (steps per block, one unit
    per block, or paired i and nb-1-i under ``causal`` when that finishes no later), repeated for ``BN``
    heads, and whether it pairs."""
    single = _deal(_units(per_block, False), BN, ncores)[0]
    if causal:
        paired = _deal(_units(per_block, True), BN, ncores)[0]
        if paired[1] <= single[1]:
            return paired, True
    return single, False


def _schedule(BN, per_block, causal, ncores):
    """:func:`_dealing`'s (cores, lockstep steps, blocks on the busiest core)."""
    return _dealing(BN, per_block, causal, ncores)[0]


@cached
def _schedule_floor(BN, nb, top, total, causal, ncores):
    """Lower bounds of :func:`_schedule` for the tiling search's bound (:func:`_search`), from a summary of
    the steps per block (``nb`` blocks, ``top`` the most, ``total`` in all) without dealing: at most the
    cores, at most the steps, and a block count at most the busiest core's whose share per step is at most
    the dealing's (blocks / steps).

    Equal blocks are dealt round-robin, and so are their pairs when there is no middle block: exact.
    Otherwise the cores are at most the single blocks' (pairs are fewer units); the steps at least the
    average load and the largest block (a unit of either dealing holds it); the blocks at least their
    average. A greedy dealer gives a core its last unit while it is the least loaded, so no core of the
    single dealing (n cores) ends above ``(BN·total - largest) // n + largest`` steps (the paired one is
    taken only when no longer): the blocks stand in scaled by the lower over that upper bound of the
    steps."""
    if _round_robin(nb, top * nb == total, causal):
        return _schedule(BN, (top,) * nb, causal, ncores)
    n = min(ncores, BN * nb)
    cores = min(ncores, BN * ceil_div(nb, 2)) if causal else n
    steps = max(ceil_div(BN * total, n), top)
    steps_hi = (BN * total - top) // n + top
    return cores, steps, ceil_div(BN * nb, n) * steps / steps_hi


# ------------------------------------------------------------------------------------------ model
class _Port:
    """Per-core GM transfers of one lockstep step: unit cycles per engine and the shared port's cycles."""

    def __init__(self, dev, n):
        self.dev, self.n = dev, n
        self.l2, self.hbm, self.rates = dev.l2_bytes_per_cycle, dev.hbm_bytes_per_cycle, dev.rates
        self.unit = {"mte2": 0.0, "mte3": 0.0, "fixpipe": 0.0, "vmte2": 0.0}
        self.port = 0.0
        self.vport = 0.0
        self.hits = {False: 0.0, True: 0.0}     # the ports' L2-hit cycles alone (cube / vector side)

    def add(self, unit, path, nbytes, cores, hit=1.0, vec=False, every=1.0, chip=None):
        """``nbytes`` per core over ``path`` on ``cores`` cores at once, ``every`` times per step on average;
        ``hit``: the fraction that hits L2; ``chip``: what each of those cores moves on average (default
        ``nbytes``: cores doing alike). The engine is busy until its cycles and its port share are done; the port
        carries the share only."""
        l2 = self.l2
        moved = nbytes if chip is None else chip
        share = cores * moved * (hit / l2 + (1 - hit) / self.hbm)
        self.unit[unit] += every * max(nbytes / self.rates[path], share)
        self.hits[vec] += every * cores * moved * hit / l2
        if vec:
            self.vport += every * share
        else:
            self.port += every * share


def _hit_port(p, split):
    """A core's GM port cycles of L2 hits per step (coupled: one port for both sides; split: the AIC's, which
    carries the phase's HBM traffic). A transfer holds the port for its hits and then for the chip's HBM
    bytes of that transfer (misses, write-throughs, the dirty lines it evicts): over a phase the port is busy
    for these hits plus all the phase's HBM bytes at the HBM bandwidth."""
    return p.hits[False] + (0.0 if split else p.hits[True])


def _missed(first, between, second, l2):
    """Fraction of a tensor's second reads that miss: heads are visited in the same order by both phases, so
    head x (0..1) finds ``first·(1-x) + between + second·x`` bytes touched since its first use; LRU has
    evicted it when that exceeds L2."""
    lo, hi = first + between, second + between
    if max(lo, hi) <= l2:
        return 0.0
    if min(lo, hi) >= l2:
        return 1.0
    x = (l2 - lo) / (hi - lo)
    return 1.0 - x if hi > lo else x


def _vec_rep(rows, cols, f=4):
    return rows * math.ceil(cols / (256 / f))


def _evict(l2, state, alloc, dirty, direct):
    """HBM bytes of a phase: its misses and write-throughs (``direct``) and the dirty lines it evicts (LRU by
    volume: what a phase allocates beyond L2 pushes out the oldest lines, dirty ones in proportion); and
    L2's (resident, dirty) bytes after it, from ``state`` before it."""
    res, drt = state
    out = max(0.0, res + alloc - l2)
    # the oldest lines go first: the earlier phases' (dirty in their proportion), then this phase's own
    old = min(out, res)
    wb = (old * drt / res if res else 0.0) + ((out - old) * dirty / alloc if alloc else 0.0)
    res = min(l2, res + alloc)
    return direct + wb, (res, min(res, drt + dirty - wb))


class _L2Plan(NamedTuple):
    """What the launch's phases touch in L2 and what misses again, whatever the tiling (heads in the same
    order in every phase)."""
    q_b: float
    do_b: float
    kv_k: float           # K's bytes
    mask_b: float         # the mask as stored (broadcast on reading)
    miss_q: float         # the fractions of the second reads that miss: Q (phase 1 -> 2), dO (0 -> 2), the mask
    miss_do: float
    miss_mask: float
    miss_dq: float        # the dq workspace read back by the cast
    hit_kv: float         # K's main-phase reads that hit (read in phase 1)
    hbm_ph0: float        # HBM bytes of phases 0 and 1
    hbm_ph1: float
    after: tuple          # L2's (resident, dirty) bytes after phase 1
    main: tuple           # the main phase's (allocated, dirty, direct) HBM bytes but its hand-off lines
    cast: tuple           # the cast's
    hbm: float            # the launch's HBM bytes but the hand-off lines left dirty: inputs once (again where
    #                       evicted between phases), outputs through, the dq workspace's evicted zeros


@cached
def _l2_plan(device, specs, mask, drop, stats):
    """:class:`_L2Plan` of a launch (tiling-independent, so worked out once per search)."""
    dev = get_device(device)
    B, N, Sq, D, Nkv, Skv, Dv, dtype = launch_dims(specs)
    isz = itemsize(dtype)
    msz = 0 if mask is None else itemsize(mask[1])
    BNS = B * N * Sq
    l2 = dev.l2_bytes
    q_b, do_b = BNS * D * isz, BNS * Dv * isz
    kv_b = B * Nkv * Skv * (D + Dv) * isz
    dq_b, st_b = BNS * D * 4, BNS * 4
    W0 = 2 * do_b + dq_b + st_b
    mask_b = 0 if mask is None else math.prod(mask[0]) * msz
    W1 = (q_b + B * Nkv * Skv * D * isz + 2 * st_b + mask_b) if stats else 0.0
    W2 = q_b + do_b + kv_b + dq_b + 3 * st_b + mask_b
    W3 = dq_b + BNS * D * isz
    miss_q = _missed(W1, 0.0, W2, l2) if stats else 0.0
    # the mask: first read by phase 1 (else by phase 2), again by phase 2 (its query heads share the lines)
    miss_mask = miss_q if stats else 1.0
    miss_do = _missed(W0, W1, W2, l2)
    miss_k = _missed(W1, 0.0, W2, l2) if stats else 0.0
    zero_out = _missed(W0, W1, W2, l2)                            # zeroed dq lines evicted before the adds
    miss_dq = _missed(W2, 0.0, W3, l2)
    kv_k = B * Nkv * Skv * D * isz
    hbm_ph0, state = _evict(l2, (0.0, 0.0), 2 * do_b + dq_b + st_b, dq_b + st_b, 2 * do_b)
    hbm_ph1 = 0.0
    if stats:
        hbm_ph1, state = _evict(l2, state, q_b + kv_k + 2 * st_b + mask_b, 2 * st_b, q_b + kv_k + mask_b)
    re_read = miss_q * q_b + miss_do * do_b + miss_k * kv_k + miss_mask * mask_b
    main = (re_read + kv_b - (kv_k if stats else 0) + zero_out * dq_b + kv_b, zero_out * dq_b,
            re_read + kv_b - (kv_k if stats else 0) + kv_b)
    cast = (miss_dq * dq_b + BNS * D * isz, 0.0, miss_dq * dq_b + BNS * D * isz)
    hbm = q_b + 2 * do_b + kv_b                                   # q, out, dout, k, v
    hbm += kv_b                                                   # dk, dv
    hbm += miss_q * q_b + miss_do * do_b + miss_k * B * Nkv * Skv * D * isz
    if mask is not None:
        hbm += mask_b * (1 + (miss_mask if stats else 0.0))
    if drop:
        hbm += BNS * ceil_div(Skv, 8)
    if dtype != F32:
        hbm += BNS * D * isz + miss_dq * dq_b                     # dq out; the workspace read back
    hbm += dq_b * (1 + zero_out)                                  # the dq workspace's lines (evicted zeros)
    hbm += st_b * 3              # Dr, and the max and sum: recomputed (written back) or given (read)
    return _L2Plan(q_b, do_b, kv_k, mask_b, miss_q, miss_do, miss_mask, miss_dq, 1 - miss_k if stats else 0.0,
                   hbm_ph0, hbm_ph1, state, main, cast, hbm)


@cached
def _phase0(device, BN, Sq, D, Dv, dtype, qb, nv, single, hbm_ph0):
    """Phase 0 of a tiling's query blocks ``qb`` on ``nv`` vector cores: the dq workspace zeroed and
    Dr = rowsum(dO∘O), both round-robin over the vector cores. ``single``: one dO or O tile (a step's loads wait
    for the sum of the step before). Returns (its cycles, its busy (vector, mte2, mte3) cycles, and the zeroing's
    (items, rounds, active cores, rows), which the cast of phase 3 deals alike)."""
    dev = get_device(device)
    split = dev.arch == "split"
    nh = 2 if split else 1
    isz = itemsize(dtype)
    nq = ceil_div(Sq, qb)
    Rr = qb // nh
    itemsz = BN * ceil_div(Sq, Rr)
    Tz, actz, rz = ceil_div(itemsz, nv), min(nv, itemsz), min(Rr, Sq)
    items0 = BN * nq
    T0, act0, r0 = ceil_div(items0, nv), min(nv, items0), Sq / nq
    p0 = _Port(dev, act0)
    p0.add("mte2", "GM->UB", 2 * r0 * Dv * isz, act0, hit=0.0)
    p0.add("mte3", "UB->GM", r0 * 4, act0)
    vec0 = _vec_rep(r0, Dv) * ((3 if dtype != F32 else 1) + 1)
    pz = _Port(dev, actz)
    pz.add("mte3", "UB->GM", rz * D * 4, actz)
    if single:
        # one dO or O tile: a step's loads wait for the sum of the step before (and for the zero stores
        # booked on the port ahead of them)
        step0 = p0.unit["mte2"] + vec0 + Tz * pz.port / T0
    else:
        step0 = max(p0.unit["mte2"], vec0)
    # zero stores interleaved with the Dr steps: once L2 is full the oldest lines go, the zeroed ones among
    # them written back
    ph0 = max(T0 * step0 + r0 * Dv * isz / dev.rates["GM->UB"] + vec0, Tz * pz.unit["mte3"] + T0 * p0.unit["mte3"],
              Tz * pz.port + T0 * p0.port,
              Tz * _hit_port(pz, split) + T0 * _hit_port(p0, split) + hbm_ph0 / dev.hbm_bytes_per_cycle)
    return ph0, (T0 * vec0, T0 * p0.unit["mte2"], T0 * p0.unit["mte3"]), (itemsz, Tz, actz, rz)


@cached
def _phase3(device, itemsz, Tz, nv, actz, rz, D, isz, miss_dq):
    """The cast of phase 3 (dq = cast(workspace)), dealt as phase 0's zeroing: rounds of the round-robin deal, the
    full ones on every vector core, the last on those left over. Returns (the steps' cycles, the port's hit cycles,
    a step's Vector cycles, each round's (mte2, mte3) busy cycles in order)."""
    dev = get_device(device)
    split = dev.arch == "split"
    left = itemsz - (Tz - 1) * nv
    steps3 = hits3 = 0.0
    vec3 = _vec_rep(rz, D)
    spent = []
    for rounds, cores3 in ((Tz - 1, actz), (1, left)):
        if rounds <= 0 or cores3 <= 0:
            continue
        p3 = _Port(dev, cores3)
        p3.add("mte2", "GM->UB", rz * D * 4, cores3, hit=1 - miss_dq)
        p3.add("mte3", "UB->GM", rz * D * isz, cores3, hit=0.0)
        steps3 += rounds * max(p3.unit["mte2"], p3.port, vec3, p3.unit["mte3"])
        hits3 += rounds * _hit_port(p3, split)
        spent.append((rounds * p3.unit["mte2"], rounds * p3.unit["mte3"]))
    return steps3, hits3, vec3, tuple(spent)


def _model(dev, specs, mask, causal, t, drop, stats, bound=False, cap=False, window=0, sharp=False, stats_only=False):
    """(core cycles, HBM bytes, bytes per GM path, busy cycles per unit, workspace bytes, phase ends) of tiling ``t``
    (with ``bound``, then the four phases' cycles ``(ph0, ph1, ph2, ph3)``, the core cycles their sum in that order).
    With ``bound`` the dealings' lower bounds (:func:`_schedule_floor`) stand in for them, the hand-off lines
    left dirty count none and the Dr phase's loads overlap its sums (whatever tiles the kernel grants): the
    cycles are a lower bound of the exact ones (see :func:`_search`). ``sharp`` (with ``bound``): the statistics
    sweep as the exact model prices it (its dealing and replay), a sharper bound. ``stats_only`` (with ``sharp``):
    the statistics sweep's cycles alone (nothing else in a bound depends on how that sweep is priced)."""
    cores = dev.cube_cores

    def deal(BN, steps, summary, exact=False):
        # the dealing of units of these steps per block, or (bound) its lower bounds from their summary
        return _schedule_floor(BN, *summary(), bool(causal), cores) if bound and not exact else \
            _schedule(BN, steps(), bool(causal), cores)

    B, N, Sq, D, Nkv, Skv, Dv, dtype = launch_dims(specs)
    isz = itemsize(dtype)
    split = dev.arch == "split"
    nh = 2 if split else 1
    qb, kvb = t["q"], t["kv"]
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    group = N // Nkv
    k0f = dev.cube_k0[dtype]
    L2bw, HBMbw = dev.l2_bytes_per_cycle, dev.hbm_bytes_per_cycle
    rate = dev.rates
    f32 = dtype == F32
    msz = 0 if mask is None else itemsize(mask[1])
    mpass = mask_passes(mask)
    busy = {u: 0.0 for u in ("cube", "mte1", "mte2", "fixpipe", "vector", "mte3")}
    n_main = min(dev.cube_cores, B * Nkv * nkv)
    nv = n_main * nh if split else n_main
    qe_avg = Sq / nq                      # rows of an average query block (edges included)
    ke_avg = Skv / nkv
    sweep = _pairs(Sq, Skv, qb, kvb, causal, window)
    band = _band_tiles(Sq, Skv, qb, kvb, window) if window else None    # a window's (pairs, diagonal, left edge)

    # ---- L2: what misses again and the HBM bytes of each phase (the main one's with its hand-off lines)
    l2p = _l2_plan(dev.name, specs, mask, drop, stats)
    hit_q = 1 - (l2p.miss_q * l2p.q_b + l2p.miss_do * l2p.do_b) / (l2p.q_b + l2p.do_b) / nkv
    hit_kv, miss_mask, mask_b, kv_k = l2p.hit_kv, l2p.miss_mask, l2p.mask_b, l2p.kv_k
    ws_lines = n_main * 2 * min(qb, Sq) * min(kvb, Skv) * (isz * 2 + (8 if split else 0))
    alloc, dirty, direct = l2p.main
    hbm_ph2, state = _evict(dev.l2_bytes, l2p.after, alloc + ws_lines, dirty + ws_lines, direct)
    hbm_ph3 = _evict(dev.l2_bytes, state, *l2p.cast)[0] if not f32 else 0.0
    BNS = B * N * Sq

    # ---- phase 0: dq workspace := 0 (the halves phase 2 adds to), Dr = rowsum(dO∘O) (query blocks), both
    # round-robin over the vector cores
    # (the bound takes the loads and sums overlapped, the shorter: it grants no tiles)
    single = not bound and min(_tile_counts(dev.name, D, Dv, dtype, qb, kvb, _mask_spec(mask), drop, stats, cap)[x]
                               for x in ("pre_do", "pre_o")) < 2
    ph0, (busy["vector"], busy["mte2"], busy["mte3"]), (itemsz, Tz, actz, rz) = _phase0(
        dev.name, B * N, Sq, D, Dv, dtype, qb, nv, single, l2p.hbm_ph0)

    # ---- phase 1: the row statistics (items (b, h, query block) over their KV tiles)
    ph1 = 0.0
    # few items, Q and K read once from HBM: the phase replayed core by core (the forward's deal)
    replay1 = stats and B * N * nq <= REPLAY_UNITS and l2p.hbm_ph1 <= l2p.q_b + l2p.kv_k + l2p.mask_b
    if replay1:
        ph1 = _stats_replay(dev.name, B, N, Nkv, Sq, Skv, D, Dv, dtype, qb, kvb, bool(causal), window, mask, mpass,
                            drop, cap, bound and not sharp)
    if stats and not (replay1 and bound):      # (what follows a replay is the units' busy time, which no bound reads)
        n1, T1, items1 = deal(B * N, lambda: _q_steps(Sq, Skv, qb, kvb, causal, window),
                              lambda: (nq, max(_q_steps(Sq, Skv, qb, kvb, causal, window)) if window else
                                       ceil_div(min(Sq, Skv), kvb) if causal else nkv, sweep.count), sharp)
        qe, ke = (min(qb, Sq) if causal else qe_avg), ke_avg
        rows = qe / nh
        p1 = _Port(dev, n1)
        # K: the first reader of a tile misses, the other items' reads (the same step or later) hit
        p1.add("mte2", "GM->L1", ke * D * isz, n1, hit=1 - kv_k / (B * N * sweep.keys * D * isz))
        p1.add("mte2", "GM->L1", qe * D * isz, n1, hit=0.0, every=items1 / T1)
        part = 0.0
        if band:                  # the pairs crossing the diagonal or the window's left edge
            part = (band[1] + band[2]) / band[0]
        elif causal:
            part = min(1.0, ceil_div(qb, kvb) * items1 / T1)
        # (the mask: each line's first reader misses, the other query heads' reads hit)
        cube1, mte1, vec1 = _stats_step(dev, p1, qe, ke, part, D, dtype, mpass, cap, nv, mask is not None and
                                        (rows * ke * msz, 1 - mask_b / (rows * ke * msz * nv * T1)))
        mte1 += _r16(qe) * D * isz / rate["L1->L0A"] * items1 / T1
        p1.add("mte3", "UB->GM", 2 * rows * 4, nv, vec=True, every=items1 / T1)
        mte2 = p1.unit["mte2"] + (0 if split else p1.unit["vmte2"])
        step1 = max(cube1, mte1, mte2, p1.unit["vmte2"] if split else 0, p1.port + (0 if split else p1.vport),
                    p1.vport if split else 0, p1.unit["fixpipe"], vec1)
        if not replay1:
            # the port: without a causal mask the cores on a head read K tile j at the same step, the first one's
            # miss held by all of them, so each waits for the instruction's hits and its misses in turn; with one,
            # a core's items reach tile j at steps of their own (a pair's first query block ends early and the
            # second starts again at tile 0), so in one instruction some cores hit and others miss, and each
            # waits for the one or the other
            hits1 = T1 * _hit_port(p1, split)
            port1 = max(hits1, l2p.hbm_ph1 / HBMbw) if causal else hits1 + l2p.hbm_ph1 / HBMbw
            ph1 = max(T1 * step1, port1) + qe * D * isz / rate["GM->L1"] + cube1 + vec1 + p1.unit["fixpipe"]
        busy["cube"] += T1 * cube1
        busy["vector"] += T1 * vec1
        busy["mte2"] += T1 * mte2
        busy["mte1"] += T1 * mte1
        busy["fixpipe"] += T1 * p1.unit["fixpipe"]
    if stats_only:
        return ph1

    # ---- phase 2: the gradients (units (b, kv head, KV block j) of group·(query blocks that see j) steps)
    n2, T2, units2 = deal(B * Nkv, lambda: _kv_steps(Sq, Skv, qb, kvb, group, causal, window),
                          lambda: _kv_steps_sum(Sq, Skv, qb, kvb, group, causal, window))
    per_unit = units2 / T2
    # the cores that load a unit's K and V (and store its dK, dV) at the same time: all of them when the units are
    # alike; causal units differ in length, so after the first units the cores start theirs at different steps
    kvc = n2
    if causal and units2 > 1:
        kvc = max(1.0, n2 / _unit_lengths(Sq, Skv, qb, kvb, group, window))
    a, b_ = rate["L1->L0A"], rate["L1->L0B"]
    # the Vector passes of a step's scores (the ones crossing the diagonal or the window's left edge twice more)
    part = 0.0
    if band:
        part = (band[1] + band[2]) / band[0]
    elif causal:
        part = min(1.0, ceil_div(qb, kvb) * per_unit * 2)
    base = 7 + (0 if f32 else 2) + (4 if drop else 0) + mpass + (SOFTCAP_PASSES + 3 if cap else 0)

    granted = None if bound else _tile_counts(dev.name, D, Dv, dtype, qb, kvb, _mask_spec(mask), drop, stats, cap)
    R2 = qb // nh
    # a step's transfers' port cycles per byte by their hit fraction (:class:`_Port`), and the rates they move at
    f_q, f_kv = hit_q / L2bw + (1 - hit_q) / HBMbw, hit_kv / L2bw + (1 - hit_kv) / HBMbw
    f_hit, f_miss = 1.0 / L2bw + (1 - 1.0) / HBMbw, 0.0 / L2bw + (1 - 0.0) / HBMbw
    r_l1, r_ub, r_out = rate["GM->L1"], rate["GM->UB"], rate["UB->GM"]
    # the head dims in fractals (ceil_div(x, 16) and ceil_div(x, k0f)), taken once: every candidate's steps use them
    D16, Dv16, Dk0, Dvk0 = -(-D // 16), -(-Dv // 16), -(-D // k0f), -(-Dv // k0f)

    def step_of(qe, ke, qc, kc):
        """One step of query rows ``qe`` against keys ``ke``, the chip's cores at that step running ``qc`` rows
        and ``kc`` keys each on average (what they move shares the port): its time and its units' (and port's)
        shares."""
        rows, rc = qe / nh, qc / nh
        qi, ki = int(math.ceil(qe)), int(math.ceil(ke))
        # stage B runs per half of the block's rows on split cores (each AIV's rows, as it stored them): each half
        # its own products and moves, each padded to whole fractals
        halves = [h for h in (min(qb // 2, qi), min(qb // 2, max(0, qi - qb // 2))) if h > 0] if split else [qi]
        # the Cube's fractals of a step: S and dP, then stage B's dV, dK and dQ (integers: the per-half sums
        # factored, ceil_div written out; a step is priced for every candidate the search bounds)
        qf, kf, hk0, h16 = -(-qi // 16), -(-ki // 16), 0, 0
        for h in halves:
            hk0 += -(-h // k0f)
            h16 += -(-h // 16)
        cs, cdp = qf * kf * Dk0, qf * kf * Dvk0
        cdv, cdk = kf * hk0 * Dv16, kf * hk0 * D16
        cdq = h16 * -(-ki // k0f) * D16
        cube_b = cdv + cdk + cdq
        cube2 = cs + cdp + cube_b
        q16, k16 = -(-qe // 16) * 16, -(-ke // 16) * 16     # _r16
        qh16 = h16 * 16                              # stage B's rows, padded per half
        mte1 = (q16 * (D + Dv) * isz / a + k16 * (D + Dv) * isz / b_ + 3 * k16 * qh16 * isz / a
                + qh16 * (Dv + D) * isz / b_ + k16 * D * isz / b_)
        # the step's GM transfers as _Port.add prices them (the same operations in the same order, written out: a
        # step is priced for every candidate the search bounds): per transfer of ``nb`` bytes a core, ``mv`` on
        # average, on ``n`` cores ``every`` times a step, its share of the port ``n·mv·f`` (``f`` from its hit
        # fraction), its unit busy for the larger of its own time and that share, its L2 hits on the port apart
        # (a transfer that never hits adds none)
        # Q and dO every step: cores on the same head read the same rows at once (L2 hits after the first)
        nb, mv = qe * (D + Dv) * isz, qc * (D + Dv) * isz
        share = n2 * mv * f_q
        mte2 = max(nb / r_l1, share)
        hits = n2 * mv * hit_q / L2bw
        port = share
        # K (phase 1's)
        nb, mv = ke * D * isz, kc * D * isz
        share = kvc * mv * f_kv
        mte2 += per_unit * max(nb / r_l1, share)
        hits += per_unit * kvc * mv * hit_kv / L2bw
        port += per_unit * share
        # V: first read
        nb, mv = ke * Dv * isz, kc * Dv * isz
        share = kvc * mv * f_miss
        mte2 += per_unit * max(nb / r_l1, share)
        port += per_unit * share
        # Pd, dS back from the workspace
        nb, mv = 2 * qe * ke * isz, 2 * qc * kc * isz
        share = n2 * mv * f_hit
        mte2 += max(nb / r_l1, share)
        hits += n2 * mv / L2bw
        port += share
        # max, sum, Dr
        nb, mv = 3 * rows * 4, 3 * rc * 4
        share = nv * mv * f_hit
        vmte2 = max(nb / r_ub, share)
        vhits = nv * mv / L2bw
        vport = share
        if mask is not None:
            h = 1 - miss_mask * mask_b / (rc * kc * msz * nv * T2)
            nb, mv = rows * ke * msz, rc * kc * msz
            share = nv * mv * (h / L2bw + (1 - h) / HBMbw)
            vmte2 += max(nb / r_ub, share)
            vhits += nv * mv * h / L2bw
            vport += share
        if drop:
            nb, mv = rows * math.ceil(ke / 8), rc * math.ceil(kc / 8)
            share = nv * mv * f_miss
            vmte2 += max(nb / r_ub, share)
            vport += share
        # Pd, dS out
        nb, mv = 2 * rows * ke * isz, 2 * rc * kc * isz
        share = nv * mv * f_hit
        mte3 = max(nb / r_out, share)
        vhits += nv * mv / L2bw
        vport += share
        v = _vec_rep(rows, ke)
        vec2 = v * base + v * part * 2
        if split:
            r_fix = rate["L0C->GM"]
            # S, dP out
            nb, mv = 2 * qe * ke * 4, 2 * qc * kc * 4
            share = n2 * mv * f_hit
            fix = max(nb / r_fix, share)
            hits += n2 * mv / L2bw
            port += share
            # S, dP in
            nb, mv = 2 * rows * ke * 4, 2 * rc * kc * 4
            share = nv * mv * f_hit
            vmte2 += max(nb / r_ub, share)
            vport += share
        else:
            fix = (2 * qe * ke * 4 + qe * D * 4) / rate["L0C->UB"] + per_unit * ke * (D + Dv) * 4 / rate["L0C->UB"]
        # dQ atomic add, then dK, dV out: from L0C to GM (split) or by the MTE3 from UB (coupled)
        r_o = r_fix if split else r_out
        nb, mv = qe * D * 4, qc * D * 4
        share = n2 * mv * f_hit
        dq = max(nb / r_o, share)
        hits += n2 * mv / L2bw
        port += share
        nb, mv = ke * (D + Dv) * isz, kc * (D + Dv) * isz
        share = kvc * mv * f_miss
        dkv = per_unit * max(nb / r_o, share)
        port += per_unit * share
        if split:
            fix += dq
            fix += dkv
            stores = 0.0
        else:
            mte3 += dq
            mte3 += dkv
            mte2 += vmte2
            vmte2 = 0.0
            hits += vhits           # (coupled: one port for both sides)
            # the unit's dK and dV stores (written through to HBM, every core of the unit's instruction at once)
            # hold the port at the unit's end: priced there (below), not spread over its steps
            stores = kvc * kc * (D + Dv) * isz / HBMbw
            port, vport = port + vport - per_unit * stores, 0.0
        # the software pipeline's loop spans two steps: S, dP(s) -> to the Vector -> P, dS(s) -> out to the
        # workspace -> back into L1 -> the products of step s, and the in-order Cube starts S(s+2) after them
        pds = 2 * qe * ke * isz
        hand = (2 * qe * ke * 4 / rate["L0C->GM"] + 2 * rows * ke * 4 / rate["GM->UB"]) if split \
            else 2 * qe * ke * 4 / rate["L0C->UB"]
        # (coupled: the one MTE2 queue also carries the Vector's loads, all of it is in the loop; split: the AIC's
        # Q and dO loads run ahead, only Pd and dS back are)
        loop = cube2 + mte1 * LOOP_MTE1 + hand + vec2 + pds / nh / rate["UB->GM"] + \
            (pds / rate["GM->L1"] if split else mte2)
        chain = 0.0
        if not split:
            # coupled: MTE3 takes the dQ add of step s (after its products) ahead of step s+2's Pd, dS stores,
            # which step s+2's products wait for (in that order on one queue): a chain over two steps
            dq_out = qe * D * 4
            # a unit's end (dK, dV out through UB on the same queues) and the next one's K, V loads sit in it too
            edge = ke * (D + Dv) * (isz / rate["UB->GM"] + 4 / rate["L0C->UB"] + isz / rate["GM->L1"])
            chain = (cube_b + dq_out / rate["L0C->UB"] + max(dq_out / rate["UB->GM"], n2 * (qc * D * 4) / L2bw)
                     + pds / rate["UB->GM"] + pds / rate["GM->L1"] + (3 * k16 * q16 * isz / a + q16 * (Dv + D) * isz / b_)
                     + 2 * per_unit * edge)
        # the Q and dO tiles are a ring of two: step s+1's loads wait for step s-1's last read of its Q (the Q->L0B
        # of its dK), so one step holds, in order: the Q and dO loads (at least their port share, the dQ add of the
        # step before and, coupled, the Pd and dS stores: both booked on the port ahead of them), dO->L0A and
        # V^T->L0B, dP, then stage B's products up to its last Q->L0B (coupled: dV; split: the first half's three)
        qdo = qe * (D + Dv) * isz
        ahead = n2 * qc * D * 4 / L2bw + (0.0 if split else nv * (2 * qc * kc * isz) / nh / L2bw)
        ring = (max(qdo / rate["GM->L1"], n2 * (qc * (D + Dv) * isz) * (hit_q / L2bw + (1 - hit_q) / HBMbw) + ahead)
                + q16 * Dv * isz / a + Dv * k16 * isz / b_ + cdp
                + (cdv if not split else cube_b / len(halves)) + (q16 if not split else _r16(halves[0])) * D * isz / b_)
        step2 = max(cube2, mte1, mte2, vmte2, port, vport, fix, vec2, mte3, loop / 2, chain / 2, ring)
        # coupled: a unit's dK and dV stores go out on MTE3 one step after its last and take the core's one GM port;
        # the loads queued behind them wait (the next steps' workspace loads, and with them the Cube) unless the
        # port had slack, which the steps around the unit's end give: STORE_SLACK_STEPS steps of it (taken before
        # the L0 rings' chain, so the search's bound, which leaves that chain out, stays below the model)
        exposed = max(0.0, stores - STORE_SLACK_STEPS * max(0.0, step2 - port))
        if granted is not None:
            # the L0 moves and the products in the kernel's order: a move into a ring of one tile waits for the
            # product reading the tile before
            A, Bb = "L0A:%dx%d", "L0B:%dx%d"
            seq = [("mv", "kb0", k16 * D * isz / b_),
                   ("mv", A % (qb, D), q16 * D * isz / a), ("mv", Bb % (D, kvb), k16 * D * isz / b_),
                   ("mm", (A % (qb, D), Bb % (D, kvb)), cs),
                   ("mv", A % (qb, Dv), q16 * Dv * isz / a), ("mv", Bb % (Dv, kvb), k16 * Dv * isz / b_),
                   ("mm", (A % (qb, Dv), Bb % (Dv, kvb)), cdp)]
            for h in halves:
                h16 = _r16(h)
                seq += [("mv", A % (kvb, R2), k16 * h16 * isz / a), ("mv", Bb % (R2, Dv), h16 * Dv * isz / b_),
                        ("mm", (A % (kvb, R2), Bb % (R2, Dv)), ceil_div(ki, 16) * ceil_div(h, k0f) * ceil_div(Dv, 16)),
                        ("mv", A % (kvb, R2), k16 * h16 * isz / a), ("mv", Bb % (R2, D), h16 * D * isz / b_),
                        ("mm", (A % (kvb, R2), Bb % (R2, D)), ceil_div(ki, 16) * ceil_div(h, k0f) * ceil_div(D, 16)),
                        ("mv", A % (R2, kvb), h16 * k16 * isz / a),
                        ("mm", (A % (R2, kvb), "kb0"), ceil_div(h, 16) * ceil_div(ki, k0f) * ceil_div(D, 16))]
            step2 = max(step2, _l0_period(seq, granted))
        # a unit's K and V (one L1 tile each) load after the last step of the unit before has moved them to L0B:
        # the next S waits for the load, shared with the other cores starting a unit at that step (kvc)
        kv_core = ke * (D + Dv) * isz
        bubble = max(kv_core / rate["GM->L1"], kvc * kc * isz * (D * (hit_kv / L2bw + (1 - hit_kv) / HBMbw) + Dv / HBMbw))
        step2 += per_unit * (bubble + exposed)
        fill2 = (ke * (D + Dv) + qe * (D + Dv)) * isz / rate["GM->L1"] + cube2 + vec2
        return {"step": step2, "cube": cube2, "vec": vec2, "mte1": mte1, "mte2": max(mte2, vmte2), "mte3": mte3,
                "fix": fix, "hit": hits, "fill": fill2}

    # the steps by extent: a query block's edge rows (every KV block's last query block, once per query head)
    # and the edge KV block's steps, priced apart from the full blocks' (a step's cost is not linear in its
    # extent: whole fractals per half, fixed moves), the port shared with the chip's other cores at their mean
    # extents (the launch's shares)
    if window:
        q_mix, k_mix = [(1.0, min(qb, Sq) if causal else qe_avg)], [(1.0, ke_avg)]
    else:
        _, _, total = _kv_steps_sum(Sq, Skv, qb, kvb, group, causal)
        last = group * (nq - min((nkv - 1) * kvb, Sq) // qb) if causal else group * nq
        q_mix = _extent_mix(Sq, qb, min(1.0, group * nkv / max(1, total)))
        k_mix = _extent_mix(Skv, kvb, last / max(1, total))
    qc, kc = sum(w * x for w, x in q_mix), sum(w * x for w, x in k_mix)
    kinds = [[step_of(q_, k_, qc, kc) for _, q_ in q_mix] for _, k_ in k_mix]    # [KV extent][query extent]
    parts = [(wq * wk, kinds[b][a]) for b, (wk, _) in enumerate(k_mix) for a, (wq, _) in enumerate(q_mix)
             if wq * wk > 0]

    def mixed(key):
        return sum(w * p[key] for w, p in parts)

    step2 = mixed("step")
    fill2 = parts[0][1]["fill"]
    steps2 = T2 * step2
    if len(parts) > 1:
        # edge blocks: each core's own steps by extent (the launch's shares can miss the busiest core: dealt
        # round-robin, a core may hold only full KV blocks); the bound takes them where the dealing is round-robin,
        # else the cores' mean from the launch's counts (no deal)
        per_block = _kv_steps(Sq, Skv, qb, kvb, group, causal, window)
        by_core = _core_extents(B * Nkv, per_block, bool(causal), cores, group if len(q_mix) > 1 else 0,
                                len(k_mix) > 1, bound)
        if by_core is not None:
            price = np.array([kinds[b][a]["step"] for b in (0, len(k_mix) - 1) for a in (0, len(q_mix) - 1)])
            steps2 = float((by_core @ price).max())
    ph2 = max(steps2, T2 * mixed("hit") + hbm_ph2 / HBMbw) + fill2
    for unit, key in () if bound else (("cube", "cube"), ("vector", "vec"), ("mte1", "mte1"), ("mte2", "mte2"),
                                        ("mte3", "mte3"), ("fixpipe", "fix")):     # (a bound's busy is not read)
        busy[unit] += T2 * mixed(key)

    # ---- phase 3: dq = cast(workspace)
    ph3 = 0.0
    if not f32:
        # rounds of the round-robin deal: the full ones on every vector core, the last on those left over
        steps3, hits3, vec3, spent = _phase3(dev.name, itemsz, Tz, nv, actz, rz, D, isz, l2p.miss_dq)
        for mte2, mte3 in spent:
            busy["mte2"] += mte2
            busy["mte3"] += mte3
        ph3 = max(steps3, hits3 + hbm_ph3 / HBMbw) + rz * D * 4 / rate["GM->UB"] + vec3
        busy["vector"] += Tz * vec3
    core = ph0 + ph1 + ph2 + ph3

    # ---- HBM: the launch's (:func:`_l2_plan`) and the hand-off lines still dirty at the end
    hbm = l2p.hbm
    ws = n_main * 2 * qb * kvb * isz * 2 + (n_main * 2 * qb * kvb * 4 * 2 if split else 0)
    # hand-off lines still dirty: per core and slot, one line per block extent it has written
    if not bound:
        hbm += _ws_lines(B * Nkv, Sq, Skv, qb, kvb, group, bool(causal), cores, window) * (isz * 2 + (8 if split else 0))
    nbytes = _gm_bytes(B, N, Nkv, Sq, Skv, D, Dv, isz, kvb, sweep, split, mask, msz, drop, stats, f32)
    # the phases between the kernel's SyncAlls, named, with their ends (the simulator's Stats.phases)
    ends, end = [], 0.0
    for name, ph, there in (("zero dq, Dr", ph0, True), ("statistics", ph1, stats), ("gradients", ph2, True),
                            ("dq cast", ph3, not f32)):
        if there:
            end += ph
            ends.append((name, int(math.ceil(end))))
    out = core, float(hbm), nbytes, busy, ws + BNS * D * 4 + BNS * 4 * 3, tuple(ends)
    return out + ((ph0, ph1, ph2, ph3),) if bound else out


@cached
def _stats_replay(device, B, N, Nkv, Sq, Skv, D, Dv, dtype, qb, kvb, causal, window, mask, mpass, drop, cap, bound):
    """Phase 1 (the row statistics) of a launch of few items, from the forward's deal replayed step by step
    (:func:`cost_model.flash_attention._core_tallies`: the kernel deals phase 1's items as the forward does). Per
    core: its steps by kind (query rows, KV extent, masked), each with its own K port wait (a K tile's miss delays
    the cores reading it in that instruction; the instruction's hits go through L2 together); where the L0B ring
    of K^T holds one tile, a step's K^T move waits for the step before's S (they run in series); the first items' Q
    loads, one instruction of every core's rows from HBM ahead of any K; each later item's Q load (its instruction's
    rows from HBM), on the MTE2 queue with the K loads, exposed beyond the MTE2 slack of the step it joins; after an
    item's last K load its K^T move, S, the hand-off to the Vector and its passes; and the core's GM port busy time
    as a bound. ``bound``: a lower bound instead (every step at least its kind's busiest unit without any port wait,
    over the mean core), without the replay. Cached: the search's sharp bound and the model price it alike."""
    dev = get_device(device)
    split = dev.arch == "split"
    nh = 2 if split else 1
    isz = itemsize(dtype)
    rate, L2bw, HBMbw = dev.rates, dev.l2_bytes_per_cycle, dev.hbm_bytes_per_cycle
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    n1 = min(dev.cube_cores, B * N * nq)
    nv = n1 * nh
    msz = 0 if mask is None else itemsize(mask[1])
    granted = None if bound else _tile_counts(dev.name, D, Dv, dtype, qb, kvb, _mask_spec(mask), drop, True, cap)
    serial = granted is not None and granted.get(f"L0B:{D}x{kvb}", 2) < 2

    def kind(qe, ke, m):
        k_xfer = ke * D * isz / rate["GM->L1"]
        p = _Port(dev, n1)
        cube, mte1, vec = _stats_step(dev, p, qe, ke, float(m), D, dtype, mpass, cap, nv,
                                      mask is not None and (qe / nh * ke * msz, 1.0))
        fixed = max(cube, mte1, vec, p.unit["fixpipe"], p.unit["vmte2"] if split else 0.0, p.vport if split else 0.0,
                    mte1 + cube if serial else 0.0)
        rest = 0.0 if split else p.unit["vmte2"]           # coupled: the mask loads on the one MTE2 queue and port
        rest_port = p.port + (0.0 if split else p.vport)
        # the item's Q load, and after the last K load: its K^T move, S, the hand-off to the Vector and its passes
        return fixed, k_xfer, rest, rest_port, qe * D * isz / rate["GM->L1"] + mte1 + cube + vec + p.unit["fixpipe"] \
            + (qe / nh * ke * 4 / rate["GM->UB"] if split else 0.0)

    if bound:          # every step at least its kind's busiest unit that no port wait touches, over the mean core
        floor = 0.0
        for (qe, ke, m), c in zip(*kind_steps(nq, nkv, Sq, Skv, qb, kvb, causal, window)):
            floor += c * max(*_stats_units(dev, qe, ke, float(m), D, dtype, mpass, cap), ke * D * isz / rate["GM->L1"])
        return B * N * floor / n1
    tal = _core_tallies(B, N, nq, nkv, Sq, Skv, qb, kvb, causal, dev.cube_cores, window, N // Nkv)
    table = np.array([kind(qe, ke, m) for qe, ke, m in tal.kinds]).T
    fixed, k_xfer, rest, rest_port, fill = table
    P = np.divide((tal.hit / L2bw + tal.miss / HBMbw) * (D * isz), tal.counts, out=np.zeros(tal.hit.shape),
                  where=tal.counts > 0)
    mte2 = np.maximum(k_xfer, P) + rest
    port = P + rest_port
    step = np.maximum(fixed, np.maximum(mte2, port))
    counts = tal.counts
    n = len(counts)
    q_row = D * isz / HBMbw
    qown = np.array([qe for qe, _, _ in tal.kinds]) * D * isz / rate["GM->L1"]     # a Q load's own time, per kind
    q = np.maximum(qown[tal.sk], tal.sq * q_row)
    # a later item's Q load queues on MTE2 with the K loads: it shows beyond the MTE2 slack of the step it joins
    starts = np.bincount(tal.sc, weights=np.maximum(0.0, q - (step - mte2)[tal.sc, tal.sk]), minlength=n)
    # the item's statistics out (two rows x 4 B stores) ride the MTE3 queue: negligible beside the steps
    # the first items' Q loads: one instruction of the cores' rows, from HBM, before any K
    t = fill[tal.first] + np.maximum(0.0, tal.q0 * q_row - qown[tal.first]) + (counts * step).sum(1) + starts
    gm = tal.q0 * q_row + (counts * port).sum(1) + np.bincount(tal.sc, weights=tal.sq * q_row, minlength=n)
    return float(np.maximum(t, gm).max())


def _stats_units(dev, qe, ke, part, D, dtype, mpass, cap):
    """The Cube's S, the K^T move and the Vector's passes of one step of the statistics sweep (:func:`_stats_step`)."""
    isz = itemsize(dtype)
    rows = qe / (2 if dev.arch == "split" else 1)
    cube = ceil_div(int(qe), 16) * ceil_div(D, dev.cube_k0[dtype]) * ceil_div(int(math.ceil(ke)), 16)
    mte1 = D * _r16(ke) * isz / dev.rates["L1->L0B"]
    vec = _vec_rep(rows, ke) * (5 + mpass + (SOFTCAP_PASSES if cap else 0)) + _vec_rep(rows, ke) * part * 2 \
        + math.ceil(rows / 64) * 5
    return cube, mte1, vec


def _stats_step(dev, p, qe, ke, part, D, dtype, mpass, cap, nv, mask_load):
    """One step of the statistics sweep, ``qe`` query rows over ``ke`` keys (``part``: the share of such steps
    crossing the diagonal or the window's left edge, two Vector passes more): (the Cube's S, the K^T move, the
    Vector's passes); the S hand-off (split cores: out to GM and into the AIVs' UB; coupled: L0C->UB) and the mask's
    loads (``mask_load``: bytes per vector core and the hit fraction, or False) added to the port ``p``."""
    split = dev.arch == "split"
    rate = dev.rates
    rows = qe / (2 if split else 1)
    cube, mte1, vec = _stats_units(dev, qe, ke, part, D, dtype, mpass, cap)
    if mask_load:
        p.add("vmte2", "GM->UB", mask_load[0], nv, hit=mask_load[1], vec=True)
    if split:
        p.add("fixpipe", "L0C->GM", qe * ke * 4, p.n)
        p.add("vmte2", "GM->UB", rows * ke * 4, 2 * p.n, vec=True)
    else:
        p.unit["fixpipe"] += qe * ke * 4 / rate["L0C->UB"]
    return cube, mte1, vec


def _l0_period(seq, counts, reps=4):
    """Cycles a step of the Cube and MTE1 in series where their L0 rings make them: ``seq`` is one step's moves
    (``("mv", ring, cycles)``) and products (``("mm", rings read, cycles)``) in the kernel's order, ``counts`` the
    tiles of each ring. Both queues run in order; a product waits for its operands' moves, a move for the
    product that read its tile's previous content. The steady state of a few steps in a row."""
    mte1 = cube = 0.0
    moves, cur, read = {}, {}, {}
    ends = []
    for _ in range(reps):
        for kind, ring, c in seq:
            if kind == "mv":
                i = moves.get(ring, 0)
                moves[ring] = i + 1
                slot = (ring, i % max(1, counts.get(ring, 1)))
                mte1 = max(mte1, read.get(slot, 0.0)) + c
                cur[ring] = (slot, mte1)
            else:
                cube = max([cube] + [cur[g][1] for g in ring]) + c
                for g in ring:
                    read[cur[g][0]] = cube
        ends.append(max(mte1, cube))
    return (ends[-1] - ends[1]) / (reps - 2)


def _extent_mix(S, b, edge_share):
    """[(weight, extent)] of a dimension of ``S`` split in blocks of ``b``: the full blocks and, when ``S % b``,
    the edge block with weight ``edge_share`` (one block alone: its own extent)."""
    n = ceil_div(S, b)
    if n == 1 or S % b == 0:
        return [(1.0, float(min(S, b)))]
    if edge_share <= 0:
        return [(1.0, float(b))]
    return [(1.0 - edge_share, float(b)), (edge_share, float(S - (n - 1) * b))]


@cached
def _q_steps(Sq, Skv, qb, kvb, causal, window=0):
    """Steps of each query block's item in the statistics sweep: the KV blocks it sees (causal: up to its
    last row; a sliding window: the band's). In all they are the sweep's pairs (:func:`_pairs`)."""
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    if not causal:
        return (nkv,) * nq
    if window:
        lo, hi = _spans(qb, kvb, Sq, Skv, True, window)
        return tuple((hi - lo).tolist())
    return tuple(ceil_div(min(min((i + 1) * qb, Sq), Skv), kvb) for i in range(nq))


@cached
def _seen_by(qb, kvb, Sq, Skv, window):
    """A sliding window's query blocks ``[i0, i1)`` per KV block j (int arrays) with a row that sees it: from the
    one holding the block's first key to the one holding the last row whose window reaches its last key."""
    j = np.arange(ceil_div(Skv, kvb))
    i0 = np.minimum(j * kvb, Sq) // qb
    return i0, np.maximum(i0, np.minimum(ceil_div(Sq, qb), (np.minimum((j + 1) * kvb, Skv) - 1 + window - 1) // qb + 1))


@cached
def _kv_steps(Sq, Skv, qb, kvb, group, causal, window=0):
    """Steps of each KV block's unit in the main phase: its query heads times the query blocks that see it
    (causal: from the one holding the block's first key; a sliding window: :func:`_seen_by`)."""
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    if not causal:
        return (group * nq,) * nkv
    if window:
        i0, i1 = _seen_by(qb, kvb, Sq, Skv, window)
        return tuple((group * (i1 - i0)).tolist())
    return tuple(group * (nq - min(j * kvb, Sq) // qb) for j in range(nkv))


@cached
def _unit_lengths(Sq, Skv, qb, kvb, group, window):
    """How many different step counts the causal main phase's KV blocks have."""
    return len(set(_kv_steps(Sq, Skv, qb, kvb, group, True, window)))


@cached
def _kv_steps_sum(Sq, Skv, qb, kvb, group, causal, window=0):
    """(blocks, most steps, total steps) of :func:`_kv_steps` in closed form: block 0 takes every query block;
    block j skips the ``min(j·kvb, Sq) // qb`` before its first key, the floors of a progression up to Sq."""
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    if window:
        steps = _kv_steps(Sq, Skv, qb, kvb, group, causal, window)
        return nkv, max(steps), sum(steps)
    skipped = 0
    if causal:
        within = min(nkv, Sq // kvb + 1)              # the blocks starting at or before Sq
        skipped = _floor_sum(within - 1, kvb, qb) + (nkv - within) * (Sq // qb)
    return nkv, group * nq, group * (nq * nkv - skipped)


@cached
def _ws_lines(BNkv, Sq, Skv, qb, kvb, group, causal, ncores, window=0):
    """Elements (rows · keys) of the distinct hand-off workspace regions the main phase writes, over every
    core and slot: L2 keeps a line per region written, so a slot written with a full block and with an edge
    block (fewer rows or keys) holds both. Each core's units from the kernel's dealing; a unit's steps run
    over its query heads, each over the query blocks that see its KV block, the slot alternating per step.

    The regions a unit writes depend only on the slot its first step takes (and the slots repeat after two
    heads): each unit's regions are listed once from either slot. Walking the dealing, a core's slot before a
    unit is the parity of the steps it has run; it holds the union of the region sets of its (unit, slot)
    pairs."""
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    per_block = _kv_steps(Sq, Skv, qb, kvb, group, causal, window)
    seen = _seen_by(qb, kvb, Sq, Skv, window)[1].tolist() if window else None
    (cores, _, _), paired = _dealing(BNkv, per_block, causal, ncores)
    owner = _deal(_units(per_block, paired), BNkv, ncores, owners=True)[1]
    blocks = _units(tuple(range(nkv)), paired)
    edge_q = Sq - (nq - 1) * qb
    regions, kind, odd = {}, [], []         # distinct region sets; each unit's set id from slot 0 / 1
    for unit in blocks:
        rs, p = set(), 0
        for j in unit:
            ke, n_i = min(kvb, Skv - j * kvb), per_block[j] // group
            # the unit's last query block: the edge one, but a window's may end before it
            last_q = edge_q if not window or seen[j] == nq else qb
            for h in range(min(group, 2)):
                q = p + h * n_i
                if n_i > 2:
                    rs.update({(0, qb, ke), (1, qb, ke)})
                elif n_i == 2:
                    rs.add((q % 2, qb, ke))
                if n_i:
                    rs.add(((q + n_i - 1) % 2, last_q, ke))
            p += group * n_i
        for flipped in (rs, {(1 - s, r, k) for s, r, k in rs}):        # from slot 1 every slot swaps
            kind.append(regions.setdefault(frozenset(flipped), len(regions)))
        odd.append(p % 2)
    L, K = len(blocks), len(regions)
    slot, held = [0] * cores, set()             # each core's slot; (core, region set) pairs as core·K + set id
    for x, c in enumerate(owner):
        u = x % L
        held.add(c * K + kind[2 * u + slot[c]])
        slot[c] ^= odd[u]
    sets = list(regions)
    lines = [set() for _ in range(cores)]
    for key in held:
        lines[key // K] |= sets[key % K]
    return sum(r * k for ls in lines for _, r, k in ls)


def _ceil_sum(n, a, b):
    """Σ ceil(t·a / b) for t = 1..n. The sequence is periodic up to a shift: t + b/g (g = gcd(a, b)) adds
    exactly a/g, so whole periods are an arithmetic series and only one period is summed term by term."""
    g = math.gcd(a, b)
    period, step = b // g, a // g
    whole, rest = divmod(n, period)
    first = [ceil_div(t * a, b) for t in range(1, period + 1)]
    return (whole * sum(first) + step * period * whole * (whole - 1) // 2
            + sum(first[:rest]) + rest * whole * step)


def _floor_sum(n, a, b):
    """Σ floor(t·a / b) for t = 1..n: the ceilings less one for each t·a that b does not divide."""
    return _ceil_sum(n, a, b) - n + n // (b // math.gcd(a, b))


class _Sweep(NamedTuple):
    """Sums over the (query block, KV block) pairs a causal or full sweep visits (qe, ke: the pair's rows and
    keys)."""
    count: int          # pairs
    rows: int           # Σ qe
    keys: int           # Σ ke
    area: int           # Σ qe·ke
    rows_last: int      # Σ qe over the pairs with the last KV block (an edge block when kvb does not divide Skv)


@cached
def _pairs(Sq, Skv, qb, kvb, causal, window=0):
    """:class:`_Sweep` in closed form. Query block i sees the KV blocks up to its last row ``e_i`` (causal; all
    blocks otherwise): ``nj = ceil(min(e_i, Skv) / kvb)`` of them, ``min(nj·kvb, Skv)`` keys. The full query
    blocks (``e = t·qb``, t = 1..nq-1) that end before ``Skv`` see ``ceil(t·qb / kvb)`` blocks (a
    :func:`_ceil_sum`), their keys a whole number of blocks except where that block is the last, an edge;
    the others see every block; the last query block (its rows an edge) is added on its own."""
    nq, nkv = ceil_div(Sq, qb), ceil_div(Skv, kvb)
    if not causal:
        return _Sweep(nq * nkv, nkv * Sq, nq * Skv, Sq * Skv, Sq)
    if window:                    # a sliding window: each query block's band of KV blocks, summed
        lo, hi = _spans(qb, kvb, Sq, Skv, True, window)
        qe = np.minimum(qb, Sq - np.arange(nq) * qb)
        k = np.minimum(hi * kvb, Skv) - lo * kvb
        return _Sweep(int((hi - lo).sum()), int((qe * (hi - lo)).sum()), int(k.sum()), int((qe * k).sum()),
                      int(qe[hi == nkv].sum()))
    edge_keys = nkv * kvb - Skv                   # keys the last KV block lacks
    t1 = min(nq - 1, (Skv - 1) // qb)             # full query blocks ending before Skv: t = 1..t1
    t0 = (nkv - 1) * kvb // qb                    # ... of which t > t0 reach the last KV block
    nj_full = _ceil_sum(t1, qb, kvb) + (nq - 1 - t1) * nkv
    keys_full = nj_full * kvb - (max(0, t1 - t0) + nq - 1 - t1) * edge_keys
    qe_last = Sq - (nq - 1) * qb
    nj_last = ceil_div(min(Sq, Skv), kvb)
    keys_last = min(nj_last * kvb, Skv)
    # the query blocks that reach the last KV block: from the first whose last row passes its start
    start = (nkv - 1) * kvb
    rows_last = 0 if Sq <= start else Sq - min(nq - 1, start // qb) * qb
    return _Sweep(nj_full + nj_last, qb * nj_full + qe_last * nj_last, keys_full + keys_last,
                  qb * keys_full + qe_last * keys_last, rows_last)


def _gm_bytes(B, N, Nkv, Sq, Skv, D, Dv, isz, kvb, sweep, split, mask, msz, drop, stats, f32):
    """Bytes per GM path, counted as the kernel moves them (every pair of ``sweep`` of every head; K, V per
    unit)."""
    BN, BNS = B * N, B * N * Sq
    sq, sk, sqk = sweep.rows, sweep.keys, sweep.area
    kv_unit = B * Nkv * Skv * (D + Dv) * isz                     # K, V (and dK, dV) once per unit
    mrows = 1 if mask is None else ((1,) * (4 - len(mask[0])) + tuple(mask[0]))[2] != 1
    mcols = 1 if mask is None else ((1,) * (4 - len(mask[0])) + tuple(mask[0]))[3] != 1
    mask_pair = 0.0 if mask is None else msz * (sqk if mrows and mcols else (sq if mrows else (sk if mcols else 0)))
    b = {"GM->UB": 2 * BNS * Dv * isz + BN * (3 * sq * 4 + mask_pair),
         "UB->GM": BNS * 4 + BNS * D * 4 + BN * 2 * sqk * isz,
         "GM->L1": kv_unit + BN * (sq * (D + Dv) * isz + 2 * sqk * isz)}
    if mask is not None and mask_pair == 0.0:
        b["GM->UB"] += BN * msz * sweep.count
    if drop:
        b["GM->UB"] += BN * _sum_drop(sweep, Skv, kvb)
    if stats:
        b["GM->L1"] += BNS * D * isz + BN * sk * D * isz          # each item's Q once, K per (item, tile)
        b["GM->UB"] += BN * mask_pair
        b["UB->GM"] += 2 * BNS * 4
        if split:
            b["L0C->GM"] = b.get("L0C->GM", 0) + BN * sqk * 4
            b["GM->UB"] += BN * sqk * 4
    if split:
        b["L0C->GM"] = b.get("L0C->GM", 0) + BN * (2 * sqk * 4 + sq * D * 4) + kv_unit
        b["GM->UB"] += BN * 2 * sqk * 4
    else:
        b["UB->GM"] += BN * sq * D * 4 + kv_unit
    if not f32:
        b["GM->UB"] += BNS * D * 4
        b["UB->GM"] += BNS * D * isz
    return b


def _sum_drop(sweep, Skv, kvb):
    """Keep-mask bytes the main phase loads: ceil(ke / 8) per row of every pair (the last KV block's keys may
    be an edge)."""
    full, edge = ceil_div(kvb, 8), ceil_div(Skv - (ceil_div(Skv, kvb) - 1) * kvb, 8)
    return full * sweep.rows - (full - edge) * sweep.rows_last


def flops(B, N, Sq, Skv, D, Dv, causal, window=0):
    return 2.0 * B * N * attended_pairs(Sq, Skv, causal, window) * (3 * D + 2 * Dv)


def _mask_spec(mask):
    if mask is None:
        return None
    m4 = (1,) * (4 - len(mask[0])) + tuple(mask[0])
    return (mask[1], m4[2] != 1, m4[3] != 1)


def _roofline(dev, specs, mask=None, causal=False, drop=False, window=0, **_):
    (qs, dtype), (ks, _), (vs, _) = specs[:3]
    B, N, Sq, D = qs
    Skv, Dv = ks[2], vs[3]
    isz = itemsize(dtype)
    io = (2 * math.prod(qs[:3]) * (D + 2 * Dv) + 2 * (math.prod(ks) + math.prod(vs))) * isz
    if mask is not None:
        io += math.prod(mask[0]) * itemsize(mask[1])
    fl = flops(B, N, Sq, Skv, D, Dv, causal, window)
    return max(fl / (2.0 * dev.cube_macs[dtype] * dev.cube_cores), io / dev.hbm_bytes_per_cycle)


# tiles of at most this many elements (q·kv) nearly always fit and are rarely the cheapest: the search checks
# their fit only when one comes to be modelled; larger ones often overflow and are checked before their bound
SMALL_TILE = 64 * 32



@cached
def _search(device, specs, mask, causal, drop, stats, cap=False, window=0):
    """The fitting tiling of the fewest cycles (the first in :func:`_tilings` order among equals), and its
    model.

    Dealing the main phase's units to the cores is most of a model's work, so each candidate is first
    bounded: the model with the dealings' lower bounds (:func:`_schedule_floor`), no dirty hand-off lines,
    the Dr phase's loads overlapping its sums, the shorter of its two forms, a replayed statistics sweep as
    its mean core's steps at each kind's busiest unit that no port wait touches, no L0 ring chain (which only adds),
    and a main phase with edge blocks priced core by core where the dealing is round-robin, else as its cores' mean
    (at most the busiest core's) (``bound=True``). The model's
    cycles never decrease as its cores, steps, blocks (at a given steps count) or blocks per step grow: each
    phase's time is its steps times a step's busiest unit, whose per-block terms (K and V loads, the unit's
    bubble) scale with the blocks per step, plus a fill that grows with the blocks per step; HBM bytes only
    grow with the lines. So the bound is at most the exact cycles, and the
    candidates are modelled exactly in the order of their bounds until the next bound exceeds the best found:
    none of the rest can be cheaper. Once a best is found, a candidate is first bounded again with its statistics
    sweep priced as the model prices it (``sharp``: the bound's loosest part for short launches) and passed over
    when that is above the best. A candidate that does not fit is passed over, whenever its fit is checked
    (:data:`SMALL_TILE`)."""
    dev = get_device(device)
    (qs, dtype), (ks, _), (vs, _) = specs[:3]
    cands = _tilings(qs[2], ks[2])

    def fits(t):
        return _fits(device, qs[3], vs[3], dtype, t["q"], t["kv"], _mask_spec(mask), drop, stats, cap)

    bounds, bounded = [], {}
    for i, t in enumerate(cands):
        if t["q"] * t["kv"] <= SMALL_TILE or fits(t):
            bounded[i] = res = _model(dev, specs, mask, causal, t, drop, stats, True, cap, window)
            bounds.append((kernel_cycles(dev, *res[:3]), i))
    bounds.sort()
    best = None
    for low, i in bounds:
        if best is not None and low > best[0] * (1 + ROUNDING):
            break
        if cands[i]["q"] * cands[i]["kv"] <= SMALL_TILE and not fits(cands[i]):
            continue
        if best is not None and stats:
            # before the whole model, a sharper bound: the statistics sweep as the model prices it (its dealing and
            # replay are then cached for the model), the bound's other phases, HBM and GM bytes as they were (the
            # same sum, in the same order, as a bound made with ``sharp`` gives)
            _, hbm, nbytes, _, _, _, (ph0, _, ph2, ph3) = bounded[i]
            ph1 = _model(dev, specs, mask, causal, cands[i], drop, stats, True, cap, window, sharp=True,
                         stats_only=True)
            low = kernel_cycles(dev, ph0 + ph1 + ph2 + ph3, hbm, nbytes)
            if low > best[0] * (1 + ROUNDING):
                continue
        res = _model(dev, specs, mask, causal, cands[i], drop, stats, cap=cap, window=window)
        cost = kernel_cycles(dev, *res[:3])
        if best is None or (cost, i) < best[:2]:
            best = (cost, i, res)
    if best is None:
        raise ValueError(f"flash_attention_grad: no tiling fits {dev.name}")
    return cands[best[1]], best[2]


@register("flash_attention_grad", _roofline)
def estimate_flash_attention_grad(dev, specs, mask=None, drop_mask=None, softmax_max=None, softmax_sum=None,
                                  scale=None, causal=False, keep_prob=1.0, fill=float("-inf"), empty_rows="zero",
                                  tiling=None, softcap=None, window=0, mask_add_dtype=None, fill_in_mask=False):
    """``specs``: q, k, v, out, dout. ``mask``/``drop_mask``: their specs; ``softmax_max`` given: no statistics
    sweep. ``fill``/``empty_rows``/``scale``/``keep_prob`` change values, not the work (a finite bool fill adds
    the select that zeroes dS); ``fill_in_mask`` (an additive mask): its filled entries take the fill in both
    phases' recompute, a compare and a select per score more. ``softcap``: the cap's passes in both phases,
    its derivative's three in phase 2 and the tanh tile; its value changes values only. ``window`` (with
    ``causal``): a sliding window, the band's (query block, KV block) pairs only, those crossing its left edge with a
    compare and a select more. ``mask_add_dtype``: a 16-bit additive mask added in its dtype, as the forward adds it
    (one Vector pass per score more in both phases: the scores cast down, the add, the sum cast back up)."""
    window = int(window or 0)
    specs = tuple(specs[:5])
    mask = with_add_dtype(mask, mask_add_dtype, "flash_attention_grad", bool(fill_in_mask))
    drop = drop_mask is not None
    stats = softmax_max is None
    cap = softcap is not None
    if tiling is None:
        t, res = _search(dev.name, specs, mask, bool(causal), drop, stats, cap, window)
    else:
        t = {k: int(tiling[k]) for k in ("q", "kv")}
        (qs, dtype), _, (vs, _) = specs[:3]
        if not _fits(dev.name, qs[3], vs[3], dtype, t["q"], t["kv"], _mask_spec(mask), drop, stats, cap):
            raise ValueError(f"flash_attention_grad tiling {t} does not fit {dev.name}")
        res = _model(dev, specs, mask, bool(causal), t, drop, stats, cap=cap, window=window)
    core, hbm, nbytes, busy, ws, phases = res
    (qs, _), (ks, _), (vs, _) = specs[:3]
    return make("flash_attention_grad", dev, core, hbm, nbytes, busy, dict(t),
                _roofline(dev, specs, mask, causal, drop, window),
                flops(qs[0], qs[1], qs[2], ks[2], qs[3], vs[3], causal, window),
                workspace=ws, phases=phases)


__all__ = ["estimate_flash_attention_grad"]
