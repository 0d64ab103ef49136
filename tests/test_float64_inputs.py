"""float64 inputs a model casts before computing with them (a vision model's ``pixel_values``, which eager accepts in
float64 because the model's first op casts them to its weights' dtype) are fused as eager runs them: the fused
blocks only ever read the cast values. An input the model computes with in float64 (type promotion, a cast to
float64 itself, one path of several) or returns is refused, naming the op that reads it so."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import autofuse
from autofuse import AutoFusionEngine
from autofuse.backend import reports
from autofuse.fused import is_fused_call
from autofuse.verify import compare

F64 = torch.float64


class CastThenAttention(nn.Module):
    """``x.to(self.q.weight.dtype)`` first (as DINOv2's embeddings cast ``pixel_values``), then self-attention."""

    def __init__(self, d=32, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        x = x.to(self.q.weight.dtype)
        b, n, d = x.shape

        def split(t):
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        a = torch.softmax(q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5, -1) @ v
        return self.o(a.transpose(1, 2).reshape(b, n, d))


class ViewsThenCast(nn.Module):
    """Views, a slice, a copy and a size read of the float64 input before its cast, then a projection with a GELU
    epilogue and a LayerNorm."""

    def __init__(self, d=32):
        super().__init__()
        self.lin, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):                           # x: [b, d, n + 1]
        h = x.permute(0, 2, 1).unsqueeze(0).squeeze(0)[:, 1:].contiguous().detach()
        zeros = torch.zeros_like(x, dtype=self.lin.weight.dtype)   # reads x's shape only
        h = h.to(self.lin.weight.dtype) + zeros.sum()
        return self.norm(torch.nn.functional.gelu(self.lin(h)))


def _as_eager(model, args, got):
    """``got`` within the verifier's bound of eager's output on the float64 inputs: at most twice eager's own error
    against the model run in float64 (a copy of it: the user's model stays as it is)."""
    want = model(*args)
    ref = copy.deepcopy(model).double()(*args)
    ok, err, tol = compare(want, ref, got)
    assert got.dtype == want.dtype and ok, (err, tol)


def _applied(report) -> list:
    return [d.pattern for d in report.decisions if d.applied]


def _fused_reads_no_float64(fused):
    """Every fused call of every plan reads cast values only (no float64 or complex128 tensor)."""
    for p in fused.plans.values():
        calls = [n for n in p.graph_module.graph.nodes if is_fused_call(n)]
        assert calls
        for n in calls:
            for a in n.all_input_nodes:
                v = a.meta.get("val")
                assert not (isinstance(v, torch.Tensor) and v.dtype in (F64, torch.complex128)), (n.name, a.name)


@torch.no_grad()
def test_an_input_cast_first_fuses_and_equals_eager():
    torch.manual_seed(0)
    model, x = CastThenAttention().eval(), torch.randn(2, 16, 32, dtype=F64)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert "attention" in _applied(fused.report)
    _fused_reads_no_float64(fused)
    _as_eager(model, (x,), fused(x))
    assert model.q.weight.dtype == torch.float32          # the user's model is left as it is


@torch.no_grad()
def test_views_slices_and_size_reads_before_the_cast_are_fine():
    torch.manual_seed(0)
    model, x = ViewsThenCast().eval(), torch.randn(2, 32, 9, dtype=F64)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert _applied(fused.report), [(d.pattern, d.reason) for d in fused.report.decisions]
    _fused_reads_no_float64(fused)
    _as_eager(model, (x,), fused(x))


@torch.no_grad()
def test_simulate_accepts_an_input_cast_first():
    torch.manual_seed(0)
    model, x = CastThenAttention().eval(), torch.randn(2, 16, 32, dtype=F64)
    res = autofuse.simulate(model, (x,))
    assert res.cycles > 0
    _as_eager(model, (x,), res.outputs[0] if isinstance(res.outputs, (tuple, list)) else res.outputs)


def test_a_float64_input_cast_first_trains_as_eager():
    """A training step: the float64 input's gradient (float64, through the cast's backward) and every parameter's
    equal eager's to fp32 rounding, and ``simulate(backward=True)`` prices the step on the cast graph."""
    torch.manual_seed(0)
    model, x = CastThenAttention().train(), torch.randn(2, 16, 32, dtype=F64)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert "attention" in _applied(fused.report)

    def grads(m):
        model.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        m(xg).pow(2).mean().backward()
        return [xg.grad] + [p.grad for p in model.parameters()]

    want, got = grads(model), grads(fused)
    assert got[0].dtype == F64 and len(got) == len(want) == 9
    for g, w in zip(got, want):
        # both are fp32 computations of one gradient in other orders (the fused blocks' fp32 sums): a few ulps of
        # fp32 at these magnitudes, far inside this bound
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-3)
    res = autofuse.simulate(model, (x.clone().requires_grad_(True),), backward=True)
    assert res.phases["forward"] > 0 and res.phases["backward"] > 0, res.phases


