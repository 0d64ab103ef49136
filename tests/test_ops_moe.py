"""The fused MoE ops against the eager spellings of transformers 5.24's routers and experts.

Mixtral (softmax, top-k, y / sum(y)), Qwen2-MoE / Qwen3-MoE (softmax, top-k, optional renorm, cast to the
logits' dtype) and DeepSeek-V3 (sigmoid, selection bias, group top-2, y / (sum(y) + 1e-20), scaling), and
the experts (gate_up_proj [E, 2I, H], chunk(2) -> silu(gate) * up, down_proj [E, H, I], weighted index_add),
written here as those models' forward methods spell them. Errors are measured against float64 and must
stay within twice eager's own; indices must equal eager's.
"""
import pytest
import torch
import torch.nn.functional as F

from autofuse import ops_moe as M


def mixtral_router(logits, k, acc=torch.float32):
    """``acc``: the type the model computes in (float32; float64 for the reference)."""
    p = F.softmax(logits.to(acc), dim=-1)
    v, i = torch.topk(p, k, dim=-1)
    v /= v.sum(dim=-1, keepdim=True)
    return v, i


def qwen_router(logits, k, norm_topk_prob, acc=torch.float32):
    p = F.softmax(logits, dtype=acc, dim=-1)
    v, i = torch.topk(p, k, dim=-1)
    if norm_topk_prob:
        v /= v.sum(dim=-1, keepdim=True)
    return v.to(logits.dtype), i


def deepseek_router(logits, bias, k, n_group, topk_group, scale, acc=torch.float32):
    scores = logits.to(acc).sigmoid()
    choice = scores + bias
    E = logits.shape[-1]
    gs = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    gi = torch.topk(gs, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(gs).scatter_(1, gi, 1).unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
    choice = choice.masked_fill(~mask.bool(), float("-inf"))
    idx = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, idx


def experts_eager(x, idx, w, gate_up, down):
    """MixtralExperts.forward (the eager loop): per expert, gather, gate_up, silu(gate)*up, down, weight,
    index_add."""
    out = torch.zeros_like(x)
    E = gate_up.shape[0]
    mask = F.one_hot(idx, num_classes=E).permute(2, 1, 0)
    for e in range(E):
        pos, tok = torch.where(mask[e])
        if tok.numel() == 0:
            continue
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down[e]) * w[tok, pos, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


def experts_fused(x, idx, w, gate_up, down, device="ascend910"):
    E = gate_up.shape[0]
    xs, row, counts = M.moe_init_routing(x, idx, E, device=device)
    h = M.grouped_matmul(xs, gate_up, counts, trans_w=True, activation="swiglu", device=device)
    y = M.grouped_matmul(h, down, counts, trans_w=True, device=device)
    return M.moe_finalize_routing(y, w, row, device=device)


def _err(a, ref):
    return (a.double() - ref.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixtral_router(dtype):
    torch.manual_seed(0)
    logits = torch.randn(64, 8).to(dtype)
    v, i = mixtral_router(logits, 2)
    w, j = M.moe_gating_topk(logits, k=2, renorm=True, eps=0.0)
    assert torch.equal(i, j) and w.dtype == torch.float32
    ref, _ = mixtral_router(logits, 2, torch.float64)
    assert _err(w, ref) <= 2 * _err(v, ref) + 1e-7       # 1e-7: eager may round exactly where the kernel does not


@pytest.mark.parametrize("norm", [True, False])
def test_qwen_router(norm):
    torch.manual_seed(1)
    logits = torch.randn(33, 60).to(torch.bfloat16)
    v, i = qwen_router(logits, 4, norm)
    w, j = M.moe_gating_topk(logits, k=4, renorm=norm, eps=0.0, out_dtype=None)
    assert torch.equal(i, j) and w.dtype == torch.bfloat16
    ref, _ = qwen_router(logits, 4, norm, torch.float64)
    assert _err(w, ref) <= 2 * _err(v, ref) + 1e-7


def test_deepseek_v3_router():
    torch.manual_seed(2)
    logits, bias = torch.randn(40, 64), torch.randn(64) * 0.05
    v, i = deepseek_router(logits, bias, 6, 8, 3, 2.5)
    w, j = M.moe_gating_topk(logits, bias, k=6, norm="sigmoid", renorm=True, eps=1e-20, routed_scaling_factor=2.5,
                             n_group=8, topk_group=3, group_score="top2")
    # eager asks for sorted=False (order unspecified); the kernel returns the same experts, largest first
    assert torch.equal(i.sort(-1).values, j.sort(-1).values)
    order = i.argsort(-1)
    ref, _ = deepseek_router(logits, bias.double(), 6, 8, 3, 2.5, torch.float64)
    assert _err(w.gather(1, j.argsort(-1)), ref.gather(1, order)) <= 2 * _err(v, ref) + 1e-6


def test_router_near_misses():
    """Not what the kernel computes: largest=False, sigmoid for softmax, no renormalisation."""
    torch.manual_seed(3)
    logits = torch.randn(16, 8)
    w, j = M.moe_gating_topk(logits, k=2, renorm=True, eps=0.0)
    assert not torch.equal(j, torch.topk(torch.softmax(logits, -1), 2, largest=False).indices)
    v, _ = qwen_router(logits, 2, False)
    assert _err(w, v) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_block(dtype):
    torch.manual_seed(4)
    T, H, I, E, k = 24, 32, 48, 4, 2
    x = torch.randn(T, H).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H) * 0.2).to(dtype)
    down = (torch.randn(E, H, I) * 0.2).to(dtype)
    w, idx = mixtral_router(torch.randn(T, E), k)
    eager = experts_eager(x, idx, w, gate_up, down)
    fused = experts_fused(x, idx, w, gate_up, down)
    ref = experts_eager(x.double(), idx, w.double(), gate_up.double(), down.double())
    assert _err(fused, ref) <= 2 * _err(eager, ref) + 1e-6


