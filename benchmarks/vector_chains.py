"""Generated Vector kernels against the unfused chains eager would launch, at 7B-class shapes.

Each chain is written in torch as a model writes it (HF Llama's RMSNorm, rotate_half RoPE, SwiGLU, ...),
traced to aten, and run on the simulator two ways:

* unfused: the aten graph op by op, each op as the simulator kernel eager would launch for it (elementwise,
  reduce, cat, ...), each with the tiling the cost model's search picks (``autofuse.simulate``);
* fused: the whole graph as one generated ``vector_program`` kernel (``program_from_nodes``), with the tiling
  the cost model's search picks.

It also compares RMSNorm and AddRmsNorm with the hand-written ``rms_norm`` / ``add_rms_norm`` kernels, and
matmul + GELU (``matmul_epilogue``) with the matmul and GELU kernels launched one after the other.

    python benchmarks/vector_chains.py                # ascend910, 4096 tokens, hidden 4096, fp16
    python benchmarks/vector_chains.py --device ascend910b --tokens 1024
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

F16 = torch.float16


# ------------------------------------------------------------------------------------------ the chains
def rms_norm(x, w):
    """HF LlamaRMSNorm."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


def add_rms_norm(x, residual, w):
    """The residual add before a norm, both outputs used (the sum is the next residual)."""
    s = x + residual
    return rms_norm(s, w), s


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope(q, k, cos, sin):
    """HF apply_rotary_pos_emb (half rotation) on q and k; cos/sin [B, S, D] broadcast over the heads."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def swiglu(gate, up):
    """LlamaMLP's act_fn(gate_proj(x)) * up_proj(x)."""
    return F.silu(gate) * up


def swiglu_sigmoid(gate, up):
    """The same written out as gate * sigmoid(gate) * up (some model code does)."""
    return gate * torch.sigmoid(gate) * up


def chains(tokens=4096, hidden=4096, inter=11008, heads=32, head_dim=128, dtype=F16):
    """(name, function, input shapes) of each chain at the given sizes."""
    T, H = tokens, hidden
    return [
        ("RMSNorm", rms_norm, [(T, H), (H,)]),
        ("AddRmsNorm", add_rms_norm, [(T, H), (T, H), (H,)]),
        ("RoPE q,k", rope, [(1, heads, T, head_dim), (1, heads, T, head_dim), (1, T, head_dim), (1, T, head_dim)]),
        ("SwiGLU", swiglu, [(T, inter), (T, inter)]),
        ("SwiGLU (x*sigmoid(x))", swiglu_sigmoid, [(T, inter), (T, inter)]),
    ]


def build(fn, shapes, dtype=F16):
    """The chain traced on meta tensors: (BuiltProgram, graph module)."""
    from autofuse.vector_program import program_from_function
    return program_from_function(fn, [torch.empty(s, dtype=dtype, device="meta") for s in shapes])


def input_values(built, gm, args):
    """The program's inputs for the graph's placeholder values ``args`` (views of inputs computed here)."""
    interp = torch.fx.Interpreter(gm, garbage_collect_values=False)
    interp.run(*args)
    return [interp.env[n] for n in built.inputs]
