"""Automatic discovery: Vector regions become generated kernels, regions after a matmul its epilogue, and
regions that compute a known fused op are named after it; near misses are named correctly or not at all,
and always computed as written."""
import collections
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.models import build
from autofuse.verify import compare

tf = pytest.importorskip("transformers")

LAYERS = 1      # one decoder layer holds every site kind (the blocks repeat it)


def _names(report, applied=True):
    """Every name in the applied (or all) decisions, split at '+'."""
    ds = report.applied if applied else report.decisions
    return collections.Counter(n for d in ds for n in d.pattern.split("+"))


def _inference_fuse(*args, **kwargs):
    """An inference plan (made without grad): these modules return a value their region also reads (a residual sum
    and its norm, a statistic and what it scales), which a plan made with grad cuts the region at so the returned
    tensor keeps its gradient (test_autograd_semantics); without grad the region fuses whole."""
    with torch.no_grad():
        return AutoFusionEngine.fuse(*args, **kwargs)


def _within_bound(model, args, kwargs, got_fn):
    with torch.no_grad():
        want = model(*args, **kwargs)
        ref = copy.deepcopy(model).double()(*[a.double() if a.is_floating_point() else a for a in args], **kwargs)
        got = got_fn()
    pick = lambda o: o.logits if hasattr(o, "logits") else (o if isinstance(o, tuple) else (o,))  # noqa: E731
    for w, r, g in zip(*(pick(o) if isinstance(pick(o), tuple) else (pick(o),) for o in (want, ref, got))):
        ok, err, tol = compare(w, r, g)
        assert ok, (err, tol)


def _lm(cfg_cls, model_cls, **kw):
    def build(impl):
        cfg = cfg_cls(vocab_size=128, num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)
        cfg._attn_implementation = impl
        return model_cls(cfg).eval()
    return build


ARCHS = {
    "llama": (_lm(tf.LlamaConfig, tf.LlamaForCausalLM), "swiglu"),
    "mistral": (_lm(tf.MistralConfig, tf.MistralForCausalLM), "swiglu"),
    "qwen2": (_lm(tf.Qwen2Config, tf.Qwen2ForCausalLM), "swiglu"),
    "gemma": (_lm(tf.GemmaConfig, tf.GemmaForCausalLM, head_dim=16, hidden_activation="gelu_pytorch_tanh"), "geglu"),
}


@pytest.mark.parametrize("arch,impl", [(a, i) for a in ARCHS for i in ("eager", "sdpa")])
def test_every_norm_rope_and_glu_site_is_fused_and_named(arch, impl):
    torch.manual_seed(0)
    build, glu = ARCHS[arch]
    model = build(impl)
    ids = torch.randint(1, 128, (2, 16))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    names = _names(fused.report)
    # per layer: two norms (the second of a residual sum), the rotations of q and k, one gated MLP; a final norm
    assert names["rms_norm"] + names["add_rms_norm"] == 2 * LAYERS + 1, fused.report.summary()
    assert names["rope"] == 2 * LAYERS, fused.report.summary()
    assert names[glu] == LAYERS, fused.report.summary()
    assert names["attention"] == LAYERS
    _within_bound(model, (ids,), {"use_cache": False}, lambda: fused(ids, use_cache=False))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gptj_interleaved_partial_rotation_is_one_rope_region(impl):
    """GPT-J rotates pairs (``rotate_every_two``: a stack of (-x[1::2], x[::2]) on a new last dim, flattened)
    over the first ``rotary_dim`` of each head and concatenates the rest: one region per rotation, named."""
    torch.manual_seed(0)
    cfg = tf.GPTJConfig(vocab_size=128, n_layer=LAYERS, n_embd=64, n_head=4, rotary_dim=8, n_positions=64)
    cfg._attn_implementation = impl
    model = tf.GPTJForCausalLM(cfg).eval()
    ids = torch.randint(1, 128, (2, 16))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    ropes = [d for d in fused.report.applied if "rope" in d.pattern.split("+")]
    assert len(ropes) == 2 * LAYERS, fused.report.summary()
    # the rotation, its pairing and the concatenation with the unrotated part are in one kernel each
    assert all({"stack", "cat"} <= {n.rstrip("_0123456789") for n in d.nodes} for d in ropes), fused.report.summary()
    code = fused.graph_module.code
    assert "aten.stack" not in code and "aten.neg" not in code, code
    _within_bound(model, (ids,), {"use_cache": False}, lambda: fused(ids, use_cache=False))


# ----------------------------------------------------------------------------------------- near misses

class Norm(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.rand(32) + 0.5)

    def forward(self, x, r):
        h = x + r
        ms = h.pow(2).mean(-1, keepdim=True)
        if self.kind == "rms":
            y = h * torch.rsqrt(ms + 1e-6)
        elif self.kind == "rms_div_sqrt":          # the same norm, its inverse root spelled three other ways
            y = h / torch.sqrt(ms + 1e-6)
        elif self.kind == "rms_pow":
            y = h * (ms + 1e-6).pow(-0.5)
        elif self.kind == "rms_reciprocal":
            y = h * torch.reciprocal(torch.sqrt(ms + 1e-6))
        elif self.kind == "rms_mean_unsqueezed":   # the statistic's dim dropped, then put back
            y = h * torch.rsqrt(h.pow(2).mean(-1).unsqueeze(-1) + 1e-6)
        elif self.kind == "pow_quarter":           # not an inverse square root
            y = h * (ms + 1e-6).pow(-0.25)
        elif self.kind in ("ln_var", "ln_var_unbiased"):   # LayerNorm by torch's variance (an unbiased one is not)
            c = h - h.mean(-1, keepdim=True)
            y = c * torch.rsqrt(h.var(-1, keepdim=True, unbiased=self.kind == "ln_var_unbiased") + 1e-6)
        elif self.kind == "ln_div_sqrt":           # LayerNorm divided by its root
            c = h - h.mean(-1, keepdim=True)
            y = c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
        elif self.kind == "centred":               # Cohere's LayerNorm without bias: x - mean(x) normalised
            c = h - h.mean(-1, keepdim=True)
            y = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
        else:                                      # eps outside the square root: not RMSNorm
            y = h / (torch.sqrt(h.pow(2).mean(-1, keepdim=True)) + 1e-6)
        return torch.relu(y * self.w) @ x.new_ones(32, 8), h


@pytest.mark.parametrize("kind,name", [("rms", "add_rms_norm"), ("centred", "layer_norm"), ("eps_outside", None),
                                       ("rms_div_sqrt", "add_rms_norm"), ("rms_pow", "add_rms_norm"),
                                       ("rms_reciprocal", "add_rms_norm"), ("rms_mean_unsqueezed", "add_rms_norm"),
                                       ("pow_quarter", None), ("ln_div_sqrt", "layer_norm"),
                                       ("ln_var", "layer_norm"), ("ln_var_unbiased", None)])
def test_norm_named_only_when_it_is_one(kind, name):
    torch.manual_seed(0)
    m = Norm(kind).eval()
    x, r = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
    fused = _inference_fuse(m, (x, r))
    names = _names(fused.report)
    assert (names[name] >= 1) if name else not (names["rms_norm"] or names["add_rms_norm"]), fused.report.summary()
    assert fused.report.applied, "the region is fused either way"
    _within_bound(m, (x, r), {}, lambda: fused(x, r))


class TorchRMSNorm(nn.Module):
    """torch's own RMSNorm (``nn.RMSNorm``, ``F.rms_norm``: one ``aten.rms_norm`` op in the graph, as torchtitan's
    Llama writes its norms) of a residual sum; the sum, the norm and a projection of it are returned."""

    def __init__(self, spelling="module", eps=None, affine=True, shape=(32,), residual=True, trains=False):
        super().__init__()
        self.spelling, self.eps, self.residual, self.trains = spelling, eps, residual, trains
        self.norm = nn.RMSNorm(shape, eps=eps, elementwise_affine=affine)
        if affine:
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 1.5)
        self.proj = nn.Linear(32, 8, bias=False)

    def forward(self, x, r):
        h = x + r if self.residual else x
        if self.spelling == "module":
            y = self.norm(h)
        else:
            y = F.rms_norm(h, self.norm.normalized_shape, self.norm.weight, self.eps)
        if self.trains:     # the sum leaves the region, and the norm is read twice in it, neither returned as read
            return self.proj(torch.relu(y)), self.proj(h), y.sin()
        return self.proj(torch.relu(y)), h, y


def _rounded_once_as_eager(got, want):
    """torch computes rms_norm of a 16-bit input in fp32 and rounds once to the output's dtype (the weight applied
    before that rounding); so does the fused kernel. Its fp32 sums run in another order, which may move a value across a
    rounding boundary: at most 1 % of the elements, by one unit in the last place. Rounding twice (the weight
    applied after a rounding) differs in about a quarter of them."""
    ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    diff = (got.float() - want.float()).abs()
    assert got.dtype == want.dtype and (diff <= ulp).all(), diff.max()
    assert (diff > 0).float().mean() <= 0.01, (diff > 0).float().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spelling,eps,affine", [("module", None, True), ("module", 1e-6, False),
                                                 ("functional", 1e-5, True)])
def test_torch_rms_norm_is_fused_and_named(dtype, spelling, eps, affine):
    torch.manual_seed(0)
    m = TorchRMSNorm(spelling, eps, affine).to(dtype).eval()
    x, r = torch.randn(4, 6, 32, dtype=dtype), torch.randn(4, 6, 32, dtype=dtype)
    fused = _inference_fuse(m, (x, r))
    assert [d.pattern for d in fused.report.applied if "rms" in d.pattern] == ["add_rms_norm"], \
        fused.report.summary()
    assert "aten.rms_norm" not in fused.graph_module.code
    _within_bound(m, (x, r), {}, lambda: fused(x, r))


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
def test_torch_rms_norm_rounds_once_as_eager(dtype, weight_dtype):
    # the norm of a region's input (a residual sum made in the region would be kept in fp32, more precise than
    # eager's rounded sum: test_torch_rms_norm_is_fused_and_named bounds that); a bf16 x with an fp32 weight
    # gives bf16, the weight applied before the rounding
    torch.manual_seed(0)
    m = TorchRMSNorm(residual=False).to(dtype)
    m.norm.weight.data = m.norm.weight.data.to(weight_dtype)
    m.eval()
    x, r = torch.randn(16, 6, 32, dtype=dtype), torch.randn(16, 6, 32, dtype=dtype)
    fused = _inference_fuse(m, (x, r))
    assert [d.pattern for d in fused.report.applied if "rms" in d.pattern] == ["rms_norm"], fused.report.summary()
    with torch.no_grad():
        _rounded_once_as_eager(fused(x, r)[2], m(x, r)[2])


def test_torch_rms_norm_trains_as_eager():
    torch.manual_seed(0)
    m = TorchRMSNorm(eps=1e-6, trains=True).train()
    x, r = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
    fused = AutoFusionEngine.fuse(m, (x, r.clone().requires_grad_()))
    assert [d.pattern for d in fused.report.applied if "rms" in d.pattern] == ["add_rms_norm"], \
        fused.report.summary()
    grads = []
    for run in (m, fused):
        m.zero_grad()
        rr = r.clone().requires_grad_()
        out, h, y = run(x, rr)
        (out.square().sum() + h.sum() + y.sum()).backward()
        grads.append([rr.grad] + [p.grad.clone() for p in m.parameters()])
    for want, got in zip(*grads):
        # fp32 gradients of a 32-wide row: the derived backward sums in another order than autograd's
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


def test_torch_rms_norm_over_two_dims_is_not_a_row_program():
    # normalised over the last two dims: not a row-wise Vector program; it runs as captured, correctly
    torch.manual_seed(0)
    m = TorchRMSNorm(shape=(6, 32)).eval()
    x, r = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
    fused = AutoFusionEngine.fuse(m, (x, r))
    assert not [d for d in fused.report.applied if "rms" in d.pattern], fused.report.summary()
    assert "aten.rms_norm" in fused.graph_module.code
    _within_bound(m, (x, r), {}, lambda: fused(x, r))


@pytest.mark.parametrize("kind", ["rms_div_sqrt", "rms_pow", "rms_reciprocal"])
def test_a_norm_of_one_row_is_named_as_any_other(kind):
    # batch 1, one token (a decode step): the statistic is one value, still a row statistic
    torch.manual_seed(0)
    m = Norm(kind).eval()
    x, r = torch.randn(1, 1, 32), torch.randn(1, 1, 32)
    fused = _inference_fuse(m, (x, r))
    assert _names(fused.report)["add_rms_norm"] == 1, fused.report.summary()


