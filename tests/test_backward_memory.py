"""What a generated Vector kernel keeps for its backward: the inputs its derived backward reads and no other, and in
a training plan the values that hold fewer bytes than those inputs (a minimum cut of the program's dataflow), stored
by the forward kernel as outputs of its own. LayerNorm over a sum of embeddings keeps the sum, as eager does, not
the three terms; the gradients are those of recomputing from the inputs, bit for bit."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.fused_vector import kept_values, with_saved
from autofuse.ops_vector import matmul_epilogue, vector_program
from autofuse.vector_program import run_program_torch
from autofuse.verify import compare
from cost_model.program import Builder, ProgramError, as_program
from cost_model.program_grad import backward_program, backward_reads
from tests.cost_model.test_program_grad import rmsnorm, rope
from tests.test_checkpointing import saved_bytes


def _layer_norm_of_sum(dtype="float32", lead=(2, 16), width=64):
    """``layer_norm(a + b + c) * w + bias``; b broadcast along the batch (a position embedding)."""
    b = Builder(lead)
    x, y = b.input(dtype, lead + (width,)), b.input(dtype, (1,) + lead[1:] + (width,))
    z = b.input(dtype, lead + (width,))
    w, bias = b.input(dtype, (width,)), b.input(dtype, (width,))
    s = b.add(b.add(x, y), z)
    d = b.sub(s, b.reduce(s, kind="mean"))
    r = b.rsqrt(b.add(b.reduce(b.mul(d, d), kind="mean"), 1e-5))
    b.output(b.add(b.mul(b.mul(d, r), w), bias), dtype)
    return b.build()


def test_the_backward_reads_the_values_its_rules_read_and_recomputes_the_rest():
    prog = _layer_norm_of_sum()
    reads = backward_reads(prog, range(5))
    assert 3 in reads                                        # the weight, read by its own gradient
    assert not {0, 1, 2} & set(reads)                        # the terms only through their sum
    assert all(v >= len(prog.inputs) for v in reads if v != 3)


def test_a_minimum_cut_keeps_the_sum_in_place_of_its_terms_and_the_inputs_where_they_are_cheaper():
    prog = _layer_norm_of_sum()
    keep = kept_values(prog, free={3, 4})                    # the weight and bias: parameters, held anyway
    values = [v for v in keep if v >= len(prog.inputs)]
    # one tensor for three: the sum a + b + c or its centred value (as many bytes), and the weight, free
    assert len(values) == 1 and prog.values[values[0]].width == 64 and set(keep) - set(values) <= {3, 4}, keep
    assert kept_values(rmsnorm(dtype="float32"), free={1}) == (0, 1)      # RMSNorm: its input (and weight)
    assert kept_values(rmsnorm(dtype="bfloat16"), free={1}) == (0, 1)    # the fp32 upcast costs twice the input
    # near miss: terms that are held anyway (inputs of the model) cost nothing: nothing is stored for them
    assert all(v < len(prog.inputs) for v in kept_values(prog, free={0, 1, 2, 3, 4}))


def test_a_saved_output_must_hold_its_value_exactly():
    prog, saved = with_saved(_layer_norm_of_sum("bfloat16"), (3, 6))
    assert saved == (1,) and prog.outputs[1].dtype == "float32"       # stored in its own dtype: fp32
    b = Builder((4,))
    x = b.input("float32", (4, 8))
    b.output(b.exp(x), "bfloat16")                             # rounded: not the value itself
    with pytest.raises(ProgramError, match="saved output 0"):
        backward_program(b.build(), [0], saved=(0,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_backward_reading_saved_values_gives_the_recomputed_gradients_bit_for_bit(dtype):
    name = str(dtype).replace("torch.", "")
    prog = _layer_norm_of_sum(name)
    stored, saved = with_saved(prog, kept_values(prog, free={3, 4}))
    gen = torch.Generator().manual_seed(0)
    shapes = [tuple(i.shape) for i in prog.inputs]
    ins = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]
    g = torch.randn((2, 16, 64), generator=gen).to(dtype)

    def grads(program, saved_):
        for t in ins:
            t.grad = None
        out = vector_program(ins, program, saved=saved_)
        out[0].backward(g)
        return out[0].detach(), [t.grad.clone() for t in ins]

    want = grads(prog, ())
    got = grads(stored, saved)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b), (a - b).abs().max()


def _split(width=48, part=16):
    """A fused projection's columns split three ways (q, k, v), each scaled."""
    b = Builder((4, 8))
    x = b.input("float32", (4, 8, width))
    for i, c in enumerate((2.0, 3.0, 4.0)):
        b.output(b.mul(b.slice(x, start=i * part, stop=(i + 1) * part), c), "float32")
    return b.build()


@pytest.mark.parametrize("make", [lambda: rope(False, "float32"), lambda: rope(True, "float32"), _split],
                         ids=["rope", "rope_interleaved", "qkv_split"])
