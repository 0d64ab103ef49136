"""Backwards of the fused MoE ops as fused launches: the gradients equal eager autograd of the unfused chain
(within the verifier's bound around a float64 reference), across dtypes, layouts, epilogues, empty experts and
uneven loads; and a simulated training step of a tiny Mixtral runs them as grouped launches."""
import collections
import copy

import pytest
import torch
import torch.nn.functional as F

from autofuse import ops_moe
from autofuse.verify import compare

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LOADS = [[5, 0, 9, 3], [0, 0, 16, 0], [1, 1, 1, 1, 12]]      # uneven, empty experts, one-row groups


def _unfused_gmm(x, w, counts, bias, trans_w, act, order="gate_up"):
    """What eager runs: one GEMM per expert, + bias, the activation op by op (SwiGLU: chunk, silu, mul);
    rows past the last group are zero."""
    parts, s = [], 0
    for g, c in enumerate(counts):
        y = x[s:s + c] @ (w[g].t() if trans_w else w[g])
        if bias is not None:
            y = y + bias[g].to(y.dtype)
        if act == "swiglu":
            a, u = y.chunk(2, -1)
            y = F.silu(a) * u if order == "gate_up" else F.silu(u) * a
        elif act == "gelu":
            y = F.gelu(y)
        parts.append(y)
        s += c
    n = parts[0].shape[1]
    return torch.cat(parts + [x.new_zeros(x.shape[0] - s, n)])


def _grads(fn, leaves, g):
    ls = [t.detach().requires_grad_(True) for t in leaves]
    return torch.autograd.grad(fn(*ls), ls, g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [None, "swiglu", "gelu"])
