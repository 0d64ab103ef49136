"""Ready-made models for the CLI, the benchmarks and the tests: transformers architectures built from
configs with random weights (no download), and a plain ``nn.MultiheadAttention`` block.

``build(name, ...) -> (model, (args, kwargs))``. With ``meta=True`` the model and its inputs live on the
meta device: nothing is allocated, so a GPT-2-small or larger configuration can be planned on any machine.
"""
from __future__ import annotations

import importlib.util
import runpy

import torch

ZOO = {
    "gpt2": "GPT-2 (transformers GPT2LMHeadModel); causal attention with a combined causal/padding mask",
    "llama": "Llama (transformers LlamaForCausalLM); RoPE, RMSNorm, SwiGLU, grouped-query attention",
    "qwen2": "Qwen2 (transformers Qwen2ForCausalLM); like Llama with biased q/k/v projections",
    "bert": "BERT (transformers BertModel); bidirectional attention with a padding mask",
    "mha": "torch.nn.MultiheadAttention self-attention block with a causal mask",
}


def _transformers_model(name, layers, hidden, heads, kv_heads, seq, vocab, attn):
    try:
        import transformers as tf
    except ImportError as e:
        raise RuntimeError(f"model {name!r} needs the transformers package: pip install transformers==5.24.0") from e
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
          meta=False, attn="eager"):
    """``(model, (args, kwargs))`` for a zoo name, or a ``file.py:function`` / ``module:function`` spec whose
    function returns ``(model, example_inputs)``."""
    if ":" in name:
        return _from_spec(name)
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(ZOO)} or give 'file.py:function'")
    ctx = torch.device("meta") if meta else torch.device("cpu")
    with ctx:
        if name == "mha":
            model = MHABlock(hidden, heads)
        else:
            model = _transformers_model(name, layers, hidden, heads, kv_heads, seq, vocab, attn)
    model = model.to(dtype).eval()
    if name == "mha":
        x = torch.randn(batch, seq, hidden, dtype=dtype, device=ctx)
        return model, ((x,), {})
    ids = torch.randint(1, vocab, (batch, seq), device=ctx) if not meta else torch.empty(
        (batch, seq), dtype=torch.long, device="meta")
    kwargs = {"use_cache": False} if name != "bert" else {}
    return model, ((ids,), kwargs)


def _from_spec(spec: str):
    path, _, fn = spec.rpartition(":")
    if path.endswith(".py"):
        ns = runpy.run_path(path)
        if fn not in ns:
            raise ValueError(f"{path} has no function {fn!r}")
        built = ns[fn]()
    else:
        if importlib.util.find_spec(path) is None:
            raise ValueError(f"cannot import module {path!r} for model spec {spec!r}")
        built = getattr(importlib.import_module(path), fn)()
    model, inputs = built
    from autofuse.engine import _normalise_inputs
    return model, _normalise_inputs(inputs)
