"""The backward of torch.ops.autofuse.vector_program as a derived Vector program (cost_model.program_grad):
gradients equal the host recompute's (torch autograd of run_program_torch in fp32), the backward is one more
``vector_program`` launch (traced with make_fx in fake mode, as whole-graph training simulation traces it),
and a program whose backward is no Vector program falls back to the host recompute."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import autofuse.ops_vector as ov
from autofuse.ops import recording
from autofuse.vector_program import run_program_torch
from cost_model.program import Builder, Output
from tests.cost_model.test_program_grad import derived_grads, layernorm, make_inputs, rmsnorm, rope, swiglu

ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
# the simulator's exp/tanh/rsqrt and torch's differ in the last fp32 ulps; the derived formulas reorder fp32
# sums over <= 64 columns: a few fp32 ulps of the largest gradient
TOL = 3e-5


def dropout_chain():
    b = Builder((4, 6))
    x, res, keep = b.input("float16", (4, 6, 64)), b.input("float16", (4, 6, 64)), b.input("bit", (4, 6, 64))
    b.output(b.add(b.where(keep, b.mul(b.gelu(x), 1.0 / 0.9), 0.0), res), "float16")
    return b.build()


def host_grads(prog, xs, gouts, wrt):
    """The host recompute: torch autograd of run_program_torch on fp32 leaves."""
    leaves = [x.detach().float().requires_grad_(k in wrt) if x.is_floating_point() else x for k, x in enumerate(xs)]
    outs = run_program_torch(prog, leaves)
    got = torch.autograd.grad(outs, [leaves[k] for k in wrt], [g.to(o.dtype) for o, g in zip(outs, gouts)])
    return [g.to(xs[k].dtype) for k, g in zip(wrt, got)]


def leaves_of(prog, seed=0):
    xs = make_inputs(prog, seed)
    return [x.requires_grad_() if x.is_floating_point() else x for x in xs]


CASES = {"rmsnorm": lambda: rmsnorm(dtype="float16"), "layernorm": layernorm, "rope": lambda: rope(False),
         "rope_interleaved": lambda: rope(True), "swiglu": swiglu, "dropout": dropout_chain}


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_equal_host_recompute(name):
    prog = CASES[name]()
    xs = leaves_of(prog)
    wrt = [k for k, x in enumerate(xs) if x.requires_grad]
    gen = torch.Generator().manual_seed(3)
    gouts = [torch.randn(s, generator=gen).to(getattr(torch, o.dtype))
             for o, s in zip(prog.outputs, prog.output_shapes())]
    torch.autograd.backward(ov.vector_program(xs, prog), gouts)
    want = host_grads(prog, xs, gouts, wrt)
    # a lead-broadcast input's gradient sums rows rounded to its dtype: one ulp of each row's contribution more
    _, _, slack = derived_grads(prog, [x.detach() for x in xs], dict(enumerate(gouts)), wrt)
    for k, w, sl in zip(wrt, want, slack):
        got = xs[k].grad
        assert got.shape == w.shape and got.dtype == w.dtype
        # both rounded to the input's dtype once: at most one ulp of it apart, plus fp32 differences
        bound = 2 * ULP[w.dtype] * w.double().abs() + TOL * w.double().abs().max() + sl
        assert bool(((got.double() - w.double()).abs() <= bound).all()), (name, k)


def grads64(fn, args, g_out):
    leaves = [a.detach().double().requires_grad_() for a in args]
    torch.autograd.backward([fn(*leaves)], [g.double() for g in g_out])
    return [x.grad for x in leaves]


def _count(gm, op):
    return sum(n.op == "call_function" and n.target == op for n in gm.graph.nodes)


@pytest.mark.parametrize("name", ["rmsnorm", "rope", "dropout"])
def test_backward_is_one_vector_program_launch(name):
    prog = CASES[name]()
    xs = leaves_of(prog)
    wrt = [x for x in xs if x.requires_grad]

    def step(*xs):
        outs = ov.vector_program(list(xs), prog)
        loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
        return torch.autograd.grad(loss, [x for x in xs if x.requires_grad])

    gm = make_fx(step, tracing_mode="fake")(*xs)
    assert _count(gm, torch.ops.autofuse.vector_program.default) == 2, gm.graph   # forward + backward
    # a weight broadcast along lead dims gets its rows summed by a torch sum (a separate reduction)
    sums = {"rmsnorm": 1, "rope": 2, "dropout": 0}[name]
    assert _count(gm, torch.ops.aten.sum.dim_IntList) == sums, gm.graph
    outs = gm(*xs)
    assert [tuple(o.shape) for o in outs] == [tuple(x.shape) for x in wrt]


def test_launch_recorded_by_the_simulator():
    prog = rmsnorm(dtype="float16")
    xs = leaves_of(prog)
    out = ov.vector_program(xs, prog)[0]
    with recording() as launches:
        out.float().sum().backward()
    assert [name for name, _ in launches] == ["vector_program"]


def test_wide_swiglu_backward_in_column_chunks():
    """SwiGLU on a fused gate_up of 2 x 11008 fp16 columns: its backward's cat of the halves' gradients would need
    whole rows in UB, which do not fit; the halves come out as two outputs (column chunks) and torch.cat joins
    them."""
    prog = swiglu(F=11008)
    xs = leaves_of(prog)
    gout = torch.randn(prog.output_shapes()[0], generator=torch.Generator().manual_seed(2)).half()
    with recording() as launches:
        torch.autograd.backward(ov.vector_program(xs, prog), [gout])
    assert [k for k, _ in launches] == ["vector_program", "vector_program"]
    want = host_grads(prog, xs, [gout], [0])[0]
    bound = 2 * ULP[torch.float16] * want.double().abs() + TOL * want.double().abs().max()
    assert bool(((xs[0].grad.double() - want.double()).abs() <= bound).all())


def test_not_differentiable_falls_back_to_host():
    """A step-3 slice has no derived gradient: the host recompute gives it, with no launch in the backward."""
    b = Builder((4,))
    x = b.input("float32", (4, 30))
    b.output(b.tanh(b.slice(x, start=0, stop=30, step=3)), "float32")
    prog = b.build()
    xs = leaves_of(prog)

    def step(x):
        (o,) = ov.vector_program([x], prog)
        return torch.autograd.grad(o.sum(), [x])

    gm = make_fx(step, tracing_mode="fake")(*xs)
    assert _count(gm, torch.ops.autofuse.vector_program.default) == 1
    (g,) = step(*xs)
    want = torch.zeros(4, 30)
    want[:, ::3] = 1 - torch.tanh(xs[0].detach()[:, ::3]) ** 2
    torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)   # fp32 tanh', a few ulps


# ------------------------------------------------------------------------------------------ matmul_epilogue
def gelu_bias_epilogue(M, N, product="float32"):
    """gelu_tanh(a @ w + bias) in fp16: the program of an MLP's first linear."""
    b = Builder((M,))
    p = b.input(product, (M, N))
    b.output(b.gelu_tanh(b.cast(p, dtype="float32")), "float16")
    return b.build()


