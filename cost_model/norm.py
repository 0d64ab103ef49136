"""Row norms (``autofuse/npu/kernels/norm.py``): layer_norm, rms_norm, add_rms_norm.

Rows are split evenly over the vector cores, ``rows`` rows per task; rows longer than UB are chunked
(``chunk`` < H) into a statistics pass and a normalising pass, backwards: the last chunk is still in UB,
the other reloads hit L2 while the step's rows fit. Per task the Vector passes are the kernel's (see its
docstring): casts, ``x*x`` or the mean and squared deviations with their reductions and Brcb, the small
rstd passes, the normalisation, weight and bias, the cast out; MTE3 stores y, the fp32 statistics and
(add_rms) the sum. Weight and bias are loaded once per core (every core reads the same region: one miss,
the rest L2 hits) or, chunked, per chunk. The tasks run through :func:`cost_model.stream.stream`.
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import ceil_div, itemsize
from cost_model.devices import ITEMSIZE, get_device
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.stream import block_steps, port, stream
from cost_model.vecutil import fits, largest, pad

STAT = 8
F32 = "float32"


def _specs(kind, dtype, wdt, has_w, has_b, R, cc, H, tight=False):
    """The kernel's UB tiles (its ``_specs``): ``tight`` whole rows write the outputs over dead inputs."""
    cp = pad(cc, "float16")
    tile = (R, cp)
    sp = [(tile, dtype)] * 2
    if kind == "add_rms":
        sp += [(tile, dtype)] * (2 if tight else 4)
    if dtype != F32:
        sp.append((tile, F32))
    sp.append((tile, F32))
    nbuf = 1 if cc >= H else 2
    shared = tight and has_w and has_b and wdt[0] == wdt[1]
    for j, (present, dt) in enumerate(((has_w, wdt[0]), (has_b, wdt[1]))):
        if present:
            sp += [((1, cp), F32)] * nbuf
            if dt != F32 and not (shared and j == 1):
                sp += [((1, cp), dt)] * nbuf
    if not tight:
        sp += [(tile, dtype)] * 2
    return sp + [((R, STAT), F32)] * 10


def _layout(dev, kind, dtype, wdt, has_w, has_b, H):
    """The kernel's ``layout``: whole rows use the tight tiles when they fit UB only that way."""
    tight = not fits(dev, _specs(kind, dtype, wdt, has_w, has_b, 1, H, H)) and \
        fits(dev, _specs(kind, dtype, wdt, has_w, has_b, 1, H, H, True))
    return (lambda r, c: _specs(kind, dtype, wdt, has_w, has_b, r, c, H, tight and c >= H)), tight


