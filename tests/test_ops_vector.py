"""torch.ops.autofuse.vector_program / matmul_epilogue: outputs, fake tensors, launches recorded, autograd
against eager chains (float64), the torch twins."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import autofuse.ops_vector as ov
from autofuse.ops import recording
from cost_model.program import Builder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import vector_chains as vc  # noqa: E402
from cost_model_accuracy import epilogue  # noqa: E402


def built(fn, args):
    b, gm = vc.build(fn, [tuple(a.shape) for a in args], args[0].dtype)
    return b.program, vc.input_values(b, gm, args)


def grads64(fn, args, g_out):
    leaves = [a.detach().double().requires_grad_() for a in args]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(list(out), [g.double() for g in g_out])
    return [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fn, shapes", [(vc.rms_norm, [(4, 8, 64), (64,)]), (vc.add_rms_norm, [(12, 32), (12, 32), (32,)]),
                                        (vc.swiglu, [(10, 48), (10, 48)])], ids=["rms", "add_rms", "swiglu"])
def test_op_values_launches_and_gradients(fn, shapes, dtype):
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    prog, ins = built(fn, args)
    leaves = [x.detach().clone().requires_grad_() for x in ins]
    with recording() as log:
        outs = ov.vector_program(leaves, prog)
    assert [k for k, _ in log] == ["vector_program"] and log[0][1].cycles > 0
    eager = fn(*args)
    eager = eager if isinstance(eager, tuple) else (eager,)
    twin = ov.reference_vector_program(ins, prog)
    for o, e, t in zip(outs, eager, twin):
        assert o.dtype == e.dtype and o.shape == e.shape
        # fp32: the same steps as eager (exp/rsqrt implementations apart); fp16: eager rounds each step
        tol = 1e-5 if dtype == torch.float32 else 4e-3
        torch.testing.assert_close(o.float(), e.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(o.float(), t.float(), rtol=tol, atol=tol)
    g_out = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
    torch.autograd.backward(list(outs), g_out)
    want = grads64(fn, args, g_out)
    for leaf, w in zip(leaves, want):
        # the backward is the program differentiated in fp32 (inputs and output gradients as given, the
        # result rounded to the input's dtype): fp32 rounding, or one rounding of the fp16 gradient
        tol = 1e-4 if dtype == torch.float32 else 2 ** -9
        assert (leaf.grad.double() - w).abs().max() <= tol * w.abs().max() + 1e-5


def test_fake_shapes_and_dtypes():
    b = Builder((4, 8))
    x = b.input("bfloat16", (4, 8, 64))
    r = b.reduce(x, kind="max")
    b.output(b.sub(x, r), "float32")
    b.output(r, "bfloat16")
    b.output(b.gt(x, 0.0), "bool")
    p = b.build()
    with FakeTensorMode():
        x_ = torch.empty(4, 8, 64, dtype=torch.bfloat16)
        outs = torch.ops.autofuse.vector_program([x_], p.to_json(), "ascend910", "")
        assert [(tuple(o.shape), o.dtype) for o in outs] == [((4, 8, 64), torch.float32), ((4, 8, 1), torch.bfloat16),
                                                            ((4, 8, 64), torch.bool)]
        a, w = torch.empty(32, 16, dtype=torch.float16), torch.empty(16, 96, dtype=torch.float16)
        pe, _ = epilogue("swiglu", 32, 96)
        (o,) = torch.ops.autofuse.matmul_epilogue(a, w, None, [], pe.to_json(), False, "ascend910b", "")
        assert tuple(o.shape) == (32, 48) and o.dtype == torch.float16


def test_opcheck():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(6, 32, generator=g), torch.randn(32, generator=g)
    prog, ins = built(vc.rms_norm, [x, w])
    torch.library.opcheck(torch.ops.autofuse.vector_program.default, ([t.requires_grad_() for t in ins],
                                                                      prog.to_json(), "ascend910", ""))


@pytest.mark.parametrize("kind, product", [("gelu", "float16"), ("swiglu", "float16"), ("residual", "float32")])
def test_matmul_epilogue_op_and_gradients(kind, product):
    M, K, N = 24, 32, 64
    g = torch.Generator().manual_seed(2)
    p, extra_specs = epilogue(kind, M, N, dtype="float16", product=product)
    a = (torch.randn(M, K, generator=g) / 4).half().requires_grad_()
    b = (torch.randn(K, N, generator=g) / 4).half().requires_grad_()
    extra = [torch.randn(s, generator=g).to(getattr(torch, d)).requires_grad_() for s, d in extra_specs]
    with recording() as log:
        (out,) = ov.matmul_epilogue(a, b, p, extra, device="ascend910b")
    assert [k for k, _ in log] == ["matmul_epilogue"]
    (twin,) = ov.reference_matmul_epilogue(a.detach(), b.detach(), None, [e.detach() for e in extra], p)
    torch.testing.assert_close(out.float(), twin.float(), rtol=2 ** -9, atol=1e-4)   # K order of fp32 sums
    gout = torch.randn(out.shape, generator=g).half()
    out.backward(gout)

    def eager(a_, b_, *ex):
        prod = a_ @ b_
        if kind == "gelu":
            return F.gelu(prod)
        if kind == "swiglu":
            return F.silu(prod[:, : N // 2]) * prod[:, N // 2:]
        return prod * ex[1] + ex[0]
    want = grads64(eager, [a, b] + extra, [gout])
    for leaf, w in zip([a, b] + extra, want):
        # fp32 recompute of an fp16-rounded product (straight-through), gradients rounded to fp16
        assert (leaf.grad.double() - w).abs().max() <= 2 ** -8 * w.abs().max() + 1e-4


def test_epilogue_program_from_aten_nodes():
    """The region after a matmul node, built with the matmul as input 0, runs as matmul_epilogue and equals
    eager (fp16 product, as eager's matmul rounds it)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from autofuse.vector_program import program_from_nodes

    def mlp(x, w_gate_up, r):
        gu = x @ w_gate_up
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up + r

    g = torch.Generator().manual_seed(4)
    x, w, r = (torch.randn(32, 64, generator=g) / 4).half(), (torch.randn(64, 96, generator=g) / 4).half(), \
        torch.randn(32, 48, generator=g).half()
    gm = make_fx(mlp)(x, w, r)
    mm = next(n for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target))
    region = [n for n in gm.graph.nodes if n.op == "call_function" and n is not mm]
    b = program_from_nodes(region, first=mm)
    assert b.inputs[0] is mm and len(b.program.inputs) == 2
    (out,) = ov.matmul_epilogue(x, w, b.program, [r], device="ascend910")
    torch.testing.assert_close(out.float(), mlp(x.float(), w.float(), r.float()).half().float(),
                               rtol=2 ** -8, atol=2 ** -8)   # eager fp16 rounds between its ops
