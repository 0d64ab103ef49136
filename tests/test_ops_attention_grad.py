"""torch.ops.autofuse.flash_attention_grad: the fused attention's backward runs it (recorded, traceable by
make_fx), its torch twin and timing function agree with it, and gradients through the fused forward match
eager's (dropout included); what the kernel does not compute still goes to the host recompute."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autofuse.ops import REFERENCES, TIMING, flash_attention, pack_keep, recording
from autofuse.ops_attention_grad import flash_attention_grad


def _qkv(B, N, Nkv, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, S, D, generator=g).to(dtype).requires_grad_() for n in (N, Nkv, Nkv)]


def _eager64(q, k, v, causal=False, keep=None, p=0.0):
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = (q.double() @ kk.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    pr = torch.softmax(s, -1)
    if keep is not None:
        pr = pr * keep / (1 - p)
    return pr @ vv


def test_backward_runs_the_kernel_and_matches_eager():
    q, k, v = _qkv(2, 4, 2, 24, 16, torch.float32)
    go = torch.randn(2, 4, 24, 16, generator=torch.Generator().manual_seed(1))
    with recording() as log:
        flash_attention(q, k, v, causal=True).backward(go)
    assert [name for name, _ in log] == ["flash_attention", "flash_attention_grad"]
    got = [t.grad.clone() for t in (q, k, v)]
    ref = torch.autograd.grad(_eager64(q, k, v, causal=True), (q, k, v), go.double())
    for a, b in zip(got, ref):
        # fp32 throughout: the kernel's Dr = rowsum(dO∘O) and fp32 sums, well inside 1e-5 of the gradients' size
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)


def test_dropout_backward_uses_the_keep_mask():
    q, k, v = _qkv(1, 2, 2, 20, 16, torch.float16)
    p = 0.2
    keep = torch.rand(1, 2, 20, 20, generator=torch.Generator().manual_seed(2)) >= p
    go = torch.randn(1, 2, 20, 16, generator=torch.Generator().manual_seed(3)).half()
    flash_attention(q, k, v, drop_mask=pack_keep(keep), dropout_p=p).backward(go)
    ref = torch.autograd.grad(_eager64(q, k, v, keep=keep.double(), p=p), (q, k, v), go.double())
    for a, b in zip((q.grad, k.grad, v.grad), ref):
        # fp16 operands: P, dS and the gradients are rounded to fp16 (2^-11 relative) a few times
        assert (a.double() - b).abs().max() <= 8e-3 * max(1.0, b.abs().max().item())


def test_traceable_by_make_fx_as_one_node():
    q, k, v = _qkv(1, 2, 1, 16, 8, torch.float32)

    def step(q, k, v):
        return torch.autograd.grad(flash_attention(q, k, v, causal=True).sum(), (q, k, v))

    gm = make_fx(step, tracing_mode="fake")(q, k, v)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("autofuse.flash_attention_grad.default") == 1
    assert not any("softmax" in t for t in targets)          # no host recompute in the traced backward


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_twin_and_timing_agree_with_the_op(dtype):
    q, k, v = (t.detach() for t in _qkv(1, 4, 2, 40, 32, dtype))
    mask = torch.rand(1, 1, 40, 40, generator=torch.Generator().manual_seed(4)) > 0.3
    out = flash_attention(q, k, v, mask=mask)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    with recording() as log:
        got = flash_attention_grad(q, k, v, out, do, mask=mask)
    twin = REFERENCES["flash_attention_grad"](q, k, v, out, do, mask=mask)
    for a, b in zip(got, twin):
        assert a.dtype == b.dtype == dtype
        # same numerics, different summation orders (tiles, atomic adds): a few roundings of the output dtype
        u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
        assert (a.float() - b.float()).abs().max() <= 4 * u * max(1.0, b.float().abs().max().item())
    stats = TIMING["flash_attention_grad"](*(x.to("meta") for x in (q, k, v, out, do)), mask=mask.to("meta"))
    assert stats[0][1].cycles == log[0][1].cycles


@pytest.mark.parametrize("mask", [None, "bool"])
def test_sdpa_attention_backward_runs_the_kernel(mask):
    """SDPA's fused attention (its masks applied by adding -inf, ``mask_keeps_nan``) differentiates through the
    backward kernel too: one flash_attention_grad launch, gradients as eager SDPA's on finite inputs."""
    import torch.nn.functional as F
    from autofuse import AutoFusionEngine

    class Attn(torch.nn.Module):
        def forward(self, q, k, v, m=None):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None)

    q, k, v = _qkv(2, 4, 4, 24, 16, torch.float32)
    g = torch.Generator().manual_seed(4)
    m = (torch.rand(2, 1, 24, 24, generator=g) > 0.3) | torch.eye(24, dtype=torch.bool) if mask else None
    args = (q, k, v) + ((m,) if mask else ())
    fused = AutoFusionEngine.fuse(Attn(), (tuple(t.detach() for t in args), {}))
    assert [d.pattern for d in fused.report.applied] == ["attention"]
    go = torch.randn(2, 4, 24, 16, generator=g)
    with recording() as log:
        got = torch.autograd.grad(fused(*args), (q, k, v), go)
    assert [name for name, _ in log] == ["flash_attention", "flash_attention_grad"]
    want = torch.autograd.grad(Attn()(*args), (q, k, v), go)
    ref = [t.double() for t in torch.autograd.grad(
        Attn()(*(t.double() if t.is_floating_point() else t for t in args)), (q, k, v), go.double())]
    for a, b, r in zip(got, want, ref):
        # the bound the project holds fused gradients to: twice eager's own distance to float64, plus one
        # fp32 rounding of the gradients' size
        assert (a.double() - r).abs().max() <= 2 * (b.double() - r).abs().max() + 2 ** -23 * r.abs().max()