@torch.no_grad()
def test_torch_compile_fuses_a_graph_that_casts_its_float64_input_first():
    torch.manual_seed(0)
    model, x = CastThenAttention().eval(), torch.randn(2, 16, 32, dtype=F64)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=autofuse.backend())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = compiled(x)
        assert not [w for w in caught if "runs unfused" in str(w.message)], [str(w.message) for w in caught]
        assert any("attention" in _applied(r) for r in reports(compiled))
        _as_eager(model, (x,), got)
    finally:
        torch._dynamo.reset()


@torch.no_grad()
@pytest.mark.parametrize("arch", ["dinov2", "vit"])
def test_vision_models_float64_pixel_values_fuse(arch):
    """transformers' DINOv2 and ViT cast ``pixel_values`` to the patch projection's dtype first: eager takes
    float64."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                 patch_size=8, attn_implementation="sdpa")
    model = (tf.Dinov2Model(tf.Dinov2Config(**sizes)) if arch == "dinov2" else tf.ViTModel(tf.ViTConfig(**sizes)))
    model, x = model.eval(), torch.randn(2, 3, 32, 32, dtype=F64)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert _applied(fused.report).count("attention") == 2, _applied(fused.report)
    _fused_reads_no_float64(fused)
    want = model(x).last_hidden_state
    ref = copy.deepcopy(model).double()(x).last_hidden_state
    ok, err, tol = compare(want, ref, fused(x).last_hidden_state)
    assert ok, (err, tol)


class ComplexCastFirst(nn.Module):
    """A complex128 input cast to complex64 first, then its real and imaginary parts projected."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 32)

    def forward(self, z):
        parts = torch.view_as_real(z.to(torch.complex64))
        return torch.nn.functional.gelu(self.lin(parts.flatten(-2)))


@torch.no_grad()
def test_a_complex128_input_cast_to_complex64_first_fuses():
    torch.manual_seed(0)
    model, z = ComplexCastFirst().eval(), torch.randn(4, 32, dtype=torch.complex128)
    fused = AutoFusionEngine.fuse(model, (z,))
    assert _applied(fused.report), [(d.pattern, d.reason) for d in fused.report.decisions]
    _fused_reads_no_float64(fused)
    lin = copy.deepcopy(model.lin).double()     # the model in float64: its parts projected without the cast
    ref = torch.nn.functional.gelu(lin(torch.view_as_real(z).flatten(-2)))
    ok, err, tol = compare(model(z), ref, fused(z))
    assert ok, (err, tol)


class ComplexComputed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 32)

    def forward(self, z):
        parts = torch.view_as_real(z).flatten(-2)
        return self.lin((parts * 2).float())


def test_a_complex128_input_computed_with_is_refused_naming_the_op():
    with pytest.raises(TypeError, match=r"^fuse: example input 0 is complex128; .*make it complex64 first .*\. It is "
                                        r"read in float64 by mul \(aten\.mul\.Tensor\) at .*parts \* 2"):
        AutoFusionEngine.fuse(ComplexComputed().eval(), (torch.randn(4, 32, dtype=torch.complex128),))


def test_a_float64_input_multiplied_with_float32_weights_says_to_cast_it():
    """Eager refuses a float64 input into a float32 Linear too; the hint is the cast, not casting the model."""
    from autofuse.capture import CaptureError
    with pytest.raises(CaptureError, match=r"multiplies float64 and float32 tensors.*hint: cast the float64 value "
                                           r"into the model's dtype.*x\.to\(self\.weight\.dtype\)"):
        AutoFusionEngine.fuse(nn.Linear(4, 4), (torch.randn(2, 4, dtype=F64),))


@torch.no_grad()
@pytest.mark.parametrize("first", [torch.float32, F64])
def test_the_other_dtype_at_a_later_call_is_a_new_plan(first):
    """Planned on one dtype, called with the other: a new signature, a new plan, each as eager."""
    torch.manual_seed(0)
    model = CastThenAttention().eval()
    x = torch.randn(2, 16, 32, dtype=first)
    other = torch.randn(2, 16, 32, dtype=F64 if first is torch.float32 else torch.float32)
    fused = AutoFusionEngine.fuse(model, (x,))
    for inp in (x, other, x):
        got = fused(inp)
        assert got.dtype == torch.float32
        if inp.dtype == F64:
            _as_eager(model, (inp,), got)
        else:
            torch.testing.assert_close(got, model(inp), atol=1e-5, rtol=1e-4)   # fp32: rounding only
    assert len(fused.plans) == 2
    assert all("attention" in _applied(p.report) for p in fused.plans.values())



