"""The attention family: every spelling the variant generator knows is matched once and the rewrite
equals eager; near-misses are rejected, each in its own test."""
import dataclasses
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuse.canonicalize as canonicalize_mod
from autofuse.canonicalize import canonicalize
from autofuse.capture import capture
from autofuse.match import Match, find_matches
from autofuse.verify import compare
from conftest import rewrite_with
from patterns.attention import AXES, AttentionVariant, build_variant, find_attention

B, N, S, D = 2, 4, 8, 16


@pytest.fixture(autouse=True)
def _strict(monkeypatch):
    monkeypatch.setattr(canonicalize_mod, "STRICT", True)


def _args(var: AttentionVariant, kv_heads=N, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, S, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, kv_heads, S, D, generator=g, dtype=dtype) for _ in range(2))
    if var.mask == "additive":
        return q, k, v, torch.randn(B, 1, S, S, generator=g, dtype=dtype)
    if var.mask in ("masked_fill", "where"):
        keep = torch.rand(B, 1, S, S, generator=g) > 0.3
        keep[..., 0] = True  # no fully masked row: eager and the kernel then agree exactly
        return q, k, v, keep
    return q, k, v


def _fuse(module, args, ref_op, kwargs=None):
    cap = capture(module, args, kwargs)
    gm = canonicalize(cap.graph_module)
    matches = [m for m in find_attention(gm) if "unsupported" not in m.params]     # those the kernel can run
    return cap, gm, matches, rewrite_with(cap.graph_module, gm, matches, ref_op)


def _assert_fused_equal(module, args, ref_op, n=1, atol=1e-5, rtol=1e-4):
    module.eval()
    cap, gm, matches, fused = _fuse(module, args, ref_op)
    assert len(matches) == n, f"expected {n} attention match(es), got {len(matches)}:\n{gm.code}"
    want = module(*args)
    got = cap.unflatten_outputs(fused(*cap.flatten_inputs(*args)))
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    return matches


def _variants():
    """Each axis value against the default, plus a fixed random sample of combinations."""
    base = AttentionVariant()
    out = {dataclasses.replace(base, **{axis: v}) for axis, vals in AXES.items() for v in vals}
    rng = random.Random(0)
    for _ in range(20):
        out.add(AttentionVariant(**{axis: rng.choice(vals) for axis, vals in AXES.items()}))
    return sorted(out, key=repr)


@pytest.mark.parametrize("var", _variants(), ids=repr)
def test_variant_matched_once_and_equal(var, ref_op):
    kv_heads = 2 if var.gqa else N
    m = _assert_fused_equal(build_variant(var, N, kv_heads), _args(var, kv_heads), ref_op)[0]
    p = m.params
    assert p["scale"] == pytest.approx(1.0 if var.scale == "one" else D ** -0.5)
    assert p["num_heads"] == (1 if var.qk in () else N) and p["num_kv_heads"] == kv_heads
    assert p["causal"] == (var.mask is not None and var.mask.startswith("causal"))
    want_kind = {"additive": "additive", "masked_fill": "bool", "where": "bool"}.get(var.mask)
    assert p["mask_kind"] == want_kind and (("mask" in m.inputs) == (want_kind is not None))
    assert p["dropout_p"] == 0.0 and p["probs_used"] is False and p["layout"] == "BNSD"


def test_variant_generator_rejects_unknown_spelling():
    with pytest.raises(ValueError, match="scale"):
        AttentionVariant(scale="sqrt")


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_low_precision_with_fp32_softmax(dtype, tol, ref_op):
    var = AttentionVariant(softmax="fp32_dtype", mask="additive", gqa="repeat_kv")
    m = _assert_fused_equal(build_variant(var, N, 2), _args(var, 2, dtype), ref_op, atol=tol, rtol=tol)[0]
    assert m.params["dtype"] == dtype


# --------------------------------------------------------------------------- hand-written modules

class ThreeDHeads(nn.Module):
    """MHA-style: heads folded into the batch, bmm on 3-D tensors, pre-scaled q."""

    def forward(self, q, k, v):
        q3, k3, v3 = (t.reshape(B * N, S, D) for t in (q, k, v))
        p = torch.softmax(torch.bmm(q3 / math.sqrt(D), k3.transpose(1, 2)), dim=2)
        return torch.bmm(p, v3)


def test_three_d_heads_recovers_head_dim(ref_op):
    # the 3-D tensors are reshapes of 4-D ones: canonicalization lifts the block back to BNSD
    q, k, v = _args(AttentionVariant())
    m = _assert_fused_equal(ThreeDHeads(), (q, k, v), ref_op)[0]
    assert m.params["layout"] == "BNSD" and m.params["q_shape"] == (B, N, S, D)


def test_three_d_heads_only(ref_op):
    q, k, v = (t.reshape(B * N, S, D) for t in _args(AttentionVariant()))

    class M(nn.Module):
        def forward(self, q3, k3, v3):
            return torch.bmm(torch.softmax(torch.bmm(q3, k3.transpose(1, 2)) * 0.25, dim=-1), v3)

    m = _assert_fused_equal(M(), (q, k, v), ref_op)[0]
    assert m.params["layout"] == "(BN)SD" and m.params["q_shape"] == (B * N, S, D)


def test_multihead_attention_module_with_weights(ref_op):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, S, 32)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)  # True = not allowed (MHA convention)
    cap, gm, matches, fused = _fuse(mha, (x, x, x), ref_op, {"attn_mask": mask})
    assert len(matches) == 1 and matches[0].params["probs_used"]  # need_weights=True averages the probs
    # the mask is a graph input, so it is not provably causal: MHA turns it into an additive -inf mask
    assert not matches[0].params["causal"] and matches[0].params["mask_kind"] == "additive"
    want = mha(x, x, x, attn_mask=mask)
    got = cap.unflatten_outputs(fused(*cap.flatten_inputs(x, x, x, attn_mask=mask)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_multihead_attention_module_sdpa_path(ref_op):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, S, 32)
    pad = torch.zeros(2, S, dtype=torch.bool)
    pad[1, -2:] = True
    cap, gm, matches, fused = _fuse(mha, (x, x, x), ref_op, {"key_padding_mask": pad, "need_weights": False})
    assert len(matches) == 1 and matches[0].params["mask_kind"] is not None
    want = mha(x, x, x, key_padding_mask=pad, need_weights=False)
    got = cap.unflatten_outputs(fused(*cap.flatten_inputs(x, x, x, key_padding_mask=pad, need_weights=False)))
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)


class ProbsReturned(nn.Module):
    def forward(self, q, k, v):
        p = (q @ k.transpose(-1, -2) * D ** -0.5).softmax(-1)
        return p @ v, p.mean(1)


