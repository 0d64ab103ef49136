"""Training-mode dropouts outside attention (residual, embedding, MLP), fused into the generated Vector kernels
and matmul epilogues around them: the fused call draws eager's keep-mask (``dropout_gen_mask``, same seed, same
elements dropped, the generator left where eager leaves it) and applies it from a ``bit`` input in the same
pass as the residual add and the norm; gradients follow the same mask; a dropout whose draw would move past
another random op, or whose mask is read, is left as captured."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.verify import compare

H = 64


class ResidualNorm(nn.Module):
    """GPT-2's block tail: ``ln(x + dropout(proj(x)))``."""

    def __init__(self, p=0.1):
        super().__init__()
        self.proj, self.drop, self.ln = nn.Linear(H, H), nn.Dropout(p), nn.LayerNorm(H)

    def forward(self, x):
        return self.ln(x + self.drop(self.proj(x)))


class Embedding(nn.Module):
    """GPT-2's embedding: ``dropout(tokens + positions)``, then a norm reading it."""

    def __init__(self, p=0.1):
        super().__init__()
        self.pos, self.drop, self.ln = nn.Parameter(torch.randn(16, H)), nn.Dropout(p), nn.LayerNorm(H)

    def forward(self, x):
        h = self.drop(x + self.pos)
        return h, self.ln(h)


class TwoDropouts(nn.Module):
    """Two dropouts of other p in one region: drawn in graph order."""

    def __init__(self):
        super().__init__()
        self.d1, self.d2 = nn.Dropout(0.3), nn.Dropout(0.1)

    def forward(self, a, b):
        return F.gelu(self.d1(a) * 2.0 + self.d2(b))


class Functional(nn.Module):
    """``F.dropout`` written in forward, with an odd width (the bits of a row end inside a byte)."""

    def forward(self, x):
        return torch.tanh(F.dropout(x * 0.5, 0.2, training=self.training)) + 1.0


def _run_seeded(fn, seed=7):
    torch.manual_seed(seed)
    out = fn()
    return out, torch.rand(4)          # what the generator gives next: where each run left it


def _float64(model, args):
    m64 = type(model)().double()
    m64.load_state_dict(model.state_dict())
    m64.train(model.training)
    return _run_seeded(lambda: m64(*[a.detach().double() for a in args]))[0]


def _args(model, dtype, grad=False):
    g = torch.Generator().manual_seed(0)
    width = 100 if isinstance(model, Functional) else H
    n = 2 if isinstance(model, TwoDropouts) else 1
    return tuple(torch.randn(2, 16, width, generator=g).to(dtype).requires_grad_(grad) for _ in range(n))


def _drawing(fused):
    return [d for d in fused.report.decisions if d.params.get("draws")]


MODELS = [ResidualNorm, Embedding, TwoDropouts, Functional]


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_dropout_draws_what_eager_draws(cls, dtype):
    torch.manual_seed(0)
    model = cls().to(dtype).train()
    args = _args(model, dtype)
    fused = AutoFusionEngine.fuse(model, args)
    ds = [d for d in _drawing(fused) if d.applied]       # (a region and its epilogue form conflict: one is)
    assert ds, [(d.pattern, d.reason) for d in fused.report.decisions]
    assert all("keep-mask" in d.reason and "dropout p=" in d.reason for d in ds)
    code = fused.graph_module.code
    assert "dropout_gen_mask" in code and "native_dropout" not in code and "aten.dropout" not in code
    got, after_fused = _run_seeded(lambda: fused(*args))
    want, after_eager = _run_seeded(lambda: model(*args))
    assert torch.equal(after_fused, after_eager)           # the generator moved exactly as far
    ref = _float64(model, args)
    for g_, w_, r_ in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want, ref))):
        assert torch.equal(g_ == 0, w_ == 0) or isinstance(model, (ResidualNorm, TwoDropouts))
        ok, err, tol = compare(w_, r_, g_)
        assert ok, (err, tol)


def test_the_dropped_elements_are_eagers():
    """No op after the dropout but a residual add of zeros: the output is zero exactly where eager's is."""
    class Drop(nn.Module):
        def forward(self, x, z):
            return F.dropout(x, 0.5, training=True) + z

    x, z = torch.randn(3, 8, 200) + 5.0, torch.zeros(3, 8, 200)
    fused = AutoFusionEngine.fuse(Drop(), (x, z))
    assert _drawing(fused)[0].applied
    got, _ = _run_seeded(lambda: fused(x, z), seed=11)
    want, _ = _run_seeded(lambda: Drop()(x, z), seed=11)
    assert torch.equal(got, want) and 0.4 < (want == 0).float().mean() < 0.6


