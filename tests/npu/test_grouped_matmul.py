"""grouped_matmul and matmul_per_group kernels vs float64 torch, skewed and empty experts, epilogues."""
import numpy as np
import pytest
import torch

from autofuse import npu
from conftest import assert_same_product

DEVICES = ["ascend910", "ascend910b", "ascend310p"]


def _gate_up(y, order):
    if order == "interleaved":
        return y[..., 0::2], y[..., 1::2]
    a, u = y.chunk(2, -1)
    return (a, u) if order == "gate_up" else (u, a)


def _ref(x, w, counts, trans_w, bias=None, act=None, order="gate_up", limit=7.0, alpha=1.702):
    out, s = [], 0
    N = w.shape[1] if trans_w else w.shape[2]
    for g, c in enumerate(counts):
        wg = w[g].double()
        y = x[s:s + c].double() @ (wg.T if trans_w else wg)
        if bias is not None:
            y = y + bias[g].double()
        if act == "swiglu":
            a, u = _gate_up(y, order)
            y = torch.nn.functional.silu(a) * u
        elif act == "clamped_swiglu":              # GPT-OSS's experts
            a, u = _gate_up(y, order)
            a = a.clamp(max=limit)
            y = (u.clamp(-limit, limit) + 1) * a * torch.sigmoid(a * alpha)
        elif act == "gelu":
            y = torch.nn.functional.gelu(y)
        elif act == "relu":
            y = torch.relu(y)
        out.append(y)
        s += c
    out.append(torch.zeros(x.shape[0] - s, N // 2 if act in ("swiglu", "clamped_swiglu") else N, dtype=torch.float64))
    return torch.cat(out)


def _eager(x, w, counts, trans_w, bias=None, act=None, order="gate_up"):
    """What the models compute in x's dtype (float32 for bf16/fp16 inputs on the CPU, rounded)."""
    return _ref(x.float(), w.float(), counts, trans_w, bias, act, order).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act,trans_w,N", [("clamped_swiglu", False, 96), ("clamped_swiglu", True, 520),
                                           ("swiglu", False, 40)])
def test_interleaved_gate_up_pairs(device, dtype, act, trans_w, N):
    """Gate and up alternating in the weight's columns (GPT-OSS's gate_up_proj), a bias per expert, GPT-OSS's
    clamped SwiGLU: against float64 within twice eager's error; an output tile of n0 columns reads 2·n0
    contiguous weight columns (its pairs), tiles narrower than n0 at the edge included (N = 520)."""
    torch.manual_seed(4)
    E, K = 4, 64
    counts = [30, 0, 70, 5]
    M = sum(counts) + 3
    x = (torch.randn(M, K) * 2).to(dtype)                          # products beyond the clamp limit too
    w = (torch.randn(E, N, K) if trans_w else torch.randn(E, K, N)).to(dtype) * 0.5
    b = torch.randn(E, N).to(dtype)
    kw = dict(limit=7.0, alpha=1.702) if act == "clamped_swiglu" else {}
    r = npu.run("grouped_matmul", x, w, torch.tensor(counts, dtype=torch.int32), b, trans_w=trans_w, activation=act,
                swiglu_order="interleaved", device=device, **kw)
    ref = _ref(x, w, counts, trans_w, b, act, "interleaved")
    assert (ref.abs() > 7).any() if act == "clamped_swiglu" else True
    eager = _eager(x, w, counts, trans_w, b, act, "interleaved")
    got = r.torch_outputs()[0].double()
    # fp32 accumulation, one rounding to the dtype: within 2x eager's error (+ the fp32 accumulation's own)
    assert (got - ref).abs().max() <= 2 * (eager.double() - ref).abs().max() + 1e-4
    assert got[sum(counts):].abs().max() == 0
    halves = _ref(x, w, counts, trans_w, b, act, "gate_up")          # near miss: the halves order differs
    assert (got - halves).abs().max() > 1e-2


def test_clamped_swiglu_needs_a_positive_limit():
    x, w = torch.randn(8, 16), torch.randn(2, 16, 8)
    for limit in (None, 0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="limit"):
            npu.run("grouped_matmul", x, w, torch.tensor([4, 4], dtype=torch.int32), activation="clamped_swiglu",
                    limit=limit)
    with pytest.raises(ValueError, match="swiglu_order"):
        npu.run("grouped_matmul", x, w, torch.tensor([4, 4], dtype=torch.int32), activation="swiglu",
                swiglu_order="odd_even")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", [None, "swiglu", "gelu", "relu"])
