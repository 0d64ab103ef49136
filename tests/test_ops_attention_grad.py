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


def test_learnable_scale_keeps_the_host_recompute():
    q, k, v = _qkv(1, 2, 2, 16, 8, torch.float32)
    t = torch.tensor(1.3, requires_grad=True)
    with recording() as log:
        flash_attention(q, k, v, scale_tensor=t).sum().backward()
    assert [name for name, _ in log] == ["flash_attention"] and t.grad is not None and q.grad is not None

