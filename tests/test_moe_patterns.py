"""The MoE families end to end: every router and every experts block of Mixtral, Qwen2-MoE, Qwen3-MoE and
DeepSeek-V3 (transformers configs, random weights) fused, in both exported experts implementations; outputs
within the verifier's bound of float64; routers' top-k indices equal eager's; near misses left alone."""
import collections
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

tf = pytest.importorskip("transformers")

from autofuse import AutoFusionEngine  # noqa: E402
from autofuse.capture import CaptureError  # noqa: E402
from autofuse.verify import compare  # noqa: E402

LAYERS = 1      # one decoder layer holds one of each block (attention, router, experts)
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=32)


def _mixtral():
    return tf.MixtralForCausalLM(tf.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4,
                                                  num_experts_per_tok=2))


def _qwen2_moe():
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16,
                                                    shared_expert_intermediate_size=24, num_experts=4,
                                                    num_experts_per_tok=2, decoder_sparse_step=1,
                                                    norm_topk_prob=False))


def _qwen3_moe():
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16,
                                                    num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                                                    norm_topk_prob=True, head_dim=8))


def _deepseek_v3():
    cfg = dict(COMMON, num_key_value_heads=4)
    m = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
        **cfg, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=0, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5))
    with torch.no_grad():               # the router's weights start at zero (every score ties): give it some
        for layer in m.model.layers:
            layer.mlp.gate.weight.normal_()
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return m


MODELS = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}
# The attention implementation does not change the router's or the experts' graph: an sdpa case adds only its
# attention block, which is the dense sibling's, fused and checked against eager where that model is tested:
# Mixtral's in tests/test_engine.py [mixtral-sdpa], Qwen2-MoE's (Qwen2's attention) there [qwen2-sdpa], Qwen3-MoE's
# (Qwen3's, q/k norms) in tests/test_more_architectures.py [qwen3-sdpa]; their routers and experts in the
# [*-grouped_mm-eager] cases here. Those three sdpa cases run with -m slow; DeepSeek-V3's (multi-head latent
# attention, not tested elsewhere) stays in the default run.
SDPA_COVERED = {"mixtral", "qwen2_moe", "qwen3_moe"}
CASES = [pytest.param(n, impl, attn, id=f"{n}-{impl}-{attn}",
                      marks=[pytest.mark.slow] if attn == "sdpa" and n in SDPA_COVERED else [])
         for n in MODELS for impl in ("grouped_mm", "batched_mm")
         for attn in ("eager", "sdpa") if attn == "eager" or impl == "grouped_mm"]


def _build(name, impl, attn, seed=0):
    torch.manual_seed(seed)
    m = MODELS[name]().eval()
    m.set_experts_implementation(impl)
    m.config._attn_implementation = attn
    return m, torch.randint(0, 64, (2, 8))


def _assert_within_the_bound_of_float64(model, fused, ids):
    """The fused model's logits within the verifier's bound of a float64 run (twice eager's error, plus one rounding)."""
    ref_model = copy.deepcopy(model).double()
    ref_model.set_experts_implementation("batched_mm")      # the same math; grouped_mm has no float64 kernel
    with torch.no_grad():
        got = fused(ids, use_cache=False).logits
        want = model(ids, use_cache=False).logits
        ref = ref_model(ids, use_cache=False).logits
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)


@pytest.mark.parametrize("name,impl,attn", CASES)
def test_every_router_and_experts_block_is_fused(name, impl, attn):
    model, ids = _build(name, impl, attn)
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    codes = collections.Counter((d.pattern, d.reason_code)
                                for d in fused.report.of("attention", "moe_gating", "moe_experts"))
    assert codes == {("attention", "fused"): LAYERS, ("moe_gating", "fused"): LAYERS,
                     ("moe_experts", "fused"): LAYERS}, fused.report.summary()
    assert not [d for d in fused.report.decisions if d.reason_code == "verification_failed"], fused.report.summary()
    # the attention's softmax is a softmax-family candidate too: it loses the conflict (attention saves more)
    assert not [d for d in fused.report.applied if d.pattern == "softmax"], fused.report.summary()
    targets = {str(n.target) for n in fused.graph_module.graph.nodes if n.op == "call_function"}
    assert not targets & {"transformers.grouped_mm_fallback.default", "aten.topk.default", "aten.sort.default"}
    _assert_within_the_bound_of_float64(model, fused, ids)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_bf16_experts_through_torchs_grouped_mm_are_fused(name):
    """With bf16 weights transformers calls torch's own ``_grouped_mm`` (not its fallback op): the experts block
    is the same family (it was left op by op); the float64 check runs it one matmul per group (torch's kernel has
    no float64); eager prices it as one grouped launch."""
    model, ids = _build(name, "grouped_mm", "sdpa")
    model = model.to(torch.bfloat16)
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    codes = collections.Counter((d.pattern, d.reason_code) for d in fused.report.of("moe_gating", "moe_experts"))
    assert codes == {("moe_gating", "fused"): LAYERS, ("moe_experts", "fused"): LAYERS}, fused.report.summary()
    targets = {str(n.target) for n in fused.graph_module.graph.nodes if n.op == "call_function"}
    assert "aten._grouped_mm.default" not in targets
    _assert_within_the_bound_of_float64(model, fused, ids)


