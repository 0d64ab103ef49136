"""Whole-graph simulation: totals that add up, a per-node breakdown, peak memory, fused faster than unfused."""
import json
import sys

import pytest
import torch

import autofuse
from autofuse import AutoFusionEngine, SimulationResult
from autofuse.simulate import simulate_graph
from autofuse.models import build
from patterns.attention import AttentionVariant, build_variant


@pytest.fixture(scope="module")
def mha():
    torch.manual_seed(0)
    model, (args, kwargs) = build("mha", hidden=64, heads=2, seq=128, batch=2)
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    return model, args, kwargs, fused


def test_fused_is_faster_and_its_numbers_add_up(mha):
    model, args, kwargs, fused = mha
    before = autofuse.simulate(model, (args, kwargs), device="ascend910")
    after = fused.simulate(*args, **kwargs)
    for r in (before, after):
        assert isinstance(r, SimulationResult) and r.device == "ascend910"
        assert r.cycles == sum(n.cycles for n in r.nodes) > 0
        assert r.hbm_bytes == sum(n.hbm_bytes for n in r.nodes) > 0
        assert r.seconds == pytest.approx(r.cycles / 1e9)        # ascend910 runs at 1 GHz
        assert r.launches >= r.distinct_launches > 0
        assert all(n.cycles > 0 and n.kernels for n in r.nodes)  # views cost nothing and are not listed
    assert after.cycles < before.cycles
    (fa,) = [n for n in after.nodes if n.fused]
    assert fa.kernels == ("flash_attention",) and fa.target == "autofuse.flash_attention"
    assert not [n for n in before.nodes if n.fused]
    sdpa = [n for n in before.nodes if "scaled_dot_product_attention" in n.target]
    assert len(sdpa) == 1 and sdpa[0].kernels == ("matmul", "elementwise", "elementwise", "softmax", "matmul")
    assert fa.cycles < sdpa[0].cycles
    assert after.by_kernel()["flash_attention"] == fa.cycles
    # outputs of the simulated run are the model's outputs
    torch.testing.assert_close(after.outputs[0], model(*args), atol=1e-5, rtol=1e-4)
    text = after.summary()
    assert "flash_attention" in text and "[fused]" in text and "peak activation memory" in text
    json.dumps(after.to_dict(), default=str)


class _IntChain(torch.nn.Module):
    def forward(self, x):
        return (x * 2 + 1).sum(-1)


def test_a_launch_that_falls_back_to_generic_counts_once():
    """An int64 chain: the kernels cannot take int64, each op runs as a generic launch, and the summary counts
    one launch per op (the refused launch is not counted beside the generic one that replaced it)."""
    r = autofuse.simulate(_IntChain().eval(), (torch.randint(0, 9, (2, 8, 16)),))
    assert [n.kernels for n in r.nodes] == [("generic",)] * 3
    assert r.launches == 3 and "3 kernel launches" in r.summary()


def test_launches_are_the_kernels_recorded_per_node():
    torch.manual_seed(0)
    model, (args, kwargs) = build("gpt2", layers=1, hidden=32, heads=2, seq=16)
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    for r in (autofuse.simulate(model, (args, kwargs)), fused.simulate(*args, **kwargs)):
        assert r.launches == sum(len(n.kernels) for n in r.nodes)


def test_peak_memory_drops_when_scores_are_not_materialised():
    torch.manual_seed(0)
    model = build_variant(AttentionVariant(mask="causal_tril")).eval()
    q, k, v = (torch.randn(1, 4, 256, 32) for _ in range(3))
    fused = AutoFusionEngine.fuse(model, (q, k, v))
    before = autofuse.simulate(model, (q, k, v))
    after = fused.simulate(q, k, v)
    scores = 4 * 256 * 256 * 4                     # one [1, 4, 256, 256] float32 tensor
    assert before.peak_memory >= 2 * scores       # scores and probabilities live at once
    assert after.peak_memory < scores
    assert fused.report.peak_memory_fused == after.peak_memory
    assert fused.report.peak_memory_unfused == before.peak_memory
    assert after.cycles < before.cycles


