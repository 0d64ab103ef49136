"""Swin v2's cosine attention: scores scaled by a learnable factor per head (``exp(clamp(logit_scale))``, shape
``[H, 1, 1]``), a bias added, and in a shifted-window stage the windows' mask added through a view that splits the
batch dim (``s.view(B / nW, nW, H, N, N) + mask[None, :, None]``, twice as transformers 5 writes it, then
``view(B, H, N, N)``). Fused: the factor is the kernel's per-head scale read at call time, the mask the ``[B, 1, N,
N]`` term each row reads, built in the graph ahead of the fused call. Outputs and gradients against eager's, fp32
and 16-bit; near misses (a factor per query row, a view splitting another dim, a mask after the softmax) stay
unfused."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.canonicalize import canonicalize
from autofuse.capture import capture
from autofuse.verify import compare
from conftest import main_output
from patterns.attention import find_attention


class CosineWindowAttention(torch.nn.Module):
    """Swin v2's attention as its modeling file writes it, on given q, k, v ``[B, H, N, D]`` and an optional window
    mask ``[nW, N, N]`` (``twice``: added twice through the 5-D view, as transformers 5.x does)."""

    def __init__(self, heads=2, n=16, twice=True, scale_shape=None):
        super().__init__()
        self.twice = twice
        shape = scale_shape or (heads, 1, 1)
        g = torch.Generator().manual_seed(1)
        self.logit_scale = torch.nn.Parameter(torch.log(10 * torch.ones(shape)) + 0.2 * torch.randn(shape, generator=g))
        self.table = torch.nn.Parameter(torch.randn(heads, n, n, generator=g))

    def forward(self, q, k, v, mask=None):
        B, H, N, _ = q.shape
        s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        s = s * torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        s = s + 16 * torch.sigmoid(self.table).unsqueeze(0)
        if mask is not None:
            nw = mask.shape[0]
            s = s.view(B // nw, nw, H, N, N) + mask.unsqueeze(1).unsqueeze(0)
            if self.twice:
                s = s + mask.unsqueeze(1).unsqueeze(0)
            s = s.view(-1, H, N, N)
        return F.softmax(s, dim=-1) @ v


def _window_mask(nw, n, dtype=torch.float32):
    """Swin's shifted-window mask: 0 where two tokens share a region, -100 elsewhere (the diagonal always kept)."""
    g = torch.Generator().manual_seed(3)
    keep = (torch.rand(nw, n, n, generator=g) > 0.4) | torch.eye(n, dtype=torch.bool)
    return torch.zeros(nw, n, n).masked_fill(~keep, -100.0).to(dtype)


def _inputs(B, H, N, D, dtype, nw=None):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(3))
    return (q, k, v) + ((_window_mask(nw, N, dtype),) if nw else ())


def _check_fused(module, args, dtype, train=False):
    """Fuse ``module`` on ``args``; the attention block applied; output and every gradient (of q, k, v, the
    per-head scale and the bias table, through one backward of a fixed projection) against eager: fp32 within
    1e-5 / 1e-4 as the suite's fp32 models, 16-bit within the verifier's bound (at most twice eager's error of
    float64)."""
    module = module.to(dtype).train(train)
    ref = copy.deepcopy(module).double()
    fused = AutoFusionEngine.fuse(module, args)
    att = fused.report.of("attention")
    assert len(att) == 1 and att[0].applied, fused.report.summary()
    assert att[0].params.get("scale_per_head")
    runs = []
    w = None
    for m, xs in ((module, args), (fused, args), (ref, [a.double() for a in args])):
        xs = [x.detach().clone().requires_grad_(x.is_floating_point() and x.dim() == 4) for x in xs]
        for p in module.parameters():
            p.grad = None
        out = m(*xs)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) if w is None else w
        (out.double() * w).sum().backward()
        params = ref.parameters() if m is ref else module.parameters()
        runs.append((out.detach(), [x.grad for x in xs if x.grad is not None] + [p.grad.clone() for p in params]))
    (want, want_g), (got, got_g), (f64, f64_g) = runs
    assert len(got_g) == len(want_g) == 5
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        for a, b in zip(got_g, want_g):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)        # fp32 both sides
    else:
        ok, err, tol = compare(want, f64, got)
        assert ok, ("output", err, tol)
        for i, (a, b, c) in enumerate(zip(want_g, f64_g, got_g)):
            ok, err, tol = compare(a, b, c)
            assert ok, (i, err, tol)
    return fused


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(8, 2, 16, 16, 4), (6, 3, 9, 8, 3)]
# every dtype at the first shape; the second (odd sizes: 3 windows, 3 heads, 9 tokens) in fp32 and one 16-bit dtype.
# fp16 and bf16 take the same path (the verifier's bound against float64); the second shape in fp16 runs with
# -m slow, covered by [shape1-dtype2] (the same sizes, 16-bit) and [shape0-dtype1] (fp16)
SPLIT_CASES = [pytest.param(dtype, shape, id=f"shape{i}-dtype{j}",
                            marks=[pytest.mark.slow] if (i, dtype) == (1, torch.float16) else [])
               for i, shape in enumerate(SHAPES) for j, dtype in enumerate(DTYPES)]


