"""More real architectures from transformers (random weights from configs, no download), end to end
through AutoFusionEngine: every attention block fused, verified and equal to eager. Covers GQA and MQA,
RoPE variants, a relative position bias added to the scores (T5), encoder-decoders with cross-attention
(T5, BART), encoder-only vision and audio (ViT, Whisper's encoder), and both attention implementations."""
import copy

import pytest
import torch

tf = pytest.importorskip("transformers")

from autofuse import AutoFusionEngine  # noqa: E402
from conftest import main_output  # noqa: E402
from autofuse.verify import compare  # noqa: E402

LAYERS = 1          # one layer of each: every block kind of an architecture occurs in it (encoder-decoders: three)
WINDOW_LAYERS = 2   # sliding and full layers alternate: two show both kinds
FUSED_OP = torch.ops.autofuse.flash_attention.default


def _lm(cfg_cls, model_cls, **kw):
    def build(impl):
        cfg = cfg_cls(vocab_size=128, num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, max_position_embeddings=64, **kw)
        cfg._attn_implementation = impl
        return model_cls(cfg), (torch.randint(1, 128, (2, 16)),), {"use_cache": False}
    return build


def _opt(impl):
    cfg = tf.OPTConfig(vocab_size=128, num_hidden_layers=LAYERS, hidden_size=64, ffn_dim=128, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=64)
    cfg._attn_implementation = impl
    return tf.OPTForCausalLM(cfg), (torch.randint(1, 128, (2, 16)),), {"use_cache": False}


def _t5_encoder(impl):       # relative position bias added to the scores: an additive float mask
    cfg = tf.T5Config(vocab_size=128, num_layers=LAYERS, d_model=64, d_ff=128, num_heads=4, d_kv=16)
    cfg._attn_implementation = impl
    return tf.T5EncoderModel(cfg), (torch.randint(1, 128, (2, 16)),), {}


def _vit(impl):
    cfg = tf.ViTConfig(num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       image_size=32, patch_size=8)
    cfg._attn_implementation = impl
    return tf.ViTModel(cfg), (torch.randn(2, 3, 32, 32),), {}


def _seq2seq(cfg_cls, model_cls, **kw):       # encoder self, decoder causal self and cross attention (Sq != Skv)
    def build(impl):
        cfg = cfg_cls(vocab_size=128, pad_token_id=0, decoder_start_token_id=0, **kw)
        cfg._attn_implementation = impl
        ids, dec = torch.randint(1, 128, (2, 12)), torch.randint(1, 128, (2, 8))
        return model_cls(cfg), (ids,), {"decoder_input_ids": dec, "use_cache": False}
    return build


def _whisper_encoder(impl):
    cfg = tf.WhisperConfig(vocab_size=128, encoder_layers=LAYERS, decoder_layers=LAYERS, d_model=64,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32, max_target_positions=32,
                           pad_token_id=0, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0)
    cfg._attn_implementation = impl
    return tf.WhisperModel(cfg).get_encoder(), (torch.randn(2, 16, 64),), {}


BLOCKS = {"t5": 3 * LAYERS, "bart": 3 * LAYERS}     # the others: one block per layer

