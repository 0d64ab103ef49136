"""A causal mask added to a learned bias (T5's decoder self-attention: ``scores + position_bias + causal_mask``, or
``scores + (bias + causal_mask)``): the block keeps its mask, and the fused op may run the causal kernel reading the
bias alone in the kept tiles, skipping the tiles above the diagonal, where two run-time bounds (``score_bound`` on
q and k, ``bias_bound`` on the bias as the op receives it) prove every skipped weight is exactly 0 in fp32
(:func:`autofuse.ops.causal_bias_skip_is_exact`: ``v·(1 - 1e-3) + 2(A + max|b|)(1 + 1e-3) <= -110`` for the causal
mask's masked value v). With transformers' ``finfo(float32).min`` and the magnitudes here (|s| and |b| below 100)
the bound holds with a margin of about 3e38 on any IEEE fp32 CPU, so the skip is taken; the kept scores are ``s + b``
exactly as eager's (``b + 0 == b``), so the skip gives bit-for-bit what reading the mask gives. Weights that break
the bound (``3e38``, inf) make the op read the mask as before; nothing about the bias is baked into the plan.

The cost model prefers reading the mask at small shapes (two more launches, and the bias bound reads the bias once
more); where a test needs the skip at those shapes it prefers it explicitly (``prefer``), and one test at a larger
shape shows the planner choosing it by itself."""
import pytest
import torch
import torch.nn as nn

import autofuse.fused as fused_mod
from autofuse import AutoFusionEngine
from autofuse.ops import recording
from conftest import assert_as_eager, main_output

FUSED_OP = torch.ops.autofuse.flash_attention.default
BIAS_BOUND = torch.ops.autofuse.bias_bound.default
FMIN = torch.finfo(torch.float32).min
H, D = 4, 16
SKIP = ["bias_bound", "score_bound", "flash_attention"]      # the bias bound: its own call, ahead of the block
SWITCHES = {"attention": "force", "softmax": "off"}     # the attention block, never the softmax alone


@pytest.fixture
def prefer(monkeypatch):
    """``prefer(flag)``: the plan takes the causal skip (True) or the mask read (False) whatever the cost model says
    (the other implementation's price stays in the report's alternatives)."""
    orig = fused_mod._cheaper

    def set_(flag):
        def chosen(price_on, device, names, option):
            p = orig(price_on, device, names, option)
            if option != "causal_skip" or bool(p.options.get(option)) == flag:
                return p
            other = price_on(device, flag)
            other.alternatives, other.options = p.alternatives, {**other.options, option: flag}
            return other
        monkeypatch.setattr(fused_mod, "_cheaper", chosen)
    return set_


