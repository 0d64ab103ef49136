"""Real architectures from transformers configs (tiny sizes, random weights, no download), each through
``AutoFusionEngine.fuse``: what was fused, by name, the fused model's largest difference from eager, and the
predicted speed-up of the whole graph against eager op by op and against generic fusion alone (ascend910).

    python benchmarks/architectures.py [--only NAME ...] [--device ascend910] [--dtype bfloat16]
    python benchmarks/architectures.py --train [--only NAME ...]    # gradients of every parameter against eager's
    python benchmarks/architectures.py --train --checkpointing      # activation checkpointing on: gradients, memory
    python benchmarks/architectures.py --generate [--only NAME ...] # KV caches: fused(ids) and generate() vs eager
    python benchmarks/architectures.py --generate --static --new-tokens 5  # generate() with a static cache
    python benchmarks/architectures.py --disable attention          # the rest fused around torch's own attention
    python benchmarks/architectures.py --train --dtype bfloat16     # 16 bits: fused and eager each from float64
    python benchmarks/architectures.py --generate --dtype float16   # tokens, and a near tie told from a failure
    python benchmarks/architectures.py --more [...]                 # further architectures, any mode above
    python benchmarks/architectures.py --batch 1 --seq 13 [...]     # other inputs than 16 tokens at batch 2
    python benchmarks/architectures.py --compile [--only NAME ...]  # through torch.compile(backend="autofuse")
    python benchmarks/architectures.py --compile --train            # a training step through torch.compile
    python benchmarks/architectures.py --compile --generate [--static]  # generate() with a compiled forward

Every row is one model built, captured, planned, verified and run here; a model that fails prints its error
in its row (nothing is skipped silently). Sizes are small (2 layers, hidden 64, 16 tokens): the point is
coverage of the spellings, not speed figures (see ``model_speedup.py`` and ``scale.py`` for those).

``--compile``: each row through ``torch.compile(model, backend="autofuse")`` instead, called at 16 tokens and then
at 12 and 20 (Dynamo compiles a graph with a symbolic sequence length at the second size; the backend plans it per
size): the largest difference from eager over the three calls, the graphs Dynamo handed over and the plans made,
and the blocks the first call fused by name against those ``fuse()`` fuses on the same model (a row whose blocks
differ says so; a graph break, such as JetMoe's data-dependent expert sizes, makes them differ). With ``--train``:
the training step below, through ``torch.compile`` (its fused blocks: those of every graph Dynamo handed over at
the first call), at 16 tokens and then at 12 and 20 (the text rows), the worst of the three. With ``--generate``:
the generative rows with ``model.forward`` compiled and the model's own ``generate()`` (Dynamo makes the decode
steps' graph dynamic at the second step; the backend plans it per cache length, or once with ``--static``).

``--train`` and ``--generate`` compare with eager in fp32 directly. With a 16-bit ``--dtype`` both sides round far
more and may differ by it, so each row also runs a float64 reference (the same weights widened exactly, the same
inputs, eager) and measures eager's error and the fused model's from it: a row passes where the fused error is at
most twice eager's (the verifier's rule). ``--train``: the output's error relative to its largest float64 value,
and each gradient's relative to its own largest (at least 1e-3 of the model's largest), the worst over the
gradients on each side; dropout and drop paths off, checked by two float64 forwards under other seeds.
``--train --checkpointing``: with transformers' activation checkpointing on (non-reentrant), the same gradients, and
what each forward keeps alive for the backward (the storages its ops made that are alive when it returns, but the
output's): the fused model's, eager's with checkpointing, and eager's without; a row whose fused model keeps more
than eager's checkpointed forward is counted.
``--generate``: the logits of ``fused(ids)``; where the generated tokens differ from eager's, the first differing
step is a tie (not a failure) when the float64 logits of the two tokens picked are closer than eager's own error
there.
"""
from __future__ import annotations

import argparse
import collections
import gc
import logging
import time
import traceback
import warnings

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

L = "num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4&vocab_size=128&pad_token_id=0"
KV = L + "&num_key_value_heads=2"
MOE = "&num_local_experts=8&num_experts_per_tok=2"

