"""MC2 kernels: a matmul fused with its collective, cut into tiles whose communication overlaps the later tiles'
products (CANN's MatmulAllReduce, MatmulReduceScatter, AllGatherMatmul).

One launch holds the Cube program (:class:`autofuse.npu.kernels.matmul.Program`, the plain matmul's schedule,
its timelines carrying on from tile to tile), the link unit and the Vector cores that add received partials
(:class:`~autofuse.npu.kernels.collectives.Collective`).

Tiles (:func:`tile_plan`):

* **row tiles** when the rows hold at least ``tiles`` base blocks (``m0`` rows): tile t is a range of whole
  row blocks (of every rank's share, for the reduce-scatter);
* **column tiles** otherwise (decode: a few rows), when there are more column blocks: tile t is a range of
  whole ``n0`` column blocks of every row. Each tile streams its share of the weight, so the first tiles'
  collectives run while later columns of the weight are still being read (when a tile's blocks fill the
  cores: the tiling is chosen per tile count). A column tile of M rows is a
  strided block of the output; its collective runs on a tile-major buffer (each tile's M × w block
  contiguous), and the collective's last writes of the tile (the stores of the reduced values and the peers'
  landings) go to the tile's columns of the output, a 2-D strided DMA of the same bytes: the simulator keeps
  the tile-major buffer as the output's storage and lays its values out as [M, N] when the launch ends.

Schedules (program order is a two-stage software pipeline):

* ``matmul_all_reduce``  x[M, K/p] @ w[K/p, N] summed over ranks: compute tile t, then all-reduce tile t-1,
  so the links and adds of tile t-1 run under tile t's products.
* ``matmul_reduce_scatter``  the same, rank r keeping rows [r·M/p, (r+1)·M/p) of the sum.
* ``all_gather_matmul``  gather(x[m, K]) @ w[K, N/p]: the link starts on every tile at once; the Cube
  multiplies this rank's own rows first (nothing to wait for), then each block of gathered rows as soon as
  that peer's rows of that tile have landed (with one tile: every gathered row in one sweep once all have
  landed, so that the weight is read once). Also returns the gathered x (what the backward needs).

The Cube's blocks (``m0 × n0`` output tiles) are issued in lockstep waves over the Cube cores in tile order, a
wave filling up with the next tile's blocks when a tile's do not fill the cores; each block waits only for
its own operands. Column tiles of rows that fit one block keep x in each Cube core's L1 for the whole launch
(:class:`_Resident`): a tile narrow enough to fill the cores then streams only its weight columns, instead of
reloading x for every narrow block. Each tile's collective uses the algorithm a collective library picks
for its size (``cost_model.links.default_algorithm``: one-shot all-reduce for small tiles on a full mesh).

On coupled chips the adds share the AI cores' UB with the matmul, so the matmul is tiled for half the UB
(``tiling`` otherwise as the plain matmul's default); on split chips the adds run on the AIV cores.
``tiles=1`` is the matmul and the collective back to back in one launch.
"""
from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import numpy as np

from autofuse.npu.kernels.collectives import Collective, flat, pieces_of
from autofuse.npu.kernels.matmul import CUBE_DTYPES, Program, _ceil, default_tiling, tiling_fits
from autofuse.npu.link import make_comm
from autofuse.npu.run import ALL, kernel
from cost_model.links import check, default_algorithm


