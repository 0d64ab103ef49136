"""torch.ops.autofuse.scaled_masked_softmax's backward: the op as a Vector program, differentiated and run as one
vector_program launch, against torch autograd of the op's twin on float64 leaves."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import autofuse.ops_softmax as osm
from autofuse.ops import recording

# fp32: both sides compute in fp32 (the reference's softmax backward is the closed form, the program's the
# chain rule through max, exp, sum and div): a few fp32 ulps of the largest gradient over sums of 40 columns;
# fp16/bf16: the gradient rounded once to the input's dtype, one ulp of the largest
TOL = {torch.float32: 2e-6, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def grads(x, mask, **kw):
    x = x.clone().requires_grad_()
    m = mask.clone().requires_grad_() if mask is not None and mask.is_floating_point() else mask
    y = osm.scaled_masked_softmax(x, m, **kw)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    with recording() as log:
        y.backward(g)
    xl = x.detach().double().requires_grad_()
    ml = m.detach().double().requires_grad_() if m is not None and m.is_floating_point() else m
    osm.reference_scaled_masked_softmax(xl, ml, upcast=True, **kw).backward(g.double())
    pairs = [(x.grad, xl.grad)] + ([(m.grad, ml.grad)] if m is not None and m.is_floating_point() else [])
    return [k for k, _ in log], pairs


def _close(got, want, dtype):
    assert bool((got.isnan() == want.isnan()).all())
    got, want = got.double().nan_to_num(), want.nan_to_num()
    assert (got - want).abs().max() <= TOL[dtype] * want.abs().max() + 1e-12


g = torch.Generator().manual_seed(0)
X = torch.randn(2, 3, 8, 40, generator=g)
BOOL = torch.rand(2, 1, 8, 40, generator=g) < 0.5
BOOL[0, 0, 3] = False                                   # an all-masked row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask, kw", [(None, {}), (None, {"log": True, "scale": 0.3}),
                                      (BOOL, {"empty_rows": "zero"}), (BOOL, {"empty_rows": "nan", "scale": 0.125}),
                                      (torch.randn(1, 1, 8, 40, generator=g), {}),
                                      (torch.randn(8, 40, generator=g), {"log": True})],
                         ids=["plain", "log", "bool_zero", "bool_nan", "additive_bcast", "additive_log"])
def test_gradients(dtype, mask, kw):
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    launches, pairs = grads(X.to(dtype), mask, **kw)
    assert launches == ["vector_program"]
    for got, want in pairs:
        _close(got, want, dtype)


def test_other_dim_falls_back_to_host():
    launches, pairs = grads(X, None, dim=2)
    assert launches == []
    _close(*pairs[0], torch.float32)


def test_backward_traced_as_one_launch():
    mask = torch.randn(8, 40).requires_grad_()

    def step(x, m):
        y = osm.scaled_masked_softmax(x, m, scale=0.5)
        return torch.autograd.grad((y * y).sum(), [x, m])

    gm = make_fx(step, tracing_mode="fake")(X.clone().requires_grad_(), mask)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.autofuse.vector_program.default) == 1
    assert ops.count(torch.ops.autofuse.scaled_masked_softmax.default) == 1


# ------------------------------------------------------------------------------------- inf_rows="lse"

INF = float("inf")
XI = X.clone()
XI[0, 0, 1, 3] = INF                                    # +inf once
XI[0, 1, 2, 5] = XI[0, 1, 2, 30] = INF                  # twice
XI[0, 2, 3, 4], XI[0, 2, 3, 9] = INF, -INF              # with -inf beside it
XI[1, 0, 0] = -INF                                      # all -inf
XI[1, 1, 1, 7] = float("nan")                           # NaN
XI[1, 2, 2, 3], XI[1, 2, 2, 8] = INF, float("nan")      # NaN wins over +inf
KEEP = torch.rand(2, 1, 8, 40, generator=g) < 0.7
KEEP[0, 0, 1, 3] = KEEP[0, 0, 2, 5] = KEEP[0, 0, 3, 4] = True
ADD = torch.randn(1, 1, 8, 40, generator=g)


def _eager_lse(x, mask, scale=None, log=False, dim=-1, **_):
    """The logsumexp spelling the op replaces, as eager computes it (in the leaves' dtype)."""
    z = x if scale is None else x * scale
    if mask is not None:
        z = z.masked_fill(~mask, -INF) if mask.dtype == torch.bool else z + mask
    y = z - torch.logsumexp(z, dim, keepdim=True)
    return y if log else y.exp()


def _same_specials(got, want):
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(got), test(want)), (test.__name__, int((test(got) != test(want)).sum()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask, kw", [(None, {}), (None, {"log": True, "scale": 0.3}), (KEEP, {"scale": 0.125}),
                                      (KEEP, {"log": True}), (ADD, {}), (ADD, {"log": True}),
                                      (None, {"dim": 2}), (None, {"dim": 2, "log": True})],
                         ids=["plain", "log", "bool", "bool_log", "additive", "additive_log", "dim2", "dim2_log"])
