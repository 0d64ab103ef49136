"""Collectives (``autofuse/npu/kernels/collectives.py``): the link schedule replayed slice by slice.

The model follows one rank of a rank-symmetric world (what the single-process simulation times):

* a send of ``b`` bytes occupies its lane for ``b / bandwidth`` from when its data is ready and the lane is
  free; the data lands ``latency`` later. A peer's send to this rank is timed on a mirror of the peer's lane
  (ready when this rank's own data of the same step is);
* a reducing step adds the received slices on the Vector cores (:func:`add_cycles`), one pass per slice in
  order; a slice is forwarded when its add is done;
* pieces are cut into slices as the kernel cuts them (at most 1 MiB, at least 4 of at least 64 KiB).

This is a recurrence over (step, slice) with closed-form costs per slice — no instruction is simulated.
:func:`add_cycles`: the partial and the ``k`` received slices are loaded, added and stored by every vector core
on its share, in UB tiles of at most 16 KiB, double-buffered: per tile, the core's GM port carries
``(k + 2)`` tile transfers, each priced at the lockstep wave's share of L2 (the partial, just stored, hits) or
HBM (received data, written by the link, misses) bandwidth, and at least the MTE rates.
"""
from __future__ import annotations

import math

from cost_model.common import ceil_div, itemsize
from cost_model.estimate import make, register
from cost_model.links import check, default_algorithm, get_links

SLICE_BYTES = 1 << 20
MIN_SLICE = 64 << 10
TILE_BYTES = 16 << 10


