"""grouped_matmul_weight_grad and matmul_per_group_weight_grad kernels vs float64 torch: skewed loads, empty
experts (zero blocks), rows past the last group, group lists as counts and running sums, tilings, errors."""
import numpy as np
import pytest
import torch

from autofuse import npu

DEVICES = ["ascend910", "ascend910b", "ascend310p"]


def _ref(lhs, rhs, counts):
    out, s = [], 0
    for c in counts:
        out.append(lhs[s:s + c].double().T @ rhs[s:s + c].double())
        s += c
    return torch.stack(out)


def _bound(lhs, rhs, counts, dtype):
    """fp32 accumulation of products of exact operands (error ~ rows·2^-24·|terms|) and one rounding to the
    output dtype (half an ulp of the largest |value|): 2 ulps of the output dtype at the largest magnitude
    covers both on any CPU."""
    ref = _ref(lhs, rhs, counts)
    eps = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    terms = _ref(lhs.abs(), rhs.abs(), counts)
    return ref, 2 * eps * terms.max().item() + 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_weight_grad(device, dtype):
    torch.manual_seed(0)
    counts = [30, 0, 70, 5]                       # skewed, an empty expert
    M = sum(counts) + 3                           # rows past the last group: not read
    lhs, rhs = torch.randn(M, 96).to(dtype), torch.randn(M, 80).to(dtype)
    lhs[sum(counts):] = float("nan")              # a read of them would show
    r = npu.run("grouped_matmul_weight_grad", lhs, rhs, torch.tensor(counts, dtype=torch.int32), device=device)
    got = r.torch_outputs()[0]
    assert got.dtype == dtype and got.shape == (4, 96, 80)
    ref, tol = _bound(lhs, rhs, counts, dtype)
    assert (got[1] == 0).all()                    # the empty expert's block is written, zero
    assert (got.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("device", DEVICES)
def test_cumsum_tilings_and_the_per_group_baseline_agree(device):
    torch.manual_seed(1)
    counts = [0, 17, 1, 0, 40, 33]                # empty first and in the middle, a one-row group
    M = sum(counts)
    lhs, rhs = torch.randn(M, 50).to(torch.float16), torch.randn(M, 130).to(torch.float16)
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    ref, tol = _bound(lhs, rhs, counts, torch.float16)
    for tiling in (None, {"m0": 16, "n0": 32, "k0": 16, "k1": 32}, {"m0": 64, "n0": 128, "k0": 32, "k1": 96}):
        got = npu.run("grouped_matmul_weight_grad", lhs, rhs, offs, group_list_type="cumsum", tiling=tiling,
                      device=device).torch_outputs()[0]
        assert (got.double() - ref).abs().max().item() <= tol, tiling
    base = npu.run("matmul_per_group_weight_grad", lhs, rhs, offs, device=device)
    assert (base.torch_outputs()[0].double() - ref).abs().max().item() <= tol
    fused = npu.run("grouped_matmul_weight_grad", lhs, rhs, offs, group_list_type="cumsum", device=device)
    assert fused.stats.cycles < base.stats.cycles          # one launch vs four


def test_all_groups_empty_writes_zeros():
    lhs, rhs = torch.randn(8, 32), torch.randn(8, 48)
    for device in DEVICES:
        got = npu.run("grouped_matmul_weight_grad", lhs, rhs, torch.zeros(3, dtype=torch.int32),
                      device=device).torch_outputs()[0]
        assert got.shape == (3, 32, 48) and (got == 0).all()


def test_timing_only_matches_full_run():
    torch.manual_seed(2)
    lhs, rhs = torch.randn(300, 64).half(), torch.randn(300, 96).half()
    gl = torch.tensor([100, 0, 150, 50], dtype=torch.int32)
    full = npu.run("grouped_matmul_weight_grad", lhs, rhs, gl, device="ascend910b").stats
    timed = npu.run("grouped_matmul_weight_grad", lhs, rhs, gl, device="ascend910b", timing_only=True).stats
    assert (full.cycles, full.hbm_bytes) == (timed.cycles, timed.hbm_bytes)


def test_errors():
    a = torch.zeros(10, 16)
    with pytest.raises(ValueError, match="share their rows"):
        npu.run("grouped_matmul_weight_grad", a, torch.zeros(9, 16), torch.tensor([5, 5]))
    with pytest.raises(TypeError, match="cast one of them"):
        npu.run("grouped_matmul_weight_grad", a, torch.zeros(10, 16).half(), torch.tensor([5, 5]))
    with pytest.raises(ValueError, match="covers 11 rows"):
        npu.run("grouped_matmul_weight_grad", a, a, torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="does not fit"):
        npu.run("grouped_matmul_weight_grad", a, a, torch.tensor([5, 5]),
                tiling={"m0": 512, "n0": 512, "k0": 256, "k1": 512}, device="ascend910b")