def test_gradients_match_eager():
    torch.manual_seed(5)
    T, H, I, E, k = 12, 16, 8, 3, 2
    x = torch.randn(T, H, requires_grad=True)
    gate_up = (torch.randn(E, 2 * I, H) * 0.3).requires_grad_(True)
    down = (torch.randn(E, H, I) * 0.3).requires_grad_(True)
    logits = torch.randn(T, E, requires_grad=True)
    g = torch.randn(T, H)

    def run(fused):
        w, idx = M.moe_gating_topk(logits, k=2, renorm=True, eps=0.0) if fused else mixtral_router(logits, k)
        out = experts_fused(x, idx, w, gate_up, down) if fused else experts_eager(x, idx, w, gate_up, down)
        return torch.autograd.grad((out * g).sum(), (x, gate_up, down, logits))

    for a, b in zip(run(True), run(False)):
        assert (a - b).abs().max() < 1e-4                    # fp32 on both sides, different summation orders


def test_grouped_matmul_bias_gradient():
    torch.manual_seed(6)
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(2, 8, 6, requires_grad=True)
    b = torch.randn(2, 6, requires_grad=True)
    counts = torch.tensor([4, 6])
    M.grouped_matmul(x, w, counts, b).pow(2).sum().backward()
    xe, we, be = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    torch.cat([xe[:4] @ we[0] + be[0], xe[4:] @ we[1] + be[1]]).pow(2).sum().backward()
    for a, e in ((x, xe), (w, we), (b, be)):
        assert (a.grad - e.grad).abs().max() < 1e-4


def test_fake_and_schema():
    torch.manual_seed(7)
    x, idx = torch.randn(6, 8), torch.randint(0, 3, (6, 2))
    torch.library.opcheck(torch.ops.autofuse.moe_init_routing.default, (x, idx, 3))
    torch.library.opcheck(torch.ops.autofuse.moe_gating_topk.default, (torch.randn(6, 8), None, 2))
    w = torch.randn(3, 8, 4)
    torch.library.opcheck(torch.ops.autofuse.grouped_matmul.default, (torch.randn(12, 8), w, torch.tensor([4, 0, 8])))
    with torch.device("meta"):
        y = torch.ops.autofuse.grouped_matmul(torch.empty(12, 8), torch.empty(3, 10, 8), torch.empty(3, dtype=torch.int64),
                                              None, True, "count", "swiglu")
    assert y.shape == (12, 5)


