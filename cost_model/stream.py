"""The double-buffered task stream every Vector kernel runs, in closed form.

A Vector kernel (``autofuse/npu/kernels/tiles.py``) splits its work evenly over ``n`` vector cores and
walks each core's share in lockstep *tasks*: MTE2 loads task i+1 while the Vector unit works on task i
and MTE3 stores task i-1. Per task (numpy arrays over tasks, the busiest core's figures):

* ``load``: MTE2 cycles ``max(bytes / rate, port)`` where ``port`` is the wave's GM-port time (its L2 hits
  over the L2 bandwidth plus its misses over the HBM bandwidth, shared by the cores in lockstep);
* ``vec``: Vector repeats (one cycle each), ``instr``: instructions (one Scalar issue cycle each);
* ``store``: MTE3 ``max(bytes / rate, port)``, the write-through to HBM.

The stream lasts ``load[0] + sum_i max(vec_i, load_{i+1}, store_{i-1}, port_{i+1} + port_{i-1}) +
store[-1]``: the first load and the last store are exposed, in between the busiest of the overlapping
units sets the pace, and loads and stores share each core's single GM port — never less than the port
time of all the stream's transfers, which that port carries one at a time.
"""
from __future__ import annotations

import numpy as np

from cost_model.common import ceil_div


def shares(total: int, n: int):
    """Even contiguous shares of ``total`` units over ``n`` cores: ``[(size, cores with that size)]``."""
    base, rem = divmod(total, n)
    out = []
    if rem:
        out.append((base + 1, rem))
    if base and n - rem:
        out.append((base, n - rem))
    return out


def block_steps(total: int, n: int, block: int):
    """Per lockstep step: (busiest core's extent, summed extent over cores, active cores).

    Each core's share is cut into blocks of ``block`` units (the last one shorter).
    """
    classes = shares(total, n)
    steps = max(ceil_div(q, block) for q, _ in classes)
    if steps <= 32:               # a few steps: the same integer counts in plain Python (no numpy per call)
        worst, tot, act = [0] * steps, [0] * steps, [0] * steps
        for q, cnt in classes:
            for i in range(steps):
                ext = min(max(q - i * block, 0), block)
                worst[i] = max(worst[i], ext)
                tot[i] += ext * cnt
                act[i] += (ext > 0) * cnt
        return np.array(worst, dtype=float), np.array(tot, dtype=float), np.array(act, dtype=float)
    s = np.arange(steps)
    worst = np.zeros(steps)
    tot = np.zeros(steps)
    act = np.zeros(steps)
    for q, cnt in classes:
        ext = np.clip(q - s * block, 0, block)
        worst = np.maximum(worst, ext)
        tot += ext * cnt
        act += (ext > 0) * cnt
    return worst, tot, act


def port(dev, hit_bytes, miss_bytes):
    """GM-port cycles of a lockstep transfer (every core that hits waits for the wave's hits, every core that
    misses for the wave's misses)."""
    hit_bytes = np.asarray(hit_bytes, dtype=float)
    miss_bytes = np.asarray(miss_bytes, dtype=float)
    return (np.where(hit_bytes > 0, hit_bytes / dev.l2_bytes_per_cycle, 0.0)
            + np.where(miss_bytes > 0, miss_bytes / dev.hbm_bytes_per_cycle, 0.0))


def stream(dev, load_bytes, load_port, vec, store_bytes, store_port, instr, load_rate=None, store_rate=None):
    """Cycles of the double-buffered task stream and the busy cycles per unit (see the module docstring).

    1-D arrays: one stream (the busiest core's). 2-D arrays ``[cores, tasks]``: one stream per core; the
    launch lasts as long as the slowest, and each unit's busy cycles are its busiest core's (as the
    simulator reports them).
    """
    lr = load_rate or dev.rates["GM->UB"]
    sr = store_rate or dev.rates["UB->GM"]
    n = load_bytes.shape[-1] if isinstance(load_bytes, np.ndarray) and load_bytes.ndim == 1 else 8
    if n < 8 and all(isinstance(a, np.ndarray) and a.shape == (n,)
                     for a in (load_port, vec, store_bytes, store_port, instr)):
        return _short(dev, load_bytes, load_port, vec, store_bytes, store_port, instr, lr, sr)
    lp = np.asarray(load_port, dtype=float)
    sp = np.asarray(store_port, dtype=float)
    load = np.maximum(np.asarray(load_bytes, float) / lr, lp)
    store = np.maximum(np.asarray(store_bytes, float) / sr, sp)
    vec = np.asarray(vec, dtype=float)
    instr = np.asarray(instr, dtype=float) * dev.scalar_issue_cycles
    lp, sp, vec, instr = (a if a.shape == load.shape else np.broadcast_to(a, load.shape) for a in (lp, sp, vec, instr))
    nxt, nxt_p, prv, prv_p = (np.zeros(load.shape) for _ in range(4))
    nxt[..., :-1], nxt_p[..., :-1] = load[..., 1:], lp[..., 1:]
    prv[..., 1:], prv_p[..., 1:] = store[..., :-1], sp[..., :-1]
    # np.maximum.reduce of the five, in that order, without stacking them into one array first
    body = np.maximum(np.maximum(np.maximum(np.maximum(vec, nxt), prv), nxt_p + prv_p), instr)
    total = load[..., 0] + body.sum(axis=-1) + store[..., -1]
    # the port carries one transfer at a time: the stream lasts at least all its port time
    total = np.maximum(total, lp.sum(axis=-1) + sp.sum(axis=-1))
    busy = {"mte2": load.sum(axis=-1).max(), "vector": vec.sum(axis=-1).max(), "mte3": store.sum(axis=-1).max(),
            "scalar": instr.sum(axis=-1).max()}
    return float(total.max()), {k: float(v) for k, v in busy.items()}


def _seq(xs):
    """The sum of floats left to right from 0, as numpy adds fewer than 8."""
    s = 0.0
    for x in xs:
        s += x
    return s


def _short(dev, load_bytes, load_port, vec, store_bytes, store_port, instr, lr, sr):
    """:func:`stream` of one stream of fewer than 8 tasks, in plain Python: the same operations in the same
    order as the numpy form (which adds so few items left to right), without its per-call cost."""
    lp = np.asarray(load_port, dtype=float).tolist()
    sp = np.asarray(store_port, dtype=float).tolist()
    load = [max(b / lr, p) for b, p in zip(np.asarray(load_bytes, float).tolist(), lp)]
    store = [max(b / sr, p) for b, p in zip(np.asarray(store_bytes, float).tolist(), sp)]
    vec = np.asarray(vec, dtype=float).tolist()
    sic = dev.scalar_issue_cycles
    instr = [x * sic for x in np.asarray(instr, dtype=float).tolist()]
    last = len(load) - 1
    body = [max(vec[i], load[i + 1] if i < last else 0.0, store[i - 1] if i else 0.0,
                (lp[i + 1] if i < last else 0.0) + (sp[i - 1] if i else 0.0), instr[i]) for i in range(last + 1)]
    total = load[0] + _seq(body) + store[-1]
    total = max(total, _seq(lp) + _seq(sp))
    return float(total), {"mte2": _seq(load), "vector": _seq(vec), "mte3": _seq(store), "scalar": _seq(instr)}


__all__ = ["block_steps", "port", "shares", "stream"]
