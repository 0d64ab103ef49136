"""MoE Vector kernels (``autofuse/npu/kernels/moe_gating.py``, ``moe_routing.py``) in closed form.

*moe_gating_topk / topk*: lockstep tasks of ``lanes`` token rows per core (:func:`cost_model.stream.stream`).
Per task the Vector repeats are the kernel's instruction list with tokens on lanes: with
``R = ceil(lanes / 64)``, a pass over ``r`` expert rows costs ``r·R`` repeats, a reduction over them
``(r - groups)·R``; the transposes in and out cost ``ceil(16-rounded tile bytes / 512)`` (twice for 4-byte
types). A selection round is two reductions and four passes. The iota (and the bias load) run once, under
the first task's load. The model assumes no tied values (ties cost Scalar cycles the data decides).

*moe_init_routing*: phase 1 per index block (ids load, one Scalar cycle per id), the counts stored and
all cores synchronised; the column sums; phase 2 per block (ids reloaded from L2, the Scalar walk, the row
indices stored) and per token one row load and k row stores through the GM port (each row of x read once,
every store written through to HBM), as the ``gather`` model prices row copies.

*moe_finalize_routing*: per token and H chunk, k row gathers (+ the skip row), the Vector's casts and
``axpy`` passes, the cast out and the store: the busiest of MTE2, Vector, MTE3 and the port sets the pace.

*index_add*: the copy of x row by row (load + store per row), a barrier, then per index a row load, the
optional ``muls`` and an atomic-add store.
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import ceil_div, itemsize, round_up
from cost_model.devices import get_device
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.stream import block_steps, port, shares, stream
from cost_model.vecutil import block_elems, fits, largest, pad

RING = 4


# ------------------------------------------------------------------------------------------ gating / topk
def _gating_specs(E, k, lanes, dtype, out_dtype, bias, n_group):
    f32 = "float32"
    L = pad(lanes, f32)
    specs = [((lanes, pad(E, dtype)), dtype)] * 2 + [((E, L), f32)] * 4
    if bias:
        specs += [((E, 8), f32), ((E, L), f32)]
    if n_group > 1:
        specs += [((n_group, L), f32)] * 2
    specs += [((k, L), f32)] * 2
    return specs + [((lanes, pad(k, out_dtype)), out_dtype)] * 2 + [((lanes, pad(k, "int32")), "int32")] * 2


def _default_lanes(dev, T, E, k, dtype, out_dtype, bias, n_group):
    n = max(1, min(dev.vector_cores, T))
    per_core = ceil_div(T, n)
    top = largest(lambda v: fits(dev, _gating_specs(E, k, 8 * v, dtype, out_dtype, bias, n_group)), 1, 1 << 12)
    if top < 1:
        raise ValueError(f"moe_gating_topk: {E} experts do not fit UB on {dev.name}")
    return int(min(8 * top, max(8, round_up(ceil_div(per_core, 4), 8)), round_up(per_core, 8))), 8 * top


def _vnch(rows, cols, isz):
    return (1 if isz == 2 else 2) * np.ceil(round_up(rows, 16) * round_up(cols, 16) * isz / 512)


def norm_repeats(norm, E, ew):
    """(Vector repeats, instructions) of the router's normalisation over E experts (``ew(r)``: repeats of a
    pass over r expert rows): softmax is two reductions and three passes, sigmoid four passes."""
    if norm == "softmax":
        return ew(5 * E - 2), 5
    if norm == "sigmoid":
        return ew(4 * E), 4
    return 0, 0


def _gating_task(ke, E, k, dtype, out_dtype, norm, bias, ng, kg, gscore, renorm, eps, scale, largest_, gather):
    """(Vector repeats, instructions) of one task of ``ke`` lanes on the busiest core (``gather``: the chosen
    experts' unbiased scores are gathered after the selection: with a bias, or a group fill other than -inf and the
    weights the scores, not the filled choices)."""
    R = np.ceil(ke / 64)
    ew = lambda r: r * R                                    # noqa: E731
    v = _vnch(ke, E, itemsize(dtype))
    ins = 1
    if dtype != "float32":
        v, ins = v + ew(E), ins + 1
    if not largest_:
        v, ins = v + ew(E), ins + 1
    nv, ni = norm_repeats(norm, E, ew)
    v, ins = v + nv, ins + ni
    if bias:
        v, ins = v + ew(E), ins + 1

    def rounds(rows, groups, picks):
        return picks * (2 * ew(rows - groups) + 4 * ew(rows)), 6 * picks

    v, ins = v + ew(E), ins + 1                             # copy of the choices
    if ng > 1:
        if gscore == "max":
            v, ins = v + ew(E - ng), ins + 1
        else:
            rv, ri = rounds(E, ng, 2)
            v, ins = v + rv + ew(ng), ins + ri + 1
        rv, ri = rounds(ng, 1, kg)
        v, ins = v + ew(ng) + rv + ew(E), ins + 2 + ri
    rv, ri = rounds(E, 1, k)
    v, ins = v + rv, ins + ri
    v, ins = v + ew(E - 1) + ew(k), ins + 2                 # tie flags
    if gather:                                              # the unbiased scores: compare, select, sum per pick
        v, ins = v + k * (2 * ew(E) + ew(E - 1)), ins + 3 * k
    if not largest_:
        v, ins = v + ew(k), ins + 1
    if norm == "topk_softmax":                              # softmax over the chosen: sub, exp, sum, div
        v, ins = v + 3 * ew(k) + ew(k - 1), ins + 4
    if renorm:
        v, ins = v + ew(k - 1) + ew(k) + (ew(1) if eps != 0 else 0), ins + 2 + (eps != 0)
    if scale != 1:
        v, ins = v + ew(k), ins + 1
    if out_dtype != "float32":
        v, ins = v + ew(k), ins + 1
    v = v + _vnch(k, ke, itemsize(out_dtype)) + ew(k) + _vnch(k, ke, 4)
    return v, ins + 3 + 2                                   # + 3 vector, the load and two stores


def _gating_model(dev, T, E, dtype, out_dtype, k, bias_spec, norm, renorm, eps, scale, ng, kg, gscore, largest_,
                  gather, lanes):
    isz, osz = itemsize(dtype), itemsize(out_dtype)
    n = max(1, min(dev.vector_cores, T))
    worst, tot, _ = block_steps(T, n, lanes)
    vec, ins = _gating_task(worst, E, k, dtype, out_dtype, norm, bias_spec is not None, ng, kg, gscore, renorm,
                            eps, scale, largest_, gather)
    vec = np.broadcast_to(vec, worst.shape).astype(float)
    ins = np.full(worst.shape, float(ins))
    load_b = worst * E * isz
    store_b = worst * k * (osz + 4)
    core, busy = stream(dev, load_b, port(dev, 0 * tot, tot * E * isz), vec, store_b,
                        tot * k * (osz + 4) / dev.hbm_bytes_per_cycle, ins)
    # the iota (and the bias load) run before the first task's Vector work, under its load
    pro = np.ceil(round_up(lanes, 8) / 64) * E + 1
    bias_b = 0.0
    if bias_spec is not None:
        bias_b = E * itemsize(bias_spec[1])
        pro = max(pro, bias_b / dev.rates["GM->UB"] + n * 0) + (np.ceil(E * 8 / 64) if bias_spec[1] != "float32"
                                                               else 0)
    first_load = max(load_b[0] / dev.rates["GM->UB"], float(tot[0] * E * isz / dev.hbm_bytes_per_cycle))
    core += max(0.0, float(pro) - first_load)
    busy["vector"] += pro
    hbm = float(tot.sum() * E * isz + tot.sum() * k * (osz + 4)) + bias_b
    nbytes = {"GM->UB": float(tot.sum() * E * isz) + bias_b * n, "UB->GM": float(tot.sum() * k * (osz + 4))}
    return core, hbm, nbytes, busy


@cached
def _gating_search(device, T, E, dtype, out_dtype, k, bias_spec, norm, renorm, eps, scale, ng, kg, gscore,
                   largest_, gather):
    dev = get_device(device)
    default, top = _default_lanes(dev, T, E, k, dtype, out_dtype, bias_spec is not None, ng)
    n = max(1, min(dev.vector_cores, T))
    per_core = ceil_div(T, n)
    best = None
    cands = [default] + [v for v in (round_up(ceil_div(per_core, j), 8) for j in (1, 2, 8)) if v <= top]
    for lanes in dict.fromkeys(cands):
        res = _gating_model(dev, T, E, dtype, out_dtype, k, bias_spec, norm, renorm, eps, scale, ng, kg, gscore,
                            largest_, gather, lanes)
        if best is None or kernel_cycles(dev, *res[:3]) < kernel_cycles(dev, *best[0][:3]):
            best = (res, lanes)
    return best


def _gating_estimate(name, dev, x, bias, k, norm, renorm, eps, scale, ng, kg, gscore, out_dtype, largest_, tiling,
                     group_fill=None, weights_from="scores"):
    shape, dtype = x
    E = shape[-1]
    T = math.prod(shape[:-1])
    out_dtype = out_dtype or dtype
    if not 1 <= k <= E:
        raise ValueError(f"{name}: k={k} must be in [1, {E}]")
    args = (T, E, dtype, out_dtype, int(k), bias, norm, bool(renorm), float(eps), float(scale), int(ng), int(kg),
            gscore, bool(largest_),
            bias is not None or (int(ng) > 1 and group_fill is not None and weights_from == "scores"))
    if T == 0:
        return make(name, dev, 0.0, 0.0, {}, {}, None, 0.0)
    if tiling:
        lanes = int(tiling["lanes"])
        res = _gating_model(dev, *args, lanes)
    else:
        res, lanes = _gating_search(dev.name, *args)
    io = T * E * itemsize(dtype) + T * k * (itemsize(out_dtype) + 4)
    return make(name, dev, *res, {"lanes": lanes}, io / dev.hbm_bytes_per_cycle, 0.0)


def _gating_roof(dev, specs, **p):
    (shape, dtype) = specs[0]
    k = int(p.get("k", 1))
    T = math.prod(shape[:-1])
    return (T * shape[-1] * itemsize(dtype) + T * k * 8) / dev.hbm_bytes_per_cycle


@register("moe_gating_topk", _gating_roof)
def estimate_moe_gating_topk(dev, specs, bias=None, k=1, norm="softmax", renorm=False, eps=1e-20,
                             routed_scaling_factor=1.0, n_group=1, topk_group=1, group_score="max",
                             out_dtype="float32", tiling=None, group_fill=None, weights_from="scores"):
    bias = specs[1] if len(specs) > 1 and specs[1] is not None else bias
    return _gating_estimate("moe_gating_topk", dev, specs[0], bias, k, norm, renorm, eps, routed_scaling_factor,
                            n_group, topk_group, group_score, out_dtype, True, tiling, group_fill, weights_from)


@register("topk", _gating_roof)
def estimate_topk(dev, specs, k=1, largest=True, tiling=None):
    return _gating_estimate("topk", dev, specs[0], None, k, "none", False, 0.0, 1.0, 1, 1, "max", None, largest,
                            tiling)


# ------------------------------------------------------------------------------------------ row copies
def _row_time(dev, row_b, n, loads, stores, miss=1.0, vec=0.0, instr=0):
    """Cycles of one lockstep token: ``loads`` row loads and ``stores`` row stores of ``row_b`` bytes per core
    (n cores in lockstep, a fraction ``miss`` of the loads from HBM), ``vec`` Vector repeats: the busiest of
    MTE2, MTE3, the Vector unit and the GM port that carries every transfer."""
    p_load = port(dev, n * row_b * (1 - miss), n * row_b * miss)
    p_store = n * row_b / dev.hbm_bytes_per_cycle
    load = max(row_b / dev.rates["GM->UB"], float(p_load))
    store = max(row_b / dev.rates["UB->GM"], p_store)
    return max(loads * load, stores * store, loads * float(p_load) + stores * p_store, vec,
               (loads + stores + instr) * dev.scalar_issue_cycles), load, store


def _waves(total, n):
    """Lockstep steps of ``total`` rows dealt evenly over ``n`` cores: ``[(steps, active cores)]``."""
    return [(q - lower, sum(c for qq, c in shares(total, n) if qq >= q))
            for q, lower in zip([q for q, _ in shares(total, n)],
                                [q for q, _ in shares(total, n)][1:] + [0])]


def _rows_cost(dev, total, n, row_b, loads, stores, miss=1.0, vec=0.0, instr=0):
    """(cycles, MTE2 busy, MTE3 busy) of ``total`` rows dealt over ``n`` cores, a :func:`_row_time` each."""
    cyc = l_ = s_ = 0.0
    for steps, active in _waves(total, n):
        t, load, store = _row_time(dev, row_b, active, loads, stores, miss, vec, instr)
        cyc += steps * t
        l_ += steps * loads * load
        s_ += steps * stores * store
    return cyc, l_, s_


def _row_chunks(dev, H, dtype, fixed):
    cblk = block_elems(dtype)
    spec = lambda h: list(fixed) + [((1, round_up(h, cblk)), dtype)] * RING      # noqa: E731
    if fits(dev, spec(H)):
        return H
    return cblk * largest(lambda v: fits(dev, spec(v * cblk)), 1, ceil_div(H, cblk))


@register("moe_init_routing", lambda dev, specs, **p: 3 * math.prod(specs[0][0]) * itemsize(specs[0][1])
          / dev.hbm_bytes_per_cycle)
def estimate_moe_init_routing(dev, specs, num_experts=None, group_list_type="count", tiling=None):
    (T, H), dtype = specs[0]
    (_, k) = specs[1][0]
    E = int(num_experts) if num_experts is not None else 1
    isz = itemsize(dtype)
    if T * k == 0:
        return make("moe_init_routing", dev, 0.0, 0.0, {}, {}, None, 0.0)
    n = min(dev.vector_cores, T)
    most = ceil_div(T, n) * k
    block = int((tiling or {}).get("block", 0)) or min(most, 2048)
    block = max(k, block // k * k)
    fixed = [((pad(block, "int32"),), "int32")] * 2 + [((pad(E, "int32"),), "int32")] * 2 + \
        [((n, pad(E, "int32")), "int32")]
    hc = min(int((tiling or {}).get("cols", 0)) or _row_chunks(dev, H, dtype, fixed), H)
    nch = ceil_div(H, hc)
    sc = dev.scalar_issue_cycles
    ids_b = block * 4
    nblk = ceil_div(most, block)
    idl = max(ids_b / dev.rates["GM->UB"], n * ids_b / dev.hbm_bytes_per_cycle)
    # phase 1: ids loads (HBM) and the Scalar count, overlapped block by block; counts stored
    p1 = idl + nblk * max(idl, most / nblk * sc) + E * 4 / dev.rates["UB->GM"] + n * E * 4 / dev.hbm_bytes_per_cycle
    # phase 2: the counts (L2), the column sums, the prefix; per block the ids again (L2), walk, store
    p2 = n * E * 4 / dev.l2_bytes_per_cycle + max(n * E * 4 / dev.rates["GM->UB"], 0) \
        + 2 * max(n - 1, 1) * ceil_div(E, 64) + E * sc
    rows, l_, s_ = _rows_cost(dev, T, n, hc * isz, 1, k)
    rows *= nch
    _, load, store = _row_time(dev, hc * isz, n, 1, k)
    walk = ids_b / dev.rates["GM->UB"] + most / nblk * sc
    rows += load + store
    core = p1 + p2 + nblk * walk + rows
    hbm = T * k * 4 + T * H * isz + T * k * H * isz + T * k * 4 + E * 4 + n * E * 4
    nbytes = {"GM->UB": 2 * T * k * 4 + n * n * E * 4 + T * H * isz,
              "UB->GM": n * E * 4 + T * k * 4 + E * 4 + T * k * H * isz}
    busy = {"mte2": nch * l_, "mte3": nch * s_, "scalar": 2 * most * sc}
    return make("moe_init_routing", dev, core, hbm, nbytes, busy, {"block": block, "cols": hc},
                3 * T * H * isz / dev.hbm_bytes_per_cycle)


def _finalize_specs(k, block, hc, dtype, sd):
    f32 = "float32"
    s = [((pad(block * k, "int32"),), "int32")] * 2 + [((block, pad(k, f32)), f32)] * 2
    s += [((1, pad(hc, f32)), f32)] * 2 + [((1, pad(hc, dtype)), dtype)] * 2
    if sd is not None:
        s += [((1, pad(hc, sd)), sd)] * 2
    return s


@register("moe_finalize_routing", lambda dev, specs, **p: (math.prod(specs[0][0]) + 2 * math.prod(specs[1][0])
                                                           * specs[0][0][1]) * itemsize(specs[0][1])
          / specs[1][0][1] / dev.hbm_bytes_per_cycle)
def estimate_moe_finalize_routing(dev, specs, skip=None, tiling=None):
    (R, H), dtype = specs[0]
    (T, k), sdt = specs[1]
    skip = specs[3] if len(specs) > 3 and specs[3] is not None else skip
    sd = None if skip is None else skip[1]
    isz = itemsize(dtype)
    if T * H == 0:
        return make("moe_finalize_routing", dev, 0.0, 0.0, {}, {}, None, 0.0)
    block = int((tiling or {}).get("block", 0)) or 64
    cblk = max(block_elems(dtype), 8)
    ok = lambda h: fits(dev, _finalize_specs(k, block, h, dtype, sd) + [((1, round_up(h, cblk)), dtype)] * RING)  # noqa
    hc = min(int((tiling or {}).get("cols", 0)) or
             (H if ok(H) else cblk * largest(lambda v: ok(v * cblk), 1, ceil_div(H, cblk))), H)
    n = min(dev.vector_cores, T)
    ntok = ceil_div(T, n)
    lowp = dtype != "float32"
    core = 0.0
    busy = {"mte2": 0.0, "mte3": 0.0, "vector": 0.0}
    for c0 in range(0, H, hc):
        he = min(hc, H - c0)
        rep = ceil_div(he, 64)
        vec = rep * ((2 * k if lowp else k) + 1 + (1 if sd is not None else 0))
        nl = k + (1 if sd is not None else 0)
        t, l_, s_ = _rows_cost(dev, T, n, he * isz, nl, 1, vec=vec, instr=k + 3)
        core += t
        busy["mte2"] += l_
        busy["mte3"] += s_
        busy["vector"] += ntok * vec
    nblk = ceil_div(ntok, block)
    idx_b = block * k * 4 + block * k * itemsize(sdt)
    core += nblk * max(idx_b / dev.rates["GM->UB"], n * idx_b / dev.hbm_bytes_per_cycle)
    sk = 0 if sd is None else T * H * itemsize(sd)
    hbm = T * k * H * isz + T * k * (4 + itemsize(sdt)) + sk + T * H * isz
    nbytes = {"GM->UB": T * k * H * isz + T * k * (4 + itemsize(sdt)) + sk, "UB->GM": T * H * isz}
    return make("moe_finalize_routing", dev, core, hbm, nbytes, busy, {"block": block, "cols": hc},
                (T * k * H * isz + T * H * isz + sk) / dev.hbm_bytes_per_cycle)


@register("index_add", lambda dev, specs, **p: (2 * math.prod(specs[0][0]) + 2 * math.prod(specs[2][0]))
          * itemsize(specs[0][1]) / dev.hbm_bytes_per_cycle)
def estimate_index_add(dev, specs, alpha=1.0, tiling=None):
    xs, dtype = specs[0]
    N = math.prod(specs[1][0])
    ib = itemsize(specs[1][1])
    V = xs[0]
    H = math.prod(xs[1:])
    isz = itemsize(dtype)
    if V * H == 0:
        return make("index_add", dev, 0.0, 0.0, {}, {}, None, 0.0)
    block = int((tiling or {}).get("block", 0)) or 64
    hc = min(int((tiling or {}).get("cols", 0)) or
             _row_chunks(dev, H, dtype, [((pad(block, specs[1][1]),), specs[1][1])] * 2), H)
    n = min(dev.vector_cores, max(V, N))
    core = 0.0
    busy = {"mte2": 0.0, "mte3": 0.0, "vector": 0.0}
    for c0 in range(0, H, hc):
        he = min(hc, H - c0)
        t1, l1, s1 = _rows_cost(dev, V, n, he * isz, 1, 1)
        rep = ceil_div(he * isz, 256) if alpha != 1 else 0
        # src rows are distinct; the atomic adds' targets may repeat but each is written through
        t2, l2, s2 = _rows_cost(dev, N, n, he * isz, 1, 1, vec=rep) if N else (0.0, 0.0, 0.0)
        core += t1 + t2
        busy["mte2"] += l1 + l2
        busy["mte3"] += s1 + s2
    if N:
        core += ceil_div(ceil_div(N, n), block) * max(block * ib / dev.rates["GM->UB"],
                                                      min(n, N) * block * ib / dev.hbm_bytes_per_cycle)
    hbm = 2 * V * H * isz + 2 * N * H * isz + N * ib
    nbytes = {"GM->UB": V * H * isz + N * H * isz + N * ib, "UB->GM": V * H * isz + N * H * isz}
    return make("index_add", dev, core, hbm, nbytes, busy, {"block": block, "cols": hc},
                (2 * V * H + 2 * N * H) * isz / dev.hbm_bytes_per_cycle)


__all__ = ["estimate_moe_gating_topk", "estimate_topk", "estimate_moe_init_routing",
           "estimate_moe_finalize_routing", "estimate_index_add"]
