"""Gradients are eager's where the forward says what the gradient is: a ``detach`` inside a fused Vector region
stops it (a straight-through estimator, a stop-gradient factor, a detached statistic); planned without grad,
detach is dropped and the plan is not reused with grad."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine


class Detaching(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.l1, self.l2 = kind, nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = F.gelu(self.l1(x))
        if self.kind == "straight_through":             # fake quantisation, identity gradient
            h = h + (torch.round(h * 4) / 4 - h).detach()
        elif self.kind == "stop_gradient_factor":
            h = h * h.detach().sigmoid()
        else:                                           # RMS scaling by a detached statistic
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).detach() + 1e-6)
        return self.l2(h)


def _assert_grads_as_eager(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        # fp32: the fused regions reassociate sums; relative to the largest gradient entry
        assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max(), name


@pytest.mark.parametrize("kind", ["straight_through", "stop_gradient_factor", "detached_statistic"])
def test_detach_inside_a_vector_chain_stops_the_gradient(kind):
    torch.manual_seed(0)
    model = Detaching(kind)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert fused.report.applied                         # the regions around the detach still fuse
    ref(x).pow(2).sum().backward()
    fused(x).pow(2).sum().backward()
    _assert_grads_as_eager(model, ref)


def test_a_plan_made_without_grad_is_not_reused_with_grad():
    torch.manual_seed(0)
    model = Detaching("straight_through")
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 16)
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), ref(x), atol=1e-6, rtol=1e-5)      # fp32 reassociation only
    fused(x).sum().backward()
    ref(x).sum().backward()
    assert len(fused.plans) == 2
    torch.testing.assert_close(model.l1.weight.grad, ref.l1.weight.grad, atol=1e-5, rtol=1e-4)


class Epilogue(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.l1, self.l2 = kind, nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        if self.kind == "step":                   # no differentiable path from l1: autograd gives None
            return self.l2((self.l1(x) > 0).float())
        if self.kind == "times_zero":             # a path whose derivative is zero: autograd gives zeros
            return self.l2(self.l1(x) * 0.0 + x)
        return self.l2(F.dropout(F.gelu(self.l1(x)), p=1.0, training=True))     # every element dropped: zeros


@pytest.mark.parametrize("kind", ["step", "times_zero", "dropout_all"])
def test_an_epilogue_without_gradient_gives_what_autograd_gives(kind):
    """None where no differentiable path joins a parameter to the loss, zeros where one does with a zero
    derivative: an optimizer skips a None (no weight decay), so the two differ after a step."""
    torch.manual_seed(0)
    model = Epilogue(kind)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert any(d.pattern in ("matmul_epilogue", "vector_chain") or "matmul" in d.pattern
               for d in fused.report.applied), fused.report.summary()
    ref(x).pow(2).sum().backward()
    fused(x).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)   # fp32 reassociation only


class STE(torch.autograd.Function):
    """Round, with an identity gradient (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class Quantised(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(16, 16)

    def forward(self, x):
        return torch.softmax(STE.apply(self.l1(x) * 4) / 4, -1)


def _user_function_ops(gm) -> int:
    from autofuse.grad_ops import USER_FUNCTION_OP
    return sum(n.target is USER_FUNCTION_OP for n in gm.graph.nodes)


def _train_step(fn, model, x, w):
    model.zero_grad()
    (fn(x) * w).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_custom_autograd_function_is_kept_whole_with_grad_and_traced_through_without():
    """Capture traces a custom Function's forward, not its backward: with grad (and trainable parameters) a
    Function whose backward is not its forward's derivative is kept whole, one op that applies it when the graph
    runs, so the gradients are its backward's (straight through, where round's own would be zero), and the
    projection with its scale and the softmax fuse around it; the report names it and its line. Under no_grad the
    capture traces through it (nothing to lose), and that plan is not reused when grad comes back."""
    torch.manual_seed(0)
    model, x, w = Quantised().train(), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    eager = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert _user_function_ops(fused.graph_module) == 1
    assert sorted(d.pattern for d in fused.report.applied) == ["matmul_epilogue", "softmax"]
    (said,) = [m for m in fused.report.warnings if "custom autograd.Function" in m]
    assert "STE" in said and "STE.apply(self.l1(x) * 4)" in said
    # the simulated training step traces the op on fake tensors (its forward, then the Function's backward)
    assert fused.simulate(x, backward=True).phases["backward"] > 0
    want = _train_step(eager, eager, x, w)
    assert want[0].abs().max() > 0.1                                   # straight through, not zero
    for g, h in zip(_train_step(fused, model, x, w), want):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)         # fp32 reassociation only
    with torch.no_grad():
        torch.testing.assert_close(fused(x), eager(x), atol=1e-6, rtol=1e-5)
        assert _user_function_ops(fused.graph_module) == 0            # the no-grad plan traced through it
    for g, h in zip(_train_step(fused, model, x, w), want):             # grad again: the kept plan
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)
    assert len(fused.plans) == 2


def test_a_custom_function_trains_fused_through_torch_compile_as_through_fuse():
    """torch.compile keeps the Function whole too (from Dynamo's forward and backward graphs): the same blocks and
    the same straight-through gradients as fuse()'s."""
    import autofuse
    torch.manual_seed(0)
    model, x, w = Quantised().train(), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="autofuse")
    got = _train_step(compiled, model, x, w)
    assert sorted(d.pattern for r in autofuse.reports(compiled) for d in r.applied) == ["matmul_epilogue", "softmax"]
    want = _train_step(eager, eager, x, w)
    for g, h in zip(got, want):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)         # fp32 reassociation only


