"""The fused model is the user's model: what runs is the captured graph plus fused calls; parameters and
buffers are read at call time and get their gradients; finite mask fills, fully masked rows, training
mode and guarded assumptions behave as eager does."""
import copy
import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.capture import capture
from autofuse.models import build
from conftest import assert_as_eager, main_output

B, N, S, D = 2, 4, 16, 16
FUSED_OP = torch.ops.autofuse.flash_attention.default


def _fused_calls(fused):
    return [n for n in fused.graph_module.graph.nodes if n.op == "call_function" and n.target is FUSED_OP]


def _qkv(dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(B, N, S, D, generator=g) * scale).to(dtype) for _ in range(3))


# ------------------------------------------------------------------ the captured graph runs, not the canonical


class PreScaledQuery(nn.Module):
    """nn.MultiheadAttention, BART and Whisper scale q before q·kᵀ; in fp16 the unscaled scores overflow."""

    def forward(self, q, k, v):
        return torch.softmax((q * 0.125) @ k.transpose(-2, -1), -1) @ v


def test_prescaled_fp16_query_runs_as_captured_at_o0():
    args = _qkv(torch.float16, scale=40.0)          # |q·k| reaches ~1e5 > 65504; (q/8)·k stays finite
    model = PreScaledQuery()
    want = model(*args)
    assert torch.isfinite(want).all()
    fused = AutoFusionEngine.fuse(model, args, optimization_level="O0")
    captured = capture(model, args)
    got = fused(*args)
    assert torch.equal(got, want) and torch.equal(got, captured(*args))     # bit for bit


def test_prescaled_fp16_query_fuses_and_stays_finite():
    args = _qkv(torch.float16, scale=40.0)
    model = PreScaledQuery()
    fused = AutoFusionEngine.fuse(model, args, optimization_level="O2")
    assert [d.reason_code for d in fused.report.decisions if d.pattern == "attention"] == ["fused"], \
        fused.report.summary()
    assert [d.pattern for d in fused.report.applied] == ["attention"]
    got = fused(*args)
    assert torch.isfinite(got).all()
    assert_as_eager(model, args, got)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "mha"])
def test_o0_is_bit_identical_to_the_captured_graph(name):
    torch.manual_seed(0)
    model, (args, kwargs) = build(name, layers=2, hidden=32, heads=4, seq=8)
    model.eval()
    fused = AutoFusionEngine.fuse(model, (args, kwargs), optimization_level="O0")
    cap = capture(model, args, kwargs)
    with torch.no_grad():
        got, want = main_output(fused(*args, **kwargs)), main_output(cap(*args, **kwargs))
    assert torch.equal(got, want)
    # every node of the executed graph is a captured node, unchanged
    fmt = lambda gm: [(n.op, str(n.target), str(n.args), str(n.kwargs)) for n in gm.graph.nodes]  # noqa: E731
    assert fmt(fused.graph_module) == fmt(cap.graph_module)


def test_nodes_outside_a_fusion_are_the_captured_nodes():
    torch.manual_seed(0)
    model, (args, kwargs) = build("gpt2", layers=2, hidden=32, heads=4, seq=8)
    fused = AutoFusionEngine.fuse(model.eval(), (args, kwargs))
    cap = capture(model, args, kwargs)
    gone = {n for d in fused.report.applied for n in d.nodes}

    def form(n):                # a node's op and arguments; a read of a replaced value reads the fused output
        args = torch.fx.map_arg((n.args, n.kwargs), lambda a: "<fused>" if a.name in gone or
                                a.op == "call_function" and a.target is not None and "autofuse" in str(a.args)
                                else a.name)
        return n.op, str(n.target), str(args)

    captured = {n.name: form(n) for n in cap.graph_module.graph.nodes}
    executed = {n.name: n for n in fused.graph_module.graph.nodes}
    kept = {name for name in captured if name not in gone}
    assert kept <= set(executed)
    for name in kept:
        op, target, args = form(executed[name])
        assert (op, target) == captured[name][:2], name
        assert args == captured[name][2] or "<fused>" in captured[name][2] or "getitem" in args, name


# ---------------------------------------------------------------------------------- values are never baked in


class Temperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.temp = nn.Parameter(torch.tensor(0.5))

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * self.temp, -1) @ v


def test_learnable_temperature_is_read_at_call_time_and_gets_its_gradient():
    model = Temperature()
    args = _qkv()
    fused = AutoFusionEngine.fuse(model, args)
    assert len(_fused_calls(fused)) == 1, fused.report.summary()
    with torch.no_grad():
        model.temp.fill_(2.0)
    torch.testing.assert_close(fused(*args), model(*args), atol=1e-5, rtol=1e-4)
    model.zero_grad()
    model(*args).square().sum().backward()
    want = model.temp.grad.clone()
    model.zero_grad()
    fused(*args).square().sum().backward()
    assert model.temp.grad is not None
    torch.testing.assert_close(model.temp.grad, want, atol=1e-4, rtol=1e-4)


class ScaleBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_scale", torch.tensor(4.0))

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / self.inv_scale, -1) @ v


def test_scale_buffer_follows_state_dict():
    model = ScaleBuffer()
    args = _qkv()
    fused = AutoFusionEngine.fuse(model, args)
    assert len(_fused_calls(fused)) == 1, fused.report.summary()
    model.load_state_dict({"inv_scale": torch.tensor(0.5)})
    torch.testing.assert_close(fused(*args), model(*args), atol=1e-5, rtol=1e-4)


class ZeroBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.zeros(1, 1, S, S))

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5 + self.bias, -1) @ v


def test_zero_bias_buffer_is_guarded_and_replanned_after_load_state_dict():
    model = ZeroBias()
    args = _qkv()
    fused = AutoFusionEngine.fuse(model, args)
    (d,) = fused.report.applied
    assert d.params["mask_kind"] is None and "bias" in fused.report.guards[0]     # proven empty, guarded
    model.load_state_dict({"bias": torch.randn(1, 1, S, S)})
    torch.testing.assert_close(fused(*args), model(*args), atol=1e-5, rtol=1e-4)
    assert "bias" in fused.report.replanned_because and "in place" in fused.report.replanned_because
    (d,) = fused.report.applied
    assert d.params["mask_kind"] == "additive"