def test_a_slice_backward_shapes_its_zeros_from_the_gradient_not_the_input(make):
    """RoPE's rotation and a q/k/v split are linear in their input: their backward reads no forward value of it
    (the zeros around a slice's gradient are shaped from that gradient), so the input is not kept."""
    prog = make()
    assert 0 not in backward_reads(prog, [0])
    gen = torch.Generator().manual_seed(0)
    ins = [torch.randn(tuple(i.shape), generator=gen).requires_grad_(k == 0) for k, i in enumerate(prog.inputs)]
    outs, nbytes = saved_bytes(lambda: vector_program(ins, prog), exclude=ins[1:])
    assert nbytes == 0
    gs = [torch.randn(o.shape, generator=gen) for o in outs]
    got, = torch.autograd.grad(outs, [ins[0]], gs)
    x = ins[0].detach().requires_grad_()
    want, = torch.autograd.grad(run_program_torch(prog, [x] + ins[1:]), [x], gs)    # torch's own autograd
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)     # fp32 both: summation order apart


def test_an_op_keeps_only_the_inputs_its_backward_reads():
    """A residual add's backward reads nothing; ``silu(gate) * up`` reads both; an epilogue's residual is not kept
    (eager's add keeps nothing either)."""
    b = Builder((8,))
    x, r = b.input("float32", (8, 32)), b.input("float32", (8, 32))
    b.output(b.add(x, r), "float32")
    add = b.build()
    xs = [torch.randn(8, 32, requires_grad=True) for _ in range(2)]
    _, nbytes = saved_bytes(lambda: vector_program(xs, add))
    assert nbytes == 0
    b = Builder((8,))
    gate, up = b.input("float32", (8, 32)), b.input("float32", (8, 32))
    b.output(b.mul(b.silu(gate), up), "float32")
    _, nbytes = saved_bytes(lambda: vector_program(xs, b.build()))
    assert nbytes == 2 * 8 * 32 * 4
    b = Builder((8,))
    p, res = b.input("float32", (8, 32)), b.input("float32", (8, 32))
    b.output(b.add(p, res), "float32")
    a, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    out, nbytes = saved_bytes(lambda: matmul_epilogue(a, w, b.build(), extra=[xs[1]]), exclude=(w,))
    assert nbytes == a.numel() * 4                           # a, for w's gradient; the residual not
    out[0].sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(8, 32) @ w.detach().t())
    torch.testing.assert_close(xs[1].grad, torch.ones(8, 32))


class Embeddings(nn.Module):
    """BERT's embeddings: word, position and token type embeddings summed, then LayerNorm."""

    def __init__(self, vocab=50, seq=16, hidden=64):
        super().__init__()
        self.word, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.kinds = nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, ids, types):
        pos = torch.arange(ids.shape[1], device=ids.device)[None]
        return self.head(self.norm(self.word(ids) + self.pos(pos) + self.kinds(types)))


def _inputs():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (2, 16), generator=gen), torch.randint(0, 2, (2, 16), generator=gen)


def test_a_training_plan_keeps_eagers_bytes_for_layer_norm_over_embeddings():
    torch.manual_seed(0)
    model = Embeddings().train()
    ids, types = _inputs()
    fused = AutoFusionEngine.fuse(model, (ids, types))
    calls = [n for n in fused.graph_module.graph.nodes if n.target == torch.ops.autofuse.vector_program.default]
    assert len(calls) == 1 and calls[0].kwargs.get("saved") == "[1]", [n.kwargs for n in calls]
    params = list(model.parameters())
    _, kept_fused = saved_bytes(lambda: fused(ids, types), exclude=params + [ids, types])
    _, kept_eager = saved_bytes(lambda: model(ids, types), exclude=params + [ids, types])
    assert kept_fused <= kept_eager, (kept_fused, kept_eager)
    # near miss: a plan for the model in eval mode (inference) stores nothing more
    inference = AutoFusionEngine.fuse(copy.deepcopy(model).eval(), (ids, types))
    calls = [n for n in inference.graph_module.graph.nodes if n.target == torch.ops.autofuse.vector_program.default]
    assert [n.kwargs.get("saved") for n in calls] == [None]


def test_the_training_plan_prices_the_store_of_what_it_keeps():
    torch.manual_seed(0)
    model = Embeddings().train()
    ids, types = _inputs()
    trained = AutoFusionEngine.fuse(model, (ids, types))
    inference = AutoFusionEngine.fuse(copy.deepcopy(model).eval(), (ids, types))
    price = lambda f: next(d for d in f.report.applied if "layer_norm" in d.pattern)     # noqa: E731
    # one more fp32 [2, 16, 64] store: the sum
    assert price(trained).hbm_bytes_fused - price(inference).hbm_bytes_fused == 2 * 16 * 64 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gradients_through_the_kept_sum_are_within_eagers_error_in_each_dtype(dtype):
    """Against float64: the fused gradients' error at most twice eager's (the verifier's rule, autofuse.verify)."""
    torch.manual_seed(0)
    model = Embeddings().train().to(dtype)
    ids, types = _inputs()
    fused = AutoFusionEngine.fuse(model, (ids, types))
    assert any(n.kwargs.get("saved") for n in fused.graph_module.graph.nodes), fused.report.summary()

    def grads(fn, m):
        m.zero_grad()
        out = fn(ids, types)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
        (out * w).sum().backward()
        return [p.grad.clone() for p in m.parameters()]

    got, want = grads(fused, model), grads(model, model)
    ref_model = copy.deepcopy(model).double()
    ref = grads(ref_model, ref_model)
    for g, w, r in zip(got, want, ref):
        ok, err, tol = compare(w, r, g)
        assert ok, (dtype, err, tol)
    F.mse_loss(fused(ids, types).float(), torch.zeros(2, 16, 64)).backward()      # a second step runs as well