def test_a_custom_function_planned_while_frozen_is_kept_once_a_parameter_requires_grad():
    """Planned with grad while every parameter was frozen (nothing to lose: traced through), the plan is not reused
    once training unfreezes them: the next call captures again and keeps the Function whole, so the gradient is
    its backward's (before, it ran the Function's forward under autograd, which differentiated round())."""
    torch.manual_seed(0)
    model, x, w = Quantised().eval(), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    eager = copy.deepcopy(model)
    model.requires_grad_(False)
    fused = AutoFusionEngine.fuse(model, (x,))
    fused(x)
    assert _user_function_ops(fused.graph_module) == 0
    model.requires_grad_(True)
    for g, h in zip(_train_step(fused, model, x, w), _train_step(eager, eager, x, w)):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)         # fp32 reassociation only
    assert _user_function_ops(fused.graph_module) == 1


def test_a_custom_function_is_seen_at_every_size_after_calls_without_grad():
    """Calls at several lengths share one symbolic export (autofuse.sizes), whose captures at later lengths do not run
    the forward: a Function applied there was not seen, so a call with grad after calls without got the no-grad
    export's graph, which differentiates round() (every gradient of the projection zero, before). A size family is
    now one autograd state (calls with grad start their own), and a capture it serves carries the Functions its
    export's trace applied, so a no-grad plan of a served length is not reused with grad; with grad the Function is
    kept whole at every length, each exported by itself. Without grad the family still shares its export."""
    torch.manual_seed(0)
    model = Quantised().train()
    eager = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        for seq in (8, 12, 16, 20):
            x = torch.randn(2, seq, 16)
            torch.testing.assert_close(fused(x), eager(x), atol=1e-6, rtol=1e-5)   # fp32 reassociation only
    served = fused._sizes.served
    assert served >= 1                              # 16 and 20 served from one export
    for seq in (20, 24, 8):
        x, w = torch.randn(2, seq, 16), torch.randn(2, seq, 16)
        want = _train_step(eager, eager, x, w)
        assert want[0].abs().max() > 0.1
        for g, h in zip(_train_step(fused, model, x, w), want):
            torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)     # fp32 reassociation only
        assert _user_function_ops(fused.graph_module) == 1, seq
    assert fused._sizes.served == served            # none with grad


class GradientReversal(torch.autograd.Function):
    """A domain-adaptation gradient reversal: the identity (a view) forward, ``-alpha`` times the gradient back;
    a second output, the input's sign, is not differentiable."""

    @staticmethod
    def forward(ctx, x, alpha, clip=None):
        ctx.alpha = alpha
        sign = torch.sign(x)
        ctx.mark_non_differentiable(sign)
        return x.view_as(x), sign

    @staticmethod
    def backward(ctx, g, _):
        return -ctx.alpha * g, None, None


class Adversarial(nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.l1, self.l2, self.alpha = nn.Linear(16, 16), nn.Linear(16, 16), alpha

    def forward(self, x):
        h, sign = GradientReversal.apply(F.gelu(self.l1(x)), self.alpha)
        return torch.softmax(self.l2(h) * 0.5, -1) + sign.sum() * 0.0, torch.softmax(self.l2(h), -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gradient_reversal_with_a_constant_and_a_non_differentiable_output_trains_as_eager(dtype):
    """A Function returning a view of its input and a non-differentiable output, called with a Python float: kept
    whole, its gradients are eager's (reversed), the view is the op's own output (a copy: the op returns no alias),
    and the float is the model's: changing it makes a new plan that applies the new value, not the old one."""
    from autofuse.grad_ops import USER_FUNCTION_OP, USER_FUNCTIONS
    torch.manual_seed(0)
    model = Adversarial(0.5).to(dtype).train()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 8, 16, dtype=dtype)
    fused = AutoFusionEngine.fuse(model, (x,))

    def step(fn, m):
        m.zero_grad()
        a, b = fn(x)
        (a.float().pow(2).sum() + b.float().sum() * 0.5).backward()
        return [p.grad.float().clone() for p in m.parameters()]
    def close(g, h):
        if dtype == torch.float32:
            torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)       # reassociation only
        else:
            # bf16: the fused kernels round where eager's ops round differently; four bf16 ulps of the tensor's
            # largest gradient (1.7 measured), far below the gradient itself
            assert (g - h).abs().max() <= 4 * torch.finfo(dtype).eps * h.abs().max()
    for alpha in (0.5, 2.0):
        model.alpha = eager.alpha = alpha
        got, want = step(fused, model), step(eager, eager)
        (op,) = [n for n in fused.graph_module.graph.nodes if n.target is USER_FUNCTION_OP]
        assert USER_FUNCTIONS[op.args[1]].leaves[1] == alpha     # this call's alpha, not the first's
        assert want[0].abs().max() > 0                          # the reversed gradient reaches l1
        for g, h in zip(got, want):
            close(g, h)


