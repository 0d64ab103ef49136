"""MC2 kernels: a matmul fused with its collective, the matmul cut into ``tiles`` row tiles whose
communication overlaps the next tile's compute (CANN's MatmulAllReduce, AllGatherMatmul,
MatmulReduceScatter).

One launch holds the Cube program (:class:`autofuse.npu.kernels.matmul.Program`, the plain matmul's schedule,
run tile by tile on one group of cores whose timelines carry on from tile to tile), the link unit and the
Vector cores that add received partials (:class:`~autofuse.npu.kernels.collectives.Collective`). Program
order is a two-stage software pipeline:

* ``matmul_all_reduce``  x[M, K/p] @ w[K/p, N] summed over ranks:  compute tile t, then all-reduce tile t-1
  (its rows of the output, in place), so the links and adds of tile t-1 run under tile t's products.
* ``matmul_reduce_scatter``  the same, tile t being rows t of every rank's share; reduce-scatter of tile t-1
  under the products of tile t. Rank r's output is its share of the reduced partial.
* ``all_gather_matmul``  gather(x[M/p, K]) @ w[K, N/p]: the link starts on every tile at once; the Cube
  first multiplies this rank's own rows (nothing to wait for), then each tile's gathered rows as they land
  (with one tile: every row in one sweep once all have landed).
  Also returns the gathered x (what the backward needs).

On coupled chips the adds share the AI cores' UB with the matmul, so the matmul is tiled for half the UB
(``tiling`` otherwise as the plain matmul's default); on split chips the adds run on the AIV cores.
``tiles=1`` is the matmul and the collective back to back in one launch.
"""
from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import numpy as np

from autofuse.npu.kernels.collectives import Collective, flat
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


def _view(t, r0, r1):
    return type(t)(t.data[r0:r1], t.dtype, t.name)


class _Fused:
    """The parts every MC2 kernel shares: operands as 2-D, the matmul program, the collective."""

    def __init__(self, launch, x, w, comm, world, rank, op, algorithm, tiling, slice_bytes, rows_of_x=None):
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
        self.prog = Program(launch, self.dtype, self.dtype, self.t, dev.cube_cores, False)
        self.col = Collective(launch, self.comm, self.dtype, group=self.prog.g if dev.arch == "coupled" else None,
                              slice_bytes=slice_bytes)
        self.algorithm = algorithm or default_algorithm(self.col.links.profile, op, self.comm.world)
        if self.comm.world > 1:
            check(op, self.algorithm, self.comm.world, self.col.links.profile)
        self.ranks = list(range(self.comm.world))

    def matmul_rows(self, a, out, spans, deps=()):
        """Rows ``spans`` ([(r0, r1), ...]) of ``out = a @ w`` on the Cube, all in one lockstep sweep (their
        blocks spread over every core); returns when they are stored."""
        m0, n0 = self.t["m0"], self.t["n0"]
        items = [((), (b, min(m0, r1 - b)), ni) for r0, r1 in spans for b in range(r0, r1, m0)
                 for ni in range(_ceil(self.N, n0))]
        return self.prog.run(a, self.w, None, out, items, a.shape[0], self.N, self.K, deps=deps)


@kernel("matmul_all_reduce", steer=ALL)
def matmul_all_reduce(launch, x, w, comm=None, world=None, rank=0, tiles=4, algorithm=None, tiling=None,
                      slice_bytes=None):
    """``all_reduce(x @ w)`` (sum), ``tiles`` row tiles pipelined (see the module docstring)."""
    f = _Fused(launch, x, w, comm, world, rank, "all_reduce", algorithm, tiling, slice_bytes)
    M, N = f.x.shape[0], f.N
    out = launch.empty((M, N), f.dtype, "out")
    pending = None
    for r0, r1 in row_tiles(M, f.t["m0"], tiles):
        done = f.matmul_rows(f.x, out, [(r0, r1)])
        if pending is not None:
            f.col.all_reduce(flat(out), flat(out), pending[0] * N, pending[1] * N, f.ranks, pending[2], f.algorithm)
        pending = (r0, r1, done)
    f.col.all_reduce(flat(out), flat(out), pending[0] * N, pending[1] * N, f.ranks, pending[2], f.algorithm)
    f.col.finish()
    return (type(out)(out.data.reshape(*f.lead, N), out.dtype, out.name),)


