"""MC2 kernels (``autofuse/npu/kernels/mc2.py``): a matmul cut into row tiles, each tile's collective
overlapping the next tile's products; and the choice of the tile count.

The model replays the kernel's two-stage pipeline:

* compute: tile t's products take the matmul model's cycles for its rows (``cost_model.matmul``, with the
  kernel's tiling for the UB the collective leaves it), tiles back to back on the Cube;
* communication: tile t's collective starts when tile t is stored and is replayed on the rank's link lanes
  and Vector cores (:class:`cost_model.collectives.LinkReplay`), which carry over from tile to tile;
* on coupled chips the adds share the AI cores' MTE queues with the matmul: tile t-1's adds start after tile
  t's products are issued, and tile t+1's products after those adds (the kernel's program order).

``link time`` is the busiest lane's occupancy, ``overlap`` the part of the shorter of compute and link
time hidden under the other: ``(compute + communication alone) - fused``.

:func:`choose_tiles` prices tile counts 1, 2, 4, 8, 16 (as far as the rows allow) against the unfused pair
(the matmul with its searched tiling, then the collective: two launches) and returns the best, or 0 with
the reason when no tile count beats the unfused pair.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from cost_model.collectives import LinkReplay, nslices, _algorithm
from cost_model.common import ceil_div, itemsize, round_up
from cost_model.devices import get_device
from cost_model.estimate import estimate, kernel_cycles, make, register
from cost_model.matmul import _model, fits, kernel_default

KINDS = {"matmul_all_reduce": "all_reduce", "matmul_reduce_scatter": "reduce_scatter",
         "all_gather_matmul": "all_gather"}
TILE_COUNTS = (1, 2, 4, 8, 16)


def shared_ub_device(dev):
    if dev.arch != "coupled":
        return dev
    return replace(dev, buffers=MappingProxyType({**dev.buffers, "UB": dev.buffers["UB"] // 2}))


def mc2_tiling(dev, M, N, K, dtype):
    mdev = shared_ub_device(dev)
    t = kernel_default(mdev, M, N, K, 1, dtype, dtype)
    if t is None or not fits(mdev, dtype, dtype, t):
        raise ValueError(f"no MC2 matmul tiling fits {dev.name} for {dtype}")
    return t


def row_tiles(rows, m0, tiles):
    nb = ceil_div(rows, m0)
    T = max(1, min(tiles, nb))
    cuts = [min(rows, (nb * t // T) * m0) for t in range(T + 1)]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _mm(dev, rows, N, K, dtype, t):
    core, hbm, nbytes, busy = _model(dev, rows, N, K, 1, False, False, dtype, dtype, t, 0)
    return kernel_cycles(dev, core, hbm, nbytes), hbm, busy.get("cube", 0.0)


def _dims(specs):
    (xs, dt), (ws, dtw) = specs[0], specs[1]
    if len(ws) != 2 or xs[-1] != ws[0] or dt != dtw:
        raise ValueError(f"MC2: x {list(xs)} {dt} @ w {list(ws)} {dtw} is not a matmul with a 2-D weight")
    return math.prod(xs[:-1]), xs[-1], ws[1], dt


@dataclass(frozen=True)
class Plan:
    """What the cost model decides for one matmul + collective pair."""

    tiles: int                 # 0: keep unfused
    fused_cycles: int          # at the best tile count (also when that does not pay)
    unfused_cycles: int
    matmul_cycles: int
    collective_cycles: int
    link_cycles: int
    overlap_cycles: int
    reason: str
    best_tiles: int = 1        # the fastest tile count, paying or not
    hbm_bytes: int = 0         # of the fused launch
    tiling: dict = field(default_factory=dict)     # the fused launch's matmul tiling
    bound: str = ""            # the fused launch's busiest unit
    workspace: int = 0         # GM the fused launch allocates besides its outputs

    @property
    def speedup(self) -> float:
        return self.unfused_cycles / self.fused_cycles if self.fused_cycles else 0.0


def _replay(kind, dev, M, K, N, dtype, world, tiles, algorithm):
    """(cycles before launch overhead, HBM bytes, link busy, cube busy) of one fused launch."""
    op = KINDS[kind]
    algorithm = _algorithm(dev, op, world, algorithm)
    p = world
    rows_all = p * M if kind == "all_gather_matmul" else M
    t = mc2_tiling(dev, rows_all, N, K, dtype)
    isz = itemsize(dtype)
    shared = 2 * t["m0"] * t["n0"] * isz if dev.arch == "coupled" else None
    rep = LinkReplay(dev, p, dtype, ub_shared=shared)
    coupled = dev.arch == "coupled"
    ranks = list(range(p))
    clock = 0.0

    # The tiles run back to back on one program: the weight stays in L2 and one sweep's fill hides under the
    # previous one's drain, so a sweep costs the whole matmul's cycles per wave of base tiles times its waves
    # (a sweep with fewer blocks than cores still takes a whole wave).
    whole, hbm, cube = _mm(dev, rows_all, N, K, dtype, t)
    nn = ceil_div(N, t["n0"])
    waves_all = ceil_div(ceil_div(rows_all, t["m0"]) * nn, dev.cube_cores)

    height = round_up(min(rows_all, t["m0"]), 16)

    def mm(rows, start, spans=1):
        blocks = spans * ceil_div(rows, t["m0"]) * nn
        # blocks shorter than the whole matmul's keep the Cube busy for fewer rows
        short = round_up(min(rows, t["m0"]), 16) / height
        return start + whole * ceil_div(blocks, dev.cube_cores) / waves_all * short

    if kind == "all_gather_matmul":
        own = rep.copy(M * K, 0.0)
        ranges = row_tiles(M, t["m0"], tiles)
        arrivals = []
        for r0, r1 in ranges:
            if p > 1:
                pieces = [(r1 - r0) * K] * p
                S = nslices(max(pieces) * isz)
                rd = [[own] * S for _ in range(p)]
                rep.all_gather(pieces, ranks, rd, algorithm)
                arrivals.append(max(max(r) for j, r in enumerate(rd) if j != 0))
        if len(ranges) == 1 and p > 1:
            clock = mm(p * M, max(arrivals + [own]))
        else:
            clock = mm(M, own if coupled else 0.0)
            for (r0, r1), arr in zip(ranges, arrivals):
                clock = mm(r1 - r0, max(clock, arr), p - 1)
        end = max(clock, rep.last)
        return end, hbm + rep.hbm, rep.link_busy(), cube, t

    share = M // p if kind == "matmul_reduce_scatter" else M
    pending = None

    def communicate(r0, r1, ready):
        if coupled:
            rep.vec_free = max(rep.vec_free, clock)
        if kind == "matmul_all_reduce":
            rep.all_reduce((r1 - r0) * N, ranks, ready, algorithm)
        elif p > 1:
            pieces = [(r1 - r0) * N] * p
            S = nslices(max(pieces) * isz)
            rep.reduce_scatter(pieces, ranks, [[ready] * S for _ in range(p)], algorithm)

    ranges = row_tiles(share, t["m0"], tiles)
    for r0, r1 in ranges:
        start = max(clock, rep.vec_free) if coupled and pending is not None else clock
        if kind == "matmul_reduce_scatter" and len(ranges) > 1:
            done = mm(r1 - r0, start, p)             # tile t of every rank's share
        else:
            done = mm(M if kind == "matmul_reduce_scatter" else r1 - r0, start)
        clock = done
        if pending is not None:
            communicate(*pending)
        pending = (r0, r1, done)
    communicate(*pending)
    return max(clock, rep.last), hbm + rep.hbm, rep.link_busy(), cube, t


def _estimate(kind, dev, specs, world=None, tiles=4, algorithm=None, rank=0, comm=None, tiling=None,
              slice_bytes=None):
    M, K, N, dtype = _dims(specs)
    p = int(world or 1)
    end, hbm, link, cube, t = _replay(kind, dev, M, K, N, dtype, p, int(tiles), algorithm)
    rows = p * M if kind == "all_gather_matmul" else M
    fl = 2.0 * rows * N * K
    busy = {"link": link, "cube": cube}
    return make(kind, dev, end, hbm, {}, busy, dict(t), link, fl, notes=(f"{int(tiles)} tiles",))


@register("matmul_all_reduce")
def estimate_matmul_all_reduce(dev, specs, **kw):
    return _estimate("matmul_all_reduce", dev, specs, **kw)


@register("matmul_reduce_scatter")
def estimate_matmul_reduce_scatter(dev, specs, **kw):
    return _estimate("matmul_reduce_scatter", dev, specs, **kw)


@register("all_gather_matmul")
def estimate_all_gather_matmul(dev, specs, **kw):
    return _estimate("all_gather_matmul", dev, specs, **kw)


def unfused(kind, x, w, device, world, algorithm=None) -> tuple[int, int]:
    """(matmul cycles, collective cycles) of the unfused pair: two launches, the matmul's tiling searched."""
    M, K, N, dtype = _dims([x, w])
    p = int(world)
    if kind == "all_gather_matmul":
        coll = estimate("all_gather", [((M, K), dtype)], device=device, world=p, algorithm=algorithm)
        mm = estimate("matmul", [((p * M, K), dtype), ((K, N), dtype)], device=device)
    else:
        mm = estimate("matmul", [((M, K), dtype), ((K, N), dtype)], device=device)
        coll = estimate(KINDS[kind], [((M, N), dtype)], device=device, world=p, algorithm=algorithm)
    return mm.cycles, coll.cycles


