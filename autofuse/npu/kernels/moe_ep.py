"""Expert parallelism in one launch: all-to-all dispatch, grouped GEMM, all-to-all combine, pipelined by chunks
(CANN's MoeDistributeDispatch + GroupedMatmul + MoeDistributeCombine as one MC2 kernel).

    npu.run("moe_dispatch_combine", x, expert_ids, weight, comm=..., chunks=4)        -> (y,)

Each of the ``p`` ranks holds ``E_l`` experts (``weight [E_l, K, N]``: rank r holds global experts
``r·E_l .. (r+1)·E_l - 1``) and ``S`` routed rows (``x [S, K]``, a token repeated once per expert it picked,
``expert_ids [S]`` global expert ids). Output ``y [S, N]``: ``y[i] = x[i] @ W[expert_ids[i]]``, wherever that
expert lives (the weighted combine of a token's rows is the caller's ``moe_finalize_routing``).

Schedule, on each rank:

1. **counts**: how many rows go to each peer for each of its experts, sent on every port at once (one small
   message per peer; the receiving side needs them to place rows and to group its GEMM);
2. **dispatch**: the rows for rank j, ordered by expert, cut into ``chunks`` equal chunks; chunk c of every
   destination goes out as one pairwise all-to-all (every port at once on a full mesh). The DMA reads each
   row where it is in ``x`` (a row gather, the same bytes): the simulator hands the link a copy in send
   order. The landing DMA writes each received row to its expert's rows of the chunk (experts in order, each
   expert's rows source by source, as MoeDistributeDispatch lays out its expanded rows; a row scatter, the
   same bytes: the simulator lands them off the link in order and places them);
3. **grouped GEMM**: the blocks (expert, ``m0`` rows of the chunk's rows for that expert, ``n0`` columns) go
   to the Cube in lockstep waves (:class:`autofuse.npu.kernels.mc2._Cube`), each block waiting only for the
   sources whose rows it holds; the expert picks the block's weight, so no row is re-sorted by a launch;
4. **combine**: when chunk c's blocks are stored, its rows go back to the ranks they came from (an all-to-all
   the other way) and land where their tokens were in ``x`` (a row scatter by the landing DMA, the same
   bytes; the simulator lands them in send order and places them).

Program order is dispatch(0), dispatch(1), then for each chunk c: GEMM(c), combine(c), dispatch(c+2): chunk
c+1's all-to-all runs under chunk c's products, and chunk c's combine under chunk c+1's. The link lanes carry
transfers in the order they are issued.

Unfused, expert parallelism is eight launches (``benchmarks/moe_kernels.py``): the counts' all-to-all, a row
gather into send order, the dispatch all-to-all, a gather of the received rows by expert, the grouped GEMM,
the gather back, the combine all-to-all, the gather back to token order.
"""
from __future__ import annotations

import numpy as np

from autofuse.npu.kernels.collectives import Collective
from autofuse.npu.kernels.matmul import CUBE_DTYPES, Program, _ceil
from autofuse.npu.kernels.mc2 import _Cube, mc2_tiling
from autofuse.npu.link import make_comm
from autofuse.npu.run import ALL, kernel
from cost_model.links import get_links


def send_plan(expert_ids: np.ndarray, world: int, local: int):
    """``(order, counts)``: the rows in send order (by destination rank, then expert) and ``counts[j][e]``,
    the rows for rank j's local expert e."""
    ids = np.asarray(expert_ids).reshape(-1).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= world * local):
        raise ValueError(f"moe_dispatch_combine: expert ids must lie in [0, {world * local}) ({world} ranks × "
                         f"{local} experts), got {int(ids.min())}..{int(ids.max())}")
    order = np.argsort(ids, kind="stable")
    counts = np.bincount(ids, minlength=world * local).reshape(world, local)
    return order, counts


def chunk_rows(n: int, c: int, chunks: int) -> tuple[int, int]:
    """Rows ``[a, b)`` of chunk c of a segment of ``n`` rows."""
    return n * c // chunks, n * (c + 1) // chunks


def expert_spans(counts_e, a: int, b: int):
    """``[(expert, first, last)]``: rows ``[a, b)`` of a segment ordered by expert (``counts_e`` rows each), cut
    at the experts' boundaries (offsets within the segment)."""
    out, lo = [], 0
    for e, n in enumerate(counts_e):
        s, t = max(a, lo), min(b, lo + n)
        if t > s:
            out.append((e, s, t))
        lo += n
    return out