class InPlaceClamp(torch.autograd.Function):
    """An in-place forward (``mark_dirty``) with an identity gradient: it cannot be an op that returns new values."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.clamp_(-1, 1)

    @staticmethod
    def backward(ctx, g):
        return g


class Clamped(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(16, 16)

    def forward(self, x):
        return torch.softmax(InPlaceClamp.apply(self.l1(x) * 2), -1)


class _ClampThenReverse(torch.autograd.Function):
    """A Function whose forward applies another (an in-place clamp, which could not be kept by itself) and whose
    backward reverses the gradient: eager runs the inner one's forward without grad, so only the outer backward
    counts."""

    @staticmethod
    def forward(ctx, x):
        return InPlaceClamp.apply(x.clone()) * 2

    @staticmethod
    def backward(ctx, g):
        return -g


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(16, 16)

    def forward(self, x):
        return torch.softmax(_ClampThenReverse.apply(self.l1(x) * 4), -1)


def test_a_kept_function_whose_forward_applies_another_is_one_op():
    """The Function a kept Function's forward applies is not the graph's (the kept op's fake run applies it): an
    in-place one was seen as the forward's own and refused, though eager never runs its backward."""
    torch.manual_seed(0)
    model, x, w = Nested().train(), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    eager = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert _user_function_ops(fused.graph_module) == 1
    for g, h in zip(_train_step(fused, model, x, w), _train_step(eager, eager, x, w)):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)         # fp32 reassociation only


class _Holder:
    def __init__(self, t):
        self.t = t


class ScaledBy(torch.autograd.Function):
    """Scales by a tensor an object holds, with an identity gradient: the object may hold the trace's tensors."""

    @staticmethod
    def forward(ctx, x, holder):
        return x * holder.t.sum()

    @staticmethod
    def backward(ctx, g):
        return g, None


class HeldScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(16, 16)

    def forward(self, x):
        return torch.softmax(ScaledBy.apply(self.l1(x), _Holder(x[0, 0, :2])), -1)


@pytest.mark.parametrize("model, named", [(Clamped, r"InPlaceClamp.*in-place"),
                                          (HeldScale, r"ScaledBy.*an object other than a tensor")])
def test_a_custom_function_that_cannot_be_kept_is_refused_with_grad_by_name(model, named):
    """A Function that marks its input dirty returns that input updated, not an op's fresh output; one handed an
    object holding a tensor (the trace's, at capture) cannot keep that object as a constant. With grad each is
    refused by name (what cannot be kept, and torch.compile); without grad it fuses through."""
    from autofuse.capture import CaptureError
    torch.manual_seed(0)
    model, x = model(), torch.randn(2, 8, 16)
    with pytest.raises(CaptureError, match=named + r".*torch\.compile"):
        AutoFusionEngine.fuse(model, (x,))
    with torch.no_grad():
        fused = AutoFusionEngine.fuse(model, (x,))
        torch.testing.assert_close(fused(x), model(x), atol=1e-6, rtol=1e-5)   # fp32 reassociation only


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x, mask):
        B, S, _ = x.shape
        q, k, v = (lin(x).view(B, S, 4, 8).transpose(1, 2) for lin in (self.q, self.k, self.v))
        s = (q @ k.transpose(-1, -2) * 8 ** -0.5).masked_fill(~mask, float("-inf"))
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(B, S, 32)


def test_a_query_row_with_no_key_spreads_nan_where_eager_does():
    """A padding query that sees no key is NaN in eager's plain softmax; a loss that skips it gets NaN in v's
    gradient only (masked_fill's backward stops the row's NaN before q and k), and so does the fused model."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 8, 32, generator=g)
    mask = torch.rand(2, 1, 8, 8, generator=g) > 0.4
    mask[..., 0] = True
    mask[0, 0, 3] = False
    keep = torch.ones(2, 8, dtype=torch.bool)
    keep[0, 3] = False
    torch.manual_seed(0)
    model = MaskedAttention()
    ref = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model, (x, mask))
    assert [d.pattern for d in fused.report.applied] == ["attention"]
    ref(x, mask)[keep].pow(2).sum().backward()
    fused(x, mask)[keep].pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad.isnan(), q.grad.isnan()), name
        ok = ~q.grad.isnan()
        torch.testing.assert_close(p.grad[ok], q.grad[ok], atol=1e-4, rtol=1e-4)     # fp32 reassociation only


def test_a_custom_autograd_function_is_refused_with_grad_on_the_symbolic_trace_route():
    """symbolic_trace hands the Function proxies, on which its backward cannot be checked: refused with grad as on
    the export route (it was taken as checked, and training differentiated round() instead of the identity)."""
    from autofuse.capture import CaptureError
    with pytest.raises(CaptureError, match=r"custom autograd.Function\(s\) STE.*torch.no_grad\(\)"):
        AutoFusionEngine.fuse(Quantised(), (torch.randn(2, 8, 16),), route="symbolic_trace")


class Square(torch.autograd.Function):
    """A custom Function whose backward is its forward's derivative (as BLOOM's GeLU is)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return 2 * x * g


