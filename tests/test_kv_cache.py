"""KV caches through fuse(): a transformers causal LM's prefill returns eager's cache, a decode step updates the
cache it is given in place as eager does, and generate() gives eager's tokens (autofuse.caches)."""

import copy
import re
import warnings

import pytest
import torch

from autofuse import AutoFusionEngine
from autofuse.capture import capture
from autofuse.verify import compare

tf = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _model(kind="llama", layers=2, **kw):
    """Two layers by default (a cache's layers kept apart); one where a test is about something else."""
    torch.manual_seed(0)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_layer=layers, n_embd=64, n_head=4,
                                                n_positions=64)).eval()
    config, model = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                     "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                     "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
                     "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM)}[kind]
    return model(config(**{**SMALL, "num_hidden_layers": layers}, **kw)).eval()


def _fused_attention(report) -> int:
    return sum(d.applied and d.pattern == "attention" for d in report.decisions)


def _double(cache):
    """A float64 copy of ``cache`` (the reference a decode step is judged against)."""
    c = copy.deepcopy(cache)
    for layer in c.layers:
        layer.keys, layer.values = layer.keys.double(), layer.values.double()
    return c


def _assert_as_eager(want, ref, got):
    ok, err, tol = compare(want, ref, got)     # the verifier's bound: at most twice eager's error against float64
    assert ok, (err, tol)


def test_prefill_returns_eager_cache():
    """Called as the model is called by default (``use_cache`` on): the logits and a new DynamicCache whose keys
    and values are eager's, with every attention block fused."""
    model, ids = _model(), torch.randint(1, 128, (2, 8))
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        got, want, ref = fused(ids), model(ids), copy.deepcopy(model).double()(ids)
    assert isinstance(got.cache, tf.DynamicCache) and got.cache is not want.cache
    _assert_as_eager(want.logits, ref.logits, got.logits)
    for g, w, r in zip(got.cache.layers, want.cache.layers, ref.cache.layers):
        _assert_as_eager(w.keys, r.keys, g.keys)
        _assert_as_eager(w.values, r.values, g.values)
    assert _fused_attention(fused.report) == 2, fused.report.summary()


def test_decode_step_updates_the_given_cache_in_place():
    """Eager appends the step's keys and values to the cache it is given and returns that object: so does the
    fused step, keeping the cache's own layer objects (a caller holding one sees the update). The one-token
    attention against the cache is fused."""
    model, ids = _model(), torch.randint(1, 128, (2, 8))
    with torch.no_grad():
        prefill = model(ids).cache
    step = torch.randint(1, 128, (2, 1))
    mine, theirs, ref = copy.deepcopy(prefill), copy.deepcopy(prefill), _double(prefill)
    layers = list(mine.layers)
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        got = fused(step, cache=mine)
        want = model(step, cache=theirs)
        expect = copy.deepcopy(model).double()(step, cache=ref)
    assert got.cache is mine and want.cache is theirs
    assert mine.layers == layers and all(a is b for a, b in zip(mine.layers, layers))
    _assert_as_eager(want.logits, expect.logits, got.logits)
    for g, w, r in zip(mine.layers, theirs.layers, ref.layers):
        assert g.keys.shape == w.keys.shape == (2, 2, 9, 16)
        _assert_as_eager(w.keys, r.keys, g.keys)
        _assert_as_eager(w.values, r.values, g.values)
    assert _fused_attention(fused.report) == 2, fused.report.summary()


def test_an_empty_cache_given_is_filled_and_returned():
    model, ids = _model(), torch.randint(1, 128, (1, 6))
    mine = tf.DynamicCache(config=model.config)
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        got, want = fused(ids, cache=mine), model(ids)
    assert got.cache is mine and mine.get_seq_length() == 6
    assert torch.equal(mine.layers[0].keys, got.cache.layers[0].keys)
    assert (mine.layers[1].values - want.cache.layers[1].values).abs().max() < 1e-5   # fp32, |v| ~ 1: rounding


def test_capture_leaves_the_example_cache_as_it_was():
    """export traces the model on the example inputs; the cache it is given keeps its own tensors."""
    model, ids = _model(layers=1), torch.randint(1, 128, (1, 6))      # one layer: each layer's tensors are kept alike
    with torch.no_grad():
        cache = model(ids).cache
    keys = [layer.keys for layer in cache.layers]
    captured = capture(model, (torch.randint(1, 128, (1, 1)),), {"cache": cache})
    assert all(layer.keys is k and k.shape[2] == 6 for layer, k in zip(cache.layers, keys))
    assert captured.route == "export"


