"""Softmax kernel vs torch: dtypes, aligned and ragged shapes, any dim, long (chunked) rows, capacity, timing."""
import numpy as np
import pytest
import torch

from autofuse import npu
from autofuse.npu.kernels.softmax import default_tiling
from autofuse.npu.machine import CapacityError
from cost_model.devices import get_device

# fp32: both sides compute in fp32, with different exp implementations and summation orders: a few ulps
# of each output (rtol 1e-5) and 1e-6 absolute for the tiny probabilities. fp16/bf16: the reference is
# torch in fp32 on the same low-precision inputs, and the kernel's output carries one rounding to the
# element type (fp16: 2^-11 relative, bf16: 2^-8).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3),
       torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = list(TOL)


def _check(x, dim, **kw):
    r = npu.run("softmax", x, dim=dim, **kw)
    got = torch.from_numpy(r.outputs[0].astype(np.float32))
    ref = torch.softmax(x.float(), dim)
    assert r.dtypes == (str(x.dtype).replace("torch.", ""),)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, **TOL[x.dtype])
    return r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 129), (64, 256), (2, 3, 1000), (5, 7), (1, 1)])
def test_last_dim(dtype, shape):
    torch.manual_seed(0)
    _check((torch.randn(shape) * 3).to(dtype), -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((6, 37, 19), 1), ((6, 37, 19), 0), ((4, 2, 3, 200), 2), ((33, 64), 0)])
def test_other_dims(dtype, shape, dim):
    torch.manual_seed(1)
    _check((torch.randn(shape) * 3).to(dtype), dim)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_tiling_matches(dtype):
    """A row split into chunks (online max/sum, then a second pass) equals the one-pass result."""
    torch.manual_seed(2)
    x = (torch.randn(5, 1000) * 5).to(dtype)
    _check(x, -1, tiling={"block": 2, "chunk": 128})
    _check(x.T.contiguous(), 0, tiling={"block": 3, "chunk": 7})


def test_long_rows_are_chunked_and_reread_from_l2():
    """Rows longer than UB take the two-pass scheme by default; the second pass hits L2, not HBM."""
    torch.manual_seed(3)
    C = 70_000
    dev = get_device("ascend910")
    t = default_tiling(dev, "float32", 3, C, 1)
    assert t["chunk"] < C
    x = torch.randn(3, C) * 4
    r = npu.run("softmax", x, dim=-1)
    got = torch.from_numpy(r.outputs[0]).double()
    ref = torch.softmax(x.double(), -1)
    # A bound from the arithmetic, not from one CPU's exp: each probability is exp(x - max) / sum, with exp
    # good to 2 ulps and the fp32 row sum accumulated per Vector lane (64 lanes, C/64 terms each) then
    # across lanes; the relative error of a sum of positive terms is at most (terms - 1) roundings.
    eps = torch.finfo(torch.float32).eps
    rel = (C / 64 + 64 + 4) * eps
    assert torch.all((got - ref).abs() <= rel * ref + torch.finfo(torch.float32).tiny)
    nbytes = 3 * C * 4
    assert r.stats.bytes["GM->UB"] == 2 * nbytes          # every chunk loaded twice ...
    assert r.stats.hbm_bytes == 2 * nbytes                # ... but read from HBM once (+ the output)


def test_extreme_values():
    x = torch.tensor([[0.0, -float("inf"), 1.0], [1e4, 1e4, -1e4], [-1e4, -1e4, -1e4]])
    _check(x, -1)


def test_errors():
    with pytest.raises(TypeError, match="softmax: x is int32"):
        npu.run("softmax", np.ones((4, 4), np.int32))
    with pytest.raises(ValueError, match="dim 2 out of range"):
        npu.run("softmax", np.ones((4, 4), np.float32), dim=2)
    with pytest.raises(CapacityError, match="UB overflow"):
        npu.run("softmax", np.ones((64, 4096), np.float32), device="ascend910b",
                tiling={"block": 64, "chunk": 4096})


