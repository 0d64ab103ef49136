"""MoE kernels on the simulator: fused vs the unfused chain eager launches, kernel by kernel.

    python benchmarks/moe_kernels.py            # 7B-class MoE shapes (Mixtral-8x7B: H 4096, I 14336, 8 experts,
                                                # top-2, 4096 tokens) on ascend910
    python benchmarks/moe_kernels.py --quick    # smaller shapes
    python benchmarks/moe_kernels.py --device ascend910b
    python benchmarks/moe_kernels.py --model gpt_oss   # GPT-OSS-120B's MoE shapes (H 2880, I 2880, 128 experts,
                                                       # top-4): biases, the clamped SwiGLU on interleaved pairs
    python benchmarks/moe_kernels.py --model llama4    # Llama 4 Scout's experts (H 5120, I 8192, 16 experts,
                                                       # top-1) in their dense form
    python benchmarks/moe_kernels.py --model loop      # Mixtral's shapes, the experts a hand-written layer's loop
                                                       # over a list of nn.Linear experts

Every figure is simulated cycles (``npu.run``), each kernel with the tiling the cost model's search picks, on
both sides. The unfused chains are what eager runs, priced with the competent kernels of the same
simulator (``topk``, ``gather``, ``matmul_per_group``, ...; ops without a kernel of their own — sort,
histc, cumsum, the inverse permutation's index_put — as ``generic`` Vector passes):

* gating: bf16 logits → cast to fp32, softmax, topk, sum, div (Mixtral's router after its linear) vs
  ``moe_gating_topk``;
* experts GEMMs: ``grouped_mm_fallback`` (one matmul launch per expert) for gate_up, silu(gate) · up as two
  elementwise launches, the down projection per expert, vs ``grouped_matmul`` with the SwiGLU epilogue and
  ``grouped_matmul`` for down; at a decode load (64 tokens per expert) and a prefill load;
* GPT-OSS (``--model gpt_oss``): the router takes the top k of the bf16 logits, then the softmax over the k (two
  launches) vs ``moe_gating_topk(norm="topk_softmax")``; the experts' weights are stored ``[E, in, out]`` and read
  as stored, each GEMM's per-expert bias is gathered by the sorted expert ids and added (a gather and an add per
  GEMM), and the activation runs op by op: ``min(gate, 7)``, ``max(up, -7)``, ``min(·, 7)``, ``gate·1.702``,
  ``sigmoid``, ``gate·sigmoid``, ``up + 1``, the product (eight launches over ``[M, I]``; the interleaved halves are
  priced as contiguous reads, which favours the unfused side) vs ``grouped_matmul`` with both biases and the
  ``clamped_swiglu`` epilogue on interleaved pairs, and ``grouped_matmul`` with its bias;
* Llama 4 (``--model llama4``): its experts as eager runs them, every token through every expert (the scores
  scattered from the top k into -inf, sigmoid, transposed; the tokens repeated per expert and scaled; a matmul
  per expert over all the tokens, SiLU and the product, the down matmul per expert, the sum over the experts) vs
  the fused graph's sparse form (sigmoid of the k scores, ``moe_init_routing``, the scores put at the routed rows
  and scaling them, ``grouped_matmul`` with the SwiGLU epilogue, ``grouped_matmul``, ``moe_finalize_routing``);
  the router's top-k runs on both sides;
* a hand-written layer (``--model loop``): its loop over the experts as eager runs it (per expert the selection,
  ``torch.where``, the gather, three matmuls, SiLU and the product, the weights' gather, the scaling, the in-place
  ``index_add_``) vs the fused block (routing, two grouped GEMMs over the experts' weight lists, the combine);
* routing + finalize: sort of the expert ids, ``perm // k``, the token gather, the weights' gather, histc,
  cumsum (transformers' grouped_mm path) and, after the experts, the weighting, the inverse permutation, its
  gather and the sum over k vs ``moe_init_routing`` + ``moe_finalize_routing``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import cost_model
from autofuse import npu


def run(kernel, arrays, device, timing_only=False, **params):
    """Simulated cycles of one launch with the tiling the cost model's search picks (``group_sizes`` goes to
    the model only: the kernel reads the group list)."""
    specs = [None if a is None else (tuple(a.shape), str(a.dtype).replace("torch.", "")) for a in arrays]
    e = cost_model.estimate(kernel, specs, device=device, **params)
    p = {k: v for k, v in params.items() if k != "group_sizes"}
    if e.tiling:
        p["tiling"] = e.tiling
    return npu.run(kernel, *arrays, device=device, timing_only=timing_only, **p).stats.cycles


def generic(ins, outs, device, timing_only=False):
    return npu.run("generic", *ins, device=device, outputs=[(tuple(s), d) for s, d in outs],
                   timing_only=timing_only).stats.cycles


def gating(T, E, k, device):
    torch.manual_seed(0)
    logits = torch.randn(T, E).to(torch.bfloat16)
    f = logits.float()
    unfused = [run("elementwise", [logits], device, op="cast", out_dtype="float32"),
               run("softmax", [f], device, dim=-1),
               run("topk", [torch.softmax(f, -1)], device, k=k),
               run("reduce", [torch.zeros(T, k)], device, op="sum", dim=-1, keepdim=True),
               run("elementwise", [torch.zeros(T, k), torch.ones(T, 1)], device, op="div")]
    fused = run("moe_gating_topk", [logits], device, k=k, renorm=True, eps=0.0)
    return sum(unfused), fused, len(unfused)


def experts(T, H, I, E, k, device, dtype=torch.bfloat16):
    """gate_up + SwiGLU + down for T tokens, top-k of E experts, even loads."""
    M = T * k
    sizes = tuple(M // E + (g < M % E) for g in range(E))
    x = torch.zeros(M, H, dtype=dtype)
    gate_up = torch.zeros(E, 2 * I, H, dtype=dtype)
    down = torch.zeros(E, H, I, dtype=dtype)
    offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32)
    counts = torch.tensor(sizes, dtype=torch.int32)
    h2 = torch.zeros(M, 2 * I, dtype=dtype)
    h = torch.zeros(M, I, dtype=dtype)
    unfused = [run("matmul_per_group", [x, gate_up, offs], device, trans_w=True, group_sizes=sizes),
               run("elementwise", [h], device, op="silu"),
               run("elementwise", [h, h], device, op="mul"),
               run("matmul_per_group", [h, down, offs], device, trans_w=True, group_sizes=sizes)]
    del h2
    fused = [run("grouped_matmul", [x, gate_up, counts], device, trans_w=True, activation="swiglu",
                 group_sizes=sizes),
             run("grouped_matmul", [h, down, counts], device, trans_w=True, group_sizes=sizes)]
    return sum(unfused), sum(fused), len(unfused), unfused, fused


def gating_topk_first(T, E, k, device):
    """GPT-OSS's router after its linear: top k of the bf16 logits, softmax over the k chosen (in fp32)."""
    torch.manual_seed(0)
    logits = torch.randn(T, E).to(torch.bfloat16)
    unfused = [run("topk", [logits], device, k=k),
               run("softmax", [torch.zeros(T, k)], device, dim=-1)]
    fused = run("moe_gating_topk", [logits], device, k=k, norm="topk_softmax")
    return sum(unfused), fused, len(unfused)