class Rope(nn.Module):
    def __init__(self, sign):
        super().__init__()
        self.sign = sign

    def forward(self, q, cos, sin):
        h = q.shape[-1] // 2
        x1, x2 = q[..., :h], q[..., h:]
        if self.sign.startswith("chunk"):               # the halves by chunk (split): the same rotation
            x1, x2 = q.chunk(2, -1)
            if self.sign == "chunk_wrong":
                x1, x2 = x2, x1
        if self.sign in ("halves", "halves_wrong", "halves_negated_sin"):   # GPT-OSS: each half rotated apart
            c, s = cos[..., :h], sin[..., :h]
            if self.sign == "halves_negated_sin":     # the inverse rotation, by the sine negated in the graph
                s = -s
            if self.sign != "halves_wrong":
                out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
            else:                                     # the inverse rotation
                out = torch.cat((x1 * c + x2 * s, x2 * c - x1 * s), -1)
            return out @ q.new_ones(q.shape[-1], 4)
        if self.sign.startswith("pairs"):          # GPT-J's pairs: (x0, x1) -> (-x1, x0), or the wrong sign
            ev, od = q[..., ::2], q[..., 1::2]
            rot = torch.stack((od, -ev) if self.sign == "pairs_wrong" else (-od, ev), -1).flatten(-2)
        else:
            rot = torch.cat((x2, -x1), -1) if self.sign == "wrong" else torch.cat((-x2, x1), -1)
        if self.sign == "pairs_no_tables":         # the pair swap alone: no rotation at all
            out = (q + rot) * 2.0
        elif self.sign == "pairs_inverse":
            out = q * cos - rot * sin
        elif self.sign == "negated_sin":           # the inverse rotation, by the sine negated in the graph
            out = q * cos + rot * -sin
        elif self.sign == "cos_twice":
            out = q * cos + rot * cos
        elif self.sign in ("from_angles", "swapped_angles", "scaled_angles"):   # tables computed from angles
            c, s = cos.cos(), cos.sin()
            if self.sign == "scaled_angles":       # Llama's attention_scaling: both tables times a positive number
                c, s = c * 0.5, s * 0.5
            if self.sign == "swapped_angles":
                c, s = s, c
            out = q * c + rot * s
        else:
            out = q * cos + rot * sin
        return out @ q.new_ones(q.shape[-1], 4)


@pytest.mark.parametrize("sign,named", [("right", True), ("wrong", False), ("pairs", True), ("pairs_wrong", False),
                                        ("halves", True), ("halves_wrong", False), ("pairs_no_tables", False),
                                        ("pairs_inverse", False), ("negated_sin", False), ("cos_twice", False),
                                        ("halves_negated_sin", False), ("from_angles", True),
                                        ("scaled_angles", True), ("swapped_angles", False), ("chunk", True),
                                        ("chunk_wrong", False)])
def test_rope_named_only_with_the_right_sign(sign, named):
    torch.manual_seed(0)
    m = Rope(sign).eval()
    q, cos, sin = torch.randn(2, 4, 8, 16), torch.randn(2, 1, 8, 16), torch.randn(2, 1, 8, 16)
    fused = AutoFusionEngine.fuse(m, (q, cos, sin))
    assert (_names(fused.report)["rope"] == 1) == named, fused.report.summary()
    assert fused.report.applied
    _within_bound(m, (q, cos, sin), {}, lambda: fused(q, cos, sin))


class InterleavedRope(nn.Module):
    """DeepSeek-V3's interleaved RoPE (transformers' ``apply_rotary_pos_emb_interleave``): the even and the odd
    elements of x rotated as the halves are, ``cat(x₁·c − x₂·s, x₂·c + x₁·s)`` with x₁ = x[..., 0::2],
    x₂ = x[..., 1::2] and c, s the first halves of the tables; ``kind`` names a near miss (not a RoPE)."""

    def __init__(self, kind="right"):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, cos, sin):
        c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        x1, x2 = q[..., 0::2], q[..., 1::2]
        if self.kind == "odd_first":                 # the pairs' elements swapped: the inverse rotation of (x1, x0)
            x1, x2 = x2, x1
        elif self.kind == "two_sources":             # the odd elements of another tensor
            x2 = k[..., 1::2]
        elif self.kind == "short":                   # the last pair left out of both slices
            w = q.shape[-1]
            x1, x2, c, s = q[..., 0:w - 2:2], q[..., 1:w - 2:2], c[..., :-1], s[..., :-1]
        elif self.kind == "negated_sin":             # the inverse rotation, by the sine negated in the graph
            s = -s
        if self.kind == "wrong_sign":                # the inverse rotation
            return torch.cat([x1 * c + x2 * s, x2 * c - x1 * s], dim=-1)
        if self.kind == "halves_swapped":            # the two rotated halves concatenated in the other order
            return torch.cat([x2 * c + x1 * s, x1 * c - x2 * s], dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _interleaved_inputs(q_shape, table_shape, dtype):
    torch.manual_seed(0)
    q, k = torch.randn(q_shape).to(dtype), torch.randn(q_shape).to(dtype)
    angles = torch.rand(table_shape) * 6
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_shape,table_shape", [((2, 4, 16, 8), (16, 8)), ((1, 2, 5, 32), (1, 1, 5, 32)),
                                                 ((3, 7, 64), (7, 64))])
def test_deepseek_v3_interleaved_rope_is_named_rope(q_shape, table_shape, dtype):
    m = InterleavedRope().eval()
    args = _interleaved_inputs(q_shape, table_shape, dtype)
    fused = _inference_fuse(m, args)
    assert [d.pattern for d in fused.report.applied] == ["rope"], fused.report.summary()
    _within_bound(m, args, {}, lambda: fused(*args))
    if dtype == torch.float32:        # the same products, differences and sums in fp32 as eager's, one by one
        with torch.no_grad():
            assert torch.equal(fused(*args), m(*args))


@pytest.mark.parametrize("kind", ["odd_first", "two_sources", "short", "negated_sin", "wrong_sign",
                                  "halves_swapped"])
def test_interleaved_rope_near_misses_are_not_named_and_compute_as_written(kind):
    m = InterleavedRope(kind).eval()
    args = _interleaved_inputs((2, 4, 16, 8), (16, 8), torch.float32)
    fused = _inference_fuse(m, args)
    assert fused.report.applied and not _names(fused.report)["rope"], fused.report.summary()
    _within_bound(m, args, {}, lambda: fused(*args))


def test_switching_rope_off_leaves_the_interleaved_rope_unfused():
    m = InterleavedRope().eval()
    args = _interleaved_inputs((2, 4, 16, 8), (16, 8), torch.float32)
    fused = _inference_fuse(m, args, fusion_switches={"rope": "off"})
    assert not fused.report.applied, fused.report.summary()
    (d,) = [d for d in fused.report.decisions if d.pattern == "rope"]
    assert d.reason == "switched off by the rope switch", d.reason
    with torch.no_grad():
        assert torch.equal(fused(*args), m(*args))


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_v3_rotations_are_named_rope_either_way(interleave):
    """DeepSeek-V3 rotates the rotary part of q and of k per layer: by even/odd slices (``rope_interleave``, the
    default) or by ``rotate_half``; both are named rope (k's in the region of kv_a_layernorm's RMSNorm)."""
    torch.manual_seed(0)
    cfg = tf.DeepseekV3Config(vocab_size=128, num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                              q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                              v_head_dim=16, first_k_dense_replace=LAYERS, rope_interleave=interleave)
    cfg._attn_implementation = "sdpa"
    model = tf.DeepseekV3ForCausalLM(cfg).eval()
    ids = torch.randint(1, 128, (2, 16))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    assert _names(fused.report)["rope"] == 2 * LAYERS, fused.report.summary()
    _within_bound(model, (ids,), {"use_cache": False}, lambda: fused(ids, use_cache=False))


class FusedGateUp(nn.Module):
    """A fused gate_up projection split in halves; ``order`` says which half goes through SiLU."""

    def __init__(self, order, act="silu"):
        super().__init__()
        self.order, self.act = order, act
        self.gate_up = nn.Linear(32, 2 * 48, bias=False)
        self.down = nn.Linear(48, 32, bias=False)

    def forward(self, x):
        a, b = self.gate_up(x).chunk(2, -1)
        g, u = (a, b) if self.order == "gate_up" else (b, a)
        act = F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh")
        return self.down(act * u)


@pytest.mark.parametrize("order,act,name", [("gate_up", "silu", "swiglu"), ("up_gate", "silu", "swiglu"),
                                            ("gate_up", "gelu", "geglu")])
def test_gated_projection_fuses_as_matmul_epilogue(order, act, name):
    # silu(b) * a is still a gated unit: the half under the activation is the gate, whatever its position
    torch.manual_seed(0)
    m = FusedGateUp(order, act).eval()
    x = torch.randn(3, 10, 32)
    fused = AutoFusionEngine.fuse(m, (x,))
    ps = [d.pattern for d in fused.report.applied]
    assert f"matmul+{name}" in ps, fused.report.summary()
    _within_bound(m, (x,), {}, lambda: fused(x))