def test_training_with_the_router_aux_loss_fuses_the_routers_and_experts_and_equals_eager():
    """``output_router_logits=True``: transformers' load-balancing loss recomputes the router's softmax and top-k,
    which the capture merges with the router's own, so the aux loss reads the router's softmax and the experts'
    reshape of the indices. Those pure intermediates stay in the graph for it while the fused calls recompute them:
    every router and experts block fused; loss, aux loss and every parameter's gradient within the verifier's
    bound of a float64 run, as eager's."""
    layers = 2
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128)).train()
    ids = torch.randint(0, 128, (2, 12))
    kw = dict(labels=ids, output_router_logits=True, use_cache=False)
    fused = AutoFusionEngine.fuse(model, ((ids,), kw))
    codes = collections.Counter((d.pattern, d.reason_code) for d in fused.report.of("moe_gating", "moe_experts"))
    assert codes == {("moe_gating", "fused"): layers, ("moe_experts", "fused"): layers}, fused.report.summary()
    ref_model = copy.deepcopy(model).double()
    ref_model.set_experts_implementation("batched_mm")        # the same math; grouped_mm has no float64 kernel
    runs = []
    for run in (model, fused, ref_model):
        model.zero_grad(), ref_model.zero_grad()
        out = run(ids, **kw)
        out.loss.backward()
        params = ref_model if run is ref_model else model
        runs.append((out.loss.detach(), out.aux_loss.detach(),
                     {n: p.grad.clone() for n, p in params.named_parameters() if p.grad is not None}))
    (loss, aux, grads), (f_loss, f_aux, f_grads), (r_loss, r_aux, r_grads) = runs
    for want, got, ref in ((loss, f_loss, r_loss), (aux, f_aux, r_aux)):
        ok, err, tol = compare(want, ref, got)
        assert ok, (err, tol)
    assert grads.keys() == f_grads.keys() == r_grads.keys() and "model.layers.1.mlp.gate.weight" in grads
    for name in grads:
        ok, err, tol = compare(grads[name], r_grads[name], f_grads[name])
        assert ok, (name, err, tol)


def test_a_router_whose_softmax_is_read_outside_is_fused_and_the_softmax_kept_for_that_reader():
    """The captured router's own softmax read by another op: it stays in the graph, computed as captured for that
    reader, and is not priced as saved; the fused call recomputes it; the block is verified with it inside."""
    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(32, 8, bias=False)

        def forward(self, x):
            p = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
            w, i = torch.topk(p, 2, dim=-1)
            return w / w.sum(-1, keepdim=True), i, p.mean(0)

    torch.manual_seed(0)
    model, x = Router(), torch.randn(16, 32)
    with torch.no_grad():
        fused = AutoFusionEngine.fuse(model, (x,))
        (d,) = fused.report.of("moe_gating")
        assert d.reason_code == "fused" and d.verify_error is not None, fused.report.summary()
        assert "softmax" not in d.nodes             # still runs: not counted in the block's unfused price
        targets = [str(n.target) for n in fused.graph_module.graph.nodes if n.op == "call_function"]
        assert "aten.softmax.int" in targets and "aten.topk.default" not in targets
        (w, i, p), (fw, fi, fp) = model(x), fused(x)
    assert torch.equal(i, fi) and torch.equal(p, fp)
    torch.testing.assert_close(fw, w)


def test_the_eager_experts_loop_is_named_in_the_capture_error():
    model, ids = _build("mixtral", "eager", "eager")
    with pytest.raises(CaptureError, match="data-dependent"):
        AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))


@pytest.mark.parametrize("name", list(MODELS))
def test_every_router_and_experts_block_is_fused_when_planned_on_meta_tensors(name):
    # no weights, no data: blocks are verified on random values; off the CPU transformers counts tokens per expert
    # with an integer histc, which the CPU check runs on float ids (the same counts)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MODELS[name]().eval()
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    codes = collections.Counter((d.pattern, d.reason_code) for d in fused.report.of("moe_gating", "moe_experts"))
    assert codes == {("moe_gating", "fused"): LAYERS, ("moe_experts", "fused"): LAYERS}, fused.report.summary()


def test_deepseek_v3_routing_at_its_real_sizes_is_fused_and_matches_eager():
    # 256 experts in 8 groups, the best 4 groups, top-8: torch's CPU top-k with sorted=False returns each token's
    # picks in another order than sorted at these sizes (not at the small sizes above); the order is unspecified
    # and the experts block sums over the picks, so the check compares each token's picks ordered by index
    torch.manual_seed(0)
    # one layer, its MLP the routed experts (the dense first layer of the model's own layout routes nothing)
    cfg = tf.DeepseekV3Config(num_hidden_layers=1, first_k_dense_replace=0, hidden_size=64, vocab_size=64,
                              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=16,
                              intermediate_size=48, max_position_embeddings=64)
    assert (cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (256, 8, 4, 8)
    model = tf.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        gate = model.model.layers[0].mlp.gate
        gate.weight.normal_(0, 0.1)         # scores off the sigmoid's flat ends, where fp32 ties every pick at 1.0
        gate.e_score_correction_bias.normal_(0, 0.1)
    ids = torch.randint(0, 64, (2, 32))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    codes = collections.Counter((d.pattern, d.reason_code) for d in fused.report.of("moe_gating", "moe_experts"))
    assert codes == {("moe_gating", "fused"): 1, ("moe_experts", "fused"): 1}, fused.report.summary()
    _assert_within_the_bound_of_float64(model, fused, ids)


def test_an_experts_block_verified_on_reduced_shapes_keeps_its_expert_count():
    """EXAONE-MoE's defaults: 64 experts, top-8, an expert width of 1024; at hidden 64 the expert count equals the
    hidden size, and the fused gate_up width 2048 equals 32 tokens x 64. The block is too large to check at its size
    (its float64 reference), so it is checked on reduced shapes, which keep the expert count: a view of the
    [32, 64] hidden states read as a split of 2048 reduced 64 to 3, three experts for a top-8, and the check
    failed the block (error 78.8). Fused, and within the bound of float64."""
    torch.manual_seed(0)
    cfg = tf.ExaoneMoeConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128, pad_token_id=0)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (64, 8, 1024)
    model = tf.ExaoneMoeForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (2, 16))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    experts = fused.report.of("moe_experts")
    assert experts and all(d.reason_code == "fused" for d in experts), fused.report.summary()
    assert all("verified on reduced shapes" in d.reason and "64 ->" not in d.reason for d in experts)
    _assert_within_the_bound_of_float64(model, fused, ids)