def test_a_replaced_buffer_fires_its_guard():
    model = ZeroBias()
    args = _qkv()
    fused = AutoFusionEngine.fuse(model, args)
    model.bias = torch.ones(1, 1, S, S)               # a new tensor object under the same name
    torch.testing.assert_close(fused(*args), model(*args), atol=1e-5, rtol=1e-4)
    assert "replaced" in fused.report.replanned_because


@pytest.mark.parametrize("edit", ["assign", "copy"])
def test_a_buffer_edited_through_data_fires_its_guard(edit):
    # .data moves neither the tensor's identity nor its version counter: the guard compares the values too
    model = ZeroBias()
    args = _qkv()
    fused = AutoFusionEngine.fuse(model, args)
    new = torch.randn(1, 1, S, S)
    if edit == "assign":
        model.bias.data = new
    else:
        model.bias.data.copy_(new)
    torch.testing.assert_close(fused(*args), model(*args), atol=1e-5, rtol=1e-4)
    assert "other values" in fused.report.replanned_because


@pytest.mark.parametrize("when", ["added", "removed", "forward"])
def test_hooks_or_a_forward_changed_after_fuse_replan(when):
    # capture runs a module's hooks (and an instance's own forward) into the graph: a change re-plans
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).eval()
    x = torch.randn(4, 16)
    handle = model[0].register_forward_hook(lambda m, i, o: o * 2) if when == "removed" else None
    fused = AutoFusionEngine.fuse(model, (x,))
    if when == "added":
        model[0].register_forward_hook(lambda m, i, o: o * 0.5)
    elif when == "removed":
        handle.remove()
    else:
        model[0].forward = lambda t: t * 3
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)
    assert "forward hooks or another forward" in fused.report.replanned_because


def test_a_plan_made_outside_autocast_is_not_run_inside_it_and_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16)).eval()
    x = torch.randn(4, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want, got = model(x), fused(x)
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)   # bf16 outputs: a few of its ulps
        plain = fused(x)              # outside again: the fp32 plan, not the autocast one
    assert plain.dtype == torch.float32 and len(fused.plans) == 2
    torch.testing.assert_close(plain, model(x), atol=1e-5, rtol=1e-4)


class Fp32Region(nn.Module):
    """A forward that turns autocast off for part of its work (as transformers computes RoPE angles in fp32)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        h = self.fc1(x)
        with torch.autocast("cpu", enabled=False):
            return self.fc2(h.float()).softmax(-1)


@pytest.mark.parametrize("route", ["fuse", "torch.compile"])
def test_an_autocast_disabled_region_inside_the_forward_stays_fp32_under_the_callers_autocast(route):
    """The graph captured under autocast holds autocast's casts and runs with autocast off: the region the forward
    keeps in fp32 is not cast down again at run time (before, its output came back in bf16, 3e-3 off)."""
    torch.manual_seed(0)
    model, x = Fp32Region().eval(), torch.randn(2, 8, 32)
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        run = AutoFusionEngine.fuse(model, (x,)) if route == "fuse" else torch.compile(model, backend="autofuse")
        got, want = run(x), model(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)      # the same bf16 fc1, then fp32 ops


@pytest.mark.parametrize("convert", ["half", "bfloat16"])
def test_dtype_conversion_after_fuse_replans(convert):
    torch.manual_seed(0)
    model, (args, kwargs) = build("gpt2", layers=1, hidden=32, heads=4, seq=8)
    model.eval()
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    model.half() if convert == "half" else model.to(torch.bfloat16)
    with torch.no_grad():
        got, want = main_output(fused(*args, **kwargs)), main_output(model(*args, **kwargs))
    assert got.dtype == want.dtype
    assert "changed from float32" in fused.report.replanned_because
    # the fused kernel computes in fp32 where eager rounds each op: within a few 16-bit roundings of the logits
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.05)


# --------------------------------------------------------------------------- finite fills, fully masked rows


class Masked(nn.Module):
    def __init__(self, fill, spelling):
        super().__init__()
        self.fill, self.spelling = fill, spelling

    def forward(self, q, k, v, keep):
        s = q @ k.transpose(-2, -1) * D ** -0.5
        fill = torch.finfo(s.dtype).min if self.fill == "finfo.min" else self.fill
        if self.spelling == "masked_fill":
            s = s.masked_fill(~keep, fill)
        else:
            s = torch.where(keep, s, fill)
        return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fill", ["finfo.min", -1e4, -1e9, float("-inf")])
@pytest.mark.parametrize("spelling", ["masked_fill", "where"])
def test_fully_masked_rows_as_eager(dtype, fill, spelling):
    if spelling == "masked_fill" and fill == -1e9 and dtype == torch.float16:
        pytest.skip("eager refuses it: masked_fill of -1e9 overflows float16")
    model = Masked(fill, spelling)
    q, k, v = _qkv(dtype)
    keep = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(1)) > 0.4
    keep[:, :, 3] = False                           # query row 3 sees no key
    args = (q, k, v, keep)
    fused = AutoFusionEngine.fuse(model, args)
    assert len(_fused_calls(fused)) == 1, fused.report.summary()
    got = fused(*args)
    want = model(*args)
    # a finite fill averages V over every key; -inf (or a fill that overflows the dtype) gives NaN, as eager
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    if fill == "finfo.min" or (fill == -1e4 and dtype != torch.float16) or (fill == -1e9 and dtype != torch.float16):
        torch.testing.assert_close(got[:, :, 3].float(), v.float().mean(-2).to(dtype).float(),
                                   atol=4 * torch.finfo(dtype).eps, rtol=4 * torch.finfo(dtype).eps)
    assert_as_eager(model, args, got)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_rows_through_sdpa_give_zeros(kind):
    class M(nn.Module):
        def forward(self, q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    q, k, v = _qkv()
    m = torch.ones(B, 1, S, S, dtype=torch.bool)
    m[:, :, 5] = False
    if kind == "additive":
        m = torch.zeros(B, 1, S, S).masked_fill(~m, float("-inf"))
    fused = AutoFusionEngine.fuse(M(), (q, k, v, m))
    assert len(_fused_calls(fused)) == 1
    got = fused(q, k, v, m)
    assert torch.equal(got[:, :, 5], torch.zeros_like(got[:, :, 5]))
    torch.testing.assert_close(got, M()(q, k, v, m), atol=1e-5, rtol=1e-4)


def test_an_infinite_score_under_an_sdpa_bool_mask_is_nan_as_in_eager():
    """SDPA adds -inf for a False entry of a bool mask: a masked +inf score is NaN (+inf - inf), and so is its row,
    as a NaN score is; the fused kernel adds the fill too instead of replacing the score with it."""
    class M(nn.Module):
        def forward(self, q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    q, k, v = _qkv()
    m = torch.ones(B, 1, S, S, dtype=torch.bool)
    m[:, :, 5, 3] = False                       # query 5 does not see key 3
    fused = AutoFusionEngine.fuse(M(), (q, k, v, m))
    assert len(_fused_calls(fused)) == 1
    k = k.clone()
    k[:, :, 3, 0] = float("inf")                # key 3's scores are +inf or -inf, by the sign of q's first feature
    got, want = fused(q, k, v, m), M()(q, k, v, m)
    assert torch.isnan(want[:, :, 5]).any()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, equal_nan=True)


def test_nan_in_a_query_row_propagates_as_in_eager():
    model = Masked("finfo.min", "masked_fill")
    q, k, v = _qkv()
    keep = torch.ones(B, 1, S, S, dtype=torch.bool)
    fused = AutoFusionEngine.fuse(model, (q, k, v, keep))
    q = q.clone()
    q[0, 1, 7] = float("nan")
    got, want = fused(q, k, v, keep), model(q, k, v, keep)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got).any()


class PaddedEagerAttention(nn.Module):
    """GPT-2's eager attention (transformers 5) on a left-padded batch: ``q·kᵀ·scale + mask``, the mask
    ``where(keep, 0, finfo(dtype).min)`` in the model's dtype, built from the causal keep-mask and the padding mask;
    a padded query sees no key."""

    def forward(self, q, k, v, attention_mask):
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril() & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
        return torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5 + mask, -1) @ v


PAD = 5
PADDED = (1, slice(None), slice(0, PAD))        # batch 1's padded queries, every head


def _padded(dtype, grad=False):
    q, k, v = (t.requires_grad_(grad) for t in _qkv(dtype, seed=3))
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[1, :PAD] = 0                 # left padding: batch 1's first PAD tokens
    return q, k, v, attention_mask


def _in_float64(model, args):
    return model.double()(*[a.detach().double().requires_grad_(a.requires_grad) if a.is_floating_point() else a
                            for a in args])


def test_left_padded_fp16_rows_average_v_as_eager():
    """Eager fp16 attention adds the ``finfo(float16).min`` mask in fp16: each score of a padded query rounds to
    -65504 and its row is the uniform average of V, as in the float64 model (whose own finfo.min absorbs the scores).
    The fused kernel adds the mask as the captured fp16 add does (``mask_add_dtype``). Bound at the padded rows: the
    project's, at most twice eager's error against float64 plus one rounding (:func:`autofuse.verify.compare`); an
    fp32 add there kept the scores' differences (1.08 off, the bound 1.4e-3)."""
    from autofuse.verify import compare
    model = PaddedEagerAttention()
    args = _padded(torch.float16)
    fused = AutoFusionEngine.fuse(model, args)
    (call,) = _fused_calls(fused)
    assert call.kwargs["mask_add_dtype"] == torch.float16
    got, want, ref = fused(*args), model(*args), _in_float64(model, args)
    ok, err, tol = compare(want[PADDED], ref[PADDED], got[PADDED])
    assert ok, (err, tol)
    torch.testing.assert_close(got[PADDED].float(), args[2][1].float().mean(-2, keepdim=True).expand(N, PAD, D),
                               atol=4e-3, rtol=4e-3)
    assert_as_eager(model.half(), args, got)