class AdaptedGateUp(nn.Module):
    """A fused gate_up projection plus a term as wide as it, added before the split (Zamba2's shared MLP adds a
    per-layer LoRA adapter's output, ``gate_up_proj(x) + adapter(x)``; here also a residual input)."""

    def __init__(self, act, adapter):
        super().__init__()
        self.act, self.adapter = act, adapter
        self.gate_up = nn.Linear(32, 2 * 48, bias=False)
        self.lora = nn.Sequential(nn.Linear(32, 8, bias=False), nn.Linear(8, 2 * 48, bias=False))
        self.down = nn.Linear(48, 32, bias=False)

    def forward(self, x, r):
        h = self.gate_up(x) + (self.lora(x) if self.adapter else r)
        g, u = torch.split(h, 48, dim=-1)
        return self.down((F.silu(g) if self.act == "silu" else F.gelu(g)) * u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act,name,adapter", [("silu", "swiglu", True), ("gelu", "geglu", False)])
def test_a_term_added_before_the_split_of_a_gated_projection_is_in_its_epilogue(act, name, adapter, dtype):
    """The epilogue reads the product and the added term whole, row by row, and its gated unit works on halves as
    wide as the output: each op covers its own columns (the halves ran as if as wide as the row, and the check
    raised, so the block ran unfused)."""
    torch.manual_seed(0)
    m = AdaptedGateUp(act, adapter).to(dtype).eval()
    x, r = torch.randn(3, 10, 32, dtype=dtype), torch.randn(3, 10, 96, dtype=dtype)
    fused = AutoFusionEngine.fuse(m, (x, r))
    assert not [d for d in fused.report.decisions if d.reason_code == "verification_failed"], fused.report.summary()
    assert f"matmul+{name}" in [d.pattern for d in fused.report.applied], fused.report.summary()
    _within_bound(m, (x, r), {}, lambda: fused(x, r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_major_sum_viewed_back_to_its_batch_keeps_its_epilogue_at_batch_one(dtype):
    """Qwen2-MoE's shared expert, ``sigmoid(gate(h)) · expert(h)`` on token-major rows ``h = [T, C]``, is added to
    the routed experts' output and the sum viewed back to ``[B, S, C]``. At batch 1 that view looked like a
    regrouping of batch dims, and the canonical form moved the sum past it: the gate's epilogue then ended in a
    value only the canonical form held, and it ran unfused. Batch 1 fuses what batch 2 fuses; only a sum with batch
    dims of its own is moved."""
    from autofuse.models import build_transformers
    fused_at = {}
    for batch in (1, 2):
        torch.manual_seed(0)
        model, (args, kwargs) = build_transformers(
            "transformers:Qwen2MoeConfig?num_hidden_layers=1&hidden_size=64&intermediate_size=128"
            "&num_attention_heads=4&num_key_value_heads=2&vocab_size=128&num_experts=8&num_experts_per_tok=2"
            "&moe_intermediate_size=32&shared_expert_intermediate_size=64", seq=16, batch=batch, attn="sdpa",
            dtype=dtype)
        fused = AutoFusionEngine.fuse(model, (args, kwargs))
        fused_at[batch] = collections.Counter(d.pattern for d in fused.report.applied)
        ref = copy.deepcopy(model).double()
        ref.set_experts_implementation("eager")         # torch's grouped GEMM takes no float64: the same sums
        with torch.no_grad():
            ok, err, tol = compare(model(*args, **kwargs).logits, ref(*args, **kwargs).logits,
                                   fused(*args, **kwargs).logits)
        assert ok, (batch, err, tol)
    assert fused_at[1]["matmul_epilogue"] == 1 and fused_at[1] == fused_at[2], fused_at


class GateUp(nn.Module):
    """Separate gate and up projections (Llama's MLP): the SwiGLU can be either one's epilogue."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(32, 48, bias=False), nn.Linear(32, 48, bias=False), \
            nn.Linear(48, 32, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def test_two_epilogues_at_one_anchor_are_told_apart_in_the_report():
    torch.manual_seed(0)
    m = GateUp().eval()
    x = torch.randn(2, 8, 32)
    fused = AutoFusionEngine.fuse(m, (x,))
    both = [d for d in fused.report.decisions if d.pattern == "matmul+swiglu"]
    assert len(both) == 2 and {d.anchor for d in both} == {both[0].anchor}, fused.report.summary()
    (won,), (lost,) = [d for d in both if d.applied], [d for d in both if not d.applied]
    assert lost.reason_code == "conflict"
    # the loser's reason names the projection the winner is over, and its own: not just the shared anchor
    (theirs,), (ours,) = (set(a.nodes) - set(b.nodes) for a, b in ((won, lost), (lost, won)))
    assert f"over {theirs} where this one is over {ours}" in lost.reason, lost.reason
    _within_bound(m, (x,), {}, lambda: fused(x))


@pytest.mark.parametrize("spelling", ["gelu(x) * 3 + 1", "silu(x) * 0.5", "silu(x) * x", "silu(x) * w",
                                      "silu(x) * (x + 1)", "silu(x) * sigmoid(x)"])
def test_an_activation_times_no_second_projection_is_not_a_gated_unit(spelling):
    # a gated unit multiplies by another tensor of the gate's shape, computed without the gate; a number, a
    # per-channel scale, the gate's own input or a value made from it make an activation chain (computed as
    # written, named vector_chain)
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64))

        def forward(self, x):
            return {"gelu(x) * 3 + 1": lambda: F.gelu(x) * 3 + 1, "silu(x) * 0.5": lambda: F.silu(x) * 0.5,
                    "silu(x) * x": lambda: F.silu(x) * x, "silu(x) * w": lambda: F.silu(x) * self.w,
                    "silu(x) * (x + 1)": lambda: F.silu(x) * (x + 1),
                    "silu(x) * sigmoid(x)": lambda: F.silu(x) * torch.sigmoid(x)}[spelling]()

    m = M().eval()
    x = torch.randn(8, 64)
    fused = AutoFusionEngine.fuse(m, (x,))
    assert [d.pattern for d in fused.report.applied] == ["vector_chain"], fused.report.summary()
    _within_bound(m, (x,), {}, lambda: fused(x))


class Chain(nn.Module):
    def forward(self, x, y):
        return torch.tanh(x * 2.0 + y).sigmoid() @ x.new_ones(x.shape[-1], 3)


def test_an_unnamed_chain_is_a_vector_chain():
    m = Chain()
    x, y = torch.randn(5, 7, 12), torch.randn(5, 7, 12)
    fused = AutoFusionEngine.fuse(m, (x, y))
    assert [d.pattern for d in fused.report.applied] == ["vector_chain"], fused.report.summary()
    _within_bound(m, (x, y), {}, lambda: fused(x, y))


def test_a_single_op_is_not_a_region():
    class One(nn.Module):
        def forward(self, x):
            return torch.tanh(x) @ torch.ones(12, 3)
    fused = AutoFusionEngine.fuse(One(), (torch.randn(5, 12),))
    assert not [d for d in fused.report.decisions if d.params.get("family") == "vector_chain"]


class TableBiasedAttention(nn.Module):
    """Swin v2's relative position bias, ``16 · sigmoid(table)`` of shape [H, N, N], added to the scores: at batch 1
    the scores' sum and the bias share one iteration space, so one Vector region holds the scale, the sum and the
    bias's ops, and the attention block takes the scale and the sum from it. ``ops=1`` is a bias of one op."""

    def __init__(self, heads=4, n=16, ops=2):
        super().__init__()
        self.ops = ops
        self.table = nn.Parameter(torch.randn(heads, n, n))

    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        bias = torch.sigmoid(self.table)
        s = s + (16 * bias if self.ops == 2 else bias).to(s.dtype)
        return s.softmax(-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 16, 16), (1, 2, 24, 8)])
def test_the_rest_of_a_region_an_attention_block_wins_is_fused_on_its_own(shape, dtype):
    torch.manual_seed(0)
    b, h, n, d = shape
    m = TableBiasedAttention(h, n).eval()
    q, k, v = (torch.randn(shape, dtype=dtype) for _ in range(3))
    fused = _inference_fuse(m, (q, k, v))
    applied = {d.pattern: d for d in fused.report.applied}
    assert set(applied) == {"attention", "vector_chain"}, fused.report.summary()
    assert {"sigmoid", "mul_1", "_to_copy"} >= set(applied["vector_chain"].nodes) >= {"sigmoid", "mul_1"}, \
        fused.report.summary()
    whole = [d for d in fused.report.decisions if d.pattern == "vector_chain" and "add" in d.nodes]
    assert whole and whole[0].reason_code == "conflict", fused.report.summary()   # the region as found lost
    assert "aten.sigmoid" not in fused.graph_module.code
    _within_bound(m, (q, k, v), {}, lambda: fused(q, k, v))


def test_near_miss_the_rest_of_a_region_of_one_op_is_left_as_captured():
    """A bias of one op (``sigmoid(table)``): what the attention block leaves of the region gains nothing fused."""
    torch.manual_seed(0)
    m = TableBiasedAttention(ops=1).eval()
    q, k, v = (torch.randn(1, 4, 16, 16) for _ in range(3))
    fused = _inference_fuse(m, (q, k, v))
    assert [d.pattern for d in fused.report.applied] == ["attention"], fused.report.summary()
    assert "aten.sigmoid" in fused.graph_module.code
    _within_bound(m, (q, k, v), {}, lambda: fused(q, k, v))


def test_the_rest_of_a_region_is_cut_where_a_block_gives_it_a_value_back():
    """A block that reads the region at one node (``mul``) and gives it a value back at another (``add``, from the
    block's own matmul, outside the region): the rest of the region (exp, neg | add, abs, add_1) is offered in two
    parts, one above the block and one below it; one call holding both would be a cycle with the block's call."""
    from autofuse.capture import capture
    from autofuse.canonicalize import canonicalize
    from autofuse.match import Match
    from patterns.vector_chain import outside_blocks

    class M(nn.Module):
        def forward(self, x, y):
            b = x.exp().neg()
            t = b * 2
            o = y @ y
            p = b + o
            return p + t.abs()

    x, y = torch.randn(8, 8), torch.randn(8, 8)
    gm = canonicalize(capture(M(), (x, y)).graph_module)
    names = [n.name for n in gm.graph.nodes]
    above, below = {"exp", "neg"}, {"add", "abs_1", "add_1"}
    assert above | below | {"mul", "matmul"} <= set(names), names
    block = Match("softmax", ("mul", "matmul"), "mul")     # stands for a pattern's block over those two nodes
    offered = [set(m.nodes) for m in outside_blocks(gm, [block])]
    assert above in offered and below in offered, offered
    assert not [o for o in offered if o & above and o & below], offered


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 64)

    def forward(self, x):
        return F.gelu(self.fc(x)) @ x.new_ones(64, 4)


def test_matmul_gelu_epilogue_and_its_alternatives_on_every_device():
    torch.manual_seed(0)
    m = Linear().eval()
    x = torch.randn(4, 9, 32)
    fused = AutoFusionEngine.fuse(m, (x,))
    (d,) = [d for d in fused.report.applied if d.params.get("family") == "matmul_epilogue"]
    assert d.pattern == "matmul_epilogue"
    alts = d.params["alternatives"]
    assert set(alts) == {"ascend910", "ascend910b", "ascend310p"}
    assert all({"matmul_epilogue", "matmul + vector_program"} == {a[0] for a in v} for v in alts.values())
    _within_bound(m, (x,), {}, lambda: fused(x))


MULTI_READ = {   # activations that read the projection's output more than once
    "quick_gelu": lambda h: h * torch.sigmoid(1.702 * h),                      # CLIP's
    "silu_spelled": lambda h: h * torch.sigmoid(h),
    "gelu_new": lambda h: 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0)))),
}


class Projected(nn.Module):
    def __init__(self, act, keep=False):
        super().__init__()
        self.act, self.keep = act, keep
        self.fc, self.out = nn.Linear(32, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = self.fc(x)
        y = self.out(MULTI_READ[self.act](h))
        return (y, h) if self.keep else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", list(MULTI_READ))
def test_an_activation_reading_the_product_several_times_is_its_epilogue(act, dtype):
    # the product's every reader is in the region, so it never goes to HBM: one matmul_epilogue launch, values
    # within eager's bound
    torch.manual_seed(0)
    m = Projected(act).to(dtype).eval()
    x = torch.randn(3, 10, 32).to(dtype)
    fused = AutoFusionEngine.fuse(m, (x,))
    (d,) = [d for d in fused.report.applied if d.params.get("family") == "matmul_epilogue"]
    assert "linear" in d.nodes, fused.report.summary()
    _within_bound(m, (x,), {}, lambda: fused(x))


@pytest.mark.parametrize("act", list(MULTI_READ))
def test_a_multi_read_epilogue_trains_as_eager(act):
    # the product's gradient is the sum over its readers, as autograd's
    torch.manual_seed(0)
    m = Projected(act).train()
    x0 = torch.randn(3, 10, 32)
    fused = AutoFusionEngine.fuse(m, (x0.clone().requires_grad_(),))
    assert [d for d in fused.report.applied if d.params.get("family") == "matmul_epilogue"], fused.report.summary()
    grads = []
    for run in (m, fused):
        m.zero_grad()
        x = x0.clone().requires_grad_()
        run(x).square().sum().backward()
        grads.append([x.grad] + [p.grad.clone() for p in m.parameters()])
    for w, g in zip(*grads):
        # fp32: the derived backward and autograd sum the readers' terms in other orders, over 30 rows
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-5), (act, (g - w).abs().max())


@pytest.mark.parametrize("act", list(MULTI_READ))
def test_a_product_the_model_also_returns_is_no_epilogue(act):
    # near miss: the product is read outside the region (returned), so it is stored anyway: no epilogue over it
    torch.manual_seed(0)
    m = Projected(act, keep=True).eval()
    x = torch.randn(3, 10, 32)
    fused = AutoFusionEngine.fuse(m, (x,))
    assert not [d for d in fused.report.decisions if d.params.get("family") == "matmul_epilogue"
                and "linear" in d.nodes], fused.report.summary()
    _within_bound(m, (x,), {}, lambda: fused(x))


