"""Per-rank bodies of tests/test_distributed.py (module level, so that spawned ranks can import them)."""
import copy

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F

from autofuse.capture import CaptureError, capture
from autofuse.tp_models import TPBlock, build, example_input, make_block


class Pairs(torch.nn.Module):
    """Near misses around the fusible pairs: a max all-reduce, a biased linear before the reduction, a matmul
    output used twice, and one good pair of each kind."""

    def __init__(self, k=32, n=48):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(n, k, generator=g) / k ** 0.5)
        self.b = torch.nn.Parameter(torch.randn(n, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(k, n, generator=g) / n ** 0.5)

    def forward(self, x):
        grp = dist.group.WORLD
        good = fc.all_reduce(F.linear(x, self.w), "sum", grp)
        mx = fc.all_reduce(F.linear(x, self.w), "max", grp)
        biased = fc.all_reduce(F.linear(x, self.w, self.b), "sum", grp)
        y = F.linear(x, self.w)
        twice = fc.all_reduce(y, "sum", grp) + y
        rs = fc.reduce_scatter_tensor(F.linear(x, self.w), "sum", 0, grp)
        ag = F.linear(fc.all_gather_tensor(x, 0, grp), self.w)
        return good, mx, biased, twice, rs, F.linear(ag, self.w2)


def checks(rank, world):
    """What one rank sees: capture targets, find_mc2 verdicts, the world pipeline, the op's gradients."""
    from autofuse.distributed import rank_pipeline
    from patterns.mc2 import find_mc2
    out = {}
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    c = capture(Pairs(), (x,), route="export")
    out["targets"] = sorted({str(n.target) for n in c.graph_module.graph.nodes if "c10d" in str(n.target)})
    out["matches"] = [(m.pattern, m.params["unsupported"]) for m in find_mc2(c.graph_module)]
    # the whole pipeline on the Megatron block
    block, args = build(rank, world)
    res = rank_pipeline(block, args, device="ascend910b")
    ref64 = copy.deepcopy(make_block()).double()(example_input().double())
    with torch.no_grad():
        out["err_fused"] = (res.outputs.double() - ref64).abs().max().item()
        out["err_unfused"] = (block(*args).double() - ref64).abs().max().item()
    out["decisions"] = [(d.kind, d.applied, d.reason) for d in res.decisions]
    out["cycles"] = (res.fused.cycles, res.unfused.cycles)
    out["collectives"] = [(cc.kind, cc.bytes, cc.link_cycles, cc.overlapped_with) for cc in res.fused.collectives]
    out["fused_vs_unfused"] = res.max_abs_diff
    # gradients of the fused op against the eager row-parallel linear (functional all-reduce)
    import autofuse.ops_mc2  # noqa: F401
    g = torch.Generator().manual_seed(10 + rank)
    xa = torch.randn(6, 16, generator=g, requires_grad=True)
    w = torch.randn(24, 16, generator=g, requires_grad=True)
    name = dist.group.WORLD.group_name
    y = torch.ops.autofuse.matmul_all_reduce(xa, w, "sum", name, 2, "ascend910b")
    y.pow(2).sum().backward()
    yb = fc.wait_tensor(fc.all_reduce(F.linear(xa.detach(), w.detach()), "sum", name))
    dy = 2 * yb                    # the replicated output's gradient; the all-reduce's backward is the identity
    out["grad"] = max((xa.grad - dy @ w.detach()).abs().max().item(),
                      (w.grad - dy.t() @ xa.detach()).abs().max().item(), (y - yb).abs().max().item())
    # torch's own functional all_reduce, differentiated: how its backward treats the replicated gradient
    xb = xa.detach().clone().requires_grad_()
    try:
        fc.wait_tensor(fc.all_reduce(F.linear(xb, w.detach()), "sum", name)).pow(2).sum().backward()
        out["torch_grad_ratio"] = (xb.grad.norm() / xa.grad.norm()).item()
    except RuntimeError as e:
        out["torch_grad_ratio"] = str(e).splitlines()[0]
    # torch.distributed.tensor.parallel: what export makes of it in this torch
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        parallelize_module(mlp, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        capture(mlp, (torch.randn(4, 16),), route="export")
        out["dtensor"] = "captured"
    except CaptureError as e:
        out["dtensor"] = str(e).splitlines()[1]
    return out


def tp_block_only(rank, world):
    block, args = build(rank, world)
    from autofuse.distributed import rank_pipeline
    res = rank_pipeline(block, args, device="ascend910b")
    ref64 = copy.deepcopy(make_block()).double()(example_input().double())
    with torch.no_grad():
        return {"err_fused": (res.outputs.double() - ref64).abs().max().item(),
                "err_unfused": (block(*args).double() - ref64).abs().max().item(),
                "applied": [d.applied for d in res.decisions], "cycles": (res.fused.cycles, res.unfused.cycles)}


__all__ = ["TPBlock", "checks", "tp_block_only"]
