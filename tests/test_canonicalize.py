"""Canonicalize: each spelling family ends in one canonical op, the module computes the same values,
and the input GraphModule is not modified."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuse.canonicalize as canonicalize_mod
from autofuse.canonicalize import canonicalize
from autofuse.capture import capture
from autofuse.graph import to_networkx

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    monkeypatch.setattr(canonicalize_mod, "STRICT", True)


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _canon(fn, *args):
    """Capture fn, canonicalize, check equal values and an untouched input; return the op targets."""
    cap = capture(Fn(fn).eval(), args)
    before = cap.graph_module.code
    gm = canonicalize(cap.graph_module)
    assert cap.graph_module.code == before
    want = fn(*args)
    got = gm(*args)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


x4 = torch.randn(2, 3, 5, 4)
y4 = torch.randn(2, 3, 6, 4)


@pytest.mark.parametrize("fn", [
    lambda a, b: torch.matmul(a, b.transpose(-2, -1)),
    lambda a, b: torch.einsum("bhid,bhjd->bhij", a, b),
    lambda a, b: torch.einsum("...id,...jd->...ij", a, b),
    lambda a, b: torch.bmm(a.reshape(6, 5, 4), b.reshape(6, 6, 4).transpose(1, 2)).view(2, 3, 5, 6),
    lambda a, b: torch.baddbmm(torch.zeros(6, 5, 6), a.reshape(6, 5, 4), b.reshape(6, 6, 4).mT).view(2, 3, 5, 6),
    lambda a, b: a @ b.permute(0, 1, 3, 2),
    lambda a, b: a @ b.transpose(1, 2).contiguous().permute(0, 2, 3, 1),
], ids=["matmul", "einsum", "einsum_ellipsis", "bmm3d", "baddbmm3d", "permute", "bsnd_permute"])
def test_qk_spellings_become_matmul_of_transpose(fn):
    targets = _canon(fn, x4, y4)
    assert targets.count(aten.matmul.default) == 1
    assert not {aten.bmm.default, aten.einsum.default, aten.baddbmm.default} & set(targets)
    assert aten.transpose.int in targets


def test_einsum_output_permutation():
    targets = _canon(lambda p, v: torch.einsum("bhij,bhjd->bihd", p, v), torch.randn(2, 3, 5, 6), y4)
    assert targets == [aten.matmul.default, aten.permute.default]


@pytest.mark.parametrize("fn", [
    lambda s: s / math.sqrt(4.0),
    lambda s: s * (1 / 2.0),
    lambda s: (s * 0.25) * 2.0,
    lambda s: s / torch.sqrt(torch.tensor(4.0)),
], ids=["div", "mul", "chained", "tensor_constant"])
def test_scalar_scale_is_one_mul(fn):
    targets = _canon(fn, x4)
    assert targets == [aten.mul.Tensor]


def test_prescaled_q_and_k_scale_moves_to_the_matmul_output():
    targets = _canon(lambda q, k: (q * 0.5) @ (k * 0.5).transpose(-2, -1), x4, y4)
    assert targets == [aten.transpose.int, aten.matmul.default, aten.mul.Tensor]


@pytest.mark.parametrize("fn", [
    lambda s: F.softmax(s, dim=-1),
    lambda s: s.softmax(3),
    lambda s: nn.Softmax(dim=-1)(s),
    lambda s: torch._softmax(s, -1, False),
    lambda s: torch.exp(s - s.amax(-1, keepdim=True)) / torch.exp(s - s.amax(-1, keepdim=True)).sum(-1, keepdim=True),
    lambda s: (s - s.max(-1, keepdim=True)[0]).exp() / (s - s.max(-1, keepdim=True)[0]).exp().sum(-1).unsqueeze(-1),
    lambda s: s.exp() / s.exp().sum(dim=-1, keepdim=True),
    lambda s: torch.exp(s - torch.logsumexp(s, -1, keepdim=True)),
    lambda s: F.log_softmax(s, -1).exp(),
    lambda s: F.softmax(s - s.max(dim=-1, keepdim=True).values, dim=-1, dtype=s.dtype),
    lambda s: (s - s.amax(3, keepdim=True)).softmax(-1),
], ids=["function", "method_dim3", "module", "_softmax", "decomposed_amax", "decomposed_max", "no_max",
        "logsumexp", "log_softmax", "shifted_max", "shifted_amax"])
def test_softmax_spellings(fn):
    targets = _canon(fn, x4)
    assert targets == [aten.softmax.int]


@pytest.mark.parametrize("fn", [
    lambda s: (s - s.amax(-2, keepdim=True)).softmax(-1),            # the max of another dim
    lambda s: (s - s.amax(-1, keepdim=True)[..., :1, :]).softmax(-1),    # another row's max
    lambda s: (s - s.amax(-1, keepdim=True) * 0.5).softmax(-1),       # not the max itself
], ids=["other_dim", "other_row", "scaled_max"])
def test_softmax_of_another_shift_keeps_the_subtraction(fn):
    assert aten.sub.Tensor in _canon(fn, x4)


def _softmaxes(fn, *args):
    gm = canonicalize(capture(Fn(fn), args).graph_module)
    return [n for n in gm.graph.nodes if n.target == aten.softmax.int]


def test_softmax_from_logsumexp_remembers_it():
    """exp(s - logsumexp(s)) is a softmax marked ``autofuse_lse_softmax`` (its +inf rows are 0 but at the +inf
    scores, where softmax is NaN over the row), also when the scores were folded for a bmm and the softmax sunk
    below the reshape, and when a dim counted from the front is rewritten; CSE keeps it apart from a plain
    softmax of the same scores; the softmax spellings carry no mark, and a marked softmax keeps its shift."""
    (sm,) = _softmaxes(lambda s: torch.exp(s - torch.logsumexp(s, 3, keepdim=True)), x4)
    assert sm.meta.get("autofuse_lse_softmax") is True and sm.args[1] == -1

    def folded(s):
        f = s.reshape(-1, *s.shape[-2:])
        return torch.exp(f - torch.logsumexp(f, -1, keepdim=True)).reshape(s.shape)
    (sm,) = _softmaxes(folded, x4)
    assert sm.meta.get("autofuse_lse_softmax") is True and len(sm.args[0].meta["val"].shape) == 4   # sunk
    both = _softmaxes(lambda s: torch.exp(s - torch.logsumexp(s, -1, keepdim=True)) + s.softmax(-1), x4)
    assert sorted(bool(n.meta.get("autofuse_lse_softmax")) for n in both) == [False, True]
    (sm,) = _softmaxes(lambda s: s.softmax(-1), x4)
    assert "autofuse_lse_softmax" not in sm.meta
    shifted = _softmaxes(lambda s: torch.exp((s - s.amax(-1, keepdim=True)) - torch.logsumexp(
        s - s.amax(-1, keepdim=True), -1, keepdim=True)), x4)
    assert len(shifted) == 1 and shifted[0].meta.get("autofuse_lse_softmax") is True
    assert shifted[0].args[0].target == aten.sub.Tensor


def test_softmax_shift_is_exact_in_fp32():
    """softmax(x - max(x)) and softmax(x) compute the same ``x - max`` in fp32: equal values, so the rewrite
    changes no bit where the input's dtype is fp32."""
    s = torch.randn(3, 5, 7) * 30
    assert torch.equal(torch.softmax(s - s.amax(-1, keepdim=True), -1), torch.softmax(s, -1))


