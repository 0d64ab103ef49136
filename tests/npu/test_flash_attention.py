"""FlashAttention kernel against torch: shapes, dtypes, masks, causal, GQA, probabilities, devices; its
rounding helper bit for bit; its tilings; and its memory traffic (HBM near the minimum, K/V re-reads in L2)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autofuse import npu
from autofuse.npu.kernels.flash_attention import default_tiling, min_hbm_bytes, round_to, tiling_fits
from cost_model.devices import get_device

DEVICES = ["ascend910", "ascend910b", "ascend310p"]
# P and the output are rounded to the operand dtype once each (fp32 stats and accumulation)
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}
PTOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}


def _ref(q, k, v, mask=None, causal=False, scale=None):
    """fp32 attention on the same (low-precision) inputs; rows with nothing to attend give 0."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = (q.float() @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    return p @ v, p


def _inputs(B, N, Nkv, Sq, Skv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype)
            for shape in ((B, N, Sq, D), (B, Nkv, Skv, D), (B, Nkv, Skv, D))]


def _check(r, q, k, v, mask=None, causal=False, scale=None, probs=False):
    out, p = _ref(q, k, v, mask, causal, scale)
    got = torch.as_tensor(np.asarray(r.outputs[0], dtype=np.float32))
    assert got.shape == out.shape
    assert r.outputs[0].dtype == (np.float16 if q.dtype == torch.float16 else np.float32)
    err = (got - out).abs().max().item()
    assert err <= TOL[q.dtype] * max(1.0, out.abs().max().item()), err
    if probs:
        gp = torch.as_tensor(np.asarray(r.outputs[1], dtype=np.float32))
        assert gp.shape == p.shape
        perr = (gp - p).abs().max().item()
        assert perr <= PTOL[q.dtype], perr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1, 16), (1, 2, 1, 7, 33, 72), (2, 2, 2, 33, 130, 64),
                                   (1, 3, 3, 130, 7, 128)])
def test_matches_reference(device, dtype, shape):
    q, k, v = _inputs(*shape, dtype)
    _check(npu.run("flash_attention", q, k, v, device=device), q, k, v)


def test_semantics_equal_torch_sdpa():
    """Bool mask True = attend, additive float masks, top-left causal, GQA: as F.scaled_dot_product_attention."""
    q, k, v = _inputs(2, 4, 2, 40, 70, 32, torch.float32, seed=1)
    g = torch.Generator().manual_seed(5)
    bmask = torch.rand(2, 1, 40, 70, generator=g) > 0.3
    fmask = torch.randn(40, 70, generator=g)
    for kw, tkw in [({"mask": bmask}, {"attn_mask": bmask}), ({"mask": fmask}, {"attn_mask": fmask}),
                    ({"causal": True}, {"is_causal": True}), ({"scale": 0.3}, {"scale": 0.3})]:
        r = npu.run("flash_attention", q, k, v, **kw)
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **tkw)
        assert np.abs(r.outputs[0] - ref.numpy()).max() < 2e-5, kw


