"""UB packing and the tile-size search the Vector kernels choose their tiles with: shared data, no cost formula.

The simulator's kernels (``autofuse/npu/kernels/tiles.py`` re-exports the UB helpers) and the cost model both
read this module, so the two sides agree by construction on a UB row's pitch, on what fits UB and on the
largest tile that does; and, for the elementwise and reduce kernels (``autofuse/npu/kernels/vector.py``), on
the dtype an op computes in, how its shapes coalesce and which UB tiles it allocates; for the movement kernels
(``autofuse/npu/kernels/movement.py``), on a permutation's coalesced dims and the default copy and transpose
tiles; for the score bound (``autofuse/npu/kernels/score_bound.py``), on its UB tiles and rows per tile. It holds
semantics and geometry only: nothing here counts or prices cycles or bytes moved.
"""
from __future__ import annotations

import math

from cost_model.common import ceil_div, itemsize, round_up
from cost_model.devices import ITEMSIZE

BLOCK = 32                       # UB alignment: one 32 B block


def block_elems(dtype: str) -> int:
    return BLOCK // itemsize(dtype)


def pad(n, dtype: str):
    """``n`` elements rounded up to whole 32 B blocks (a UB row pitch). (round_up and block_elems written out:
    the Vector models pad some ten thousand rows a sweep)"""
    b = BLOCK // ITEMSIZE[dtype]
    return -(-n // b) * b


def ub_need(dev, specs) -> int:
    """UB bytes of tiles ``[(shape, dtype)]`` allocated in order, each at the UB alignment (the tile-size
    searches call this thousands of times: the rounding and item sizes are inlined)."""
    align = dev.align["UB"]
    used = 0
    for shape, dtype in specs:
        used = -(-used // align) * align + math.prod(shape) * ITEMSIZE[dtype]
    return used


def fits(dev, specs) -> bool:
    return ub_need(dev, specs) <= dev.buffers["UB"]


def largest(ok, lo: int, hi: int) -> int:
    """The largest ``x`` in ``[lo, hi]`` with ``ok(x)`` (monotone), ``lo - 1`` if none."""
    if hi < lo or not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


# ------------------------------------------------------------------------------- elementwise and reduce
_FLOATS = ("float16", "bfloat16", "float32")
_INTS = ("int32", "int8")


def promote(dtypes, float_scalar: bool) -> str:
    """torch's type promotion among tensor dtypes (a Python float scalar lifts integers to float32)."""
    for d in dtypes:
        if d not in _FLOATS and d not in _INTS and d != "bool":
            raise TypeError(f"elementwise: {d} is not supported by the Vector unit (float16, bfloat16, "
                            f"float32, int32, int8, bool); cast the tensor first")
    floats = {d for d in dtypes if d in _FLOATS}
    if floats:
        return floats.pop() if len(floats) == 1 else "float32"
    if any(d in _INTS for d in dtypes):
        if float_scalar:
            return "float32"
        return "int32" if "int32" in dtypes else "int8"
    return "float32" if float_scalar else "bool"


def coalesce(out_shape, shapes):
    """Drop size-1 output dims, merge neighbours with equal broadcast flags; at least two dims."""
    nd = len(out_shape)
    padded = [(1,) * (nd - len(s)) + tuple(s) for s in shapes]
    dims, flags = [], []
    for i, d in enumerate(out_shape):
        if d == 1:
            continue
        f = tuple(p[i] == d for p in padded)
        if dims and flags[-1] == f:
            dims[-1] *= d
        else:
            dims.append(d)
            flags.append(f)
    full = tuple(True for _ in shapes)
    while len(dims) < 2:
        dims.insert(0, 1)
        flags.insert(0, full)
    return dims, flags


def reduce_groups(shape, red) -> list:
    """A reduction's coalesced dims, ``[size, reduced?]`` each: size-1 dims dropped, neighbours of the same kind
    merged; at least one kept and one reduced group (of size 1 where the shape has none)."""
    groups = []
    for i, s in enumerate(shape):
        if s == 1:
            continue
        f = i in red
        if groups and groups[-1][1] == f:
            groups[-1][0] *= s
        else:
            groups.append([s, f])
    if not any(not f for _, f in groups):
        groups.insert(0, [1, False])
    if not any(f for _, f in groups):
        groups.append([1, True])
    return groups


def reduce_tiles(dtype, out_dt, rowmode, block, chunk) -> list:
    """The reduce kernel's UB tiles ``[(shape, dtype)]`` in allocation order: the input (two), its fp32 cast
    (16-bit inputs), this chunk's per-row partial (rows reduced along the row), the fp32 accumulator and the
    output (two)."""
    shape = (block, pad(chunk, dtype)) if rowmode else (chunk, pad(block, dtype))
    sp = [(shape, dtype)] * 2
    if dtype != "float32":
        sp.append((shape, "float32"))
    bp = pad(block, "float16")
    if rowmode:
        sp.append(((bp,), "float32"))
    return sp + [((bp,), "float32")] + [((bp,), out_dt)] * 2


# ------------------------------------------------------------------------------------------- movement
def coalesce_perm(shape, perm):
    """Drop size-1 dims and merge output neighbours that are input neighbours in order: ``(in_sizes, q)``, the
    coalesced input sizes and, for output dim ``j``, the coalesced input dim ``q[j]``."""
    keep = [d for d in range(len(shape)) if shape[d] != 1]
    perm = [p for p in perm if p in keep]
    groups = []                          # in output order: lists of input dims
    for p in perm:
        if groups and groups[-1][-1] + 1 == p:
            groups[-1].append(p)
        else:
            groups.append([p])
    order = sorted(range(len(groups)), key=lambda i: groups[i][0])      # groups in input order
    in_sizes = [math.prod(shape[d] for d in groups[i]) for i in order]
    pos = {gi: k for k, gi in enumerate(order)}
    return in_sizes, [pos[i] for i in range(len(groups))]


def copy_tile(dev, dtype, maxc, target):
    """The row copies' default tile: the largest ``rows x cols`` tile of about ``target`` elements that fits UB
    double-buffered (columns in whole 32 B blocks, at most ``maxc``)."""
    cblk = block_elems(dtype)
    spec = lambda r, c: [((r, round_up(c, cblk)), dtype)] * 2            # noqa: E731
    c = maxc if fits(dev, spec(1, maxc)) else \
        cblk * largest(lambda k: fits(dev, spec(1, k * cblk)), 1, ceil_div(maxc, cblk))
    c = max(cblk, min(c, round_up(target, cblk)))
    r = max(1, min(largest(lambda x: fits(dev, spec(x, c)), 1, 1 << 20), target // c))
    return r, c


def transpose_tiles(a, l_, dtype) -> list:
    """The transpose's UB tiles: ``a x l`` in (two), ``l x a`` out (two), rows padded to 32 B."""
    cblk = block_elems(dtype)
    return [((a, round_up(l_, cblk)), dtype)] * 2 + [((l_, round_up(a, cblk)), dtype)] * 2


def transpose_default(dev, SA, SL, dtype):
    """The transpose's default tile: 128 x 128, a short side letting the other grow (e.g. [.., 8] -> long runs
    of the other dim)."""
    a, l_ = min(SA, 128), min(SL, 128)
    if a < 128:
        l_ = min(SL, largest(lambda v: fits(dev, transpose_tiles(a, v, dtype)), 1, 1 << 16))
    elif l_ < 128:
        a = min(SA, largest(lambda v: fits(dev, transpose_tiles(v, l_, dtype)), 1, 1 << 16))
    return a, l_


# ---------------------------------------------------------------------------------------- score bound
def score_bound_tiles(dtype: str, R: int, D: int) -> list:
    """The score bound's UB tiles, in allocation order: x (two), x in fp32 (fp16/bf16), x², per-row sums,
    running max, out (one 32 B block of fp32)."""
    dp = pad(D, "float16")
    sp = [((R, dp), dtype)] * 2
    if dtype != "float32":
        sp.append(((R, dp), "float32"))
    rp = pad(R, "float32")
    return sp + [((R, dp), "float32"), ((rp,), "float32"), ((rp,), "float32"), ((8,), "float32")]


def score_bound_cores(dev, rows: int) -> int:
    """The cores the score and bias bounds run on (each stores one partial): one per row, at most every Vector core,
    at least one."""
    return max(1, min(dev.vector_cores, rows))


def score_bound_rows(dev, dtype: str, D: int, per_core: int) -> int:
    """The score bound's default rows per tile: the most that fit UB, capped so each core has four tiles."""
    r = largest(lambda r: fits(dev, score_bound_tiles(dtype, r, D)), 1, max(1, per_core))
    if r < 1:
        raise ValueError(f"score_bound: not one row of {D} {dtype} values fits UB on {dev.name}")
    return max(1, min(r, ceil_div(per_core, 4)))
