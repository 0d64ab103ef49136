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