# --------------------------------------------------------------------------------------- routers alone


def _routers():
    out = {}
    for name in MODELS:
        model, _ = _build(name, "grouped_mm", "eager")
        out[name] = model.model.layers[0].mlp.gate
    return out


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_weights_and_indices_equal_eager(name, dtype):
    router = _routers()[name].to(dtype)
    x = torch.randn(3, 5, 32, dtype=dtype)
    with torch.no_grad():   # the router alone returns its scores, which a plan made with grad does not fuse across
        fused = AutoFusionEngine.fuse(router, (x,))
        got, want = fused(x), router(x)
    assert [d.reason_code for d in fused.report.decisions if d.pattern == "moe_gating"] == ["fused"], \
        fused.report.summary()
    ref = copy.deepcopy(router).double()(x.double())
    w_got, w_want = got[-2], want[-2]
    assert torch.equal(got[-1], want[-1])                       # indices: exactly torch.topk's
    ok, err, tol = compare(w_want, ref[-2], w_got)
    assert ok, (err, tol)


# ------------------------------------------------------------------- groups not kept filled with a number

def _mistral4(n_group, topk_group):
    cfg = dict(COMMON, num_key_value_heads=4)
    m = tf.Mistral4ForCausalLM(tf.Mistral4Config(
        **cfg, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=n_group, topk_group=topk_group, first_k_dense_replace=0, n_shared_experts=1, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, norm_topk_prob=True))
    with torch.no_grad():               # the router's weights start at zero (every score ties): give it some
        for layer in m.model.layers:
            layer.mlp.gate.weight.normal_()
    return m.eval()


@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (1, 1)])
def test_mistral4_routers_filling_the_groups_not_kept_with_zero_are_fused(n_group, topk_group):
    """Mistral 4's router (softmax, group-limited by each group's top two, the scores gathered, renormalised, scaled)
    fills the experts of the groups not kept with 0.0, not -inf (as DeepSeek-V2's does); the kernel takes the fill
    (``group_fill``), so the selection is eager's whatever the scores. With one group (its config's default) every
    group is kept and the fill plays no part."""
    torch.manual_seed(0)
    model = _mistral4(n_group, topk_group)
    model.set_experts_implementation("grouped_mm")
    ids = torch.randint(0, 64, (2, 8))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    gating = fused.report.of("moe_gating")
    assert [d.reason_code for d in gating] == ["fused"] * LAYERS, fused.report.summary()
    calls = [n for n in fused.graph_module.graph.nodes if "moe_gating_topk" in str(n.target)]
    assert [n.kwargs["group_fill"] for n in calls] == [0.0 if n_group > 1 else None] * LAYERS
    _assert_within_the_bound_of_float64(model, fused, ids)


class GroupRouter(nn.Module):
    """DeepSeek-V3's spelling (sigmoid, a selection bias, groups scored by their top two, the scores gathered) with
    the groups not kept filled with ``fill``; the bias makes a third of the choices negative, so a 0.0 fill takes
    experts from the groups not kept. ``kind``: the spelling, or a near miss."""

    def __init__(self, fill, kind="gather", E=16, n_group=4, topk_group=2, k=4):
        super().__init__()
        self.fill, self.kind, self.E, self.ng, self.kg, self.k = fill, kind, E, n_group, topk_group, k
        g = torch.Generator().manual_seed(4)
        self.w = nn.Parameter(torch.randn(E, 16, generator=g))
        self.register_buffer("bias", torch.randn(E, generator=g) - 0.6)

    def forward(self, x):
        E, ng = self.E, self.ng
        scores = F.linear(x.to(self.w.dtype), self.w).sigmoid()      # the weights' (fp32) scores, as DeepSeek's
        choice = scores + self.bias
        gs = choice.view(-1, ng, E // ng).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(gs, k=self.kg, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(gs).scatter_(1, group_idx, 1)
        keep = mask.unsqueeze(-1).expand(-1, ng, E // ng).reshape(-1, E)
        if self.kind == "mask_not_inverted":        # fills the kept groups instead
            choice = choice.masked_fill(keep.bool(), self.fill)
        else:
            choice = choice.masked_fill(~keep.bool(), self.fill)
        if self.kind == "values":                   # weights from the filled choices (biased, and the fill itself)
            w, idx = torch.topk(choice, k=self.k, dim=-1)
        else:
            idx = torch.topk(choice, k=self.k, dim=-1)[1]
            w = scores.gather(1, idx)
        return w / (w.sum(-1, keepdim=True) + 1e-20), idx


@pytest.mark.parametrize("fill, dtype", [(0.0, torch.float32), (-0.5, torch.float32), (float("-inf"), torch.float32),
                                         (0.0, torch.bfloat16), (0.0, torch.float16)])
def test_a_router_filling_the_groups_not_kept_with_a_number_is_fused_and_routes_as_eager(fill, dtype):
    torch.manual_seed(0)
    router = GroupRouter(fill)
    x = torch.randn(64, 16).to(dtype)
    with torch.no_grad():
        fused = AutoFusionEngine.fuse(router, (x,), fusion_switches=GENERIC_OFF)
        got, want = fused(x), router(x)
        kept_only = GroupRouter(float("-inf"))(x)[1]
    assert [d.reason_code for d in fused.report.of("moe_gating")] == ["fused"], fused.report.summary()
    if fill == 0.0:
        assert not torch.equal(want[1], kept_only), "no token took an expert of a group not kept: nothing tested"
    assert torch.equal(got[1], want[1])
    ok, err, tol = compare(want[0], copy.deepcopy(router).double()(x.double())[0], got[0])
    assert ok, (err, tol)
    # training: the router's backward through the chosen experts, the selection as eager's
    xs = [x.clone().requires_grad_() for _ in range(2)]
    fused_grad = AutoFusionEngine.fuse(router, (x,), fusion_switches=GENERIC_OFF)
    for fn, xi in zip((fused_grad, router), xs):
        fn(xi)[0].pow(2).sum().backward()
    assert [d.reason_code for d in fused_grad.report.of("moe_gating")] == ["fused"], fused_grad.report.summary()
    # fp32 sigmoid chains a few ulps apart, then (a 16-bit input) rounded once to x's dtype: one of its ulps
    atol = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps * xs[1].grad.abs().max().item()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("kind, fill", [("mask_not_inverted", 0.0), ("values", 0.0), ("gather", float("inf"))])
def test_filled_group_near_misses_are_not_fused(kind, fill):
    """The kept groups filled instead of the others; weights taken from the filled choices (biased, and the fill
    where a token takes an expert of a group not kept: not MoeGatingTopK's weights); a fill of +inf (every group
    not kept chosen first)."""
    torch.manual_seed(0)
    router = GroupRouter(fill, kind)
    x = torch.randn(64, 16)
    with torch.no_grad():
        fused = AutoFusionEngine.fuse(router, (x,), fusion_switches=GENERIC_OFF)
        got, want = fused(x), router(x)
    assert not [d for d in fused.report.applied if d.pattern == "moe_gating"], fused.report.summary()
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def _deepseek_v2_grouped():
    cfg = dict(COMMON, num_key_value_heads=4)
    m = tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
        **cfg, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, topk_method="group_limited_greedy", first_k_dense_replace=0, n_shared_experts=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        routed_scaling_factor=2.5))
    with torch.no_grad():               # the router's weights start at zero (every score ties): give it some
        for layer in m.model.layers:
            layer.mlp.gate.weight.normal_()
    return m.eval()


