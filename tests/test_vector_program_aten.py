"""The aten -> Vector program builder and the torch interpreter: the mapping, near misses it must refuse,
views, rounding modes."""
import pytest
import torch
import torch.nn.functional as F

from autofuse.vector_program import NotExpressible, program_from_function, run_program_torch


def meta(*shapes, dtype=torch.float16):
    return [torch.empty(s, dtype=dtype, device="meta") for s in shapes]


def ops(fn, *shapes, **kw):
    b, _ = program_from_function(fn, meta(*shapes), **kw)
    return [i.op + (f":{i.kind}" if i.kind else "") for i in b.program.instrs], b


def test_mapping_of_common_ops():
    names, b = ops(lambda x, w: torch.clamp(F.gelu(x, approximate="tanh") * w + 1.0, min=-2.0).rsqrt(), (8, 32), (32,))
    assert names == ["gelu_tanh", "mul", "add", "maximum:clamp", "rsqrt"]
    names, _ = ops(lambda x: torch.softmax(x, -1), (4, 16))
    assert names == ["reduce:max", "sub", "exp", "reduce:sum", "div"]
    names, _ = ops(lambda x: (x > 0).logical_and(x < 1).to(torch.float16) - x.sin(), (4, 16))
    assert names == ["gt", "lt", "logical_and", "cast", "sin", "sub"]


def test_output_shapes_and_inputs():
    _, b = ops(lambda x, w: (x * w).sum(-1), (3, 5, 64), (64,))
    assert b.output_shapes == [(3, 5)] and b.program.output_shapes() == [(3, 5, 1)]
    _, b = ops(lambda x, r: (x + r, (x + r).mean(-1, keepdim=True)), (6, 40), (6, 40))
    assert [n.name for n in b.inputs] == ["x_1", "r_1"] and len(b.program.outputs) == 2


@pytest.mark.parametrize("fn, shapes, why", [
    (lambda x: x.sum(0), [(4, 16)], "not the last dim"),
    (lambda x: torch.softmax(x, 0), [(4, 16)], "not the last dim"),
    (lambda x: x.sum((0, 1)), [(4, 16)], "more than the last dim"),
    (lambda x: x.transpose(0, 1).exp(), [(4, 16)], "no Vector-program instruction"),
    (lambda x: x[:2].exp(), [(4, 16)], "other than the last"),
    (lambda x: x.reshape(4, 8, 2).exp().reshape(4, 16), [(4, 16)], "changes the rows or the last dim"),
    (lambda x: x.cumsum(-1), [(4, 16)], "no Vector-program instruction"),
    (lambda x: x.to(torch.int32), [(4, 16)], "only casts"),
    # a stack the program does not flatten into pairs, read by a reduction or an elementwise op
    (lambda x: torch.stack([x, x * 2], -1).sum(-1), [(4, 16)], "does not hold as one value"),
    (lambda x: torch.stack([x, x.exp()], -1).exp(), [(4, 16)], "does not hold as one value"),
])
def test_near_misses_are_refused(fn, shapes, why):
    with pytest.raises(NotExpressible, match=why):
        program_from_function(fn, meta(*shapes))


def test_views_and_broadcasts():
    def fn(x, cos):
        return x * cos.unsqueeze(1) + x.view(6, 32).view(2, 3, 32)
    _, b = ops(fn, (2, 3, 32), (2, 32))
    names = [n.name for n in b.inputs]
    assert "unsqueeze" in names                                 # a view of an input stays outside the op
    assert b.program.inputs[names.index("unsqueeze")].shape == (2, 1, 32)
    i = names.index("view")                                     # rows grouped as [6, 32]: viewed [2, 3, 32]
    assert b.input_shapes[i] == (2, 3, 32)
    with pytest.raises(NotExpressible, match="changes the rows or the last dim"):
        program_from_function(lambda x: x.exp().view(2, 3, 4, 8).view(2, 3, 32), meta((2, 3, 32)))