@pytest.mark.parametrize("numel", [4, 1])
@pytest.mark.parametrize("stats", [False, True])
def test_attention_sinks_gradients_equal_eagers(numel, stats):
    """The sink logits are the user's parameter: their gradient (and q's, k's, v's) through the fused op equal
    eager's concatenate-softmax-slice, within fp32 roundings: with the forward's statistics (which count the
    sink) from the backward kernel and ``-sum(P_sink · rowsum(dO ∘ O))``, without them from the host recompute."""
    q, k, v = _qkv(2, 4, 2, 20, 16, torch.float32)
    sinks = torch.linspace(-1.0, 2.0, numel).requires_grad_()
    go = torch.randn(2, 4, 20, 16, generator=torch.Generator().manual_seed(6))
    with recording() as log:
        out = flash_attention(q, k, v, causal=True, sinks=sinks, return_stats=stats)
        got = torch.autograd.grad(out, (q, k, v, sinks), go)
    assert [name for name, _ in log] == ["flash_attention"] + (["flash_attention_grad"] if stats else [])

    def eager64(q, k, v, sinks):
        kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
        s = (q.double() @ kk.transpose(-2, -1)) * 16 ** -0.5
        s = s.masked_fill(~torch.ones(20, 20, dtype=torch.bool).tril(), float("-inf"))
        col = sinks.double().reshape(-1).expand(4).reshape(1, 4, 1, 1).expand(2, 4, 20, 1)
        return torch.softmax(torch.cat([s, col], -1), -1)[..., :-1] @ vv

    ref = torch.autograd.grad(eager64(q, k, v, sinks), (q, k, v, sinks), go.double())
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        # fp32 recompute against float64: roundings far below 1e-5 of the gradients' size
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5 * max(1.0, b.abs().max().item()), rtol=1e-4)


@pytest.mark.parametrize("stats", [False, True])
def test_soft_capped_attention_backward_runs_the_kernel(stats):
    """Gemma 2's logit soft-capping: the backward kernel caps the scores as the forward does and applies the cap's
    derivative (no host recompute): gradients equal eager's within fp32 roundings."""
    q, k, v = _qkv(2, 4, 2, 24, 16, torch.float32)
    q.data.mul_(4)                                          # scores large enough for the cap to bite
    go = torch.randn(2, 4, 24, 16, generator=torch.Generator().manual_seed(8))
    with recording() as log:
        got = torch.autograd.grad(flash_attention(q, k, v, causal=True, softcap=5.0, return_stats=stats), (q, k, v),
                                  go)
    assert [name for name, _ in log] == ["flash_attention", "flash_attention_grad"]

    def eager64(q, k, v):
        kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
        s = torch.tanh((q.double() @ kk.transpose(-2, -1)) * 16 ** -0.5 / 5.0) * 5.0
        s = s.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), float("-inf"))
        return torch.softmax(s, -1) @ vv

    ref = torch.autograd.grad(eager64(q, k, v), (q, k, v), go.double())
    for a, b in zip(got, ref):
        # fp32 throughout: the kernel's Dr = rowsum(dO∘O) and fp32 sums, well inside 1e-5 of the gradients' size
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5 * max(1.0, b.abs().max().item()), rtol=1e-4)


