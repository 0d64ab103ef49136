"""``generic``: the price of an op with no dedicated kernel — read every input once, one Vector pass per
output element, write every output once, streamed through UB on all vector cores and double-buffered.

It moves and counts real bytes but computes nothing: callers that need the op's values compute them
elsewhere (``autofuse.simulate`` uses torch) and use this kernel for what the op costs on the device.

    npu.run("generic", *inputs, outputs=[((4, 8), "float16")], passes=1)
"""
from __future__ import annotations

import math

import numpy as np

from autofuse.npu.dtypes import itemsize
from autofuse.npu.run import kernel


@kernel("generic")
def generic(launch, *inputs, outputs=(), passes=1, tiling=None):
    dev = launch.device
    ins = [t for t in inputs if t is not None]
    outs = [launch.empty(tuple(shape), dtype, f"out{i}") for i, (shape, dtype) in enumerate(outputs)]
    streams = [(t, False) for t in ins] + [(t, True) for t in outs]
    sizes = [max(1, math.prod(t.shape)) for t, _ in streams]
    if not streams:
        launch.group("aiv", 1)
        return ()
    biggest = max(sizes)
    widest_dtype = streams[sizes.index(biggest)][0].dtype
    # elements of the largest stream per step such that every stream's tile, double-buffered, fits UB
    per_elem = sum(2 * itemsize(t.dtype) * s / biggest for (t, _), s in zip(streams, sizes))
    chunk = int((tiling or {}).get("chunk", 0)) or max(32, int(dev.buffers["UB"] * 0.9 / per_elem) // 32 * 32)
    steps = -(-biggest // chunk)
    n = min(dev.vector_cores, steps)
    g = launch.group("aiv", n)
    flat = [type(t)(t.data.reshape(-1), t.dtype, t.name) if t.data.ndim != 1 else t for t, _ in streams]
    for f, (t, _) in zip(flat, streams):
        f.id = t.id
    tiles = [[g.alloc("UB", (max(1, -(-s * chunk // biggest)),), t.dtype, f"{t.name}_{b}") for b in range(2)]
             for (t, _), s in zip(streams, sizes)]
    for w in range(-(-steps // n)):
        idx = [w * n + c if w * n + c < steps else None for c in range(n)]
        active = np.array([i is not None for i in idx])
        act = None if active.all() else active
        regions = []
        for s in sizes:
            regions.append([None if i is None else (slice(i * s // steps, (i + 1) * s // steps),) for i in idx])
        for k, ((t, is_out), f) in enumerate(zip(streams, flat)):
            if not is_out:
                g.load(tiles[k][w % 2], f, regions[k], active=act, name=f"load {t.name}")
        out_tiles = [tiles[k][w % 2] for k, (_, o) in enumerate(streams) if o]
        in_tiles = [tiles[k][w % 2] for k, (_, o) in enumerate(streams) if not o]
        g.vector("generic", writes=out_tiles, reads=in_tiles,
                 repeats=int(g.repeats(-(-biggest // steps), widest_dtype)) * passes, active=act)
        for k, ((t, is_out), f) in enumerate(zip(streams, flat)):
            if is_out:
                g.store(tiles[k][w % 2], f, regions[k], active=act, name=f"store {t.name}")
    return tuple(outs)
