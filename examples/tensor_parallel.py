"""A GPT-2-style block split Megatron-style over tensor-parallel ranks, its matmul + all-reduce pairs fused
into MC2 kernels by AutoFusionEngine.fuse on every rank, every rank simulating its own NPU.

    torchrun --nproc-per-node 4 examples/tensor_parallel.py [--device ascend910b] [--dtype float16]

Each rank fuses its shard (``autofuse.distributed.rank_pipeline``: ``AutoFusionEngine.fuse`` finds the
row-parallel linears with their all-reduce, prices them with the tile count the cost model picks and verifies
them against the captured pair, all ranks together), then simulates the captured and the fused graph (data
through gloo). Rank 0 prints the decisions with their reason codes, each collective's link figures, the
system time (the slowest rank) fused and unfused, and how far the fused output is from the single-device
block's (against a float64 reference, next to the unfused tensor-parallel graph's own error).
"""
import argparse
import copy
import os

import torch
import torch.distributed as dist

from autofuse.distributed import RankResult, WorldResult, rank_pipeline
from autofuse.tp_models import TPBlock, example_input, make_block


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="ascend910b")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    os.environ.setdefault("AUTOFUSE_NPU_THREADS", "1")      # several ranks share the host's cores
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, a.dtype)
    block = make_block(a.hidden, a.heads, dtype)
    x = example_input(2, a.seq, a.hidden, dtype)
    shard = TPBlock(block, rank, world).eval()
    result: RankResult = rank_pipeline(shard, (x,), device=a.device)
    with torch.no_grad():
        ref64 = copy.deepcopy(block).double()(x.double())
        unfused_tp = shard(x)
    err_fused = (result.outputs.double() - ref64).abs().max().item()
    err_unfused = (unfused_tp.double() - ref64).abs().max().item()
    results = [None] * world
    dist.all_gather_object(results, result)
    errors = [None] * world
    dist.all_gather_object(errors, (err_fused, err_unfused))
    if rank == 0:
        print(WorldResult(world, a.device, results).summary())
        worst = max(e[0] for e in errors)
        base = max(e[1] for e in errors)
        print(f"error vs the float64 single-device block: fused {worst:.3g}, unfused tensor-parallel {base:.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