@pytest.mark.parametrize("dtype, shape", SPLIT_CASES)
@pytest.mark.parametrize("train", [False, True])
def test_cosine_attention_with_a_batch_split_window_mask_fuses_as_eager(dtype, shape, train):
    B, H, N, D, nw = shape
    fused = _check_fused(CosineWindowAttention(H, N), _inputs(B, H, N, D, dtype, nw), dtype, train)
    d = fused.report.of("attention")[0]
    # the window mask reaches the kernel as the [B, 1, N, N] term each window reads, priced as read; with the bias
    assert [t[1] for t in d.params["mask_terms"]] == ["additive"] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cosine_attention_without_a_mask_fuses_as_eager(dtype):
    _check_fused(CosineWindowAttention(4, 16), _inputs(2, 4, 16, 16, dtype), dtype, train=True)


def test_the_mask_added_once_fuses_too():
    _check_fused(CosineWindowAttention(2, 16, twice=False), _inputs(8, 2, 16, 16, torch.float32, 4), torch.float32)


def test_the_per_head_scale_is_read_at_call_time():
    """The factor is the user's parameter: changed after fusing, the fused model follows it (no re-plan needed)."""
    m = CosineWindowAttention(2, 16).eval()
    args = _inputs(8, 2, 16, 16, torch.float32, 4)
    fused = AutoFusionEngine.fuse(m, args)
    with torch.no_grad():
        m.logit_scale.copy_(torch.tensor([0.5, 4.0]).reshape(2, 1, 1))
        torch.testing.assert_close(fused(*args), m(*args), atol=1e-5, rtol=1e-4)
    assert fused.report.of("attention")[0].applied


# ------------------------------------------------------------------------------------------- near misses

def _attention_matches(module, args):
    cap = capture(module.eval(), args)
    return find_attention(canonicalize(cap.graph_module))