def test_repeated_layers_are_simulated_once_and_kernels_agree_with_torch():
    torch.manual_seed(0)
    model, (args, kwargs) = build("llama", layers=2, hidden=32, heads=4, seq=16)
    memo = autofuse.simulate(model, (args, kwargs))
    assert memo.distinct_launches < memo.launches and any(n.reused for n in memo.nodes)
    full = autofuse.simulate(model, (args, kwargs), check=True)
    assert full.cycles == memo.cycles and not any(n.reused for n in full.nodes)
    # check=True compares every kernel's own output with torch's value of the node
    # (int64 casts are left out: the elementwise kernel promotes int64 as bool, reported as a kernel bug)
    checked = [n for n in full.nodes if n.max_error is not None and n.target != "aten._to_copy.default"]
    assert len(checked) > 20 and all(n.max_error < 1e-4 for n in checked), [(n.node, n.max_error) for n in checked]


@pytest.mark.parametrize("device", ["ascend910b", "ascend310p"])
def test_other_devices(device, mha):
    model, args, kwargs, _ = mha
    fused = AutoFusionEngine.fuse(model, (args, kwargs), target_device=device)
    assert len(fused.report.applied) == 1
    before = autofuse.simulate(model, (args, kwargs), device=device)
    after = fused.simulate(*args)
    assert after.device == device and after.cycles < before.cycles


def test_simulate_needs_data():
    model, (args, kwargs) = build("mha", hidden=32, heads=2, seq=16, meta=True)
    with pytest.raises(ValueError, match="meta.*needs data"):
        autofuse.simulate(model, (args, kwargs))


@pytest.mark.parametrize("model,needle", [
    (lambda a: a * 2, r"simulate: model must be a torch.nn.Module .* got function; wrap a function in a module"),
    ("gpt2", r"simulate: model must be a torch.nn.Module .* got str"),
    (torch.nn.Linear, r"simulate: model is the class Linear, not a module: pass an instance of it"),
    (torch.nn.Linear(16, 16).double(), r"simulate: parameter 'weight' of Linear is float64; the NPU target "
                                       r"ascend910 computes in float16, bfloat16 and float32")])
def test_simulate_checks_its_model_as_fuse_does(model, needle):
    """What fuse() refuses, simulate() refuses with the same message, named as simulate's."""
    with pytest.raises(TypeError, match=needle):
        autofuse.simulate(model, (torch.randn(2, 8, 16),))
    with pytest.raises(TypeError, match=needle.replace("simulate: ", "fuse: ")):
        AutoFusionEngine.fuse(model, (torch.randn(2, 8, 16),))


def test_simulate_checks_its_inputs_and_device_as_fuse_does():
    with pytest.raises(TypeError, match=r"simulate: example input 0 is float64"):
        autofuse.simulate(torch.nn.ReLU(), (torch.randn(2, 8, dtype=torch.float64),))
    with pytest.raises(ValueError, match=r"simulate: device='gpu' is not a known device"):
        autofuse.simulate(torch.nn.ReLU(), (torch.randn(2, 8),), device="gpu")