@torch.no_grad()
def test_float64_calls_after_a_shared_export_are_planned_on_their_own_graph():
    """From the third length on one symbolic export serves a signature's other sizes: a float64 call after float32
    ones is checked and planned on a graph of float64 inputs, not served from the float32 export."""
    torch.manual_seed(0)
    model = CastThenAttention().eval()
    fused = AutoFusionEngine.fuse(model)
    for n in (8, 12, 16):
        fused(torch.randn(2, n, 32))
    for n in (20, 24):
        x = torch.randn(2, n, 32, dtype=F64)
        _as_eager(model, (x,), fused(x))
    dtypes = [next(iter(p.captured.graph_module.graph.find_nodes(op="placeholder"))).meta["val"].dtype
              for p in fused.plans.values()]
    assert dtypes == [torch.float32] * 3 + [F64] * 2
    _fused_reads_no_float64(fused)
    computes = AutoFusionEngine.fuse(Promotes().eval())
    for n in (8, 12, 16):
        computes(torch.randn(2, n, 32))
    with pytest.raises(TypeError, match=r"^fused model: this call's input 0 is float64; .* by add "):
        computes(torch.randn(2, 20, 32, dtype=F64))

class Promotes(nn.Module):
    """float64 + a float32 parameter: type promotion computes the sum in float64."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(32))

    def forward(self, x):
        return torch.softmax(x + self.b, -1)


class Returns(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x.float()), x


class CastsToFloat64(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        h = x.to(torch.float64)
        return self.lin(torch.tanh(h).to(self.lin.weight.dtype))


class OnePathComputes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x.float()) + x.transpose(0, 1).mul(2).transpose(0, 1).float()


class UpdatesInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        y = self.lin(x.float())
        x.mul_(0.5)
        return y


REFUSED = [(Promotes, r"It is read in float64 by add \(aten\.add\.Tensor\) at .*test_float64_inputs\.py:\d+: "
                      r"return torch\.softmax\(x \+ self\.b, -1\)"),
           (Returns, r"The model returns it in float64"),
           (CastsToFloat64, r"It is read in float64 by tanh \(aten\.tanh\.default\) at .*torch\.tanh\(h\)"),
           (OnePathComputes, r"It is read in float64 by mul \(aten\.mul\.Tensor\) at .*\.mul\(2\)"),
           (UpdatesInPlace, r"It is read in float64 by mul \(aten\.mul\.Tensor\) at .*x\.mul_\(0\.5\)")]


@pytest.mark.parametrize("cls,read", REFUSED, ids=[c.__name__ for c, _ in REFUSED])
def test_an_input_computed_in_float64_is_refused_naming_the_op(cls, read):
    x = torch.randn(4, 32, dtype=F64)
    with pytest.raises(TypeError, match=r"^fuse: example input 0 is float64; the NPU target ascend910 computes in "
                                        r"float16, bfloat16 and float32: cast .*\. " + read):
        AutoFusionEngine.fuse(cls().eval(), (x,))


def test_simulate_refuses_an_input_computed_in_float64_naming_the_op():
    with pytest.raises(TypeError, match=r"^simulate: example input 0 is float64; .* It is read in float64 by add "
                                        r"\(aten\.add\.Tensor\)"):
        autofuse.simulate(Promotes().eval(), (torch.randn(4, 32, dtype=F64),))


def test_a_call_computing_in_float64_is_refused_as_the_calls():
    fused = AutoFusionEngine.fuse(Promotes().eval(), (torch.randn(4, 32),))
    with pytest.raises(TypeError, match=r"^fused model: this call's input 0 is float64; .* by add "):
        fused(torch.randn(4, 32, dtype=F64))


@torch.no_grad()
def test_torch_compile_runs_a_graph_computing_in_float64_unfused_naming_the_op():
    torch.manual_seed(0)
    model, x = OnePathComputes().eval(), torch.randn(4, 32, dtype=F64)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=autofuse.backend())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = compiled(x)
        said = [str(w.message) for w in caught if "runs unfused" in str(w.message)]
        assert len(said) == 1 and "read in float64 by mul (aten.mul.Tensor)" in said[0], said
        assert torch.equal(got, model(x))
    finally:
        torch._dynamo.reset()


@torch.no_grad()
@pytest.mark.parametrize("cls", [CastThenAttention, OnePathComputes])
def test_torch_compile_dynamic_graphs_follow_the_same_rule(cls):
    """A graph Dynamo made dynamic is planned at each call's sizes: one that casts first fuses at each, one that
    computes in float64 runs unfused at each signature (one warning per signature, naming the op)."""
    torch.manual_seed(0)
    model = cls().eval()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=autofuse.backend(), dynamic=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n in (4, 6, 4):
                x = torch.randn(n, 16, 32, dtype=F64) if cls is CastThenAttention else torch.randn(n, 32, dtype=F64)
                got = compiled(x)
                if cls is CastThenAttention:
                    _as_eager(model, (x,), got)
                else:
                    assert torch.equal(got, model(x))
        said = [str(w.message) for w in caught if "runs unfused" in str(w.message)]
        if cls is CastThenAttention:
            assert not said and [_applied(r).count("attention") for r in reports(compiled)] == [1, 1]
        else:
            assert len(said) == 2 and all("read in float64 by mul (aten.mul.Tensor)" in t for t in said), said
    finally:
        torch._dynamo.reset()