def test_left_padded_fp16_gradients_as_eager():
    """The backward recomputes P with the forward's fp16 sum (the padded rows' P uniform, as the forward's), and the
    rounding passes the gradient through as eager's fp16 add does: dq, dk, dv within the bound of the forward's test
    (twice eager's error against the float64 model's gradients, plus one rounding)."""
    from autofuse.verify import compare
    model = PaddedEagerAttention()
    args = _padded(torch.float16, grad=True)
    fused = AutoFusionEngine.fuse(model, args)
    (call,) = _fused_calls(fused)
    assert call.kwargs["mask_add_dtype"] == torch.float16
    g = torch.randn(B, N, S, D, generator=torch.Generator().manual_seed(4))
    leaves = args[:3]
    got = torch.autograd.grad(fused(*args), leaves, g.half())
    want = torch.autograd.grad(model(*args), leaves, g.half())
    args64 = [a.detach().double().requires_grad_() if a.is_floating_point() else a for a in args]
    ref = torch.autograd.grad(model.double()(*args64), args64[:3], g.double())
    for name, a, e, r in zip("qkv", got, want, ref):
        ok, err, tol = compare(e, r, a)
        assert ok, (name, err, tol)


@pytest.mark.parametrize("case", ["bf16 eager", "fp32 eager", "fp16 sdpa"])
def test_masks_added_in_fp32_stay_so(case):
    """Where the captured add is not a 16-bit one the mask is added in fp32, as before: an fp32 model; torch's CPU
    SDPA, which adds its fp16 float mask to fp32 scores (a padded row keeps the scores' differences, in eager as
    fused). bf16's ``finfo.min`` (-3.39e38) absorbs any score in fp32 already: its padded rows average V as before,
    now through the bf16 add the captured graph has (its other scores rounded to bf16, as eager rounds them)."""
    dtype = {"bf16 eager": torch.bfloat16, "fp32 eager": torch.float32, "fp16 sdpa": torch.float16}[case]

    class Sdpa(nn.Module):
        def forward(self, q, k, v, attention_mask):
            keep = torch.ones(S, S, dtype=torch.bool).tril() & attention_mask[:, None, None, :].bool()
            mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    model = Sdpa() if case == "fp16 sdpa" else PaddedEagerAttention()
    args = _padded(dtype)
    fused = AutoFusionEngine.fuse(model, args)
    (call,) = _fused_calls(fused)
    assert call.kwargs.get("mask_add_dtype") == (torch.bfloat16 if case == "bf16 eager" else None)
    got, want = fused(*args), model(*args)
    mean = args[2][1].float().mean(-2, keepdim=True).expand(N, PAD, D)
    if case == "fp16 sdpa":
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        assert (want[PADDED].float() - mean).abs().max() > 0.1     # SDPA's fp32 add: not the average of V
    else:
        torch.testing.assert_close(got[PADDED].float(), mean, atol=2e-2, rtol=2e-2)
    assert_as_eager(model, args, got)