@kernel("matmul_reduce_scatter", steer=ALL)
def matmul_reduce_scatter(launch, x, w, comm=None, world=None, rank=0, tiles=4, algorithm=None, tiling=None,
                          slice_bytes=None):
    """``reduce_scatter(x @ w)`` along rows: rank r keeps rows [r·M/p, (r+1)·M/p) of the sum."""
    f = _Fused(launch, x, w, comm, world, rank, "reduce_scatter", algorithm, tiling, slice_bytes)
    p, me = f.comm.world, f.comm.rank
    M, N = f.x.shape[0], f.N
    if M % p:
        raise ValueError(f"matmul_reduce_scatter: {M} rows do not split over {p} ranks")
    share = M // p
    partial = launch.empty((M, N), f.dtype, "partial", scratch=True)
    pending = None

    def scatter(r0, r1, ready):
        pieces = [((j * share + r0) * N, (j * share + r1) * N) for j in range(p)]
        if p == 1:
            return
        S = f.col._nslices(pieces)
        f.col.reduce_scatter(flat(partial), flat(partial), pieces, f.ranks, [[ready] * S for _ in range(p)],
                             f.algorithm)

    ranges = row_tiles(share, f.t["m0"], tiles)
    for r0, r1 in ranges:
        # one tile: every row at once (rank shares need not be whole row blocks); else tile t of every share
        spans = [(0, M)] if len(ranges) == 1 else [(j * share + r0, j * share + r1) for j in range(p)]
        done = f.matmul_rows(f.x, partial, spans)
        f.col.last = max(f.col.last, done)
        if pending is not None:
            scatter(*pending)
        pending = (r0, r1, done)
    scatter(*pending)
    f.col.finish()
    out = type(partial)(partial.data[me * share:(me + 1) * share].reshape(share, *f.lead[1:], N), f.dtype, "out")
    return (out,)


@kernel("all_gather_matmul", steer=ALL)
def all_gather_matmul(launch, x, w, comm=None, world=None, rank=0, tiles=4, algorithm=None, tiling=None,
                      slice_bytes=None):
    """``(all_gather(x) @ w, all_gather(x))``: x [m, K] of every rank stacked along rows, times w [K, N]."""
    c = make_comm(comm, world, rank)
    p, me = c.world, c.rank
    m = int(np.prod(x.shape[:-1]))
    f = _Fused(launch, x, w, c, world, rank, "all_gather", algorithm, tiling, slice_bytes, rows_of_x=p * m)
    K, N = f.K, f.N
    gathered = launch.empty((p * m, K), f.dtype, "gathered")
    out = launch.empty((p * m, N), f.dtype, "out")
    own = f.col.copy(flat(gathered), me * m * K, flat(f.x), 0, m * K)
    ranges = row_tiles(m, f.t["m0"], tiles)
    arrivals = []
    for r0, r1 in ranges:
        pieces = [((j * m + r0) * K, (j * m + r1) * K) for j in range(p)]
        if p > 1:
            S = f.col._nslices(pieces)
            rd = [[own] * S for _ in range(p)]
            f.col.all_gather(flat(gathered), pieces, f.ranks, rd, f.algorithm)
            arrivals.append(max(max(r) for j, r in enumerate(rd) if j != me))
    if len(ranges) == 1 and p > 1:
        # nothing to pipeline: one sweep over every gathered row once they have landed (a sweep of this
        # rank's rows first would cost a wave of its own)
        f.matmul_rows(gathered, out, [(0, p * m)], deps=(max(arrivals + [own]),))
    else:
        f.matmul_rows(f.x, _view(out, me * m, (me + 1) * m), [(0, m)])
        for (r0, r1), arr in zip(ranges, arrivals):
            f.matmul_rows(gathered, out, [(j * m + r0, j * m + r1) for j in range(p) if j != me], deps=(arr,))
    f.col.finish()
    lead = (p * x.shape[0], *x.shape[1:-1]) if x.data.ndim > 1 else (p * m,)
    return (type(out)(out.data.reshape(*lead, N), out.dtype, out.name),
            type(gathered)(gathered.data.reshape(*lead, K), gathered.dtype, gathered.name))


__all__ = ["all_gather_matmul", "matmul_all_reduce", "matmul_reduce_scatter", "mc2_tiling", "row_tiles",
           "shared_ub_device"]