def test_rounding_modes_and_interpreter():
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(8, 64, generator=g).half() for _ in range(2))

    def fn(x, y):
        return (x * y + y).exp() * 0.25

    fp32, _ = program_from_function(fn, (x, y))
    eager, _ = program_from_function(fn, (x, y), rounding="eager")
    assert sum(i.op == "cast" for i in eager.program.instrs) == 4 and \
        not any(i.op == "cast" for i in fp32.program.instrs)
    ref = fn(x.double(), y.double())
    e = fn(x, y)
    (a,) = run_program_torch(fp32.program, [x, y])
    (b,) = run_program_torch(eager.program, [x, y])
    assert torch.equal(b, e)                                    # eager's rounding, step by step
    assert (a.double() - ref).abs().max() <= (e.double() - ref).abs().max()   # fewer roundings: closer


def test_first_input_and_missing_one():
    def fn(x, w, r):
        return F.silu(x @ w) + r
    from torch.fx.experimental.proxy_tensor import make_fx
    from autofuse.vector_program import program_from_nodes
    gm = make_fx(fn)(*[torch.randn(s) for s in ((8, 16), (16, 32), (8, 32))])
    mm = next(n for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target))
    region = [n for n in gm.graph.nodes if n.op == "call_function" and n is not mm]
    assert program_from_nodes(region, first=mm).inputs[0] is mm
    with pytest.raises(NotExpressible, match="not an input"):
        program_from_nodes(region[1:], first=mm)


def test_mapping_of_activations():
    # the formulas eager's CPU kernels compute (see _Build.activation); make_fx writes logsigmoid as
    # log_sigmoid_forward (output, buffer), its buffer unread
    assert ops(lambda x: torch.erf(x) + torch.log1p(x) * torch.expm1(x), (4, 16))[0] == \
        ["erf", "log1p", "expm1", "mul", "add"]
    assert ops(lambda x: F.softplus(x), (4, 16))[0] == ["softplus"]
    assert ops(lambda x: F.softplus(x, 2.0, 5.0), (4, 16))[0] == ["mul", "softplus", "div", "gt", "where"]
    assert ops(lambda x: F.mish(x), (4, 16))[0] == ["softplus", "tanh", "mul"]
    assert ops(lambda x: F.logsigmoid(x), (4, 16))[0] == ["neg", "softplus", "neg"]
    assert ops(lambda x: F.leaky_relu(x, 0.2), (4, 16))[0] == ["gt", "mul", "where"]
    assert ops(lambda x: F.selu(x), (4, 16))[0] == ["minimum:clamp", "expm1", "mul", "le", "mul", "where"]
    assert ops(lambda x: F.celu(x, 2.0), (4, 16))[0] == ["mul", "minimum:clamp", "expm1", "mul", "le", "where"]
    assert ops(lambda x: F.relu6(x), (4, 16))[0] == ["maximum:hardtanh", "minimum:hardtanh"]
    assert ops(lambda x: F.hardswish(x), (4, 16))[0] == ["add", "maximum:open", "minimum:open", "mul", "div"]


@pytest.mark.parametrize("fn", [lambda x: F.logsigmoid(x), lambda x: F.selu(x), lambda x: F.hardswish(x),
                                lambda x: F.softplus(x, 0.5, 3.0)])
def test_activation_programs_compute_eagers_values(fn):
    x = torch.cat([torch.randn(4, 64) * 5, torch.tensor([[0.0, 3.0, -3.0, 6.0, 6.1, 1.5, 1.6, -1e-7] * 8])])
    b, _ = program_from_function(fn, (x,))
    (got,) = run_program_torch(b.program, [x])
    # fp32: torch's own log1p/expm1 inside the twin, torch's formulas: an ulp or two
    assert torch.allclose(got, fn(x), rtol=2.5e-7, atol=0)


