"""FlashAttention backward kernel (flash_attention_grad) against float64 torch autograd of attention: shapes
(GQA, Sq != Skv, odd sizes, Dv != D), dtypes, devices, causal, bool / additive masks, fully masked rows,
dropout with a known keep-mask, the saved-statistics path; its errors (capacity names the buffer)."""
import numpy as np
import pytest
import torch

from autofuse import npu
from autofuse.npu.kernels.flash_attention_grad import default_tiling, tiling_fits
from autofuse.ops import pack_keep, reference_flash_attention
from cost_model.devices import get_device

DEVICES = ["ascend910", "ascend910b", "ascend310p"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _inputs(B, N, Nkv, Sq, Skv, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, N, Sq, D), (B, Nkv, Skv, D), (B, Nkv, Skv, Dv), (B, N, Sq, Dv))
    q, k, v, do = (torch.randn(*s, generator=g).to(dtype) for s in shapes)
    return q, k, v, do


def _attention(q, k, v, mask, causal, drop, p, fill=None):
    """Attention in the inputs' dtype, every op in torch (eager), differentiable."""
    return reference_flash_attention(q, k, v, mask=mask, causal=causal, drop_mask=drop, dropout_p=p, fill=fill)[0]


def _eager(q, k, v, mask, causal, drop=None, p=0.0, fill=None):
    """Eager attention in the operand dtype (scores, softmax, products all in it) and its autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    rep = q.shape[1] // k.shape[1]
    kk, vv = leaves[1].repeat_interleave(rep, 1), leaves[2].repeat_interleave(rep, 1)
    s = (leaves[0] @ kk.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if mask is not None:
        s = s + mask.to(s.dtype) if mask.is_floating_point() else s.masked_fill(~mask, float("-inf") if fill is None
                                                                                else fill)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    pr = torch.softmax(s, -1)
    if drop is not None:
        from autofuse.ops import unpack_keep
        pr = pr * unpack_keep(drop, s.shape[-1]).to(pr.dtype) / (1 - p)
    out = pr @ vv
    return out, leaves


def _ref64(q, k, v, do, mask=None, causal=False, drop=None, p=0.0, fill=None, mask64=None):
    """float64 autograd of the same attention (the kernel's inputs, upcast): out, (dq, dk, dv). ``mask64``: the float64
    model's own additive mask (``finfo(float64).min`` where the 16-bit one holds its dtype's), else ``mask`` upcast."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    m = mask.double() if mask is not None and mask.is_floating_point() else mask
    m = m if mask64 is None else mask64
    out = _attention(*leaves, m, causal, drop, p, fill)
    return out, torch.autograd.grad(out, leaves, do.double())


def _run(device, q, k, v, out, do, **kw):
    r = npu.run("flash_attention_grad", q, k, v, out.to(q.dtype), do, device=device, **kw)
    got = [torch.as_tensor(np.asarray(a, dtype=np.float64)) for a in r.outputs]
    assert [a.shape for a in got] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    want = {torch.float16: np.float16, torch.bfloat16: np.float32, torch.float32: np.float32}[q.dtype]
    assert [a.dtype for a in r.outputs] == [want] * 3
    return got, r


