"""Text generation through a fused model: a Llama-style causal LM (grouped-query attention) from a transformers
config, its prefill and every decode step fused, the KV cache updated as eager updates it.

The script generates greedily with the fused model and with eager and compares the tokens, prints one line per
plan (with the default dynamic cache each cache length is a new input signature, planned once; with
``--cache static`` the decode steps keep one signature), then simulates one decode step against a cache of the
prompt's length: eager op by op and fused, on the simulated NPU.

Run:  python examples/generate.py [--layers 2] [--hidden 128] [--heads 8] [--kv-heads 2] [--batch 2] [--prompt 32]
                                  [--new-tokens 4] [--cache dynamic|static] [--device ascend910]
"""
import argparse
import copy

import torch
import transformers

import autofuse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--cache", choices=["dynamic", "static"], default="dynamic",
                    help="the KV cache generate() makes (static: preallocated, written in place)")
    ap.add_argument("--device", default="ascend910")
    a = ap.parse_args()
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                                   num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                   num_key_value_heads=a.kv_heads, max_position_embeddings=a.prompt + a.new_tokens,
                                   pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    prompt = torch.randint(1, 256, (a.batch, a.prompt))

    # no example inputs: the fused model plans at each call whose sizes it has not seen
    fused = autofuse.AutoFusionEngine.fuse(model, target_device=a.device, optimization_level="O3")
    settings = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
                    cache_implementation=a.cache)
    with torch.no_grad():
        want = model.generate(prompt, **settings)
        got = fused.generate(prompt, **settings)
    print(f"generated {a.new_tokens} tokens x {a.batch} sequences: "
          f"{'the same as eager' if torch.equal(got, want) else 'DIFFERENT from eager'}")
    for i, plan in enumerate(fused.plans.values()):
        r = plan.report
        names = sorted({d.pattern for d in r.applied})
        print(f"  plan {i}: {len(r.applied)} fused ({', '.join(names)}), predicted "
              f"{r.speedups()['eager op by op']:.2f}x vs eager op by op")

    # one decode step against a cache of the prompt, on the simulated NPU
    with torch.no_grad():
        cache = model(prompt).cache
    step = got[:, a.prompt:a.prompt + 1]
    before = autofuse.simulate(model, ((step,), {"cache": copy.deepcopy(cache)}), device=a.device)
    after = fused.simulate(step, cache=copy.deepcopy(cache))
    print(f"simulated decode step on {a.device} (batch {a.batch}, {a.prompt} cached tokens): "
          f"{before.cycles:,} -> {after.cycles:,} cycles ({before.cycles / max(after.cycles, 1):.2f}x)")


if __name__ == "__main__":
    main()