class Squared(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(16, 16)

    def forward(self, x):
        return torch.softmax(Square.apply(self.l1(x)), -1)


def test_a_custom_function_whose_backward_is_its_forwards_derivative_fuses_with_grad():
    torch.manual_seed(0)
    model, x = Squared(), torch.randn(2, 8, 16)
    ref = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model, (x,))
    fused(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(model.l1.weight.grad, ref.l1.weight.grad, atol=1e-5, rtol=1e-4)   # fp32 rounding
    assert len(fused.plans) == 1            # fuse()'s plan, made with grad, serves the call with grad (it made two)


class Sqrt(torch.autograd.Function):
    """sqrt with its derivative written out: NaN at the negatives of the check's random inputs, as autograd's."""

    @staticmethod
    def forward(ctx, x):
        y = torch.sqrt(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        y, = ctx.saved_tensors
        return g / (2 * y)


class SqrtBoundDerivative(torch.autograd.Function):
    """RecurrentGemma's: sqrt whose derivative is bounded near 0 (``x`` clipped to 1e-6 in the backward), which
    autograd's derivative of the forward is not (inf at 0, NaN below)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return g / torch.sqrt(x.clip(min=1e-6)) / 2


class SqrtGate(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.l1, self.fn = nn.Linear(16, 16), fn

    def forward(self, x):
        return torch.softmax(self.fn.apply(torch.sigmoid(self.l1(x))), -1)


def test_a_custom_function_checked_where_its_gradient_is_nan():
    """The derivative check's random inputs include negatives, where a sqrt's gradient is NaN: NaN in the same
    places on both sides is agreement (the model fuses through it with grad and trains as eager), a finite gradient
    where autograd's is NaN is not (RecurrentGemma's bounded derivative is kept whole, and trains with its own
    backward). The check's tolerance used to be NaN there, and torch.allclose raised about atol instead."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    for fn, kept in ((Sqrt, 0), (SqrtBoundDerivative, 1)):
        model = SqrtGate(fn)
        ref = copy.deepcopy(model)
        fused = AutoFusionEngine.fuse(model, (x,))
        assert _user_function_ops(fused.graph_module) == kept, fn
        fused(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        torch.testing.assert_close(model.l1.weight.grad, ref.l1.weight.grad, atol=1e-5, rtol=1e-4)  # fp32 rounding


class TanhGelu(torch.autograd.Function):
    """BLOOM's GeLU (transformers' ``GeLUFunction``): the tanh approximation, its backward the derivative written
    out by hand, which rounds otherwise than autograd's derivative of the forward in 16 bits."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
        return ff * g


class GeluMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.down(TanhGelu.apply(self.up(x)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_custom_functions_derivative_is_checked_in_fp32_for_16_bit_arguments(dtype):
    """In 16 bits the hand-written derivative and autograd's differ by roundings (more than fp32's tolerance):
    the check runs in fp32, so BLOOM's GeLU in bf16 captures with grad as in fp32, its gradients eager's."""
    torch.manual_seed(0)
    model, x = GeluMlp().to(dtype), torch.randn(2, 8, 16, dtype=dtype)
    ref = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model, (x,))
    fused(x).float().pow(2).sum().backward()
    ref(x).float().pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        # two roundings of one derivative: a few 16-bit ulps of the gradient's scale
        torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=0.02 * float(q.grad.abs().max()), rtol=0)


class SqrtAbs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        return torch.sqrt(x.abs()) * self.w + x


def test_abs_at_zero_passes_an_infinite_gradient_on_as_eager():
    """abs's gradient is g·sgn(x): at x = 0 with an infinite g (sqrt's at 0) eager gives NaN, not 0."""
    model = SqrtAbs()
    x = torch.randn(2, 4, 16)
    x[0, 0, :3] = 0.0
    fused = AutoFusionEngine.fuse(model, (x,))
    assert fused.report.applied
    xe, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(xe).sum().backward()
    fused(xf).sum().backward()
    assert torch.equal(xe.grad.isnan(), xf.grad.isnan()) and xe.grad.isnan().sum() == 3
    ok = ~xe.grad.isnan()
    torch.testing.assert_close(xf.grad[ok], xe.grad[ok], atol=1e-5, rtol=1e-5)      # fp32 rounding only


class GradBlocks(nn.Module):
    """A forward with its own grad-mode blocks: a scale computed without grad (a ``with`` block, a decorated
    method, ``set_grad_enabled(False)`` as a block or a call, or ``inference_mode()``), and inside a no_grad block an ``enable_grad`` block that is tracked."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.l1, self.l2 = kind, nn.Linear(16, 16), nn.Linear(16, 16)

    @torch.no_grad()
    def _scale(self, h):
        return h.abs().amax(-1, keepdim=True) + 1

    @torch.no_grad()
    def _tracked_inside(self, h):
        frozen = h.sigmoid() * 3
        with torch.enable_grad():
            return h.abs().amax(-1, keepdim=True) + frozen.mean(-1, keepdim=True)

    def forward(self, x):
        h = self.l1(x)
        if self.kind == "with":
            with torch.no_grad():
                s = h.abs().amax(-1, keepdim=True) + 1
        elif self.kind == "decorated":
            s = self._scale(h)
        elif self.kind == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                s = h.abs().amax(-1, keepdim=True) + 1
        elif self.kind == "set_grad_enabled_call":    # called as a function, not a block
            torch.set_grad_enabled(False)
            s = h.abs().amax(-1, keepdim=True) + 1
            torch.set_grad_enabled(True)
        elif self.kind == "inference_mode":           # an inference tensor, read outside through a copy
            with torch.inference_mode():
                s = h.abs().amax(-1, keepdim=True) + 1
            s = s.clone()
        elif self.kind == "enable_grad_in_a_decorated_method":
            s = self._tracked_inside(h)
        else:                                               # enable_grad nested in no_grad: s is tracked
            with torch.no_grad():
                frozen = h.sigmoid() * 3
                with torch.enable_grad():
                    s = h.abs().amax(-1, keepdim=True) + frozen.mean(-1, keepdim=True)
        return self.l2(h / s * 2), s


@pytest.mark.parametrize("route", ["fuse", "torch.compile"])
@pytest.mark.parametrize("kind", ["with", "decorated", "set_grad_enabled", "set_grad_enabled_call", "inference_mode",
                                  "enable_grad_inside", "enable_grad_in_a_decorated_method"])
