"""A GPT-2-style transformer block, whole and split Megatron-style over tensor-parallel ranks.

Megatron's split (Shoeybi et al., 2019): the QKV projection and the MLP's first linear are *column-parallel*
(each rank holds a slice of the output features: its heads, its share of the hidden units), the attention
output projection and the MLP's second linear are *row-parallel* (each rank holds the matching slice of the
input features and produces a partial sum), each followed by an all-reduce. Row-parallel biases are added
once, after the all-reduce. The collectives are the functional ones (``_functional_collectives``), so the
block captures with ``torch.export`` as ``_c10d_functional.all_reduce`` + ``wait_tensor`` nodes.

``Block`` is the single-device model; ``TPBlock.from_block(block, rank, world)`` takes its shard of the very
same weights, so the two compute the same function.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def attention(x, qkv_w, qkv_b, heads):
    """Causal multi-head attention of ``x`` with a fused QKV projection (q, k, v stacked, heads contiguous)."""
    B, S, _ = x.shape
    q, k, v = F.linear(x, qkv_w, qkv_b).view(B, S, 3, heads, -1).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, -1)


class Block(nn.Module):
    def __init__(self, hidden: int = 64, heads: int = 8, dtype=torch.float32):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden, dtype=dtype), nn.LayerNorm(hidden, dtype=dtype)
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.fc1 = nn.Linear(hidden, 4 * hidden, dtype=dtype)
        self.fc2 = nn.Linear(4 * hidden, hidden, dtype=dtype)

    def forward(self, x):
        x = x + self.proj(attention(self.ln1(x), self.qkv.weight, self.qkv.bias, self.heads))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TPBlock(nn.Module):
    """One rank's shard of :class:`Block` (see the module docstring)."""

    def __init__(self, block: Block, rank: int, world: int, group=None):
        super().__init__()
        import torch.distributed as dist
        hidden = block.proj.weight.shape[0]
        if block.heads % world or (4 * hidden) % world:
            raise ValueError(f"{block.heads} heads / {4 * hidden} hidden units do not split over {world} ranks")
        self.group = group if group is not None else dist.group.WORLD
        self.heads = block.heads // world
        self.ln1, self.ln2 = block.ln1, block.ln2
        d = hidden // world

        def rows(t, parts, width):   # this rank's output features of each of ``parts`` stacked projections
            return torch.cat([c[rank * width:(rank + 1) * width] for c in t.detach().chunk(parts, 0)], 0)

        self.qkv_w = nn.Parameter(rows(block.qkv.weight, 3, d))
        self.qkv_b = nn.Parameter(rows(block.qkv.bias, 3, d))
        self.proj_w = nn.Parameter(block.proj.weight.detach()[:, rank * d:(rank + 1) * d].clone())
        self.proj_b = nn.Parameter(block.proj.bias.detach().clone())
        self.fc1_w = nn.Parameter(rows(block.fc1.weight, 1, 4 * d))
        self.fc1_b = nn.Parameter(rows(block.fc1.bias, 1, 4 * d))
        self.fc2_w = nn.Parameter(block.fc2.weight.detach()[:, rank * 4 * d:(rank + 1) * 4 * d].clone())
        self.fc2_b = nn.Parameter(block.fc2.bias.detach().clone())

    def row_parallel(self, x, w, b):
        import torch.distributed._functional_collectives as fc
        return fc.all_reduce(F.linear(x, w), "sum", self.group) + b

    def forward(self, x):
        a = attention(self.ln1(x), self.qkv_w, self.qkv_b, self.heads)
        x = x + self.row_parallel(a, self.proj_w, self.proj_b)
        return x + self.row_parallel(F.gelu(F.linear(self.ln2(x), self.fc1_w, self.fc1_b)), self.fc2_w, self.fc2_b)


def make_block(hidden=64, heads=8, dtype=torch.float32, seed=0) -> Block:
    torch.manual_seed(seed)
    b = Block(hidden, heads, dtype)
    with torch.no_grad():       # non-trivial norms and biases
        for p in b.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return b.eval()


def example_input(batch=2, seq=16, hidden=64, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, hidden, generator=g).to(dtype)


def build(rank: int, world: int, hidden=64, heads=8, batch=2, seq=16, dtype=torch.float32):
    """``(TPBlock shard, (x,))`` for ``simulate_world``."""
    return TPBlock(make_block(hidden, heads, dtype), rank, world).eval(), (example_input(batch, seq, hidden, dtype),)


__all__ = ["Block", "TPBlock", "build", "example_input", "make_block"]
