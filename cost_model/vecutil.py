"""UB packing and the tile-size search the Vector kernels choose their tiles with: shared data, no cost formula.

The simulator's kernels (``autofuse/npu/kernels/tiles.py`` re-exports these) and the cost model both read
this module, so the two sides agree by construction on a UB row's pitch, on what fits UB and on the largest
tile that does. It holds geometry only: nothing here counts or prices cycles or bytes moved.
"""
from __future__ import annotations

import math

from cost_model.common import itemsize
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