class _MaskAfterSoftmax(CosineWindowAttention):
    def forward(self, q, k, v, mask=None):
        B, H, N, _ = q.shape
        s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        s = s * torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        p = F.softmax(s, dim=-1)
        nw = mask.shape[0]
        p = (p.view(B // nw, nw, H, N, N) + mask.unsqueeze(1).unsqueeze(0)).view(-1, H, N, N)
        return p @ v


class _SplitHeads(CosineWindowAttention):
    """The view splits the heads dim, not the batch: the mask is per head pair, not per window."""

    def forward(self, q, k, v, mask=None):
        B, H, N, _ = q.shape
        s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        s = s * torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()
        s = (s.view(B, H // 2, 2, N, N) + mask.unsqueeze(0).unsqueeze(0)).view(B, H, N, N)
        return F.softmax(s, dim=-1) @ v


# each near miss beside its twin of the form that is matched (one attention block): the refusal is the form's

def test_a_scale_varying_per_query_row_is_not_matched():
    args = _inputs(8, 2, 16, 16, torch.float32, 4)
    assert _attention_matches(CosineWindowAttention(2, 16, scale_shape=(2, 16, 1)), args) == []
    assert len(_attention_matches(CosineWindowAttention(2, 16, scale_shape=(2, 1, 1)), args)) == 1


def test_a_view_splitting_another_dim_than_batch_is_not_matched():
    q, k, v = _inputs(2, 4, 16, 16, torch.float32)
    assert _attention_matches(_SplitHeads(4, 16), (q, k, v, _window_mask(2, 16))) == []
    assert len(_attention_matches(CosineWindowAttention(4, 16), (q, k, v, _window_mask(2, 16)))) == 1


def test_a_mask_added_after_the_softmax_is_not_matched():
    args = _inputs(8, 2, 16, 16, torch.float32, 4)
    assert _attention_matches(_MaskAfterSoftmax(2, 16), args) == []
    assert len(_attention_matches(CosineWindowAttention(2, 16, twice=False), args)) == 1


# ------------------------------------------------------------------------------------------- the real model

tf = pytest.importorskip("transformers")

SPEC = ("transformers:Swinv2Config?depths=[2,2]&num_heads=[2,4]&embed_dim=32&image_size=32&patch_size=4"
        "&window_size=4&drop_path_rate=0.0")


def _swinv2(dtype=torch.float32):
    from autofuse.models import build_transformers
    torch.manual_seed(0)
    return build_transformers(SPEC, seq=16, batch=2, attn="eager", dtype=dtype)


def _f64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _shifted(model) -> list:
    return [b.shift_size for layer in model.swinv2.encoder.layers for b in layer.blocks] if hasattr(model, "swinv2") \
        else [b.shift_size for layer in model.encoder.layers for b in layer.blocks]


# bf16 runs with -m slow: the same 16-bit path as fp16 (the verifier's bound against float64) through the same
# model, covered by [dtype1] (fp16) and, in bf16, by the cosine-attention tests above (the same scores, per-head
# scale, bias and window mask added twice through the 5-D view, at both shapes, eval and training)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_swinv2_every_attention_block_is_fused_as_eager(dtype):
    """Four blocks: the first stage's second one shifted (its window mask added through the 5-D view), the second
    stage's unshifted (its image fits one window): each fused, the output as eager's."""
    model, (args, kwargs) = _swinv2(dtype)
    ref = copy.deepcopy(model).double()
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    att = fused.report.of("attention")
    assert len(att) == 4 and all(d.applied and d.params.get("scale_per_head") for d in att), fused.report.summary()
    assert sum(len(d.params["mask_terms"]) == 3 for d in att) == 1          # the shifted block: bias and mask twice
    assert _shifted(model)[1] > 0
    with torch.no_grad():
        want, got = (main_output(m(*args, **kwargs)) for m in (model, fused))
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        else:
            f64 = main_output(ref(*[_f64(a) for a in args], **{k: _f64(a) for k, a in kwargs.items()}))
            ok, err, tol = compare(want, f64, got)
            assert ok, (err, tol)


def test_swinv2_trains_with_eagers_gradients():
    """Training mode (dropout 0 by default, drop path off): every parameter's gradient, the per-head logit scales'
    among them, is eager's up to fp32 rounding."""
    model, (args, kwargs) = _swinv2()
    model.train()
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    assert sum(d.applied for d in fused.report.of("attention")) == 4, fused.report.summary()
    grads = []
    for m in (fused, model):
        model.zero_grad()
        out = main_output(m(*args, **kwargs))
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        (out * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert sum("logit_scale" in n for n in grads[0]) == 4
    for n, want in grads[1].items():
        # fp32 both sides; gradients here reach 277, so each is bounded relative to its own largest: the per-head
        # scale's sums B·N·N products (its host recompute in another order than eager's), measured 1.2e-05
        err = (grads[0][n] - want).abs().max().item()
        assert err <= 5e-5 * want.abs().max().item(), (n, err, want.abs().max().item())