def test_probs_used_outside_block(ref_op):
    m = _assert_fused_equal(ProbsReturned(), _args(AttentionVariant()), ref_op)[0]
    assert m.params["probs_used"] and m.params["probs_node"] == "softmax" and "softmax" in m.nodes


class TwoLayers(nn.Module):
    def forward(self, q, k, v):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.softmax(torch.einsum("bhid,bhjd->bhij", o, k) / 4.0, -1) @ v


def test_two_blocks_and_generic_driver(ref_op):
    args = _args(AttentionVariant())
    _assert_fused_equal(TwoLayers(), args, ref_op, n=2)
    gm = canonicalize(capture(TwoLayers(), args).graph_module)
    assert [m.pattern for m in find_matches(gm)] == ["attention", "attention"]


class TensorConstantScale(nn.Module):
    def forward(self, q, k, v):
        s = torch.matmul(q, k.transpose(2, 3)) / torch.sqrt(torch.tensor(float(D)))
        return F.softmax(s, -1) @ v


def test_zero_dim_constant_scale(ref_op):
    m = _assert_fused_equal(TensorConstantScale(), _args(AttentionVariant()), ref_op)[0]
    assert m.params["scale"] == pytest.approx(D ** -0.5)


def test_match_is_frozen_and_names_nodes(ref_op):
    cap, gm, matches, _ = _fuse(build_variant(AttentionVariant()).eval(), _args(AttentionVariant()), ref_op)
    (m,) = matches
    assert isinstance(m, Match) and m.pattern == "attention"
    names = {n.name for n in gm.graph.nodes}
    assert set(m.nodes) <= names and m.anchor in m.nodes and set(m.inputs.values()) <= names
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.anchor = "x"


def test_rewrite_leaves_input_untouched_and_shares_parameters(ref_op):
    class WithProj(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(D, 3 * D)

        def forward(self, x):
            q, k, v = self.qkv(x).unsqueeze(1).chunk(3, -1)
            return F.softmax(q @ k.mT * 0.25, -1) @ v

    model = WithProj().eval()
    x = torch.randn(B, S, D)
    cap = capture(model, (x,))
    gm = canonicalize(cap.graph_module)
    before, captured_before = gm.code, cap.graph_module.code
    fused = rewrite_with(cap.graph_module, gm, find_attention(gm), ref_op)
    assert gm.code == before and cap.graph_module.code == captured_before
    assert fused.get_parameter("qkv.weight") is model.qkv.weight
    torch.testing.assert_close(fused(x)[0], model(x), atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------ near-miss negatives

def _count(module, args):
    """The attention blocks found that the kernel can run (a block found but unsupported carries its reason)."""
    found = find_attention(canonicalize(capture(module.eval(), args).graph_module))
    return len([m for m in found if "unsupported" not in m.params])


def test_near_miss_softmax_over_other_dim():
    class M(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-2) @ v
    assert _count(M(), _args(AttentionVariant())) == 0


def test_near_miss_permute_is_not_a_transpose():
    # k.permute(0, 2, 1, 3) swaps heads and sequence, not the last two dims; with S == N == D the
    # shapes line up, which is how Inductor mis-fused it.
    class M(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.permute(0, 2, 1, 3) * 0.25, dim=-1) @ v
    q = torch.randn(1, 4, 4, 4)
    assert _count(M(), (q, q.clone(), q.clone())) == 0


def test_near_miss_scale_is_not_scalar():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.rand(S))  # one factor per key: not a per-head scale

        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1) * self.w, dim=-1) @ v
    assert _count(M(), _args(AttentionVariant())) == 0


def test_near_miss_probabilities_mutated_in_place():
    class M(nn.Module):
        def forward(self, q, k, v):
            p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1)
            p.mul_(2.0)
            return p @ v
    assert _count(M(), _args(AttentionVariant())) == 0


def test_near_miss_scores_used_elsewhere():
    class M(nn.Module):
        def forward(self, q, k, v):
            s = q @ k.transpose(-2, -1) * 0.25
            return torch.softmax(s, dim=-1) @ v, s.amax(-1)
    assert _count(M(), _args(AttentionVariant())) == 0


def _only_decision(module, args):
    from autofuse import AutoFusionEngine
    (d,) = [d for d in AutoFusionEngine.fuse(module, args).report.decisions if d.pattern == "attention"]
    return d


def test_dropout_on_the_probabilities_is_part_of_the_match():
    # the block with its dropout (tests/test_dropout_attention.py: fused, drawing eager's keep-mask)
    class M(nn.Module):
        def forward(self, q, k, v):
            p = F.dropout(torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1), p=0.5, training=True)
            return p @ v
    args = _args(AttentionVariant())
    (m,) = find_attention(canonicalize(capture(M().eval(), args).graph_module))
    # the draw: the probabilities' shape and dtype, in row-major order (None: no other layout to follow)
    assert m.params["dropout_p"] == 0.5 and m.params["dropout_draw"] == ((*args[0].shape[:-1], args[1].shape[-2]),
                                                                         args[0].dtype, None)
    assert _only_decision(M().eval(), args).applied


def test_sdpa_with_dropout_is_matched_with_its_draw():
    class M(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    args = _args(AttentionVariant())
    (m,) = find_attention(canonicalize(capture(M().eval(), args).graph_module))
    assert m.params["dropout_p"] == 0.1 and m.params["dropout_draw"] is not None
    assert _only_decision(M().eval(), args).applied


def test_two_dropouts_on_the_probabilities_are_not_one_attention_dropout():
    class M(nn.Module):
        def forward(self, q, k, v):
            p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
            return F.dropout(F.dropout(p, 0.1, training=True), 0.2, training=True) @ v
    args = _args(AttentionVariant())
    assert find_attention(canonicalize(capture(M().eval(), args).graph_module)) == []


def test_near_miss_tiled_kv_is_not_gqa():
    # k.repeat(1, 2, 1, 1) tiles heads (head n reads kv head n % Nkv), GQA groups them (n // rep):
    # still attention, but k/v must stay the repeated tensors, not the grouped source.
    class M(nn.Module):
        def forward(self, q, k, v):
            k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
            return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v
    q, k, v = _args(AttentionVariant(), kv_heads=2)
    (m,) = find_attention(canonicalize(capture(M(), (q, k, v)).graph_module))
    assert m.params["num_kv_heads"] == N


def test_near_miss_mask_fill_is_not_negative_enough():
    class M(nn.Module):
        def forward(self, q, k, v, keep):
            return torch.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, 0.0), -1) @ v
    assert _count(M(), _args(AttentionVariant(mask="masked_fill"))) == 0


