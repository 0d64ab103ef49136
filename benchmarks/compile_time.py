"""Compile time: fuse() on GPT-2-small-shaped models captured on meta tensors, against capture alone.

Goals: fuse(12 layers) <= 5x capture(12 layers); fuse(48 layers) <= 4.5x fuse(12 layers).

    python benchmarks/compile_time.py [--seq 1024] [--batch 1] [--repeat 2]
    python benchmarks/compile_time.py --generate 16 [--layers 4] [--then-batch 3] [--sliding-window 4096]

``--generate N``: a Llama-style causal LM (GQA, hidden 256) generates N tokens through ``fused.generate``, once with
every decode step exported by itself and once with the steps' exports shared (``share_exports``, the default: one
symbolic export specialised to each cache length), side by side in one run: wall time, the median decode
step's planning time by stage, and whether the tokens are eager's. ``--then-batch B``: the same fused model then
generates again at batch B (a dimension the first generation kept fixed), timed the same way. ``--sliding-window W``:
the same sizes as a Mistral-style model whose attention has a window of W keys (Mistral-7B v0.1's is 4096), whose
dynamic cache keeps each layer's length as a Python int in its structure.
"""
import argparse
import time

import torch

from autofuse import AutoFusionEngine
from autofuse.capture import capture
from autofuse.models import build


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--device", default="ascend910")
    ap.add_argument("--generate", type=int, metavar="TOKENS", help="time fused.generate of this many tokens instead")
    ap.add_argument("--layers", type=int, default=4, help="with --generate: the model's layers")
    ap.add_argument("--then-batch", type=int, help="with --generate: generate again at this batch size with the "
                                                    "same fused model")
    ap.add_argument("--sliding-window", type=int, metavar="W",
                    help="with --generate: a Mistral-style model, attention over a window of W keys")
    a = ap.parse_args()
    if a.generate:
        generate(a.generate, a.layers, a.device, a.then_batch, a.sliding_window)
        return
    rows = {}
    for layers in (12, 48):
        model, (args, kwargs) = build("gpt2", layers=layers, hidden=768, heads=12, seq=a.seq, batch=a.batch,
                                      vocab=50257, meta=True, attn="eager")
        t_cap, _ = best(lambda: capture(model, args, kwargs), a.repeat)
        t_fuse, fused = best(lambda: AutoFusionEngine.fuse(model, (args, kwargs), target_device=a.device), a.repeat)
        r = fused.report
        rows[layers] = (t_cap, t_fuse)
        print(f"{layers:>3} layers: capture {t_cap:6.2f} s   fuse {t_fuse:6.2f} s   fuse/capture {t_fuse / t_cap:4.2f}x   "
              f"fused {len(r.applied)}/{len(r.decisions)} blocks   stages: "
              + ", ".join(f"{k} {v:.2f}s" for k, v in r.timings.items()))
    (c12, f12), (_, f48) = rows[12], rows[48]
    print(f"\nfuse(12)/capture(12) = {f12 / c12:.2f}x (goal <= 5x);  fuse(48)/fuse(12) = {f48 / f12:.2f}x (goal <= 4.5x)")


def generate(tokens, layers, device, then_batch=None, window=None):
    import statistics

    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    sizes = dict(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    if window is None:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).eval()
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**sizes, sliding_window=window)).eval()
    prompts = [torch.randint(1, 512, (2, 32))] + ([torch.randint(1, 512, (then_batch, 32))] if then_batch else [])
    settings = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    wants = []
    style = "Llama-style" if window is None else f"Mistral-style (a {window}-key sliding window)"
    print(f"{style}, {layers} layers, hidden 256, prompt 32, {tokens} new tokens, {device}")
    for prompt in prompts:
        t = time.perf_counter()
        with torch.no_grad():
            wants.append(model.generate(prompt, **settings))
        print(f"  {'eager':16} batch {len(prompt)}  generate {time.perf_counter() - t:6.2f} s")
    for share in (False, True):
        fused = AutoFusionEngine.fuse(model, target_device=device, share_exports=share, max_plans=None)
        for prompt, want in zip(prompts, wants):
            before, served_before = len(fused.plans), fused._sizes.served if share else 0
            t = time.perf_counter()
            with torch.no_grad():
                got = fused.generate(prompt, **settings)
            wall = time.perf_counter() - t
            # the decode steps (the prefill first) of this generation
            steps = [p.report.timings for p in fused.plans.values()][before + 1:]
            stages = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
            served = (fused._sizes.served if share else 0) - served_before
            print(f"  {'shared export' if share else 'export per step':16} batch {len(prompt)}  generate {wall:6.2f} s  "
                  f"({wall / tokens:.2f} s/token)   median decode step: "
                  + ", ".join(f"{k[:-2]} {v:.3f}s" for k, v in stages.items())
                  + f"   steps from the shared export {served}/{len(steps)}   tokens "
                  + ("eager's" if torch.equal(got, want) else "DIFFERENT"))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