class SplitOrScaled(nn.Module):
    """A projection split into unequal parts (Mamba's in_proj), or scaled per sample (a drop-path mask)."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.fc = kind, nn.Linear(16, 40)

    def forward(self, x, s):
        h = self.fc(x)
        if self.kind == "split":
            a, b, c = h.split([8, 16, 16], -1)
            return torch.tanh(a).sum(-1, keepdim=True) * F.silu(b) * c
        return F.layer_norm(torch.tanh(h * s) + 1.0, (40,))


@pytest.mark.parametrize("kind,says", [("split", "parts of widths [8, 16]"),
                                       ("per_sample", "[3, 1, 1] broadcast over some of the product's leading dims "
                                                      "only (it changes along the product's leading dims of sizes "
                                                      "[3] and repeats along [5]; as a per-sample drop-path mask "
                                                      "[B, 1, 1] over [B, S, H] does)")])
def test_an_epilogue_the_kernel_cannot_read_says_why_in_the_models_terms(kind, says):
    torch.manual_seed(0)
    m = SplitOrScaled(kind).eval()
    x, s = torch.randn(3, 5, 16), torch.rand(3, 1, 1)
    fused = AutoFusionEngine.fuse(m, (x, s))
    why = [d.reason for d in fused.report.decisions if d.params.get("family") == "matmul_epilogue"
           and d.reason_code == "unsupported"]
    assert why and all(says in r and "Error" not in r for r in why), why
    _within_bound(m, (x, s), {}, lambda: fused(x, s))


class RotatedProjection(nn.Module):
    """A projection rotated by position tables [S, 16] that every sample reads (RoPE on a projection's output)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("angles", torch.rand(5, 16) * 6)

    def forward(self, x):
        h = self.fc(x)
        return h * self.angles.cos() + torch.cat((-h[..., 8:], h[..., :8]), -1) * self.angles.sin()


def test_an_epilogue_reading_a_table_every_sample_shares_names_the_table_not_a_drop_path_mask():
    torch.manual_seed(0)
    m = RotatedProjection().eval()
    x = torch.randn(3, 5, 16)
    fused = AutoFusionEngine.fuse(m, (x,))
    why = [d.reason for d in fused.report.decisions if d.params.get("family") == "matmul_epilogue"
           and d.reason_code == "unsupported"]
    assert why, fused.report.summary()
    for r in why:
        assert "[5, 16] broadcast over some of the product's leading dims only (it changes along the product's " \
               "leading dims of sizes [5] and repeats along [3])" in r and "drop-path" not in r, r
        assert "a cos table (computed by aten.cos)" in r and "a sin table (computed by aten.sin)" in r, r
    _within_bound(m, (x,), {}, lambda: fused(x))


def test_a_whole_region_name_switches_only_that_region():
    # "matmul+swiglu" off: the SwiGLU is no epilogue, but still fused as a Vector region of its own
    torch.manual_seed(0)
    m = GateUp().eval()
    x = torch.randn(2, 8, 32)
    fused = AutoFusionEngine.fuse(m, (x,), fusion_switches={"matmul+swiglu": "off"})
    assert [d.pattern for d in fused.report.applied] == ["swiglu"], fused.report.summary()
    assert {d.reason_code for d in fused.report.decisions if d.pattern == "matmul+swiglu"} == {"disabled_by_switch"}


def test_switching_a_name_off_leaves_it_unfused():
    torch.manual_seed(0)
    m = Norm("rms").eval()
    x, r = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
    fused = AutoFusionEngine.fuse(m, (x, r), fusion_switches={"add_rms_norm": "off"})
    assert not [d for d in fused.report.applied if "add_rms_norm" in d.pattern]
    off = [d for d in fused.report.decisions if d.reason_code == "disabled_by_switch"]
    assert off and all(d.reason == "switched off by the add_rms_norm switch" for d in off), [d.reason for d in off]
    # a family's switch is named as the family's, not as the region's name
    fused = AutoFusionEngine.fuse(m, (x, r), fusion_switches={"vector_chain": "off", "matmul_epilogue": "off"})
    reasons = {d.pattern: d.reason for d in fused.report.decisions}
    assert reasons["add_rms_norm"] == "switched off by the vector_chain switch (the vector_chain family)", reasons


@pytest.mark.parametrize("value", ["on", "force"])
def test_a_names_switch_wins_over_its_familys(value):
    """A region name is the finer switch: turned on or forced while its family is off, that region fuses and
    the family's other regions stay unfused; switched off while its family is forced, it stays unfused."""
    torch.manual_seed(0)
    m = Norm("rms").eval()
    x, r = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
    fused = _inference_fuse(m, (x, r), fusion_switches={"vector_chain": "off", "add_rms_norm": value})
    assert [d.pattern for d in fused.report.applied] == ["add_rms_norm"], fused.report.summary()
    fused = _inference_fuse(m, (x, r), fusion_switches={"vector_chain": "force", "add_rms_norm": "off"})
    (d,) = [d for d in fused.report.decisions if d.pattern == "add_rms_norm"]
    assert not d.applied and d.reason == "switched off by the add_rms_norm switch", d.reason


def test_forced_is_said_only_where_the_switch_changed_the_outcome():
    torch.manual_seed(0)
    m = Norm("rms").eval()
    x, r = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
    fused = _inference_fuse(m, (x, r), fusion_switches={"add_rms_norm": "force"})
    (d,) = [d for d in fused.report.applied if d.pattern == "add_rms_norm"]
    assert d.speedup > 1 and not d.reason.startswith("forced"), d.reason


def test_a_norm_reading_a_copy_of_its_own_add_verifies_on_meta_planning():
    """GPT-2's embedding sum feeds its first LayerNorm through a copy (eval dropout): the region (add, norm) is
    checked with that copy recomputed inside the block, so random inputs on a meta plan stay consistent."""
    model, (args, kwargs) = build("gpt2", layers=1, hidden=32, heads=4, seq=8, meta=True)
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    assert not [d for d in fused.report.decisions if d.reason_code == "verification_failed"], fused.report.summary()
    (d,) = [d for d in fused.report.decisions if d.anchor == "add_1"]
    assert d.applied and d.pattern == "layer_norm"
    # the copy (eval dropout's clone) is only read by the block's consumers: the fused call's fresh result
    # takes its place, so the copy goes with the block instead of running after it
    assert "clone" in d.nodes and "clone" not in {n.name for n in fused.graph_module.graph.nodes}


def test_report_shows_each_regions_implementation_on_every_device():
    """A 2-layer LLaMA: every fused Vector region and epilogue is named, and the Markdown report lists every fused
    region's (attention's too) chosen implementation and price on each of the three device profiles."""
    from autofuse.report import implementation_rows, markdown
    torch.manual_seed(0)
    model, (args, kwargs) = build("llama", layers=2, hidden=32, heads=4, seq=8)
    report = AutoFusionEngine.fuse(model, (args, kwargs)).report
    names = {d.pattern for d in report.applied}
    assert {"rope", "matmul+swiglu"} <= names and any("rms_norm" in n for n in names), report.summary()
    rows = implementation_rows(report)
    regions = {(r[0], r[1]) for r in rows}
    assert {r[0] for r in rows} == names
    assert any(r[0] == "attention" and r[3].startswith("flash_attention (q ") for r in rows)
    assert regions and all({r[2] for r in rows if (r[0], r[1]) == k} == {"ascend910", "ascend910b", "ascend310p"}
                           for k in regions)
    md = markdown(report)
    assert "## Implementation choices per device" in md
    for name, anchor, device, chosen, cycles, _ in rows:
        assert f"| {name} | `{anchor}` | {device} | {chosen} | {cycles:,} |" in md


class ResidualNorm(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc, self.norm = nn.Linear(h, h), nn.LayerNorm(h)

    def forward(self, x, r):
        return self.norm(self.fc(x) + r)


def test_a_whole_row_epilogue_of_a_wide_projection_is_priced_and_runs():
    # LayerNorm after a 768-wide projection needs whole rows per tile: the K slices shrink so the row-wide B
    # tile fits L0B. The cost model prices it (and, here, prefers the norm alone); forced, it runs as eager
    torch.manual_seed(0)
    m = ResidualNorm(768).half().eval()
    x, r = torch.randn(2, 40, 768).half(), torch.randn(2, 40, 768).half()
    fused = AutoFusionEngine.fuse(m, (x, r))
    (d,) = [d for d in fused.report.decisions if d.pattern == "matmul+layer_norm"]
    assert d.reason_code in ("conflict", "not_profitable") and d.cycles_fused > 0, d.reason
    forced = AutoFusionEngine.fuse(m, (x, r), fusion_switches={"vector_chain": "off", "matmul_epilogue": "force"})
    assert [d.pattern for d in forced.report.applied] == ["matmul+layer_norm"], forced.report.summary()
    if d.reason_code == "not_profitable":        # fused only because it was forced: the reason says so
        assert forced.report.applied[0].reason.startswith("forced by switch"), forced.report.applied[0].reason
    _within_bound(m, (x, r), {}, lambda: forced(x, r))


def test_an_epilogue_whose_rows_cannot_fit_ub_says_what_it_needs():
    m = ResidualNorm(4096).half().eval()
    x, r = torch.randn(1, 8, 4096).half(), torch.randn(1, 8, 4096).half()
    fused = AutoFusionEngine.fuse(m, (x, r))
    (d,) = [d for d in fused.report.decisions if d.pattern == "matmul+layer_norm"]
    assert d.reason_code == "unsupported"
    assert "whole rows of 4096 columns" in d.reason and "B of UB, 262,144 B available" in d.reason


def test_phi3_full_rotary_with_an_empty_pass_through_part_is_rope():
    """Phi-3 rotates ``q[..., :rotary_dim]`` and concatenates ``q[..., rotary_dim:]``, which is empty at full
    rotary (partial_rotary_factor 1): the empty part is no value of the program (the region was refused whole)."""
    torch.manual_seed(0)
    cfg = tf.Phi3Config(vocab_size=128, num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    model = tf.Phi3ForCausalLM(cfg).eval()
    ids = torch.randint(1, 128, (2, 16))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    assert _names(fused.report)["rope"] == 2 * LAYERS, fused.report.summary()
    _within_bound(model, (ids,), {"use_cache": False}, lambda: fused(ids, use_cache=False))


class EmptyPart(nn.Module):
    def forward(self, x):
        return torch.cat([torch.relu(x) * 2, x[..., 32:]], -1) + 1, x[..., 32:] * 3


def test_an_empty_slice_read_by_anything_but_a_cat_is_refused_by_name_and_costs_nothing():
    from autofuse.vector_program import NotExpressible, program_from_nodes
    from autofuse.capture import capture
    gm = capture(EmptyPart(), (torch.randn(4, 32),)).graph_module
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    with pytest.raises(NotExpressible, match="empty"):
        program_from_nodes(nodes)
    m = EmptyPart()
    x = torch.randn(4, 32)
    fused = AutoFusionEngine.fuse(m, (x,))          # the op on the empty slice is priced as no work (it crashed)
    for g, w in zip(fused(x), m(x)):
        torch.testing.assert_close(g, w)
    assert fused.simulate(x).cycles > 0


def test_halves_read_slices_with_their_defaults():
    """A slice node may leave its end (and step) out: the per-half RoPE check reads them as defaults (indexing
    them raised IndexError inside the naming pass)."""
    import torch.fx as fx
    from patterns.vector_chain import _halves
    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 8)
    first = g.call_function(aten.slice.Tensor, (x, -1, 0, 4))
    second = g.call_function(aten.slice.Tensor, (x, -1, 4))                     # end left out
    second_full = g.call_function(aten.slice.Tensor, (x, 1, 4, 2 ** 63 - 1))
    assert _halves(first, second) is x and _halves(first, second_full) is x
    assert _halves(second, first) is None                                       # the halves' order matters
    # the even and the odd elements (DeepSeek-V3's interleaved pairs), of one source, evens first, every pair whole
    y = g.placeholder("y")
    y.meta["val"] = torch.empty(2, 8)
    ev, od = g.call_function(aten.slice.Tensor, (x, -1, 0, None, 2)), g.call_function(aten.slice.Tensor, (x, -1, 1))
    od2 = g.call_function(aten.slice.Tensor, (x, 1, 1, 2 ** 63 - 1, 2))
    assert _halves(ev, od) is None                                              # the odd ones by step 1: no pairs
    assert _halves(ev, od2) is x and _halves(od2, ev) is None
    assert _halves(ev, g.call_function(aten.slice.Tensor, (y, -1, 1, None, 2))) is None       # another source
    assert _halves(ev, g.call_function(aten.slice.Tensor, (x, -1, 1, 6, 2))) is None          # a pair left out


def test_a_region_split_at_an_op_it_cannot_run_never_holds_both_sides_of_that_op():
    """A sum over a dim that is not the last splits its region; the ops that feed the sum and the ops that read
    it share rows (the summed dim has size 1) and an input, but one part holding both would feed the sum and
    read it back: a cycle once the part is one call (Qwen3-Next's gated delta rule wrote this)."""
    from autofuse.capture import capture

    class M(nn.Module):
        def forward(self, x, y):
            a = torch.sigmoid(x[..., 0:1]) * 2.0                     # [2, 4, 1, 1]
            m = (a.unsqueeze(-1) * y[..., 0:1]).exp()               # [2, 4, 1, 1, 1]: the rows of a
            return (a + m.sum(-2)).tanh() * 3.0                     # the sum's dim is not the last

    x, y = torch.randn(2, 4, 1, 5), torch.randn(2, 4, 1, 1, 5)
    f = AutoFusionEngine.fuse(M(), (x, y))
    g = capture(M(), (x, y)).graph_module.graph
    s = next(n for n in g.nodes if n.target == torch.ops.aten.sum.dim_IntList)
    above, below, stack = set(), set(), [s]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a.name not in above:
                above.add(a.name)
                stack.append(a)
    stack = [s]
    while stack:
        for u in stack.pop().users:
            if u.name not in below:
                below.add(u.name)
                stack.append(u)
    offered = [set(d.nodes) for d in f.report.decisions]
    assert any(d & below for d in offered) and any(d & above for d in offered)     # both sides are regions
    assert not [d for d in offered if d & above and d & below]
    _within_bound(M(), (x, y), {}, lambda: f(x, y))


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_rope_outputs_keep_the_captured_memory_layout_for_an_unfused_attention(arch):
    """With attention left unfused (switched off here; a rejected block alike), the fused RoPE feeds torch's SDPA,
    whose output follows its query's memory layout, and a later ``view`` relies on it: the generated kernel
    stores the rotated q and k in the captured [B, S, N, D] memory order (the outputs were row-major before, and
    the view failed)."""
    from autofuse.graph import val
    torch.manual_seed(0)
    model = ARCHS[arch][0]("sdpa")
    ids = torch.randint(1, 128, (2, 16))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}), fusion_switches={"attention": "off"})
    assert _names(fused.report)["rope"] == 2 * LAYERS and not _names(fused.report)["attention"]
    gm = next(iter(fused.plans.values())).graph_module
    laid = [n for n in gm.graph.nodes if n.target == torch.ops.autofuse.vector_program.default and n.kwargs.get("layouts")]
    assert len(laid) >= LAYERS                        # the rotations (q and k together, or apart)
    for n in laid:
        for user in n.users:
            v = val(user)
            assert v is not None and not v.is_contiguous() and v.stride()[-1] == 1
    _within_bound(model, (ids,), {"use_cache": False}, lambda: fused(ids, use_cache=False))


