"""Dropout keep-masks: one bit per element, generated on the Vector unit (CANN's DropOutGenMask).

    npu.run("dropout_gen_mask", shape=[B, N, Sq, Skv], keep_prob=0.9, draws=HostDraws(keep))
        -> (mask,)   uint8 [B, N, Sq, ceil(Skv / 8)], bit j % 8 of byte j // 8 = keep element j of its row

The mask is what FlashAttention's ``drop_mask`` input reads (``flash_attention(..., drop_mask=mask)``) and
what a DropOutDoMask multiplies by; rows are packed separately (a row of S elements takes ``ceil(S / 8)``
bytes), so a tile of keys starting at a multiple of 8 starts at a byte.

**The bits.** A fused model must draw the dropout masks eager PyTorch draws (same seed, same elements
dropped), and the chip's Philox stream is not the CPU generator's: so the bits themselves come from the host
(``draws``: the caller's boolean keep-mask, drawn with torch's generator exactly as eager's dropout draws it)
and the kernel writes them where the chip's generator would. What the simulator measures is the generator's
cost, modelled below; a timing-only launch needs no draws.

**The cost (a model, not a published figure).** CANN's StatelessDropOutGenMask runs Philox4x32-10 on the
Vector unit: per counter, 10 rounds of two 32x32 -> 64-bit products, two XORs with the key and two key
increments produce four 32-bit words. The Vector unit multiplies int32 lanes to their low 32 bits; the
high halves take four 16-bit partial products and their carries (modelled as 5 passes each). That is
``10 * (2 + 2 * 5 + 2 + 2) / 4 = 40`` int32 passes per element, plus one to turn the word into a uniform
and compare it with ``keep_prob`` into the bit (``vcmp`` writes a bit mask): ``PHILOX_PASSES = 41`` passes
of 64 int32 lanes. (On the 910B, CANN's DSAGenBitMask uses the SoC's DSA engine instead, which the
simulator does not model: the Vector kernel is then an upper bound.)

Schedule: the rows, split evenly over the vector cores, ``rows`` rows per tile; per tile: the Philox passes
over the four state words (int32 tiles of the row's padded width), the compare into a uint8 bit tile
(double-buffered) and its store. Nothing is read from GM.

``tiling``: ``{"rows": rows per tile}``; ``None`` picks the largest tile that fits UB, capped so each core
has at least four tiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autofuse.npu.kernels.tiles import (active_mask, ceil_div, extents, fits, largest, lockstep, pad, pipeline,
                                        split_blocks, view)
from autofuse.npu.run import kernel

PHILOX_PASSES = 41             # int32 Vector passes per element: Philox4x32-10 (40) and the compare (1)
STATE_WORDS = 4                # Philox's counter block: four int32 words per element slot


@dataclass(frozen=True)
class HostDraws:
    """The keep-mask drawn on the host (bool, the launch's ``shape``): the values the kernel writes (see the
    module docstring). A wrapper, not an array, so the launch does not take it for a GM input."""
    keep: np.ndarray


def pack_keep(keep: np.ndarray) -> np.ndarray:
    """A boolean keep-mask ``[..., S]`` as the kernels store and read it: uint8 ``[..., ceil(S / 8)]``, bit
    ``j % 8`` of byte ``j // 8`` (little-endian bit order, numpy's ``packbits(bitorder="little")``)."""
    return np.packbits(np.asarray(keep, dtype=bool), axis=-1, bitorder="little")


def unpack_keep(bits: np.ndarray, n: int | None = None) -> np.ndarray:
    """The 0/1 keep-mask (uint8) ``[..., n]`` of packed ``bits`` (every bit when ``n`` is None)."""
    return np.unpackbits(bits, axis=-1, count=n, bitorder="little")


def specs(R: int, cols: int) -> list:
    """UB tiles, in allocation order: the Philox state words (int32), the bit tile (two)."""
    return [((R, pad(cols, "int32")), "int32")] * STATE_WORDS + [((R, pad(ceil_div(cols, 8), "uint8")), "uint8")] * 2


def default_rows(dev, cols: int, per_core: int) -> int:
    r = largest(lambda r: fits(dev, specs(r, cols)), 1, max(1, per_core))
    if r < 1:
        raise ValueError(f"dropout_gen_mask: not one row of {cols} elements fits UB on {dev.name}")
    return max(1, min(r, ceil_div(per_core, 4)))


@kernel("dropout_gen_mask")
def dropout_gen_mask(launch, shape=(), keep_prob=1.0, draws=None, tiling=None):
    """The keep-mask of ``shape`` (see the module docstring); ``draws`` is required when values are computed."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 1 or any(s < 0 for s in shape):
        raise ValueError(f"dropout_gen_mask: shape {list(shape)} must have at least one dim, none negative")
    if not 0.0 <= float(keep_prob) <= 1.0:
        raise ValueError(f"dropout_gen_mask: keep_prob={keep_prob} must be in [0, 1]")
    dev = launch.device
    cols, rows = shape[-1], math.prod(shape[:-1])
    cb = ceil_div(cols, 8)
    out = launch.empty((*shape[:-1], cb), "uint8", "mask")
    if launch.values:
        if not isinstance(draws, HostDraws) or tuple(draws.keep.shape) != shape:
            raise ValueError(f"dropout_gen_mask: draws must be HostDraws of a bool keep-mask {list(shape)} "
                             f"(got {type(draws).__name__})")
        out.data = np.zeros(out.shape, dtype=np.uint8)         # bytes, not the float32 storage of float outputs
    if rows == 0 or cols == 0:
        return (out,)
    flat = view(out, (rows, cb))
    keep = draws.keep.reshape(rows, cols) if launch.values else None
    n = max(1, min(dev.vector_cores, rows))
    if tiling:
        R = int(tiling.get("rows", 1))
        if R < 1:
            raise ValueError(f"dropout_gen_mask: tiling rows={R} must be positive")
    else:
        R = default_rows(dev, cols, ceil_div(rows, n))
    g = launch.group("aiv", n)
    cp = pad(cols, "int32")
    W = [g.alloc("UB", (R, cp), "int32", f"philox{i}") for i in range(STATE_WORDS)]
    Bt = [g.alloc("UB", (R, pad(cb, "uint8")), "uint8", f"bits{i}") for i in range(2)]
    ctr = {"b": 0}

    def take(items):
        bt = Bt[ctr["b"] % 2]
        ctr["b"] += 1
        return bt

    def work(items, bt):
        act = active_mask(items)
        re = extents(items, lambda it: it[1])
        per_pass = g.repeats(re * cp, "int32")
        g.vector("philox4x32-10", W, W, per_pass * (PHILOX_PASSES - 1), active=act)

        def bits():
            for c, it in enumerate(items):
                if it is not None:
                    s, e = it
                    bt.data[c, :e, :cb] = pack_keep(keep[s:s + e])
        g.vector("compare -> bits", (bt,), W, per_pass, active=act,
                 compute=bits if launch.values else None)
        g.store(bt, flat, [None if it is None else (slice(it[0], it[0] + it[1]), slice(0, cb)) for it in items],
                active=act, name="store mask")

    def tasks():
        for items in lockstep(split_blocks(rows, n, R)):
            yield (lambda items=items: take(items)), (lambda bt, items=items: work(items, bt))

    pipeline(tasks())
    return (out,)


__all__ = ["HostDraws", "PHILOX_PASSES", "default_rows", "dropout_gen_mask", "pack_keep", "specs", "unpack_keep"]