def nslices(piece_bytes: int) -> int:
    return max(1, ceil_div(piece_bytes, SLICE_BYTES), min(4, piece_bytes // MIN_SLICE))


def pieces_of(n: int, p: int) -> list:
    base, rem = divmod(n, p)
    return [base + (j < rem) for j in range(p)]


def vector_group(dev, shared=None):
    """(cores, UB bytes free) of the cores that add: the AIVs, or on coupled chips the AI cores (whose UB the
    matmul of an MC2 kernel shares: ``shared`` = bytes it holds)."""
    if dev.arch == "split":
        return dev.vector_cores, dev.buffers["UB"]
    return dev.cube_cores, dev.buffers["UB"] - (shared or 0)


def tile_elems(dev, dtype, ub_free) -> int:
    isz = itemsize(dtype)
    blk = 32 // isz
    free = ub_free - 4 * dev.align["UB"]
    return min(TILE_BYTES // isz, (free // (4 * isz)) // blk * blk)


def add_cycles(dev, dtype, elems, k, cores, tile, hits_partial=True) -> float:
    """Cycles of one Vector pass adding ``k`` received slices into a partial of ``elems`` elements."""
    if elems <= 0:
        return 0.0
    isz = itemsize(dtype)
    blk = 32 // isz
    per = ceil_div(ceil_div(elems, blk), cores) * blk          # the busiest core's share
    n = min(cores, ceil_div(elems, per))
    tiles = ceil_div(per, tile)
    tb = min(per, tile) * isz
    wave = n * tb
    hit = wave / dev.l2_bytes_per_cycle
    miss = wave / dev.hbm_bytes_per_cycle
    part = hit if hits_partial else miss
    lanes = dev.vector_bytes_per_cycle // (4 if dtype == "bfloat16" else isz)
    vec = (3 if dtype == "bfloat16" else 1) * ceil_div(min(per, tile), lanes)
    load_p = max(tb / dev.rates["GM->UB"], part)
    load_r = max(tb / dev.rates["GM->UB"], miss)
    store = max(tb / dev.rates["UB->GM"], miss)
    port = part + k * miss + miss
    steady = max(port, load_p + k * load_r, k * vec, store)
    fill = load_p + load_r + vec + store
    return fill + (tiles - 1) * steady + (k - 1) * max(load_r, vec)


class LinkReplay:
    """The link lanes, the mirrored peer lanes and the Vector cores of one rank, replayed in time."""

    def __init__(self, dev, world, dtype, ub_shared=None):
        self.dev, self.world, self.dtype = dev, world, dtype
        self.isz = itemsize(dtype)
        self.links = get_links(dev)
        self.rate = [p.bytes_per_s / dev.clock_hz for p in self.links.lane_ports()]
        self.lat = [p.latency_s * dev.clock_hz for p in self.links.lane_ports()]
        self.lane_free = [0.0] * self.links.lanes
        self.mirror = {}
        self.cores, ub = vector_group(dev, ub_shared)
        self.tile = tile_elems(dev, dtype, ub)
        self.vec_free = 0.0
        self.sent = 0.0
        self.busy = [0.0] * self.links.lanes
        self.last = 0.0
        self.rank = 0
        self.hbm = 0.0             # link sends read HBM, arrivals write it; adds read every operand, write the sum

    def send(self, peer, nbytes, ready):
        lane = self.links.lane(self.rank, peer)
        start = max(ready, self.lane_free[lane])
        occ = nbytes / self.rate[lane]
        self.lane_free[lane] = start + occ
        self.busy[lane] += occ
        self.sent += nbytes
        self.hbm += nbytes
        return start

    def recv(self, peer, nbytes, ready):
        lane = self.links.lane(peer, self.rank)
        start = max(ready, self.mirror.get(peer, 0.0))
        end = start + nbytes / self.rate[lane]
        self.mirror[peer] = end
        self.hbm += nbytes
        arr = end + self.lat[lane]
        self.last = max(self.last, arr)
        return arr

    def add(self, elems, k, ready):
        start = max(ready, self.vec_free)
        self.vec_free = start + add_cycles(self.dev, self.dtype, elems, k, self.cores, self.tile)
        self.hbm += (k + 2) * elems * self.isz
        self.last = max(self.last, self.vec_free)
        return self.vec_free

    def copy(self, elems, ready):
        return self.add(elems, 0, ready)

    # --- the kernel's algorithms, per slice
    def _slices(self, pieces, ranks, ready):
        """``(p, me, S, sl)``: the ranks, this rank's place among them, the slices per piece (``ready``'s) and
        ``sl[j][k]``, the elements of piece ``j``'s slice ``k``."""
        p, me = len(ranks), ranks.index(self.rank)
        S = len(ready[0])
        return p, me, S, [[pieces[j] * (k + 1) // S - pieces[j] * k // S for k in range(S)] for j in range(p)]

    def reduce_scatter(self, pieces, ranks, ready, algorithm):
        p, me, S, sl = self._slices(pieces, ranks, ready)
        if algorithm == "ring":
            nxt, prv = ranks[(me + 1) % p], ranks[(me - 1) % p]
            for s in range(p - 1):
                cs, cr = (me - 1 - s) % p, (me - 2 - s) % p
                for k in range(S):
                    r = ready[cs][k]
                    self.send(nxt, sl[cs][k] * self.isz, r)
                    arr = self.recv(prv, sl[cr][k] * self.isz, r)
                    ready[cr][k] = self.add(sl[cr][k], 1, arr)
        else:
            peers = [j for j in range(p) if j != me]
            for k in range(S):
                r = max(ready[j][k] for j in peers)
                for j in peers:
                    self.send(ranks[j], sl[j][k] * self.isz, ready[j][k])
                arr = max(self.recv(ranks[j], sl[me][k] * self.isz, r) for j in peers)
                ready[me][k] = self.add(sl[me][k], p - 1, max(arr, ready[me][k]))

    def all_gather(self, pieces, ranks, ready, algorithm):
        p, me, S, sl = self._slices(pieces, ranks, ready)
        if algorithm == "ring":
            nxt, prv = ranks[(me + 1) % p], ranks[(me - 1) % p]
            for s in range(p - 1):
                cs, cr = (me - s) % p, (me - s - 1) % p
                for k in range(S):
                    self.send(nxt, sl[cs][k] * self.isz, ready[cs][k])
                    ready[cr][k] = self.recv(prv, sl[cr][k] * self.isz, ready[cs][k])
        else:
            peers = [j for j in range(p) if j != me]
            for k in range(S):
                for j in peers:
                    self.send(ranks[j], sl[me][k] * self.isz, ready[me][k])
                for j in peers:
                    ready[j][k] = self.recv(ranks[j], sl[j][k] * self.isz, ready[me][k])

    def all_reduce(self, n, ranks, ready, algorithm):
        p = len(ranks)
        if p == 1:
            return self.copy(n, ready)
        if algorithm == "oneshot":             # the mesh reduce-scatter with every piece the whole buffer
            rd = [[ready] * nslices(n * self.isz) for _ in range(p)]
            self.reduce_scatter([n] * p, ranks, rd, "mesh")
            return max(rd[ranks.index(self.rank)])
        if algorithm == "hierarchical":
            L = self.links.mesh
            me = ranks.index(self.rank)
            domain = [r for r in ranks if ranks.index(r) // L == me // L]
            column = [r for r in ranks if ranks.index(r) % L == me % L]
            pieces = pieces_of(n, L)
            S = nslices(max(pieces) * self.isz)
            rd = [[ready] * S for _ in range(L)]
            self.reduce_scatter(pieces, domain, rd, "mesh")
            i = domain.index(self.rank)
            rd[i] = [self.all_reduce(pieces[i], column, max(rd[i]), "ring")] * S
            self.all_gather(pieces, domain, rd, "mesh")
            return max(max(r) for r in rd)
        pieces = pieces_of(n, p)
        S = nslices(max(pieces) * self.isz)
        rd = [[ready] * S for _ in range(p)]
        self.reduce_scatter(pieces, ranks, rd, algorithm)
        self.all_gather(pieces, ranks, rd, algorithm)
        return max(max(r) for r in rd)

    def all_to_all(self, src, out, ranks, ready, full_mesh) -> list:
        """Returns, per rank, when its piece has landed (this rank's: when its copy is done)."""
        p, me = len(ranks), ranks.index(self.rank)
        S = max(nslices(max(src) * self.isz), nslices(max(out) * self.isz))
        arrived = [float(ready)] * p
        if src[me]:
            arrived[me] = self.copy(src[me], ready)
        rounds = [[(me + s) % p for s in range(1, p)]] if full_mesh else [[(me + s) % p] for s in range(1, p)]
        for to in rounds:
            frm = [(2 * me - j) % p for j in to]
            for k in range(S):
                for j in to:
                    self.send(ranks[j], (src[j] * (k + 1) // S - src[j] * k // S) * self.isz, ready)
                for j in frm:
                    arr = self.recv(ranks[j], (out[j] * (k + 1) // S - out[j] * k // S) * self.isz, ready)
                    arrived[j] = max(arrived[j], arr)
        return arrived

    def link_busy(self) -> float:
        return max(self.busy)


def _algorithm(dev, op, world, algorithm, nbytes=None):
    links = get_links(dev)
    algorithm = algorithm or default_algorithm(links, op, world, nbytes)
    if world > 1:
        check(op, algorithm, world, links)
    return algorithm


def _finish(kernel, dev, rep: LinkReplay, end, flops=0.0, notes=()):
    hbm = rep.hbm
    busy = {"link": rep.link_busy(), "vector": max(0.0, rep.vec_free)}
    return make(kernel, dev, max(end, rep.last, rep.link_busy()), hbm, {"HBM->link": rep.sent}, busy, None,
                rep.link_busy(), flops, notes)


def _spec(specs):
    (shape, dtype) = specs[0]
    return shape, dtype, math.prod(shape)


def _world(world):
    if not world or world < 1:
        raise ValueError("collective cost: give world= (the number of ranks)")
    return int(world)


def _replay(dev, specs, world):
    """A collective's element count, dtype and ranks, and a fresh replay of its links."""
    shape, dtype, n = _spec(specs)
    p = _world(world)
    return n, dtype, p, LinkReplay(dev, p, dtype)


@register("all_reduce")
def estimate_all_reduce(dev, specs, world=None, algorithm=None, rank=0, comm=None, slice_bytes=None):
    n, dtype, p, rep = _replay(dev, specs, world)
    end = rep.all_reduce(n, list(range(p)), 0.0, _algorithm(dev, "all_reduce", p, algorithm, n * itemsize(dtype)))
    return _finish("all_reduce", dev, rep, end)


@register("reduce_scatter")
def estimate_reduce_scatter(dev, specs, world=None, algorithm=None, rank=0, comm=None, slice_bytes=None):
    n, dtype, p, rep = _replay(dev, specs, world)
    per = n // p
    if p > 1:
        S = nslices(per * itemsize(dtype))
        rd = [[0.0] * S for _ in range(p)]
        rep.reduce_scatter([per] * p, list(range(p)), rd, _algorithm(dev, "reduce_scatter", p, algorithm))
    end = rep.copy(per, rep.last)
    return _finish("reduce_scatter", dev, rep, end)


@register("all_gather")
def estimate_all_gather(dev, specs, world=None, algorithm=None, rank=0, comm=None, slice_bytes=None):
    n, dtype, p, rep = _replay(dev, specs, world)
    own = rep.copy(n, 0.0)
    if p > 1:
        S = nslices(n * itemsize(dtype))
        rd = [[own] * S for _ in range(p)]
        rep.all_gather([n] * p, list(range(p)), rd, _algorithm(dev, "all_gather", p, algorithm))
    return _finish("all_gather", dev, rep, rep.last)


@register("all_to_all")
def estimate_all_to_all(dev, specs, world=None, algorithm=None, rank=0, comm=None, slice_bytes=None,
                        output_split_sizes=None, input_split_sizes=None):
    shape, dtype, n = _spec(specs)
    p = _world(world)
    rows = shape[0]
    row = n // rows if rows else 0
    ins = list(input_split_sizes) if input_split_sizes else [rows // p] * p
    outs = list(output_split_sizes) if output_split_sizes else ins
    rep = LinkReplay(dev, p, dtype)
    links = get_links(dev)
    rep.all_to_all([r * row for r in ins], [r * row for r in outs], list(range(p)), 0.0,
                   links.full_mesh and p <= links.mesh)
    return _finish("all_to_all", dev, rep, rep.last)


__all__ = ["LinkReplay", "add_cycles", "nslices", "tile_elems", "vector_group"]
