"""Sliding-window attention found in the graph: a constant mask equal to the causal band ``i - w < j <= i``
(transformers' ``sliding_window_causal_mask_function``: Mistral, Gemma 2's and GPT-OSS's local layers) is proven
and the kernel runs with ``causal=True, window=w``, walking the band's tiles and reading no mask; near misses (a
band that is not that one) stay masks the kernel reads, and every form computes what eager does."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.ops import recording
from conftest import assert_as_eager

FUSED_OP = torch.ops.autofuse.flash_attention.default
B, N, S, D, W = 2, 4, 40, 16, 9


def _qkv(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, N, S, D, generator=g).to(dtype) for _ in range(3))


def _band(kind, s=S, w=W):
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    return {"window": (j <= i) & (j > i - w),
            "bidirectional": (j - i).abs() < w,                          # both sides of the diagonal
            "no_diagonal": (j < i) & (j > i - w) | ((i == 0) & (j == 0)),  # the diagonal left out (row 0 keeps it)
            "hole": ((j <= i) & (j > i - w)) & ~((i == 20) & (j == 17)),  # one key inside the band masked
            "sink_token": ((j <= i) & (j > i - w)) | (j == 0),            # StreamingLLM: key 0 always kept
            }[kind]


class Windowed(nn.Module):
    """Attention over a constant band built in forward from aranges (as transformers builds its masks)."""

    def __init__(self, kind="window", spelling="masked_fill", value=None, w=W):
        super().__init__()
        self.kind, self.spelling, self.value, self.w = kind, spelling, value, w

    def forward(self, q, k, v):
        keep = _band(self.kind, q.shape[-2], self.w)
        if self.spelling == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        value = torch.finfo(s.dtype).min if self.value == "finfo.min" else float("-inf")
        if self.spelling == "additive":
            s = s + torch.zeros(keep.shape, dtype=s.dtype).masked_fill(~keep, value)
        elif self.spelling == "where":
            s = torch.where(keep, s, torch.full([], value, dtype=s.dtype))
        else:
            s = s.masked_fill(~keep, value)
        return torch.softmax(s, -1) @ v


def _decision(fused):
    (d,) = [d for d in fused.report.applied if d.pattern == "attention"]
    (call,) = [n for n in fused.graph_module.graph.nodes if n.op == "call_function" and n.target is FUSED_OP]
    return d, call


@pytest.mark.parametrize("spelling,value", [("masked_fill", None), ("additive", None), ("where", "finfo.min"),
                                            ("additive", "finfo.min"), ("sdpa", None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_causal_band_runs_as_a_window(spelling, value, dtype):
    """-inf, or fp32/bf16's finfo.min (which absorbs any score added to it): the band is the kernel's window, no
    mask input, only the band's tiles launched."""
    model, args = Windowed("window", spelling, value), _qkv(dtype)
    fused = AutoFusionEngine.fuse(model, args)
    d, call = _decision(fused)
    assert d.params["causal"] and d.params["window"] == W and d.params["mask_kind"] is None
    assert call.args[3] is None and call.kwargs["window"] == W
    assert f"a {W}-key sliding window (the band's tiles only, no mask read)" in d.reason
    with recording() as log:
        got = fused(*args)
    assert [k for k, _ in log] == ["flash_attention"]
    assert_as_eager(model, args, got)


def test_a_finite_fp16_band_is_skipped_under_the_score_bound():
    """fp16's finfo.min (-65504) does not absorb a score: the band stays the user's mask, and the kernel skips the
    tiles outside it (the diagonal's and the window's) where the run-time bound on the scores proves their weights
    vanish, as for a finite causal mask."""
    g = torch.Generator().manual_seed(0)
    model = Windowed("window", "where", "finfo.min", w=64)
    args = tuple(torch.randn(1, 8, 1024, 64, generator=g).half() for _ in range(3))   # large enough for the skip
    fused = AutoFusionEngine.fuse(model, args)
    d, call = _decision(fused)
    assert not d.params["causal"] and d.params["causal_value"] == -65504.0 and d.params["window"] == 64
    assert d.params["alternatives"]["ascend910"][0][0] == "causal skip under a score bound"
    assert "a 64-key sliding window (the band's tiles only where the score bound proves the skip exact)" in d.reason
    with recording() as log:
        got = fused(*args)
    assert [k for k, _ in log] == ["score_bound", "flash_attention"]
    assert_as_eager(model, args, got)


class TwoMasks(nn.Module):
    """Two proven masks on the same scores (a window and the causal mask, or two windows): their intersection."""

    def __init__(self, first, second):
        super().__init__()
        self.widths = (first, second)            # 0: the causal mask

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        for w in self.widths:
            s = s.masked_fill(~_band("window", q.shape[-2], w or 10 ** 6), float("-inf"))
        return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("first,second,window", [(W, 0, W), (0, W, W), (5, W, 5), (W, 5, 5)])
