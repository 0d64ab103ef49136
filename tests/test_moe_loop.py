"""A hand-written MoE layer looping over a list of experts (each three ``nn.Linear``s: ``down(silu(gate(x)) *
up(x))``), in its three usual spellings: the tokens of each expert found by ``torch.where(ids == e)`` and added back
by ``index_add_``; Mixtral's original ``one_hot(ids).permute(2, 1, 0)`` mask with ``x[None, tok]``; and the dense
form that runs every token through every expert scaled by ``(w * (ids == e)).sum(-1, keepdim=True)``. Each is fused
as one experts block (routing, two grouped GEMMs over the lists of the experts' weights, combine), equal to eager
within the verifier's bound of float64, in inference and training; near misses are left as captured."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.verify import compare


class Expert(nn.Module):
    """``w2(act(w1(x)) * w3(x))`` (gated), ``w2(act(w1(x)))`` (plain), or Phi-3's MLP, the gate and up projections one
    layer (``joined``: ``g, u = w1(x).chunk(2, -1)``, ``w2(u * act(g))``; ``swapped``: the halves the other way
    round); ``up_bias`` overrides the up projection's bias."""

    def __init__(self, H, inter, bias=False, act=F.silu, gated=True, up_bias=None, joined=False, swapped=False):
        super().__init__()
        self.joined, self.swapped = joined, swapped
        self.w1 = nn.Linear(H, inter * (2 if joined else 1), bias=bias)
        self.w3 = nn.Linear(H, inter, bias=bias if up_bias is None else up_bias) if gated and not joined else None
        self.w2 = nn.Linear(inter, H, bias=bias)
        self.act = act

    def forward(self, x):
        if self.joined:
            g, u = self.w1(x).chunk(2, -1)
            if self.swapped:
                g, u = u, g
            return self.w2(u * self.act(g))
        h = self.act(self.w1(x))
        return self.w2(h * self.w3(x) if self.w3 is not None else h)


class HandMoE(nn.Module):
    """A router (softmax, top-k, renormalise) and a loop over the experts; ``variant`` names a near miss."""

    def __init__(self, H=32, inter=48, E=4, k=2, kind="where", variant="", **expert):
        super().__init__()
        self.kind, self.variant, self.E, self.k = kind, variant, E, k
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert(H, inter, **expert) for _ in range(E))

    def forward(self, x, ids=None):
        shp = x.shape
        x = x.reshape(-1, shp[-1])
        w, idx = torch.topk(F.softmax(self.gate(x), -1, dtype=torch.float), self.k)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        if ids is not None:                 # expert ids the layer is given: their range is not known
            idx = ids
        out = x.clone() if self.variant == "residual_start" else torch.zeros_like(x)
        picks = list(range(self.E))
        if self.variant == "missing_expert":
            picks = picks[:-1]
        elif self.variant == "expert_twice":
            picks[1] = 0
        if self.kind == "where":
            for e in picks:
                tok, slot = torch.where(idx == e)
                scale = w[tok].sum(-1, keepdim=True) if self.variant == "all_weights" else w[tok, slot, None]
                out.index_add_(0, tok, self.experts[e](x[tok]) * scale)
        elif self.kind == "mixtral":
            mask = F.one_hot(idx, num_classes=self.E).permute(2, 1, 0)
            for e in picks:
                slot, tok = torch.where(mask[e])
                y = self.experts[e](x[None, tok].reshape(-1, shp[-1])) * w[tok, slot, None]
                out.index_add_(0, tok, y.to(x.dtype))
        else:
            for e in picks:
                we = (w * (idx == e)).sum(-1, keepdim=True)
                out = out + we * self.experts[e](x)
        return out.reshape(shp)


def _experts(fused):
    return [d.reason_code for d in fused.report.decisions if d.pattern == "moe_experts"]