def test_a_no_grad_block_inside_the_forward_stops_the_gradient(kind, route):
    torch.manual_seed(0)
    model = GradBlocks(kind)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 16)
    run = AutoFusionEngine.fuse(model, (x,)) if route == "fuse" else torch.compile(model, backend="autofuse")
    y, s = run(x)
    y_ref, s_ref = ref(x)
    assert s.requires_grad == s_ref.requires_grad          # a value made without grad is returned without it
    (y.pow(2).sum() + (s.sum() if s.requires_grad else 0)).backward()
    (y_ref.pow(2).sum() + (s_ref.sum() if s_ref.requires_grad else 0)).backward()
    _assert_grads_as_eager(model, ref)     # through the scale instead, l1's moved by about its own size


def test_a_no_grad_block_planned_without_grad_is_not_reused_with_grad():
    torch.manual_seed(0)
    model = GradBlocks("with")
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 16)
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        fused(x)
    fused(x)[0].pow(2).sum().backward()
    ref(x)[0].pow(2).sum().backward()
    assert len(fused.plans) == 2
    assert (model.l1.weight.grad - ref.l1.weight.grad).abs().max() <= 1e-5 * ref.l1.weight.grad.abs().max()


def test_torchs_own_grad_blocks_are_not_the_forwards():
    """Capture marks only the forward's blocks: a model without any has no node marked (torch's tracer enters
    blocks of its own around the trace, which must not make the whole graph gradient-free)."""
    from autofuse.capture import GRAD_BLOCK, capture
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))
    gm = capture(model, (torch.randn(2, 8),)).graph_module
    assert not any(GRAD_BLOCK in (n.meta.get("custom") or {}) for n in gm.graph.nodes)
    assert not any(n.target == torch.ops.aten.detach.default for n in gm.graph.nodes)


class InPlaceInBlock(nn.Module):
    """A tensor made with grad, updated in place inside the forward's own no_grad block and read after it: eager's
    autograd does not see the update, so the reads get the new values and pass their gradient to the tensor's
    history unchanged."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.l1, self.l2 = kind, nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.l1(x) * 2
        y = self.l2(x)
        with torch.no_grad():
            if self.kind == "clamp_":
                h.clamp_(-0.5, 0.5)
            elif self.kind == "setitem":
                h[..., :3] = 0
            elif self.kind == "setitem_tensor":
                h[..., :3] = y[..., :3] * 2
            elif self.kind == "through_a_view":
                h[..., 4:8].mul_(3)
            elif self.kind == "augmented":
                h += 1
            elif self.kind == "function":
                torch.relu_(h)
            elif self.kind == "copy_":
                h.copy_(y * 2)
            elif self.kind == "masked_fill_":
                h.masked_fill_(h > 0.3, 0.0)
            else:                                       # two updates
                h.mul_(2)
                h.sub_(0.1)
        return h.sigmoid() * 3 + y


@pytest.mark.parametrize("route", ["fuse", "torch.compile"])
@pytest.mark.parametrize("kind", ["clamp_", "setitem", "setitem_tensor", "through_a_view", "augmented", "function",
                                  "copy_", "masked_fill_", "two_updates"])
def test_an_update_in_place_inside_a_no_grad_block_passes_the_gradient_on_as_eager(kind, route):
    torch.manual_seed(0)
    model = InPlaceInBlock(kind)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, 16)
    torch._dynamo.reset()
    run = AutoFusionEngine.fuse(model, (x,)) if route == "fuse" else torch.compile(model, backend="autofuse")
    y, y_ref = run(x), ref(x)
    # fp32, one fused matmul epilogue against eager's ops: a few units in the last place of values below 4
    assert (y - y_ref).abs().max() <= 1e-5
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    # stopped there (as before), l1's gradient would be zero; through the update, it would differ by its own size
    assert ref.l1.weight.grad.abs().max() > 0.1
    _assert_grads_as_eager(model, ref)
    with torch.no_grad():                       # planned without grad: the pass is dropped, the values stay
        assert (run(x) - ref(x)).abs().max() <= 1e-5


def test_a_graph_dynamo_gives_that_cannot_be_captured_runs_unfused_with_a_warning(monkeypatch):
    from autofuse.capture import CaptureError
    from autofuse.engine import AutoFusionEngine as Engine

    def refuse(*args, **kwargs):
        raise CaptureError("export", "could not capture GraphModule: a construct the tracer cannot follow")
    monkeypatch.setattr(Engine, "fuse", refuse)
    torch.manual_seed(0)
    model = InPlaceInBlock("clamp_")
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, 16)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="runs unfused, as Dynamo gave it.*a construct the tracer cannot follow"):
        y = torch.compile(model, backend="autofuse")(x)
    y_ref = ref(x)
    assert torch.equal(y, y_ref)            # Dynamo's own graph: eager's ops
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    _assert_grads_as_eager(model, ref)


class ReadsAutograd(nn.Module):
    """A forward that branches on autograd state, as code that picks a custom backward or a cheaper inference path
    does: the branch taken must be eager's for each call's state."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.l1, self.l2 = kind, nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.l1(x)
        if self.kind == "requires_grad":
            taken = h.requires_grad
        elif self.kind == "input_requires_grad":
            taken = x.requires_grad
        elif self.kind == "is_grad_enabled":
            taken = torch.is_grad_enabled()
        elif self.kind == "both":
            taken = torch.is_grad_enabled() and h.requires_grad
        elif self.kind == "inside_no_grad":             # made inside the forward's own no_grad block: False
            with torch.no_grad():
                s = h.abs().amax(-1, keepdim=True)
            taken = not s.requires_grad
        elif self.kind == "view_in_no_grad":            # a view of what requires grad requires it in any mode
            with torch.no_grad():
                taken = self.l1.weight.t().requires_grad and h[:, 1:].requires_grad
        elif self.kind == "factory":                    # asked for by the factory
            taken = torch.zeros(3, requires_grad=torch.is_grad_enabled()).requires_grad
        elif self.kind == "c_is_grad_enabled":
            taken = torch._C.is_grad_enabled()
        else:                                           # through an in-place update and a detach
            g = torch.zeros_like(h)
            g += h
            taken = g.requires_grad and not g.detach().requires_grad
        return self.l2(torch.tanh(h) * 3 if taken else h * 2)