def _mask(kind, s, value=FMIN):
    """An additive [1, 1, s, s] mask built from aranges: ``causal`` (j <= i kept), ``shifted`` (j <= i + 1)."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    keep = {"causal": j <= i, "shifted": j <= i + 1}[kind]
    return torch.zeros(s, s).masked_fill(~keep, value)[None, None]


class BiasAttention(nn.Module):
    """``softmax(q·kᵀ + b + C) · v`` with ``b`` [1, H, S, S] a learned bias (``embedding``: T5-like bucket lookup,
    bidirectional buckets so the bias differs above the diagonal; ``param``: an nn.Parameter; ``input``: computed
    from q) and ``C`` a mask; ``order``: ``sum_bc`` s + (b + C), ``sum_cb`` s + (C + b), ``two_bc`` (s + b) + C,
    ``two_cb`` (s + C) + b, ``sub`` (s - b) + C."""

    def __init__(self, s, bias="embedding", order="sum_bc", mask="causal", value=FMIN, pad=False):
        super().__init__()
        self.s, self.bias, self.order, self.mask, self.value, self.pad = s, bias, order, mask, value, pad
        g = torch.Generator().manual_seed(1)
        self.rel = nn.Embedding(31, H)
        self.rel.weight.data = torch.randn(31, H, generator=g) * 2
        self.table = nn.Parameter(torch.randn(1, H, s, s, generator=g))
        self.register_buffer("keep", torch.rand(s, s, generator=g) > 0.5)      # a random mask (near miss)

    def _bias(self, q):
        if self.bias == "param":
            return self.table
        if self.bias == "input":
            return q.mean(-1, keepdim=True)[:1] * 3.0 + self.table      # depends on the input, bounded at run time
        i = torch.arange(self.s)
        bucket = (i[None, :] - i[:, None]).clamp(-15, 15) + 15
        return self.rel(bucket).permute(2, 0, 1).unsqueeze(0)

    def forward(self, q, k, v, pad=None):
        s = q @ k.transpose(-1, -2)
        b = self._bias(q)
        c = torch.zeros(self.s, self.s).masked_fill(~self.keep, self.value)[None, None] if self.mask == "random" \
            else _mask(self.mask, self.s, self.value)
        if self.order == "sum_bc":
            s = s + (b + c)
        elif self.order == "sum_cb":
            s = s + (c + b)
        elif self.order == "two_bc":
            s = s + b + c
        elif self.order == "two_cb":
            s = s + c + b
        else:
            s = s - b + c
        if pad is not None:
            s = s.masked_fill(~pad, float("-inf"))
        return torch.softmax(s, -1) @ v


def _qkv(s, b=2, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(b, H, s, D, generator=g) * 0.5).requires_grad_(grad) for _ in range(3))


def _decision(fused):
    (d,) = fused.report.of("attention")
    assert d.applied, d.reason
    (call,) = [n for n in fused.graph_module.graph.nodes if n.op == "call_function" and n.target is FUSED_OP]
    return d, call


def _run(fused, args):
    with recording() as log, torch.no_grad():
        got = fused(*args)
    return got, log


def _flash(log):
    (st,) = [s for k, s in log if k == "flash_attention"]
    return st


# ------------------------------------------------------------------------------------------------ positive

@pytest.mark.parametrize("bias,s,order", [("embedding", 37, o) for o in ("sum_bc", "sum_cb", "two_bc", "two_cb")]
                         + [("param", 37, "sum_cb"), ("param", 37, "two_bc"), ("embedding", 130, "sum_bc"),
                            ("embedding", 130, "two_cb")])
def test_bias_plus_causal_mask_runs_the_causal_kernel(bias, s, order, prefer):
    prefer(True)
    model = BiasAttention(s, bias, order).eval()
    args = _qkv(s)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    d, call = _decision(fused)
    assert d.params["causal_value"] == FMIN and d.params["causal_bias"] == "mask" and not d.params["causal"]
    assert {n for n, _, _ in d.params["alternatives"]["ascend910"]} == {"causal skip under score and bias bounds",
                                                                         "mask read"}
    assert call.kwargs["causal_value"] == FMIN and call.kwargs["causal_bias"] is not None
    got, log = _run(fused, args)
    assert [k for k, _ in log] == SKIP
    with torch.no_grad():
        assert_as_eager(model, args, got)
    # the same call reading the mask (the bias plus the causal mask, with the same tiling): the same values bit for
    # bit, and more work
    with torch.no_grad():
        q, k, v = args
        mask = model._bias(q) + _mask("causal", s)
        kw = {n: call.kwargs[n] for n in ("scale", "device", "tiling", "empty_rows")}
        with recording() as log2:
            want = FUSED_OP(q, k, v, mask, **kw)[0]
    assert [k for k, _ in log2] == ["flash_attention"]
    assert torch.equal(got, want.reshape(got.shape))
    if s == 130:
        assert _flash(log).cycles < _flash(log2).cycles and _flash(log).hbm_bytes < _flash(log2).hbm_bytes


def test_the_planner_takes_the_skip_where_it_is_cheaper():
    """At 16 x 4 heads x 512 tokens the two bound launches cost less than the tiles they save on every device: the
    plan chooses the skip by itself, and the report shows both prices."""
    s = 512
    model = BiasAttention(s, "embedding", "two_bc").eval()
    args = _qkv(s, b=16)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    d, call = _decision(fused)
    assert d.params["alternatives"]["ascend910"][0][0] == "causal skip under score and bias bounds"
    assert "; causal skip under score and bias bounds (mask read " in d.reason
    got, log = _run(fused, args)
    assert [k for k, _ in log] == SKIP
    with torch.no_grad():
        assert_as_eager(model, args, got)
    # weights past the bound: the mask is read (more cycles and bytes), still eager's values
    model.rel.weight.data.fill_(3e38)
    got2, log2 = _run(fused, args)
    assert [k for k, _ in log2] == SKIP
    assert _flash(log).cycles < _flash(log2).cycles and _flash(log).hbm_bytes < _flash(log2).hbm_bytes
    with torch.no_grad():
        torch.testing.assert_close(got2, model(*args), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("order", ["sum_bc", "two_bc"])
def test_a_bias_computed_from_the_input_is_bounded_at_run_time(order, prefer):
    """The bias need not come from weights: whatever reaches the op is bounded when it runs."""
    prefer(True)
    model = BiasAttention(37, "input", order).eval()
    args = _qkv(37)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    d, _ = _decision(fused)
    assert d.params["causal_bias"] == "mask"
    got, log = _run(fused, args)
    assert [k for k, _ in log][-3:] == SKIP            # after the launch computing the bias
    with torch.no_grad():
        assert_as_eager(model, args, got)


# ------------------------------------------------------------------------------------------------ run-time fallback

@pytest.mark.parametrize("order", ["sum_bc", "two_cb"])
def test_weights_past_the_bound_read_the_mask_and_later_weights_are_followed(order, prefer):
    """Nothing about the bias is baked in: weights of 3e38 (the bound fails: the mask is read) and inf (NaN in the
    bound) give what the mask-reading call gives, bit for bit, and eager's values; new finite weights are skipped
    again with their own values."""
    prefer(True)
    model = BiasAttention(37, "embedding", order).eval()
    args = _qkv(37)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    prefer(False)
    read = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    skipped = _flash(_run(fused, args)[1])
    for value in (3e38, float("inf"), -3e38):
        model.rel.weight.data.fill_(value)
        model.rel.weight.data[3, 1] = 1.0
        got, log = _run(fused, args)
        assert [k for k, _ in log] == SKIP and _flash(log).hbm_bytes > skipped.hbm_bytes      # the mask read
        assert torch.equal(got.nan_to_num(7.0), _run(read, args)[0].nan_to_num(7.0))
        with torch.no_grad():
            torch.testing.assert_close(got, model(*args), atol=1e-5, rtol=1e-4, equal_nan=True)
    model.rel.weight.data = torch.randn(31, H) * 5
    got, log = _run(fused, args)
    assert _flash(log).hbm_bytes == skipped.hbm_bytes                                       # skipped again
    with torch.no_grad():
        assert_as_eager(model, args, got)


# ------------------------------------------------------------------------------------------------ near misses

@pytest.mark.parametrize("mask,value,order", [
    ("shifted", FMIN, "sum_bc"),        # a causal mask shifted by one: not causal
    ("random", FMIN, "sum_bc"),         # not causal
    ("random", FMIN, "two_bc"),
    ("causal", -1e4, "sum_bc"),         # a masked value that does not absorb the bias
    ("causal", -1e4, "two_bc"),
    ("causal", FMIN, "sub"),            # the bias subtracted: another factor
])
def test_near_misses_read_their_mask(mask, value, order):
    model = BiasAttention(37, "embedding", order, mask, value).eval()
    args = _qkv(37)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    d, call = _decision(fused)
    assert d.params.get("causal_bias") is None and "causal_bias" not in call.kwargs
    got, log = _run(fused, args)
    assert "bias_bound" not in [k for k, _ in log]
    with torch.no_grad():
        assert_as_eager(model, args, got)


class BiasAttention16(nn.Module):
    """T5's decoder spelling in a 16-bit model (``dtype``): scores, a learned bias and transformers' causal mask
    (``finfo(dtype).min`` above the diagonal) all of that dtype, added in it."""

    def __init__(self, s, dtype, order):
        super().__init__()
        self.s, self.order = s, order
        self.rel = nn.Embedding(31, H).to(dtype)
        i = torch.arange(s)
        self.register_buffer("bucket", (i[None, :] - i[:, None]).clamp(-15, 15) + 15)

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2)
        b = self.rel(self.bucket).permute(2, 0, 1).unsqueeze(0)
        keep = torch.ones(self.s, self.s, dtype=torch.bool).tril()
        c = torch.zeros(self.s, self.s, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)[None, None]
        s = s + (b + c) if self.order == "sum_bc" else s + b + c
        return torch.softmax(s.float(), -1).to(v.dtype) @ v


@pytest.mark.parametrize("order", ["sum_bc", "two_bc"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_bias_and_causal_mask_are_read_as_before(dtype, order):
    """The skip is proven in fp32 only: a 16-bit model's bias and causal mask (added in 16 bits, where the masked
    value need not absorb the bias) are read as the mask, with no bias bound, and the output is eager's."""
    torch.manual_seed(0)
    model = BiasAttention16(37, dtype, order).eval()
    args = tuple(t.to(dtype) for t in _qkv(37))
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    d, call = _decision(fused)                        # the block fuses, reading its mask
    assert d.params.get("causal_bias") is None and "causal_bias" not in call.kwargs
    got, log = _run(fused, args)
    assert "bias_bound" not in [k for k, _ in log]
    with torch.no_grad():
        assert_as_eager(model, args, got)