def shared_ub_device(dev):
    """The device as the matmul of an MC2 kernel sees it: on coupled chips half the UB is the adds'."""
    if dev.arch != "coupled":
        return dev
    return replace(dev, buffers=MappingProxyType({**dev.buffers, "UB": dev.buffers["UB"] // 2}))


def mc2_tiling(dev, M, N, K, dtype, out_dtype, tiling=None):
    """The matmul tiling of an MC2 kernel: ``tiling`` if it fits, else the matmul's default for the UB the
    matmul may use."""
    mdev = shared_ub_device(dev)
    t = dict(tiling) if tiling else default_tiling(mdev, M, N, K, 1, dtype, out_dtype)
    if not tiling_fits(mdev, dtype, out_dtype, t):
        raise ValueError(f"MC2 matmul tiling {t} does not fit {dev.name} with the collective's UB share")
    return t


def row_tiles(rows: int, m0: int, tiles: int) -> list:
    """``[0, rows)`` in ``tiles`` ranges of whole ``m0`` blocks (fewer if there are fewer blocks)."""
    nb = _ceil(rows, m0)
    T = max(1, min(tiles, nb))
    cuts = [min(rows, (nb * t // T) * m0) for t in range(T + 1)]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def tile_plan(rows: int, N: int, m0: int, n0: int, tiles: int) -> tuple[str, list]:
    """``("rows", ranges of rows)`` in whole ``m0`` blocks when the rows hold ``tiles`` of them (or at least as
    many tiles as the columns give), else ``("cols", ranges of columns)``: equal ranges of whole ``n0`` blocks
    (as many as divide the column blocks evenly, up to ``tiles``; see the module docstring)."""
    nr = _ceil(rows, m0)
    nc = N // n0 if N % n0 == 0 else 1
    tc = max(d for d in range(1, min(tiles, nc) + 1) if nc % d == 0)
    if nr >= tiles or nr >= tc:
        return "rows", row_tiles(rows, m0, tiles)
    return "cols", [(i * N // tc, (i + 1) * N // tc) for i in range(tc)]


def tile_algorithm(algorithm: str | None, last: bool) -> str | None:
    """A tile's collective algorithm from the kernel's ``algorithm``: one name for every tile, or ``"A|B"``:
    ``B`` for the last tile (whose collective no later product hides: a one-shot's single latency), ``A`` for
    the others (whose bytes the links must keep up with: the two-shot mesh). None: the size-based default."""
    if not algorithm:
        return None
    parts = algorithm.split("|")
    return parts[-1] if last else parts[0]


def _view(t, r0, r1):
    return type(t)(t.data[r0:r1], t.dtype, t.name)


def _blocks(r0: int, r1: int, m0: int, ncols: int, batch=()) -> list:
    return [(batch, (b, min(m0, r1 - b)), ni) for b in range(r0, r1, m0) for ni in range(ncols)]


class _Cube:
    """The matmul of an MC2 kernel: blocks issued in lockstep waves over every Cube core in the order they are
    added, a wave filling up with the next tile's blocks when a tile's do not fill the cores (see the module
    docstring); each block's loads wait for its own ``ready`` time. ``done[tag]``: when the waves holding a
    tile's blocks are stored."""

    def __init__(self, prog: Program, K: int):
        self.prog, self.K, self.n = prog, K, prog.g.n
        self.wave, self.ops, self.done = [], None, {}

    def add(self, a, b, out, blocks, ready=0.0, tag=None):
        """Blocks ``(batch index, (first row, rows), column block)`` of ``out = a @ b``."""
        if self.ops is not None and tuple(map(id, self.ops)) != (id(a), id(b), id(out)):
            self.flush()
        self.ops = (a, b, out)
        ready = ready if isinstance(ready, list) else [ready] * len(blocks)
        for blk, r in zip(blocks, ready):
            self.wave.append((blk, r, tag))
            if len(self.wave) == self.n:
                self.flush()

    def pending(self, tag) -> bool:
        return any(t == tag for _, _, t in self.wave)

    def flush(self):
        if not self.wave:
            return
        a, b, out = self.ops
        items = [blk for blk, _, _ in self.wave] + [None] * (self.n - len(self.wave))
        deps = np.array([r for _, r, _ in self.wave] + [0.0] * (self.n - len(self.wave)))
        fold = out.data.ndim == 2
        end = self.prog.run(a, b, None, out, items, a.shape[-2], b.shape[-1], self.K, fold=fold, deps=(deps,))
        for _, _, tag in self.wave:
            self.done[tag] = max(self.done.get(tag, 0.0), end)
        self.wave = []


class _Resident:
    """The matmul's schedule when every row of x fits one ``m0`` block (column tiles): x is loaded into each
    Cube core's L1 once, whole, and stays; a block streams only its weight columns through L1 (double-buffered
    ``k1`` chunks) and the L0 buffers. Same interface as :class:`~autofuse.npu.kernels.matmul.Program`'s
    ``run`` for blocks of all the rows."""

    def __init__(self, launch, dtype, t, ncores, x):
        dev = launch.device
        self.launch, self.dtype, self.t, self.x = launch, dtype, dict(t), x
        m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
        self.K = x.shape[1]
        g = self.g = launch.group("core" if dev.arch == "coupled" else "aic", ncores)
        self.a1 = g.alloc("L1", (m0, _ceil(self.K, k0) * k0), dtype, "x resident")
        self.b1 = [g.alloc("L1", (k1, n0), dtype, f"b1_{i}") for i in range(2)]
        self.a0 = [g.alloc("L0A", (m0, k0), dtype, f"a0_{i}") for i in range(2)]
        self.b0 = [g.alloc("L0B", (k0, n0), dtype, f"b0_{i}") for i in range(2)]
        nc = 2 if 2 * m0 * n0 * 4 <= dev.buffers["L0C"] else 1
        self.c0 = [g.alloc("L0C", (m0, n0), "float32", f"c_{i}") for i in range(nc)]
        self.ub = [g.alloc("UB", (m0, n0), dtype, f"ub_{i}") for i in range(2)] if dev.arch == "coupled" else None
        rows = (slice(0, x.shape[0]), slice(0, self.K))
        g.load(self.a1, x, [rows] * g.n, name="load x (resident)")
        self.slot = self.step = 0

    @staticmethod
    def fits(dev, dtype, t, K) -> bool:
        m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
        isz = 4 if dtype == "float32" else 2
        return (m0 * _ceil(K, k0) * k0 + 2 * k1 * n0) * isz <= dev.buffers["L1"] - 64

    def run(self, a, b, bias, out, items, M_rows, N, K, fold=True, deps=()):
        g, t, isz = self.g, self.t, 4 if self.dtype == "float32" else 2
        k0, k1, n0 = t["k0"], t["k1"], t["n0"]
        active = np.array([it is not None for it in items])
        act = None if active.all() else active
        m = np.array([it[1][1] if it else 0 for it in items])
        n_ext = np.array([min(n0, (b.shape[-1]) - it[2] * n0) if it else 0 for it in items])
        cols = [slice(it[2] * n0, it[2] * n0 + n_ext[c]) if it else None for c, it in enumerate(items)]
        acc = self.c0[self.step % len(self.c0)]
        self.step += 1
        for kk in range(_ceil(K, k1)):
            ks = slice(kk * k1, min(K, (kk + 1) * k1))
            B1 = self.b1[kk % 2]
            g.load(B1, b, [None if it is None else tuple(it[0]) + (ks, cols[c]) for c, it in enumerate(items)],
                   active=act, deps=deps, name="load B")
            for kq in range(_ceil(ks.stop - ks.start, k0)):
                kv = min(k0, ks.stop - ks.start - kq * k0)
                A0, B0 = self.a0[self.slot % 2], self.b0[self.slot % 2]
                self.slot += 1
                ka, sl = slice(ks.start + kq * k0, ks.start + (kq + 1) * k0), slice(kq * k0, (kq + 1) * k0)
                g.move(A0, self.a1, fn=lambda x, ka=ka: x[:, :, ka], nbytes=_round16(m) * kv * isz, active=act)
                g.move(B0, B1, fn=lambda x, sl=sl: x[:, sl, :], nbytes=kv * _round16(n_ext) * isz, active=act)
                g.mmad(acc, A0, B0, m, kv, n_ext, accumulate=not (kk == 0 and kq == 0), active=act)
        regs = [None if it is None else tuple(it[0]) + (slice(it[1][0], it[1][0] + it[1][1]), cols[c])
                for c, it in enumerate(items)]
        if self.ub is not None:
            U = self.ub[self.step % 2]
            g.move(U, acc, nbytes=m * n_ext * 4, active=act, name="L0C->UB")
            end = g.store(U, out, regs, active=act, name="store out")
        else:
            end = g.store(acc, out, regs, active=act, name="store out")
        return float(np.max(end if act is None else np.where(act, end, 0.0)))


def _round16(v):
    return -(-np.asarray(v) // 16) * 16


class _Fused:
    """The parts every MC2 kernel shares: operands as 2-D, the matmul program, the collective."""

    def __init__(self, launch, x, w, comm, world, rank, op, algorithm, tiling, slice_bytes, rows_of_x=None,
                 tiled_rows=None, tiles=1):
        for name, t in (("x", x), ("w", w)):
            if t.dtype not in CUBE_DTYPES:
                raise TypeError(f"{op}: {name} is {t.dtype}; the Cube takes {', '.join(CUBE_DTYPES)}")
        if w.data.ndim != 2 or x.shape[-1] != w.shape[0] or x.dtype != w.dtype:
            raise ValueError(f"{op}: x {list(x.shape)} {x.dtype} @ w {list(w.shape)} {w.dtype} is not a matmul "
                             f"of one dtype with a 2-D weight")
        dev = launch.device
        self.launch, self.op = launch, op
        self.lead = tuple(x.shape[:-1])
        self.K, self.N = x.shape[-1], w.shape[1]
        self.x = type(x)(x.data.reshape(-1, self.K), x.dtype, x.name)
        self.w = w
        self.dtype = x.dtype
        self.comm = make_comm(comm, world, rank)
        M = rows_of_x if rows_of_x is not None else self.x.shape[0]
        self.t = mc2_tiling(dev, M, self.N, self.K, self.dtype, self.dtype, tiling)
        # column tiles of rows that fit one block: x stays in L1 (``tiled_rows``: the rows the tiles cut)
        split = tile_plan(tiled_rows, self.N, self.t["m0"], self.t["n0"], tiles)[0] if tiled_rows else "rows"
        self.resident = split == "cols" and M <= self.t["m0"] and _Resident.fits(dev, self.dtype, self.t, self.K)
        self.prog = (_Resident(launch, self.dtype, self.t, dev.cube_cores, self.x) if self.resident else
                     Program(launch, self.dtype, self.dtype, self.t, dev.cube_cores, False))
        self.cube = _Cube(self.prog, self.K)
        self.col = Collective(launch, self.comm, self.dtype, group=self.prog.g if dev.arch == "coupled" else None,
                              slice_bytes=slice_bytes)
        self.algorithm = algorithm
        self.ranks = list(range(self.comm.world))

    def algorithm_for(self, nbytes: int, last: bool = False) -> str:
        """The algorithm of one tile's collective: the caller's (``"A|B"``: B for the last tile, A for the
        others), else the library's pick for the tile's size."""
        a = tile_algorithm(self.algorithm, last) or default_algorithm(self.col.links.profile, self.op,
                                                                       self.comm.world, nbytes)
        if self.comm.world > 1:
            check(self.op, a, self.comm.world, self.col.links.profile)
        return a

    def tiles(self, rows: int, tiles: int, M: int, name: str):
        """The output storage (``M`` × N, flat) and the tiles of its first ``rows`` rows' products:
        ``(split, store, b, out, [(lo, hi, blocks)])`` — the weight as the blocks read it, the output as they
        write it, each tile's range of the flat storage and its blocks. Column tiles lay the storage out
        tile-major (``out`` [T, M, w], ``b`` the weight's columns as [T, K, w]; see the module docstring)."""
        N, K, m0, n0 = self.N, self.K, self.t["m0"], self.t["n0"]
        split, ranges = tile_plan(rows, N, m0, n0, tiles)
        store = self.launch.empty((M * N,), self.dtype, name)
        if split == "rows":
            out = type(store)(store.data.reshape(M, N), store.dtype, name)
            return split, store, self.w, out, [(r0 * N, r1 * N, _blocks(r0, r1, m0, _ceil(N, n0))) for r0, r1 in ranges]
        T, w_ = len(ranges), N // len(ranges)
        b = type(self.w)(self.w.data.reshape(K, T, w_).transpose(1, 0, 2), self.w.dtype, self.w.name)
        out = type(store)(store.data.reshape(T, M, w_), store.dtype, name)
        return split, store, b, out, [(t * M * w_, (t + 1) * M * w_, _blocks(0, M, m0, _ceil(w_, n0), (t,)))
                                      for t in range(T)]

    def pipeline(self, parts, b, out, communicate, blocks_of=lambda blocks: blocks):
        """Tile t's products, then the collective of every earlier tile whose blocks are all issued (the
        two-stage pipeline of the module docstring); the rest after the last tile. ``communicate`` may return a
        second phase (an all-reduce's all-gather), issued after the next tile's first phase, so that a lane's
        queue never holds a tile's second phase, waiting for its adds, in front of the next tile's sends."""
        sent, later = 0, None

        def send(i):
            nonlocal later
            phase2 = communicate(*parts[i][:2], self.cube.done[i], i == len(parts) - 1)
            if later is not None:
                later()
            later = phase2

        for t, (lo, hi, blocks) in enumerate(parts):
            self.cube.add(self.x, b, out, blocks_of(blocks), tag=t)
            while sent < t and not self.cube.pending(sent):
                send(sent)
                sent += 1
        self.cube.flush()
        for i in range(sent, len(parts)):
            send(i)
        if later is not None:
            later()


def _tile_major_to_rows(data, M, T):
    """[T, M, w] storage as [M, T·w]."""
    return data.reshape(T, M, -1).transpose(1, 0, 2).reshape(M, -1)


@kernel("matmul_all_reduce", steer=ALL)
def matmul_all_reduce(launch, x, w, comm=None, world=None, rank=0, tiles=4, algorithm=None, tiling=None,
                      slice_bytes=None):
    """``all_reduce(x @ w)`` (sum), ``tiles`` tiles pipelined (see the module docstring)."""
    rows = int(np.prod(x.shape[:-1]))
    f = _Fused(launch, x, w, comm, world, rank, "all_reduce", algorithm, tiling, slice_bytes, tiled_rows=rows,
               tiles=tiles)
    M, N = f.x.shape[0], f.N
    split, store, b, out, parts = f.tiles(M, tiles, M, "out")
    s = flat(store)

    def communicate(lo, hi, ready, last):
        alg = f.algorithm_for((hi - lo) * f.col.isz, last)
        if alg not in ("mesh", "ring") or f.comm.world == 1:
            f.col.all_reduce(s, s, lo, hi, f.ranks, ready, alg)
            return None
        # two phases, as Collective.all_reduce runs them; the all-gather is issued after the next tile's
        # reduce-scatter (see _Fused.pipeline)
        pieces = pieces_of(lo, hi, f.comm.world)
        rd = [[ready] * f.col._nslices(pieces) for _ in pieces]
        f.col.reduce_scatter(s, s, pieces, f.ranks, rd, alg)
        return lambda: f.col.all_gather(s, pieces, f.ranks, rd, alg)

    f.pipeline(parts, b, out, communicate)
    f.col.finish()
    rows = store.data if split == "rows" else _tile_major_to_rows(store.data, M, len(parts))
    store.data = np.ascontiguousarray(rows).reshape(*f.lead, N)
    return (store,)


@kernel("matmul_reduce_scatter", steer=ALL)
def matmul_reduce_scatter(launch, x, w, comm=None, world=None, rank=0, tiles=4, algorithm=None, tiling=None,
                          slice_bytes=None):
    """``reduce_scatter(x @ w)`` along dim 0: rank r keeps rows [r·M/p, (r+1)·M/p) of the sum."""
    c = make_comm(comm, world, rank)
    f = _Fused(launch, x, w, c, world, rank, "reduce_scatter", algorithm, tiling, slice_bytes,
               tiled_rows=max(int(np.prod(x.shape[:-1])) // c.world, 1), tiles=tiles)
    p, me = f.comm.world, f.comm.rank
    M, N = f.x.shape[0], f.N
    if M % p or (len(f.lead) > 1 and f.lead[0] % p):
        raise ValueError(f"matmul_reduce_scatter: dim 0 of x {list(x.shape)} does not split over {p} ranks")
    share = M // p
    m0, nn = f.t["m0"], _ceil(N, f.t["n0"])
    # the partial sums are scratch; tiles are ranges of each rank's share (row tiles: tile t of every share)
    split, partial, b, out, parts = f.tiles(share, tiles, M, "partial")
    partial.scratch = True
    s = flat(partial)

    def blocks_of(blocks):
        if split != "rows":
            return blocks
        if len(parts) == 1:            # one tile: every row at once (rank shares need not be whole row blocks)
            return _blocks(0, M, m0, nn)
        r0, r1 = blocks[0][1][0], blocks[-1][1][0] + blocks[-1][1][1]
        return [blk for j in range(p) for blk in _blocks(j * share + r0, j * share + r1, m0, nn)]

    def communicate(lo, hi, ready, last):
        if p == 1:
            return
        if split == "rows":
            pieces = [(lo + j * share * N, hi + j * share * N) for j in range(p)]
        else:
            w_ = (hi - lo) // M
            pieces = [(lo + j * share * w_, lo + (j + 1) * share * w_) for j in range(p)]
        S = f.col._nslices(pieces)
        f.col.reduce_scatter(s, s, pieces, f.ranks, [[ready] * S for _ in range(p)], f.algorithm_for(0, last))

    f.pipeline(parts, b, out, communicate, blocks_of)
    f.col.finish()
    rows = partial.data.reshape(M, N) if split == "rows" else _tile_major_to_rows(partial.data, M, len(parts))
    lead = (f.lead[0] // p, *f.lead[1:]) if len(f.lead) > 1 else (share,)
    result = launch.empty((share, N), f.dtype, "out")
    result.data = np.ascontiguousarray(rows[me * share:(me + 1) * share]).reshape(*lead, N)
    return (result,)


@kernel("all_gather_matmul", steer=ALL)
def all_gather_matmul(launch, x, w, comm=None, world=None, rank=0, tiles=4, algorithm=None, tiling=None,
                      slice_bytes=None):
    """``(all_gather(x) @ w, all_gather(x))``: x [m, K] of every rank stacked along rows, times w [K, N]."""
    c = make_comm(comm, world, rank)
    p, me = c.world, c.rank
    m = int(np.prod(x.shape[:-1]))
    f = _Fused(launch, x, w, c, world, rank, "all_gather", algorithm, tiling, slice_bytes, rows_of_x=p * m)
    K, N = f.K, f.N
    m0, nn = f.t["m0"], _ceil(N, f.t["n0"])
    gathered = launch.empty((p * m, K), f.dtype, "gathered")
    out = launch.empty((p * m, N), f.dtype, "out")
    own = f.col.copy(flat(gathered), me * m * K, flat(f.x), 0, m * K)
    ranges = row_tiles(m, m0, tiles)
    arrivals = []                          # per tile: when each peer's rows of it have landed
    for r0, r1 in ranges:
        pieces = [((j * m + r0) * K, (j * m + r1) * K) for j in range(p)]
        if p > 1:
            S = f.col._nslices(pieces)
            rd = [[own] * S for _ in range(p)]
            f.col.all_gather(flat(gathered), pieces, f.ranks, rd, f.algorithm_for(0))
            arrivals.append([max(r) for r in rd])
    if len(ranges) == 1 or p == 1:
        # nothing to pipeline: one sweep over every gathered row once they have landed (the weight read once)
        f.cube.add(gathered, f.w, out, _blocks(0, p * m, m0, nn), max([own] + [max(a) for a in arrivals]))
    else:
        f.cube.add(f.x, f.w, _view(out, me * m, (me + 1) * m), _blocks(0, m, m0, nn))
        for (r0, r1), arr in zip(ranges, arrivals):
            for j in (j for j in range(p) if j != me):
                bj = _blocks(j * m + r0, j * m + r1, m0, nn)
                f.cube.add(gathered, f.w, out, bj, [arr[j]] * len(bj))
    f.cube.flush()
    f.col.finish()
    lead = (p * x.shape[0], *x.shape[1:-1]) if x.data.ndim > 1 else (p * m,)
    return (type(out)(out.data.reshape(*lead, N), out.dtype, out.name),
            type(gathered)(gathered.data.reshape(*lead, K), gathered.dtype, gathered.name))


__all__ = ["all_gather_matmul", "matmul_all_reduce", "matmul_reduce_scatter", "mc2_tiling", "row_tiles",
           "shared_ub_device", "tile_algorithm", "tile_plan"]