def test_grouped_matmul(device, dtype, act):
    torch.manual_seed(0)
    E, K, N = 4, 96, 80
    counts = [30, 0, 70, 5]                                       # skewed, one empty expert
    M = sum(counts) + 3                                           # rows past the last group: zeros
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(E, N, K) * 0.1).to(dtype)
    b = torch.randn(E, N) if act in (None, "swiglu") else None
    r = npu.run("grouped_matmul", x, w, torch.tensor(counts, dtype=torch.int32), b, trans_w=True, activation=act,
                device=device)
    ref = _ref(x, w, counts, True, b, act)
    eager = _eager(x, w, counts, True, b, act)
    got = r.torch_outputs()[0].double()
    # fp32 accumulation, one rounding to the dtype: within 2x eager's error (+ the fp32 accumulation's own)
    assert (got - ref).abs().max() <= 2 * (eager.double() - ref).abs().max() + 1e-4
    assert got[sum(counts):].abs().max() == 0


@pytest.mark.parametrize("order", ["gate_up", "up_gate"])
def test_swiglu_order_and_storage(order):
    torch.manual_seed(1)
    E, K, N = 3, 64, 96
    counts = [10, 20, 5]
    x = torch.randn(35, K)
    w = torch.randn(E, K, N) * 0.1                               # [E, K, N] storage
    r = npu.run("grouped_matmul", x, w, torch.tensor(counts, dtype=torch.int32), activation="swiglu",
                swiglu_order=order, device="ascend910b")
    ref = _ref(x, w, counts, False, act="swiglu", order=order)
    other = _ref(x, w, counts, False, act="swiglu", order="up_gate" if order == "gate_up" else "gate_up")
    got = torch.from_numpy(r.outputs[0]).double()
    assert (got - ref).abs().max() < 1e-4                        # fp32 operands and accumulation
    assert (got - other).abs().max() > 1e-2                      # near miss: the other half order differs


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_per_group_is_grouped_mm_fallback(device):
    torch.manual_seed(2)
    E, K, N = 5, 48, 40
    counts = torch.tensor([3, 0, 17, 9, 0])
    x = torch.randn(int(counts.sum()), K).half()
    w = torch.randn(E, K, N).half()
    offs = counts.cumsum(0).int()
    r = npu.run("matmul_per_group", x, w, offs, device=device)
    ref = _ref(x, w, counts.tolist(), False)
    assert (torch.from_numpy(r.outputs[0]).double() - ref).abs().max() <= \
        2 * (_eager(x, w, counts.tolist(), False).double() - ref).abs().max() + 1e-4
    # one launch per non-empty expert: three launch overheads
    g = npu.run("grouped_matmul", x, w, counts.int(), device=device)
    assert r.stats.cycles > g.stats.cycles


def test_empty_groups_cost_only_bookkeeping():
    x = torch.randn(64, 128).half()
    w = torch.randn(64, 128, 128).half()
    few = torch.zeros(64, dtype=torch.int32)
    few[5] = 64
    one = npu.run("grouped_matmul", x, w[5:6], torch.tensor([64], dtype=torch.int32))
    many = npu.run("grouped_matmul", x, w, few)
    assert np.array_equal(one.outputs[0], many.outputs[0])
    # 63 empty experts: the group list read and one Scalar cycle each, no GEMM work
    assert many.stats.busy["cube"] == one.stats.busy["cube"]
    assert many.stats.cycles - one.stats.cycles < 200


def test_errors():
    x, w = torch.randn(8, 16), torch.randn(2, 16, 8)
    with pytest.raises(ValueError, match="covers 9 rows"):
        npu.run("grouped_matmul", x, w, torch.tensor([4, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="K=16"):
        npu.run("grouped_matmul", x, w, torch.tensor([4, 4], dtype=torch.int32), trans_w=True)
    with pytest.raises(ValueError, match="even N"):
        npu.run("grouped_matmul", x, torch.randn(2, 16, 7), torch.tensor([4, 4], dtype=torch.int32),
                activation="swiglu")
    with pytest.raises(ValueError, match="does not fit"):
        npu.run("grouped_matmul", x, w, torch.tensor([4, 4], dtype=torch.int32),
                tiling={"m0": 512, "n0": 512, "k0": 256, "k1": 512})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act,order", [("swiglu", "gate_up"), ("swiglu", "up_gate"), ("gelu", "gate_up"),
                                       ("clamped_swiglu", "interleaved")])