def swiglu_epilogue(M, F_):
    b = Builder((M,))
    p = b.input("float16", (M, 2 * F_))
    b.output(b.mul(b.silu(b.slice(p, start=0, stop=F_)), b.slice(p, start=F_, stop=2 * F_)), "float16")
    return b.build()


def with_product(prog):
    """``prog`` (an epilogue's program) also storing its product, input 0, as a training plan's cut does for GELU."""
    return dataclasses.replace(prog, outputs=prog.outputs + (Output(0, prog.inputs[0].dtype),))


def test_a_training_plan_keeps_the_product_only_where_the_backward_reads_it():
    from autofuse.fused_vector import _epilogue_weights, kept_values, with_saved
    prog = gelu_bias_epilogue(8, 16)
    keep = kept_values(prog, weigh=_epilogue_weights(prog))
    trained, saved = with_saved(prog, keep, product=True)
    # GELU reads its input: the product, or the identity cast of it the program reads (as many bytes), is stored
    assert len(trained.outputs) == 2 and trained.values[trained.outputs[1].value].width == 16
    assert ov.product_output(with_product(prog)) == 1 and ov.product_output(prog) is None
    b = Builder((8,))                             # a residual add: d(product) is the output's gradient alone
    p, r = b.input("float32", (8, 16)), b.input("float16", (8, 16))
    b.output(b.add(p, r), "float16")
    prog = b.build()
    assert kept_values(prog, weigh=_epilogue_weights(prog)) == ()
    # SwiGLU on a fused gate_up: outputs half the product's width; the kernel walks the output's columns, so
    # it stores no product and the backward recomputes it
    prog = swiglu_epilogue(8, 16)
    keep = kept_values(prog, weigh=_epilogue_weights(prog))
    assert 0 in keep and with_saved(prog, keep, product=True)[0] is prog


