"""Property tests (hypothesis): random hand-written MoE layers that loop over a list of experts, fused through
``AutoFusionEngine.fuse``, must fuse as one experts block and give eager's outputs (within the verifier's bound of
float64) on other tokens than they were planned on, and, with grad, eager's gradients of the tokens and of every
expert's parameters (the router's weight: see ``_check``); near misses must stay as captured.

A layer is a router (softmax in fp32, top-k of 2 to 8 experts, optionally renormalised, cast to the tokens' dtype)
over 1 to 24 tokens (2-D or 3-D, fp32 or bf16), and a loop over the experts in any order, in one of three spellings
(``torch.where(ids == e)`` + ``index_add_``; Mixtral's ``one_hot(ids).permute(2, 1, 0)`` mask with
``x[None, tok]``; the dense ``out + (w * (ids == e)).sum(-1, keepdim=True) * expert(x)``). An expert is gated
(``w2(silu(w1 x) * w3 x)``), joined (Phi-3's ``w1(x).chunk(2)``) or plain (``w2(act(w1 x))``: ReLU, GELU exact or
tanh, SiLU), with or without biases. A near miss leaves one expert out of the loop, visits one twice, scales a token
by all its weights instead of its slot's, starts the sum from the tokens, or puts a tanh between the projections.

The default run draws a few layers per mode (derandomized); ``python -m pytest -m slow
tests/test_random_expert_loops.py`` draws 200 per mode.
"""
import copy
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from conftest import drawn  # noqa: E402

from autofuse import AutoFusionEngine  # noqa: E402
from autofuse.verify import compare  # noqa: E402

FAST = drawn(4)
SLOW = drawn(200)
ACTS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
        "tanh": torch.tanh}
NEAR_MISSES = ("missing_expert", "expert_twice", "all_weights", "residual_start", "tanh")


@dataclass(frozen=True)
class Layer:
    E: int
    k: int
    T: int
    H: int
    inter: int
    dtype: torch.dtype
    kind: str           # where, mixtral, dense
    form: str           # gated, joined, plain
    act: str
    bias: bool
    renorm: bool
    three_d: bool
    order: tuple        # the loop's order over the experts
    variant: str = ""   # a near miss, or ""


@st.composite
def layers(draw, variant=st.just("")):
    E = draw(st.sampled_from([2, 3, 4, 8]))
    form = draw(st.sampled_from(["gated", "joined", "plain"]))
    v = draw(variant)
    kind = draw(st.sampled_from(["where", "dense"] if v == "all_weights" else ["where", "mixtral", "dense"]))
    act = "tanh" if v == "tanh" else draw(st.sampled_from(["relu", "gelu", "gelu_tanh", "silu"])) \
        if form == "plain" else "silu"
    return Layer(E, draw(st.integers(1, min(E, 3))), draw(st.sampled_from([1, 5, 12, 24])),
                 draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 24])),
                 draw(st.sampled_from([torch.float32, torch.bfloat16])), kind, "plain" if v == "tanh" else form, act,
                 draw(st.booleans()), draw(st.booleans()), draw(st.booleans()), tuple(draw(st.permutations(range(E)))),
                 v)


class Expert(nn.Module):
    def __init__(self, c: Layer, g: torch.Generator):
        super().__init__()
        def lin(i, o):
            m = nn.Linear(i, o, bias=c.bias)
            with torch.no_grad():
                m.weight.copy_(torch.randn(o, i, generator=g) * i ** -0.5)
                if c.bias:
                    m.bias.copy_(torch.randn(o, generator=g) * 0.1)
            return m
        self.form, self.act = c.form, ACTS[c.act]
        self.w1 = lin(c.H, c.inter * (2 if c.form == "joined" else 1))
        self.w3 = lin(c.H, c.inter) if c.form == "gated" else None
        self.w2 = lin(c.inter, c.H)

    def forward(self, x):
        if self.form == "joined":
            g, u = self.w1(x).chunk(2, -1)
            return self.w2(u * self.act(g))
        h = self.act(self.w1(x))
        return self.w2(h * self.w3(x) if self.form == "gated" else h)