@pytest.mark.parametrize("route", ["fuse", "torch.compile"])
@pytest.mark.parametrize("kind", ["requires_grad", "input_requires_grad", "is_grad_enabled", "both",
                                  "inside_no_grad", "in_place_and_detach", "view_in_no_grad", "factory",
                                  "c_is_grad_enabled"])
def test_a_branch_on_autograd_state_takes_eagers_branch_in_each_state(kind, route):
    """With grad, without it, and with an input that requires grad: one fused module gives eager's values and
    gradients in each, the branch taken as eager takes it (the two branches' outputs differ by their own size)."""
    torch.manual_seed(0)
    model = ReadsAutograd(kind)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 4, 16)
    torch._dynamo.reset()
    run = AutoFusionEngine.fuse(model) if route == "fuse" else torch.compile(model, backend="autofuse")
    for grad, x_grad in ((True, False), (False, False), (True, True), (True, False)):
        xi, xr = x.clone().requires_grad_(x_grad), x.clone().requires_grad_(x_grad)
        with torch.set_grad_enabled(grad):
            y, y_ref = run(xi), ref(xr)
        # fp32, fused regions against eager's ops: a few units in the last place of values below 10
        assert (y - y_ref).abs().max() <= 1e-5, (grad, x_grad)
        if grad:
            y.pow(2).sum().backward()
            y_ref.pow(2).sum().backward()
            _assert_grads_as_eager(model, ref)
            if x_grad:
                assert (xi.grad - xr.grad).abs().max() <= 1e-5 * xr.grad.abs().max()
            model.zero_grad(), ref.zero_grad()


def test_a_tensor_hook_registered_in_the_forward_is_refused_by_name():
    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            h = self.l(x)
            h.register_hook(lambda g: g * 0)
            return h * 2

    from autofuse.capture import CaptureError
    with pytest.raises(CaptureError, match=r"registers a tensor hook \(register_hook, at .*test_autograd_semantics"
                                           r".*torch.compile\(model, backend='autofuse'\)"):
        AutoFusionEngine.fuse(Hooked(), (torch.randn(2, 8),))


def test_a_forward_reading_autograd_state_is_not_served_by_an_export_shared_across_sizes():
    """One export serves a signature's other sizes; a forward that branches on autograd state is exported at each
    size instead, so that a call with grad after several without takes eager's branch."""
    torch.manual_seed(0)
    model = ReadsAutograd("is_grad_enabled")
    ref = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model)
    for n in (3, 4, 5, 6, 7):
        x = torch.randn(2, n, 16)
        with torch.no_grad():
            assert (fused(x) - ref(x)).abs().max() <= 1e-5       # fp32 reassociation in fused regions
    x = torch.randn(2, 8, 16)
    assert (fused(x) - ref(x)).abs().max() <= 1e-5
    assert fused._sizes.served == 0


class AttentionAndRouter(nn.Module):
    def forward(self, q, k, v, logits):
        w, i = torch.topk(logits.softmax(-1), 2)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v, w / w.sum(-1, keepdim=True), i


@pytest.mark.parametrize("which, family", [(0, "attention"), (1, "moe_gating")])
def test_a_gradient_of_the_gradient_through_attention_or_a_router_is_refused_by_name(which, family):
    """A gradient penalty (create_graph=True, then a gradient of the gradient) through fused attention or a fused
    router raises naming the family and its switch (before: torch's "no autograd formula was registered")."""
    torch.manual_seed(0)
    ins = [torch.randn(2, 2, 8, 16) for _ in range(3)] + [torch.randn(16, 8)]
    fused = AutoFusionEngine.fuse(AttentionAndRouter(), tuple(ins))
    assert {d.pattern for d in fused.report.applied} >= {"attention", "moe_gating"}
    ins = [t.clone().requires_grad_() for t in ins]
    out = fused(*ins)[which]
    first = torch.autograd.grad(out.square().sum(), ins[3] if which else ins[0], create_graph=True)[0]
    with pytest.raises(RuntimeError, match=rf"gradient of the gradient.*fusion_switches=\{{'{family}': 'off'\}}"):
        torch.autograd.grad(first.square().sum(), ins[3] if which else ins[0])


class NormedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.n = nn.Linear(32, 32), nn.LayerNorm(32)

    def forward(self, x):
        return self.n(F.silu(self.a(x)) + x)