def test_softmax_dtype_is_an_explicit_cast():
    targets = _canon(lambda s: F.softmax(s, -1, dtype=torch.float64), x4)
    assert targets == [aten._to_copy.default, aten.softmax.int]


def test_softmax_other_dim_stays_other_dim():
    cap = capture(Fn(lambda s: s.softmax(1)), (x4,))
    (sm,) = [n for n in canonicalize(cap.graph_module).graph.nodes if n.target == aten.softmax.int]
    assert sm.args[1] == -3


@pytest.mark.parametrize("fn", [
    lambda s, m: s.masked_fill(~m, float("-inf")),
    lambda s, m: s.masked_fill(m == 0, float("-inf")),
    lambda s, m: torch.where(m, s, float("-inf")),
    lambda s, m: torch.where(~m, torch.tensor(float("-inf")), s),
    lambda s, m: torch.where(m, s, torch.full([], -1e9)),
], ids=["masked_fill_not", "masked_fill_eq0", "where", "where_swapped_tensor_fill", "where_full"])
def test_bool_masks_become_where_keep(fn):
    m = torch.rand(2, 1, 5, 5) > 0.5
    targets = _canon(fn, torch.randn(2, 3, 5, 5), m)
    assert targets[-1] == aten.where.ScalarOther
    assert aten.masked_fill.Scalar not in targets and aten.where.self not in targets


def test_repeat_kv_becomes_repeat_interleave():
    def repeat_kv(k):
        b, h, s, d = k.shape
        return k[:, :, None, :, :].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)
    assert _canon(repeat_kv, x4) == [aten.repeat_interleave.self_int]
    assert _canon(lambda k: k.unsqueeze(2).expand(-1, -1, 3, -1, -1).flatten(1, 2), x4) == [
        aten.repeat_interleave.self_int]


def test_tiling_repeat_is_not_repeat_interleave():
    assert aten.repeat_interleave.self_int not in _canon(lambda k: k.repeat(1, 2, 1, 1), x4)


def test_eval_dropout_clone_and_same_dtype_cast_vanish():
    drop = nn.Dropout(0.3).eval()
    targets = _canon(lambda s: drop(s).contiguous().clone().to(torch.float32).type_as(s) * 2, x4)
    assert targets == [aten.mul.Tensor]


def test_transpose_chains_compose():
    assert _canon(lambda a: a.transpose(1, 2).transpose(1, 2), x4) == []
    assert _canon(lambda a: a.transpose(2, 3), x4) == [aten.transpose.int]
    assert _canon(lambda a: a.permute(0, 2, 1, 3).permute(0, 2, 1, 3).mT, x4) == [aten.transpose.int]


