"""A convolution's sizes as the Cube's implicit GEMM sees them (:class:`Geometry`: output size, each row block's
input band) and the shapes of its tilings: facts the simulator's ``conv`` kernel and the cost model
(:mod:`cost_model.conv`) share, no cost formula."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from cost_model.common import ceil_div, round_up


def _pair(v, n):
    v = tuple(v) if isinstance(v, (list, tuple)) else (v,) * n
    if len(v) != n:
        raise ValueError(f"conv: expected {n} values, got {list(v)}")
    return tuple(int(x) for x in v)


@dataclass(frozen=True)
class Geometry:
    """A convolution's sizes, a 1-D one as 2-D over ``[L, 1]``."""
    N: int
    H: int
    W: int
    G: int
    Cg: int                 # input channels per group
    Cog: int                # output channels per group
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int

    @property
    def Ho(self):
        return (self.H + 2 * self.ph - self.dh * (self.kh - 1) - 1) // self.sh + 1

    @property
    def Wo(self):
        return (self.W + 2 * self.pw - self.dw * (self.kw - 1) - 1) // self.sw + 1

    @property
    def K(self):
        return self.Cg * self.kh * self.kw

    @functools.lru_cache(maxsize=64)
    def blocks(self, m0: int):
        """Per block of ``m0`` output pixels of one image: (its pixels, its band's first input row, the band's
        rows), three int arrays."""
        HoWo, Wo = self.Ho * self.Wo, self.Wo
        p0 = np.arange(ceil_div(HoWo, m0)) * m0
        p1 = np.minimum(HoWo, p0 + m0)
        lo = np.maximum(0, (p0 // Wo) * self.sh - self.ph)
        hi = np.minimum(self.H, ((p1 - 1) // Wo) * self.sh - self.ph + (self.kh - 1) * self.dh + 1)
        return p1 - p0, lo, np.maximum(0, hi - lo)

    def rows(self, m0: int) -> int:
        """The most input rows a block of ``m0`` output pixels reads (the L1 band's height)."""
        return max(1, int(self.blocks(m0)[2].max()))


def geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1) -> Geometry:
    nd = len(x_shape) - 2
    if nd not in (1, 2) or len(w_shape) != nd + 2:
        raise ValueError(f"conv: input {list(x_shape)} and weight {list(w_shape)}: 1-D or 2-D batched convolutions "
                         f"only")
    N, Cin = x_shape[:2]
    Cout, Cg = w_shape[:2]
    if groups < 1 or Cin % groups or Cout % groups or Cin // groups != Cg:
        raise ValueError(f"conv: {Cin} input and {Cout} output channels, weight {list(w_shape)}, groups={groups}")
    (sh, sw), (ph, pw), (dh, dw) = ((_pair(v, nd) + (fill,))[:2] for v, fill in
                                    ((stride, 1), (padding, 0), (dilation, 1)))
    H, W = (x_shape[2], 1) if nd == 1 else x_shape[2:]
    kh, kw = (w_shape[2], 1) if nd == 1 else w_shape[2:]
    geo = Geometry(int(N), int(H), int(W), int(groups), int(Cg), int(Cout) // groups, int(kh), int(kw),
                   sh, sw, ph, pw, dh, dw)
    if min(sh, sw, dh, dw) < 1 or min(ph, pw) < 0 or geo.Ho < 1 or geo.Wo < 1:
        raise ValueError(f"conv: no output for input {list(x_shape)}, weight {list(w_shape)}, stride {stride}, "
                         f"padding {padding}, dilation {dilation}")
    return geo


def gemm_tiling(t: dict, geo: Geometry) -> dict:
    """The Cube's tiling (m0, n0, k0, k1) of conv tiling ``t`` (m0, n0, k0, c1: input channels per K chunk)."""
    return {"m0": t["m0"], "n0": t["n0"], "k0": t["k0"], "k1": t["c1"] * geo.kh * geo.kw}


def band_elems(t: dict, geo: Geometry) -> int:
    """Elements of one L1 buffer of the input band: ``c1 × rows × W``."""
    return t["c1"] * geo.rows(t["m0"]) * geo.W


def even(t: dict, geo: Geometry) -> dict:
    """``t`` with its K slices as even as its chunk allows: a chunk of ``c1`` channels is rarely a whole number
    of ``k0`` slices (9 per channel for 3×3), and a short last slice each chunk lands in the same L0 buffer of the
    two every time, so the long slices' moves wait for the Cube instead of overlapping it (a 13 % slower 3×3 layer
    on the 910). As many slices, of the chunk's depth over their count (in whole fractals): never deeper."""
    k1 = t["c1"] * geo.kh * geo.kw
    return {**t, "k0": min(t["k0"], round_up(ceil_div(k1, ceil_div(k1, t["k0"])), 16))}


def first(geo: Geometry, m0: int, n0: int, k0: int, k1: int) -> dict:
    """The conv tiling of a GEMM tile ``m0 × n0`` with slices ``k0`` and chunks about ``k1`` deep: whole channels a
    chunk, 16 at a time when there are that many, and :func:`even` slices."""
    c1 = max(1, min(geo.Cg, k1 // (geo.kh * geo.kw)))
    return even({"m0": m0, "n0": n0, "k0": k0, "c1": c1 // 16 * 16 if c1 >= 16 else c1}, geo)


def smaller(t: dict, geo: Geometry) -> dict | None:
    """The next tiling to try when ``t`` does not fit: fewer channels per chunk, then fewer rows, then fewer
    columns (None: none is smaller)."""
    for key, floor in (("c1", 1), ("m0", 16), ("n0", 16)):
        if t[key] > floor:
            return even({**t, key: max(floor, t[key] // 2)}, geo)
    return None