class Model(nn.Module):
    def __init__(self, c: Layer):
        super().__init__()
        self.c = c
        g = torch.Generator().manual_seed(c.E * 1000 + c.H + c.inter)
        self.gate = nn.Linear(c.H, c.E, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(c.E, c.H, generator=g))
        self.experts = nn.ModuleList(Expert(c, g) for _ in range(c.E))

    def forward(self, x):
        c, shp = self.c, x.shape
        x = x.reshape(-1, shp[-1])
        w, idx = torch.topk(F.softmax(self.gate(x), -1, dtype=torch.float), c.k)
        if c.renorm:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(x.dtype)
        out = x.clone() if c.variant == "residual_start" else torch.zeros_like(x)
        order = list(c.order)
        if c.variant == "missing_expert":
            order = order[1:]
        elif c.variant == "expert_twice":
            order[-1] = order[0]
        if c.kind == "mixtral":
            mask = F.one_hot(idx, num_classes=c.E).permute(2, 1, 0)
        for e in order:
            if c.kind == "dense":
                we = (w * (idx == e)).sum(-1, keepdim=True)
                if c.variant == "all_weights":
                    we = w.sum(-1, keepdim=True) * (idx == e).any(-1, keepdim=True)
                out = out + we * self.experts[e](x)
            elif c.kind == "where":
                tok, slot = torch.where(idx == e)
                scale = w[tok].sum(-1, keepdim=True) if c.variant == "all_weights" else w[tok, slot, None]
                out.index_add_(0, tok, self.experts[e](x[tok]) * scale)
            else:
                slot, tok = torch.where(mask[e])
                y = self.experts[e](x[None, tok].reshape(-1, shp[-1])) * w[tok, slot, None]
                out.index_add_(0, tok, y.to(x.dtype))
        return out.reshape(shp)


def _check(c: Layer, grad: bool):
    model = Model(c).to(c.dtype)
    g = torch.Generator().manual_seed(c.T * 7 + c.E)
    shape = (2, c.T, c.H) if c.three_d else (c.T, c.H)
    x = torch.randn(shape, generator=g).to(c.dtype)
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore")
        fused = AutoFusionEngine.fuse(model, (x,))
    experts = [d.reason_code for d in fused.report.decisions if d.pattern == "moe_experts"]
    if c.variant:
        assert experts == [], f"a near miss ({c.variant}) was fused: {fused.report.summary()}"
    else:
        assert experts == ["fused"], f"a hand-written loop was not fused: {fused.report.summary()}"
    x2 = torch.randn(shape, generator=g).to(c.dtype)      # other tokens: another routing, other group sizes
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        got, want, exact = fused(x2), model(x2), ref(x2.double())
    ok, err, tol = compare(want, exact, got)
    assert ok, f"output: error {err:.3g} > bound {tol:.3g}"
    if grad and c.dtype == torch.float32:
        eager = copy.deepcopy(model)
        dy = torch.randn(shape, generator=g, dtype=torch.float64)
        xs = []
        for f, dt in ((fused, torch.float32), (eager, torch.float32), (ref, torch.float64)):
            xi = x2.detach().to(dt).requires_grad_()
            (f(xi).double() * dy).sum().backward()
            xs.append(xi.grad)
        ok, err, tol = compare(xs[1], xs[2], xs[0])
        assert ok, f"gradient of x: error {err:.3g} > bound {tol:.3g}"
        # every expert's parameters (zero where no token picked the expert). Not the router's weight: its gradient
        # is the softmax's and the renormalisation's backward, two cancelling differences, summed over a few tokens,
        # so eager's own error swings with the summation order (3.5x between the where and dense spellings of one
        # 2-token draw: 1.45e-7 and 5.05e-7 of a largest 0.85) and twice it is no bound there; the routers' property
        # tests and test_moe_loop's trained layers check that gradient (through the tokens' gradient here too)
        for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
            if name.startswith("gate."):
                continue
            ok, err, tol = compare(q.grad, r.grad, p.grad if p.grad is not None else torch.zeros_like(q.grad))
            assert ok, f"gradient of {name}: error {err:.3g} > bound {tol:.3g}"


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@FAST
@given(c=layers())
def test_random_expert_loops_fuse_and_give_eagers_values(grad, c):
    _check(c, grad)


@FAST
@given(c=layers(st.sampled_from(NEAR_MISSES)))
def test_random_expert_loop_near_misses_stay_as_captured(c):
    _check(c, False)


@pytest.mark.slow
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@SLOW
@given(c=layers())
def test_random_expert_loops_200_per_mode(grad, c):
    _check(c, grad)


@pytest.mark.slow
@SLOW
@given(c=layers(st.sampled_from(NEAR_MISSES)))
def test_random_expert_loop_near_misses_200(c):
    _check(c, False)
