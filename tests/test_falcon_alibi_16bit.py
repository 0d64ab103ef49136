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