@pytest.mark.parametrize("load", range(len(LOADS)))
def test_grouped_matmul_gradients_equal_eager(dtype, act, load):
    torch.manual_seed(load)
    counts = LOADS[load]
    E, K, N = len(counts), 24, 32
    M = sum(counts) + 2                                              # rows past the last group
    trans_w = load % 2 == 0
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(E, N, K) if trans_w else torch.randn(E, K, N)).mul(0.3).to(dtype)
    bias = torch.randn(E, N).to(dtype) if act != "gelu" else None
    gl = torch.tensor(counts)
    leaves = [x, w] + ([bias] if bias is not None else [])
    out_n = N // 2 if act == "swiglu" else N
    g = torch.randn(M, out_n).to(dtype)

    def fused(x, w, b=None):
        return ops_moe.grouped_matmul(x, w, gl, b, trans_w=trans_w, activation=act)

    def eager(x, w, b=None):
        return _unfused_gmm(x, w, counts, b, trans_w, act)

    got = _grads(fused, leaves, g)
    want = _grads(eager, leaves, g)
    ref = _grads(eager, [t.double() for t in leaves], g.double())
    for name, gg, ww, rr in zip(("dx", "dw", "dbias"), got, want, ref):
        assert gg.dtype == ww.dtype and gg.shape == ww.shape, name
        ok, err, tol = compare(ww, rr, gg)
        assert ok, (name, err, tol)
    if counts[1] == 0:
        assert (got[1][1] == 0).all()                                 # an empty expert's weight: no gradient


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("load", range(len(LOADS)))
def test_stored_product_gives_the_recompute_paths_gradients(dtype, act, load):
    """grouped_matmul_with_product: the output grouped_matmul gives, the product the backward would recompute
    (so the same gradients, bit for bit), and a backward that launches no product GEMM."""
    from autofuse import ops
    torch.manual_seed(10 + load)
    counts = LOADS[load]
    E, K, N = len(counts), 24, 32
    M = sum(counts) + 2
    trans_w = load % 2 == 0
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(E, N, K) if trans_w else torch.randn(E, K, N)).mul(0.3).to(dtype)
    bias = torch.randn(E, N).to(dtype) if act == "swiglu" else None
    gl = torch.tensor(counts)
    leaves = [x, w] + ([bias] if bias is not None else [])
    g = torch.randn(M, N // 2 if act == "swiglu" else N).to(dtype)
    y, prod = ops_moe.grouped_matmul_with_product(x, w, gl, bias, trans_w=trans_w, activation=act)
    assert torch.equal(y, ops_moe.grouped_matmul(x, w, gl, bias, trans_w=trans_w, activation=act))
    assert torch.equal(prod, ops_moe.grouped_matmul(x, w, gl, bias, trans_w=trans_w))
    twin_y, twin_p = ops_moe.reference_grouped_matmul_with_product(x, w, gl, bias, trans_w=trans_w, activation=act)
    assert torch.equal(twin_p, ops_moe.reference_grouped_matmul(x, w, gl, bias, trans_w=trans_w))
    with ops.recording() as stored:
        got = _grads(lambda *t: ops_moe.grouped_matmul_with_product(t[0], t[1], gl, *t[2:], trans_w=trans_w,
                                                                    activation=act)[0], leaves, g)
    with ops.recording() as recomputed:
        want = _grads(lambda *t: ops_moe.grouped_matmul(t[0], t[1], gl, *t[2:], trans_w=trans_w, activation=act),
                      leaves, g)
    for gg, ww in zip(got, want):
        assert torch.equal(gg, ww)
    launches = collections.Counter(name for name, _ in stored)
    # the forward and dx: two grouped GEMMs (the recompute path runs a third for the product)
    assert launches["grouped_matmul"] == 2
    assert collections.Counter(name for name, _ in recomputed)["grouped_matmul"] == 3
    assert launches["vector_program"] == 1                     # the epilogue's derivative, on the stored product


def test_gradient_through_the_stored_product():
    """A graph that also uses the product: its gradient adds to the epilogue's, as eager autograd gives."""
    torch.manual_seed(3)
    counts, E, K, N = [6, 0, 9], 3, 16, 32
    x, w = torch.randn(15, K), torch.randn(E, K, N) * 0.3
    gl = torch.tensor(counts)
    gy, gp = torch.randn(15, N // 2), torch.randn(15, N)

    def eager(x, w):
        p = _unfused_gmm(x, w, counts, None, False, None)
        a, u = p.chunk(2, -1)
        return F.silu(a) * u, p

    got = _grads(lambda x, w: ops_moe.grouped_matmul_with_product(x, w, gl, activation="swiglu"), [x, w], (gy, gp))
    want = _grads(eager, [x, w], (gy, gp))
    ref = _grads(eager, [x.double(), w.double()], (gy.double(), gp.double()))
    for name, gg, ww, rr in zip(("dx", "dw"), got, want, ref):
        ok, err, tol = compare(ww, rr, gg)
        assert ok, (name, err, tol)
    # near miss: without the product's gradient the result is off
    only_y = _grads(lambda x, w: eager(x, w)[0], [x.double(), w.double()], gy.double())
    assert not compare(want[0], ref[0], only_y[0].float())[0]


def test_with_product_fake_and_errors():
    with torch._subclasses.FakeTensorMode():
        y, p = torch.ops.autofuse.grouped_matmul_with_product(torch.empty(20, 16), torch.empty(3, 96, 16),
                                                              torch.empty(3, dtype=torch.int64), None, True)
    assert y.shape == (20, 48) and p.shape == (20, 96)
    with pytest.raises(ValueError, match="needs an activation"):
        ops_moe.grouped_matmul_with_product(torch.randn(8, 16), torch.randn(2, 16, 8), torch.tensor([4, 4]),
                                            activation=None)


def test_weight_grad_op_twin_and_fake():
    torch.manual_seed(0)
    lhs, rhs, gl = torch.randn(20, 16).half(), torch.randn(20, 24).half(), torch.tensor([0, 12, 8])
    got = ops_moe.grouped_matmul_weight_grad(lhs, rhs, gl)
    twin = ops_moe.reference_grouped_matmul_weight_grad(lhs, rhs, gl)
    # the same fp32 sums of the same products in another order, one rounding to fp16 each: one ulp apart
    assert (got.float() - twin.float()).abs().max().item() <= 2.0 ** -10 * twin.float().abs().max().item()
    with torch._subclasses.FakeTensorMode():
        f = torch.ops.autofuse.grouped_matmul_weight_grad(torch.empty(20, 16), torch.empty(20, 24),
                                                          torch.empty(3, dtype=torch.int64), "count", "float32")
    assert f.shape == (3, 16, 24) and f.dtype == torch.float32


tf = pytest.importorskip("transformers")


def _mixtral_step(layers=1):
    from autofuse import AutoFusionEngine
    from autofuse.simulate import simulate_graph
    torch.manual_seed(0)
    cfg = tf.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=32)
    model = tf.MixtralForCausalLM(cfg).train()
    model.set_experts_implementation("grouped_mm")
    ids = torch.randint(0, 64, (1, 12))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    plan = fused.plans[next(iter(fused.plans))]
    leaves = plan.captured.flatten_inputs(ids, use_cache=False)
    return model, ids, simulate_graph(plan.graph_module, leaves, backward=True), plan.graph_module


def test_training_step_runs_the_experts_backward_as_grouped_launches():
    layers = 2
    _, _, res, gm = _mixtral_step(layers)
    # a training plan: gate_up's launch stores its product (the down projection has no epilogue to undo)
    fused = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    assert fused["autofuse.grouped_matmul_with_product.default"] == layers
    assert fused["autofuse.grouped_matmul.default"] == layers
    fwd = collections.Counter(n.target for n in res.nodes if n.phase == "forward")
    assert fwd["autofuse.grouped_matmul_with_product"] == layers
    bwd = collections.Counter(n.target for n in res.nodes if n.phase == "backward")
    # per layer: dx of both projections (2 grouped_matmul; no product recompute), dw of both (2)
    assert bwd["autofuse.grouped_matmul"] == 2 * layers
    assert bwd["autofuse.grouped_matmul_weight_grad"] == 2 * layers
    # no GEMM of the experts' backward runs as an aten op
    assert not [n for n in res.nodes if n.phase == "backward" and "grouped_mm" in n.target]


def test_training_step_gradients_equal_eager():
    """Every parameter's gradient from the fused step (the experts' from the grouped launches) against eager
    autograd, around a float64 run of the same model."""
    model, ids, res, _ = _mixtral_step()
    names = [name for name, _ in res.joint.params]
    grads = dict(zip(names, res.outputs[len(res.outputs) - len(names):]))
    ref_model = copy.deepcopy(model).double()
    ref_model.set_experts_implementation("batched_mm")        # the same math; grouped_mm has no float64 kernel
    g_out = res.joint.arguments([ids])[-1]                     # the logits' gradient the step was given
    for m in (model, ref_model):
        m.zero_grad()
        logits = m(ids, use_cache=False).logits
        logits.backward(g_out.to(logits.dtype))
    eager, ref = dict(model.named_parameters()), dict(ref_model.named_parameters())
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"} <= set(grads)
    for name, got in grads.items():
        ok, err, tol = compare(eager[name].grad, ref[name].grad, got)
        assert ok, (name, err, tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,k,E", [(7, 2, 4), (16, 3, 8), (5, 1, 2)])
def test_init_routing_gradient_is_one_finalize_launch(dtype, T, k, E):
    from autofuse import ops
    torch.manual_seed(T)
    x = torch.randn(T, 24).to(dtype)
    idx = torch.randint(0, E // 2, (T, k))                  # uneven: half the experts get every row
    g = torch.randn(T * k, 24).to(dtype)

    def eager(x):
        flat = idx.reshape(-1)
        perm = torch.sort(flat, stable=True).indices
        return x[perm // k]

    with ops.recording() as log:
        got, = _grads(lambda x: ops_moe.moe_init_routing(x, idx, E)[0], [x], g)
    assert [name for name, _ in log] == ["moe_init_routing", "moe_finalize_routing"]
    want, = _grads(eager, [x], g)
    ref, = _grads(eager, [x.double()], g.double())
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)