def test_default_tiling_fits_every_device():
    for name in npu.devices():
        dev = get_device(name)
        for dtype in ("float16", "bfloat16", "float32"):
            for outer, C, inner in ((4096, 4096, 1), (8, 100_000, 1), (2, 5000, 300)):
                t = default_tiling(dev, dtype, outer, C, inner)
                assert t["block"] >= 1 and 1 <= t["chunk"] <= C


def _cycles(rows, cols=1024, device="ascend910"):
    x = torch.randn(rows, cols).half()
    return npu.run("softmax", x, device=device).stats


def test_timing_scales_with_rows():
    a, b = _cycles(1024), _cycles(2048)
    ratio = (b.cycles - b.launch_cycles) / (a.cycles - a.launch_cycles)
    assert 1.8 < ratio < 2.2


def test_fp16_on_910_is_vector_bound():
    """Seven fp32 passes per element (64 lanes) outweigh 4 B of HBM traffic per element at 1.2 kB/cycle."""
    s = _cycles(2048, 2048)
    assert s.bound == "vector"
    assert s.busy["vector"] > 0.85 * (s.cycles - s.launch_cycles)    # loads and stores hide under it


def test_fp16_on_310p_is_memory_bound():
    """The 310P's DRAM (≈192 B/cycle for 15 cores) is far slower than its Vector units."""
    s = _cycles(512, 2048, device="ascend310p")
    assert s.bound in ("mte2", "mte3") and s.util["vector"] < 0.5
    assert s.cycles < 1.1 * s.hbm_bytes / get_device("ascend310p").hbm_bytes_per_cycle + s.launch_cycles


@pytest.mark.slow
def test_acceptance_4096_square_fp16_on_910():
    """The busiest unit is at least 85 % busy (double buffering, seven fp32 passes per element)."""
    torch.manual_seed(0)
    r = _check(torch.randn(4096, 4096).half(), -1)
    assert max(r.stats.util.values()) >= 0.85


# --------------------------------------------------------------------------- scale, mask, log, dtypes, empty rows

EPS32 = 2.0 ** -24                     # unit roundoff of fp32
UNIT = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
SUB = {torch.float32: 2.0 ** -150, torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}   # half a subnormal step


def _reference(x, mask, dim, scale, fill, log, empty_rows):
    """Exact (float64) result of the kernel's definition on the same input values; the fill as fp32 holds it."""
    z = x.double() * (1.0 if scale is None else scale)
    if mask is not None:
        z = z.masked_fill(~mask, float(np.float32(fill))) if mask.dtype == torch.bool else z + mask.double()
    y = torch.log_softmax(z, dim) if log else torch.softmax(z, dim)
    if empty_rows == "zero":
        y = y.masked_fill(torch.isneginf(z).all(dim, keepdim=True), 0.0)
    return y, z