MODELS = {
    "mistral": _lm(tf.MistralConfig, tf.MistralForCausalLM, num_key_value_heads=2, sliding_window=None),
    # a sliding window shorter than the sequence: the kernel's window, no mask read
    "mistral_window": _lm(tf.MistralConfig, tf.MistralForCausalLM, num_key_value_heads=2, sliding_window=5),
    "gemma": _lm(tf.GemmaConfig, tf.GemmaForCausalLM, num_key_value_heads=1, head_dim=16),      # MQA
    "qwen3": _lm(tf.Qwen3Config, tf.Qwen3ForCausalLM, num_key_value_heads=2, head_dim=16),      # q/k norms
    "phi3": _lm(tf.Phi3Config, tf.Phi3ForCausalLM, num_key_value_heads=4, pad_token_id=0),
    "gpt_neox": _lm(tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM),                                    # partial RoPE
    "opt": _opt,
    "t5_encoder": _t5_encoder,
    "vit": _vit,
    "whisper_encoder": _whisper_encoder,
    "t5": _seq2seq(tf.T5Config, tf.T5ForConditionalGeneration, num_layers=LAYERS, num_decoder_layers=LAYERS,
                   d_model=64, d_ff=128, num_heads=4, d_kv=16),
    "bart": _seq2seq(tf.BartConfig, tf.BartForConditionalGeneration, encoder_layers=LAYERS, decoder_layers=LAYERS,
                     d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_attention_heads=4,
                     decoder_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                     forced_eos_token_id=None),
}


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_attention_block_is_fused(name, impl):
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name](impl)
    model.eval()
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    report = fused.report
    blocks = BLOCKS.get(name, LAYERS)
    attention = report.of("attention")
    assert len(attention) == blocks and all(d.applied for d in attention), report.summary()
    assert not [d for d in report.applied if d.pattern == "softmax"], report.summary()   # never the softmax alone
    assert not [d for d in report.rejected if d.reason_code == "verification_failed"], report.summary()
    assert all(d.verify_error is not None and d.verify_error <= d.verify_tolerance for d in report.applied)
    targets = [n.target for n in fused.graph_module.graph.nodes if n.op == "call_function"]
    assert targets.count(FUSED_OP) == blocks
    leftover = {torch.ops.aten.softmax.int, torch.ops.aten._softmax.default,
                torch.ops.aten.scaled_dot_product_attention.default}
    assert not leftover & set(targets)
    if name == "mistral_window":
        assert all(d.params["causal"] and d.params["window"] == 5 and d.params["mask_kind"] is None for d in attention)
    if name in ("mistral", "mistral_window", "gemma", "qwen3"):     # grouped/multi-query attention as is
        assert all(d.params["num_kv_heads"] < d.params["num_heads"] for d in attention)
    with torch.no_grad():
        torch.testing.assert_close(main_output(fused(*args, **kwargs)), main_output(model(*args, **kwargs)), atol=1e-5, rtol=1e-4)


DROPOUT_ATTRS = ("attention_dropout", "attention_probs_dropout_prob", "dropout_rate")


@pytest.mark.parametrize("name,impl", [(n, "sdpa") for n in MODELS] + [("t5", "eager"), ("bart", "eager")])
def test_training_mode_fuses_attention_dropout_with_eagers_draws(name, impl):
    """Training mode with a 10 % attention dropout: every block fused with its dropout, and every other dropout
    with the Vector region or epilogue around it, drawing the keep-masks
    eager draws (same seed: the same output, and the generator left where eager leaves it). SDPA's dropout_p
    for every architecture (transformers' default); the explicit nn.Dropout spelling in the encoder-decoders
    (self, causal and cross attention), GPT-2's in tests/test_engine.py and tests/test_autograd.py."""
    torch.manual_seed(0)
    model, args, kwargs = MODELS[name](impl)
    cfg = model.config
    for attr in DROPOUT_ATTRS:
        if hasattr(cfg, attr):
            setattr(cfg, attr, 0.1)
    model = type(model)(cfg) if name != "whisper_encoder" else tf.WhisperModel(cfg).get_encoder()
    model.train()
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    attention = fused.report.of("attention")
    assert len(attention) == BLOCKS.get(name, LAYERS) and all(d.applied for d in attention), fused.report.summary()
    assert all(d.params["dropout_p"] == 0.1 for d in attention)
    # every other dropout (residual, embedding, MLP) fused into the Vector region or epilogue around it
    code = fused.graph_module.code
    assert "native_dropout" not in code and "aten.dropout" not in code, code
    runs = []
    for m in (model, fused):
        torch.manual_seed(3)
        out = main_output(m(*args, **kwargs))
        runs.append((out, torch.rand(3)))
    (want, after_eager), (got, after_fused) = runs
    assert torch.equal(after_fused, after_eager)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)     # fp32 both sides, the same keep-masks