def choose_tiles(kind: str, x, w, device, world: int, algorithm=None, counts=TILE_COUNTS, baseline=None,
                 search_tiling: bool = True) -> Plan:
    """The tile count that makes the fused kernel fastest, or ``tiles=0`` (keep unfused) with the reason.

    ``x``, ``w``: ``(shape, dtype)`` of the matmul operands as the fused op takes them (x [..., K], w [K, N]).
    ``baseline``: the unfused pair's cycles if the caller priced it (the planner prices the captured nodes);
    else the matmul with its searched tiling, then the collective: two launches.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown MC2 kernel {kind!r}: choose one of {', '.join(KINDS)}")
    dev = get_device(device)
    mm, coll = unfused(kind, x, w, dev.name, world, algorithm)
    base = int(baseline) if baseline is not None else mm + coll
    best = None
    for T in counts:
        e = estimate(kind, [x, w], device=dev.name, world=world, tiles=T, algorithm=algorithm)
        if best is None or e.cycles < best[1].cycles:
            best = (T, e)
    T, e = best
    link = int(e.busy.get("link", 0))
    overlap = max(0, mm + coll - dev.launch_cycles - e.cycles)
    common = dict(best_tiles=T, hbm_bytes=e.hbm_bytes, tiling=dict(e.tiling or {}), bound=e.bound,
                  workspace=e.workspace_bytes)
    if e.cycles >= base:
        return Plan(0, e.cycles, base, mm, coll, link, overlap,
                    f"fused {e.cycles:,} cycles (best at {T} tiles) is no faster than the unfused pair's {base:,} "
                    f"(matmul {mm:,} + {KINDS[kind]} {coll:,})", **common)
    return Plan(T, e.cycles, base, mm, coll, link, overlap,
                f"fused at {T} tiles: {e.cycles:,} cycles vs {base:,} unfused ({base / e.cycles:.2f}x)", **common)


__all__ = ["KINDS", "Plan", "choose_tiles", "mc2_tiling", "row_tiles", "shared_ub_device", "unfused"]