class DropAffine(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, training=self.training) * 2.0 + 1.0


class DropNegated(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, training=self.training) * -2.0


class DropProjection(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = nn.Linear(32, 32), nn.Dropout(0.1)

    def forward(self, x, r):
        return self.drop(self.lin(x)) + r


def test_a_dropped_nan_or_inf_is_nan_and_a_dropped_negative_zero_stays_negative():
    # eager's native_dropout multiplies, x · mask · scale: a dropped NaN or inf is NaN, a dropped -0.0 or negative
    # value -0.0; a select (where(keep, x · scale, 0)) gave +0 at every dropped element
    torch.manual_seed(0)
    m = DropAffine().train()
    fused = AutoFusionEngine.fuse(m, (torch.randn(4, 16),))
    assert _drawing(fused)[0].applied
    x = torch.randn(4, 16)
    x[0], x[1], x[2] = float("nan"), float("inf"), -0.0
    with torch.no_grad():
        got, want = _run_seeded(lambda: fused(x))[0], _run_seeded(lambda: m(x))[0]
        ref = _run_seeded(lambda: m(x.double()))[0]
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().sum() > 16
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)
    s = DropNegated().train()
    fused_s = AutoFusionEngine.fuse(s, (torch.randn(4, 16),))
    assert _drawing(fused_s)[0].applied
    with torch.no_grad():
        got, want = _run_seeded(lambda: fused_s(x))[0], _run_seeded(lambda: s(x))[0]
    assert torch.equal(torch.signbit(got[2:]), torch.signbit(want[2:]))
    # in a matmul epilogue: a projection row made inf by one overflowed activation
    p = DropProjection().train()
    args = (torch.randn(4, 8, 32), torch.randn(4, 8, 32))
    fused = AutoFusionEngine.fuse(p, args)
    assert any(d.applied and d.kernel == "matmul_epilogue" for d in _drawing(fused)), fused.report.summary()
    x, r = torch.randn(4, 8, 32), torch.randn(4, 8, 32)
    x[0, 0, 5] = float("inf")
    with torch.no_grad():
        got, want = _run_seeded(lambda: fused(x, r))[0], _run_seeded(lambda: p(x, r))[0]
        p64 = DropProjection().double()
        p64.load_state_dict(p.state_dict())
        ref = _run_seeded(lambda: p64.train()(x.double(), r.double()))[0]
    assert want.isnan().any() and torch.equal(got.isnan(), want.isnan())
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)


def test_a_nan_gradient_at_a_dropped_element_stays_nan():
    # torch's dropout backward is g · mask · scale: a NaN or inf cotangent at a dropped element gives NaN there
    torch.manual_seed(0)
    m = DropAffine().train()
    fused = AutoFusionEngine.fuse(m, (torch.randn(4, 16, requires_grad=True),))
    assert _drawing(fused)[0].applied
    cot = torch.randn(4, 16)
    cot[0], cot[1] = float("nan"), float("inf")
    grads = []
    for fn, dt in ((m, torch.float32), (m, torch.float64), (fused, torch.float32)):
        xx = torch.randn(4, 16, generator=torch.Generator().manual_seed(1)).to(dt).requires_grad_()
        out, _ = _run_seeded(lambda fn=fn, xx=xx: fn(xx))
        out.backward(cot.to(dt))
        grads.append(xx.grad)
    want, ref, got = grads
    assert want.isnan().sum() > 16 and torch.equal(got.isnan(), want.isnan())
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)


class DropOneColumn(nn.Module):
    def forward(self, x):
        return torch.exp(F.dropout(x, 0.3, training=self.training)) * 2.0


class DropRowSum(nn.Module):
    def forward(self, x):
        s = F.dropout(x.sum(-1, keepdim=True), 0.2, self.training)
        return x * s + x.exp()


@pytest.mark.parametrize("cls, shape", [(DropOneColumn, (4, 1)), (DropRowSum, (4, 16))],
                         ids=["one_column", "row_sum"])
