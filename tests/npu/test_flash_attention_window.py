"""Sliding-window attention (CANN's band sparse mode): query i sees keys ``i - window < j <= i``. The forward and
backward kernels against torch with the band as an explicit mask (values, probabilities, gradients); the KV tiles
outside the band are skipped, not computed and masked; the window's argument errors."""
import numpy as np
import pytest
import torch

from autofuse import npu
from autofuse.ops import band_keep, reference_flash_attention
from npu.test_flash_attention import PTOL, TOL, _inputs, _ref
from npu.test_flash_attention_grad import _check_vs_eager, _ref64, _run
from npu.test_flash_attention_grad import _inputs as _grad_inputs

DEVICES = ["ascend910", "ascend910b", "ascend310p"]
# (B, N, Nkv, Sq, Skv, D, window, tiling): a window inside one tile, one across tiles, one not a multiple of the
# tile, a window of one key (the diagonal alone), Sq > Skv + window (rows past the keys: nothing to attend)
SHAPES = [(1, 2, 1, 100, 100, 32, 7, None), (2, 4, 2, 300, 300, 64, 70, {"q": 64, "kv": 64}),
          (1, 2, 2, 130, 130, 64, 128, None), (1, 2, 1, 70, 70, 16, 1, {"q": 16, "kv": 16}),
          (1, 1, 1, 64, 20, 32, 5, {"q": 16, "kv": 16})]


def _tiling(device, t):
    if t is None:
        return {}
    return {"tiling": {**t, "vq": t["q"] // 2 if device == "ascend910b" else t["q"]}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_equals_the_band_as_a_mask(device, dtype, shape):
    *dims, w, t = shape
    q, k, v = _inputs(*dims, dtype, seed=w)
    r = npu.run("flash_attention", q, k, v, causal=True, window=w, return_probs=True, device=device,
                **_tiling(device, t))
    out, p = _ref(q, k, v, mask=band_keep(dims[3], dims[4], w))
    got = torch.as_tensor(np.asarray(r.outputs[0], dtype=np.float32))
    assert (got - out).abs().max().item() <= TOL[dtype] * max(1.0, out.abs().max().item())
    gp = torch.as_tensor(np.asarray(r.outputs[1], dtype=np.float32))
    assert (gp - p).abs().max().item() <= PTOL[dtype]
    assert (gp[..., ~band_keep(dims[3], dims[4], w)] == 0).all()    # outside the band: written, as zeros


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:4])
@pytest.mark.parametrize("stats", [True, False])
def test_backward_no_worse_than_eager(device, dtype, shape, stats):
    """dq, dk, dv with the forward's statistics or recomputing them (phase 1 walks the band too): against float64
    autograd, no worse than eager's own autograd in the dtype (the band given to both as a bool mask). (Every row
    attends a key here: eager's softmax of a row with none is NaN.)"""
    B, N, Nkv, Sq, Skv, D, w, t = shape
    q, k, v, do = _grad_inputs(B, N, Nkv, Sq, Skv, D, D, dtype, seed=w)
    band = band_keep(Sq, Skv, w)
    out, _ = _ref64(q, k, v, do, mask=band)
    kw = {"tiling": t} if t else {}
    if stats:              # each row's max and sum, in float64 then rounded once (as the forward hands them over)
        st = reference_flash_attention(q.double(), k.double(), v.double(), causal=True, window=w,
                                       return_stats=True)[2].float()
        kw.update(softmax_max=st[0], softmax_sum=st[1])
    got, _ = _run(device, q, k, v, out, do, causal=True, window=w, **kw)
    _check_vs_eager(got, q, k, v, do, mask=band)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_skipping_equals_masking(device, dtype, shape):
    """The window kernels against the causal kernels reading the band as a bool mask: the tiles a window skips
    hold only masked scores, whose weights are exact zeros there, so the forward's output and statistics and the
    backward's dk, dv are equal bit for bit. dq is the sum of one partial per KV block, added atomically in the
    order the cores reach them, which the different dealing of the units changes: equal up to reassociating
    that fp32 sum, at most (KV blocks) x u32 x the sum of the partials' magnitudes."""
    B, N, Nkv, Sq, Skv, D, w, t = shape
    q, k, v, do = _grad_inputs(B, N, Nkv, Sq, Skv, D, D, dtype, seed=w)
    band = band_keep(Sq, Skv, w)
    f = [npu.run("flash_attention", q, k, v, causal=True, device=device, return_stats=True, **kw).outputs
         for kw in ({"window": w}, {"mask": band})]
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(*f))
    out = torch.as_tensor(np.asarray(f[0][0], dtype=np.float32)).to(dtype)
    tk = {"tiling": t} if t else {}
    (dq, dk, dv), (mq, mk, mv) = [npu.run("flash_attention_grad", q, k, v, out, do, causal=True, device=device,
                                          **tk, **kw).outputs for kw in ({"window": w}, {"mask": band})]
    assert np.array_equal(dk, mk) and np.array_equal(dv, mv)
    # the partials' magnitudes, in float64: |dS| @ |K| with dS = scale * P * (dP - Dr)
    qd, kd, vd, dod = (x.double() for x in (q, k, v, do))
    o, p, _ = reference_flash_attention(qd, kd, vd, causal=True, window=w, return_probs=True)
    rep = N // Nkv
    dp = dod @ vd.repeat_interleave(rep, 1).transpose(-2, -1)
    ds = (p * (dp - (dod * o).sum(-1, keepdim=True))).abs() * D ** -0.5
    bound = -(-Skv // (t or {"kv": 16})["kv"]) * 2.0 ** -24 * (ds @ kd.abs().repeat_interleave(rep, 1)).max().item()
    ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 0.0}[dtype]
    diff = np.abs(np.asarray(dq, np.float64) - np.asarray(mq, np.float64)).max()
    assert diff <= bound + ulp * np.abs(np.asarray(mq, np.float64)).max(), diff   # + one rounding to the dtype


