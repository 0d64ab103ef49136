"""Convolution on the Cube: an implicit GEMM whose img2col is formed on the way from L1 to L0A, as CANN's
Conv2D does it ("load3d").

``conv(x, w, bias=None, stride, padding, dilation, groups)``: ``x`` ``[N, Cin, H, W]`` (or ``[N, Cin, L]``), ``w``
``[Cout, Cin/groups, kh, kw]`` (or ``[Cout, Cin/groups, k]``), ``bias`` ``[Cout]``; out ``[N, Cout, Ho, Wo]`` (or
``[N, Cout, Lo]``) in ``x``'s dtype, as ``torch.nn.functional.conv2d`` / ``conv1d``. A 1-D convolution runs as a
2-D one over ``[L, 1]``: its output positions are output *rows*, so a tile's input band is the positions it
reads, not the whole sequence.

Per group ``g`` it is a GEMM: rows are one image's output pixels (``Ho·Wo``), K is ``Cin/g·kh·kw`` (``k = c·kh·kw +
i·kw + j``, the weights' own layout, so B is ``w`` viewed ``[Cout, K]`` and read transposed, as a linear layer's
weight), columns are the group's ``Cout/g`` output channels. Groups (depthwise included) are a batch of
independent GEMMs.

Schedule: work items (group, image, block of ``m0`` output pixels, block of ``n0`` output channels) go
round-robin over the cores in lockstep, as the matmul's; each item is the matmul's K loop
(:class:`autofuse.npu.kernels.matmul.Cube`) with another A side (:class:`Band`):

    for each K chunk of c1 input channels (k1 = c1·kh·kw, double-buffered in L1):
        MTE2  GM -> L1: the input band: c1 channels × the input rows the tile's output rows read (the kernel's
              extent included, clipped to the image: padding is never loaded) × the whole input width.
              The bytes moved from GM are the band's, not the img2col matrix's.
        MTE2  GM -> L1: the weights' n0 × k1 block (transposed, as the matmul's B); a bias once per tile
        for each k0 slice (double-buffered):
              MTE1  L1 -> L0A: load3d forms the m0 × k0 img2col fractal from the band (padding, and rows past
                    the tile, are zeros), charged as the L0A tile's bytes; L1 -> L0B
              Cube  L0C += L0A @ L0B (fp32; the bias seeds the accumulator)
    coupled: FixPipe L0C -> UB (cast), MTE3 UB -> GM; split: FixPipe L0C -> GM (cast), into NCHW

The img2col values are the band's own (copies), so the result is the exact GEMM of the im2col matrix with
fp32 accumulation. Transposed and 3-D convolutions have no kernel here (``autofuse.lower`` prices them as a
generic pass). The shapes (:class:`cost_model.conv_geometry.Geometry`: output size, each block's band) are read
from the cost model's shared geometry, as both must agree on them; every count is the simulator's own.
"""
from __future__ import annotations

import numpy as np

from autofuse.npu.kernels.matmul import CUBE_DTYPES, Program, _ceil, default_tiling as mm_default_tiling, overflow
from autofuse.npu.run import kernel
from cost_model.conv_geometry import Geometry, band_elems, first, geometry, gemm_tiling, smaller


def tiling_overflow(device, dtype: str, geo: Geometry, t: dict) -> str | None:
    """The first buffer conv tiling ``t`` (m0, n0, k0, c1) overflows (None: it fits): the matmul's buffers, with
    two input bands of ``c1 × rows × W`` as the L1 buffers of A."""
    if min(t["m0"], t["n0"], t["k0"], t["c1"]) < 1 or t["c1"] > geo.Cg:
        return f"channels per chunk (1 to {geo.Cg})"
    return overflow(device, dtype, dtype, gemm_tiling(t, geo), a1_elems=band_elems(t, geo))