def test_torch_func_transforms_and_forward_mode_ad_run_the_model_unfused_with_a_warning():
    """torch.func's transforms and forward-mode AD reach the fused ops, which have no functorch or forward-AD rules:
    torch raised about a custom autograd.Function the user never wrote. Such a call runs the model itself (eager's
    values and derivatives) and says so."""
    import torch.autograd.forward_ad as fwAD
    torch.manual_seed(0)
    model, x = NormedMLP(), torch.randn(4, 8, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert fused.report.applied
    with pytest.warns(UserWarning, match="torch.func transform.*runs the model itself, unfused"):
        g = torch.func.grad(lambda t: fused(t).square().sum())(x)
    torch.testing.assert_close(g, torch.func.grad(lambda t: model(t).square().sum())(x))
    with pytest.warns(UserWarning, match="runs the model itself"):
        j = torch.func.vmap(fused)(x)
    torch.testing.assert_close(j, model(x))
    tangent = torch.randn_like(x)
    with fwAD.dual_level():
        with pytest.warns(UserWarning, match="forward-mode AD"):
            t_fused = fwAD.unpack_dual(fused(fwAD.make_dual(x, tangent))).tangent
        t_eager = fwAD.unpack_dual(model(fwAD.make_dual(x, tangent))).tangent
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            plain = fused(x)            # no tangent on this call: fused as usual
    torch.testing.assert_close(t_fused, t_eager)
    torch.testing.assert_close(plain, model(x), atol=1e-5, rtol=1e-4)


def test_a_batched_gradient_through_a_fused_op_names_the_op_and_the_way_out():
    """``is_grads_batched`` runs the backward under torch's legacy batching, for which the fused ops have no rule:
    torch's own error ("Batching rule not implemented ... could not generate a fallback") said nothing more."""
    torch.manual_seed(0)
    model, x = NormedMLP(), torch.randn(4, 8, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    xi = x.clone().requires_grad_(True)
    out = fused(xi)
    with pytest.raises(NotImplementedError, match=r"autofuse::\w+ \(a fused op of autofuse\) has no batching rule.*"
                                                  r"one grad_output at a time"):
        torch.autograd.grad(out, xi, torch.randn(3, *out.shape), is_grads_batched=True)


class RmsNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


class ReturnsResidual(nn.Module):
    """A residual stream the forward returns (a hidden state) and also norms: one AddRmsNorm region (with the
    projection before it, an epilogue) would both give ``h`` and read it."""

    def __init__(self, d=32, returns=True):
        super().__init__()
        self.returns, self.a, self.norm, self.b = returns, nn.Linear(d, d), RmsNorm(d), nn.Linear(d, d)

    def forward(self, x):
        h = x + self.a(x)
        y = self.b(self.norm(h))
        return (y, h) if self.returns else y


def _observe(m, x, how):
    """What the caller sees of the returned ``h``'s gradient, and a.weight's gradient, the loss on ``y`` only."""
    m.zero_grad(set_to_none=True)
    y, h = m(x)
    loss = y.square().sum()
    if how == "autograd_grad":
        return torch.autograd.grad(loss, h)[0], None
    if how == "retain_grad":
        h.retain_grad()
    else:                                                   # a hook that zeroes h's gradient: nothing reaches a
        h.register_hook(lambda g: torch.zeros_like(g))      # (it crashes if given None)
    loss.backward()
    return h.grad if how == "retain_grad" else None, m.a.weight.grad


def _close(got, want):
    assert (got is None) == (want is None)
    if want is not None:
        torch.testing.assert_close(got, want, atol=1e-5 * max(want.abs().max().item(), 1.0), rtol=1e-4)


@pytest.mark.parametrize("how", ["retain_grad", "zeroing_hook", "autograd_grad"])
def test_a_returned_value_read_again_inside_a_region_keeps_its_gradient(how):
    """A plan made with grad cuts a region at a value the model returns and reads on: the readers take the
    returned tensor, so its retain_grad(), its hooks and autograd.grad with respect to it see the gradient of
    the model's later uses, as in eager (before: None, a hook that changed nothing upstream, and "appears to
    not have been used in the graph")."""
    torch.manual_seed(0)
    model = ReturnsResidual()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    for got, want in zip(_observe(fused, x, how), _observe(ref, x, how)):
        _close(got, want)
    if how == "zeroing_hook":
        assert not model.a.weight.grad.any()
    cut = [d for d in fused.report.decisions if d.reason_code == "returned_value_read"]      # the report says why
    assert cut and all("add_rms_norm" in d.pattern and "returned by the model" in d.reason for d in cut)
    assert {d.pattern for d in fused.report.applied} >= {"rms_norm", "matmul_epilogue"}, fused.report.summary()


def test_without_grad_or_unreturned_the_region_still_fuses_whole_and_grad_plans_again():
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32)
    kept = AutoFusionEngine.fuse(ReturnsResidual(returns=False), (x,))          # with grad, h not returned
    assert any({"add", "rsqrt"} <= set(d.nodes) for d in kept.report.applied), kept.report.summary()
    assert not any(d.reason_code == "returned_value_read" for d in kept.report.decisions)
    model = ReturnsResidual()
    ref = copy.deepcopy(model)
    with torch.no_grad():                                   # an inference plan keeps today's fusion
        fused = AutoFusionEngine.fuse(model, (x,))
        assert any("add_rms_norm" in d.pattern for d in fused.report.applied), fused.report.summary()
        for got, want in zip(fused(x), ref(x)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(_observe(fused, x, "retain_grad"), _observe(ref, x, "retain_grad")):
        _close(got, want)                                   # not served by the plan made without grad
    assert len(fused.plans) == 2


class ReturnsMask(nn.Module):
    """A bool mask the model returns and its region reads on: no gradient flows through a bool."""

    def forward(self, x):
        keep = x > 0.1
        return torch.where(keep, x.exp(), x.sin()) * 2.0 + x, keep


def test_a_returned_value_that_carries_no_gradient_does_not_cut_the_region():
    x = torch.randn(4, 8, 32)
    model = ReturnsMask()
    fused = AutoFusionEngine.fuse(model, (x,))
    assert not any(d.reason_code == "returned_value_read" for d in fused.report.decisions), fused.report.summary()
    assert len(fused.report.applied) == 1 and {"gt", "where"} <= set(fused.report.applied[0].nodes)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    (y, keep), (y0, keep0) = fused(xs[0]), model(xs[1])
    assert torch.equal(keep, keep0)
    torch.testing.assert_close(y, y0, atol=1e-6, rtol=1e-6)        # fp32 exp and sin: a few ulps
    y.sum().backward()
    y0.sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, atol=1e-6, rtol=1e-6)


def _tiny(kind):
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        cfg._attn_implementation = "eager"
        return tf.GPT2LMHeadModel(cfg), ("transformer.wpe.weight", "transformer.h.0.mlp.c_fc.weight")
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    return tf.LlamaForCausalLM(cfg), ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hidden_states_and_attentions_returned_by_a_transformer_keep_their_gradients(kind):
    """output_hidden_states / output_attentions in a training step: every returned hidden state's and attention
    map's retain_grad() is eager's, a hook zeroing hidden_states[1]'s gradient leaves nothing upstream of it,
    and autograd.grad with respect to it is eager's (the norms and attention that read them run apart)."""
    model, upstream = _tiny(kind)
    model.train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    kw = dict(output_hidden_states=True, output_attentions=True, use_cache=False)
    fused = AutoFusionEngine.fuse(model)

    def run(m, how):
        params = dict((ref if m is ref else model).named_parameters())
        m.zero_grad(set_to_none=True)
        out = m(ids, **kw)
        held = list(out.hidden_states) + list(out.attentions)
        loss = out.logits.square().mean()
        if how == "autograd_grad":
            return torch.autograd.grad(loss, out.hidden_states[1]), None
        if how == "retain_grad":
            for t in held:
                t.retain_grad()
        else:
            out.hidden_states[1].register_hook(lambda g: torch.zeros_like(g))
        loss.backward()
        return [t.grad for t in held] if how == "retain_grad" else [], [params[n].grad for n in upstream]

    for how in ("retain_grad", "zeroing_hook", "autograd_grad"):
        got, want = run(fused, how), run(ref, how)
        for g, w in zip(got[0], want[0]):
            _close(g, w)
        if how == "zeroing_hook":
            assert all(g is None or not g.any() for g in got[1]) and all(w is None or not w.any() for w in want[1])
    assert len(fused.plans) == 1
    assert any(d.reason_code == "returned_value_read" for d in fused.report.decisions)


class AdditiveMaskAttention(nn.Module):
    def forward(self, q, k, v, mask):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + mask, -1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("skip_row", [False, True])
def test_an_additive_mask_that_requires_grad_spreads_an_empty_rows_nan_where_eager_does(dtype, skip_row):
    """An additive ``-inf`` mask leaving a query row no key: eager's softmax is NaN there, and its backward puts
    NaN in that row's dq and mask gradient and in every dk, also when the loss skips the row. With the mask
    requiring grad the backward runs on the host, which gave finite dq, dk and mask gradients there (0 in the
    row) while eager's were NaN."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g).to(dtype) for _ in range(3))
    mask = torch.zeros(1, 1, 8, 8)
    mask[0, 0, 3] = float("-inf")                          # query 3 sees no key
    mask[0, 0, 5, 6:] = float("-inf")
    mask = mask.to(dtype)
    model = AdditiveMaskAttention()
    fused = AutoFusionEngine.fuse(model, (q, k, v, mask))
    assert [d.pattern for d in fused.report.applied] == ["attention"]
    w = torch.randn(1, 2, 8, 16, generator=g, dtype=torch.float64)
    if skip_row:
        w[..., 3, :] = 0

    def grads(fn):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v, mask)]
        out = fn(*ins).double()
        (out.nan_to_num(0) * w if skip_row else out * w).sum().backward()
        return [t.grad for t in ins]
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), grads(fused), grads(model)):
        assert torch.equal(a.isnan(), b.isnan()), (name, int(a.isnan().sum()), int(b.isnan().sum()))
        ok = ~b.isnan()
        # the finite entries: the kernel's fp32 softmax against eager's, rounded to dtype (a few ulps of 16 bits)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(a[ok].float(), b[ok].float(), atol=tol, rtol=tol)


class ReturnedWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x, mask):
        return self.attn(x, x, x, attn_mask=mask, need_weights=True)


def test_multihead_attention_returning_its_weights_spreads_an_empty_rows_nan_where_eager_does():
    """``nn.MultiheadAttention(need_weights=True)`` with a bool mask leaving a query no key: it makes the mask an
    additive ``-inf`` one, so eager's weights and output are NaN in that row and its backward puts NaN in q's, k's and
    v's projection gradients. The fused attention returns its probabilities, so its backward runs on the host; that
    gave NaN in v's part only (256 of the 768 entries of ``in_proj_weight``)."""
    torch.manual_seed(0)
    model = ReturnedWeights()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 6, 16)
    mask = torch.zeros(6, 6, dtype=torch.bool)
    mask[2] = True                                          # True = not attended: query 2 sees no key
    fused = AutoFusionEngine.fuse(model, (x, mask))
    assert "attention" in [d.pattern for d in fused.report.applied]
    for m, fn in ((model, fused), (ref, ref)):
        out, weights = fn(x, mask)
        (out.nan_to_num(0).sum() + weights.nan_to_num(0).sum()).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad.isnan(), q.grad.isnan()), (name, int(p.grad.isnan().sum()), int(q.grad.isnan().sum()))
        ok = ~q.grad.isnan()
        torch.testing.assert_close(p.grad[ok], q.grad[ok], atol=1e-4, rtol=1e-4)     # fp32 reassociation only