#: (row name, transformers spec, attention implementation)
MODELS = [
    ("llama", f"LlamaConfig?{KV}", "sdpa"),
    ("mistral", f"MistralConfig?{KV}", "sdpa"),
    ("qwen2", f"Qwen2Config?{KV}", "sdpa"),
    ("qwen3", f"Qwen3Config?{KV}&head_dim=16", "sdpa"),
    ("gemma", f"GemmaConfig?{KV}&head_dim=16", "sdpa"),
    ("gemma2 (soft-capping)", f"Gemma2Config?{KV}&head_dim=16", "eager"),
    ("gemma3", f"Gemma3TextConfig?{KV}&head_dim=16", "sdpa"),
    ("phi", f"PhiConfig?{L}", "sdpa"),
    ("phi3", f"Phi3Config?{L}&num_key_value_heads=4", "sdpa"),
    ("olmo2", f"Olmo2Config?{KV}", "sdpa"),
    ("cohere", f"CohereConfig?{KV}", "sdpa"),
    ("granite", f"GraniteConfig?{KV}", "sdpa"),
    ("glm", f"GlmConfig?{KV}&head_dim=16", "sdpa"),
    ("stablelm", f"StableLmConfig?{L}&num_key_value_heads=4", "sdpa"),
    ("starcoder2", f"Starcoder2Config?{KV}", "sdpa"),
    ("persimmon", f"PersimmonConfig?{L}", "eager"),
    ("gpt2", "GPT2Config?n_layer=2&n_embd=64&n_head=4&vocab_size=128", "eager"),
    ("gpt_neox", f"GPTNeoXConfig?{L}", "sdpa"),
    ("gptj (interleaved RoPE)", "GPTJConfig?n_layer=2&n_embd=64&n_head=4&vocab_size=128&rotary_dim=8", "eager"),
    ("codegen", "CodeGenConfig?n_layer=2&n_embd=64&n_head=4&vocab_size=128&rotary_dim=8", "eager"),
    ("falcon (multi-query)", "FalconConfig?num_hidden_layers=2&hidden_size=64&num_attention_heads=4&vocab_size=128",
     "eager"),
    ("falcon (ALiBi)", "FalconConfig?num_hidden_layers=2&hidden_size=64&num_attention_heads=4&vocab_size=128"
     "&alibi=True", "eager"),
    ("bloom (ALiBi)", "BloomConfig?n_layer=2&hidden_size=64&n_head=4&vocab_size=128", "eager"),
    ("mpt (ALiBi)", "MptConfig?n_layers=2&d_model=64&n_heads=4&vocab_size=128", "eager"),
    ("llama4 text (complex RoPE)", f"Llama4TextConfig?{KV}&head_dim=16&num_local_experts=4&num_experts_per_tok=1"
     "&intermediate_size_mlp=128", "sdpa"),
    ("exaone4", f"Exaone4Config?{KV}", "sdpa"),
    ("helium", f"HeliumConfig?{KV}&head_dim=16", "sdpa"),
    ("smollm3", f"SmolLM3Config?{KV}", "sdpa"),
    ("nemotron", f"NemotronConfig?{KV}", "sdpa"),
    ("arcee", f"ArceeConfig?{KV}", "sdpa"),
    ("glm4", f"Glm4Config?{KV}&head_dim=16", "sdpa"),
    ("cohere2", f"Cohere2Config?{KV}", "sdpa"),
    ("olmo3", f"Olmo3Config?{KV}", "sdpa"),
    ("apertus", f"ApertusConfig?{KV}", "sdpa"),
    ("seed_oss", f"SeedOssConfig?{KV}&head_dim=16", "sdpa"),
    ("ernie4_5", f"Ernie4_5Config?{KV}&head_dim=16", "sdpa"),
    ("hunyuan_v1_dense", f"HunYuanDenseV1Config?{KV}&head_dim=16", "sdpa"),
    ("bitnet", f"BitNetConfig?{KV}", "sdpa"),
    ("mixtral", f"MixtralConfig?{KV}{MOE}", "sdpa"),
    ("qwen2_moe", f"Qwen2MoeConfig?{KV}&num_experts=8&num_experts_per_tok=2&moe_intermediate_size=32"
     "&shared_expert_intermediate_size=64", "sdpa"),
    ("dots1", f"Dots1Config?{KV}&n_routed_experts=8&num_experts_per_tok=2&moe_intermediate_size=32"
     "&first_k_dense_replace=1&n_group=1&topk_group=1&n_shared_experts=1", "sdpa"),
    ("glm4_moe", f"Glm4MoeConfig?{KV}&n_routed_experts=8&num_experts_per_tok=2&moe_intermediate_size=32"
     "&first_k_dense_replace=1&n_shared_experts=1", "sdpa"),
    ("ernie4_5_moe", f"Ernie4_5_MoeConfig?{KV}&moe_num_experts=8&moe_k=2&moe_intermediate_size=32", "sdpa"),
    ("hunyuan_moe", f"HunYuanMoEV1Config?{KV}&num_experts=8&moe_topk=2&head_dim=16", "sdpa"),
    ("flex_olmo", f"FlexOlmoConfig?{KV}&num_experts=8&num_experts_per_tok=2", "sdpa"),
    ("minimax (linear attention)", f"MiniMaxConfig?{KV}{MOE}&head_dim=16"
     "&layer_types=[full_attention,linear_attention]", "sdpa"),
    ("qwen3_next (gated deltanet)", f"Qwen3NextConfig?{KV}&num_experts=8&num_experts_per_tok=2"
     "&moe_intermediate_size=32&shared_expert_intermediate_size=32&layer_types=[linear_attention,full_attention]"
     "&head_dim=16&linear_num_value_heads=4&linear_num_key_heads=2&linear_key_head_dim=16&linear_value_head_dim=16",
     "sdpa"),
    ("lfm2 (short convolutions)", f"Lfm2Config?{KV}&layer_types=[conv,full_attention]", "sdpa"),
    ("jetmoe (data-dependent experts)", "JetMoeConfig?num_hidden_layers=2&hidden_size=64&num_key_value_heads=2"
     "&kv_channels=16&intermediate_size=128&num_local_experts=4&num_experts_per_tok=2&vocab_size=128", "eager"),
    ("qwen3_moe", f"Qwen3MoeConfig?{KV}&num_experts=8&num_experts_per_tok=2&moe_intermediate_size=32", "sdpa"),
    ("olmoe", f"OlmoeConfig?{KV}&num_experts=8&num_experts_per_tok=2", "sdpa"),
    ("granitemoe (top-k first)", f"GraniteMoeConfig?{KV}{MOE}", "sdpa"),
    ("gpt_oss (top-k first)", f"GptOssConfig?{KV}{MOE}&head_dim=16", "eager"),
    ("vaultgemma", f"VaultGemmaConfig?{KV}&head_dim=16&sliding_window=8"
     "&layer_types=[sliding_attention,full_attention]", "eager"),
    ("gemma3n", f"Gemma3nTextConfig?{KV}&head_dim=16&sliding_window=8&layer_types=[sliding_attention,full_attention]"
     "&num_kv_shared_layers=0&laurel_rank=8&altup_num_inputs=2&hidden_size_per_layer_input=16"
     "&intermediate_size=[128,128]&activation_sparsity_pattern=[0.0,0.0]", "eager"),
    ("deepseek_v3 (latent attention)", f"DeepseekV3Config?{L}&num_key_value_heads=4&kv_lora_rank=32&q_lora_rank=48"
     "&qk_rope_head_dim=8&qk_nope_head_dim=16&v_head_dim=16&n_routed_experts=8&num_experts_per_tok=2&n_group=2"
     "&topk_group=1&first_k_dense_replace=1&moe_intermediate_size=32&n_shared_experts=1", "sdpa"),
    ("opt", "OPTConfig?num_hidden_layers=2&hidden_size=64&ffn_dim=128&num_attention_heads=4&vocab_size=128"
     "&word_embed_proj_dim=64&max_position_embeddings=64&pad_token_id=0", "sdpa"),
    ("t5 (relative position bias)", "T5Config?num_layers=2&num_decoder_layers=2&d_model=64&d_ff=128&num_heads=4"
     "&d_kv=16&vocab_size=128&decoder_start_token_id=0", "eager"),
    ("bart", "BartConfig?encoder_layers=2&decoder_layers=2&d_model=64&encoder_ffn_dim=128&decoder_ffn_dim=128"
     "&encoder_attention_heads=4&decoder_attention_heads=4&vocab_size=128&max_position_embeddings=64", "sdpa"),
    ("whisper (conv front-end)", "WhisperConfig?encoder_layers=2&decoder_layers=2&d_model=64&encoder_ffn_dim=128"
     "&decoder_ffn_dim=128&encoder_attention_heads=4&decoder_attention_heads=4&vocab_size=128&num_mel_bins=16"
     "&max_source_positions=16&max_target_positions=32&pad_token_id=0&bos_token_id=1&eos_token_id=2"
     "&decoder_start_token_id=3", "sdpa"),
    ("clip text", "CLIPTextConfig?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
     "&vocab_size=128&max_position_embeddings=32&pad_token_id=0&bos_token_id=1&eos_token_id=2", "sdpa"),
    ("bert", f"BertConfig?{L}", "sdpa"),
    ("modernbert (local attention)", "ModernBertConfig?num_hidden_layers=2&hidden_size=64&intermediate_size=128"
     "&num_attention_heads=4&vocab_size=128&pad_token_id=0&local_attention=8"
     "&layer_types=[full_attention,sliding_attention]&rope_parameters={\"full_attention\":{\"rope_type\":"
     "\"default\",\"rope_theta\":160000.0},\"sliding_attention\":{\"rope_type\":\"default\","
     "\"rope_theta\":10000.0}}", "sdpa"),
    ("roberta", f"RobertaConfig?{L}", "sdpa"),
    ("deberta_v2", f"DebertaV2Config?{L}", "eager"),
    ("electra", f"ElectraConfig?{L}&embedding_size=64", "sdpa"),
    ("swin", "SwinConfig?depths=[2,2]&num_heads=[2,4]&embed_dim=32&image_size=32&patch_size=4&window_size=4",
     "eager"),
    ("swinv2 (cosine attention)", "Swinv2Config?depths=[2,2]&num_heads=[2,4]&embed_dim=32&image_size=32&patch_size=4"
     "&window_size=4", "eager"),
    ("beit", "BeitConfig?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
     "&image_size=32&patch_size=8", "eager"),
    ("vit", "ViTConfig?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4&image_size=32"
     "&patch_size=8", "sdpa"),
    ("siglip vision", "SiglipVisionConfig?num_hidden_layers=2&hidden_size=64&intermediate_size=128"
     "&num_attention_heads=4&image_size=32&patch_size=8", "eager"),
    ("resnet (BatchNorm)", "ResNetConfig?embedding_size=16&hidden_sizes=[16,32]&depths=[1,1]&layer_type=basic",
     "eager"),
]


