"""Expert parallelism in one launch (``autofuse/npu/kernels/moe_ep.py``): dispatch, grouped GEMM and combine,
pipelined by chunks.

The model replays the kernel's schedule for one rank of a rank-symmetric world (every rank routes the same
numbers of rows to each rank and expert; ``counts``: this rank's ``[p][E_l]`` rows per rank and expert,
default an even spread of the ``S`` rows):

* the counts go out on every port at once; a GEMM block starts no earlier than their arrival;
* dispatch(c), combine(c): the pairwise all-to-all of chunk c on the rank's link lanes and Vector cores
  (:class:`cost_model.collectives.LinkReplay`), in the kernel's program order: dispatch(0), dispatch(1), then
  GEMM(c), combine(c), dispatch(c+2);
* GEMM(c): the blocks (expert, ``m0`` of the chunk's rows for that expert, ``n0`` columns) in lockstep waves
  over the Cube cores (:class:`cost_model.mc2._Cube`), after the chunk has landed (every source's: in a
  symmetric world they land together); a block occupies its core for one wave of the GEMM as
  ``cost_model.matmul`` prices a batch of matmuls, one per (chunk, expert) with rows, of their average rows,
  each with its expert's weight (chunks cut each source's rows in expert order, so an expert's rows mostly
  fall in one chunk).
"""
from __future__ import annotations

import numpy as np

from cost_model.collectives import LinkReplay
from cost_model.common import ceil_div, itemsize
from cost_model.estimate import make, register
from cost_model.links import get_links
from cost_model.mc2 import _Cube, mc2_tiling


def even_counts(S: int, world: int, local: int) -> np.ndarray:
    """``S`` rows spread as evenly as they go over ``world × local`` experts: ``[world][local]``."""
    E = world * local
    return np.array([S // E + (e < S % E) for e in range(E)]).reshape(world, local)


def chunk_rows(n, c, chunks):
    return n * c // chunks, n * (c + 1) // chunks


def _spans(counts_e, a, b):
    """``[(expert, rows)]`` of rows ``[a, b)`` of a segment ordered by expert."""
    out, lo = [], 0
    for e, n in enumerate(counts_e):
        if min(b, lo + n) > max(a, lo):
            out.append((e, min(b, lo + n) - max(a, lo)))
        lo += n
    return out


@register("moe_dispatch_combine")
def estimate_moe_dispatch_combine(dev, specs, world=None, chunks=4, tiling=None, counts=None, rank=0, comm=None,
                                  slice_bytes=None):
    (xs, dtype), _, (ws, _) = specs
    S, K = xs
    E_l, _, N = ws
    p = int(world or 1)
    cnt = np.asarray(counts, dtype=np.int64).reshape(p, E_l) if counts is not None else even_counts(S, p, E_l)
    isz = itemsize(dtype)
    links = get_links(dev)
    full_mesh = links.full_mesh and p <= links.mesh
    ranks = list(range(p))
    n = cnt.sum(axis=1)
    # the GEMM's rows per chunk and expert, from every source (a symmetric world: as many as this rank sends)
    regions = np.zeros((chunks, E_l), dtype=np.int64)
    for ch in range(chunks):
        for j in ranks:
            for e, rows in _spans(cnt[j], *chunk_rows(n[j], ch, chunks)):
                regions[ch, e] += rows
    filled = regions[regions > 0]
    seg_rows = max(1, int(round(filled.mean()))) if filled.size else 1
    t = {k: int(tiling[k]) for k in ("m0", "n0", "k0", "k1")} if tiling else mc2_tiling(dev, max(S, 16), N, K, dtype)
    rep = LinkReplay(dev, p, dtype, ub_shared=2 * t["m0"] * t["n0"] * isz if dev.arch == "coupled" else None)
    cube = _Cube(dev, seg_rows, N, K, dtype, t, batch=max(1, filled.size))

    t_counts = 0.0
    for j in ranks[1:]:
        rep.send(j, E_l * 4, 0.0)
        t_counts = max(t_counts, rep.recv(j, E_l * 4, 0.0))
    nn = ceil_div(N, t["n0"])

    def a2a(width, ch, ready):
        piece = [int(np.subtract(*chunk_rows(n[j], ch, chunks)[::-1])) * width for j in ranks]
        return rep.all_to_all(piece, piece, ranks, ready, full_mesh)

    def gemm(ch, arrived):
        blocks = [min(t["m0"], int(m) - r) for m in regions[ch] for r in range(0, int(m), t["m0"]) for _ in range(nn)]
        cube.add("recv", blocks, max([t_counts] + list(arrived)), tag=ch)
        cube.flush()

    arrivals = {0: a2a(K, 0, 0.0)}
    if chunks > 1:
        arrivals[1] = a2a(K, 1, 0.0)
    for ch in range(chunks):
        gemm(ch, arrivals[ch])
        a2a(N, ch, cube.done.get(ch, 0.0))
        if ch + 2 < chunks:
            arrivals[ch + 2] = a2a(K, ch + 2, 0.0)
    end = max(cube.end, rep.last)
    R = int(cnt.sum())
    busy = {"link": rep.link_busy(), "cube": cube.cube_busy}
    workspace = R * (K + N) * isz + S * N * isz
    return make("moe_dispatch_combine", dev, end, cube.hbm + rep.hbm, {}, busy, dict(t), rep.link_busy(),
                2.0 * R * K * N, notes=(f"{chunks} chunks",), workspace=workspace)


def unfused_steps(S: int, K: int, N: int, local: int, world: int, dtype: str = "float16") -> list:
    """The launches of expert parallelism without the fused kernel, for ``S`` rows per rank spread evenly:
    ``[(kernel, input specs, params, {input index: values})]`` — the counts' all-to-all, a gather into send
    order, the dispatch all-to-all, a gather of the received rows by expert, the grouped GEMM, the gather back,
    the combine all-to-all, the gather back to token order."""
    rows, idx = ((S, K), dtype), ((S,), "int32")
    out = ((S, N), dtype)
    a2a = {"world": world}
    groups = {2: np.full(local, S // local, dtype=np.int64)}
    return [("all_to_all", [((world, local), "float32")], a2a, {}), ("gather", [rows, idx], {}, {}),
            ("all_to_all", [rows], a2a, {}), ("gather", [rows, idx], {}, {}),
            ("grouped_matmul", [rows, ((local, K, N), dtype), ((local,), "int64")], {}, groups),
            ("gather", [out, idx], {}, {}), ("all_to_all", [out], a2a, {}), ("gather", [out, idx], {}, {})]


def choose_chunks(S, K, N, local, world, device, dtype="float16", counts=(1, 2, 4, 8)) -> tuple[int, int]:
    """``(chunks, cycles)``: the chunk count the model prices fastest for even routing."""
    from cost_model.estimate import estimate
    specs = [((S, K), dtype), ((S,), "int32"), ((local, K, N), dtype)]
    best = min((estimate("moe_dispatch_combine", specs, device=device, world=world, chunks=c).cycles, c)
               for c in counts)
    return best[1], best[0]


__all__ = ["choose_chunks", "estimate_moe_dispatch_combine", "even_counts", "unfused_steps"]
