"""The convolution kernel (implicit GEMM on the Cube, img2col formed from an input band in L1): values against
torch's convolution, its schedule's counts, capacity."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autofuse import npu
from autofuse.npu.machine import CapacityError

# (x shape, w shape, params): a ViT's patch embedding (kernel = stride), 3×3 stride 1 pad 1, 1×1, depthwise 1-D
# short convolutions (LFM2's kernel 3 and Mamba's kernel 4, causally padded), Whisper's Conv1d with stride 2,
# prime channel counts, a kernel taller than the input, padding and dilation 2, groups that are not depthwise
CASES = [
    ((1, 3, 32, 32), (48, 3, 16, 16), {"stride": 16}),
    ((2, 8, 9, 11), (12, 8, 3, 3), {"padding": 1}),
    ((2, 16, 7, 5), (24, 16, 1, 1), {}),
    ((2, 16, 20), (16, 1, 3), {"padding": 2, "groups": 16}),
    ((1, 24, 33), (24, 1, 4), {"padding": 3, "groups": 24}),
    ((1, 20, 37), (16, 20, 3), {"stride": 2, "padding": 1}),
    ((1, 7, 13, 11), (11, 7, 3, 5), {"padding": (1, 2)}),
    ((2, 5, 3, 8), (7, 5, 5, 3), {"padding": (2, 1)}),
    ((1, 13, 12, 10), (17, 13, 3, 3), {"padding": 2, "dilation": 2}),
    ((1, 12, 8, 9), (18, 4, 3, 3), {"stride": (2, 1), "padding": 1, "groups": 3}),
]
DEVICES = ("ascend910", "ascend910b", "ascend310p")
U = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}     # unit roundoff


def _conv(x, w, b, params):
    return (F.conv1d if x.dim() == 3 else F.conv2d)(x, w, b, **params)


def _run(xs, ws, params, dtype, device, bias=True, tiling=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    x = torch.randn(xs, generator=g).to(dt)
    w = torch.randn(ws, generator=g).to(dt)
    b = torch.randn(ws[0], generator=g).to(dt) if bias else None
    r = npu.run("conv", x, w, bias=b, device=device, tiling=tiling, **params)
    return x, w, b, r


def _bound(x, w, b, params, dtype):
    """The float64 reference and how far the kernel may be from it: the Cube's products of fp16/bf16 values are
    exact in fp32 and fp32 ones are rounded once; the K of them and the bias are summed in fp32, each addition
    rounding once, so the sum is within γ_{K+1}·Σ|x·w| + |b| (γ_n = n·u / (1 - n·u), u = 2⁻²⁴) of the exact one
    (Higham, Accuracy and Stability, 3.1); an fp16/bf16 output is then rounded once more (half an ulp of the
    value: its unit roundoff relative, and half fp16's least subnormal absolute)."""
    xd, wd = x.double(), w.double()
    ref = _conv(xd, wd, None if b is None else b.double(), params)
    mag = _conv(xd.abs(), wd.abs(), None if b is None else b.double().abs(), params)
    K = w[0].numel() + 1
    u32 = 2.0 ** -24
    acc = K * u32 / (1 - K * u32) * mag
    if dtype == "float32":
        return ref, acc
    return ref, acc + U[dtype] * (ref.abs() + acc) + 2.0 ** -25


@pytest.mark.parametrize("i", range(len(CASES)))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_values_match_torch(i, dtype):
    xs, ws, params = CASES[i]
    device = DEVICES[(i + len(dtype)) % 3]
    x, w, b, r = _run(xs, ws, params, dtype, device, bias=i % 4 != 2)
    (out,) = r.torch_outputs()
    ref, bound = _bound(x, w, b, params, dtype)
    assert out.shape == ref.shape and out.dtype == x.dtype
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), float((err - bound).max())
    if dtype == "float32":           # torch's own fp32 convolution is within the same bound of the reference
        eager = _conv(x, w, b, params).double()
        assert ((out.double() - eager).abs() <= 2 * bound).all()
    assert r.stats.busy["cube"] > 0


@pytest.mark.parametrize("tiling", [
    {"m0": 16, "n0": 16, "k0": 16, "c1": 1},          # one channel a chunk, a slice per kernel row
    {"m0": 48, "n0": 16, "k0": 32, "c1": 3},          # chunks that do not divide the channels, k0 not dividing k1
    {"m0": 32, "n0": 32, "k0": 64, "c1": 13},         # every channel in one chunk
])
def test_tilings_give_torchs_values(tiling):
    xs, ws, params = (1, 13, 12, 10), (20, 13, 3, 3), {"padding": 1, "stride": (1, 2)}
    for device in DEVICES:
        x, w, b, r = _run(xs, ws, params, "float16", device, tiling=tiling)
        ref, bound = _bound(x, w, b, params, "float16")
        assert ((r.torch_outputs()[0].double() - ref).abs() <= bound).all(), device