class ZeroTerm(nn.Module):
    """XLNet's scores, ``(ac + bd + ef) * scale`` with the segment term ``ef = 0`` (no token types): a Python 0 added to
    the scores and a bias (the relative-position term); ``spelling`` says where the number goes."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v, bias):
        s = q @ k.transpose(-2, -1)
        s = {"s + b + 0": lambda: s + bias + 0, "(s + b) - 0": lambda: (s + bias) - 0,
             "0 + (s + b)": lambda: 0 + (s + bias), "s + 0 + b": lambda: s + 0 + bias,
             "s + b + 1e-3": lambda: s + bias + 1e-3, "s + b + 0.0 * s": lambda: s + bias + 0.0 * s}[self.spelling]()
        return torch.softmax(s * 0.25, -1) @ v


def _zero_term_args(dtype):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 4, 16, 16, generator=g).to(dtype) for _ in range(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spelling", ["s + b + 0", "(s + b) - 0", "0 + (s + b)", "s + 0 + b"])
def test_a_zero_added_to_the_scores_is_the_scores(spelling, dtype):
    """``s + 0`` is ``s`` (but for a zero's sign, which exp does not see): XLNet's attention, whose absent segment
    term adds a Python 0, fuses with its relative-position term as the mask, and equals eager within the bound."""
    from autofuse import AutoFusionEngine
    module, args = ZeroTerm(spelling), _zero_term_args(dtype)
    assert _count(module, args) == 1
    fused = AutoFusionEngine.fuse(module, args)
    (d,) = [d for d in fused.report.applied if d.pattern == "attention"]
    assert [kind for _, kind, _ in d.params["mask_terms"]] == ["additive"]
    ref = ZeroTerm(spelling)(*(a.double() for a in args))
    ok, err, tol = compare(module(*args), ref, fused(*args))
    assert ok, (err, tol)


@pytest.mark.parametrize("spelling", ["s + b + 1e-3", "s + b + 0.0 * s"])
def test_near_miss_a_nonzero_number_or_a_zero_product_added_is_not_the_scores(spelling):
    """A number other than 0 changes the scores' roundings (the softmax is shift-invariant, its fp32 rounding is not);
    ``0.0 * s`` is NaN where s is infinite: neither is taken as the scores."""
    assert _count(ZeroTerm(spelling), _zero_term_args(torch.float32)) == 0


class RoundTrip(nn.Module):
    """Scores or probabilities cast ``through`` a dtype and back to ``dtype`` (fake quantisation, or a model in a
    16-bit dtype computing its softmax in fp32)."""

    def __init__(self, where, through, dtype=torch.float32):
        super().__init__()
        self.where, self.through, self.dtype = where, through, dtype

    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) * 0.25
        if self.where == "scores":
            s = s.to(self.through).to(self.dtype)
        p = torch.softmax(s, -1)
        if self.where == "probs":
            p = p.to(self.through).to(self.dtype)
        return p @ v


@pytest.mark.parametrize("through", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("where", ["scores", "probs"])
def test_near_miss_scores_or_probabilities_rounded_to_16_bits_and_back(where, through):
    """``s.bfloat16().float()`` in an fp32 model: eager keeps the rounding, a FlashAttention computing its chain
    in fp32 would drop it (0.04 off eager). Not attention; the fused model keeps the rounding."""
    args = tuple(t * 2 for t in _args(AttentionVariant()))
    module = RoundTrip(where, through)
    assert _count(module, args) == 0
    from autofuse import AutoFusionEngine
    fused = AutoFusionEngine.fuse(module, args)
    assert not [d for d in fused.report.applied if d.pattern == "attention"], fused.report.summary()
    (d,) = [d for d in fused.report.decisions if d.pattern == "attention"]     # found, and the report says why not
    assert d.reason_code == "unsupported", fused.report.summary()
    name = str(through).replace("torch.", "")
    assert (f"cast down from float32 to {name}" if where == "scores" else
            f"rounded to a narrower dtype and widened again (float32 -> {name} -> float32)") in d.reason, d.reason
    # what may differ: a generated kernel's exp and sums in another order than torch's, a few fp32 roundings of
    # values at most 1 (the dropped rounding was 0.04)
    torch.testing.assert_close(fused(*args), module(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,through", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("where", ["softmax_dtype", "probs"])
def test_near_miss_16_bit_block_rounded_through_the_other_16_bit_dtype(dtype, through, where):
    """A bf16 block whose softmax runs in fp16 (``softmax(s, -1, dtype=float16)``, then cast back for P·V), or whose
    probabilities go through fp16 and back, rounds where the kernel would not (fp16 and bf16 each hold values the
    other cannot): not attention, and the report names the rounding instead of saying nothing."""
    class M(nn.Module):
        def forward(self, q, k, v):
            s = q @ k.transpose(-2, -1) * 0.25
            if where == "softmax_dtype":
                p = torch.softmax(s, -1, dtype=through)
            else:
                p = torch.softmax(s, -1).to(through)
            return p.to(v.dtype) @ v
    args = tuple(t.to(dtype) for t in _args(AttentionVariant()))
    assert _count(M(), args) == 0
    from autofuse import AutoFusionEngine
    fused = AutoFusionEngine.fuse(M(), args)
    (d,) = [d for d in fused.report.decisions if d.pattern == "attention"]
    assert d.reason_code == "unsupported" and not d.applied, fused.report.summary()
    a, b = (str(t).replace("torch.", "") for t in (dtype, through))
    assert (f"cast down from {a} to {b} before the softmax" if where == "softmax_dtype" else
            f"widened again ({a} -> {b} -> {a})") in d.reason, d.reason
    # the softmax family may take the softmax and its cast (computed in fp32 and rounded once, where eager rounds
    # to the softmax's dtype first): each weight off by at most one 16-bit rounding (2^-8 of it, bf16), so each
    # output by at most 2^-8·max|v| (the weights sum to 1), plus the output's own rounding in its dtype
    q, k, v = args
    bound = 2 ** -8 * v.abs().max().item() + 2 ** -8 * M()(*args).abs().max().item()
    assert (fused(*args).double() - M()(*args).double()).abs().max().item() <= bound


@pytest.mark.parametrize("where", ["scores", "probs"])
def test_verification_catches_a_dropped_16_bit_round_trip(where, monkeypatch):
    """With the pattern's guards off, the fused attention drops the rounding; the float64 reference keeps a round
    trip the model asks for, so verification refuses the candidate and the model runs as captured."""
    import patterns.attention as attention_mod
    import patterns.softmax as softmax_mod
    from autofuse import AutoFusionEngine
    for mod in (attention_mod, softmax_mod):
        monkeypatch.setattr(mod, "rounds_and_widens", lambda chain: False)
        monkeypatch.setattr(mod, "narrowing_casts", lambda chain: [])
    args = tuple(t * 2 for t in _args(AttentionVariant()))
    module = RoundTrip(where, torch.bfloat16)
    fused = AutoFusionEngine.fuse(module, args)
    (d,) = [d for d in fused.report.decisions if d.pattern == "attention"]
    assert d.reason_code == "verification_failed", fused.report.summary()
    # a generated kernel may take a part (its exp and sums in another order than torch's): a few fp32 roundings
    torch.testing.assert_close(fused(*args), module(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scores_cast_up_for_the_softmax_and_down_for_pv_are_attention(dtype, ref_op):
    """The legitimate casts of a 16-bit model: ``softmax(s.float()).to(dtype) @ v`` widens, then narrows, never
    rounds and widens again. An fp32 model's round trip through float64 loses nothing: attention too."""
    class Upcast(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax((q @ k.transpose(-2, -1) * 0.25).float(), -1).to(dtype) @ v
    tol = 2e-3 if dtype == torch.float16 else 2e-2      # one rounding of P and of the output in the model's dtype
    _assert_fused_equal(Upcast(), _args(AttentionVariant(), dtype=dtype), ref_op, atol=tol, rtol=tol)
    assert _count(RoundTrip("scores", torch.float64), _args(AttentionVariant())) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_near_miss_fp32_scores_rounded_down_before_the_softmax(dtype):
    """``softmax((q @ kᵀ).half() * 0.25) @ v16`` with fp32 q and k: the model rounds its scores to 16 bits, the
    attention kernel (fp32, v cast up) would compute them unrounded: 5.6x eager's error against the exact value of
    the model's 16-bit scores in fp16, 3.6x in bf16. Not attention; the softmax family takes the block after the
    cast, and the fused model is within the verifier's bound of that exact value. The report says why: the
    attention candidate is unsupported, its reason naming the cast."""
    from autofuse import AutoFusionEngine
    from autofuse.verify import compare

    class Rounded(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax((q @ k.transpose(-2, -1)).to(v.dtype) * 0.25, -1) @ v
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 32, 16, generator=g) * 2 for _ in range(2))
    v = torch.randn(2, 4, 32, 16, generator=g).to(dtype)
    module = Rounded().eval()
    (m,) = find_attention(canonicalize(capture(module, (q, k, v)).graph_module))
    name = str(dtype).replace("torch.", "")
    assert m.params["unsupported"].startswith(f"the scores are cast down from float32 to {name} before the softmax, "
                                              "by a cast the model writes"), m.params
    fused = AutoFusionEngine.fuse(module, (q, k, v))
    assert not [d for d in fused.report.applied if d.pattern == "attention"], fused.report.summary()
    (d,) = [d for d in fused.report.decisions if d.pattern == "attention"]
    assert d.reason_code == "unsupported" and "cast down" in d.reason, fused.report.summary()
    got, want = fused(q, k, v), module(q, k, v)
    s = (q.double() @ k.double().transpose(-2, -1)).to(dtype).double()
    ok, err, tol = compare(want, torch.softmax(s * 0.25, -1) @ v.double(), got)
    assert ok, (err, tol)


class BroadcastKV(nn.Module):
    """Multi-query attention written as Falcon's eager path writes it: one k/v head that the two matmuls
    broadcast over the query heads."""

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_kv_head_broadcast_over_the_heads_is_multi_query_attention(ref_op, dtype):
    q, k, v = _args(AttentionVariant(), kv_heads=1, dtype=dtype)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    (m,) = _assert_fused_equal(BroadcastKV(), (q, k, v), ref_op, **tol)
    assert m.params["num_heads"] == N and m.params["num_kv_heads"] == 1


@pytest.mark.parametrize("k_heads,v_heads,batch", [(1, N, B), (N, 1, B), (1, 1, 1)])
def test_near_miss_broadcasts_other_than_one_kv_head(k_heads, v_heads, batch):
    # k alone or v alone broadcast over the heads, or a batch broadcast: not a FlashAttention layout
    q, _, _ = _args(AttentionVariant())
    g = torch.Generator().manual_seed(1)
    k = torch.randn(batch, k_heads, S, D, generator=g)
    v = torch.randn(batch, v_heads, S, D, generator=g)
    assert find_attention(canonicalize(capture(BroadcastKV(), (q, k, v)).graph_module)) == []


class Alibi(nn.Module):
    """Bloom's scores: ``alibi.baddbmm(q, kᵀ, beta=1, alpha=scale)`` on heads folded into the batch, the bias
    ``[B·N, 1, S]`` broadcast over the queries, then the 4-D view, the mask, softmax, and a bmm with v."""

    def __init__(self, scores_out=False):
        super().__init__()
        self.scores_out = scores_out        # a near miss: the biased scores read outside the block

    def forward(self, q, k, v, alibi, mask):
        (b, n, sq, d), sk = q.shape, k.shape[2]
        q3, k3, v3 = q.reshape(b * n, sq, d), k.reshape(b * n, sk, d), v.reshape(b * n, sk, d)
        s = alibi.baddbmm(batch1=q3, batch2=k3.transpose(-1, -2), beta=1.0, alpha=0.25)
        p = torch.softmax(s.view(b, n, sq, sk) + mask, -1)
        out = torch.bmm(p.view(b * n, sq, sk), v3).view(b, n, sq, d)
        return (out, s) if self.scores_out else out


def test_alibi_bias_added_by_baddbmm_on_folded_heads_is_an_additive_mask(ref_op):
    q, k, v = _args(AttentionVariant())
    slopes = 2.0 ** -torch.arange(1, N + 1, dtype=torch.float32)
    alibi = (slopes[:, None] * torch.arange(S)[None, :]).repeat(B, 1)[:, None, :]       # [B·N, 1, S]
    mask = torch.zeros(B, 1, S, S).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    (m,) = _assert_fused_equal(Alibi(), (q, k, v, alibi, mask), ref_op)
    assert m.params["mask_kind"] == "additive" and len(m.params["mask_terms"]) == 2


def _alibi_args(batch, queries, dtype):
    """Bloom's inputs at ``batch`` and ``queries`` (1: a decode step over S cached keys): q, k, v, the bias
    ``[batch·N, 1, S]`` and a padding mask ``[batch, 1, queries, S]`` that hides two keys of the last sequence."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(batch, N, queries, D, generator=g).to(dtype)
    k, v = (torch.randn(batch, N, S, D, generator=g).to(dtype) for _ in range(2))
    slopes = 2.0 ** -torch.arange(1, N + 1, dtype=torch.float32)
    alibi = (slopes[:, None] * torch.arange(S)[None, :]).repeat(batch, 1)[:, None, :].to(dtype)
    mask = torch.zeros(batch, 1, queries, S, dtype=dtype)
    mask[-1, ..., :2] = torch.finfo(dtype).min
    return q, k, v, alibi, mask


@pytest.mark.parametrize("batch,queries", [(1, S), (1, 1), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_alibi_on_folded_heads_at_batch_one_and_one_query(ref_op, batch, queries, dtype):
    """At one query the folded bias ``[B·H, 1, S]`` has the scores' shape, and at batch 1 the mask broadcasts over
    the folded heads: the canonical form adds both at full rank, as for the prefill, and the block matches with
    the bias as an additive mask (before, the two rules that unfold such sums undid each other)."""
    args = _alibi_args(batch, queries, dtype)
    cap, gm, matches, fused = _fuse(Alibi().eval(), args, ref_op)
    (m,) = matches
    assert m.params["mask_kind"] == "additive" and len(m.params["mask_terms"]) == 2, gm.code
    got = cap.unflatten_outputs(fused(*cap.flatten_inputs(*args)))
    ok, err, tol = compare(Alibi()(*args), Alibi()(*(t.double() for t in args)), got)
    assert ok, (err, tol)


@pytest.mark.parametrize("batch,queries", [(1, S), (2, 1)])
def test_near_miss_alibi_scores_read_outside_the_block(batch, queries):
    # the biased scores are returned too: the fused kernel never writes them, so the block must not match
    args = _alibi_args(batch, queries, torch.float32)
    assert find_attention(canonicalize(capture(Alibi(scores_out=True), args).graph_module)) == []


class SoftCap(nn.Module):
    """Gemma 2's scores: scale, then ``cap · tanh(s / cap)``, then the mask; ``kind`` spells a near miss."""

    def __init__(self, kind="gemma2", cap=5.0):
        super().__init__()
        self.kind, self.cap = kind, cap

    def forward(self, q, k, v, mask):
        s = (q @ k.transpose(-2, -1)) * 0.25
        if self.kind == "mask_inside":             # the mask before the cap: not the kernel's order
            s = torch.tanh((s + mask) / self.cap) * self.cap
        elif self.kind == "scaled_after":          # c·tanh(s/c)·0.5 is 2.5·tanh(s/c): a cap of 2.5, scale a·2.5
            s = torch.tanh(s / self.cap) * self.cap * 0.5 + mask
        elif self.kind == "tensor_cap":            # a cap per head (a tensor): not one softcap value
            s = torch.tanh(s / self.cap) * torch.full((q.shape[1], 1, 1), self.cap, dtype=q.dtype) + mask
        elif self.kind == "tanh_reused":           # the tanh read outside the block too
            t = torch.tanh(s / self.cap)
            return torch.softmax(t * self.cap + mask, -1) @ v, t
        else:
            s = torch.tanh(s / self.cap) * self.cap + mask
        return torch.softmax(s.float(), -1).to(q.dtype) @ v


@pytest.mark.parametrize("kind,cap,scale", [("gemma2", 5.0, 0.25), ("scaled_after", 2.5, 0.125)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_soft_capping_is_part_of_the_match(ref_op, dtype, kind, cap, scale):
    q, k, v = (t * 4 for t in _args(AttentionVariant(), dtype=dtype))
    mask = torch.zeros(1, 1, S, S, dtype=dtype).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1),
                                                            torch.finfo(dtype).min)
    module = SoftCap(kind).eval()
    cap_, gm, matches, fused = _fuse(module, (q, k, v, mask), ref_op)
    (m,) = matches
    assert m.params["softcap"] == cap and m.params["scale"] == pytest.approx(scale)
    got = cap_.unflatten_outputs(fused(*cap_.flatten_inputs(q, k, v, mask)))
    # eager rounds the scores to bf16 at every step of the cap; the reference op computes them in fp32: the
    # verifier's bound (within twice eager's own error of a float64 run, plus one rounding)
    ref64 = module(*(t.double() for t in (q, k, v, mask)))
    ok, err, tol = compare(module(q, k, v, mask), ref64, got)
    assert ok, (err, tol)


@pytest.mark.parametrize("kind", ["mask_inside", "tensor_cap", "tanh_reused"])
def test_near_miss_soft_capping_out_of_the_kernels_order(kind):
    q, k, v = _args(AttentionVariant())
    mask = torch.randn(1, 1, S, S)
    assert find_attention(canonicalize(capture(SoftCap(kind).eval(), (q, k, v, mask)).graph_module)) == []


class AddThenFill(nn.Module):
    """MPT's order: an additive bias (ALiBi), then ``masked_fill(causal, fill)``."""

    def __init__(self, fill=None):
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v, bias):
        s = (q @ k.transpose(-2, -1)) * 0.25 + bias
        fill = torch.finfo(s.dtype).min if self.fill is None else self.fill
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), fill)
        return torch.softmax(s, -1) @ v


