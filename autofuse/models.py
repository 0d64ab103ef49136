"""Ready-made models for the CLI, the benchmarks and the tests, and the ``--model`` spec parser.

``build(spec, ...) -> (model, (args, kwargs))``. A spec is one of

* a zoo name (:data:`ZOO`): transformers architectures built from small configs with random weights (no
  download), and a plain ``nn.MultiheadAttention`` block; ``layers``/``hidden``/``heads`` size them;
* ``transformers:ConfigClass?key=value&...``: any transformers configuration class by name, with keyword
  overrides (values read as int, float, bool, None, a ``[list,of,them]`` or string), e.g.
  ``transformers:LlamaConfig?num_hidden_layers=2&hidden_size=256``. Without keys the class's own defaults
  apply (``LlamaConfig`` is Llama-7B). The model class is chosen from the configuration (see
  :func:`auto_class`); ``use_cache`` is off; ``seq``/``batch`` shape the example inputs;
* ``path/to/file.py:function`` or ``package.module:function``: the function returns ``(model,
  example_inputs)``.

With ``meta=True`` the model and its inputs live on the meta device: nothing is allocated, so a 7B
configuration can be planned on any machine. A wrong spec raises :class:`ModelSpecError` naming the fix.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import json
import os
import runpy
from urllib.parse import parse_qsl

import torch

ZOO = {
    "gpt2": "GPT-2 (transformers GPT2LMHeadModel); causal attention with a combined causal/padding mask",
    "llama": "Llama (transformers LlamaForCausalLM); RoPE, RMSNorm, SwiGLU, grouped-query attention",
    "qwen2": "Qwen2 (transformers Qwen2ForCausalLM); like Llama with biased q/k/v projections",
    "mixtral": "Mixtral (transformers MixtralForCausalLM); Llama's attention with a sparse MoE: a top-2 router over "
               "8 SwiGLU experts (intermediate 3.5 x hidden, as Mixtral-8x7B)",
    "bert": "BERT (transformers BertModel); bidirectional attention with a padding mask",
    "mha": "torch.nn.MultiheadAttention self-attention block with a causal mask",
}
TRANSFORMERS_PREFIX = "transformers:"


class ModelSpecError(ValueError):
    """The ``--model`` spec cannot be turned into a model: the message names the part and the fix."""


def did_you_mean(word, choices) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``word`` (difflib's ratio of at least 0.6), else ``""``."""
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ModelSpecError("transformers models need the transformers package: pip install transformers==5.24.0 "
                             "(or pip install -e '.[models]')") from e
    return transformers


def _zoo_model(name, layers, hidden, heads, kv_heads, seq, vocab, attn):
    tf = _transformers()
    common = dict(vocab_size=vocab)
    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=max(seq, 16), bos_token_id=0,
                            eos_token_id=0, **common)
        cls = tf.GPT2LMHeadModel
    elif name in ("llama", "qwen2"):
        cfg_cls, cls = ((tf.LlamaConfig, tf.LlamaForCausalLM) if name == "llama"
                        else (tf.Qwen2Config, tf.Qwen2ForCausalLM))
        cfg = cfg_cls(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_attention_heads=heads, num_key_value_heads=kv_heads or max(1, heads // 2),
                      max_position_embeddings=max(seq, 16), bos_token_id=0, eos_token_id=0, pad_token_id=0, **common)
    elif name == "mixtral":
        cfg = tf.MixtralConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                               num_attention_heads=heads, num_key_value_heads=kv_heads or max(1, heads // 2),
                               num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=max(seq, 16),
                               bos_token_id=0, eos_token_id=0, pad_token_id=0, **common)
        cls = tf.MixtralForCausalLM
    elif name == "bert":
        cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            intermediate_size=4 * hidden, max_position_embeddings=max(seq, 16), **common)
        cls = tf.BertModel
    else:
        raise KeyError(name)
    cfg._attn_implementation = attn
    return cls(cfg)