def _run_family(x, mask=None, dim=-1, scale=None, fill=float("-inf"), log=False, empty_rows="nan", out=None,
                **kw):
    """Run the kernel and check it against float64 with a bound from the arithmetic.

    The kernel's fp32 steps each round once: the scale (|z| ε), the mask add, ``z - m`` (|z| + |m|, so 2 max|z|
    with the scale's error carried), ``exp`` (numpy's float32 exp: within 2 ulps), the row sum (at most
    C/64 + 64 roundings, accumulated per Vector lane and then across lanes), the division or ``log``; the
    error of ``z - m`` enters exp as an absolute one, hence a relative one of the probability. With
    ε = 2^-24: ``rel = ε (4 max|z| + C/64 + 72)``. Output rounding: half an ulp of ``out`` (relative), or half
    the subnormal step below its normal range. Log-probabilities carry ``rel`` as an absolute error.
    """
    out = out or x.dtype
    r = npu.run("softmax", x, dim=dim, mask=mask, scale=scale, fill=fill, log=log, empty_rows=empty_rows,
                out_dtype=str(out).replace("torch.", ""), **kw)
    assert r.dtypes == (str(out).replace("torch.", ""),)
    got = torch.from_numpy(r.outputs[0].astype(np.float64))
    ref, z = _reference(x, mask, dim, scale, fill, log, empty_rows)
    assert got.shape == ref.shape
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN where eager has NaN, nowhere else"
    # -inf where the exact result is -inf or overflows the output dtype (a log-probability near finfo.min)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref.to(out)))
    fin = torch.isfinite(ref.to(out))
    zmax = z[torch.isfinite(z)].abs().max().item() if torch.isfinite(z).any() else 0.0
    C = x.shape[dim]
    rel = EPS32 * (4 * zmax + C / 64 + 72)
    if log:
        tol = rel + UNIT[out] * ref.abs() * (1 + rel)
    else:
        tol = ref * (rel + UNIT[out]) * (1 + rel) + SUB[out]
    bad = ((got - ref).abs() > tol) & fin
    assert not bad.any(), f"{int(bad.sum())} outside the bound, worst {(got - ref)[fin].abs().max().item():.3g}"
    return r


MASKS = [(2, 1, 1, 40), (24, 40), (2, 1, 24, 40), (2, 3, 24, 40), (1, 3, 1, 40), (2, 3, 24, 1), (40,)]
MASK_IDS = ["padding", "causal", "per-batch", "full", "per-head", "per-row", "row"]


def _mask(shape, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(shape, generator=g) > 0.35
    if kind == "bool":
        return keep
    return torch.where(keep, torch.randn(shape, generator=g), float("-inf") if kind == "-inf" else -1e4).to(
        {"add32": torch.float32, "add16": torch.float16, "-inf": torch.float32}[kind])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mshape", MASKS, ids=MASK_IDS)
def test_scale_and_mask_broadcasts(dtype, mshape):
    """Every broadcast of a bool keep-mask and of an additive mask (fp32, fp16, or with -inf: each in turn),
    with a scale."""
    torch.manual_seed(4)
    x = (torch.randn(2, 3, 24, 40) * 3).to(dtype)
    additive = ("add32", "add16", "-inf")[(MASKS.index(mshape) + DTYPES.index(dtype)) % 3]
    for i, kind in enumerate(("bool", additive)):
        _run_family(x, _mask(mshape, kind, i), scale=0.37)


@pytest.mark.parametrize("fill", [float("-inf"), float(torch.finfo(torch.float32).min), -1e4])
def test_fills_and_fully_masked_rows(fill):
    """A masked score takes the fill after the scale; a fully masked row is NaN with -inf (eager softmax)
    and uniform with a finite fill (every score equal), as eager gives."""
    torch.manual_seed(5)
    x = torch.randn(4, 5, 64).half()
    keep = torch.rand(4, 1, 64) > 0.5
    keep[1] = False
    r = _run_family(x, keep, scale=3.0, fill=fill)
    row = r.outputs[0][1].astype(np.float64)
    if fill == float("-inf"):
        assert np.isnan(row).all()
    else:
        assert np.allclose(row, 1 / 64, rtol=2.0 ** -10)
    _run_family(x, keep, fill=fill, log=True)


@pytest.mark.parametrize("tiling", [None, {"block": 2, "chunk": 16}], ids=["one-pass", "chunked"])
def test_empty_rows_nan_or_zero(tiling):
    """All -inf rows: NaN (softmax) or 0 (_safe_softmax); a leading chunk of -inf in an otherwise live row
    must not poison the running sum (the max in use is 0 until a finite score is seen)."""
    torch.manual_seed(6)
    x = torch.randn(6, 48)
    keep = torch.rand(6, 48) > 0.3
    keep[2] = False
    keep[3, :40] = False                          # live only in the last chunk
    r = _run_family(x, keep, tiling=tiling)
    assert np.isnan(r.outputs[0][2]).all() and not np.isnan(r.outputs[0][3]).any()
    z = _run_family(x, keep, empty_rows="zero", tiling=tiling)
    assert (z.outputs[0][2] == 0).all()
    x2 = x.clone()
    x2[4, :20] = float("-inf")                    # -inf in the input itself, no mask
    _run_family(x2, None, tiling=tiling)
    _run_family(x2, keep, log=True, tiling=tiling)


@pytest.mark.parametrize("dtype,out", [(torch.float16, torch.float32), (torch.float32, torch.bfloat16),
                                       (torch.bfloat16, torch.float16), (torch.float32, torch.float16)])
def test_output_dtype(dtype, out):
    torch.manual_seed(7)
    x = (torch.randn(3, 7, 130) * 4).to(dtype)
    _run_family(x, _mask((3, 1, 130), "add16"), scale=0.5, out=out)
    _run_family(x, _mask((7, 130), "bool"), log=True, out=out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,mshape", [(1, (4, 1, 5, 30)), (1, (1, 6, 1, 1)), (2, (4, 6, 5, 1)), (0, (6, 1, 30)),
                                        (2, (1, 6, 1, 30)), (-2, (5, 30))])
