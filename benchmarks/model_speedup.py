"""Simulated speed-up of fusion on whole models, against two baselines, on the same simulator.

Baselines: *eager op by op* (the captured graph, every op its own competently tiled kernel) and *generic
fusion alone* (the plan with every pattern family switched off: automatic discovery of Vector regions and
matmul epilogues only). A pattern's value is its figure against the second. Also the attention blocks alone.

    python benchmarks/model_speedup.py [--quick] [--device ascend910] [--only gpt2|llama]

Goals: GPT-2-small shapes at batch 8, sequence 1024, whole model >= 2x against eager op by op; a LLaMA-style
decoder layer's figures printed against both baselines.
"""
import argparse
import resource
import time

import torch

import autofuse
from autofuse import AutoFusionEngine
from autofuse.engine import generic_only
from autofuse.models import build


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def run(name, layers, hidden, heads, seq, batch, dtype, device, vocab=50257, kv_heads=None):
    model, (args, kwargs) = build(name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, seq=seq,
                                  batch=batch, vocab=vocab, dtype=dtype)
    model.eval()
    t0 = time.perf_counter()
    fused = AutoFusionEngine.fuse(model, (args, kwargs), target_device=device, optimization_level="O3")
    t1 = time.perf_counter()
    generic = AutoFusionEngine.fuse(model, (args, kwargs), target_device=device, optimization_level="O3",
                                    fusion_switches=generic_only())
    t2 = time.perf_counter()
    eager = autofuse.simulate(model, (args, kwargs), device=device)
    gen = generic.simulate(*args, **kwargs)
    after = fused.simulate(*args, **kwargs)
    t3 = time.perf_counter()
    r = fused.report
    attn = [d for d in r.applied if d.pattern == "attention"]
    attn_before = eager.cycles_of([n for d in attn for n in d.nodes])
    attn_after = sum(n.cycles for n in after.nodes if n.fused and n.target == "autofuse.flash_attention")
    print(f"{name} L={layers} H={hidden} heads={heads} B={batch} S={seq} {str(dtype).replace('torch.', '')} on "
          f"{device}: {len(r.applied)} fused ({', '.join(sorted({d.pattern for d in r.applied}))})")
    print(f"  eager op by op      : {eager.cycles:>14,} cycles   fused {eager.cycles / after.cycles:5.2f}x")
    print(f"  generic fusion alone: {gen.cycles:>14,} cycles   fused {gen.cycles / after.cycles:5.2f}x   "
          f"(generic alone vs eager {eager.cycles / gen.cycles:5.2f}x)")
    print(f"  fused               : {after.cycles:>14,} cycles")
    if attn:
        print(f"  attention blocks    : {attn_before:>14,} -> {attn_after:>14,} cycles   "
              f"{attn_before / max(attn_after, 1):5.2f}x")
    print(f"  (fuse {t1 - t0:.1f} s, generic plan {t2 - t1:.1f} s, simulate three graphs {t3 - t2:.1f} s wall; "
          f"peak memory {_peak_gb():.1f} GB)")
    return eager, gen, after


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="ascend910")
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    ap.add_argument("--only", choices=["gpt2", "llama"], default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.quick:
        run("gpt2", 2, 256, 4, 256, 2, torch.float16, a.device, vocab=1000)
        run("llama", 1, 256, 4, 256, 1, torch.float16, a.device, vocab=1000, kv_heads=2)
        return
    if a.only in (None, "gpt2"):
        run("gpt2", 12, 768, 12, 1024, 8, torch.float16, a.device)
    if a.only in (None, "llama"):
        # one LLaMA-7B-shaped decoder layer (hidden 4096, 32 heads, 8 kv heads as in Llama-3; the zoo's
        # intermediate size is 4 x hidden), 2048 tokens; a small vocabulary, so the layer, not the LM head, is
        # what is measured
        run("llama", 1, 4096, 32, 2048, 1, torch.float16, a.device, vocab=1024, kv_heads=8)


if __name__ == "__main__":
    main()