class MHABlock(torch.nn.Module):
    """Self-attention through ``nn.MultiheadAttention`` with a causal float mask."""

    def __init__(self, dim, heads):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x):
        s = x.shape[1]
        mask = torch.full((s, s), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


def build(name: str, layers=2, hidden=64, heads=4, kv_heads=None, seq=16, batch=2, vocab=128, dtype=torch.float32,
          meta=False, attn="eager", past=0):
    """``(model, (args, kwargs))`` for a spec (see the module docstring). ``layers``, ``hidden``, ``heads``,
    ``kv_heads`` and ``vocab`` size zoo models only; a ``transformers:`` spec carries its sizes as keys.
    ``past`` > 0: a decode step of a causal LM, ``seq`` new tokens per sequence after a KV cache of ``past``
    tokens (:func:`decode_step`)."""
    if past and ":" in name and not name.startswith(TRANSFORMERS_PREFIX):
        raise ModelSpecError(f"a KV cache (past={past}) applies to zoo and transformers models; {name} builds its "
                             f"own inputs")
    if name.startswith(TRANSFORMERS_PREFIX):
        return build_transformers(name, seq=seq, batch=batch, dtype=dtype, meta=meta, attn=attn, past=past)
    if ":" in name:
        return _from_spec(name)
    if name == "tp-block":
        raise ModelSpecError("tp-block is split over ranks (tensor parallel): simulate it with --world-size N, N "
                             "of 2 or more (gloo processes on this machine), with the command simulate")
    if name not in ZOO:
        raise ModelSpecError(f"unknown model {name!r}{did_you_mean(name, ZOO)}: choose one of {', '.join(ZOO)}, "
                             f"'transformers:ConfigClass?key=value', 'file.py:function' or 'module:function'")
    ctx = torch.device("meta") if meta else torch.device("cpu")
    with ctx:
        if name == "mha":
            model = MHABlock(hidden, heads)
        else:
            model = _zoo_model(name, layers, hidden, heads, kv_heads, seq + past, vocab, attn)
    model = model.to(dtype).eval()
    if name == "mha":
        if past:
            raise ModelSpecError(f"a KV cache (past={past}) needs a causal language model; mha is one attention "
                                 f"block without a cache")
        x = torch.randn(batch, seq, hidden, dtype=dtype, device=ctx)
        return model, ((x,), {})
    ids = torch.randint(1, vocab, (batch, seq), device=ctx) if not meta else torch.empty(
        (batch, seq), dtype=torch.long, device="meta")
    kwargs = {"use_cache": False} if name != "bert" else {}
    if past:
        return model, decode_step(model, (ids,), kwargs, past)
    return model, ((ids,), kwargs)


# ------------------------------------------------------------------------------ transformers:ConfigClass?k=v

def parse_value(text: str):
    """A query-string value as Python: ``2`` -> int, ``1e-5`` -> float, ``true``/``False`` -> bool,
    ``None``/``null`` -> None, ``[2,2,6]`` -> a list of such values (Swin's ``depths``, ConvNeXt's
    ``hidden_sizes``; ``[full_attention,sliding_attention]`` a list of strings), JSON (``["a","b"]``,
    ``{"moe_num_experts":4}`` for a nested config), ``"text"`` -> text, anything else stays a string."""
    text = text.strip()
    if len(text) >= 2 and (text[0], text[-1]) in (("[", "]"), ("{", "}"), ('"', '"')):
        try:
            return json.loads(text)
        except ValueError:
            pass
    if len(text) >= 2 and text[0] == "[" and text[-1] == "]":
        inner = text[1:-1].strip()
        return [parse_value(t) for t in inner.split(",")] if inner else []
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_transformers_spec(spec: str) -> tuple[str, dict]:
    """``"transformers:LlamaConfig?num_hidden_layers=2"`` -> ``("LlamaConfig", {"num_hidden_layers": 2})``."""
    body = spec[len(TRANSFORMERS_PREFIX):]
    name, _, query = body.partition("?")
    if not name:
        raise ModelSpecError(f"model spec {spec!r} names no configuration class: write e.g. "
                             f"'transformers:LlamaConfig?num_hidden_layers=2'")
    keys = {}
    for item in filter(None, query.split("&")):
        if "=" not in item:
            raise ModelSpecError(f"model spec {spec!r}: {item!r} has no value; write key=value pairs joined by '&'")
    for key, value in parse_qsl(query, keep_blank_values=True):
        keys[key] = parse_value(value)
    return name, keys


def config_keys(cfg_cls) -> set:
    """The keys a configuration class understands: its defaults, its constructor's parameters and aliases."""
    try:
        keys = set(cfg_cls().to_dict())
    except Exception:  # noqa: BLE001 - a class whose defaults do not construct: its signature still lists keys
        keys = set()
    keys |= {p for p in inspect.signature(cfg_cls.__init__).parameters if p not in ("self", "kwargs")}
    keys |= set(getattr(cfg_cls, "attribute_map", {}) or {})
    return keys | GENERAL_KEYS


#: Keys every configuration takes as its own although a class may not list them (transformers keeps an unlisted
#: keyword as an attribute): the special token ids ``generate`` reads (T5's configuration has no
#: ``decoder_start_token_id``, which its ``generate`` needs)
GENERAL_KEYS = {"bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id"}


def make_config(spec: str):
    """The configuration object a ``transformers:`` spec describes (unknown classes and keys are errors)."""
    tf = _transformers()
    name, keys = parse_transformers_spec(spec)
    cfg_cls = getattr(tf, name, None) if name.endswith("Config") else None
    if cfg_cls is None or not (inspect.isclass(cfg_cls) and issubclass(cfg_cls, tf.PretrainedConfig)):
        known = [n for n in dir(tf) if n.endswith("Config") and n[0].isupper()]
        raise ModelSpecError(f"transformers has no configuration class {name!r}{did_you_mean(name, known)} "
                             f"(any *Config class of transformers works, e.g. LlamaConfig, GPT2Config, BertConfig)")
    allowed = config_keys(cfg_cls)
    for key in keys:
        if key not in allowed:
            hint = did_you_mean(key, allowed) or f" (its keys: {', '.join(sorted(k for k in allowed if k[0] != '_'))})"
            raise ModelSpecError(f"{name} has no key {key!r}{hint}")
    try:
        cfg = cfg_cls(**keys)
    except Exception as e:  # noqa: BLE001 - transformers' validators raise their own error types too
        raise ModelSpecError(f"{name}({', '.join(f'{k}={v!r}' for k, v in keys.items())}) is not a valid "
                             f"configuration: {type(e).__name__}: {e}") from None
    cfg.use_cache = False
    return cfg


def auto_class(cfg):
    """The transformers Auto class for a configuration: encoder-decoders get their sequence-to-sequence LM (a
    speech encoder-decoder such as Whisper its speech-to-text model), encoders (configurations with a masked-LM
    head that are not decoders, such as BERT) their base model, decoders their causal LM, anything else (vision,
    audio encoders) its base model."""
    tf = _transformers()
    from transformers.models.auto import modeling_auto as ma
    cls = type(cfg)
    if getattr(cfg, "is_encoder_decoder", False) and cls in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING:
        return tf.AutoModelForSeq2SeqLM
    if getattr(cfg, "is_encoder_decoder", False) and cls in ma.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING:
        return tf.AutoModelForSpeechSeq2Seq     # Whisper: its causal-LM class would be the decoder alone
    if cls in ma.MODEL_FOR_MASKED_LM_MAPPING and not getattr(cfg, "is_decoder", False):
        return tf.AutoModel
    if cls in ma.MODEL_FOR_CAUSAL_LM_MAPPING:
        return tf.AutoModelForCausalLM
    if cls in ma.MODEL_MAPPING:
        return tf.AutoModel
    raise ModelSpecError(f"transformers has no model class for {cls.__name__}: give 'file.py:function' that "
                         f"builds the model")


def example_inputs(model, cfg, seq, batch, dtype, device):
    """Example inputs for ``model.main_input_name`` (token ids, pixel values or audio features) plus
    ``decoder_input_ids`` for encoder-decoders and ``use_cache=False`` where the forward takes it."""
    main = getattr(model, "main_input_name", "input_ids")
    vocab = getattr(cfg, "vocab_size", None) or 128
    meta = device == torch.device("meta")

    def ids():
        if meta:
            return torch.empty((batch, seq), dtype=torch.long, device=device)
        return torch.randint(1, max(vocab, 2), (batch, seq), device=device)

    def pixels(c):
        size = getattr(c, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        return torch.randn(batch, getattr(c, "num_channels", 3), size, size, dtype=dtype, device=device)

    params = inspect.signature(model.forward).parameters
    if main == "input_ids":
        kwargs = {"input_ids": ids()}
        if "pixel_values" in params and getattr(cfg, "vision_config", None) is not None and \
                getattr(cfg, "text_config", None) is not None and \
                not any(getattr(cfg, k, None) is not None for k in ("image_token_id", "image_token_index")):
            # a two-tower model (CLIP, SigLIP) takes both; a model whose images stand in for image tokens of the
            # text (LLaVA) needs those tokens in input_ids too, which the CLI does not make up: text alone there
            kwargs["pixel_values"] = pixels(cfg.vision_config)
    elif main == "pixel_values":
        kwargs = {"pixel_values": pixels(cfg)}
    elif main == "input_features":
        frames = 2 * getattr(cfg, "max_source_positions", seq)
        kwargs = {"input_features": torch.randn(batch, cfg.num_mel_bins, frames, dtype=dtype, device=device)}
    else:
        raise ModelSpecError(f"{type(model).__name__} takes {main!r} as its main input, which the CLI cannot "
                             f"make up: give 'file.py:function' returning the model and its inputs")
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        kwargs["decoder_input_ids"] = ids()
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return (), kwargs


def build_transformers(spec: str, seq=16, batch=2, dtype=torch.float32, meta=False, attn="eager", past=0):
    """``(model, (args, kwargs))`` for a ``transformers:ConfigClass?key=value`` spec (``past``: see :func:`build`)."""
    cfg = make_config(spec)
    device = torch.device("meta") if meta else torch.device("cpu")
    auto = auto_class(cfg)
    with device:
        try:
            model = auto.from_config(cfg, attn_implementation=attn)
        except ValueError as e:                 # e.g. an architecture without an sdpa implementation
            raise ModelSpecError(f"{type(cfg).__name__} with attention {attn!r}: {e}") from None
    model = model.to(dtype).eval()
    inputs = example_inputs(model, cfg, seq, batch, dtype, device)
    return model, (decode_step(model, *inputs, past) if past else inputs)


def decode_step(model, args, kwargs, past: int):
    """The example inputs of a decode step: ``kwargs``' new tokens (``input_ids``, or the first argument) after a KV
    cache of ``past`` tokens (:func:`kv_cache`), with ``use_cache`` on."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None or not _is_causal_lm(model):
        raise ModelSpecError(f"a KV cache (past={past}) needs a causal language model taking input_ids; "
                             f"{type(model).__name__} is not one")
    return args, {**kwargs, "use_cache": True, "cache": kv_cache(model, ids.shape[0], past)}


def _is_causal_lm(model) -> bool:
    """A transformers model that generates text token by token, without an encoder (GenerationMixin's own test)."""
    can = getattr(model, "can_generate", None)
    return callable(can) and can() and not getattr(model.config, "is_encoder_decoder", False)


def kv_cache(model, batch: int, past: int):
    """A KV cache of ``past`` tokens for ``model``, a transformers causal LM: the model's own cache class and
    layers (sliding windows included), filled through the cache's ``update`` as a prefill of ``past`` tokens fills
    it, with random keys and values (empty ones on the meta device). The keys' and values' sizes per layer are
    read from the cache of a one-token forward of the model."""
    tf = _transformers()
    device = next(model.parameters()).device
    with torch.no_grad():
        probe = model(torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True)
    got = getattr(probe, "cache", None)
    if type(got) is not tf.DynamicCache:
        raise ModelSpecError(f"{type(model).__name__} keeps its keys and values in {type(got).__name__}, not a "
                             f"DynamicCache: build the decode step's inputs yourself (file.py:function)")
    cache = tf.DynamicCache(config=model.config)
    make = torch.empty if device.type == "meta" else torch.randn
    for i, layer in enumerate(got.layers):
        k, v = layer.keys, layer.values
        cache.update(make((batch, k.shape[1], past, k.shape[3]), dtype=k.dtype, device=device),
                     make((batch, v.shape[1], past, v.shape[3]), dtype=v.dtype, device=device), i)
    return cache


# ------------------------------------------------------------------------------ file.py:function, module:function

def _from_spec(spec: str):
    path, _, fn = spec.rpartition(":")
    if not path or not fn:
        raise ModelSpecError(f"model spec {spec!r}: write 'path/to/file.py:function' or 'package.module:function'")
    if path.endswith(".py") or os.sep in path or "/" in path:
        if not os.path.isfile(path):
            raise ModelSpecError(f"model file {path!r} does not exist (spec {spec!r}): give the path of a .py file")
        ns = runpy.run_path(path)
        where = path
    else:
        try:
            found = importlib.util.find_spec(path)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ModelSpecError(f"cannot import module {path!r} (spec {spec!r}): put it on PYTHONPATH or give "
                                 f"'path/to/file.py:{fn}'")
        ns = vars(importlib.import_module(path))
        where = f"module {path}"
    if not callable(ns.get(fn)):
        funcs = [k for k, v in ns.items() if inspect.isfunction(v) and not k.startswith("_")
                 and v.__module__ == ns.get("__name__")]
        raise ModelSpecError(f"{where} has no function {fn!r}{did_you_mean(fn, funcs)} "
                             f"(functions defined there: {', '.join(funcs) or 'none'})")
    try:
        inspect.signature(ns[fn]).bind()
    except TypeError:
        raise ModelSpecError(f"{where}:{fn} must be callable without arguments and return (model, example_inputs)") \
            from None
    except ValueError:          # no signature (a builtin): call it and see
        pass
    built = ns[fn]()
    if not (isinstance(built, (tuple, list)) and len(built) == 2 and isinstance(built[0], torch.nn.Module)):
        if isinstance(built, (tuple, list)):
            got = f"a {type(built).__name__} of {len(built)} item(s): " + ", ".join(type(b).__name__ for b in built[:4])
        else:
            got = type(built).__name__
        raise ModelSpecError(f"{where}:{fn}() must return (model, example_inputs) with model an nn.Module; it "
                             f"returned {got}")
    model, inputs = built
    from autofuse.engine import _normalise_inputs
    try:
        return model, _normalise_inputs(inputs)
    except TypeError as e:
        raise ModelSpecError(f"{where}:{fn}() returned example inputs autofuse cannot use: {e}") from None
