"""The score-bound kernel: per core, the largest squared row norm of q and of k, as torch computes it."""
import math

import numpy as np
import pytest
import torch

from autofuse import npu
from autofuse.npu.machine import CapacityError
from autofuse.ops import SKIP_MARGIN, causal_skip_is_exact


def _rand(*shape, dtype=torch.float16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _maxima(r):
    return r.outputs[0][:, :, 0].max(axis=0)


@pytest.mark.parametrize("device", npu.devices())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qs,ks", [((2, 3, 77, 64), (2, 1, 80, 64)), ((1, 1, 5, 80), (1, 1, 5, 80)),
                                   ((1, 4, 1, 128), (1, 2, 300, 128)), ((3, 200, 16), (3, 200, 16))])
def test_maxima_equal_torch(device, dtype, qs, ks):
    q, k = _rand(*qs, dtype=dtype, scale=3.0), _rand(*ks, dtype=dtype, seed=1)
    got = _maxima(npu.run("score_bound", q, k, device=device))
    want = [(t.float() ** 2).sum(-1).max().item() for t in (q, k)]
    # fp32 sums of at most 128 fp32 squares, in another order than torch's: a few roundings of the sum
    np.testing.assert_allclose(got, want, rtol=128 * 2 ** -24)


def test_the_row_with_the_largest_norm_is_found_wherever_it_is():
    q, k = _rand(2, 4, 333, 64), _rand(2, 4, 333, 64, seed=1)
    for row in (0, 1, 332, 2 * 4 * 333 - 1, 1000):
        qq = q.clone().view(-1, 64)
        qq[row] = 30.0
        got = _maxima(npu.run("score_bound", qq.view_as(q), k))
        assert got[0] == np.float32(30.0 ** 2 * 64)


def test_nan_and_inf_reach_the_bound():
    q, k = _rand(1, 2, 100, 64), _rand(1, 2, 100, 64, seed=1)
    q[0, 1, 57, 3] = float("nan")
    k[0, 0, 99, 0] = float("inf")
    got = _maxima(npu.run("score_bound", q, k))
    assert math.isnan(got[0]) and got[1] == np.inf


def test_a_tile_larger_than_ub_is_a_capacity_error():
    with pytest.raises(CapacityError, match="UB"):
        npu.run("score_bound", _rand(1, 1, 4096, 128), _rand(1, 1, 4096, 128), tiling={"rows": 4096})


def test_mismatched_head_dims_are_refused():
    with pytest.raises(ValueError, match="last dim"):
        npu.run("score_bound", _rand(1, 1, 8, 64), _rand(1, 1, 8, 32))


def _partials(mq, mk):
    return np.array([[[mq] * 8, [mk] * 8]], dtype=np.float32)


def test_skip_decision_follows_the_cauchy_schwarz_bound():
    fp16_min = float(torch.finfo(torch.float16).min)
    # |q| = |k| = 100, scale 1/8: |score| <= 1250; 2 * 1250 - 65504 is far below the margin
    assert causal_skip_is_exact(_partials(1e4, 1e4), 0.125, fp16_min, additive=True)
    # the bound 2A + value must stay below -SKIP_MARGIN: A just under and just over the limit
    a = (-fp16_min - SKIP_MARGIN) / 2
    under, over = (a * 0.99 / 1.001) ** 2, (a * 1.01) ** 2
    assert causal_skip_is_exact(_partials(under, 1.0), 1.0, fp16_min, additive=True)
    assert not causal_skip_is_exact(_partials(over, 1.0), 1.0, fp16_min, additive=True)
    # a fill (bool mask) replaces the score: only one A counts
    assert causal_skip_is_exact(_partials(over, 1.0), 1.0, fp16_min, additive=False)
    # -1e4 with unit-norm rows but a large scale; a negative scale bounds the same
    assert not causal_skip_is_exact(_partials(1.0, 1.0), 1e4, -1e4, additive=False)
    assert causal_skip_is_exact(_partials(1.0, 1.0), -1.0, -1e4, additive=True)
    for bad in (float("nan"), float("inf")):
        assert not causal_skip_is_exact(_partials(bad, 1.0), 0.125, fp16_min, additive=True)
    # soft-capped scores (c·tanh(s / c)) stay within c whatever the rows' norms; a NaN or inf still fails
    assert causal_skip_is_exact(_partials(over, 1.0), 1.0, fp16_min, additive=True, softcap=50.0)
    assert not causal_skip_is_exact(_partials(1.0, 1.0), 1.0, -60.0, additive=False, softcap=50.0 + SKIP_MARGIN)
    for bad in (float("nan"), float("inf")):
        assert not causal_skip_is_exact(_partials(bad, 1.0), 0.125, fp16_min, additive=True, softcap=50.0)


@pytest.mark.parametrize("device", npu.devices())
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_cost_model_prices_the_tiling_the_kernel_picks(device, dtype):
    import cost_model
    from cost_model.devices import get_device
    from cost_model.vecutil import score_bound_rows      # the kernel's default rows, shared with the model
    dev = get_device(device)
    for D in (16, 64, 80, 128, 256):
        rows = 4 * 2 * 1000
        per_core = -(-rows // dev.vector_cores)
        e = cost_model.estimate("score_bound", [((4, 2, 1000, D), dtype)] * 2, device=device)
        assert e.tiling == {"rows": score_bound_rows(dev, dtype, D, per_core)}
