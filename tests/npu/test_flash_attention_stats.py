"""FlashAttention's saved softmax statistics (``return_stats``): each row's max and sum against float64 on every
device and dtype (GQA, causal, bool and additive masks, fully masked rows, finite fills, dropout), and the
backward kernel given them: the gradients of its own recompute, in fewer cycles."""
import math

import numpy as np
import pytest
import torch

from autofuse import npu
from autofuse.npu.kernels.dropout import pack_keep

DEVICES = ["ascend910", "ascend910b", "ascend310p"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
U32 = 2.0 ** -24


def _inputs(B, N, Nkv, Sq, Skv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype)
            for shape in ((B, N, Sq, D), (B, Nkv, Skv, D), (B, Nkv, Skv, D))]


def _mask(kind, B, Sq, Skv, seed=1):
    """A mask with some rows masked entirely (rows 3 and 5 of the first batch): they attend nothing."""
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "bool":
        m = torch.rand(B, 1, Sq, Skv, generator=g) < 0.6
        m[0, :, 3] = False
        m[0, :, min(5, Sq - 1)] = False
        return m
    return (torch.randn(B, 1, Sq, Skv, generator=g) * 2).to(torch.float16)


def _f64(x) -> torch.Tensor:
    """A kernel output (numpy, or a torch tensor for bf16) as float64."""
    return x.double() if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x, dtype=np.float64))


def _ref64(q, k, v, mask, causal, fill):
    """float64 statistics of the same inputs: the row max of the scaled masked scores, the sum of exp(x - max)
    (a row with every score -inf: -inf and 0); and per row the bound on the kernel's fp32 score error."""
    rep = q.shape[1] // k.shape[1]
    kd = k.double().repeat_interleave(rep, 1)
    scale = q.shape[-1] ** -0.5
    s = (q.double() @ kd.transpose(-2, -1)) * scale
    # fp32 scores: a D-term dot product of exactly representable products (|error| <= D·u·Σ|q_d k_d|), one
    # rounding of the dot and one of the scale; the mask's add one more rounding of |x|
    mag = (q.double().abs() @ kd.abs().transpose(-2, -1)) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, fill)
        else:
            s = s + mask.double()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    err = ((q.shape[-1] + 2) * mag + s.abs().nan_to_num(posinf=0, neginf=0)) * U32
    m = s.amax(-1)
    e = torch.exp(s - torch.where(torch.isneginf(m), 0.0, m)[..., None])
    return m, e.sum(-1), err.amax(-1)


CASES = {  # name: (B, N, Nkv, Sq, Skv, D), mask kind, causal, fill
    "gqa_causal": ((2, 4, 2, 70, 150, 64), None, True, float("-inf")),
    "bool_masked_rows": ((2, 2, 1, 40, 90, 32), "bool", False, float("-inf")),
    "bool_causal_finite_fill": ((1, 4, 4, 40, 40, 64), "bool", True, -65504.0),
    "additive": ((2, 2, 2, 33, 130, 64), "additive", False, float("-inf")),
}


def _check_stats(m, lsum, ref, skv):
    """Kernel max and sum against float64. Max: the scores' fp32 error δ (``_ref64``). Sum: each term
    exp(x - m) carries 2δ (x and m) and exp's own rounding, the fp32 sum one rounding per term: relative
    ≤ 2δ + (Skv + 4)·u. Rows with no key: max and sum exactly -inf and 0."""
    m64, l64, delta = ref
    m, lsum = _f64(m), _f64(lsum)
    assert m.shape == m64.shape and lsum.shape == l64.shape
    empty = torch.isneginf(m64)
    assert torch.equal(torch.isneginf(m), empty)
    assert torch.all(lsum[empty] == 0)
    keep = ~empty
    assert torch.all((m - m64)[keep].abs() <= delta[keep])
    rel = (lsum - l64)[keep].abs() / l64[keep]
    assert torch.all(rel <= 2.5 * delta[keep] + (skv + 4) * U32), rel.max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_stats_match_float64(device, dtype, case):
    shape, kind, causal, fill = CASES[case]
    B, N, Nkv, Sq, Skv, D = shape
    q, k, v = _inputs(*shape, dtype)
    mask = _mask(kind, B, Sq, Skv)
    r = npu.run("flash_attention", q, k, v, mask=mask, causal=causal, fill=fill, return_stats=True, device=device)
    assert len(r.outputs) == 3 and r.outputs[1].dtype == r.outputs[2].dtype == np.float32
    _check_stats(r.outputs[1], r.outputs[2], _ref64(q, k, v, mask, causal, fill), Skv)
    if kind == "bool" and math.isfinite(fill):
        # every key of rows 3 and 5 takes the finite fill: max = fill, sum = the keys the row sees (exact)
        m, lsum = np.asarray(r.outputs[1]), np.asarray(r.outputs[2])
        for row in (3, 5):
            assert np.all(m[0, :, row] == np.float32(fill)) and np.all(lsum[0, :, row] == row + 1)
    # the output is the same launch's with or without the statistics
    plain = npu.run("flash_attention", q, k, v, mask=mask, causal=causal, fill=fill, device=device)
    assert np.array_equal(np.asarray(plain.outputs[0]), np.asarray(r.outputs[0]), equal_nan=True)
    assert r.stats.cycles >= plain.stats.cycles