def test_reference_twins_match_the_kernels():
    torch.manual_seed(8)
    logits = torch.randn(20, 16)
    assert all(torch.allclose(a.float(), b.float(), atol=1e-6) for a, b in
               zip(M.moe_gating_topk(logits, k=3, renorm=True), M.reference_moe_gating_topk(logits, k=3, renorm=True)))
    x, idx = torch.randn(20, 8).half(), torch.randint(0, 4, (20, 2))
    got, ref = M.moe_init_routing(x, idx, 4), M.reference_moe_init_routing(x, idx, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    y = torch.randn(40, 8).half()
    sc = torch.rand(20, 2)
    assert torch.equal(M.moe_finalize_routing(y, sc, got[1]), M.reference_moe_finalize_routing(y, sc, got[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_over_a_weight_list_is_the_stacked_launch(dtype):
    """``grouped_matmul_list`` (a hand-written layer's experts: one weight per group, the gate and up projections
    apart) gives the stacked op's values and launch: the same kernel reading the same bytes, the same cycles."""
    from autofuse.ops import recording
    torch.manual_seed(9)
    E, H, inter = 3, 16, 24
    x, counts = torch.randn(20, H, dtype=dtype), torch.tensor([7, 0, 13])
    gate, up = ([torch.randn(inter, H, dtype=dtype) * 0.3 for _ in range(E)] for _ in range(2))
    down = [torch.randn(H, inter, dtype=dtype) * 0.3 for _ in range(E)]
    with recording() as listed:
        h = M.grouped_matmul_list(x, gate, counts, up, trans_w=True, activation="swiglu")
        y = M.grouped_matmul_list(h, down, counts, trans_w=True)
    with recording() as stacked:
        h2 = M.grouped_matmul(x, torch.cat([torch.stack(gate), torch.stack(up)], 1), counts, trans_w=True,
                              activation="swiglu")
        y2 = M.grouped_matmul(h2, torch.stack(down), counts, trans_w=True)
    assert torch.equal(h, h2) and torch.equal(y, y2)
    assert [(k, s.cycles, s.hbm_bytes) for k, s in listed] == [(k, s.cycles, s.hbm_bytes) for k, s in stacked]
    # the twin accumulates in fp32 in torch's order, the kernel in its tiles': equal up to fp32 rounding, then up to
    # one step of the output's rounding (bf16: 2^-8 relative)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(y, M.reference_grouped_matmul_list(h, down, counts, trans_w=True), **tol)
    torch.library.opcheck(torch.ops.autofuse.grouped_matmul_list.default, (x.float(), [g.float() for g in gate], counts,
                                                                          [u.float() for u in up], [], [], True,
                                                                          "count", "swiglu"))
    with pytest.raises(ValueError, match="as many up projections"):
        M.grouped_matmul_list(x, gate, counts, up[:2], trans_w=True, activation="swiglu")


@pytest.mark.parametrize("activation", ["swiglu", "relu", "gelu_tanh"])
def test_grouped_matmul_over_weight_and_bias_lists_trains_as_eager(activation):
    """Per-group weights and biases as lists (a SwiGLU's gate and up apart; a plain activation's one projection):
    the values and every gradient (x, each weight, each bias) those of eager's per-group linears, within the bound
    of their float64 values."""
    from autofuse.verify import compare
    torch.manual_seed(10)
    E, H, inter = 3, 16, 24
    counts = torch.tensor([5, 0, 9])
    glu = activation == "swiglu"
    x = torch.randn(14, H)
    ws = [torch.randn(inter, H) * 0.3 for _ in range(E * (2 if glu else 1))]
    bs = [torch.randn(inter) * 0.3 for _ in range(E * (2 if glu else 1))]
    act = {"relu": torch.relu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}.get(activation)

    def eager(x, ws, bs):
        out, start = [], 0
        for e, c in enumerate(counts.tolist()):
            xe = x[start:start + c]
            a = F.linear(xe, ws[e], bs[e])
            out.append(F.silu(a) * F.linear(xe, ws[E + e], bs[E + e]) if glu else act(a))
            start += c
        return torch.cat(out)
    leaves = [[t.clone().requires_grad_() for t in group] for group in ([x], ws, bs)]
    ref_leaves = [[t.double().requires_grad_() for t in group] for group in ([x], ws, bs)]
    eager_leaves = [[t.clone().requires_grad_() for t in group] for group in ([x], ws, bs)]
    (xg,), wg, bg = leaves
    got = M.grouped_matmul_list(xg, wg[:E], counts, wg[E:] if glu else None, bg[:E], bg[E:] if glu else None,
                                trans_w=True, activation=activation)
    want, ref = eager(eager_leaves[0][0], *eager_leaves[1:]), eager(ref_leaves[0][0], *ref_leaves[1:])
    assert compare(want, ref, got)[0]
    g = torch.randn_like(want)
    for out, ls in ((got, leaves), (want, eager_leaves), (ref, ref_leaves)):
        (out * g.to(out.dtype)).sum().backward()
    for a, b, r in zip(*(sum(ls, []) for ls in (leaves, eager_leaves, ref_leaves))):
        if r.grad.abs().max() > 0:          # the empty group's weights and biases get none
            ok, err, tol = compare(b.grad, r.grad, a.grad)
            assert ok, (err, tol)
        else:
            assert a.grad is None or not a.grad.any()


def test_grouped_matmul_list_with_product_stores_what_the_backward_reads():
    """The training forward's list op: the stacked op's values, product and launch; its backward reads the stored
    product (no recompute launch) and gives the gradients the plain list op gives."""
    from autofuse.ops import recording
    torch.manual_seed(11)
    E, H, inter = 3, 16, 24
    counts = torch.tensor([6, 2, 0])
    x = torch.randn(8, H)
    gate, up, bias, bias_up = ([torch.randn(*s) * 0.3 for _ in range(E)] for s in ((inter, H), (inter, H), (inter,),
                                                                                     (inter,)))
    with recording() as listed:
        y, prod = M.grouped_matmul_list_with_product(x, gate, counts, up, bias, bias_up, trans_w=True)
    with recording() as stacked:
        y2, prod2 = M.grouped_matmul_with_product(x, torch.cat([torch.stack(gate), torch.stack(up)], 1), counts,
                                                  torch.cat([torch.stack(bias), torch.stack(bias_up)], 1),
                                                  trans_w=True)
    assert torch.equal(y, y2) and torch.equal(prod, prod2)
    assert [(k, s.cycles, s.hbm_bytes) for k, s in listed] == [(k, s.cycles, s.hbm_bytes) for k, s in stacked]
    from autofuse.verify import compare

    def eager(x, g, u, b, bu):         # per-group linears, fp32 or float64
        out, start = [], 0
        for e, c in enumerate(counts.tolist()):
            xe = x[start:start + c]
            out.append(F.silu(F.linear(xe, g[e], b[e])) * F.linear(xe, u[e], bu[e]))
            start += c
        return torch.cat(out)
    runs = []
    for op in (M.grouped_matmul_list_with_product, M.grouped_matmul_list, eager, eager):
        dt = torch.float64 if len(runs) == 3 else torch.float32
        leaves = [t.detach().to(dt, copy=True).requires_grad_() for t in [x] + gate + up + bias + bias_up]
        xs, ws = leaves[0], leaves[1:]
        with recording() as log:
            if op is eager:
                out = eager(xs, ws[:E], ws[E:2 * E], ws[2 * E:3 * E], ws[3 * E:])
            else:
                out = op(xs, ws[:E], counts, ws[E:2 * E], ws[2 * E:3 * E], ws[3 * E:], trans_w=True,
                         activation="swiglu")
            out = out[0] if isinstance(out, tuple) else out
            out.square().sum().backward()
        runs.append(([t.grad for t in leaves], [k for k, _ in log]))
    (stored, log_stored), (recomputed, log_recomputed), (want, _), (ref, _) = runs
    # one grouped_matmul launch fewer: the backward's recompute of the product
    assert log_recomputed.count("grouped_matmul") == log_stored.count("grouped_matmul") + 1
    for got, again, w, r in zip(stored, recomputed, want, ref):     # both within the bound of float64
        if r is None:                   # the empty group's weights: no gradient in eager, zeros fused
            assert not got.any() and not again.any()
            continue
        for g in (got, again):
            ok, err, tol = compare(w, r, g)
            assert ok, (err, tol)
