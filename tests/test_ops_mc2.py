"""``torch.ops.autofuse.matmul``, the MC2 backwards' local GEMM, on one process: values against float64 for every
transpose and dtype, the launch it records, its fake and its twin, and the shapes it refuses. The MC2 ops
themselves (and their backwards) need a process group: tests/test_distributed.py."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import autofuse.ops_mc2 as ops_mc2
from autofuse.ops import recording


def _operands(M, N, K, trans_a, trans_b, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(K, N, generator=g).to(dtype)
    return (a.t().contiguous() if trans_a else a), (b.t().contiguous() if trans_b else b), a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_matches_float64(dtype, trans_a, trans_b):
    A, B, a, b = _operands(40, 24, 72, trans_a, trans_b, dtype)
    with recording() as log:
        got = torch.ops.autofuse.matmul(A, B, trans_a, trans_b, "ascend910b")
    assert [k for k, _ in log] == ["matmul"] and log[0][1].cycles > 0
    ref = a.double() @ b.double()
    eager = (A.t() if trans_a else A) @ (B.t() if trans_b else B)
    assert got.dtype == dtype and got.shape == (40, 24)
    # fp32 accumulation rounded once to the dtype: within half an ulp of the largest output plus fp32's sum error,
    # which eager's max error over 960 outputs (at best the same single rounding) is not far below: at most twice it
    err = 2 * (eager.double() - ref).abs().max()
    assert (got.double() - ref).abs().max() <= err
    twin = ops_mc2.reference_matmul(A, B, trans_a, trans_b)          # the twin has the kernel's numerics
    assert (twin.double() - ref).abs().max() <= err


def test_matmul_fake_shapes():
    with FakeTensorMode():
        a, b = torch.empty(16, 40), torch.empty(24, 16)
        assert torch.ops.autofuse.matmul(a, b, True, True).shape == (40, 24)


def test_matmul_refuses_what_is_not_a_2d_product():
    with pytest.raises(ValueError, match="must be 2-D"):
        torch.ops.autofuse.matmul(torch.ones(2, 3, 4), torch.ones(4, 5))
    with pytest.raises(ValueError, match="inner dims"):
        torch.ops.autofuse.matmul(torch.ones(3, 4), torch.ones(3, 5))        # trans_a would make it fit