def _bloom():
    cfg = tf.BloomConfig(vocab_size=128, n_layer=LAYERS, hidden_size=64, n_head=4)
    cfg._attn_implementation = "eager"
    return tf.BloomForCausalLM(cfg), (torch.randint(1, 128, (2, 16)),), {"use_cache": False}


def _falcon(**kw):
    def build():
        cfg = tf.FalconConfig(vocab_size=128, num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4, **kw)
        cfg._attn_implementation = "eager"
        return tf.FalconForCausalLM(cfg), (torch.randint(1, 128, (2, 16)),), {"use_cache": False}
    return build


def _gemma2(layers=LAYERS, **kw):
    cfg = tf.Gemma2Config(vocab_size=128, num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, **kw)
    cfg._attn_implementation = "eager"
    return tf.Gemma2ForCausalLM(cfg), (torch.randint(1, 128, (2, 16)),), {"use_cache": False}


def _gpt_oss(layers=LAYERS, **kw):
    cfg = tf.GptOssConfig(vocab_size=128, num_hidden_layers=layers, hidden_size=64, intermediate_size=64,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64, **kw)
    cfg._attn_implementation = "eager"
    return tf.GptOssForCausalLM(cfg), (torch.randint(1, 128, (2, 16)),), {"use_cache": False}


def _mpt():
    cfg = tf.MptConfig(vocab_size=128, n_layers=LAYERS, d_model=64, n_heads=4)
    return tf.MptForCausalLM(cfg), (torch.randint(1, 128, (2, 16)),), {"use_cache": False}


EAGER_ONLY = {
    "gemma2": _gemma2,
    "mpt": _mpt,                                                # ALiBi, then masked_fill(causal, finfo.min)                                          # logit soft-capping: 50·tanh(s / 50), then the mask
    "bloom": _bloom,                                            # ALiBi added by baddbmm on heads folded into batch
    "falcon": _falcon(),                                        # one k/v head broadcast by the matmuls, RoPE
    "falcon_alibi": _falcon(alibi=True),                        # the same with ALiBi added before the scale
    "falcon_gqa": _falcon(new_decoder_architecture=True, num_kv_heads=2),
    "gpt_oss": _gpt_oss,                                        # a learnable sink logit per head in the softmax
    # local layers (every other one) with a window shorter than the sequence: the cap / the sinks and the window
    "gemma2_window": lambda: _gemma2(WINDOW_LAYERS, sliding_window=6),
    "gpt_oss_window": lambda: _gpt_oss(WINDOW_LAYERS, sliding_window=6),
}


def _windows(model):
    """The window each layer's attention has: 6 on the sliding layers, 0 (causal alone) on the full ones."""
    return [6 if t == "sliding_attention" else 0 for t in model.config.layer_types]


@pytest.mark.parametrize("name", list(EAGER_ONLY))
def test_eager_only_attention_spellings_are_fused(name):
    """Architectures whose transformers code has only the eager attention path in this form."""
    torch.manual_seed(0)
    model, args, kwargs = EAGER_ONLY[name]()
    model.eval()
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    attention = fused.report.of("attention")
    layers = WINDOW_LAYERS if name.endswith("_window") else LAYERS
    assert len(attention) == model.config.num_hidden_layers == layers, fused.report.summary()
    assert all(d.applied for d in attention), fused.report.summary()
    assert not [d for d in fused.report.rejected if d.reason_code == "verification_failed"], fused.report.summary()
    if name.startswith("falcon") and name != "falcon_gqa":
        assert all(d.params["num_kv_heads"] == 1 for d in attention)
    if name in ("bloom", "falcon_alibi", "mpt"):        # the ALiBi bias reaches the kernel as an additive mask
        assert all(d.params["mask_kind"] == "additive" for d in attention)
    if name == "mpt":                                   # the fill applied after it: where(keep, bias, fill)
        assert all(d.params["fill_last"] for d in attention)
    if name.startswith("gemma2"):
        assert all(d.params["softcap"] == model.config.attn_logit_softcapping == 50.0 for d in attention)
    if name.startswith("gpt_oss"):                      # the sink logits are one input of the kernel
        assert all(d.params["sinks"] for d in attention)
    if name.endswith("_window"):
        assert [d.params["window"] for d in attention] == _windows(model) == [6, 0]
    with torch.no_grad():
        torch.testing.assert_close(main_output(fused(*args, **kwargs)), main_output(model(*args, **kwargs)),
                                   atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["bloom", "falcon_alibi", "mpt"])