@pytest.mark.parametrize("batch", [1, 2])
def test_generated_kernels_store_the_layout_eager_gives_the_value_they_replace(batch):
    """Mamba-2's chunk scan (Zamba2's hybrid layers) adds a transposed skip term ``D·x`` to its merged chunk outputs,
    then cuts the padded positions and merges the heads with a ``view``, which relies on eager's (row-major) layout
    of that sum. The canonical form sums at the chunks' rank with the terms in another order, and its meta kernel
    lays that sum out otherwise: the generated kernel stores its output in the captured value's layout, not the
    canonical node's (with the canonical one, the view failed at batch 2)."""
    from autofuse.models import build_transformers
    torch.manual_seed(0)
    model, (args, kwargs) = build_transformers(
        "transformers:Zamba2Config?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
        "&num_key_value_heads=2&vocab_size=128&layers_block_type=[mamba,hybrid]&mamba_d_state=16&mamba_headdim=16",
        seq=16, batch=batch, attn="sdpa")
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    assert _names(fused.report)["attention"] == 1
    with torch.no_grad():
        torch.testing.assert_close(fused(*args, **kwargs).logits, model(*args, **kwargs).logits, atol=1e-5, rtol=1e-4)


class _HeadNormMerge(nn.Module):
    """xLSTM's multi-head norm: a norm over each head of a value whose heads and tokens were transposed, then the
    heads merged by ``reshape``, which torch.export spells as a contiguous ``clone`` and an ``_unsafe_view``."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.proj(x).view(b, t, 8, 8).transpose(1, 2).contiguous().transpose(1, 2)    # [b, t, heads, d]
        mu = h.mean(-1, keepdim=True)
        c = h - mu
        n = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.out(n.reshape(b, t, 64))


@pytest.mark.parametrize("model_", ["head_norm", "xlstm"])
def test_a_region_whose_output_a_contiguous_copy_relays_keeps_the_copy(model_):
    """The region's value is laid out heads-first (the transposed input's layout, as eager's elementwise ops lay it
    out), and ``.contiguous()`` moves it before the view merges the heads. The rewrite took that copy for one the
    fused call's fresh result makes needless, but the result is laid out as the value (so a view may rely on it):
    the view then raised "view size is not compatible with input tensor's size and stride" at every call (xLSTM
    in fuse() and through torch.compile, training or not). The copy of a value it relays now stays."""
    from autofuse.models import build_transformers
    torch.manual_seed(0)
    if model_ == "xlstm":
        model, (args, kwargs) = build_transformers(
            "transformers:xLSTMConfig?num_hidden_layers=2&hidden_size=64&num_heads=4&vocab_size=128", seq=16,
            batch=2, attn="eager")
    else:
        model, args, kwargs = _HeadNormMerge().eval(), (torch.randn(2, 16, 16),), {}
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    assert fused.report.applied
    with torch.no_grad():
        got, want = fused(*args, **kwargs), model(*args, **kwargs)
    got, want = (getattr(got, "logits", got), getattr(want, "logits", want))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)      # fp32 both sides: summation orders


# ----------------------------------------------------------------------------------------- activations

ACTIVATIONS = {
    "erf": torch.erf, "log1p": torch.log1p, "expm1": torch.expm1,
    "softplus": F.softplus, "softplus_beta_threshold": lambda t: F.softplus(t, beta=2.0, threshold=5.0),
    "mish": F.mish, "logsigmoid": F.logsigmoid,
    "leaky_relu": F.leaky_relu, "leaky_relu_0.2": lambda t: F.leaky_relu(t, 0.2),
    "elu": F.elu, "elu_0.5": lambda t: F.elu(t, 0.5), "selu": F.selu, "celu_2": lambda t: F.celu(t, 2.0),
    "hardtanh": F.hardtanh, "hardtanh_-2_0.5": lambda t: F.hardtanh(t, -2.0, 0.5), "relu6": F.relu6,
    "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish,
}
# the kinks and switches of the formulas (0, the bounds, ±3, softplus's thresholds, expm1's 0.5), large values,
# values below log1p's -1 (NaN, as eager)
KINKS = [0.0, -1.0, 1.0, -3.0, 3.0, 6.0, -2.0, 0.5, -0.5, 2.5, 5.0, 20.0, 25.0, -20.0, -30.0, 90.0, -90.0, 1e-6,
         -1e-6, -1.5, 0.25, -0.75, 8.0, -8.0]


class Act(nn.Module):
    """An activation of a region input, inside a chain to a projection; its own value is returned negated (the
    region's output, rounded once as eager rounds the activation)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(24, 8)

    def forward(self, x):
        y = self.fn(x)
        return self.lin(y * 3 + x), -y


def _act_input(dtype, nonfinite=False):
    torch.manual_seed(0)
    x = torch.randn(6, 24) * 4
    x[0] = torch.tensor(KINKS)
    if nonfinite:
        x[1, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    return x.to(dtype)


def _equal_as_eager(got, want, truth):
    """The same NaNs and infinities; fp32 within four ulps (the erf polynomial, the log1p and expm1 corrections
    against torch's own implementations); fp16/bf16 torch's fp32 value rounded once, by the kernel from fp32 values a
    few fp32 ulps apart: within one unit of the exact value (``truth``, float64), and equal to eager's value but where
    eager's is further from it (eager's 16-bit erf is a coarser approximation than its fp32 one: a few units off
    near 0)."""
    assert got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isinf()], want[want.isinf()])
    fin = want.isfinite()
    g, w, t = got[fin].double(), want[fin].double(), truth[fin].double()
    if want.dtype == torch.float32:
        assert bool(((g - w).abs() <= 4 * 2 ** -23 * w.abs() + 1e-38).all()), (g - w).abs().max()
        return
    ulp = torch.finfo(want.dtype).eps * t.abs().clamp_min(torch.finfo(want.dtype).tiny)
    assert bool(((g - t).abs() <= ulp).all()), ((g - t).abs() / ulp).max()
    assert bool(((g - t).abs() <= (w - t).abs() + 4 * 2 ** -23 * t.abs()).all()), ((g - t).abs() - (w - t).abs()).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_an_activation_joins_its_chain_in_one_region_as_eager(name, dtype):
    m = Act(ACTIVATIONS[name]).to(dtype).eval()
    x = _act_input(dtype, nonfinite=True)
    fused = AutoFusionEngine.fuse(m, (x,))
    regions = [d for d in fused.report.applied if d.kernel == "vector_program"]
    assert len(regions) == 1 and len(regions[0].nodes) >= 4, fused.report.summary()
    for inp in (x, _act_input(dtype)):
        with torch.no_grad():
            _equal_as_eager(fused(inp)[1], m(inp)[1], -ACTIVATIONS[name](inp.double()))
    finite = _act_input(dtype)
    _within_bound(m, (finite,), {}, lambda: fused(finite))


def _train_grads(m, run, x0):
    m.zero_grad()
    x = x0.clone().requires_grad_()
    out, y = run(x)
    (out.square().sum() + (y * torch.linspace(-1, 1, y.shape[-1])).sum()).backward()
    return [x.grad] + [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_an_activation_trains_as_eager_at_its_kinks(name):
    # the derived backward's gradient at 0, at the bounds (hardtanh's and relu6's none there, hardsigmoid's none at
    # ±3, leaky_relu's slope and elu's alpha·scale at 0, softplus's 1/2 at 0) and past the thresholds is eager's
    m = Act(ACTIVATIONS[name]).train()
    x0 = _act_input(torch.float32)
    fused = AutoFusionEngine.fuse(m, (x0.clone().requires_grad_(),))
    assert len([d for d in fused.report.applied if d.kernel == "vector_program"]) == 1, fused.report.summary()
    want, got = _train_grads(m, m, x0), _train_grads(m, fused, x0)
    for w, g in zip(want, got):
        # fp32 gradients: the derived formulas and autograd's differ in their last ulps (exp, erf, the correction
        # of log1p), summed over 6 rows and 8 outputs for the projection's
        assert torch.equal(w.isnan(), g.isnan()), name
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=True), (name, (g - w).abs().nan_to_num().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gelu_spelled_with_erf_is_one_region(dtype):
    # x·½·(1 + erf(x/√2)), as older models write GELU: one region with the chain around it, within the bound of eager
    # (its 1 + erf cancels for very negative x: relative differences there are the formula's, not the kernel's)
    m = Act(lambda t: t * 0.5 * (1.0 + torch.erf(t / math.sqrt(2.0)))).to(dtype).eval()
    x = _act_input(dtype)
    fused = AutoFusionEngine.fuse(m, (x,))
    regions = [d for d in fused.report.applied if d.kernel == "vector_program"]
    assert len(regions) == 1 and "erf" in regions[0].nodes, fused.report.summary()
    _within_bound(m, (x,), {}, lambda: fused(x))


@pytest.mark.parametrize("name", ["hardtanh", "relu6", "hardsigmoid", "leaky_relu", "elu", "softplus", "mish", "erf"])
def test_an_activations_gradient_at_nan_is_eagers(name):
    # hardtanh passes the gradient at NaN, hardsigmoid does not (elu and leaky_relu take their positive or negative
    # branch there as eager); hardswish's is NaN fused (x · the clamp's NaN), 1 in eager: not tested
    m = Act(ACTIVATIONS[name]).train()
    x0 = _act_input(torch.float32, nonfinite=True)[:, 2:]
    m.lin = nn.Linear(22, 8)
    fused = AutoFusionEngine.fuse(m, (x0.clone().requires_grad_(),))
    want, got = _train_grads(m, m, x0)[0], _train_grads(m, fused, x0)[0]
    assert torch.equal(w := want.isnan(), got.isnan()), (name, w)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True), name


@pytest.mark.parametrize("name", ["relu", "abs"])
def test_gradient_at_a_nan_input_of_relu_and_abs_is_eagers(name):
    # a NaN input whose gradient reaches it finite (the product with a weight): relu's backward passes it (torch's
    # threshold_backward zeroes it only where the result is <= 0, NaN is not), abs's is 0 (sgn(NaN) is 0); they were
    # 0 and NaN fused
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.linspace(0.5, 2.0, 8))

        def forward(self, x):
            return (torch.relu(x) if name == "relu" else torch.abs(x)) * self.w

    m = M().train()
    fused = AutoFusionEngine.fuse(m, (torch.randn(2, 8, requires_grad=True),))
    assert [d.kernel for d in fused.report.applied] == ["vector_program"], fused.report.summary()
    x = torch.randn(2, 8)
    x[0, 3], x[1, 5] = float("nan"), 0.0
    grads = []
    for run in (m, fused):
        xx = x.clone().requires_grad_()
        run(xx).sum().backward()
        grads.append(xx.grad)
    assert torch.equal(grads[0].isnan(), grads[1].isnan()) and not grads[0].isnan().any()
    assert torch.equal(grads[1], grads[0])      # each element one product of the weight, or 0