T5S = "num_layers=2&num_decoder_layers=2&d_model=64&d_ff=128&num_heads=4&vocab_size=128&d_kv=16"
E2 = ("encoder_layers=2&decoder_layers=2&d_model=64&encoder_ffn_dim=128&decoder_ffn_dim=128&encoder_attention_heads=4"
      "&decoder_attention_heads=4&vocab_size=128&pad_token_id=0")

#: ``--more``: further architectures, run by their own command (the README says which modes were run over them)
MORE = [
    ("zamba2 (adapter on gate_up)", f"Zamba2Config?{KV}&layers_block_type=[mamba,hybrid]&mamba_d_state=16"
     "&mamba_headdim=16", "sdpa"),
    ("bamba (mamba2 hybrid)", f"BambaConfig?{KV}&attn_layer_indices=[1]", "sdpa"),
    ("jamba (mamba hybrid, MoE)", f"JambaConfig?{KV}&num_experts=4&attn_layer_period=2&attn_layer_offset=1"
     "&expert_layer_period=2&expert_layer_offset=1", "sdpa"),
    ("falcon_h1 (parallel mamba2)", f"FalconH1Config?{KV}", "sdpa"),
    ("granitemoehybrid (mamba2 hybrid, MoE)", f"GraniteMoeHybridConfig?{KV}&layers_block_type=[mamba,attention]",
     "sdpa"),
    ("mamba", "MambaConfig?num_hidden_layers=2&hidden_size=64&vocab_size=128", "eager"),
    ("deepseek_v2 (latent attention)", f"DeepseekV2Config?{L}&num_key_value_heads=4&kv_lora_rank=32&q_lora_rank=48"
     "&qk_rope_head_dim=8&qk_nope_head_dim=16&v_head_dim=16&n_routed_experts=4&num_experts_per_tok=2"
     "&moe_intermediate_size=32&first_k_dense_replace=1", "sdpa"),
    ("granitemoeshared", f"GraniteMoeSharedConfig?{KV}&num_local_experts=4&num_experts_per_tok=2"
     "&shared_intermediate_size=64", "sdpa"),
    ("phimoe (sparsemixer router)", f"PhimoeConfig?{KV}&num_local_experts=4&num_experts_per_tok=2", "sdpa"),
    ("olmo", f"OlmoConfig?{KV}", "sdpa"),
    ("gpt_bigcode (multi-query)", "GPTBigCodeConfig?n_layer=2&n_embd=64&n_head=4&vocab_size=128", "sdpa"),
    ("biogpt", f"BioGptConfig?{L}", "sdpa"),
    ("mt5", f"MT5Config?{T5S}", "eager"),
    ("umt5", f"UMT5Config?{T5S}", "eager"),
    ("mbart", f"MBartConfig?{E2}", "sdpa"),
    ("marian", f"MarianConfig?{E2}&decoder_start_token_id=0", "sdpa"),
    ("pegasus", f"PegasusConfig?{E2}", "sdpa"),
    ("m2m_100", f"M2M100Config?{E2}", "sdpa"),
    ("distilbert", "DistilBertConfig?n_layers=2&dim=64&hidden_dim=128&n_heads=4&vocab_size=128", "sdpa"),
    ("albert", "AlbertConfig?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
     "&vocab_size=128&embedding_size=32", "sdpa"),
    ("mobilebert (NoNorm)", "MobileBertConfig?num_hidden_layers=2&vocab_size=128", "eager"),
    ("xlm_roberta", f"XLMRobertaConfig?{L}", "sdpa"),
    ("megatron_bert", f"MegatronBertConfig?{L}", "eager"),
    ("roformer (rotary)", f"RoFormerConfig?{L}&embedding_size=64", "eager"),
    ("esm (rotary)", f"EsmConfig?{L}&position_embedding_type=rotary&mask_token_id=1", "sdpa"),
    ("xlnet (relative attention)", "XLNetConfig?n_layer=2&d_model=64&n_head=4&d_inner=128&vocab_size=128", "eager"),
    ("deit", "DeiTConfig?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
     "&image_size=32&patch_size=8", "sdpa"),
    ("dinov2", "Dinov2Config?num_hidden_layers=2&hidden_size=64&mlp_ratio=2&num_attention_heads=4&image_size=32"
     "&patch_size=8", "sdpa"),
    ("convnext", "ConvNextConfig?depths=[1,1]&hidden_sizes=[16,32]&num_stages=2", "eager"),
    ("convnextv2", "ConvNextV2Config?depths=[1,1]&hidden_sizes=[16,32]&num_stages=2", "eager"),
]


def _main_output(out):
    for attr in ("logits", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr)
    return out[0] if isinstance(out, (tuple, list)) else out


def run(name, spec, attn, device, dtype=torch.float32, switches=None):
    from autofuse import AutoFusionEngine
    t0 = time.perf_counter()
    model, (args, kwargs) = _eval_model(spec, attn, dtype=dtype)
    with torch.no_grad():
        want = _main_output(model(*args, **kwargs))
    fused = AutoFusionEngine.fuse(model, (args, kwargs), target_device=device, fusion_switches=switches)
    with torch.no_grad():
        got = _main_output(fused(*args, **kwargs))
    err = (got.float() - want.float()).abs().max().item()
    r = fused.report
    names = collections.Counter(d.pattern for d in r.applied)
    failed = [d for d in r.decisions if d.reason_code == "verification_failed"]
    sp = r.speedups()            # the whole graph's predicted cycles against each baseline
    return dict(err=err, names=names, failed=len(failed), seconds=time.perf_counter() - t0,
                vs_eager=sp.get("eager op by op", float("nan")), vs_generic=sp.get("generic fusion alone", float("nan")))