def test_additive_mask_then_an_absorbing_fill_is_one_mask_where_keep_sum_fill(ref_op):
    """The fill replaces the biased score: ``where(keep, bias, fill)`` added to the scores says it exactly,
    since ``s + finfo.min == finfo.min`` for any score the kernel sees; a row the bias masks entirely (-inf)
    attends to the filled keys, as in eager."""
    q, k, v = _args(AttentionVariant())
    bias = torch.randn(1, N, 1, S)
    (m,) = _assert_fused_equal(AddThenFill(), (q, k, v, bias), ref_op)
    assert m.params["fill_last"] and m.params["mask_kind"] == "additive"
    cap, gm, matches, fused = _fuse(AddThenFill(), (q, k, v, bias), ref_op)
    bias = bias.expand(B, N, S, S).clone()
    bias[0, 1, 3] = float("-inf")
    got = cap.unflatten_outputs(fused(*cap.flatten_inputs(q, k, v, bias)))
    want = AddThenFill()(q, k, v, bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert torch.isfinite(want[0, 1, 3]).all()


class BiasThenKeep(nn.Module):
    """MPT's order with the keep-mask an input: an additive bias, then ``masked_fill(~keep, fill)``."""

    def __init__(self, fill=None):
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v, bias, keep):
        s = (q @ k.transpose(-2, -1)) * 0.25 + bias
        return torch.softmax(s.masked_fill(~keep, torch.finfo(s.dtype).min if self.fill is None else self.fill),
                             -1) @ v