def test_a_random_slope_is_not_a_leaky_relu():
    # F.rrelu's slope in training is drawn at random: no leaky_relu of the region; it stays as captured
    class Slope(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(24, 8)

        def forward(self, x):
            y = F.rrelu(x, training=True)
            return self.lin(y * 3 + x), -y

    m = Slope().eval()
    x = _act_input(torch.float32)
    fused = AutoFusionEngine.fuse(m, (x,))
    assert all("rrelu" not in n for d in fused.report.applied for n in d.nodes)
    assert "aten.rrelu" in fused.graph_module.code


class PReLU(nn.Module):
    """nn.PReLU of ``C`` slopes (spread over -0.5 .. 0.5: negative, zero and positive ones) in a chain to a projection;
    its own value is returned negated."""

    def __init__(self, C):
        super().__init__()
        self.p = nn.PReLU(C)
        with torch.no_grad():
            self.p.weight.copy_(torch.linspace(-0.5, 0.5, C))
        self.lin = nn.Linear(24, 8)

    def forward(self, x):
        y = self.p(x * 2 + 1)
        return self.lin(y * 3 + x), -y


PRELU_CASES = {"per_column": ((6, 24), 24), "one_slope": ((6, 24), 1), "one_slope_3d": ((4, 5, 24), 1)}


def _prelu_input(shape, dtype, nonfinite=True):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3
    flat = x.view(-1, 24)
    flat[0] = torch.tensor(KINKS) / 2 - 0.5                    # x * 2 + 1 is the kinks, 0 among them
    if nonfinite:
        flat[1, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(PRELU_CASES))
def test_prelu_joins_its_chain_with_eagers_values(case, dtype):
    # lin(prelu(x * 2 + 1) * 3 + x) is one region (prelu cut it in two before); x > 0 ? x : w · x is eager's value
    # bit for bit (one product, one rounding), at 0, ±inf and NaN too
    shape, C = PRELU_CASES[case]
    m = PReLU(C).to(dtype).eval()
    x = _prelu_input(shape, dtype)
    fused = AutoFusionEngine.fuse(m, (x,))
    regions = [d for d in fused.report.applied if d.kernel in ("vector_program", "matmul_epilogue")]
    assert any("prelu" in d.nodes and "add" in d.nodes and "add_1" in d.nodes for d in regions), \
        fused.report.summary()
    with torch.no_grad():
        _identical(fused(x)[1], m(x)[1])
    finite = _prelu_input(shape, dtype, nonfinite=False)
    _within_bound(m, (finite,), {}, lambda: fused(finite))


@pytest.mark.parametrize("case", list(PRELU_CASES))
def test_prelu_trains_as_eager(case):
    # torch's gradients: g or w · g for x, x · g for the slopes where x <= 0, summed over the rows (and the columns
    # for one slope); against a float64 copy within the verifier's bound
    shape, C = PRELU_CASES[case]
    m = PReLU(C).train()
    x0 = _prelu_input(shape, torch.float32, nonfinite=False)
    fused = AutoFusionEngine.fuse(m, (x0.clone().requires_grad_(),))
    regions = [d for d in fused.report.applied if d.kernel in ("vector_program", "matmul_epilogue")]
    assert any("prelu" in d.nodes for d in regions), fused.report.summary()
    grads, m64 = [], copy.deepcopy(m).double()
    for run, dt, params in ((m, torch.float32, m), (m64, torch.float64, m64), (fused, torch.float32, m)):
        params.zero_grad()
        x = x0.detach().to(dt, copy=True).requires_grad_()
        out, y = run(x)
        (out.square().sum() + (y * torch.linspace(-1, 1, 24, dtype=dt)).sum()).backward()
        grads.append([x.grad] + [p.grad.clone() for p in params.parameters()])
    for want, ref, got in zip(*grads):
        ok, err, tol = compare(want, ref, got)
        assert ok, (case, err, tol)


def test_prelu_slopes_along_a_dim_other_than_the_last_stay_as_captured():
    # nn.PReLU(C) on a 3-D input applies its C slopes along dim 1, not the row: it stays as captured, eager's values
    m = PReLU(5).eval()
    x = _prelu_input((4, 5, 24), torch.float32, nonfinite=False)
    fused = AutoFusionEngine.fuse(m, (x,))
    assert all("prelu" not in d.nodes for d in fused.report.applied)
    assert "aten.prelu" in fused.graph_module.code
    _within_bound(m, (x,), {}, lambda: fused(x))


# ----------------------------------------------------------------------------------------- var / std

SPREADS = {
    "var": lambda t: t.var(-1, keepdim=True), "var_correction_0": lambda t: t.var(-1, correction=0, keepdim=True),
    "std": lambda t: t.std(-1, keepdim=True), "std_unbiased_false": lambda t: t.std(-1, unbiased=False, keepdim=True),
    "var_correction_2": lambda t: torch.var(t, -1, correction=2, keepdim=True),
}


class Spread(nn.Module):
    """A row's spread of a residual sum scales it before a projection; the spread is returned too (``twice``: twice
    it, so the value the region reads is not the one returned, and a plan made with grad keeps it inside)."""

    def __init__(self, fn, twice=False):
        super().__init__()
        self.fn, self.twice = fn, twice
        self.lin = nn.Linear(24, 8)

    def forward(self, x, r):
        h = x + r
        s = self.fn(x)
        return self.lin(h * s + h), (s * 2 if self.twice else s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPREADS))
def test_var_and_std_over_the_last_dim_join_their_region(name, dtype):
    torch.manual_seed(0)
    m = Spread(SPREADS[name]).to(dtype).eval()
    x, r = torch.randn(16, 6, 24, dtype=dtype) * 3 + 1, torch.randn(16, 6, 24, dtype=dtype)
    fused = _inference_fuse(m, (x, r))
    regions = [d for d in fused.report.applied if d.kernel == "vector_program"]
    assert len(regions) == 1 and any(n.startswith(name[:3]) for n in regions[0].nodes), fused.report.summary()
    with torch.no_grad():
        got, want = fused(x, r)[1], m(x, r)[1]
    if dtype == torch.float32:
        # the squared deviations summed in another order than torch's: a few fp32 ulps
        assert torch.allclose(got, want, rtol=1e-6, atol=0), (got - want).abs().max()
    else:
        _rounded_once_as_eager(got, want)
    _within_bound(m, (x, r), {}, lambda: fused(x, r))


@pytest.mark.parametrize("name", ["var", "std_unbiased_false"])
def test_var_of_rows_with_a_large_mean_keeps_eagers_precision(name):
    # 1e4 + 1e-2·randn: the fp32 mean's own rounding error, squared, is the size of the variance unless the sum of
    # squares is corrected by the deviations' sum (it was 8e-3 off, relative, against eager's 5e-8)
    torch.manual_seed(0)
    m = Spread(SPREADS[name]).eval()
    x, r = 1e4 + 1e-2 * torch.randn(16, 6, 24), torch.randn(16, 6, 24)
    fused = AutoFusionEngine.fuse(m, (x, r))
    assert [d.kernel for d in fused.report.applied] == ["vector_program"], fused.report.summary()
    with torch.no_grad():
        got, want = fused(x, r)[1], m(x, r)[1]
    truth = SPREADS[name](x.double())
    eager, ours = (((v.double() - truth) / truth).abs().max().item() for v in (want, got))
    assert ours <= 2 * eager + 1e-6, (ours, eager)     # eager's own error, within the verifier's bound of it


def test_var_without_keepdim_is_an_output_of_its_region():
    class M(nn.Module):
        def forward(self, x):
            h = x * 2 + 1
            return h.var(-1), h.std(-1, correction=0), h * h.var(-1, correction=0).unsqueeze(-1)

    x = torch.randn(4, 6, 24)
    m = M()
    fused = AutoFusionEngine.fuse(m, (x,))
    assert [d.kernel for d in fused.report.applied] == ["vector_program"], fused.report.summary()
    assert {"var", "std", "var_1", "unsqueeze"} <= set(fused.report.applied[0].nodes), fused.report.applied[0].nodes
    got, want = fused(x), m(x)
    # the squared deviations summed in another order than torch's: a few fp32 ulps
    assert all(g.shape == w.shape and torch.allclose(g, w, rtol=1e-6, atol=0) for g, w in zip(got, want))
    assert got[0].shape == (4, 6)


def _spread_grads(m, run, x, r):
    """The gradients of x and of m's parameters through ``run`` (m or its fused module) of a loss on both outputs."""
    m.zero_grad()
    xx = x.clone().requires_grad_()
    out, s = run(xx, r)
    (out.square().sum() + s.sin().sum()).backward()
    return [xx.grad] + [p.grad.clone() for p in m.parameters()]


def test_var_trains_as_eager():
    torch.manual_seed(0)
    m = Spread(SPREADS["std"], twice=True).train()
    x, r = torch.randn(4, 6, 24), torch.randn(4, 6, 24)
    fused = AutoFusionEngine.fuse(m, (x.clone().requires_grad_(), r))
    regions = [d for d in fused.report.applied if d.kernel == "vector_program"]
    assert len(regions) == 1 and "std" in regions[0].nodes, fused.report.summary()
    for want, got in zip(_spread_grads(m, m, x, r), _spread_grads(m, fused, x, r)):
        # fp32 gradients of a 24-wide row: the derived backward sums in another order than autograd's
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


@pytest.mark.parametrize("name", ["std", "std_unbiased_false"])
def test_std_of_a_constant_row_trains_as_eager(name):
    # torch's std backward is 0 where the std is 0 (an all-zero padding row, a constant row); through sqrt's own
    # rule it was 0/0, NaN for every element of the row and for the parameters it reaches
    torch.manual_seed(0)
    m = Spread(SPREADS[name], twice=True).train()
    x, r = torch.randn(4, 6, 24), torch.randn(4, 6, 24)
    fused = AutoFusionEngine.fuse(m, (x.clone().requires_grad_(), r))
    assert any("std" in d.nodes for d in fused.report.applied if d.kernel == "vector_program"), fused.report.summary()
    x[0, 1], x[2, 3] = 0.0, 3.0
    for want, got in zip(_spread_grads(m, m, x, r), _spread_grads(m, fused, x, r)):
        assert not want.isnan().any() and not got.isnan().any()
        # fp32 gradients summed in another order than autograd's (over a 24-wide row, over 24 rows for the
        # projection's weight): an element that cancels to near 0 is off by ulps of the largest terms, not of itself
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * max(1.0, want.abs().max().item())), \
            (got - want).abs().max()


class TanhSpread(nn.Module):
    def forward(self, x):
        t = torch.tanh(x)
        return t.std(-1, keepdim=True) * 3.0, t.var(-1, keepdim=True) * 3.0, torch.log(t.var(-1, keepdim=True))


def test_var_and_std_of_a_constant_row_of_inexact_values_are_zero_as_eagers():
    # a row of tanh(2.5): its fp32 mean is off by a rounding error, so every deviation is that same error; the sum of
    # squares corrected by the deviations' sum cancelled to a tiny negative number (std and log(var) NaN, and the
    # std's gradient NaN) where eager's var is exactly 0 (std 0, log(var) -inf)
    torch.manual_seed(0)
    x = torch.full((4, 7), 2.5)
    x[1], x[2], x[3] = 0.3, -1.7, torch.randn(7)
    m = TanhSpread().eval()
    fused = AutoFusionEngine.fuse(m, (torch.randn(4, 7),))
    assert [d.kernel for d in fused.report.applied] == ["vector_program"], fused.report.summary()
    with torch.no_grad():
        for w, r, g in zip(m(x), m(x.double()), fused(x)):
            ok, err, tol = compare(w, r, g)
            assert ok, (err, tol, g.flatten().tolist())
    m = TanhSpread().train()
    fused = AutoFusionEngine.fuse(m, (torch.randn(4, 7, requires_grad=True),))
    assert [d.kernel for d in fused.report.applied] == ["vector_program"], fused.report.summary()
    cot = torch.randn(4, 1)
    grads = []
    for run, dt in ((m, torch.float32), (m, torch.float64), (fused, torch.float32)):
        xx = x.to(dt).requires_grad_()
        s, v, _ = run(xx)
        grads.append(torch.autograd.grad((s * cot.to(dt)).sum() + (v * cot.to(dt)).sum(), xx)[0])
    ok, err, tol = compare(*grads)
    assert ok, (err, tol, grads[2][:3])


class AboveMean(nn.Module):
    def forward(self, x):
        return torch.where(x >= x.mean(-1, keepdim=True), x, x * 0.5)


def test_a_mean_divides_its_sum_as_eagers_so_a_comparison_with_it_does_not_flip():
    # a row of 6.25 or 3.0: eager's mean (sum / N) is exact; sum · (1/N) was an ulp below, x >= mean flipped (3.12)
    torch.manual_seed(0)
    m = AboveMean().eval()
    fused = AutoFusionEngine.fuse(m, (torch.randn(4, 1000),))
    assert [d.kernel for d in fused.report.applied] == ["vector_program"], fused.report.summary()
    x = torch.randn(4, 1000)
    x[0], x[1], x[2] = 1.0, 6.25, 3.0
    with torch.no_grad():
        want, ref, got = m(x), m(x.double()), fused(x)
    assert torch.equal(got, want)
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)


