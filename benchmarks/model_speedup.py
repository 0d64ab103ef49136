"""Simulated speed-up of fusion on whole models, against two baselines, on the same simulator.

Baselines: *eager op by op* (the captured graph, every op its own competently tiled kernel) and *generic
fusion alone* (the plan with every pattern family switched off: automatic discovery of Vector regions and
matmul epilogues only). A pattern's value is its figure against the second. Also the attention blocks alone.

    python benchmarks/model_speedup.py [--quick] [--device ascend910] [--only gpt2|llama|mixtral] [--values] [--train]
                                       [--backward] [--decode PAST [--batch B]]

Every figure printed is a simulation statistic, so the three graphs simulate timing only (``values=False``:
the same statistics as with values, no outputs; tests/test_simulate.py compares them); ``--values`` simulates
with values. Each simulation prints its wall time, CPU time and peak resident memory (the process's high-water
mark, reset before it where Linux allows, else since the start). ``--train`` runs the models' forward in
training mode: GPT-2's attention, residual and embedding dropouts (p = 0.1) draw their keep-masks, eager as
DropOutGenMask + DropOutDoMask, fused as the keep-mask generator + the kernel reading the bits (FlashAttention
for the attention dropout, the generated Vector kernel or matmul epilogue for the residual and embedding ones;
generic fusion alone reads them in its Vector kernels and epilogues too). ``--backward`` simulates a whole
training step (``simulate(..., backward=True)``, :mod:`autofuse.training`): the forward and the backward of
every parameter, eager's backward as autograd dispatches its derivative ops, the fused model's as its fused
ops' backwards; figures per phase.

``--decode PAST`` measures decode steps instead: the LLaMA-7B- and Mixtral-8x7B-shaped layers at batch ``--batch``
(default 16), one new token per sequence after a KV cache of PAST tokens (random keys and values, built through
the model's own cache as a prefill fills it: :func:`autofuse.models.kv_cache`).

Goals: GPT-2-small shapes at batch 8, sequence 1024, whole model >= 2x against eager op by op; a LLaMA-style
decoder layer's figures printed against both baselines; a Mixtral-style (MoE) decoder layer's too.
"""
import argparse
import resource
import time

import torch

import autofuse
from autofuse import AutoFusionEngine
from autofuse.engine import generic_only
from autofuse.models import build


def _reset_peak() -> bool:
    """Reset the process's peak resident memory (Linux: VmHWM); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak() -> int:
    """The process's peak resident memory in bytes (VmHWM where readable, else ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _measured(label, fn):
    reset = _reset_peak()
    t, c = time.perf_counter(), time.process_time()
    result = fn()
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    print(f"  {label:<28}: {wall:6.1f} s wall, {cpu:6.1f} s CPU, peak {_peak() / 1e9:5.2f} GB"
          f"{'' if reset else ' (since the start)'}", flush=True)
    return result, wall


def _generators_of(gm, op: str) -> set:
    """Names of the keep-mask generator calls whose bits a ``torch.ops.autofuse.<op>`` call reads (directly or
    through a view)."""
    out = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and "dropout_gen_mask" in str(n.target):
            users = list(n.users) + [w for u in n.users for w in u.users]
            if any(f"autofuse.{op}" in str(u.target) for u in users):
                out.add(n.name)
    return out