@pytest.mark.parametrize("trans_b, bias, batched", [(False, False, False), (True, True, False), (True, False, True)])
@pytest.mark.parametrize("save", [True, False])
def test_epilogue_gradients(trans_b, bias, batched, save):
    """Gradients of a, b, bias through matmul_epilogue with the product saved (the training plan's program) or
    recomputed, against eager float64."""
    M, K, N = 24, 32, 48
    g = torch.Generator().manual_seed(4)
    prog = gelu_bias_epilogue(M, N)
    prog = with_product(prog) if save else prog
    a = (torch.randn(*((2, M // 2) if batched else (M,)), K, generator=g) / 4).half().requires_grad_()
    w = (torch.randn(N, K, generator=g) / 4 if trans_b else torch.randn(K, N, generator=g) / 4).half().requires_grad_()
    bb = (torch.randn(N, generator=g) / 4).half().requires_grad_() if bias else None
    outs = ov.matmul_epilogue(a, w, prog, bias=bb, trans_b=trans_b)
    assert len(outs) == (2 if save else 1)
    gout = torch.randn(M, N, generator=g).half()
    with recording() as log:
        outs[0].backward(gout)
    assert [k for k, _ in log] == ["vector_program"]

    def eager(a_, w_, *b_):
        prod = a_ @ (w_.T if trans_b else w_) + (b_[0] if b_ else 0)
        return F.gelu(prod, approximate="tanh").reshape(M, N)     # the program's rows (batched: [B*S, N])
    leaves = [a, w] + ([bb] if bias else [])
    want = grads64(eager, leaves, [gout])
    for leaf, ww in zip(leaves, want):
        # d(product) rounded to the product's dtype, then fp16 matmuls (as eager's fp16 linear backward):
        # a few fp16 ulps of the largest gradient
        assert (leaf.grad.double() - ww).abs().max() <= 2 ** -8 * ww.abs().max() + 1e-4


@pytest.mark.parametrize("save", [True, False])
def test_epilogue_backward_traced(save):
    """Traced in fake mode: the backward is one vector_program launch (d(product)) and the matmuls of dA and dB;
    without the saved product a third matmul recomputes it."""
    M, K, N = 16, 32, 24
    prog = gelu_bias_epilogue(M, N, product="float16")
    prog = with_product(prog) if save else prog
    a = torch.randn(M, K).half().requires_grad_()
    w = torch.randn(K, N).half().requires_grad_()

    def step(a, w):
        (o, *_) = ov.matmul_epilogue(a, w, prog)
        return torch.autograd.grad(o.float().sum(), [a, w])

    gm = make_fx(step, tracing_mode="fake")(a, w)
    assert _count(gm, torch.ops.autofuse.matmul_epilogue.default) == 1
    assert _count(gm, torch.ops.autofuse.vector_program.default) == 1
    mms = sum(n.op == "call_function" and n.target in (torch.ops.aten.mm.default, torch.ops.aten.matmul.default)
              for n in gm.graph.nodes)
    assert mms == (2 if save else 3), gm.graph


def test_training_graph_flag():
    from autofuse.fused_vector import training_graph

    def f(x):
        return torch.ops.aten.native_dropout.default(x, 0.1, True)[0] * 2
    gm = make_fx(f)(torch.randn(4, 8))
    assert training_graph(gm.graph)
    gm = make_fx(lambda x: x * 2)(torch.randn(4, 8))
    assert not training_graph(gm.graph)
    gm.meta["autofuse_training"] = True          # capture's own record, when it gives one
    assert training_graph(gm.graph)


@pytest.mark.parametrize("seed", range(10))
def test_random_backward_programs_on_the_simulator(seed):
    """The simulator's kernel runs every form the derivation emits (zeros and broadcasts by selects, padded
    slices, interleaves with zeros, amax tie counts) as the torch twin computes it."""
    from cost_model.program import random_program
    from cost_model.program_grad import backward_program
    prog = random_program(seed, lead=(4, 3), width=32, dtype=["float16", "float32", "bfloat16"][seed % 3],
                          n_ops=8, reductions=1 + seed % 2, shuffles=seed % 2 == 0)
    wrt = [k for k, i in enumerate(prog.inputs) if i.dtype in ("float16", "bfloat16", "float32")]
    gp = backward_program(prog, wrt)
    gen = torch.Generator().manual_seed(seed)
    gouts = [torch.randn(gp.program.inputs[k].shape, generator=gen).to(getattr(torch, gp.program.inputs[k].dtype))
             for k in range(len(prog.inputs), len(gp.program.inputs))]
    ins = make_inputs(prog, seed) + gouts
    for got, want in zip(ov.vector_program(ins, gp.program), run_program_torch(gp.program, ins)):
        # the simulator's exp/tanh/erf and torch's differ in the last fp32 ulps, carried through a few dozen
        # steps; then one rounding to the output's dtype (a tie may round either way: one ulp of it)
        bound = ULP[want.dtype] * want.double().abs() + TOL * want.double().abs().max()
        assert bool(((got.double() - want.double()).abs() <= bound).all())


def test_swiglu_with_the_gate_as_extra_saves_the_product():
    """The epilogue on the up projection with the gate projection's output as an extra input: the product's own
    gradient does not read it (g · silu(gate)), the gate's does (g · up · silu'(gate)): the product is saved."""
    from autofuse.fused_vector import _epilogue_weights, kept_values
    b = Builder((8,))
    up, gate = b.input("float16", (8, 16)), b.input("float16", (8, 16))
    b.output(b.mul(b.silu(gate), up), "float16")
    prog = b.build()
    assert 0 in kept_values(prog, weigh=_epilogue_weights(prog))
    # a residual add reads no product, whichever input needs a gradient
    b = Builder((8,))
    p, r = b.input("float16", (8, 16)), b.input("float16", (8, 16))
    b.output(b.add(p, r), "float16")
    prog = b.build()
    assert kept_values(prog, weigh=_epilogue_weights(prog)) == ()


@pytest.mark.parametrize("kind", ["clamp", "clamp_min", "clamp_max", "lo_above_hi"])
def test_a_clamps_gradient_is_clamps_at_its_bounds_and_at_nan(kind):
    # torch.clamp passes all of g where lo <= x <= hi, the bounds themselves included, and none at NaN; a maximum
    # or minimum would split g on the tie with its bound
    from autofuse import AutoFusionEngine

    class M(torch.nn.Module):
        def forward(self, x):
            y = {"clamp": lambda: x.clamp(0.0, 0.5), "clamp_min": lambda: x.clamp_min(0.0),
                 "clamp_max": lambda: x.clamp_max(0.5), "lo_above_hi": lambda: x.clamp(0.5, 0.0)}[kind]()
            return y * 2.0 + 1.0

    m = M().train()
    x0 = torch.tensor([[-1.0, 0.0, 0.25, 0.5, 1.0, 0.0, 0.5, float("nan")]] * 2)
    fused = AutoFusionEngine.fuse(m, (x0.clone().requires_grad_(),))
    assert [d.kernel for d in fused.report.applied] == ["vector_program"], fused.report.summary()
    grads = []
    for run in (m, fused):
        x = x0.clone().requires_grad_()
        y = run(x)
        y.backward(torch.ones_like(y))
        grads.append(x.grad)
    assert torch.equal(grads[1], grads[0]), grads


@pytest.mark.parametrize("name,fn", [
    ("sum of x minus its mean", lambda x: (x - x.mean(-1, keepdim=True)).sum(-1, keepdim=True)),
    ("mean of exp plus the row sum", lambda x: (x.exp() + x.sum(-1, keepdim=True)).mean(-1, keepdim=True)),
    ("sum of x plus its max", lambda x: (x + x.amax(-1, keepdim=True)).sum(-1, keepdim=True)),
    ("a cat with one column", lambda x: torch.cat([-x, x[..., :1]], -1) * 2),
    ("a cat with the row sum", lambda x: torch.cat([x.sin(), x.sum(-1, keepdim=True)], -1) * 2),
])
def test_derived_backward_of_per_row_terms_equals_autograd(name, fn):
    """A row reduction's adjoint is one column standing for the whole row: a per-row term added to the row took
    it once instead of summed over the row (the gradient of (x + amax(x)).sum(-1, keepdim=True) at the max was
    2 for 5); a cat's one-column part took column 0's gradient (the kernel read column 0 of a one-column slice)."""
    from cost_model.program_grad import backward_program
    from autofuse.vector_program import program_from_function
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0))
    bp, _ = program_from_function(fn, (x,))
    gp = backward_program(bp.program, (0,))
    g = torch.randn(gp.program.inputs[1].shape, generator=torch.Generator().manual_seed(1))
    got = ov.run_grad_program(gp, "", [x], [g], "ascend910")[0]
    x64 = x.double().requires_grad_()
    (fn(x64) * g.double()).sum().backward()
    # fp32 sums of 16 terms of size about 1 against float64: 1e-5 is a few hundred ulps and far below the wrong
    # factors (errors 0.6 to 21 before)
    assert (got.double() - x64.grad).abs().max() <= 1e-5 * max(1.0, x64.grad.abs().max().item())


def test_a_row_whose_max_is_nan_gets_a_nan_gradient_as_eager():
    from cost_model.program_grad import backward_program
    from autofuse.vector_program import program_from_function
    x = torch.tensor([[1.0, float("nan"), 3.0, 2.0], [1.0, 5.0, 3.0, 2.0]])
    fn = lambda t: t.amax(-1, keepdim=True) * 2       # noqa: E731
    bp, _ = program_from_function(fn, (x,))
    gp = backward_program(bp.program, (0,))
    got = ov.run_grad_program(gp, "", [x], [torch.ones(2, 1)], "ascend910")[0]
    xe = x.clone().requires_grad_()
    fn(xe).sum().backward()
    assert torch.equal(got.isnan(), xe.grad.isnan()) and got.isnan()[0].all()
    assert torch.equal(got[1], xe.grad[1])


def test_derived_backward_of_the_new_unary_ops_on_the_simulator():
    """erf, softplus, log1p and expm1 differentiated into a Vector program the simulator runs: torch's derivatives
    (2/√π·exp(−x²), sigmoid(x), 1/(1 + x), expm1(x) + 1), as the torch twin's autograd gives them."""
    from cost_model.program_grad import backward_program
    b = Builder((4, 3))
    x = b.input("float32", (4, 3, 32))
    b.output(b.add(b.add(b.erf(x), b.softplus(b.mul(x, 4.0))), b.mul(b.log1p(b.abs(x)), b.expm1(b.mul(x, 0.25)))),
             "float32")
    prog = b.build()
    gp = backward_program(prog, [0])
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, 32, generator=gen) * 3]
    g = torch.randn(4, 3, 32, generator=gen)
    (got,) = ov.vector_program(xs + [g], gp.program)
    leaf = xs[0].double().requires_grad_()
    y = torch.erf(leaf) + F.softplus(leaf * 4) + torch.log1p(leaf.abs()) * torch.expm1(leaf * 0.25)
    (want,) = torch.autograd.grad(y, [leaf], g.double())
    # fp32 against float64: the kernel's exp, erf polynomial and corrections, a few ulps of the largest term
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_derived_backward_of_the_roundings_sign_and_an_immediate_base_on_the_simulator():
    """floor, ceil, trunc, round and sign pass no gradient (torch's zeros, at ±inf and NaN too), frac's passes 1,
    pow of an immediate base g·y·log(base) (a base of 0: 0 where the exponent is >= 0; a negative base: NaN): the
    derived program the simulator runs gives autograd's gradients of the same values."""
    from cost_model.program_grad import backward_program
    b = Builder((4, 3))
    x, z, n = (b.input("float32", (4, 3, 32)) for _ in range(3))
    steps = b.add(b.add(b.floor(x), b.ceil(x)), b.add(b.mul(b.trunc(x), b.round(x)), b.sign(x)))
    b.output(b.add(b.add(steps, b.sub(x, b.trunc(x))), b.mul(b.pow(0.5, x), 3.0)), "float32")
    b.output(b.add(b.pow(0.0, z), b.pow(-2.0, n)), "float32")
    prog = b.build()
    gp = backward_program(prog, [0, 1, 2])
    gen = torch.Generator().manual_seed(0)
    xs = [torch.round(torch.randn(4, 3, 32, generator=gen) * 6) / 2 for _ in range(3)]
    for t in xs:
        t[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    gs = [torch.randn(4, 3, 32, generator=gen) for _ in range(2)]
    got = ov.vector_program(xs + gs, gp.program)
    leaves = [t.double().requires_grad_() for t in xs]
    lx, lz, ln = leaves
    y0 = torch.floor(lx) + torch.ceil(lx) + torch.trunc(lx) * torch.round(lx) + torch.sign(lx) + \
        torch.frac(lx) + torch.pow(0.5, lx) * 3
    y1 = torch.pow(0.0, lz) + torch.pow(-2.0, ln)
    want = torch.autograd.grad([y0, y1], leaves, [gs[0].double(), gs[1].double()])
    for w, g in zip(want, got):
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.isinf(), w.isinf())
        fin = w.isfinite()
        # fp32 against float64: pow's and log's ulps of the largest term
        scale = w[fin].abs().max() if fin.any() else 0.0
        assert bool(((g[fin].double() - w[fin]).abs() <= 1e-5 * scale).all())
    assert want[2].isnan().all() and not want[1].isnan().all()     # a negative base's log: NaN