class ClampedNorm(nn.Module):
    def forward(self, x):
        return F.layer_norm(torch.clamp(x, max=0.5), (x.shape[-1],)) * 2.0


class NormPow(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(64) + 0.1 * torch.randn(64)), nn.Parameter(0.1 * torch.randn(64))

    def forward(self, x):
        return torch.pow(F.layer_norm(x, (64,), self.w, self.b, eps=1e-5), 4)


def test_layer_norm_of_a_row_of_equal_values_is_zero_as_eagers_and_trains_as_eager():
    # eager's (Welford) mean of a row of 0.1 is exact and the row normalises to 0; the fused mean was off by its
    # rounding error, times rsqrt(eps) = 316 (1.9e-5 where eager is exact; a gradient after pow(., 4) 15x its bound)
    torch.manual_seed(0)
    m = ClampedNorm().train()
    fused = AutoFusionEngine.fuse(m, (torch.randn(3, 1000, requires_grad=True),))
    assert any(d.kernel == "vector_program" for d in fused.report.applied), fused.report.summary()
    x = torch.full((3, 1000), 0.1)
    x[1], x[2] = 0.3, -0.2
    with torch.no_grad():
        want, ref, got = m(x), m(x.double()), fused(x)
    assert got.abs().max() == 0 and want.abs().max() == 0
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)
    torch.manual_seed(0)
    g = NormPow().train()
    fused = AutoFusionEngine.fuse(g, (torch.randn(6, 64, requires_grad=True),))
    assert any(d.kernel == "vector_program" for d in fused.report.applied), fused.report.summary()
    x = torch.randn(6, 64)
    x[0] = 0.7
    cot = torch.randn(6, 64)
    grads = []
    for model, dt in ((g, torch.float32), (copy.deepcopy(g).double(), torch.float64), (fused, torch.float32)):
        xx = x.to(dt).requires_grad_()
        grads.append(torch.autograd.grad((model(xx) * cot.to(dt)).sum(), xx)[0])
    ok, err, tol = compare(*grads)
    assert ok, (err, tol)