@pytest.mark.parametrize("fill", [None, float("-inf")])
@pytest.mark.parametrize("bias_grad", [False, True])
def test_a_bias_then_a_keep_mask_trains_as_eager_on_rows_that_see_no_key(fill, bias_grad):
    """A left-padded query under a causal and padding keep-mask sees no key: eager's ``masked_fill`` makes every
    score of its row a constant, so q of that row and k get no gradient through it, though P there is uniform
    (a finite fill) or NaN (-inf, whose NaN reaches only v). The fused block, whose one mask is the bias and the
    fill combined, must give the same gradients (the kernel's backward, and the host recompute for a bias that
    requires grad)."""
    from autofuse import AutoFusionEngine
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, N, S, 16, generator=g) for _ in range(3))
    bias = torch.randn(1, N, S, S, generator=g)
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
    keep[1, :, :, :3] = False                       # sequence 1 left-padded by three: queries 0-2 see no key
    model = BiasThenKeep(fill).train()
    with torch.enable_grad():
        fused = AutoFusionEngine.fuse(model, ((q, k, v, bias, keep), {}))
    (d,) = [d for d in fused.report.applied if d.pattern == "attention"]
    assert {kind for _, kind, _ in d.params["mask_terms"]} == {"bool", "additive"}
    grads = []
    for f, dt in ((fused, torch.float32), (model, torch.float32), (model, torch.float64)):
        xs = [t.detach().to(dt).requires_grad_(i < 3 or bias_grad) for i, t in enumerate((q, k, v, bias))]
        out = f(*xs, keep)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(dt)
        torch.where(torch.isfinite(out), out * w, 0).sum().backward()
        grads.append([x.grad for x in xs if x.requires_grad])
    for name, got, want, exact in zip("qkvb", *grads):
        assert not bool(want[1, :, :3].any()) if name == "q" else True, "the test needs rows that see no key"
        ok, err, tol = compare(want, exact, got)
        assert ok and torch.equal(torch.isnan(got), torch.isnan(want)), (name, err, tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_a_16_bit_bias_then_a_keep_mask_is_priced_as_the_mask_the_kernel_reads(dtype):
    """The kernel reads one mask, ``where(keep, bias, fill)``: the bias's 16-bit dtype, the terms' broadcast shape.
    Priced from the first term (the bool keep-mask) with the bias's ``mask_add_dtype``, the block was refused: "the
    fused kernel cannot be priced for this block: ... needs an additive bfloat16 mask, got bool"."""
    from autofuse import AutoFusionEngine
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, N, S, 16, generator=g).to(dtype) for _ in range(3))
    bias = torch.randn(1, N, S, S, generator=g).to(dtype)
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S)
    fused = AutoFusionEngine.fuse(BiasThenKeep().eval(), ((q, k, v, bias, keep), {}))
    (d,) = [d for d in fused.report.decisions if d.pattern == "attention"]
    assert d.applied, d.reason
    with torch.no_grad():
        want, got = BiasThenKeep()(q, k, v, bias, keep), fused(q, k, v, bias, keep)
        exact = BiasThenKeep()(*(t.double() for t in (q, k, v, bias)), keep)
    ok, err, tol = compare(want, exact, got)
    assert ok, (err, tol)


