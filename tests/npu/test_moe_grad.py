"""moe_finalize_routing_grad and moe_gating_topk_grad kernels vs float64 autograd of the forward math: dtypes,
k, H split into chunks, rows named twice or never (zero fill and atomic adds), every router variant; capacity,
timing-only launches and errors."""
import numpy as np
import pytest
import torch

from autofuse import npu, ops_moe

DEVICES = ["ascend910", "ascend910b", "ascend310p"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
TINY = {torch.float32: 2.0 ** -149, torch.float16: 2.0 ** -24, torch.bfloat16: 2.0 ** -133}   # subnormal step


def _finalize_ref(g, e, sc, ridx):
    """float64 autograd of out = Σ_j scales[:, j]·expanded[ridx[t·k + j]] from the inputs' values."""
    T, k = sc.shape
    ee, ss = e.double().requires_grad_(), sc.double().requires_grad_()
    (ee[ridx.long()].reshape(T, k, -1) * ss[:, :, None]).sum(1).backward(g.double())
    return ee.grad, ss.grad


def _finalize_check(g, e, sc, ridx, d_exp, d_sc):
    T, k = sc.shape
    H = g.shape[1]
    want_e, want_s = _finalize_ref(g, e, sc, ridx)
    # d_expanded: each product exact to fp32 rounding, then one rounding to the dtype (half an ulp); a row named
    # twice adds two rounded products in the dtype (one more rounding): eps·Σ|terms| plus the subnormal step
    terms = torch.zeros_like(want_e)
    terms.index_add_(0, ridx.long(), (g.double()[:, None, :] * sc.double()[:, :, None]).abs().reshape(T * k, H))
    assert (d_exp.double() - want_e).abs().le(2 * EPS[e.dtype] * terms + TINY[e.dtype]).all()
    # d_scales: fp32 sums of H exact products (each partial sum within H·2^-24 of Σ|terms|), one rounding to
    # scales' dtype
    dots = (g.double()[:, None, :].abs() * e.double()[ridx.long()].abs().reshape(T, k, H)).sum(-1)
    assert (d_sc.double() - want_s).abs().le(H * 2.0 ** -24 * dots + EPS[sc.dtype] * want_s.abs() + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,k,H", [(7, 2, 40), (5, 1, 64), (9, 4, 24), (1, 2, 16)])
def test_finalize_grad_permutation(dtype, T, k, H):
    torch.manual_seed(T * k)
    g, e, sc = torch.randn(T, H).to(dtype), torch.randn(T * k, H).to(dtype), torch.rand(T, k)
    ridx = torch.randperm(T * k).int()
    d_exp, d_sc = npu.run("moe_finalize_routing_grad", g, e, sc, ridx).torch_outputs()
    assert d_exp.dtype == dtype and d_sc.dtype == torch.float32
    _finalize_check(g, e, sc, ridx, d_exp, d_sc)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_finalize_grad_repeated_and_unused_rows(device, dtype):
    """Rows named twice get the sum of their products, rows never named stay zero (accumulate=True)."""
    torch.manual_seed(3)
    T, k, H, R = 11, 3, 48, 40
    g, e, sc = torch.randn(T, H).to(dtype), torch.randn(R, H).to(dtype), torch.rand(T, k).to(dtype)
    ridx = torch.randint(0, R - 6, (T * k,)).int()                 # repeats likely; the last 6 rows never named
    assert ridx.unique().numel() < T * k
    d_exp, d_sc = npu.run("moe_finalize_routing_grad", g, e, sc, ridx, accumulate=True, device=device).torch_outputs()
    assert d_sc.dtype == dtype
    _finalize_check(g, e, sc, ridx, d_exp, d_sc)
    assert (d_exp[R - 6:] == 0).all()
    with pytest.raises(ValueError, match="accumulate=True"):
        npu.run("moe_finalize_routing_grad", g, e, sc, ridx, device=device)


def test_finalize_grad_chunks_blocks_and_twin():
    """H in several chunks (the dots add their parts), tokens in several index blocks: the same values as the
    whole-row tiling; and the op's twin gives them too."""
    torch.manual_seed(5)
    T, k, H = 13, 2, 200
    g, e, sc = torch.randn(T, H).half(), torch.randn(T * k, H).half(), torch.rand(T, k)
    ridx = torch.randperm(T * k).int()
    whole = npu.run("moe_finalize_routing_grad", g, e, sc, ridx).torch_outputs()
    parts = npu.run("moe_finalize_routing_grad", g, e, sc, ridx, tiling={"block": 2, "cols": 64}).torch_outputs()
    _finalize_check(g, e, sc, ridx, *parts)
    assert torch.equal(whole[0], parts[0])                    # the same product and rounding per element
    # the dots: fp32 sums in another grouping, each within H·2^-24 of Σ|terms|
    _finalize_check(g, e, sc, ridx, *whole)
    twin = ops_moe.reference_moe_finalize_routing_grad(g, e, sc, ridx)
    assert torch.equal(twin[0], whole[0])
    dots = (g.float()[:, None].abs() * e.float()[ridx.long()].abs().reshape(T, k, H)).sum(-1)
    assert (twin[1] - whole[1]).abs().le(2 * H * 2.0 ** -24 * dots).all()


def test_finalize_grad_capacity_timing_only_and_errors():
    T, k, H = 6, 2, 32
    g, e, sc = torch.randn(T, H), torch.randn(T * k, H), torch.rand(T, k)
    ridx = torch.randperm(T * k).int()
    full = npu.run("moe_finalize_routing_grad", g, e, sc, ridx).stats
    timing = npu.run("moe_finalize_routing_grad", g, e, sc, ridx, timing_only=True).stats
    assert (timing.cycles, timing.hbm_bytes, timing.bytes) == (full.cycles, full.hbm_bytes, full.bytes)
    with pytest.raises(Exception, match="UB"):                  # rows too wide for UB: a capacity error
        npu.run("moe_finalize_routing_grad", torch.randn(2, 1 << 17), torch.randn(4, 1 << 17), torch.rand(2, 2),
                torch.randperm(4).int(), tiling={"cols": 1 << 17})
    with pytest.raises(IndexError, match="out of range"):
        npu.run("moe_finalize_routing_grad", g, e, sc, torch.full((T * k,), T * k).int())
    with pytest.raises(TypeError, match="int32"):
        npu.run("moe_finalize_routing_grad", g, e, sc, ridx.long())
    with pytest.raises(TypeError, match="cast grad"):
        npu.run("moe_finalize_routing_grad", g.half(), e, sc, ridx)


# ------------------------------------------------------------------------------------------ gating
VARIANTS = [dict(k=2, norm="softmax", renorm=True, eps=0.0), dict(k=2, norm="softmax"),
            dict(k=3, norm="sigmoid", renorm=True, eps=1e-20, routed_scaling_factor=2.5),
            dict(k=1, norm="none", routed_scaling_factor=2.0), dict(k=4, norm="sigmoid"),
            dict(k=4, norm="softmax", renorm=True, eps=1e-3, routed_scaling_factor=0.5)]


def _gating_ref(x, gw, idx, p):
    """float64 autograd of the router's weights w.r.t. the logits, the experts fixed."""
    xl = x.double().requires_grad_()
    y, _ = ops_moe.reference_moe_gating_topk(xl, None, **p, upcast=True, indices=idx.long())
    y.backward(gw.double())
    return xl.grad


def _grad_scale(x, gw, idx, p):
    """The largest |dy| the chain can make: ``c·|gw|``, times ``2 / (Σy + eps)`` with renormalisation."""
    c = p.get("routed_scaling_factor", 1.0) * gw.abs().max().item()
    if not p.get("renorm"):
        return c
    s = x.double()
    s = torch.softmax(s, -1) if p["norm"] == "softmax" else torch.sigmoid(s) if p["norm"] == "sigmoid" else s
    return c * 2 / (s.gather(-1, idx.long()).sum(-1) + p.get("eps", 1e-20)).min().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
def test_gating_grad(dtype, variant):
    p = VARIANTS[variant]
    torch.manual_seed(variant)
    T, E = 37, 8
    x = torch.randn(T, E).to(dtype)
    idx = torch.rand(T, E).argsort(-1)[:, :p["k"]].int()         # any distinct experts: the gradient's choice
    gw = torch.randn(T, p["k"]).to(dtype if variant % 2 else torch.float32)
    dx, = npu.run("moe_gating_topk_grad", x, gw, idx, **p).torch_outputs()
    assert dx.dtype == dtype and dx.shape == x.shape
    want = _gating_ref(x, gw, idx, p)
    # fp32 throughout over E = 8 experts (each step a few fp32 ulps of the largest term: 2^-16 of the scale
    # covers them) and one rounding to x's dtype (half an ulp)
    scale = _grad_scale(x, gw, idx, p)
    bound = EPS[dtype] * want.abs() + 2.0 ** -16 * scale + TINY[dtype]
    assert (dx.double() - want).abs().le(bound).all()
    twin = ops_moe.reference_moe_gating_topk_grad(x, gw, idx, **p)
    assert (twin.double() - dx.double()).abs().le(2 * bound).all()
    # the experts not chosen get a gradient only through the softmax's normaliser
    if p["norm"] != "softmax":
        hit = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx.long(), True)
        assert (dx[~hit] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_gating_grad_tiles_and_timing_only(device):
    torch.manual_seed(2)
    T, E, k = 300, 64, 6
    x, gw = torch.randn(T, E), torch.randn(T, k)
    idx = torch.rand(T, E).argsort(-1)[:, :k].int()
    p = dict(k=k, renorm=True, routed_scaling_factor=2.5)
    full = npu.run("moe_gating_topk_grad", x, gw, idx, device=device, **p)
    other = npu.run("moe_gating_topk_grad", x, gw, idx, device=device, tiling={"lanes": 8}, **p)
    assert torch.equal(full.torch_outputs()[0], other.torch_outputs()[0])       # per lane, the same steps
    timing = npu.run("moe_gating_topk_grad", x, gw, idx, device=device, timing_only=True, **p).stats
    assert (timing.cycles, timing.hbm_bytes) == (full.stats.cycles, full.stats.hbm_bytes)


def test_gating_grad_capacity_and_errors():
    x, gw, idx = torch.randn(16, 8), torch.randn(16, 2), torch.zeros(16, 2, dtype=torch.int32)
    idx[:, 1] = 1
    with pytest.raises(Exception, match="UB"):                     # a tile of 8192 lanes does not fit
        npu.run("moe_gating_topk_grad", torch.randn(8192, 256), torch.randn(8192, 2),
                torch.zeros(8192, 2, dtype=torch.int32), k=2, tiling={"lanes": 8192})
    with pytest.raises(ValueError, match="norm="):
        npu.run("moe_gating_topk_grad", x, gw, idx, k=2, norm="relu")
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        npu.run("moe_gating_topk_grad", x, gw, idx, k=3)
    with pytest.raises(IndexError, match="out of range"):
        npu.run("moe_gating_topk_grad", x, gw, idx + 7, k=2)