def test_simulating_a_decode_step_leaves_the_cache_alone():
    model, ids = _model(layers=1), torch.randint(1, 128, (1, 6))      # one layer: the check reads the first
    with torch.no_grad():
        cache = model(ids).cache
    keys = cache.layers[0].keys
    fused = AutoFusionEngine.fuse(model)
    result = fused.simulate(torch.randint(1, 128, (1, 1)), cache=cache, values=False)
    assert result.cycles > 0 and cache.layers[0].keys is keys and cache.get_seq_length() == 6


@pytest.mark.parametrize("kind, kw", [("llama", {}), ("mistral", {"sliding_window": 4, "layers": 1}),
                                      ("gemma2", {"head_dim": 16, "sliding_window": 4}), ("gpt2", {"layers": 1}),
                                      ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "layers": 1})])
def test_generate_gives_eager_tokens(kind, kw):
    """Greedy decoding through the fused forward (prefill and each decode step planned once per length): the
    tokens eager's generate() picks. Mistral's and Gemma 2's windows (4) are shorter than the prompt, so their
    sliding-window caches drop keys while decoding; Gemma 2's two layers are one sliding, one full."""
    model, ids = _model(kind, **kw), torch.randint(1, 128, (1, 8))
    fused = AutoFusionEngine.fuse(model)
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **settings)
        got = fused.generate(ids, **settings)
    assert torch.equal(got, want)
    assert len(fused.plans) == 3                  # the prefill, then two decode steps (8 -> 9 -> 10 cached)
    assert all(_fused_attention(p.report) == model.config.num_hidden_layers for p in fused.plans.values())


@pytest.mark.parametrize("kind, kw, tokens, plans", [("llama", {}, 5, 2),
                                                     ("gemma2", {"head_dim": 16, "sliding_window": 4}, 3, 3)])
def test_generate_with_a_static_cache(kind, kw, tokens, plans):
    """A static cache (``cache_implementation="static"``) keeps its size while decoding: its tensors are written
    in place at the new positions, and every decode step has the same input sizes. The fused model writes them
    as eager does, so one plan serves every decode step: two plans for five new tokens, not six. Gemma 2's
    static cache has sliding-window layers (window 4, shorter than the prompt): each keeps its length as a Python
    int, from which the mask's offset is computed, so each of its steps is planned (three plans for three tokens;
    their exports shared, test_a_static_cache_with_sliding_layers_shares_one_export) and the tokens are still
    eager's."""
    model, ids = _model(kind, **kw), torch.randint(1, 128, (2, 8))
    fused = AutoFusionEngine.fuse(model)
    settings = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                    cache_implementation="static")
    with torch.no_grad():
        want = model.generate(ids, **settings)
        got = fused.generate(ids, **settings)
    assert torch.equal(got, want)
    assert len(fused.plans) == plans
    assert all(_fused_attention(p.report) == 2 for p in fused.plans.values())


def _hints(fused, ids, **settings) -> list:
    """The messages of generate()'s planning hint while ``fused`` generates from ``ids``, each shown at the line
    that called generate() (here), as warnings point at the user's code."""
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        fused.generate(ids, do_sample=False, pad_token_id=0, **settings)
    hints = [w for w in seen if str(w.message).startswith("autofuse: generate() planned")]
    assert all(w.filename == __file__ for w in hints), [w.filename for w in hints]
    return [str(w.message) for w in hints]


