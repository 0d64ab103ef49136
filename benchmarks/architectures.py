"""Real architectures from transformers configs (tiny sizes, random weights, no download), each through
``AutoFusionEngine.fuse``: what was fused, by name, the fused model's largest difference from eager, and the
predicted speed-up of the whole graph against eager op by op and against generic fusion alone (ascend910).

    python benchmarks/architectures.py [--only NAME ...] [--device ascend910] [--dtype bfloat16]
    python benchmarks/architectures.py --train [--only NAME ...]    # gradients of every parameter against eager's
    python benchmarks/architectures.py --generate [--only NAME ...] # KV caches: fused(ids) and generate() vs eager
    python benchmarks/architectures.py --generate --static --new-tokens 5  # generate() with a static cache
    python benchmarks/architectures.py --disable attention          # the rest fused around torch's own attention

Every row is one model built, captured, planned, verified and run here; a model that fails prints its error
in its row (nothing is skipped silently). Sizes are small (2 layers, hidden 64, 16 tokens): the point is
coverage of the spellings, not speed figures (see ``model_speedup.py`` and ``scale.py`` for those).
"""
from __future__ import annotations

import argparse
import collections
import time
import traceback
import warnings

import torch

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


def _main_output(out):
    for attr in ("logits", "last_hidden_state"):
        if hasattr(out, attr):
            return getattr(out, attr)
    return out[0] if isinstance(out, (tuple, list)) else out


def run(name, spec, attn, device, dtype=torch.float32, switches=None):
    from autofuse import AutoFusionEngine
    from autofuse.models import build_transformers
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, (args, kwargs) = build_transformers("transformers:" + spec, seq=16, batch=2, attn=attn, dtype=dtype)
    model.eval()
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