def test_hbm_reads_are_the_bands_not_the_img2col_matrix():
    """A 3×3 convolution in blocks of 4 output rows: each block's band is the 6 input rows they read (5 at the
    image's edges), all channels and columns; HBM moves the bands, the weights once (the other blocks hit L2) and
    the output, far less than the img2col matrix (9× the input). load3d moves that matrix's fractals to L0A."""
    C, H = 32, 32
    _, _, _, r = _run((1, C, H, H), (C, C, 3, 3), {"padding": 1}, "float16", "ascend910", bias=False,
                      tiling={"m0": 4 * H, "n0": C, "k0": 64, "c1": 16})
    s = r.stats
    band_rows = 5 + 6 * 6 + 5                      # 8 blocks
    bands, w_bytes, out_bytes = band_rows * C * H * 2, C * C * 9 * 2, C * H * H * 2
    assert s.bytes["GM->L1"] == bands + 8 * w_bytes
    assert s.hbm_bytes == bands + w_bytes + out_bytes
    img2col = H * H * C * 9 * 2
    assert s.hbm_bytes < img2col / 3
    assert s.bytes["L1->L0A"] == img2col


def test_absurd_tilings_are_refused_naming_the_buffer():
    xs, ws = (1, 16, 8, 8), (16, 16, 3, 3)
    with pytest.raises(ValueError, match="L0A"):
        _run(xs, ws, {"padding": 1}, "float32", "ascend910", tiling={"m0": 1024, "n0": 16, "k0": 128, "c1": 1})
    with pytest.raises(ValueError, match="channels per chunk"):
        _run(xs, ws, {"padding": 1}, "float32", "ascend910", tiling={"m0": 16, "n0": 16, "k0": 16, "c1": 17})
    wide = torch.zeros(1, 64, 4, 8192, device="meta")       # bands of 64 channels × 4 rows × 8192 columns
    w = torch.zeros(32, 64, 3, 3, device="meta")
    with pytest.raises(ValueError, match="L1"):
        npu.run("conv", wide, w, padding=1, timing_only=True, tiling={"m0": 256, "n0": 32, "k0": 64, "c1": 64})
    # the default tiling shrinks its chunks and rows until the bands fit: 512 KB of L1 on the 910B
    r = npu.run("conv", wide, w, padding=1, timing_only=True, device="ascend910b")
    assert r.stats.busy["cube"] > 0


def test_capacity_is_the_simulators():
    """The check mirrors the allocations: a tiling it passes allocates; past it the simulator raises."""
    from autofuse.npu.kernels.conv import tiling_overflow
    from autofuse.npu.machine import Launch
    from cost_model.conv import geometry
    from cost_model.devices import get_device
    dev = get_device("ascend910b")
    geo = geometry((1, 64, 4, 8192), (32, 64, 3, 3), padding=1)
    t = {"m0": 256, "n0": 32, "k0": 64, "c1": 64}
    assert tiling_overflow(dev, "float16", geo, t) == "L1"
    g = Launch(dev, "conv").group("aic", 1)
    with pytest.raises(CapacityError, match="L1"):
        for i in range(2):
            g.alloc("L1", (t["c1"], geo.rows(t["m0"]), geo.W), "float16", f"band{i}")


def test_errors_name_the_problem():
    x, w = torch.zeros(1, 6, 8, 8), torch.zeros(4, 4, 3, 3)
    with pytest.raises(ValueError, match="groups"):
        npu.run("conv", x, w, groups=1)
    with pytest.raises(TypeError, match="cast"):
        npu.run("conv", x, w.half()[:, :3], groups=2)
    with pytest.raises(ValueError, match="no output"):
        npu.run("conv", torch.zeros(1, 4, 2, 2), torch.zeros(4, 4, 3, 3))


def test_timing_only_counts_as_the_full_launch():
    xs, ws, params = CASES[1]
    _, _, _, full = _run(xs, ws, params, "float16", "ascend910b")
    timed = npu.run("conv", torch.zeros(xs, dtype=torch.float16, device="meta"),
                    torch.zeros(ws, dtype=torch.float16, device="meta"),
                    bias=torch.zeros(ws[0], dtype=torch.float16, device="meta"), device="ascend910b",
                    timing_only=True, **params)
    assert timed.stats.cycles == full.stats.cycles and timed.stats.hbm_bytes == full.stats.hbm_bytes
    assert timed.stats.bytes == full.stats.bytes
    assert np.all([o.shape == f.shape for o, f in zip(timed.outputs, full.outputs)])