def test_a_dropout_of_per_row_values_runs_as_captured_beside_its_region(cls, shape):
    # one keep bit per row is no bit input of a program: the dropout stays as captured; the region around it
    # builds without it (it crashed: the part holding the dropout's getitem looked the dropout up)
    torch.manual_seed(0)
    m = cls().train()
    fused = AutoFusionEngine.fuse(m, (torch.randn(*shape, requires_grad=True),))
    assert "native_dropout" in fused.graph_module.code or "aten.dropout" in fused.graph_module.code
    x = torch.randn(*shape)
    grads = []
    for fn, dt in ((m, torch.float32), (m, torch.float64), (fused, torch.float32)):
        xx = x.clone().to(dt).requires_grad_()
        out, after = _run_seeded(lambda fn=fn, xx=xx: fn(xx))
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), xx.grad, after))
    (we, ge, ae), (wr, gr, _), (wf, gf, af) = grads
    assert torch.equal(ae, af)                      # the generator left where eager leaves it
    for want, ref, got in ((we, wr, wf), (ge, gr, gf)):
        ok, err, tol = compare(want, ref, got)
        assert ok, (err, tol)


def test_a_region_holding_a_dropouts_output_but_not_the_dropout_does_not_build():
    from torch.fx.experimental.proxy_tensor import make_fx

    from autofuse.vector_program import NotExpressible, program_from_nodes

    def fn(x):
        return torch.ops.aten.native_dropout(x, 0.2, True)[0].exp() * 2.0

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(4, 16))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target != torch.ops.aten.native_dropout.default]
    with pytest.raises(NotExpressible, match="not in the region"):
        program_from_nodes(nodes, [nodes[-1]])


class DeadDropout(nn.Module):
    """A dropout whose result nobody reads: eager still draws its mask, and the next dropout draws after it."""

    def forward(self, x):
        F.dropout(x + 1.0, 0.1, training=self.training)               # its result unused
        return torch.tanh(F.dropout(x, 0.3, training=self.training) * 2.0) + 1.0


@pytest.mark.parametrize("route", ["export", "auto"])
def test_a_dead_dropout_still_draws_as_eagers_does(route):
    # torch's trace dropped the unused dropout as dead code: the live one drew the dead one's mask (2.4 off eager)
    torch.manual_seed(0)
    m = DeadDropout().train()
    x = torch.randn(4, 8)
    fused = AutoFusionEngine.fuse(m, (x,), route=route)
    got, after_fused = _run_seeded(lambda: fused(x))
    want, after_eager = _run_seeded(lambda: m(x))
    assert torch.equal(after_fused, after_eager)
    assert torch.equal(got == 1.0, want == 1.0)
    ok, err, tol = compare(want, _float64(m, (x,)), got)
    assert ok, (err, tol)


@pytest.mark.parametrize("cls", [ResidualNorm, TwoDropouts], ids=lambda c: c.__name__)
def test_gradients_follow_the_same_mask(cls):
    torch.manual_seed(0)
    model = cls().train()
    args = _args(model, torch.float32, grad=True)
    fused = AutoFusionEngine.fuse(model, args)
    assert any(d.applied for d in _drawing(fused)) and "native_dropout" not in fused.graph_module.code
    grads = []
    for fn in (fused, model):
        for a in args:
            a.grad = None
        model.zero_grad()
        out, _ = _run_seeded(lambda fn=fn: fn(*args))
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads.append([a.grad.clone() for a in args] + [p.grad.clone() for p in model.parameters()])
    for gf, ge in zip(*grads):
        # fp32 both sides, the same mask: the backward recomputes the chain in fp32 (a few roundings a term)
        torch.testing.assert_close(gf, ge, rtol=1e-4, atol=1e-5)


def test_a_draw_that_would_move_past_another_random_op_stays_as_captured():
    class Between(nn.Module):
        def forward(self, x):
            h = F.dropout(x, 0.1, training=True)
            r = torch.rand_like(x)            # drawn after the dropout; the region reads it
            return F.layer_norm(h + r, (H,))

    x = torch.randn(2, 16, H)
    fused = AutoFusionEngine.fuse(Between(), (x,))
    ds = _drawing(fused)
    assert ds and not any(d.applied for d in ds)
    assert any("would move past the random op" in d.reason for d in ds), [d.reason for d in ds]
    got, after_fused = _run_seeded(lambda: fused(x))
    want, after_eager = _run_seeded(lambda: Between()(x))
    assert torch.equal(after_fused, after_eager) and torch.allclose(got, want, atol=1e-5)


