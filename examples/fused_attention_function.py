"""A user's own attention function (Q, K, V, mask, scale -> output and probabilities), fused by autofuse.

Run:  python examples/fused_attention_function.py [--seq 128] [--heads 4] [--dim 64] [--device ascend910]
"""
import argparse

import torch

import autofuse


def my_attention(q, k, v, mask, scale):
    """Plain PyTorch: scores, masked_fill, softmax, then the weighted sum. Returns (output, probabilities)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(mask == 0, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v), probs


class Block(torch.nn.Module):
    def forward(self, q, k, v, mask):
        out, probs = my_attention(q, k, v, mask, q.shape[-1] ** -0.5)
        return out, probs.mean(dim=1)         # the probabilities are used: the fused kernel returns them


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64, help="head dimension")
    ap.add_argument("--device", default="ascend910")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    B, N, S, D = 2, a.heads, a.seq, a.dim
    q, k, v = (torch.randn(B, N, S, D, dtype=torch.float16) for _ in range(3))
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    model = Block().eval()

    fused = autofuse.AutoFusionEngine.fuse(model, (q, k, v, mask), target_device=a.device,
                                           optimization_level="O3")
    print(fused.report.summary())
    out, probs = fused(q, k, v, mask)
    ref_out, ref_probs = model(q, k, v, mask)
    print(f"max |fused - eager|: output {(out.float() - ref_out.float()).abs().max():.2e}, "
          f"probabilities {(probs.float() - ref_probs.float()).abs().max():.2e}")

    before = autofuse.simulate(model, (q, k, v, mask), device=a.device)
    after = fused.simulate(q, k, v, mask)
    print(f"simulated on {a.device}: {before.cycles:,} cycles unfused -> {after.cycles:,} fused "
          f"({before.cycles / after.cycles:.2f}x)")
    return fused, before, after


if __name__ == "__main__":
    main()
