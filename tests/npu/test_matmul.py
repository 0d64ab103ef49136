"""Cube matmul against torch: odd shapes, dtypes, transposes, bias, batches, devices, tilings."""
import numpy as np
import pytest
import torch

from autofuse import npu
from autofuse.npu.kernels.matmul import default_tiling, tiling_fits
from cost_model.devices import get_device

DEVICES = ["ascend910", "ascend910b", "ascend310p"]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


def _ref(a, b, bias=None):
    out = a.float() @ b.float()
    return out if bias is None else out + bias.float()


def _close(got, ref, dtype):
    # one rounding of the fp32 accumulator to the output dtype, relative to the output's magnitude
    got = torch.as_tensor(np.asarray(got, dtype=np.float32))
    err = (got - ref).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mkn", [(1, 1, 1), (37, 50, 29), (128, 64, 96), (300, 17, 130)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_matmul_matches_torch(device, mkn, dtype):
    M, K, N = mkn
    g = torch.Generator().manual_seed(M * 7 + K)
    a, b = torch.randn(M, K, generator=g, dtype=dtype), torch.randn(K, N, generator=g, dtype=dtype)
    r = npu.run("matmul", a, b, device=device)
    assert r.outputs[0].shape == (M, N)
    _close(r.outputs[0], _ref(a, b), dtype)


@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (True, False), (True, True)])
def test_transposed_operands(trans_a, trans_b):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(45, 70, generator=g, dtype=torch.float16)
    b = torch.randn(33, 70, generator=g, dtype=torch.float16)
    A = a.T.contiguous() if trans_a else a
    B = b if trans_b else b.T.contiguous()
    r = npu.run("matmul", A, B, trans_a=trans_a, trans_b=trans_b)
    _close(r.outputs[0], _ref(a, b.T), torch.float16)


def test_bias_and_batch_broadcast():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 1, 20, 24, generator=g, dtype=torch.float16)
    b = torch.randn(4, 24, 18, generator=g, dtype=torch.float16)
    bias = torch.randn(18, generator=g, dtype=torch.float16)
    r = npu.run("matmul", a, b, bias=bias, device="ascend910b")
    assert r.outputs[0].shape == (3, 4, 20, 18)
    _close(r.outputs[0], _ref(a, b, bias), torch.float16)


def test_batched_rows_against_one_weight_fold_into_one_gemm():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 40, generator=g)
    w = torch.randn(40, 24, generator=g)
    r = npu.run("matmul", x, w)
    assert r.outputs[0].shape == (2, 5, 24)
    _close(r.outputs[0], _ref(x, w), torch.float32)
    assert r.stats.hbm_bytes == (x.numel() + w.numel() + 2 * 5 * 24) * 4


def test_explicit_tiling_is_used_and_checked():
    a = np.ones((64, 64), np.float16)
    small = npu.run("matmul", a, a, tiling={"m0": 16, "n0": 16, "k0": 16, "k1": 16})
    big = npu.run("matmul", a, a, tiling={"m0": 64, "n0": 64, "k0": 64, "k1": 64})
    assert small.stats.bytes["GM->L1"] > big.stats.bytes["GM->L1"]
    np.testing.assert_array_equal(small.outputs[0], big.outputs[0])
    with pytest.raises(ValueError, match="does not fit"):
        npu.run("matmul", a, a, tiling={"m0": 512, "n0": 512, "k0": 128, "k1": 128})


@pytest.mark.parametrize("device", DEVICES)
def test_default_tilings_fit(device):
    dev = get_device(device)
    for shape in [(1, 1, 1), (4096, 4096, 4096), (17, 9000, 33), (100000, 64, 64)]:
        t = default_tiling(dev, *shape, 1, "float16", "float16")
        assert tiling_fits(dev, "float16", "float16", t)


def test_cube_cycles_count_every_fractal_once():
    a = np.ones((512, 512), np.float16)
    s = npu.run("matmul", a, a, device="ascend310p").stats
    assert s.busy_total["cube"] == 512 ** 3 // 4096        # one 16x16x16 fractal per cycle, all cores


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="inner dims differ"):
        npu.run("matmul", np.ones((3, 4), np.float16), np.ones((5, 6), np.float16))
    with pytest.raises(TypeError, match="a is float16 but b is float32"):
        npu.run("matmul", np.ones((3, 4), np.float16), np.ones((4, 6), np.float32))
    with pytest.raises(TypeError, match="Cube takes"):
        npu.run("matmul", np.ones((3, 4), np.int32), np.ones((4, 6), np.int32))