def test_lse_rows_forward_and_gradients_are_eagers(dtype, mask, kw):
    """``inf_rows="lse"``: a row whose max is +inf gives ``z - inf`` (log) or ``exp(z - inf)``, as eager's
    ``z - logsumexp(z)`` does (-inf / 0 at finite scores, NaN at +inf ones), and the gradients of x and of an
    additive mask are eager's autograd of that spelling: NaN exactly where eager's are, finite ones equal to the
    float64 run's within the op's tolerance or twice eager's own error in x's dtype (logsumexp is rounded to
    it, in eager as in the kernel). Last dim: one vector_program launch; another dim: the host."""
    x = XI.to(dtype)
    if mask is not None and mask.is_floating_point():
        mask = mask.detach().to(dtype).clone().requires_grad_()
    xg = x.clone().requires_grad_()
    y = osm.scaled_masked_softmax(xg, mask, inf_rows="lse", **kw)
    xl = x.double().requires_grad_()
    ml = mask.detach().double().requires_grad_() if mask is not None and mask.is_floating_point() else mask
    want = _eager_lse(xl, ml, **kw)
    xe = x.clone().requires_grad_()
    me = mask.detach().clone().requires_grad_() if ml is not None and ml.is_floating_point() else mask
    eager = _eager_lse(xe, me, **kw)
    _same_specials(y, want)
    fin = torch.isfinite(want)
    assert (y.double() - want)[fin].abs().max() <= 4 * TOL[dtype] * max(1.0, want[fin].abs().max().item())
    gout = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    with recording() as log:
        y.backward(gout)
    want.backward(gout.double())
    eager.backward(gout)
    assert [k for k, _ in log] == ([] if kw.get("dim") == 2 else ["vector_program"])
    pairs = [(xg.grad, xl.grad, xe.grad)] + ([(mask.grad, ml.grad, me.grad)] if ml is not None and
                                             ml.is_floating_point() else [])
    for got, ref, eag in pairs:
        _same_specials(got, ref)
        err = (eag.double() - ref).nan_to_num().abs().max()
        assert (got.double() - ref).nan_to_num().abs().max() <= max(2 * err, TOL[dtype] * ref.nan_to_num().abs().max())


def test_lse_rows_twin_and_fake():
    """The torch twin gives the kernel's values (NaN and inf where the kernel has them); the fake takes the new
    argument; ``inf_rows`` must be "nan" or "lse"."""
    y = osm.scaled_masked_softmax(XI, KEEP, scale=0.5, inf_rows="lse", out_dtype=torch.float16)
    twin = osm.reference_scaled_masked_softmax(XI, KEEP, scale=0.5, inf_rows="lse", out_dtype="float16")
    _same_specials(y, twin)
    torch.testing.assert_close(y.nan_to_num(), twin.nan_to_num(), rtol=2.0 ** -10, atol=2.0 ** -24)
    torch.library.opcheck(torch.ops.autofuse.scaled_masked_softmax.default, (X, None),
                          {"log": True, "inf_rows": "lse"})
    with pytest.raises(ValueError, match="inf_rows"):
        osm.scaled_masked_softmax(X, inf_rows="inf")
    # the default keeps softmax's own semantics: NaN over a row whose max is +inf
    assert bool(osm.scaled_masked_softmax(XI)[0, 0, 1].isnan().all())


# ------------------------------------------------------------------------- an additive 16-bit mask, eager's add

def _padding(dtype, value):
    """An additive padding mask ``[2, 1, 1, 40]`` of ``dtype``: batch 0 masks every key with ``value`` (a padded
    row), batch 1 a random third of them."""
    keep = torch.rand(2, 1, 1, 40, generator=torch.Generator().manual_seed(3)) > 0.33
    keep[0] = False
    return torch.where(keep, 0.0, value).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("value", ["finfo.min", -1e4, -INF])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [-1, 2])
