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

The shapes (:class:`cost_model.conv_geometry.Geometry`) and its tilings' shapes are shared with the kernel, which
reads them from :mod:`cost_model.conv_geometry`.
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import itemsize, tile1d
from cost_model.conv_geometry import Geometry, band_elems, even, first, gemm_tiling, geometry, smaller
from cost_model.estimate import cached, make, register
from cost_model.matmul import _candidates, _model, _quick_score, cheapest, fits as mm_fits, kernel_default as mm_default


@cached
def _band_elems(geo: Geometry, m0: int, c1: int) -> int:
    """:func:`band_elems` of a tiling's ``m0`` and ``c1``: the searches check the fit of many tilings of the few
    row-block heights, each a reduction over the image's blocks otherwise."""
    return band_elems({"m0": m0, "c1": c1}, geo)


def fits(dev, dtype: str, geo: Geometry, t: dict, bias: bool = False) -> bool:
    return 1 <= t["c1"] <= geo.Cg and mm_fits(dev, dtype, dtype, gemm_tiling(t, geo), bias,
                                               _band_elems(geo, t["m0"], t["c1"]))


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
    return tile1d(ext, geo.N), tile1d(band, geo.N).astype(float), float(band.max()), tile1d(same, geo.N)


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
