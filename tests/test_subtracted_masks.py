"""Additive masks written as a subtraction, ``scores - m`` (XLNet's ``score - 65500 * mask``, Funnel's
``score - INF * (1 - mask)``): the mask ``m`` with its factor negated, since ``fl(s - m) == fl(s + (-m))`` in IEEE
arithmetic. The attention and softmax families fuse them as they fuse ``scores + (-m)``: a 16-bit mask subtracted
in 16 bits is added so by the kernel (``mask_add_dtype``: -1 is a power of two up to its sign, which commutes with
the rounding), so a fully masked row is eager's; a subtracted constant causal mask is proven causal; the mask's
gradient is ``-dS``. Near misses: ``m - s`` (negated scores) is no mask, and a subtracted mask that raises the
scores is never taken as masking; both are computed as eager does. The verifier's float64 run subtracts a 16-bit
masking value as eager does, so a kernel subtracting in fp32 is rejected."""
import pytest
import torch
import torch.nn as nn

from autofuse import AutoFusionEngine
from autofuse.capture import capture
from autofuse.verify import _F64, _f64, compare
from tests.test_softmax_pattern import UNIT, _same_specials, scores_grad_as_eagers

INF = float("inf")
B, N, S, D = 2, 2, 32, 16
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ONLY_SOFTMAX = {"softmax": "force", "vector_chain": "off"}      # the softmax kernel, whatever the cost model says


def _applied(fused, family):
    return [d for d in fused.report.applied if d.pattern == family]


def _keep(dtype, s=S):
    """A 1/0 keep tensor ``[B, 1, 1, s]``: batch 0 keeps its first ``3s/4`` keys, batch 1 none (every row of it fully
    masked)."""
    keep = torch.ones(B, 1, 1, s, dtype=dtype)
    keep[0, ..., 3 * s // 4:] = 0
    keep[1] = 0
    return keep


def _value(value, dtype):
    return torch.finfo(dtype).max if value == "finfo.max" else value


# ------------------------------------------------------------------------------------------------ attention

class SubtractedAttention(nn.Module):
    """``softmax(q @ kᵀ · 0.25 - (1 - keep) · value) @ v``; ``negated``: ``(1 - keep) · value - scores``."""

    def __init__(self, value="finfo.max", negated=False):
        super().__init__()
        self.value, self.negated = value, negated

    def forward(self, q, k, v, keep):
        s = q @ k.transpose(-1, -2) * 0.25
        m = (1 - keep) * _value(self.value, q.dtype)
        return torch.softmax(m - s if self.negated else s - m, -1) @ v


def _qkv(dtype, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, N, S, D, generator=g) * 2).to(dtype).requires_grad_(grad) for _ in range(3)]


def _in_float64(model, args):
    return model(*[a.detach().double() for a in args])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", ["finfo.max", 1e4])
