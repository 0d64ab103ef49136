"""The price of an op with no dedicated kernel: the simulator's ``generic`` kernel in closed form.

``generic`` reads every input once, runs ``passes`` Vector passes per output element and writes every
output once, streamed through UB on all vector cores, double-buffered: the inputs and outputs are cut
into ``steps`` equal slices (the largest slice that, double-buffered for every stream, fits 90 % of UB)
dealt to the cores in waves. Every slice is a distinct region, so every load misses L2 and every store
writes through to HBM; the waves run through :func:`cost_model.stream.stream`.

    cost_model.estimate("generic", [((4, 8), "float16")], outputs=[((4, 8), "float16")], passes=1)
    cost_model.generic_op([((4096, 4096), "float16")], [((4096, 4096), "float16")], passes=3)
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import ceil_div, itemsize
from cost_model.estimate import estimate, make, register
from cost_model.stream import port


def _model(dev, ins, outs, passes, tiling):
    streams = [(s, d, False) for s, d in ins] + [(s, d, True) for s, d in outs]
    sizes = [max(1, math.prod(s)) for s, _, _ in streams]
    if not streams:
        return 0.0, 0.0, {}, {}, None
    biggest = max(sizes)
    widest = streams[sizes.index(biggest)][1]
    per_elem = sum(2 * itemsize(d) * sz / biggest for (_, d, _), sz in zip(streams, sizes))
    chunk = int((tiling or {}).get("chunk", 0)) or max(32, int(dev.buffers["UB"] * 0.9 / per_elem) // 32 * 32)
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
    # Unlike the prefetching kernels, generic issues wave w+1's loads after wave w's stores: they take the
    # GM port in the idle interval the Vector work leaves before those stores only if they fit there.
    L = np.maximum(lb / dev.rates["GM->UB"], port(dev, 0 * miss, miss))
    S = np.maximum(sb / dev.rates["UB->GM"], stot / dev.hbm_bytes_per_cycle)
    V = float(rep)
    per_wave = np.where(L > V, L + V + S, np.maximum(V, L + S))
    instr = float(n_in + n_out + 1) * dev.scalar_issue_cycles
    core = float(np.maximum(per_wave, instr).sum())
    if L[0] <= V:                                      # overlapped: the first load and last store stick out
        core += float(L[0] + S[-1])
    busy = {"mte2": float(L.sum()), "vector": V * waves, "mte3": float(S.sum()), "scalar": instr * waves}
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
    core, hbm, nbytes, busy, t = _model(dev, ins, outs, passes, tiling)
    N = max([math.prod(s) for s, _ in outs] or [0])
    return make("generic", dev, core, hbm, nbytes, busy, t, _roofline(dev, ins, outs, passes), float(N * passes))


def generic_op(inputs, outputs, passes: int = 1, device="ascend910"):
    """Price of an op without a kernel: a generic Vector op with a GM round trip (see the module doc)."""
    return estimate("generic", inputs, device=device, outputs=[(tuple(s), d) for s, d in outputs], passes=passes)


__all__ = ["estimate_generic", "generic_op"]
