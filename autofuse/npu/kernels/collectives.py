"""Collectives on the simulated NPU: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``.

Each rank runs the kernel on its own chip; the data moves through :class:`autofuse.npu.link.Links` (the
link unit, one lane per port) and the peers' data comes from the run's communicator (``comm=``: a gloo
process group, a thread world, or a rank-symmetric stand-in for timing; see ``autofuse/npu/link.py``).

Algorithms (``algorithm=``, default as HCCL-style libraries pick, ``cost_model.links.default_algorithm``):

* **ring** over ``p`` ranks: the buffer is cut into ``p`` pieces. Reduce-scatter: in step ``s`` rank ``i``
  sends piece ``i-1-s`` to ``i+1`` and adds the piece ``i-2-s`` it receives from ``i-1`` into its partial
  (after ``p-1`` steps it holds piece ``i`` reduced). All-gather: step ``s`` forwards piece ``i-s`` and
  receives piece ``i-s-1``. All-reduce is the two in turn.
* **mesh** (one step per phase, a full mesh): reduce-scatter sends piece ``j`` to rank ``j`` on every port at
  once and adds the ``p-1`` pieces it receives; all-gather sends its piece to every peer at once; all-reduce
  is the two (two-shot).
* **oneshot** all-reduce (a full mesh, small buffers): the mesh reduce-scatter with every piece the whole
  buffer: every rank sends all of it to every peer at once and adds the ``p-1`` buffers it receives.
* **hierarchical** all-reduce: mesh reduce-scatter inside the domain, ring all-reduce of the rank's piece
  among the ranks of the same position in the other domains, mesh all-gather inside the domain.
* **pairwise** all-to-all: piece ``j`` goes to rank ``j``; on a full mesh all at once, else one peer per step.

Pipelining: every piece is cut into slices of at most ``slice_bytes``; a slice is forwarded as soon as its
own add is done, so the link carries slice k+1 while the Vector unit adds slice k.

Reduction: the Vector cores (AIV on split chips, the AI cores on coupled ones) load the partial and the
received slice (MTE2), add them (Vector, rounded to the dtype as the hardware's fp16/fp32 add does; bf16 adds
in fp32 between two casts) and store the partial (MTE3), double-buffered, the slice split evenly over the
cores. The first add of a piece reads the input, so the input is never modified.
"""
from __future__ import annotations

import math

import numpy as np

from autofuse.npu.dtypes import itemsize
from autofuse.npu.kernels.tiles import VEC_FLOATS, ceil_div, check_dtype, lockstep, rnd, split_blocks
from autofuse.npu.link import Links, make_comm
from autofuse.npu.run import ALL, kernel
from cost_model.links import check, default_algorithm

SLICE_BYTES = 1 << 20          # pipelining grain of a piece (bytes)
MIN_SLICE = 64 << 10           # pieces are cut in up to 4 slices no smaller than this
TILE_BYTES = 16 << 10          # largest UB tile per core and operand


def pieces_of(lo: int, hi: int, p: int) -> list:
    """``[lo, hi)`` cut into ``p`` contiguous pieces as even as possible (``np.array_split`` sizes)."""
    n = hi - lo
    base, rem = divmod(n, p)
    out, a = [], lo
    for j in range(p):
        b = a + base + (j < rem)
        out.append((a, b))
        a = b
    return out


