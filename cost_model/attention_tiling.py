"""FlashAttention's buffer requests: shared data, no cost formula.

The tiles the ``flash_attention`` kernel asks of each buffer for a tiling, in allocation order, which the
simulator's kernel (``autofuse/npu/kernels/flash_attention.py``) allocates and the cost model
(``cost_model/flash_attention.py``) places; each side grants the double buffers itself (``_counts``). Geometry
only: nothing here counts or prices cycles or bytes moved.
"""
from __future__ import annotations

F32 = "float32"
#: UB tile of the sink logit (one fp32 value, the tile padded to UB's 32-byte alignment)
SINK_TILE = 8


def out_rows(vq: int) -> int:
    """Rows of the output tile: the normalised O leaves in pieces of at most 64 rows (a small UB tile),
    a divisor of ``vq`` (hence of the rows a vector core owns)."""
    return next(d for d in range(min(vq, 64), 0, -1) if vq % d == 0)


def l0b_requests(D, Dv, dtype, kv) -> list:
    """L0B's requests (:func:`requests`): K^T and V, one ring when their shapes agree; the same for every q and vq."""
    if (D, kv) == (kv, Dv):
        return [("cube", "L0B", "b0", (D, kv), dtype, 1, 2)]
    return [("cube", "L0B", "kt0", (D, kv), dtype, 1, 2), ("cube", "L0B", "v0", (kv, Dv), dtype, 1, 2)]


def requests(device, D: int, Dv: int, dtype: str, t: dict, mask_spec, drop: bool = False, sink: bool = False):
    """Buffer requests ``(side, buffer, name, shape, dtype, min_count, max_count)`` in allocation order.

    ``side`` is "cube" (coupled core, or AIC) or "vec" (coupled core, or AIV). Counts above the minimum are
    granted, in list order, while they fit (double buffers). ``mask_spec``: ``(dtype, rows, cols)`` of
    the mask tile or None. ``drop``: a dropout keep-mask tile (one bit per score) per row block. ``sink``: a
    small tile for the item's sink logit (attention sinks), loaded at its first step.
    """
    q, kv, vq = t["q"], t["kv"], t["vq"]
    split = device.arch == "split"
    rows = q // 2 if split else q              # query rows one vector core owns
    req = [("vec", "UB", "s", (vq, kv), F32, 1, 2), ("vec", "UB", "p", (rows, kv), dtype, 1, 1)]
    if mask_spec is not None:
        mdt, mr, mc = mask_spec
        req.append(("vec", "UB", "mask", (vq if mr else 1, kv if mc else 1), mdt, 1, 2))
    if drop:
        req.append(("vec", "UB", "drop", (vq, kv // 8), "uint8", 1, 2))
    req += [("vec", "UB", "pv", (rows, Dv), F32, 1, 1), ("vec", "UB", "o", (rows, Dv), F32, 1, 1),
            ("vec", "UB", "out", (out_rows(vq), Dv), dtype, 1, 2)]
    req += [("vec", "UB", st, (rows,), F32, 2, 2) for st in ("m", "l", "alpha")]
    if sink:
        req.append(("vec", "UB", "sink", (SINK_TILE,), F32, 1, 1))
    # Q sits in L0A for a whole item: one tile (coupled), or one per row block (split: S leaves per block)
    q0 = [("cube", "L0A", "q0", (q, D), dtype, 1, 1)] if not split else \
        [("cube", "L0A", "q0", (vq, D), dtype, q // vq, q // vq)]
    req += [("cube", "L1", "q1", (q, D), dtype, 1, 1), ("cube", "L1", "kt1", (D, kv), dtype, 1, 2),
            ("cube", "L1", "v1", (kv, Dv), dtype, 2, 2)]
    req += q0 + [("cube", "L0A", "p0", (rows, kv), dtype, 1, 2)]
    req += l0b_requests(D, Dv, dtype, kv)
    s0, o0 = ((vq, kv) if split else (q, kv)), (rows, Dv)
    if s0 == o0:
        req.append(("cube", "L0C", "c0", s0, F32, 2, 4))
    else:
        req += [("cube", "L0C", "s0", s0, F32, 1, 2), ("cube", "L0C", "o0", o0, F32, 1, 2)]
    return req