def _by_op(nodes, total: int, top: int) -> str:
    """``nodes``' cycles summed per op (the largest ``top``), each as a share of ``total``."""
    by: dict = {}
    for n in nodes:
        key = n.target.replace("aten.", "").replace(".default", "")
        by[key] = by.get(key, 0) + n.cycles
    return ", ".join(f"{k} {v / max(total, 1):.0%}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:top])


def _backward_breakdown(eager, fused, top=6):
    """The backward's largest kernels on each side (cycles summed over the launches of each kernel)."""
    for label, r in (("eager", eager), ("fused", fused)):
        print(f"  backward, {label:<5}  : "
              + _by_op([n for n in r.nodes if n.phase == "backward"], r.phases["backward"], top))


def run(name, layers, hidden, heads, seq, batch, dtype, device, vocab=50257, kv_heads=None, values=False,
        train=False, backward=False, past=0):
    # every row from the same seed: a MoE layer's routing (how many tokens each expert gets) follows its random
    # weights, so a row read the same alone (--only) and after the rows before it
    torch.manual_seed(0)
    model, (args, kwargs) = build(name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, seq=seq,
                                  batch=batch, vocab=vocab, dtype=dtype, past=past)
    model.train(train)
    print(f"{name} L={layers} H={hidden} heads={heads} B={batch} S={seq}"
          f"{f' after a KV cache of {past}' if past else ''} {str(dtype).replace('torch.', '')} on "
          f"{device}{'' if values else ', simulated timing only'}{', training mode' if train else ''}"
          f"{', forward and backward' if backward else ''}:", flush=True)
    fused, _ = _measured("fuse", lambda: AutoFusionEngine.fuse(model, (args, kwargs), target_device=device,
                                                                optimization_level="O3"))
    generic, _ = _measured("plan generic fusion alone", lambda: AutoFusionEngine.fuse(
        model, (args, kwargs), target_device=device, optimization_level="O3", fusion_switches=generic_only()))
    eager, w1 = _measured("simulate eager op by op", lambda: autofuse.simulate(
        model, (args, kwargs), device=device, values=values, backward=backward))
    gen, w2 = _measured("simulate generic alone",
                        lambda: generic.simulate(*args, values=values, backward=backward, **kwargs))
    after, w3 = _measured("simulate fused", lambda: fused.simulate(*args, values=values, backward=backward, **kwargs))
    r = fused.report
    attn = [d for d in r.applied if d.pattern == "attention"]
    attn_before = eager.cycles_of([n for d in attn for n in d.nodes])
    # the fused attention's launches: its keep-mask generator (training), score bound and kernel; the other
    # dropouts' generators (residual, embedding) feed generated Vector kernels and epilogues
    attn_gen = _generators_of(fused.graph_module, "flash_attention")
    attn_after = sum(n.cycles for n in after.nodes if n.fused and (n.target == "autofuse.flash_attention"
                                                                     or n.node in attn_gen))
    print(f"  {len(r.applied)} fused: {', '.join(sorted({d.pattern for d in r.applied}))}")
    print(f"  eager op by op      : {eager.cycles:>14,} cycles   fused {eager.cycles / after.cycles:5.2f}x")
    print(f"  generic fusion alone: {gen.cycles:>14,} cycles   fused {gen.cycles / after.cycles:5.2f}x   "
          f"(generic alone vs eager {eager.cycles / gen.cycles:5.2f}x)")
    print(f"  fused               : {after.cycles:>14,} cycles")
    if backward:
        for phase in ("forward", "backward"):
            e, g, f = (sim.phases[phase] for sim in (eager, gen, after))
            print(f"  {phase + ' phase':<20}: {e:>14,} / {g:>14,} / {f:>14,} cycles (eager / generic / fused)   "
                  f"fused {e / max(f, 1):5.2f}x / {g / max(f, 1):5.2f}x")
        _backward_breakdown(eager, after)
        # the attention blocks' nodes are named in the captured graphs, not in the traced training steps
        print("  (attention blocks and keep-mask generators alone: the same command without --backward)")
        print(f"  (eager and fused simulated in {w1 + w3:.1f} s wall; all three in {w1 + w2 + w3:.1f} s)", flush=True)
        return eager, gen, after
    if attn:
        print(f"  attention blocks    : {attn_before:>14,} -> {attn_after:>14,} cycles   "
              f"{attn_before / max(attn_after, 1):5.2f}x")
        names = {n for d in attn for n in d.nodes}
        print("  attention blocks op by op: " + _by_op([n for n in eager.nodes if n.node in names], attn_before, 4))
        hbm_before = sum(n.hbm_bytes for n in eager.nodes if n.node in names)
        hbm_after = sum(n.hbm_bytes for n in after.nodes if n.fused and n.target == "autofuse.flash_attention")
        print(f"  attention HBM bytes : {hbm_before:>14,} -> {hbm_after:>14,} (the fused kernels alone)")
    gen = sum(n.cycles for n in after.nodes if n.fused and n.node in attn_gen)
    others = sum(n.cycles for n in after.nodes if n.fused and n.target == "autofuse.dropout_gen_mask") - gen
    if gen:
        # eager's dropout on the same probabilities launches the same generator (same shapes, same kernel, the
        # same cycles): the blocks' figure without it is what fusion changes
        print(f"  keep-mask generator : {gen:>14,} cycles on both sides (attention dropouts); without it the "
              f"attention blocks are {attn_before - gen:,} -> {attn_after - gen:,} cycles   "
              f"{(attn_before - gen) / max(attn_after - gen, 1):5.2f}x")
    if others:
        print(f"  other dropouts' generators: {others:,} cycles on every side (residual and embedding keep-masks)")
    print(f"  (eager and fused simulated in {w1 + w3:.1f} s wall; all three in {w1 + w2 + w3:.1f} s)", flush=True)
    return eager, gen, after


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="ascend910")
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    ap.add_argument("--only", choices=["gpt2", "llama", "mixtral"], default=None)
    ap.add_argument("--values", action="store_true",
                    help="simulate with values (slower; the same figures as the default timing-only simulation)")
    ap.add_argument("--train", action="store_true", help="the forward in training mode (dropout active)")
    ap.add_argument("--backward", action="store_true", help="a whole training step: forward and backward")
    ap.add_argument("--decode", type=int, default=0, metavar="PAST",
                    help="decode steps instead: the LLaMA and Mixtral layers at batch --batch, one new token per "
                         "sequence after a KV cache of PAST tokens")
    ap.add_argument("--batch", type=int, default=16, help="sequences in a decode step (with --decode)")
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.decode:
        if a.train or a.backward:
            ap.error("--decode simulates inference steps; drop --train and --backward")
        for name in ("llama", "mixtral"):
            if a.only in (None, name):
                run(name, 1, 256 if a.quick else 4096, 4 if a.quick else 32, 1, a.batch, torch.float16, a.device,
                    vocab=1000 if a.quick else 1024, kv_heads=2 if a.quick else 8, values=a.values, past=a.decode)
        return
    if a.quick:
        run("gpt2", 2, 256, 4, 256, 2, torch.float16, a.device, vocab=1000, values=a.values, train=a.train, backward=a.backward)
        run("llama", 1, 256, 4, 256, 1, torch.float16, a.device, vocab=1000, kv_heads=2, values=a.values, train=a.train, backward=a.backward)
        run("mixtral", 1, 256, 4, 256, 1, torch.float16, a.device, vocab=1000, kv_heads=2, values=a.values, train=a.train, backward=a.backward)
        return
    if a.only in (None, "gpt2"):
        run("gpt2", 12, 768, 12, 1024, 8, torch.float16, a.device, values=a.values, train=a.train, backward=a.backward)
    if a.only in (None, "llama"):
        # one LLaMA-7B-shaped decoder layer (hidden 4096, 32 heads, 8 kv heads as in Llama-3; the zoo's
        # intermediate size is 4 x hidden), 2048 tokens; a small vocabulary, so the layer, not the LM head, is
        # what is measured
        run("llama", 1, 4096, 32, 2048, 1, torch.float16, a.device, vocab=1024, kv_heads=8, values=a.values, train=a.train, backward=a.backward)
    if a.only in (None, "mixtral"):
        # one Mixtral-8x7B-shaped decoder layer (hidden 4096, 32 heads, 8 kv heads, 8 experts of intermediate
        # 14336, top-2), 2048 tokens, a small vocabulary: the router, the experts block and attention measured
        run("mixtral", 1, 4096, 32, 2048, 1, torch.float16, a.device, vocab=1024, kv_heads=8, values=a.values, train=a.train, backward=a.backward)


if __name__ == "__main__":
    main()