@pytest.mark.parametrize("batch,new", [(1, 16), (1, 1), (2, 1)])
def test_alibi_attention_is_fused_at_batch_one_and_at_a_decode_step(name, batch, new):
    """ALiBi at batch 1 and at a decode step (one new token after a KV cache of 15). Bloom adds its bias to scores
    folded as ``[B·H, q, S]``: at one query the bias has the scores' shape, and at batch 1 its mask broadcasts over
    the folded heads; both must reach the prefill's full-rank form, where the bias is an additive mask."""
    torch.manual_seed(0)
    model, _, _ = EAGER_ONLY[name]()
    model.eval()
    ids = torch.randint(1, 128, (batch, 16))
    if new == ids.shape[1]:
        args, kwargs = (ids,), {"use_cache": False}
    else:
        with torch.no_grad():
            cache = model(ids[:, :-new], use_cache=True).cache
        args, kwargs = (ids[:, -new:],), {"use_cache": True, "cache": cache}

    def fresh():            # a call with a cache appends to it: each call gets its own copy
        return args, {**kwargs, "cache": copy.deepcopy(kwargs["cache"])} if "cache" in kwargs else kwargs

    fused = AutoFusionEngine.fuse(model, fresh())
    attention = fused.report.of("attention")
    assert len(attention) == LAYERS and all(d.applied for d in attention), fused.report.summary()
    assert all(d.params["mask_kind"] == "additive" for d in attention)
    with torch.no_grad():
        a, k = fresh()
        got = main_output(fused(*a, **k))
        a, k = fresh()
        torch.testing.assert_close(got, main_output(model(*a, **k)), atol=1e-5, rtol=1e-4)


def _trained_gradients(build):
    """The model in training mode, fused; one backward through the fused model (the attention backward kernel
    launched once per layer) and one through the model itself: (fused report, fused gradients, eager's)."""
    from autofuse.ops import recording
    torch.manual_seed(0)
    model, args, kwargs = build()
    model.train()
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    grads = []
    for m in (fused, model):
        model.zero_grad()
        with recording() as log:
            main_output(m(*args, **kwargs)).float().square().mean().backward()
        if m is fused:
            assert [n for n, _ in log].count("flash_attention_grad") == model.config.num_hidden_layers
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[1]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4)    # fp32 both sides
    return fused.report, grads[0]


def test_gemma2_soft_capped_attention_trains_with_eagers_gradients():
    """The soft-capped kernel's backward runs the backward kernel with the cap (its derivative applied to dS): the
    gradients of every parameter equal eager's."""
    report, _ = _trained_gradients(_gemma2)
    assert all(d.applied and d.params["softcap"] == 50.0 for d in report.of("attention"))


def test_mpt_trains_with_eagers_gradients_on_a_left_padded_batch():
    """MPT adds its ALiBi bias, then fills the masked scores with ``finfo.min``: one mask combining both. A
    left-padded sequence's first queries see no key (causal and padding), so every score of their rows is filled: no
    gradient flows into q or k there (P is uniform), and the fused backward must give none either. Every parameter's
    gradient equals eager's."""
    def build():
        model, (ids,), kwargs = _mpt()
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        return model, (ids,), dict(kwargs, attention_mask=mask)
    report, _ = _trained_gradients(build)
    assert all(d.applied and {kind for _, kind, _ in d.params["mask_terms"]} == {"bool", "additive"}
               for d in report.of("attention"))