def test_mask_added_as_eager_adds_it_forward_and_gradients(dtype, value, log, dim):
    """``mask_add_dtype`` (the mask's own 16-bit dtype; None for fp32, whose add is the kernel's): the op is eager's
    ``softmax(x + m)`` or ``log_softmax``, values and the gradients of x and of the mask (eager's autograd in the
    leaves' dtype, the reference), a row whose every key is masked included (uniform with ``finfo.min``: the mask
    absorbs every score; NaN with ``-inf``). Last dim: the derived Vector program; another dim: the host."""
    value = torch.finfo(dtype).min if value == "finfo.min" else value
    x = (X * 3).to(dtype)
    m = _padding(dtype, value)
    if dim == 2:
        x, m = x.transpose(2, 3).contiguous(), m.transpose(2, 3).contiguous()
    add = None if dtype == torch.float32 else dtype
    xg, mg = x.clone().requires_grad_(), m.clone().requires_grad_()
    y = osm.scaled_masked_softmax(xg, mg, dim=dim, log=log, mask_add_dtype=add)
    xe, me = x.clone().requires_grad_(), m.clone().requires_grad_()
    want = torch.log_softmax(xe + me, dim) if log else torch.softmax(xe + me, dim)
    _same_specials(y, want)
    fin = torch.isfinite(want)
    unit = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}[dtype]
    # the same fp32 softmax of the same sums, each output rounded once: an output rounding apart
    assert ((y.double() - want.double())[fin].abs() <= unit * (want.double()[fin].abs() + 1)).all()
    if value == torch.finfo(dtype).min and not log:
        row = y[0].double()
        assert (row - 1 / 40).abs().max() <= unit, "a fully masked row is uniform, as eager's"
    gout = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    with recording() as launches:
        gx, gm = torch.autograd.grad(y, (xg, mg), gout)
    wx, wm = torch.autograd.grad(want, (xe, me), gout)
    assert [k for k, _ in launches] == ([] if dim == 2 else ["vector_program"])
    for got, ref in ((gx, wx), (gm, wm)):
        _same_specials(got, ref)
        fin = torch.isfinite(ref)
        # eager rounds its softmax backward once to the dtype (the mask's, summed over the broadcast, too)
        assert (got.double() - ref.double())[fin].abs().max() <= 4 * unit * max(1.0, ref.double()[fin].abs().max())


def test_mask_add_dtype_twin_and_fake():
    """The torch twin adds as the kernel does (the kernel's values); the fake takes the argument; a mask of another
    dtype than ``mask_add_dtype`` is refused by the kernel."""
    x = (X * 3).half()
    m = _padding(torch.float16, torch.finfo(torch.float16).min)
    y = osm.scaled_masked_softmax(x, m, mask_add_dtype=torch.float16)
    twin = osm.reference_scaled_masked_softmax(x, m, mask_add_dtype=torch.float16)
    torch.testing.assert_close(y, twin, rtol=2.0 ** -10, atol=2.0 ** -24)
    assert not torch.allclose(osm.reference_scaled_masked_softmax(x, m)[0].float(), twin[0].float(), atol=0.1)
    torch.library.opcheck(torch.ops.autofuse.scaled_masked_softmax.default, (x, m),
                          {"log": True, "mask_add_dtype": torch.float16})
    with pytest.raises(ValueError, match="mask_add_dtype"):
        osm.scaled_masked_softmax(x, m.float(), mask_add_dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("log", [True, False])
@pytest.mark.parametrize("tiling", [None, {"block": 2, "chunk": 16}], ids=["one_pass", "two_pass"])
def test_lse_rows_a_finite_fill_absorbs_are_eagers(dtype, log, tiling):
    """``inf_rows="lse"`` computes eager's statistic, ``logsumexp = max + log Σ`` in x's dtype: on a row whose
    every score is ``finfo.min`` it is the max, so the op gives 0 (log) or 1 at every score and the gradient
    ``g - Σ g`` as eager's ``z - logsumexp(z)`` (not ``-log C``, ``1/C``); other rows, a partially masked one and
    a +inf one included, as eager within a rounding of x's dtype. One pass and online (chunks of C)."""
    lo = torch.finfo(dtype).min
    x = torch.randn(2, 3, 6, 40, generator=torch.Generator().manual_seed(7)).to(dtype)
    x[1, 2, 4, 9] = float("inf")
    mask = torch.zeros(1, 1, 6, 40, dtype=dtype)
    mask[..., 25:] = lo
    mask[..., 3, :] = lo
    kw = dict(log=log, inf_rows="lse", mask_add_dtype=None if dtype == torch.float32 else dtype, tiling=tiling)
    xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = osm.scaled_masked_softmax(xg, mask, **kw)
    want = _eager_lse(xe, mask, log=log)
    _same_specials(y, want)
    assert bool((want[:, :, 3] == (0.0 if log else 1.0)).all())
    assert torch.equal(y[:, :, 3], want[:, :, 3])
    eps = torch.finfo(dtype).eps
    fin = torch.isfinite(want)
    assert (y - want).double()[fin].abs().max() <= 2 * eps * max(1.0, want[fin].abs().max().item())
    gout = torch.ones(x.shape, dtype=dtype)
    gout[..., 0] = 2.0
    (gg,), (gw,) = (torch.autograd.grad(a, t, gout) for a, t in ((y, xg), (want, xe)))
    _same_specials(gg, gw)
    if log:
        assert torch.equal(gw[:, :, 3], gout[:, :, 3] - gout[:, :, 3].sum(-1, keepdim=True))
    assert torch.equal(gg[:, :, 3], gw[:, :, 3])
    gfin = torch.isfinite(gw)
    assert (gg - gw).double()[gfin].abs().max() <= 4 * eps * max(1.0, gw[gfin].abs().max().item())