def test_a_subtracted_padding_mask_is_an_attention_mask(dtype, value):
    """The subtracted mask is the attention block's additive mask with factor -1, added in the scores' 16-bit dtype
    as eager subtracts it; within the bound of eager against float64, and at batch 1 (every key masked) eager's
    values: the average of V with ``finfo.max`` (every score absorbed), eager's 16-bit differences with 1e4."""
    if value == 1e4 and dtype == torch.float32:
        pytest.skip("1e4 masks fp32 scores without absorbing them: the padded row is the scores' softmax")
    model = SubtractedAttention(value).eval()
    args = (*_qkv(dtype), _keep(dtype))
    fused = AutoFusionEngine.fuse(model, args)
    (d,) = _applied(fused, "attention")
    assert d.params["mask_terms"] == (("mask", "additive", -1.0),)
    assert d.params["mask_add_dtype"] == (None if dtype == torch.float32 else dtype)
    with torch.no_grad():
        got, want, ref = fused(*args), model(*args), _in_float64(model, args)
    ok, err, tol = compare(want[0], ref[0], got[0])
    assert ok, (err, tol)
    unit = UNIT[dtype]
    assert (got[1].double() - want[1].double()).abs().max() <= 4 * unit * (want[1].double().abs().max() + 1)
    if value == "finfo.max":
        mean = args[2][1].double().mean(-2, keepdim=True).expand(N, S, D)
        assert (got[1].double() - mean).abs().max() <= 4 * unit * (mean.abs().max() + 1), "V averaged, as eager's"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_subtracted_mask_gets_minus_the_scores_gradient(dtype):
    """A learnable bias subtracted from the scores (``s - b``, b requiring grad): the fused block's gradients of q, k,
    v and b are eager's within the bound against float64, and b's is ``-dS`` (the gradient of the added ``-b``)."""

    class Biased(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(1)
            self.bias = nn.Parameter((torch.randn(1, N, S, S, generator=g) * 2).to(dtype))

        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-1, -2) * 0.25 - self.bias, -1) @ v

    model = Biased().train()
    args = _qkv(dtype, grad=True)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches={"attention": "force"})
    (d,) = _applied(fused, "attention")
    assert d.params["mask_terms"] == (("mask", "additive", -1.0),)
    g = torch.randn(B, N, S, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    wrt = [*args, model.bias]
    got = torch.autograd.grad(fused(*args), wrt, g)
    want = torch.autograd.grad(model(*args), wrt, g)
    m64 = Biased().double()
    m64.bias.data.copy_(model.bias.detach().double())
    a64 = [a.detach().double().requires_grad_() for a in args]
    ref = torch.autograd.grad(m64(*a64), [*a64, m64.bias], g.double())
    for name, a, e, r in zip(("q", "k", "v", "bias"), got, want, ref):
        ok, err, tol = compare(e, r, a)
        assert ok, (name, err, tol)
    # -dS: the bias's gradient is minus that of an added one
    added = torch.autograd.grad(torch.softmax((args[0] @ args[1].transpose(-1, -2) * 0.25).double() + (-model.bias)
                                              .double(), -1) @ args[2].double(), [model.bias], g.double())[0]
    ok, err, tol = compare(want[3], added, got[3])
    assert ok, (err, tol)


class SubtractedCausal(nn.Module):
    """``softmax(q @ kᵀ · 0.25 - (1 - tril) · value) @ v`` (``sign`` -1: ``- (tril - 1) · value``, which raises the
    scores above the diagonal)."""

    def __init__(self, value, sign=1.0, window=0):
        super().__init__()
        self.value, self.sign, self.window = value, sign, window

    def forward(self, q, k, v):
        tril = torch.ones(S, S, dtype=q.dtype).tril()
        if self.window:                     # a sliding window: query i keeps keys i - window < j <= i
            tril = tril - torch.ones(S, S, dtype=q.dtype).tril(-self.window)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 - self.sign * (1 - tril) * self.value, -1) @ v


@pytest.mark.parametrize("value", ["finfo.max", 1e9])
@pytest.mark.parametrize("window", [0, 8])
def test_a_subtracted_causal_mask_is_proven_causal(value, window):
    """``s - (1 - tril) · finfo.max`` is SDPA's causal mask (the kernel skips above the diagonal, no mask read), as the
    added ``(1 - tril) · finfo.min`` is; ``s - (1 - tril) · 1e9`` is a causal mask whose masked entries are -1e9,
    kept as the user's mask with ``causal_value`` -1e9, as the added ``(1 - tril) · -1e9`` is. The same with a
    sliding window's band (``params["window"]``)."""
    v = torch.finfo(torch.float32).max if value == "finfo.max" else value
    model = SubtractedCausal(v, window=window).eval()
    args = _qkv(torch.float32)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches={"attention": "force"})
    (d,) = _applied(fused, "attention")
    assert d.params["window"] == window
    if value == "finfo.max":
        assert d.params["causal"] and d.params["mask_terms"] == ()
    else:
        assert not d.params["causal"] and d.params["causal_value"] == -1e9
        assert d.params["mask_terms"] == (("mask", "additive", -1.0),)
    with torch.no_grad():
        got, want, ref = fused(*args), model(*args), _in_float64(model, args)
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)