def test_deepseek_v2_group_limited_routers_are_fused():
    """DeepSeek-V2's ``group_limited_greedy`` router: groups scored by their max, the others filled with 0.0, the
    weights the top-k values of the filled scores, scaled (``group_score="max"``, ``group_fill=0.0``,
    ``weights_from="choices"``)."""
    torch.manual_seed(0)
    model = _deepseek_v2_grouped()
    model.set_experts_implementation("grouped_mm")
    ids = torch.randint(0, 64, (2, 8))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    assert [d.reason_code for d in fused.report.of("moe_gating")] == ["fused"] * LAYERS, fused.report.summary()
    (call,) = [n for n in fused.graph_module.graph.nodes if "moe_gating_topk" in str(n.target)]
    assert (call.kwargs["group_score"], call.kwargs["group_fill"], call.kwargs["weights_from"]) == ("max", 0.0,
                                                                                                    "choices")
    _assert_within_the_bound_of_float64(model, fused, ids)


class GreedyGroupRouter(nn.Module):
    """DeepSeek-V2's router spelled out; ``kind``: the spelling, or a near miss (renormalised, a positive fill)."""

    def __init__(self, kind="values", fill=0.0, E=8, n_group=4, topk_group=1, k=2):
        super().__init__()
        self.kind, self.fill, self.E, self.ng, self.kg, self.k = kind, fill, E, n_group, topk_group, k
        self.w = nn.Parameter(torch.eye(E, 16))

    def forward(self, x):
        E, ng = self.E, self.ng
        scores = F.linear(x, self.w).softmax(dim=-1)
        gs = scores.view(-1, ng, E // ng).max(dim=-1).values
        group_idx = torch.topk(gs, k=self.kg, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(gs).scatter_(1, group_idx, 1)
        keep = mask.unsqueeze(-1).expand(-1, ng, E // ng).reshape(-1, E)
        w, idx = torch.topk(scores.masked_fill(~keep.bool(), self.fill), k=self.k, dim=-1)
        if self.kind == "renorm":
            w = w / w.sum(-1, keepdim=True)
        return w * 2.5, idx


def test_a_token_taking_an_expert_of_a_group_not_kept_weighs_the_fill_with_no_gradient():
    """Logits ``[10, -200 | 9, 9 | 8, 8 | 7, 7]``: group 0 is kept, its second expert's score underflows to 0.0 and
    ties with the filled 0.0s, and torch's top-k takes one of the filled experts for the second pick; eager's weight
    there is 0.0 (not that expert's score, 0.27) and no gradient flows through it."""
    router = GreedyGroupRouter()
    x = torch.zeros(3, 16)
    x[:, :8] = torch.tensor([10.0, -200.0, 9.0, 9.0, 8.0, 8.0, 7.0, 7.0])
    x[1, :8] = torch.tensor([1.0, 0.5, 3.0, -1.0, 0.0, 0.2, 0.3, 0.1])          # an ordinary token beside them
    want_w, want_i = router(x)
    assert want_i[0, 1] >= 2 and want_w[0, 1] == 0.0, "the second pick is not a filled expert: nothing tested"
    fused = AutoFusionEngine.fuse(router, (x,), fusion_switches=GENERIC_OFF)
    assert [d.reason_code for d in fused.report.of("moe_gating")] == ["fused"], fused.report.summary()
    xs = [x.clone().requires_grad_() for _ in range(2)]
    (got_w, got_i), (w0, i0) = fused(xs[0]), router(xs[1])
    assert torch.equal(got_i, want_i) and torch.equal(got_i, i0)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)       # fp32 softmax: a few ulps
    g = torch.randn(got_w.shape, generator=torch.Generator().manual_seed(0))
    (got_w * g).sum().backward()
    (w0 * g).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, fill", [("renorm", 0.0), ("values", 0.25)])
def test_greedy_group_near_misses(kind, fill):
    """Renormalised: the kernel's renormalisation would take a filled pick's score in its gradient, so the gating
    kernel ends at the top-k values and the division and the scale stay as captured; a positive fill could equal a
    score (a weight at the fill would not be known as filled): not fused."""
    torch.manual_seed(0)
    router = GreedyGroupRouter(kind, fill)
    router.w.data.normal_()
    x = torch.randn(32, 16)
    with torch.no_grad():
        fused = AutoFusionEngine.fuse(router, (x,), fusion_switches=GENERIC_OFF)
        got, want = fused(x), router(x)
    gating = [d for d in fused.report.applied if d.pattern == "moe_gating"]
    if kind == "renorm":
        (d,) = gating
        assert not d.params["renorm"] and d.params["routed_scaling_factor"] == 1.0
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)     # fp32 softmax: a few ulps
    else:
        assert not gating, fused.report.summary()
        assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------------------- near misses

class Router(nn.Module):
    def __init__(self, kind, E=8, k=2):
        super().__init__()
        self.kind, self.k = kind, k
        self.w = nn.Parameter(torch.randn(E, 16))
        self.b = nn.Parameter(torch.randn(E) * 0.1)

    def forward(self, x):
        logits = F.linear(x, self.w)
        if self.kind == "softmax_over_tokens":
            p = logits.softmax(0)
        elif self.kind == "biased_weights":            # selection bias also in the weights: not MoeGatingTopK's
            p = logits.sigmoid() + self.b
        elif self.kind == "bias_on_selected":
            p = logits.sigmoid()
        else:
            p = logits.softmax(-1)
        if self.kind == "topk_wrong_dim":
            v, i = torch.topk(p, self.k, dim=0)
        elif self.kind == "smallest":
            v, i = torch.topk(p, self.k, dim=-1, largest=False)
        else:
            v, i = torch.topk(p, self.k, dim=-1)
        if self.kind == "other_denominator":
            v = v / p.sum(-1, keepdim=True).clamp_min(0.5)
        elif self.kind == "bias_on_selected":
            v = v + self.b[i]
        elif self.kind == "biased_weights":
            pass
        else:
            v = v / v.sum(-1, keepdim=True)
        return v, i


GENERIC_OFF = {"softmax": "off", "vector_chain": "off", "matmul_epilogue": "off"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_a_router_selecting_on_16_bit_scores_is_not_fused(kind, dtype):
    """Eager rounds the scores to 16 bits before the top-k: saturated sigmoids (7, 7.5, 8 and 6.5 are all 1.0 in
    bf16) tie and fall in torch.topk's order, which the kernel's fp32 scores tell apart. Not fused: the
    experts chosen are eager's."""
    class Low(nn.Module):
        def forward(self, x):
            p = x.sigmoid() if kind == "sigmoid" else x.softmax(-1)
            v, i = torch.topk(p, 2, dim=-1)
            return v / v.sum(-1, keepdim=True), i
    x = torch.tensor([[7.0, 7.5, 8.0, 0.0, -1.0, 6.5]] * 4 if kind == "sigmoid" else
                     [[-1.0, -1.0, 0.0, -1.0, 0.003, 0.002]] * 4, dtype=dtype)
    fused = AutoFusionEngine.fuse(Low(), (x,), fusion_switches=GENERIC_OFF)
    gating = [d for d in fused.report.decisions if d.pattern == "moe_gating"]
    assert [d.reason_code for d in gating] == ["unsupported"], fused.report.summary()
    assert f"the scores are {str(dtype)[6:]} before the top-k" in gating[0].reason
    assert torch.equal(fused(x)[1], Low()(x)[1])
    # the same router computing its scores in fp32 (as transformers' routers do) is fused
    class High(Low):
        def forward(self, x):
            return super().forward(x.float())
    fused = AutoFusionEngine.fuse(High(), (x,), fusion_switches=GENERIC_OFF)
    assert [d.reason_code for d in fused.report.decisions if d.pattern == "moe_gating"] == ["fused"]


@pytest.mark.parametrize("trip", [torch.float16, torch.bfloat16, torch.float64])
def test_a_router_rounding_its_fp32_scores_to_16_bits_before_the_top_k_is_not_fused(trip):
    """``softmax(x).to(bf16).float()``: both ends of the cast chain are fp32, but eager selects on scores rounded
    to 16 bits, whose ties it breaks by index where the kernel's fp32 scores tell them apart. Not fused, and the
    experts chosen are eager's. A round trip through float64 loses nothing and is fused."""
    class RoundTrip(nn.Module):
        def forward(self, x):
            p = x.softmax(-1).to(trip).float()
            v, i = torch.topk(p, 2, dim=-1)
            return v / v.sum(-1, keepdim=True), i
    torch.manual_seed(0)
    x = torch.randn(512, 16) * 0.3          # about 15 of these tokens pick other experts on bf16 scores
    fused = AutoFusionEngine.fuse(RoundTrip(), (x,), fusion_switches=GENERIC_OFF)
    gating = [d for d in fused.report.decisions if d.pattern == "moe_gating"]
    assert [d.reason_code for d in gating] == (["fused"] if trip == torch.float64 else ["unsupported"]), \
        fused.report.summary()
    assert trip == torch.float64 or "rounded to 16 bits on the way" in gating[0].reason
    assert torch.equal(fused(x)[1], RoundTrip()(x)[1])


def test_deepseek_v3_router_under_autocast_routes_as_eager_and_the_report_says_why_it_is_not_gated():
    """Under CPU autocast the router's linear returns bf16, so eager's sigmoid scores are rounded to bf16 before the
    fp32 selection bias is added: the sums tie. The gating family refuses it and says so; the Vector region that
    fuses ``sigmoid -> add`` reads the sigmoid rounded where the add widens it, so the experts are eager's."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    torch.manual_seed(0)
    cfg = tf.DeepseekV3Config(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    router = DeepseekV3TopkRouter(cfg).eval()
    nn.init.normal_(router.weight, std=0.05)
    h = torch.randn(8, 32, 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        fused = AutoFusionEngine.fuse(router, (h,))
        want, got = router(h)[2], fused(h)[2]
    assert torch.equal(want.sort(-1).values, got.sort(-1).values)          # 9 of 256 tokens differed
    assert any(d.applied and d.nodes == ("sigmoid", "add") for d in fused.report.decisions), fused.report.summary()
    gating = [d for d in fused.report.decisions if d.pattern == "moe_gating"]
    assert [d.reason_code for d in gating] == ["unsupported"], fused.report.summary()
    assert "the scores are bfloat16 before the top-k" in gating[0].reason
    assert "the scores are bfloat16 before the top-k" in fused.report.summary()


def test_verification_catches_a_router_selecting_on_scores_it_did_not_round(monkeypatch):
    """With the pattern's guard off, the fused router selects on fp32 scores where eager rounded them to bf16 and
    back; the float64 reference keeps that rounding, so verification refuses the candidate."""
    import patterns.moe as moe_mod
    monkeypatch.setattr(moe_mod, "_narrows", lambda cast, *ends: False)

    class RoundTrip(nn.Module):
        def forward(self, x):
            v, i = torch.topk(x.softmax(-1).bfloat16().float(), 2, dim=-1)
            return v / v.sum(-1, keepdim=True), i
    torch.manual_seed(0)
    x = torch.randn(512, 16) * 0.3
    fused = AutoFusionEngine.fuse(RoundTrip(), (x,), fusion_switches=GENERIC_OFF)
    assert [d.reason_code for d in fused.report.decisions if d.pattern == "moe_gating"] == \
        ["verification_failed"], fused.report.summary()
    assert torch.equal(fused(x)[1], RoundTrip()(x)[1])


@pytest.mark.parametrize("kind", ["plain", "topk_wrong_dim", "smallest", "softmax_over_tokens", "other_denominator",
                                  "biased_weights", "bias_on_selected"])
def test_router_near_misses_are_not_fused(kind):
    torch.manual_seed(0)
    router = Router(kind)
    x = torch.randn(10, 16)
    # only the MoE families: the generic ones would fuse a near miss's softmax, and its output is compared bit
    # for bit with the captured graph
    fused = AutoFusionEngine.fuse(router, (x,), fusion_switches=GENERIC_OFF)
    gating = [d for d in fused.report.decisions if d.pattern == "moe_gating"]
    got, want = fused(x), router(x)
    if kind == "plain":                     # the control: the same module spelled right is fused
        assert [d.reason_code for d in gating] == ["fused"]
        assert torch.equal(got[1], want[1])
    elif kind == "bias_on_selected":        # topk(sigmoid) is a router without bias; the add stays as captured
        (d,) = gating
        assert d.reason_code == "fused" and d.params["renorm"] is False and "bias" not in d.nodes
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    else:
        # the selected values also read outside (other_denominator: a router without renorm, whose top-k stays for
        # that reader) fuse only where the kept top-k leaves a saving: here none
        assert [d.reason_code for d in gating] == (["not_profitable"] if kind == "other_denominator" else []), \
            fused.report.summary()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class TopkFirst(nn.Module):
    """A router that takes the top k of the logits and the softmax over the k chosen (GraniteMoE, GPT-OSS),
    or a near miss of it."""

    def __init__(self, kind="plain", E=8, k=2, scale=1.0):
        super().__init__()
        self.kind, self.k, self.scale = kind, k, scale
        self.w = nn.Parameter(torch.randn(E, 16))

    def forward(self, x):
        logits = F.linear(x, self.w).float()
        v, i = torch.topk(logits, self.k, dim=0 if self.kind == "topk_wrong_dim" else -1,
                          largest=self.kind != "smallest")
        if self.kind == "softmax_over_tokens":
            w = v.softmax(0)
        elif self.kind == "values_read":            # the chosen logits also leave the block
            return v.softmax(-1).type_as(x), i, v
        else:
            w = v.softmax(-1)
        if self.scale != 1.0:
            w = w * self.scale
        return w.type_as(x), i


@pytest.mark.parametrize("T,E,k,scale", [(10, 8, 2, 1.0), (33, 32, 4, 1.0), (7, 40, 8, 2.0), (1, 8, 1, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_topk_then_softmax_router_is_fused_and_equals_eager(T, E, k, scale, dtype):
    torch.manual_seed(0)
    router = TopkFirst(E=E, k=k, scale=scale).to(dtype)
    x = torch.randn(T, 16, dtype=dtype)
    fused = AutoFusionEngine.fuse(router, (x,), fusion_switches=GENERIC_OFF)
    (d,) = [d for d in fused.report.decisions if d.pattern == "moe_gating"]
    assert d.reason_code == "fused" and d.params["norm"] == "topk_softmax", fused.report.summary()
    assert d.params["routed_scaling_factor"] == scale
    got, want = fused(x), router(x)
    assert torch.equal(got[1], want[1])                         # indices: exactly torch.topk's of the logits
    ref = copy.deepcopy(router).double()(x.double())
    ok, err, tol = compare(want[0], ref[0], got[0])
    assert ok, (err, tol)


@pytest.mark.parametrize("kind", ["topk_wrong_dim", "smallest", "softmax_over_tokens", "values_read"])
def test_topk_then_softmax_near_misses_are_not_fused(kind):
    torch.manual_seed(0)
    router = TopkFirst(kind)
    x = torch.randn(10, 16)
    fused = AutoFusionEngine.fuse(router, (x,), fusion_switches=GENERIC_OFF)
    # values_read: the top-k stays for its outside reader, so the fused router would save nothing
    assert [d.reason_code for d in fused.report.decisions if d.pattern == "moe_gating"] == \
        (["not_profitable"] if kind == "values_read" else []), fused.report.summary()
    for g, w in zip(fused(x), router(x)):
        assert torch.equal(g, w)


@pytest.mark.parametrize("name", ["granitemoe", "gpt_oss"])
def test_granitemoe_and_gpt_oss_routers_are_fused(name):
    """Both take the top k of the router logits, then the softmax over the k chosen; q and k rotated, named."""
    torch.manual_seed(0)
    common = dict(COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    if name == "granitemoe":
        model = tf.GraniteMoeForCausalLM(tf.GraniteMoeConfig(**common))
    else:
        model = tf.GptOssForCausalLM(tf.GptOssConfig(**common, head_dim=8))
        model.config._attn_implementation = "eager"
    model.eval()
    ids = torch.randint(0, 64, (2, 8))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    gating = fused.report.of("moe_gating")
    assert [d.reason_code for d in gating] == ["fused"] * LAYERS, fused.report.summary()
    assert all(d.params["norm"] == "topk_softmax" for d in gating)
    # GPT-OSS rotates each half apart (cat(x1·cos - x2·sin, x2·cos + x1·sin)): named RoPE as the other spellings
    ropes = [d for d in fused.report.applied if "rope" in d.pattern.split("+")]
    assert len(ropes) == 2 * LAYERS, fused.report.summary()
    _assert_within_the_bound_of_float64(model, fused, ids)


class Experts(nn.Module):
    """transformers' grouped_mm experts spelled by hand, with a configurable gate activation and half order."""

    def __init__(self, act="silu", order="gate_up", E=4, H=16, inter=8):
        super().__init__()
        self.act, self.order, self.E = act, order, E
        self.gate_up = nn.Parameter(torch.randn(E, 2 * inter, H) * 0.2)
        self.down = nn.Parameter(torch.randn(E, H, inter) * 0.2)

    def forward(self, x, idx, w):
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.sort(flat)
        perm = order.indices
        xs = x[perm // k]
        w_sorted = w.reshape(-1)[perm]
        offs = torch.histc(order.values.float(), self.E, 0, self.E - 1).cumsum(0, dtype=torch.int32)
        h = torch.ops.transformers.grouped_mm_fallback(xs, self.gate_up.transpose(-2, -1), offs)
        a, b = h.split(h.shape[-1] // 2, -1)
        gate, up = (a, b) if self.order == "gate_up" else (b, a)
        h = (F.silu(gate) if self.act == "silu" else F.gelu(gate)) * up
        y = torch.ops.transformers.grouped_mm_fallback(h, self.down.transpose(-2, -1), offs) * w_sorted[:, None]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(T * k)
        return y[inv].reshape(T, k, -1).sum(1)


@pytest.mark.parametrize("act,order,fuses", [("silu", "gate_up", True), ("gelu", "gate_up", False),
                                             ("silu", "up_gate", False)])
def test_experts_near_misses(act, order, fuses):
    import transformers.integrations.moe  # noqa: F401  (registers transformers.grouped_mm_fallback)
    torch.manual_seed(0)
    m = Experts(act, order)
    x, idx = torch.randn(6, 16), torch.randint(0, 4, (6, 2))
    w = torch.rand(6, 2)
    fused = AutoFusionEngine.fuse(m, (x, idx, w), fusion_switches=GENERIC_OFF)     # (as for the routers)
    experts = [d.reason_code for d in fused.report.decisions if d.pattern == "moe_experts"]
    assert experts == (["fused"] if fuses else []), fused.report.summary()
    got, want = fused(x, idx, w), m(x, idx, w)
    if fuses:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    else:
        assert torch.equal(got, want)


class ClampedExperts(nn.Module):
    """GPT-OSS's experts spelled by hand: ``[E, in, out]`` weights read as stored, a bias per expert gathered by the
    sorted expert ids, the clamped SwiGLU on interleaved gate/up pairs; ``kind`` spells a near miss."""

    def __init__(self, kind="gpt_oss", E=4, H=16, inter=8, batched=False):
        super().__init__()
        self.kind, self.E, self.batched = kind, E, batched
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * inter) * 0.5)
        self.gate_up_bias = nn.Parameter(torch.randn(E, 2 * inter))
        self.down = nn.Parameter(torch.randn(E, inter, H) * 0.3)
        self.down_bias = nn.Parameter(torch.randn(E, H))

    def forward(self, x, idx, w):
        T, k = idx.shape
        if self.batched:
            return self.forward_batched(x, idx, w)
        order = torch.sort(idx.reshape(-1))
        perm, ids = order.indices, order.values
        xs = x[perm // k]
        offs = torch.histc(ids.float(), self.E, 0, self.E - 1).cumsum(0, dtype=torch.int32)
        b1 = self.gate_up_bias[perm % self.E if self.kind == "bias_by_pair" else ids]
        h = self.act(torch.ops.transformers.grouped_mm_fallback(xs, self.gate_up, offs) + b1)
        y = torch.ops.transformers.grouped_mm_fallback(h, self.down, offs) + self.down_bias[ids]
        y = y * w.reshape(-1)[perm][:, None]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(T * k)
        return y[inv].reshape(T, k, -1).sum(1)

    def act(self, h):
        gate, up = (h[..., 1::2], h[..., ::2]) if self.kind == "odd_gate" else (h[..., ::2], h[..., 1::2])
        gate = gate.clamp(min=-7.0, max=7.0) if self.kind == "gate_clamped_below" else gate.clamp(max=7.0)
        up = up.clamp(-5.0, 5.0) if self.kind == "other_limit" else up.clamp(-7.0, 7.0)
        glu = gate * torch.sigmoid(gate * 1.702)
        return (up + 2 if self.kind == "up_plus_2" else up + 1) * glu

    def forward_batched(self, x, idx, w):
        """transformers' ``batched_mm`` spelling: each token repeated k times, each pair's weights and biases
        gathered by the flat expert ids, ``x[:, None] @ w``."""
        T, k = idx.shape
        ids = idx.reshape(-1)
        xs = x.repeat_interleave(k, dim=0)
        b1 = self.gate_up_bias[(ids + 1) % self.E if self.kind == "bias_by_pair" else ids]
        h = self.act(torch.bmm(xs[:, None], self.gate_up[ids]).squeeze(1) + b1)
        y = torch.bmm(h[:, None], self.down[ids]).squeeze(1) + self.down_bias[ids]
        y = y * w.reshape(-1)[:, None]
        return y.reshape(T, k, -1).sum(1)


@pytest.mark.parametrize("kind,fuses", [("gpt_oss", True), ("odd_gate", False), ("gate_clamped_below", False),
                                        ("other_limit", False), ("up_plus_2", False), ("bias_by_pair", False)])
@pytest.mark.parametrize("batched", [False, True], ids=["grouped", "batched"])
def test_clamped_experts_and_near_misses(kind, fuses, batched):
    """GPT-OSS's experts (grouped or batched spelling) fuse into one grouped_matmul with the clamped SwiGLU
    epilogue on interleaved pairs and both biases; a gate at the odd columns, a gate clamped from below too, two
    different limits, ``up + 2`` and a bias gathered by another index are not that op."""
    import transformers.integrations.moe  # noqa: F401  (registers transformers.grouped_mm_fallback)
    torch.manual_seed(0)
    m = ClampedExperts(kind, batched=batched)
    x, idx = torch.randn(6, 16) * 2, torch.randint(0, 4, (6, 2))
    w = torch.rand(6, 2)
    fused = AutoFusionEngine.fuse(m, (x, idx, w), fusion_switches=GENERIC_OFF)
    experts = [d for d in fused.report.decisions if d.pattern == "moe_experts"]
    assert [d.reason_code for d in experts] == (["fused"] if fuses else []), fused.report.summary()
    got, want = fused(x, idx, w), m(x, idx, w)
    if fuses:
        p = experts[0].params
        assert (p["activation"], p["swiglu_order"], p["limit"], p["alpha"]) == ("clamped_swiglu", "interleaved", 7.0,
                                                                                1.702)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)      # fp32 both sides
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_experts_are_fused(dtype, impl):
    """Every GPT-OSS experts block (and router) fused, in both exported experts implementations (``batched_mm``:
    ``[E, in, out]`` weights and biases gathered per (token, expert) pair by the same ids, ``x[:, None] @ w``, the
    bias added in place); logits within the verifier's bound of float64."""
    torch.manual_seed(0)
    common = dict(COMMON, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(**common, head_dim=8)).to(dtype)
    model.config._attn_implementation = "eager"
    model.set_experts_implementation(impl)
    model.eval()
    ids = torch.randint(0, 64, (2, 8))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    codes = collections.Counter((d.pattern, d.reason_code)
                                for d in fused.report.of("attention", "moe_gating", "moe_experts"))
    assert codes == {("attention", "fused"): LAYERS, ("moe_gating", "fused"): LAYERS,
                     ("moe_experts", "fused"): LAYERS}, fused.report.summary()
    for d in fused.report.of("moe_experts"):
        p = d.params
        assert (p["implementation"], p["activation"], p["swiglu_order"], p["limit"], p["alpha"], p["trans_w"]) == \
            (impl, "clamped_swiglu", "interleaved", model.config.swiglu_limit, 1.702, False), p
    targets = {str(n.target) for n in fused.graph_module.graph.nodes if n.op == "call_function"}
    assert not targets & {"transformers.grouped_mm_fallback.default", "aten._grouped_mm.default", "aten.sort.default",
                          "aten.clamp.default", "aten.repeat_interleave.self_int"}
    if dtype == torch.float32:
        _assert_within_the_bound_of_float64(model, fused, ids)
    else:
        with torch.no_grad():
            got, want = fused(ids, use_cache=False).logits, model(ids, use_cache=False).logits
        assert (got.float() - want.float()).abs().max() < 0.05 * want.float().abs().max()


@pytest.mark.parametrize("model,blocks", [("gpt_oss", 5), ("llama4", 2), ("loop", 4)])
def test_the_moe_kernels_benchmark_runs(capsys, model, blocks):
    """``benchmarks/moe_kernels.py --model gpt_oss --quick`` (and ``llama4``: its dense experts, a row per load;
    ``loop``: a hand-written layer's loop over its experts) runs, its kernels with the options the fused graph
    calls them with, and prints a row per block, each faster fused."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe_kernels.py"
    spec = importlib.util.spec_from_file_location("moe_kernels_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--model", model, "--quick"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.rstrip().endswith("x")]
    assert len(rows) == blocks and all(float(r.split()[-1][:-1]) > 1 for r in rows), rows
    assert model == "llama4" or rows[-1].startswith("whole MoE block"), rows