def test_gpt_oss_attention_sinks_train_with_eagers_gradients():
    """GPT-OSS's sink logits are parameters: fused in training (the experts too), the gradients of every parameter
    equal eager's; the attention backward runs its kernel from the forward's saved statistics, which count the
    sink, and the sinks' gradient follows from them."""
    report, grads = _trained_gradients(_gpt_oss)
    assert len(report.of("attention")) == LAYERS and all(d.applied for d in report.of("attention"))
    assert len(report.of("moe_experts")) == LAYERS and all(d.applied for d in report.of("moe_experts"))
    assert any("sinks" in n for n in grads)


def test_gpt_oss_sliding_window_trains_with_eagers_gradients():
    """GPT-OSS with a window shorter than the sequence: the sliding layers' forward and backward kernels walk the
    band (sinks too); the gradients of every parameter equal eager's."""
    report, _ = _trained_gradients(lambda: _gpt_oss(WINDOW_LAYERS, sliding_window=6))
    assert [d.params["window"] for d in report.of("attention")] == [6, 0]


def test_gpt_oss_sinks_with_attention_dropout_train_as_eager():
    """Attention dropout after the sink column is dropped: the fused block draws eager's keep-mask for the
    [B, N, Sq, Skv] probabilities (the sink has none), so a seeded step gives eager's outputs and gradients."""
    torch.manual_seed(0)
    model, args, kwargs = _gpt_oss(attention_dropout=0.1)
    model.train()
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    attention = fused.report.of("attention")
    assert len(attention) == LAYERS and all(d.applied and d.params["sinks"] and d.params["dropout_p"] == 0.1
                                            for d in attention), fused.report.summary()
    runs = []
    for m in (fused, model):
        torch.manual_seed(5)
        model.zero_grad()
        out = main_output(m(*args, **kwargs))
        out.float().square().mean().backward()
        runs.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (got, got_g), (want, want_g) = runs
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)       # fp32 both sides, the same keep-masks
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], atol=1e-5, rtol=1e-4)


def test_fp32_q_and_k_with_a_bf16_v_fuse_with_v_cast_up():
    """GPT-J in bf16 upcasts q and k to fp32 and leaves v in bf16 (fusing it as it was crashed fuse()): v is cast
    up to fp32 ahead of the kernel (an exact widening, priced as its own launch) and the block fuses."""
    torch.manual_seed(0)
    cfg = tf.GPTJConfig(vocab_size=128, n_layer=LAYERS, n_embd=64, n_head=4, rotary_dim=8, n_positions=64)
    cfg._attn_implementation = "eager"
    model, ids = tf.GPTJForCausalLM(cfg).to(torch.bfloat16).eval(), torch.randint(1, 128, (2, 16))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    attention = fused.report.of("attention")
    assert [d.reason_code for d in attention] == ["fused"] * LAYERS, fused.report.summary()
    assert all(d.params["v_cast"] == torch.float32 for d in attention)
    with torch.no_grad():
        got, want = fused(ids, use_cache=False).logits, model(ids, use_cache=False).logits
        ref = copy.deepcopy(model).double()(ids, use_cache=False).logits
    assert got.dtype == want.dtype == torch.bfloat16
    ok, err, tol = compare(want, ref, got)        # the verifier's bound: within twice eager's error of float64
    assert ok, (err, tol)


class MixedDtypes(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1).to(v.dtype) @ v


