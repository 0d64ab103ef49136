"""MC2 (matmul fused with its collective) on N simulated NPUs: the acceptance figures.

    python benchmarks/mc2.py            # everything (the 8-rank world and the 256 MB all-reduce take minutes)
    python benchmarks/mc2.py --quick    # TP 2 and 4 only, a 32 MB all-reduce, prefill at 1024 tokens

1. Tensor-parallel worlds (gloo ranks, one process each) through ``AutoFusionEngine.fuse`` on every rank: a
   Megatron-split GPT-2 block; the error of the fused world's output against the float64 single-device block
   next to the unfused TP model's; every matmul + collective pair's decision; the system's cycles.
2. A 7B-class layer (hidden 4096, FFN 11008) at TP 8 on the 910B2: each projection with its collective,
   simulated unfused (the matmul with its searched tiling, then the collective: two launches) and fused (the
   tile count, matmul tiling and tile algorithm the cost model picks at O3, or kept unfused), decode (1, 16,
   64 tokens) and prefill (4096 tokens). ``link`` and ``compute`` are the collective's and the matmul's
   launches without the launch overhead; ``link/compute`` their ratio.
3. The link model against the ring formula: an all-reduce of 256 MB across 8 simulated first-generation 910s.
4. How the all-reduce and the fused MLP-down projection scale to 16 and 64 ranks (servers of 8 over RoCE,
   hierarchical all-reduce).
5. Expert parallelism at EP 8: all-to-all dispatch, grouped GEMM and combine in one launch
   (``moe_dispatch_combine``) against the eight launches of the unfused path.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from autofuse import npu
from cost_model.devices import get_device
from cost_model.links import get_links, ring_bottleneck, ring_time
from cost_model.mc2 import KINDS, choose_tiles, tile_plan


def worlds(sizes):
    import copy

    from autofuse.distributed import simulate_world
    from autofuse.tp_models import build, example_input, make_block
    print("\n## Tensor-parallel GPT-2 block (hidden 64, 8 heads, batch 2, seq 16, fp32), ascend910b, "
          "AutoFusionEngine.fuse on every rank")
    print(f"{'TP':>3} {'fused cyc':>10} {'unfused cyc':>11} {'speed-up':>8} {'err fused':>10} {'err unfused TP':>14} "
          f"{'wall':>6}  pairs")
    ref = copy.deepcopy(make_block()).double()(example_input().double())
    for p in sizes:
        t = time.time()
        w = simulate_world(build, p, device="ascend910b")
        err = max((r.outputs.double() - ref).abs().max().item() for r in w.ranks)
        base = max((r.outputs_unfused.double() - ref).abs().max().item() for r in w.ranks)
        dec = "; ".join(f"{d.pattern} {d.reason_code} ({d.tiling.get('tiles', '-')} tiles)" for d in w.ranks[0].pairs)
        print(f"{p:>3} {w.cycles:>10,} {w.cycles_unfused:>11,} {w.speedup:>7.2f}x {err:>10.3g} {base:>14.3g} "
              f"{time.time() - t:>5.0f}s  {dec}")


def _zeros(shape):
    return np.zeros(shape, np.float16)


def pair(kind, rows, K, N, p, device):
    """Simulated (unfused, fused, plan, matmul, collective) cycles of one pair, x [rows, K] on each rank."""
    import cost_model
    x, w = _zeros((rows, K)), _zeros((K, N))
    plan = choose_tiles(kind, ((rows, K), "float16"), ((K, N), "float16"), device, p)
    if kind == "all_gather_matmul":
        mm_x = _zeros((p * rows, K))
        coll = npu.run("all_gather", x, device=device, world=p).stats.cycles
    else:
        mm_x = x
        coll = npu.run(KINDS[kind], _zeros((rows, N)), device=device, world=p).stats.cycles
    t = cost_model.estimate("matmul", [(mm_x.shape, "float16"), ((K, N), "float16")], device=device).tiling
    mm = npu.run("matmul", mm_x, w, device=device, tiling=t).stats.cycles
    fused = mm + coll
    if plan.tiles:
        fused = npu.run(kind, x, w, device=device, world=p, tiles=plan.tiles, tiling=plan.tiling,
                        algorithm=plan.algorithm or None).stats.cycles
    return mm + coll, fused, plan, mm, coll


def _how(kind, rows, N, p, plan):
    if not plan.tiles:
        return "kept"
    tiled_rows = rows if kind == "all_gather_matmul" else (rows // p if kind == "matmul_reduce_scatter" else rows)
    split, ranges = tile_plan(tiled_rows, N, plan.tiling["m0"], plan.tiling["n0"], plan.tiles)
    alg = f" {plan.algorithm}" if plan.algorithm else ""
    return f"{len(ranges)} {split}{alg}"


def layer(prefill):
    p, dev = 8, "ascend910b"
    H, F = 4096, 11008
    launch = get_device(dev).launch_cycles
    clock = get_device(dev).clock_hz / 1e6
    print(f"\n## 7B-class layer (hidden {H}, FFN {F}) at TP {p} on {dev}, fp16: simulated cycles")
    print(f"{'projection':38s} {'tokens':>6} {'unfused':>9} {'fused':>9} {'tiles':>18} {'speed-up':>8} "
          f"{'compute µs':>10} {'link µs':>8} {'link/compute':>12} {'with launches':>13}")
    shapes = [("attention out (row-parallel, all-reduce)", "matmul_all_reduce", H // p, H),
              ("MLP down (row-parallel, all-reduce)", "matmul_all_reduce", F // p, H),
              ("QKV (sequence-parallel, all-gather)", "all_gather_matmul", H, 3 * H // p),
              ("MLP down (sequence-parallel, reduce-scatter)", "matmul_reduce_scatter", F // p, H)]
    for tokens in (1, 16, 64, prefill):
        for label, kind, K, N in shapes:
            rows = tokens // p if kind == "all_gather_matmul" else tokens
            if rows == 0 or (kind == "matmul_reduce_scatter" and rows % p):
                continue           # sequence parallelism needs at least one token per rank
            u, f, plan, mm, coll = pair(kind, rows, K, N, p, dev)
            comp, link = mm - launch, coll - launch
            print(f"{label:38s} {tokens:>6} {u:>9,} {f:>9,} {_how(kind, rows, N, p, plan):>18} {u / f:>7.2f}x "
                  f"{comp / clock:>10.2f} {link / clock:>8.2f} {link / comp:>12.2f} {coll / mm:>13.2f}", flush=True)


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
    print(f"\n## Scaling on {dev} (servers of 8 NPUs, HCCS inside, 25 GB/s RoCE [A] between): one rank simulated; "
          f"MLP down row-parallel at {tokens} tokens, K = 11008/TP")
    print(f"{'ranks':>5} {'algorithm':>12} {'all-reduce 32 MiB':>18} {'link busy':>10} {'bytes sent':>12} "
          f"{'MLP down unfused':>16} {'fused':>9} {'tiles':>18} {'speed-up':>8}")
    for p in (8, 16, 64):
        r = npu.run("all_reduce", _zeros((4096, 4096)), device=dev, world=p)
        alg = "mesh" if p <= 8 else "hierarchical"
        u, f, plan, _, _ = pair("matmul_all_reduce", tokens, 11008 // p, 4096, p, dev)
        print(f"{p:>5} {alg:>12} {r.stats.seconds * 1e6:>15.1f} µs {r.stats.busy['link']:>10,} "
              f"{r.stats.bytes['HBM->link']:>12,} {u:>16,} {f:>9,} "
              f"{_how('matmul_all_reduce', tokens, 4096, p, plan):>18} {u / f:>7.2f}x", flush=True)


def _simulate_steps(steps, device):
    total = 0
    for kernel, specs, params, values in steps:
        xs = [values.get(i, np.zeros(shape, np.float16 if dt == "float16" else getattr(np, dt)))
              for i, (shape, dt) in enumerate(specs)]
        total += npu.run(kernel, *xs, device=device, **params).stats.cycles
    return total


def expert_parallel(prefill_tokens):
    """EP 8 on the 910B2: 32 experts (4 per rank), hidden 4096 -> expert width 1536, top-8 routing spread
    evenly; the unfused path's eight launches against one fused launch at the chunk count the model picks."""
    from cost_model.moe_ep import choose_chunks, unfused_steps
    dev, p, E_l, K, N, k = "ascend910b", 8, 4, 4096, 1536, 8
    print(f"\n## Expert parallelism at EP {p} on {dev} ({p * E_l} experts, {E_l} per rank, hidden {K}, expert "
          f"width {N}, top-{k}, even routing), fp16: simulated cycles")
    print(f"{'tokens/rank':>11} {'rows':>6} {'unfused (8 launches)':>20} {'fused':>9} {'chunks':>6} {'speed-up':>8} "
          f"{'dispatch all-to-all':>20} {'its bandwidth':>14}")
    for tokens in (16, prefill_tokens):
        S = tokens * k
        ids = np.repeat(np.arange(p * E_l), S // (p * E_l)).astype(np.int32)
        unfused = _simulate_steps(unfused_steps(S, K, N, E_l, p), dev)
        chunks, _ = choose_chunks(S, K, N, E_l, p, dev)
        fused = npu.run("moe_dispatch_combine", _zeros((S, K)), ids, _zeros((E_l, K, N)), device=dev, world=p,
                        chunks=chunks).stats.cycles
        a2a = npu.run("all_to_all", _zeros((S, K)), device=dev, world=p).stats
        # bytes each rank sends over the launch's time, as all-to-all benchmarks quote a "bottleneck bandwidth"
        bw = a2a.bytes["HBM->link"] / a2a.seconds / 1e9
        print(f"{tokens:>11} {S:>6} {unfused:>20,} {fused:>9,} {chunks:>6} {unfused / fused:>7.2f}x "
              f"{a2a.seconds * 1e6:>17.1f} µs {bw:>10.0f} GB/s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-worlds", action="store_true", help="leave out the gloo worlds (part 1)")
    a = ap.parse_args(argv)
    if not a.skip_worlds:
        worlds((2, 4) if a.quick else (2, 4, 8))
    layer(1024 if a.quick else 4096)
    ring_check((32 if a.quick else 256) << 20)
    scaling(1024 if a.quick else 4096)
    expert_parallel(128 if a.quick else 512)


if __name__ == "__main__":
    main()