def test_two_proven_masks_keep_the_narrower_band(first, second, window):
    model, args = TwoMasks(first, second), _qkv()
    fused = AutoFusionEngine.fuse(model, args)
    d, call = _decision(fused)
    assert d.params["causal"] and d.params["window"] == window and call.args[3] is None
    assert_as_eager(model, args, fused(*args))


@pytest.mark.parametrize("kind", ["bidirectional", "no_diagonal", "hole", "sink_token"])
@pytest.mark.parametrize("spelling", ["masked_fill", "sdpa"])
def test_bands_that_are_not_a_sliding_window_stay_masks(kind, spelling):
    """Not the causal band: fused with the mask read as it is (window 0), and equal to eager."""
    model, args = Windowed(kind, spelling), _qkv()
    fused = AutoFusionEngine.fuse(model, args)
    d, call = _decision(fused)
    assert d.params["window"] == 0 and d.params["mask_kind"] == "bool" and call.args[3] is not None, kind
    assert_as_eager(model, args, fused(*args))


@pytest.mark.parametrize("w,window", [(1, 1), (S - 1, S - 1), (S, 0), (S + 3, 0)])
def test_window_widths(w, window):
    """A window of one key (the diagonal alone) up to S - 1; one of S keys or more is the causal mask itself."""
    model, args = Windowed("window", "masked_fill", w=w), _qkv()
    fused = AutoFusionEngine.fuse(model, args)
    d, _ = _decision(fused)
    assert d.params["causal"] and d.params["window"] == window
    assert_as_eager(model, args, fused(*args))


def test_a_window_trains_with_eagers_gradients():
    """Training: the forward saves its statistics and the backward kernel walks the band (its launch recorded);
    q, k, v's gradients equal eager's."""
    model = Windowed("window", "masked_fill")
    args = tuple(t.requires_grad_() for t in _qkv())
    fused = AutoFusionEngine.fuse(model, args)
    got, want = [], []
    with recording() as log:
        fused(*args).square().sum().backward()
    assert [k for k, _ in log].count("flash_attention_grad") == 1
    got = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    model(*args).square().sum().backward()
    want = [a.grad for a in args]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)       # fp32 both sides


@pytest.mark.parametrize("faulty", [False, True])
def test_a_windows_reduced_check_runs_the_band(monkeypatch, faulty):
    """A block too large to check at its size is checked on reduced sequences; a window's are the window plus 80
    keys (at 80 a 100-key window is the causal mask), so a kernel that ignored the window is caught there."""
    from autofuse import ops
    if faulty:
        real = ops.run_kernel

        def no_window(name, *a, **kw):
            if name == "flash_attention":
                kw.pop("window", None)
            return real(name, *a, **kw)
        monkeypatch.setattr(ops, "run_kernel", no_window)
    g = torch.Generator().manual_seed(0)
    model = Windowed("window", "masked_fill", w=100)
    args = tuple(torch.randn(1, 8, 1024, 32, generator=g) for _ in range(3))   # 64 MiB of float64 scores
    fused = AutoFusionEngine.fuse(model, args)
    (d,) = fused.report.of("attention")
    assert "verified on reduced shapes (1024 -> 180)" in d.verify_note
    assert d.applied != faulty and (d.reason_code == "verification_failed") == faulty, d.reason


class SharedLongMask(nn.Module):
    """Two attention layers reading one band mask materialised per batch (as transformers builds it), long enough
    that the mask (2 x 3000^2 = 18 M values) is read by the proof in row blocks and stands for itself in the
    reduced-shape check as an input both blocks share."""

    def __init__(self, w, hole=False):
        super().__init__()
        self.w, self.hole = w, hole

    def forward(self, x):
        b, n, s, d = x.shape
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        keep = torch.ones(b, 1, s, s, dtype=torch.bool) & (j <= i) & (j > i - self.w)
        if self.hole:                                   # one key inside the band masked, in the last row block
            keep = keep & ~((i == s - 1) & (j == s - 2))
        for _ in range(2):
            x = torch.softmax((x @ x.transpose(-1, -2) * d ** -0.5).masked_fill(~keep, float("-inf")), -1) @ x
        return x


@pytest.mark.parametrize("hole", [False, True])
def test_a_long_mask_is_proven_in_row_blocks_and_checked_as_itself(hole):
    from autofuse.canonicalize import LARGEST_CONSTANT
    from patterns.attention import PROOF_CHUNK
    x = torch.randn(2, 1, 3000, 8, generator=torch.Generator().manual_seed(0))
    assert PROOF_CHUNK < 2 * 3000 ** 2 <= LARGEST_CONSTANT and 2 * 3000 ** 2 > 1 << 24
    model = SharedLongMask(300, hole)
    fused = AutoFusionEngine.fuse(model, (x,))
    attention = fused.report.of("attention")
    assert len(attention) == 2 and all(d.applied for d in attention), fused.report.summary()
    assert [d.params["window"] for d in attention] == [0, 0] if hole else [300, 300]
    assert all("verified on reduced shapes (3000 -> " in d.verify_note for d in attention)
    assert_as_eager(model, (x,), fused(x))