def test_q_k_and_v_of_other_mixed_dtypes_are_reported_not_fused():
    """bf16 q and k against an fp32 v: casting v down would round it, so no one kernel dtype says it."""
    q, k, v = torch.randn(2, 4, 8, 16).bfloat16(), torch.randn(2, 4, 8, 16).bfloat16(), torch.randn(2, 4, 8, 16)
    m = MixedDtypes().eval()
    fused = AutoFusionEngine.fuse(m, (q, k, v))
    (d,) = fused.report.of("attention")
    assert d.reason_code == "unsupported" and "different dtypes (bfloat16, bfloat16, float32)" in d.reason
    # the softmax still fuses on its own (fp32 inside, where eager rounds to bf16): the verifier's bound
    ok, err, tol = compare(m(q, k, v), m(q.double(), k.double(), v.double()), fused(q, k, v))
    assert ok, (err, tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_eager_attention_under_autocast_is_fused_and_trains_within_the_bound(dtype):
    """Under CPU autocast RoPE leaves q and k in fp32, and autocast casts q, kᵀ and the fp32 probabilities where the
    matmuls read them: each block is fused all the same, in the autocast dtype. Its output and every parameter's
    gradient (the attention backward kernel launched per layer) are within the verifier's bound of float64: at most
    twice eager's error."""
    from autofuse.ops import recording
    torch.manual_seed(0)
    model, args, kwargs = _lm(tf.LlamaConfig, tf.LlamaForCausalLM, num_key_value_heads=2)("eager")
    model.eval()
    ref = copy.deepcopy(model).double()
    with torch.autocast("cpu", dtype=dtype):
        fused = AutoFusionEngine.fuse(model, (args, kwargs))
    attention = fused.report.of("attention")
    assert len(attention) == LAYERS and all(d.applied and d.params["dtype"] == dtype for d in attention), \
        fused.report.summary()
    weights = torch.randn(2, 16, 128, dtype=torch.float64)
    (main_output(ref(*args, **kwargs)) * weights).sum().backward()
    runs = []
    for m in (model, fused):
        model.zero_grad()
        with recording() as log:
            with torch.autocast("cpu", dtype=dtype):
                out = main_output(m(*args, **kwargs))
            (out.double() * weights).sum().backward()
        if m is fused:
            assert [n for n, _ in log].count("flash_attention_grad") == LAYERS
        runs.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (want, want_g), (got, got_g) = runs
    ok, err, tol = compare(want, main_output(ref(*args, **kwargs)).detach(), got)
    assert ok, ("logits", err, tol)
    for n, p in ref.named_parameters():
        ok, err, tol = compare(want_g[n], p.grad, got_g[n])
        assert ok, (n, err, tol)


def test_gemma3n_trains_with_its_altup_coefficients_clamped_as_in_eager():
    """Gemma 3n clamps its AltUp prediction coefficients through ``.data`` in each training forward: the fused model
    writes the clamped values back and reads them with their gradient, as eager does. With a clip small enough to
    bite, every parameter's gradient (the coefficients' included) equals eager's, and the coefficients after the
    call are eager's, bit for bit (the same clamp)."""
    from autofuse.models import build_transformers
    spec = ("transformers:Gemma3nTextConfig?num_hidden_layers=2&hidden_size=64&intermediate_size=[128,128]"
            "&num_attention_heads=4&num_key_value_heads=2&vocab_size=128&pad_token_id=0&head_dim=16"
            "&sliding_window=8&layer_types=[sliding_attention,full_attention]&num_kv_shared_layers=0&laurel_rank=8"
            "&altup_num_inputs=2&hidden_size_per_layer_input=16&activation_sparsity_pattern=[0.0,0.0]"
            "&altup_coef_clip=0.05")
    torch.manual_seed(0)
    model, (args, kwargs) = build_transformers(spec, seq=8, batch=2, attn="eager")
    model.train()
    coefs = [n for n, _ in model.named_parameters() if n.endswith("prediction_coefs.weight")]
    with torch.no_grad():
        for n in coefs:
            model.get_parameter(n).normal_()            # beyond the clip
    eager = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    assert fused.report.applied, fused.report.summary()
    for m in (fused, eager):
        main_output(m(*args, **kwargs)).float().square().mean().backward()
    want = dict(eager.named_parameters())
    assert coefs
    for n, p in model.named_parameters():
        if want[n].grad is None:
            assert p.grad is None, n
            continue
        torch.testing.assert_close(p.grad, want[n].grad, atol=1e-5, rtol=1e-4, msg=n)    # fp32 both sides
        assert torch.equal(p, want[n]), n
    for n in coefs:         # small gradients: compared against their own largest too (a pass missing leaves them 0)
        p, top = model.get_parameter(n), float(want[n].grad.abs().max())
        assert top > 0 and float((p.grad - want[n].grad).abs().max()) <= 1e-4 * top, n
        assert bool((p.abs() <= torch.tensor(0.05)).all()), n


@pytest.mark.parametrize("route", ["compile", "fuse"])
def test_phimoe_trains_fused_with_its_router_function_kept(route):
    """PhiMoE's router in training (sparsemixer) applies a custom autograd.Function whose backward is not its
    forward's derivative, between two torch.no_grad() blocks, before transformers' grouped_mm_fallback op. Through
    torch.compile with grad the whole graph ran unfused (the Function), then, with the Function kept, its capture
    failed (the blocks' end turned grad on inside torch.export's trace); fuse() refused it. The Function now runs as
    one op with its own backward on both routes (torch.compile's from Dynamo's graphs of it, fuse()'s applying the
    Function itself), the blocks' calls do nothing while the graph is captured, and the rest fuses: the output and
    every gradient equal eager's within fp32 rounding (the same seed draws the router's jitter alike)."""
    import autofuse
    from autofuse.backend import graphs
    from autofuse.grad_ops import CUSTOM_FUNCTION, USER_FUNCTION_OP
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = tf.PhimoeConfig(vocab_size=128, num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    cfg._attn_implementation = "sdpa"
    model = tf.PhimoeForCausalLM(cfg).train()
    ids = torch.randint(1, 128, (2, 16))
    fused = torch.compile(model, backend="autofuse") if route == "compile" else AutoFusionEngine.fuse(model)
    grads, outs = [], []
    for m in (fused, model):
        model.zero_grad()
        torch.manual_seed(7)
        out = m(ids, use_cache=False).logits
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    if route == "compile":
        reports, op = autofuse.reports(fused), CUSTOM_FUNCTION
        plans = [p for g in graphs(fused) for p in g.fused.plans.values()]
    else:
        reports, op, plans = [fused.report], USER_FUNCTION_OP, list(fused.plans.values())
    applied = [d.pattern for r in reports for d in r.applied]
    assert "attention" in applied and any("moe" in p or "grouped" in p for p in applied), applied
    assert sum(n.target is op for p in plans for n in p.captured.graph_module.graph.nodes) == 2
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-4)       # fp32 both sides: summation orders
    assert grads[0].keys() == grads[1].keys()
    for n in grads[1]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4, msg=n)