def default_tiling(device, dtype: str, geo: Geometry) -> dict:
    """The matmul's default base tile for the GEMM (rows ``Ho·Wo``, a batch of ``groups × N``), K chunks of whole
    channels with even slices (``cost_model.conv_geometry.first``); made ``smaller`` (fewer channels, then rows, then
    columns) until the bands fit."""
    mm = mm_default_tiling(device, geo.Ho * geo.Wo, geo.Cog, geo.K, geo.G * geo.N, dtype, dtype)
    t = first(geo, mm["m0"], mm["n0"], mm["k0"], mm["k1"])
    while tiling_overflow(device, dtype, geo, t):
        t = smaller(t, geo)
        if t is None:
            raise ValueError(f"no conv tiling fits {device.name} for {dtype} (input width {geo.W})")
    return t


class Band:
    """The A side of one step of the implicit GEMM (see :meth:`Cube.accumulate`): per core, its item's input
    band into L1, and load3d's img2col fractals from it into L0A."""

    def __init__(self, geo: Geometry, x, mine, t, R, index):
        self.geo, self.x, self.mine, self.c1, self.R = geo, x, mine, t["c1"], R
        _, self.lo, self.rows = geo.blocks(t["m0"])
        self.k1 = t["c1"] * geo.kh * geo.kw
        self.index = index              # the step's img2col indices into each core's band (None: timing only)

    def load(self, g, A1, ks, act, deps):
        geo, c1 = self.geo, self.c1
        c_lo = ks.start // self.k1 * c1
        c_hi = min(geo.Cg, c_lo + c1)
        regs = []
        for it in self.mine:
            if it is None:
                regs.append(None)
                continue
            gi, n, mi, _ = it
            lo, rows = int(self.lo[mi]), int(self.rows[mi])
            regs.append((n, slice(gi * geo.Cg + c_lo, gi * geo.Cg + c_hi), slice(lo, lo + rows), slice(0, geo.W)))
        g.load(A1, self.x, regs, active=act, deps=deps, name="load band")

    def fractal(self, sl):
        index = self.index

        def img2col(band, cs):
            n = band.shape[0]
            flat = np.concatenate([band.reshape(n, -1), np.zeros((n, 1), band.dtype)], axis=1)
            idx = index[cs][:, :, sl]
            return np.take_along_axis(flat, idx.reshape(n, -1), axis=1).reshape(idx.shape)
        return img2col, True


def _indices(geo: Geometry, m0: int, k1: int, R: int, mi: int) -> np.ndarray:
    """``[m0, k1]``: where each element of block ``mi``'s img2col rows (its pixels) and a K chunk's columns sits in
    the chunk's band ``[c1, R, W]`` flattened; padding, and rows past the block, point past the band (a zero)."""
    ext, lo, _ = geo.blocks(m0)
    m_ext, lo = ext[mi], lo[mi]
    p = mi * m0 + np.arange(m0)
    oh, ow = p // geo.Wo, p % geo.Wo
    kc = np.arange(k1)
    c, i, j = kc // (geo.kh * geo.kw), (kc // geo.kw) % geo.kh, kc % geo.kw
    ih = oh[:, None] * geo.sh - geo.ph + i[None, :] * geo.dh
    iw = ow[:, None] * geo.sw - geo.pw + j[None, :] * geo.dw
    ok = (np.arange(m0) < m_ext)[:, None] & (ih >= 0) & (ih < geo.H) & (iw >= 0) & (iw < geo.W)
    zero = k1 // (geo.kh * geo.kw) * R * geo.W
    return np.where(ok, (c[None, :] * R + ih - lo) * geo.W + iw, zero).astype(np.intp)