@pytest.mark.parametrize("device", DEVICES)
def test_tiles_outside_the_band_are_skipped(device):
    """At 2048 tokens a 128-key window walks a few KV tiles per query block, not the causal triangle: the Cube does
    about window/S of the causal work (forward and backward), and a window as long as the sequence is the causal
    kernel, step for step."""
    q = np.zeros((1, 4, 2048, 64), np.float16)
    t = _tiling(device, {"q": 128, "kv": 128})
    causal = npu.run("flash_attention", q, q, q, causal=True, device=device, timing_only=True, **t).stats
    band = npu.run("flash_attention", q, q, q, causal=True, window=128, device=device, timing_only=True, **t).stats
    whole = npu.run("flash_attention", q, q, q, causal=True, window=2048, device=device, timing_only=True, **t).stats
    # causal: 136 tiles of 128x128 per head (16 blocks); the band: 16 blocks x 2 tiles less the first's one
    assert band.busy_total["cube"] * 136 == pytest.approx(causal.busy_total["cube"] * 31, rel=0.01)
    assert whole.cycles == causal.cycles and whole.busy_total == causal.busy_total
    g_causal = npu.run("flash_attention_grad", q, q, q, q, q, causal=True, device=device, timing_only=True).stats
    g_band = npu.run("flash_attention_grad", q, q, q, q, q, causal=True, window=128, device=device,
                     timing_only=True).stats
    assert g_band.busy_total["cube"] < 0.3 * g_causal.busy_total["cube"]
    assert g_band.cycles < 0.5 * g_causal.cycles


@pytest.mark.parametrize("kernel", ["flash_attention", "flash_attention_grad"])
@pytest.mark.parametrize("kw,match", [({"window": 4}, "needs causal"), ({"window": -1, "causal": True}, "whole"),
                                      ({"window": 2.5, "causal": True}, "whole")])
def test_window_errors_name_the_argument(kernel, kw, match):
    q = np.zeros((1, 1, 8, 16), np.float32)
    args = (q, q, q) if kernel == "flash_attention" else (q, q, q, q, q)
    with pytest.raises(ValueError, match=match):
        npu.run(kernel, *args, **kw)