def compiled(name, spec, attn, device, dtype=torch.float32, switches=None):
    """The row through ``torch.compile(backend=autofuse.backend(...))`` at 16, 12 and 20 tokens (see the module
    docstring): the largest difference from eager, the graphs and plans, the first call's blocks by name and
    ``fuse()``'s on the same model."""
    import autofuse
    from autofuse.backend import graphs
    fuse_names = run(name, spec, attn, device, dtype, switches)["names"]
    t0 = time.perf_counter()
    torch._dynamo.reset()
    model, _ = _eval_model(spec, attn, dtype=dtype)
    comp = torch.compile(model, backend=autofuse.backend(target_device=device, fusion_switches=switches))
    err, names = 0.0, None
    for seq in (16, 12, 20):
        args, kwargs = _eval_model(spec, attn, seq, dtype)[1]
        with torch.no_grad():
            want, got = _main_output(model(*args, **kwargs)), _main_output(comp(*args, **kwargs))
        err = max(err, (got.float() - want.float()).abs().max().item())
        if names is None:
            names = collections.Counter(d.pattern for r in autofuse.reports(comp) for d in r.applied)
    reports = autofuse.reports(comp)
    failed = sum(d.reason_code == "verification_failed" for r in reports for d in r.decisions)
    return dict(err=err, names=names, fuse_names=fuse_names, graphs=len(graphs(comp)),
                plans=len(reports), failed=failed, seconds=time.perf_counter() - t0)


#: The inputs' tokens and batch of the rows (the generation set-up has its own): ``--seq``, ``--batch``.
SIZES = {"seq": 16, "batch": 2}


def _eval_model(spec, attn, seq=None, dtype=torch.float32, batch=None):
    """A row's model, built from seed 0 and in eval mode, and its inputs at ``seq`` tokens and ``batch`` (by default
    :data:`SIZES`): ``(model, (args, kwargs))``. The training and generation set-ups start from it."""
    from autofuse.models import build_transformers
    seq, batch = SIZES["seq"] if seq is None else seq, SIZES["batch"] if batch is None else batch
    torch.manual_seed(0)
    model, inputs = build_transformers("transformers:" + spec, seq=seq, batch=batch, attn=attn, dtype=dtype)
    return model.eval(), inputs


def _training_model(spec, attn, dtype=torch.float32, rates=False):
    """A row's model for a training step, ``(model, args, kwargs)``: built (seed 0, :data:`SIZES`) in train
    mode with its ``nn.Dropout``s off; ``rates``: also a module's float rate named ``*drop*`` (T5's functional
    dropout, a drop path's ``drop_prob``), which 16-bit runs switch off (seeding alone need not draw the same mask in
    16 bits and float64)."""
    model, (args, kwargs) = _eval_model(spec, attn, dtype=dtype)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr, v in list(vars(m).items()) if rates else ():
            if isinstance(v, float) and "drop" in attr:
                setattr(m, attr, 0.0)
    return model, args, kwargs


def _generation_model(spec, attn, dtype=torch.float32):
    """A row's model for generation, ``(model, args, kwargs)`` (seed 0, 8 tokens, batch 1, eval mode, its cache on as
    its configuration has it, which ``build`` turns off), or None for a model that does not generate."""
    model, (args, kwargs) = _eval_model(spec, attn, 8, dtype, batch=1)
    if not model.can_generate():
        return None
    model.config.use_cache = True                  # the configuration's default, which build() turns off
    model.generation_config.use_cache = True       # and generate()'s: without it every step recomputes the prompt
    return model, args, {k: v for k, v in kwargs.items() if k != "use_cache"}


class _Made(TorchDispatchMode):
    """Every storage an op makes while it is active: a weak reference, its bytes and its address."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                s = t.untyped_storage()
                self.made.append((StorageWeakRef(s), s.nbytes(), s.data_ptr()))
        return out


def _kept(fn, model):
    """``(fn(), bytes)``: what a forward keeps alive for its backward, the bytes of the storages its ops made that are
    still alive when it returns, but the output's (what autograd saves, what a checkpoint keeps of its inputs, what
    its recomputation closes over). The model's parameters and buffers, which it reads, are not made by it."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    with _Made() as mode:
        out = fn()
    gc.collect()
    outs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
    alive = {r.cdata: n for r, n, ptr in mode.made if not r.expired() and ptr not in own and ptr not in outs}
    return out, sum(alive.values())


def train(name, spec, attn, device, switches=None, checkpointing=False, compiled=False):
    """One training step's gradients (train mode, dropout off, the loss a fixed random projection of the output)
    of the fused model against eager's: (the worst |fused - eager| of a parameter's gradient relative to that
    gradient's largest, among gradients above 1e-3 of the model's largest; that parameter; the worst of every
    gradient relative to the model's largest; the parameters eager gives a gradient and the fused model none; the
    fused blocks; the bytes each forward keeps alive for the backward (:func:`_kept`), fused and eager).
    ``checkpointing``: with transformers' activation checkpointing on (non-reentrant; None for a model without
    it), and the bytes eager keeps without it last. ``compiled``: through ``torch.compile(model,
    backend=autofuse.backend(...))`` instead of ``fuse()`` (the fused blocks: those of every graph Dynamo handed
    over at the first call; the bytes its forward keeps are not measured: Dynamo does not compile a frame under the
    dispatch mode that measures them), and then at 12 and 20 tokens (a text row), the worst of the three steps."""
    import autofuse
    from autofuse import AutoFusionEngine
    model, args, kwargs = _training_model(spec, attn)
    if checkpointing:
        if not model.supports_gradient_checkpointing:
            return None
        model.activation_checkpointing_enable({"use_reentrant": False})
    if compiled:
        torch._dynamo.reset()
        fused = torch.compile(model, backend=autofuse.backend(target_device=device, fusion_switches=switches))
    else:
        fused = AutoFusionEngine.fuse(model, (args, kwargs), target_device=device, fusion_switches=switches)
    def step(args, kwargs):
        grads, kept = [], []
        for fn in (fused, model):
            model.zero_grad()
            torch.manual_seed(7)                    # any functional dropout left draws the same in both
            if compiled and fn is fused:    # Dynamo runs a frame eagerly under a dispatch mode: kept is not measured
                out, nbytes = _main_output(fn(*args, **kwargs)).float(), float("nan")
            else:
                out, nbytes = _kept(lambda: _main_output(fn(*args, **kwargs)).float(), model)
            kept.append(nbytes)
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
            (out * w).sum().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return grads, kept

    (got, want), kept = step(args, kwargs)
    applied = sum(len(r.applied) for r in autofuse.reports(fused)) if compiled else len(fused.report.applied)
    steps = [(got, want)]
    if compiled and "pixel_values" not in kwargs:
        # then at 12 and 20 tokens: Dynamo compiles a graph with a symbolic length, planned per size
        steps += [step(*_eval_model(spec, attn, seq)[1])[0] for seq in (12, 20)]
    if checkpointing:
        model.activation_checkpointing_disable()
        kept.append(_kept(lambda: _main_output(model(*args, **kwargs)), model)[1])
    # a gradient that is zero by symmetry (a key projection's bias: softmax cancels it) is rounding noise in both:
    # relative errors are taken over the gradients above 1e-3 of the model's largest; every gradient's error is
    # also given relative to that largest (the worst over the steps)
    rel, rel_top, missing = (0.0, ""), 0.0, []
    for got, want in steps:
        top = max(g.abs().max().item() for g in want.values())
        err = {n: (got[n] - g).abs().max().item() for n, g in want.items() if n in got}
        rel = max(rel, max((err[n] / want[n].abs().max().item(), n) for n in err
                           if want[n].abs().max().item() >= 1e-3 * top))
        rel_top = max(rel_top, max(err.values()) / top)
        missing += [n for n in want if n not in got and n not in missing]
    return rel[0], rel[1], rel_top, missing, applied, kept


