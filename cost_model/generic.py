"""The price of an op with no dedicated kernel: the simulator's ``generic`` kernel in closed form.

``generic`` reads every input once, runs ``passes`` Vector passes per output element and writes every
output once, streamed through UB on all vector cores, double-buffered: the inputs and outputs are cut
into ``steps`` equal slices dealt to the cores in waves. The kernel's default slice is the largest that,
double-buffered for every stream, fits 90 % of UB; the search also prices slices that give every core 2
or 4 waves (so loads, work and stores overlap) and keeps the cheapest. Every slice is a distinct region,
so every load misses L2 and every store writes through to HBM; the waves run through
:func:`cost_model.stream.stream`.

    cost_model.estimate("generic", [((4, 8), "float16")], outputs=[((4, 8), "float16")], passes=1)
    cost_model.generic_op([((4096, 4096), "float16")], [((4096, 4096), "float16")], passes=3)
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import MIN_TILE_BYTES, ceil_div, itemsize, round_up
from cost_model.devices import get_device
from cost_model.estimate import cached, estimate, kernel_cycles, make, register
from cost_model.stream import port, stream


def _max_chunk(dev, per_elem):
    return max(32, int(dev.buffers["UB"] * 0.9 / per_elem) // 32 * 32)


@cached
def _search(device, ins, outs, passes):
    """The largest slice that fits (the kernel's default), or one giving every core 2 or 4 waves (each at
    least 8 KB of the largest stream): the cheapest."""
    dev = get_device(device)
    best = _model(dev, ins, outs, passes, None)
    if best[4] is None:
        return best
    sizes = [max(1, math.prod(s)) for s, _ in list(ins) + list(outs)]
    biggest = max(sizes)
    widest = (list(ins) + list(outs))[sizes.index(biggest)][1]
    top = best[4]["chunk"]
    floor = MIN_TILE_BYTES // itemsize(widest)
    for waves in (2, 4):
        chunk = max(floor, round_up(ceil_div(biggest, dev.vector_cores * waves), 32))
        if chunk >= top:
            continue
        res = _model(dev, ins, outs, passes, {"chunk": chunk})
        if kernel_cycles(dev, *res[:3]) < kernel_cycles(dev, *best[:3]):
            best = res
    return best


def _model(dev, ins, outs, passes, tiling):
    streams = [(s, d, False) for s, d in ins] + [(s, d, True) for s, d in outs]
    sizes = [max(1, math.prod(s)) for s, _, _ in streams]
    if not streams:
        return 0.0, 0.0, {}, {}, None
    biggest = max(sizes)
    widest = streams[sizes.index(biggest)][1]
    per_elem = sum(2 * itemsize(d) * sz / biggest for (_, d, _), sz in zip(streams, sizes))
    chunk = int((tiling or {}).get("chunk", 0)) or _max_chunk(dev, per_elem)
    steps = ceil_div(biggest, chunk)
    n = min(dev.vector_cores, steps)
    waves = ceil_div(steps, n)
    act = np.array([min(n, steps - w * n) for w in range(waves)], dtype=float)
    lb = sum(ceil_div(sz, steps) * itemsize(d) for (_, d, o), sz in zip(streams, sizes) if not o)
    sb = sum(ceil_div(sz, steps) * itemsize(d) for (_, d, o), sz in zip(streams, sizes) if o)
    n_in = sum(1 for *_, o in streams if not o)
    n_out = len(streams) - n_in
    rep = ceil_div(ceil_div(biggest, steps), 256 // itemsize(widest)) * passes
    miss = act * sum(sz * itemsize(d) for (_, d, o), sz in zip(streams, sizes) if not o) / steps
    stot = act * sum(sz * itemsize(d) for (_, d, o), sz in zip(streams, sizes) if o) / steps
    # Wave w+1's loads are issued after wave w's stores, but they run as soon as their buffers are free
    # and fill the GM port while the Vector works, so the waves stream like the prefetching kernels'.
    core, busy = stream(dev, np.full(waves, float(lb)), port(dev, 0 * miss, miss), np.full(waves, float(rep)),
                        np.full(waves, float(sb)), stot / dev.hbm_bytes_per_cycle,
                        np.full(waves, float(n_in + n_out + 1)))
    hbm = float(miss.sum() + stot.sum())
    return core, hbm, {"GM->UB": float(miss.sum()), "UB->GM": float(stot.sum())}, busy, {"chunk": chunk}


def _roofline(dev, specs, outputs=(), passes=1, tiling=None):
    io = sum(math.prod(s) * itemsize(d) for s, d in list(specs) + [tuple(o) for o in outputs] if s is not None)
    N = max([math.prod(s) for s, _ in outputs] or [1])
    return max(io / dev.hbm_bytes_per_cycle, N * passes / 64 / dev.vector_cores)


@register("generic", _roofline)
def estimate_generic(dev, specs, outputs=(), passes=1, tiling=None):
    ins = [s for s in specs if s is not None]
    outs = [(tuple(s), d) for s, d in outputs]
    if tiling is None:
        core, hbm, nbytes, busy, t = _search(dev.name, tuple(ins), tuple(outs), passes)
    else:
        core, hbm, nbytes, busy, t = _model(dev, ins, outs, passes, tiling)
    N = max([math.prod(s) for s, _ in outs] or [0])
    return make("generic", dev, core, hbm, nbytes, busy, t and dict(t), _roofline(dev, ins, outs, passes), float(N * passes))


def generic_op(inputs, outputs, passes: int = 1, device="ascend910"):
    """Price of an op without a kernel: a generic Vector op with a GM round trip (see the module doc)."""
    return estimate("generic", inputs, device=device, outputs=[(tuple(s), d) for s, d in outputs], passes=passes)


__all__ = ["estimate_generic", "generic_op"]
