"""The softmax family end to end: softmax / log-softmax spellings with their scale, mask and casts fused through
``AutoFusionEngine.fuse`` into one ``scaled_masked_softmax`` and equal to eager within the verifier's bound
(``autofuse.verify.compare``: at most twice eager's own error against float64, plus one rounding); near misses
left as captured, bit for bit; the softmax of an attention block or of a MoE router still claimed by its own
family; the op's fake, autograd and torch twin."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuse
from autofuse import AutoFusionEngine
from autofuse.canonicalize import canonicalize
from autofuse.capture import capture
from autofuse.ops_softmax import reference_scaled_masked_softmax, scaled_masked_softmax
from autofuse.verify import _F64, _f64, compare
from patterns.attention import AttentionVariant, build_variant
from patterns.softmax import find_softmax
from test_canonicalize import Fn      # a module around a function

OP = torch.ops.autofuse.scaled_masked_softmax.default
INF = float("inf")


def _calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is OP]


def _data(dtype=torch.float16, shape=(2, 4, 16, 32), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    keep = torch.rand(shape[0], 1, 1, shape[-1], generator=g) > 0.3
    keep[1, ..., :] = False                          # batch 1 fully masked: NaN rows (softmax) or 0 (safe)
    add = torch.where(torch.rand(shape[-1], generator=g) > 0.3, torch.randn(shape[-1], generator=g), -INF)
    return x, keep, add


def _fused_once(fn, *args, **params):
    """Fuse ``fn``; exactly one softmax block applied, with these params; the fused call equals eager within
    the verifier's bound against the float64 run of the captured graph."""
    model = Fn(fn).eval()
    fused = AutoFusionEngine.fuse(model, args)
    applied = [d for d in fused.report.applied if d.pattern == "softmax"]
    assert len(applied) == 1 and len(_calls(fused.graph_module)) == 1, fused.report.summary()
    for k, v in params.items():
        assert applied[0].params[k] == v, (k, applied[0].params[k])
    with torch.no_grad():
        got, want = fused(*args), model(*args)
        ref = _F64(fused.plans[next(iter(fused.plans))].captured.graph_module).run(*[_f64(a) for a in args])[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)
    return fused, applied[0]


# ------------------------------------------------------------------------------------------ spellings

