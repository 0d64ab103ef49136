"""The softmax family on the simulator: one fused ``scaled_masked_softmax`` against the chain eager launches.

    python benchmarks/softmax_family.py                          # [16, 4096, 4096] fp16 on ascend910
    python benchmarks/softmax_family.py --quick                  # [16, 1024, 1024]
    python benchmarks/softmax_family.py --device ascend910b --shape 8,2048,2048

The block, as models spell a masked, scaled softmax computed in fp32 (keep: a [B, 1, S] padding mask)::

    s = (x.float() * scale).masked_fill(~keep, torch.finfo(torch.float32).min)
    p = torch.softmax(s, dim=-1).to(x.dtype)

``AutoFusionEngine.fuse`` captures and plans it (verification off: the tests verify the family; here the
figures are the point). Both graphs then run on the simulator at full size (``autofuse.simulate``): the
captured graph node by node as eager launches it (cast, mul, the mask's logical_not, where, softmax, cast:
each lowered by ``autofuse.lower`` and launched with the tiling the cost model's search picks), and the
fused graph, whose one call runs the ``softmax`` kernel with the planned tiling. Printed: each launch,
the totals, the speed-up, HBM bytes, the cost model's prediction of both sides, and the largest difference
between the fused and the eager output.
"""
from __future__ import annotations

import argparse
import time

import torch

from autofuse import AutoFusionEngine
from autofuse.simulate import simulate_graph


class Block(torch.nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x, keep):
        s = (x.float() * self.scale).masked_fill(~keep, torch.finfo(torch.float32).min)
        return torch.softmax(s, dim=-1).to(x.dtype)


def _table(title, res):
    print(f"  {title}: {res.cycles:,} cycles ({res.seconds * 1e6:,.1f} µs), HBM {res.hbm_bytes / 2**20:,.1f} MiB, "
          f"{res.launches} launches")
    for n in res.nodes:
        print(f"    {n.node:<30s} {'/'.join(n.kernels):<22s} {n.cycles:>12,} cycles  {n.hbm_bytes / 2**20:>9,.1f} MiB"
              f"  bound {n.bound}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="16,4096,4096", help="B,S,S (softmax over the last dim)")
    ap.add_argument("--quick", action="store_true", help="shape 16,1024,1024")
    ap.add_argument("--device", default="ascend910")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    a = ap.parse_args(argv)
    shape = (16, 1024, 1024) if a.quick else tuple(int(s) for s in a.shape.split(","))
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    x = (torch.randn(shape) * 4).to(dtype)
    keep = torch.rand(shape[0], 1, shape[-1]) > 0.1
    keep[..., 0] = True
    model = Block(shape[-1] ** -0.5).eval()
    t0 = time.perf_counter()
    fused = AutoFusionEngine.fuse(model, (x, keep), target_device=a.device, verify=False)
    plan = fused.plans[next(iter(fused.plans))]
    (d,) = fused.report.applied
    print(f"scaled masked softmax {list(shape)} {a.dtype}, padding mask {list(keep.shape)}, on {a.device} "
          f"(planned in {time.perf_counter() - t0:.1f} s)")
    print(f"  plan: {d.pattern} at {d.anchor}, replaces {', '.join(d.nodes)}; tiling {d.tiling}")
    t = time.perf_counter()
    unfused = simulate_graph(plan.captured.graph_module, plan.captured.flatten_inputs(x, keep), a.device)
    t_unfused = time.perf_counter() - t
    t = time.perf_counter()
    fused_sim = simulate_graph(plan.graph_module, plan.captured.flatten_inputs(x, keep), a.device)
    t_fused = time.perf_counter() - t
    _table(f"unfused (simulated in {t_unfused:.0f} s)", unfused)
    _table(f"fused (simulated in {t_fused:.0f} s)", fused_sim)
    got = fused_sim.outputs[0] if isinstance(fused_sim.outputs, (tuple, list)) else fused_sim.outputs
    want = unfused.outputs[0] if isinstance(unfused.outputs, (tuple, list)) else unfused.outputs
    err = (got.float() - want.float()).abs().max().item()
    print(f"\n  simulated speed-up {unfused.cycles / fused_sim.cycles:.2f}x "
          f"({unfused.cycles:,} -> {fused_sim.cycles:,} cycles); HBM {unfused.hbm_bytes / 2**20:,.0f} -> "
          f"{fused_sim.hbm_bytes / 2**20:,.0f} MiB")
    print(f"  cost model: {d.cycles_unfused:,} -> {d.cycles_fused:,} cycles (predicted {d.cycles_unfused / d.cycles_fused:.2f}x)")
    print(f"  max |fused - eager| = {err:.3g} (both {a.dtype} outputs of an fp32 softmax)")


if __name__ == "__main__":
    main()