@pytest.mark.parametrize("device", DEVICES)
def test_stats_are_before_dropout_and_with_probs_the_same(device):
    """Dropout comes after the row sum (the softmax's denominator): the statistics are those without it, bit for
    bit; with return_probs too they follow the probabilities, unchanged."""
    q, k, v = _inputs(2, 4, 2, 70, 100, 64, torch.float16)
    keep = np.random.default_rng(3).random((2, 4, 70, 100)) < 0.8
    base = npu.run("flash_attention", q, k, v, causal=True, return_stats=True, device=device)
    drop = npu.run("flash_attention", q, k, v, causal=True, return_stats=True, drop_mask=pack_keep(keep),
                   keep_prob=0.8, device=device)
    both = npu.run("flash_attention", q, k, v, causal=True, return_stats=True, return_probs=True, device=device)
    assert len(both.outputs) == 4
    for a, b in ((base, drop), (base, both)):
        assert np.array_equal(np.asarray(a.outputs[-2]), np.asarray(b.outputs[-2]))
        assert np.array_equal(np.asarray(a.outputs[-1]), np.asarray(b.outputs[-1]))
    assert not np.array_equal(np.asarray(base.outputs[0]), np.asarray(drop.outputs[0]))


def test_stats_stores_are_counted():
    """Two fp32 values a row leave UB for GM (and reach HBM as outputs): 8·B·N·Sq bytes more."""
    q, k, v = _inputs(2, 4, 2, 70, 100, 64, torch.float16)
    for device in DEVICES:
        a = npu.run("flash_attention", q, k, v, device=device).stats
        b = npu.run("flash_attention", q, k, v, return_stats=True, device=device).stats
        assert b.bytes["UB->GM"] - a.bytes["UB->GM"] == 8 * 2 * 4 * 70
        assert b.hbm_bytes - a.hbm_bytes == 8 * 2 * 4 * 70


def _grad_bounds(q, k, v, out, do, mask, causal, keep, keep_prob):
    """How far dq, dk, dv may move when the backward's statistics come from the forward instead of its own
    recompute. Both are fp32 computations of the same max and sum (scores up to δ, ``_ref64``; sums up to
    (Skv + 4)·u apart), so P moves by ε = 2δ + (Skv + 4)·u relative, and by one ulp of the operand dtype more
    where that crosses a rounding boundary (Pd and dS are rounded to it): |ΔPd| ≤ (ε + 2u_op)·|Pd|,
    |ΔdS| ≤ (ε + 2u_op)·scale·|P|·|dP·keep - Dr|. The products then move by Σ|Δ|·|operand|, their fp32 sums
    by 2n·u·Σ|terms| (n terms, two runs), and the results by one ulp of their dtype each."""
    m64, l64, delta = _ref64(q, k, v, mask, causal, float("-inf"))
    rep = q.shape[1] // k.shape[1]
    kd, vd = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    qd, dod, od = q.double(), do.double(), out.double()
    scale = q.shape[-1] ** -0.5
    s = (qd @ kd.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    kp = torch.ones_like(p) if keep is None else torch.from_numpy(np.asarray(keep)).double() / keep_prob
    dp = dod @ vd.transpose(-2, -1)
    dr = (dod * od).sum(-1, keepdim=True)
    u_op = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: U32}[q.dtype]
    eps = 2 * delta[..., None] + (k.shape[2] + 4) * U32 + 2 * u_op
    dpd = eps * p * kp
    dds = eps * scale * p * (dp * kp - dr).abs()
    B, Nkv, Skv, Sq = k.shape[0], k.shape[1], k.shape[2], q.shape[2]
    pd = p * kp
    ds = scale * p * (dp * kp - dr).abs()

    def heads(x):                      # GQA: the query heads of a kv head summed
        return x.reshape(B, Nkv, rep, *x.shape[2:]).sum(2)

    move = [dds @ kd.abs(), heads(dds.transpose(-2, -1) @ qd.abs()), heads(dpd.transpose(-2, -1) @ dod.abs())]
    sums = [(ds @ kd.abs(), Skv), (heads(ds.transpose(-2, -1) @ qd.abs()), Sq * rep),
            (heads(pd.transpose(-2, -1) @ dod.abs()), Sq * rep)]
    return [mv + 2 * n * U32 * t for mv, (t, n) in zip(move, sums)], u_op


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,causal,drop", [(None, True, False), ("bool", False, True), ("additive", True, False)])
def test_grad_given_forward_stats(device, dtype, kind, causal, drop):
    """The backward kernel given the forward's statistics: the gradients of its own recompute (within
    ``_grad_bounds``; bit for bit in these fp16 and bf16 cases), without its recompute sweep (fewer cycles)."""
    B, N, Nkv, Sq, Skv, D = 2, 4, 2, 40, 72, 32
    q, k, v = _inputs(B, N, Nkv, Sq, Skv, D, dtype)
    mask = _mask(kind, B, Sq, Skv)
    kw = dict(mask=mask, causal=causal, device=device)
    keep = None
    if drop:
        keep = np.random.default_rng(4).random((B, N, Sq, Skv)) < 0.9
        kw.update(drop_mask=pack_keep(keep), keep_prob=0.9)
    fwd = npu.run("flash_attention", q, k, v, return_stats=True, **kw)
    out = _f64(fwd.outputs[0]).to(dtype)
    do = torch.randn(B, N, Sq, D, generator=torch.Generator().manual_seed(9)).to(dtype)
    own = npu.run("flash_attention_grad", q, k, v, out, do, **kw)
    given = npu.run("flash_attention_grad", q, k, v, out, do, softmax_max=fwd.outputs[1],
                    softmax_sum=fwd.outputs[2], **kw)
    bounds, u_op = _grad_bounds(q, k, v, out, do, mask, causal, keep, 0.9)
    for a, b, bound in zip(own.outputs, given.outputs, bounds):
        a, b = _f64(a), _f64(b)
        assert torch.all((a - b).abs() <= bound + 2 * u_op * a.abs())
    assert given.stats.cycles < own.stats.cycles
