"""Dropout on the simulator: the keep-mask generator writes the host's draws as bits, and FlashAttention with a
keep-mask (FlashAttentionScore's ``drop_mask``) drops exactly the masked weights of the full softmax."""
import numpy as np
import pytest
import torch

import cost_model
from autofuse import npu
from autofuse.npu.kernels import dropout as kernel
from autofuse.npu.kernels.dropout import HostDraws, pack_keep
from cost_model import dropout as model

DEVICES = npu.devices()
# P and the output are rounded to the operand dtype once each (fp32 statistics and accumulation), as without
# dropout; the kept weights are scaled by 1/keep (1.25 here), which scales the output's rounding with them
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 3, 37, 45), (1, 1, 1, 8), (4, 130), (7,), (2, 2, 64, 1000)])
def test_gen_mask_writes_the_draws_bit_for_bit(device, shape):
    keep = np.random.default_rng(0).random(shape) < 0.8
    r = npu.run("dropout_gen_mask", shape=shape, keep_prob=0.8, draws=HostDraws(keep), device=device)
    got = r.outputs[0]
    assert got.dtype == np.uint8 and got.shape == (*shape[:-1], -(-shape[-1] // 8))
    np.testing.assert_array_equal(got, pack_keep(keep))
    np.testing.assert_array_equal(np.unpackbits(got, axis=-1, count=shape[-1], bitorder="little").astype(bool), keep)
    t = npu.run("dropout_gen_mask", shape=shape, keep_prob=0.8, device=device, timing_only=True)
    assert (t.stats.cycles, t.stats.hbm_bytes) == (r.stats.cycles, r.stats.hbm_bytes)
    # nothing is read; every byte of the mask is written once
    assert r.stats.hbm_bytes == got.size and r.stats.bytes.get("GM->UB", 0) == 0


def test_gen_mask_needs_the_draws_to_compute_values():
    with pytest.raises(ValueError, match="HostDraws"):
        npu.run("dropout_gen_mask", shape=(4, 16), keep_prob=0.9)
    with pytest.raises(ValueError, match="keep_prob"):
        npu.run("dropout_gen_mask", shape=(4, 16), keep_prob=1.5, timing_only=True)


def test_gen_mask_cost_is_the_vector_generator():
    """The Philox passes set the time: about PHILOX_PASSES int32 passes per element on every vector core."""
    for device in DEVICES:
        dev = cost_model.get_device(device)
        shape = (8, 12, 64, 1024)
        r = npu.run("dropout_gen_mask", shape=shape, keep_prob=0.9, device=device, timing_only=True)
        passes = np.prod(shape) * kernel.PHILOX_PASSES / (dev.vector_bytes_per_cycle // 4) / dev.vector_cores
        assert r.stats.bound == "vector" and passes <= r.stats.busy["vector"] <= 1.05 * passes


def test_cost_model_restates_the_kernel():
    """The cost model's copy of the kernel's constants and UB layout (it imports no simulator code)."""
    assert model.PHILOX_PASSES == kernel.PHILOX_PASSES and model.STATE_WORDS == kernel.STATE_WORDS
    for R, cols in ((1, 7), (16, 1000), (5, 4096)):
        assert model._specs(R, cols) == kernel.specs(R, cols)
    for device in DEVICES:
        dev = cost_model.get_device(device)
        assert model._rows(dev, 1024, 777) == kernel.default_rows(dev, 1024, 777)


def _ref(q, k, v, keep, p, causal=False, mask=None):
    """float64 attention on the same inputs, the kept weights of the full softmax scaled by 1/(1-p)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    w = torch.softmax(s, -1) * torch.as_tensor(keep) / (1 - p)
    return w @ v.double()


def _inputs(B, N, Sq, Skv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for shape in ((B, N, Sq, D), (B, N, Skv, D), (B, N, Skv, D))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,causal", [((1, 2, 33, 130, 64), False), ((2, 2, 130, 130, 64), True),
                                          ((1, 1, 7, 5, 16), False), ((1, 3, 200, 300, 128), True)])
def test_flash_attention_drops_the_masked_weights(device, dtype, shape, causal):
    q, k, v = _inputs(*shape, dtype)
    B, N, Sq, Skv, _ = shape
    keep = np.random.default_rng(1).random((B, N, Sq, Skv)) < 0.75
    r = npu.run("flash_attention", q, k, v, causal=causal, drop_mask=pack_keep(keep), keep_prob=0.75, device=device)
    want = _ref(q, k, v, keep, 0.25, causal)
    got = torch.as_tensor(np.asarray(r.outputs[0], dtype=np.float32)).double()
    assert (got - want).abs().max().item() <= TOL[dtype] * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_dropped_weights_are_exactly_zero(device):
    """With V the identity, the output is the dropped-out weights themselves: zero exactly where dropped."""
    Sq = Skv = D = 64
    q, k, _ = _inputs(1, 2, Sq, Skv, D, torch.float32)
    v = torch.eye(Skv).expand(1, 2, Skv, Skv).contiguous()
    keep = np.random.default_rng(2).random((1, 2, Sq, Skv)) < 0.5
    keep[..., 0] = True
    r = npu.run("flash_attention", q, k, v, drop_mask=pack_keep(keep), keep_prob=0.5, device=device)
    np.testing.assert_array_equal(r.outputs[0] != 0, keep)


@pytest.mark.parametrize("device", DEVICES)
def test_drop_mask_composes_with_a_mask(device):
    q, k, v = _inputs(1, 2, 70, 90, 32, torch.float16)
    mask = torch.rand(1, 2, 70, 90, generator=torch.Generator().manual_seed(3)) < 0.7
    mask[..., 0] = True
    keep = np.random.default_rng(4).random((1, 2, 70, 90)) < 0.9
    r = npu.run("flash_attention", q, k, v, mask=mask, drop_mask=pack_keep(keep), keep_prob=0.9, device=device)
    want = _ref(q, k, v, keep, 0.1, mask=mask)
    got = torch.as_tensor(np.asarray(r.outputs[0], dtype=np.float32)).double()
    assert (got - want).abs().max().item() <= TOL[torch.float16] * max(1.0, want.abs().max().item())


def test_keeping_everything_is_no_dropout():
    q, k, v = _inputs(1, 2, 100, 100, 64, torch.float16)
    keep = np.ones((1, 2, 100, 100), dtype=bool)
    a = npu.run("flash_attention", q, k, v, causal=True, drop_mask=pack_keep(keep), keep_prob=1.0).outputs[0]
    b = npu.run("flash_attention", q, k, v, causal=True).outputs[0]
    np.testing.assert_array_equal(a, b)


def test_drop_mask_traffic_is_one_bit_per_attended_score():
    q, k, v = _inputs(2, 4, 256, 256, 64, torch.float16)
    bits = pack_keep(np.ones((2, 4, 256, 256), dtype=bool))
    for causal in (False, True):
        a = npu.run("flash_attention", q, k, v, causal=causal, drop_mask=bits, keep_prob=0.9, timing_only=True)
        b = npu.run("flash_attention", q, k, v, causal=causal, timing_only=True)
        extra = a.stats.hbm_bytes - b.stats.hbm_bytes
        full = bits.size
        if causal:           # the tiles on or below the diagonal: 3 of the 4 128x128 tiles of a head
            assert extra == 0.75 * full
        else:
            assert extra == full


def test_bad_drop_masks_are_refused_with_the_shape_needed():
    q, k, v = _inputs(1, 2, 40, 50, 32, torch.float16)
    with pytest.raises(ValueError, match=r"uint8 \[1, 2, 40, 7\]"):
        npu.run("flash_attention", q, k, v, drop_mask=np.zeros((1, 2, 40, 50), dtype=np.uint8), keep_prob=0.9)
    with pytest.raises(ValueError, match="keep_prob"):
        npu.run("flash_attention", q, k, v, drop_mask=np.zeros((1, 2, 40, 7), dtype=np.uint8), keep_prob=0.0)
    with pytest.raises(ValueError, match="return_probs"):
        npu.run("flash_attention", q, k, v, drop_mask=np.zeros((1, 2, 40, 7), dtype=np.uint8), keep_prob=0.9,
                return_probs=True)