def _model(dev, kind, dtype, rows, H, wdt, has_w, has_b, return_stats, R, cc):
    isz = itemsize(dtype)
    n = min(dev.vector_cores, rows)
    lowp = dtype != F32
    nch = ceil_div(H, cc)
    re, tot, act = block_steps(rows, n, R)
    S = len(re)
    HBM = dev.hbm_bytes_per_cycle
    small = np.ceil(re * STAT / 64)
    brcb = np.ceil(re / 8)
    stat_outs = (1 if kind != "layer" or return_stats else 0) + (1 if kind == "layer" and return_stats else 0)
    pbytes = [itemsize(dt) for present, dt in ((has_w, wdt[0]), (has_b, wdt[1])) if present]
    pcasts = sum(1 for present, dt in ((has_w, wdt[0]), (has_b, wdt[1])) if present and dt != F32)
    nparams = len(pbytes)
    cols = {k: [] for k in ("lb", "hit", "miss", "vec", "sb", "stot", "instr")}

    def add(lb, hit, miss, vec, sb, stot, instr):
        """One task per step: each figure a number or an array over the steps."""
        for k, v in zip(cols, (lb, hit, miss, vec, sb, stot, instr)):
            cols[k].append(v)

    step_bytes = tot * H * isz
    for k in range(nch):                                    # pass 1 (the only pass when nch == 1)
        cv = min(cc, H - k * cc)
        ew = np.ceil(re * pad(cv, "float16") / 64)
        row = re * ceil_div(cv, 64)
        vec, instr = 0.0, 0
        loads = 2 if kind == "add_rms" else 1
        lb, miss = loads * re * cv * isz, loads * tot * cv * isz
        sb, stot = 0.0, 0.0
        if kind == "add_rms":
            if dtype != "bfloat16":
                vec += np.ceil(re * pad(cv, "float16") / (256 // isz))
                instr += 1
            else:
                vec += 4 * ew
                instr += 4
            sb, stot = sb + re * cv * isz, stot + tot * cv * isz
            instr += 1
        if lowp:
            vec, instr = vec + ew, instr + 1
        if kind in ("rms", "add_rms"):
            vec += ew + row + brcb + (small if k else 0)
            instr += 3 + (1 if k else 0)
        else:
            vec += row + brcb + small + row + ew + row + brcb + (6 * small if k else 0)
            instr += 7 + (6 if k else 0)
        if k == nch - 1:
            vec, instr = vec + 3 * small, instr + 3
        if nch == 1:                                        # normalise at once
            vec += row * (1 + nparams) + ew
            instr += 2 + nparams
            sb, stot = sb + re * cv * isz + stat_outs * re * 4, stot + tot * cv * isz + stat_outs * tot * 4
            instr += 1 + stat_outs
        add(lb, 0.0, miss, vec, sb, stot, instr + loads)
    if nch > 1:
        for k in reversed(range(nch)):                      # pass 2, backwards: reload (L2), weights per chunk
            cv = min(cc, H - k * cc)
            ew = np.ceil(re * pad(cv, "float16") / 64)
            row = re * ceil_div(cv, 64)
            resident = step_bytes * (2 if kind == "add_rms" else 1) + tot * k * cc * isz <= dev.l2_bytes
            kept = k == nch - 1                             # the last chunk of pass 1, still in UB
            b = 0.0 if kept else tot * cv * isz
            # weight chunks: every core reads the same region; the first pass over a chunk misses
            p_b = sum(pbytes) * cv
            first = 1.0 if S == 1 else np.where(np.arange(S) == 0, 1.0, 0.0)
            p_hit = p_b * (act - first)
            p_miss = p_b * first
            hit = np.where(resident, b, 0.0) + p_hit
            miss = np.where(resident, 0.0, b) + p_miss
            vec = (ew if lowp else 0) + (row if kind == "layer" else 0) + row + row * nparams + ew \
                + pcasts * ceil_div(pad(cv, "float16"), 64)
            instr = (1 if lowp else 0) + (1 if kind == "layer" else 0) + 2 + nparams + pcasts
            sb = re * cv * isz + (stat_outs * re * 4 if k == nch - 1 else 0)
            stot = tot * cv * isz + (stat_outs * tot * 4 if k == nch - 1 else 0)
            add((0 if kept else re * cv * isz) + p_b, hit, miss, vec, sb, stot,
                instr + (1 if kept else 2) + nparams + (stat_outs if k == nch - 1 else 0))
    arr = {}
    for k, v in cols.items():                               # [steps, tasks], step-major
        a = np.empty((S, len(v)))
        for j, x in enumerate(v):
            a[:, j] = x
        arr[k] = a.reshape(-1)
    core, busy = stream(dev, arr["lb"], port(dev, arr["hit"], arr["miss"]), arr["vec"], arr["sb"],
                        arr["stot"] / HBM, arr["instr"])
    hbm = arr["miss"].sum() + arr["stot"].sum()
    gm_ub = arr["hit"].sum() + arr["miss"].sum()
    if nch == 1 and nparams:                                # weights once per core, before the first task
        p_b = sum(pbytes) * H
        pt = max(p_b / dev.rates["GM->UB"], port(dev, p_b * (n - 1), p_b))
        core += float(pt)
        hbm += p_b
        gm_ub += p_b * n
        busy["mte2"] += float(pt)
    return core, float(hbm), {"GM->UB": float(gm_ub), "UB->GM": float(arr["stot"].sum())}, busy


def _ub_fits(dev, kind, dtype, wdt, has_w, has_b, H, tight):
    """``ok(R, cc)``: whether :func:`_layout`'s tiles for ``R`` rows and chunks of ``cc`` fit UB, summed as
    :func:`cost_model.vecutil.fits` sums them (each tile at the UB alignment), for the tile searches' many probes:
    each chunk's tiles are listed once, their rows left open (whether they scale with R, their bytes a row)."""
    align, cap = dev.align["UB"], dev.buffers["UB"]
    layouts = {}

    def ok(R, cc):
        tiles = layouts.get(cc)
        if tiles is None:
            tiles = layouts[cc] = [(rows == "R", cols * ITEMSIZE[dt]) for (rows, cols), dt in
                                   _specs(kind, dtype, wdt, has_w, has_b, "R", cc, H, tight and cc >= H)]
        used = 0
        for scales, row_bytes in tiles:
            used = -(-used // align) * align + (R if scales else 1) * row_bytes
        return used <= cap
    return ok


def _candidates(dev, ok, H, per_core):
    step = 64
    if ok(1, H):
        ccs = [H]
    else:
        top = step * largest(lambda k: ok(1, k * step), 1, ceil_div(H, step))
        if top < 1:
            raise ValueError(f"norm: not even one row chunk of {step} values fits UB on {dev.name}")
        ccs = [top]
    out = []
    for cc in ccs:
        rmax = largest(lambda r: ok(r, cc), 1, per_core)
        for j in (1, 2, 4):
            r = max(1, min(rmax, ceil_div(per_core, j)))
            if {"rows": r, "chunk": cc} not in out:
                out.append({"rows": r, "chunk": cc})
    return out


@cached
def _search(device, kind, dtype, rows, H, wdt, has_w, has_b, return_stats):
    dev = get_device(device)
    n = min(dev.vector_cores, rows)
    _, tight = _layout(dev, kind, dtype, wdt, has_w, has_b, H)
    best = None
    for t in _candidates(dev, _ub_fits(dev, kind, dtype, wdt, has_w, has_b, H, tight), H, ceil_div(rows, n)):
        res = _model(dev, kind, dtype, rows, H, wdt, has_w, has_b, return_stats, t["rows"], t["chunk"])
        cost = kernel_cycles(dev, *res[:3])
        if best is None or cost < best[0]:
            best = (cost, t, res)
    return best[1], best[2]


def _estimate(kernel, kind, dev, x, residual, weight, bias, return_stats, tiling):
    shape, dtype = x
    H = shape[-1]
    rows = math.prod(shape[:-1])
    has_w, has_b = weight is not None, bias is not None
    wdt = (weight[1] if has_w else F32, bias[1] if has_b else F32)
    if tiling is None:
        t, res = _search(dev.name, kind, dtype, rows, H, wdt, has_w, has_b, bool(return_stats))
    else:
        t = {"rows": int(tiling.get("rows", 1)), "chunk": min(int(tiling.get("chunk", H)), H)}
        res = _model(dev, kind, dtype, rows, H, wdt, has_w, has_b, bool(return_stats), t["rows"], t["chunk"])
    core, hbm, nbytes, busy = res
    N = rows * H
    return make(kernel, dev, core, hbm, nbytes, busy, dict(t), _roof(dev, kind, x, has_w, has_b), 8.0 * N)


def _roof(dev, kind, x, has_w, has_b):
    shape, dtype = x
    N = math.prod(shape)
    io = N * itemsize(dtype) * (4 if kind == "add_rms" else 2)
    vec = N * 6 / (dev.vector_bytes_per_cycle / 4) / dev.vector_cores
    return max(vec, io / dev.hbm_bytes_per_cycle)


def _pos(specs, names, params):
    """Positional input specs and keyword tensor parameters, by name."""
    out = dict(zip(names, specs))
    for k in names:
        if params.get(k) is not None:
            out[k] = params[k]
    return [out.get(k) for k in names]


@register("layer_norm", lambda dev, specs, **p: _roof(dev, "layer", specs[0], True, True))
def estimate_layer_norm(dev, specs, weight=None, bias=None, eps=1e-5, tiling=None, return_stats=False):
    x, w, b = _pos(specs, ("x", "weight", "bias"), {"weight": weight, "bias": bias})
    return _estimate("layer_norm", "layer", dev, x, None, w, b, return_stats, tiling)


@register("rms_norm", lambda dev, specs, **p: _roof(dev, "rms", specs[0], True, False))
def estimate_rms_norm(dev, specs, weight=None, eps=1e-6, tiling=None):
    x, w = _pos(specs, ("x", "weight"), {"weight": weight})
    return _estimate("rms_norm", "rms", dev, x, None, w, None, False, tiling)


@register("add_rms_norm", lambda dev, specs, **p: _roof(dev, "add_rms", specs[0], True, False))
def estimate_add_rms_norm(dev, specs, residual=None, weight=None, eps=1e-6, tiling=None):
    x, r, w = _pos(specs, ("x", "residual", "weight"), {"residual": residual, "weight": weight})
    return _estimate("add_rms_norm", "add_rms", dev, x, r, w, None, False, tiling)


__all__ = ["estimate_add_rms_norm", "estimate_layer_norm", "estimate_rms_norm"]