# ------------------------------------------------------------------------------------------- training mode


class DropoutAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.25)

    def forward(self, q, k, v):
        return self.drop(torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, -1)) @ v


def test_training_mode_fuses_dropout_and_eval_fuses():
    model = DropoutAttention().train()
    args = _qkv()
    fused = AutoFusionEngine.fuse(model, args)
    (d,) = [d for d in fused.report.decisions if d.pattern == "attention"]
    assert d.applied and d.params["dropout_p"] == 0.25 and "dropout_gen_mask" in fused.graph_module.code
    torch.manual_seed(3)
    want = model(*args)
    torch.manual_seed(3)                   # the same keep-mask (tests/test_dropout_attention.py: exactly)
    torch.testing.assert_close(fused(*args), want, atol=1e-5, rtol=1e-4)
    model.eval()
    got = fused(*args)
    assert fused.report.applied and not fused.report.training
    torch.testing.assert_close(got, model(*args), atol=1e-5, rtol=1e-4)


def test_training_mode_without_dropout_fuses_and_trains():
    model = Temperature().train()
    args = tuple(t.requires_grad_() for t in _qkv())
    fused = AutoFusionEngine.fuse(model, args)
    assert fused.report.training and len(fused.report.applied) == 1
    out = fused(*args)
    out.sum().backward()
    assert all(t.grad is not None for t in args) and model.temp.grad is not None


def test_user_model_mode_is_not_changed_by_fuse():
    model = DropoutAttention().train()
    AutoFusionEngine.fuse(model, _qkv())
    assert model.training and model.drop.training
    model.eval()
    AutoFusionEngine.fuse(model, _qkv())
    assert not model.training and not model.drop.training


# ------------------------------------------------------ causal masks with a finite value: skipped under a bound

SB, SN, SS, SD = 2, 8, 512, 64      # large enough that skipping beats reading the mask on the 910


class FiniteCausal(nn.Module):
    """GPT-2's spelling (a causal buffer, ``finfo.min`` added) and the masked_fill / where spellings."""

    def __init__(self, spelling, s=SS, value="finfo.min"):
        super().__init__()
        self.spelling, self.value = spelling, value
        self.register_buffer("bias", torch.ones(s, s, dtype=torch.bool).tril().view(1, 1, s, s), persistent=False)

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        n = s.shape[-1]
        value = torch.finfo(s.dtype).min if self.value == "finfo.min" else self.value
        keep = self.bias[:, :, :n, :n]
        if self.spelling == "additive":
            s = s + torch.zeros(n, n, dtype=s.dtype).masked_fill(~keep[0, 0], value)
        else:
            s = torch.where(keep, s, torch.full([], value, dtype=s.dtype))
        return torch.softmax(s.float(), -1).to(q.dtype) @ v


def _big_qkv(dtype=torch.float16, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(SB, SN, SS, SD, generator=g) * (scale if i < 2 else 1.0)).to(dtype) for i in range(3))


@pytest.fixture(scope="module", params=["additive", "where"])
def finite_causal(request):
    model = FiniteCausal(request.param)
    args = _big_qkv()
    return model, args, AutoFusionEngine.fuse(model, args)


def test_finite_causal_mask_is_skipped_where_the_bound_proves_it_exact(finite_causal):
    from autofuse.ops import recording
    model, args, fused = finite_causal
    (d,) = [d for d in fused.report.applied if d.pattern == "attention"]
    choices = {name for name, _, _ in d.params["alternatives"]["ascend910"]}
    assert choices == {"causal skip under a score bound", "mask read"}
    assert d.params["alternatives"]["ascend910"][0][0] == "causal skip under a score bound"
    assert "; causal skip under a score bound (mask read " in d.reason
    (call,) = _fused_calls(fused)
    assert call.kwargs["causal_value"] == float(torch.finfo(torch.float16).min)
    with recording() as log:
        got = fused(*args)
    assert [k for k, _ in log] == ["score_bound", "flash_attention"]
    assert_as_eager(model, args, got)
    # a query row and a key row of norm 1000, orthogonal: no score is large, but the bound |q||k|/8 passes
    # 65504 - margin, so it proves nothing and the kernel reads the mask; the result is still eager's
    big = tuple(t.clone() for t in args)
    big[0][:, :, 0], big[1][:, :, -1] = 0.0, 0.0
    big[0][:, :, 0, 0], big[1][:, :, -1, 1] = 1000.0, 1000.0
    with recording() as log2:
        got = fused(*big)
    assert [k for k, _ in log2] == ["score_bound", "flash_attention"]
    mask_bytes = SS * SS * (2 if model.spelling == "additive" else 1)
    assert log2[1][1].hbm_bytes >= log[1][1].hbm_bytes + mask_bytes     # the mask was read
    assert_as_eager(model, big, got)


@pytest.mark.parametrize("kind", ["additive", "bool"])
@pytest.mark.parametrize("return_probs", [False, True])
def test_skipping_is_bit_for_bit_the_mask_read(kind, return_probs):
    """Where the bound holds every skipped weight is exactly 0 in fp32: the skip equals the full computation."""
    from autofuse.fused import kernel_default_tiling
    q, k, v = (t[:1, :4, :300] for t in _big_qkv(seed=2))
    fmin = float(torch.finfo(torch.float16).min)
    keep = torch.ones(300, 300, dtype=torch.bool).tril()
    mask = keep if kind == "bool" else torch.zeros(300, 300, dtype=torch.float16).masked_fill(~keep, fmin)
    spec = [(tuple(t.shape), "float16") for t in (q, k, v)]
    tiling = json.dumps(kernel_default_tiling("ascend910", spec, ((300, 300), "bool" if kind == "bool" else "float16")))
    op = torch.ops.autofuse.flash_attention
    kw = dict(return_probs=return_probs, tiling=tiling, fill=fmin if kind == "bool" else None)
    skipped = op(q, k, v, mask, **kw, causal_value=fmin)
    read = op(q, k, v, mask, **kw)
    assert torch.equal(skipped[0], read[0]) and torch.equal(skipped[1], read[1])


