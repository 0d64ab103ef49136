"""Shared pieces of the Vector-unit kernels: dtype checks, UB budgets, work split over cores, repeat counts.

Every vector kernel here is written the same way, as an Ascend C kernel author writes one:

1. The work (rows, or lanes of a reduction, or flat elements) is split into contiguous, even shares,
   one per vector core (``n = min(device.vector_cores, work units)``), as ``GetBlockIdx()`` offsets do.
2. Each core walks its share in tiles sized to fit UB (32 B aligned rows), double-buffered: while the
   Vector unit works on tile i, MTE2 loads tile i+1 and MTE3 stores tile i-1. The machine's RAW/WAR
   tracking turns two alternating buffers into that overlap; the program only alternates them.
3. The cores run in lockstep (:func:`lockstep`): step s runs the s-th tile of every core that still
   has one; the others idle under an ``active`` mask.

Repeat counts: one Vector instruction sweeps 256 B per repeat (``Group.repeats``). A pass over a tile
whose rows are padded to 32 B costs ``repeats(rows * padded_cols)``; a per-row operation (a reduction,
or an operand broadcast along the row) costs ``rows * repeats(cols)``, since each row starts its own
repeats (``Group.row_repeats``).
"""
from __future__ import annotations

import numpy as np

from autofuse.npu.dtypes import itemsize, round_bf16
# UB packing and the tile-size search, shared with the cost model (data both sides read, no cost formula)
from cost_model.vecutil import block_elems, fits, largest, pad, ub_need

VEC_FLOATS = ("float16", "bfloat16", "float32")
BLOCK = 32                      # UB alignment and the unit of DataCopy: one 32 B block


def ceil_div(a, b):
    return -(-a // b)


def round_up(a, b):
    return ceil_div(a, b) * b


def lanes(device, dtype: str) -> int:
    """Elements of ``dtype`` one Vector repeat covers (128 fp16, 64 fp32)."""
    return device.vector_bytes_per_cycle // itemsize(dtype)


def dtype_name(dt) -> str | None:
    """A dtype given as a string, numpy dtype or torch dtype -> its name (``None`` stays ``None``)."""
    if dt is None:
        return None
    s = str(dt).replace("torch.", "")
    return {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
            "fp32": "float32", "int": "int32"}.get(s, s)


def check_dtype(kernel: str, what: str, t, allowed=VEC_FLOATS) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{kernel}: {what} is {t.dtype} (shape {list(t.shape)}); this kernel takes "
                        f"{', '.join(allowed)}")


def split_blocks(total: int, ncores: int, block: int, period: int | None = None, align: int = 1):
    """Contiguous, even shares of ``range(total)`` per core, each cut into blocks of at most ``block``.

    Shares start at multiples of ``align`` (e.g. a 32 B block of elements); blocks never cross a multiple
    of ``period`` (the end of one softmax row group, one broadcast region, ...). Returns, per core, a list
    of ``(start, extent)``.
    """
    units = ceil_div(total, align)
    base, rem = divmod(units, ncores)
    out, u = [], 0
    for c in range(ncores):
        n_units = base + (c < rem)
        s, e = u * align, min(total, (u + n_units) * align)
        u += n_units
        blocks = []
        b = s
        while b < e:
            stop = min(e, b + block)
            if period:
                stop = min(stop, (b // period + 1) * period)
            blocks.append((b, stop - b))
            b = stop
        out.append(blocks)
    return out


def lockstep(per_core):
    """Steps of a lockstep program: yields, per step, a list with each core's item (``None`` when idle)."""
    steps = max((len(items) for items in per_core), default=0)
    for s in range(steps):
        yield [items[s] if s < len(items) else None for items in per_core]


def pipeline(tasks) -> None:
    """Run ``(load, work)`` tasks with the loads one task ahead in program order.

    ``load()`` issues the MTE2 transfers of a task into the next free buffers and returns what ``work``
    needs; ``work(handle)`` issues its Vector instructions and stores. Issuing the load of task i+1 before
    the work of task i is the prefetch of a double-buffered Ascend C loop: the GM port is then booked in
    the order the transfers run, loads ahead of the stores they overlap.
    """
    prev = None
    for load, work in tasks:
        handle = load()
        if prev is not None:
            prev[0](prev[1])
        prev = (work, handle)
    if prev is not None:
        prev[0](prev[1])


def active_mask(items):
    """``None`` when every core works this step (the machine's fast path), else a boolean mask."""
    act = np.array([it is not None for it in items])
    return None if act.all() else act


def extents(items, pick, idle=0):
    """Per-core numpy array of ``pick(item)`` (``idle`` for idle cores)."""
    return np.array([idle if it is None else pick(it) for it in items])


def round_fp16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest float16 (ties to even, subnormals, overflow to inf), as float32.

    ``x + M - M`` rounds to a multiple of ulp(M) in one float32 rounding; M = 1.5 * 2**(e + 13) has the
    ulp 2**(e - 10) of fp16 values of exponent e (e clamped to fp16's -14..15). numpy's own float16
    conversion takes a slow path for the many values that land in fp16's subnormal range (softmax
    outputs), about 30x slower than these few vector passes.
    """
    shape = np.shape(x)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)        # 1-d: in-place ops need arrays
    e = (x.view(np.uint32) >> 23) & np.uint32(0xFF)
    np.clip(e, 127 - 14, 127 + 15, out=e)
    e += np.uint32(13)
    e <<= np.uint32(23)
    e |= np.uint32(0x400000)
    m = e.view(np.float32)
    r = x + m
    r -= m
    np.copysign(r, x, out=r)
    big = np.abs(r) > np.float32(65504)
    if big.any():
        r[big] = np.copysign(np.float32(np.inf), x[big])
    return r.reshape(shape)


def rnd(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype``, held as float32 (as tiles hold values); integers truncate toward zero."""
    if dtype == "float16":
        return round_fp16(x)
    if dtype == "bfloat16":
        return round_bf16(x)
    if dtype in ("int32", "int8"):
        with np.errstate(invalid="ignore"):
            return np.trunc(np.asarray(x, dtype=np.float32))
    if dtype == "bool":
        return np.asarray(x) != 0
    return np.asarray(x, dtype=np.float32)


def view(t, shape, name=None):
    """A GM tensor viewed with another shape (same element order; the data is shared when contiguous)."""
    shape = tuple(int(s) for s in shape)
    if tuple(t.shape) == shape:
        return t
    return type(t)(t.data.reshape(shape), t.dtype, name or t.name, getattr(t, "scratch", False))


__all__ = ["VEC_FLOATS", "active_mask", "block_elems", "ceil_div", "check_dtype", "dtype_name", "extents",
           "fits", "lanes", "largest", "lockstep", "pad", "pipeline", "rnd", "round_fp16", "round_up", "split_blocks", "ub_need", "view"]