def experts_clamped(T, H, I, E, k, device, dtype=torch.bfloat16):
    """GPT-OSS's experts for T tokens, top-k of E, even loads: gate_up (+ bias) + clamped SwiGLU on interleaved
    pairs + down (+ bias). Timed on shapes (meta tensors; the group list and the gathers' indices real): its
    weights alone are 6 GB."""
    M = T * k
    sizes = tuple(M // E + (g < M % E) for g in range(E))

    def meta(*shape):
        return torch.empty(shape, dtype=dtype, device="meta")
    x, h2, h, y = meta(M, H), meta(M, 2 * I), meta(M, I), meta(M, H)
    gate_up, down, b1, b2 = meta(E, H, 2 * I), meta(E, I, H), meta(E, 2 * I), meta(E, H)
    ids = torch.repeat_interleave(torch.arange(E, dtype=torch.int32), torch.tensor(sizes))
    offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32)
    counts = torch.tensor(sizes, dtype=torch.int32)
    t = dict(timing_only=True)
    unfused = [run("matmul_per_group", [x, gate_up, offs], device, group_sizes=sizes, **t),
               run("gather", [b1, ids], device, **t), run("elementwise", [h2, h2], device, op="add", **t),
               run("elementwise", [h], device, op="minimum", scalar=7.0, **t),
               run("elementwise", [h], device, op="maximum", scalar=-7.0, **t),
               run("elementwise", [h], device, op="minimum", scalar=7.0, **t),
               run("elementwise", [h], device, op="mul", scalar=1.702, **t),
               run("elementwise", [h], device, op="sigmoid", **t),
               run("elementwise", [h, h], device, op="mul", **t),
               run("elementwise", [h], device, op="add", scalar=1.0, **t),
               run("elementwise", [h, h], device, op="mul", **t),
               run("matmul_per_group", [h, down, offs], device, group_sizes=sizes, **t),
               run("gather", [b2, ids], device, **t), run("elementwise", [y, y], device, op="add", **t)]
    fused = [run("grouped_matmul", [x, gate_up, counts, b1], device, activation="clamped_swiglu",
                 swiglu_order="interleaved", limit=7.0, alpha=1.702, group_sizes=sizes, **t),
             run("grouped_matmul", [h, down, counts, b2], device, group_sizes=sizes, **t)]
    return sum(unfused), sum(fused), len(unfused), unfused, fused


