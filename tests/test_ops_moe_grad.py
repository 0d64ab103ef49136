"""Backwards of the fused MoE ops as fused launches: the gradients equal eager autograd of the unfused chain
(within the verifier's bound around a float64 reference), across dtypes, layouts, epilogues, empty experts,
uneven loads, repeated rows and every router variant; and a simulated training step of a tiny Mixtral runs them
as fused launches."""
import collections
import copy

import pytest
import torch
import torch.nn.functional as F

from autofuse import ops_moe
from autofuse.verify import compare
from conftest import assert_same_product

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
        elif act == "clamped_swiglu":          # GPT-OSS: interleaved pairs, clamped
            a, u = y[..., ::2].clamp(max=7.0), y[..., 1::2].clamp(-7.0, 7.0)
            y = (u + 1) * (a * torch.sigmoid(a * 1.702))
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
@pytest.mark.parametrize("stored", [False, True])
def test_clamped_swiglu_on_interleaved_pairs_gradients_equal_eager(dtype, stored):
    """GPT-OSS's experts epilogue: the derived Vector backward of the clamped SwiGLU on interleaved pairs (zero
    gradient where a clamp bites), from the recomputed or the stored product."""
    torch.manual_seed(7)
    counts = LOADS[0]
    E, K, N = len(counts), 24, 32
    M = sum(counts) + 2
    x = (torch.randn(M, K) * 3).to(dtype)                             # products beyond the clamp limit too
    w, bias = torch.randn(E, K, N).mul(0.5).to(dtype), torch.randn(E, N).to(dtype)
    gl = torch.tensor(counts)
    g = torch.randn(M, N // 2).to(dtype)
    op = ops_moe.grouped_matmul_with_product if stored else ops_moe.grouped_matmul

    def fused(x, w, b):
        y = op(x, w, gl, b, activation="clamped_swiglu", swiglu_order="interleaved", limit=7.0, alpha=1.702)
        return y[0] if stored else y

    def eager(x, w, b):
        return _unfused_gmm(x, w, counts, b, False, "clamped_swiglu")

    product = _unfused_gmm(x.double(), w.double(), counts, bias.double(), False, None)
    assert (product[..., ::2] > 7).any() and (product[..., 1::2].abs() > 7).any()     # both clamps bite
    got, want = _grads(fused, [x, w, bias], g), _grads(eager, [x, w, bias], g)
    ref = _grads(eager, [t.double() for t in (x, w, bias)], g.double())
    for name, gg, ww, rr in zip(("dx", "dw", "dbias"), got, want, ref):
        assert gg.dtype == ww.dtype and gg.shape == ww.shape, name
        ok, err, tol = compare(ww, rr, gg)
        assert ok, (name, err, tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["swiglu", "gelu"])
@pytest.mark.parametrize("load", range(len(LOADS)))
def test_stored_product_gives_the_recompute_paths_gradients(dtype, act, load):
    """grouped_matmul_with_product: the output grouped_matmul gives, the product the backward would recompute (up
    to the order of its fp32 sums, which the simulator's BLAS picks per GEMM shape and CPU: assert_same_product),
    gradients within the verifier's bound of eager's (bit for bit the recompute path's wherever the two products'
    bits agree), and a backward that launches no product GEMM."""
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
    recomputed_product = ops_moe.grouped_matmul(x, w, gl, bias, trans_w=trans_w)
    magnitude = _unfused_gmm(x.double().abs(), w.double().abs(), counts,
                             None if bias is None else bias.double().abs(), trans_w, None)
    assert_same_product(prod, recomputed_product, magnitude, K)
    twin_y, twin_p = ops_moe.reference_grouped_matmul_with_product(x, w, gl, bias, trans_w=trans_w, activation=act)
    assert torch.equal(twin_p, ops_moe.reference_grouped_matmul(x, w, gl, bias, trans_w=trans_w))
    with ops.recording() as stored:
        got = _grads(lambda *t: ops_moe.grouped_matmul_with_product(t[0], t[1], gl, *t[2:], trans_w=trans_w,
                                                                    activation=act)[0], leaves, g)
    with ops.recording() as recomputed:
        want = _grads(lambda *t: ops_moe.grouped_matmul(t[0], t[1], gl, *t[2:], trans_w=trans_w, activation=act),
                      leaves, g)

    def eager(x, w, b=None):
        return _unfused_gmm(x, w, counts, b, trans_w, act)

    eager_g, ref = _grads(eager, leaves, g), _grads(eager, [t.double() for t in leaves], g.double())
    for name, gg, ww, ee, rr in zip(("dx", "dw", "dbias"), got, want, eager_g, ref):
        ok, err, tol = compare(ee, rr, gg)
        assert ok, (name, err, tol)
        if torch.equal(prod, recomputed_product):
            assert torch.equal(gg, ww), name
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


# ------------------------------------------------------------------------------------------ finalize, gating
def _eager_finalize(expanded, scales, ridx, skip=None):
    """What eager runs (transformers' combine): gather the rows, weight them in their dtype, sum over k."""
    T, k = scales.shape
    out = (expanded[ridx].reshape(T, k, -1) * scales.to(expanded.dtype)[:, :, None]).sum(1)
    return out + skip if skip is not None else out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("case", ["uneven", "repeats", "skip"])
def test_finalize_routing_gradients_equal_eager(dtype, k, case):
    """d_expanded, d_scales (and d_skip) from one moe_finalize_routing_grad launch vs eager autograd, around
    float64: rows from moe_init_routing with skewed experts, rows named twice (and never), a skip input."""
    from autofuse import ops
    torch.manual_seed(k)
    T, H, E = 13, 40, 4
    if case == "repeats":
        R = T * k + 3
        ridx = torch.randint(0, R - 3, (T * k,))                    # repeated rows, the last 3 never named
    else:
        ids = torch.randint(0, E // 2 if case == "uneven" else E, (T, k))     # uneven: half the experts
        _, ridx, _ = ops_moe.moe_init_routing(torch.randn(T, H), ids, E)
        R = T * k
    expanded = torch.randn(R, H).to(dtype)
    scales = torch.rand(T, k)
    skip = torch.randn(T, H).to(dtype) if case == "skip" else None
    g = torch.randn(T, H).to(dtype)
    leaves = [expanded, scales] + ([skip] if skip is not None else [])
    with ops.recording() as log:
        got = _grads(lambda e, s, *sk: ops_moe.moe_finalize_routing(e, s, ridx, *sk), leaves, g)
    assert [name for name, _ in log] == ["moe_finalize_routing", "moe_finalize_routing_grad"]
    want = _grads(lambda e, s, *sk: _eager_finalize(e, s, ridx, *sk), leaves, g)
    ref = _grads(lambda e, s, *sk: _eager_finalize(e, s, ridx, *sk), [t.double() for t in leaves], g.double())
    for name, gg, ww, rr in zip(("d_expanded", "d_scales", "d_skip"), got, want, ref):
        assert gg.dtype == ww.dtype and gg.shape == ww.shape, name
        ok, err, tol = compare(ww, rr, gg)
        assert ok, (name, err, tol)
    if case == "skip":
        assert torch.equal(got[2], g)                               # d_skip is the gradient itself
    if case == "repeats":
        assert (got[0][R - 3:] == 0).all()
    # near miss: the scales' gradient without the gather (each token's first row for every j) is off
    wrong = (g.double()[:, None] * expanded.double()[ridx.reshape(T, k)[:, :1]]).sum(-1).expand(T, k)
    assert k == 1 or not compare(want[1], ref[1], wrong.float())[0]


def _eager_router(x, idx, norm, renorm, eps, routed_scaling_factor, **_):
    """The router as model code writes it (fp32 softmax or sigmoid, gather, renormalise, scale)."""
    s = x.float()
    s = torch.softmax(s, -1) if norm == "softmax" else torch.sigmoid(s) if norm == "sigmoid" else s
    y = s.gather(-1, idx)
    if norm == "topk_softmax":                  # GraniteMoE / GPT-OSS: softmax over the chosen logits
        y = torch.softmax(y, -1)
    if renorm:
        y = y / (y.sum(-1, keepdim=True) + eps)
    return y * routed_scaling_factor


ROUTERS = [dict(k=2, norm="softmax", renorm=True, eps=0.0),                                   # Mixtral
           dict(k=4, norm="softmax"),                                                         # no renorm
           dict(k=4, norm="sigmoid", renorm=True, eps=1e-20, routed_scaling_factor=2.5, bias=True,
                n_group=4, topk_group=2, group_score="top2"),                                 # DeepSeek-V3
           dict(k=2, norm="sigmoid", routed_scaling_factor=1.5, n_group=2, topk_group=1),
           dict(k=1, norm="none", renorm=False, routed_scaling_factor=2.0, bias=True),
           dict(k=3, norm="topk_softmax", routed_scaling_factor=1.5)]                          # top-k first


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("router", range(len(ROUTERS)))
def test_gating_gradients_equal_eager(dtype, router):
    """dx from one moe_gating_topk_grad launch vs eager autograd of the router with the same experts (the
    selection bias and the group limit only chose them), around float64."""
    from autofuse import ops
    p = dict(ROUTERS[router])
    p.setdefault("renorm", False)
    p.setdefault("eps", 1e-20)
    p.setdefault("routed_scaling_factor", 1.0)
    torch.manual_seed(router)
    T, E = 19, 16
    x = torch.randn(T, E).to(dtype)
    bias = torch.randn(E) * 0.1 if p.pop("bias", False) else None
    g = torch.randn(T, p["k"])
    xl = x.detach().requires_grad_(True)
    with ops.recording() as log:
        w, idx = ops_moe.moe_gating_topk(xl, bias, **p)
        got, = torch.autograd.grad(w, xl, g)
    assert [name for name, _ in log] == ["moe_gating_topk", "moe_gating_topk_grad"]
    want, = _grads(lambda x: _eager_router(x, idx, **p), [x], g)
    ref, = _grads(lambda x: _eager_router(x, idx, **p), [x.double()], g.double())
    assert got.dtype == want.dtype
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)
    # near miss: the derivative without the renormalisation (or, without one, without the scaling factor)
    q = dict(p, renorm=False) if p["renorm"] else dict(p, routed_scaling_factor=1.0 + p["routed_scaling_factor"])
    off, = _grads(lambda x: _eager_router(x, idx, **q), [x.double()], g.double())
    assert not compare(want, ref, off.to(dtype))[0]


def test_gating_weights_unused_launch_no_gradient():
    """Only the indices used (as a top-k router's dispatch): no gradient reaches the logits, no launch."""
    from autofuse import ops
    x = torch.randn(6, 8, requires_grad=True)
    with ops.recording() as log:
        w, idx = ops_moe.moe_gating_topk(x, k=2)
        (x.sum() + 0 * idx.sum()).backward()
    assert [name for name, _ in log] == ["moe_gating_topk"]
    assert torch.equal(x.grad, torch.ones(6, 8))


def test_backward_ops_fakes_and_twins():
    torch.manual_seed(0)
    T, k, H, E = 5, 2, 16, 8
    g, e, sc = torch.randn(T, H).half(), torch.randn(T * k, H).half(), torch.rand(T, k)
    ridx = torch.randperm(T * k)
    got = ops_moe.moe_finalize_routing_grad(g, e, sc, ridx)
    twin = ops_moe.reference_moe_finalize_routing_grad(g, e, sc, ridx)
    assert torch.equal(got[0], twin[0])
    # the dots: fp32 sums of the same products in another order: within H·2^-24 of Σ|terms| each
    terms = (g.float()[:, None].abs() * e.float()[ridx].abs().reshape(T, k, H)).sum(-1)
    assert (got[1] - twin[1]).abs().le(2 * H * 2.0 ** -24 * terms).all()
    x, gw = torch.randn(T, E).bfloat16(), torch.randn(T, k)
    idx = torch.rand(T, E).argsort(-1)[:, :k]
    dx = ops_moe.moe_gating_topk_grad(x, gw, idx, renorm=True, norm="sigmoid")
    tw = ops_moe.reference_moe_gating_topk_grad(x, gw, idx, k, renorm=True, norm="sigmoid")
    # the same fp32 steps, sums over the experts in another order, then one bf16 rounding: one bf16 ulp apart
    assert ((dx.float() - tw.float()).abs() <= 2.0 ** -7 * tw.float().abs() + 1e-6).all()
    with torch._subclasses.FakeTensorMode():
        fe, fs = torch.ops.autofuse.moe_finalize_routing_grad(torch.empty(T, H), torch.empty(T * k, H),
                                                              torch.empty(T, k), torch.empty(T * k, dtype=torch.int64))
        fx = torch.ops.autofuse.moe_gating_topk_grad(torch.empty(3, T, E), torch.empty(3, T, k),
                                                     torch.empty(3, T, k, dtype=torch.int64), k)
    assert fe.shape == (T * k, H) and fs.shape == (T, k) and fx.shape == (3, T, E)


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
    # the combine's and the router's backward: one launch each per layer
    assert bwd["autofuse.moe_finalize_routing_grad"] == layers
    assert bwd["autofuse.moe_gating_topk_grad"] == layers


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