def test_a_padding_mask_combined_in_is_read():
    model = BiasAttention(37, "embedding", "sum_bc", pad=True).eval()
    pad = torch.ones(2, 1, 1, 37, dtype=torch.bool)
    pad[1, ..., 30:] = False
    args = (*_qkv(37), pad)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    d, call = _decision(fused)
    assert d.params.get("causal_bias") is None and "causal_bias" not in call.kwargs
    with torch.no_grad():
        assert_as_eager(model, args, _run(fused, args)[0])


# ------------------------------------------------------------------------------------------------ training

def test_training_skips_forward_and_recomputes_the_backward_as_before(prefer):
    """A learnable bias needs its gradient: the backward recomputes on the host in fp32 from the mask the block
    reads (as it did), so dq, dk, dv and the bias's gradient are eager's; the forward may skip (exact either way)."""
    prefer(True)
    model = BiasAttention(37, "embedding", "two_bc").train()
    args = _qkv(37, grad=True)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    d, _ = _decision(fused)
    assert d.params["causal_bias"] == "mask"
    with recording() as log:
        out = fused(*args)
    assert [k for k, _ in log][:3] == SKIP
    _assert_as_eager_with_grads(model, args, out)


def _assert_as_eager_with_grads(model, args, out):
    """``out`` (the fused model's on ``args``) and its gradients for q, k, v and the bias's weights are eager's."""
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [*args, model.rel.weight], g)
    ref_args = [a.detach().clone().requires_grad_(True) for a in args]
    want_out = model(*ref_args)
    want = torch.autograd.grad(want_out, [*ref_args, model.rel.weight], g)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)     # fp32: the kernel's sums in another order
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ T5