def test_near_miss_a_subtracted_mask_that_raises_the_scores_is_not_causal():
    """``s - (tril - 1) · 1e4`` adds 1e4 above the diagonal: no mask proof takes it as masking (with its sign
    dropped it would be a causal mask of -1e4); it is fused as the additive mask it is, equal to eager."""
    model = SubtractedCausal(1e4, sign=-1.0).eval()
    args = _qkv(torch.float32)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches={"attention": "force"})
    (d,) = _applied(fused, "attention")
    assert not d.params["causal"] and d.params["causal_value"] is None and not d.params["window"]
    assert d.params["mask_terms"] == (("mask", "additive", -1.0),)
    with torch.no_grad():
        got, want, ref = fused(*args), model(*args), _in_float64(model, args)
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)


class BothWays(nn.Module):
    """Two attention blocks on one keep tensor: ``softmax(s - m) @ v`` and ``softmax(m - s2) @ v``."""

    def forward(self, q, q2, k, v, keep):
        m = (1 - keep) * torch.finfo(q.dtype).max
        s, s2 = (t @ k.transpose(-1, -2) * 0.25 for t in (q, q2))
        return torch.softmax(s - m, -1) @ v, torch.softmax(m - s2, -1) @ v


def test_near_miss_mask_minus_scores_is_not_attention():
    """``m - s`` negates the scores: no attention block (the kernel's scores are ``+s``), while ``s - m`` beside it
    is one; both computed as eager."""
    model = BothWays().eval()
    q, k, v = _qkv(torch.float16)
    args = (q, _qkv(torch.float16, seed=1)[0], k, v, _keep(torch.float16))
    fused = AutoFusionEngine.fuse(model, args, fusion_switches={"attention": "force"})
    (d,) = [d for d in fused.report.decisions if d.pattern == "attention"]
    assert d.applied and d.params["mask_terms"] == (("mask", "additive", -1.0),), fused.report.summary()
    with torch.no_grad():
        got, want = fused(*args), model(*args)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0, equal_nan=True)
    assert (got[0].double() - want[0].double()).abs().max() <= 4 * UNIT[torch.float16] * (want[0].abs().max() + 1)


# ------------------------------------------------------------------------------------------------ softmax

class SubtractedSoftmax(nn.Module):
    """``softmax(x · 0.5 - m)`` (or log_softmax), ``m = (1 - keep) · value`` in x's dtype (``inf``: 0 / +inf);
    ``after``: ``(x - m) · 0.5``, the mask scaled by -0.5; ``negated``: ``m - x · 0.5``."""

    def __init__(self, value, log, after=False, negated=False):
        super().__init__()
        self.value, self.log, self.after, self.negated = value, log, after, negated

    def forward(self, x, keep):
        if self.value == "inf":
            m = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(keep == 0, INF)
        else:
            m = (1 - keep) * _value(self.value, x.dtype)
        if self.negated:
            z = m - x * 0.5
        else:
            z = (x - m) * 0.5 if self.after else x * 0.5 - m
        return torch.log_softmax(z, -1) if self.log else torch.softmax(z, -1)


