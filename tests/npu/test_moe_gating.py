"""moe_gating_topk and topk kernels vs torch: values within rounding, indices equal torch.topk's (ties too)."""
import numpy as np
import pytest
import torch

from autofuse import npu
from autofuse.npu.kernels.stl_select import torch_topk
from autofuse.npu.machine import CapacityError

DEVICES = ["ascend910", "ascend910b", "ascend310p"]


def _ref(x, bias=None, k=2, norm="softmax", renorm=False, eps=1e-20, scale=1.0, n_group=1, topk_group=1,
         group_score="max", group_fill=float("-inf")):
    """The router spelled as the models spell it, in float64."""
    s = x.double()
    s = torch.softmax(s, -1) if norm == "softmax" else torch.sigmoid(s) if norm == "sigmoid" else s
    choice = s + (bias.double() if bias is not None else 0)
    E = x.shape[-1]
    if n_group > 1:
        g = choice.view(-1, n_group, E // n_group)
        gs = g.amax(-1) if group_score == "max" else g.topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, torch.topk(gs, topk_group, -1, sorted=False).indices, 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, -1), group_fill)
    idx = torch.topk(choice, k, -1).indices
    y = s.gather(-1, idx)
    if renorm:
        y = y / (y.sum(-1, keepdim=True) + eps)
    return y * scale, idx


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_softmax_topk_renorm(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(300, 8).to(dtype)
    r = npu.run("moe_gating_topk", x, k=2, renorm=True, eps=0.0, device=device)
    y, idx = _ref(x.float(), k=2, renorm=True, eps=0.0)
    assert np.array_equal(r.outputs[1], idx.numpy())
    # fp32 softmax of the same logits: a few float32 ulps of a value <= 1
    assert np.abs(r.outputs[0] - y.numpy()).max() < 1e-6


@pytest.mark.parametrize("device", ["ascend910", "ascend910b"])
def test_deepseek_v3_groups_bias_scale(device):
    torch.manual_seed(1)
    E = 64
    x, b = torch.randn(77, E), torch.randn(E) * 0.1
    p = dict(k=6, norm="sigmoid", renorm=True, eps=1e-20, n_group=8, topk_group=3, group_score="top2")
    r = npu.run("moe_gating_topk", x, b, routed_scaling_factor=2.5, device=device, **p)
    y, idx = _ref(x, b, scale=2.5, **p)
    assert np.array_equal(r.outputs[1], idx.numpy())
    assert np.abs(r.outputs[0] - y.numpy()).max() < 1e-5         # fp32 sigmoid, sum and divide: ~1e-7 relative
    # group_score="max" is a different selection
    r2 = npu.run("moe_gating_topk", x, b, device=device, **{**p, "group_score": "max"})
    _, idx2 = _ref(x, b, **{**p, "group_score": "max"})
    assert np.array_equal(r2.outputs[1], idx2.numpy())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fill", [0.0, -0.25])
def test_groups_not_kept_filled_with_a_number(device, fill):
    """DeepSeek-V2's and Mistral 4's routers give the experts of the groups not kept 0.0, not -inf: a kept expert
    whose choice is below the fill (a negative bias) loses to them, and they tie with each other at the fill. The
    weights stay the chosen experts' unbiased scores (the routers gather them)."""
    torch.manual_seed(2)
    E = 16
    x, b = torch.randn(200, E), torch.randn(E) - 0.6          # sigmoid(x) + b: a third of the choices below 0
    p = dict(k=4, norm="sigmoid", renorm=True, eps=1e-20, n_group=4, topk_group=2, group_score="top2")
    r = npu.run("moe_gating_topk", x, b, group_fill=fill, device=device, **p)
    y, idx = _ref(x, b, group_fill=fill, **p)
    _, kept_only = _ref(x, b, **p)
    assert not torch.equal(idx, kept_only), "no row picked an expert outside the kept groups: the test tests nothing"
    assert np.array_equal(r.outputs[1], idx.numpy())
    assert np.abs(r.outputs[0] - y.numpy()).max() < 1e-5         # fp32 sigmoid, sum and divide: ~1e-7 relative
    # without a bias (softmax scores, every choice above 0.0): the fill changes nothing, the weights are gathered
    r0 = npu.run("moe_gating_topk", x, k=4, n_group=4, topk_group=2, group_fill=0.0, device=device)
    y0, idx0 = _ref(x, k=4, n_group=4, topk_group=2, group_fill=0.0)
    assert np.array_equal(r0.outputs[1], idx0.numpy()) and np.abs(r0.outputs[0] - y0.numpy()).max() < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_weights_from_the_filled_choices(device):
    """DeepSeek-V2's group-limited greedy router: groups scored by their max, the others filled with 0.0, the
    weights the top-k values of the filled scores: 0.0 where a token takes a filled expert (its kept experts'
    scores underflowed to 0.0 and tie with the fill), the expert's score elsewhere."""
    E, n_group = 8, 4
    x = torch.randn(64, E, generator=torch.Generator().manual_seed(5))
    x[:8] = torch.tensor([10.0, -200.0, 9.0, 9.0, 8.0, 8.0, 7.0, 7.0])     # group 0 kept, its second score 0.0
    p = dict(k=2, norm="softmax", n_group=n_group, topk_group=1, group_score="max")
    r = npu.run("moe_gating_topk", x, group_fill=0.0, weights_from="choices", routed_scaling_factor=2.5,
                device=device, **p)
    s = torch.softmax(x, -1)                    # fp32, as the kernel and eager: exp(-210) underflows to 0.0 here
    keep = torch.zeros(64, n_group).scatter_(1, s.view(64, n_group, 2).amax(-1).topk(1, -1).indices, 1).bool()
    filled = s.masked_fill(~keep.repeat_interleave(2, -1), 0.0)
    w, idx = torch.topk(filled, 2, -1)
    assert (idx[:8, 1] >= 2).all() and (w[:8, 1] == 0).all(), "no token took a filled expert: nothing tested"
    assert np.array_equal(r.outputs[1], idx.numpy())
    assert np.abs(r.outputs[0] - 2.5 * w.numpy()).max() < 1e-6        # fp32 softmax, one scale: a few ulps
    with pytest.raises(ValueError, match="weights_from"):                   # renormalised: not this form
        npu.run("moe_gating_topk", x, group_fill=0.0, weights_from="choices", renorm=True, **p)


@pytest.mark.parametrize("fill, n_group", [(float("nan"), 4), (0.0, 1)])
def test_a_group_fill_needs_groups_and_a_number(fill, n_group):
    with pytest.raises(ValueError, match="group_fill"):
        npu.run("moe_gating_topk", torch.randn(4, 16), k=2, n_group=n_group, topk_group=1, group_fill=fill)


def test_weights_in_logits_dtype():
    x = torch.randn(40, 60).to(torch.bfloat16)
    r = npu.run("moe_gating_topk", x, k=4, out_dtype="bfloat16")
    y, idx = _ref(x.float(), k=4)
    assert r.dtypes[0] == "bfloat16"
    assert np.array_equal(r.outputs[1], idx.numpy())
    assert np.abs(r.outputs[0] - y.numpy()).max() <= 2.0 ** -8       # one bf16 rounding of a value < 1


def test_torch_topk_tie_rule_is_not_lowest_index_first():
    """torch.topk on the CPU orders equal values as libstdc++'s nth_element / partial_sort leaves them."""
    x = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 0.0])
    assert torch.topk(x, 2).indices.tolist() == [2, 4]
    assert torch_topk(x.tolist(), 2)[0] == [2, 4]
    gen = torch.Generator().manual_seed(3)
    for n, k, largest, srt in [(8, 2, True, True), (60, 4, True, True), (256, 8, True, False), (300, 3, False, True),
                               (17, 17, True, True), (1000, 10, True, True)]:
        for _ in range(20):
            v = torch.randint(0, 3, (n,), generator=gen).float()
            assert torch_topk(v.tolist(), k, largest, srt)[0] == torch.topk(v, k, largest=largest, sorted=srt).indices.tolist()


