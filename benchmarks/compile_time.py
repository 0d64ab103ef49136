"""Compile time: fuse() on GPT-2-small-shaped models captured on meta tensors, against capture alone.

Goals: fuse(12 layers) <= 5x capture(12 layers); fuse(48 layers) <= 4.5x fuse(12 layers).

    python benchmarks/compile_time.py [--seq 1024] [--batch 1] [--repeat 2]
"""
import argparse
import time

import torch

from autofuse import AutoFusionEngine
from autofuse.capture import capture
from autofuse.models import build


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--device", default="ascend910")
    a = ap.parse_args()
    rows = {}
    for layers in (12, 48):
        model, (args, kwargs) = build("gpt2", layers=layers, hidden=768, heads=12, seq=a.seq, batch=a.batch,
                                      vocab=50257, meta=True, attn="eager")
        t_cap, _ = best(lambda: capture(model, args, kwargs), a.repeat)
        t_fuse, fused = best(lambda: AutoFusionEngine.fuse(model, (args, kwargs), target_device=a.device), a.repeat)
        r = fused.report
        rows[layers] = (t_cap, t_fuse)
        print(f"{layers:>3} layers: capture {t_cap:6.2f} s   fuse {t_fuse:6.2f} s   fuse/capture {t_fuse / t_cap:4.2f}x   "
              f"fused {len(r.applied)}/{len(r.decisions)} blocks   stages: "
              + ", ".join(f"{k} {v:.2f}s" for k, v in r.timings.items()))
    (c12, f12), (c48, f48) = rows[12], rows[48]
    print(f"\nfuse(12)/capture(12) = {f12 / c12:.2f}x (goal <= 5x);  fuse(48)/fuse(12) = {f48 / f12:.2f}x (goal <= 4.5x)")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