def test_mapping_of_roundings_sign_nan_to_num_and_logs():
    # the roundings and sign are instructions; frac, round(decimals), nan_to_num, log2/log10 their formulas;
    # exp2 and a number to a tensor the pow instruction with an immediate base
    f32 = dict(dtype=torch.float32)
    b, _ = program_from_function(lambda x: (torch.floor(x), torch.ceil(x), torch.trunc(x), torch.round(x),
                                            torch.sign(x)), meta((4, 16), **f32))
    assert [i.op for i in b.program.instrs] == ["floor", "ceil", "trunc", "round", "sign"]
    assert [i.op for i in program_from_function(torch.frac, meta((4, 16), **f32))[0].program.instrs] == \
        ["trunc", "sub"]
    assert [i.op for i in program_from_function(lambda x: torch.round(x, decimals=2), meta((4, 16), **f32))[0]
            .program.instrs] == ["mul", "round", "div"]
    assert [i.op for i in program_from_function(lambda x: torch.round(x, decimals=-1), meta((4, 16), **f32))[0]
            .program.instrs] == ["div", "round", "mul"]
    names, b = ops(torch.nan_to_num, (4, 16))                   # float16: its own largest and smallest values
    assert names == ["eq", "where", "eq", "where", "ne", "where"]
    assert [i.args[1] for i in b.program.instrs if i.op == "where"] == [-65504.0, 65504.0, 0.0]
    names, b = ops(lambda x: torch.nan_to_num(x, posinf=1e5), (4, 16))
    assert b.program.instrs[3].args[1] == float("inf")          # 1e5 as float16 holds it, as eager stores it
    assert ops(torch.log2, (4, 16))[0] == ["log", "div"]
    for fn in (torch.exp2, lambda x: 2 ** x, lambda x: torch.pow(2.0, x)):
        names, b = ops(fn, (4, 16))
        assert names == ["pow"] and b.program.instrs[0].args[0] == 2.0


def test_a_rounding_reads_a_16_bit_operand_as_eager_holds_it():
    # floor(x · 2.7) in float16: eager rounds the product to float16 before the floor; the program too (a cast),
    # so a product just below an integer that rounds up to it floors as eager's
    names, _ = ops(lambda x: torch.floor(x * 2.7), (4, 16))
    assert names == ["mul", "cast", "floor"]
    b, _ = program_from_function(lambda x: torch.floor(x * 2.7), meta((4, 16), dtype=torch.float32))
    assert [i.op for i in b.program.instrs] == ["mul", "floor"]             # float32: nothing to round
    assert ops(lambda x: torch.floor(x), (4, 16))[0] == ["floor"]        # an input holds its values already
    # each product below an integer in fp32 that rounds up to it in float16 (0.37036 · 2.7 = 0.99998 -> 1.0)
    x = torch.tensor([[0.370361328125, 0.74072265625, 1.4814453125, 1.8515625, 2.962890625, 3.703125, 5.5546875,
                       -0.5]], dtype=torch.float16)
    fn = lambda t: torch.floor(t * 2.7)                                   # noqa: E731
    b, _ = program_from_function(fn, (x,))
    (got,) = run_program_torch(b.program, [x])
    assert torch.equal(got, fn(x))


def test_a_16_bit_value_an_op_widens_is_read_as_eager_stored_it():
    """``sigmoid(x16) + b32``: eager stores the sigmoid in 16 bits and the add widens that rounded value; the program
    rounds it there too (one cast), so sums of tied scores tie as eager's, bit for bit. A compare in fp32 of a
    16-bit value reads it rounded too. An explicit ``.float()`` and ops that keep the 16-bit dtype stay in fp32."""
    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float16):
        x, bias = (torch.randn(64, 16, generator=g) * 3).to(dt), torch.randn(16, generator=g) * 1e-3
        for fn in (lambda x, b: x.sigmoid() + b, lambda x, b: (x.exp() * 0.5 > b).float(),
                   lambda x, b: torch.where(x.sigmoid() > 0.5, x.sigmoid(), b)):
            built, _ = program_from_function(fn, (x, bias))
            assert [i.dtype for i in built.program.instrs if i.op == "cast"][:1] == [str(dt)[6:]]
            (got,) = run_program_torch(built.program, [x, bias])
            assert torch.equal(got, fn(x, bias))
    x = torch.randn(8, 16).bfloat16()
    # RoPE's rotate_half of a 16-bit input, widened by an fp32 table (autocast): exact in bf16 already, no cast
    for fn in (lambda x, b: x.sigmoid().float() + b, lambda x, b: x.sigmoid() * x,
               lambda x, b: torch.cat([-x[..., 8:], x[..., :8]], -1) * b):
        built, _ = program_from_function(fn, (x, torch.randn(16)))
        assert not [i for i in built.program.instrs if i.op == "cast" and i.dtype != "float32"]


