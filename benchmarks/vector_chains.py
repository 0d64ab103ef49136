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
import warnings

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
    return [interp.env[n].reshape(s) for n, s in zip(built.inputs, built.input_shapes)]


# ------------------------------------------------------------------------------------------ running
class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def unfused(fn, args, device):
    """The chain op by op on the simulator, as eager launches it (searched tilings): SimulationResult."""
    from autofuse.simulate import simulate
    return simulate(_Fn(fn), tuple(args), device=device)


def fused(fn, args, device):
    """The chain as one generated kernel, with the tiling the cost model picks: (Result, Estimate, program)."""
    import cost_model
    from autofuse import npu
    built, gm = build(fn, [tuple(a.shape) for a in args], args[0].dtype)
    ins = input_values(built, gm, args)
    specs = [(tuple(x.shape), str(x.dtype).replace("torch.", "")) for x in ins]
    e = cost_model.estimate("vector_program", specs, device=device, program=built.program)
    r = npu.run("vector_program", *ins, program=built.program, device=device, tiling=e.tiling)
    return r, e, built


def hand_written(name, args, device):
    """The hand-written norm kernel for the chain, with its searched tiling: Result."""
    import cost_model
    from autofuse import npu
    kernel = {"RMSNorm": "rms_norm", "AddRmsNorm": "add_rms_norm"}[name]
    specs = [(tuple(a.shape), "float16") for a in args]
    e = cost_model.estimate(kernel, specs, device=device)
    return npu.run(kernel, *args, device=device, tiling=e.tiling)


def matmul_gelu(tokens, hidden, inter, device):
    """(unfused cycles, fused Result, fused Estimate): matmul then GELU (two launches) vs matmul_epilogue."""
    import cost_model
    from autofuse import npu
    from cost_model.program import Builder
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(tokens, hidden, generator=g) / 8).to(F16)
    w = (torch.randn(hidden, inter, generator=g) / 8).to(F16)
    specs = [((tokens, hidden), "float16"), ((hidden, inter), "float16")]
    em = cost_model.estimate("matmul", specs, device=device)
    rm = npu.run("matmul", a, w, device=device, tiling=em.tiling)
    eg = cost_model.estimate("elementwise", [((tokens, inter), "float16")], device=device, op="gelu")
    rg = npu.run("elementwise", rm.outputs[0], op="gelu", device=device, tiling=eg.tiling)
    b = Builder((tokens,))
    b.output(b.gelu(b.input("float16", (tokens, inter))), "float16")      # the product as eager rounds it
    prog = b.build()
    ef = cost_model.estimate("matmul_epilogue", specs, device=device, program=prog)
    rf = npu.run("matmul_epilogue", a, w, program=prog, device=device, tiling=ef.tiling)
    same = float(abs(rf.outputs[0].astype("float32") - rg.outputs[0].astype("float32")).max())
    return rm.stats, rg.stats, rf, ef, same


def matmul_swiglu(tokens, hidden, inter, device):
    """A fused gate_up projection then SwiGLU: matmul [tokens, 2*inter] + silu + mul (three launches, the
    halves as views) vs matmul_epilogue computing gate and up columns in one step and writing ``inter``."""
    import cost_model
    from autofuse import npu
    from cost_model.program import Builder
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(tokens, hidden, generator=g) / 8).to(F16)
    w = (torch.randn(hidden, 2 * inter, generator=g) / 8).to(F16)
    specs = [((tokens, hidden), "float16"), ((hidden, 2 * inter), "float16")]
    em = cost_model.estimate("matmul", specs, device=device)
    rm = npu.run("matmul", a, w, device=device, tiling=em.tiling)
    gu = torch.from_numpy(rm.outputs[0])
    gate, up = gu[:, :inter], gu[:, inter:]
    half = [((tokens, inter), "float16")]
    es = cost_model.estimate("elementwise", half, device=device, op="silu")
    rs = npu.run("elementwise", gate, op="silu", device=device, tiling=es.tiling)
    emu = cost_model.estimate("elementwise", half * 2, device=device, op="mul")
    rmu = npu.run("elementwise", torch.from_numpy(rs.outputs[0]), up, op="mul", device=device, tiling=emu.tiling)
    b = Builder((tokens,))
    acc = b.input("float16", (tokens, 2 * inter))
    b.output(b.mul(b.silu(b.slice(acc, start=0, stop=inter)), b.slice(acc, start=inter, stop=2 * inter)), "float16")
    prog = b.build()
    ef = cost_model.estimate("matmul_epilogue", specs, device=device, program=prog)
    rf = npu.run("matmul_epilogue", a, w, program=prog, device=device, tiling=ef.tiling)
    return (rm.stats, rs.stats, rmu.stats), rf, ef


