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
    """Cycles of the double-buffered task stream and the busy cycles per unit (see the module docstring)."""
    lr = load_rate or dev.rates["GM->UB"]
    sr = store_rate or dev.rates["UB->GM"]
    load = np.maximum(np.asarray(load_bytes, float) / lr, load_port)
    store = np.maximum(np.asarray(store_bytes, float) / sr, store_port)
    vec = np.asarray(vec, dtype=float)
    instr = np.asarray(instr, dtype=float) * dev.scalar_issue_cycles
    nxt = np.concatenate([load[1:], [0.0]])
    nxt_p = np.concatenate([np.asarray(load_port, float)[1:], [0.0]])
    prv = np.concatenate([[0.0], store[:-1]])
    prv_p = np.concatenate([[0.0], np.asarray(store_port, float)[:-1]])
    body = np.maximum.reduce([vec, nxt, prv, nxt_p + prv_p, instr])
    total = load[0] + body.sum() + store[-1]
    # the port carries one transfer at a time: the stream lasts at least all its port time
    total = max(total, float(np.sum(load_port) + np.sum(store_port)))
    busy = {"mte2": load.sum(), "vector": vec.sum(), "mte3": store.sum(), "scalar": instr.sum()}
    return float(total), busy


__all__ = ["block_steps", "port", "shares", "stream"]