class MLP(nn.Module):
    """``fc2(act(fc1(x)))``: fc1 and its activation fuse as a matmul epilogue."""

    def __init__(self, act, d=32):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _epilogue_calls(fused):
    return [n for n in fused.graph_module.graph.nodes if n.target == torch.ops.autofuse.matmul_epilogue.default]


def _outputs_of(call):
    return as_program(call.args[4]).outputs


def test_a_relu_epilogue_keeps_its_output_not_its_product():
    """ReLU's backward reads its result, which the kernel stores anyway: kept in place of the product (OPT's
    fc1), so the kernel stores nothing more and keeps what eager keeps."""
    torch.manual_seed(0)
    model = MLP(F.relu).train()
    x = torch.randn(2, 8, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    call, = _epilogue_calls(fused)
    assert call.kwargs.get("saved") == "[0]" and len(_outputs_of(call)) == 1, call.kwargs
    exclude = list(model.parameters()) + [x]
    _, kept_fused = saved_bytes(lambda: fused(x), exclude)
    _, kept_eager = saved_bytes(lambda: model(x), exclude)
    assert kept_fused <= kept_eager, (kept_fused, kept_eager)


def test_near_miss_a_gelu_epilogue_keeps_its_product():
    """GELU's backward reads its input: the product, stored by the kernel as one more output (as before); and its
    output, which fc2 keeps for its own backward: read, not recomputed."""
    torch.manual_seed(0)
    fused = AutoFusionEngine.fuse(MLP(F.gelu).train(), (torch.randn(2, 8, 32),))
    call, = _epilogue_calls(fused)
    outputs = _outputs_of(call)
    assert len(outputs) == 2 and outputs[1].value == 0 and call.kwargs.get("saved") == "[0]", call.kwargs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gradients_through_a_kept_output_are_within_eagers_error_in_each_dtype(dtype):
    torch.manual_seed(0)
    model = MLP(F.relu).train().to(dtype)
    x = torch.randn(2, 8, 32).to(dtype).requires_grad_()
    fused = AutoFusionEngine.fuse(model, (x,))

    def grads(fn, m, x_):
        m.zero_grad()
        x_.grad = None
        out = fn(x_)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
        (out * w).sum().backward()
        return [p.grad.clone() for p in m.parameters()] + [x_.grad.clone()]

    got, want = grads(fused, model, x), grads(model, model, x)
    ref_model = copy.deepcopy(model).double()
    ref = grads(ref_model, ref_model, x.detach().double().requires_grad_())
    for g, w, r in zip(got, want, ref):
        ok, err, tol = compare(w, r, g)
        assert ok, (dtype, err, tol)


class MaskedExp(nn.Module):
    """Mamba2's decay: ``exp(where(mask, x, -inf))``, read by a matmul (which keeps it for its own backward)."""

    def forward(self, x, v):
        mask = torch.ones(x.shape[-2:], dtype=torch.bool).tril()
        return torch.exp(x.masked_fill(~mask, float("-inf"))) @ v


def test_a_region_whose_output_a_matmul_keeps_keeps_that_output_not_its_input():
    """exp's backward reads its result: the region's output, which the matmul keeps anyway, not its input (which
    nothing else keeps): the fused forward keeps what eager keeps."""
    torch.manual_seed(0)
    model = MaskedExp().train()
    x, v = torch.randn(2, 16, 16, requires_grad=True), torch.randn(2, 16, 8, requires_grad=True)
    fused = AutoFusionEngine.fuse(model, (x, v))
    calls = [n for n in fused.graph_module.graph.nodes if n.target == torch.ops.autofuse.vector_program.default]
    assert [n.kwargs.get("saved") for n in calls] == ["[0]"], fused.report.summary()
    _, kept_fused = saved_bytes(lambda: fused(x, v), exclude=(x, v))
    _, kept_eager = saved_bytes(lambda: model(x, v), exclude=(x, v))
    assert kept_fused <= kept_eager, (kept_fused, kept_eager)
    got = torch.autograd.grad(fused(x, v).sum(), [x, v])
    want = torch.autograd.grad(model(x, v).sum(), [x, v])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)     # fp32 both: exp's rounding apart
