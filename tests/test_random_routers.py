"""Property tests (hypothesis): random MoE router spellings, fused through ``AutoFusionEngine.fuse`` (generic fusion
off, so that what is tested is the gating family), must route as eager does and weigh within the verifier's bound;
the spellings of known models must fuse.

A router is logits ``x @ w`` (fp32, or bf16 weights and tokens, cast up first or not) of 4 to 32 experts over 1 to 16
tokens (2-D or 3-D), scores by softmax (the method, ``F.softmax(dtype=float32)`` or ``exp(z - max) / sum``) or
sigmoid, an optional selection bias, optional group-limited selection (``n_group`` groups scored by the sum of their
top two or by their max, the ``topk_group`` best kept, the others filled with 0.0, -1.0 or ``-inf``), top-k sorted or
not, weights gathered from the unbiased scores or (group-limited) the top-k values of the filled choices, an optional
renormalisation (plus eps), a scaling factor and a cast. Indices must equal eager's (both sides canonically ordered
where ``sorted=False`` leaves the order open; a tie may go the float64 run's way); weights within the verifier's
bound (:func:`autofuse.verify.compare`); with grad (fp32), the gradient of the tokens under an order-invariant loss
within the same bound.

The spellings of Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3 and Mistral 4 (groups scored by their top two, or by their max
with the values as weights, as DeepSeek-V2's greedy router does without a bias) fuse where the scores are fp32
(a router selecting on 16-bit scores is refused: eager's rounding ties scores the kernel's fp32 ones tell apart).

The default run draws a few routers per mode (derandomized); ``python -m pytest -m slow tests/test_random_routers.py``
draws 300 per mode.
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

FAST = drawn(15)
SLOW = drawn(300)
GENERIC_OFF = {"softmax": "off", "vector_chain": "off", "matmul_epilogue": "off"}


@dataclass(frozen=True)
class Router:
    E: int
    H: int
    k: int
    wdt: torch.dtype
    upcast: bool
    score: str
    bias: bool
    group: bool
    n_group: int
    topk_group: int
    gmax: bool
    values: bool
    fill: float
    sorted: bool
    renorm: object
    scale: object
    cast: bool
    T: int
    three_d: bool
    bias_scale: float


@st.composite
def routers(draw):
    E = draw(st.sampled_from([4, 8, 16, 32]))
    n_group = draw(st.sampled_from([g for g in (1, 2, 4) if E // g >= 2]))
    topk_group = draw(st.integers(1, n_group))
    group = draw(st.booleans())
    k = draw(st.integers(1, min(4, E)))
    if group:
        k = min(k, topk_group * (E // n_group))
    return Router(E, draw(st.sampled_from([8, 16, 32])), k, draw(st.sampled_from([torch.float32, torch.bfloat16])),
                  draw(st.booleans()), draw(st.sampled_from(["softmax", "softmax_f32", "decomposed", "sigmoid"])),
                  draw(st.booleans()), group, n_group, topk_group, draw(st.booleans()), draw(st.booleans()),
                  draw(st.sampled_from([0.0, -1.0, float("-inf")])), draw(st.booleans()),
                  draw(st.sampled_from([None, "sum", "sum_eps"])), draw(st.sampled_from([None, 2.5])),
                  draw(st.booleans()), draw(st.sampled_from([1, 3, 7, 16])), draw(st.booleans()),
                  draw(st.sampled_from([0.1, 1.0])))


class Model(nn.Module):
    def __init__(self, c: Router):
        super().__init__()
        self.c = c
        g = torch.Generator().manual_seed(c.E * 100 + c.H)
        self.w = nn.Parameter(torch.randn(c.E, c.H, generator=g).to(c.wdt))
        self.register_buffer("bias", torch.randn(c.E, generator=g) * c.bias_scale)

    def forward(self, x):
        c, E = self.c, self.c.E
        h = x.reshape(-1, x.shape[-1])
        logits = F.linear(h.float(), self.w.float()) if c.upcast else F.linear(h, self.w)
        if c.score == "softmax":
            p = logits.softmax(-1)
        elif c.score == "softmax_f32":
            p = F.softmax(logits, dim=1, dtype=torch.float)
        elif c.score == "decomposed":
            e = (logits - logits.amax(-1, keepdim=True)).exp()
            p = e / e.sum(-1, keepdim=True)
        else:
            p = logits.sigmoid()
        choice = p + self.bias if c.bias else p
        if c.group:
            groups = choice.view(-1, c.n_group, E // c.n_group)
            gs = groups.max(dim=-1).values if c.gmax else groups.topk(2, dim=-1)[0].sum(dim=-1)
            gi = torch.topk(gs, k=c.topk_group, dim=-1, sorted=False)[1]
            gm = torch.zeros_like(gs).scatter_(1, gi, 1)
            keep = gm.unsqueeze(-1).expand(-1, c.n_group, E // c.n_group).reshape(-1, E)
            choice = choice.masked_fill(~keep.bool(), c.fill)
        if c.group and c.values:
            v, idx = torch.topk(choice, k=c.k, dim=-1, sorted=c.sorted)
        elif c.bias or c.group:
            idx = torch.topk(choice, k=c.k, dim=-1, sorted=c.sorted)[1]
            v = p.gather(1, idx)
        else:
            v, idx = torch.topk(choice, c.k, dim=-1, sorted=c.sorted)
        if c.renorm == "sum":
            v = v / v.sum(-1, keepdim=True)
        elif c.renorm == "sum_eps":
            v = v / (v.sum(-1, keepdim=True) + 1e-20)
        if c.scale:
            v = v * c.scale
        if c.cast:
            v = v.to(x.dtype)
        return v, idx


def _known(c: Router) -> bool:
    """A spelling of a known model's router, with fp32 scores (module docstring)."""
    if not (c.wdt == torch.float32 or c.upcast or c.score == "softmax_f32"):
        return False
    if not c.group or (not c.gmax and not c.values):
        return True                             # Mixtral, Qwen, DeepSeek-V3 and Mistral 4
    return c.gmax and c.values and not c.bias and c.renorm is None      # DeepSeek-V2's greedy groups