def test_fp16_mpt_attention_fuses_with_the_kernel_selecting_its_fill():
    """MPT in fp16 adds its fp32 ALiBi bias to fp16 scores (fp32 logits) and fills the masked ones with fp16's
    ``finfo.min``, -65504, which a fp32 score added to it does not vanish into: a left-padded query's row, every key
    masked, is uniform in eager. The kernel reads one mask ``where(keep, bias, fill)`` and selects the fill where
    the mask holds it (``fill_in_mask``), so every block fuses as attention (before that select each was reported
    unsupported and only its softmax fused), and the output is eager's within the verifier's bound, the padded rows
    included."""
    torch.manual_seed(0)
    model, (ids,), kwargs = _mpt()
    model = model.to(torch.float16).eval()
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kwargs = dict(kwargs, attention_mask=mask)
    fused = AutoFusionEngine.fuse(model, ((ids,), kwargs))
    attention = fused.report.of("attention")
    assert [d.reason_code for d in attention] == ["fused"] * LAYERS, fused.report.summary()
    calls = [n for p in fused.plans.values() for n in p.graph_module.graph.nodes
             if n.target is torch.ops.autofuse.flash_attention.default]
    assert len(calls) == LAYERS and all(n.kwargs.get("fill_in_mask") for n in calls)
    with torch.no_grad():
        want, got = main_output(model(ids, **kwargs)), main_output(fused(ids, **kwargs))
        ref = main_output(copy.deepcopy(model).double()(ids, **kwargs))
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)