@pytest.mark.parametrize("device", ["ascend910", "ascend910b"])
def test_ties_follow_torch(device):
    torch.manual_seed(2)
    x = torch.randint(0, 3, (200, 16)).float()
    r = npu.run("topk", x, k=5, device=device)
    v, i = torch.topk(x, 5)
    assert np.array_equal(r.outputs[1], i.numpy()) and np.array_equal(r.outputs[0], v.numpy())
    r = npu.run("topk", x.half(), k=3, largest=False, device=device)
    assert np.array_equal(r.outputs[1], torch.topk(x.half(), 3, largest=False).indices.numpy())
    assert r.stats.busy["scalar"] > 0                                # the tied rows were re-selected


@pytest.mark.parametrize("norm", ["softmax", "sigmoid", "topk_softmax", "none"])
def test_nan_and_infinite_logits_choose_as_torch(norm):
    """torch.topk orders NaN as the largest value: a NaN score is chosen first and several NaNs (a softmax row
    with a NaN or +inf logit is all NaN) fall in torch's order. Indices stay in range and equal eager's."""
    torch.manual_seed(3)
    x = torch.randn(12, 6)
    x[0, 3] = float("nan")
    x[1, 4] = float("inf")
    x[2] = float("-inf")
    x[3, [1, 4]] = float("nan")
    x[4, :] = float("nan")
    if norm == "none":
        r = npu.run("topk", x, k=2)
        assert np.array_equal(r.outputs[1], torch.topk(x, 2).indices.numpy())
        r = npu.run("topk", x, k=2, largest=False)
        assert np.array_equal(r.outputs[1], torch.topk(x, 2, largest=False).indices.numpy())
        return
    r = npu.run("moe_gating_topk", x, k=2, norm=norm, renorm=True, eps=0.0)
    s = x if norm == "topk_softmax" else torch.softmax(x, -1) if norm == "softmax" else torch.sigmoid(x)
    idx = torch.topk(s, 2).indices
    assert np.array_equal(r.outputs[1], idx.numpy())
    y = torch.from_numpy(r.outputs[0])
    want = torch.softmax(x.gather(-1, idx), -1) if norm == "topk_softmax" else \
        s.gather(-1, idx) / s.gather(-1, idx).sum(-1, keepdim=True)
    torch.testing.assert_close(y, want, equal_nan=True, atol=1e-6, rtol=1e-5)   # fp32 rounding only


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_ties_with_a_selection_bias_are_settled_on_the_choices(n_group, topk_group):
    """With a bias, the selection is on scores + bias, the weights the unbiased scores: tied *scores* (sigmoid
    saturated at 1) must not re-select on the scores, tied *choices* re-select on the choices."""
    E = 8
    bias = torch.tensor([0.0, 0.0, 0.9, 0.8, 0.25, -0.25, 0.0, 0.0])
    x = torch.tensor([[20.0, 20.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0],     # tied scores, distinct choices
                      [2.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0],       # tied choices
                      [0.0] * E])
    x = torch.cat([x, torch.randint(-2, 3, (40, E)).float()])
    p = dict(k=2, norm="sigmoid", renorm=True, eps=1e-20, n_group=n_group, topk_group=topk_group,
             group_score="top2", routed_scaling_factor=2.5)
    r = npu.run("moe_gating_topk", x, bias, **p)
    # the reference in float32, as the kernel and the models compute it (ties are ties of fp32 values)
    s = torch.sigmoid(x)
    choice = s + bias
    if n_group > 1:
        gs = choice.view(-1, n_group, E // n_group).topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, torch.topk(gs, topk_group, -1, sorted=False).indices, 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, -1), float("-inf"))
    idx = torch.topk(choice, 2, -1).indices
    assert np.array_equal(r.outputs[1], idx.numpy())
    y = s.gather(-1, idx)
    torch.testing.assert_close(torch.from_numpy(r.outputs[0]), y / (y.sum(-1, keepdim=True) + 1e-20) * 2.5,
                               atol=1e-6, rtol=1e-5)                   # fp32 rounding only


def test_zero_router_ties_in_groups():
    """A zero-initialised router (every score equal): groups and experts chosen as torch chooses them."""
    x = torch.zeros(20, 64)
    p = dict(k=6, norm="sigmoid", renorm=True, n_group=8, topk_group=3, group_score="top2")
    r = npu.run("moe_gating_topk", x, torch.zeros(64), **p)
    _, idx = _ref(x, torch.zeros(64), **p)
    assert np.array_equal(r.outputs[1], idx.numpy())


def test_topk_smallest_is_not_largest():
    """Near miss: largest=False must give the k smallest, not the k largest."""
    x = torch.randn(50, 33)
    small = npu.run("topk", x, k=3, largest=False).outputs[1]
    assert np.array_equal(small, torch.topk(x, 3, largest=False).indices.numpy())
    assert not np.array_equal(small, torch.topk(x, 3).indices.numpy())


def test_errors_name_the_argument():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="k=9"):
        npu.run("moe_gating_topk", x, k=9)
    with pytest.raises(ValueError, match="n_group=3"):
        npu.run("moe_gating_topk", x, k=2, n_group=3)
    with pytest.raises(ValueError, match="norm="):
        npu.run("moe_gating_topk", x, k=2, norm="relu")
    with pytest.raises(ValueError, match="bias"):
        npu.run("moe_gating_topk", x, torch.zeros(7), k=2)