def test_scaled():
    x, _, _ = _data()
    _fused_once(lambda x: torch.softmax(x * 0.125, -1), x, scale=0.125, mask_kind=None)
    _fused_once(lambda x: F.softmax(x / 8.0, dim=-1), x, scale=0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_masked_fill_minus_inf(dtype):
    x, keep, _ = _data(dtype)
    _fused_once(lambda x, k: x.masked_fill(~k, -INF).softmax(-1), x, keep, mask_kind="bool", fill=None)


@pytest.mark.parametrize("fill", ["finfo.min", -1e4])
def test_where_with_a_finite_fill(fill):
    x, keep, _ = _data(torch.bfloat16 if fill == "finfo.min" else torch.float16)
    f = torch.finfo(x.dtype).min if fill == "finfo.min" else fill

    def fn(x, k):
        return torch.softmax(torch.where(k, x * 0.5, f), dim=-1)
    _, d = _fused_once(fn, x, keep, mask_kind="bool", scale=0.5)
    assert d.params["fill"] == float(torch.tensor(f, dtype=x.dtype))


def test_fill_through_a_later_scale_and_cast():
    """where(keep, x, -1e4) in fp16, then * 0.5 and an upcast: the fill the softmax sees is -5000."""
    x, keep, _ = _data()
    _fused_once(lambda x, k: (torch.where(k, x, -1e4) * 0.5).float().softmax(-1), x, keep, fill=-5000.0,
                scale=0.5, out_dtype=torch.float32)


def test_additive_mask_and_mask_before_the_scale():
    x, _, add = _data(torch.float32)
    _fused_once(lambda x, a: torch.softmax(x * 0.3 + a, -1), x, add, mask_kind="additive", scale=0.3)
    # (x + a) * 0.3: the mask is scaled too (factor 0.3 at the softmax input)
    _, d = _fused_once(lambda x, a: torch.softmax((x + a) * 0.3, -1), x, add, mask_kind="additive")
    assert d.params["mask_terms"] == (("mask", "additive", 0.3),)


def test_two_masks_combine():
    x, keep, add = _data(torch.float32)
    _fused_once(lambda x, k, a: torch.softmax((x + a).masked_fill(~k, -INF), -1), x, keep, add,
                mask_kind="additive")


def test_dtype_float32_upcast_and_downcast():
    x, _, _ = _data()
    _fused_once(lambda x: F.softmax(x, -1, dtype=torch.float32).to(torch.float16), x, out_dtype=torch.float16,
                scale=None, mask_kind=None)


def test_log_softmax():
    x, keep, add = _data(torch.float32)
    _fused_once(lambda x, a: F.log_softmax(x * 0.5 + a, -1), x, add, log=True)
    xh, _, _ = _data()
    _fused_once(lambda x, k: torch.log_softmax(x.float().masked_fill(~k, -INF), 3), xh, keep, log=True, dim=-1,
                out_dtype=torch.float32)


def test_log_forms_of_softmax():
    x, _, _ = _data(torch.float32)
    _fused_once(lambda x: x - torch.logsumexp(x, -1, keepdim=True), x, log=True, scale=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_log_of_softmax_keeps_eagers_underflow(dtype):
    """``log(softmax(z))`` is not ``log_softmax``: where eager's probability underflows to 0 (a score 150 below its
    row's max here, beyond every dtype's exp range), ``log`` gives ``-inf`` and the gradient is NaN over that row.
    The softmax and its scale fuse; the log stays as captured, so the fused model gives both as eager does."""
    def fn(x):
        return torch.log(torch.softmax(x * 0.5, -1))
    x = torch.randn(2, 3, 8).to(dtype)
    x[0, 1, 3] = -300.0                  # 0.5 * -300: exp(-150) is 0 in fp32
    fused, _ = _fused_once(fn, x, log=False, scale=0.5)
    model = Fn(fn)
    with torch.no_grad():
        got, want = fused(x), model(x)
    assert bool(torch.isneginf(want[0, 1, 3])), "the test needs eager's underflow"
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "-inf where eager's probability underflows"
    grads = []
    for f in (fused, model):
        xg = x.clone().requires_grad_()
        f(xg).sum().backward()
        grads.append(xg.grad)
    assert torch.equal(torch.isnan(grads[0]), torch.isnan(grads[1])) and bool(torch.isnan(grads[1][0, 1]).all())


def test_a_fill_doubled_then_halved_overflows_as_in_eager():
    """``(s·2)·0.5`` is not ``s·1`` where ``s·2`` overflows: a score filled with the dtype's ``finfo.min`` and
    doubled is ``-inf`` in eager (and in the float64 run, whose ``finfo.min`` doubles to ``-inf`` too), so a row
    whose every score is masked is NaN, not uniform."""
    x, _, _ = _data(torch.float32, shape=(2, 3, 8))
    keep = torch.rand(2, 3, 8, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[0, 1] = False

    def fn(x, k):
        return torch.softmax(x.masked_fill(~k, torch.finfo(x.dtype).min) * 2 * 0.5, -1)
    fused, d = _fused_once(fn, x, keep, mask_kind="bool")
    with torch.no_grad():
        got, want = fused(x, keep), Fn(fn)(x, keep)
    assert bool(torch.isnan(want[0, 1]).all()) and torch.equal(torch.isnan(got), torch.isnan(want))


@pytest.mark.parametrize("order", ["last", "first"])
@pytest.mark.parametrize("bias_grad", [False, True])
def test_a_bias_and_a_keep_mask_give_no_gradient_through_the_filled_scores(bias_grad, order):
    """``softmax((x + bias).masked_fill(~keep, -inf))`` (or the fill first, then the bias) with rows whose every score
    is masked: eager's softmax is NaN there and ``nan_to_num`` after it zeroes them; ``masked_fill``'s backward stops
    the row's NaN from reaching x (and, filled last, the bias). The fused op's one mask is the bias and the fill
    combined: its backward must do the same (the derived Vector backward, and the host recompute for a bias that
    requires grad). Filled first, eager passes the bias the row's NaN; the fused graph's ``where`` that combines the
    two masks gives the bias none from that row (elsewhere eager's gradient)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 8, 16, generator=g)
    bias = torch.randn(1, 3, 8, 16, generator=g)
    keep = torch.rand(2, 1, 8, 16, generator=g) > 0.3
    keep[1, :, :2] = False

    def fn(x, b, k):
        z = (x + b).masked_fill(~k, -INF) if order == "last" else x.masked_fill(~k, -INF) + b
        return torch.softmax(z, -1).nan_to_num(0.0)
    model = Fn(fn).train()
    with torch.enable_grad():
        fused = AutoFusionEngine.fuse(model, (x, bias, keep))
    (d,) = [d for d in fused.report.applied if d.pattern == "softmax"]
    assert {kind for _, kind, _ in d.params["mask_terms"]} == {"bool", "additive"}
    grads = []
    for f, dt in ((fused, torch.float32), (model, torch.float32), (model, torch.float64)):
        xs = [t.detach().to(dt).requires_grad_(i == 0 or bias_grad) for i, t in enumerate((x, bias))]
        w = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dt)
        (f(*xs, keep) * w).sum().backward()
        grads.append([t.grad for t in xs if t.requires_grad])
    for i, (got, want, exact) in enumerate(zip(*grads)):
        stopped = i == 0 or order == "last"
        assert bool(torch.isfinite(want).all()) == stopped, "masked_fill stops the NaN where it comes after"
        if not stopped:                          # the bias filled first: finite where eager's gradient is NaN
            nan = torch.isnan(want)
            got, want, exact = got[~nan], want[~nan], exact[~nan]
        ok, err, tol = compare(want, exact, got)
        assert ok and bool(torch.isfinite(got).all()), (i, err, tol)


@pytest.mark.parametrize("dtype,big", [(torch.float16, 32752.0), (torch.bfloat16, 1000.0)])
@pytest.mark.parametrize("log", [False, True])
def test_a_16_bit_logsumexp_spelling_rounds_its_scores_as_eager(dtype, big, log):
    """``z - logsumexp(z)`` over 16-bit scaled scores: eager holds ``z`` in 16 bits and its logsumexp is rounded to
    them, so a score that dominates its row gives ``z - lse == 0`` there (fp16 ``32752 / 3`` is 10920, spacing 8).
    The kernel rounds the scores to x's dtype as it rounds the statistic: with fp32 scores it gave
    ``10917.3 - 10920`` (``exp``: 0.07 where eager and float64 give 1)."""
    x = (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    x[2, 3] = big

    def fn(x):
        z = x / 3
        return z - torch.logsumexp(z, -1, keepdim=True) if log else torch.exp(z - z.logsumexp(-1, keepdim=True))
    _fused_once(fn, x, log=log, inf_rows="lse")


def test_decomposed_softmax():
    x, keep, _ = _data(torch.float32)

    def fn(x, k):
        s = x.masked_fill(~k, -INF)
        e = (s - s.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)
    _fused_once(fn, x, keep, mask_kind="bool")


def test_safe_softmax_gives_zero_rows():
    x, keep, _ = _data(torch.float32)
    fused, d = _fused_once(lambda x, k: torch.ops.aten._safe_softmax(x.masked_fill(~k, -INF), -1), x, keep,
                           empty_rows="zero")
    assert (fused(x, keep)[1] == 0).all()


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_other_dims(dim):
    x, _, _ = _data(torch.float32, shape=(4, 6, 8, 5), seed=dim)
    keep = torch.rand(4, 6, 1, 5) > 0.2
    _fused_once(lambda x, k: torch.softmax(x.masked_fill(~k, -1e30) * 2.0, dim), x, keep, dim=dim - 4)


# ------------------------------------------------------------------------------------------ near misses

def _not_fused(fn, *args, absent=()):
    """No softmax block applied; no softmax candidate takes the nodes named (the near miss); the output is
    the captured graph's, bit for bit."""
    model = Fn(fn).eval()
    fused = AutoFusionEngine.fuse(model, args)
    assert not fused.report.applied and not _calls(fused.graph_module), fused.report.summary()
    taken = {n for d in fused.report.decisions if d.pattern == "softmax" for n in d.nodes}
    assert not taken & set(absent), fused.report.summary()
    with torch.no_grad():
        assert torch.equal(fused(*args), model(*args))
    return fused


def test_near_miss_per_element_scale():
    x, _, _ = _data(torch.float32)
    t = torch.rand_like(x)
    _not_fused(lambda x, t: torch.softmax(x * t, -1), x, t, absent=("mul",))


def test_near_miss_mask_after_the_softmax():
    x, keep, _ = _data(torch.float32)
    _not_fused(lambda x, k: torch.softmax(x, -1).masked_fill(~k, 0.0), x, keep, absent=("masked_fill",))


def test_near_miss_a_fill_that_does_not_mask():
    x, keep, _ = _data(torch.float32)
    _not_fused(lambda x, k: x.masked_fill(~k, 0.5).softmax(-1), x, keep, absent=("masked_fill",))


def test_near_miss_masks_that_would_broadcast_the_scores():
    """The kernel reads x as it is and broadcasts the mask: a sum of two broadcast operands, or a keep-mask
    larger than the scores, would need x broadcast."""
    a, b = torch.randn(2, 1, 32), torch.randn(1, 4, 32)
    _not_fused(lambda a, b: torch.softmax(a + b, -1), a, b, absent=("add",))
    x, big = torch.randn(2, 1, 16, 32), torch.rand(2, 4, 16, 32) > 0.3
    _not_fused(lambda x, k: torch.where(k, x, -INF).softmax(-1), x, big, absent=("where",))


def test_near_miss_candidates_are_not_found():
    """The same near misses at the matcher: the chain stops before the op that does not qualify."""
    x, keep, _ = _data(torch.float32)
    for fn, args in ((lambda x, t: torch.softmax(x * t, -1), (x, torch.rand_like(x))),
                     (lambda x, k: x.masked_fill(~k, 0.5).softmax(-1), (x, keep))):
        gm = canonicalize(capture(Fn(fn).eval(), args).graph_module)
        assert find_softmax(gm) == []


# ------------------------------------------------------------------------------------------ other families

def test_attention_softmax_is_claimed_by_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    keep = torch.rand(2, 1, 16, 16) > 0.2
    model = build_variant(AttentionVariant(mask="masked_fill")).eval()
    fused = AutoFusionEngine.fuse(model, (q, k, v, keep))
    assert [d.pattern for d in fused.report.applied] == ["attention"], fused.report.summary()
    (s,) = [d for d in fused.report.decisions if d.pattern == "softmax"]
    assert s.reason_code == "conflict" and "saves more" in s.reason


class _Router(nn.Module):
    """Mixtral's router: softmax in fp32 of bf16 logits, top-2, renormalised, back to bf16."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(32, 8, bias=False)

    def forward(self, x):
        p = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(p, 2, dim=-1)
        return (w / w.sum(-1, keepdim=True)).to(x.dtype), idx


def test_router_softmax_is_claimed_by_moe_gating():
    torch.manual_seed(0)
    router = _Router().to(torch.bfloat16).eval()
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    fused = AutoFusionEngine.fuse(router, (x,))
    assert [d.pattern for d in fused.report.applied] == ["moe_gating"], fused.report.summary()
    assert [d.reason_code for d in fused.report.decisions if d.pattern == "softmax"] == ["conflict"]


def test_training_attention_runs_its_softmax_fused_and_keeps_dropout():
    """With the attention family off, a training-mode attention block keeps its dropout; its scale, mask and
    softmax are fused by this family, and gradients flow through the fused op (recomputed on the host)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    keep = torch.rand(2, 1, 16, 16) > 0.2
    model = build_variant(AttentionVariant(mask="masked_fill", dropout=True)).train()
    fused = AutoFusionEngine.fuse(model, (q, k, v, keep), fusion_switches={"attention": "off"})
    codes = {d.pattern: d.reason_code for d in fused.report.decisions}
    # the generic vector chain (fill + softmax) is a candidate too and loses to the softmax family
    assert codes == {"attention": "disabled_by_switch", "softmax": "fused", "vector_chain": "conflict"}, \
        fused.report.summary()
    torch.manual_seed(1)
    want = model(q, k, v, keep)
    gw = torch.autograd.grad(want.sum(), (q, k, v))
    torch.manual_seed(1)                        # the same dropout masks: only the softmax's rounding differs
    got = fused(q, k, v, keep)
    gg = torch.autograd.grad(got.sum(), (q, k, v))
    # fp32 both sides: a few ulps of each probability (rtol 1e-5), carried through the dropout and P·V
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ the op

def test_op_fake_autograd_and_twin():
    x, keep, add = _data(torch.float32, shape=(2, 3, 5, 32))
    args = (x, keep)
    kw = {"scale": 0.5, "fill": -1e4, "out_dtype": "float16"}
    torch.library.opcheck(OP, args, kw)
    y = scaled_masked_softmax(x, keep, scale=0.5, fill=-1e4, out_dtype=torch.float16)
    twin = reference_scaled_masked_softmax(x, keep, scale=0.5, fill=-1e4, out_dtype="float16")
    assert y.dtype == torch.float16
    # both fp32 then one rounding to fp16: equal but where an fp32 ulp apart straddles an fp16 rounding boundary
    torch.testing.assert_close(y, twin, rtol=2.0 ** -10, atol=2.0 ** -24)
    xg, ag = x.clone().requires_grad_(), add.clone().requires_grad_()
    scaled_masked_softmax(xg, ag, log=True).sum().backward()
    xr, ar = x.clone().requires_grad_(), add.clone().requires_grad_()
    torch.log_softmax(xr + ar, -1).sum().backward()
    finite = torch.isfinite(ar.grad)
    torch.testing.assert_close(xg.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ag.grad[finite], ar.grad[finite], rtol=1e-5, atol=1e-5)
    assert autofuse.ops.REFERENCES["scaled_masked_softmax"] is reference_scaled_masked_softmax
    with pytest.raises(ValueError, match="would broadcast x"):
        scaled_masked_softmax(x[:, :1], keep.expand(2, 3, 5, 32))
    assert math.isnan(float(scaled_masked_softmax(x, torch.zeros(32, dtype=torch.bool))[0, 0, 0, 0]))


class Float8RoundTrip(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x.to(torch.float8_e4m3fn).to(torch.float32) * 2.0, -1) + 1


def test_near_miss_a_round_trip_through_float8_is_not_a_cast_of_the_block():
    """x.to(float8).to(float32) rounds x: the softmax block starts after it (it failed verification when the
    round trip was taken into the block as two casts)."""
    x = torch.randn(4, 64)
    fused = AutoFusionEngine.fuse(Float8RoundTrip(), (x,))
    assert not [d for d in fused.report.decisions if d.reason_code == "verification_failed"], fused.report.summary()
    sm = [d for d in fused.report.applied if d.pattern == "softmax"]
    assert sm and not {"_to_copy", "_to_copy_1"} & set(sm[0].nodes), fused.report.summary()
    torch.testing.assert_close(fused(x), Float8RoundTrip()(x))


@pytest.mark.parametrize("through", [torch.float16, torch.bfloat16])
def test_near_miss_a_16_bit_round_trip_before_the_softmax_is_not_a_cast_of_the_block(through):
    """``(x * 0.25).bfloat16().float()`` in an fp32 model rounds the scores (fake quantisation): the kernel,
    computing in fp32, would drop the rounding (7e-3 off eager). No softmax block takes the round trip (a block may
    take its second cast, an fp32 upcast of its 16-bit input, the rounding left to the first); the fused model
    keeps it."""
    x = torch.randn(4, 8, 16) * 8
    model = Fn(lambda x: torch.softmax((x * 0.25).to(through).float(), -1) * 2).eval()
    fused = AutoFusionEngine.fuse(model, (x,))
    for d in fused.report.applied:
        assert d.pattern != "softmax" or "_to_copy" not in d.nodes, fused.report.summary()
    # a generated kernel's exp and sum in another order than torch's: a few fp32 roundings of values at most 2
    torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_16_bit_rounding_of_the_probabilities_is_the_blocks_output_dtype():
    """``softmax(x).bfloat16().float()``: the softmax block ends at the narrowing cast, its output rounded as
    eager rounds it; the widening after it is outside the block."""
    x, _, _ = _data(torch.float32)
    _fused_once(lambda x: torch.softmax(x * 0.25, -1).to(torch.bfloat16), x, out_dtype=torch.bfloat16)
    model = Fn(lambda x: torch.softmax(x * 0.25, -1).bfloat16().float() * 2).eval()
    fused = AutoFusionEngine.fuse(model, (x,))
    assert [d.params["out_dtype"] for d in fused.report.applied if d.pattern == "softmax"] == [torch.bfloat16]
    # the rounding to bfloat16 is eager's; fp32 exp and sum in another order may move a value across a bf16
    # rounding boundary: one bf16 step of a probability (at most 1), times 2
    torch.testing.assert_close(fused(x), model(x), atol=2 * 2 ** -8, rtol=0)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype,cast", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                        (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_a_16_bit_softmax_cast_to_another_dtype_keeps_its_own_rounding(dtype, cast, log):
    """``softmax(x16 * 0.25).float()``: eager's softmax rounds the probabilities to x's dtype and the cast then
    widens them (or rounds them again, to the other 16-bit dtype). A block taking the cast in would write the
    cast's dtype straight from fp32 and drop the first rounding (2e-3 off eager in bf16). The block ends at the
    softmax, written in x's dtype; the cast runs after it."""
    x, _, _ = _data(dtype)
    f = torch.log_softmax if log else torch.softmax
    model = Fn(lambda x: f(x * 0.25, -1).to(cast) * 2).eval()
    fused = AutoFusionEngine.fuse(model, (x,))
    assert [d.params["out_dtype"] for d in fused.report.applied if d.pattern == "softmax"] == [dtype], \
        fused.report.summary()
    with torch.no_grad():
        got, want = fused(x), model(x)
        ref = _F64(fused.plans[next(iter(fused.plans))].captured.graph_module).run(_f64(x))[0]
    assert got.dtype == want.dtype == cast
    assert torch.equal((got / 2).to(dtype).to(cast), got / 2)    # every probability rounded to x's dtype, as eager's
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scores_the_model_rounds_down_are_read_rounded(dtype, log):
    """``softmax(x.half() * 0.5 + mask16)`` of fp32 scores x: the model rounds x to 16 bits, a kernel reading x and
    computing in fp32 would not (7.6x eager's error against the exact value of the model's own 16-bit operands in
    fp16, 5x in bf16). The block starts after the cast and reads x as rounded. A chain that only widens
    (``x16.float() * 0.5 + mask``) still takes its cast in."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 32, 32, generator=g) * 8
    mask = torch.zeros(1, 1, 32, 32)
    mask[..., 24:] = -INF
    f = torch.log_softmax if log else torch.softmax
    model = Fn(lambda x, m: f(x.to(dtype) * 0.5 + m.to(dtype), -1)).eval()
    fused = AutoFusionEngine.fuse(model, (x, mask))
    (d,) = [d for d in fused.report.applied if d.pattern == "softmax"]
    assert d.params["dtype"] == dtype, fused.report.summary()
    with torch.no_grad():
        got, want = fused(x, mask), model(x, mask)
    exact = f(x.to(dtype).double() * 0.5 + mask.double(), -1)
    ok, err, tol = compare(want, exact, got)
    assert ok, (err, tol)
    _fused_once(lambda x, m: f(x.float() * 0.5 + m, -1), x.to(dtype), mask, dtype=dtype, scale=0.5,
                out_dtype=torch.float32)


class _LargeSoftmax(torch.nn.Module):
    def forward(self, x, mask):
        return torch.softmax(x * 0.125 + mask, -1)


@pytest.mark.parametrize("faulty", [False, True])
def test_a_large_softmax_is_verified_on_reduced_shapes(monkeypatch, faulty):
    """A standalone softmax too large to check at its size (every block counts as such here) is checked on the
    same computation with its dims above 256 reduced: the block and its mask as views of the same sizes; a
    kernel off by a little is rejected there too."""
    import autofuse.ops
    import autofuse.verify
    from conftest import off_by_a_bit
    monkeypatch.setattr(autofuse.verify, "LARGEST_CHECKED", 0)
    if faulty:
        off_by_a_bit(monkeypatch, autofuse.ops, "softmax")
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(2, 3, 300, 260, generator=g), torch.randn(1, 1, 300, 260, generator=g)
    fused = AutoFusionEngine.fuse(_LargeSoftmax(), (x, mask), fusion_switches={"vector_chain": "off"})
    (d,) = fused.report.of("softmax")
    assert "verified on reduced shapes (260 -> 80, 300 -> 80)" in d.verify_note, d.verify_note
    if faulty:
        assert d.reason_code == "verification_failed", fused.report.summary()
    else:
        assert d.applied, fused.report.summary()
        # the kernel's fp32 softmax against eager's: a few fp32 roundings of values at most 1
        torch.testing.assert_close(fused(x, mask), _LargeSoftmax()(x, mask), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------ logsumexp's +inf rows

def _special_rows(x):
    """x with the rows the logsumexp spellings treat apart from softmax: +inf (once, twice, with -inf beside
    it), all -inf, NaN, and NaN with +inf (NaN wins: torch's max of that row is NaN)."""
    x = x.clone()
    x[0, 0, 1, 3] = INF
    x[0, 1, 2, 5] = x[0, 1, 2, 20] = INF
    x[0, 2, 3, 4], x[0, 2, 3, 9] = INF, -INF
    x[1, 0, 0] = -INF
    x[1, 1, 1, 7] = float("nan")
    x[1, 2, 2, 3], x[1, 2, 2, 8] = INF, float("nan")
    return x


def _same_specials(got, want, what):
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(got), test(want)), (what, test.__name__, int((test(got) != test(want)).sum()))


def scores_grad_as_eagers(got, want, xg, xe, dtype):
    """The gradient of the scores ``xg`` through the fused output ``got`` and of ``xe`` through eager's ``want``, for
    one random output gradient: NaN and infinities at eager's places, the finite entries within 4 units of ``dtype``
    relative to the largest (the kernel's fp32 arithmetic against eager's, each rounded to ``dtype``)."""
    gout = torch.randn(want.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    (gg,), (gw,) = (torch.autograd.grad(y, t, gout) for y, t in ((got, xg), (want, xe)))
    _same_specials(gg, gw, "gradient")
    fin = torch.isfinite(gw)
    assert (gg.double() - gw.double())[fin].abs().max() <= 4 * UNIT[dtype] * max(1.0, gw.double()[fin].abs().max())


LSE_FORMS = {
    "log": lambda z: z - torch.logsumexp(z, -1, keepdim=True),
    "exp": lambda z: torch.exp(z - torch.logsumexp(z, -1, keepdim=True)),
}
LSE_PRE = {
    "plain": (lambda x: x, None),
    "scale": (lambda x: x * 0.5, None),
    "bool": (lambda x, k: (x * 0.25).masked_fill(~k, -INF), "bool"),
    "upcast": (lambda x: x.float() * 0.5, None),
}
# (an additive mask: test_logsumexp_spellings_keep_their_value_on_rows_a_finite_fill_absorbs below)


@pytest.mark.parametrize("pre", list(LSE_PRE))
@pytest.mark.parametrize("form", list(LSE_FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_logsumexp_spellings_keep_logsumexp_on_rows_whose_max_is_plus_inf(dtype, form, pre):
    """``z - logsumexp(z)`` and ``exp(z - logsumexp(z))`` fuse with ``inf_rows="lse"``: on a row holding +inf,
    logsumexp is +inf, so eager gives -inf (0) at the finite scores and NaN only at the +inf ones, where
    log_softmax (softmax) is NaN over the row; all -inf and NaN rows stay NaN. Forward and gradients equal
    eager's: the same NaN and inf positions, finite values within the verifier's bound of float64."""
    fn_pre, kind = LSE_PRE[pre]
    g = torch.Generator().manual_seed(3)
    shape = (2, 3, 4, 32)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    extra = ()
    if kind == "bool":
        keep = torch.rand(2, 1, 1, 32, generator=g) > 0.3
        keep[0, ..., 20] = False                     # one of row (0, 1, 2)'s +inf scores masked away
        keep[0, ..., 3] = True
        extra = (keep,)

    def fn(x, *m):
        return LSE_FORMS[form](fn_pre(x, *m))
    model = Fn(fn).train()
    fused = AutoFusionEngine.fuse(model, (x, *extra), fusion_switches={"vector_chain": "off"})
    applied = [d for d in fused.report.applied if d.pattern == "softmax"]
    assert len(applied) == 1, fused.report.summary()
    assert applied[0].params["inf_rows"] == "lse" and applied[0].params["log"] == (form == "log")
    xs = _special_rows(x)
    xg, xe = xs.clone().requires_grad_(), xs.clone().requires_grad_()
    got, want = fused(xg, *extra), model(xe, *extra)
    x64 = xs.double().requires_grad_()
    ref = model(x64, *[_f64(a) for a in extra])
    _same_specials(got, want, "forward")
    row = want[0, 0, 1]                              # -inf (log) or 0 (exp) but at the +inf score, NaN there
    assert int(torch.isnan(row).sum()) == 1 and int((row == (-INF if form == "log" else 0)).sum()) == 31
    ok, err, tol = compare(want.detach(), ref.detach(), got.detach())
    assert ok, (err, tol)
    gout = torch.randn(shape, generator=g).to(dtype)
    (gg,), (gw,), (gr,) = (torch.autograd.grad(y, t, gout.to(y.dtype)) for y, t in
                           ((got, xg), (want, xe), (ref, x64)))
    _same_specials(gg, gw, "gradient")
    if form == "log":                                # g at the finite scores of a +inf row, NaN at the +inf
        assert bool(torch.isfinite(gw[0, 0, 1]).sum() == 31)
    ok, err, tol = compare(gw, gr, gg)
    assert ok, ("gradient", err, tol)


@pytest.mark.parametrize("fill", ["additive", "masked_fill"])
@pytest.mark.parametrize("form", list(LSE_FORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_logsumexp_spellings_keep_their_value_on_rows_a_finite_fill_absorbs(dtype, form, fill):
    """A row whose every score is ``finfo.min`` (added to small scores, or filled in): eager's ``logsumexp``,
    ``max + log Σ`` rounded to the scores' dtype, absorbs ``log C`` into the max, so ``z - logsumexp(z)`` is 0
    and its ``exp`` 1 at every score (``log_softmax`` would give ``-log C``, ``softmax`` ``1/C``), and the
    gradient of x there is ``g - Σ g`` (times the scale), not log-softmax's. The fused kernel computes the
    statistic as eager does: the same values on that row, on partially masked rows and on a row holding +inf
    (``z - inf``), and the same gradients (eager's autograd of the spelling is the reference)."""
    lo = torch.finfo(dtype).min
    g = torch.Generator().manual_seed(5)
    shape = (2, 2, 4, 16)
    x = torch.randn(shape, generator=g).to(dtype)
    x[0, 1, 1, 3] = INF                              # a +inf row: -inf (0) at its finite scores, NaN at the +inf
    keep = torch.ones(1, 1, 4, 16, dtype=torch.bool)
    keep[..., 10:] = False                           # rows partially masked
    keep[..., 2, :] = False                          # row 2: every key masked
    m = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, lo)
    extra = (m,) if fill == "additive" else (keep,)

    def fn(x, a):
        z = x * 0.25 + a if fill == "additive" else (x * 0.25).masked_fill(~a, lo)
        return LSE_FORMS[form](z)
    model = Fn(fn).train()
    fused = AutoFusionEngine.fuse(model, (x, *extra), fusion_switches={"vector_chain": "off"})
    applied = [d for d in fused.report.applied if d.pattern == "softmax"]
    assert len(applied) == 1, fused.report.summary()
    assert applied[0].params["inf_rows"] == "lse"
    xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = fused(xg, *extra), model(xe, *extra)
    _same_specials(got, want, "forward")
    full = want[:, :, 2]
    assert bool((full == (0.0 if form == "log" else 1.0)).all())     # eager absorbs log C
    assert torch.equal(got[:, :, 2], full)
    eps = torch.finfo(dtype).eps
    fin = torch.isfinite(want)
    assert (got - want).double()[fin].abs().max() <= 2 * eps * max(1.0, want[fin].abs().max().item())
    gout = torch.ones(shape, dtype=dtype)
    gout[..., 0] = 2.0
    (gg,), (gw,) = (torch.autograd.grad(y, t, gout) for y, t in ((got, xg), (want, xe)))
    _same_specials(gg, gw, "gradient")
    expect = (0.25 * (gout[:, :, 2] - gout[:, :, 2].sum(-1, keepdim=True))).to(dtype)
    if form == "log" and fill == "additive":         # (masked_fill passes no gradient to the filled scores)
        assert torch.equal(gw[:, :, 2], expect)      # g - exp(0) Σ g, scaled
    assert torch.equal(gg[:, :, 2], gw[:, :, 2])
    gfin = torch.isfinite(gw)
    assert (gg - gw).double()[gfin].abs().max() <= 4 * eps * max(1.0, gw[gfin].abs().max().item())


def test_softmax_and_log_softmax_keep_nan_rows_for_plus_inf():
    """The softmax spellings themselves are NaN over a row holding +inf, as eager: ``inf_rows="nan"``."""
    x = _special_rows(torch.randn(2, 3, 4, 32))
    for fn, log in ((lambda x: torch.softmax(x * 0.5, -1), False), (lambda x: F.log_softmax(x * 0.5, -1), True)):
        fused, d = _fused_once(fn, torch.randn(2, 3, 4, 32), log=log, inf_rows="nan")
        with torch.no_grad():
            got, want = fused(x), fn(x)
        _same_specials(got, want, "forward")
        assert bool(torch.isnan(got[0, 0, 1]).all())


def test_exp_logsumexp_attention_is_not_flash_attention():
    """An attention whose softmax is spelled ``exp(s - logsumexp(s))`` is no flash attention (a row with a +inf
    score weights every other key 0 there, so dV stays finite but at that key, where flash attention's softmax
    is NaN over the row); its softmax is fused with the logsumexp semantics and eager's values come out."""
    class Att(nn.Module):
        def forward(self, q, k, v):
            s = q @ k.transpose(-2, -1) * 0.25
            return torch.exp(s - torch.logsumexp(s, -1, keepdim=True)) @ v

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    model = Att().train()
    fused = AutoFusionEngine.fuse(model, (q, k, v))
    assert "attention" not in [d.pattern for d in fused.report.applied], fused.report.summary()
    assert [d.params["inf_rows"] for d in fused.report.applied if d.pattern == "softmax"] == ["lse"]
    q2 = q.clone()
    q2[0, 0, 3] = INF * torch.sign(k[0, 0, 5])      # row (0, 0, 3) scores +inf at key 5 (and ±inf elsewhere)
    ins = [t.clone().requires_grad_() for t in (q2, k, v)]
    ref = [t.clone().requires_grad_() for t in (q2, k, v)]
    got, want = fused(*ins), model(*ref)
    _same_specials(got, want, "forward")
    gout = torch.randn(got.shape)
    for a, b in zip(torch.autograd.grad(got, ins, gout), torch.autograd.grad(want, ref, gout)):
        _same_specials(a, b, "gradient")
        fin = torch.isfinite(b)
        torch.testing.assert_close(a[fin], b[fin], rtol=1e-4, atol=1e-5)


class _LseRouter(_Router):
    """The same router with its softmax spelled exp(z - logsumexp(z))."""

    def forward(self, x):
        z = self.gate(x).float()
        p = torch.exp(z - torch.logsumexp(z, -1, keepdim=True))
        w, idx = torch.topk(p, 2, dim=-1)
        return (w / w.sum(-1, keepdim=True)).to(x.dtype), idx


def test_router_softmax_spelled_with_logsumexp_is_not_gating():
    """Its weights on a row of logits holding +inf are 0 but at the +inf one (NaN there), where the gating
    kernel's softmax is NaN over the row: no moe_gating; the softmax family keeps logsumexp's meaning."""
    torch.manual_seed(0)
    router = _LseRouter().to(torch.bfloat16).eval()
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    fused = AutoFusionEngine.fuse(router, (x,))
    assert "moe_gating" not in [d.pattern for d in fused.report.applied], fused.report.summary()
    with torch.no_grad():
        router.gate.weight[3] = INF                  # logit 3 is +inf wherever x sums positive
        got, want = fused(x), router(x)
    _same_specials(got[0], want[0], "weights")
    assert torch.equal(got[1][~want[0].isnan().any(-1)], want[1][~want[0].isnan().any(-1)])


# ------------------------------------------------------------------------- a 16-bit additive mask: eager's add

class PaddedSoftmax(nn.Module):
    """A standalone softmax (or log_softmax) over ``x + m``, ``m`` the additive padding mask made from a 1/0 keep
    tensor in x's dtype: ``(1 - keep) * value`` (``finfo(x.dtype).min`` or ``-1e4``), or 0 / ``-inf``."""

    def __init__(self, value, log):
        super().__init__()
        self.value, self.log = value, log

    def forward(self, x, keep):
        if self.value == "-inf":
            m = torch.zeros(keep.shape, dtype=x.dtype).masked_fill(keep == 0, -INF)
        else:
            v = torch.finfo(x.dtype).min if self.value == "finfo.min" else self.value
            m = (1.0 - keep.to(x.dtype)) * v
        z = x + m[:, None, None, :]
        return torch.log_softmax(z, -1) if self.log else torch.softmax(z, -1)


def _padded_inputs(dtype):
    """Scores ``[2, 2, 16, 16]`` and a keep tensor: batch 0 masks every key (a padded row), batch 1 keys 10 on."""
    x = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    keep = torch.ones(2, 16)
    keep[0] = 0
    keep[1, 10:] = 0
    return x, keep


UNIT = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("value", ["finfo.min", -1e4, "-inf"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_a_16_bit_mask_is_added_as_eager_adds_it(dtype, value, log):
    """The captured add of a 16-bit mask to 16-bit scores is eager's 16-bit add: the fused kernel adds it so
    (``mask_add_dtype``, the add's dtype; None in fp32, whose add the kernel's is), and the fused model is eager's,
    forward and the scores' gradient, a fully masked row included (uniform with ``finfo.min``: every score absorbed;
    NaN with ``-inf``). Adding the fp16 mask in fp32 kept the scores' differences there: 0.61 off eager for softmax,
    3.6 for log_softmax."""
    x, keep = _padded_inputs(dtype)
    model = PaddedSoftmax(value, log).train()
    fused = AutoFusionEngine.fuse(model, (x, keep))
    applied = [d for d in fused.report.applied if d.pattern == "softmax"]
    assert len(applied) == 1, fused.report.summary()
    assert applied[0].params.get("mask_add_dtype") == (None if dtype == torch.float32 else dtype)
    assert applied[0].to_dict()["params"].get("mask_add_dtype") == \
        (None if dtype == torch.float32 else str(dtype).replace("torch.", ""))
    xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = fused(xg, keep), model(xe, keep)
    _same_specials(got, want, "forward")
    fin = torch.isfinite(want)
    unit = UNIT[dtype]
    assert ((got.double() - want.double())[fin].abs() <= unit * (want.double()[fin].abs() + 1)).all(), \
        (got.double() - want.double())[fin].abs().max()
    if value == "finfo.min" and not log:
        assert (got[0].double() - 1 / 16).abs().max() <= unit, "the padded row is uniform, as eager's"
    scores_grad_as_eagers(got, want, xg, xe, dtype)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_verification_rejects_a_kernel_that_adds_a_16_bit_mask_in_fp32(monkeypatch, log):
    """The kernel as it was (the fp16 mask added in fp32, ``mask_add_dtype`` not passed on) disagrees with eager at
    the padded row, and verification rejects it: its float64 reference adds a 16-bit mask's masking values as eager
    adds them (:class:`autofuse.verify._F64`). Against the float64 sum it did not (the float64 run keeps the scores'
    differences under -65504 as the fp32 add does; eager's error there, 0.6 and 6, made the bound 1.2 and 76)."""
    import patterns.softmax
    monkeypatch.setattr(patterns.softmax, "_mask_add_dtype", lambda *a: None)
    x, keep = _padded_inputs(torch.float16)
    model = PaddedSoftmax("finfo.min", log).eval()
    fused = AutoFusionEngine.fuse(model, (x, keep))
    codes = {d.pattern: d.reason_code for d in fused.report.decisions}
    assert codes["softmax"] == "verification_failed", fused.report.summary()
    with torch.no_grad():
        got, want = fused(x, keep), model(x, keep)
    assert torch.equal(got, want)


def test_the_float64_reference_adds_a_16_bit_mask_as_eager_does():
    """``_F64`` (the verifier's float64 run): a 16-bit add where an operand holds a masking value (at or below -1e4)
    gives eager's 16-bit sum there, with the gradient passing through; elsewhere, and for an fp32 add, the float64
    sum."""
    from autofuse.verify import _masked_sum
    a = torch.tensor([1.25, 3.0, -2.0, 7.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([-65504.0, -1e4, 0.5, -INF], dtype=torch.float64)
    out = _masked_sum(a + b, a, b, torch.float16)
    assert out.tolist() == [-65504.0, -10000.0, -1.5, -INF]     # -9997 is -10000 in fp16 (a step of 8 there)
    out[:3].sum().backward()
    assert a.grad.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert torch.equal(_masked_sum(a + b, a, b, torch.bfloat16)[2:3], torch.tensor([-1.5], dtype=torch.float64))


# ------------------------------------------------------- a 16-bit additive mask added to fp32 scores, then scaled

ONLY_SOFTMAX = {"softmax": "force", "vector_chain": "off"}      # the softmax kernel, whatever the cost model says


class WidenedBias(nn.Module):
    """``softmax((x.float() + b [+ b2]) * scale).half()`` (or log_softmax), the 16-bit biases promoted to the fp32
    scores by the add: eager adds each bias in fp32 and scales the fp32 sum."""

    def __init__(self, scale, log):
        super().__init__()
        self.scale, self.log = scale, log

    def forward(self, x, *biases):
        z = x.float()
        for b in biases:
            z = z + b
        z = z * self.scale
        return (torch.log_softmax(z, -1) if self.log else torch.softmax(z, -1)).half()


def _widened_inputs(bdtype, n):
    """fp16 scores ``[2, 2, 8, 16]`` and ``n`` ALiBi-like biases in ``bdtype`` (the last keys of the first at
    ``-1e4``), whose products with a scale that is not a power of two are not exact in 16 bits."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 2, 8, 16, generator=g) * 4).half()
    biases = []
    for i in range(n):
        b = -torch.rand(1, 2, 8, 16, generator=g) * 40
        if i == 0:
            b[..., -3:] = -1e4
        biases.append(b.to(bdtype))
    return x, biases


@pytest.mark.parametrize("n", [1, 2], ids=["one_mask", "two_masks"])
@pytest.mark.parametrize("scale", [0.3, 0.5])
@pytest.mark.parametrize("bdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_a_16_bit_mask_added_to_fp32_scores_is_scaled_and_summed_in_fp32(log, bdtype, scale, n):
    """The kernel's mask is built as eager's arithmetic goes: each 16-bit bias cast up to the fp32 the graph adds
    it in, then scaled and summed there (no ``mask_add_dtype``). Scaling a bf16 bias by 0.3 in bf16 (what the mask
    was built with) gave softmax(x*0.3 + bf16(b*0.3)): 5x eager's error against float64, and a -1e4 log_softmax
    mask -3006 for eager's -3010; summing two masks in 16 bits rounded the sum."""
    x, biases = _widened_inputs(bdtype, n)
    model = WidenedBias(scale, log).eval()
    args = (x, *biases)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=ONLY_SOFTMAX, verify=False)
    applied = [d for d in fused.report.applied if d.pattern == "softmax"]
    assert len(applied) == 1 and len(_calls(fused.graph_module)) == 1, fused.report.summary()
    assert applied[0].params.get("mask_add_dtype") is None
    with torch.no_grad():
        got, want = fused(*args), model(*args)
        z = x.double()
        for b in biases:
            z = z + b.double()
        ref = (torch.log_softmax if log else torch.softmax)(z * scale, -1)
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)
    if log:                                     # the -1e4 positions: eager's value, not 2 fp16 ulps off
        assert torch.equal(got[..., -3:], want[..., -3:])


def test_a_bf16_bias_scaled_after_an_fp32_add_is_fused_as_eager():
    """The spelling above as it comes (no switch, verified): fused as the softmax family, eager's values."""
    x, (b,) = _widened_inputs(torch.bfloat16, 1)
    model = WidenedBias(0.3, False).eval()
    fused = AutoFusionEngine.fuse(model, (x, b))
    assert [d.pattern for d in fused.report.applied] == ["softmax"], fused.report.summary()
    with torch.no_grad():
        got, want = fused(x, b), model(x, b)
        ref = torch.softmax((x.double() + b.double()) * 0.3, -1)
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.3, 0.5])
def test_a_16_bit_mask_added_in_16_bits_then_scaled(dtype, scale):
    """Scores and mask of one 16-bit dtype, added there and scaled: by a power of two the kernel adds the mask in
    that dtype (``mask_add_dtype``; the scaling commutes with the rounding), by 0.3 in fp32 (the mask cast up
    before it is scaled): within the bound of eager either way."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 2, 8, 16, generator=g) * 4).to(dtype)
    m = (-torch.rand(1, 1, 8, 16, generator=g) * 40).to(dtype)
    m[..., -3:] = torch.finfo(dtype).min
    model = Fn(lambda x, m: torch.softmax((x + m) * scale, -1)).eval()
    fused = AutoFusionEngine.fuse(model, (x, m), fusion_switches=ONLY_SOFTMAX, verify=False)
    applied = [d for d in fused.report.applied if d.pattern == "softmax"]
    assert len(applied) == 1, fused.report.summary()
    assert applied[0].params.get("mask_add_dtype") == (dtype if scale == 0.5 else None)
    with torch.no_grad():
        got, want = fused(x, m), model(x, m)
        ref = _F64(fused.plans[next(iter(fused.plans))].captured.graph_module).run(_f64(x), _f64(m))[0]
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)