@kernel("conv")
def conv(launch, x, w, bias=None, stride=1, padding=0, dilation=1, groups=1, tiling=None):
    """The convolution of ``x`` with ``w`` on the Cube (see the module docstring). ``tiling``: dict m0, n0, k0
    and c1 (input channels per K chunk), else the kernel's default."""
    for name, v in (("x", x), ("w", w)):
        if v.dtype not in CUBE_DTYPES:
            raise TypeError(f"conv: {name} is {v.dtype}; the Cube takes {', '.join(CUBE_DTYPES)}")
    if x.dtype != w.dtype:
        raise TypeError(f"conv: x is {x.dtype} but w is {w.dtype}; cast one of them first")
    dev = launch.device
    dtype = x.dtype
    one_d = len(x.shape) == 3
    geo = geometry(x.shape, w.shape, stride, padding, dilation, groups)
    Cout = geo.G * geo.Cog
    if bias is not None and tuple(bias.shape) != (Cout,):
        raise ValueError(f"conv: bias has shape {list(bias.shape)}, expected [{Cout}]")
    t = dict(tiling) if tiling else default_tiling(dev, dtype, geo)
    where = tiling_overflow(dev, dtype, geo, t)
    if where:
        raise ValueError(f"conv tiling {t} does not fit the {where} of {dev.name}")
    m0, n0 = t["m0"], t["n0"]
    R, HoWo = geo.rows(m0), geo.Ho * geo.Wo
    ext = geo.blocks(m0)[0]
    gt = gemm_tiling(t, geo)
    xg = type(x)(x.data.reshape(geo.N, geo.G * geo.Cg, geo.H, geo.W), x.dtype, x.name)
    wg = type(w)(w.data.reshape(Cout, geo.K), w.dtype, w.name)
    shape = (geo.N, Cout, geo.Ho) if one_d else (geo.N, Cout, geo.Ho, geo.Wo)
    result = launch.empty(shape, dtype, "out")
    out = type(result)(result.data.reshape(geo.N, Cout, HoWo), dtype, "out")       # a view: the GEMM's columns
    nm, nn = _ceil(HoWo, m0), _ceil(geo.Cog, n0)
    items = [(gi, n, mi, ni) for gi in range(geo.G) for n in range(geo.N) for mi in range(nm) for ni in range(nn)]
    prog = Program(launch, dtype, dtype, gt, min(dev.cube_cores, len(items)), bias is not None,
                   a1_shape=(t["c1"], R, geo.W))
    g, cube = prog.g, prog.cube
    ncores = g.n
    blocks = {}                         # block -> its img2col indices (values only)

    def block_index(mi):
        if mi not in blocks:
            blocks[mi] = _indices(geo, m0, gt["k1"], R, mi)
        return blocks[mi]

    for step in range(_ceil(len(items), ncores)):
        mine = [items[step * ncores + c] if step * ncores + c < len(items) else None for c in range(ncores)]
        active = np.array([it is not None for it in mine])
        act = None if active.all() else active
        m_ext = np.array([0 if it is None else ext[it[2]] for it in mine])
        n_ext = np.array([0 if it is None else min(n0, geo.Cog - it[3] * n0) for it in mine])
        pix = [None if it is None else slice(it[2] * m0, it[2] * m0 + m_ext[c]) for c, it in enumerate(mine)]
        cols = [None if it is None else slice(it[0] * geo.Cog + it[3] * n0, it[0] * geo.Cog + it[3] * n0 + n_ext[c])
                for c, it in enumerate(mine)]
        index = None
        if launch.values:
            pad = np.full((m0, gt["k1"]), gt["k1"] // (geo.kh * geo.kw) * R * geo.W, dtype=np.intp)
            index = np.stack([pad if it is None else block_index(it[2]) for it in mine])
        side = Band(geo, xg, mine, t, R, index)
        acc = cube.acc[prog.step % cube.nc]
        prog.step += 1
        for _ in cube.accumulate(None, wg, None, [()] * ncores, pix, [cols], m_ext, n_ext, geo.K, act, acc, bias,
                                 trans_b=True, a_side=side):
            pass
        out_reg = [None if it is None else (it[1], cols[c], pix[c]) for c, it in enumerate(mine)]
        prog.write_out(acc[0], out, out_reg, m_ext, n_ext, act, fn=np.transpose)
    return (result,)


__all__ = ["Band", "conv", "default_tiling", "tiling_overflow"]
