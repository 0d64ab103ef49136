"""matmul_epilogue: GELU, SwiGLU on a fused gate_up, residual, bias and casts, against torch, on every device;
what stays on chip; errors."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autofuse import npu
from autofuse.ops_vector import reference_matmul_epilogue
from cost_model.program import Builder, ProgramError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cost_model_accuracy import epilogue  # noqa: E402

DEVICES = ("ascend910", "ascend910b", "ascend310p")


def operands(M, K, N, seed=0, trans_b=False):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) / 8).half()
    b = (torch.randn(N, K) if trans_b else torch.randn(K, N, generator=g)) / 8
    return a, b.half()


def extras(p, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(i.shape, generator=g).to(getattr(torch, i.dtype)) for i in p.inputs[1:]]


def close(got, want, dtype):
    # the product is accumulated in fp32 in another order than torch's (K-chunked on the Cube): a few fp32
    # ulps, which may move an fp16 product across a rounding boundary (one fp16 ulp, 2^-10 relative) before
    # the epilogue; the epilogue's own fp32 steps add a few fp32 ulps; then one rounding of the output
    got = torch.from_numpy(np.asarray(got)).double()
    want = want.double()
    tol = {"float16": 2 ** -9, "bfloat16": 2 ** -6, "float32": 2 ** -9}[dtype]
    assert (got - want).abs().max() <= tol * want.abs().max() + 1e-5, (got - want).abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind, M, K, N, product", [
    ("gelu", 200, 96, 160, "float16"), ("swiglu", 130, 64, 192, "float16"), ("residual", 77, 64, 333, "float32"),
    ("bias_silu_cast", 100, 48, 80, "float32")])
def test_epilogues_match_torch(device, kind, M, K, N, product):
    p, _ = epilogue(kind, M, N, product=product)
    a, b = operands(M, K, N)
    ex = extras(p)
    r = npu.run("matmul_epilogue", a, b, *ex, program=p, device=device)
    ref = reference_matmul_epilogue(a, b, None, ex, p)
    for got, want, o in zip(r.outputs, ref, p.outputs):
        assert got.shape == tuple(want.shape)
        close(got, want, o.dtype)


@pytest.mark.parametrize("m0, sub", [(48, 16), (32, 8), (64, 24)])
def test_split_cores_several_sub_blocks_per_half(m0, sub):
    """On split cores each AIV loads its half of the tile's product sub-block by sub-block: with several
    sub-blocks per half, each one's load goes to the other buffer while the previous one is worked on."""
    p, _ = epilogue("residual", 96, 200, product="float32")
    a, b = operands(96, 32, 200)
    ex = extras(p)
    r = npu.run("matmul_epilogue", a, b, *ex, program=p, device="ascend910b",
                tiling={"m0": m0, "n0": 64, "k0": 32, "k1": 32, "sub": sub})
    close(r.outputs[0], reference_matmul_epilogue(a, b, None, ex, p)[0], "float16")


def test_eager_matmul_then_gelu_and_swiglu():
    """Eager: an fp16 matmul (fp32 accumulation, rounded) then the op; the kernel with an fp16 product."""
    a, b = operands(64, 128, 96)
    p, _ = epilogue("gelu", 64, 96)
    got = npu.run("matmul_epilogue", a, b, program=p, device="ascend910").outputs[0]
    eager = F.gelu((a.float() @ b.float()).half().float()).half()
    close(got, eager.float(), "float16")
    p, _ = epilogue("swiglu", 64, 96)
    got = npu.run("matmul_epilogue", a, b, program=p, device="ascend910b").outputs[0]
    gu = (a.float() @ b.float()).half().float()
    close(got, (F.silu(gu[:, :48]) * gu[:, 48:]).half().float(), "float16")


def test_bias_trans_b_and_batched_rows():
    B, S, K, N = 2, 40, 64, 72
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(B, S, K, generator=g) / 8).half()
    w = (torch.randn(N, K, generator=g) / 8).half()
    bias = torch.randn(N, generator=g)
    bld = Builder((B, S))
    acc = bld.input("float32", (B, S, N))
    bld.output(bld.relu(acc), "float16")
    p = bld.build()
    for dev in DEVICES:
        r = npu.run("matmul_epilogue", a, w, program=p, bias=bias, trans_b=True, device=dev)
        close(r.outputs[0], torch.relu(a.float() @ w.float().T + bias), "float16")


def test_whole_row_epilogue():
    """A reduction after the matmul (RMSNorm of its rows): tiles as wide as the row."""
    M, K, N = 96, 64, 200
    b_ = Builder((M,))
    acc, w = b_.input("float32", (M, N)), b_.input("float16", (N,))
    r_ = b_.rsqrt(b_.add(b_.reduce(b_.mul(acc, acc), kind="mean"), 1e-6))
    b_.output(b_.mul(b_.mul(acc, r_), w), "float16")
    p = b_.build()
    a, b = operands(M, K, N)
    ex = extras(p)
    for dev in DEVICES:
        r = npu.run("matmul_epilogue", a, b, *ex, program=p, device=dev)
        close(r.outputs[0], reference_matmul_epilogue(a, b, None, ex, p)[0], "float16")


def test_the_pre_activation_stays_on_chip():
    """Coupled: no GM traffic for the product (no workspace, HBM = operands + output). Split: the product
    goes through an L2 workspace, and never the 2F-wide gate_up output."""
    M, K, F_ = 256, 128, 256
    p, _ = epilogue("swiglu", M, 2 * F_)
    a, b = operands(M, K, 2 * F_)
    r = npu.run("matmul_epilogue", a, b, program=p, device="ascend910")
    assert r.stats.workspace_bytes == 0 and "L0C->GM" not in r.stats.bytes
    assert r.stats.bytes["UB->GM"] == M * F_ * 2                       # the F-wide output only
    r = npu.run("matmul_epilogue", a, b, program=p, device="ascend910b")
    assert r.stats.workspace_bytes > 0 and r.stats.bytes["UB->GM"] == M * F_ * 2
    # HBM: the operands, the output, and what of the workspace is still dirty in L2 at the end
    assert r.stats.hbm_bytes <= (a.numel() + b.numel()) * 2 + M * F_ * 2 + r.stats.workspace_bytes


def test_errors():
    a, b = operands(32, 16, 48)
    bad = Builder((32,))
    bad.output(bad.exp(bad.input("bfloat16", (32, 48))), "float16")
    with pytest.raises(ProgramError, match="product"):
        npu.run("matmul_epilogue", a, b, program=bad.build())
    p, _ = epilogue("swiglu", 32, 48)
    with pytest.raises(ProgramError, match="bias"):
        npu.run("matmul_epilogue", a, b, program=p, bias=torch.zeros(48))
    with pytest.raises(ValueError, match="does not fit"):
        npu.run("matmul_epilogue", a, b, program=p, tiling={"m0": 4096, "n0": 4096, "k0": 16, "k1": 16, "sub": 16})
    with pytest.raises(ValueError, match="inner dims"):
        npu.run("matmul_epilogue", a, b[:8], program=p)
