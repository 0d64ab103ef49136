"""layer_norm / rms_norm / add_rms_norm kernels vs torch: dtypes, ragged H, chunked rows, stats, timing."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autofuse import npu
from autofuse.npu.machine import CapacityError
from cost_model.devices import get_device

# fp32: y = d * rstd * w + b sums terms of magnitude up to ~10 here; different reduction orders move rstd
# by a few ulps, so y may differ by a few ulps of those terms (1e-5). rstd/mean: a few ulps (1e-5
# relative). fp16/bf16: the reference is torch in fp32 on the same inputs; one rounding of y.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
STAT_TOL = dict(rtol=1e-5, atol=1e-6)
DTYPES = list(TOL)
CASES = [((3, 37, 129), None), ((64, 1000), None), ((5, 1000), {"rows": 2, "chunk": 256}), ((16, 64), None),
         ((2, 70000), None)]          # the last has rows longer than UB: chunked by default


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a)).float()


def _inputs(shape, dtype, seed=0):
    torch.manual_seed(seed)
    H = shape[-1]
    return ((torch.randn(shape) + 2).to(dtype), torch.randn(H).to(dtype), torch.randn(H).to(dtype),
            torch.randn(shape).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,tiling", CASES)
def test_layer_norm(shape, tiling, dtype):
    x, w, b, _ = _inputs(shape, dtype)
    H = shape[-1]
    y, mean, rstd = npu.run("layer_norm", x, w, b, eps=1e-5, tiling=tiling, return_stats=True).outputs
    torch.testing.assert_close(_t(y), F.layer_norm(x.float(), (H,), w.float(), b.float(), 1e-5).to(dtype).float(),
                               **TOL[dtype])
    xf = x.float()
    torch.testing.assert_close(_t(mean), xf.mean(-1, keepdim=True), **STAT_TOL)
    torch.testing.assert_close(_t(rstd), torch.rsqrt(xf.var(-1, unbiased=False, keepdim=True) + 1e-5), **STAT_TOL)
    (y0,) = npu.run("layer_norm", x, eps=1e-5, tiling=tiling).outputs          # no affine, no stats
    torch.testing.assert_close(_t(y0), F.layer_norm(xf, (H,), eps=1e-5).to(dtype).float(), **TOL[dtype])


def _rms(x, w, eps):
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return x.float() * rstd * w.float(), rstd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,tiling", CASES)
def test_rms_norm(shape, tiling, dtype):
    x, w, _, _ = _inputs(shape, dtype, 1)
    y, rstd = npu.run("rms_norm", x, w, eps=1e-6, tiling=tiling).outputs
    ref, ref_rstd = _rms(x, w, 1e-6)
    assert rstd.shape == tuple(shape[:-1]) + (1,) and rstd.dtype == np.float32
    torch.testing.assert_close(_t(y), ref.to(dtype).float(), **TOL[dtype])
    torch.testing.assert_close(_t(rstd), ref_rstd, **STAT_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,tiling", CASES)
def test_add_rms_norm(shape, tiling, dtype):
    """The sum is rounded to x's dtype before the norm: what an add followed by RMSNorm computes."""
    x, w, _, res = _inputs(shape, dtype, 2)
    y, rstd, s = npu.run("add_rms_norm", x, res, w, eps=1e-6, tiling=tiling).outputs
    ref_s = x + res
    torch.testing.assert_close(_t(s), ref_s.float(), rtol=0, atol=0)
    ref, ref_rstd = _rms(ref_s, w, 1e-6)
    torch.testing.assert_close(_t(y), ref.to(dtype).float(), **TOL[dtype])
    torch.testing.assert_close(_t(rstd), ref_rstd, **STAT_TOL)


def test_mixed_weight_dtype_and_large_mean():
    """fp32 weights with bf16 activations; a large mean (no E[x²]-E[x]² cancellation, chunked too)."""
    torch.manual_seed(3)
    x = (torch.randn(8, 3000) * 0.01 + 1000).to(torch.bfloat16)
    w = torch.randn(3000)
    for tiling in (None, {"rows": 3, "chunk": 640}):
        (y,) = npu.run("layer_norm", x, w, None, tiling=tiling).outputs
        torch.testing.assert_close(_t(y), F.layer_norm(x.float(), (3000,), w, None, 1e-5).to(torch.bfloat16).float(),
                                   **TOL[torch.bfloat16])


def test_errors():
    x = np.ones((4, 64), np.float32)
    with pytest.raises(ValueError, match="weight has shape \\[32\\]; expected 64"):
        npu.run("rms_norm", x, np.ones(32, np.float32))
    with pytest.raises(ValueError, match="residual is \\[4, 32\\]"):
        npu.run("add_rms_norm", x, np.ones((4, 32), np.float32), np.ones(64, np.float32))
    with pytest.raises(TypeError, match="x is int32"):
        npu.run("layer_norm", np.ones((4, 64), np.int32))
    with pytest.raises(CapacityError, match="UB overflow"):
        npu.run("rms_norm", np.ones((64, 4096), np.float32), np.ones(4096, np.float32),
                tiling={"rows": 32, "chunk": 4096})


def _stats(kernel, rows, H=2048, device="ascend910"):
    torch.manual_seed(4)
    x, w = torch.randn(rows, H).half(), torch.randn(H).half()
    args = (x, x, w) if kernel == "add_rms_norm" else (x, w)
    return npu.run(kernel, *args, device=device).stats


def test_timing_scales_with_rows():
    a, b = _stats("rms_norm", 1024), _stats("rms_norm", 2048)
    assert 1.8 < (b.cycles - b.launch_cycles) / (a.cycles - a.launch_cycles) < 2.2


@pytest.mark.parametrize("kernel", ["rms_norm", "add_rms_norm"])
def test_rms_norms_on_910_run_at_hbm_speed(kernel):
    """Six fp32 passes per element hide under the HBM traffic: within 10 % of the bandwidth bound."""
    s = _stats(kernel, 2048)
    hbm = s.hbm_bytes / get_device("ascend910").hbm_bytes_per_cycle
    assert s.bound in ("mte2", "mte3")
    assert s.cycles - s.launch_cycles < 1.1 * hbm


def test_layer_norm_with_bias_on_910_is_vector_bound():
    torch.manual_seed(5)
    x, w, b = torch.randn(2048, 2048).half(), torch.randn(2048).half(), torch.randn(2048).half()
    s = npu.run("layer_norm", x, w, b).stats
    assert s.bound == "vector" and s.busy["vector"] > 0.85 * (s.cycles - s.launch_cycles)