class FakeQuant(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.w, self.dtype = nn.Parameter(torch.randn(1000)), dtype

    def forward(self, x):
        h = x.sum(-1, keepdim=True) - self.w
        return h.to(self.dtype).to(h.dtype) * 2.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gradient_through_a_16_bit_round_trip_is_rounded_as_eagers(dtype):
    # the forward keeps the rounding; eager's autograd rounds the gradient there too (the backward of .to(float32)
    # casts it to the 16-bit dtype): the derived backward passed it in fp32 (0.127 off eager's dx)
    torch.manual_seed(0)
    m = FakeQuant(dtype).train()
    fused = AutoFusionEngine.fuse(m, (torch.randn(3, 1000, requires_grad=True),))
    assert [d.kernel for d in fused.report.applied] == ["vector_program"], fused.report.summary()
    x, cot = torch.randn(3, 1000), torch.randn(3, 1000)
    grads = []
    for model, dt in ((m, torch.float32), (copy.deepcopy(m).double(), torch.float64), (fused, torch.float32)):
        xx = x.to(dt).requires_grad_()
        out = model(xx)
        grads.append(torch.autograd.grad((out * cot.to(out.dtype)).sum(), [xx] + list(model.parameters())))
    for want, ref, got in zip(*grads):
        ok, err, tol = compare(want, ref, got)
        assert ok, (err, tol)


def test_verification_tries_a_row_of_equal_values(monkeypatch):
    # a generated kernel wrong only on a row of equal values (as var/std, a mean and layer_norm were) is caught by
    # verification itself, not left to the call that meets such a row
    import types

    import numpy as np

    import autofuse.ops_vector as ov
    from autofuse.verify import adversarial

    x = torch.randn(2, 3, 8)
    (label, xs), = adversarial([x, torch.randn(8), 1.5], {"in0": [0], "in1": [1], "in2": [2]})
    assert "equal values" in label and torch.equal(xs[0][:, 0], x[:, 0, :1].expand(2, 8))
    assert torch.equal(xs[0][:, 1:], x[:, 1:]) and (xs[1] == xs[1][0]).all() and xs[2] == 1.5

    launch = ov._launch_vector_program

    def off_on_equal_rows(inputs, program, device, tiling, **kw):
        prog, r = launch(inputs, program, device, tiling, **kw)
        t = inputs[0]
        equal = (t == t[..., :1]).all(-1, keepdim=True).numpy()
        return prog, types.SimpleNamespace(outputs=[np.where(equal, o + 1, o) for o in r.outputs], stats=r.stats)

    monkeypatch.setattr(ov, "_launch_vector_program", off_on_equal_rows)
    m = AboveMean().eval()
    fused = AutoFusionEngine.fuse(m, (torch.randn(4, 1000),))
    assert not fused.report.applied and fused.report.decisions[0].reason_code == "verification_failed", \
        fused.report.summary()
    assert "equal values" in fused.report.summary()


def test_a_row_of_equal_values_leaves_an_input_the_other_run_recomputes_alone():
    """Where the model computes one input of a block from another (``entangled_inputs``: ``r = repeat(s)`` beside
    ``s``) and one of the two runs reads only one of them (the captured block recomputes ``r`` from ``s``, the fused
    call reads ``r``), a row of equal values in ``r`` alone is no input the model can give: ``r`` is left as it
    is. The same pair read by both runs, or a pair no run recomputes, is changed as before."""
    import torch.fx as fx

    from autofuse.verify import adversarial, entangled_inputs

    g = fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("s")
    r = g.call_function(torch.repeat_interleave, (g.call_function(torch.unsqueeze, (s, 2)), 2, 3))
    h = g.call_function(torch.add, (x, x))
    g.output((r, h))
    assert entangled_inputs([h, r, x, s]) == {(0, 2), (1, 3)}        # h from x, r from s
    assert entangled_inputs([h, r]) == frozenset()

    inputs = [torch.randn(2, 8), torch.randn(1, 4, 1, 8), torch.randn(2, 8), torch.randn(1, 4, 4)]
    roles = {"in0": [0], "in1": [1]}
    one_sided = ({0, 1, 3}, {0, 1})                 # the captured block reads s too: it recomputes r
    (label, xs), = adversarial(inputs, roles, one_sided, entangled=frozenset({(1, 3)}))
    assert "equal values" in label and not torch.equal(xs[0], inputs[0]) and xs[1] is inputs[1]
    for read, pairs in ((({0, 1, 3}, {0, 1, 3}), frozenset({(1, 3)})), (one_sided, frozenset())):
        (label, xs), = adversarial(inputs, roles, read, entangled=pairs)
        assert not torch.equal(xs[1], inputs[1])


def test_codegens_rotations_are_verified_and_fused():
    """CodeGen's rotary sin and cos are ``repeat_interleave``d once per rotation; the canonical form computes that
    once per layer, so the fused call reads the key's where the captured block recomputes the query's from ``sin``.
    The verifier's row of equal values changed the one without the other and the two runs differed (0.79): both
    rotations were left unfused as not verified. Each is one ``rope`` region, within the bound."""
    torch.manual_seed(0)
    cfg = tf.CodeGenConfig(vocab_size=128, n_layer=LAYERS, n_embd=64, n_head=4, rotary_dim=8, n_positions=64)
    model = tf.CodeGenForCausalLM(cfg).eval()
    ids = torch.randint(1, 128, (2, 16))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    assert not [d for d in fused.report.decisions if d.reason_code == "verification_failed"], fused.report.summary()
    assert _names(fused.report)["rope"] == LAYERS, fused.report.summary()
    _within_bound(model, (ids,), {"use_cache": False}, lambda: fused(ids, use_cache=False))


@pytest.mark.parametrize("spelling", ["dim0", "two_dims"])
def test_a_var_over_another_dim_is_not_a_row_program(spelling):
    # over dim 0 or over the last two dims: not a row-wise Vector program; it runs as captured, correctly
    fn = (lambda t: t.var(0, keepdim=True)) if spelling == "dim0" else (lambda t: t.var((-2, -1), keepdim=True))
    torch.manual_seed(0)
    m = Spread(fn).eval()
    x, r = torch.randn(4, 6, 24), torch.randn(4, 6, 24)
    fused = AutoFusionEngine.fuse(m, (x, r))
    assert not any(n.startswith("var") for d in fused.report.applied for n in d.nodes), fused.report.summary()
    assert "aten.var" in fused.graph_module.code
    _within_bound(m, (x, r), {}, lambda: fused(x, r))


COMBINATIONS = {
    "lerp_low": lambda a, e, t: torch.lerp(a, e, 0.3),
    "lerp_high": lambda a, e, t: torch.lerp(a, e, 0.7),
    "addcmul": lambda a, e, t: torch.addcmul(a, e, t, value=0.5),
    "addcdiv": lambda a, e, t: torch.addcdiv(a, e, t.abs() + 1.0, value=-2.0),
}


class Combine(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(24, 8)

    def forward(self, a, e, t):
        return self.lin(torch.tanh(self.fn(a * 2, e, t)) * 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_lerp_addcmul_and_addcdiv_join_their_region(name, dtype):
    torch.manual_seed(0)
    m = Combine(COMBINATIONS[name]).to(dtype).eval()
    args = tuple(torch.randn(4, 6, 24, dtype=dtype) for _ in range(3))
    fused = AutoFusionEngine.fuse(m, args)
    regions = [d for d in fused.report.applied if d.kernel in ("vector_program", "matmul_epilogue")]
    assert any(any(n.startswith(name[:4]) for n in d.nodes) and "tanh" in d.nodes for d in regions), \
        fused.report.summary()
    _within_bound(m, args, {}, lambda: fused(*args))


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_lerp_addcmul_and_addcdiv_train_as_eager(name):
    torch.manual_seed(0)
    m = Combine(COMBINATIONS[name]).train()
    args = tuple(torch.randn(4, 6, 24) for _ in range(3))
    fused = AutoFusionEngine.fuse(m, tuple(a.clone().requires_grad_() for a in args))
    grads = []
    for run, dt in ((m, torch.float32), (copy.deepcopy(m).double(), torch.float64), (fused, torch.float32)):
        xs = [a.detach().to(dt, copy=True).requires_grad_() for a in args]
        run(*xs).square().sum().backward()
        grads.append([x.grad for x in xs])
    for want, ref, got in zip(*grads):
        assert (want is None) == (got is None)          # lerp reads no third operand
        if want is not None:
            ok, err, tol = compare(want, ref, got)      # the verifier's bound: twice eager's error against float64
            assert ok, (err, tol)


# ------------------------------------------------------------------------------ roundings, sign, nan_to_num, logs

ROUNDINGS = {
    "sign": torch.sign, "floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc,
    "frac": torch.frac, "round_2": lambda t: torch.round(t, decimals=2),
    "round_-1": lambda t: torch.round(t, decimals=-1), "floor_of_product": lambda t: torch.floor(t * 2.7),
    "nan_to_num": torch.nan_to_num,
    "nan_to_num_args": lambda t: torch.nan_to_num(t, nan=0.5, posinf=1e5, neginf=-7.0),   # 1e5: inf in float16
}
# ±0, the .5 ties (to even), values just off them, 2^23 and past it (already integral), tiny and large values, and
# in 16 bits the values a float16 cannot hold
TIES = [0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.3, 3.7, -3.7, 1e-30, 8388607.5, 8388609.0,
        -8388609.0, 1e30, -1e30, 65504.0, 0.125, 0.135, 4.5, -4.5, 1234.5]


def _ties_input(dtype, nonfinite=True):
    torch.manual_seed(0)
    x = torch.randn(6, 24) * 4
    x[0] = torch.tensor(TIES)
    x[2] = torch.round(x[2] * 2) / 2                       # more ties
    if nonfinite:
        x[1, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    return x.to(dtype)


def _identical(got, want):
    """The same values bit for bit up to NaN's payload: the same NaNs, the same numbers, the same signs of zero."""
    assert got.dtype == want.dtype
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan], want[~nan]), (got[~nan] - want[~nan]).abs().max()
    assert torch.equal(got[~nan].signbit(), want[~nan].signbit())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(ROUNDINGS))
def test_a_rounding_sign_or_nan_to_num_joins_its_chain_with_eagers_values(name, dtype):
    # lin(op(x) * 3 + x) is one region (each op cut it in two before); the op's values are eager's exactly, at the
    # ties, at ±0 (ceil(-0.5) is -0.0, sign(-0.0) +0), at ±inf and NaN (sign(NaN) 0, frac(inf) NaN, nan_to_num's
    # replacements as the dtype holds them), and past 2^23
    m = Act(ROUNDINGS[name]).to(dtype).eval()
    x = _ties_input(dtype)
    fused = AutoFusionEngine.fuse(m, (x,))
    regions = [d for d in fused.report.applied if d.kernel == "vector_program"]
    assert len(regions) == 1 and len(regions[0].nodes) >= 4, fused.report.summary()
    with torch.no_grad():
        _identical(fused(x)[1], m(x)[1])
    finite = _ties_input(dtype, nonfinite=False)
    finite[0, 16:18] = 0.0                                  # 1e30 * 3 overflows the float16/bfloat16 projection
    _within_bound(m, (finite,), {}, lambda: fused(finite))


def _grads_through_y(m, run, x0):
    """d/dx of the activation's own output (the second one), weighted: the gradient at non-finite points without
    the projection's NaNs."""
    x = x0.clone().requires_grad_()
    _, y = run(x)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return x.grad


@pytest.mark.parametrize("name", list(ROUNDINGS))
def test_a_rounding_sign_or_nan_to_num_trains_as_eager(name):
    # torch's gradients: zero for the roundings and sign (at ties, ±inf and NaN too), one for frac, isfinite(x) for
    # nan_to_num; the projection's and the input's against a float64 copy within the verifier's bound
    torch.manual_seed(0)
    m = Act(ROUNDINGS[name]).train()
    x0 = _ties_input(torch.float32, nonfinite=False)
    x0[0, 16:18] = 0.0
    fused = AutoFusionEngine.fuse(m, (x0.clone().requires_grad_(),))
    regions = [d for d in fused.report.applied if d.kernel == "vector_program"]
    assert len(regions) == 1 and len(regions[0].nodes) >= 4, fused.report.summary()       # the op inside
    grads, m64 = [], copy.deepcopy(m).double()
    for run, dt, params in ((m, torch.float32, m), (m64, torch.float64, m64), (fused, torch.float32, m)):
        params.zero_grad()                                  # the fused module trains m's own parameters
        x = x0.detach().to(dt, copy=True).requires_grad_()
        out, y = run(x)
        (out.square().sum() + (y * torch.linspace(-1, 1, 24, dtype=dt)).sum()).backward()
        grads.append([x.grad] + [p.grad.clone() for p in params.parameters()])
    for want, ref, got in zip(*grads):
        ok, err, tol = compare(want, ref, got)
        assert ok, (name, err, tol)
    xs = _ties_input(torch.float32)
    want, got = _grads_through_y(m, m, xs), _grads_through_y(m, fused, xs)
    assert torch.equal(want, got), name                     # zeros, the weights, or isfinite(x) times them


def test_floor_division_is_not_a_floor_of_a_quotient():
    # div(x, 3, rounding_mode="floor") is torch's floor division (a - fmod(a, b)) / b with its corrections, not
    # floor(x / 3): it stays as captured, eager's values
    class FloorDiv(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(24, 8)

        def forward(self, x):
            return self.lin(torch.div(x * 2, 0.1, rounding_mode="floor") * 3 + x)

    m = FloorDiv().eval()
    x = _ties_input(torch.float32, nonfinite=False)
    fused = AutoFusionEngine.fuse(m, (x,))
    assert not any(n.startswith("div") and "rounding" in n for d in fused.report.applied for n in d.nodes)
    assert "rounding_mode = 'floor'" in fused.graph_module.code
    with torch.no_grad():
        assert torch.equal(fused(x), m(x))


LOGS = {
    "log2": torch.log2, "log10": torch.log10, "exp2": torch.exp2, "two_to_the": lambda t: 2 ** t,
    "pow_10": lambda t: torch.pow(10.0, t), "pow_0.5": lambda t: torch.pow(0.5, t),
    "pow_1": lambda t: torch.pow(1.0, t), "pow_0": lambda t: torch.pow(0.0, t),
    "pow_-2": lambda t: torch.pow(-2.0, t), "pow_-1": lambda t: torch.pow(-1.0, t),
}
# ±0, integers (a negative base's sign), halves (a negative base's NaN), powers of two (log2 exact), exponents
# that overflow or reach fp32's subnormals, tiny and huge arguments of the logs, negative arguments (NaN)
EXPONENTS = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 3.0, 0.5, -0.5, 8.0, 1024.0, 1e-30, 1e-40, 127.0, 128.0, -149.0,
             -150.0, 200.0, -200.0, 10.0, 0.1, 3.5, -3.0, 1e30]


def _log_input(dtype, nonfinite=True):
    torch.manual_seed(0)
    x = torch.randn(6, 24) * 4
    x[0] = torch.tensor(EXPONENTS)
    x[2] = torch.round(x[2])
    if nonfinite:
        x[1, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(LOGS))
def test_exp2_log2_log10_and_a_number_to_a_tensor_join_their_chain_as_eager(name, dtype):
    # one region; torch's values at 0 and -0 (log -inf; pow(0, x) 1, 0 or inf by x's sign), at negative arguments
    # (log NaN; a negative base: ± by the exponent's parity, NaN off the integers), at ±inf and NaN (pow(1, NaN) 1),
    # overflowing (inf) and underflowing exponents (subnormals, then 0); fp32 within four ulps, 16-bit within one
    # rounding of the exact value
    m = Act(LOGS[name]).to(dtype).eval()
    x = _log_input(dtype)
    fused = AutoFusionEngine.fuse(m, (x,))
    regions = [d for d in fused.report.applied if d.kernel == "vector_program"]
    assert len(regions) == 1 and len(regions[0].nodes) >= 4, fused.report.summary()
    with torch.no_grad():
        _equal_as_eager(fused(x)[1], m(x)[1], -LOGS[name](x.double()))
    finite = _log_input(dtype, nonfinite=False).abs().clamp(0.125, 6.0)
    _within_bound(m, (finite,), {}, lambda: fused(finite))


@pytest.mark.parametrize("name", list(LOGS))
def test_exp2_log2_log10_and_a_number_to_a_tensor_train_as_eager(name):
    # torch's gradients: 1 / (x ln 2), 1 / (x ln 10), y ln(base); a base of 0: 0 where x >= 0, -inf·g elsewhere; a
    # negative base: NaN (its log), as eager
    torch.manual_seed(0)
    m = Act(LOGS[name]).train()
    x0 = torch.round(_log_input(torch.float32, nonfinite=False).clamp(-6.0, 6.0) * 2) / 2
    if name.startswith("log"):
        x0 = x0.abs() + 0.25
    fused = AutoFusionEngine.fuse(m, (x0.clone().requires_grad_(),))
    regions = [d for d in fused.report.applied if d.kernel == "vector_program"]
    assert len(regions) == 1 and len(regions[0].nodes) >= 4, fused.report.summary()       # the op inside
    want, got = _grads_through_y(m, m, x0), _grads_through_y(m, fused, x0)
    ref = _grads_through_y(copy.deepcopy(m).double(), copy.deepcopy(m).double(), x0.double())
    ok, err, tol = compare(want, ref, got)
    assert ok, (name, err, tol)
    xs = _log_input(torch.float32)
    want, got = _grads_through_y(m, m, xs), _grads_through_y(m, fused, xs)
    assert torch.equal(want.isnan(), got.isnan()) and torch.equal(want.isinf(), got.isinf()), name
    fin = want.isfinite()
    assert torch.allclose(got[fin], want[fin], rtol=4 * 2 ** -23, atol=0), name


# ------------------------------------------------------------------------------------------ 2-norm over the last dim

NORMS = {
    "normalize": lambda t: F.normalize(t, dim=-1),
    "norm_keepdim": lambda t: t * t.norm(dim=-1, keepdim=True),
    "vector_norm_unsqueezed": lambda t: t / torch.linalg.vector_norm(t, dim=-1).unsqueeze(-1).clamp_min(1e-6),
    "torch_norm": lambda t: t - torch.norm(t, dim=-1, keepdim=True) * 0.1,
}


class Normed(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(24, 8)

    def forward(self, x):
        y = self.fn(x * 2 + 1)
        return self.lin(y * 3 + x), -y


def _norm_input(dtype, zero_row=True):
    torch.manual_seed(0)
    x = torch.randn(6, 24) * 3
    if zero_row:
        x[0] = -0.5                                      # a row of zeros after x * 2 + 1
    x[2] *= 40                                           # 16-bit squares past float16's range: eager sums in fp32
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(NORMS))
def test_a_2_norm_over_the_last_dim_joins_its_region(name, dtype):
    # lin(f(x * 2 + 1) * 3 + x) is one region with the norm in it (the norm cut it in two before; F.normalize's
    # expand of the per-row norm is a broadcast); values within eager's bound, a row of zeros included (its
    # normalize 0 / eps = 0; in 16 bits eager's eps rounds to 0 and its 0 / 0 is NaN, the fused fp32 value 0 nearer
    # the float64 one)
    m = Normed(NORMS[name]).to(dtype).eval()
    x = _norm_input(dtype)
    fused = AutoFusionEngine.fuse(m, (x,))
    regions = [d for d in fused.report.applied if d.kernel == "vector_program"]
    assert len(regions) == 1 and "linalg_vector_norm" in regions[0].nodes and "add_1" in regions[0].nodes, \
        fused.report.summary()
    _within_bound(m, (x,), {}, lambda: fused(x))


@pytest.mark.parametrize("name", list(NORMS))
def test_a_2_norm_trains_as_eager_at_a_row_of_zeros(name):
    # torch's norm backward passes 0 for a zero row (sqrt's own derivative would make it 0 · inf = NaN): the derived
    # backward's root is of kind norm and does the same, so F.normalize's zero row gets eager's g / eps
    m = Normed(NORMS[name]).train()
    x0 = _norm_input(torch.float32)
    fused = AutoFusionEngine.fuse(m, (x0.clone().requires_grad_(),))
    regions = [d for d in fused.report.applied if d.kernel == "vector_program"]
    assert len(regions) == 1 and "linalg_vector_norm" in regions[0].nodes, fused.report.summary()
    grads, m64 = [], copy.deepcopy(m).double()
    for run, dt, params in ((m, torch.float32, m), (m64, torch.float64, m64), (fused, torch.float32, m)):
        params.zero_grad()
        x = x0.detach().to(dt, copy=True).requires_grad_()
        out, y = run(x)
        (out.square().sum() + (y * torch.linspace(-1, 1, 24, dtype=dt)).sum()).backward()
        grads.append([x.grad] + [p.grad.clone() for p in params.parameters()])
    assert bool(grads[0][0][0].isfinite().all())                 # eager's zero-row gradient: finite
    for want, ref, got in zip(*grads):
        ok, err, tol = compare(want, ref, got)
        assert ok, (name, err, tol)


@pytest.mark.parametrize("spelling", ["dim0", "p1", "two_dims"])
def test_a_norm_of_another_order_or_dim_is_not_a_row_norm(spelling):
    # the 1-norm, or a 2-norm over dim 0 or two dims: not this program's norm; it runs as captured, correctly
    fn = {"dim0": lambda t: t * t.norm(dim=0, keepdim=True), "p1": lambda t: t * t.norm(p=1, dim=-1, keepdim=True),
          "two_dims": lambda t: t * t.norm(dim=(-2, -1), keepdim=True)}[spelling]
    m = Normed(fn).eval()
    x = _norm_input(torch.float32)
    fused = AutoFusionEngine.fuse(m, (x,))
    assert not any(n.startswith("linalg_vector_norm") for d in fused.report.applied for n in d.nodes)
    assert "aten.linalg_vector_norm" in fused.graph_module.code
    _within_bound(m, (x,), {}, lambda: fused(x))


class _Divided(nn.Module):
    def forward(self, x, m):
        z = (x.float() + m) / 3.0
        return torch.sigmoid(z) + z


def test_a_division_by_a_number_is_eagers_division():
    """``z / 3`` is one rounding in eager; the canonical form's ``z · (1/3)`` is two (1/3 is rounded). The generated
    kernel divides as eager does, so the region equals eager bit for bit in fp32; with the product, scores far from
    0 (a masked ``finfo(float16).min`` plus x, about -21835, whose ulp is 0.002) came out an ulp apart, which a
    softmax reading their differences turned into relative errors of 2e-3 in the probabilities."""
    x = (torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 3).half()
    m = torch.full((64, 32), torch.finfo(torch.float16).min).half()
    fused = AutoFusionEngine.fuse(_Divided(), ((x, m), {}))
    assert [d.pattern for d in fused.report.applied] == ["vector_chain"]
    with torch.no_grad():
        assert torch.equal(fused(x, m), _Divided()(x, m))
