"""Softmax kernel vs torch: dtypes, aligned and ragged shapes, any dim, long (chunked) rows, capacity, timing."""
import numpy as np
import pytest
import torch

from autofuse import npu
from autofuse.npu.kernels.softmax import default_tiling
from autofuse.npu.machine import CapacityError
from cost_model.devices import get_device

# fp32: both sides compute in fp32, with different exp implementations and summation orders: a few ulps
# of each output (rtol 1e-5) and 1e-6 absolute for the tiny probabilities. fp16/bf16: the reference is
# torch in fp32 on the same low-precision inputs, and the kernel's output carries one rounding to the
# element type (fp16: 2^-11 relative, bf16: 2^-8).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = list(TOL)


def _check(x, dim, **kw):
    r = npu.run("softmax", x, dim=dim, **kw)
    got = torch.from_numpy(r.outputs[0].astype(np.float32))
    ref = torch.softmax(x.float(), dim)
    assert r.dtypes == (str(x.dtype).replace("torch.", ""),)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, **TOL[x.dtype])
    return r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 129), (64, 256), (2, 3, 1000), (5, 7), (1, 1)])
def test_last_dim(dtype, shape):
    torch.manual_seed(0)
    _check((torch.randn(shape) * 3).to(dtype), -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((6, 37, 19), 1), ((6, 37, 19), 0), ((4, 2, 3, 200), 2), ((33, 64), 0)])
def test_other_dims(dtype, shape, dim):
    torch.manual_seed(1)
    _check((torch.randn(shape) * 3).to(dtype), dim)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_tiling_matches(dtype):
    """A row split into chunks (online max/sum, then a second pass) equals the one-pass result."""
    torch.manual_seed(2)
    x = (torch.randn(5, 1000) * 5).to(dtype)
    _check(x, -1, tiling={"block": 2, "chunk": 128})
    _check(x.T.contiguous(), 0, tiling={"block": 3, "chunk": 7})


def test_long_rows_are_chunked_and_reread_from_l2():
    """Rows longer than UB take the two-pass scheme by default; the second pass hits L2, not HBM."""
    torch.manual_seed(3)
    C = 70_000
    dev = get_device("ascend910")
    t = default_tiling(dev, "float32", 3, C, 1)
    assert t["chunk"] < C
    x = torch.randn(3, C) * 4
    r = npu.run("softmax", x, dim=-1)
    got = torch.from_numpy(r.outputs[0]).double()
    ref = torch.softmax(x.double(), -1)
    # A bound from the arithmetic, not from one CPU's exp: each probability is exp(x - max) / sum, with exp
    # good to 2 ulps and the fp32 row sum accumulated per Vector lane (64 lanes, C/64 terms each) then
    # across lanes; the relative error of a sum of positive terms is at most (terms - 1) roundings.
    eps = torch.finfo(torch.float32).eps
    rel = (C / 64 + 64 + 4) * eps
    assert torch.all((got - ref).abs() <= rel * ref + torch.finfo(torch.float32).tiny)
    nbytes = 3 * C * 4
    assert r.stats.bytes["GM->UB"] == 2 * nbytes          # every chunk loaded twice ...
    assert r.stats.hbm_bytes == 2 * nbytes                # ... but read from HBM once (+ the output)


def test_extreme_values():
    x = torch.tensor([[0.0, -float("inf"), 1.0], [1e4, 1e4, -1e4], [-1e4, -1e4, -1e4]])
    _check(x, -1)


def test_errors():
    with pytest.raises(TypeError, match="softmax: x is int32"):
        npu.run("softmax", np.ones((4, 4), np.int32))
    with pytest.raises(ValueError, match="dim 2 out of range"):
        npu.run("softmax", np.ones((4, 4), np.float32), dim=2)
    with pytest.raises(CapacityError, match="UB overflow"):
        npu.run("softmax", np.ones((64, 4096), np.float32), device="ascend910b",
                tiling={"block": 64, "chunk": 4096})


def test_default_tiling_fits_every_device():
    for name in npu.devices():
        dev = get_device(name)
        for dtype in ("float16", "bfloat16", "float32"):
            for outer, C, inner in ((4096, 4096, 1), (8, 100_000, 1), (2, 5000, 300)):
                t = default_tiling(dev, dtype, outer, C, inner)
                assert t["block"] >= 1 and 1 <= t["chunk"] <= C


def _cycles(rows, cols=1024, device="ascend910"):
    x = torch.randn(rows, cols).half()
    return npu.run("softmax", x, device=device).stats


def test_timing_scales_with_rows():
    a, b = _cycles(1024), _cycles(2048)
    ratio = (b.cycles - b.launch_cycles) / (a.cycles - a.launch_cycles)
    assert 1.8 < ratio < 2.2


def test_fp16_on_910_is_vector_bound():
    """Seven fp32 passes per element (64 lanes) outweigh 4 B of HBM traffic per element at 1.2 kB/cycle."""
    s = _cycles(2048, 2048)
    assert s.bound == "vector"
    assert s.busy["vector"] > 0.85 * (s.cycles - s.launch_cycles)    # loads and stores hide under it


def test_fp16_on_310p_is_memory_bound():
    """The 310P's DRAM (≈192 B/cycle for 15 cores) is far slower than its Vector units."""
    s = _cycles(512, 2048, device="ascend310p")
    assert s.bound in ("mte2", "mte3") and s.util["vector"] < 0.5
    assert s.cycles < 1.1 * s.hbm_bytes / get_device("ascend310p").hbm_bytes_per_cycle + s.launch_cycles


@pytest.mark.slow
def test_acceptance_4096_square_fp16_on_910():
    """The busiest unit is at least 85 % busy (double buffering, seven fp32 passes per element)."""
    torch.manual_seed(0)
    r = _check(torch.randn(4096, 4096).half(), -1)
    assert max(r.stats.util.values()) >= 0.85
