"""Simulated speed-up of fusion on whole models and on attention blocks alone (same simulator both sides).

Goals (issue 4): GPT-2-small shapes at batch 8, sequence 1024: whole model >= 1.3x;
attention blocks alone >= 3x at sequence 2048.

    python benchmarks/model_speedup.py [--quick] [--device ascend910]
"""
import argparse
import time

import torch

import autofuse
from autofuse import AutoFusionEngine
from autofuse.models import build


def run(name, layers, hidden, heads, seq, batch, dtype, device, vocab=50257):
    model, (args, kwargs) = build(name, layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch,
                                  vocab=vocab, dtype=dtype)
    t0 = time.perf_counter()
    fused = AutoFusionEngine.fuse(model, (args, kwargs), target_device=device, optimization_level="O3")
    t1 = time.perf_counter()
    before = autofuse.simulate(model, (args, kwargs), device=device)
    after = fused.simulate(*args, **kwargs)
    t2 = time.perf_counter()
    r = fused.report
    attn_nodes = [n for d in r.applied for n in d.nodes]
    attn_before = before.cycles_of(attn_nodes)
    attn_after = sum(n.cycles for n in after.nodes if n.fused)
    print(f"{name} L={layers} H={hidden} heads={heads} B={batch} S={seq} {str(dtype).replace('torch.', '')} on "
          f"{device}: fused {len(r.applied)}/{len(r.decisions)} blocks")
    print(f"  whole model: {before.cycles:>14,} -> {after.cycles:>14,} cycles   speed-up {before.cycles / after.cycles:5.2f}x")
    print(f"  attention  : {attn_before:>14,} -> {attn_after:>14,} cycles   speed-up "
          f"{attn_before / max(attn_after, 1):5.2f}x")
    print(f"  (fuse {t1 - t0:.1f} s, simulate both {t2 - t1:.1f} s wall)")
    return before, after


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="ascend910")
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.quick:
        run("gpt2", 2, 256, 4, 256, 2, torch.float16, a.device, vocab=1000)
        return
    run("gpt2", 12, 768, 12, 1024, 8, torch.float16, a.device)
    run("gpt2", 1, 768, 12, 2048, 1, torch.float16, a.device)


if __name__ == "__main__":
    main()