@pytest.mark.parametrize("value,spelling,why", [
    (-5.0, "additive", "a soft bias, not a mask: not proven causal"),
    ("triu", "where", "the keys above the diagonal kept: not causal"),
    (-1e4, "pad", "a causal mask and a second mask: the skip would drop the second's effect on skipped keys"),
])
def test_finite_masks_that_are_not_skipped(value, spelling, why):
    class Pad(FiniteCausal):
        def forward(self, q, k, v, pad):
            s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
            fill = torch.full([], -1e4, dtype=s.dtype)
            s = torch.where(pad, torch.where(self.bias, s, fill), fill)
            return torch.softmax(s.float(), -1).to(q.dtype) @ v

    n = 96
    q, k, v = (t[:1, :2, :n] for t in _big_qkv(seed=3))
    if spelling == "pad":
        pad = torch.ones(1, 1, 1, n, dtype=torch.bool)
        pad[..., -7:] = False
        model, args = Pad("where", s=n), (q, k, v, pad)
    else:
        model, args = FiniteCausal(spelling, s=n, value=value if value != "triu" else -1e4), (q, k, v)
        if value == "triu":
            model.bias = model.bias.logical_not().logical_or(torch.eye(n, dtype=torch.bool))
    fused = AutoFusionEngine.fuse(model, args)
    (d,) = [d for d in fused.report.applied if d.pattern == "attention"]
    assert d.params.get("causal_value") is None and not d.params["causal"], why
    assert_as_eager(model, args, fused(*args))