def _scores(dtype, shape=(B, N, 16, S)):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", ["finfo.max", 1e4, "inf"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("after", [False, True], ids=["masked", "scaled_after"])
def test_a_subtracted_mask_is_a_softmax_mask(dtype, value, log, after):
    """The softmax family fuses ``x · 0.5 - m`` (factor -1) and ``(x - m) · 0.5`` (factor -0.5) with the mask
    subtracted in the scores' 16-bit dtype as eager subtracts it: eager's values and x's gradient (a fully masked
    row included: uniform with ``finfo.max``, NaN with ``inf``), and within the bound against float64."""
    x, keep = _scores(dtype), _keep(dtype)
    model = SubtractedSoftmax(value, log, after).train()
    fused = AutoFusionEngine.fuse(model, (x, keep), fusion_switches=ONLY_SOFTMAX)
    (d,) = _applied(fused, "softmax")
    assert d.params["mask_terms"] == (("mask", "additive", -0.5 if after else -1.0),)
    assert d.params["mask_add_dtype"] == (None if dtype == torch.float32 else dtype)
    xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = fused(xg, keep), model(xe, keep)
    _same_specials(got, want, "forward")
    fin = torch.isfinite(want)
    unit = UNIT[dtype]
    err = (got.double() - want.double())[fin].abs()
    assert (err <= 2 * unit * (want.double()[fin].abs() + 1)).all(), err.max()
    if value == "finfo.max" and not log:
        assert (got[1].double() - 1 / S).abs().max() <= unit, "the fully masked row is uniform, as eager's"
    with torch.no_grad():
        ref = _F64(fused.plans[next(iter(fused.plans))].captured.graph_module).run(_f64(x), _f64(keep))[0]
    ok, e, tol = compare(want.detach(), ref, got.detach())
    assert ok, (e, tol)
    scores_grad_as_eagers(got, want, xg, xe, dtype)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_a_subtracted_mask_gets_minus_the_softmax_gradient(log):
    """A subtracted bias that requires grad: its gradient through the fused softmax is eager's, ``-dz``."""
    x = _scores(torch.float32)
    b = torch.randn(1, 1, 16, S, generator=torch.Generator().manual_seed(1)).requires_grad_()

    class Biased(nn.Module):
        def forward(self, x, b):
            z = x * 0.5 - b
            return torch.log_softmax(z, -1) if log else torch.softmax(z, -1)

    model = Biased().train()
    fused = AutoFusionEngine.fuse(model, (x, b), fusion_switches=ONLY_SOFTMAX)
    (d,) = _applied(fused, "softmax")
    assert d.params["mask_terms"] == (("mask", "additive", -1.0),)
    gout = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    (got,) = torch.autograd.grad(fused(x, b), [b], gout)
    (want,) = torch.autograd.grad(model(x, b), [b], gout)
    bp = b.detach().neg().requires_grad_()
    z = x * 0.5 + bp
    (plus,) = torch.autograd.grad(torch.log_softmax(z, -1) if log else torch.softmax(z, -1), [bp], gout)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, -plus, atol=1e-5, rtol=1e-5)


class TwoSoftmaxes(nn.Module):
    """``softmax(x · 0.5 - m)`` beside a near miss on y: ``m - y · 0.5`` (negated scores) or ``torch.sub(y · 0.5, m,
    alpha=2)`` (``y - 2m``, eager scaling m unrounded in fp32, where the kernel's 16-bit term could overflow)."""

    def __init__(self, miss):
        super().__init__()
        self.miss = miss

    def forward(self, x, y, keep):
        m = (1 - keep) * 1e4
        near = m - y * 0.5 if self.miss == "negated" else torch.sub(y * 0.5, m, alpha=2)
        return torch.softmax(x * 0.5 - m, -1), torch.softmax(near, -1)


@pytest.mark.parametrize("miss", ["negated", "alpha"])
def test_near_miss_negated_scores_or_alpha_are_no_softmax_mask(miss):
    """Of the two softmaxes only ``x · 0.5 - m`` fuses with a mask; the near miss has none; both as eager."""
    x, y, keep = _scores(torch.float16), _scores(torch.float16) * 0.5, _keep(torch.float16)
    model = TwoSoftmaxes(miss).eval()
    fused = AutoFusionEngine.fuse(model, (x, y, keep), fusion_switches=ONLY_SOFTMAX)
    masked = [d for d in fused.report.decisions if d.pattern == "softmax" and d.params.get("mask_terms")]
    assert len(masked) == 1 and masked[0].applied, fused.report.summary()
    assert masked[0].params["mask_terms"] == (("mask", "additive", -1.0),)
    with torch.no_grad():
        got, want = fused(x, y, keep), model(x, y, keep)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0, equal_nan=True)
    assert (got[0].double() - want[0].double()).abs().max() <= 2 * UNIT[torch.float16]