def test_repeated_fused_launches_reuse_statistics_and_keep_values():
    torch.manual_seed(0)
    model, (args, kwargs) = build("gpt2", layers=2, hidden=32, heads=4, seq=16)
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    memo = fused.simulate(*args, **kwargs)
    every = simulate_graph(fused.graph_module, list(fused.plans.values())[0].captured.flatten_inputs(
        *args, **kwargs), memo=False)
    fa_memo = [n for n in memo.nodes if n.fused and n.target == "autofuse.flash_attention"]
    fa_every = [n for n in every.nodes if n.fused and n.target == "autofuse.flash_attention"]
    assert [n.reused for n in fa_memo] == [False, True] and not any(n.reused for n in fa_every)
    assert [n.cycles for n in fa_memo] == [n.cycles for n in fa_every] and memo.cycles == every.cycles
    # every repeated fused launch (layer norms, GELU epilogues) reuses the first one's statistics too
    assert [n.cycles for n in memo.nodes] == [n.cycles for n in every.nodes]
    assert any(n.reused for n in memo.nodes if n.fused and n.target != "autofuse.flash_attention")
    with torch.no_grad():
        want = fused(*args, **kwargs).logits
    torch.testing.assert_close(memo.outputs[0], want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(every.outputs[0], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", [None, "bool", "additive", "causal"])
def test_reference_twin_follows_the_kernel(dtype, mask):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 40, 16).to(dtype), torch.randn(1, 2, 40, 16).to(dtype), torch.randn(1, 2, 40, 16).to(dtype)
    m = None
    if mask == "bool":
        m = torch.rand(1, 1, 40, 40) < 0.6
        m[..., 3, :] = False                                      # a row with no key gives zeros
    elif mask == "additive":
        m = torch.randn(1, 4, 40, 40).to(dtype)
    kernel = autofuse.ops.flash_attention(q, k, v, m, causal=mask == "causal", return_probs=True)
    twin = autofuse.ops.reference_flash_attention(q, k, v, m, causal=mask == "causal", return_probs=True)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(kernel, twin):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_unfused_kernels_run_timing_only_and_count_what_full_launches_count():
    """Unfused nodes take their values from torch, so their kernels run timing-only; with check=True they run in
    full (their values are compared): the per-node cycles, bytes and workspace are the same."""
    torch.manual_seed(0)
    model, (args, kwargs) = build("gpt2", layers=1, hidden=32, heads=4, seq=16, dtype=torch.float16)
    timed = autofuse.simulate(model, (args, kwargs), memo=False)
    full = autofuse.simulate(model, (args, kwargs), memo=False, check=True)
    assert [(n.node, n.kernels, n.cycles, n.hbm_bytes, n.workspace) for n in timed.nodes] == \
        [(n.node, n.kernels, n.cycles, n.hbm_bytes, n.workspace) for n in full.nodes]
    assert any(n.max_error is not None for n in full.nodes) and all(n.max_error is None for n in timed.nodes)


def test_large_values_are_computed_in_blocks(monkeypatch):
    """A float16 GEMM whose fp32 result exceeds BLOCK_BYTES is computed in blocks of rows, and repeated
    attention's twin by batch index: the same figures, and the same values up to the order BLAS sums in."""
    sim = sys.modules["autofuse.simulate"]
    torch.manual_seed(0)
    model, (args, kwargs) = build("gpt2", layers=2, hidden=64, heads=4, seq=64, batch=4, vocab=300,
                                  dtype=torch.float16)
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    whole = [autofuse.simulate(model, (args, kwargs)), fused.simulate(*args, **kwargs)]
    monkeypatch.setattr(sim, "BLOCK_BYTES", 4096)
    twin = autofuse.ops.REFERENCES["flash_attention"]
    calls = []
    monkeypatch.setitem(autofuse.ops.REFERENCES, "flash_attention", lambda q, *a, **k: calls.append(q.shape[0])
                        or twin(q, *a, **k))
    blocked = [autofuse.simulate(model, (args, kwargs)), fused.simulate(*args, **kwargs)]
    assert calls == [1, 1, 1, 1]                           # the second layer's attention, one batch index a call
    assert sim._row_blocks(torch.ops.aten.linear.default, [torch.zeros(4, 64, 64), None],
                           torch.zeros(4, 64, 300)) == ({0}, 1)
    for w, b in zip(whole, blocked):
        assert [(n.node, n.cycles) for n in w.nodes] == [(n.node, n.cycles) for n in b.nodes]
        # a BLAS may block a product of fewer rows differently: the fp32 sums then differ in their last bits, which
        # moves an fp16 result by at most one ulp (2**-10 relative), and the next layers' ops by about as much
        # again: two ulps (subnormals: the smallest normal as absolute bound); this machine's BLAS gives equal bits
        torch.testing.assert_close(w.outputs[0], b.outputs[0], atol=2 ** -14, rtol=2 ** -9)


def test_launches_steered_by_values_are_not_reused_across_values():
    """Two gathers of the same shapes from different rows cost differently (L2 hits on repeated rows): the memo
    keys them by their indices' values too."""
    class TwoLookups(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(4096, 256)

        def forward(self, a, b):
            return self.emb(a) + self.emb(b)

    spread = torch.arange(0, 4096, 64)[None]
    repeated = torch.zeros(1, 64, dtype=torch.long)
    memo = autofuse.simulate(TwoLookups(), (spread, repeated))
    every = autofuse.simulate(TwoLookups(), (spread, repeated), memo=False)
    gathers = [n for n in memo.nodes if n.kernels == ("gather",)]
    assert len(gathers) == 2 and gathers[0].cycles != gathers[1].cycles and not any(n.reused for n in gathers)
    assert [n.cycles for n in memo.nodes] == [n.cycles for n in every.nodes]


def test_fused_launches_steered_by_values_are_not_reused_across_values():
    """Two grouped GEMMs of the same shapes, one with even groups and one with a hot expert, cost differently
    (the busiest core sets the time): the memo keys a fused op by its steering values (the group list), and a
    simulation without values computes the group lists and times the GEMMs on shapes."""
    class TwoGroupings(torch.nn.Module):
        def forward(self, x, w, even, skewed):
            gmm = torch.ops.autofuse.grouped_matmul.default
            return gmm(x, w, even) + gmm(x, w, skewed)

    torch.manual_seed(0)
    x, w = torch.randn(256, 128, dtype=torch.float16), torch.randn(4, 128, 256, dtype=torch.float16)
    inputs = [x, w, torch.tensor([64, 64, 64, 64]), torch.tensor([253, 1, 1, 1])]
    gm = torch.fx.symbolic_trace(TwoGroupings())
    runs = {(memo, values): simulate_graph(gm, inputs, memo=memo, values=values)
            for memo in (True, False) for values in (True, False)}
    for r in runs.values():
        gmms = [n for n in r.nodes if n.target == "autofuse.grouped_matmul"]
        assert len(gmms) == 2 and gmms[0].cycles < gmms[1].cycles and not any(n.reused for n in gmms)
        assert _figures(r)[1:] == _figures(runs[True, True])[1:]


def _figures(r):
    return ([(n.node, n.kernels, n.cycles, n.hbm_bytes, n.workspace, n.reused) for n in r.nodes], r.cycles,
            r.hbm_bytes, r.peak_memory, r.launches, r.distinct_launches)


@pytest.mark.parametrize("memo", [True, False])
@pytest.mark.parametrize("name", ["gpt2", "mixtral"])
def test_timing_only_simulation_counts_what_the_simulation_with_values_counts(name, memo):
    """values=False computes only the values a launch needs (the router and routing of an MoE layer steer its
    experts' kernels; a fused op's first launch runs its kernel); every figure is that of values=True."""
    torch.manual_seed(0)
    if name == "gpt2":
        model, (args, kwargs) = build("gpt2", layers=2, hidden=64, heads=4, seq=64, batch=2, dtype=torch.float16)
    else:
        pytest.importorskip("transformers")
        from test_moe_patterns import _build
        model, ids = _build("mixtral", "grouped_mm", "eager")
        args, kwargs = (ids,), {"use_cache": False}
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    leaves = list(fused.plans.values())[0].captured.flatten_inputs(*args, **kwargs)
    with_values = [autofuse.simulate(model, (args, kwargs), memo=memo),
                   simulate_graph(fused.graph_module, leaves, memo=memo)]
    timing = [autofuse.simulate(model, (args, kwargs), memo=memo, values=False),
              simulate_graph(fused.graph_module, leaves, memo=memo, values=False)]
    if memo:     # the fused module's own entry point passes values through
        assert _figures(fused.simulate(*args, values=False, **kwargs)) == _figures(with_values[1])
    assert any(n.fused for n in with_values[1].nodes)
    for v, t in zip(with_values, timing):
        assert _figures(t) == _figures(v)
        assert t.outputs is None and v.outputs is not None
    with pytest.raises(ValueError, match="check=True"):
        autofuse.simulate(model, (args, kwargs), check=True, values=False)


def test_attention_twin_split_by_batch_keeps_every_output(monkeypatch):
    """Attention's twin computed batch index by batch index (scores over BLOCK_BYTES) gives what it gives in
    one piece: the output and probabilities joined along the batch, the row statistics [2, B, N, Sq] along
    their second dim."""
    from autofuse.ops import reference_flash_attention
    sim = sys.modules["autofuse.simulate"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 24, 16, generator=g) for _ in range(3))
    mask = torch.rand(3, 1, 24, 24, generator=g) < 0.7
    kw = dict(causal=True, return_probs=True, return_stats=True)
    whole = reference_flash_attention(q, k, v, mask, **kw)
    monkeypatch.setattr(sim, "BLOCK_BYTES", 1024)
    split = sim._twin_value("flash_attention", reference_flash_attention, (q, k, v, mask), kw)
    assert whole[2].shape == (2, 3, 2, 24)
    for a, b in zip(whole, split):
        assert a.shape == b.shape
        # the same fp32 operations on each batch's rows, up to BLAS's summation order of D = 16 products
        torch.testing.assert_close(a, b, rtol=16 * 2.0 ** -24, atol=1e-6)


def test_timing_only_training_step_of_an_moe_layer_counts_what_values_count():
    """A training step's MoE launches (grouped GEMMs and their weight gradients, the combine and its backward,
    the router's backward) are timed on shapes plus their group lists and row indices: the same figures."""
    pytest.importorskip("transformers")
    from test_moe_patterns import _build
    torch.manual_seed(0)
    model, ids = _build("mixtral", "grouped_mm", "eager")
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    with_values = fused.simulate(ids, use_cache=False, backward=True)
    timing = fused.simulate(ids, use_cache=False, backward=True, values=False)
    names = {n.target for n in timing.nodes if n.fused}
    assert {"autofuse.grouped_matmul_weight_grad", "autofuse.moe_finalize_routing_grad",
            "autofuse.moe_gating_topk_grad"} <= names
    assert _figures(timing) == _figures(with_values) and timing.phases == with_values.phases


class ComplexRope(torch.nn.Module):
    """Meta's original Llama rotary embedding: q and k viewed as complex pairs, multiplied by complex
    frequencies (``torch.polar``), viewed back; then attention. Complex values are not Vector-program data,
    so the rotation stays as captured; the model still plans, prices, fuses its attention and simulates."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.d = heads, d
        self.qkv = torch.nn.Linear(d * heads, 3 * d * heads)
        freqs = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("freqs", torch.outer(torch.arange(64).float(), freqs))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.d).unbind(2)
        cis = torch.polar(torch.ones_like(self.freqs[:s]), self.freqs[:s])[None, :, None, :]
        rot = lambda t: torch.view_as_real(torch.view_as_complex(t.float().reshape(b, s, self.heads, -1, 2)) * cis)  # noqa: E731
        q, k = (rot(t).flatten(3).type_as(x).transpose(1, 2) for t in (q, k))
        att = torch.softmax(q @ k.transpose(-2, -1) / self.d ** 0.5, -1) @ v.transpose(1, 2)
        return att.transpose(1, 2).reshape(b, s, -1)


def test_complex_values_are_priced_and_simulated_as_their_float_pairs():
    torch.manual_seed(0)
    model, x = ComplexRope().eval(), torch.randn(2, 8, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert [d.applied for d in fused.report.of("attention")] == [True], fused.report.summary()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)     # fp32 both sides
    before = autofuse.simulate(model, ((x,), {}), device="ascend910")
    for r in (before, fused.simulate(x), fused.simulate(x, values=False)):
        assert r.cycles == sum(n.cycles for n in r.nodes) > 0
    cost = {n.node: n for n in before.nodes}
    # the complex multiply moves float pairs: q or k [2, 8, 2, 8] complex64 in and out, the frequencies
    # [1, 8, 1, 8] in, 8 bytes an element; the views between complex and float pairs move nothing
    assert cost["mul"].kernels == ("generic",) and cost["mul"].hbm_bytes == (2 * 256 + 64) * 8
    assert not {"view_as_complex", "view_as_real"} & cost.keys()


class ComplexBuffer(torch.nn.Module):
    """RoPE frequencies kept as a complex64 buffer (torchtitan's Llama registers ``freqs_cis`` so)."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(16, 16)
        self.register_buffer("freqs_cis", torch.polar(torch.ones(8, 8), torch.randn(8, 8)), persistent=False)

    def forward(self, x):
        z = torch.view_as_complex(self.l(x).reshape(*x.shape[:-1], 8, 2)) * self.freqs_cis
        return torch.view_as_real(z).flatten(-2)


def test_a_complex64_buffer_is_captured_and_complex128_is_refused_with_what_to_do():
    """A complex64 buffer holds float32 pairs, which the target computes: it fuses (before, it was refused with the
    hint model.float(), which leaves complex tensors complex); complex128 is refused with a hint that works."""
    torch.manual_seed(0)
    model, x = ComplexBuffer().eval(), torch.randn(2, 8, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-6, rtol=1e-5)      # fp32 pairs both sides
    model.freqs_cis = model.freqs_cis.to(torch.complex128)
    with pytest.raises(TypeError, match=r"buffer 'freqs_cis' of ComplexBuffer is complex128.*t.to\(torch.complex64\)"):
        AutoFusionEngine.fuse(model, (x,))


def test_llama4_with_complex_rotary_embedding_fuses_and_simulates():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.Llama4TextConfig(vocab_size=128, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                              intermediate_size_mlp=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_local_experts=4, num_experts_per_tok=1, pad_token_id=0)
    model, ids = tf.Llama4ForCausalLM(cfg).eval(), torch.randint(1, 128, (2, 8))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    assert fused.report.of("attention") and all(d.applied for d in fused.report.of("attention"))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                   atol=1e-5, rtol=1e-4)
    assert fused.simulate(ids, use_cache=False).cycles > 0


def test_a_per_expert_loop_runs_tuned_for_the_rows_its_routing_gives():
    """transformers' grouped_mm_fallback (one matmul launch per expert) runs each launch with the tiling the cost
    model's search picks for that expert's rows. The search used to see balanced groups (the planner's price,
    without the routing): every other row count ran the kernel's default tiling, a slower baseline (232,308
    cycles instead of 209,705 here; 7.55 M instead of 5.17 M on a Mixtral-8x7B gate_up loop)."""
    import numpy as np
    import transformers.integrations.moe  # noqa: F401 - registers torch.ops.transformers.grouped_mm_fallback
    import cost_model
    from autofuse import npu
    from autofuse.capture import capture
    M, K, N, E = 4096, 1024, 4096, 8
    sizes = [477, 369, 449, 582, 519, 870, 475, 355]

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(E, K, N, dtype=torch.float16), requires_grad=False)

        def forward(self, x, offs):
            return torch.ops.transformers.grouped_mm_fallback(x, self.w, offs)

    x, offs = torch.zeros(M, K, dtype=torch.float16), torch.tensor(np.cumsum(sizes), dtype=torch.int32)
    cap = capture(Experts(), (x, offs))
    res = simulate_graph(cap.graph_module, cap.flatten_inputs(x, offs), values=False)
    (node,) = [n for n in res.nodes if "grouped_mm_fallback" in n.target]
    specs = [((M, K), "float16"), ((E, K, N), "float16"), ((E,), "int64")]
    tuned = cost_model.estimate("matmul_per_group", specs, group_sizes=sizes).tiling
    want = npu.run("matmul_per_group", np.zeros((M, K), np.float16), np.zeros((E, K, N), np.float16),
                   np.cumsum(sizes), timing_only=True, tiling=tuned).stats.cycles
    assert node.cycles == want