@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_the_skip_is_exact_at_the_edge_of_the_bound(kind):
    """The worst case of the bound: query row 0 keeps one key at score -A and has every masked key at +A
    (q = c·e0, k0 = -c·e0, the other keys +c·e0). At the largest fp16 c the bound still accepts, the skip equals
    the mask read bit for bit; at the next c the op reads the mask. Row 0 then averages its one key: v[0]."""
    from autofuse.fused import kernel_default_tiling
    from autofuse.ops import causal_skip_is_exact
    S, D = 64, 64
    scale = D ** -0.5
    value = float(torch.finfo(torch.float16).min)
    keep = torch.ones(S, S, dtype=torch.bool).tril()
    mask = keep if kind == "bool" else torch.zeros(S, S, dtype=torch.float16).masked_fill(~keep, value)

    def inputs(c):
        q, k = torch.zeros(1, 1, S, D, dtype=torch.float16), torch.zeros(1, 1, S, D, dtype=torch.float16)
        q[..., 0] = c
        k[..., 0] = c
        k[..., 0, 0] = -c
        return q, k

    def accepts(c):
        n2 = float(torch.tensor(c, dtype=torch.float16)) ** 2
        part = np.array([[[n2] * 8, [n2] * 8]], dtype=np.float32)
        return causal_skip_is_exact(part, scale, value, additive=kind == "additive")

    cs = torch.arange(0x3C00, 0x7800, dtype=torch.int16).view(torch.float16)       # every fp16 in [1, 32768)
    ok = [float(c) for c in cs if accepts(float(c))]
    edge = max(ok)
    after = float(cs[cs > edge][0])
    assert not accepts(after)
    v = torch.randn(1, 1, S, D, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    spec = [((1, 1, S, D), "float16")] * 3
    tiling = json.dumps(kernel_default_tiling("ascend910", spec, ((S, S), "bool" if kind == "bool" else "float16")))
    op = torch.ops.autofuse.flash_attention
    kw = dict(scale=scale, tiling=tiling, fill=value if kind == "bool" else None)
    from autofuse.ops import recording
    for c in (edge, after):
        q, k = inputs(c)
        with recording() as log:
            skipped, _, _ = op(q, k, v, mask, **kw, causal_value=value)
        read, _, _ = op(q, k, v, mask, **kw)
        assert torch.equal(skipped, read), c
        hbm = log[1][1].hbm_bytes
        if c == edge:
            assert torch.equal(skipped[0, 0, 0], v[0, 0, 0])          # row 0: one key kept, weight exactly 1
            skip_hbm = hbm
        else:
            assert hbm > skip_hbm                                       # past the edge: the mask is read


class Block(nn.Module):
    """A residual dropout and a LayerNorm: two plain attributes (p, eps) that capture bakes in as constants."""

    def __init__(self):
        super().__init__()
        self.proj, self.drop, self.ln = nn.Linear(32, 32), nn.Dropout(0.1), nn.LayerNorm(32)

    def forward(self, x):
        return self.ln(x + self.drop(self.proj(x)))


def _seeded(fn, seed=5):
    torch.manual_seed(seed)
    return fn(), torch.rand(3)


def test_a_changed_dropout_p_replans_with_the_new_value():
    model = Block().train()
    x = torch.randn(2, 8, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    model.drop.p = 0.5
    (got, after_f), (want, after_e) = _seeded(lambda: fused(x)), _seeded(lambda: model(x))
    assert "drop.p changed from 0.1 to 0.5" in fused.report.replanned_because
    assert torch.equal(after_f, after_e)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert any(d.applied and [dr[1] for dr in d.params.get("draws", ())] == [0.5] for d in fused.report.decisions)


def test_a_changed_eps_replans_and_an_unchanged_model_does_not():
    model = Block().eval()
    x = torch.randn(2, 8, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    report = fused.report
    fused(x), model(x), fused(x)                      # eager runs in between change nothing the plan read
    assert fused.report is report and not report.replanned_because
    assert any("attributes: identity, hooks and forward" in g for g in report.guards)
    model.ln.eps = 0.5
    torch.testing.assert_close(fused(x), model(x), atol=1e-6, rtol=1e-5)
    assert "ln.eps changed from 1e-05 to 0.5" in fused.report.replanned_because


def test_a_swapped_module_replans():
    model = Block().eval()
    x = torch.randn(2, 8, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    model.drop = nn.Identity()
    model.ln = nn.RMSNorm(32)
    model.eval()                                      # the same training flags: the same plan key
    torch.testing.assert_close(fused(x), model(x), atol=1e-6, rtol=1e-5)
    assert "module drop was replaced" in fused.report.replanned_because


def test_a_mask_built_from_a_trainable_parameter_keeps_its_gradient_path():
    """An additive attention bias read from a learnable table that starts at zeros (Swin's relative position
    bias): proving the mask zero from the table's value (guarded) was right for the forward but cut the table's
    gradient. A tensor that requires grad is never evaluated into a proof: the table gets eager's gradient."""
    class Biased(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(2, 16))      # [heads, distance buckets], zeros at init
            self.register_buffer("index", (torch.arange(8)[:, None] - torch.arange(8)[None, :]).abs())
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
            bias = self.table[:, self.index]                           # [heads, 8, 8]
            scores = q @ k.transpose(-2, -1) * 8 ** -0.5 + bias
            return (scores.softmax(-1) @ v).sum()

    torch.manual_seed(0)
    m = Biased().train()
    x = torch.randn(2, 8, 16)
    f = AutoFusionEngine.fuse(m, (x,))
    (d,) = f.report.of("attention")
    assert d.applied and d.params["mask_kind"] == "additive"
    grads = []
    for fn in (f, m):
        m.zero_grad()
        fn(x).backward()
        grads.append(m.table.grad.clone())
    assert grads[1].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)   # fp32 host recompute: reassociation


# ------------------------------------------------------------------ state the forward updates in place

def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 10),
                         nn.LayerNorm(10))


def test_batchnorm_training_updates_its_statistics_as_eager():
    """Training mode: BatchNorm's running mean, variance and batch count are updated by each fused call as by
    eager's, step after step (the same plan: the statistics' values are nothing the plan relies on), and the
    gradients are eager's. Both sides compute the statistics with torch's own batch-norm kernel on the same
    inputs, so they agree to a few float32 units in the last place (rtol 1e-5)."""
    import copy
    net = _bn_net().train()
    ref = copy.deepcopy(net)
    fused = AutoFusionEngine.fuse(net)
    for step in range(3):
        x, w = torch.randn(4, 3, 8, 8), torch.randn(4, 10)
        got, want = fused(x), ref(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # a random projection of the output as the loss: the final LayerNorm makes a sum or a sum of squares of
        # its output nearly constant, whose gradients are rounding noise on both sides
        (got * w).sum().backward()
        (want * w).sum().backward()
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(net[1], name), getattr(ref[1], name), rtol=1e-5, atol=1e-7)
        assert int(net[1].num_batches_tracked) == int(ref[1].num_batches_tracked) == step + 1
    # the two sides sum the same fp32 products in other orders (the fused LayerNorm epilogue; dot products of at
    # most K = 288 terms): each side within K·2^-24 of the exact sums, relative to the gradients' scale, so the
    # two within 2·288·2^-24 < 4e-5 of the model's largest gradient (the conv bias, which BatchNorm cancels, is
    # rounding noise on both sides and is only held to that)
    top = max(float(q.grad.abs().max()) for q in ref.parameters())
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert float((p.grad - q.grad).abs().max()) <= 4e-5 * top, name
    assert len(fused.plans) == 1 and fused.report.applied


def test_simulating_a_training_step_leaves_the_statistics_alone():
    net = _bn_net().train()
    x = torch.randn(4, 3, 8, 8)
    fused = AutoFusionEngine.fuse(net, (x,))
    before = {n: b.clone() for n, b in net.named_buffers()}
    result = fused.simulate(x, backward=True)
    assert result.phases["forward"] > 0 and result.phases["backward"] > 0
    assert all(torch.equal(b, before[n]) for n, b in net.named_buffers())


class _Counting(nn.Module):
    """A forward that counts its calls in a buffer and clamps its weight through ``.data``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        self.lin.weight.data.clamp_(-0.1, 0.1)
        return F.gelu(self.lin(x)) * 2 + 1


def test_updated_buffers_and_parameters_are_written_back():
    model = _Counting().eval()
    with torch.no_grad():
        model.lin.weight.normal_()                     # outside the clamp's range
    fused = AutoFusionEngine.fuse(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        first = fused(x)
        fused(x)
    assert int(model.calls) == 2 and bool((model.lin.weight.abs() <= torch.tensor(0.1)).all())
    with torch.no_grad():
        torch.testing.assert_close(first, model(x), rtol=1e-5, atol=1e-6)     # eager, after the clamp
    assert int(model.calls) == 3


class _NoGradClamped(_Counting):
    """:class:`_Counting` with its clamp written as an update under ``torch.no_grad()``."""

    def forward(self, x):
        self.calls += 1
        with torch.no_grad():
            self.lin.weight.clamp_(-0.1, 0.1)
        return F.gelu(self.lin(x)) * 2 + 1


class _Renormed(nn.Module):
    """``nn.Embedding(max_norm=...)``: each call renormalises the rows it looks up in place (torch's
    ``embedding_renorm_`` under no_grad), then a projection and a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16, max_norm=1.0)
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, ids):
        return self.norm(F.gelu(self.lin(self.emb(ids))) * 2 + 1)


def _updated_in_training(kind, dtype):
    torch.manual_seed(0)
    model = {"data": _Counting, "no_grad": _NoGradClamped, "max_norm": _Renormed}[kind]().train()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()                 # outside the clamp's range, embedding rows longer than max_norm
    x = torch.randint(0, 32, (4, 6)) if kind == "max_norm" else torch.randn(4, 8)
    return model.to(dtype), x.to(dtype) if x.is_floating_point() else x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["data", "no_grad", "max_norm"])
