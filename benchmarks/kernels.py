"""Simulated kernels: cycles, bottleneck, HBM traffic against the minimum, and simulator speed against torch.

Per kernel and shape: simulated cycles and µs, the busiest unit and its utilisation, HBM bytes over the
least possible (inputs read once, outputs written once), and the wall time of the simulator call next to
torch's CPU wall time for the same computation in fp32 (same process; warm-up, then best of ``--repeat``).

    matmul           2048³ fp16 on every device
    softmax          4096 x 4096 fp16, last dim (skipped if the kernel is not registered)
    flash_attention  B=1, N=16, S=2048, D=128 fp16 on the 910 (the acceptance shape, with its checks),
                     and the 910B sweep S = 2048, 4096, 8192 (N = 8) in TFLOP/s next to published figures
    flash_attention_grad  its backward (FlashAttentionScoreGrad) on a GPT-2 layer's causal attention,
                     B=8, N=12, S=1024, D=64 fp16, every device, next to the forward: timing only
    sliding window   Mistral-7B v0.1's (S=8192, window 4096) and a GPT-OSS-120B local layer's (S=4096, window
                     128) forward and backward on the 910: the band read as a mask, causal, the window
    learned bias + causal mask  T5-base-shaped decoder self-attention (N=12, D=64, fp32) at 1024-4096 tokens on
                     the 910: the mask read by the full kernel against the causal skip (score_bound + bias_bound +
                     the causal kernel reading the bias), timing only; and T5-base's 12 decoder layers at batch 1:
                     the mask read x12 against one shared bias_bound + 12 x (score_bound + causal kernel), with the
                     cost model's choice; ``--bias-causal`` runs this part alone

FlashAttention FLOPs: 4·B·N·Sq·Skv·D (Q·Kᵀ and P·V; causal would count attended scores only).

    python benchmarks/kernels.py            # everything, ~2-4 min on 2 cores
    python benchmarks/kernels.py --quick    # matmul, softmax, the acceptance shape, the sweep's S=2048

BLAS threads. The simulator's Cube products are numpy batched matmuls: one small GEMM per simulated core.
Multithreaded OpenBLAS hands each of them to its worker threads; when other processes keep the CPUs busy,
every hand-off waits for a scheduler time slice and a 4 ms product can take 700 ms (measured here at load
average 7 on 2 CPUs). The simulator therefore holds numpy's OpenBLAS at one thread inside a kernel
(``autofuse.npu.machine.host_blas``) and splits the cores over its own host threads instead. This script's
``--blas-threads`` sets numpy's OpenBLAS threads outside the simulator (through OpenBLAS's own
``set_num_threads``); the acceptance shape is timed both with one thread and with OpenBLAS's default, and
both ratios are printed. torch keeps its own threads throughout.
"""
import argparse
import ctypes
import glob
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from autofuse import npu
from autofuse.npu.kernels.flash_attention import flops as fa_flops
from autofuse.npu.kernels.flash_attention import min_hbm_bytes



def _openblas():
    """numpy's bundled OpenBLAS (set, get) thread-count functions, or None."""
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "*openblas*.so*"))
    for path in libs:
        lib = ctypes.CDLL(path)
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                set_, get = f"{prefix}_set_num_threads{suffix}", f"{prefix}_get_num_threads{suffix}"
                if hasattr(lib, set_) and hasattr(lib, get):
                    return getattr(lib, set_), getattr(lib, get)
    return None


BLAS = _openblas()
BLAS_DEFAULT = BLAS[1]() if BLAS else None


def set_blas_threads(n):
    """``n`` threads for numpy's OpenBLAS ("default": as it started); returns the count now in use."""
    if BLAS is None:
        return None
    BLAS[0](BLAS_DEFAULT if n == "default" else int(n))
    return BLAS[1]()


# Published FlashAttention throughput on a 910B2, D=128, normalised to 24 cores (shared/npu-facts.md)
PUBLISHED_910B = (85.0, 190.0)