# ------------------------------------------------------------------------------------------------ verify

@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_verification_rejects_a_kernel_that_subtracts_a_16_bit_mask_in_fp32(monkeypatch, log):
    """The kernel subtracting the fp16 mask in fp32 (``mask_add_dtype`` not passed on) keeps the scores' differences
    at the fully masked row, where eager's fp16 subtraction absorbs them: verification rejects it, its float64 run
    subtracting a 16-bit masking value as eager does (against the float64 difference it passed)."""
    import patterns.softmax
    monkeypatch.setattr(patterns.softmax, "_mask_add_dtype", lambda *a: None)
    x, keep = _scores(torch.float16), _keep(torch.float16)
    model = SubtractedSoftmax("finfo.max", log).eval()
    fused = AutoFusionEngine.fuse(model, (x, keep), fusion_switches=ONLY_SOFTMAX)
    codes = {d.pattern: d.reason_code for d in fused.report.decisions}
    assert codes["softmax"] == "verification_failed", fused.report.summary()
    with torch.no_grad():
        got, want = fused(x, keep), model(x, keep)
    assert torch.equal(got, want)


def test_verification_rejects_an_attention_kernel_that_subtracts_a_16_bit_mask_in_fp32(monkeypatch):
    """The same for the attention family: the padded fp16 rows average V in eager, not in an fp32 subtraction."""
    import patterns.attention
    monkeypatch.setattr(patterns.attention, "_mask_add_dtype", lambda *a: None)
    model = SubtractedAttention().eval()
    args = (*_qkv(torch.float16), _keep(torch.float16))
    fused = AutoFusionEngine.fuse(model, args, fusion_switches={"attention": "force"})
    codes = {d.pattern: d.reason_code for d in fused.report.decisions}
    assert codes["attention"] == "verification_failed", fused.report.summary()


@pytest.mark.parametrize("spelling", ["sub", "rsub", "sub_alpha_1"])
def test_the_float64_reference_subtracts_a_16_bit_mask_as_eager_does(spelling):
    """``_F64``: a 16-bit ``a - b`` (``sub(a, b)``, ``rsub(b, a)``) where the subtrahend is at or above 1e4 or the
    minuend at or below -1e4 is eager's 16-bit difference there, the gradient passing through (-1 for b);
    elsewhere the float64 difference."""

    class Sub(nn.Module):
        def forward(self, a, b):
            if spelling == "rsub":
                return torch.rsub(b, a)
            return torch.sub(a, b, alpha=1) if spelling == "sub_alpha_1" else a - b

    a = torch.tensor([1.25, 3.0, -2.0, 7.0, -65504.0], dtype=torch.float16)
    b = torch.tensor([65504.0, 1e4, -0.5, INF, 0.25], dtype=torch.float16)
    gm = capture(Sub(), (a, b)).graph_module
    assert any(n.op == "call_function" and "sub" in str(n.target) for n in gm.graph.nodes), gm.code
    a64, b64 = _f64(a).requires_grad_(), _f64(b).requires_grad_()
    (out,) = _F64(gm).run(a64, b64)
    # -9997 is -10000 in fp16 (a step of 8 there); -65504.25 is -65504
    assert out.tolist() == [-65504.0, -10000.0, -1.5, -INF, -65504.0]
    out[[0, 1, 2, 4]].sum().backward()
    assert a64.grad.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0] and b64.grad.tolist() == [-1.0, -1.0, -1.0, 0.0, -1.0]
