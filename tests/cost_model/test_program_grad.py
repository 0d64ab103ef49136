"""The backward programs of cost_model.program_grad against torch autograd of run_program_torch.

Each case builds a forward program, derives its backward for every float input, runs it with the torch
interpreter (the kernel's reference twin) and compares with torch autograd of the forward interpreter on
float64 leaves (the forward still computes in fp32, as the program specifies; the leaves' gradients come back
in float64). Bounds: both sides compute in fp32 with differently ordered formulas, so gradients agree to a few
fp32 ulps of the largest gradient (``TOL`` of the norm); a gradient rounded to fp16/bf16 at the output is
within one ulp of its dtype of the reference; a program that rounds to fp16/bf16 inside (``cast``) makes
torch round the gradient flowing back through it too, while the derived program keeps it in fp32: those
cases take that dtype's ulp as the bound.
"""
import contextlib

import pytest
import torch

from cost_model.program import Builder, ProgramError, random_program, stored_shape
from cost_model.program_grad import NotDifferentiable, backward_program
import autofuse.vector_program as vp
from autofuse.ops_vector import gradients_from
from autofuse.vector_program import run_program_torch, torch_dtype

TOL = 3e-5          # fp32 (2^-23 = 1.2e-7) ulps of the largest gradient, for reordered sums over <= 256 columns
ULP = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def make_inputs(prog, seed=0, ties=False):
    gen = torch.Generator().manual_seed(seed)
    xs = []
    for inp in prog.inputs:
        shape = tuple(inp.shape) or (1,)
        if inp.dtype == "bit":
            xs.append(torch.randint(0, 256, stored_shape(inp), generator=gen, dtype=torch.uint8))
        elif inp.dtype == "bool":
            xs.append(torch.rand(shape, generator=gen) < 0.5)
        else:
            x = torch.randn(shape, generator=gen) * 0.8
            if ties:                   # values on a coarse grid: maxima and maximum() tie often
                x = torch.round(x * 2) / 2
            xs.append(x.reshape(inp.shape).to(torch_dtype(inp.dtype)))
    return xs