def test_a_dropout_whose_mask_is_read_is_not_absorbed():
    class ReadsMask(nn.Module):
        def forward(self, x):
            y, keep = torch.ops.aten.native_dropout(x, 0.2, True)
            return F.layer_norm(y + 1.0, (H,)), keep

    x = torch.randn(2, 16, H)
    fused = AutoFusionEngine.fuse(ReadsMask(), (x,))
    assert not _drawing(fused) and "native_dropout" in fused.graph_module.code
    (got, gk), after_fused = _run_seeded(lambda: fused(x))
    (want, wk), after_eager = _run_seeded(lambda: ReadsMask()(x))
    assert torch.equal(gk, wk) and torch.equal(after_fused, after_eager)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_eval_mode_draws_nothing():
    model = ResidualNorm().eval()
    (x,) = _args(model, torch.float32)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert not _drawing(fused) and "dropout_gen_mask" not in fused.graph_module.code
    assert any(d.applied for d in fused.report.decisions)


@pytest.mark.parametrize("width", [13, 64, 100])
def test_the_torch_twin_reads_the_kernels_bit_format(width):
    """run_program_torch unpacks a bit input as the simulator's kernel does (pack_keep's format), so the op's
    reference twin and backward see the mask the kernel applied: the two agree exactly in fp32."""
    import numpy as np

    from autofuse.npu.kernels.dropout import pack_keep
    from autofuse.ops_vector import vector_program
    from autofuse.vector_program import Builder, run_program_torch, unpack_bits

    g = torch.Generator().manual_seed(width)
    keep = torch.rand(3, 5, width, generator=g) < 0.7
    bits = torch.from_numpy(pack_keep(keep.numpy()))
    assert bits.dtype == torch.uint8 and bits.shape[-1] == -(-width // 8)
    assert torch.equal(unpack_bits(bits, width), keep)
    b = Builder((3, 5))
    x, r, k = b.input("float32", (3, 5, width)), b.input("float32", (3, 5, width)), b.input("bit", (3, 5, width))
    b.output(b.add(b.where(k, b.mul(x, 1.0 / 0.7), 0.0), r), "float32")
    prog = b.build()
    xs = [torch.randn(3, 5, width, generator=g) for _ in range(2)]
    (want,) = run_program_torch(prog, xs + [bits])
    (got,) = vector_program(xs + [bits], prog)
    assert torch.equal(got, want)
    assert torch.equal(want, torch.where(keep, xs[0] * np.float32(1.0 / 0.7), 0.0) + xs[1])
    with pytest.raises(Exception, match="bit input of width"):
        run_program_torch(prog, xs + [bits[..., :-1].contiguous()])


# ------------------------------------------------------------------ dropouts of tensors not laid out row-major

# views whose dropout draws in another order than the logical one (eager fills ``empty_like(input)``, which keeps
# a dense input's strides, in memory order) and views that eager lays out row-major (a slice, a broadcast)
VIEWS = {
    "transposed": ((16, 2, H), lambda x: x.transpose(0, 1)),
    "permuted": ((4, H, 6), lambda x: x.permute(2, 0, 1)),
    "channels_last": ((2, 6, 5, H), lambda x: x.contiguous(memory_format=torch.channels_last)),
    "sliced": ((2, 16, 2 * H), lambda x: x[..., :H]),
    "strided_slice": ((2, 16, 2 * H), lambda x: x[..., ::2]),
    "expanded": ((2, 1, H), lambda x: x.expand(2, 16, H)),
    # copies whose layout the canonical form forgets: the draws follow the copy's
    "transposed_then_contiguous": ((16, 2, H), lambda x: x.transpose(0, 1).contiguous()),
    "transposed_copy": ((2, 16, H), lambda x: x.transpose(0, 1).contiguous().transpose(0, 1)),
}


class DropView(nn.Module):
    """A dropout of a view of the input, then Vector ops: the dropout's input is laid out as the view leaves it."""

    def __init__(self, view):
        super().__init__()
        self.view = view

    def forward(self, x):
        return torch.tanh(F.dropout(self.view(x), 0.3, training=self.training) * 2.0) + 1.0


class ProjectionTransposed(nn.Module):
    """A projection's output transposed to batch-first, then dropout, a residual constant and a norm (what
    ``nn.MultiheadAttention`` hands ``nn.TransformerEncoderLayer(batch_first=True)``)."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.ln = nn.Linear(H, H), nn.Dropout(0.1), nn.LayerNorm(H)

    def forward(self, x):
        return self.ln(self.drop(self.fc(x).transpose(0, 1)) + 1.0)


def _same_as_eager(fused, model, args, seed=7):
    got, after_fused = _run_seeded(lambda: fused(*args), seed)
    want, after_eager = _run_seeded(lambda: model(*args), seed)
    assert torch.equal(after_fused, after_eager)           # the generator moved exactly as far
    # the same masks: fp32 on both sides, the fused chain rounds a few ops differently (tanh, the norm's sums)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", VIEWS)
def test_a_dropout_of_a_view_draws_eagers_mask_in_eagers_order(name):
    from autofuse.graph import draw_order
    from autofuse.ops import draw_keep, pack_keep

    shape, view = VIEWS[name]
    x = view(torch.randn(shape))
    torch.manual_seed(5)
    want = F.dropout(torch.ones_like(x), 0.3) != 0        # eager's keep-mask for an input laid out as x
    torch.manual_seed(5)
    got = draw_keep(x.shape, 0.3, x.dtype, draw_order(x))
    assert torch.equal(got, want)
    torch.manual_seed(5)
    bits = torch.ops.autofuse.dropout_gen_mask(list(x.shape), 0.3, x.dtype, order=draw_order(x))
    assert torch.equal(bits, pack_keep(want))


@pytest.mark.parametrize("name", VIEWS)
def test_fused_dropout_of_a_view_drops_eagers_elements(name):
    shape, view = VIEWS[name]
    model = DropView(view).train()
    args = (torch.randn(shape),)
    fused = AutoFusionEngine.fuse(model, args)
    assert any(d.applied for d in _drawing(fused)), [(d.pattern, d.reason) for d in fused.report.decisions]
    _same_as_eager(fused, model, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_dropout_of_a_transposed_projection_drops_eagers_elements(dtype):
    torch.manual_seed(0)
    model = ProjectionTransposed().to(dtype).train()
    args = (torch.randn(16, 2, H).to(dtype),)
    fused = AutoFusionEngine.fuse(model, args)
    assert any(d.applied for d in _drawing(fused)), [(d.pattern, d.reason) for d in fused.report.decisions]
    got, after_fused = _run_seeded(lambda: fused(*args))
    want, after_eager = _run_seeded(lambda: model(*args))
    assert torch.equal(after_fused, after_eager)
    ok, err, tol = compare(want, _float64(model, args), got)
    assert ok, (err, tol)


def test_a_caller_laid_out_input_is_planned_for_its_layout():
    """An input broadcast along its rows and a transposed one sort their strides alike, but eager lays out (and
    draws the dropout of) the first row-major and the second transposed: each gets its own plan."""
    model = DropView(lambda x: x * 1.5).train()
    broadcast = torch.randn(1, H).expand(32, H)
    transposed = torch.randn(H, 32).t()
    fused = AutoFusionEngine.fuse(model, (broadcast,))
    assert any(d.applied for d in _drawing(fused))
    for x in (broadcast, transposed, broadcast):
        _same_as_eager(fused, model, (x,))


def test_a_dropout_of_a_view_through_torch_compile_drops_eagers_elements():
    import copy

    torch.manual_seed(0)
    model = ProjectionTransposed().train()
    compiled = torch.compile(copy.deepcopy(model), backend="autofuse")
    x = torch.randn(16, 2, H)
    _same_as_eager(compiled, model, (x,))
    import autofuse
    assert any(d.params.get("draws") and d.applied for r in autofuse.reports(compiled) for d in r.decisions)


class ChannelNorm(nn.Module):
    """BatchNorm1d over channels of a [B, T, C] sequence (transposed in and back), GELU, dropout: torch's meta kernel
    keeps the transposed input's strides for the norm's output, eager's CPU kernel writes it contiguous, so the
    dropout's input is laid out otherwise than the captured graph said."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.drop, self.out = nn.Linear(H, 32), nn.BatchNorm1d(32), nn.Dropout(0.2), nn.Linear(32, 4)

    def forward(self, x):
        h = self.bn(self.fc(x).transpose(1, 2)).transpose(1, 2)
        return self.out(self.drop(F.gelu(h)))


@pytest.mark.parametrize("bn_train", [True, False])
@pytest.mark.parametrize("route", ["export", "compile"])
def test_a_dropout_after_a_transposed_batch_norm_drops_eagers_elements(bn_train, route):
    # a fused dropout drew in the captured (transposed) order: 0.96 off eager's output with the same seed
    import copy

    torch.manual_seed(0)
    model = ChannelNorm().train()
    model.bn.train(bn_train)
    x = torch.randn(6, 8, H)
    eager = copy.deepcopy(model)           # BatchNorm's running statistics move at each training call
    if route == "export":
        fused = AutoFusionEngine.fuse(model, (x,))
        assert any(d.applied for d in _drawing(fused)), [(d.pattern, d.reason) for d in fused.report.decisions]
    else:
        fused = torch.compile(model, backend="autofuse")
    _same_as_eager(fused, eager, (x,))


@pytest.mark.parametrize("op", ["masked_select", "nonzero"])
def test_a_size_read_from_data_after_a_transposed_batch_norm_still_captures(op):
    # laying the norm's output out as eager does re-runs what follows under the export's fake mode: a size read
    # from data made there is a new unknown size, and comparing it with the captured one failed the capture
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(8)

        def forward(self, x):
            h = self.bn(x.transpose(1, 2)).transpose(1, 2)
            kept = h.masked_select(h > 0) if op == "masked_select" else torch.nonzero(h > 0).float()
            return kept.sum(), h * 2

    x = torch.randn(2, 5, 8)
    model = M().eval()
    fused = AutoFusionEngine.fuse(model, (x,))
    with torch.no_grad():
        for got, want in zip(fused(x), model(x)):
            torch.testing.assert_close(got, want)


def test_transformer_encoder_layer_batch_first_trains_with_eagers_masks():
    """nn.MultiheadAttention hands the layer's first dropout a transposed output."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True).train()
    x = torch.randn(2, 8, 32)
    fused = AutoFusionEngine.fuse(layer, (x,))
    assert any(d.applied for d in _drawing(fused)), [(d.pattern, d.reason) for d in fused.report.decisions]
    _same_as_eager(fused, layer, (x,))


# ----------------------------------------------------------------------- dropouts that draw nothing in eager

class EdgeThenDropout(nn.Module):
    """A dropout of ``p`` (eager's ``dropout`` draws nothing at p = 0 and p = 1: it returns its input, or zeros),
    fused into a Vector region or a projection's epilogue, then an ordinary dropout whose mask shows where the
    generator was left."""

    def __init__(self, p, where):
        super().__init__()
        self.where, self.fc, self.edge, self.drop = where, nn.Linear(H, H), nn.Dropout(p), nn.Dropout(0.5)

    def forward(self, x, r):
        h = self.edge(self.fc(x)) if self.where == "epilogue" else self.edge(x * 2.0)
        return self.drop(torch.tanh(h + r * 3.0) * 1.5) @ torch.ones(H, 4, dtype=x.dtype)


@pytest.mark.parametrize("route", ["fuse", "torch.compile"])
@pytest.mark.parametrize("where", ["vector", "epilogue"])
@pytest.mark.parametrize("p", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dropout_eager_draws_nothing_for_leaves_the_generator_alone(p, where, route, dtype):
    import copy

    torch.manual_seed(0)
    model = EdgeThenDropout(p, where).to(dtype).train()
    args = tuple(torch.randn(4, 6, H).to(dtype) for _ in range(2))
    if route == "fuse":
        fused = AutoFusionEngine.fuse(copy.deepcopy(model), args)
        decisions = fused.report.decisions
    else:
        torch._dynamo.reset()
        fused = torch.compile(copy.deepcopy(model), backend="autofuse")
        fused(*args)
        import autofuse
        decisions = [d for r in autofuse.reports(fused) for d in r.decisions]
    assert any(d.applied for d in decisions), [(d.pattern, d.reason) for d in decisions]
    got, after_fused = _run_seeded(lambda: fused(*args))
    want, after_eager = _run_seeded(lambda: model(*args))
    assert torch.equal(after_fused, after_eager)           # the generator moved exactly as far
    ok, err, tol = compare(want, _run_seeded(lambda: copy.deepcopy(model).double()(*[a.double() for a in args]))[0],
                           got)
    assert ok, (err, tol)
