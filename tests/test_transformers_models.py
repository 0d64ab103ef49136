"""Real transformers architectures (random weights from configs, no download): every attention
layer is matched, and the rewritten graph with the reference op equals eager."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autofuse.canonicalize import canonicalize  # noqa: E402
from autofuse.capture import capture  # noqa: E402
from conftest import rewrite_with  # noqa: E402
from patterns.attention import find_attention  # noqa: E402

LAYERS = 1      # one decoder layer holds every site kind (the blocks repeat it)


def _gpt2(impl):
    cfg = transformers.GPT2Config(vocab_size=128, n_layer=LAYERS, n_embd=64, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, attn_implementation=impl)
    return transformers.GPT2Model(cfg)


def _llama(impl):  # GQA: 4 query heads share 2 kv heads
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, attn_implementation=impl)
    return transformers.LlamaModel(cfg)


def _qwen2(impl):
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32, attn_implementation=impl)
    return transformers.Qwen2Model(cfg)


def _bert(impl):  # bidirectional, padding mask only
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                  num_attention_heads=4, max_position_embeddings=32, attn_implementation=impl)
    return transformers.BertModel(cfg, add_pooling_layer=False)


MODELS = {"gpt2": _gpt2, "llama": _llama, "qwen2": _qwen2, "bert": _bert}


def _inputs(padded: bool):
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 8))
    kw = {"use_cache": False}
    if padded:  # right padding: every query row keeps at least one key
        am = torch.ones(2, 8, dtype=torch.long)
        am[1, 6:] = 0
        kw["attention_mask"] = am
    return ids, kw


def _check(model, ids, kw, ref_op, expect_causal, impl=None):
    model.eval()
    cap = capture(model, (ids,), kw)
    if impl is not None:  # the implementation asked for is really the one captured
        want = {"eager": torch.ops.aten.softmax.int, "sdpa": torch.ops.aten.scaled_dot_product_attention.default}[impl]
        assert sum(n.target == want for n in cap.graph_module.graph.nodes) == LAYERS
    gm = canonicalize(cap.graph_module)
    matches = find_attention(gm)
    assert len(matches) == LAYERS, [m.params for m in matches]
    if expect_causal is not None:
        assert all(m.params["causal"] == expect_causal for m in matches), [m.params for m in matches]
    fused = rewrite_with(cap.graph_module, gm, matches, ref_op)
    assert not [n for n in fused.graph.nodes if n.target == torch.ops.aten.softmax.int]
    want = model(ids, **{**kw}).last_hidden_state
    got = cap.unflatten_outputs(fused(*cap.flatten_inputs(ids, **kw))).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    return matches


CASES = [pytest.param(name, impl, padded, id=f"{name}-{impl}-{'padded' if padded else 'nomask'}",
                      marks=[pytest.mark.slow] if padded and name in ("gpt2", "qwen2") else [])
         for name in MODELS for impl in ("eager", "sdpa") for padded in (False, True)]


@pytest.mark.parametrize("name,impl,padded", CASES)
def test_every_attention_layer_matched_and_equal(name, impl, padded, ref_op):
    ids, kw = _inputs(padded)
    causal = None if padded else (name != "bert")
    matches = _check(MODELS[name](impl), ids, kw, ref_op, causal, impl)
    if name in ("llama", "qwen2"):
        assert all(m.params["num_kv_heads"] < m.params["num_heads"] for m in matches)
    if not padded:  # no padding: the mask is proven causal (decoders) or empty (BERT) and dropped
        assert all(m.params["mask_kind"] is None for m in matches), [m.params for m in matches]
    else:
        assert all(m.params["mask_kind"] in ("bool", "additive") for m in matches)


def test_output_attentions_reuses_probs(ref_op):
    model = _llama("eager").eval()
    ids, kw = _inputs(False)
    kw["output_attentions"] = True
    cap = capture(model, (ids,), kw)
    gm = canonicalize(cap.graph_module)
    matches = find_attention(gm)
    assert len(matches) == LAYERS and all(m.params["probs_used"] for m in matches)
    fused = rewrite_with(cap.graph_module, gm, matches, ref_op)
    want = model(ids, **kw)
    got = cap.unflatten_outputs(fused(*cap.flatten_inputs(ids, **kw)))
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-5, rtol=1e-4)
    for a, b in zip(got.attentions, want.attentions):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_gpt2_capture_on_meta_matches_every_layer():
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=64, n_head=4, n_positions=32)
    with torch.device("meta"):
        model = transformers.GPT2Model(cfg).eval()
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    cap = capture(model, (ids,), {"use_cache": False})
    matches = find_attention(canonicalize(cap.graph_module))
    assert len(matches) == LAYERS
    assert all(m.params["causal"] and m.params["q_shape"] == (1, 4, 16, 16) for m in matches)


@pytest.mark.slow
def test_gpt2_small_12_layers_on_meta():
    # how long this takes is benchmarks/compile_time.py's figure, not a test's
    cfg = transformers.GPT2Config()  # 12 layers, 768 hidden, 12 heads
    with torch.device("meta"):
        model = transformers.GPT2Model(cfg).eval()
    ids = torch.zeros(1, 1024, dtype=torch.long, device="meta")
    cap = capture(model, (ids,), {"use_cache": False})
    matches = find_attention(canonicalize(cap.graph_module))
    assert len(matches) == 12