def test_other_dims_with_masks(dtype, dim, mshape):
    """Softmax over any dim; the mask broadcast along the softmax dim, the lanes or the outer dims."""
    torch.manual_seed(8)
    x = (torch.randn(4, 6, 5, 30) * 3).to(dtype)
    _run_family(x, _mask(mshape, "bool"), dim=dim, scale=1.7)
    _run_family(x, _mask(mshape, "add32"), dim=dim, log=True)
    _run_family(x, _mask(mshape, "bool", 1), dim=dim, fill=-1e4, tiling={"block": 3, "chunk": 2})


@pytest.mark.parametrize("log", [False, True])
def test_long_rows_with_a_mask_are_chunked(log):
    """Rows longer than UB: two passes over the chunks, the mask read in both (the second time from L2)."""
    torch.manual_seed(9)
    C = 70_000
    x = torch.randn(3, C) * 4
    keep = torch.rand(1, C) > 0.2
    keep[0, :20_000] = False                      # the first chunks fully masked
    r = _run_family(x, keep, scale=0.5, log=log)
    nx = 3 * C * 4
    assert r.stats.hbm_bytes == 2 * nx + C        # x and y once, the mask row once (bool)
    assert r.stats.bytes["GM->UB"] == 2 * nx + 2 * 3 * C   # x twice; each row's mask row twice


def test_a_broadcast_mask_is_read_by_the_tile_not_materialised():
    """A [B, 1, 1, S] padding mask is read one mask row per tile, a [S, S] causal mask one row per tile row:
    GM->UB carries what the tiles read, HBM each mask byte once (the launch fits L2), never B·N·S·S."""
    from autofuse.npu.kernels.softmax import default_tiling as dt, mask_geometry
    from autofuse.npu.kernels.tiles import split_blocks
    torch.manual_seed(10)
    B, N, S = 2, 4, 64
    x = torch.randn(B, N, S, S).half()
    dev = get_device("ascend910")
    for mshape in ((B, 1, 1, S), (S, S)):
        keep = torch.rand(mshape) > 0.3
        r = _run_family(x, keep, scale=0.125)
        period, along_block, _ = mask_geometry(x.shape, 3, mshape)
        t = dt(dev, "float16", B * N * S, S, 1, "float16", ("bool", along_block, True), False, period)
        blocks = [b for core in split_blocks(B * N * S, 32, t["block"], period=period) for b in core]
        read = sum(e if along_block else 1 for _, e in blocks) * S
        assert r.stats.bytes["GM->UB"] == x.numel() * 2 + read
        assert r.stats.hbm_bytes == 2 * x.numel() * 2 + keep.numel()
        # the padding mask: one mask row per tile; the causal one: each score row reads its mask row (from L2)
        assert read < x.numel() // 2 if not along_block else read == x.numel()


