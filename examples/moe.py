"""A Mixtral-style mixture-of-experts model from a transformers config, fused end to end.

Every router becomes one ``moe_gating_topk`` call and every experts block ``moe_init_routing`` +
``grouped_matmul`` (SwiGLU) + ``grouped_matmul`` + ``moe_finalize_routing``; attention becomes
``flash_attention``. The script prints the report, the fused model's distance to eager, and the simulated
cycles of the MoE blocks and of the whole model, unfused (eager op by op) and fused.

Run:  python examples/moe.py [--layers 2] [--hidden 64] [--experts 4] [--top-k 2] [--tokens 64]
                             [--experts-impl grouped_mm|batched_mm] [--device ascend910]
"""
import argparse

import torch
import transformers

import autofuse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="sequence length (batch 1)")
    ap.add_argument("--experts-impl", default="grouped_mm", choices=["grouped_mm", "batched_mm"])
    ap.add_argument("--device", default="ascend910")
    a = ap.parse_args()
    torch.manual_seed(0)

    cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=a.hidden, intermediate_size=a.intermediate,
                                     num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=a.experts, num_experts_per_tok=a.top_k,
                                     max_position_embeddings=max(64, a.tokens))
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.set_experts_implementation(a.experts_impl)
    ids = torch.randint(0, 256, (1, a.tokens))
    inputs = ((ids,), {"use_cache": False})

    fused = autofuse.AutoFusionEngine.fuse(model, inputs, target_device=a.device, optimization_level="O3")
    print(fused.report.summary())

    with torch.no_grad():
        err = (fused(ids, use_cache=False).logits - model(ids, use_cache=False).logits).abs().max().item()
    print(f"max |fused - eager| logits = {err:.3g}")

    before = autofuse.simulate(model, inputs, device=a.device)
    after = fused.simulate(ids, use_cache=False)
    moe = [d for d in fused.report.applied if d.pattern.startswith("moe")]
    moe_before = before.cycles_of([n for d in moe for n in d.nodes])
    moe_after = sum(n.cycles for n in after.nodes if n.fused and n.target.startswith(("autofuse.moe",
                                                                                       "autofuse.grouped")))
    print(f"simulated MoE blocks on {a.device}: {moe_before:,} -> {moe_after:,} cycles "
          f"({moe_before / max(moe_after, 1):.2f}x)")
    print(f"simulated whole model on {a.device}: {before.cycles:,} -> {after.cycles:,} cycles "
          f"({before.cycles / max(after.cycles, 1):.2f}x)")


if __name__ == "__main__":
    main()