def _check_vs_eager(got, q, k, v, do, mask=None, causal=False, drop=None, p=0.0, fill=None, mask64=None):
    """|kernel - ref64| <= 2 |eager - ref64| + floor per gradient, eager's autograd in the same dtype being the
    yardstick. The floor: u·max|ref| (u the dtype's unit roundoff: a gradient eager happens to get exactly
    right on a tiny case; the kernel rounds dS and Pd to the operand dtype once), plus the one error source
    FlashAttention's backward has and eager's has not: Dr = rowsum(dO∘O) replaces rowsum(P∘dP), a sum of Dv
    fp32 products, off by at most δ = Dv·u32·Σ|dO∘O| per row; dS = scale·P∘(dP - Dr) carries it into
    dq by at most scale·δ·max|K| (a row of P sums to 1) and into dk by scale·δ·max|Q|·max_j Σ_i P_ij. And the
    kernel's own fp32 sums: each gradient element sums n products (dq: Skv, dk and dv: Sq per query head of the
    group) in an order numpy's BLAS picks per GEMM shape and CPU (as eager's does), so its error is bounded, on any
    CPU, only by (n + 4)·u32·Σ|terms| (n additions, the term's own few roundings); which of the two lands nearer
    the float64 value differs between CPUs (seen: an fp32 dv 2.7x eager's error on an AMD EPYC, within 2x on Intel)."""
    _, ref = _ref64(q, k, v, do, mask, causal, drop, p, fill, mask64)
    out_e, leaves = _eager(q, k, v, mask, causal, drop, p, fill)
    eager = torch.autograd.grad(out_e, leaves, do)
    u = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[q.dtype]
    m = mask.double() if mask is not None and mask.is_floating_point() else mask
    m = m if mask64 is None else mask64
    out, probs, _ = reference_flash_attention(q.double(), k.double(), v.double(), mask=m, causal=causal, fill=fill,
                                           return_probs=True)
    scale = q.shape[-1] ** -0.5
    delta = v.shape[-1] * 2.0 ** -24 * (do.double() * out.double()).abs().sum(-1).max().item() / (1 - p)
    fa = [scale * delta * k.double().abs().max().item(),
          scale * delta * q.double().abs().max().item() * probs.sum(-2).max().item() / (1 - p) * q.shape[1], 0.0]
    rep, u32 = q.shape[1] // k.shape[1], 2.0 ** -24
    kk, vv = (t.double().repeat_interleave(rep, 1).abs() for t in (k, v))
    pk, dA = probs / (1 - p), do.double().abs()                 # a kept probability, at most; |dO|
    ds = pk * (dA @ vv.transpose(-2, -1) / (1 - p) + (do.double() * out).abs().sum(-1, keepdim=True))   # >= |dS|

    def group(t):                                               # a KV head's gradient sums its group's query heads
        return t.unflatten(1, (k.shape[1], rep)).sum(2)
    n_kv = rep * q.shape[2] + 4
    acc = [(k.shape[2] + 4) * u32 * scale * (ds @ kk).max().item(),
           n_kv * u32 * scale * group(ds.transpose(-2, -1) @ q.double().abs()).max().item(),
           n_kv * u32 * group(pk.transpose(-2, -1) @ dA).max().item()]
    fa = [f + a for f, a in zip(fa, acc)]
    for name, a, e, r, f in zip(("dq", "dk", "dv"), got, eager, ref, fa):
        err_k = (a - r).abs().max().item()
        err_e = (e.double() - r).abs().max().item()
        assert err_k <= 2 * err_e + u * r.abs().max().item() + f, f"{name}: kernel {err_k:.3e}, eager {err_e:.3e}"