def long_chain(n_ops, tokens, hidden):
    """A chain of ``n_ops`` ops (transcendental and simple, a per-col weight, the input re-read) on
    [tokens, hidden] fp16: the program."""
    from cost_model.program import Builder
    b = Builder((tokens,))
    x, w = b.input("float16", (tokens, hidden)), b.input("float16", (hidden,))
    y = x
    kinds = ["tanh", "mul_w", "silu", "add_x", "sigmoid", "mul_c", "gelu", "sub_x", "exp", "neg", "abs", "sin"]
    for i in range(n_ops):
        k = kinds[i % len(kinds)]
        y = {"mul_w": lambda: b.mul(y, w), "add_x": lambda: b.add(y, x), "sub_x": lambda: b.sub(y, x),
             "mul_c": lambda: b.mul(y, 0.7)}.get(k, lambda: b.op(k, y))()
    b.output(y, "float16")
    return b.build()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="ascend910")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--no-matmul", action="store_true", help="skip matmul + GELU (the slowest to simulate)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)      # torch.export's pytree deprecations
    dev = a.device
    targets = {"RMSNorm": 2.0, "AddRmsNorm": 2.0, "RoPE q,k": 3.0, "SwiGLU": 2.0, "SwiGLU (x*sigmoid(x))": 2.0}
    print(f"{dev}, {a.tokens} tokens, hidden {a.hidden}, intermediate {a.inter}, fp16\n")
    print(f"{'chain':24s} {'unfused':>30s} {'fused':>22s} {'speed-up':>9s} {'target':>7s}   fused util (busiest)   "
          f"HBM unfused / fused")
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, fn, shapes in chains(a.tokens, a.hidden, a.inter):
        args = [torch.randn(s, generator=g).to(F16) for s in shapes]
        t0 = time.time()
        u = unfused(fn, args, dev)
        r, e, built = fused(fn, args, dev)
        st = r.stats
        launches = sum(len(n.kernels) for n in u.nodes)
        sp = u.cycles / st.cycles
        busiest = max(st.util, key=st.util.get)
        rows.append((name, u, r))
        print(f"{name:24s} {u.cycles:>12,} cycles, {launches:2d} launches {st.cycles:>13,} cycles {sp:8.2f}x "
              f"{targets.get(name, 0):6.1f}x   {busiest} {st.util[busiest]:.2f} (vector {st.util['vector']:.2f})"
              f"   {u.hbm_bytes / 1e6:,.0f} / {st.hbm_bytes / 1e6:,.0f} MB   ({time.time() - t0:.0f} s)")
    print("\nagainst the hand-written norm kernels (searched tilings):")
    for name, _, r in rows:
        if name in ("RMSNorm", "AddRmsNorm"):
            shapes = dict((n, s) for n, _, s in chains(a.tokens, a.hidden, a.inter))[name]
            args = [torch.randn(s, generator=g).to(F16) for s in shapes]
            h = hand_written(name, args, dev)
            print(f"  {name:12s} generated {r.stats.cycles:>9,} cycles, hand-written {h.stats.cycles:>9,} cycles: "
                  f"generated / hand-written = {r.stats.cycles / h.stats.cycles:.3f} "
                  f"(vector busy {r.stats.busy['vector']:,} vs {h.stats.busy['vector']:,}; "
                  f"HBM {r.stats.hbm_bytes / 1e6:,.1f} vs {h.stats.hbm_bytes / 1e6:,.1f} MB)")
    print("\nlong chains on the generated kernel (busiest unit's utilisation; target >= 0.80):")
    import cost_model
    from autofuse import npu
    for n_ops in (8, 12, 16):
        p = long_chain(n_ops, a.tokens, a.hidden)
        xs = [torch.randn(s.shape, generator=g).to(F16) for s in p.inputs]
        e = cost_model.estimate("vector_program", [(s.shape, s.dtype) for s in p.inputs], device=dev, program=p)
        st = npu.run("vector_program", *xs, program=p, device=dev, tiling=e.tiling).stats
        busiest = max(st.util, key=st.util.get)
        print(f"  {n_ops:2d} ops [{a.tokens}, {a.hidden}]: {st.cycles:,} cycles, {busiest} {st.util[busiest]:.2f} "
              f"(predicted {e.cycles:,})")
    if not a.no_matmul:
        print("\nfused gate_up projection + SwiGLU (what removes the HBM traffic SwiGLU alone cannot):")
        t0 = time.time()
        (sm, ss, smu), rf, ef = matmul_swiglu(a.tokens, a.hidden, a.inter, dev)
        un = sm.cycles + ss.cycles + smu.cycles
        print(f"  matmul {sm.cycles:,} + silu {ss.cycles:,} + mul {smu.cycles:,} = {un:,}; matmul_epilogue "
              f"{rf.stats.cycles:,} (tiling {ef.tiling}, predicted {ef.cycles:,}): {un / rf.stats.cycles:.2f}x; "
              f"the fused kernel vs the gate_up matmul alone: {rf.stats.cycles / sm.cycles:.3f} (it writes "
              f"{a.inter} columns, not {2 * a.inter})  ({time.time() - t0:.0f} s)")
        print("\nmatmul + GELU, the product as eager rounds it (fp16):")
        for inter in sorted({a.inter, 14336}):
            t0 = time.time()
            sm, sg, rf, ef, same = matmul_gelu(a.tokens, a.hidden, inter, dev)
            un = sm.cycles + sg.cycles
            print(f"  {a.tokens}x{a.hidden} @ {a.hidden}x{inter}: matmul {sm.cycles:,} + gelu {sg.cycles:,} = {un:,}; "
                  f"matmul_epilogue {rf.stats.cycles:,} (tiling {ef.tiling}, predicted {ef.cycles:,}): "
                  f"{un / rf.stats.cycles:.2f}x (target 1.3x); max |fused - unfused| = {same:g}  "
                  f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