def best(fn, repeat):
    """Warm up once, then the best wall time of ``repeat`` calls (and the last result)."""
    out = fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def row(kernel, shape, device, r, least, t_sim, t_torch, extra=""):
    st = r.stats
    b = st.bound
    ratio = t_sim / t_torch if t_torch else float("nan")
    print(f"{kernel:16s} {shape:22s} {device:11s} {st.cycles:>11,} {st.seconds * 1e6:>9.1f} "
          f"{b:>7s} {st.util[b]:>5.0%} {st.hbm_bytes / 2**20:>8.1f} {st.hbm_bytes / least:>6.2f}x "
          f"{t_sim:>8.3f} {t_torch:>8.3f} {ratio:>6.1f}x  {extra}")


def header():
    print(f"{'kernel':16s} {'shape':22s} {'device':11s} {'cycles':>11s} {'µs':>9s} {'busiest':>7s} {'util':>5s} "
          f"{'HBM MiB':>8s} {'/min':>7s} {'sim s':>8s} {'torch s':>8s} {'ratio':>7s}")


def bench_matmul(repeat):
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(2048, 2048, generator=g).half() for _ in range(2))
    t_torch, _ = best(lambda: a.float() @ b.float(), repeat)
    least = 3 * 2048 * 2048 * 2
    for dev in npu.devices():
        t_sim, r = best(lambda: npu.run("matmul", a, b, device=dev), repeat)
        row("matmul", "2048x2048x2048 fp16", dev, r, least, t_sim, t_torch)


def bench_softmax(repeat):
    if "softmax" not in npu.KERNELS:
        print("softmax          (kernel not registered yet: skipped)")
        return
    x = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(1)).half()
    xf = x.float()
    t_torch, _ = best(lambda: torch.softmax(xf, -1), repeat)
    least = 2 * x.numel() * 2
    for dev in npu.devices():
        t_sim, r = best(lambda: npu.run("softmax", x, dim=-1, device=dev), repeat)
        row("softmax", "4096x4096 fp16", dev, r, least, t_sim, t_torch)


def _qkv(B, N, S, D, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, N, S, D, generator=g).half() for _ in range(3)]


def _side_by_side(q, k, v, qf, kf, vf, repeat):
    """Best wall times of torch SDPA and the simulator, alternated so both see the same machine load."""
    t_torch, t_sim = [], []
    ref = F.scaled_dot_product_attention(qf, kf, vf)
    r = npu.run("flash_attention", q, k, v, device="ascend910")
    for _ in range(repeat):
        t = time.perf_counter()
        ref = F.scaled_dot_product_attention(qf, kf, vf)
        t_torch.append(time.perf_counter() - t)
        t = time.perf_counter()
        r = npu.run("flash_attention", q, k, v, device="ascend910")
        t_sim.append(time.perf_counter() - t)
    return min(t_torch), min(t_sim), ref, r


def bench_fa_acceptance(repeat, blas):
    B, N, S, D = 1, 16, 2048, 128
    q, k, v = _qkv(B, N, S, D)
    qf, kf, vf = q.float(), k.float(), v.float()
    timings = {}
    for setting in dict.fromkeys([blas, "default"]):
        used = set_blas_threads(setting)
        timings[setting] = (used, os.getloadavg()[0]) + _side_by_side(q, k, v, qf, kf, vf, repeat)
    set_blas_threads(blas)
    _, _, t_torch, t_sim, ref, r = timings[blas]
    least = min_hbm_bytes(q.shape, k.shape, v.shape, "float16")
    st = r.stats
    tflops = fa_flops(B, N, S, S, D) / st.seconds / 1e12
    row("flash_attention", "1x16x2048x128 fp16", "ascend910", r, least, t_sim, t_torch, f"{tflops:.0f} TFLOP/s")
    err = float(np.abs(r.outputs[0].astype(np.float32) - ref.numpy()).max())
    checks = [("max |out - torch fp32 SDPA|", f"{err:.2e}", "<= 2e-3", err <= 2e-3),
              (f"busiest unit ({st.bound}) utilisation", f"{st.util[st.bound]:.3f}", ">= 0.80",
               st.util[st.bound] >= 0.80),
              ("HBM bytes / minimum", f"{st.hbm_bytes / least:.3f}", "<= 1.5", st.hbm_bytes <= 1.5 * least)]
    for setting, (used, load, tt, ts, _, _) in timings.items():
        checks.append((f"sim / torch wall, BLAS threads {used}", f"{ts / tt:.2f} ({ts:.3f} s / {tt:.3f} s)",
                       f"<= 3; load avg {load:.1f}", ts <= 3 * tt))
    print(f"\n  acceptance on ascend910 ({os.cpu_count()} CPUs):")
    for name, got, want, ok in checks:
        print(f"    {'PASS' if ok else 'FAIL'}  {name:36s} {got:32s} (want {want})")
    print(f"    {st}\n")
    return st