def test_a_cast_of_kt_or_of_repeated_heads_moves_inside_the_view():
    """Autocast casts kᵀ where the matmul reads it (RoPE leaves q and k in fp32): the cast moves inside the
    transpose, and inside a GQA repeat, so the matmul reads the transpose; the values are the captured ones."""
    def scores(q, k):
        return torch.softmax(q @ torch.repeat_interleave(k, 3, dim=1).transpose(-2, -1), -1)
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 1, 6, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cap = capture(Fn(scores).eval(), (q, k))
    (mm,) = [n for n in cap.graph_module.graph.nodes if n.target == aten.matmul.default]
    assert mm.args[1].target == aten._to_copy.default and mm.args[1].args[0].target == aten.transpose.int
    gm = canonicalize(cap.graph_module)
    (mm,) = [n for n in gm.graph.nodes if n.target == aten.matmul.default]
    kt = mm.args[1]
    assert kt.target == aten.transpose.int and kt.args[0].target == aten.repeat_interleave.self_int
    cast = kt.args[0].args[0]
    assert cast.target == aten._to_copy.default and cast.kwargs == {"dtype": torch.bfloat16} and cast.args[0].op \
        == "placeholder"
    assert torch.equal(gm(q, k)[0], cap.graph_module(q, k)[0])
    # a cast that also lays the value out (memory_format=) stays where it is, as does a cast of another permutation
    assert _canon(lambda a: a.transpose(-2, -1).to(torch.bfloat16, memory_format=torch.contiguous_format), x4) == [
        aten.transpose.int, aten._to_copy.default]
    assert _canon(lambda a: a.permute(0, 2, 1, 3).bfloat16(), x4) == [aten.permute.default, aten._to_copy.default]


def test_sdpa_stays_one_op():
    targets = _canon(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), x4, x4, x4)
    assert targets == [aten.scaled_dot_product_attention.default]


def test_networkx_view_has_one_node_per_fx_node():
    cap = capture(Fn(lambda a, b: torch.softmax(a @ b.mT / 2, -1)), (x4, y4))
    gm = canonicalize(cap.graph_module)
    g = to_networkx(gm)
    assert set(g.nodes) == {n.name for n in gm.graph.nodes}
    sm = [n for n, d in g.nodes(data=True) if d["target"] == "aten.softmax.int"][0]
    assert g.nodes[sm]["shape"] == (2, 3, 5, 6) and g.nodes[sm]["dtype"] == "torch.float32"
    (pred,) = g.predecessors(sm)
    assert g.nodes[pred]["target"] == "aten.mul.Tensor"


@pytest.mark.parametrize("fn", [
    lambda x: x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).pow(-0.5),
    lambda x: x * torch.reciprocal(torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
    lambda x: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
])
def test_a_row_statistics_inverse_root_is_rsqrt(fn):
    ops = _canon(fn, x4)
    assert aten.rsqrt.default in ops
    assert not {aten.sqrt.default, aten.reciprocal.default, aten.div.Tensor} & set(ops), ops
    assert aten.pow.Tensor_Scalar in ops        # the square stays; the -0.5 power is gone
    assert ops.count(aten.pow.Tensor_Scalar) == 1


def test_a_zero_d_scales_root_and_other_powers_stay():
    # a learnable 0-d temperature's root is left as written (a fused call's preamble may rebuild its reciprocal,
    # not an rsqrt); pow(-0.25) is no inverse square root
    t = torch.tensor(4.0)
    ops = _canon(lambda x, t: x / torch.sqrt(t) + x * (x.pow(2).mean(-1, keepdim=True) + 1).pow(-0.25), x4, t)
    assert aten.rsqrt.default not in ops and aten.sqrt.default in ops, ops



@pytest.mark.parametrize("fn", [lambda x: x.var(-1, keepdim=True, unbiased=False),
                                lambda x: torch.var(x, -1, correction=0),
                                lambda x: x.var(-1, unbiased=False).unsqueeze(-1)])
def test_a_population_variance_over_the_last_dim_is_a_mean_of_squares(fn):
    ops = _canon(fn, x4)
    assert aten.var.dim not in ops and aten.var.correction not in ops, ops
    assert ops.count(aten.mean.dim) == 2 and aten.sub.Tensor in ops


@pytest.mark.parametrize("fn", [lambda x: x.var(-1, keepdim=True), lambda x: x.var(1, unbiased=False)])
def test_an_unbiased_variance_or_one_over_another_dim_stays(fn):
    ops = _canon(fn, x4)
    assert aten.var.dim in ops or aten.var.correction in ops, ops


def test_a_reduction_over_every_dim_read_back_through_unsqueeze_stays():
    ops = _canon(lambda x: x * x.mean(dim=None).unsqueeze(-1) + x.sum(dim=None).unsqueeze(-1), x4)
    assert ops.count(aten.unsqueeze.default) == 2, ops