CASES = [  # B, N, Nkv, Sq, Skv, D, Dv, causal
    (1, 2, 1, 40, 72, 32, 32, False),       # GQA, Sq != Skv
    (2, 2, 2, 33, 17, 16, 24, False),       # odd sizes, Dv != D
    (1, 4, 2, 70, 70, 64, 64, True),        # causal over several blocks, GQA
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_gradients_no_worse_than_eager(device, dtype, case):
    *shape, causal = case
    q, k, v, do = _inputs(*shape, dtype)
    out, _ = _ref64(q, k, v, do, causal=causal)
    got, _ = _run(device, q, k, v, out, do, causal=causal)
    _check_vs_eager(got, q, k, v, do, causal=causal)


@pytest.mark.parametrize("device", DEVICES)
def test_bool_mask_with_fully_masked_rows_gives_zero_gradients(device):
    q, k, v, do = _inputs(2, 2, 1, 24, 40, 16, 16, torch.float16)
    mask = torch.rand(2, 1, 24, 40, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[:, :, 5] = False                                     # row 5 attends nothing: SDPA gives 0, grads 0
    out, ref = _ref64(q, k, v, do, mask)
    got, _ = _run(device, q, k, v, out, do, mask=mask)
    assert torch.all(got[0][:, :, 5] == 0)
    live = torch.ones(24, dtype=torch.bool)
    live[5] = False
    _check_vs_eager([got[0][:, :, live], got[1], got[2]], q[:, :, live], k, v, do[:, :, live], mask[:, :, live])


@pytest.mark.parametrize("device", DEVICES)
def test_additive_mask_and_finite_fill(device):
    q, k, v, do = _inputs(1, 2, 2, 20, 36, 32, 32, torch.float16)
    g = torch.Generator().manual_seed(4)
    add = (torch.randn(1, 1, 20, 36, generator=g) * 2).to(torch.float16)     # broadcast over B and N
    out, _ = _ref64(q, k, v, do, add, causal=True)
    got, _ = _run(device, q, k, v, out, do, mask=add, causal=True)
    _check_vs_eager(got, q, k, v, do, add, causal=True)
    # a finite fill: a fully masked row averages V, as eager's masked_fill(finfo.min) softmax does
    mask = torch.rand(1, 2, 20, 36, generator=g) > 0.5
    mask[..., 3, :] = False
    fill = float(torch.finfo(torch.float16).min)
    out, ref = _ref64(q, k, v, do, mask, fill=fill)
    got, _ = _run(device, q, k, v, out, do, mask=mask, fill=fill)
    _check_vs_eager(got, q, k, v, do, mask, fill=fill)
    assert got[0][:, :, 3].abs().max() > 0 or ref[0][:, :, 3].abs().max() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_mask_added_in_its_16_bit_dtype(device):
    """``mask_add_dtype``: the forward's additive fp16 mask added as eager adds it (the scores cast down, the sum
    rounded). The backward recomputes P with the same rounded sum, so a row whose every key takes -65504 (left
    padding) has the forward's uniform P, and the rounding passes the gradient through as eager's fp16 add does: dq,
    dk, dv within twice eager's error against the float64 model, whose own finfo.min absorbs the scores as fp16's
    does. With the fp32 add P there is the scores' softmax, not the forward's."""
    q, k, v, do = _inputs(2, 2, 1, 24, 40, 16, 16, torch.float16)
    keep = torch.rand(2, 1, 24, 40, generator=torch.Generator().manual_seed(6)) > 0.3
    keep[1, :, :4] = False                                    # batch 1's first four queries see no key
    mask = torch.zeros(keep.shape, dtype=torch.float16).masked_fill(~keep, torch.finfo(torch.float16).min)
    mask64 = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
    out, _ = _ref64(q, k, v, do, mask, mask64=mask64)
    got, _ = _run(device, q, k, v, out, do, mask=mask, mask_add_dtype="float16")
    _check_vs_eager(got, q, k, v, do, mask, mask64=mask64)
    old, _ = _run(device, q, k, v, out, do, mask=mask)
    with pytest.raises(AssertionError, match="dq"):
        _check_vs_eager(old, q, k, v, do, mask, mask64=mask64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dropout_with_known_keep_mask(device, dtype):
    q, k, v, do = _inputs(1, 2, 1, 33, 48, 32, 32, dtype)
    p = 0.25
    keep = torch.rand(1, 2, 33, 48, generator=torch.Generator().manual_seed(5)) >= p
    bits = pack_keep(keep)
    out, _ = _ref64(q, k, v, do, drop=bits, p=p, causal=True)
    got, _ = _run(device, q, k, v, out, do, drop_mask=bits, keep_prob=1 - p, causal=True)
    _check_vs_eager(got, q, k, v, do, causal=True, drop=bits, p=p)
    # near miss: the kernel reads the mask (another keep-mask gives other gradients)
    other, _ = _run(device, q, k, v, out, do, drop_mask=pack_keep(~keep), keep_prob=1 - p, causal=True)
    assert (other[2] - got[2]).abs().max() > 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_saved_statistics_skip_the_sweep(device):
    """Given each row's log-sum-exp the kernel skips its statistics sweep: the same gradients, fewer cycles."""
    q, k, v, do = _inputs(1, 2, 1, 48, 64, 32, 32, torch.float16)
    mask = torch.rand(1, 1, 48, 64, generator=torch.Generator().manual_seed(6)) > 0.3
    mask[..., 0] = True
    out, _ = _ref64(q, k, v, do, mask)
    s = ((q.double() @ k.double().transpose(-2, -1)) * 32 ** -0.5).masked_fill(~mask, float("-inf"))
    mx = s.amax(-1)
    sm = torch.exp(s - mx[..., None]).sum(-1)
    a, ra = _run(device, q, k, v, out, do, mask=mask)
    b, rb = _run(device, q, k, v, out, do, mask=mask, softmax_max=mx.float(), softmax_sum=sm.float())
    _check_vs_eager(b, q, k, v, do, mask)
    for x, y in zip(a, b):
        # the recomputed statistics differ from the float64 ones by a few fp32 ulps: P by ~1e-6 relative, far
        # below one fp16 rounding of dS and P (2^-11); what remains are flips of one rounding step of those
        assert (x - y).abs().max().item() <= 2.0 ** -9 * max(1.0, y.abs().max().item())
    assert rb.stats.cycles < ra.stats.cycles
    # wrong statistics change the result (the kernel reads them)
    c, _ = _run(device, q, k, v, out, do, mask=mask, softmax_max=mx.float(), softmax_sum=2 * sm.float())
    assert (c[2] - b[2]).abs().max() > 1e-2


def test_empty_rows_nan():
    q, k, v, do = _inputs(1, 1, 1, 16, 16, 16, 16, torch.float32)
    mask = torch.ones(16, 16, dtype=torch.bool)
    mask[2] = False
    out, _ = _ref64(q, k, v, do, mask)
    got, _ = _run("ascend910", q, k, v, out, do, mask=mask, empty_rows="nan")
    # eager's plain softmax of masked_fill(-inf): the empty row's NaN reaches dv (its P feeds every key's dv)
    # but not dq or dk (masked_fill's backward zeroes every masked score's gradient, the whole row here)
    dq, dk, dv = got
    assert (dq[0, 0, 2] == 0).all() and not torch.isnan(dq).any() and not torch.isnan(dk).any()
    assert torch.isnan(dv).all()
    ql, kl, vl = (t.double().requires_grad_() for t in (q, k, v))
    s = (ql @ kl.transpose(-2, -1) * 16 ** -0.5).masked_fill(~mask, float("-inf"))
    torch.autograd.backward(torch.softmax(s, -1) @ vl, do.double())
    assert torch.equal(torch.isnan(ql.grad), torch.isnan(dq)) and torch.equal(torch.isnan(kl.grad), torch.isnan(dk))
    assert torch.equal(torch.isnan(vl.grad), torch.isnan(dv))


def test_timing_only_matches_values_run():
    q, k, v, do = _inputs(1, 2, 2, 40, 40, 32, 32, torch.float16)
    out, _ = _ref64(q, k, v, do, causal=True)
    _, r = _run("ascend910b", q, k, v, out, do, causal=True)
    t = npu.run("flash_attention_grad", *(x.to("meta") for x in (q, k, v, out.to(q.dtype), do)), causal=True,
                device="ascend910b", timing_only=True)
    assert t.stats.cycles == r.stats.cycles and t.stats.hbm_bytes == r.stats.hbm_bytes


def test_tilings_fit_and_errors_name_the_buffer():
    for name in DEVICES:
        dev = get_device(name)
        for D in (64, 128):
            t = default_tiling(dev, 1024, 1024, D, D, "float16")
            assert tiling_fits(dev, D, D, "float16", t)
    q, k, v, do = _inputs(1, 1, 1, 256, 256, 128, 128, torch.float16)
    with pytest.raises(ValueError, match="L0C needs"):
        npu.run("flash_attention_grad", q, k, v, do, do, tiling={"q": 256, "kv": 256}, device="ascend910b")
    with pytest.raises(ValueError, match="multiples of 16"):
        npu.run("flash_attention_grad", q, k, v, do, do, tiling={"q": 24, "kv": 16})
    with pytest.raises(TypeError, match="dtypes differ"):
        npu.run("flash_attention_grad", q, k.float(), v, do, do)
    with pytest.raises(ValueError, match="softmax_max is float32"):
        npu.run("flash_attention_grad", q, k, v, do, do, softmax_max=torch.zeros(1, 1, 255),
                softmax_sum=torch.zeros(1, 1, 255))
    with pytest.raises(ValueError, match="together"):
        npu.run("flash_attention_grad", q, k, v, do, do, softmax_max=torch.zeros(1, 1, 256))
    with pytest.raises(ValueError, match="dout"):
        npu.run("flash_attention_grad", q, k, v, do, do[:, :, :8])


def _capped64(q, k, v, do, cap, causal):
    """float64 autograd of soft-capped attention (Gemma 2: ``cap·tanh(scale·q·kᵀ / cap)``, then the causal mask)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    rep = q.shape[1] // k.shape[1]
    s = (leaves[0] @ leaves[1].repeat_interleave(rep, 1).transpose(-2, -1)) * q.shape[-1] ** -0.5
    s = torch.tanh(s / cap) * cap
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(s, -1) @ leaves[2].repeat_interleave(rep, 1)
    return out, torch.autograd.grad(out, leaves, do.double())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stats", [False, True])
def test_logit_soft_capping(device, dtype, stats):
    """The backward of soft-capped scores: both phases cap them as the forward does and dS takes the cap's
    derivative ``1 - tanh²``: against float64 autograd (fp32: within 2e-5 of the gradients' size, a few fp32
    roundings of P, dS and the products; bf16: the kernel's own torch twin within a few bf16 roundings); eleven more Vector passes per score in phase 2 (eight in phase 1) than without the cap."""
    from autofuse.ops_attention_grad import reference_flash_attention_grad
    q, k, v, do = _inputs(1, 4, 2, 70, 70, 64, 64, dtype, seed=5)
    q = q * 4                                                       # scores large enough for the cap to bite
    cap = 5.0
    out, ref = _capped64(q, k, v, do, cap, True)
    kw = dict(causal=True, softcap=cap)
    if stats:
        o, _, st = reference_flash_attention(q.float(), k.float(), v.float(), causal=True, softcap=cap,
                                             return_stats=True)
        kw.update(softmax_max=st[0], softmax_sum=st[1])
    got, r = _run(device, q, k, v, out, do, **kw)
    twin = reference_flash_attention_grad(q, k, v, out.to(dtype), do, softcap=cap, causal=True,
                                          softmax_max=kw.get("softmax_max"), softmax_sum=kw.get("softmax_sum"))
    for a, t, rr in zip(got, twin, ref):
        if dtype == torch.float32:
            assert (a - rr).abs().max() <= 2e-5 * rr.abs().max()
        else:        # same numerics, other summation orders (tiles, atomic adds): a few bf16 roundings
            assert (a - t.double()).abs().max() <= 4 * 2.0 ** -8 * max(1.0, t.double().abs().max().item())
    plain = npu.run("flash_attention_grad", q, k, v, out.to(dtype), do, device=device, timing_only=True,
                    **{k_: v_ for k_, v_ in kw.items() if k_ != "softcap"})
    assert r.stats.busy["vector"] > plain.stats.busy["vector"]


@pytest.mark.parametrize("device", DEVICES)
def test_cost_model_grants_the_kernels_tile_counts_with_the_cap(device):
    """The cost model restates the backward's requests, soft-capping's tanh tile included."""
    from autofuse.npu.kernels import flash_attention_grad as kern
    from cost_model import flash_attention_grad as model
    dev = get_device(device)
    for D, dt, q, kv, stats, cap in [(64, "float16", 64, 128, True, True), (256, "bfloat16", 32, 32, False, True),
                                     (128, "float32", 32, 64, True, False)]:
        t = {"q": q, "kv": kv}
        assert model._counts(dev, model._requests(dev, D, D, dt, t, None, False, stats, cap)) == \
            kern._counts(dev, kern._requests(dev, D, D, dt, t, None, False, stats, cap))