def test_derived_backward_of_a_2_norm_on_the_simulator():
    """A 2-norm's root (sqrt of kind norm) differentiated into a Vector program the simulator runs: torch's norm
    backward ``x · g / ‖x‖``, 0 at a row of zeros (F.normalize's zero row: g / eps, finite)."""
    from cost_model.program_grad import backward_program
    b = Builder((4, 3))
    x = b.input("float32", (4, 3, 32))
    norm = b.sqrt(b.reduce(b.mul(x, x), kind="sum"), kind="root")
    b.output(b.div(x, b.maximum(norm, 1e-12, kind="clamp")), "float32")
    b.output(norm, "float32")
    prog = b.build()
    gp = backward_program(prog, [0])
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, 32, generator=gen)]
    xs[0][1, 2] = 0.0
    gs = [torch.randn(4, 3, 32, generator=gen), torch.randn(4, 3, 1, generator=gen)]
    (got,) = ov.vector_program(xs + gs, gp.program)
    leaf = xs[0].double().requires_grad_()
    nrm = torch.linalg.vector_norm(leaf, dim=-1, keepdim=True)
    (want,) = torch.autograd.grad([leaf / nrm.clamp_min(1e-12), nrm], [leaf], [g.double() for g in gs])
    assert bool(got.isfinite().all()) and bool(want.isfinite().all())
    # fp32 against float64, relative to each row's largest gradient (1e12 · g on the zero row)
    scale = want.abs().amax(-1, keepdim=True)
    assert bool(((got.double() - want).abs() <= 1e-5 * scale).all())