def train(name, spec, attn, device, switches=None):
    """One training step's gradients (train mode, dropout off, the loss a fixed random projection of the output)
    of the fused model against eager's: (the worst |fused - eager| of a parameter's gradient relative to that
    gradient's largest, among gradients above 1e-3 of the model's largest; that parameter; the worst of every
    gradient relative to the model's largest; the parameters eager gives a gradient and the fused model none; the
    fused blocks)."""
    from autofuse import AutoFusionEngine
    from autofuse.models import build_transformers
    torch.manual_seed(0)
    model, (args, kwargs) = build_transformers("transformers:" + spec, seq=16, batch=2, attn=attn)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    fused = AutoFusionEngine.fuse(model, (args, kwargs), target_device=device, fusion_switches=switches)
    grads = []
    for fn in (fused, model):
        model.zero_grad()
        torch.manual_seed(7)                    # any functional dropout left draws the same in both
        out = _main_output(fn(*args, **kwargs)).float()
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        (out * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    got, want = grads
    # a gradient that is zero by symmetry (a key projection's bias: softmax cancels it) is rounding noise in both:
    # relative errors are taken over the gradients above 1e-3 of the model's largest; every gradient's error is
    # also given relative to that largest
    top = max(g.abs().max().item() for g in want.values())
    err = {n: (got[n] - g).abs().max().item() for n, g in want.items() if n in got}
    rel = max((err[n] / want[n].abs().max().item(), n) for n in err if want[n].abs().max().item() >= 1e-3 * top)
    return rel[0], rel[1], max(err.values()) / top, [n for n in want if n not in got], len(fused.report.applied)


def generate(name, spec, attn, device, new_tokens=3, static=False, switches=None):
    """Generation through the fused model: ``fused(ids)`` with the model's default cache on (the logits' largest
    difference from eager's, the cache's class), then greedy ``generate()`` of ``new_tokens`` tokens, fused and
    eager (whether the tokens are equal; the plans made, one per cache length; the fewest attention blocks fused
    in a plan). ``static``: ``generate()`` with ``cache_implementation="static"`` (one plan for every decode step
    but where a sliding-window layer keeps its length in the cache's structure); a model whose eager
    ``generate()`` refuses a static cache gives its reason instead."""
    from autofuse import AutoFusionEngine
    from autofuse.models import build_transformers
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model, (args, kwargs) = build_transformers("transformers:" + spec, seq=8, batch=1, attn=attn)
    model.eval()
    if not model.can_generate():
        return None
    model.config.use_cache = True                  # the configuration's default, which build() turns off
    model.generation_config.use_cache = True       # and generate()'s: without it every step recomputes the prompt
    kwargs = {k: v for k, v in kwargs.items() if k != "use_cache"}
    fused = AutoFusionEngine.fuse(model, target_device=device, fusion_switches=switches)
    with torch.no_grad():
        got, want = fused(*args, **kwargs), model(*args, **kwargs)
        settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        prompt = kwargs[model.main_input_name]      # token ids, or Whisper's audio features
        if static:
            settings["cache_implementation"] = "static"
            try:
                expect = model.generate(prompt, **settings)
            except Exception as e:  # noqa: BLE001 - eager's own refusal is the row's answer
                return dict(refused=f"{type(e).__name__}: {str(e).splitlines()[0][:90]}")
        else:
            expect = model.generate(prompt, **settings)
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
    return dict(err=err, cache=type(got.cache).__name__, same=same, plans=len(made), one=one,
                served=served, attention=attention, seconds=time.perf_counter() - t0)


FAILED = object()


def _rows(only, fn, label=lambda name, attn: f"{name:32}", trace=False):
    """``(name, attn, fn(name, spec, attn))`` for each row ``--only`` keeps; a row that raises prints its failure
    (``trace``: the traceback's last frames too) and gives :data:`FAILED`."""
    for name, spec, attn in MODELS:
        if only and not any(name.startswith(o) for o in only):
            continue
        try:
            yield name, attn, fn(name, spec, attn)
        except Exception as e:  # noqa: BLE001 - a row reports its own failure
            print(f"{label(name, attn)} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
            if trace:
                traceback.print_exc(limit=-3)
            yield name, attn, FAILED


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="rows whose name starts with one of these")
    ap.add_argument("--device", default="ascend910")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--disable", action="append", default=[], metavar="FAMILY",
                    help="switch a pattern family off (repeatable), e.g. attention: the rest must still fuse and run")
    ap.add_argument("--train", action="store_true", help="gradients of a training step against eager's")
    ap.add_argument("--generate", action="store_true",
                    help="the generative models with their KV cache: a fused call and greedy generate() against eager's")
    ap.add_argument("--static", action="store_true", help="with --generate: generate() with a static cache")
    ap.add_argument("--new-tokens", type=int, default=3, help="with --generate: tokens generated")
    a = ap.parse_args()
    if (a.train or a.generate) and a.dtype != "float32":
        # gradients are compared with eager's relative to their largest and tokens for equality, measures of fp32
        # rounding: in 16 bits both sides round far more and may differ by it (a float64 reference per row needed)
        ap.error(f"--{'train' if a.train else 'generate'} runs in float32; --dtype {a.dtype} is not taken with it")
    switches = {f: "off" for f in a.disable} or None
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    if a.generate:
        print(f"{'model':32} {'max|fused-eager|':>16} {'cache':>14} {'tokens':>7} {'plans':>5} {'1-token':>7} "
              f"{'shared':>6} {'attention':>9} {'s':>5}   (plans: made by generate() of {a.new_tokens} tokens"
              f"{', static cache' if a.static else ''}; 1-token: those of a step fed one token; shared: those whose "
              f"capture was specialised from a symbolic export)")
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
                  f"{row['plans']:5} {row['one']:7} {row['served']:6} {row['attention']:9} {row['seconds']:5.1f}",
                  flush=True)
        print(f"\n{bad} failed or generated other tokens" + (f"; eager refused a static cache for {refused}"
                                                               if a.static else ""))
        return
    if a.train:
        print(f"{'model':32} {'fused':>5} {'vs its own':>10} {'vs largest':>10}  worst parameter (vs its own largest)")
        bad = 0
        for name, _, row in _rows(a.only, lambda name, spec, attn: train(name, spec, attn, a.device, switches)):
            if row is FAILED:
                bad += 1
                continue
            err, param, err_top, missing, n = row
            bad += bool(missing)
            note = f"  NO GRADIENT: {', '.join(missing)}" if missing else ""
            print(f"{name:32} {n:5} {err:10.2e} {err_top:10.2e}  {param}{note}", flush=True)
        print(f"\n{bad} failed or missing a gradient")
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
        names = ", ".join(f"{k} {v}" for k, v in sorted(row["names"].items(), key=lambda kv: (-kv[1], kv[0])))
        note = f"  ({row['failed']} not verified)" if row["failed"] else ""
        print(f"{name:28} {attn:5} {row['err']:16.2e} {row['vs_eager']:7.2f}x {row['vs_generic']:9.2f}x "
              f"{row['seconds']:6.1f}  {names}{note}", flush=True)
    print(f"\n{bad} failed")


if __name__ == "__main__":
    main()
