"""An MoE experts block's training step on the simulator: eager (per-expert GEMMs, the activation op by op)
vs fused (grouped launches), forward and backward, kernel by kernel.

    python benchmarks/moe_training.py            # Mixtral-8x7B's experts: H 4096, I 14336, 8 experts, top-2,
                                                 # 4096 tokens, bf16, on ascend910
    python benchmarks/moe_training.py --quick    # smaller shapes
    python benchmarks/moe_training.py --device ascend910b

The launches are those the training step's joint graph (``autofuse.training``) lowers the block's experts to,
each run timing-only with the tiling the cost model's search picks, group sizes even (T·k / E rows each):

* eager forward: ``grouped_mm_fallback`` (one matmul per expert) for gate_up, silu(gate) and · up, the down
  projection per expert; eager backward: ``grouped_mm_fallback_backward`` of down (per expert: dx and dw
  GEMMs), the SwiGLU's derivative as autograd dispatches it (two muls, ``silu_backward``, the cat of the
  halves' gradients), ``grouped_mm_fallback_backward`` of gate_up;
* fused forward, as a training plan runs it: ``grouped_matmul_with_product`` (the SwiGLU epilogue, the
  pre-activation product stored too), ``grouped_matmul`` for down; fused backward (``autofuse.ops_moe``'s
  grouped_matmul autograd): down's dx (``grouped_matmul``, weight transposed) and dw
  (``grouped_matmul_weight_grad``), the SwiGLU's gradient (the epilogue's derived Vector program) on the stored
  product, gate_up's dx and dw.

Routing, finalize and gating (forward and backward) are not in these figures (benchmarks/moe_kernels.py prices
their forward). The last line prices the alternative an eval plan's op leaves the backward: no product stored,
one more ``grouped_matmul`` launch recomputing it.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np
import torch

from autofuse.lower import _ROW_GRADS, _row_grad_program
from autofuse.ops_moe import _epilogue_program
from autofuse.ops_vector import _grad_launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # moe_kernels, beside this script
import moe_kernels  # noqa: E402

aten = torch.ops.aten


run = functools.partial(moe_kernels.run, timing_only=True)


def step(T, H, I, E, k, device, dtype=torch.bfloat16):
    M = T * k
    sizes = tuple(M // E + (g < M % E) for g in range(E))
    z = lambda *s: torch.zeros(*s, dtype=dtype)                                     # noqa: E731
    x, gu, down = z(M, H), z(E, 2 * I, H), z(E, H, I)          # transformers' storage: [E, out, in]
    h, gu_out, dy = z(M, I), z(M, 2 * I), z(M, H)
    offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32)
    counts = torch.tensor(sizes, dtype=torch.int32)
    gs = {"group_sizes": sizes}
    silu_bwd, order = _row_grad_program(_ROW_GRADS[aten.silu_backward.default], [h, h], [])
    eager_fwd = {"gate_up (per expert)": run("matmul_per_group", [x, gu, offs], device, trans_w=True, **gs),
                 "silu": run("elementwise", [h], device, op="silu"),
                 "mul": run("elementwise", [h, h], device, op="mul"),
                 "down (per expert)": run("matmul_per_group", [h, down, offs], device, trans_w=True, **gs)}
    eager_bwd = {"down dx (per expert)": run("matmul_per_group", [dy, down, offs], device, **gs),
                 "down dw (per expert)": run("matmul_per_group_weight_grad", [h, dy, offs], device, **gs),
                 "2 muls": 2 * run("elementwise", [h, h], device, op="mul"),
                 "silu_backward": run("vector_program", [h, h], device, program=silu_bwd),
                 "cat": run("cat", [h, h], device, dim=1),
                 "gate_up dx (per expert)": run("matmul_per_group", [gu_out, gu, offs], device, **gs),
                 "gate_up dw (per expert)": run("matmul_per_group_weight_grad", [x, gu_out, offs], device, **gs)}
    gp, _ = _grad_launch(_epilogue_program("swiglu", "gate_up", M, 2 * I, str(dtype)[6:]), (0,), (0,), device)
    fused_fwd = {"gate_up+SwiGLU (product stored)": run("grouped_matmul", [x, gu, counts], device, trans_w=True,
                                                        activation="swiglu", return_product=True, **gs),
                 "down": run("grouped_matmul", [h, down, counts], device, trans_w=True, **gs)}
    recompute = {"gate_up+SwiGLU": run("grouped_matmul", [x, gu, counts], device, trans_w=True, activation="swiglu",
                                       **gs),
                 "gate_up product (recompute)": run("grouped_matmul", [x, gu, counts], device, trans_w=True, **gs)}
    fused_bwd = {"down dx": run("grouped_matmul", [dy, down, counts], device, **gs),
                 "down dw": run("grouped_matmul_weight_grad", [dy, h, counts], device, **gs),
                 "SwiGLU backward": run("vector_program", [gu_out, h], device, program=gp.program),
                 "gate_up dx": run("grouped_matmul", [gu_out, gu, counts], device, **gs),
                 "gate_up dw": run("grouped_matmul_weight_grad", [gu_out, x, counts], device, **gs)}
    return eager_fwd, eager_bwd, fused_fwd, fused_bwd, recompute


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--device", default="ascend910")
    a = ap.parse_args(argv)
    T, H, I, E, k = (512, 1024, 2048, 8, 2) if a.quick else (4096, 4096, 14336, 8, 2)
    print(f"MoE experts training step on {a.device}: T={T} H={H} I={I} E={E} top-{k}, bf16, even loads "
          f"(simulated cycles)")
    ef, eb, ff, fb, rc = step(T, H, I, E, k, a.device)
    for label, parts in (("eager forward", ef), ("eager backward", eb), ("fused forward", ff),
                         ("fused backward", fb)):
        print(f"  {label:15s} {sum(parts.values()):>13,}   " + ", ".join(f"{n} {v:,}" for n, v in parts.items()))
    e, f = sum(ef.values()) + sum(eb.values()), sum(ff.values()) + sum(fb.values())
    print(f"  backward: {sum(eb.values()):,} -> {sum(fb.values()):,} cycles "
          f"({sum(eb.values()) / sum(fb.values()):.2f}x)")
    print(f"  training step: {e:,} -> {f:,} cycles ({e / f:.2f}x)")
    stored = ff["gate_up+SwiGLU (product stored)"]
    alt = f - stored + sum(rc.values())
    print(f"  without the product stored: gate_up+SwiGLU {rc['gate_up+SwiGLU']:,} (vs {stored:,} storing it), "
          f"+ its recompute {rc['gate_up product (recompute)']:,} in the backward: training step {alt:,} cycles "
          f"({e / alt:.2f}x eager)")


if __name__ == "__main__":
    main()
