"""A generated Vector kernel's derived backward at a cast to 16 bits, against eager autograd: eager's gradient of
the 16-bit tensor a ``.half()``/``.bfloat16()`` makes is 16-bit, so the gradient that reaches the cast's fp32
operand is rounded to that dtype, also when an op widens the 16-bit value again by type promotion
(``x.bfloat16() + y16`` is fp32, ``x.half() * 3 + y32``, SwiGLU's ``silu(g).half() * u32``). Bound per gradient:
max|fused − f64| <= 2·max|eager − f64| + one rounding of the gradient's dtype, the f64 copy rounding at the
model's own 16-bit casts; and a gradient the cast's backward makes is as 16-bit exact as eager's."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine


def _cast(t, dt):
    """``t.to(dt)`` as the model writes it; a float64 copy keeps the rounding in float64."""
    return t.to(dt).double() if t.dtype == torch.float64 else t.to(dt)


class Spelling(nn.Module):
    def __init__(self, v, dt):
        super().__init__()
        self.v, self.dt = v, dt

    def forward(self, x, y):
        if self.v == "add_promoted":            # 16-bit + other 16-bit dtype (or fp32) -> fp32 by promotion
            return torch.tanh(_cast(x, self.dt) + y)
        if self.v == "mul_then_promoted":       # 16-bit * 3, then + fp32
            return torch.tanh(_cast(x, self.dt) * 3.0 + y)
        return _cast(F.silu(x * 30), self.dt) * y      # silu(g).half() * u32


class SwiGLU(nn.Module):
    """An fp32 MLP with a 16-bit cast inside (matmul epilogue): ``silu(x Wgᵀ).half() * (x Wuᵀ)``."""

    def __init__(self, dt):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.dt = dt
        self.wg = nn.Parameter(torch.randn(32, 16, generator=g) * 30.0)
        self.wu = nn.Parameter(torch.randn(32, 16, generator=g) * 30.0)

    def forward(self, x):
        return _cast(F.silu(F.linear(x, self.wg)), self.dt) * F.linear(x, self.wu)


def _grads(model, args, wants):
    args = [a.clone().requires_grad_(w) for a, w in zip(args, wants)]
    out = model(*args)
    c = (torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape) % 9 - 4) / 4
    (out.double() * c).sum().backward()
    gs = [a.grad for a in args if a.requires_grad] + [p.grad for p in model.parameters()]
    return out.detach(), gs


def _check(model, args, one):
    """``one``: the dtype of the one rounding the bound allows (the 16-bit cast's where the gradient is rounded
    to it, fp32 for the MLP's parameters)."""
    fm = AutoFusionEngine.fuse(model, tuple(args), target_device="ascend910", optimization_level="O3",
                               memory_budget="16GB")
    assert fm.report.applied, "nothing fused"
    ref = copy.deepcopy(model).double()
    wants = [a.dtype == torch.float32 for a in args]          # the fp32 leaves (a 16-bit y is data)
    r_out, r = _grads(ref, [a.double() for a in args], wants)
    e_out, e = _grads(model, args, wants)
    f_out, f = _grads(fm, args, wants)
    assert torch.equal(e_out, f_out) or (e_out.double() - f_out.double()).abs().max() <= \
        2 * (e_out.double() - r_out).abs().max() + torch.finfo(e_out.dtype).eps * r_out.abs().max()
    assert len(e) == len(f) == len(r)
    for ge, gf, gr in zip(e, f, r):
        err_e = (ge.double() - gr).abs().max()
        err_f = (gf.double() - gr).abs().max()
        assert err_f <= 2 * err_e + torch.finfo(one).eps * gr.abs().max(), (err_f, err_e, gr.abs().max())
    return e, f


DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("v", ["add_promoted", "mul_then_promoted", "silu_cast_mul"])
def test_gradient_rounded_at_a_16_bit_cast_as_eager(v, dt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 16, generator=g)
    other = torch.bfloat16 if dt == torch.float16 else torch.float16
    ydt = other if v == "add_promoted" else torch.float32
    y = torch.randn(2, 8, 16, generator=g).to(ydt)
    # silu's dx is fp32 (silu's backward of the rounded gradient); the others' the cast's backward of it
    one = torch.float32 if v == "silu_cast_mul" else dt
    e, f = _check(Spelling(v, dt), [x, y], one)
    exact = lambda t: (t.to(dt).float() == t).float().mean().item()    # noqa: E731
    if v != "silu_cast_mul":           # dx is the cast's backward of a 16-bit gradient: 16-bit exact in eager
        assert exact(e[0]) == 1.0
        assert exact(f[0]) == 1.0
    tol = 4 * torch.finfo(torch.float32).eps if v == "silu_cast_mul" else torch.finfo(dt).eps
    assert (e[0] - f[0]).abs().max() <= tol * e[0].abs().max()


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_swiglu_mlp_fp32_with_a_16_bit_cast_inside(dt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 16, generator=g) * 30.0
    _check(SwiGLU(dt), [x], torch.float32)
