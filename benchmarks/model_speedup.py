"""Simulated speed-up of fusion on whole models and on attention blocks alone (same simulator both sides).

Goals (issue 4): GPT-2-small shapes at batch 8, sequence 1024: whole model >= 1.3x;
attention blocks alone >= 3x at sequence 2048.

    python benchmarks/model_speedup.py [--quick] [--device ascend910] [--values] [--first]

Every figure printed is a simulation statistic, so both sides simulate timing only (``values=False``: the
same statistics as with values, no outputs; tests/test_simulate.py compares them); ``--values`` simulates with
values. Each side's simulation prints its wall time, CPU time and peak resident memory (the process's
high-water mark, reset before the side where Linux allows it, else since the start).
"""
import argparse
import resource
import time

import torch

import autofuse
from autofuse import AutoFusionEngine
from autofuse.models import build


def _reset_peak() -> bool:
    """Reset the process's peak resident memory (Linux: VmHWM); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak() -> int:
    """The process's peak resident memory in bytes (VmHWM where readable, else ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _measured(label, fn):
    reset = _reset_peak()
    t, c = time.perf_counter(), time.process_time()
    result = fn()
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    print(f"  simulate {label:<8}: {wall:6.1f} s wall, {cpu:6.1f} s CPU, peak {_peak() / 1e9:5.2f} GB"
          f"{'' if reset else ' (since the start)'}", flush=True)
    return result, wall


def run(name, layers, hidden, heads, seq, batch, dtype, device, vocab=50257, values=False):
    model, (args, kwargs) = build(name, layers=layers, hidden=hidden, heads=heads, seq=seq, batch=batch,
                                  vocab=vocab, dtype=dtype)
    t0 = time.perf_counter()
    fused = AutoFusionEngine.fuse(model, (args, kwargs), target_device=device, optimization_level="O3")
    t1 = time.perf_counter()
    print(f"{name} L={layers} B={batch} S={seq}: fuse {t1 - t0:.1f} s wall, peak {_peak() / 1e9:.2f} GB"
          f"{'' if values else '; simulating timing only (values=False)'}", flush=True)
    before, w1 = _measured("unfused", lambda: autofuse.simulate(model, (args, kwargs), device=device, values=values))
    after, w2 = _measured("fused", lambda: fused.simulate(*args, values=values, **kwargs))
    r = fused.report
    attn_nodes = [n for d in r.applied for n in d.nodes]
    attn_before = before.cycles_of(attn_nodes)
    attn_after = sum(n.cycles for n in after.nodes if n.fused)
    print(f"{name} L={layers} H={hidden} heads={heads} B={batch} S={seq} {str(dtype).replace('torch.', '')} on "
          f"{device}: fused {len(r.applied)}/{len(r.decisions)} blocks")
    print(f"  whole model: {before.cycles:>14,} -> {after.cycles:>14,} cycles   speed-up {before.cycles / after.cycles:5.2f}x")
    print(f"  attention  : {attn_before:>14,} -> {attn_after:>14,} cycles   speed-up "
          f"{attn_before / max(attn_after, 1):5.2f}x")
    print(f"  (fuse {t1 - t0:.1f} s, simulate both {w1 + w2:.1f} s wall)")
    return before, after


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="ascend910")
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    ap.add_argument("--first", action="store_true", help="the first case only (GPT-2-small shapes, B8 S1024)")
    ap.add_argument("--values", action="store_true",
                    help="simulate with values (slower; the same figures as the default timing-only simulation)")
    a = ap.parse_args()
    torch.manual_seed(0)
    values = a.values
    if a.quick:
        run("gpt2", 2, 256, 4, 256, 2, torch.float16, a.device, vocab=1000, values=values)
        return
    run("gpt2", 12, 768, 12, 1024, 8, torch.float16, a.device, values=values)
    if not a.first:
        run("gpt2", 1, 768, 12, 2048, 1, torch.float16, a.device, values=values)


if __name__ == "__main__":
    main()
