"""Shared test fixtures: a plain-torch reference for the fused attention op.

``attention_ref`` (``torch.ops.autofuse_test.attention_ref``) has the signature of
``torch.ops.autofuse.flash_attention`` and SDPA semantics: bool mask True = attend, additive mask
added to the scaled scores, ``causal`` = top-left ``tril``, GQA by ``k/v.repeat_interleave``, fp32
softmax, a row with every key masked gives zeros.
"""
import pytest
import torch


@torch.library.custom_op("autofuse_test::attention_ref", mutates_args=())
def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                  scale: float | None = None, causal: bool = False,
                  return_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    p = torch.softmax(s, -1)
    p = torch.where(torch.isinf(s).all(-1, keepdim=True) & (s < 0).all(-1, keepdim=True), 0.0, p)
    out = p.to(v.dtype) @ v
    return out.to(q.dtype), (p.to(q.dtype) if return_probs else q.new_empty(0))


@attention_ref.register_fake
def _(q, k, v, mask=None, scale=None, causal=False, return_probs=False):
    b, n, sq, _ = q.shape
    probs = q.new_empty(b, n, sq, k.shape[-2]) if return_probs else q.new_empty(0)
    return q.new_empty(b, n, sq, v.shape[-1]), probs


def main_output(out):
    """The tensor a model's output is judged by: the tensor itself, a tuple's first element, logits, or the
    last hidden state."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.fixture
def ref_op():
    return torch.ops.autofuse_test.attention_ref.default