def _t5():
    tf = pytest.importorskip("transformers")
    cfg = tf.T5Config(vocab_size=128, num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16,
                      pad_token_id=0, decoder_start_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(cfg).eval()
    ids, dec = torch.randint(1, 128, (2, 12)), torch.randint(1, 128, (2, 37))
    return model, (ids,), {"decoder_input_ids": dec, "use_cache": False}


def test_t5_decoder_self_attention_runs_causal(prefer):
    """transformers' T5: ``scores + position_bias + causal_mask`` in the decoder's self-attention. Both decoder
    self-attention blocks take the skip; they read the one position bias the first layer computes, bounded once per
    call (one ``bias_bound`` launch, whose result both read); encoder and cross attention have no causal mask. Large
    weights on the decoder's relative bias make the bound fail: the mask is read, eager's values."""
    prefer(True)
    model, args, kwargs = _t5()
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    attention = fused.report.of("attention")
    assert len(attention) == 6 and all(d.applied for d in attention)
    bias = [d for d in attention if d.params.get("causal_bias")]
    assert len(bias) == 2 and all(d.params["causal_value"] == FMIN and d.params["q_shape"][-2] == 37 for d in bias)
    assert all(d.params["bias_readers"] == 2 for d in bias)
    (bound,) = [n for n in fused.graph_module.graph.nodes if n.target is BIAS_BOUND]
    calls = [n for n in fused.graph_module.graph.nodes if n.target is FUSED_OP and "causal_bias" in n.kwargs]
    assert len(calls) == 2 and all(c.kwargs["bias_partials"] is bound for c in calls)
    assert all(c.kwargs["causal_bias"] is bound.args[0] for c in calls)
    with recording() as log, torch.no_grad():
        got = main_output(fused(*args, **kwargs))
        want = main_output(model(*args, **kwargs))
    kernels = [k for k, _ in log]
    assert kernels.count("bias_bound") == 1 and kernels.count("score_bound") == 2
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    emb = model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias
    emb.weight.data[0] = 2e38
    with recording() as log, torch.no_grad():
        got = main_output(fused(*args, **kwargs))
        want = main_output(model(*args, **kwargs))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, equal_nan=True)