def test_a_generate_that_plans_many_lengths_says_why_once(monkeypatch):
    """A generate() that plans GENERATE_PLANS_HINT new signatures or more says so once per fused module: how many,
    the seconds of planning, why (each cache length is one), and with a dynamic cache what keeps the decode steps on
    one plan. Below the count, with a static cache (two plans), and the second time, it says nothing; a static cache
    whose sliding layers keep their length as a Python int (Gemma 2's: 4 signatures, 2 of them planned) says nothing
    below the count, and at it gets the reason without the advice it followed."""
    import autofuse.engine as engine
    monkeypatch.setattr(engine, "GENERATE_PLANS_HINT", 3)      # the rule, at fewer tokens than the default count
    model, ids = _model("llama", layers=1), torch.randint(1, 128, (1, 8))
    fused = AutoFusionEngine.fuse(model)
    assert _hints(fused, ids, max_new_tokens=2, min_new_tokens=2) == []                 # two plans: below
    (hint,) = _hints(fused, torch.randint(1, 128, (1, 12)), max_new_tokens=3, min_new_tokens=3)   # 12 to 14
    assert re.match(r"autofuse: generate\(\) planned 3 new input signatures \(\d+\.\d s of planning\): each new "
                    r"cache length is one", hint), hint
    assert "cache_implementation='static'" in hint
    assert _hints(fused, torch.randint(1, 128, (1, 20)), max_new_tokens=3, min_new_tokens=3) == []   # said once
    static = dict(max_new_tokens=4, min_new_tokens=4, cache_implementation="static")
    fused = AutoFusionEngine.fuse(model)
    assert _hints(fused, ids, **static) == [] and len(fused.plans) == 2
    # Gemma 2's static cache: 4 signatures (its sliding layer's length), the last two served by the second's plan
    # (test_a_static_cache_with_sliding_layers_shares_one_export): 2 planned, below the count
    gemma = AutoFusionEngine.fuse(_model("gemma2", head_dim=16, sliding_window=4))
    assert _hints(gemma, torch.randint(1, 128, (1, 8)), **static) == [] and len(gemma.plans) == 4
    monkeypatch.setattr(engine, "GENERATE_PLANS_HINT", 2)
    gemma = AutoFusionEngine.fuse(_model("gemma2", head_dim=16, sliding_window=4))
    (hint,) = _hints(gemma, torch.randint(1, 128, (1, 8)), **static)
    assert "planned 2 new input signatures" in hint and "cache_implementation" not in hint


@pytest.mark.parametrize("given, advised", [({}, True), ({"cache_implementation": "static"}, False),
                                            ({"generation_config": "static"}, False), ({"cache": "object"}, False),
                                            ({"past_key_values": "object"}, False)])
def test_the_generate_hint_advises_a_static_cache_only_where_none_was_asked_for(given, advised):
    """The hint's advice is left out where generate() was asked for a static cache: by keyword, in the
    generation_config passed, or as a StaticCache object under either keyword transformers takes."""
    model = _model("llama", layers=1)
    fused = AutoFusionEngine.fuse(model)
    kwargs = {}
    for key, value in given.items():
        if value == "object":
            kwargs[key] = tf.StaticCache(config=model.config, max_cache_len=16)
        elif key == "generation_config":
            kwargs[key] = tf.GenerationConfig(cache_implementation=value)
        else:
            kwargs[key] = value
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused._hint_generate(20, 1.5, kwargs)
    (hint,) = [str(w.message) for w in seen]
    assert hint.startswith("autofuse: generate() planned 20 new input signatures (1.5 s of planning)")
    assert ("cache_implementation='static'" in hint) == advised


@pytest.mark.parametrize("kind, kw, advised", [("llama", {}, True), ("mistral", {"sliding_window": 4}, False),
                                               ("mistral", {"sliding_window": None}, True),
                                               ("gemma2", {"head_dim": 16, "sliding_window": 4}, False)])
def test_the_generate_hint_does_not_advise_a_static_cache_to_a_model_with_sliding_layers(kind, kw, advised):
    """A static cache's sliding-window layers keep their length in its structure, so each decode step is exported
    and planned by itself; a dynamic cache's share one export until the window fills. The hint advises a static
    cache only to a model without such layers (Mistral without a window has none)."""
    fused = AutoFusionEngine.fuse(_model(kind, layers=1, **kw))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused._hint_generate(20, 1.5, {})
    (hint,) = [str(w.message) for w in seen]
    assert ("cache_implementation='static'" in hint) == advised


