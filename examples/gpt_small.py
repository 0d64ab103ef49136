"""A small GPT-style model (pre-norm blocks, causal self-attention, GELU MLP, nanoGPT's dropouts) fused end to end.

Run:  python examples/gpt_small.py [--device ascend910] [--layers 4] [--seq 256] [--dim 256] [--heads 8]
"""
import argparse

import torch
from torch import nn
from torch.nn import functional as F

import autofuse


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.dropout, self.resid_dropout = nn.Dropout(0.1), nn.Dropout(0.1)

    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, S, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        mask = torch.tril(torch.ones(S, S, dtype=torch.bool, device=x.device))
        att = att.masked_fill(~mask, float("-inf"))
        att = self.dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, S, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim),
                                 nn.Dropout(0.1))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=1024, dim=256, heads=8, layers=4, max_seq=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_seq, dim)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="ascend910")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model = GPT(dim=a.dim, heads=a.heads, layers=a.layers).eval()
    idx = torch.randint(0, 1024, (a.batch, a.seq))
    fused = autofuse.AutoFusionEngine.fuse(model, (idx,), target_device=a.device, optimization_level="O3")
    print(fused.report.summary())
    with torch.no_grad():
        err = (fused(idx) - model(idx)).abs().max().item()
    print(f"max |fused - eager| logits = {err:.2e}")
    before, after = autofuse.simulate(model, (idx,), device=a.device), fused.simulate(idx)
    print(f"simulated whole model on {a.device}: {before.cycles:,} -> {after.cycles:,} cycles "
          f"({before.cycles / after.cycles:.2f}x)")
    print(after.summary(top=6))
    return fused, before, after


if __name__ == "__main__":
    main()