class AlibiThenKeep(nn.Module):
    """MPT's order written by hand: ALiBi built in the forward from ``arange`` (slopes ``2^-(h+1)``, the distance to
    the key), then ``masked_fill(~keep, fill)``."""

    def __init__(self, fill):
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v, keep):
        slopes = 2.0 ** -torch.arange(1, q.shape[1] + 1, dtype=torch.float32)
        pos = torch.arange(q.shape[-2], dtype=torch.float32)
        bias = -slopes[:, None, None] * (pos[:, None] - pos[None, :]).abs()
        s = (q @ k.transpose(-2, -1)) * 0.25 + bias
        return torch.softmax(s.masked_fill(~keep, self.fill), -1) @ v


@pytest.mark.parametrize("fill", [-1e4, -1e9])
def test_alibi_then_a_fill_that_does_not_absorb_trains_as_eager_on_rows_that_see_no_key(fill):
    """-1e4 added to a score is not -1e4: the one mask ``where(keep, bias, fill)`` is read with ``fill_in_mask``, the
    kernel selecting the fill where the mask holds it (such a block was reported unsupported before: the kernel only
    added). A left-padded row sees no key and is uniform over the filled keys, as eager's; the output and the
    gradients of q, k and v within the verifier's bound of float64."""
    from autofuse import AutoFusionEngine
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, N, S, 16, generator=g) for _ in range(3))
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
    keep[1, :, :, :3] = False                       # sequence 1 left-padded by three: queries 0-2 see no key
    model = AlibiThenKeep(fill).train()
    with torch.enable_grad():
        fused = AutoFusionEngine.fuse(model, ((q, k, v, keep), {}))
    (d,) = [d for d in fused.report.decisions if d.pattern == "attention"]
    assert d.applied and d.params["fill_last"] and d.params["fill"] == fill, fused.report.summary()
    calls = [n for p in fused.plans.values() for n in p.graph_module.graph.nodes
             if n.target is torch.ops.autofuse.flash_attention.default]
    assert len(calls) == 1 and calls[0].kwargs.get("fill_in_mask") is True
    runs = []
    for f, dt in ((fused, torch.float32), (model, torch.float32), (model, torch.float64)):
        xs = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        out = f(*xs, keep)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(dt)
        (out * w).sum().backward()
        runs.append([out.detach()] + [x.grad for x in xs])
    uniform = v[1].mean(-2, keepdim=True).expand(N, 3, 16)        # every key filled: eager's weights are uniform
    assert torch.allclose(runs[1][0][1, :, :3], uniform, atol=1e-6), "the test needs rows that see no key"
    for name, got, want, exact in zip(("out", "dq", "dk", "dv"), *runs):
        ok, err, tol = compare(want, exact, got)
        assert ok, (name, err, tol)


class InputMaskThenFill(nn.Module):
    """An additive mask, then a causal fill of the same value: as an input, built from that constant, a buffer that
    holds it, or a learned bias (a parameter the model may set to it)."""

    def __init__(self, kind, fill=-1e4):
        super().__init__()
        self.kind, self.fill = kind, fill
        self.holder = nn.Module()                       # a buffer of a submodule: a dotted attribute
        self.holder.register_buffer("pad", torch.zeros(1, 1, 1, S).index_fill(-1, torch.tensor([0, 1]), fill))
        self.bias = nn.Parameter(torch.randn(1, N, S, S, generator=torch.Generator().manual_seed(8)))

    def forward(self, q, k, v, m):
        if self.kind == "built":
            m = (1.0 - m) * self.fill                   # a 0/1 keep mask made additive: -1e4 where it masks
        elif self.kind == "buffer":
            m = self.holder.pad
        elif self.kind == "parameter":
            m = self.bias
        s = (q @ k.transpose(-2, -1)) * 0.25 + m
        return torch.softmax(s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), self.fill), -1) @ v


@pytest.mark.parametrize("kind", ["input", "built", "buffer", "parameter"])
def test_near_miss_an_additive_mask_that_may_hold_the_fill_then_that_fill(kind):
    """The kernel marks a filled score by the fill's value in the one mask; an additive mask of that same value
    (a padding mask of -1e4 under a causal fill of -1e4) would be read as filled, and a left-padded row, every key
    of which is masked, is eager's softmax of s + fill there, not uniform. Reported unsupported, naming why; the
    model's output is eager's on such rows. A parameter that holds no such value now is refused too: the user may
    set it to one after planning, and its values are not guarded."""
    from autofuse import AutoFusionEngine
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(B, N, S, 16, generator=g) for _ in range(3))
    keep = torch.ones(B, 1, 1, S)
    keep[1, ..., :2] = 0                            # sequence 1 left-padded by two
    m = keep if kind == "built" else (1.0 - keep) * -1e4
    model = InputMaskThenFill(kind).eval()
    fused = AutoFusionEngine.fuse(model, ((q, k, v, m), {}))
    (d,) = [d for d in fused.report.decisions if d.pattern == "attention"]
    why = {"input": "it is the model's input", "built": "is built from it", "buffer": "it reads holder.pad",
           "parameter": "it reads bias"}[kind]
    assert d.reason_code == "unsupported" and "may hold the fill -10000 itself" in d.reason and why in d.reason, \
        fused.report.summary()
    with torch.no_grad():
        want, got = model(q, k, v, m), fused(q, k, v, m)
        exact = model.double()(*(t.double() for t in (q, k, v, m)))
    ok, err, tol = compare(want, exact, got)
    assert ok, (err, tol)