def bench_fa_sweep(sizes, N=8):
    lo, hi = PUBLISHED_910B
    print(f"  910B fidelity (B=1, N={N}, D=128 fp16; FLOPs = 4·B·N·S²·D; published {lo:.0f}-{hi:.0f} TFLOP/s):")
    rows = []
    for S in sizes:
        q, k, v = _qkv(1, N, S, 128, seed=3)
        t = time.perf_counter()
        r = npu.run("flash_attention", q, k, v, device="ascend910b")
        t_sim = time.perf_counter() - t
        qf, kf, vf = q.float(), k.float(), v.float()
        t = time.perf_counter()
        F.scaled_dot_product_attention(qf, kf, vf)
        t_torch = time.perf_counter() - t
        least = min_hbm_bytes(q.shape, k.shape, v.shape, "float16")
        tf = fa_flops(1, N, S, S, 128) / r.stats.seconds / 1e12
        off = tf / hi if tf > hi else (lo / tf if tf < lo else 1.0)
        note = "within" if off == 1.0 else f"{'above' if tf > hi else 'below'} by {off:.2f}x"
        row("flash_attention", f"1x{N}x{S}x128 fp16", "ascend910b", r, least, t_sim, t_torch,
            f"{tf:.0f} TFLOP/s ({note}; 1 run)")
        rows.append((S, tf))
    return rows


def bench_fa_backward(B=8, N=12, S=1024, D=64):
    """The attention backward next to its forward (timing only: the same statistics as a full launch,
    tests/npu/test_timing_only.py), with the row statistics recomputed (what the fused op's backward runs
    today: the forward does not output them) and given (CANN's softmax_max / softmax_sum)."""
    print(f"  attention backward, B={B} N={N} S={S} D={D} fp16 causal (cycles; timing only):")
    q, k, v = _qkv(B, N, S, D, seed=4)
    o, do = _qkv(B, N, S, D, seed=5)[:2]
    stats = {"softmax_max": torch.zeros(B, N, S), "softmax_sum": torch.ones(B, N, S)}
    for dev in npu.devices():
        fwd = npu.run("flash_attention", q, k, v, causal=True, device=dev, timing_only=True).stats
        bwd = npu.run("flash_attention_grad", q, k, v, o, do, causal=True, device=dev, timing_only=True).stats
        saved = npu.run("flash_attention_grad", q, k, v, o, do, causal=True, device=dev, timing_only=True,
                        **stats).stats
        print(f"    {dev:<11} forward {fwd.cycles:>10,}   backward {bwd.cycles:>10,} ({bwd.cycles / fwd.cycles:.2f}x the "
              f"forward, bound {bwd.bound})   with saved statistics {saved.cycles:>10,} "
              f"({saved.cycles / fwd.cycles:.2f}x)")


WINDOWS = [  # (name, B, N, Nkv, S, D, window): a sliding window's layers at their models' shapes
    ("Mistral-7B v0.1", 1, 32, 8, 8192, 128, 4096),
    ("GPT-OSS-120B local layer", 1, 64, 8, 4096, 64, 128),
]