def generate(name, spec, attn, device, new_tokens=3, static=False, switches=None):
    """Generation through the fused model: ``fused(ids)`` with the model's default cache on (the logits' largest
    difference from eager's, the cache's class), then greedy ``generate()`` of ``new_tokens`` tokens, fused and
    eager (whether the tokens are equal; the plans made, one per cache length; the fewest attention blocks fused
    in a plan). ``static``: ``generate()`` with ``cache_implementation="static"`` (one plan for every decode step
    but where a sliding-window layer's length is part of each step's signature: there a step whose capture is an
    earlier step's but for the length it returns is served by that step's plan); a model whose eager
    ``generate()`` refuses a static cache gives its reason instead."""
    from autofuse import AutoFusionEngine
    t0 = time.perf_counter()
    built = _generation_model(spec, attn)
    if built is None:
        return None
    model, args, kwargs = built
    fused = AutoFusionEngine.fuse(model, target_device=device, fusion_switches=switches)
    with torch.no_grad():
        got, want = fused(*args, **kwargs), model(*args, **kwargs)
        settings, prompt, expect = _eager_generation(model, kwargs, new_tokens, static)
        if isinstance(expect, dict):
            return expect
        # the plans generate() made, by key: a plan whose guards fail (eager's generate() may set an attribute on
        # the model) is dropped when the next one is made, so the count of plans would undercount
        before, served = set(fused.plans), fused._sizes.served
        same = torch.equal(fused.generate(prompt, **settings), expect)
        served = fused._sizes.served - served
        made = [key for key in fused.plans if key not in before]
    # the steps generate() fed one new token (its KV cache holding the rest): a long [batch, 1] input
    one = sum(any(x[0] == "T" and x[2] == torch.long and len(x[1]) == 2 and x[1][1] == 1 for x in key[0][1])
              for key in made)
    err = (got.logits - want.logits).abs().max().item()
    attention = min(sum(d.applied and d.pattern == "attention" for d in p.report.decisions)
                    for p in fused.plans.values())
    # the cache the fused call returned (XLNet's is its ``mems``)
    cache = next((getattr(got, a) for a in ("cache", "mems") if getattr(got, a, None) is not None), None)
    twins = sum(fused.plans[key].twin_of is not None for key in made if key in fused.plans)
    return dict(err=err, cache=type(cache).__name__, same=same, plans=len(made), one=one,
                served=served, twins=twins, attention=attention, seconds=time.perf_counter() - t0)


def _eager_generation(model, kwargs, new_tokens, static):
    """``(settings, prompt, tokens)``: a greedy ``generate()`` of ``new_tokens`` tokens (``static``: with a static
    cache), its prompt (token ids, or Whisper's audio features) and eager's tokens; where eager refuses a static
    cache, its refusal as ``dict(refused=...)`` in the tokens' place (the row's answer)."""
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if static:
        settings["cache_implementation"] = "static"
    prompt = kwargs[model.main_input_name]
    try:
        return settings, prompt, model.generate(prompt, **settings)
    except Exception as e:  # noqa: BLE001 - eager's own refusal is the row's answer
        if not static:
            raise
        return settings, prompt, dict(refused=f"{type(e).__name__}: {str(e).splitlines()[0][:90]}")