CASES = [("where", torch.float32, 4, 2, 16), ("mixtral", torch.float32, 8, 2, 24), ("dense", torch.float32, 4, 1, 16),
         ("where", torch.bfloat16, 8, 2, 24), ("mixtral", torch.bfloat16, 4, 2, 16), ("dense", torch.bfloat16, 8, 2, 8),
         ("where", torch.float16, 2, 1, 8)]


@pytest.mark.parametrize("kind,dtype,E,k,T", CASES, ids=[f"{c[0]}-{str(c[1])[6:]}-E{c[2]}k{c[3]}" for c in CASES])
def test_a_hand_written_expert_loop_is_one_fused_experts_block_equal_to_eager(kind, dtype, E, k, T):
    torch.manual_seed(0)
    model = HandMoE(E=E, k=k, kind=kind).to(dtype).eval()
    x = torch.randn(2, T // 2, 32, dtype=dtype)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert _experts(fused) == ["fused"], fused.report.summary()
    calls = [n.target for n in fused.graph_module.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.autofuse.grouped_matmul_list.default) == 2
    # the loop is gone: no per-expert selection, gather, size check or linear is left in the graph
    loop = {torch.ops.aten.where.default, torch.ops.aten.index_add.default, torch.ops.aten._assert_scalar.default,
            torch.ops.aten.sym_size.int, torch.ops.aten.one_hot.default, torch.ops.aten.silu.default}
    assert not loop & set(calls), calls
    assert sum(t is torch.ops.aten.linear.default for t in calls) == 1      # the router's, which gating reads
    ref_model = copy.deepcopy(model).double()
    with torch.no_grad():
        for scale in (1.0, 4.0):            # other inputs than planned on: another routing, other group sizes
            xi = x * scale if scale != 1.0 else x
            want, got, ref = model(xi), fused(xi), ref_model(xi.double())
            ok, err, tol = compare(want, ref, got)
            assert ok, (err, tol)


@pytest.mark.parametrize("kind", ["where", "mixtral", "dense"])
def test_a_hand_written_expert_loop_trains_with_eagers_gradients(kind):
    torch.manual_seed(1)
    model = HandMoE(E=4, k=2, kind=kind).train()
    x = torch.randn(2, 6, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert _experts(fused) == ["fused"], fused.report.summary()
    # a training plan's first GEMM stores its product for the backward (no recompute there)
    calls = [n.target for n in fused.graph_module.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.autofuse.grouped_matmul_list_with_product.default) == 1
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    g = torch.randn(2, 6, 32)
    xs = [x.clone().requires_grad_() for _ in range(2)] + [x.double().requires_grad_()]
    for m, xi in zip((fused, eager, ref), xs):
        (m(xi) * (g if xi.dtype == torch.float32 else g.double())).sum().backward()
    # every parameter's gradient (the fused model trains the user's parameters) and the input's
    pairs = [(a.grad, b.grad, c.grad) for a, b, c in zip(model.parameters(), eager.parameters(), ref.parameters())]
    pairs.append((xs[1].grad, xs[2].grad, xs[0].grad))
    for (got, want, r) in pairs[:-1]:
        ok, err, tol = compare(want, r, got)
        assert ok, (err, tol)
    want, r, got = pairs[-1]
    ok, err, tol = compare(want, r, got)
    assert ok, (err, tol)


@pytest.mark.parametrize("kind,variant", [("where", "missing_expert"), ("where", "expert_twice"),
                                          ("where", "all_weights"), ("where", "residual_start"),
                                          ("dense", "missing_expert"), ("dense", "expert_twice"),
                                          ("mixtral", "missing_expert"), ("where", "ids_given")])
def test_expert_loop_near_misses_are_not_fused(kind, variant):
    """An expert the router can pick but the loop leaves out, an expert looped over twice, every token's weights
    summed instead of its slot's, an accumulator that starts from the tokens, ids of unknown range."""
    torch.manual_seed(0)
    model = HandMoE(kind=kind, variant=variant).eval()
    x = torch.randn(12, 32)
    args = (x, torch.randint(0, 4, (12, 2))) if variant == "ids_given" else (x,)
    fused = AutoFusionEngine.fuse(model, args)
    assert _experts(fused) == [], fused.report.summary()
    with torch.no_grad():
        torch.testing.assert_close(fused(*args), model(*args), atol=1e-5, rtol=1e-5)   # fp32, op by op


GELU_TANH = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
EXPERTS = {"gated+bias": dict(bias=True), "relu+bias": dict(gated=False, act=F.relu, bias=True),
           "gelu": dict(gated=False, act=F.gelu), "gelu_tanh+bias": dict(gated=False, act=GELU_TANH, bias=True),
           "silu": dict(gated=False), "joined+bias": dict(joined=True, bias=True)}


@pytest.mark.parametrize("kind", ["where", "dense"])
@pytest.mark.parametrize("expert", list(EXPERTS))
def test_experts_with_biases_or_a_plain_activation_fuse_and_train_as_eager(expert, kind):
    """Experts with biases (``nn.Linear``'s default), ungated experts (``w2(act(w1(x)))``, ReLU, GELU, SiLU) and
    Phi-3's joined gate and up projection: the grouped GEMMs take the bias lists and the activation as their
    epilogue; outputs and every gradient as eager's."""
    torch.manual_seed(2)
    model = HandMoE(kind=kind, **EXPERTS[expert]).train()
    x = torch.randn(12, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert _experts(fused) == ["fused"], fused.report.summary()
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    g = torch.randn(12, 32)
    outs = [m(x) for m in (fused, eager)] + [ref(x.double())]
    ok, err, tol = compare(outs[1], outs[2], outs[0])
    assert ok, (err, tol)
    for out in outs:
        (out * g.to(out.dtype)).sum().backward()
    for got, want, r in zip(model.parameters(), eager.parameters(), ref.parameters()):
        ok, err, tol = compare(want.grad, r.grad, got.grad)
        assert ok, (err, tol)


@pytest.mark.parametrize("what", ["geglu", "tanh", "gate_bias_only", "joined_swapped"])
def test_experts_the_grouped_gemm_cannot_take_are_not_fused(what):
    """A gated expert with GELU (GeGLU: no such epilogue), an activation without an epilogue (tanh), a gate with a
    bias and an up projection without, a joined projection whose second half is the gate."""
    torch.manual_seed(0)
    expert = {"geglu": dict(act=F.gelu), "tanh": dict(gated=False, act=torch.tanh),
              "gate_bias_only": dict(bias=True, up_bias=False), "joined_swapped": dict(joined=True, swapped=True)}[what]
    model = HandMoE(**expert).eval()
    x = torch.randn(12, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert _experts(fused) == [], fused.report.summary()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)


def test_verification_catches_a_loop_block_whose_weight_lists_are_misread(monkeypatch):
    """The fused call checked against the captured loop: with the lists read in the wrong order (expert e's tokens
    through expert E-1-e's weights) verification refuses the block, and the model runs as captured."""
    from autofuse import ops_moe
    stacked = ops_moe._stacked
    monkeypatch.setattr(ops_moe, "_stacked", lambda w, up, t: stacked(w[::-1], up[::-1], t))
    torch.manual_seed(0)
    model = HandMoE(kind="where").eval()
    x = torch.randn(12, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert _experts(fused) == ["verification_failed"], fused.report.summary()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-5)


def test_the_dense_loop_fuses_through_torch_compile():
    """``torch.compile(model, backend="autofuse")``: the dense spelling (no data-dependent size) is one graph, fused."""
    import torch._dynamo

    import autofuse
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = HandMoE(kind="dense").eval()
    x = torch.randn(12, 32)
    compiled = torch.compile(model, backend="autofuse")
    with torch.no_grad():
        got = compiled(x)
        want = model(x)
    ok, err, tol = compare(want, copy.deepcopy(model).double()(x.double()), got)
    assert ok, (err, tol)
    assert [d.reason_code for r in autofuse.reports(compiled) for d in r.decisions if d.pattern == "moe_experts"] \
        == ["fused"]