MASKS = {  # name -> mask shape for B=2, N=2, Sq=33, Skv=70
    "SS": (33, 70), "11SS": (1, 1, 33, 70), "B1SS": (2, 1, 33, 70), "BNSS": (2, 2, 33, 70),
    "padding B11S": (2, 1, 1, 70), "keys S": (70,), "rows BNS1": (2, 2, 33, 1),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize("mdtype", [torch.bool, torch.float16, torch.float32])
def test_masks(device, kind, mdtype):
    q, k, v = _inputs(2, 2, 2, 33, 70, 64, torch.float16, seed=2)
    g = torch.Generator().manual_seed(3)
    if mdtype == torch.bool:
        mask = torch.rand(*MASKS[kind], generator=g) > 0.25
        if kind != "rows BNS1":
            mask[..., 0] = True                     # every row keeps a key (fully masked rows: see below)
    else:
        mask = (torch.randn(*MASKS[kind], generator=g) * 2).to(mdtype)
    r = npu.run("flash_attention", q, k, v, mask=mask, device=device)
    _check(r, q, k, v, mask=mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sq,skv", [(33, 33), (130, 33), (7, 130), (130, 257), (1, 1)])
def test_causal_top_left(device, sq, skv):
    q, k, v = _inputs(1, 2, 1, sq, skv, 72, torch.float16, seed=4)
    _check(npu.run("flash_attention", q, k, v, causal=True, device=device), q, k, v, causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_causal_and_mask_both_apply(device):
    q, k, v = _inputs(2, 2, 2, 130, 130, 64, torch.bfloat16, seed=5)
    mask = torch.rand(2, 1, 130, 130, generator=torch.Generator().manual_seed(6)) > 0.5
    mask[..., 0] = True
    r = npu.run("flash_attention", q, k, v, mask=mask, causal=True, device=device)
    _check(r, q, k, v, mask=mask, causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nkv", [1, 2, 3])
def test_gqa(device, nkv):
    q, k, v = _inputs(1, 6, nkv, 70, 100, 64, torch.float16, seed=7)
    _check(npu.run("flash_attention", q, k, v, device=device), q, k, v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_return_probs(device, dtype):
    q, k, v = _inputs(1, 2, 1, 130, 200, 64, dtype, seed=8)
    mask = (torch.randn(130, 200, generator=torch.Generator().manual_seed(9))).to(dtype)
    r = npu.run("flash_attention", q, k, v, mask=mask, causal=True, return_probs=True, device=device)
    assert len(r.outputs) == 2 and r.outputs[1].shape == (1, 2, 130, 200)
    _check(r, q, k, v, mask=mask, causal=True, probs=True)
    # the probabilities above the diagonal are written (zeros), not left out
    assert r.stats.hbm_bytes >= 1 * 2 * 130 * 200 * q.element_size()


@pytest.mark.parametrize("device", DEVICES)
def test_rows_with_nothing_to_attend_give_zero(device):
    """As torch 2.13's SDPA: a bool mask (or -inf additive mask) hiding every key of a row gives 0, not NaN."""
    q, k, v = _inputs(1, 2, 2, 20, 150, 32, torch.float16, seed=10)
    bmask = torch.ones(20, 150, dtype=torch.bool)
    bmask[3] = False
    bmask[7, :140] = False                          # the only key left is in the second KV tile
    fmask = torch.zeros(20, 150)
    fmask[5] = float("-inf")
    for mask in (bmask, fmask):
        r = npu.run("flash_attention", q, k, v, mask=mask, return_probs=True, device=device)
        out, probs = r.outputs
        assert np.isfinite(out.astype(np.float32)).all()
        rows = [3] if mask.dtype == torch.bool else [5]
        assert (out[:, :, rows] == 0).all() and (probs[:, :, rows] == 0).all()
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        assert np.abs(out.astype(np.float32) - ref.numpy()).max() < 2e-3


def _padded_mask(dtype, B, Sq, Skv, pad, seed):
    """An additive ``where(keep, 0, finfo(dtype).min)`` mask in ``dtype``: random keys masked, batch 1's first ``pad``
    query rows masked entirely (left padding), and one row of batch 0 a soft bias (ALiBi-like, no fill)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.finfo(dtype).min
    mask = torch.where(torch.rand(B, 1, Sq, Skv, generator=g) > 0.3, 0.0, low).to(dtype)
    mask[1, :, :pad] = low
    mask[0, :, 7] = (torch.randn(Skv, generator=g) * 3).to(dtype)
    return mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mask_added_in_its_16_bit_dtype(device, dtype):
    """``mask_add_dtype``: the additive mask added as eager adds it to scores of that dtype (the scores cast down, the
    sum rounded to it, then cast back up): a row whose every key takes ``finfo.min`` averages V, as eager's softmax of
    that sum does; every row as the fp32 softmax of that sum within one rounding of P and of the output. Without it
    (an fp32 add, SDPA's CPU kernel's) an fp16 row so masked keeps the scores' differences."""
    q, k, v = _inputs(2, 2, 1, 40, 150, 32, dtype, seed=12)
    mask = _padded_mask(dtype, 2, 40, 150, 5, 13)
    name = str(dtype).replace("torch.", "")
    r = npu.run("flash_attention", q, k, v, mask=mask, mask_add_dtype=name, return_probs=True, device=device)
    s = (q.float() @ k.float().transpose(-1, -2)) * 32 ** -0.5
    p = torch.softmax((s.to(dtype) + mask).float(), -1)
    out = p.to(dtype).float() @ v.float()
    got, gp = (torch.as_tensor(np.asarray(a, dtype=np.float32)) for a in r.outputs)
    assert (gp - p).abs().max().item() <= PTOL[dtype]
    assert (got - out).abs().max().item() <= TOL[dtype] * max(1.0, out.abs().max().item())
    mean = v[1].float().mean(-2)                                  # the one kv head: [Skv, D] -> [D]
    torch.testing.assert_close(got[1, :, :5], mean.expand(2, 5, -1), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(gp[1, :, :5], torch.full_like(gp[1, :, :5], 1 / 150).to(dtype).float())
    if dtype == torch.float16:                   # the fp32 add: the scores' differences survive -65504
        r32 = npu.run("flash_attention", q, k, v, mask=mask, device=device)
        plain = torch.as_tensor(np.asarray(r32.outputs[0], dtype=np.float32))
        assert (plain[1, :, :5] - mean).abs().max().item() > 10 * TOL[dtype]


def test_mask_add_dtype_needs_an_additive_mask_of_that_dtype():
    q, k, v = _inputs(1, 2, 2, 16, 16, 16, torch.float16)
    half = torch.zeros(16, 16, dtype=torch.float16)
    for mask, add, what in [(None, "float16", "no mask"), (half.bool(), "float16", "a bool mask"),
                            (half.float(), "float16", "a float32 mask"), (half, "bfloat16", "a float16 mask"),
                            (half, "float32", "float32")]:
        with pytest.raises(ValueError, match=what):
            npu.run("flash_attention", q, k, v, mask=mask, mask_add_dtype=add)
        with pytest.raises(ValueError, match=what):
            npu.run("flash_attention_grad", q, k, v, q, q, mask=mask, mask_add_dtype=add)


def test_scale():
    q, k, v = _inputs(1, 2, 2, 33, 33, 16, torch.float32, seed=11)
    _check(npu.run("flash_attention", q, k, v, scale=1.7), q, k, v, scale=1.7)


def test_devices_agree_on_values():
    """The three devices run different programs (coupled / split data paths) on the same numerics."""
    q, k, v = _inputs(1, 2, 1, 70, 90, 64, torch.float16, seed=12)
    outs = [npu.run("flash_attention", q, k, v, device=d).outputs[0] for d in DEVICES]
    for o in outs[1:]:
        assert np.abs(o.astype(np.float32) - outs[0].astype(np.float32)).max() <= 2 ** -10


# ---------------------------------------------------------------------------------------- rounding
def test_round_to_is_exact():
    g = np.random.default_rng(0)
    x = np.concatenate([g.standard_normal(200_000) * 10.0 ** g.integers(-9, 6, 200_000),
                        np.array([0.0, -0.0, 2 ** -24, 2 ** -25, 3 * 2 ** -25, 2 ** -14, 2 ** -14 * (1 - 2 ** -12),
                                  1 + 2 ** -11, 1 + 3 * 2 ** -11, 65504, 65519.99, 65520, -70000, 1e29])])
    x = x.astype(np.float32)
    out, tmp = np.empty_like(x), np.empty_like(x)
    round_to(x, "float16", out, tmp)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(out, ref)
    probs = np.minimum(np.abs(x), 1.0)                             # the nonneg mode's domain: [0, 65504]
    round_to(probs, "float16", out, tmp, nonneg=True)
    assert np.array_equal(out, probs.astype(np.float16).astype(np.float32))
    from autofuse.npu.dtypes import round_bf16
    round_to(x, "bfloat16", out, tmp)
    assert np.array_equal(out, round_bf16(x))
    y = np.array([np.inf, -np.inf, 3e38, 1.0], dtype=np.float32)   # outside the fast path's range
    with np.errstate(over="ignore"):
        round_to(y, "float16", out := np.empty_like(y), np.empty_like(y))
    assert np.array_equal(out, [np.inf, -np.inf, np.inf, 1.0])


# ---------------------------------------------------------------------------------------- tiling
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", [16, 64, 72, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_default_tiling_fits(device, D, dtype):
    dev = get_device(device)
    t = default_tiling(dev, 4096, 4096, D, dtype)
    assert tiling_fits(dev, D, dtype, t)
    t = default_tiling(dev, 4096, 4096, D, dtype, mask_spec=("float32", True, True))
    assert tiling_fits(dev, D, dtype, t, mask_spec=("float32", True, True))


def test_default_tilings_per_device():
    assert default_tiling(get_device("ascend910"), 2048, 2048, 128, "float16") == {"q": 128, "kv": 128, "vq": 128}
    assert default_tiling(get_device("ascend910b"), 2048, 2048, 128, "float16") == {"q": 128, "kv": 128, "vq": 64}
    assert default_tiling(get_device("ascend910"), 7, 33, 64, "float16") == {"q": 16, "kv": 48, "vq": 16}


def test_explicit_tiling_and_errors():
    q, k, v = _inputs(1, 2, 2, 100, 100, 64, torch.float16, seed=13)
    r = npu.run("flash_attention", q, k, v, tiling={"q": 32, "kv": 48, "vq": 16})
    _check(r, q, k, v)
    with pytest.raises(ValueError, match="UB needs"):
        npu.run("flash_attention", q, k, v, tiling={"q": 256, "kv": 512, "vq": 256})
    with pytest.raises(ValueError, match="multiples of 16"):
        npu.run("flash_attention", q, k, v, tiling={"q": 40, "kv": 64, "vq": 40})
    with pytest.raises(ValueError, match="does not broadcast"):
        npu.run("flash_attention", q, k, v, mask=torch.ones(3, 100, dtype=torch.bool))
    with pytest.raises(ValueError, match="not a multiple"):
        npu.run("flash_attention", q, k[:, :1].expand(1, 3, 100, 64).contiguous(), v[:, :1].expand(1, 3, 100, 64))
    with pytest.raises(TypeError, match="dtypes differ"):
        npu.run("flash_attention", q, k.float(), v)


# ---------------------------------------------------------------------------------------- traffic and timing
def test_hbm_within_1p5x_of_minimum():
    q, k, v = _inputs(1, 8, 8, 1024, 1024, 128, torch.float16, seed=14)
    r = npu.run("flash_attention", q, k, v, device="ascend910")
    _check(r, q, k, v)
    least = min_hbm_bytes(q.shape, k.shape, v.shape, "float16")
    assert r.stats.hbm_bytes <= 1.5 * least, (r.stats.hbm_bytes, least)


@pytest.mark.parametrize("device", ["ascend910", "ascend910b"])
def test_kv_rereads_hit_l2(device):
    """Twice the query blocks load K/V twice as often, but HBM only grows by the extra q and out."""
    stats = {}
    for sq in (1024, 2048):                    # both keep every core busy (same workspace)
        q, k, v = _inputs(1, 4, 2, sq, 1024, 64, torch.float16, seed=15)
        stats[sq] = npu.run("flash_attention", q, k, v, device=device).stats
    assert stats[2048].bytes["GM->L1"] >= 1.8 * stats[1024].bytes["GM->L1"]    # K/V loaded per query block
    extra_q_out = 2 * (4 * 1024 * 64 * 2)
    grown = stats[2048].hbm_bytes - stats[1024].hbm_bytes
    assert grown <= 1.1 * extra_q_out, (grown, extra_q_out)


def test_coupled_kernel_is_vector_bound():
    """On the 910 the Vector unit (six fp32 passes per score) binds, and the pipeline keeps it busy."""
    q, k, v = _inputs(1, 16, 16, 1024, 1024, 128, torch.float16, seed=16)
    st = npu.run("flash_attention", q, k, v, device="ascend910").stats
    assert st.bound == "vector"
    assert st.util["vector"] >= 0.8, st


def test_causal_skips_masked_tiles_and_balances_cores():
    q, k, v = _inputs(1, 8, 8, 1024, 1024, 128, torch.float16, seed=17)
    full = npu.run("flash_attention", q, k, v, device="ascend910").stats
    causal = npu.run("flash_attention", q, k, v, causal=True, device="ascend910").stats
    launch = full.launch_cycles                                # half the scores, plus the diagonal selects
    assert causal.cycles - launch < 0.7 * (full.cycles - launch)
    busy = causal.busy_total["vector"] / causal.cores["core"]
    assert busy >= 0.9 * causal.busy["vector"]                 # cores carry about equal work


@pytest.mark.parametrize("device", DEVICES)
def test_cost_model_grants_the_kernels_tile_counts(device):
    """The cost model restates the kernel's UB/L1/L0 requests and double-buffer grants (it imports no simulator
    code): the same counts for every tiling, mask and dropout combination the searches consider."""
    import itertools
    from autofuse.npu.kernels import flash_attention as kern
    from cost_model import flash_attention as model
    dev = get_device(device)
    for D, dt, q, kv, drop, ms, sink in itertools.product((16, 80, 128, 256), ("float16", "float32"), (16, 64, 128),
                                                          (16, 128, 512), (False, True),
                                                          (None, ("bool", True, True), ("float16", True, False)),
                                                          (False, True)):
        rows = q // 2 if dev.arch == "split" else q
        for vq in (rows, rows // 2):
            t = {"q": q, "kv": kv, "vq": vq}
            if vq >= 1:
                assert model._counts(dev, model._requests(dev, D, D, dt, t, ms, drop, sink)) == \
                    kern._counts(dev, kern._requests(dev, D, D, dt, t, ms, drop, sink)), (t, D, dt, drop, ms, sink)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,causal", [((1, 2, 1, 33, 130, 64), True), ((2, 4, 2, 70, 70, 128), False)])
def test_logit_soft_capping(device, dtype, shape, causal):
    """softcap · tanh(scale·q·kᵀ / softcap) before the mask (Gemma 2's attention): values against fp32 torch,
    eight more Vector passes per score than without, the same bytes."""
    q, k, v = _inputs(*shape, dtype)
    q = q * 4                                               # scores large enough for the cap to bite
    cap, scale = 5.0, shape[-1] ** -0.5
    r = npu.run("flash_attention", q, k, v, causal=causal, softcap=cap, device=device, return_probs=True)
    rep = shape[1] // shape[2]
    s = (q.float() @ k.float().repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    assert s.abs().max() > 2 * cap
    s = cap * torch.tanh(s / cap)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(s, -1)
    out = p @ v.float().repeat_interleave(rep, 1)
    got = torch.as_tensor(np.asarray(r.outputs[0], dtype=np.float32))
    assert (got - out).abs().max().item() <= TOL[dtype] * max(1.0, out.abs().max().item())
    assert (torch.as_tensor(np.asarray(r.outputs[1], dtype=np.float32)) - p).abs().max().item() <= PTOL[dtype]
    plain = npu.run("flash_attention", q, k, v, causal=causal, device=device, return_probs=True, timing_only=True)
    assert r.stats.busy["vector"] > plain.stats.busy["vector"] and r.stats.hbm_bytes == plain.stats.hbm_bytes


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), float("nan")])
def test_softcap_must_be_positive_and_finite(cap):
    q, k, v = _inputs(1, 1, 1, 4, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        npu.run("flash_attention", q, k, v, softcap=cap)


def _sink_ref(q, k, v, sinks, mask=None, causal=False):
    """fp32 eager attention with GPT-OSS's sinks: the head's sink logit as a last score column, softmax, the column
    dropped."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    col = sinks.float().reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    return p @ v, p


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,causal", [((1, 4, 2, 33, 130, 64), False), ((2, 4, 1, 150, 150, 128), True)])
def test_attention_sinks(device, dtype, shape, causal):
    """Each row's softmax also takes its head's sink logit (GPT-OSS): values and probabilities against fp32
    torch, a head whose sink dominates attending almost nothing; the work is the same as without sinks, the
    bytes a few more (one logit loaded per item)."""
    q, k, v = _inputs(*shape, dtype)
    sinks = torch.tensor([0.0, -3.0, 2.0, 40.0][:shape[1]]).to(dtype)
    r = npu.run("flash_attention", q, k, v, causal=causal, sinks=sinks, device=device, return_probs=True)
    out, p = _sink_ref(q, k, v, sinks, causal=causal)
    got = torch.as_tensor(np.asarray(r.outputs[0], dtype=np.float32))
    assert (got - out).abs().max().item() <= TOL[dtype] * max(1.0, out.abs().max().item())
    assert (torch.as_tensor(np.asarray(r.outputs[1], dtype=np.float32)) - p).abs().max().item() <= PTOL[dtype]
    assert got[:, 3].abs().max() < 1e-6 * out.abs().max()          # exp(s - 40) is below 1e-12 of the sum
    plain = npu.run("flash_attention", q, k, v, causal=causal, device=device, return_probs=True, timing_only=True)
    assert r.stats.busy["vector"] == plain.stats.busy["vector"]
    assert 0 < r.stats.hbm_bytes - plain.stats.hbm_bytes <= shape[1] * 4


def test_attention_sinks_on_rows_with_nothing_to_attend():
    """A row whose keys are all masked attends only its sink: 0 (eager's softmax gives the sink all the weight);
    with a ``-inf`` sink that row has no score at all: 0 or NaN as ``empty_rows`` says, as without sinks."""
    q, k, v = _inputs(1, 2, 2, 20, 24, 16, torch.float32)
    mask = torch.rand(1, 1, 20, 24, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 5, :] = False
    for sinks, empty in ((torch.tensor([1.0, -2.0]), "nan"), (torch.tensor([float("-inf"), 0.5]), "zero"),
                         (torch.tensor([float("-inf"), 0.5]), "nan")):
        r = npu.run("flash_attention", q, k, v, mask=mask, sinks=sinks, empty_rows=empty)
        got = torch.as_tensor(np.asarray(r.outputs[0]))
        out, _ = _sink_ref(q, k, v, sinks, mask)              # eager: NaN on row 5 of head 0 when its sink is -inf
        if empty == "zero":
            out = torch.nan_to_num(out, nan=0.0)
        torch.testing.assert_close(got, out, atol=2e-5, rtol=1e-5, equal_nan=True)
        assert got[0, 0, 5].isnan().all() == (bool(sinks[0].isneginf()) and empty == "nan")


@pytest.mark.parametrize("shape", [(3,), (4, 1), (2, 2)])
def test_sinks_must_be_one_logit_per_head(shape):
    q, k, v = _inputs(1, 4, 4, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="sinks"):
        npu.run("flash_attention", q, k, v, sinks=torch.zeros(shape))