class _RoundGradient(torch.autograd.Function):
    """The value unchanged, the gradient rounded to ``dtype``."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype).to(g.dtype), None


@contextlib.contextmanager
def fp32_cast_gradients():
    """Casts to a float dtype in run_program_torch that round the value but pass the gradient on in fp32 (the
    derived programs accumulate adjoints in fp32; torch's ``.to()`` rounds the gradient to the narrow dtype), but
    for a cast of a value the program rounded to 16 bits: there the gradient is rounded to that dtype, as torch's
    ``.to()`` backward and the derived program round it (the round trip ``x.bfloat16().float()``)."""
    orig = vp._eval

    def _eval(ins, args):
        if ins.op == "cast" and ins.dtype != "bool" and args[0].dtype != torch.bool:
            x = args[0].float()
            rounded = getattr(args[0], "_rounded_to", None)
            if rounded is not None:
                x = _RoundGradient.apply(x, rounded)
            y = x + (x.to(torch_dtype(ins.dtype)).float() - x).detach()
            if ins.dtype in ("float16", "bfloat16"):
                y._rounded_to = torch_dtype(ins.dtype)
            return y
        return orig(ins, args)
    vp._eval = _eval
    try:
        yield
    finally:
        vp._eval = orig


def reference_grads(prog, xs, gouts, wrt, torch_casts=False):
    leaves = [x.double().requires_grad_(k in wrt) if x.is_floating_point() else x for k, x in enumerate(xs)]
    with contextlib.nullcontext() if torch_casts else fp32_cast_gradients():
        outs = run_program_torch(prog, leaves)
    pairs = [(outs[j], g) for j, g in gouts.items() if outs[j].requires_grad]
    if not pairs:
        return [None for _ in wrt]
    got = torch.autograd.grad([o for o, _ in pairs], [leaves[k] for k in wrt], [g.to(o.dtype) for o, g in pairs],
                              allow_unused=True)
    return list(got)          # None where no differentiable path joins the input to a graded output


def derived_grads(prog, xs, gouts, wrt, split=False):
    """The derived gradients (run with the torch interpreter, assembled as the fused op does), and for each the
    slack its lead-dim sum adds: every row's contribution is rounded to the input's dtype first, up to one
    ulp of each."""
    gp = backward_program(prog, wrt, split=split)
    outs = run_program_torch(gp.program, list(xs) + [gouts[j] for j in gp.grad_of]) if gp.program else []
    res = gradients_from(gp, outs, "cpu")
    sizes = gradients_from(gp, [o.double().abs() for o in outs], "cpu")
    slack = [ULP[go.dtype] * s.double() if go.sum_dims and s is not None else 0.0 for go, s in zip(gp.grads, sizes)]
    return gp, res, slack


def check(prog, seed=0, inner=None, ties=False, wrt=None, split=False):
    """Derived vs autograd gradients of every float input. The reference passes gradients through casts in
    fp32 (the derived program rounds them at a cast to 16 bits, as torch's casts do: within the tolerance where
    no reduction sums those roundings); ``inner`` (the narrowest dtype the program rounds to inside): compare
    with torch's own casts, which round the gradient there too, within 4 ulps of that dtype (no reduction
    may follow the cast: it would sum the rounding errors of a row)."""
    xs = make_inputs(prog, seed, ties)
    if wrt is None:
        wrt = [k for k, i in enumerate(prog.inputs) if i.dtype in ULP]
    gen = torch.Generator().manual_seed(seed + 1)
    gouts = {j: torch.randn(s, generator=gen).to(torch_dtype(o.dtype))
             for j, (o, s) in enumerate(zip(prog.outputs, prog.output_shapes())) if o.dtype in ULP}
    ref = reference_grads(prog, xs, gouts, wrt, torch_casts=inner is not None)
    gp, got, slack = derived_grads(prog, xs, gouts, wrt, split)
    for k, r, g, sl in zip(wrt, ref, got, slack):
        assert (g is None) == (r is None), (k, "no gradient (None) exactly where autograd gives none")
        if r is None:
            continue
        assert g.shape == xs[k].shape and g.dtype == xs[k].dtype, (k, g.shape, g.dtype)
        scale = r.abs().max().item() + 1e-30
        tol = TOL if inner is None else 4 * ULP[inner]
        bound = ULP[prog.inputs[k].dtype] * r.abs() + tol * scale + sl
        err = (g.double() - r).abs()
        assert bool((err <= bound).all()), (f"input {k}: worst {err.max().item():.3g} vs bound at it "
                                            f"{bound.flatten()[err.argmax()].item():.3g} (scale {scale:.3g})")
    return gp


UNARY = ["neg", "abs", "relu", "square", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sigmoid", "tanh", "silu",
         "gelu", "gelu_tanh", "sin", "cos"]
DOMAIN = {"log", "sqrt", "rsqrt", "reciprocal"}      # fed |x| + 0.5


@pytest.mark.parametrize("op", UNARY)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_unary(op, dtype):
    b = Builder((3, 5))
    x = b.input(dtype, (3, 5, 24))
    v = b.add(b.abs(x), 0.5) if op in DOMAIN else x
    b.output(b.op(op, v), dtype)
    check(b.build(), seed=UNARY.index(op))


def test_gelu_at_zero_and_tails():
    """gelu's Phi(x) = gelu(x) / x has its own value at 0 and stays accurate out in the tails."""
    b = Builder((1,))
    x = b.input("float32", (1, 9))
    b.output(b.gelu(x), "float32")
    prog = b.build()
    xs = [torch.tensor([[0.0, -0.0, 1e-6, -1e-6, 3.0, -3.0, 8.0, -8.0, -12.0]])]
    g = torch.ones(1, 9)
    ref = reference_grads(prog, xs, {0: g}, [0])[0]
    _, got, _ = derived_grads(prog, xs, {0: g}, [0])
    assert torch.allclose(got[0].double(), ref, rtol=1e-5, atol=1e-7)   # a few fp32 ulps; tails near 0


BINARY = ["add", "sub", "mul", "div", "maximum", "minimum"]


@pytest.mark.parametrize("op", BINARY + ["pow"])
@pytest.mark.parametrize("form", ["vv", "vi", "iv", "row", "col", "scalar"])
def test_binary(op, form):
    b = Builder((4, 6))
    x = b.input("float32", (4, 6, 16))
    other = {"vv": lambda: b.input("float16", (4, 6, 16)), "row": lambda: b.input("float32", (4, 6, 1)),
             "col": lambda: b.input("bfloat16", (16,)), "scalar": lambda: b.input("float32", (1,))}
    y = other[form]() if form in other else None
    if op == "pow":                     # a positive base; a tame exponent
        x = b.add(b.abs(x), 0.5)
    if op == "div" and y is not None:
        y = b.add(b.abs(y), 0.5)
    if form == "vi":
        r = b.op(op, x, 2.5 if op == "pow" else 1.75)
    elif form == "iv":
        r = b.op(op, 1.5, b.tanh(b.mul(x, 0.25)) if op == "pow" else x)
    else:
        r = b.op(op, x, b.tanh(y) if op == "pow" else y)
    b.output(r, "float32")
    check(b.build(), seed=7, ties=op in ("maximum", "minimum"))