def routing(T, H, E, k, device, dtype=torch.bfloat16):
    torch.manual_seed(1)
    n = T * k
    x = torch.zeros(T, H, dtype=dtype)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)
    perm = torch.sort(ids.flatten().long(), stable=True).indices
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)
    y = torch.zeros(n, H, dtype=dtype)
    w = torch.rand(T, k)
    i64 = "int64"
    unfused = [generic([ids.long().flatten()], [((n,), i64), ((n,), i64)], device),          # sort
               run("elementwise", [perm.int()], device, op="div", scalar=float(k)),            # perm // k
               run("gather", [x, (perm // k).int()], device),                                 # x[perm // k]
               generic([w.flatten(), perm], [((n,), "float32")], device),                      # weights[perm]
               generic([perm.float()], [((E,), "float32")], device),                           # histc
               generic([torch.zeros(E)], [((E,), "int32")], device),                           # cumsum
               # after the experts:
               run("elementwise", [y, torch.zeros(n, 1)], device, op="mul"),                   # * weights (fp32)
               generic([perm], [((n,), i64)], device),                                         # inv_perm (index_put)
               run("gather", [torch.zeros(n, H), inv.int()], device),                          # [inv_perm]
               run("reduce", [torch.zeros(T, k, H)], device, op="sum", dim=1),                 # sum over k
               run("elementwise", [torch.zeros(T, H)], device, op="cast", out_dtype="bfloat16")]
    fused = [run("moe_init_routing", [x, ids], device, num_experts=E),
             run("moe_finalize_routing", [y, w, inv.int()], device)]
    return sum(unfused), sum(fused), len(unfused)


def dense_experts(T, H, I, E, k, device, dtype=torch.bfloat16):
    """Llama 4's experts block after its router's linear, as eager runs it (every token through every expert) and as
    the fused graph runs it (each token through its k picks)."""
    torch.manual_seed(2)
    logits = torch.randn(T, E).to(dtype)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int()
    EM, M = E * T, T * k
    f32 = "float32"
    dt = str(dtype).replace("torch.", "")
    x = torch.zeros(T, H, dtype=dtype)
    gate_up, down = torch.zeros(E, H, 2 * I, dtype=dtype), torch.zeros(E, I, H, dtype=dtype)
    dense = tuple([T] * E)
    counts = np.bincount(ids.flatten().numpy(), minlength=E)
    sizes = tuple(int(c) for c in counts)
    perm = torch.sort(ids.flatten().long(), stable=True).indices
    rows = torch.empty_like(perm)
    rows[perm] = torch.arange(M)
    topk = run("topk", [logits], device, k=k)                   # the router's top k: the same on both sides
    unfused = [topk,
               generic([torch.zeros(T, k, dtype=dtype), ids.long()], [((T, E), dt)], device),   # full_like, scatter
               run("elementwise", [logits], device, op="cast", out_dtype=f32),
               run("elementwise", [torch.zeros(T, E)], device, op="sigmoid"),
               run("elementwise", [torch.zeros(T, E)], device, op="cast", out_dtype=dt),
               generic([logits], [((E, T), dt)], device),                                       # scores transposed
               generic([x], [((EM, H), dt)], device),                                           # x.repeat(E, 1)
               run("elementwise", [torch.zeros(EM, H, dtype=dtype), torch.zeros(EM, 1, dtype=dtype)], device,
                   op="mul"),
               run("matmul_per_group", [torch.zeros(EM, H, dtype=dtype), gate_up,
                                        torch.tensor(np.cumsum(dense), dtype=torch.int32)], device, group_sizes=dense),
               run("elementwise", [torch.zeros(EM, I, dtype=dtype)], device, op="silu"),
               run("elementwise", [torch.zeros(EM, I, dtype=dtype)] * 2, device, op="mul"),
               run("matmul_per_group", [torch.zeros(EM, I, dtype=dtype), down,
                                        torch.tensor(np.cumsum(dense), dtype=torch.int32)], device, group_sizes=dense),
               run("reduce", [torch.zeros(E, T, H, dtype=dtype)], device, op="sum", dim=0)]
    cnt = torch.tensor(sizes, dtype=torch.int32)
    fused = [topk,
             run("elementwise", [torch.zeros(T, k, dtype=dtype)], device, op="cast", out_dtype=f32),
             run("elementwise", [torch.zeros(T, k)], device, op="sigmoid"),
             run("elementwise", [torch.zeros(T, k)], device, op="cast", out_dtype=dt),
             run("moe_init_routing", [x, ids], device, num_experts=E),
             generic([torch.zeros(M, dtype=dtype), rows], [((M,), dt)], device),               # scores at the rows
             run("elementwise", [torch.zeros(M, H, dtype=dtype), torch.zeros(M, 1, dtype=dtype)], device, op="mul"),
             run("grouped_matmul", [torch.zeros(M, H, dtype=dtype), gate_up, cnt], device, activation="swiglu",
                 group_sizes=sizes),
             run("grouped_matmul", [torch.zeros(M, I, dtype=dtype), down, cnt], device, group_sizes=sizes),
             run("moe_finalize_routing", [torch.zeros(M, H, dtype=dtype), torch.ones(T, k), rows.int()], device)]
    return sum(unfused), sum(fused), len(unfused), len(fused)


def _table(rows):
    """One line per block: (name, unfused cycles, fused cycles, their launches[, the target speed-up])."""
    targets = any(len(r) > 5 for r in rows)
    print(f"{'block':58s} {'unfused':>12s} {'launches':>8s} {'fused':>12s} {'launches':>8s} {'speed-up':>9s}"
          + (f" {'target':>7s}" if targets else ""))
    for name, u, f, nu, nf, *target in rows:
        print(f"{name:58s} {u:>12,} {nu:>8d} {f:>12,} {nf:>8d} {u / f:>8.2f}x" + "".join(f" {t:>7s}" for t in target))


def loop_experts(T, H, I, E, k, device, dtype=torch.bfloat16):
    """A hand-written MoE layer's experts (each three ``nn.Linear``s), as its loop runs them in eager, expert by
    expert: ``tok, slot = torch.where(ids == e)``, ``x[tok]``, the gate and up projections, SiLU and the product, the
    down projection, ``w[tok, slot, None]``, the scaling, ``out.index_add_(0, tok, .)`` (in place: the expert's rows
    read and written), after one zero fill of ``out``; vs the fused block: ``moe_init_routing``, ``grouped_matmul``
    over the lists of the experts' gate and up projections with the SwiGLU epilogue, ``grouped_matmul`` over the
    down projections, ``moe_finalize_routing``. Even loads; timed on shapes (the indices real)."""
    M = T * k
    sizes = tuple(M // E + (g < M % E) for g in range(E))
    dt = str(dtype).replace("torch.", "")
    t = dict(timing_only=True)

    def meta(*shape, dtype=dtype):
        return torch.empty(shape, dtype=dtype, device="meta")
    torch.manual_seed(3)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int()
    unfused = [generic([meta(T, H)], [((T, H), dt)], device, **t)]          # out = zeros_like(x)
    for e, n in enumerate(sizes):
        tok = torch.randint(0, T, (n,), dtype=torch.int32)
        unfused += [generic([ids], [((T, k), "bool")], device),                    # ids == e
                    generic([meta(T, k, dtype=torch.bool)], [((n,), "int64"), ((n,), "int64")], device, **t),  # where
                    run("gather", [meta(T, H), tok], device, **t),                  # x[tok]
                    run("matmul", [meta(n, H), meta(I, H)], device, trans_b=True, **t),        # gate
                    run("matmul", [meta(n, H), meta(I, H)], device, trans_b=True, **t),        # up
                    run("elementwise", [meta(n, I)], device, op="silu", **t),
                    run("elementwise", [meta(n, I), meta(n, I)], device, op="mul", **t),
                    run("matmul", [meta(n, I), meta(H, I)], device, trans_b=True, **t),        # down
                    generic([meta(T, k), meta(n, dtype=torch.int64), meta(n, dtype=torch.int64)],
                            [((n, 1), dt)], device, **t),                                # w[tok, slot, None]
                    run("elementwise", [meta(n, H), meta(n, 1)], device, op="mul", **t),
                    generic(                                                            # index_add_ (in place)
                        [meta(n, H), meta(n, H), meta(n, dtype=torch.int64)], [((n, H), dt)], device, **t)]
    counts = torch.tensor(sizes, dtype=torch.int32)
    perm = torch.sort(ids.flatten().long(), stable=True).indices
    rows = torch.empty_like(perm)
    rows[perm] = torch.arange(M)
    fused = [run("moe_init_routing", [torch.zeros(T, H, dtype=dtype), ids], device, num_experts=E),
             run("grouped_matmul", [meta(M, H), meta(E, 2 * I, H), counts], device, trans_w=True, activation="swiglu",
                 group_sizes=sizes, **t),
             run("grouped_matmul", [meta(M, I), meta(E, H, I), counts], device, trans_w=True, group_sizes=sizes, **t),
             run("moe_finalize_routing", [torch.zeros(M, H, dtype=dtype), torch.ones(T, k), rows.int()], device)]
    return sum(unfused), sum(fused), len(unfused), len(fused)


def main_loop(dev, quick):
    """Mixtral-8x7B's MoE shapes, the experts a hand-written layer's loop over a list of ``nn.Linear`` experts."""
    T, H, I, E, k, decode_T = (512, 1024, 2048, 8, 2, 256) if quick else (4096, 4096, 14336, 8, 2, 256)
    t0 = time.time()
    rows = []
    gu, gf, gn = gating(T, E, k, dev)
    rows.append((f"gating [{T}, {E}] top-{k} (bf16 logits)", gu, gf, gn, 1))
    u, f, nu, nf = loop_experts(decode_T, H, I, E, k, dev)
    rows.append((f"loop over experts, decode: {decode_T * k // E} tokens/expert", u, f, nu, nf))
    eu, ef, enu, enf = loop_experts(T, H, I, E, k, dev)
    rows.append((f"loop over experts, prefill: {T * k // E} tokens/expert", eu, ef, enu, enf))
    rows.append((f"whole MoE block (router + expert loop), {T} tokens", gu + eu, gf + ef, gn + enu, 1 + enf))
    print(f"Hand-written MoE layer (loop over {E} nn.Linear experts, H {H}, I {I}) on {dev} "
          f"(simulated cycles; {time.time() - t0:.0f} s of simulation)\n")
    _table(rows)


def main_llama4(dev, quick):
    """Llama 4 Scout's MoE shapes (``Llama4TextConfig``'s defaults: H 5120, I 8192, 16 experts, top-1), the experts
    in their dense form: every token through all 16 experts in eager."""
    H, I, E, k = (512, 1024, 16, 1) if quick else (5120, 8192, 16, 1)
    t0 = time.time()
    rows = []
    for T in ((64, 256) if quick else (64, 1024)):
        u, f, nu, nf = dense_experts(T, H, I, E, k, dev)
        rows.append((f"dense experts, {T} tokens, H {H}, I {I}, {E} experts, top-{k}", u, f, nu, nf))
    print(f"Llama 4 MoE experts on {dev} (simulated cycles; {time.time() - t0:.0f} s of simulation)\n")
    _table(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--device", default="ascend910")
    ap.add_argument("--model", choices=("mixtral", "gpt_oss", "llama4", "loop"), default="mixtral")
    a = ap.parse_args(argv)
    dev = a.device
    if a.model == "gpt_oss":
        return main_gpt_oss(dev, a.quick)
    if a.model == "llama4":
        return main_llama4(dev, a.quick)
    if a.model == "loop":
        return main_loop(dev, a.quick)
    if a.quick:
        T, H, I, E, k, decode_T = 512, 1024, 2048, 8, 2, 256
    else:
        T, H, I, E, k, decode_T = 4096, 4096, 14336, 8, 2, 256
    rows = []
    t0 = time.time()
    gu, gf, gn = gating(T, E, k, dev)
    rows.append((f"gating [{T}, {E}] top-{k} (bf16 logits)", gu, gf, gn, 1, "3x"))
    u, f, n, _, _ = experts(decode_T, H, I, E, k, dev)
    rows.append((f"experts, decode: {decode_T * k // E} tokens/expert, H {H}, I {I}", u, f, n, 2, "1.5x"))
    eu, ef, en, _, _ = experts(T, H, I, E, k, dev)
    rows.append((f"experts, prefill: {T * k // E} tokens/expert, H {H}, I {I}", eu, ef, en, 2, ">= 1x"))
    ru, rf, rn = routing(T, H, E, k, dev)
    rows.append((f"routing + finalize [{T}, {H}] top-{k}", ru, rf, rn, 2, "-"))
    # the whole block as the compiler fuses it: router, routing, both expert GEMMs (SwiGLU between), combine
    rows.append((f"whole MoE block (router + routing + experts + combine), {T} tokens", gu + eu + ru, gf + ef + rf,
                 gn + en + rn, 5, "-"))
    print(f"MoE kernels on {dev} (simulated cycles; {time.time() - t0:.0f} s of simulation)\n")
    _table(rows)


def main_gpt_oss(dev, quick):
    """GPT-OSS-120B's MoE block (``GptOssConfig``'s defaults: H 2880, I 2880, 128 experts, top-4), 4096 tokens."""
    T, H, I, E, k, decode_T = (512, 512, 512, 32, 4, 256) if quick else (4096, 2880, 2880, 128, 4, 2048)
    t0 = time.time()
    rows = []
    gu, gf, gn = gating_topk_first(T, E, k, dev)
    rows.append((f"gating [{T}, {E}] top-{k}, softmax over the k", gu, gf, gn, 1))
    u, f, n, _, _ = experts_clamped(decode_T, H, I, E, k, dev)
    rows.append((f"experts, decode: {decode_T * k // E} tokens/expert, H {H}, I {I}", u, f, n, 2))
    eu, ef, en, _, _ = experts_clamped(T, H, I, E, k, dev)
    rows.append((f"experts, prefill: {T * k // E} tokens/expert, H {H}, I {I}", eu, ef, en, 2))
    ru, rf, rn = routing(T, H, E, k, dev)
    rows.append((f"routing + finalize [{T}, {H}] top-{k}", ru, rf, rn, 2))
    rows.append((f"whole MoE block (router + routing + experts + combine), {T} tokens", gu + eu + ru, gf + ef + rf,
                 gn + en + rn, 5))
    print(f"GPT-OSS MoE kernels on {dev} (simulated cycles; {time.time() - t0:.0f} s of simulation)\n")
    _table(rows)


if __name__ == "__main__":
    main()