def test_return_product(device, dtype, act, order):
    """The product written next to the output is the pre-activation ``x·w (+ bias)`` per group, rounded once to
    the dtype: the values a launch without the epilogue gives (what the backward would otherwise recompute; up to
    the order of the fp32 sums, see assert_same_product), in the weight's own column order; the output is
    unchanged and the extra bytes go out through MTE3."""
    torch.manual_seed(3)
    E, K, N = 4, 96, 80
    counts = [30, 0, 70, 5]                                       # skewed, one empty expert
    M = sum(counts) + 3
    x = torch.randn(M, K).to(dtype)
    w = (torch.randn(E, N, K) * 0.1).to(dtype)
    b = torch.randn(E, N) if act in ("swiglu", "clamped_swiglu") else None
    gl = torch.tensor(counts, dtype=torch.int32)
    kw = dict(trans_w=True, activation=act, swiglu_order=order, device=device)
    if act == "clamped_swiglu":
        kw.update(limit=7.0, alpha=1.702)
    plain = npu.run("grouped_matmul", x, w, gl, b, **kw)
    both = npu.run("grouped_matmul", x, w, gl, b, return_product=True, **kw)
    assert np.array_equal(both.outputs[0], plain.outputs[0])
    got = both.torch_outputs()[1]
    assert got.dtype == dtype and tuple(got.shape) == (M, N)
    recompute = npu.run("grouped_matmul", x, w, gl, b, trans_w=True, device=device).torch_outputs()[0]
    assert_same_product(got, recompute, _ref(x.abs(), w.abs(), counts, True, None if b is None else b.abs()), K)
    ref = _ref(x, w, counts, True, b)
    # fp32 accumulation, one rounding to the dtype: within 2x eager's error (+ the fp32 accumulation's own)
    assert (got.double() - ref).abs().max() <= 2 * (_eager(x, w, counts, True, b).double() - ref).abs().max() + 1e-4
    assert got[sum(counts):].abs().max() == 0
    extra = M * N * dtype.itemsize - 3 * N * dtype.itemsize        # rows past the groups are not written
    assert both.stats.bytes["UB->GM"] - plain.stats.bytes["UB->GM"] == extra
    assert both.stats.cycles > plain.stats.cycles


def test_return_product_needs_an_epilogue():
    x, w = torch.randn(8, 16), torch.randn(2, 16, 8)
    with pytest.raises(ValueError, match="return_product needs an activation"):
        npu.run("grouped_matmul", x, w, torch.tensor([4, 4], dtype=torch.int32), return_product=True)


def _aiv0(r, name):
    return [(st[0], en[0]) for g, u, n, st, en, act in r.trace._events
            if g.kind == "aiv" and n == name and (act is None or act[0])]


def test_split_cores_share_a_short_row_block():
    """On split cores the two AIVs of a pair each take half of an item's rows, a row block shorter than half of
    m0 too (20 rows: 10 each; before, all 20 went to the first AIV). Values as torch's."""
    torch.manual_seed(0)
    counts = (20, 0, 7)
    x, w = torch.randn(27, 128).half(), (torch.randn(3, 64, 128) / 11).half()
    r = npu.run("grouped_matmul", x, w, np.array(counts, np.int32), device="ascend910b", trans_w=True,
                activation="gelu", tiling={"m0": 64, "n0": 64, "k0": 128, "k1": 128})
    want = _ref(x, w, counts, True, act="gelu")
    assert torch.allclose(torch.from_numpy(r.outputs[0].astype(np.float32)).double(), want, atol=2e-3, rtol=2e-3)
    ev = [act for g, u, name, st, en, act in r.trace._events if g.kind == "aiv" and name == "gelu epilogue"]
    assert ev and all(act is None or (act[0] and act[1]) for act in ev[:1])     # core 0's item: both AIVs


@pytest.mark.parametrize("sets", [1, 2])
def test_split_cores_double_buffer_the_product_tiles(monkeypatch, sets):
    """Where UB holds two sets of the fp32 product tiles, the AIV loads the next item's product while its Vector
    unit runs this item's epilogue; with one set (forced here) the load waits for the epilogue. 13 groups of 60
    rows, 4 column blocks each: 52 items on 24 cores, so core 0 holds three."""
    from autofuse.npu.kernels import grouped_matmul as gk
    from cost_model.devices import get_device
    assert gk.product_sets(get_device("ascend910b"), 64, 16, "float16", "gelu") == 2
    monkeypatch.setattr(gk, "product_sets", lambda *a, **k: sets)
    counts = (60,) * 13
    x, w = torch.randn(780, 128).half(), (torch.randn(13, 64, 128) / 11).half()
    r = npu.run("grouped_matmul", x, w, np.array(counts, np.int32), device="ascend910b", trans_w=True,
                activation="gelu", tiling={"m0": 64, "n0": 16, "k0": 128, "k1": 128}, timing_only=True)
    loads, epis = _aiv0(r, "load product"), _aiv0(r, "gelu epilogue")
    assert len(loads) == len(epis) == 3
    overlapped = loads[1][0] < epis[0][1]
    assert overlapped == (sets == 2), (loads, epis)