@pytest.mark.parametrize("e", [0.0, 1.0, 2.0, 3.0, -1.5, 0.5, 1.5, -1.0, 7.0])
def test_pow_immediate_exponents(e):
    b = Builder((8,))
    x = b.input("float32", (8, 32))
    b.output(b.pow(b.add(b.abs(x), 0.25), e), "float32")
    check(b.build())


@pytest.mark.parametrize("op", ["maximum", "minimum"])
def test_max_min_ties_split_evenly(op):
    b = Builder((2,))
    x, y = b.input("float32", (2, 4)), b.input("float32", (2, 4))
    b.output(b.op(op, x, y), "float32")
    prog = b.build()
    xs = [torch.tensor([[1.0, 2.0, 3.0, 0.0]] * 2), torch.tensor([[1.0, 1.0, 4.0, 0.0]] * 2)]
    g = torch.ones(2, 4)
    _, got, _ = derived_grads(prog, xs, {0: g}, [0, 1])
    win = [1.0, 0.0] if op == "maximum" else [0.0, 1.0]
    assert got[0][0].tolist() == [0.5, win[0], win[1], 0.5]
    assert got[1][0].tolist() == [0.5, win[1], win[0], 0.5]


@pytest.mark.parametrize("kind", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("ties", [False, True])
def test_reduce(kind, ties):
    b = Builder((5, 3))
    x, w = b.input("float16", (5, 3, 40)), b.input("float32", (40,))
    r = b.reduce(b.mul(x, w), kind=kind)
    b.output(b.sub(b.mul(x, r), b.tanh(r)), "float16")
    b.output(r, "float32")
    check(b.build(), ties=ties)


def test_reduce_max_ties_share_gradient():
    b = Builder((1,))
    x = b.input("float32", (1, 5))
    b.output(b.reduce(x, kind="max"), "float32")
    prog = b.build()
    _, got, _ = derived_grads(prog, [torch.tensor([[2.0, 1.0, 2.0, 2.0, -1.0]])], {0: torch.ones(1, 1)}, [0])
    third = torch.tensor(1.0) / 3
    assert got[0].tolist() == [[third, 0.0, third, third, 0.0]]


def test_sum_broadcast_back_is_widened():
    """An input read only through a sum gets the row's gradient broadcast over its columns."""
    b = Builder((3,))
    x = b.input("bfloat16", (3, 12))
    b.output(b.reduce(x, kind="sum"), "float32")
    check(b.build())


@pytest.mark.parametrize("shape", [(4, 6, 16), (4, 6, 1), (16,), (1,), (6, 16), (4, 1, 16), (1, 6, 1), ()])
def test_broadcasts(shape):
    """Every broadcast of a second input: per-row, per-col, scalar, over outer or inner lead dims."""
    b = Builder((4, 6))
    x, y = b.input("float32", (4, 6, 16)), b.input("float32", shape)
    b.output(b.mul(b.sigmoid(b.add(x, y)), b.sub(y, b.reduce(b.mul(x, y), kind="mean"))), "float32")
    gp = check(b.build())
    lead_sums = {(4, 6, 16): (), (4, 6, 1): (), (16,): (0, 1), (1,): (0, 1), (6, 16): (0,), (4, 1, 16): (1,),
                 (1, 6, 1): (0,), (): (0, 1)}
    assert gp.grads[1].sum_dims == lead_sums[shape]


def test_where_bool_and_bit_dropout():
    b = Builder((4,))
    x, m, keep = b.input("float16", (4, 64)), b.input("bool", (4, 64)), b.input("bit", (4, 64))
    y = b.where(m, b.exp(b.tanh(x)), b.neg(x))
    b.output(b.where(keep, b.mul(y, 1.0 / 0.9), 0.0), "float16")
    check(b.build())


def test_where_row_condition_and_immediate_branches():
    b = Builder((4,))
    x, r = b.input("float32", (4, 32)), b.input("float32", (4, 1))
    c = b.gt(r, 0.0)
    b.output(b.add(b.where(c, x, 1.0), b.where(b.lt(x, 0.2), 0.5, r)), "float32")
    check(b.build())


def test_compare_logic_carry_no_gradient():
    b = Builder((4,))
    x, y = b.input("float32", (4, 8)), b.input("float32", (4, 8))
    c = b.logical_and(b.gt(x, y), b.logical_not(b.lt(y, 0.0)))
    b.output(b.cast(c, dtype="float32"), "float32")
    b.output(b.cast(b.gt(x, 0.0), dtype="bool"), "bool")
    gp = check(b.build())
    assert gp.program is None and all(g.output is None for g in gp.grads)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_casts(dtype):
    """Casts pass the gradient; a narrow cast inside rounds torch's gradient too (``inner``)."""
    b = Builder((6,))
    x = b.input(dtype, (6, 32))
    xf = b.cast(x, dtype="float32")
    mid = b.cast(b.cast(b.mul(xf, 1.3), dtype="bfloat16"), dtype="float32")
    b.output(b.cast(b.mul(b.silu(mid), xf), dtype=dtype), dtype)
    check(b.build(), inner="bfloat16")


@pytest.mark.parametrize("start,stop,step", [(0, 16, 1), (5, 20, 1), (0, 32, 2), (1, 32, 2), (3, 30, 2),
                                             (4, 31, 2), (0, 1, 1), (31, 32, 1)])
def test_slice(start, stop, step):
    b = Builder((3,))
    x = b.input("float32", (3, 32))
    s = b.slice(b.sin(x), start=start, stop=stop, step=step)
    b.output(b.mul(s, b.reduce(s, kind="sum")), "float32")
    check(b.build())


def test_slice_step_3_refused():
    b = Builder((3,))
    x = b.input("float32", (3, 32))
    b.output(b.slice(x, start=0, stop=32, step=3), "float32")
    with pytest.raises(NotDifferentiable, match=r"instruction 0 \(slice\).*step 3"):
        backward_program(b.build(), [0])


def test_cat_and_interleave_with_broadcast_parts():
    b = Builder((2, 3))
    x, r, w = b.input("float32", (2, 3, 8)), b.input("float32", (2, 3, 1)), b.input("float32", (8,))
    c = b.cat(b.exp(x), r, w, b.mul(x, r))
    i = b.interleave(b.tanh(x), w)
    b.output(b.add(b.slice(c, start=0, stop=16), i), "float32")
    check(b.build())


@pytest.mark.parametrize("base", [0.0, -2.0, -1.0, 2.0])
def test_pow_of_an_immediate_base_is_torchs_gradient(base):
    # torch's pow_backward_exponent: g·y·log(base); a base of 0 gives 0 where the exponent is >= 0 (its NaN and
    # -inf·g elsewhere), a negative base NaN everywhere (its log)
    b = Builder((3,))
    x = b.input("float32", (3, 8))
    b.output(b.pow(base, x), "float32")
    xs = [torch.tensor([[0.0, -0.0, 1.0, -1.0, 2.0, -3.0, 0.5, -0.5]] * 2 + [[float("inf"), -float("inf"),
                        float("nan"), 127.0, -149.0, 4.0, -4.0, 1.5]])]
    g = {0: torch.linspace(-2, 2, 24).reshape(3, 8)}
    (want,) = reference_grads(b.build(), xs, g, [0])
    _, (got,), _ = derived_grads(b.build(), xs, g, [0])
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    fin = want.isfinite()
    assert torch.allclose(got[fin].double(), want[fin], rtol=4 * ULP["float32"], atol=0)


def test_wrt_checks():
    b = Builder((3,))
    x, m = b.input("float32", (3, 8)), b.input("bool", (3, 8))
    b.output(b.where(m, x, 0.0), "float32")
    with pytest.raises(ProgramError, match="input 1 is bool"):
        backward_program(b.build(), [1])
    with pytest.raises(ProgramError, match="wrt"):
        backward_program(b.build(), [3])
    assert backward_program(b.build(), [True, False]).grads[0].input == 0


def test_unused_input_and_partial_wrt():
    b = Builder((3,))
    x, w, u = b.input("float32", (3, 8)), b.input("float32", (8,)), b.input("float32", (3, 8))
    b.output(b.mul(x, w), "float32")
    b.output(b.gt(u, 0.0), "bool")
    gp = backward_program(b.build(), [0, 2])
    assert gp.grad_of == (0,) and gp.grads[1].output is None
    assert not any(ins.op == "mul" and 0 in ins.args and 1 in ins.args for ins in gp.program.instrs)
    check(b.build(), wrt=[0, 2])


# ------------------------------------------------------------------------------------------ real regions
def rmsnorm(lead=(4, 8), d=64, dtype="float16"):
    b = Builder(lead)
    x, w = b.input(dtype, lead + (d,)), b.input(dtype, (d,))
    xf = b.cast(x, dtype="float32")
    r = b.rsqrt(b.add(b.reduce(b.mul(xf, xf), kind="mean"), 1e-6))
    b.output(b.mul(b.cast(b.mul(xf, r), dtype=dtype), w), dtype)
    return b.build()


def layernorm(lead=(4, 8), d=64, dtype="float32"):
    b = Builder(lead)
    x, w, bias = b.input(dtype, lead + (d,)), b.input(dtype, (d,)), b.input(dtype, (d,))
    mean = b.reduce(x, kind="mean")
    dx = b.sub(x, mean)
    rstd = b.rsqrt(b.add(b.reduce(b.mul(dx, dx), kind="mean"), 1e-5))
    b.output(b.add(b.mul(b.mul(dx, rstd), w), bias), dtype)
    return b.build()


def rope(interleaved, dtype="bfloat16", B=2, N=3, S=5, D=16):
    b = Builder((B, N, S))
    x, cos, sin = b.input(dtype, (B, N, S, D)), b.input(dtype, (S, D)), b.input(dtype, (S, D))
    if interleaved:
        rot = b.interleave(b.neg(b.slice(x, start=1, stop=D, step=2)), b.slice(x, start=0, stop=D, step=2))
    else:
        rot = b.cat(b.neg(b.slice(x, start=D // 2, stop=D)), b.slice(x, start=0, stop=D // 2))
    b.output(b.add(b.mul(x, cos), b.mul(rot, sin)), dtype)
    return b.build()


def swiglu(dtype="float16", F=48):
    b = Builder((6,))
    g = b.input(dtype, (6, 2 * F))
    b.output(b.mul(b.silu(b.slice(g, start=0, stop=F)), b.slice(g, start=F, stop=2 * F)), dtype)
    return b.build()


def gelu_tanh_bias(dtype="float16"):
    b = Builder((8,))
    x, bias = b.input(dtype, (8, 48)), b.input(dtype, (48,))
    b.output(b.gelu_tanh(b.add(x, bias)), dtype)
    return b.build()


def softmax(dtype="float32"):
    b = Builder((3, 4))
    x, mask = b.input(dtype, (3, 4, 40)), b.input("float32", (4, 40))
    z = b.add(b.mul(x, 0.125), mask)
    e = b.exp(b.sub(z, b.reduce(z, kind="max")))
    b.output(b.div(e, b.reduce(e, kind="sum")), dtype)
    return b.build()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_rmsnorm(dtype):
    # torch's casts, which round the gradient at the cast to 16 bits as the derived backward does (no reduce after)
    gp = check(rmsnorm(dtype=dtype), inner=None if dtype == "float32" else dtype)
    assert gp.grads[1].sum_dims == (0, 1) and gp.program.outputs[1].dtype == dtype
    assert gp.program.outputs[0].dtype == dtype


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_layernorm(dtype):
    check(layernorm(dtype=dtype))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rope(interleaved, dtype):
    gp = check(rope(interleaved, dtype))
    assert [g.sum_dims for g in gp.grads] == [(), (0, 1), (0, 1)]


@pytest.mark.parametrize("make", [swiglu, gelu_tanh_bias, softmax])
def test_regions(make):
    check(make())


def test_lean():
    """RMSNorm's backward: one recompute of the forward's statistics, no duplicate instruction."""
    gp = backward_program(rmsnorm(), [0, 1])
    ins = gp.program.instrs
    assert len(set(ins)) == len(ins)
    assert sum(i.op == "reduce" for i in ins) == 2          # the mean of squares; the row's sum of g·w·x
    assert sum(i.op == "rsqrt" for i in ins) == 1


@pytest.mark.parametrize("seed", range(40))
def test_random_programs(seed):
    prog = random_program(seed, lead=(4, 3), width=32, dtype=["float16", "float32", "bfloat16"][seed % 3],
                          n_ops=8, reductions=1 + seed % 2, shuffles=seed % 2 == 0)
    check(prog, seed=seed)


def log_softmax(dtype="float32", extra_output=False):
    b = Builder((3, 4))
    x = b.input(dtype, (3, 4, 40))
    d = b.sub(x, b.reduce(x, kind="max"))
    s = b.reduce(b.exp(d), kind="sum")
    b.output(b.sub(d, b.log(s)), dtype)
    if extra_output:                  # the row's sum read outside: no closed form, the chain rule throughout
        b.output(s, "float32")
    return b.build()


@pytest.mark.parametrize("make, reductions", [(softmax, 3), (log_softmax, 3)])
def test_softmax_closed_form(make, reductions):
    """Softmax's gradient is torch's closed form: the recompute's max and sum, and one sum of its own (no
    gradient through the max, which is zero but for rounding)."""
    gp = check(make())
    assert sum(i.op == "reduce" for i in gp.program.instrs) == reductions


def lse_softmax(log=False, one=1.0, dtype="float32"):
    """The softmax family's program for a logsumexp spelling: the sum of a row whose max is +inf selected as
    ``one`` (1: ``y`` is ``z − inf`` or its exp there)."""
    b = Builder((3, 4))
    x = b.input(dtype, (3, 4, 40))
    m = b.reduce(x, kind="max")
    d = b.sub(x, m)
    e = b.exp(d)
    s = b.where(b.eq(m, float("inf")), one, b.reduce(e, kind="sum"))
    b.output(b.sub(d, b.log(s)) if log else b.div(e, s), dtype)
    return b.build()


@pytest.mark.parametrize("log", [False, True])
def test_lse_selected_sum_keeps_the_closed_form(log):
    """``where(max == +inf, 1, Σ)`` is still a softmax: the closed form (three reductions), whose value on a
    +inf row is eager's gradient of ``z − logsumexp(z)`` (g at finite scores, NaN at +inf) or of its exp
    (NaN over the row). Another immediate than 1 is no softmax: the chain rule."""
    gp = check(lse_softmax(log))
    assert sum(i.op == "reduce" for i in gp.program.instrs) == 3
    assert sum(i.op == "reduce" for i in check(lse_softmax(log, one=2.0)).program.instrs) > 3
    x = torch.randn(3, 4, 40, dtype=torch.float64)
    x[0, 1, 5] = float("inf")
    xl = x.clone().requires_grad_()
    want = xl - torch.logsumexp(xl, -1, keepdim=True)
    want = want if log else want.exp()
    g = torch.randn(3, 4, 40, dtype=torch.float64)
    want.backward(g)
    got = derived_grads(lse_softmax(log), [x.float()], {0: g.float()}, [0], False)[1][0]
    assert torch.equal(got.isnan(), xl.grad.isnan())
    fin = xl.grad.isfinite()
    torch.testing.assert_close(got.double()[fin], xl.grad[fin], rtol=1e-5, atol=1e-5)


def test_softmax_read_inside_takes_the_chain_rule():
    gp = check(log_softmax(extra_output=True))
    assert sum(i.op == "reduce" for i in gp.program.instrs) > 3


def test_split_slices_into_parts():
    """split: an input read through disjoint step-1 slices gets one output per slice, no cat; columns no slice
    reads get zeros. Overlapping slices are not split."""
    gp = check(swiglu(), split=True)
    assert gp.grads[0].parts == ((0, 0, 48), (1, 48, 96)) and gp.grads[0].output is None
    assert not any(i.op == "cat" for i in gp.program.instrs)
    b = Builder((2, 3))
    x, w = b.input("float16", (2, 3, 32)), b.input("float32", (1, 3, 32))
    b.output(b.mul(b.exp(b.slice(x, start=2, stop=10)), b.slice(w, start=12, stop=20)), "float16")
    gp = check(b.build(), split=True)
    assert [g.parts for g in gp.grads] == [((0, 2, 10),), ((1, 12, 20),)] and gp.grads[1].sum_dims == (0,)
    b = Builder((4,))
    x = b.input("float32", (4, 32))
    b.output(b.mul(b.slice(x, start=0, stop=16), b.slice(x, start=8, stop=24)), "float32")
    gp = check(b.build(), split=True)
    assert gp.grads[0].parts == () and any(i.op == "cat" for i in gp.program.instrs)