class FillThenBias(nn.Module):
    """The other order: ``masked_fill(~keep, fill)``, then an additive bias (the bias reaches the filled scores)."""

    def __init__(self, fill):
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v, bias, keep):
        return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(~keep, self.fill) + bias, -1) @ v


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e9, -1e4])
def test_near_miss_a_finite_fill_then_a_bias_is_reported_unsupported(fill):
    """Eager's filled scores are fill + bias: on a row every key of which is filled the softmax weighs the bias there
    and the bias takes a gradient there, which one mask replacing the scores does not say. The block is an
    unsupported attention candidate with that reason (no candidate at all before), the rest left to the other
    families: outputs and the bias's gradient within the verifier's bound of float64 on rows that see no key."""
    from autofuse import AutoFusionEngine
    q, k, v = _args(AttentionVariant())
    bias = torch.randn(1, N, S, S, generator=torch.Generator().manual_seed(6))
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S).clone()
    keep[1, :, :2] = False                          # queries 0-1 of sequence 1 see no key
    model = FillThenBias(fill).train()
    found = find_attention(canonicalize(capture(model, (q, k, v, bias, keep)).graph_module))
    assert len(found) == 1 and found[0].params.get("unsupported", "").startswith(
        f"a bool mask's fill {fill:g}, then an additive mask"), [m.params for m in found]
    bias = bias.requires_grad_()
    with torch.enable_grad():
        fused = AutoFusionEngine.fuse(model, ((q, k, v, bias, keep), {}))
        (d,) = [d for d in fused.report.decisions if d.pattern == "attention"]
        assert d.reason_code == "unsupported" and "the other order" in d.reason, fused.report.summary()
        runs = []
        for f, b in ((fused, bias), (model, bias), (model, bias.detach().double().requires_grad_())):
            out = f(*(t.to(b.dtype) for t in (q, k, v)), b, keep)
            runs.append((out, *torch.autograd.grad(out.sum(), b)))
    for got, want, exact in zip(*runs):
        ok, err, tol = compare(want, exact, got)
        assert ok, (err, tol, fused.report.summary())
    assert bool(runs[1][1][0, :, :2, 2:].any()), "the test needs a bias gradient where only filled rows reach it"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_alibi_and_fill_last_forms_in_low_precision(ref_op, dtype):
    """BLOOM's baddbmm bias in bf16 and fp16, and MPT's bias-then-fill in bf16 (its finfo.min absorbs a score; in
    fp16 -65504 does not, and the bias, an input here, may hold it, so that form is left unfused there): within the
    verifier's bound of float64."""
    q, k, v = (t.to(dtype) for t in _args(AttentionVariant()))
    slopes = 2.0 ** -torch.arange(1, N + 1, dtype=torch.float32)
    alibi = (slopes[:, None] * torch.arange(S)[None, :]).repeat(B, 1)[:, None, :].to(dtype)
    mask = torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1),
                                                            torch.finfo(dtype).min)
    cases = [(Alibi(), (q, k, v, alibi, mask), True),
             (AddThenFill(), (q, k, v, alibi.reshape(B, N, 1, S)[:1]), dtype == torch.bfloat16)]
    for module, args, matched in cases:
        cap, gm, matches, fused = _fuse(module, args, ref_op)
        assert len(matches) == int(matched), gm.code
        got = cap.unflatten_outputs(fused(*cap.flatten_inputs(*args)))
        ok, err, tol = compare(module(*args), module(*(t.double() for t in args)), got)
        assert ok, (type(module).__name__, err, tol)


class Sinks(nn.Module):
    """GPT-OSS's attention: the scores, the mask, one learnable sink logit per head concatenated as a last column,
    (the row max subtracted), softmax, the sink column dropped, P·V. ``kind`` spells a near miss."""

    def __init__(self, kind="gpt_oss", heads=N, shift=True):
        super().__init__()
        self.kind, self.shift = kind, shift
        self.sinks = nn.Parameter(torch.linspace(-2.0, 3.0, heads))

    def forward(self, q, k, v, mask):
        b, n, sq, _ = q.shape
        if k.shape[1] != n:                        # GQA: transformers' repeat_kv
            k, v = (t[:, :, None].expand(-1, -1, n // t.shape[1], -1, -1).reshape(b, n, *t.shape[2:]) for t in (k, v))
        s = (q @ k.transpose(-2, -1)) * 0.25 + mask
        sink = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, sq, -1).to(s.dtype)
        if self.kind == "per_query":               # a sink per query (an input's values): not one logit per head
            sink = q[..., :1]
        x = torch.cat([sink, s], -1) if self.kind == "sink_first" else torch.cat([s, sink], -1)
        if self.kind == "mask_after":              # the mask added after the cat reaches the sink column too
            x = x + F.pad(mask, (0, 1))
        if self.kind == "scale_after":             # a scale after the cat scales the sink too
            x = x * 0.5
        if self.shift:
            x = x - x.max(dim=-1, keepdim=True).values
        p = torch.softmax(x, -1, dtype=x.dtype)
        if self.kind == "sink_first":
            p = p[..., 1:]
        elif self.kind == "drop_two":              # drops a key's column too
            p = torch.cat([p[..., :-2], p[..., -1:]], -1)
        elif self.kind == "probs_read":            # the probabilities with the sink's column read outside
            return p[..., :-1] @ v, p
        else:
            p = p[..., :-1]
        return p @ v


def _causal_additive(dtype):
    return torch.zeros(1, 1, S, S, dtype=dtype).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1),
                                                            torch.finfo(dtype).min)


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [N, 2])
def test_attention_sinks_are_part_of_the_match(ref_op, dtype, shift, kv_heads):
    """GPT-OSS's sink logits: one input of the kernel, the concatenation, the max subtraction and the slice
    inside the block; values within the verifier's bound of a float64 run of the module."""
    q, k, v = _args(AttentionVariant(), kv_heads=kv_heads, dtype=dtype)
    mask = _causal_additive(dtype)
    module = Sinks(shift=shift).to(dtype).eval()
    cap_, gm, matches, fused = _fuse(module, (q, k, v, mask), ref_op)
    (m,) = matches
    assert "sinks" in m.inputs and m.params["mask_kind"] == "additive" and m.params["num_kv_heads"] == kv_heads
    got = cap_.unflatten_outputs(fused(*cap_.flatten_inputs(q, k, v, mask)))
    ref64 = module.double()(*(t.double() for t in (q, k, v, mask)))
    ok, err, tol = compare(module.to(dtype)(q, k, v, mask), ref64, got)
    assert ok, (err, tol)