def test_a_static_cache_is_written_in_place_as_eager_writes_it():
    """A decode step against a static cache: the cache's own key and value tensors (the same objects, as eager
    leaves them) hold eager's values at the step's position, and the logits are eager's."""
    model = _model()
    cache = tf.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(torch.randint(1, 128, (2, 8)), cache=cache, cache_position=torch.arange(8))
    theirs, ref = copy.deepcopy(cache), _double(cache)
    tensors = [(layer.keys, layer.values) for layer in cache.layers]
    step, at = torch.randint(1, 128, (2, 1)), torch.tensor([8])
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        got = fused(step, cache=cache, cache_position=at)
        want = model(step, cache=theirs, cache_position=at)
        expect = copy.deepcopy(model).double()(step, cache=ref, cache_position=at)
    assert got.cache is cache
    assert all(layer.keys is k and layer.values is v for layer, (k, v) in zip(cache.layers, tensors))
    _assert_as_eager(want.logits, expect.logits, got.logits)
    for g, w, r in zip(cache.layers, theirs.layers, ref.layers):
        assert g.keys.shape == (2, 2, 16, 16)
        _assert_as_eager(w.keys, r.keys, g.keys)
        _assert_as_eager(w.values, r.values, g.values)
    assert _fused_attention(fused.report) == 2, fused.report.summary()


def test_generate_with_left_padding_and_the_model_left_as_it_was():
    model = _model(layers=1)        # one layer: the point is the padded prompt, the plans kept and the model's state
    ids = torch.randint(1, 128, (2, 8))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    state = dict(vars(model))
    fused = AutoFusionEngine.fuse(model, max_plans=2)       # the oldest length's plan dropped: one per step kept
    settings = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **settings)
        got = fused.generate(ids, **settings)
    assert torch.equal(got, want) and len(fused.plans) == 2
    assert dict(vars(model)) == state and "forward" not in vars(model)


def _scores_as_eager(model, fused, ids, **settings):
    """generate()'s tokens and scores, fused against eager (and a float64 copy's scores as the bound's reference)."""
    settings = dict(settings, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        want, got = model.generate(ids, **settings), fused.generate(ids, **settings)
        ref = copy.deepcopy(model).double().generate(ids, **settings)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    for w, r, g in zip(want.scores, ref.scores, got.scores):
        _assert_as_eager(w, r, g)


def test_generate_builds_the_inputs_eager_builds_from_the_forwards_signature():
    """generate() reads the forward's parameter names to decide what it builds: an attention mask from
    pad_token_id when none is given, position_ids from the mask (GPT-2's absolute positions under left padding),
    logits_to_keep. The fused steps are called with what eager's are."""
    model = _model(layers=1, pad_token_id=0)      # one layer: the point is what generate() builds, not the cache
    ids = torch.randint(3, 128, (2, 6))
    ids[0, :3] = 0                              # left padding, no mask given: generate makes one from the pads
    _scores_as_eager(model, AutoFusionEngine.fuse(model), ids, max_new_tokens=3, do_sample=False)
    model = _model("gpt2", layers=1)
    ids = torch.randint(3, 128, (2, 6))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0              # a tokenizer's left padding: positions count from each first token
    _scores_as_eager(model, AutoFusionEngine.fuse(model), ids, attention_mask=mask, max_new_tokens=3,
                     do_sample=False, num_beams=2, pad_token_id=0)


def test_generate_continues_from_a_cache_of_the_prompts_start():
    # a cache of the first 5 tokens given with all 8: the prefill feeds only the 3 it does not hold, as eager's
    model = _model(layers=1, pad_token_id=0, eos_token_id=2)
    fused = AutoFusionEngine.fuse(model)
    torch.manual_seed(1)
    prefix = torch.randint(3, 128, (1, 5))
    full = torch.cat([prefix, torch.randint(3, 128, (1, 3))], 1)
    with torch.no_grad():
        want = model.generate(full, cache=model(prefix).cache, max_new_tokens=4, do_sample=False)
        got = fused.generate(full, cache=fused(prefix).cache, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want), (got, want)


def test_generate_without_a_generate_method_says_what_to_do():
    fused = AutoFusionEngine.fuse(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(AttributeError, match="no generate"):
        fused.generate(torch.randn(2, 4))



def test_generate_through_torch_compile():
    """The other route: the model's forward compiled with the autofuse backend, then its own generate(); Dynamo
    recompiles per cache length as a dynamic graph, which autofuse plans at each length it meets."""
    import autofuse
    model, ids = _model(layers=1), torch.randint(1, 128, (1, 8))
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **settings)
    backend = autofuse.backend()
    torch._dynamo.reset()
    try:
        model.forward = torch.compile(model.forward, backend=backend)
        with torch.no_grad():
            got = model.generate(ids, **settings)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, want)
    assert backend.reports and all(_fused_attention(r) == 1 for r in backend.reports)


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_encoder_decoder_generate(kind):
    """An encoder-decoder's generate() runs its encoder once through get_encoder(), then the decoder step by step
    against an EncoderDecoderCache: the encoder is fused too (its own plan), and every step's self- and
    cross-attention."""
    torch.manual_seed(0)
    if kind == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=128, d_model=32, d_ff=64, num_layers=1,
                                                          num_heads=2, d_kv=16, decoder_start_token_id=0))
    else:
        model = tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))
    model.eval()
    ids = torch.randint(3, 128, (1, 8))
    fused = AutoFusionEngine.fuse(model)
    settings = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, **settings)
        got = fused.generate(ids, **settings)
    assert torch.equal(got, want)
    assert fused.state_dict().keys() == model.state_dict().keys()    # the model's keys; the encoder's not added
    assert [_fused_attention(p.report) for p in fused.encoder_plans.values()] == [1]
    assert len(fused.plans) == 3 and all(_fused_attention(p.report) == 2 for p in fused.plans.values())


