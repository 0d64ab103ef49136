"""Convolution on the Cube (``autofuse/npu/kernels/conv.py``): the implicit GEMM priced as the matmul is.

The kernel is the matmul's schedule (:mod:`cost_model.matmul`) on a GEMM per group whose rows are one image's
output pixels, K is ``Cin/g·kh·kw`` and columns the group's output channels, with another A side: each row
block's K chunk loads the *input band* its output rows read (whole channels × the input rows they cover with
the kernel's extent, clipped to the image, × the input width) into L1, and load3d forms the L0A fractals from
it. So the model is the matmul's (:func:`cost_model.matmul._model`) given the row blocks as they are: per block
its pixels (blocks never cross an image: an image's last one is short) and its band's bytes, which are what
MTE2 moves from GM and what L2 holds (a block's band is read again by its other column blocks; neighbouring
blocks' bands overlap by the kernel's halo, which is read twice, as the kernel's loads are distinct regions).
MTE1 moves the img2col fractals at the L0A tile's bytes, as a matmul's A slices. A 1-D convolution is a 2-D one
over ``[L, 1]``.

The shapes (:class:`Geometry`) and the tiling's fit are shared with the kernel, which reads them from here.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from cost_model.common import ceil_div, itemsize, round_up
from cost_model.estimate import cached, make, register
from cost_model.matmul import _candidates, _model, _quick_score, cheapest, fits as mm_fits, kernel_default as mm_default

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


def fits(dev, dtype: str, geo: Geometry, t: dict, bias: bool = False) -> bool:
    return 1 <= t["c1"] <= geo.Cg and mm_fits(dev, dtype, dtype, gemm_tiling(t, geo), bias, band_elems(t, geo))


def kernel_default(dev, dtype: str, geo: Geometry, bias: bool = False) -> dict | None:
    """The kernel's own default (``default_tiling`` in the kernel, mirrored): the matmul's default base tile
    for the GEMM, :func:`first` chunks, made :func:`smaller` until it fits."""
    mm = mm_default(dev, geo.Ho * geo.Wo, geo.Cog, geo.K, geo.G * geo.N, dtype, dtype)
    if mm is None:
        return None
    t = first(geo, mm["m0"], mm["n0"], mm["k0"], mm["k1"])
    while t is not None and not fits(dev, dtype, geo, t, bias):
        t = smaller(t, geo)
    return t


def _a_rows(geo: Geometry, m0: int, isz: int):
    """:func:`cost_model.matmul._model`'s ``a_rows``: every image's blocks in the kernel's order (a block whose
    band is its predecessor's, as where a kernel taller than the image makes every band the whole image, reads
    the same regions: an L2 hit while they stay)."""
    ext, lo, rows = geo.blocks(m0)
    band = geo.Cg * rows * geo.W * isz
    same = np.concatenate([[False], (lo[1:] == lo[:-1]) & (rows[1:] == rows[:-1])])
    return np.tile(ext, geo.N), np.tile(band, geo.N).astype(float), float(band.max()), np.tile(same, geo.N)


def _model_conv(dev, geo: Geometry, dtype: str, t: dict, bias_isz: int):
    return _model(dev, geo.N * geo.Ho * geo.Wo, geo.Cog, geo.K, geo.G, True, geo.G > 1, dtype, dtype, gemm_tiling(t, geo),
                  bias_isz, a_rows=_a_rows(geo, t["m0"], itemsize(dtype)))


def _candidates_conv(dev, geo: Geometry, dtype: str, bias: bool):
    """The matmul's candidate base tiles for the GEMM, each with :func:`first` chunks, made :func:`smaller` until
    it fits."""
    out = []
    for mt in _candidates(dev, geo.Ho * geo.Wo, geo.Cog, geo.K, dtype, dtype, bias):
        t = first(geo, mt["m0"], mt["n0"], mt["k0"], mt["k1"])
        while t is not None and not fits(dev, dtype, geo, t, bias):
            t = smaller(t, geo)
        if t is not None and t not in out:
            out.append(t)
    return out


@cached
def _search(device: str, geo: Geometry, dtype: str, bias_isz: int):
    """The cheapest tiling that fits: candidates ranked by the matmul's quick score (on the GEMM's tiles), the
    best three and the kernel's default priced in full. Returns ``(tiling, model result)``."""
    from cost_model.devices import get_device
    dev = get_device(device)
    cands = _candidates_conv(dev, geo, dtype, bool(bias_isz))
    default = kernel_default(dev, dtype, geo, bool(bias_isz))
    if not cands and default is None:
        raise ValueError(f"no conv tiling fits {dev.name} for {dtype} (input width {geo.W})")
    score = _quick_score(dev, geo.Ho * geo.Wo * geo.N, geo.Cog, geo.K, geo.G, dtype)
    cands.sort(key=lambda t: score(gemm_tiling(t, geo)))
    shortlist = cands[:3] + ([default] if default is not None and default not in cands[:3] else [])
    return cheapest(dev, shortlist, default, lambda t: _model_conv(dev, geo, dtype, t, bias_isz))


def flops(geo: Geometry) -> float:
    return 2.0 * geo.N * geo.G * geo.Ho * geo.Wo * geo.Cog * geo.K


def _roofline(dev, specs, bias=None, stride=1, padding=0, dilation=1, groups=1, tiling=None):
    (xs, dtype), (ws, _) = specs[0], specs[1]
    geo = geometry(xs, ws, stride, padding, dilation, groups)
    isz = itemsize(dtype)
    io = (math.prod(xs) + math.prod(ws) + geo.N * geo.G * geo.Cog * geo.Ho * geo.Wo) * isz
    if bias is not None:
        io += math.prod(bias[0]) * itemsize(bias[1])
    return max(flops(geo) / (2.0 * dev.cube_macs[dtype] * dev.cube_cores), io / dev.hbm_bytes_per_cycle)


@register("conv", _roofline)
def estimate_conv(dev, specs, bias=None, stride=1, padding=0, dilation=1, groups=1, tiling=None):
    (xs, dtype), (ws, wdt) = specs[0], specs[1]
    if dtype != wdt or dtype not in ("float16", "bfloat16", "float32"):
        raise TypeError(f"conv: input {dtype} and weight {wdt}; the Cube takes two equal of fp16, bf16, fp32")
    geo = geometry(xs, ws, stride, padding, dilation, groups)
    bias_isz = itemsize(bias[1]) if bias is not None else 0
    if tiling is None:
        t, (core, hbm, nbytes, busy) = _search(dev.name, geo, dtype, bias_isz)
    else:
        t = {k: int(tiling[k]) for k in ("m0", "n0", "k0", "c1")}
        if not fits(dev, dtype, geo, t, bool(bias_isz)):
            raise ValueError(f"conv tiling {t} does not fit the buffers of {dev.name}")
        core, hbm, nbytes, busy = _model_conv(dev, geo, dtype, t, bias_isz)
    return make("conv", dev, core, hbm, nbytes, busy, dict(t), _roofline(dev, specs, bias, stride, padding, dilation,
                                                                          groups), flops(geo))


__all__ = ["Geometry", "band_elems", "estimate_conv", "even", "first", "fits", "flops", "geometry", "gemm_tiling",
           "kernel_default", "smaller"]