def test_t5_plans_on_meta_tensors_as_on_real_ones(prefer):
    """A plan on meta tensors (``--meta``: large configurations without memory) makes the decoder's causal mask
    constant on the model's device: it was built on the CPU, and combining it with the meta bias raised a device
    mismatch. The meta plan makes the real plan's decisions at the real plan's prices."""
    import copy
    prefer(True)
    model, args, kwargs = _t5()
    meta = copy.deepcopy(model).to("meta")
    to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t       # noqa: E731
    real = AutoFusionEngine.fuse(model, (args, kwargs)).report.decisions
    planned = AutoFusionEngine.fuse(meta, (tuple(map(to_meta, args)), {k: to_meta(v) for k, v in kwargs.items()}),
                                    verify=False).report.decisions
    assert [(d.pattern, d.applied, d.cycles_fused, d.cycles_unfused) for d in planned] == \
        [(d.pattern, d.applied, d.cycles_fused, d.cycles_unfused) for d in real]
    assert sum(bool(d.params.get("causal_bias")) and d.applied for d in planned) == 2


# ------------------------------------------------------------------------------------------------ the bias bound

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bias_bound_kernel_is_max_abs_and_keeps_nan_and_inf(dtype):
    import cost_model
    from autofuse import npu
    x = (torch.randn(1, H, 130, 130) * 3).to(dtype).permute(0, 1, 3, 2)      # as a permuted bias arrives
    r = npu.run("bias_bound", x)
    assert r.outputs[0].max() == x.abs().max().float().item()
    e = cost_model.estimate("bias_bound", [((1, H, 130, 130), str(dtype).replace("torch.", ""))])
    assert abs(e.cycles / r.stats.cycles - 1) < 0.05
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[0, 2, 77, 5] = bad
        got = npu.run("bias_bound", y).outputs[0].max()
        assert got != got if bad != bad else got == float("inf")


# ------------------------------------------------------------------------------------------------ one shared bound

class SharedBias(nn.Module):
    """``layers`` attention blocks ``h = softmax(h·kᵀ + b + C)·v + h``, every one reading the one learned bias ``b``
    (T5's decoder: the first layer's relative position bias, read by every layer) and the causal mask ``C``;
    ``split``: the last block reads a second bias (another embedding) instead."""

    def __init__(self, s, layers=3, split=False):
        super().__init__()
        self.s, self.layers, self.split = s, layers, split
        g = torch.Generator().manual_seed(2)
        self.rel, self.rel2 = nn.Embedding(31, H), nn.Embedding(31, H)
        self.rel.weight.data = torch.randn(31, H, generator=g) * 2
        self.rel2.weight.data = torch.randn(31, H, generator=g) * 2

    def forward(self, q, k, v):
        i = torch.arange(self.s)
        bucket = (i[None, :] - i[:, None]).clamp(-15, 15) + 15
        b = self.rel(bucket).permute(2, 0, 1).unsqueeze(0)
        b2 = self.rel2(bucket).permute(2, 0, 1).unsqueeze(0)
        c = _mask("causal", self.s)
        h = q
        for layer in range(self.layers):
            bias = b2 if self.split and layer == self.layers - 1 else b
            h = torch.softmax(h @ k.transpose(-1, -2) + bias + c, -1) @ v + h
        return h


def _calls(fused):
    nodes = list(fused.graph_module.graph.nodes)
    return [n for n in nodes if n.target is BIAS_BOUND], [n for n in nodes if n.target is FUSED_OP]