class Collective:
    """One rank's side of collectives inside a launch: the link unit plus Vector cores for adds and copies.

    ``group``: the Vector cores to use (a kernel that also computes passes its own group, so that the adds
    share its UB); by default the chip's vector cores. Tiles take what UB the group has left.
    """

    def __init__(self, launch, comm, dtype: str, group=None, slice_bytes: int | None = None):
        self.launch = launch
        self.links = Links(launch, comm)
        self.comm = comm
        dev = launch.device
        self.dtype, self.isz = dtype, itemsize(dtype)
        if group is None:
            group = launch.group("aiv" if dev.arch == "split" else "core",
                                 dev.vector_cores if dev.arch == "split" else dev.cube_cores)
        self.g = group
        free = dev.buffers["UB"] - group.used["UB"] - 4 * dev.align["UB"]
        blk = 32 // self.isz
        self.tile = min(TILE_BYTES // self.isz, (free // (4 * self.isz)) // blk * blk)
        if self.tile < blk:
            raise ValueError(f"collective on {dev.name}: UB has {free:,} B left, not enough for 4 tiles of 32 B")
        self.A = [group.alloc("UB", (self.tile,), dtype, f"acc_{i}") for i in range(2)]
        self.B = [group.alloc("UB", (self.tile,), dtype, f"recv_{i}") for i in range(2)]
        self.slot = 0
        self.slice_bytes = slice_bytes or SLICE_BYTES
        self.last = 0.0            # the latest arrival or add end: the collective is done then
        self.workspace = {}

    # ------------------------------------------------------------------ Vector work
    def _vector_pass(self, length, deps, body):
        """Split ``length`` elements evenly over the cores, in tiles, lockstep; ``body(items, act, A, B)``
        issues one tile's instructions and returns their end times. Returns the latest end."""
        g = self.g
        blk = 32 // self.isz
        end = 0.0
        for items in lockstep(split_blocks(length, g.n, self.tile, align=blk)):
            act = np.array([it is not None for it in items])
            A, B = self.A[self.slot % 2], self.B[self.slot % 2]
            self.slot += 1
            e = body(items, None if act.all() else act, A, B)
            end = max(end, float(np.max(np.where(act, e, 0.0))))
        return end

    def add(self, dst, dlo, a, alo, bs, length, deps=()):
        """``dst[dlo:+length] = a[alo:+length] + sum(b[blo:+length] for b, blo in bs)`` (flat GM tensors) on the
        Vector cores: the partial is loaded once, each received slice loaded and added in turn (double-buffered),
        the sum stored once."""
        g, dt = self.g, self.dtype
        wide = "float32" if dt == "bfloat16" else dt
        passes = 3 if dt == "bfloat16" else 1

        def body(items, act, A, B):
            def reg(lo):
                return [None if it is None else (slice(lo + it[0], lo + it[0] + it[1]),) for it in items]
            ext = np.array([0 if it is None else it[1] for it in items])
            g.load(A, a, reg(alo), active=act, deps=deps, name="load partial")
            for i, (b, blo) in enumerate(bs):
                Bi = self.B[i % 2]
                g.load(Bi, b, reg(blo), active=act, deps=deps, name="load received")
                g.vector("add", (A,), (A, Bi), passes * g.repeats(ext, wide), active=act,
                         compute=lambda Bi=Bi: np.copyto(A.data, rnd(A.data + Bi.data, dt)))
            return g.store(A, dst, reg(dlo), active=act, name="store partial")

        end = self._vector_pass(length, deps, body)
        self.last = max(self.last, end)
        return end

    def copy(self, dst, dlo, src, slo, length, deps=()):
        """``dst[dlo:+length] = src[slo:+length]`` through UB (MTE2, MTE3)."""
        g = self.g

        def body(items, act, A, B):
            rs = [None if it is None else (slice(slo + it[0], slo + it[0] + it[1]),) for it in items]
            rd = [None if it is None else (slice(dlo + it[0], dlo + it[0] + it[1]),) for it in items]
            g.load(A, src, rs, active=act, deps=deps, name="load")
            return g.store(A, dst, rd, active=act, name="store")

        end = self._vector_pass(length, deps, body)
        self.last = max(self.last, end)
        return end

    def scratch(self, key, elems):
        """A GM workspace of at least ``elems`` elements (one per key, reused)."""
        t = self.workspace.get(key)
        if t is None or t.data.size < elems:
            t = self.launch.empty((max(elems, 1),), self.dtype, f"scratch_{key}", scratch=True)
            self.workspace[key] = t
        return t

    # ------------------------------------------------------------------ slicing
    def _nslices(self, pieces):
        """Slices per piece: at most ``slice_bytes`` each, and at least 4 of at least ``MIN_SLICE`` bytes when
        the piece allows (a pipeline needs a few stages)."""
        biggest = max((b - a for a, b in pieces), default=0) * self.isz
        return max(1, ceil_div(biggest, self.slice_bytes), min(4, biggest // MIN_SLICE))

    @staticmethod
    def _slice(piece, k, S):
        a, b = piece
        n = b - a
        return a + n * k // S, a + n * (k + 1) // S

    def _send(self, peer, src, lo, hi, ready, what):
        return self.links.send(peer, src.data[lo:hi], (hi - lo) * self.isz, ready, what)

    def _land(self, dst, lo, data, arrival):
        """A peer's data landing in ``dst[lo:]`` (its DMA writes this chip's HBM: L2 copies are stale)."""
        dst.data[lo:lo + data.size] = data
        self.launch.l2.invalidate(dst.id)
        self.last = max(self.last, arrival)

    # ------------------------------------------------------------------ algorithms
    def reduce_scatter(self, acc, src, pieces, ranks, ready, algorithm):
        """Reduce ``src`` piece by piece into ``acc`` (flat, same layout) over ``ranks``; afterwards this rank's
        piece of ``acc`` holds the sum. ``ready[j][k]``: when slice k of piece j is ready; updated."""
        p, me = len(ranks), ranks.index(self.comm.rank)
        S = len(ready[0])
        source = {j: src for j in range(p)}
        if algorithm == "ring":
            nxt, prv = ranks[(me + 1) % p], ranks[(me - 1) % p]
            span = max(b - a for a, b in pieces)
            buf = self.scratch("ring", 2 * span)
            for s in range(p - 1):
                cs, cr = (me - 1 - s) % p, (me - 2 - s) % p
                for k in range(S):
                    slo, shi = self._slice(pieces[cs], k, S)
                    rlo, rhi = self._slice(pieces[cr], k, S)
                    m = self._send(nxt, source[cs], slo, shi, ready[cs][k], "reduce-scatter")
                    (data, arr), = self.links.exchange([m], [(prv, (rhi - rlo,), (rhi - rlo) * self.isz)])
                    off = (s % 2) * span + (rlo - pieces[cr][0])
                    self._land(buf, off, data, arr)
                    ready[cr][k] = self.add(acc, rlo, source[cr], rlo, [(buf, off)], rhi - rlo, deps=(arr,))
                source[cr] = acc
        elif algorithm == "mesh":
            span = max(b - a for a, b in pieces)
            buf = self.scratch("mesh", (p - 1) * span)
            peers = [j for j in range(p) if j != me]
            for k in range(S):
                sends = []
                for j in peers:
                    lo, hi = self._slice(pieces[j], k, S)
                    sends.append(self._send(ranks[j], src, lo, hi, ready[j][k], "reduce-scatter"))
                mlo, mhi = self._slice(pieces[me], k, S)
                got = self.links.exchange(sends, [(ranks[j], (mhi - mlo,), (mhi - mlo) * self.isz) for j in peers])
                bs, last = [], ready[me][k]
                for x, (data, arr) in enumerate(got):
                    off = x * span + (mlo - pieces[me][0])
                    self._land(buf, off, data, arr)
                    bs.append((buf, off))
                    last = max(last, arr)
                ready[me][k] = self.add(acc, mlo, src, mlo, bs, mhi - mlo, deps=(last,))
        else:
            raise ValueError(f"reduce_scatter: no {algorithm!r} phase")

    def all_gather(self, acc, pieces, ranks, ready, algorithm):
        """Every rank's piece of ``acc`` to every rank (this rank's piece is in place and ready)."""
        p, me = len(ranks), ranks.index(self.comm.rank)
        S = len(ready[0])
        if algorithm == "ring":
            nxt, prv = ranks[(me + 1) % p], ranks[(me - 1) % p]
            for s in range(p - 1):
                cs, cr = (me - s) % p, (me - s - 1) % p
                for k in range(S):
                    slo, shi = self._slice(pieces[cs], k, S)
                    rlo, rhi = self._slice(pieces[cr], k, S)
                    m = self._send(nxt, acc, slo, shi, ready[cs][k], "all-gather")
                    (data, arr), = self.links.exchange([m], [(prv, (rhi - rlo,), (rhi - rlo) * self.isz)])
                    self._land(acc, rlo, data, arr)
                    ready[cr][k] = arr
        elif algorithm == "mesh":
            peers = [j for j in range(p) if j != me]
            for k in range(S):
                lo, hi = self._slice(pieces[me], k, S)
                sends = [self._send(ranks[j], acc, lo, hi, ready[me][k], "all-gather") for j in peers]
                recvs = []
                for j in peers:
                    rlo, rhi = self._slice(pieces[j], k, S)
                    recvs.append((ranks[j], (rhi - rlo,), (rhi - rlo) * self.isz))
                for j, (data, arr) in zip(peers, self.links.exchange(sends, recvs)):
                    rlo, _ = self._slice(pieces[j], k, S)
                    self._land(acc, rlo, data, arr)
                    ready[j][k] = arr
        else:
            raise ValueError(f"all_gather: no {algorithm!r} phase")

    def all_reduce(self, acc, src, lo, hi, ranks, ready, algorithm):
        """Sum ``src[lo:hi]`` over ``ranks`` into ``acc[lo:hi]``; returns when it is all in place."""
        p = len(ranks)
        if p == 1:
            return self.copy(acc, lo, src, lo, hi - lo, deps=(ready,)) if acc is not src else ready
        if algorithm == "oneshot":
            pieces = [(lo, hi)] * p
            rd = [[ready] * self._nslices(pieces) for _ in range(p)]
            self.reduce_scatter(acc, src, pieces, ranks, rd, "mesh")
            return max(rd[ranks.index(self.comm.rank)])
        if algorithm == "hierarchical":
            L = self.links.profile.mesh
            me = ranks.index(self.comm.rank)
            domain = [r for r in ranks if ranks.index(r) // L == me // L]
            column = [r for r in ranks if ranks.index(r) % L == me % L]
            pieces = pieces_of(lo, hi, L)
            S = self._nslices(pieces)
            rd = [[ready] * S for _ in range(L)]
            self.reduce_scatter(acc, src, pieces, domain, rd, "mesh")
            mine = pieces[domain.index(self.comm.rank)]
            done = self.all_reduce(acc, acc, mine[0], mine[1], column, max(rd[domain.index(self.comm.rank)]), "ring")
            rd[domain.index(self.comm.rank)] = [done] * S
            self.all_gather(acc, pieces, domain, rd, "mesh")
            return max(max(r) for r in rd)
        pieces = pieces_of(lo, hi, p)
        S = self._nslices(pieces)
        rd = [[ready] * S for _ in range(p)]
        self.reduce_scatter(acc, src, pieces, ranks, rd, algorithm)
        self.all_gather(acc, pieces, ranks, rd, algorithm)
        return max(max(r) for r in rd)

    def all_to_all(self, out, out_pieces, src, src_pieces, ranks, ready, full_mesh) -> list:
        """Piece j of ``src`` to rank j, landing in piece ``me`` of its ``out``; this rank's own piece is copied.
        Returns, per rank j, when piece j of ``out`` is in place (rank ``me``: the copy's end)."""
        p, me = len(ranks), ranks.index(self.comm.rank)
        S = max(self._nslices(src_pieces), self._nslices(out_pieces))
        a, b = src_pieces[me]
        arrived = [float(ready)] * p
        if b > a:
            arrived[me] = self.copy(out, out_pieces[me][0], src, a, b - a, deps=(ready,))
        rounds = [[(me + s) % p for s in range(1, p)]] if full_mesh else [[(me + s) % p] for s in range(1, p)]
        for peers_to in rounds:
            peers_from = [(2 * me - j) % p for j in peers_to]
            for k in range(S):
                sends = []
                for j in peers_to:
                    lo, hi = self._slice(src_pieces[j], k, S)
                    sends.append(self._send(ranks[j], src, lo, hi, ready, "all-to-all"))
                recvs = []
                for j in peers_from:
                    lo, hi = self._slice(out_pieces[j], k, S)
                    recvs.append((ranks[j], (hi - lo,), (hi - lo) * self.isz))
                for j, (data, arr) in zip(peers_from, self.links.exchange(sends, recvs)):
                    lo, _ = self._slice(out_pieces[j], k, S)
                    self._land(out, lo, data, arr)
                    arrived[j] = max(arrived[j], arr)
        return arrived

    def finish(self):
        """The link unit waits for the last data to land (kernel time covers it); returns that time."""
        lane0 = self.links._masks[0]
        self.links.group._exec("link", np.zeros(self.links.profile.lanes), deps=(self.last,), active=lane0,
                               name="wait for the last arrival")
        return self.last


def flat(t, name=None):
    """A GM tensor viewed as 1-D (shares the data)."""
    return type(t)(t.data.reshape(-1), t.dtype, name or t.name, getattr(t, "scratch", False))


def _setup(launch, x, comm, world, rank, op, algorithm, slice_bytes, group=None):
    check_dtype(op, "x", x, VEC_FLOATS)
    c = make_comm(comm, world, rank)
    col = Collective(launch, c, x.dtype, group=group, slice_bytes=slice_bytes)
    algorithm = algorithm or default_algorithm(col.links.profile, op, c.world, x.data.size * col.isz)
    if c.world > 1:
        check(op, algorithm, c.world, col.links.profile)
    return c, col, algorithm


@kernel("all_reduce", steer=ALL)
def all_reduce(launch, x, comm=None, world=None, rank=0, algorithm=None, slice_bytes=None):
    """Sum of ``x`` over the ranks (every rank gets it). ``comm``: see :func:`autofuse.npu.link.make_comm`
    (``world``/``rank``: a rank-symmetric stand-in, timing only)."""
    c, col, algorithm = _setup(launch, x, comm, world, rank, "all_reduce", algorithm, slice_bytes)
    out = launch.empty(x.shape, x.dtype, "out")
    col.all_reduce(flat(out), flat(x), 0, x.data.size, list(range(c.world)), 0.0, algorithm)
    col.finish()
    return (out,)


@kernel("reduce_scatter", steer=ALL)
def reduce_scatter(launch, x, comm=None, world=None, rank=0, algorithm=None, slice_bytes=None):
    """Sum of ``x`` [p·m, ...] over the ranks, rank r keeping rows [r·m, (r+1)·m) (``reduce_scatter_tensor``)."""
    c, col, algorithm = _setup(launch, x, comm, world, rank, "reduce_scatter", algorithm, slice_bytes)
    p = c.world
    if x.shape[0] % p:
        raise ValueError(f"reduce_scatter: dim 0 of x {list(x.shape)} is not divisible by the world size {p}")
    rows = x.shape[0] // p
    acc = launch.empty(x.shape, x.dtype, "partial", scratch=True) if p > 1 else None
    per = x.data.size // p
    pieces = [(j * per, (j + 1) * per) for j in range(p)]
    me = c.rank
    if p > 1:
        S = col._nslices(pieces)
        rd = [[0.0] * S for _ in range(p)]
        col.reduce_scatter(flat(acc), flat(x), pieces, list(range(p)), rd, algorithm)
        src = acc
    else:
        src = x
    out = launch.empty((rows, *x.shape[1:]), x.dtype, "out")
    col.copy(flat(out), 0, flat(src), pieces[me][0], per, deps=(col.last,))
    col.finish()
    return (out,)


@kernel("all_gather", steer=ALL)
def all_gather(launch, x, comm=None, world=None, rank=0, algorithm=None, slice_bytes=None):
    """``x`` of every rank stacked along dim 0 (``all_gather_into_tensor``)."""
    c, col, algorithm = _setup(launch, x, comm, world, rank, "all_gather", algorithm, slice_bytes)
    p, me = c.world, c.rank
    out = launch.empty((p * x.shape[0], *x.shape[1:]), x.dtype, "out")
    per = x.data.size
    pieces = [(j * per, (j + 1) * per) for j in range(p)]
    end = col.copy(flat(out), pieces[me][0], flat(x), 0, per)
    if p > 1:
        S = col._nslices(pieces)
        rd = [[end] * S for _ in range(p)]
        col.all_gather(flat(out), pieces, list(range(p)), rd, algorithm)
    col.finish()
    return (out,)


@kernel("all_to_all", steer=ALL)
def all_to_all(launch, x, comm=None, world=None, rank=0, algorithm=None, slice_bytes=None, output_split_sizes=None,
               input_split_sizes=None):
    """``all_to_all_single``: rows of ``x`` split by ``input_split_sizes`` (default even) go to the ranks in
    order; rows from each rank land in order, sized by ``output_split_sizes``."""
    c, col, algorithm = _setup(launch, x, comm, world, rank, "all_to_all", algorithm, slice_bytes)
    p = c.world
    rows = x.shape[0]
    ins = list(input_split_sizes) if input_split_sizes else [rows // p] * p
    outs = list(output_split_sizes) if output_split_sizes else ins
    if sum(ins) != rows or len(ins) != p or len(outs) != p:
        raise ValueError(f"all_to_all: split sizes {ins} / {outs} do not fit x {list(x.shape)} over {p} ranks")
    row = math.prod(x.shape[1:])
    out = launch.empty((sum(outs), *x.shape[1:]), x.dtype, "out")
    src_pieces = [(sum(ins[:j]) * row, sum(ins[:j + 1]) * row) for j in range(p)]
    out_pieces = [(sum(outs[:j]) * row, sum(outs[:j + 1]) * row) for j in range(p)]
    prof = col.links.profile
    col.all_to_all(flat(out), out_pieces, flat(x), src_pieces, list(range(p)), 0.0,
                   full_mesh=prof.full_mesh and p <= prof.mesh)
    col.finish()
    return (out,)


__all__ = ["Collective", "all_gather", "all_reduce", "all_to_all", "flat", "pieces_of", "reduce_scatter"]