def test_attention_sinks_are_read_at_call_time(ref_op):
    """The sinks are the user's parameter: changing it after fusion changes the fused output as it does eager's."""
    q, k, v = _args(AttentionVariant())
    mask = _causal_additive(torch.float32)
    module = Sinks().eval()
    cap_, _, matches, fused = _fuse(module, (q, k, v, mask), ref_op)
    assert len(matches) == 1
    with torch.no_grad():
        module.sinks.add_(torch.tensor([5.0, -5.0, 0.0, 20.0]))
    got = cap_.unflatten_outputs(fused(*cap_.flatten_inputs(q, k, v, mask)))
    torch.testing.assert_close(got, module(q, k, v, mask), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["per_query", "sink_first", "mask_after", "scale_after", "drop_two", "probs_read"])
def test_near_miss_attention_sinks(kind):
    q, k, v = _args(AttentionVariant())
    mask = torch.randn(1, 1, S, S)
    assert find_attention(canonicalize(capture(Sinks(kind).eval(), (q, k, v, mask)).graph_module)) == []


def test_a_slice_of_the_probabilities_without_sinks_is_not_attention():
    class Sliced(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1), -1)[..., :-1] @ v[..., :-1, :]

    q, k, v = _args(AttentionVariant())
    assert find_attention(canonicalize(capture(Sliced(), (q, k, v)).graph_module)) == []


class RopeUnderAutocast(nn.Module):
    """Eager attention as transformers' RoPE models write it (GQA by ``repeat_interleave``, an additive fp32 mask,
    an fp32 softmax cast to q's dtype): run under autocast, q and k come out of RoPE in fp32 and v out of its
    projection in the autocast dtype, so autocast casts q, kᵀ and the probabilities where the matmuls read them."""

    def forward(self, q, k, v, mask):
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        s = q @ k.transpose(-2, -1) * 0.25 + mask
        return torch.softmax(s, -1, dtype=torch.float32).to(q.dtype) @ v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocasts_casts_of_q_kt_and_the_probabilities_are_attention(dtype):
    """The block is fused as captured: the kernel reads q, k and v cast to the autocast dtype (k before its
    transpose and repeat, the same values), accumulates in fp32 and returns eager's dtype, within the verifier's
    bound of float64."""
    from autofuse import AutoFusionEngine
    from autofuse.verify import compare
    q, k, v = _args(AttentionVariant(), kv_heads=N // 2)
    v = v.to(dtype)
    mask = torch.zeros(1, 1, S, S).masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), torch.finfo().min)
    module = RopeUnderAutocast().eval()
    with torch.autocast("cpu", dtype=dtype):
        fused = AutoFusionEngine.fuse(module, (q, k, v, mask))
        got, want = fused(q, k, v, mask), module(q, k, v, mask)
    (d,) = fused.report.of("attention")
    assert d.applied and d.params["dtype"] == dtype and d.params["num_kv_heads"] == N // 2, fused.report.summary()
    assert got.dtype == want.dtype == dtype
    ok, err, tol = compare(want, module(q.double(), k.double(), v.double(), mask.double()), got)
    assert ok, (err, tol)


def test_near_miss_casts_through_kt_to_other_dtypes_than_v():
    """q and kᵀ cast to bf16, v left in fp32: the casts no longer hide the transpose, and the block is reported
    (no one kernel dtype says it), not fused."""
    class Mixed(nn.Module):
        low = torch.bfloat16

        def forward(self, q, k, v):
            return torch.softmax(q.to(self.low) @ k.transpose(-2, -1).to(self.low) * 0.25, -1).to(v.dtype) @ v
    from autofuse import AutoFusionEngine
    from autofuse.verify import compare
    module, args = Mixed().eval(), _args(AttentionVariant())
    fused = AutoFusionEngine.fuse(module, args)
    (d,) = fused.report.of("attention")
    assert d.reason_code == "unsupported" and "different dtypes (bfloat16, bfloat16, float32)" in d.reason
    # the softmax may fuse on its own (fp32 inside, where eager rounds to bf16): the verifier's bound
    got, want = fused(*args), module(*args)
    module.low = torch.float64
    ok, err, tol = compare(want, module(*(t.double() for t in args)), got)
    assert ok, (err, tol)


def test_kt_rounded_to_16_bits_and_back_is_attention_reading_the_rounded_k(ref_op):
    """``kᵀ.bfloat16().float()`` (fake quantisation of k): the casts move inside the transpose, the kernel reads k
    as rounded (rebuilt ahead of it), so the fused block keeps the rounding eager does (0.02 off without it)."""
    class FakeQuantK(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1).bfloat16().float() * 0.25, -1) @ v
    args = tuple(t * 2 for t in _args(AttentionVariant()))
    _assert_fused_equal(FakeQuantK(), args, ref_op)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_bf16_bias_added_to_fp32_scores_then_scaled(dtype):
    """``softmax(((q @ kᵀ).float() + b) * 0.3) @ v`` with an ALiBi-like bf16 bias: eager adds it to the fp32 scores
    and scales the fp32 sum, and so does the fused call's mask (the bias cast up, then scaled), so the block fuses
    as attention within the bound of eager. Scaled by 0.3 in bf16 (rounded), its error failed verification."""
    from autofuse import AutoFusionEngine

    class Biased(nn.Module):
        def forward(self, q, k, v, b):
            s = torch.matmul(q, k.transpose(-1, -2)).float()
            return torch.matmul(torch.softmax((s + b) * 0.3, -1).to(v.dtype), v)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=g).to(dtype) for _ in range(3))
    b = -torch.rand(1, 2, 64, 64, generator=g) * 40
    b[..., -5:] = -1e4
    b = b.bfloat16()
    model = Biased().eval()
    fused = AutoFusionEngine.fuse(model, (q, k, v, b), fusion_switches={"attention": "force"})
    applied = [d for d in fused.report.applied if d.pattern == "attention"]
    assert len(applied) == 1, fused.report.summary()
    assert applied[0].params.get("mask_add_dtype") is None
    with torch.no_grad():
        got, want = fused(q, k, v, b), model(q, k, v, b)
        s = torch.matmul(q.double(), k.double().transpose(-1, -2))
        ref = torch.matmul(torch.softmax((s + b.double()) * 0.3, -1), v.double())
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)
