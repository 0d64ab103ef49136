"""Equivalence: the fused model is at most twice as far from the exact answer as eager PyTorch is.

For fp32, fp16 and bf16 (weights and inputs in that dtype) the exact answer is the same model in float64 on
the same weights and inputs (``copy.deepcopy(model).double()``). The rule, on the model's main output:

    max|fused - ref64| <= 2 * max|eager - ref64| + 1e-6

Whole models dilute the attention among other ops, so attention-only modules (where the fused kernel is the
whole computation, over several KV tiles, with masks and GQA) are held to the same rule.
"""
import copy

import pytest
import torch

from autofuse import AutoFusionEngine
from autofuse.models import build
from patterns.attention import AttentionVariant, build_variant
from conftest import main_output

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _f64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _errors(model, args, kwargs, blocks):
    ref_model = copy.deepcopy(model).double()
    with torch.no_grad():
        ref = main_output(ref_model(*[_f64(a) for a in args], **kwargs)).double()
        eager = main_output(model(*args, **kwargs)).double()
        fused = AutoFusionEngine.fuse(model, (args, kwargs))
        assert [d.applied for d in fused.report.of("attention")] == [True] * blocks, fused.report.summary()
        got = main_output(fused(*args, **kwargs))
    assert got.dtype == main_output(model(*args, **kwargs)).dtype
    return (got.double() - ref).abs().max().item(), (eager - ref).abs().max().item()


def _check(label, dtype, fused_err, eager_err):
    print(f"{label} {str(dtype).replace('torch.', '')}: |fused-ref64| {fused_err:.3g}  |eager-ref64| {eager_err:.3g}  "
          f"ratio {fused_err / max(eager_err, 1e-30):.2f}")
    assert fused_err <= 2 * eager_err + 1e-6, (fused_err, eager_err)


MODELS = [("gpt2", "eager"), ("llama", "sdpa"), ("mha", "eager")]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("name,attn", MODELS, ids=[f"{n}-{a}" for n, a in MODELS])
def test_whole_models(name, attn, dtype):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, (args, kwargs) = build(name, layers=2, hidden=32, heads=4, seq=16, batch=2, attn=attn, dtype=dtype)
    _check(f"{name}-{attn}", dtype, *_errors(model, args, kwargs, 1 if name == "mha" else 2))


ATTENTION = [
    pytest.param(AttentionVariant(mask="causal_tril"), 200, id="causal-S200"),
    pytest.param(AttentionVariant(mask="additive", scale="div"), 72, id="additive-S72"),
    pytest.param(AttentionVariant(mask="masked_fill", gqa="repeat_kv"), 300, id="bool-gqa-S300"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("var,S", ATTENTION)
def test_attention_alone(var, S, dtype):
    torch.manual_seed(0)
    kv_heads = 2 if var.gqa else 4
    model = build_variant(var, heads=4, kv_heads=kv_heads).eval().to(dtype)
    B, D = 1, 64
    args = [torch.randn(B, 4, S, D), torch.randn(B, kv_heads, S, D), torch.randn(B, kv_heads, S, D)]
    if var.mask == "additive":
        args.append(torch.randn(B, 1, S, S))
    args = [a.to(dtype) for a in args]
    if var.mask == "masked_fill":
        keep = torch.rand(B, 1, S, S) < 0.7
        keep[..., 0] = True
        args.append(keep)
    _check(f"attention {var.mask} S={S}", dtype, *_errors(model, tuple(args), {}, 1))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_padded_batch_sends_the_mask_to_the_kernel(dtype):
    """Right padding: the additive padding mask (finfo(dtype).min entries) reaches the kernel in the model's dtype."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, (args, kwargs) = build("llama", layers=2, hidden=32, heads=4, seq=12, batch=2, attn="eager", dtype=dtype)
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, 7:] = 0
    kwargs = dict(kwargs, attention_mask=am)
    fused_err, eager_err = _errors(model, args, kwargs, 2)
    _check("llama-eager padded", dtype, fused_err, eager_err)
