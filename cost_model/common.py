"""Small helpers shared by the kernel models: rounding, buffer packing, the GM port of a lockstep wave."""
from __future__ import annotations

import math

import numpy as np

from cost_model.devices import ITEMSIZE


# The smallest transfer the Vector kernels' default tilings make; tiling searches go no lower, since the
# simulator charges no DMA setup and smaller transfers would only look cheaper.
MIN_TILE_BYTES = 8192


def ceil_div(a, b):
    return -(-a // b)


def round_up(a, b):
    return -(-a // b) * b


def asum(a):
    """``a.sum()`` of a 1-D numpy array, as numpy adds it: below 8 items numpy adds left to right from 0, as
    this loop does at a fraction of the call's cost (the models sum many short per-step arrays); longer
    arrays, and any but 1-D float arrays, are left to numpy (which adds long ones pairwise)."""
    if a.ndim != 1 or len(a) >= 8 or a.dtype.kind != "f":
        return a.sum()
    s = 0.0
    for x in a.tolist():
        s += x
    return s


def unique(a, return_inverse: bool = False):
    """``np.unique(a)`` (and, with ``return_inverse``, each element's index among the values, in ``a``'s shape): the
    same arrays. Up to 4096 elements a set and ``searchsorted`` make them at a fraction of np.unique's cost (the
    models ask for the few distinct row counts or cut points of some hundreds of tasks)."""
    if a.size > 4096:
        u, inv = np.unique(a, return_inverse=True)
        return (u, inv.reshape(a.shape)) if return_inverse else u
    u = np.array(sorted(set(a.ravel().tolist())), dtype=a.dtype)
    return (u, u.searchsorted(a)) if return_inverse else u


def tile1d(a, n: int):
    """``np.tile(a, n)`` of a 1-D array ``a``, ``n >= 1``: ``n`` copies end to end (a new array). np.tile's
    Python-level shape handling costs more than the models' short arrays."""
    return np.concatenate([a] * n) if n > 1 else a.copy()


def itemsize(dtype: str) -> int:
    return ITEMSIZE[dtype]


def numel(shape) -> int:
    return math.prod(shape)


def pack(dev, allocs) -> bool:
    """Whether tiles ``[(buffer, nbytes), ...]``, allocated in order with the buffer's alignment, all fit.

    Mirrors the simulator's bump allocator: each tile starts at the next aligned offset.
    """
    used = {}
    for buf, nbytes in allocs:
        a = dev.align[buf]
        off = round_up(used.get(buf, 0), a)
        if off + nbytes > dev.buffers[buf]:
            return False
        used[buf] = off + nbytes
    return True


def port_cycles(dev, hit_bytes: float, miss_bytes: float) -> float:
    """GM-port cycles of one lockstep transfer for a core that both hits and waits on a miss.

    The simulator charges every core that hits the chip's total hit bytes over the L2 bandwidth and every
    core that needs a missed line the instruction's total HBM bytes over the HBM bandwidth.
    """
    return hit_bytes / dev.l2_bytes_per_cycle + miss_bytes / dev.hbm_bytes_per_cycle