def _canonical(w, idx):
    order = idx.argsort(-1)
    return w.gather(-1, order), idx.gather(-1, order)


def _check(c: Router, grad: bool):
    model = Model(c)
    g = torch.Generator().manual_seed(c.T * 7 + c.E)
    x = torch.randn(*((2, c.T, c.H) if c.three_d else (c.T, c.H)), generator=g).to(c.wdt)
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore")
        fused = AutoFusionEngine.fuse(model, ((x,), {}), fusion_switches=GENERIC_OFF)
    gating = [d for d in fused.report.applied if d.pattern == "moe_gating"]
    if _known(c):
        assert gating, f"a known router's spelling was not fused: {fused.report.summary()}"
    x2 = torch.randn(x.shape, generator=g).to(c.wdt)
    with torch.no_grad():
        got, want, exact = fused(x2), model(x2), copy.deepcopy(model).double()(x2.double())
    if not c.sorted:
        got, want, exact = _canonical(*got), _canonical(*want), _canonical(*exact)
    assert got[0].dtype == want[0].dtype
    ok, err, _ = compare(want[1], exact[1], got[1])
    assert ok, f"{err:.0f} indices neither eager's nor the float64 run's"
    ok, err, tol = compare(want[0], exact[0], got[0])
    assert ok, f"weights: error {err:.3g} > bound {tol:.3g}"
    if grad and c.wdt == torch.float32:
        order_free = torch.randn(c.E, generator=torch.Generator().manual_seed(c.E), dtype=torch.float64)
        grads = []
        for f, dt in ((fused, torch.float32), (model, torch.float32), (copy.deepcopy(model).double(), torch.float64)):
            xi = x2.detach().to(dt).requires_grad_()
            w, i = f(xi)
            (w.double() * order_free[i]).sum().backward()       # order-invariant: sorted=False leaves it open
            grads.append(xi.grad)
        ok, err, tol = compare(grads[1], grads[2], grads[0])
        assert ok, f"gradient of x: error {err:.3g} > bound {tol:.3g}"


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@FAST
@given(c=routers())
def test_random_routers_route_as_eager(grad, c):
    _check(c, grad)


@pytest.mark.slow
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@SLOW
@given(c=routers())
def test_random_routers_route_as_eager_300_per_mode(grad, c):
    _check(c, grad)