class _Records(logging.Handler):
    """The messages of a logger's records."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def compiled_generation(name, spec, attn, device, new_tokens=3, static=False, switches=None):
    """Generation through ``torch.compile``, as the README shows it: ``model.forward = torch.compile(model.forward,
    backend=autofuse.backend(...))``, then the model's own ``generate()`` (greedy, ``new_tokens``; ``static``: with a
    static cache). The logits of one compiled call against eager's, whether the tokens are eager's, the graphs Dynamo
    handed over, the plans made, the blocks they fused (attention among them), and the frames Dynamo stopped
    compiling at its recompile limit (they ran eagerly from there on)."""
    import autofuse
    t0 = time.perf_counter()
    built = _generation_model(spec, attn)
    if built is None:
        return None
    model, args, kwargs = built
    with torch.no_grad():
        want_logits = model(*args, **kwargs).logits
        settings, prompt, expect = _eager_generation(model, kwargs, new_tokens, static)
    if isinstance(expect, dict):
        return expect
    torch._dynamo.reset()
    be = autofuse.backend(target_device=device, fusion_switches=switches)
    model.forward = torch.compile(model.forward, backend=be)
    limits = _Records()           # Dynamo says it stopped compiling a frame only in its log
    log = logging.getLogger("torch._dynamo.convert_frame")
    log.addHandler(limits)
    try:
        with torch.no_grad():
            err = (model(*args, **kwargs).logits - want_logits).abs().max().item()
            same = torch.equal(model.generate(prompt, **settings), expect)
    finally:
        log.removeHandler(limits)
    limited = sum("recompile_limit" in m for m in limits.messages)
    names = collections.Counter(d.pattern for r in be.reports for d in r.applied)
    return dict(err=err, same=same, graphs=len(be.fused_modules), plans=len(be.reports), blocks=sum(names.values()),
                attention=names["attention"], limited=limited, seconds=time.perf_counter() - t0)


def _to64(tree):
    """``tree`` with its floating tensors cast to float64 (the 16-bit values widened exactly)."""
    from torch.utils._pytree import tree_map
    return tree_map(lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def _rel(t, ref, norm):
    """``max|t - ref| / norm``; a non-finite ``t`` where ``ref`` is finite gives inf."""
    d = (t.double() - ref).abs().max().item()
    return float("inf") if d != d else d / norm


def _within(fused, eager, dtype):
    """The project's rule (the verifier's, :func:`autofuse.verify.compare`, on relative errors): the fused error from
    float64 at most twice eager's. Where eager's error is exactly 0 (its 16-bit result happened to be exact), twice 0
    would demand an exact fused result; one rounding of the dtype (its epsilon, relative) is then allowed, the least
    any computation ending in that dtype can incur."""
    return fused <= 2 * eager or (eager == 0 and fused <= torch.finfo(dtype).eps)


def _reference(model):
    """``model``'s weights widened to float64 (exact), run eagerly. transformers' experts call torch's
    ``_grouped_mm``, which takes no float64: the reference runs them through their own loop over the experts, the
    same products and sums."""
    import copy
    m64 = copy.deepcopy(model).double()
    if getattr(m64.config, "_experts_implementation", None) not in (None, "eager"):
        m64.set_experts_implementation("eager")
    return m64


def train16(name, spec, attn, device, dtype, switches=None):
    """One training step in 16 bits (``dtype``), fused and eager, each measured from a float64 reference: the same
    model (weights built in ``dtype`` and widened exactly) and the same inputs, run eagerly in float64. Dropout off
    as in :func:`train` (and checked: two float64 forwards under other seeds must agree); the loss a fixed random
    projection of the output whose weights are ``dtype`` values, so the gradient fed back is exact in every run.

    Errors are relative: the output's ``max|x - ref| / max|ref|``; a gradient's ``max|x - ref|`` over its own largest
    float64 value, but at least 1e-3 of the model's largest (a gradient zero by symmetry, a key projection's bias,
    holds only rounding noise on every side). Returns a dict: ``out`` (eager's, fused's error of the output),
    ``grad`` (the worst eager error over every gradient, the worst fused error and its parameter), ``over`` (the
    parameters whose own fused error is above twice eager's, with the two errors: each tensor alone is a noisy
    measure, reported, not the row's test), ``missing`` (gradients eager has and the fused model not), ``dropout``
    (whether the float64 forwards disagreed), ``n`` (fused blocks)."""
    from autofuse import AutoFusionEngine
    t0 = time.perf_counter()
    model, args, kwargs = _training_model(spec, attn, dtype, rates=True)     # the rates' draws checked below
    m64 = _reference(model)
    args64, kwargs64 = _to64((args, kwargs))
    fused = AutoFusionEngine.fuse(model, (args, kwargs), target_device=device, fusion_switches=switches)
    w = None
    runs = []
    for fn, mod, a, k in ((fused, model, args, kwargs), (model, model, args, kwargs), (m64, m64, args64, kwargs64)):
        mod.zero_grad()
        torch.manual_seed(7)                    # any functional dropout left draws the same in every run
        out = _main_output(fn(*a, **k))
        if w is None:
            w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype).double()
        (out.double() * w).sum().backward()
        runs.append((out.detach().double(),
                     {n: p.grad.double().clone() for n, p in mod.named_parameters() if p.grad is not None}))
    (got_out, got), (want_out, want), (ref_out, ref) = runs
    with torch.no_grad():
        torch.manual_seed(8)
        dropout = not torch.equal(_main_output(m64(*args64, **kwargs64)).double(), ref_out)
    top = max(g.abs().max().item() for g in ref.values())
    norm = {n: max(g.abs().max().item(), 1e-3 * top) for n, g in ref.items()}
    o = max(ref_out.abs().max().item(), torch.finfo(torch.float64).tiny)
    errs = {n: (_rel(want[n], g, norm[n]), _rel(got[n], g, norm[n]) if n in got else float("nan"))
            for n, g in ref.items() if n in want}
    worst = max(((f, n) for n, (_, f) in errs.items() if f == f), default=(0.0, "-"))
    return dict(out=(_rel(want_out, ref_out, o), _rel(got_out, ref_out, o)),
                grad=(max(e for e, _ in errs.values()), worst[0], worst[1]),
                over=[(n, e, f) for n, (e, f) in errs.items() if n in got and not _within(f, e, dtype)],
                missing=[n for n in want if n not in got], dropout=dropout,
                n=len(fused.report.applied), n_params=len(errs),
                seconds=time.perf_counter() - t0)


def generate16(name, spec, attn, device, dtype, new_tokens=3, switches=None):
    """:func:`generate` in 16 bits (``dtype``), each side measured from a float64 reference (the same weights
    widened exactly, run eagerly): ``fused(ids)``'s logits and eager's, their largest |x - float64| over the
    reference's largest; then greedy ``generate()``, fused and eager. Where their tokens differ, the first step that
    differs is recomputed without a cache on the tokens both generated before it, in float64 and by eager in
    ``dtype``: a tie when the float64 logits of the two tokens picked there are closer than eager's own error at
    that step (its largest |eager - float64| over the vocabulary), so that eager's rounding alone could have picked
    either. Returns a dict: ``out`` (eager's, fused's logit error), ``tokens`` ("same", "tie" or "DIFFER"),
    ``step`` (the first differing step, its float64 gap, eager's error there and the fused model's, or None)."""
    from autofuse import AutoFusionEngine
    t0 = time.perf_counter()
    built = _generation_model(spec, attn, dtype)
    if built is None:
        return None
    model, args, kwargs = built
    m64 = _reference(model)
    args64, kwargs64 = _to64((args, kwargs))
    fused = AutoFusionEngine.fuse(model, target_device=device, fusion_switches=switches)
    with torch.no_grad():
        got, want, ref = (fn(*a, **k).logits.double() for fn, a, k in
                          ((fused, args, kwargs), (model, args, kwargs), (m64, args64, kwargs64)))
        o = max(ref.abs().max().item(), torch.finfo(torch.float64).tiny)
        settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        main = model.main_input_name
        prompt = kwargs[main]
        expect = model.generate(prompt, **settings)
        tokens = fused.generate(prompt, **settings)
        step = None
        if torch.equal(tokens, expect):
            verdict = "same"
        elif tokens.shape != expect.shape:
            verdict = "DIFFER"
        else:
            i = int((tokens[0] != expect[0]).nonzero()[0])
            prefix = expect[:, :i]

            def last(m, inputs):
                if model.config.is_encoder_decoder:
                    logits = m(**{main: inputs}, decoder_input_ids=prefix, use_cache=False).logits
                else:
                    logits = m(input_ids=prefix, use_cache=False).logits
                return logits[0, -1].double()
            r, e, f = last(m64, _to64(prompt)), last(model, prompt), last(fused, prompt)
            gap = (r[expect[0, i]] - r[tokens[0, i]]).abs().item()
            err = (e - r).abs().max().item()
            step = (i, gap, err, (f - r).abs().max().item())    # and the fused model's error there, no cache
            verdict = "tie" if gap < err else "DIFFER"
    return dict(out=(_rel(want, ref, o), _rel(got, ref, o)), tokens=verdict, step=step,
                seconds=time.perf_counter() - t0)


FAILED = object()


#: the rows a run takes: :data:`MODELS`, or :data:`MORE` with ``--more``
ROWS = MODELS


def _rows(only, fn, label=lambda name, attn: f"{name:32}", trace=False):
    """``(name, attn, fn(name, spec, attn))`` for each row of :data:`ROWS` ``--only`` keeps; a row that raises prints
    its failure (``trace``: the traceback's last frames too) and gives :data:`FAILED`."""
    for name, spec, attn in ROWS:
        if only and not any(name.startswith(o) for o in only):
            continue
        try:
            yield name, attn, fn(name, spec, attn)
        except Exception as e:  # noqa: BLE001 - a row reports its own failure
            print(f"{label(name, attn)} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
            if trace:
                traceback.print_exc(limit=-3)
            yield name, attn, FAILED


def _by_count(names) -> str:
    """Block names with their counts, the most frequent first."""
    return ", ".join(f"{k} {v}" for k, v in sorted(names.items(), key=lambda kv: (-kv[1], kv[0])))


def _ratio(fused, eager):
    return fused / eager if eager else (0.0 if not fused else float("inf"))


def sixteen(a, dtype, switches):
    """``--train`` or ``--generate`` with a 16-bit ``--dtype``: every row's errors from float64, eager's and fused's,
    and their ratio; a row passes where each fused error is within :func:`_within` of eager's."""
    rows, bad, worst = 0, [], {}

    def keep(kind, ratio, where):
        if ratio >= worst.get(kind, (-1.0, ""))[0]:
            worst[kind] = (ratio, where)
    if a.train:
        print(f"{'model':32} {'fused':>5} {'out eager':>9} {'out fused':>9} {'ratio':>5} {'grad eager':>10} "
              f"{'grad fused':>10} {'ratio':>5}  worst fused gradient   (errors from float64, relative; {a.dtype})")
        over = params = 0
        for name, _, row in _rows(a.only, lambda name, spec, attn: train16(name, spec, attn, a.device, dtype,
                                                                           switches)):
            rows += row is not None
            if row is FAILED:
                bad.append(name)
                continue
            (oe, of), (ge, gf, param) = row["out"], row["grad"]
            ro, rg = _ratio(of, oe), _ratio(gf, ge)
            keep("output", ro, name)
            keep("gradient", rg, f"{name}: {param}")
            over += len(row["over"])
            params += row["n_params"]
            fail = [f"output {ro:.2f}x eager's error"] if not _within(of, oe, dtype) else []
            fail += [f"gradients {rg:.2f}x eager's worst ({param})"] if not _within(gf, ge, dtype) else []
            fail += [f"NO GRADIENT: {', '.join(row['missing'])}"] if row["missing"] else []
            fail += ["dropout active (float64 forwards under two seeds differ)"] if row["dropout"] else []
            if fail:
                bad.append(name)
            note = "  FAILED: " + "; ".join(fail) if fail else ""
            print(f"{name:32} {row['n']:5} {oe:9.2e} {of:9.2e} {ro:5.2f} {ge:10.2e} {gf:10.2e} {rg:5.2f}  "
                  f"{param}{note}", flush=True)
            for n, e, f in row["over"]:
                print(f"{'':32}   over twice eager's alone: {n} (eager {e:.2e}, fused {f:.2e})", flush=True)
        tail = (f"; {over} of {params} parameter gradients alone over twice eager's error (each tensor alone is "
                f"noisy, not the test)")
    else:
        print(f"{'model':32} {'logits eager':>12} {'logits fused':>12} {'ratio':>5} {'tokens':>7}  first differing "
              f"step: its float64 gap, eager's error   (logit errors from float64 relative to its largest, the step's "
              f"absolute; {a.dtype}, {a.new_tokens} tokens)")
        ties = []
        for name, _, row in _rows(a.only, lambda name, spec, attn: generate16(name, spec, attn, a.device, dtype,
                                                                              a.new_tokens, switches)):
            rows += row is not None
            if row is FAILED:
                bad.append(name)
                continue
            if row is None:
                continue
            oe, of = row["out"]
            ro = _ratio(of, oe)
            keep("logits", ro, name)
            fail = [f"logits {ro:.2f}x eager's error"] if not _within(of, oe, dtype) else []
            fail += ["tokens differ, not a tie"] if row["tokens"] == "DIFFER" else []
            if fail:
                bad.append(name)
            elif row["tokens"] == "tie":
                ties.append(name)
            step = (f"  step {row['step'][0]}: gap {row['step'][1]:.2e}, eager's error {row['step'][2]:.2e} "
                    f"(fused's {row['step'][3]:.2e})" if row["step"] else "")
            note = "  FAILED: " + "; ".join(fail) if fail else ""
            print(f"{name:32} {oe:12.2e} {of:12.2e} {ro:5.2f} {row['tokens']:>7}{step}{note}", flush=True)
        tail = f"; {len(ties)} tie{'s' * (len(ties) != 1)}" + (f" ({', '.join(ties)})" if ties else "")
    worst_s = ", ".join(f"worst {k} ratio {r:.2f} ({w})" for k, (r, w) in worst.items())
    print(f"\n{rows - len(bad)} of {rows} passed, {len(bad)} failed"
          f"{' (' + ', '.join(bad) + ')' if bad else ''}; {worst_s}{tail}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="rows whose name starts with one of these")
    ap.add_argument("--device", default="ascend910")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--disable", action="append", default=[], metavar="FAMILY",
                    help="switch a pattern family off (repeatable), e.g. attention: the rest must still fuse and run")
    ap.add_argument("--train", action="store_true", help="gradients of a training step against eager's")
    ap.add_argument("--checkpointing", action="store_true",
                    help="with --train: transformers' activation checkpointing on, and the memory each side keeps")
    ap.add_argument("--generate", action="store_true",
                    help="the generative models with their KV cache: a fused call and greedy generate() against eager's")
    ap.add_argument("--static", action="store_true", help="with --generate: generate() with a static cache")
    ap.add_argument("--new-tokens", type=int, default=3, help="with --generate: tokens generated")
    ap.add_argument("--more", action="store_true", help="the further architectures (MORE) instead of the main rows")
    ap.add_argument("--batch", type=int, default=SIZES["batch"],
                    help="the rows' batch (not --generate's, which generates from one prompt)")
    ap.add_argument("--seq", type=int, default=SIZES["seq"], help="the rows' tokens (not --generate's or --compile's)")
    ap.add_argument("--compile", action="store_true",
                    help='through torch.compile(backend="autofuse") at 16, 12 and 20 tokens, against fuse()')
    a = ap.parse_args()
    if a.compile and a.dtype != "float32" and (a.train or a.generate):
        ap.error("--compile goes alone or with --train or --generate in float32")
    if a.checkpointing and (not a.train or a.dtype != "float32"):
        ap.error("--checkpointing goes with --train in float32 (the 16-bit --train measures against float64 "
                 "without it)")
    global ROWS
    ROWS = MORE if a.more else MODELS
    SIZES.update(batch=a.batch, seq=a.seq)
    switches = {f: "off" for f in a.disable} or None
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    if (a.train or a.generate) and a.dtype != "float32":
        # in 16 bits both sides round far more than fp32 and may differ by it: each is measured from float64
        sixteen(a, getattr(torch, a.dtype), switches)
        return
    if a.generate and a.compile:
        print(f"{'model':32} {'max|compiled-eager|':>19} {'tokens':>7} {'graphs':>6} {'plans':>5} {'blocks':>6} "
              f"{'attention':>9} {'s':>5}   (model.forward through torch.compile, then generate() of {a.new_tokens} "
              f"tokens{', static cache' if a.static else ''}; graphs Dynamo handed over, plans made, blocks they "
              f"fused)")
        bad = refused = limited = 0
        for name, _, row in _rows(a.only, lambda name, spec, attn: compiled_generation(
                name, spec, attn, a.device, a.new_tokens, a.static, switches)):
            if row is FAILED:
                bad += 1
                continue
            if row is None:
                continue
            if "refused" in row:
                refused += 1
                print(f"{name:32} eager refuses it: {row['refused']}", flush=True)
                continue
            bad += not row["same"]
            limited += bool(row["limited"])
            print(f"{name:32} {row['err']:19.2e} {'same' if row['same'] else 'DIFFER':>7} {row['graphs']:6} "
                  f"{row['plans']:5} {row['blocks']:6} {row['attention']:9} {row['seconds']:5.1f}"
                  + (f"   Dynamo's recompile limit: {row['limited']} frame(s) ran eagerly from there on"
                     if row["limited"] else ""), flush=True)
        print(f"\n{bad} failed or generated other tokens; {limited} hit Dynamo's recompile limit"
              + (f"; eager refused a static cache for {refused}" if a.static else ""))
        return
    if a.generate:
        print(f"{'model':32} {'max|fused-eager|':>16} {'cache':>14} {'tokens':>7} {'plans':>5} {'1-token':>7} "
              f"{'shared':>6} {'twin':>5} {'attention':>9} {'s':>5}   (plans: made by generate() of {a.new_tokens} "
              f"tokens{', static cache' if a.static else ''}, one per signature; 1-token: those of a step fed one "
              f"token; shared: those whose capture was specialised from a symbolic export; twin: those served by "
              f"another signature's plan, their capture its own but for numbers returned)")
        bad = refused = 0
        for name, _, row in _rows(a.only, lambda name, spec, attn: generate(name, spec, attn, a.device,
                                                                            a.new_tokens, a.static, switches)):
            if row is FAILED:
                bad += 1
                continue
            if row is None:
                continue                            # an encoder or a vision model: nothing to generate
            if "refused" in row:
                refused += 1
                print(f"{name:32} eager refuses it: {row['refused']}", flush=True)
                continue
            bad += not row["same"]
            print(f"{name:32} {row['err']:16.2e} {row['cache']:>14} {'same' if row['same'] else 'DIFFER':>7} "
                  f"{row['plans']:5} {row['one']:7} {row['served']:6} {row['twins']:5} {row['attention']:9} "
                  f"{row['seconds']:5.1f}",
                  flush=True)
        print(f"\n{bad} failed or generated other tokens" + (f"; eager refused a static cache for {refused}"
                                                               if a.static else ""))
        return
    if a.compile and not a.train:
        print(f"{'model':32} {'max|compiled-eager|':>19} {'graphs':>6} {'plans':>5} {'s':>5}  fused blocks by name at "
              f"the first call (16 tokens), against fuse()'s")
        bad = differ = 0
        for name, _, row in _rows(a.only, lambda name, spec, attn: compiled(name, spec, attn, a.device,
                                                                            getattr(torch, a.dtype), switches)):
            if row is FAILED:
                bad += 1
                continue
            same = row["names"] == row["fuse_names"]
            differ += not same
            note = "  (as fuse())" if same else f"  DIFFERS from fuse(): {_by_count(row['fuse_names'])}"
            note += f"  ({row['failed']} not verified)" if row["failed"] else ""
            print(f"{name:32} {row['err']:19.2e} {row['graphs']:6} {row['plans']:5} {row['seconds']:5.1f}  "
                  f"{_by_count(row['names'])}{note}", flush=True)
        print(f"\n{bad} failed; {differ} fused other blocks than fuse()")
        return
    if a.train:
        ck = a.checkpointing
        print(f"{'model':32} {'fused':>5} {'vs its own':>10} {'vs largest':>10}  {'kept KB: fused':>14} {'eager':>6}"
              + (f" {'eager without':>13}" if ck else "") + "  worst parameter (vs its own largest)"
              + ("   (activation checkpointing on, non-reentrant; kept: what the forward keeps alive for the "
                 "backward)" if ck else "") + ('   (through torch.compile(backend="autofuse"))' if a.compile else ""))
        bad = more = skipped = 0
        for name, _, row in _rows(a.only, lambda name, spec, attn: train(name, spec, attn, a.device, switches, ck,
                                                                         a.compile)):
            if row is FAILED:
                bad += 1
                continue
            if row is None:
                skipped += 1
                print(f"{name:32} no activation checkpointing in transformers", flush=True)
                continue
            err, param, err_top, missing, n, kept = row
            bad += bool(missing)
            more += kept[0] > kept[1]
            note = f"  NO GRADIENT: {', '.join(missing)}" if missing else ""
            kb = " ".join(("-" if k != k else f"{k / 1024:.1f}").rjust(w) for k, w in zip(kept, (14, 6, 13)))
            print(f"{name:32} {n:5} {err:10.2e} {err_top:10.2e}  {kb}  {param}{note}", flush=True)
        print(f"\n{bad} failed or missing a gradient" + (f"; {skipped} without checkpointing" if ck and a.compile else
                                                          f"; {more} kept more than eager's checkpointed forward; "
                                                          f"{skipped} without checkpointing" if ck else
                                                          "" if a.compile else
                                                          f"; {more} kept more than eager's forward"))
        return
    print(f"{'model':28} {'attn':5} {'max|fused-eager|':>16} {'vs eager':>8} {'vs generic':>10} {'fuse s':>6}  "
          f"fused blocks by name")
    bad = 0
    for name, attn, row in _rows(a.only, lambda name, spec, attn: run(name, spec, attn, a.device,
                                                                      getattr(torch, a.dtype), switches),
                                 label=lambda name, attn: f"{name:28} {attn:5}", trace=True):
        if row is FAILED:
            bad += 1
            continue
        names = _by_count(row["names"])
        note = f"  ({row['failed']} not verified)" if row["failed"] else ""
        print(f"{name:28} {attn:5} {row['err']:16.2e} {row['vs_eager']:7.2f}x {row['vs_generic']:9.2f}x "
              f"{row['seconds']:6.1f}  {names}{note}", flush=True)
    print(f"\n{bad} failed")


if __name__ == "__main__":
    main()
