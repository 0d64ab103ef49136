"""A hand-written mixture-of-experts layer, as many codebases write one: a router and a loop over an
``nn.ModuleList`` of experts (each three ``nn.Linear``s, ``w2(silu(w1(x)) * w3(x))``), the tokens of each expert
found with ``torch.where`` and added back with ``index_add_``.

autofuse fuses the router into ``moe_gating_topk`` and the whole loop into ``moe_init_routing`` + two
``grouped_matmul_list`` calls over the lists of the experts' weights (SwiGLU between) + ``moe_finalize_routing``.
The script prints the report, the fused layer's distance to eager, the simulated cycles unfused and fused, and
the distance of one training step's gradients to eager's.

Run:  python examples/moe_layer.py [--hidden 256] [--intermediate 512] [--experts 8] [--top-k 2] [--tokens 128]
                                   [--device ascend910]
"""
import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import autofuse


class Expert(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoELayer(nn.Module):
    def __init__(self, hidden, intermediate, experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, intermediate) for _ in range(experts))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = torch.topk(F.softmax(self.router(x), dim=-1, dtype=torch.float), self.top_k)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(ids == e)
            out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return out.reshape(shape)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="ascend910")
    a = ap.parse_args()
    torch.manual_seed(0)
    layer = MoELayer(a.hidden, a.intermediate, a.experts, a.top_k)
    x = torch.randn(1, a.tokens, a.hidden)

    fused = autofuse.AutoFusionEngine.fuse(layer.eval(), (x,), target_device=a.device, optimization_level="O3")
    print(fused.report.summary())
    x2 = torch.randn(1, a.tokens, a.hidden)          # other tokens than planned on: another routing
    with torch.no_grad():
        print(f"max |fused - eager| = {(fused(x2) - layer(x2)).abs().max().item():.3g}")
    before = autofuse.simulate(layer, (x2,), device=a.device)
    after = fused.simulate(x2)
    print(f"simulated on {a.device}: {before.cycles:,} -> {after.cycles:,} cycles "
          f"({before.cycles / max(after.cycles, 1):.2f}x)")

    # one training step's gradients: the fused layer trains the layer's own parameters
    trained = autofuse.AutoFusionEngine.fuse(layer.train(), (x,), target_device=a.device)
    eager = copy.deepcopy(layer)
    trained(x2).square().mean().backward()
    eager(x2).square().mean().backward()
    worst = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
                for p, q in zip(layer.parameters(), eager.parameters()) if q.grad is not None)
    print(f"training step: worst parameter gradient {worst:.3g} of its largest away from eager's")


if __name__ == "__main__":
    main()
