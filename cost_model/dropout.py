"""The dropout keep-mask generator (``autofuse/npu/kernels/dropout.py``): Philox on the Vector unit, bits out.

The rows are split evenly over the vector cores (as many as there are rows), ``rows`` rows per task,
through :func:`cost_model.stream.stream`. Per task: nothing loaded; the Philox passes and the compare over
the row's int32-padded width (``PHILOX_PASSES`` passes of 64 int32 lanes per element, the kernel's model of
the generator); the bit tile's store (``ceil(cols / 8)`` bytes a row), each an HBM write.
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import ceil_div
from cost_model.devices import get_device
from cost_model.estimate import cached, make, register
from cost_model.stream import block_steps, port, stream
from cost_model.vecutil import fits, largest, pad

PHILOX_PASSES = 41             # restated from the kernel (the cost model imports no simulator code; tests pin it)
STATE_WORDS = 4


def _specs(R, cols):
    return [((R, pad(cols, "int32")), "int32")] * STATE_WORDS + [((R, pad(ceil_div(cols, 8), "uint8")), "uint8")] * 2


def _rows(dev, cols, per_core):
    r = largest(lambda r: fits(dev, _specs(r, cols)), 1, max(1, per_core))
    if r < 1:
        raise ValueError(f"dropout_gen_mask: not one row of {cols} elements fits UB on {dev.name}")
    return max(1, min(r, ceil_div(per_core, 4)))


@cached
def _model(device, rows, cols, R):
    dev = get_device(device)
    n = max(1, min(dev.vector_cores, rows))
    cb = ceil_div(cols, 8)
    per = dev.vector_bytes_per_cycle // 4                      # int32 lanes per Vector repeat
    re, tot, _ = block_steps(rows, n, R)
    vec = np.ceil(re * pad(cols, "int32") / per) * PHILOX_PASSES
    sb, stot = re * cb, tot * cb
    core, busy = stream(dev, np.zeros(len(re)), port(dev, 0.0, np.zeros(len(re))), vec, sb,
                        stot / dev.hbm_bytes_per_cycle, np.full(len(re), 3.0))
    hbm = float(stot.sum())
    return core, hbm, {"UB->GM": hbm}, busy


def _roof(dev, specs, shape=(), **_):
    shape = tuple(shape)
    out = math.prod(shape[:-1]) * ceil_div(shape[-1], 8) if shape else 0
    vec = math.prod(shape) * PHILOX_PASSES / (dev.vector_bytes_per_cycle // 4) / dev.vector_cores
    return max(out / dev.hbm_bytes_per_cycle, vec)


@register("dropout_gen_mask", _roof)
def estimate_dropout_gen_mask(dev, specs, shape=(), keep_prob=1.0, tiling=None):
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("dropout_gen_mask: a shape with at least one dim is needed")
    cols, rows = shape[-1], math.prod(shape[:-1])
    n = max(1, min(dev.vector_cores, rows))
    R = int(tiling["rows"]) if tiling else _rows(dev, cols, ceil_div(rows, n))
    if rows == 0 or cols == 0:
        return make("dropout_gen_mask", dev, 0.0, 0.0, {}, {}, {"rows": R}, 0.0)
    core, hbm, nbytes, busy = _model(dev.name, rows, cols, R)
    return make("dropout_gen_mask", dev, core, hbm, nbytes, busy, {"rows": R}, _roof(dev, specs, shape))


__all__ = ["estimate_dropout_gen_mask"]