def test_masked_tilings_fit_every_device_and_capacity_is_checked():
    for name in npu.devices():
        dev = get_device(name)
        for dtype, out, mask, log in (("float16", "float32", ("bfloat16", True, True), True),
                                      ("float32", "bfloat16", ("bool", False, True), False),
                                      ("bfloat16", "bfloat16", ("float16", True, False), True)):
            for outer, C, inner in ((4096, 4096, 1), (8, 100_000, 1), (2, 5000, 300)):
                t = default_tiling(dev, dtype, outer, C, inner, out, mask, log, 64)
                assert 1 <= t["block"] <= 64 and 1 <= t["chunk"] <= C
    with pytest.raises(CapacityError, match="UB overflow"):
        npu.run("softmax", np.ones((64, 4096), np.float16), mask=np.ones((64, 4096), np.float16), log=True,
                device="ascend910b", tiling={"block": 8, "chunk": 4096})


def test_family_errors_name_the_problem():
    x = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match=r"mask shape \[3, 8\] does not broadcast to x \[4, 8\]"):
        npu.run("softmax", x, mask=np.ones((3, 8), bool))
    with pytest.raises(TypeError, match="mask is int32"):
        npu.run("softmax", x, mask=np.ones((4, 8), np.int32))
    with pytest.raises(ValueError, match="no safe form"):
        npu.run("softmax", x, log=True, empty_rows="zero")
    with pytest.raises(ValueError, match="fill=nan"):
        npu.run("softmax", x, mask=np.ones((4, 8), bool), fill=float("nan"))
    with pytest.raises(TypeError, match="out_dtype int32"):
        npu.run("softmax", x, out_dtype="int32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim, tiling", [(-1, None), (-1, {"block": 2, "chunk": 16}), (1, None),
                                         (1, {"block": 4, "chunk": 8})],
                         ids=["one-pass", "chunked", "other-dim", "other-dim-chunked"])
def test_inf_rows_lse_is_logsumexps_spelling(dtype, dim, tiling):
    """``inf_rows="lse"``: a row (lane) whose max is +inf gives ``z - inf`` (log) or ``exp(z - inf)``: -inf or 0
    at every finite or -inf score, NaN at the +inf ones, as eager's ``z - logsumexp(z)`` and its exp; the
    +inf may come in any chunk (the running max turns +inf there). Rows of -inf and NaN stay NaN; the other
    rows are the softmax, within the family's bound. ``"nan"`` (the default) keeps softmax's NaN row."""
    torch.manual_seed(9)
    x = (torch.randn(6, 48, 3) * 3).to(dtype)
    if dim == -1:
        x = x[..., 0].contiguous()
        at = lambda r, c: (r, c)                   # noqa: E731
    else:
        at = lambda r, c: (r, c, 1)                # noqa: E731
    x[at(0, 3)] = INF = float("inf")
    x[at(1, 40)] = x[at(1, 5)] = INF               # a later chunk, and twice
    x[at(2, 30)], x[at(2, 31)] = INF, -INF
    x[at(4, 7)] = float("nan")
    x[at(5, 2)], x[at(5, 9)] = INF, float("nan")
    keep = torch.rand(x.shape) > 0.2
    keep[at(0, 3)] = keep[at(1, 40)] = keep[at(2, 30)] = True
    keep[3] = False                                # every score of row 3 masked: all -inf
    for log in (False, True):
        r = npu.run("softmax", x, dim=dim, mask=keep, scale=0.5, log=log, inf_rows="lse", tiling=tiling)
        got = torch.from_numpy(r.outputs[0].astype(np.float64))
        z = (x.double() * 0.5).masked_fill(~keep, -INF)
        want = z - torch.logsumexp(z, dim, keepdim=True)
        want = want if log else want.exp()
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(test(got), test(want)), (log, test.__name__)
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin].to(dtype).double(), **TOL[dtype])
        plain = torch.from_numpy(npu.run("softmax", x, dim=dim, mask=keep, scale=0.5, log=log,
                                         tiling=tiling).outputs[0].astype(np.float64))
        lane = (lambda r: plain[r]) if dim == -1 else (lambda r: plain[r, :, 1])      # noqa: E731
        assert bool(lane(0).isnan().all()) and bool(lane(1).isnan().all())
    with pytest.raises(ValueError, match="inf_rows"):
        npu.run("softmax", x, inf_rows="zero")


