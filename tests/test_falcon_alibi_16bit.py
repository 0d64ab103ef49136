"""Falcon's ALiBi attention in 16 bits: ``softmax(logits32 + mask, -1, dtype=bf16) @ v``, the bf16 scores cast up,
ALiBi added, scaled and masked in fp32, then cast back down by the softmax's ``dtype=`` argument. Near misses (a
downcast to another dtype than the inputs', an op between the downcast and the softmax) are not fused as attention,
the report says why, and the fused model computes them as eager does."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.canonicalize import canonicalize
from autofuse.capture import capture
from patterns.attention import find_attention

B, N, S, D = 2, 4, 16, 16


class FalconLike(nn.Module):
    """Falcon's eager ALiBi branch (transformers' FalconAttention) for 16-bit q, k, v; ``down``: the dtype the
    softmax casts its fp32 logits to (Falcon's: the hidden states'), ``after``: an op between that cast and the
    softmax (then written as an explicit cast)."""

    def __init__(self, down=None, after=False):
        super().__init__()
        self.down, self.after = down, after

    def forward(self, q, k, v, alibi, mask):
        s = (q @ k.transpose(-1, -2)).to(torch.float32)
        logits = (s + alibi) * 0.25
        down = self.down or q.dtype
        if self.after:
            p = F.softmax((logits + mask).to(down) * 0.5, dim=-1)
        else:
            p = F.softmax(logits + mask, dim=-1, dtype=down)
        return p.to(v.dtype) @ v


def _args(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, N, S, D, generator=g).mul(2).to(dtype) for _ in range(3))
    slopes = 2.0 ** -torch.arange(1, N + 1.0)
    alibi = (slopes[:, None] * torch.arange(S)).reshape(1, N, 1, S).expand(B, N, 1, S)
    causal = torch.ones(S, S, dtype=torch.bool).triu(1)
    mask = torch.zeros(B, 1, S, S).masked_fill(causal, torch.finfo(dtype).min)
    mask[0, ..., :3] = torch.finfo(dtype).min           # a left-padded sample: its first query sees no key
    return q, k, v, alibi.to(dtype), mask.to(dtype)


def _attention(module, args):
    return find_attention(canonicalize(capture(module.eval(), args).graph_module))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_near_miss_softmax_cast_to_another_dtype_than_the_inputs(dtype):
    """``softmax(logits32, dtype=)`` of the other 16-bit dtype, its probabilities cast to v's: rounded to 16 bits and
    widened again on the way (bf16 then fp16, or fp16 then bf16), which the kernel would not do. Not attention; the
    fused model computes it as eager does."""
    other = torch.bfloat16 if dtype == torch.float16 else torch.float16
    module, args = FalconLike(down=other).eval(), _args(dtype)
    assert all("unsupported" in m.params for m in _attention(module, args))
    fused = AutoFusionEngine.fuse(module, args)
    assert not [d for d in fused.report.applied if d.pattern == "attention"], fused.report.summary()
    with torch.no_grad():
        got, want = fused(*args), module(*args)
    # nothing of the attention is fused; a generated Vector kernel may take the fp32 logits' adds (fp32 roundings)
    # and the probabilities are rounded once to 16 bits after: within one 16-bit rounding of eager's
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_near_miss_an_op_between_the_downcast_and_the_softmax(dtype):
    """``softmax((logits32 + mask).to(bf16) * 0.5)``: the model rounds the logits and scales them in 16 bits before
    the softmax. Not attention (the reason names the model's cast); computed as eager does."""
    module, args = FalconLike(after=True).eval(), _args(dtype)
    (m,) = _attention(module, args)
    assert "by a cast the model writes" in m.params.get("unsupported", ""), m.params
    fused = AutoFusionEngine.fuse(module, args)
    assert not [d for d in fused.report.applied if d.pattern == "attention"], fused.report.summary()
    with torch.no_grad():
        got, want = fused(*args), module(*args)
    torch.testing.assert_close(got, want, equal_nan=True)


def _exact(q, k, v, alibi, mask, dtype):
    """The block in float64 with eager's roundings kept: the 16-bit scores as its matmul returns them, the fp32
    logits cast down to ``dtype`` once before the softmax (the softmax's ``dtype=``)."""
    s = (q.double() @ k.double().transpose(-1, -2)).to(dtype).double()
    logits = ((s + alibi.double()) * 0.25 + mask.double()).to(dtype).double()
    return torch.softmax(logits, -1) @ v.double()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_falcon_like_block_fuses_with_eagers_roundings(dtype):
    """The micro-module of Falcon's spelling: one attention block, applied, its kernel rounding the scores and the
    logits as eager does (``logits_round``); within the verifier's bound of the exact value of eager's roundings."""
    from autofuse.verify import compare
    module, args = FalconLike().eval(), _args(dtype)
    fused = AutoFusionEngine.fuse(module, args)
    (d,) = [d for d in fused.report.decisions if d.pattern == "attention"]
    assert d.applied and d.params["logits_round"] == dtype, fused.report.summary()
    with torch.no_grad():
        got, want = fused(*args), module(*args)
    ok, err, tol = compare(want, _exact(*args, dtype), got)
    assert ok, (err, tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_falcon_like_block_gradients(dtype):
    """Trained through: the fused block's backward (the host's fp32 recompute with the same roundings, the gradient
    rounded at each cast as eager's autograd rounds it) gives q, k, v gradients within the verifier's bound of the
    float64 ones (the forward's roundings kept, and the gradient's at the casts)."""
    from autofuse.verify import compare
    module = FalconLike().train()
    base = _args(dtype)
    fused = AutoFusionEngine.fuse(module, base)
    assert [d.applied for d in fused.report.decisions if d.pattern == "attention"] == [True], fused.report.summary()
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(B, N, S, D, generator=g)
    runs = []
    for m, dt in ((fused, dtype), (module, dtype), (None, torch.float64)):
        leaves = [t.detach().to(dt).requires_grad_() for t in base[:3]]
        out = m(*leaves, *base[3:]) if m is not None else _exact(*leaves, *base[3:], dtype)
        (out.double() * weights.double()).sum().backward()
        runs.append([t.grad for t in leaves])
    for got, want, ref in zip(*runs):
        ok, err, tol = compare(want, ref, got)
        assert ok, (err, tol)


FALCON = "transformers:FalconConfig?num_hidden_layers=2&hidden_size=64&num_attention_heads=4&vocab_size=128&alibi=True"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_falcon_alibi_from_config_fuses_attention_in_16_bits(dtype):
    """Falcon with ALiBi (transformers' FalconConfig, eager attention) in 16 bits: both layers' attention fused, the
    kernel rounding the scores and the logits as eager does; the logits within the verifier's bound of the model run
    in float64."""
    import copy

    from autofuse.models import build_transformers
    from autofuse.verify import compare
    torch.manual_seed(0)
    model, (args, kwargs) = build_transformers(FALCON, seq=16, batch=2, attn="eager", dtype=dtype)
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    attention = [d for d in fused.report.decisions if d.pattern == "attention"]
    assert len(attention) == 2 and all(d.applied and d.params["logits_round"] == dtype for d in attention), \
        fused.report.summary()
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        got, want = (m(*args, **kwargs).logits for m in (fused, model))
        exact = ref(*args, **kwargs).logits
    ok, err, tol = compare(want, exact, got)
    assert ok, (err, tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_and_its_twin_round_the_logits(dtype):
    """``flash_attention(..., logits_dtype=dtype)`` on the simulator and its torch twin (what repeated launches read)
    both round the scores and the logits: each within the verifier's bound of the exact value of eager's roundings,
    and closer to it than the same kernel without the rounding."""
    from autofuse.ops import flash_attention, reference_flash_attention
    from autofuse.verify import compare
    q, k, v, alibi, mask = _args(dtype)
    module = FalconLike().eval()
    with torch.no_grad():
        want = module(q, k, v, alibi, mask)
    exact = _exact(q, k, v, alibi, mask, dtype)
    bias = alibi.float() * 0.25 + mask.float()          # the fused call's one fp32 mask (ALiBi scaled, then added)
    kw = dict(mask=bias, scale=0.25, empty_rows="nan")
    errs = []
    for got in (flash_attention(q, k, v, logits_dtype=dtype, **kw),
                reference_flash_attention(q, k, v, logits_dtype=dtype, **kw)[0]):
        ok, err, tol = compare(want, exact, got)
        assert ok, (err, tol)
        errs.append(err)
    _, unrounded, _ = compare(want, exact, flash_attention(q, k, v, **kw))
    assert max(errs) < unrounded, (errs, unrounded)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_falcon_alibi_from_config_trains_in_16_bits(dtype):
    """Falcon with ALiBi in training mode, 16 bits: both attention blocks fused (their backward the host's recompute
    through the same roundings); every parameter's gradient within the verifier's bound of the float64 model's."""
    import copy

    from autofuse.models import build_transformers
    from autofuse.verify import compare
    torch.manual_seed(0)
    model, (args, kwargs) = build_transformers(FALCON, seq=16, batch=2, attn="eager", dtype=dtype)
    ref = copy.deepcopy(model).double().train()
    model.train()
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    attention = [d for d in fused.report.decisions if d.pattern == "attention"]
    assert len(attention) == 2 and all(d.applied and d.params["logits_round"] == dtype for d in attention), \
        fused.report.summary()
    grads = []
    for m, owner in ((fused, model), (model, model), (ref, ref)):
        owner.zero_grad()
        m(*args, **kwargs).logits.double().square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in owner.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() == grads[2].keys()
    for n in grads[1]:
        ok, err, tol = compare(grads[1][n], grads[2][n], grads[0][n])
        assert ok, (n, err, tol)