def test_a_trainable_parameter_updated_in_training_mode_trains_as_in_eager(kind, dtype):
    """A parameter the forward updates outside autograd (through .data, under no_grad, an embedding's max_norm) is
    written back and read with its gradient, as eager reads it: the output, every gradient (the updated weight's
    included, which a read of the graph's new value alone would leave at 0) within the verifier's bound of eager
    (twice eager's own error against the model in float64), and the updated values written into the model."""
    from autofuse.verify import compare
    model, x = _updated_in_training(kind, dtype)
    ref = copy.deepcopy(model).double()
    eager = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert fused.report.applied, fused.report.summary()
    got, want = fused(x), eager(x)
    exact = ref(x.double() if x.is_floating_point() else x)
    for y in (got, want, exact):
        y.float().pow(2).sum().backward()
    ok, err, tol = compare(want, exact, got)
    assert ok, ("output", err, tol)
    for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
        assert float(q.grad.abs().max()) > 0, name
        ok, err, tol = compare(q.grad, r.grad, p.grad)
        assert ok, (name, err, tol)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p, q), name          # the update written back: the same op on the same values
    if kind == "max_norm":
        rows = x.unique()
        assert bool((model.emb.weight[rows].double().norm(dim=1) <= 1.0 + 1e-2).all())
    else:
        assert int(model.calls) == 1 and bool((model.lin.weight.abs() <= 0.1).all())


def test_training_steps_with_an_updated_parameter_follow_eager():
    """Three SGD steps, each forward clamping the weight the last step moved: the fused model's parameters stay
    eager's (fp32; the fused kernels differ from eager's only in the order of their fp32 sums)."""
    model, x = _updated_in_training("data", torch.float32)
    eager = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model, (x,))
    for _ in range(3):
        for net, run in ((model, fused), (eager, eager)):
            run(x).pow(2).sum().backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.05 * p.grad
                    p.grad = None
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert int(model.calls) == 3 and len(fused.plans) == 1


class _ReadThenClamped(_Counting):
    def forward(self, x):
        y = self.lin(x)
        self.lin.weight.data.clamp_(-0.1, 0.1)
        return F.gelu(self.lin(y))


def test_a_parameter_read_before_its_update_is_refused_with_grad():
    """Eager's backward of the first read uses the parameter's values when it runs, the clamped ones; a captured
    graph's would use those it read: refused, naming the parameter and the read, in training and in eval mode
    (with grad, a backward may follow). Frozen, or captured without grad, it fuses."""
    from autofuse.capture import CaptureError
    for mode in ("train", "eval"):
        with pytest.raises(CaptureError, match=r"reads 'lin.weight' \(linear .*\), which requires grad, before it "
                                               r"updates it in place"):
            AutoFusionEngine.fuse(getattr(_ReadThenClamped(), mode)(), (torch.randn(4, 8),))
    frozen = _ReadThenClamped().train()
    frozen.lin.weight.requires_grad_(False)
    AutoFusionEngine.fuse(frozen, (torch.randn(4, 8),))
    with torch.no_grad():
        AutoFusionEngine.fuse(_ReadThenClamped().eval(), (torch.randn(4, 8),))


def test_a_parameter_updated_in_eval_mode_keeps_its_gradient():
    """``nn.Embedding(max_norm=...)`` renormalises in eval mode too: a backward through the fused model in eval mode
    (fine-tuning without dropout) gives the embedding its gradient, as eager does (the graph's new value alone
    gave it none). A plan made without grad serves calls without grad only: a call with grad plans again, with the
    gradient's pass."""
    from autofuse.verify import compare
    model, x = _updated_in_training("max_norm", torch.float32)
    model.eval()
    ref, eager = copy.deepcopy(model).double(), copy.deepcopy(model)
    with torch.no_grad():
        fused = AutoFusionEngine.fuse(model, (x,))
        fused(x)
    got = fused(x)
    assert len(fused.plans) == 2
    for y in (got, eager(x), ref(x)):
        y.pow(2).sum().backward()
    for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
        assert p.grad is not None, name
        ok, err, tol = compare(q.grad, r.grad, p.grad)
        assert ok, (name, err, tol)


def test_a_parameter_updated_in_training_mode_through_torch_compile():
    """Dynamo passes the parameters as inputs: an update of one is an update of an input that requires grad and is
    a leaf, so outside autograd, and the graph is fused (not run as Dynamo gave it), with eager's gradients."""
    import warnings
    from autofuse import reports
    model, x = _updated_in_training("data", torch.float32)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="autofuse")
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # "runs unfused, as Dynamo gave it" would fail here
        got = compiled(x)
    want = eager(x)
    got.pow(2).sum().backward()
    want.pow(2).sum().backward()
    assert any(r.applied for r in reports(compiled))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(p, q), name


class _Accumulating(nn.Module):
    """A forward that writes into a tensor it is given: ``acc`` gathers each call's activations in place, at the
    rows ``at`` names (as a static KV cache is written), and the output reads the updated ``acc``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, acc, at):
        acc.index_copy_(0, at, F.gelu(self.lin(x)))
        return torch.softmax(acc @ acc.transpose(0, 1), dim=-1) @ acc


def test_inputs_updated_in_place_are_written_back():
    """The caller's tensor is updated as eager updates it (the same object, the same values), the output is
    eager's, and one plan serves calls that write other rows (the rows are values, not sizes). Capture,
    planning and simulation leave the tensor given alone."""
    model = _Accumulating().eval()
    x, acc = torch.randn(2, 8), torch.zeros(6, 8)
    fused = AutoFusionEngine.fuse(model, (x, acc.clone(), torch.tensor([0, 1])))
    assert fused.report.applied, fused.report.summary()
    mine, theirs = acc.clone(), acc.clone()
    for rows in ([0, 1], [2, 3], [4, 5]):
        x, at = torch.randn(2, 8), torch.tensor(rows)
        with torch.no_grad():
            got, want = fused(x, mine, at), model(x, theirs, at)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)    # the same fp32 ops, other kernels
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(fused.plans) == 1
    kept = mine.clone()
    fused.simulate(torch.randn(2, 8), mine, torch.tensor([0, 1]), values=False)
    assert torch.equal(mine, kept)


def test_an_input_that_requires_grad_updated_in_place_is_refused():
    from autofuse.capture import CaptureError
    acc = torch.zeros(6, 8, requires_grad=True) * 1           # not a leaf: eager allows the in-place write
    with pytest.raises(CaptureError, match=r"updates the input\(s\) \['acc'\] in place, and they require grad"):
        AutoFusionEngine.fuse(_Accumulating().train(), (torch.randn(2, 8), acc, torch.tensor([0, 1])))
    # planned with an input that does not require grad, then called with one that does: refused at the call too
    fused = AutoFusionEngine.fuse(_Accumulating().train(), (torch.randn(2, 8), torch.zeros(6, 8), torch.tensor([0, 1])))
    with pytest.raises(RuntimeError, match=r"updates input\(s\) \[1\] .* in place, and this call's require grad"):
        fused(torch.randn(2, 8), torch.zeros(6, 8, requires_grad=True) * 1, torch.tensor([0, 1]))
    with torch.no_grad():           # no autograd, nothing to lose: runs
        fused(torch.randn(2, 8), torch.zeros(6, 8, requires_grad=True) * 1, torch.tensor([0, 1]))


# ------------------------------------------------------------------ Python values among the inputs

class _Knobs(nn.Module):
    """Forward arguments that are Python values: an int that slices (read through ``isinstance``, as transformers
    reads ``logits_to_keep``) and a bool that SDPA takes as ``is_causal``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x, keep: int, causal: bool = False):
        q = self.proj(x).unflatten(-1, (2, 8)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=causal).transpose(1, 2).flatten(-2)
        return out[:, -keep:] if isinstance(keep, int) and keep > 0 else out * 0