def test_inf_rows_lse_costs_one_select_per_row():
    """The simulator and the cost model both count the +inf-max select: one pass over the statistics per row
    block (one pass or the last chunk of two), nothing per element."""
    import cost_model
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    for tiling in ({"block": 8, "chunk": 256}, {"block": 8, "chunk": 64}):
        base = npu.run("softmax", x, tiling=tiling, device="ascend910")
        lse = npu.run("softmax", x, tiling=tiling, device="ascend910", inf_rows="lse")
        assert lse.stats.cycles > base.stats.cycles
        pred = [cost_model.estimate("softmax", [((64, 256), "float32")], device="ascend910", tiling=tiling,
                                    inf_rows=ir).cycles for ir in ("nan", "lse")]
        assert pred[1] > pred[0]
        assert abs(pred[1] - lse.stats.cycles) / lse.stats.cycles <= 0.15


def _padding_mask(dtype, value, shape=(2, 1, 1, 40), seed=21):
    """An additive padding mask of ``dtype``: 0 where a key is kept, ``value`` where it is masked; batch 0 masks every
    key (a padded row), batch 1 a random third of them."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(shape, generator=g) > 0.33
    keep[0] = False
    return torch.where(keep, 0.0, value).to(dtype)


UNIT16 = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", ["finfo.min", -1e4, float("-inf")])
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("tiling", [None, {"block": 2, "chunk": 16}], ids=["one-pass", "chunked"])
def test_mask_added_in_its_16_bit_dtype_is_eagers_add(dtype, value, log, tiling):
    """``mask_add_dtype``: the additive mask added as eager adds a 16-bit mask to 16-bit scores (the scores cast
    down, the sum rounded to that dtype, cast back up), so the kernel's output is eager's ``softmax(x + m)`` (or
    ``log_softmax``) within one rounding of the output, the fully masked row included: uniform for ``finfo.min``
    (every score absorbed into it), NaN for ``-inf``."""
    value = torch.finfo(dtype).min if value == "finfo.min" else value
    x = (torch.randn(2, 3, 5, 40, generator=torch.Generator().manual_seed(20)) * 3).to(dtype)
    m = _padding_mask(dtype, value)
    name = str(dtype).replace("torch.", "")
    r = npu.run("softmax", x, mask=m, log=log, mask_add_dtype=name, tiling=tiling)
    got = torch.from_numpy(r.outputs[0].astype(np.float64))
    want = (torch.log_softmax(x + m, -1) if log else torch.softmax(x + m, -1)).double()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    fin = torch.isfinite(want)
    # both round the same fp32 softmax of the same 16-bit sums once: a rounding apart at most
    assert ((got - want)[fin].abs() <= 2 * UNIT16[dtype] * (want[fin].abs() + 1)).all()
    if value == torch.finfo(dtype).min and not log:
        assert torch.equal(got[0], torch.full_like(got[0], 1 / 40).to(dtype).double())


def test_the_fp32_add_of_an_fp16_finfo_min_mask_is_not_eagers():
    """Without ``mask_add_dtype`` (an fp32 add) a row whose every key is fp16's finfo.min keeps the scores'
    differences, where eager's fp16 add makes it uniform: why the family passes the add's dtype on."""
    x = (torch.randn(2, 3, 5, 40, generator=torch.Generator().manual_seed(20)) * 3).half()
    m = _padding_mask(torch.float16, torch.finfo(torch.float16).min)
    got = np.asarray(npu.run("softmax", x, mask=m).outputs[0], dtype=np.float64)
    assert np.abs(got[0] - 1 / 40).max() > 0.1


def test_mask_add_dtype_needs_an_additive_mask_of_that_dtype():
    x = torch.randn(4, 16).half()
    half = torch.zeros(16, dtype=torch.float16)
    for mask, add, what in [(None, "float16", "no mask"), (half.bool(), "float16", "a bool mask"),
                            (half.float(), "float16", "a float32 mask"), (half, "bfloat16", "a float16 mask"),
                            (half, "float32", "float32")]:
        with pytest.raises(ValueError, match=what):
            npu.run("softmax", x, mask=mask, mask_add_dtype=add)


@pytest.mark.parametrize("mshape", [(2, 1, 1, 256), (2, 4, 16, 256)], ids=["padding", "full"])
@pytest.mark.parametrize("tiling", [{"block": 8, "chunk": 256}, {"block": 8, "chunk": 64}], ids=["one-pass", "chunked"])
def test_mask_add_dtype_costs_its_casts_in_the_simulator_and_the_model(mshape, tiling):
    """The two casts around the 16-bit add (the scores down, the sum up: elementwise passes over the scores, in
    place of the mask's cast) are issued by the simulator and priced by the cost model: both see more Vector work
    than the fp32 add (the cycles may not grow where the loads bound the kernel), the same bytes, and agree within
    15 %."""
    import cost_model
    x = torch.randn(2, 4, 16, 256).half()
    m = torch.zeros(mshape, dtype=torch.float16)
    spec = [((2, 4, 16, 256), "float16")]
    runs = {}
    for extra in ({}, {"mask_add_dtype": "float16"}):
        sim = npu.run("softmax", x, mask=m, tiling=tiling, device="ascend910", timing_only=True, **extra).stats
        est = cost_model.estimate("softmax", spec, device="ascend910", tiling=tiling, mask=(mshape, "float16"),
                                  **extra)
        assert abs(est.cycles - sim.cycles) <= 0.15 * sim.cycles, (extra, est.cycles, sim.cycles)
        runs[bool(extra)] = sim, est
    (sim0, est0), (sim1, est1) = runs[False], runs[True]
    assert sim1.busy["vector"] > sim0.busy["vector"] and est1.busy["vector"] > est0.busy["vector"]
    assert est1.hbm_bytes == est0.hbm_bytes and sim1.hbm_bytes == sim0.hbm_bytes
    with pytest.raises(ValueError, match="mask_add_dtype"):
        cost_model.estimate("softmax", spec, device="ascend910", mask=(mshape, "float32"), mask_add_dtype="float16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiling", [None, {"block": 2, "chunk": 16}], ids=["one-pass", "chunked"])
def test_log_of_a_row_whose_every_score_is_finfo_min(dtype, tiling):
    """log_softmax of a row whose every score is the dtype's ``finfo.min`` (a fill, or an additive mask that absorbs
    the scores) is ``-log C``, as eager's; the two-pass form too, which subtracts the max before the log of the sum
    (``max + log sum`` as one statistic rounds ``log C`` away next to fp32's or bf16's ``finfo.min``: 0)."""
    low = torch.finfo(dtype).min
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(22)).to(dtype)
    x[1] = low
    keep = torch.ones(3, 40, dtype=torch.bool)
    keep[2] = False
    for mask, fill in ((None, float("-inf")), (keep, low)):
        r = npu.run("softmax", x, mask=mask, fill=fill, log=True, tiling=tiling)
        got = torch.from_numpy(r.outputs[0].astype(np.float64))
        z = x if mask is None else x.masked_fill(~keep, low)
        want = torch.log_softmax(z.float(), -1).to(dtype).double()
        rows = [1] if mask is None else [1, 2]
        torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=2 * UNIT[dtype] * np.log(40))
        assert (got[rows] - -np.log(40)).abs().max() <= 2 * UNIT[dtype] * np.log(40) + 1e-6
