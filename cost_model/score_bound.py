"""The attention score bound (``autofuse/npu/kernels/score_bound.py``): max squared row norm of q and of k; and the
bias bound (``bias_bound`` in the same kernel module): max |x| of an additive mask, the same passes over one tensor.

The rows of q, then of k, are split evenly over the vector cores (as many cores as the longer tensor has
rows), ``rows`` rows per task, through :func:`cost_model.stream.stream`. Per task: one load of the rows
(HBM misses: q and k are read once), the Vector passes cast (fp16/bf16), ``x*x``, a per-row reduce sum and
a small running max (a copy on a tensor's first task); after a tensor's last task a reduce max over the
tile's rows and a 32 B store per core.
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import ceil_div, itemsize
from cost_model.estimate import cached, make, register
from cost_model.devices import get_device
from cost_model.stream import block_steps, port, stream
from cost_model.vecutil import pad, score_bound_cores, score_bound_rows

F32 = "float32"
BLOCK = 8


@cached
def _model(device, dtype, rq, rk, D, R):
    dev = get_device(device)
    isz = itemsize(dtype)
    n = score_bound_cores(dev, max(rq, rk))
    dp = pad(D, "float16")
    per = dev.vector_bytes_per_cycle // 4                   # fp32 values per Vector repeat
    cols = {k: [] for k in ("lb", "miss", "vec", "sb", "stot", "instr")}
    for rows in (rq, rk):
        if rows == 0:
            continue
        re, tot, act = block_steps(rows, n, R)
        ew = np.ceil(re * dp / per)
        vec = ew * (2 if dtype != F32 else 1) + re * ceil_div(D, per) + np.ceil(re / per)
        instr = np.full(len(re), 5.0 if dtype != F32 else 4.0)
        last = np.zeros(len(re))
        last[-1] = 1.0
        vec = vec + last * ceil_div(R, per)
        instr = instr + last * 2
        for k, v in zip(cols, (re * D * isz, tot * D * isz, vec, last * BLOCK * 4, last * act * BLOCK * 4, instr)):
            cols[k].append(v)
    arr = {k: np.concatenate(v) for k, v in cols.items()}
    core, busy = stream(dev, arr["lb"], port(dev, 0.0, arr["miss"]), arr["vec"], arr["sb"],
                        arr["stot"] / dev.hbm_bytes_per_cycle, arr["instr"])
    hbm = float(arr["miss"].sum() + arr["stot"].sum())
    return core, hbm, {"GM->UB": float(arr["miss"].sum()), "UB->GM": float(arr["stot"].sum())}, busy


def _roof(dev, specs, **_):
    (qs, dtype), (ks, _) = specs[:2]
    io = (math.prod(qs) + math.prod(ks)) * itemsize(dtype)
    return io / dev.hbm_bytes_per_cycle


@register("score_bound", _roof)
def estimate_score_bound(dev, specs, tiling=None):
    (qs, dtype), (ks, _) = specs[:2]
    D = qs[-1]
    rq, rk = math.prod(qs[:-1]), math.prod(ks[:-1])
    n = score_bound_cores(dev, max(rq, rk))
    R = int(tiling["rows"]) if tiling else score_bound_rows(dev, dtype, D, ceil_div(max(rq, rk), n))
    core, hbm, nbytes, busy = _model(dev.name, dtype, rq, rk, D, R)
    flops = 2.0 * (rq + rk) * D
    return make("score_bound", dev, core, hbm, nbytes, busy, {"rows": R}, _roof(dev, specs), flops)


def _roof_bias(dev, specs, **_):
    xs, dtype = specs[0]
    return math.prod(xs) * itemsize(dtype) / dev.hbm_bytes_per_cycle


@register("bias_bound", _roof_bias)
def estimate_bias_bound(dev, specs, tiling=None):
    """The bias bound: the rows of x (its last dim a row) through the score bound's schedule, one tensor (``abs``
    for ``x*x`` and a reduce max for the reduce sum: the same pass counts)."""
    xs, dtype = specs[0]
    D = xs[-1]
    rows = math.prod(xs[:-1])
    n = score_bound_cores(dev, rows)
    R = int(tiling["rows"]) if tiling else score_bound_rows(dev, dtype, D, ceil_div(rows, n))
    core, hbm, nbytes, busy = _model(dev.name, dtype, rows, 0, D, R)
    return make("bias_bound", dev, core, hbm, nbytes, busy, {"rows": R}, _roof_bias(dev, specs), 2.0 * rows * D)


__all__ = ["estimate_bias_bound", "estimate_score_bound"]
