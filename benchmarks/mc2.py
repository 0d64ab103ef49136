"""MC2 (matmul fused with its collective) on N simulated NPUs: the acceptance figures.

    python benchmarks/mc2.py            # everything (the 8-rank world and the 256 MB all-reduce take minutes)
    python benchmarks/mc2.py --quick    # TP 2 and 4 only, a 32 MB all-reduce, prefill at 1024 tokens

1. Tensor-parallel worlds (gloo ranks, one process each): a Megatron-split GPT-2 block, fused vs unfused on
   every rank; error of the fused output against the float64 single-device block next to the unfused TP
   model's; every matmul + collective pair's decision.
2. A 7B-class layer (hidden 4096, FFN 11008) at TP 8 on the 910B2: each projection with its collective,
   simulated unfused (matmul with its searched tiling, then the collective: two launches) and fused (the tile
   count the cost model picks, or kept unfused), decode (1, 16, 64 tokens) and prefill (4096 tokens).
3. The link model against the ring formula: an all-reduce of 256 MB across 8 simulated first-generation 910s.
4. How the same all-reduce and MC2 projection scale to 16 and 64 ranks (servers of 8 over RoCE, hierarchical).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from autofuse import npu
from cost_model.devices import get_device
from cost_model.links import get_links, ring_bottleneck, ring_time
from cost_model.mc2 import KINDS, choose_tiles


def worlds(sizes):
    import copy

    from autofuse.distributed import simulate_world
    from autofuse.tp_models import build, example_input, make_block
    print("\n## Tensor-parallel GPT-2 block (hidden 64, 8 heads, batch 2, seq 16, fp32), ascend910b")
    print(f"{'TP':>3} {'fused cyc':>10} {'unfused cyc':>11} {'speed-up':>8} {'err fused':>10} {'err unfused TP':>14} "
          f"{'wall':>6}  decisions")
    ref = copy.deepcopy(make_block()).double()(example_input().double())
    for p in sizes:
        t = time.time()
        w = simulate_world(build, p, device="ascend910b")
        err = max((r.outputs.double() - ref).abs().max().item() for r in w.ranks)
        base = max((r.outputs_unfused.double() - ref).abs().max().item() for r in w.ranks)
        dec = "; ".join(f"{d.kind} {'fused' if d.applied else 'kept'} ({d.reason})" for d in w.ranks[0].decisions)
        print(f"{p:>3} {w.cycles:>10,} {w.cycles_unfused:>11,} {w.speedup:>7.2f}x {err:>10.3g} {base:>14.3g} "
              f"{time.time() - t:>5.0f}s  {dec}")


def _zeros(shape):
    return np.zeros(shape, np.float16)


def pair(kind, tokens, K, N, p, device):
    """(unfused cycles, fused cycles, tiles, matmul cycles, collective cycles) simulated, x [tokens, K]."""
    x, w = _zeros((tokens, K)), _zeros((K, N))
    plan = choose_tiles(kind, ((tokens, K), "float16"), ((K, N), "float16"), device, p)
    import cost_model
    if kind == "all_gather_matmul":
        mm_x = _zeros((p * tokens, K))
        coll = npu.run("all_gather", x, device=device, world=p).stats.cycles
    else:
        mm_x = x
        coll = npu.run(KINDS[kind], _zeros((tokens, N)), device=device, world=p).stats.cycles
    t = cost_model.estimate("matmul", [(mm_x.shape, "float16"), ((K, N), "float16")], device=device).tiling
    mm = npu.run("matmul", mm_x, w, device=device, tiling=t).stats.cycles
    fused = npu.run(kind, x, w, device=device, world=p, tiles=plan.tiles).stats.cycles if plan.tiles else mm + coll
    return mm + coll, fused, plan.tiles, mm, coll


def layer(prefill):
    p, dev = 8, "ascend910b"
    H, F = 4096, 11008
    print(f"\n## 7B-class layer (hidden {H}, FFN {F}) at TP {p} on {dev}, fp16: simulated cycles")
    print(f"{'projection':34s} {'tokens':>6} {'unfused':>10} {'fused':>10} {'tiles':>5} {'speed-up':>8} "
          f"{'link/compute':>12}")
    shapes = [("attention out (row, all-reduce)", "matmul_all_reduce", H // p, H),
              ("MLP down (row, all-reduce)", "matmul_all_reduce", F // p, H),
              ("QKV (seq-parallel, all-gather)", "all_gather_matmul", H, 3 * H // p),
              ("MLP down (seq-parallel, reduce-scatter)", "matmul_reduce_scatter", F // p, H)]
    for tokens in (1, 16, 64, prefill):
        for label, kind, K, N in shapes:
            rows = tokens if kind != "all_gather_matmul" else max(1, tokens // p)
            if kind == "matmul_reduce_scatter" and rows % p:
                continue
            u, f, T, mm, coll = pair(kind, rows, K, N, p, dev)
            ratio = coll / mm
            print(f"{label:34s} {tokens:>6} {u:>10,} {f:>10,} {T if T else 'kept':>5} {u / f:>7.2f}x {ratio:>12.2f}")


def ring_check(nbytes):
    dev = get_device("ascend910")
    t = time.time()
    r = npu.run("all_reduce", np.zeros(nbytes // 2, np.float16), device=dev, world=8, algorithm="ring")
    port = ring_bottleneck(get_links(dev), 8)
    want = ring_time("all_reduce", 8, nbytes, port)
    print(f"\n## Ring all-reduce of {nbytes / 2 ** 20:.0f} MiB across 8 simulated ascend910 (two 4-NPU HCCS groups, "
          f"RoCE between them)")
    print(f"simulated {r.stats.seconds * 1e3:.3f} ms; ring formula 2(p-1)/p·n/B + 2(p-1)·latency with B = "
          f"{port.bytes_per_s / 1e9:.1f} GB/s ({port.kind}), latency {port.latency_s * 1e6:.0f} µs: "
          f"{want * 1e3:.3f} ms; ratio {r.stats.seconds / want:.4f}; link busy {r.stats.util['link']:.0%} "
          f"({time.time() - t:.0f} s to simulate)")


def scaling(tokens):
    dev = "ascend910b"
    print(f"\n## Scaling on {dev} (servers of 8 NPUs, HCCS inside, 25 GB/s RoCE [A] between): one rank simulated")
    print(f"{'ranks':>5} {'algorithm':>12} {'all-reduce 32 MiB':>18} {'link busy':>10} {'bytes sent':>12} "
          f"{'MLP down fused':>15} {'unfused':>10} {'tiles':>5}")
    for p in (8, 16, 64):
        r = npu.run("all_reduce", _zeros((4096, 4096)), device=dev, world=p)
        alg = "mesh" if p <= 8 else "hierarchical"
        u, f, T, _, _ = pair("matmul_all_reduce", tokens, 11008 // 8, 4096, p, dev)
        print(f"{p:>5} {alg:>12} {r.stats.seconds * 1e6:>15.1f} µs {r.stats.busy['link']:>10,} "
              f"{r.stats.bytes['HBM->link']:>12,} {f:>15,} {u:>10,} {T:>5}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    worlds((2, 4) if a.quick else (2, 4, 8))
    layer(1024 if a.quick else 4096)
    ring_check((32 if a.quick else 256) << 20)
    scaling(1024 if a.quick else 4096)


if __name__ == "__main__":
    main()