@pytest.mark.parametrize("keep,causal", [(3, True), (2, False), (0, True)])
def test_int_and_bool_arguments_reach_the_forward_as_python_values(keep, causal):
    # the forward sees the values themselves, as in eager (a symbolic int fails isinstance and slices wrongly)
    torch.manual_seed(0)
    m = _Knobs().eval()
    x = torch.randn(2, 6, 16)
    fused = AutoFusionEngine.fuse(m, ((x, keep), {"causal": causal}))
    with torch.no_grad():
        want, got = m(x, keep, causal=causal), fused(x, keep, causal=causal)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)    # fp32 attention: reassociation only
    # another value is another plan, each as eager
    with torch.no_grad():
        torch.testing.assert_close(fused(x, keep + 1, causal=not causal), m(x, keep + 1, causal=not causal),
                                   atol=1e-5, rtol=1e-4)


def test_logits_to_keep_above_one_keeps_that_many_positions():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    lm = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1)).eval()
    ids = torch.randint(0, 64, (2, 8))
    fused = AutoFusionEngine.fuse(lm, ((ids,), {"use_cache": False, "logits_to_keep": 3}))
    with torch.no_grad():
        want = lm(ids, use_cache=False, logits_to_keep=3).logits
        got = fused(ids, use_cache=False, logits_to_keep=3).logits
    assert got.shape == want.shape == (2, 3, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


class _Compares(nn.Module):
    """A 16-bit chain that compares with a number, a 0-d fp32 tensor, and fills with a number 16 bits cannot hold."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x, t):
        if self.kind == "scalar":
            return torch.where(x.abs() >= 0.1, x * 2, -x)
        if self.kind == "zero_dim":
            return torch.where(x.abs() >= t, x * 2, x + 1)
        if self.kind == "equal":
            return ((x.abs() + 0) == 0.1).to(x.dtype) * x + 1
        return torch.where(x > 0, x, 1e5) * 0.5 + x      # the fill is inf in float16, as eager stores it


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["scalar", "zero_dim", "equal", "fill"])
def test_a_16_bit_comparison_or_fill_uses_the_number_as_eager_rounds_it(kind, dtype):
    """Eager compares a float16/bfloat16 tensor with a number (or a 0-d fp32 tensor) in the tensor's dtype, and
    stores a number in it rounded: 0.1 is float16's 0.0999755859375, so x = float16(0.1) passes ``>= 0.1``."""
    torch.manual_seed(0)
    x = torch.tensor([[0.1, 0.2, -1.0, 3.0, -0.1, 0.0999, 0.1001, 2.0]], dtype=dtype).repeat(4, 1)
    t = torch.tensor(0.1)
    model = _Compares(kind)
    fused = AutoFusionEngine.fuse(model, (x, t))
    assert [d.pattern for d in fused.report.decisions if d.applied] == ["vector_chain"]
    # exact: each output element is one or two operations of a 16-bit value, rounded once as eager rounds it
    torch.testing.assert_close(fused(x, t), model(x, t), atol=0, rtol=0)


def test_a_stack_leaving_a_region_stays_as_captured():
    """A stack that is not flattened into pairs has no value in a Vector program: it is left out of the region
    (planning raised AttributeError)."""
    class Stack(nn.Module):
        def forward(self, a, b):
            return torch.stack([a * 1.5, b + 1], -1).exp()
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    fused = AutoFusionEngine.fuse(Stack(), (a, b))
    torch.testing.assert_close(fused(a, b), Stack()(a, b))


def test_a_float16_operand_scaled_before_its_matmul_is_not_scaled_after_it():
    """(x·0.01) @ Wᵀ keeps float16 in range; the canonical form scales the product instead, and an epilogue took
    that product unscaled in float16: 117 infinities where eager has none (|x| ~ 1e4)."""
    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 32).half())
            self.b = nn.Parameter(torch.randn(64).half())

        def forward(self, x):
            return torch.relu((x * 0.01) @ self.w.t() + self.b) * 2 + 1
    torch.manual_seed(1)
    model = Lin().eval()
    with torch.no_grad():
        fused = AutoFusionEngine.fuse(model, (torch.randn(16, 32).half(),))
        x = (torch.randn(16, 32) * 1e4).half()
        eager, got = model(x), fused(x)
    assert not eager.isinf().any() and not got.isinf().any()
    # float16: one rounding of the output either way (the bias and relu are exact in fp32)
    torch.testing.assert_close(got, eager, atol=0, rtol=2e-3)


def test_outputs_follow_the_calls_input_layout_not_the_plans():
    """A plan made on a transposed input laid its outputs out transposed; called with a contiguous input of the
    same shape, eager's output is contiguous (``out.view(-1)`` works) and so is the fused one now."""
    class Chain(nn.Module):
        def forward(self, a):
            return (a * 1.5 + 1).exp()
    model = Chain()
    fused = AutoFusionEngine.fuse(model, (torch.randn(8, 4).t(),))
    for x in (torch.randn(4, 8), torch.randn(8, 4).t()):
        got, eager = fused(x), model(x)
        assert got.stride() == eager.stride()
        torch.testing.assert_close(got, eager)
    assert len(fused.plans) == 2