@kernel("moe_dispatch_combine", steer=ALL)      # routing and the exchange follow the values, as in MC2
def moe_dispatch_combine(launch, x, expert_ids, weight, comm=None, world=None, rank=0, chunks=4, tiling=None,
                         slice_bytes=None):
    """``y[i] = x[i] @ W[expert_ids[i]]`` across ranks (see the module docstring)."""
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in CUBE_DTYPES:
            raise TypeError(f"moe_dispatch_combine: {name} is {t.dtype}; the Cube takes {', '.join(CUBE_DTYPES)}")
    if x.data.ndim != 2 or weight.data.ndim != 3 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"moe_dispatch_combine: x [S, K] and weight [E_local, K, N] of one dtype, got x "
                         f"{list(x.shape)} {x.dtype} and weight {list(weight.shape)} {weight.dtype}")
    c = make_comm(comm, world, rank)
    p, me = c.world, c.rank
    E_l, K, N = weight.shape
    S = x.shape[0]
    dev = launch.device
    order, counts = send_plan(expert_ids.data, p, E_l)
    t = mc2_tiling(dev, max(S, 16), N, K, x.dtype, x.dtype, tiling)
    prog = Program(launch, x.dtype, x.dtype, t, dev.cube_cores, False)
    cube = _Cube(prog, K)
    col = Collective(launch, c, x.dtype, group=prog.g if dev.arch == "coupled" else None, slice_bytes=slice_bytes)
    links = col.links
    full_mesh = get_links(dev).full_mesh and p <= get_links(dev).mesh

    # 1. counts to every peer (one message each, every port at once); rc[j][e]: rows rank j sends us for expert e
    peers = [j for j in range(p) if j != me]
    sends = [links.send(j, counts[j].astype(np.float32), E_l * 4, 0.0, "counts") for j in peers]
    got = links.exchange(sends, [(j, (E_l,), E_l * 4) for j in peers]) if peers else []
    rc = np.zeros((p, E_l), dtype=np.int64)
    rc[me] = counts[me]
    t_counts = 0.0
    for j, (data, arr) in zip(peers, got):
        rc[j] = np.rint(data).astype(np.int64)
        t_counts = max(t_counts, arr)
    col.last = max(col.last, t_counts)

    # send order (the dispatch DMA gathers the rows; the link is handed them in this order)
    xs = launch.tensor(x.data.reshape(S, K)[order], x.dtype, "x in send order")
    send_lo = np.concatenate([[0], np.cumsum(counts.sum(axis=1))])          # rows of x for rank j, in xs
    n_send, n_recv = counts.sum(axis=1), rc.sum(axis=1)
    ranks = list(range(p))
    # received rows, chunk by chunk: as they come off the link (source-major, ``stage_lo[c][j]``), and where the
    # landing DMA puts them (expert-major, then source: ``where[c][j]``, their rows of ``recv``; ``regions[c]``
    # the (expert, first row, rows' sources) of each expert's rows)
    stage_lo, where, regions, sources = [], [], [], []
    R = 0
    for ch in range(chunks):
        spans = [expert_spans(rc[j], *chunk_rows(n_recv[j], ch, chunks)) for j in ranks]
        lo = [R + sum(np.subtract(*chunk_rows(n_recv[i], ch, chunks)[::-1]) for i in ranks[:j]) for j in ranks]
        stage_lo.append(lo)
        where.append([np.zeros(0, np.int64)] * p)
        regions.append([])
        src = []
        for e in range(E_l):
            first = R
            for j in ranks:
                for ee, s0, s1 in spans[j]:
                    if ee == e:
                        where[ch][j] = np.concatenate([where[ch][j], np.arange(R, R + s1 - s0)])
                        src += [j] * (s1 - s0)
                        R += s1 - s0
            if R > first:
                regions[ch].append((e, first, R))
        sources.append(np.array(src, dtype=np.int64))
    stage = launch.tensor(np.zeros((max(R, 1), K), np.float32), x.dtype, "rows off the link")
    ystage = launch.tensor(np.zeros((max(R, 1), N), np.float32), x.dtype, "outputs onto the link")
    recv = launch.empty((max(R, 1), K), x.dtype, "received rows", scratch=True)
    yrecv = launch.empty((max(R, 1), N), x.dtype, "expert outputs", scratch=True)
    ys = launch.empty((S, N), x.dtype, "y in send order", scratch=True)
    nn = _ceil(N, t["n0"])

    def sent(ch, j, width):             # chunk ch of the rows for rank j, in send order (flat elements)
        a, b = chunk_rows(n_send[j], ch, chunks)
        return (int(send_lo[j]) + a) * width, (int(send_lo[j]) + b) * width

    def staged(ch, j, width):           # chunk ch of the rows from rank j, as they come off the link
        a, b = chunk_rows(n_recv[j], ch, chunks)
        return stage_lo[ch][j] * width, (stage_lo[ch][j] + b - a) * width

    def dispatch(ch):
        arrived = col.all_to_all(_flat(stage), [staged(ch, j, K) for j in ranks], _flat(xs),
                                 [sent(ch, j, K) for j in ranks], ranks, 0.0, full_mesh)
        for j in ranks:                 # the landing DMA writes each row to its expert's rows (the same bytes)
            lo = staged(ch, j, 1)[0]
            recv.data[where[ch][j]] = stage.data[lo:lo + where[ch][j].size]
        return arrived

    def gemm(ch, arrived):
        for e, first, last in regions[ch]:
            for r in range(first, last, t["m0"]):
                m = min(t["m0"], last - r)
                # a block needs the rows of every source it covers, and the counts that place them
                ready = max([t_counts] + [arrived[j] for j in np.unique(sources[ch][r - first:r - first + m])])
                cube.add(recv, weight, yrecv, [((e,), (r, m), ni) for ni in range(nn)], ready, tag=ch)
        cube.flush()

    def combine(ch):
        for j in ranks:                 # the combine's DMA reads each row where its expert wrote it
            lo = staged(ch, j, 1)[0]
            ystage.data[lo:lo + where[ch][j].size] = yrecv.data[where[ch][j]]
        col.all_to_all(_flat(ys), [sent(ch, j, N) for j in ranks], _flat(ystage),
                       [staged(ch, j, N) for j in ranks], ranks, cube.done.get(ch, 0.0), full_mesh)

    arrivals = {0: dispatch(0)}
    if chunks > 1:
        arrivals[1] = dispatch(1)
    for ch in range(chunks):
        gemm(ch, arrivals[ch])
        combine(ch)
        if ch + 2 < chunks:
            arrivals[ch + 2] = dispatch(ch + 2)
    col.finish()
    y = launch.empty((S, N), x.dtype, "y")
    y.data[order] = ys.data            # the combine's landing DMA scatters rows to their tokens' places
    return (y,)


def _flat(t):
    return type(t)(t.data.reshape(-1), t.dtype, t.name, getattr(t, "scratch", False))


__all__ = ["chunk_rows", "expert_spans", "moe_dispatch_combine", "send_plan"]
