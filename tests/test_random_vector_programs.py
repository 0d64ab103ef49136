"""Property tests (hypothesis): random programs of Vector ops, with the matmuls, softmaxes and scans around them
that end regions, fused by generic fusion (``vector_chain``, ``matmul_epilogue`` and the named families) must equal
eager: forward without grad, forward and gradients with grad, training mode with dropout (the same keep-masks),
and through ``torch.compile``.

A program is a list of steps, each an op on earlier values (the inputs ``x`` and ``y``, then each step's result):
elementwise unary and binary ops with broadcasts, casts, reductions over the last dim or over the tokens, norms,
halves of the last dim (SwiGLU's, a rotation's), stacks, slices written in place, views that regroup rows or
transpose, and matmuls. Inputs come plain, broadcast, transposed in memory, strided or in another dtype; the model
returns its last value and a few intermediate ones (a region then has several outputs, and a plan made with grad
cuts at a returned value that a region reads again).

"Equal eager" is the verifier's bound (:func:`autofuse.verify.compare`: at most twice eager's own error against
float64 plus one rounding of the output's dtype); an output cast up to float32 at the end of a 16-bit program gets the
rounding of the program's dtype, the precision its values were computed in. With grad, the programs draw no op whose
derivative jumps (``relu``, ``clamp``, ``abs``, ``where``, ``maximum``, ``amax``...): there a one-ulp difference in
the forward (the fused program rounds a 16-bit value once, eager after every op) puts an element on the other side of
the kink, and the gradient there differs by the jump, which no bound on rounding error covers (without grad these ops
are drawn: the fused program reads a rounding or a compare's operand as eager holds it).

The default run draws a few programs per mode (derandomized: the same ones every run); ``python -m pytest -m slow
tests/test_random_vector_programs.py`` draws 300 per mode.
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

import autofuse  # noqa: E402
from autofuse import AutoFusionEngine  # noqa: E402
from autofuse.backend import reports  # noqa: E402
from autofuse.verify import compare, floor  # noqa: E402

FAST = drawn(10)
SLOW = drawn(300)

# op name -> (shape rule, function of (module, a, b, c, x)); shape rules: "same" (a's shape), "bin" (a and b
# broadcast), "tri" (a, b and c), "full" (a full-shape operand: the mask x > 0.3 broadcasts over it), "even" (a's
# last dim even and rows full: halves), "half" (the same, returns half the width), "row" (a keepdim reduction over
# the last dim), "col" (over the tokens), "width_d" (the last dim is the model's D: a norm's weight, a matmul)
OPS = {
    "neg": ("same", lambda m, a, b, c, x: -a),
    "exp": ("same", lambda m, a, b, c, x: torch.exp(a.clamp(max=20))),
    "sigmoid": ("same", lambda m, a, b, c, x: torch.sigmoid(a)),
    "tanh": ("same", lambda m, a, b, c, x: torch.tanh(a)),
    "silu": ("same", lambda m, a, b, c, x: F.silu(a)),
    "gelu": ("same", lambda m, a, b, c, x: F.gelu(a)),
    "gelu_tanh": ("same", lambda m, a, b, c, x: F.gelu(a, approximate="tanh")),
    "sin": ("same", lambda m, a, b, c, x: a.sin()),
    "cos": ("same", lambda m, a, b, c, x: a.cos()),
    "square": ("same", lambda m, a, b, c, x: a * a),
    "pow2": ("same", lambda m, a, b, c, x: a ** 2),
    "erf": ("same", lambda m, a, b, c, x: torch.erf(a)),
    "softplus": ("same", lambda m, a, b, c, x: F.softplus(a)),
    "mish": ("same", lambda m, a, b, c, x: F.mish(a)),
    "elu": ("same", lambda m, a, b, c, x: F.elu(a)),
    "selu": ("same", lambda m, a, b, c, x: F.selu(a)),
    "logsigmoid": ("same", lambda m, a, b, c, x: F.logsigmoid(a)),
    "scale": ("same", lambda m, a, b, c, x: a * 0.5),
    "shift": ("same", lambda m, a, b, c, x: a + 1.0),
    "rsqrt": ("same", lambda m, a, b, c, x: torch.rsqrt(a * a + 1)),
    "float": ("same", lambda m, a, b, c, x: a.float()),
    "to_dtype": ("same", lambda m, a, b, c, x: a.to(m.w.dtype)),
    "regroup_rows": ("same", lambda m, a, b, c, x: a.reshape(-1, a.shape[-1]).reshape(a.shape)),
    "in_place": ("same", lambda m, a, b, c, x: a.clone().mul_(1.5).add_(0.25)),
    "detach_add": ("same", lambda m, a, b, c, x: a + a.detach() * 0.5),
    "centre": ("same", lambda m, a, b, c, x: a - a.mean(-1).unsqueeze(-1)),
    "dropout": ("same", lambda m, a, b, c, x: F.dropout(a, 0.25, m.training)),
    "cumsum": ("same", lambda m, a, b, c, x: a.cumsum(-1)),                   # not a Vector op: ends regions
    "log_softmax": ("same", lambda m, a, b, c, x: torch.log_softmax(a, -1)),
    "transposed": ("same", lambda m, a, b, c, x: (a.transpose(1, 2) * 2.0).transpose(1, 2)),
    "add": ("bin", lambda m, a, b, c, x: a + b),
    "sub": ("bin", lambda m, a, b, c, x: a - b),
    "mul": ("bin", lambda m, a, b, c, x: a * b),
    "add_alpha": ("bin", lambda m, a, b, c, x: torch.add(a, b, alpha=-2.0)),
    "rsub": ("bin", lambda m, a, b, c, x: 1.0 - a * b),
    "div": ("bin", lambda m, a, b, c, x: a / (b * b + 1)),
    "addcmul": ("tri", lambda m, a, b, c, x: torch.addcmul(a, b, c, value=0.5)),
    "lerp": ("full", lambda m, a, b, c, x: torch.lerp(a, b.to(a.dtype), 0.3)),
    "rotate": ("even", lambda m, a, b, c, x: torch.cat([-a[..., a.shape[-1] // 2:], a[..., :a.shape[-1] // 2]], -1)),
    "stack_sum": ("even", lambda m, a, b, c, x: torch.stack([a, a * 2], -1).sum(-1)),
    "swiglu": ("half", lambda m, a, b, c, x: F.silu(a.chunk(2, -1)[0]) * a.chunk(2, -1)[1]),
    "geglu": ("half", lambda m, a, b, c, x: F.gelu(a.chunk(2, -1)[0], approximate="tanh") * a.chunk(2, -1)[1]),
    "sum": ("row", lambda m, a, b, c, x: a.sum(-1, keepdim=True)),
    "mean": ("row", lambda m, a, b, c, x: a.mean(-1, keepdim=True)),
    "var": ("row", lambda m, a, b, c, x: a.var(-1, keepdim=True)),
    "std": ("row", lambda m, a, b, c, x: a.std(-1, keepdim=True) + 0.1),
    "norm": ("row", lambda m, a, b, c, x: a.norm(dim=-1, keepdim=True) + 0.1),
    "sum_tokens": ("col", lambda m, a, b, c, x: a.sum(1, keepdim=True)),
    "layer_norm": ("width_d", lambda m, a, b, c, x: F.layer_norm(a, a.shape[-1:], m.w.to(a.dtype), m.b.to(a.dtype))),
    "rms_norm": ("width_d", lambda m, a, b, c, x: (a.float() * torch.rsqrt(a.float().pow(2).mean(-1, keepdim=True)
                                                                           + 1e-6)).to(a.dtype) * m.w.to(a.dtype)),
    "rms_norm_op": ("width_d", lambda m, a, b, c, x: F.rms_norm(a, a.shape[-1:], m.w.to(a.dtype), 1e-5)),
    "normalize": ("same", lambda m, a, b, c, x: F.normalize(a, dim=-1)),
    "softmax": ("same", lambda m, a, b, c, x: torch.softmax(a, -1)),
    "linear": ("width_d", lambda m, a, b, c, x: F.linear(a, m.W.to(a.dtype))),
    "linear_bias": ("width_d", lambda m, a, b, c, x: F.linear(a, m.W.to(a.dtype), m.bias.to(a.dtype))),
    # derivatives that jump (drawn without grad only, see the module docstring)
    "abs": ("same", lambda m, a, b, c, x: a.abs()),
    "relu": ("same", lambda m, a, b, c, x: F.relu(a)),
    "relu6": ("same", lambda m, a, b, c, x: F.relu6(a)),
    "leaky_relu": ("same", lambda m, a, b, c, x: F.leaky_relu(a, 0.1)),
    "hardswish": ("same", lambda m, a, b, c, x: F.hardswish(a)),
    "hardsigmoid": ("same", lambda m, a, b, c, x: F.hardsigmoid(a)),
    "clamp": ("same", lambda m, a, b, c, x: a.clamp(-2, 2)),
    "floor": ("same", lambda m, a, b, c, x: torch.floor(a)),
    "sign": ("same", lambda m, a, b, c, x: torch.sign(a)),
    "step": ("same", lambda m, a, b, c, x: (a > 0).to(a.dtype) * a),
    "sqrt_abs": ("same", lambda m, a, b, c, x: (a.abs() + 0.5).sqrt()),
    "slice_set": ("same", lambda m, a, b, c, x: _slice_set(a)),
    "amax": ("row", lambda m, a, b, c, x: a.amax(-1, keepdim=True)),
    "amin": ("row", lambda m, a, b, c, x: a.amin(-1, keepdim=True)),
    "max_tokens": ("col", lambda m, a, b, c, x: a.amax(1, keepdim=True)),
    "maximum": ("bin", lambda m, a, b, c, x: torch.maximum(a, b)),
    "minimum": ("bin", lambda m, a, b, c, x: torch.minimum(a, b)),
    "where": ("full", lambda m, a, b, c, x: torch.where(x > 0.3, a, b)),
    "where_scalar": ("full", lambda m, a, b, c, x: torch.where(x > 0.3, a, 0.0)),
    "masked_fill": ("full", lambda m, a, b, c, x: a.masked_fill(x > 0.3, -1.0)),
}
KINKED = ("abs", "relu", "relu6", "leaky_relu", "hardswish", "hardsigmoid", "clamp", "floor", "sign", "step",
          "sqrt_abs", "slice_set", "amax", "amin", "max_tokens", "maximum", "minimum", "where", "where_scalar",
          "masked_fill")
SMOOTH = [name for name in OPS if name not in KINKED and name != "dropout"]
LAYOUTS = ("plain", "broadcast_y", "transposed_y", "y_float32", "strided_x")


def _slice_set(a):
    out = a.clone()
    out[..., :2] = 0.0
    return out


@dataclass(frozen=True)
class Program:
    mode: str               # no_grad | grad | train | compile
    dtype: torch.dtype
    B: int
    S: int
    D: int
    layout: str
    steps: tuple            # (op, a, b, c): op of values a, b, c (indices of earlier values)
    returned: tuple         # the indices of intermediate values returned after the last one


def _broadcast(s, t):
    return all(p == q or p == 1 or q == 1 for p, q in zip(s, t))


def _joined(*shapes):
    return tuple(max(d) for d in zip(*shapes))


@st.composite
def programs(draw, mode):
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    B, S, D = draw(st.sampled_from([1, 2])), draw(st.sampled_from([3, 8])), draw(st.sampled_from([16, 32, 48]))
    full = (B, S, D)
    names = (SMOOTH + (["dropout"] if mode == "train" else [])) if mode != "no_grad" else \
        [n for n in OPS if n != "dropout"]
    shapes, steps = [full, full], []
    for _ in range(draw(st.integers(2, 12))):
        last = len(shapes) - 1
        a = draw(st.one_of(st.just(last), st.integers(0, last)))
        op = draw(st.sampled_from(names))
        rule, sa = OPS[op][0], shapes[a]
        ok = [j for j, s in enumerate(shapes) if _broadcast(s, sa)]
        b, c = draw(st.sampled_from(ok)), draw(st.sampled_from(ok))
        if rule == "full" and (sa != full or shapes[b] != full):
            op, rule = "add", "bin"
        if rule == "tri" and not _broadcast(shapes[c], _joined(sa, shapes[b])):
            op, rule = "mul", "bin"
        if rule in ("even", "half") and (sa[-1] % 2 or sa[-1] < 4 or sa[1] != S):
            op, rule = "sigmoid", "same"
        if rule == "width_d" and sa[-1] != D:
            op, rule = "softmax", "same"
        if op in ("transposed", "sum_tokens", "max_tokens") and sa[1] != S:
            op, rule = "tanh", "same"
        if op in ("cumsum", "var", "std") and sa[-1] == 1:
            op, rule = "neg", "same"
        shape = {"bin": lambda: _joined(sa, shapes[b]), "tri": lambda: _joined(sa, shapes[b], shapes[c]),
                 "half": lambda: sa[:-1] + (sa[-1] // 2,), "row": lambda: sa[:-1] + (1,),
                 "col": lambda: (sa[0], 1, sa[2])}.get(rule, lambda: sa)()
        steps.append((op, a, b, c))
        shapes.append(shape)
    returned = tuple(sorted(draw(st.sets(st.integers(2, len(shapes) - 2), max_size=2)))) if len(shapes) > 3 else ()
    return Program(mode, dtype, B, S, D, draw(st.sampled_from(LAYOUTS)), tuple(steps), returned)


class Model(nn.Module):
    def __init__(self, p: Program):
        super().__init__()
        self.p = p
        g = torch.Generator().manual_seed(len(p.steps))
        self.w = nn.Parameter((torch.randn(p.D, generator=g) * 0.5 + 1).to(p.dtype))
        self.b = nn.Parameter((torch.randn(p.D, generator=g) * 0.1).to(p.dtype))
        self.W = nn.Parameter((torch.randn(p.D, p.D, generator=g) / p.D ** 0.5).to(p.dtype))
        self.bias = nn.Parameter((torch.randn(p.D, generator=g) * 0.1).to(p.dtype))

    def forward(self, x, y):
        values = [x, y]
        for op, a, b, c in self.p.steps:
            values.append(OPS[op][1](self, values[a], values[b], values[c], x))
        return (values[-1],) + tuple(values[i] for i in self.p.returned)


def _inputs(p: Program):
    g = torch.Generator().manual_seed(p.B * 100 + p.S * 10 + len(p.steps))
    x = torch.randn(p.B, p.S, p.D, generator=g).to(p.dtype)
    y = torch.randn(p.B, p.S, p.D, generator=g).to(p.dtype)
    if p.layout == "broadcast_y":
        y = y[:1, :1].expand(p.B, p.S, p.D)
    elif p.layout == "transposed_y":
        y = y.transpose(1, 2).contiguous().transpose(1, 2)
    elif p.layout == "y_float32":
        y = y.float()
    elif p.layout == "strided_x":
        x = torch.randn(p.B, p.S, 2 * p.D, generator=g).to(p.dtype)[..., ::2]
    return x, y


def _run(fn, params, inputs, grad, seed):
    """Outputs, then (with grad) the inputs' and the parameters' gradients of a random weighting of the outputs."""
    xs = [t.detach().clone().requires_grad_(grad) for t in inputs]
    torch.manual_seed(seed)                         # dropout's keep-masks: the same draws for each run
    with torch.set_grad_enabled(grad):
        outs = fn(*xs)
    if not grad:
        return list(outs)
    g = torch.Generator().manual_seed(seed + 1)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in outs
               if o.requires_grad)
    for q in params:
        q.grad = None
    if isinstance(loss, torch.Tensor):
        loss.backward()
    got = [o.detach() for o in outs] + [t.grad for t in xs] + [q.grad for q in params]
    for q in params:
        q.grad = None
    return got


def _check(p: Program):
    model = Model(p).train(p.mode == "train")
    ref = copy.deepcopy(model).double()
    inputs = _inputs(p)
    grad = p.mode != "no_grad"
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore")     # e.g. the report's note on a value returned and read again
        if p.mode == "compile":
            torch._dynamo.reset()
            fused = torch.compile(model, backend=autofuse.backend())
        else:
            fused = AutoFusionEngine.fuse(model, inputs)
    got = _run(fused, list(model.parameters()), inputs, grad, 7)
    want = _run(model, list(model.parameters()), inputs, grad, 7)
    exact = _run(ref, list(ref.parameters()), [t.double() for t in inputs], grad, 7)
    if p.mode == "compile":
        assert reports(fused), "torch.compile did not hand a graph to the autofuse backend"
    for i, (w, r, f) in enumerate(zip(want, exact, got)):
        if w is None:
            assert f is None, f"value {i}: eager has no gradient there, the fused model has one"
            continue
        assert f is not None, f"value {i}: the fused model has no gradient where eager has one"
        assert (f.dtype, f.shape) == (w.dtype, w.shape), f"value {i}: {f.dtype} {list(f.shape)}, eager's " \
                                                         f"{w.dtype} {list(w.shape)}"
        ok, err, tol = compare(w, r, f)
        if not ok and w.dtype != p.dtype and w.is_floating_point():
            # a 16-bit program's value cast up at the end: one rounding of the dtype it was computed in
            tol = 2 * (w.double() - r).abs().max().item() + floor(p.dtype) * max(1.0, r.abs().max().item())
            ok = err <= tol
        assert ok, f"value {i} (outputs, then input and parameter gradients): error {err:.3g} > bound {tol:.3g}"


MODES = ["no_grad", "grad", "train", "compile"]     # train: dropout's keep-masks; compile: through torch.compile


@pytest.mark.parametrize("mode", MODES)
@FAST
@given(data=st.data())
def test_random_programs_equal_eager(mode, data):
    _check(data.draw(programs(mode)))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@SLOW
@given(data=st.data())
def test_random_programs_equal_eager_300_per_mode(mode, data):
    _check(data.draw(programs(mode)))
