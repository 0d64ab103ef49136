"""Training the small GPT of gpt_small.py with its dropouts active, fused, next to the same model in eager.

Both copies start from the same weights and see the same batches; each step seeds the generator the same way,
so the fused calls draw the keep-masks eager's dropouts draw (the same elements dropped): the attention
dropout inside the attention kernel, the residual and embedding dropouts inside the epilogues and Vector
kernels around them. The losses
and the weights then follow eager's step by step, to float32 rounding. Last, one training step (forward and
backward) runs on the simulated NPU, eager op by op and fused.

Run:  python examples/train_gpt_small.py [--steps 5] [--layers 2] [--seq 64] [--dim 128] [--heads 4]
"""
import argparse
import copy
import pathlib
import sys

import torch
from torch.nn import functional as F

import autofuse

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpt_small import GPT  # noqa: E402  (the model of the inference example)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--device", default="ascend910")
    a = ap.parse_args()

    torch.manual_seed(0)
    model = GPT(vocab=512, dim=a.dim, heads=a.heads, layers=a.layers, max_seq=a.seq).train()
    eager = copy.deepcopy(model)
    data = torch.randint(0, 512, (8, 4, a.seq + 1))          # 8 batches of 4 sequences

    fused = autofuse.AutoFusionEngine.fuse(model, (data[0, :, :-1],), target_device=a.device)
    print(fused.report.summary())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]

    print(f"\n{'step':>4}  {'eager loss':>12}  {'fused loss':>12}  {'|difference|':>12}")
    worst = 0.0
    for step in range(a.steps):
        batch = data[step % len(data)]
        losses = []
        for m, opt in zip((eager, fused), opts):
            torch.manual_seed(1000 + step)                 # the same dropout draws on both sides
            logits = m(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
        print(f"{step:>4}  {losses[0]:>12.6f}  {losses[1]:>12.6f}  {abs(losses[0] - losses[1]):>12.2e}")
    drift = max((p - q).abs().max().item() for p, q in zip(eager.parameters(), model.parameters()))
    print(f"\nafter {a.steps} steps: max |loss difference| = {worst:.2e}, max |weight difference| = {drift:.2e}")

    # one training step on the simulated NPU, timing only: the forward and the backward of every parameter
    # (the logits' gradient is an input of the step: the loss itself is not simulated)
    batch = data[0, :, :-1]
    steps = {"eager op by op": autofuse.simulate(model, (batch,), device=a.device, values=False, backward=True),
             "fused": fused.simulate(batch, values=False, backward=True)}
    print(f"\none training step simulated on {a.device}:")
    for name, r in steps.items():
        ph = r.phases
        print(f"  {name:<15} {r.cycles:>12,} cycles (forward {ph['forward']:,}, backward {ph['backward']:,})")
    e, f = (steps[k].cycles for k in ("eager op by op", "fused"))
    print(f"  speed-up of the training step: {e / f:.2f}x")


if __name__ == "__main__":
    main()