def bench_fa_window(rows=WINDOWS, device="ascend910"):
    """Sliding-window attention (CANN's band sparse mode) forward and backward (saved statistics), timing only:
    the band read as a bool mask over every tile (how the kernel ran a sliding window before it had one), the
    causal kernel (the window as wide as the sequence), and the window (the band's tiles, no mask)."""
    print(f"  sliding-window attention, fp16, {device} (cycles; timing only):")
    for name, B, N, Nkv, S, D, w in rows:
        q = np.zeros((B, N, S, D), np.float16)
        kv = np.zeros((B, Nkv, S, D), np.float16)
        band = (np.arange(S)[None, :] <= np.arange(S)[:, None]) & (np.arange(S)[None, :] > np.arange(S)[:, None] - w)
        stats = {"softmax_max": np.zeros((B, N, S), np.float32), "softmax_sum": np.ones((B, N, S), np.float32)}
        cells = []
        for kind, kw in (("band as a mask", {"mask": band}), ("causal", {"causal": True}),
                         ("window", {"causal": True, "window": w})):
            f = npu.run("flash_attention", q, kv, kv, device=device, timing_only=True, **kw).stats
            b = npu.run("flash_attention_grad", q, kv, kv, q, q, device=device, timing_only=True, **kw, **stats).stats
            cells.append((kind, f.cycles, b.cycles))
        print(f"    {name} (B{B} N{N}/{Nkv} S{S} D{D}, window {w}):")
        for kind, fc, bc in cells:
            print(f"      {kind:<15} forward {fc:>12,}  backward {bc:>12,}")
        (_, mf, mb), (_, cf, cb), (_, wf, wb) = cells
        print(f"      window vs band as a mask: forward {mf / wf:.2f}x, backward {mb / wb:.2f}x; "
              f"vs causal: forward {cf / wf:.2f}x, backward {cb / wb:.2f}x")


BIAS_CAUSAL = [(1, 1024), (1, 2048), (4, 2048), (1, 4096)]      # (B, S) at T5-base's N=12, D=64


def bench_bias_causal(rows=BIAS_CAUSAL, N=12, D=64, device="ascend910"):
    """T5's decoder self-attention, ``scores + position_bias + causal_mask`` in fp32: the mask read by the full
    kernel (the bias and the causal mask, one [1, N, S, S] additive mask) against the causal skip the fused op runs
    where its run-time bounds hold (``score_bound`` on q and k, ``bias_bound`` on the bias, then the causal kernel
    reading the bias in the kept tiles), timing only."""
    print(f"  learned bias + causal mask (T5-base decoder self-attention, N{N} D{D} fp32), {device} "
          f"(cycles; timing only):")
    for B, S in rows:
        q = np.zeros((B, N, S, D), np.float32)
        bias = np.zeros((1, N, S, S), np.float32)
        read = npu.run("flash_attention", q, q, q, mask=bias, device=device, timing_only=True).stats
        parts = [npu.run("score_bound", q, q, device=device, timing_only=True).stats,
                 npu.run("bias_bound", bias, device=device, timing_only=True).stats,
                 npu.run("flash_attention", q, q, q, mask=bias, causal=True, device=device, timing_only=True).stats]
        skip = sum(p.cycles for p in parts)
        print(f"    B{B} S{S}: mask read {read.cycles:>12,}  skip {skip:>12,} (bounds {parts[0].cycles:,} + "
              f"{parts[1].cycles:,}, causal kernel {parts[2].cycles:,})  {read.cycles / skip:.2f}x; attention "
              f"kernel alone {read.cycles / parts[2].cycles:.2f}x")


BIAS_CAUSAL_LAYERS = [(1, 1024), (1, 2048), (1, 4096)]         # (B, S), T5-base's 12 decoder layers


