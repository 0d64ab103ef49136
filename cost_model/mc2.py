"""MC2 kernels (``autofuse/npu/kernels/mc2.py``): a matmul cut into tiles, each tile's collective overlapping
the later tiles' products; and the choice of the tile count (and, at O3, of the matmul tiling for it).

The model replays the kernel's schedule:

* tiles: row tiles of whole ``m0`` blocks when the rows hold enough of them, else equal column tiles of whole
  ``n0`` blocks (:func:`tile_plan`, the kernel's rule);
* compute: the kernel issues its blocks in lockstep waves over every Cube core, a wave filling up with the
  next tile's blocks; a block occupies its core for one wave of the whole matmul as ``cost_model.matmul``
  prices it with the same tiling (its cycles over its waves), scaled by the block's rows; it starts when its
  core is free and its operands are there (all_gather_matmul: that peer's rows of that tile have landed). A
  tile is done when the waves holding its blocks are. Column tiles of rows that fit one block keep x in L1
  (the kernel's ``_Resident``): a block then streams only its weight columns (:func:`_resident`);
* communication: a tile's collective starts when the tile is done (after the next tile's blocks are issued:
  the two-stage pipeline) and is replayed on the rank's link lanes and Vector cores
  (:class:`cost_model.collectives.LinkReplay`), which carry over from tile to tile, with the algorithm the
  kernel picks for the tile's size;
* on coupled chips the adds share the AI cores' MTE queues with the matmul: a tile's adds start after the
  blocks issued before them, and the next blocks after those adds.

``link time`` is the busiest lane's occupancy, ``overlap`` the part of the shorter of compute and link
time hidden under the other: ``(compute + communication alone) - fused``.

:func:`choose_tiles` prices tile counts 1, 2, 4, 8, 16 (as far as the blocks allow) against the unfused pair
(the matmul with its searched tiling, then the collective: two launches). With ``search_tiling`` (the
planner's O3) each tile count gets its own matmul tiling: every tiling the matmul's search considers, priced
by this replay (a tile count that pipelines the weight's columns needs blocks narrow enough for each tile to
fill the cores, which the plain matmul would not pick). It returns the best, or 0 with the reason when none
beats the unfused pair.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from cost_model.collectives import LinkReplay, _algorithm, nslices, pieces_of
from cost_model.common import ceil_div, itemsize, round_up
from cost_model.devices import get_device
from cost_model.links import get_links
from cost_model.estimate import cached, estimate, kernel_cycles, make, register
from cost_model.matmul import _candidates, _model, fits, kernel_default

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


def tile_plan(rows, N, m0, n0, tiles):
    """The kernel's tiles: ``("rows", row ranges)`` or ``("cols", column ranges)`` (see the module docstring)."""
    nc = N // n0 if N % n0 == 0 else 1
    tc = max(d for d in range(1, min(tiles, nc) + 1) if nc % d == 0)
    nr = ceil_div(rows, m0)
    if nr >= tiles or nr >= tc:
        return "rows", row_tiles(rows, m0, tiles)
    return "cols", [(i * N // tc, (i + 1) * N // tc) for i in range(tc)]


def tile_algorithm(algorithm, last):
    """The kernel's per-tile algorithm: ``"A|B"`` is B for the last tile and A for the others."""
    return (algorithm.split("|")[-1] if last else algorithm.split("|")[0]) if algorithm else None


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
    algorithm: str = ""        # the tiles' collective algorithm, when not the size-based default

    @property
    def speedup(self) -> float:
        return self.unfused_cycles / self.fused_cycles if self.fused_cycles else 0.0


class _Cube:
    """The kernel's Cube schedule, replayed: blocks in lockstep waves over the cores (see the module docstring)."""

    def __init__(self, dev, rows_all, N, K, dtype, t, batch=1, resident=False):
        """``batch``: blocks of that many matmuls of ``rows_all`` rows each, each with its own weight (the
        segments of a grouped GEMM). ``resident``: x kept in L1 (:func:`_resident`)."""
        key = (dev.name, rows_all, N, K, dtype, tuple(sorted(t.items())))
        self.per_wave, self.hbm, self.cube_busy, start = _resident(*key) if resident else _waves(*key, batch) + (0.0,)
        self.height = round_up(min(rows_all, t["m0"]), 16)
        self.n = dev.cube_cores
        self.free = [start] * self.n
        self.wave, self.key, self.done = [], None, {}

    def add(self, key, rows, ready=0.0, tag=None):
        """Blocks of ``rows`` rows each (a list) reading operands ``key``, ready at ``ready`` (or one each)."""
        if key != self.key:
            self.flush()
            self.key = key
        for i, r in enumerate(rows):
            self.wave.append((r, ready[i] if isinstance(ready, list) else ready, tag))
            if len(self.wave) == self.n:
                self.flush()

    def pending(self, tag) -> bool:
        return tag in {t for *_, t in self.wave}

    def flush(self):
        if not self.wave:
            return
        end = 0.0
        for c, (rows, ready, _) in enumerate(self.wave):
            self.free[c] = max(self.free[c], ready) + self.per_wave * round_up(min(rows, self.height), 16) / self.height
            end = max(end, self.free[c])
        for _, _, tag in self.wave:
            self.done[tag] = max(self.done.get(tag, 0.0), end)
        self.wave = []

    def wait(self, t):
        """The cores' next blocks start after ``t`` (coupled chips: the adds issued before them)."""
        self.free = [max(f, t) for f in self.free]

    @property
    def end(self) -> float:
        return max(self.free)


@cached
def _waves(device, rows_all, N, K, dtype, t, batch=1):
    """(cycles per wave, HBM bytes, Cube busy) of the whole matmul (``batch`` of them) with tiling ``t``."""
    dev, t = get_device(device), dict(t)
    core, hbm, nbytes, busy = _model(dev, rows_all, N, K, batch, batch > 1, batch > 1, dtype, dtype, t, 0)
    waves = ceil_div(batch * ceil_div(rows_all, t["m0"]) * ceil_div(N, t["n0"]), dev.cube_cores)
    return kernel_cycles(dev, core, hbm, nbytes) / waves, hbm, busy.get("cube", 0.0)


@cached
def _resident(device, M, N, K, dtype, t):
    """(cycles per wave, HBM bytes, Cube busy, fill) of the kernel's schedule with x resident in L1 (M rows, one
    block): per block its weight columns ``K × n0`` stream GM→L1 (every core's at once sharing the HBM
    bandwidth, at least the MTE2 rate), the Cube's fractals and the L1→L0 moves of x and the weight overlap
    (double-buffered); the fill is x's load into every core (one miss, the rest L2 hits) and the first chunk."""
    dev, t = get_device(device), dict(t)
    isz = itemsize(dtype)
    n0, k1 = t["n0"], t["k1"]
    n = min(dev.cube_cores, ceil_div(N, n0))
    b = K * n0 * isz
    rates = dev.rates
    port = max(b / rates["GM->L1"], n * b / dev.hbm_bytes_per_cycle)
    cube = ceil_div(M, 16) * ceil_div(K, dev.cube_k0[dtype]) * ceil_div(n0, 16)
    mte1 = K * isz * (round_up(M, 16) / rates["L1->L0A"] + round_up(n0, 16) / rates["L1->L0B"])
    out = M * n0 * isz / (rates["UB->GM"] if dev.arch == "coupled" else rates["L0C->GM"])
    per_wave = max(port, cube, mte1, out)
    a = M * K * isz
    fill = max(a / rates["GM->L1"], n * a / dev.l2_bytes_per_cycle) + k1 * n0 * isz / rates["GM->L1"]
    blocks = ceil_div(N, n0)
    return per_wave, float(a + K * N * isz + M * N * isz), float(cube * ceil_div(blocks, dev.cube_cores)), fill


def _block_rows(r0, r1, m0, ncols):
    return [min(m0, r1 - b) for b in range(r0, r1, m0) for _ in range(ncols)]


def _pipeline(cube, rep, coupled, parts, communicate):
    """Tile t's blocks, then the collective of every earlier tile whose blocks are issued, a second phase (an
    all-reduce's all-gather) after the next tile's first (the kernel's order)."""
    sent, later = 0, [None]

    def send(i):
        if coupled:
            rep.vec_free = max(rep.vec_free, cube.end)
        phase2 = communicate(parts[i][0], cube.done[i], i == len(parts) - 1)
        if later[0] is not None:
            later[0]()
        later[0] = phase2
        if coupled:
            cube.wait(rep.vec_free)

    for t, (_, rows) in enumerate(parts):
        cube.add("x", rows, tag=t)
        while sent < t and not cube.pending(sent):
            send(sent)
            sent += 1
    cube.flush()
    for i in range(sent, len(parts)):
        send(i)
    if later[0] is not None:
        later[0]()


def _replay(kind, dev, M, K, N, dtype, world, tiles, algorithm, t):
    """(cycles before launch overhead, HBM bytes, link busy, cube busy, workspace) of one fused launch."""
    op = KINDS[kind]
    p = world
    isz = itemsize(dtype)
    rows_all = p * M if kind == "all_gather_matmul" else M
    def links_alg(nbytes, last=False):
        return _algorithm(dev, op, p, tile_algorithm(algorithm, last), nbytes)

    shared = 2 * t["m0"] * t["n0"] * isz if dev.arch == "coupled" else None
    rep = LinkReplay(dev, p, dtype, ub_shared=shared)
    coupled = dev.arch == "coupled"
    ranks = list(range(p))
    m0, nn = t["m0"], ceil_div(N, t["n0"])
    tiled = M // p if kind == "matmul_reduce_scatter" else M
    resident = (kind != "all_gather_matmul" and M <= m0 and tile_plan(tiled, N, m0, t["n0"], tiles)[0] == "cols"
                and (m0 * round_up(K, t["k0"]) + 2 * t["k1"] * t["n0"]) * isz <= dev.buffers["L1"] - 64)
    cube = _Cube(dev, rows_all, N, K, dtype, t, resident=resident)

    if kind == "all_gather_matmul":
        own = rep.copy(M * K, 0.0)
        ranges = row_tiles(M, m0, tiles)
        arrivals = []
        for r0, r1 in ranges:
            if p > 1:
                rd = [[own] * nslices((r1 - r0) * K * isz) for _ in range(p)]
                rep.all_gather([(r1 - r0) * K] * p, ranks, rd, links_alg(0))
                arrivals.append(max(max(r) for r in rd[1:]))
        if len(ranges) == 1 or p == 1:
            cube.add("gathered", _block_rows(0, p * M, m0, nn), max([own] + arrivals))
        else:
            cube.add("x", _block_rows(0, M, m0, nn))
            for (r0, r1), arr in zip(ranges, arrivals):
                cube.add("gathered", _block_rows(r0, r1, m0, nn) * (p - 1), arr)
        cube.flush()
        return max(cube.end, rep.last), cube.hbm + rep.hbm, rep.link_busy(), cube.cube_busy, 2 * p * M * K * isz * 0

    share = M // p if kind == "matmul_reduce_scatter" else M
    split, ranges = tile_plan(share, N, m0, t["n0"], tiles)
    if split == "rows":
        reps = p if kind == "matmul_reduce_scatter" and len(ranges) > 1 else 1
        parts = [((r1 - r0) * N, _block_rows(0, M, m0, nn) if kind == "matmul_reduce_scatter" and len(ranges) == 1
                  else _block_rows(r0, r1, m0, nn) * reps) for r0, r1 in ranges]
    else:
        parts = [((c1 - c0) * M // (p if kind == "matmul_reduce_scatter" else 1),
                  _block_rows(0, M, m0, ceil_div(c1 - c0, t["n0"]))) for c0, c1 in ranges]

    def communicate(n, ready, last):
        if kind == "matmul_all_reduce":
            alg = links_alg(n * isz, last)
            if alg not in ("mesh", "ring") or p == 1:
                rep.all_reduce(n, ranks, ready, alg)
                return None
            pieces = pieces_of(n, p)
            rd = [[ready] * nslices(max(pieces) * isz) for _ in range(p)]
            rep.reduce_scatter(pieces, ranks, rd, alg)
            return lambda: rep.all_gather(pieces, ranks, rd, alg)
        if p > 1:
            rep.reduce_scatter([n] * p, ranks, [[ready] * nslices(n * isz) for _ in range(p)], links_alg(0, last))

    _pipeline(cube, rep, coupled, parts, communicate)
    workspace = M * N * isz if kind == "matmul_reduce_scatter" else 0
    return max(cube.end, rep.last), cube.hbm + rep.hbm, rep.link_busy(), cube.cube_busy, workspace


def _estimate(kind, dev, specs, world=None, tiles=4, algorithm=None, rank=0, comm=None, tiling=None,
              slice_bytes=None):
    M, K, N, dtype = _dims(specs)
    p = int(world or 1)
    rows = p * M if kind == "all_gather_matmul" else M
    t = {k: int(tiling[k]) for k in ("m0", "n0", "k0", "k1")} if tiling else mc2_tiling(dev, rows, N, K, dtype)
    if tiling and not fits(shared_ub_device(dev), dtype, dtype, t):
        raise ValueError(f"MC2 matmul tiling {t} does not fit {dev.name} with the collective's UB share")
    end, hbm, link, cube, ws = _replay(kind, dev, M, K, N, dtype, p, int(tiles), algorithm, t)
    fl = 2.0 * rows * N * K
    busy = {"link": link, "cube": cube}
    return make(kind, dev, end, hbm, {}, busy, dict(t), link, fl, notes=(f"{int(tiles)} tiles",), workspace=ws)


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


def tilings(kind, x, w, device, world) -> list:
    """The matmul tilings :func:`choose_tiles` tries with ``search_tiling``: the kernel's default and every
    candidate of the matmul's search that fits beside the collective."""
    M, K, N, dtype = _dims([x, w])
    dev = get_device(device)
    rows = world * M if kind == "all_gather_matmul" else M
    default = mc2_tiling(dev, rows, N, K, dtype)
    return [default] + [t for t in _candidates(shared_ub_device(dev), rows, N, K, dtype, dtype, False) if t != default]


def _compute_bound(dev, rows, N, K, dtype, t) -> float:
    """A lower bound of a fused launch's cycles (before the launch overhead) with tiling ``t``: its blocks'
    cycles spread evenly over the Cube cores (whatever the tiles, the blocks are the whole matmul's)."""
    per_wave = _waves(dev.name, rows, N, K, dtype, tuple(sorted(t.items())))[0]
    height = round_up(min(rows, t["m0"]), 16)
    work = sum(round_up(r, 16) / height for r in _block_rows(0, rows, t["m0"], 1)) * ceil_div(N, t["n0"])
    return per_wave * work / dev.cube_cores


def algorithms(kind, dev, world, algorithm=None) -> list:
    """The tiles' collective algorithms to try: the caller's; else the size-based default and, for an
    all-reduce inside a full mesh, the two-shot mesh for every tile (one-shot tiles move ``p/2`` times the
    bytes of two-shot ones, which a pipeline that keeps the links busy may not afford), and the mesh for every
    tile but the last, one-shot (no later product hides the last tile's collective: one latency, not two)."""
    if algorithm is not None:
        return [algorithm]
    links = get_links(dev)
    if kind == "matmul_all_reduce" and links.full_mesh and 2 < world <= links.mesh:
        return [None, "mesh", "mesh|oneshot"]
    return [None]


def choose_tiles(kind: str, x, w, device, world: int, algorithm=None, counts=TILE_COUNTS, baseline=None,
                 search_tiling: bool = True) -> Plan:
    """The tile count (and with ``search_tiling`` the matmul tiling) that makes the fused kernel fastest, or
    ``tiles=0`` (keep unfused) with the reason.

    ``x``, ``w``: ``(shape, dtype)`` of the matmul operands as the fused op takes them (x [..., K], w [K, N]).
    ``baseline``: the unfused pair's cycles if the caller priced it (the planner prices the captured nodes);
    else the matmul with its searched tiling, then the collective: two launches.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown MC2 kernel {kind!r}: choose one of {', '.join(KINDS)}")
    dev = get_device(device)
    mm, coll = unfused(kind, x, w, dev.name, world, algorithm)
    base = int(baseline) if baseline is not None else mm + coll
    ts = [(0.0, None)]
    if search_tiling:        # by the compute's lower bound, so that tilings that cannot win are never replayed
        M, K, N, dtype = _dims([x, w])
        rows = world * M if kind == "all_gather_matmul" else M
        ts = sorted(((_compute_bound(dev, rows, N, K, dtype, t), t) for t in tilings(kind, x, w, dev.name, world)),
                    key=lambda b: b[0])
    best = None
    for bound, t in ts:
        if best is not None and bound + dev.launch_cycles >= best[1].cycles:
            break
        for T in counts:
            for a in algorithms(kind, dev, world, algorithm):
                e = estimate(kind, [x, w], device=dev.name, world=world, tiles=T, algorithm=a, tiling=t)
                if best is None or e.cycles < best[1].cycles:
                    best = (T, e, a)
    T, e, alg = best
    link = int(e.busy.get("link", 0))
    overlap = max(0, mm + coll - dev.launch_cycles - e.cycles)
    common = dict(best_tiles=T, hbm_bytes=e.hbm_bytes, tiling=dict(e.tiling or {}), bound=e.bound,
                  workspace=e.workspace_bytes, algorithm=alg or "")
    if e.cycles >= base:
        return Plan(0, e.cycles, base, mm, coll, link, overlap,
                    f"fused {e.cycles:,} cycles (best at {T} tiles) is no faster than the unfused pair's {base:,} "
                    f"(matmul {mm:,} + {KINDS[kind]} {coll:,})", **common)
    return Plan(T, e.cycles, base, mm, coll, link, overlap,
                f"fused at {T} tiles: {e.cycles:,} cycles vs {base:,} unfused ({base / e.cycles:.2f}x)", **common)


__all__ = ["KINDS", "Plan", "choose_tiles", "mc2_tiling", "row_tiles", "shared_ub_device", "tile_plan", "tilings", "algorithms",
           "unfused"]