def test_one_bias_bound_launch_serves_every_block_reading_the_bias(prefer):
    """Three blocks read one bias: one ``bias_bound`` call, emitted ahead of the first block, whose result every block
    reads (``bias_partials``); per forward one launch of it and three of the score bound and the kernel. The values
    are bit for bit those of the per-call path (each block bounding the bias itself), and eager's."""
    prefer(True)
    model = SharedBias(37).eval()
    args = _qkv(37)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    attention = fused.report.of("attention")
    assert len(attention) == 3 and all(d.applied and d.params["bias_readers"] == 3 for d in attention)
    (bound,), calls = _calls(fused)
    nodes = list(fused.graph_module.graph.nodes)
    assert len(calls) == 3 and nodes.index(bound) < min(nodes.index(c) for c in calls)
    assert all(c.kwargs["bias_partials"] is bound and c.kwargs["causal_bias"] is bound.args[0] for c in calls)
    got, log = _run(fused, args)
    assert [k for k, _ in log] == ["bias_bound"] + ["score_bound", "flash_attention"] * 3
    with torch.no_grad():
        assert_as_eager(model, args, got)
    # the same graph with each block bounding the bias itself (the per-call path): three launches, the same bits
    gm = fused.graph_module
    for c in calls:
        c.kwargs = {k: v for k, v in c.kwargs.items() if k != "bias_partials"}
    gm.graph.erase_node(bound)
    gm.recompile()
    with recording() as log2, torch.no_grad():
        old = gm(*args)
    assert [k for k, _ in log2] == ["score_bound", "bias_bound", "flash_attention"] * 3
    assert torch.equal(got, old[0] if isinstance(old, (tuple, list)) else old)


def test_a_shared_bound_that_fails_reads_the_mask_in_every_block_and_follows_new_weights(prefer):
    """The shared bound is computed from the bias of this call, never kept from an earlier one: weights of 3e38, inf
    or NaN make it fail for every block (each reads the mask: what the mask-reading plan gives, bit for bit, and
    eager's values); finite weights again are skipped again."""
    prefer(True)
    model = SharedBias(37).eval()
    args = _qkv(37)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    prefer(False)
    read = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    assert not _calls(read)[0]                          # reading the mask: no bound at all
    skipped = [s.hbm_bytes for k, s in _run(fused, args)[1] if k == "flash_attention"]
    for value in (3e38, float("inf"), float("nan")):
        model.rel.weight.data.fill_(value)
        model.rel.weight.data[3, 1] = 1.0
        got, log = _run(fused, args)
        assert [k for k, _ in log].count("bias_bound") == 1
        flash = [s.hbm_bytes for k, s in log if k == "flash_attention"]
        assert len(flash) == 3 and all(a > b for a, b in zip(flash, skipped))      # every block read the mask
        assert torch.equal(got.nan_to_num(7.0), _run(read, args)[0].nan_to_num(7.0))
        with torch.no_grad():
            torch.testing.assert_close(got, model(*args), atol=1e-5, rtol=1e-4, equal_nan=True)
    model.rel.weight.data = torch.randn(31, H) * 2
    got, log = _run(fused, args)
    assert [s.hbm_bytes for k, s in log if k == "flash_attention"] == skipped
    with torch.no_grad():
        assert_as_eager(model, args, got)


def test_two_biases_get_two_bounds(prefer):
    """A near miss: the last block reads another bias. Two bounds, each read by its own blocks; the second bias past
    the bound makes only its block read the mask."""
    prefer(True)
    model = SharedBias(37, split=True).eval()
    args = _qkv(37)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    assert sorted(d.params["bias_readers"] for d in fused.report.of("attention")) == [1, 2, 2]
    bounds, calls = _calls(fused)
    assert len(bounds) == 2 and bounds[0].args[0] is not bounds[1].args[0]
    assert [bounds.index(c.kwargs["bias_partials"]) for c in calls] == [0, 0, 1]
    assert all(c.kwargs["bias_partials"].args[0] is c.kwargs["causal_bias"] for c in calls)
    skipped = [s.hbm_bytes for k, s in _run(fused, args)[1] if k == "flash_attention"]
    model.rel2.weight.data.fill_(3e38)
    got, log = _run(fused, args)
    assert [k for k, _ in log].count("bias_bound") == 2
    flash = [s.hbm_bytes for k, s in log if k == "flash_attention"]
    assert flash[:2] == skipped[:2] and flash[2] > skipped[2]
    with torch.no_grad():
        torch.testing.assert_close(got, model(*args), atol=1e-5, rtol=1e-4)