def test_mapping_of_the_2_norm():
    # the root of the squares' sum, of kind root (its gradient 0 at a zero row, as torch's); keepdim or not; F.normalize
    # reads it through clamp_min and an expand to the row's width (a broadcast)
    assert ops(lambda x: x.norm(dim=-1, keepdim=True), (4, 16))[0] == ["mul", "reduce:sum", "sqrt:root"]
    names, b = ops(lambda x: torch.linalg.vector_norm(x, dim=-1), (4, 16))
    assert names == ["mul", "reduce:sum", "sqrt:root"] and b.output_shapes == [(4,)]
    assert ops(lambda x: F.normalize(x, dim=-1), (4, 16))[0] == ["mul", "reduce:sum", "sqrt:root", "maximum:clamp",
                                                                   "div"]
    for fn, why in ((lambda x: x.norm(p=1, dim=-1), "order 1"), (lambda x: x.norm(dim=0), "not the last dim"),
                    (lambda x: torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32), "dtype")):
        with pytest.raises(NotExpressible, match=why):
            program_from_function(fn, meta((4, 16)))


def test_the_norms_twin_gives_torchs_gradient_at_a_zero_row():
    x = torch.randn(3, 16, dtype=torch.float64)
    x[1] = 0.0
    b, _ = program_from_function(lambda t: F.normalize(t, dim=-1), meta((3, 16), dtype=torch.float32))
    leaf = x.float().requires_grad_()
    (y,) = run_program_torch(b.program, [leaf])
    y.backward(torch.ones_like(y))
    want = x.clone().requires_grad_()
    F.normalize(want, dim=-1).backward(torch.ones_like(want))
    assert bool(leaf.grad.isfinite().all())
    assert torch.allclose(leaf.grad.double(), want.grad, rtol=1e-5, atol=1e-5)    # 1e12 on the zero row


def test_mapping_of_prelu():
    # x > 0 ? x : w · x, the slopes read as a program input. make_fx writes prelu as the slopes viewed along dim 1
    # and _prelu_kernel: per column for a 2-D input, per row along a lead dim for a 3-D one
    names, b = ops(lambda x, w: F.prelu(x, w), (4, 16), (16,))
    assert names == ["gt", "mul", "where"] and b.program.inputs[1].shape == (1, 16)
    names, b = ops(lambda x, w: F.prelu(x, w), (3, 4, 16), (4,))
    assert names == ["gt", "mul", "where"] and b.program.inputs[1].shape == (1, 4, 1)
    # aten.prelu as captured (torch.export): its slopes along dim 1 are the row's only for a 2-D input
    from autofuse.capture import capture
    from autofuse.vector_program import program_from_nodes

    class M(torch.nn.Module):
        def __init__(self, c):
            super().__init__()
            self.p = torch.nn.PReLU(c)

        def forward(self, x):
            return self.p(x)
    for shape, c, ok in (((4, 16), 16, True), ((3, 4, 16), 1, True), ((3, 4, 16), 4, False)):
        gm = capture(M(c), (torch.randn(shape),)).graph_module
        (n,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.prelu.default]
        if ok:
            assert [i.op for i in program_from_nodes([n], [n]).program.instrs] == ["gt", "mul", "where"]
        else:
            with pytest.raises(NotExpressible, match="along dim 1"):
                program_from_nodes([n], [n])