def test_sampling_draws_eager_tokens_and_leaves_the_generator_as_eager():
    """Sampled generation under one seed: the fused model's tokens are eager's, and torch's generator ends where
    eager's does (planning each new length draws nothing from it)."""
    model, ids = _model(layers=1), torch.randint(1, 128, (2, 8))
    fused = AutoFusionEngine.fuse(model)
    settings = dict(max_new_tokens=4, min_new_tokens=4, do_sample=True, top_k=50, pad_token_id=0)
    with torch.no_grad():
        torch.manual_seed(1)
        want, after_eager = model.generate(ids, **settings), torch.rand(4)
        torch.manual_seed(1)
        got, after_fused = fused.generate(ids, **settings), torch.rand(4)
    assert torch.equal(got, want) and torch.equal(after_fused, after_eager)

# ------------------------------------------------------------------------------ decode steps from a spec (--past)

def test_decode_step_inputs_follow_the_model_cache():
    """``build(..., past=N)``: the new tokens, ``use_cache`` and a cache of N tokens in the model's own layers (a
    sliding window keeps its last window - 1 keys, as a prefill leaves it), on real or meta tensors."""
    from autofuse.models import build
    model, (args, kwargs) = build("llama", seq=1, batch=3, past=20)
    cache = kwargs["cache"]
    assert args[0].shape == (3, 1) and kwargs["use_cache"] is True and cache.get_seq_length() == 20
    assert [tuple(layer.keys.shape) for layer in cache.layers] == [(3, 2, 20, 16)] * 2   # 4 heads, 2 kv heads
    spec = ("transformers:MistralConfig?num_hidden_layers=2&hidden_size=64&intermediate_size=128"
            "&num_attention_heads=4&num_key_value_heads=2&sliding_window=8")
    model, (_, kwargs) = build(spec, seq=1, batch=2, past=20, meta=True)
    assert [tuple(layer.keys.shape) for layer in kwargs["cache"].layers] == [(2, 2, 7, 16)] * 2
    assert kwargs["cache"].layers[0].keys.is_meta


@pytest.mark.parametrize("spec, why", [("bert", "needs a causal language model"),
                                       ("mha", "needs a causal language model")])
def test_decode_step_of_a_model_without_a_cache_is_refused(spec, why):
    from autofuse.models import ModelSpecError, build
    with pytest.raises(ModelSpecError, match=why):
        build(spec, seq=1, past=4)


def test_report_of_a_decode_step(capsys):
    """``autofuse report --past N``: the plan of one decode step; its attention against the cache fused."""
    from autofuse.cli import main
    main(["report", "--model", "llama", "--past", "24", "--batch", "2", "--layers", "1"])
    out = capsys.readouterr().out
    assert "FUSED attention" in out and "whole graph (predicted)" in out
    with pytest.raises(SystemExit) as e:
        main(["report", "--model", "llama", "--past", "-1"])
    assert e.value.code == 2 and "--past -1" in capsys.readouterr().err