def test_the_op_bounds_the_bias_itself_without_a_shared_bound():
    """Called directly, without ``bias_partials``, the op launches ``bias_bound`` itself; given the bound (the
    ``bias_bound`` op, which no gradient flows through), it does not, and computes the same values."""
    from autofuse import ops
    q, k, v = _qkv(37)
    bias = (torch.randn(1, H, 37, 37) * 2).requires_grad_(True)
    mask = bias.detach() + _mask("causal", 37)
    kw = dict(causal_value=FMIN, causal_bias=bias.detach())
    with recording() as log, torch.no_grad():
        own = FUSED_OP(q, k, v, mask, **kw)[0]
    assert [k for k, _ in log] == ["score_bound", "bias_bound", "flash_attention"]
    with recording() as log:
        partials = ops.bias_bound(bias)
    assert [k for k, _ in log] == ["bias_bound"] and not partials.requires_grad
    assert partials.shape == BIAS_BOUND(torch.empty(1, H, 37, 37, device="meta")).shape
    assert partials.max().item() == bias.detach().abs().max().item()
    with recording() as log, torch.no_grad():
        shared = FUSED_OP(q, k, v, mask, **kw, bias_partials=partials)[0]
    assert [k for k, _ in log] == ["score_bound", "flash_attention"]
    assert torch.equal(own, shared)
    ref = ops.reference_bias_bound(bias)
    assert ref.shape == partials.shape and ref.max() == partials.max()


def test_the_planner_charges_each_block_its_share_of_the_bound():
    """Each of the n blocks reading one bias is priced with 1/n of the bound (rounded up): its skip costs what a lone
    block's does less the rest of the bound; the mask read is unchanged. The report names the sharing."""
    import cost_model
    s = 256
    args = _qkv(s, b=4)
    prices = {}
    for layers in (1, 3):
        fused = AutoFusionEngine.fuse(SharedBias(s, layers).eval(), args, fusion_switches=SWITCHES)
        d = fused.report.of("attention")[0]
        assert d.params["bias_readers"] == layers
        prices[layers] = {name.split(",")[0]: c for name, c, _ in d.params["alternatives"]["ascend910"]}
        if layers == 3:
            assert any(n.endswith(", one bias bound shared by 3 blocks") for n, _, _ in
                       d.params["alternatives"]["ascend910"])
    bb = int(cost_model.estimate("bias_bound", [((1, H, s, s), "float32")], device="ascend910").cycles)
    skip = "causal skip under score and bias bounds"
    assert prices[1]["mask read"] == prices[3]["mask read"]
    assert prices[1][skip] - prices[3][skip] == bb - -(-bb // 3)


def test_simulation_and_report_count_the_shared_launch_once(prefer):
    """The whole-graph simulation runs the one ``bias_bound`` call once; the report charges it to the first block's
    fused call (its price holds its share; the other blocks' hold theirs)."""
    from autofuse.report import node_costs
    prefer(True)
    model = SharedBias(37).eval()
    args = _qkv(37)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    (bound,), calls = _calls(fused)
    sim = fused.simulate(*args)
    launched = [n for n in sim.nodes if "bias_bound" in n.kernels]
    assert [n.node for n in launched] == [bound.name] and launched[0].kernels == ("bias_bound",)
    assert all(n.kernels == ("score_bound", "flash_attention") for n in sim.nodes if n.node in
               {c.name for c in calls})
    costs = node_costs(fused.graph_module, "ascend910", fused.report)
    assert costs[bound.name].part_of == calls[0].name and costs[bound.name].cycles == 0


def test_a_training_plan_shares_the_bound_and_keeps_its_backward(prefer):
    """Training: the forward shares the bound; the backward is the one it was (the host recompute from the mask
    each block reads), so the gradients of q, k, v and of the shared bias's weights are eager's."""
    prefer(True)
    model = SharedBias(37).train()
    args = _qkv(37, grad=True)
    fused = AutoFusionEngine.fuse(model, args, fusion_switches=SWITCHES)
    assert len(_calls(fused)[0]) == 1
    with recording() as log:
        out = fused(*args)
    assert [k for k, _ in log].count("bias_bound") == 1
    _assert_as_eager_with_grads(model, args, out)