def test_capacity():
    """Rows too long for UB: the kernel says so (the planner then prices the op as generic)."""
    with pytest.raises((ValueError, CapacityError), match="UB"):
        npu.run("topk", torch.randn(2, 4000), k=2, device="ascend910b")


def test_lanes_tiling_and_decode():
    x = torch.randn(1, 8)
    r = npu.run("moe_gating_topk", x, k=2)
    assert np.array_equal(r.outputs[1], _ref(x)[1].numpy())
    x = torch.randn(100, 8)
    a = npu.run("moe_gating_topk", x, k=2, tiling={"lanes": 8})
    b = npu.run("moe_gating_topk", x, k=2, tiling={"lanes": 64})
    assert np.array_equal(a.outputs[1], b.outputs[1]) and np.array_equal(a.outputs[0], b.outputs[0])


def _near_ties(rows, E=8, seed=0):
    """Logits a few float32 ulps apart (four per row, the rest far below): distinct as logits, often equal
    once the softmax rounds them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        v = [torch.tensor(torch.randn(1, generator=g).item() * 2)]
        for _ in range(3):
            v.append(torch.nextafter(v[-1], torch.tensor(100.0)))
        row = torch.stack(v + [torch.tensor(-5.0)] * (E - 4))
        out.append(row[torch.randperm(E, generator=g)])
    return torch.stack(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_topk_then_softmax_selects_on_the_logits(device, dtype):
    """norm="topk_softmax" (GraniteMoE's and GPT-OSS's routers): softmax(topk(x).values), indices equal
    torch.topk(x)'s (ties in x follow torch's order too)."""
    torch.manual_seed(0)
    x = torch.cat([torch.randn(300, 32), torch.randint(0, 3, (40, 32)).float()]).to(dtype)
    r = npu.run("moe_gating_topk", x, k=4, norm="topk_softmax", device=device)
    v, idx = torch.topk(x.double(), 4)
    assert np.array_equal(r.outputs[1], idx.numpy())
    # fp32 exp of differences and one division: a few float32 ulps of a value <= 1
    assert np.abs(r.outputs[0] - torch.softmax(v, -1).numpy()).max() < 1e-6


def test_topk_then_softmax_is_not_softmax_then_topk_on_near_ties():
    """The same weights as softmax -> top-k -> renormalise, but where the softmax rounds distinct logits to
    equal probabilities only a selection on the logits gives eager's indices."""
    x = _near_ties(200)
    want = torch.topk(x, 2).indices.numpy()
    first = npu.run("moe_gating_topk", x, k=2, norm="topk_softmax").outputs
    after = npu.run("moe_gating_topk", x, k=2, norm="softmax", renorm=True, eps=0.0).outputs
    assert np.array_equal(first[1], want)
    assert not np.array_equal(after[1], want)                  # rows where the probabilities tie
