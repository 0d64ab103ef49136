"""A multi-head attention layer that calls a flash-attention style helper; autofuse finds the attention
inside the helper (whatever its spelling) and replaces it with one fused NPU kernel.

Run:  python examples/mha_layer.py [--seq 256] [--dim 256] [--heads 8] [--device ascend910b]
"""
import argparse
import math

import torch
from torch import nn

import autofuse


def flash_attn_func(q, k, v, causal=False):
    """The signature of the popular flash-attention helper, written in plain PyTorch ([B, S, N, D] layout)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))            # -> [B, N, S, D]
    scores = torch.einsum("bnqd,bnkd->bnqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s_q, s_k = scores.shape[-2:]
        keep = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)              # -> [B, S, N, D]


class MultiHeadAttention(nn.Module):
    def __init__(self, dim=256, heads=8, causal=True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).unbind(2)
        y = flash_attn_func(q, k, v, causal=self.causal)
        return self.out(y.reshape(B, S, C))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--device", default="ascend910b")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    layer = MultiHeadAttention(a.dim, a.heads).eval()
    x = torch.randn(2, a.seq, a.dim)
    fused = autofuse.AutoFusionEngine.fuse(layer, (x,), target_device=a.device, optimization_level="O3")
    print(fused.report.summary())
    with torch.no_grad():
        err = (fused(x) - layer(x)).abs().max().item()
    print(f"max |fused - eager| = {err:.2e}")
    before, after = autofuse.simulate(layer, (x,), device=a.device), fused.simulate(x)
    print(f"simulated on {a.device}: {before.cycles:,} -> {after.cycles:,} cycles ({before.cycles / after.cycles:.2f}x)")
    return fused, before, after


if __name__ == "__main__":
    main()