# ------------------------------------------------------------------------------ grouped-query decode attention

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_decode_step_packs_each_kv_group_into_one_work_item(dtype):
    """Grouped-query attention with one new token: q [B, 8, 1, D] runs as [B, 2, 4, D] against the 2 kv heads, so
    each kv head's keys and values are loaded once per group, not once per query head. At this size the cost
    model finds it cheaper on the 910, the call carries it, and the logits are eager's (the verifier's bound)."""
    from autofuse.models import build
    torch.manual_seed(0)
    model, (args, kwargs) = build("llama", layers=1, hidden=256, heads=8, kv_heads=2, seq=1, batch=4, past=256,
                                  dtype=dtype)
    fused = AutoFusionEngine.fuse(model, (args, copy.deepcopy(kwargs)))
    (decision,) = fused.report.of("attention")
    best, other = decision.params["alternatives"]["ascend910"]
    assert best[0] == "a kv group's query heads in one work item" and best[1] < other[1]
    assert decision.cycles_fused == best[1] and "in one work item" in decision.reason
    (call,) = [n for n in fused.graph_module.graph.nodes if "flash_attention" in str(n.target)]
    assert tuple(call.args[0].meta["val"].shape) == (4, 2, 4, 32)
    mine, theirs, ref = copy.deepcopy(kwargs["cache"]), copy.deepcopy(kwargs["cache"]), _double(kwargs["cache"])
    with torch.no_grad():
        got = fused(*args, use_cache=True, cache=mine)
        want = model(*args, use_cache=True, cache=theirs)
        expect = copy.deepcopy(model).double()(*args, use_cache=True, cache=ref)
    _assert_as_eager(want.logits, expect.logits, got.logits)


@pytest.mark.parametrize("case, group", [
    ({}, 4),                                               # one token, 8 query heads over 2 kv heads
    ({"q_shape": (2, 8, 3, 16)}, 0),                       # three query rows: a prefill chunk
    ({"k_shape": (2, 8, 40, 16)}, 0),                      # no kv group (multi-head attention)
    ({"causal": True}, 0),
    ({"probs_used": True}, 0),
    ({"dropout_draw": ((2, 8, 1, 40), torch.float32)}, 0),
    ({"window": 16}, 0),
    ({"q_shape": (8, 1, 16)}, 0),                          # not [B, N, S, D]
])
def test_which_blocks_pack_kv_groups(case, group):
    from autofuse.fused import gqa_group
    p = {"q_shape": (2, 8, 1, 16), "k_shape": (2, 2, 40, 16), **case}
    assert gqa_group(p, []) == group


def test_a_mask_per_head_keeps_one_work_item_per_query_head():
    from autofuse.fused import gqa_group
    p = {"q_shape": (2, 8, 1, 16), "k_shape": (2, 2, 40, 16)}
    assert gqa_group(p, [(2, 1, 1, 40)]) == 4 and gqa_group(p, [(1, 40)]) == 4
    assert gqa_group(p, [(2, 8, 1, 40)]) == 0


def test_a_fused_draft_model_serves_assisted_generation():
    # the fused module reads the model's attributes through (config, generation_config, device, transformers'
    # _supports_* flags), so a fused draft drops in where the model goes; the tokens are eager's
    main, draft = _model(layers=1, pad_token_id=0, eos_token_id=2), _model(layers=1, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(5)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.05)
    fused_draft = AutoFusionEngine.fuse(draft)
    assert fused_draft.config is draft.config and fused_draft.device == draft.device
    with pytest.raises(AttributeError, match="nor has the LlamaForCausalLM it fuses"):
        fused_draft.no_such_setting
    ids = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        want = main.generate(ids, assistant_model=draft, max_new_tokens=6, do_sample=False)
        got = main.generate(ids, assistant_model=fused_draft, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want) and fused_draft.plans


@pytest.mark.parametrize("kind, kw", [("mistral", {"sliding_window": 16, "layers": 1}),
                                      ("gemma2", {"head_dim": 16, "sliding_window": 16})])
def test_sliding_window_decode_steps_share_one_export_until_the_window_fills(kind, kw):
    """A dynamic cache's sliding-window layer keeps its length as a Python int, part of the cache's structure; while
    the window is not full that int is its keys' length, and capture writes it so (caches.lengths_tied), so the
    decode steps share one symbolic export as a full-attention cache's do: 4 of 5 served, as Llama's in
    test_generate_exports_the_decode_step_once_for_its_lengths (every step a new structure before, none served).
    With a window of 6 the first two decode steps (lengths 4 and 5) are inside it: the second makes the symbolic
    export and is served from it. Past the window the keys stop growing (5) and the length does not (6, 7, 8): it
    is lifted out of the structure into an input of its own, a size like the keys' length, so those three steps
    are a second family sharing a second export (6 exported by itself, 7 the symbolic export, 8 served): 3 served.
    The tokens are eager's either way; Gemma 2 has a full layer too."""
    model, ids = _model(kind, **kw), torch.randint(1, 128, (1, 4))
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        want = model.generate(ids, **settings)
        assert torch.equal(fused.generate(ids, **settings), want)
    assert fused._sizes.served == 4

    model = _model(kind, **{**kw, "sliding_window": 6})
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        want = model.generate(ids, **settings)
        assert torch.equal(fused.generate(ids, **settings), want)
    assert fused._sizes.served == 3