def bench_bias_causal_layers(rows=BIAS_CAUSAL_LAYERS, layers=12, N=12, D=64, device="ascend910"):
    """T5-base's decoder self-attention over its ``layers`` layers, which all read the one position bias the first
    computes: the mask read in every layer against one shared ``bias_bound`` launch plus, per layer, ``score_bound``
    and the causal kernel reading the bias (and, for comparison, the bias bounded in every layer, as each block did
    before the bound was shared). Every launch runs on the simulator (timing only), once per distinct launch: the
    layers' launches are identical (same shapes, parameters, tiling; each starts with a cold L2), so a layer's
    figure is its launch's, times ``layers``. Each kernel runs with the tiling the cost model picks for it (what an
    O3 plan passes). The cost model's choice is the planner's rule: per block, the mask read against the skip with
    its 1/``layers`` share of the bias bound (:func:`autofuse.fused.bias_bound_share`)."""
    import cost_model
    from autofuse.fused import bias_bound_share
    L = layers
    print(f"  {L} layers sharing one bias (T5-base decoder self-attention, N{N} D{D} fp32), {device} (cycles; "
          f"timing only; each kernel with the cost model's tiling):")
    for B, S in rows:
        q = np.zeros((B, N, S, D), np.float32)
        bias = np.zeros((1, N, S, S), np.float32)
        specs, bspec = [((B, N, S, D), "float32")] * 3, ((1, N, S, S), "float32")
        est = {"read": cost_model.estimate("flash_attention", specs, device=device, scale=1.0, causal=False,
                                           return_probs=False, mask=bspec),
               "causal": cost_model.estimate("flash_attention", specs, device=device, scale=1.0, causal=True,
                                             return_probs=False, mask=bspec),
               "score": cost_model.estimate("score_bound", specs[:2], device=device),
               "bias": cost_model.estimate("bias_bound", [bspec], device=device)}
        run = {"read": npu.run("flash_attention", q, q, q, mask=bias, scale=1.0, tiling=dict(est["read"].tiling),
                               device=device, timing_only=True).stats,
               "causal": npu.run("flash_attention", q, q, q, mask=bias, scale=1.0, causal=True,
                                 tiling=dict(est["causal"].tiling), device=device, timing_only=True).stats,
               "score": npu.run("score_bound", q, q, device=device, timing_only=True).stats,
               "bias": npu.run("bias_bound", bias, device=device, timing_only=True).stats}
        c = {k: v.cycles for k, v in run.items()}
        read, shared = L * c["read"], c["bias"] + L * (c["score"] + c["causal"])
        per_call = L * (c["bias"] + c["score"] + c["causal"])
        share = bias_bound_share(L, bspec, device).cycles
        p_read, p_skip = int(est["read"].cycles), int(est["score"].cycles + est["causal"].cycles) + share
        choice = "skip" if p_skip < p_read else "mask read"
        print(f"    B{B} S{S}: mask read x{L} {read:>13,}  shared bound + {L} skips {shared:>13,} "
              f"({read / shared:.2f}x; bias_bound {c['bias']:,} once, score_bound {c['score']:,} + causal kernel "
              f"{c['causal']:,} per layer); bound in every layer {per_call:,} ({read / per_call:.2f}x)")
        print(f"      cost model per block: mask read {p_read:,}, skip {p_skip:,} (its 1/{L} of the bias bound "
              f"{share:,}) -> {choice}; simulated per block: mask read {c['read']:,}, skip "
              f"{c['score'] + c['causal'] + -(-c['bias'] // L):,}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a fast subset")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls after one warm-up (best is kept)")
    ap.add_argument("--blas-threads", default="1", help="numpy's OpenBLAS threads: a number or 'default'")
    ap.add_argument("--bias-causal", action="store_true", help="only the learned bias + causal mask comparison")
    a = ap.parse_args()
    if a.bias_causal:
        bench_bias_causal()
        print()
        bench_bias_causal_layers()
        return
    t0 = time.perf_counter()
    used = set_blas_threads(a.blas_threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; numpy {np.__version__}, OpenBLAS "
          f"threads {used if BLAS else 'unknown (not settable)'} (its default {BLAS_DEFAULT}); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    header()
    bench_matmul(a.repeat)
    bench_softmax(a.repeat)
    bench_fa_acceptance(a.repeat, a.blas_threads)
    bench_fa_sweep([2048] if a.quick else [2048, 4096, 8192])
    print()
    bench_fa_backward()
    print()
    bench_fa_window(WINDOWS[1:] if a.quick else WINDOWS)
    print()
    bench_bias_causal(BIAS_CAUSAL[1:2] if a.quick else BIAS_CAUSAL)
    bench_bias_causal_layers(BIAS_CAUSAL_LAYERS[:1] if a.quick else BIAS_CAUSAL_LAYERS)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