def test_learnable_scale_keeps_the_host_recompute():
    q, k, v = _qkv(1, 2, 2, 16, 8, torch.float32)
    t = torch.tensor(1.3, requires_grad=True)
    with recording() as log:
        flash_attention(q, k, v, scale_tensor=t).sum().backward()
    assert [name for name, _ in log] == ["flash_attention"] and t.grad is not None and q.grad is not None



@pytest.mark.parametrize("D, dtype, kernel", [(512, torch.float32, False), (512, torch.bfloat16, True),
                                              (256, torch.float32, True)])
def test_a_head_too_wide_for_the_backward_kernel_takes_the_host_recompute(D, dtype, kernel):
    """The backward kernel has no tiling for a 512-wide fp32 head on the 910 (Gemma 4's global layers): the backward
    recomputes on the host instead of failing in the middle of loss.backward(), with eager's gradients; a 16-bit
    512 head and a 256-wide fp32 head (near misses) fit and run the kernel."""
    from autofuse.npu.kernels.flash_attention_grad import has_tiling
    from cost_model.devices import get_device
    assert has_tiling(get_device("ascend910"), 16, 16, D, D, str(dtype).replace("torch.", "")) == kernel
    q, k, v = _qkv(1, 2, 1, 16, D, dtype)
    go = torch.randn(1, 2, 16, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    with recording() as log:
        flash_attention(q, k, v, causal=True).backward(go)
    assert [name for name, _ in log] == ["flash_attention"] + ["flash_attention_grad"] * kernel
    ref = torch.autograd.grad(_eager64(q, k, v, causal=True), (q, k, v), go.double())
    # fp32: the kernel's or the host's fp32 sums; bf16 operands: P, dS and the gradients rounded to bf16 (2^-8)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip((q.grad, k.grad, v.grad), ref):
        assert (a.double() - b).abs().max() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_saved_stats_reach_the_backward_kernel(dtype):
    """With return_stats the forward's row statistics ([2, B, N, Sq]: the twin's, as the kernel's) go to the
    backward kernel, which skips its recompute sweep: the same gradients in fewer cycles."""
    q, k, v = _qkv(2, 4, 2, 40, 32, dtype)
    go = torch.randn(2, 4, 40, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    cycles, grads = {}, {}
    for rs in (False, True):
        with recording() as log:
            out, _, stats = torch.ops.autofuse.flash_attention(q, k, v, None, None, True, return_stats=rs)
            grads[rs] = torch.autograd.grad(out, (q, k, v), go)
        cycles[rs] = dict((name, s.cycles) for name, s in log)
        assert stats.shape == ((2, 2, 4, 40) if rs else (0,)) and stats.dtype == torch.float32
        assert not stats.requires_grad
    twin = REFERENCES["flash_attention"](q, k, v, causal=True, return_stats=True)[2]
    # the same fp32 max and sum of the same fp32 scores, up to the scores' summation order (D terms)
    torch.testing.assert_close(stats, twin, rtol=1e-6 * q.shape[-1], atol=0.0)
    # the backward's own statistics and the forward's differ by fp32 rounding: the gradients within the bound
    # test_flash_attention_stats derives for the kernels
    from tests.npu.test_flash_attention_stats import _grad_bounds
    bounds, u_op = _grad_bounds(q.detach(), k.detach(), v.detach(), out.detach(), go, None, True, None, 1.0)
    for a, b, bound in zip(grads[False], grads[True], bounds):
        a, b = a.double(), b.double()
        assert torch.all((a - b).abs() <= bound + 2 * u_op * a.abs())
    assert cycles[True]["flash_attention_grad"] < cycles[False]["flash_attention_grad"]
    assert cycles[True]["flash_attention"] >= cycles[False]["flash_attention"]


@pytest.mark.parametrize("train", [True, False])
def test_training_plan_saves_stats_for_the_traced_backward(train):
    """A fused model captured in training mode asks its attention for the statistics; its joint graph (the
    forward and backward traced by make_fx in fake mode) hands them to flash_attention_grad. In eval mode
    neither: the backward recomputes them."""
    from tests.test_training_step import _graphs, _model
    from autofuse.training import joint_graph
    model, args, kwargs = _model("gpt2", train)
    graphs, leaves = _graphs(model, args, kwargs, generic=False)      # the fused plan's graph is all it reads
    g = joint_graph(graphs["fused"], leaves).graph_module.graph
    fwd = [n for n in g.nodes if n.target == torch.ops.autofuse.flash_attention.default]
    bwd = [n for n in g.nodes if n.target == torch.ops.autofuse.flash_attention_grad.default]
    assert fwd and len(bwd) == len(fwd)
    schema = [a.name for a in torch.ops.autofuse.flash_attention.default._schema.arguments]
    for f in fwd:
        given = f.kwargs.get("return_stats", f.args[schema.index("return_stats")]
                             if len(f.args) > schema.index("return_stats") else False)
        assert given is train
    for b in bwd:
        stats = b.args[7:9]
        if not train:
            assert stats == (None, None)
            continue
        for i, s in enumerate(stats):         # stats[i] of the forward's third output
            assert s.target == torch.ops.aten.select.int and s.args[1:] == (0, i)
            src = s.args[0]
            assert src.target.__name__ == "getitem" and src.args[1] == 2 and src.args[0] in fwd


def _bias_then_fill64(q, k, v, bias, keep, fill):
    """Eager's ``(s + bias).masked_fill(~keep, fill)`` in float64 (MPT's order: an ALiBi bias, then the mask)."""
    s = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5 + bias.double()
    return torch.softmax(s.masked_fill(~keep, fill), -1) @ v.double()


@pytest.mark.parametrize("device", ["ascend910", "ascend910b", "ascend310p"])
@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, float("-inf"), -1e4, -1e9])
@pytest.mark.parametrize("host", [False, True])
def test_a_bool_mask_combined_with_a_bias_passes_no_gradient_through_its_filled_scores(device, fill, host):
    """A bool and an additive mask combined into one (``where(keep, bias, fill)``, ``fill_in_mask``): the filled
    scores are constants, as ``masked_fill``'s backward makes them. On a row whose every key is masked (a left-padded
    query) P is not 0 there (uniform with a finite fill), so without the flag dq of that row and every dk would get
    a gradient eager does not give. The kernel and the host recompute (a bias that requires grad) both. A fill the
    scores do not vanish into (-1e4, -1e9: ``s + fill != fill``) is selected in place of the score, in the forward
    and in the backward's recompute: the output too is eager's."""
    q, k, v = _qkv(1, 2, 2, 24, 16, torch.float32, seed=6)
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(1, 2, 24, 24, generator=g).requires_grad_(host)
    keep = torch.rand(1, 1, 24, 24, generator=g) > 0.3
    keep[..., :3, :] = False                             # three queries that see no key
    combined = torch.where(keep, bias, fill)
    go = torch.randn(1, 2, 24, 16, generator=g)
    with recording() as log:
        out = flash_attention(q, k, v, mask=combined, fill=fill, fill_in_mask=True, device=device,
                              empty_rows="nan")                 # eager softmax: a row of -inf is NaN
        out.backward(go)
    assert ("flash_attention_grad" in [name for name, _ in log]) != host
    out64 = _bias_then_fill64(q, k, v, bias, keep, fill)
    torch.testing.assert_close(out.detach().double().nan_to_num(), out64.detach().nan_to_num(), atol=1e-5, rtol=1e-4)
    want = torch.autograd.grad(out64, (q, k, v), go.double(), allow_unused=True)
    assert bool(torch.isfinite(want[0]).all()) and not bool(want[0][:, :, :3].any()), "the test needs such rows"
    for name, a, b in zip("qkv", (q.grad, k.grad, v.grad), want):
        if fill == float("-inf") and name == "v":
            assert bool(torch.isnan(b).any()) and torch.equal(torch.isnan(a), torch.isnan(b))  # the empty rows' NaN P
            a, b = a.nan_to_num(), b.nan_to_num()
        # fp32 throughout: a few roundings of the gradients' size; a filled score's gradient would be of that size
        torch.testing.assert_close(a.double(), b.double(), atol=1e-5, rtol=1e-4)