@pytest.mark.parametrize("kind, kw", [("mistral", {"sliding_window": 16, "layers": 1}),
                                      ("gemma2", {"head_dim": 16, "sliding_window": 4})])
def test_a_static_cache_with_sliding_layers_shares_one_export(kind, kw):
    """A static cache's sliding-window layers keep their length as a Python int their keys' size does not hold (the
    keys keep the window's size); lifted out of the structure into an input of its own, it is a size of the step,
    and the decode steps share one symbolic export: 4 of 5 served (none before: every step a structure of its own).
    The length is part of each step's signature (6 keys), but from the third decode step on the captured graph is
    the second's but for the new length it returns (engine.graph_changes): that plan serves it, returning the new
    number, so 3 plans are made (the prefill and two decode steps), not 6. Gemma 2's window (4) is shorter than
    the prompt, Mistral's (16) longer than the whole generation; the tokens are eager's."""
    model, ids = _model(kind, **kw), torch.randint(1, 128, (2, 8))
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                    cache_implementation="static")
    fused = AutoFusionEngine.fuse(model)
    with torch.no_grad():
        want = model.generate(ids, **settings)
        assert torch.equal(fused.generate(ids, **settings), want)
    assert len(fused.plans) == 6 and fused._sizes.served == 4
    made = {id(p) for p in fused.plans.values() if p.twin_of is None}
    assert len(made) == 3 and fused.__dict__["_made"][0] == 3
    assert all(p.twin_of is None or id(p.twin_of) in made for p in fused.plans.values())


def test_a_cache_length_is_tied_to_its_keys_only_inside_autofuse():
    """Flattening a cache with a sliding-window layer: inside caches.lengths_tied its length is written as the keys'
    length and read back from them (the structure holds no number); outside, the structure is transformers' own,
    with the number, so a torch.export of the user's elsewhere in the process is unchanged. A length that is not
    the keys' (past the window) is a leaf of its own inside (a caches.Length), read back as a plain int, and the
    layer object is left holding its own int. An exported program's module is never tied: its forward checks the
    structure it was exported with."""
    import torch.utils._pytree as pytree
    from autofuse import caches

    model = _model("mistral", sliding_window=4, layers=1)
    assert caches.prepare(model)                       # registers the cache's pytree node, as capture does
    cache = model(torch.randint(1, 128, (1, 3))).past_key_values
    layer = cache.layers[0]
    assert layer.cumulative_length == layer.keys.shape[-2] == 3

    def spec_text(c):
        return str(pytree.tree_flatten(c)[1])

    assert "'cumulative_length': 3" in spec_text(cache)
    with caches.lengths_tied(model):
        leaves, spec = pytree.tree_flatten(cache)
        assert "'cumulative_length': 3" not in str(spec) and "autofuse.length" in str(spec)
    again = pytree.tree_unflatten(leaves, spec)       # read back outside: the mark holds wherever it is
    assert type(again.layers[0].cumulative_length) is int and again.layers[0].cumulative_length == 3
    assert again.layers[0].keys is layer.keys

    model(torch.randint(1, 128, (1, 2)), cache=cache)     # 5 tokens: the window (4) keeps 3 keys
    assert (layer.cumulative_length, layer.keys.shape[-2]) == (5, 3)
    with caches.lengths_tied(model):
        leaves, spec = pytree.tree_flatten(cache)
    assert "'cumulative_length': 5" not in str(spec) and type(leaves[-1]) is caches.Length and leaves[-1] == 5
    assert type(layer.cumulative_length) is int and layer.cumulative_length == 5
    again = pytree.tree_unflatten(leaves, spec)
    assert type(again.layers[0].cumulative_length) is int and again.layers[0].cumulative_length == 5
    with caches.lengths_tied(torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),)).module()) as on:
        assert not on and "'cumulative_length': 5" in spec_text(cache)
