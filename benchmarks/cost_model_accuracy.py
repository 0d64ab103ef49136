"""How well the analytic cost model agrees with the simulator.

Sweeps (kernel, shape, dtype, device) cases — odd sizes, tiny and huge, all devices — prices each with
``cost_model.estimate``, runs it on the simulator with the tiling the model chose, and prints the error
distribution of cycles and HBM bytes (per kernel and overall), the cases ranked by error, the agreement
on "unfused subgraph vs fused kernel" pairs, and how long ``estimate`` takes.

    python benchmarks/cost_model_accuracy.py            # the full sweep (several minutes)
    python benchmarks/cost_model_accuracy.py --quick    # the small sweep the tests pin
    python benchmarks/cost_model_accuracy.py --kernel matmul --top 30
    python benchmarks/cost_model_accuracy.py --time     # only estimate()'s speed over the sweep, and by kernel
    python benchmarks/cost_model_accuracy.py --drawn 120 --seed 1   # attention shapes drawn at random instead
    python benchmarks/cost_model_accuracy.py --drawn 60 --backward  # the same for the attention backward
    python benchmarks/cost_model_accuracy.py --drawn 60 --kernel vector_program   # generated kernels drawn at random
    python benchmarks/cost_model_accuracy.py --drawn 120 --backward --seed 8 --explain 25   # one case, phase by phase

Goal: median |pred - sim| / sim <= 5 %, worst <= 15 %, for cycles and HBM bytes; pairs
agree on the faster side in >= 98 % of cases; estimate() < 1 ms on average.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import cost_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # vector_chains, beside this script
DEVICES = ("ascend910", "ascend910b", "ascend310p")


@dataclass
class Case:
    kernel: str
    inputs: list                   # [(shape, dtype) | None]
    device: str
    params: dict = field(default_factory=dict)
    tensor_params: dict = field(default_factory=dict)   # name -> (shape, dtype): passed as arrays to npu.run
    values: dict = field(default_factory=dict)          # input position -> the array to simulate with
    timing_only: bool = False      # simulate without the data work (model-sized shapes; the counts are the same)

    def label(self) -> str:
        ins = " ".join("-" if x is None else f"{list(x[0])}{x[1][:1]}{x[1][-2:]}" for x in self.inputs)
        ps = ",".join(f"{k}={v}" for k, v in self.params.items())
        tp = ",".join(f"{k}={list(v[0])}{v[1]}" for k, v in self.tensor_params.items())
        return f"{self.kernel:16s} {self.device:10s} {ins} {ps} {tp}".rstrip()


def _array(shape, dtype, rng, high=None):
    if dtype == "uint8":                           # a packed keep-mask: random bits
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    if dtype == "bfloat16":
        import torch
        return torch.zeros(shape, dtype=torch.bfloat16)
    if dtype == "bool":
        return rng.random(shape) < 0.3
    if dtype in ("int32", "int8") and high is not None:
        return rng.integers(0, high, size=shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def simulate(case: Case, tiling=None):
    """Run a case on the simulator (values do not affect timing: zeros, except indices and masks)."""
    from autofuse import npu
    rng = np.random.default_rng(0)
    high = case.inputs[0][0][0] if case.kernel == "gather" else None
    xs = [None if x is None else case.values[i] if i in case.values else _array(x[0], x[1], rng, high)
          for i, x in enumerate(case.inputs)]
    params = {k: v for k, v in case.params.items() if k != "group_sizes"}     # the kernel reads the group list
    for k, (shape, dtype) in case.tensor_params.items():
        params[k] = _array(shape, dtype, rng)
    if case.kernel == "dropout_gen_mask":          # the host's draws, which the kernel writes as its bits
        from autofuse.npu.kernels.dropout import HostDraws
        params["draws"] = HostDraws(rng.random(case.params["shape"]) < case.params["keep_prob"])
    if tiling is not None:
        params["tiling"] = tiling
    if case.timing_only:
        params["timing_only"] = True
    return npu.run(case.kernel, *xs, device=case.device, **params).stats


def predict(case: Case):
    params = dict(case.params)
    params.update(case.tensor_params)
    return cost_model.estimate(case.kernel, case.inputs, device=case.device, **params)


# ------------------------------------------------------------------------------------------ the sweep
def _matmul_cases(quick: bool):
    f16, bf16, f32 = "float16", "bfloat16", "float32"
    big = [] if quick else [
        ((4096, 4096, 4096), f16, "ascend310p"), ((4096, 8192, 1024), f16, "ascend910"),
        ((2048, 2048, 2048), f16, "ascend910b"), ((2048, 2048, 2048), bf16, "ascend910"),
        ((128, 8192, 8192), f16, "ascend910b"), ((8192, 1024, 4096), f16, "ascend310p"),
    ]
    shapes = [(1, 1, 1), (37, 50, 29), (64, 64, 64), (300, 17, 130), (256, 256, 256), (96, 2000, 96),
              (512, 1024, 512), (33, 333, 3333), (1024, 64, 1024)]
    if not quick:
        shapes += [(1000, 777, 1500), (17, 4096, 11008), (128, 4096, 4096), (2048, 128, 2048), (4000, 4000, 100),
                   (100, 4000, 4000), (1536, 1536, 1536), (768, 3072, 768), (2047, 511, 1023)]
    out = []
    for i, (M, K, N) in enumerate(shapes):
        for d in DEVICES:
            dt = (f16, bf16, f32)[(i + DEVICES.index(d)) % 3] if not quick else (f16, f32)[i % 2]
            out.append(Case("matmul", [((M, K), dt), ((K, N), dt)], d))
    for (M, K, N), dt, d in big:
        out.append(Case("matmul", [((M, K), dt), ((K, N), dt)], d))
    # batched, transposed, bias
    extra = [
        Case("matmul", [((8, 128, 64), f16), ((8, 64, 128), f16)], "ascend910"),
        Case("matmul", [((4, 100, 300), f16), ((300, 200), f16)], "ascend910b"),
        Case("matmul", [((12, 256, 64), f16), ((12, 256, 64), f16)], "ascend310p", {"trans_b": True}),
        Case("matmul", [((64, 256), f32), ((512, 256), f32)], "ascend910", {"trans_b": True}),
        Case("matmul", [((256, 96), bf16), ((256, 160), bf16)], "ascend910b", {"trans_a": True}),
        Case("matmul", [((200, 300), f16), ((300, 400), f16)], "ascend910", {},
             {"bias": ((400,), "float32")}),
    ]
    if not quick:
        extra += [
            Case("matmul", [((32, 512, 128), f16), ((32, 128, 512), f16)], "ascend910b"),
            Case("matmul", [((16, 1024, 64), f16), ((16, 64, 1024), f16)], "ascend910"),
            Case("matmul", [((2, 8, 333, 64), bf16), ((2, 8, 64, 333), bf16)], "ascend310p"),
            Case("matmul", [((1024, 4096), f16), ((11008, 4096), f16)], "ascend910", {"trans_b": True}),
        ]
    return out + extra


def _softmax_family(quick: bool):
    """Softmax with its scale, mask (bool keep-masks and additive ones, broadcast as padding, causal and
    per-head masks are), log form, output dtype, empty-row mode and the logsumexp spellings' +inf rows:
    (shape, dim, dtype, params, mask)."""
    f16, bf16, f32, b = "float16", "bfloat16", "float32", "bool"
    cs = [((2, 4, 128, 128), -1, f16, {"scale": 0.125}, ((2, 1, 1, 128), b)),
          ((2, 4, 128, 128), -1, bf16, {"fill": -1e4}, ((128, 128), b)),
          ((4, 300), -1, f32, {"log": True}, ((4, 300), f32)),
          ((1, 8, 256, 256), -1, f16, {"out_dtype": f32}, ((1, 1, 256, 256), f16)),
          ((8, 50000), -1, f16, {"log": True, "scale": 0.5}, ((1, 50000), b)),
          ((6, 37, 19), 1, bf16, {"scale": 2.0}, ((6, 1, 19), b)),
          ((3, 5, 7), -1, f32, {"empty_rows": "zero"}, ((3, 1, 7), b)),
          ((333, 777), -1, f32, {"log": True, "out_dtype": bf16}, None),
          # a 16-bit additive mask added in its dtype, as eager adds it (scores cast down, add, sum cast up)
          ((2, 4, 128, 128), -1, f16, {"mask_add_dtype": f16}, ((2, 1, 1, 128), f16))]
    if not quick:
        cs += [((16, 1024, 1024), -1, f16, {"scale": 0.125}, ((16, 1, 1024), b)),
               ((1, 16, 2048, 2048), -1, f16, {"scale": 0.088}, ((2048, 2048), b)),
               ((2, 8, 512, 512), -1, bf16, {"fill": -3.0e38}, ((2, 1, 512, 512), b)),
               ((4096, 4096), -1, f16, {"log": True, "scale": 0.5}, ((4096, 4096), f16)),
               ((2, 512, 4096), -1, f32, {"out_dtype": bf16, "empty_rows": "zero"}, ((2, 512, 1), b)),
               ((64, 70000), -1, f32, {"log": True}, ((64, 1), f32)),
               ((4, 1000, 96), 1, f16, {"scale": 0.5}, ((4, 1, 96), f16)),
               ((32, 1024, 8), 0, f32, {"log": True}, ((1, 1024, 8), b)),
               ((8, 16, 77, 77), -1, f16, {"scale": 0.3, "out_dtype": f32}, ((8, 1, 77, 77), b)),
               ((3, 5, 100, 100), -1, f32, {}, ((100, 100), f32)),          # core shares across mask runs
               ((4, 8, 256, 256), -1, f16, {}, ((8, 256, 256), f32)),       # per-head mask, reused per batch
               ((64, 1024, 1024), -1, f16, {}, ((1024, 1024), f32)),        # re-read after L2 evicted it
               ((2, 4, 128, 128), -1, bf16, {"inf_rows": "lse", "scale": 0.5}, ((2, 1, 1, 128), b)),
               ((333, 777), -1, f16, {"inf_rows": "lse", "log": True}, None),
               ((8, 50000), -1, f32, {"inf_rows": "lse", "log": True}, None),      # two passes
               ((8, 50000), -1, f16, {"inf_rows": "lse"}, ((1, 50000), b)),
               ((4, 1000, 96), 1, f16, {"inf_rows": "lse", "scale": 0.5}, None),
               ((2, 8, 512, 512), -1, bf16, {"mask_add_dtype": bf16, "scale": 0.125}, ((2, 1, 512, 512), bf16)),
               ((8, 50000), -1, f16, {"mask_add_dtype": f16, "log": True}, ((1, 50000), f16)),      # two passes
               ((4, 1000, 96), 1, bf16, {"mask_add_dtype": bf16}, ((4, 1, 96), bf16))]
    return cs


def _vector_cases(quick: bool):
    f16, bf16, f32 = "float16", "bfloat16", "float32"
    out = []
    sm = [((333, 777), -1, f32), ((8, 50000), -1, f16), ((7,), -1, f32),
          ((64, 128, 96), 1, f16), ((2, 300, 33), 0, bf16), ((1, 8, 256, 256), -1, f16)]
    if not quick:
        sm += [((4096, 4096), -1, f16), ((1, 16, 2048, 2048), -1, f16), ((128, 70000), -1, f32), ((4, 32, 128, 128), -1, bf16),
               ((1000, 10), -1, f32), ((32, 1024, 8), 1, f16)]
    for i, (shape, dim, dt) in enumerate(sm):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("softmax", [(shape, dt)], d, {"dim": dim}))
    for i, (shape, dim, dt, p, mask) in enumerate(_softmax_family(quick)):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("softmax", [(shape, dt)], d, {"dim": dim, **p}, {"mask": mask} if mask else {}))
    norms = [((1024, 2048), f16), ((333, 777), f32), ((8, 50000), bf16), ((7,), f32)]
    if not quick:
        norms += [((4096, 4096), f16), ((2, 512, 4096), f16), ((1, 2048, 8192), bf16), ((100, 64), f16),
                  ((480, 12288), bf16), ((64, 16384), f16)]
    for i, (shape, dt) in enumerate(norms):
        H = shape[-1]
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("rms_norm", [(shape, dt), ((H,), dt)], d))
            out.append(Case("layer_norm", [(shape, dt), ((H,), dt), ((H,), dt)], d))
            if not quick:
                out.append(Case("add_rms_norm", [(shape, dt), (shape, dt), ((H,), dt)], d))
    ew = [([((1024, 2048), f16), ((1024, 2048), f16)], {"op": "add"}),
          ([((2, 128, 4096), bf16)], {"op": "gelu"}),
          ([((333, 777), f32)], {"op": "mul", "scalar": 0.5}),
          ([((8, 1, 4096), f16), ((4096,), f16)], {"op": "mul"}),
          ([((1, 8, 256, 256), f16), ((1, 1, 256, 256), "bool")], {"op": "masked_fill", "scalar": -1e4}),
          ([((100,), f32)], {"op": "exp"}),
          ([((3, 5000), f16)], {"op": "cast", "out_dtype": f32}),
          ([((64, 300), f32), ((64, 1), f32)], {"op": "div"})]
    if not quick:
        ew += [([((4096, 4096), f16), ((4096, 4096), f16)], {"op": "add"}),
               ([((2, 512, 4096), bf16)], {"op": "gelu"}),
               ([((1, 16, 512, 512), f16), ((1, 1, 512, 512), "bool")], {"op": "masked_fill", "scalar": -1e4}),
               ([((2048, 11008), f16), ((2048, 11008), f16)], {"op": "mul"}),
               ([((4, 32, 128, 128), f16)], {"op": "mul", "scalar": 0.125}),
               ([((1000, 1000), "bool"), ((1000, 1000), f16), ((1000, 1000), f16)], {"op": "where"}),
               ([((4096, 11008), bf16)], {"op": "silu"}),
               ([((17, 4097), f32)], {"op": "sigmoid"}),
               ([((2, 512, 4096), bf16)], {"op": "erf"}), ([((4096, 2048), f16)], {"op": "softplus"}),
               ([((333, 777), f32)], {"op": "log1p"}), ([((1000, 1000), f16)], {"op": "expm1"}),
               ([((2, 512, 4096), bf16)], {"op": "floor"}), ([((333, 777), f32)], {"op": "round"}),
               ([((1000, 1000), f16)], {"op": "sign"})]
    for i, (ins, p) in enumerate(ew):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("elementwise", ins, d, p))
    red = [((1024, 2048), f16, "sum", -1), ((64, 1000, 96), f32, "mean", 1), ((333, 777), bf16, "max", 0),
           ((8, 50000), f16, "sum", -1)]
    if not quick:
        red += [((4096, 4096), f16, "sum", -1), ((16, 4096, 128), bf16, "amax", (0, 2))]
    for i, (shape, dt, op, dim) in enumerate(red):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("reduce", [(shape, dt)], d, {"op": op, "dim": dim}))
    gen = [([((1024, 2048), f16)], [((1024, 2048), f16)], 1), ([((333, 777), f32), ((777,), f32)], [((333, 777), f32)], 3),
           ([((10,), f16)], [((10,), f16)], 1), ([((1000, 1000), f32)], [((1000, 1000), f32)], 40)]
    for i, (ins, outs, passes) in enumerate(gen):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("generic", ins, d, {"outputs": outs, "passes": passes}))
    return out


def _movement_cases(quick: bool):
    f16, f32 = "float16", "float32"
    mv = [("copy", [((333, 777), f32)], {}), ("copy", [((10,), "int32")], {}),
          ("cat", [((64, 300), f16), ((64, 500), f16)], {"dim": 1}),
          ("permute", [((2, 128, 16, 64), f16)], {"dims": (0, 2, 1, 3)}),
          ("permute", [((8, 100, 130), f32)], {"dims": (0, 2, 1)}),
          ("gather", [((1000, 64), f32), ((4, 77), "int32")], {})]
    if not quick:
        mv += [("copy", [((4096, 4096), f16)], {}), ("cat", [((1000, 64), f32), ((24, 64), f32)], {"dim": 0}),
               ("permute", [((2, 512, 16, 64), f16)], {"dims": (0, 2, 1, 3)}),
               ("permute", [((1024, 768), f16)], {"dims": (1, 0)}),
               ("gather", [((32000, 4096), f16), ((1, 512), "int32")], {})]
    out = []
    for i, (k, ins, p) in enumerate(mv):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case(k, ins, d, p))
    return out


def _fa_shapes(quick: bool):
    f16, bf16, f32 = "float16", "bfloat16", "float32"
    shapes = [((1, 4, 512, 128), True, f16), ((1, 8, 256, 64), False, f16), ((2, 4, 300, 64), False, bf16),
              ((1, 2, 77, 64), False, f32)]
    if not quick:
        shapes += [((1, 16, 1024, 128), True, f16), ((1, 8, 512, 64), False, f16), ((4, 16, 256, 128), False, f16),
                   ((1, 32, 2048, 128), True, f16), ((2, 8, 1024, 64), True, bf16), ((1, 4, 4096, 128), True, f16),
                   ((8, 8, 128, 64), False, f16), ((1, 16, 640, 128), False, f16)]
    return shapes


def _fa_masks(quick: bool):
    f16 = "float16"
    ms = [((1, 8, 512, 64), ((1, 1, 512, 512), "bool"), f16)]
    if not quick:
        ms += [((2, 4, 256, 64), ((256, 256), f16), f16), ((1, 16, 1024, 128), ((1, 1, 1024, 1024), "bool"), f16)]
    return ms


def _fa_probs(quick: bool):
    """return_probs cases (the second sweep that writes the normalised probabilities): coupled and split
    devices, with and without causal or a mask, odd sizes. (shape, dtype, params, tensor params, devices)"""
    f16, bf16, f32 = "float16", "bfloat16", "float32"
    m = {"mask": ((1, 1, 256, 256), "bool")}
    cs = [((1, 2, 128, 64), f16, {}, {}, ("ascend910", "ascend910b")),
          ((1, 4, 256, 64), f16, {"causal": True}, {}, ("ascend910b", "ascend310p")),
          ((2, 2, 77, 64), f32, {}, {}, ("ascend910",)),
          ((1, 4, 300, 64), bf16, {"causal": True}, {}, ("ascend910b",)),
          ((1, 4, 256, 64), f16, {}, m, ("ascend910",))]
    if not quick:
        cs = [(s_, dt, p, tp, DEVICES) for s_, dt, p, tp, _ in cs]
        cs += [((1, 8, 512, 128), f16, {}, {}, DEVICES), ((1, 16, 1024, 128), f16, {"causal": True}, {}, DEVICES),
               ((2, 8, 1000, 64), bf16, {}, {}, ("ascend910", "ascend910b"))]
    return cs


def _fa_stats(quick: bool):
    """return_stats cases (each row's max and sum written out for the backward): causal, masks, GQA, dropout, odd
    sizes. (q shape, kv heads, dtype, params, tensor params, devices)"""
    f16, bf16, f32 = "float16", "bfloat16", "float32"
    cs = [((2, 4, 256, 64), 4, f16, {"causal": True}, {}, ("ascend910",)),
          ((1, 4, 300, 64), 2, bf16, {}, {"drop_mask": ((1, 4, 300, 38), "uint8"), "keep_prob": 0.9}, ("ascend910b",)),
          ((1, 8, 512, 64), 8, f16, {}, {"mask": ((1, 1, 512, 512), "bool")}, ("ascend310p",)),
          ((2, 2, 77, 64), 2, f32, {"causal": True}, {}, ("ascend910b",))]
    if not quick:
        cs = [(s_, nk, dt, p, tp, DEVICES) for s_, nk, dt, p, tp, _ in cs]
        cs += [((8, 12, 1024, 64), 12, f16, {"causal": True}, {}, DEVICES),
               ((1, 32, 2048, 128), 8, f16, {"causal": True}, {}, DEVICES)]
    return cs


def _fa_cases(quick: bool):
    out = []
    for qs, nkv, dt, p, tp, devs in _fa_stats(quick):
        kv = ((qs[0], nkv, *qs[2:]), dt)
        tp = dict(tp)
        p = {**p, "return_stats": True}
        if "keep_prob" in tp:
            p["keep_prob"] = tp.pop("keep_prob")
        for d in devs:
            out.append(Case("flash_attention", [(qs, dt), kv, kv], d, p, tp))
    for shape, dt, p, tp, devs in _fa_probs(quick):
        for d in devs:
            out.append(Case("flash_attention", [(shape, dt)] * 3, d, {**p, "return_probs": True}, dict(tp)))
    for i, (shape, causal, dt) in enumerate(_fa_shapes(quick)):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("flash_attention", [(shape, dt)] * 3, d, {"causal": causal}))
    for i, (shape, mask, dt) in enumerate(_fa_masks(quick)):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("flash_attention", [(shape, dt)] * 3, d, {}, {"mask": mask}))
    # causal with an additive mask per head (a learned bias read in the kept tiles only: T5's decoder under the skip)
    biased = [((1, 12, 1024, 64), "float32")]
    if not quick:
        biased += [((2, 4, 130, 16), "float32"), ((2, 16, 2048, 128), "float32")]
    for i, (shape, dt) in enumerate(biased):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("flash_attention", [(shape, dt)] * 3, d, {"causal": True},
                            {"mask": ((1, shape[1], shape[2], shape[2]), dt)}))
    # a bias and a keep-mask combined into one additive mask whose filled entries replace the scores (fill_in_mask:
    # MPT's ALiBi then its fill; a bias then masked_fill(-1e9))
    selected = [((2, 4, 129, 64), "float32", "float32")]
    if not quick:
        selected += [((1, 16, 1024, 128), "float16", "float32"), ((4, 8, 512, 64), "bfloat16", "bfloat16")]
    for i, (shape, dt, mdt) in enumerate(selected):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("flash_attention", [(shape, dt)] * 3, d, {"causal": False, "fill": -1e4,
                                                                      "fill_in_mask": True},
                            {"mask": ((shape[0], shape[1], shape[2], shape[2]), mdt)}))
    # dropout on the probabilities (a keep bit per score, FlashAttentionScore's drop_mask), and its generator
    drops = [((2, 4, 256, 64), True, "float16"), ((1, 2, 100, 64), False, "float32")]
    if not quick:
        drops += [((8, 12, 1024, 64), True, "float16"), ((4, 4, 129, 80), False, "bfloat16"),
                  ((1, 16, 2048, 128), True, "float16")]
    for i, (shape, causal, dt) in enumerate(drops):
        bits = ((*shape[:3], -(-shape[2] // 8)), "uint8")
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("flash_attention", [(shape, dt)] * 3, d, {"causal": causal, "keep_prob": 0.9},
                            {"drop_mask": bits}))
            out.append(Case("dropout_gen_mask", [], d, {"shape": (*shape[:3], shape[2]), "keep_prob": 0.9}))
    # logit soft-capping (Gemma 2: head dim 256, GQA, causal) and attention sinks (GPT-OSS: head dim 64, GQA, a
    # sink logit per query head)
    forms = {"softcap": [((2, 4, 129, 64), 4, False, "float32")], "sinks": [((2, 8, 129, 64), 2, False, "float32")]}
    if not quick:
        forms["softcap"] += [((1, 8, 1024, 256), 4, True, "bfloat16"), ((4, 8, 512, 128), 8, True, "float16")]
        forms["sinks"] += [((1, 64, 2048, 64), 8, True, "bfloat16"), ((4, 16, 512, 64), 4, True, "float16")]
    for form, shapes in forms.items():
        for i, (qs, nkv, causal, dt) in enumerate(shapes):
            kv = ((qs[0], nkv, *qs[2:]), dt)
            p, tp = ({"causal": causal, "softcap": 50.0}, {}) if form == "softcap" else \
                ({"causal": causal}, {"sinks": ((qs[1],), dt)})
            for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
                out.append(Case("flash_attention", [(qs, dt), kv, kv], d, dict(p), dict(tp)))
    # a sliding window (Mistral, Gemma's and GPT-OSS's local layers): the band's tiles only, its left edge masked
    wins = [((2, 4, 300, 64), 2, 100, "float16", {})]
    if not quick:
        wins += [((1, 32, 2048, 128), 8, 128, "bfloat16", {}), ((1, 8, 4096, 64), 8, 1024, "float16", {}),
                 ((4, 4, 129, 80), 4, 40, "float32", {}), ((1, 64, 2048, 64), 8, 128, "bfloat16", {"return_stats": True}),
                 ((1, 4, 256, 64), 4, 50, "float16", {"return_probs": True}), ((2, 8, 1024, 128), 8, 300, "float16", {})]
    for i, (qs, nkv, w, dt, extra) in enumerate(wins):
        kv = ((qs[0], nkv, *qs[2:]), dt)
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("flash_attention", [(qs, dt), kv, kv], d, {"causal": True, "window": w, **extra}))
    # the score bound launched before a causal skip over a finite-valued mask (q and k; GQA: fewer k rows)
    bounds = [((8, 12, 1024, 64), (8, 12, 1024, 64), "float16"), ((1, 2, 77, 64), (1, 1, 80, 64), "float32")]
    if not quick:
        bounds += [((1, 32, 2048, 128), (1, 8, 2048, 128), "bfloat16"), ((4, 4, 129, 80), (4, 4, 129, 80), "float16"),
                   ((1, 32, 1, 128), (1, 8, 4000, 128), "float16")]
    for i, (qs, ks, dt) in enumerate(bounds):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("score_bound", [(qs, dt), (ks, dt)], d))
    # the bias bound launched with it before a causal skip over a learned bias plus a causal mask (T5's decoder)
    biases = [((1, 8, 1024, 1024), "float32"), ((1, 4, 37, 37), "float32")]
    if not quick:
        biases += [((1, 12, 130, 130), "float16"), ((2, 16, 2048, 2048), "bfloat16")]
    for i, (xs, dt) in enumerate(biases):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("bias_bound", [(xs, dt)], d))
    return out


def _fag_cases(quick: bool):
    """The attention backward (flash_attention_grad): q, k, v, out, dout; short launches, odd sizes, GQA,
    Dv != D, masks (bool per batch, additive broadcast), causal, dropout, saved statistics, soft-capping, every
    device."""
    f16, bf16, f32 = "float16", "bfloat16", "float32"
    # (B, N, Nkv, Sq, Skv, D, Dv), dtype, params, tensor-param kinds
    cs = [((1, 1, 1, 16, 16, 64, 64), f16, {}, ()), ((1, 2, 1, 77, 50, 64, 64), f32, {}, ()),
          ((2, 4, 2, 256, 256, 64, 64), f16, {"causal": True}, ()), ((1, 4, 4, 200, 333, 128, 128), bf16, {}, ()),
          ((2, 4, 4, 256, 256, 64, 64), f16, {}, ("mask",)), ((1, 4, 2, 256, 256, 64, 64), f16, {"causal": True},
                                                               ("drop",)),
          ((2, 4, 4, 128, 128, 64, 64), f16, {}, ("stats",)), ((1, 8, 8, 130, 130, 80, 64), f16, {"causal": True}, ())]
    if not quick:
        cs += [((8, 12, 12, 1024, 1024, 64, 64), f16, {"causal": True}, ()),
               ((1, 16, 16, 1024, 1024, 128, 128), f16, {"causal": True}, ()),
               ((1, 32, 8, 2048, 2048, 128, 128), bf16, {"causal": True}, ("stats",)),
               ((4, 16, 16, 256, 256, 128, 128), f16, {}, ()), ((2, 8, 8, 1000, 1000, 64, 64), bf16, {}, ("mask",)),
               ((2, 8, 8, 512, 512, 64, 64), f16, {"causal": True}, ("drop",)),
               ((1, 4, 4, 4096, 4096, 128, 128), f16, {"causal": True}, ()), ((8, 8, 8, 128, 128, 64, 64), f32, {}, ()),
               ((2, 4, 4, 256, 256, 64, 64), f16, {}, ("addmask",)),
               ((1, 16, 16, 1024, 1024, 128, 128), f16, {"fill": -1e4, "fill_in_mask": True}, ("addmask", "stats"))]
    cs += [((2, 4, 4, 129, 129, 64, 64), f32, {"fill": -1e4, "fill_in_mask": True}, ("addmask",))]
    # logit soft-capping (Gemma 2: head dim 256, GQA, causal; with and without the forward's statistics), and
    # the same head dim without the cap
    cs += [((2, 4, 2, 129, 129, 64, 64), f32, {"softcap": 50.0}, ())]
    if not quick:
        cs += [((1, 8, 4, 1024, 1024, 256, 256), bf16, {"causal": True, "softcap": 50.0}, ("stats",)),
               ((2, 8, 4, 512, 512, 128, 128), f16, {"causal": True, "softcap": 30.0}, ()),
               ((1, 8, 4, 1024, 1024, 256, 256), bf16, {"causal": True}, ("stats",))]
    # a sliding window (Mistral, Gemma's and GPT-OSS's local layers): the band's pairs only
    cs += [((1, 4, 2, 300, 300, 64, 64), f16, {"causal": True, "window": 100}, ())]
    if not quick:
        cs += [((1, 32, 8, 2048, 2048, 128, 128), bf16, {"causal": True, "window": 128}, ("stats",)),
               ((1, 8, 8, 4096, 4096, 64, 64), f16, {"causal": True, "window": 1024}, ()),
               ((2, 4, 4, 129, 129, 80, 80), f32, {"causal": True, "window": 40}, ("stats",)),
               ((1, 64, 8, 2048, 2048, 64, 64), bf16, {"causal": True, "window": 128}, ("stats",))]
    out = []
    for i, ((B, N, Nkv, Sq, Skv, D, Dv), dt, p, kinds) in enumerate(cs):
        ins = [((B, N, Sq, D), dt), ((B, Nkv, Skv, D), dt), ((B, Nkv, Skv, Dv), dt), ((B, N, Sq, Dv), dt),
               ((B, N, Sq, Dv), dt)]
        tp, p = {}, dict(p)
        if "mask" in kinds:
            tp["mask"] = ((B, 1, Sq, Skv), "bool")
        if "addmask" in kinds:
            tp["mask"] = ((Sq, Skv), dt)
        if "drop" in kinds:
            tp["drop_mask"] = ((B, N, Sq, -(-Skv // 8)), "uint8")
            p["keep_prob"] = 0.9
        if "stats" in kinds:
            tp["softmax_max"] = tp["softmax_sum"] = ((B, N, Sq), f32)
        for d in (DEVICES if not quick or i < 2 else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("flash_attention_grad", ins, d, p, dict(tp)))
    return out


def _distinct_logits(T, E, dtype, rng):
    """Router logits without ties (every row a permutation of E exactly representable values): the model
    prices the tie-free kernel; tied rows cost Scalar cycles only the data decides."""
    import torch
    x = np.argsort(rng.random((T, E)), axis=1).astype(np.float32) * (4.0 / E) - 2.0
    return torch.from_numpy(x).to(getattr(torch, dtype))


def _moe_cases(quick: bool):
    """MoE kernels: router top-k (Mixtral, Qwen, DeepSeek-V3 groups), routing, finalize, grouped GEMM with
    even, skewed and empty experts, decode- and prefill-sized loads, and their unfused counterparts."""
    f16, bf16, f32 = "float16", "bfloat16", "float32"
    rng = np.random.default_rng(1)
    out = []
    gate = [((4096, 8), f32, {"k": 2, "renorm": True, "eps": 0.0}),
            ((37, 60), bf16, {"k": 4, "out_dtype": bf16}),
            ((1, 8), f16, {"k": 2, "renorm": True}),
            ((500, 256), f32, {"k": 8, "norm": "sigmoid", "renorm": True, "n_group": 8, "topk_group": 4,
                               "group_score": "top2", "routed_scaling_factor": 2.5}, ((256,), f32))]
    if not quick:
        gate += [((1000, 128), f16, {"k": 8, "renorm": True}), ((5000, 16), bf16, {"k": 4, "norm": "sigmoid"}),
                 ((64, 64), f32, {"k": 6, "n_group": 8, "topk_group": 3, "group_score": "max"}),
                 ((2048, 32), bf16, {"k": 4, "norm": "topk_softmax", "out_dtype": bf16}),    # GPT-OSS: top-k first
                 # the groups not kept filled with 0.0 (Mistral 4; and with a selection bias): the scores gathered
                 ((512, 64), f32, {"k": 4, "renorm": True, "n_group": 4, "topk_group": 2, "group_score": "top2",
                                   "group_fill": 0.0}),
                 ((333, 256), bf16, {"k": 8, "norm": "sigmoid", "n_group": 8, "topk_group": 4, "group_score": "top2",
                                     "group_fill": 0.0}, ((256,), f32))]
    for i, g in enumerate(gate):
        (T, E), dt, p = g[:3]
        bias = g[3] if len(g) > 3 else None
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            ins = [((T, E), dt)] + ([bias] if bias else [])
            out.append(Case("moe_gating_topk", ins, d, p, values={0: _distinct_logits(T, E, dt, rng)}))
    tk = [((333, 77), f16, {"k": 5}), ((64, 500), f32, {"k": 20, "largest": False})]
    for i, ((T, E), dt, p) in enumerate(tk):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("topk", [((T, E), dt)], d, p, values={0: _distinct_logits(T, E, dt, rng)}))
    route = [(4096, 4096, 8, 2, f16), (1, 4096, 8, 2, bf16), (333, 1000, 60, 4, f32)]
    if not quick:
        route += [(64, 7168, 256, 8, bf16), (2048, 2048, 64, 6, f16)]
    for i, (T, H, E, k, dt) in enumerate(route):
        if quick and T * H > 1 << 21:
            continue
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            ids = rng.integers(0, max(1, E // (4 if i % 2 else 1)), size=(T, k)).astype(np.int32)   # skewed
            out.append(Case("moe_init_routing", [((T, H), dt), ((T, k), "int32")], d, {"num_experts": E},
                            values={1: ids}))
            perm = rng.permutation(T * k).astype(np.int32)
            out.append(Case("moe_finalize_routing", [((T * k, H), dt), ((T, k), f32), ((T * k,), "int32")]
                            + ([((T, H), dt)] if i % 2 == 0 else []), d, values={2: perm}))
    ia = [((500, 300), f32, 900), ((4096, 1024), f16, 8192)] if not quick else [((500, 300), f32, 900)]
    for i, (shape, dt, N) in enumerate(ia):
        for d in (DEVICES if not quick else DEVICES):
            idx = rng.integers(0, shape[0], size=(N,)).astype(np.int64)
            out.append(Case("index_add", [(shape, dt), ((N,), "int64"), ((N,) + shape[1:], dt)], d, {},
                            values={1: idx}))
    gm = [(64, 512, 1024, 8, (8,) * 8, None, False),                      # decode: 8 rows per expert
          (64, 512, 1024, 8, (8,) * 8, "swiglu", False),
          (300, 256, 384, 4, (200, 0, 37, 63), None, True),               # skewed, an empty expert, bias
          (300, 256, 384, 4, (200, 0, 37, 63), "gelu", False),
          (1024, 1024, 1024, 8, (128,) * 8, "swiglu", False)]              # prefill-sized
    if not quick:
        gm += [(4096, 1024, 2048, 8, (1024, 0, 512, 512, 1536, 256, 256, 0), "swiglu", False),
               (200, 2048, 768, 16, (40, 0, 0, 8, 64, 0, 0, 0, 88, 0, 0, 0, 0, 0, 0, 0), "silu", True)]
    for i, (M, K, N, E, sizes, act, bias) in enumerate(gm):
        for d in DEVICES if (not quick or i < 3) else DEVICES[i % 3:i % 3 + 1]:
            for trans in ((True,) if quick else (True, False)):
                w = ((E, N, K) if trans else (E, K, N), f16 if i % 2 == 0 else bf16)
                dt = w[1]
                ins = [((M, K), dt), w, ((E,), "int32")] + ([((E, N), f32)] if bias else [])
                out.append(Case("grouped_matmul", ins, d, {"trans_w": trans, "activation": act, "group_sizes": sizes},
                                values={2: np.array(sizes, dtype=np.int32)}))
                if act is not None:                       # a training forward: the product stored too
                    out.append(Case("grouped_matmul", ins, d, {"trans_w": trans, "activation": act,
                                                               "group_sizes": sizes, "return_product": True},
                                    values={2: np.array(sizes, dtype=np.int32)}))
                if act is None and not bias:
                    out.append(Case("matmul_per_group", [((M, K), dt), w, ((E,), "int32")], d,
                                    {"trans_w": trans, "group_sizes": sizes},
                                    values={2: np.cumsum(sizes).astype(np.int32)}))
    # GPT-OSS's experts: [E, in, out] weights, a bias per expert, the clamped SwiGLU on interleaved gate/up pairs
    oss = [(96, 256, 384, 4, (50, 0, 30, 16), "bfloat16")]
    if not quick:
        oss += [(1024, 2880, 5760, 32, (32,) * 32, "bfloat16"), (300, 512, 1040, 8, (100, 0, 0, 7, 93, 50, 50, 0),
                                                                  "float16")]
    for i, (M, K, N, E, sizes, dt) in enumerate(oss):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            ins = [((M, K), dt), ((E, K, N), dt), ((E,), "int32"), ((E, N), dt)]
            for product in (False, True):
                p = {"activation": "clamped_swiglu", "swiglu_order": "interleaved", "limit": 7.0, "alpha": 1.702,
                     "group_sizes": sizes}
                if product:
                    p["return_product"] = True
                out.append(Case("grouped_matmul", ins, d, p, values={2: np.array(sizes, dtype=np.int32)},
                                timing_only=M * N > 4_000_000))
    if not quick:
        out += _moe_7b_cases()
    out += _moe_weight_grad_cases(quick)
    out += _moe_backward_cases(quick)
    return out


def _moe_7b_cases():
    """Mixtral-8x7B's experts (H 4096, I 14336, 8 experts, bf16, transformers' [E, out, in] weights): the down
    projection, gate_up with SwiGLU (with and without the stored product) and the dx GEMMs of both (trans_w
    False), at prefill (1024 rows per expert) and decode (64) loads; the slowest to simulate on fewer devices."""
    H, I, E, bf16 = 4096, 14336, 8, "bfloat16"
    out = []

    def add(rows, x, w, devices, trans, act=None, product=False):
        sizes = (rows,) * E
        p = {"trans_w": trans, "activation": act, "group_sizes": sizes}
        if product:
            p["return_product"] = True
        for d in devices:
            out.append(Case("grouped_matmul", [((rows * E, x), bf16), (w, bf16), ((E,), "int32")], d, p,
                            values={2: np.array(sizes, dtype=np.int32)}, timing_only=True))

    for rows in (1024, 64):
        decode = rows == 64
        add(rows, I, (E, H, I), DEVICES, True)                                       # down
        add(rows, H, (E, H, I), DEVICES if decode else DEVICES[:2], False)           # down's dx
        add(rows, H, (E, 2 * I, H), DEVICES if decode else DEVICES[1:2], True, "swiglu")      # gate_up
        add(rows, H, (E, 2 * I, H), DEVICES if decode else DEVICES[:1], True, "swiglu", True)
        add(rows, 2 * I, (E, 2 * I, H), DEVICES if decode else DEVICES[2:], False)   # gate_up's dx
    return out


def _moe_weight_grad_cases(quick: bool):
    """The grouped GEMM's weight gradient (lhs [M, P], rhs [M, Q] -> [E, P, Q]): decode- and prefill-sized
    groups, skewed loads with empty experts, one expert holding nearly every row; and eager's per-expert GEMMs."""
    f16, bf16, f32 = "float16", "bfloat16", "float32"
    wg = [(203, 96, 80, (30, 0, 70, 5), bf16),                              # tiny, an empty expert
          (512, 256, 384, (64,) * 8, f16),                                   # decode-sized groups
          (1024, 512, 512, (300, 200, 0, 100, 224, 200, 0, 0), bf16),      # skewed, three empty
          (64, 128, 128, (1, 2, 3, 58), f32)]                                # one expert holds most rows
    if not quick:
        wg += [(2048, 1024, 768, (256,) * 8, f16), (4096, 512, 1024, (512,) * 8, f32),
               (1500, 384, 320, (700, 50, 50, 700), bf16), (8192, 1024, 2048, (1024,) * 8, bf16),
               (4096, 3584, 512, (512,) * 8, bf16)]                                # dP of a wide gate_up
    out = []
    for i, (M, P, Q, sizes, dt) in enumerate(wg):
        E = len(sizes)
        for d in DEVICES:
            out.append(Case("grouped_matmul_weight_grad", [((M, P), dt), ((M, Q), dt), ((E,), "int32")], d,
                            {"group_sizes": sizes}, values={2: np.array(sizes, dtype=np.int32)}))
        d = DEVICES[i % 3]
        out.append(Case("matmul_per_group_weight_grad", [((M, P), dt), ((M, Q), dt), ((E,), "int32")], d,
                        {"group_sizes": sizes}, values={2: np.cumsum(sizes).astype(np.int32)}))
    return out


def _moe_backward_cases(quick: bool):
    """The combine's and the router's backward kernels: one-token and decode-sized launches, prefill-sized
    ones, odd sizes, rows never named (the zero fill and atomic adds), low-precision scales;
    softmax/sigmoid routers with and without renormalisation and scaling."""
    f16, bf16, f32 = "float16", "bfloat16", "float32"
    rng = np.random.default_rng(7)
    out = []
    fin = [(1, 4096, 2, bf16, f32, False), (37, 333, 4, f16, f32, False), (512, 1024, 2, f32, f32, False),
           (100, 200, 3, bf16, bf16, True), (8, 7168, 8, bf16, f32, False)]
    if not quick:
        fin += [(2048, 2048, 2, bf16, f32, False), (600, 520, 6, f16, f16, False), (250, 4100, 1, f32, f32, True),
                (int(rng.integers(50, 400)), int(rng.integers(64, 3000)), int(rng.integers(1, 9)), f16, f32, False)]
    for i, (T, H, k, dt, sdt, acc) in enumerate(fin):
        R = T * k + (5 if acc else 0)
        ridx = rng.permutation(R)[:T * k]               # accumulate: 5 rows never named (zeros)
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            ins = [((T, H), dt), ((R, H), dt), ((T, k), sdt), ((T * k,), "int32")]
            out.append(Case("moe_finalize_routing_grad", ins, d, {"accumulate": acc} if acc else {},
                            values={3: ridx.astype(np.int32)}))
    gate = [((1, 8), f32, f32, {"k": 2, "renorm": True, "eps": 0.0}),
            ((4096, 8), bf16, f32, {"k": 2, "renorm": True, "eps": 0.0}),
            ((333, 60), f16, f16, {"k": 4}),
            ((500, 256), f32, f32, {"k": 8, "norm": "sigmoid", "renorm": True, "routed_scaling_factor": 2.5})]
    if not quick:
        gate += [((1000, 128), bf16, bf16, {"k": 6, "norm": "sigmoid"}), ((77, 16), f16, f32,
                                                                          {"k": 1, "norm": "none",
                                                                           "routed_scaling_factor": 2.0}),
                 ((int(rng.integers(100, 3000)), 64), f32, f32, {"k": 4, "renorm": True})]
    for i, ((T, E), dt, gdt, p) in enumerate(gate):
        k = p["k"]
        ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("moe_gating_topk_grad", [((T, E), dt), ((T, k), gdt), ((T, k), "int32")], d, p,
                            values={2: ids}))
    return out


def _link_cases(quick: bool):
    """Collectives and MC2 kernels, one rank of a rank-symmetric world (``world=``: no gloo needed)."""
    f16, bf16, f32 = "float16", "bfloat16", "float32"
    cs = [("all_reduce", [((37, 50), f32)], "ascend910b", {"world": 4}),
          ("all_reduce", [((1024, 4096), bf16)], "ascend910", {"world": 8}),
          ("all_reduce", [((256, 1000), f16)], "ascend310p", {"world": 4}),
          ("reduce_scatter", [((1024, 1024), f16)], "ascend910", {"world": 4, "algorithm": "ring"}),
          ("all_gather", [((128, 4096), f16)], "ascend910b", {"world": 8}),
          ("all_to_all", [((512, 1024), f16)], "ascend910b", {"world": 16}),
          ("matmul_all_reduce", [((16, 512), f16), ((512, 4096), f16)], "ascend910b", {"world": 8, "tiles": 1}),
          ("matmul_all_reduce", [((512, 512), f16), ((512, 2048), f16)], "ascend910", {"world": 8, "tiles": 4}),
          ("matmul_all_reduce", [((300, 200), f32), ((200, 256), f32)], "ascend310p", {"world": 4, "tiles": 2}),
          ("matmul_reduce_scatter", [((512, 256), f16), ((256, 512), f16)], "ascend910", {"world": 4, "tiles": 2}),
          ("all_gather_matmul", [((64, 512), f16), ((512, 768), f16)], "ascend910", {"world": 4, "tiles": 2}),
          ("matmul_all_reduce", [((16, 512), f16), ((512, 2048), f16)], "ascend910b",
           {"world": 8, "tiles": 8, "tiling": {"m0": 16, "n0": 16, "k0": 256, "k1": 512}}),
          ("matmul_all_reduce", [((64, 1376), f16), ((1376, 4096), f16)], "ascend910b",
           {"world": 8, "tiles": 4, "algorithm": "mesh|oneshot"})]
    if not quick:
        cs += [("all_reduce", [((4096, 4096), f16)], "ascend910b", {"world": 8}),
               ("all_reduce", [((1024, 4096), f16)], "ascend910", {"world": 8, "algorithm": "ring"}),
               ("all_reduce", [((512, 4096), f16)], "ascend910b", {"world": 16}),
               ("all_reduce", [((2048, 4096), f16)], "ascend910b", {"world": 64}),
               ("reduce_scatter", [((1024, 1024), f16)], "ascend910b", {"world": 8}),
               ("all_gather", [((128, 4096), bf16)], "ascend310p", {"world": 4}),
               ("all_to_all", [((512, 1024), f16)], "ascend910b", {"world": 8}),
               ("matmul_all_reduce", [((1024, 512), f16), ((512, 4096), f16)], "ascend910b", {"world": 8, "tiles": 4}),
               ("matmul_all_reduce", [((1024, 1376), bf16), ((1376, 4096), bf16)], "ascend910b",
                {"world": 8, "tiles": 8}),
               ("matmul_all_reduce", [((512, 512), f16), ((512, 1024), f16)], "ascend910b", {"world": 16, "tiles": 4}),
               ("matmul_reduce_scatter", [((1024, 512), f16), ((512, 1024), f16)], "ascend910b",
                {"world": 8, "tiles": 4}),
               ("all_gather_matmul", [((128, 1024), f16), ((1024, 1024), f16)], "ascend910b", {"world": 8, "tiles": 4})]
    return [Case(k, ins, d, p) for k, ins, d, p in cs]


def _vector_program_cases(quick: bool):
    """Generated kernels: random programs (tiny to 50,000 rows, odd widths, rows that need column chunks,
    RoPE-like broadcasts over an outer dim, shuffles) on every device, and (full sweep) the 7B chains."""
    from cost_model.program import random_program
    shapes = [((1,), 64, "float16", 6, 1), ((7,), 130, "float32", 9, 2), ((2, 4, 33), 512, "bfloat16", 8, 1),
              ((1000,), 20000, "float32", 5, 1)]
    if not quick:
        shapes += [((3, 100), 33, "bfloat16", 12, 0), ((64,), 96, "float16", 14, 2), ((1,), 1, "float32", 4, 0), ((5000,), 128, "float16", 10, 1), ((2, 2000), 4096, "bfloat16", 8, 2),
                   ((50000,), 64, "float16", 6, 1), ((16, 300), 257, "float32", 16, 1), ((3,), 65536, "float16", 6, 2),
                   ((8, 128), 1000, "bfloat16", 20, 0), ((1, 32, 500), 128, "float16", 9, 1),
                   ((100,), 12288, "bfloat16", 7, 1), ((4096,), 4096, "float16", 12, 0)]
    out = []
    for i, (lead, width, dt, ops, red) in enumerate(shapes):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            p = random_program(17 * i + DEVICES.index(d), lead, width, dt, n_ops=ops, reductions=red,
                               shuffles=i % 3 == 2 and width % 2 == 0 and width <= 4096)
            out.append(Case("vector_program", specs_of(p), d, {"program": p}))
    # an input broadcast over an outer dim (RoPE's cos over the heads): block-major walks
    from cost_model.program import Builder
    b = Builder((2, 8, 300))
    q, c = b.input("float16", (2, 8, 300, 64)), b.input("float32", (2, 1, 300, 64))
    rot = b.cat(b.neg(b.slice(q, start=32, stop=64)), b.slice(q, start=0, stop=32))
    b.output(b.add(b.mul(q, c), b.mul(rot, c)), "float16")
    p = b.build()
    for d in (DEVICES if not quick else DEVICES[1:2]):
        out.append(Case("vector_program", specs_of(p), d, {"program": p}))
    # dropouts over packed keep-masks (bit inputs): alone, with a residual add, with a LayerNorm after it
    # (two reductions); rows too wide for UB (column chunks); a mask broadcast over an outer dim
    drops = [("residual", (333,), 1000, "float16", None), ("layer_norm", (96,), 4096, "float32", None)]
    if not quick:
        drops += [("dropout", (4096,), 1024, "float16", None), ("dropout", (1000,), 100, "float32", None),
                  ("residual", (2, 512), 4096, "bfloat16", None), ("layer_norm", (2048,), 1024, "float16", None),
                  ("layer_norm", (8, 100), 768, "bfloat16", None), ("residual", (16,), 16384, "float32", None),
                  ("layer_norm", (24,), 32768, "float32", None), ("dropout", (4, 256), 200, "float16", (256, 200))]
    for i, (kind, lead, W, dt, ks) in enumerate(drops):
        p = dropout_program(kind, lead, W, dt, ks)
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("vector_program", specs_of(p), d, {"program": p}))
    # activations and spreads written as aten ops (erf, softplus, mish, elu, hardswish, std, ...)
    for i, (lead, W, dt, fn) in enumerate(_activation_chains(quick)):
        p = _traced_program(fn, tuple(lead) + (W,), dt)
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("vector_program", specs_of(p), d, {"program": p}))
    if not quick:
        import vector_chains as vc
        for name, fn, shapes_ in vc.chains():
            built, _ = vc.build(fn, shapes_)
            p = built.program
            for d in DEVICES:
                out.append(Case("vector_program", specs_of(p), d, {"program": p}))
    return out


def _activation_chains(quick: bool):
    """(lead, width, dtype, function of one tensor) of chains of activations and row spreads a model writes."""
    import math
    import torch
    import torch.nn.functional as F
    acts = [((2, 64), 1000, "float16", lambda x: x * 0.5 * (1 + torch.erf(x / math.sqrt(2)))),
            ((333,), 777, "float32", lambda x: F.mish(x) + F.softplus(x, 2.0, 5.0) - F.logsigmoid(x))]
    if not quick:
        acts += [((4096,), 4096, "bfloat16", lambda x: F.hardswish(x) * F.hardsigmoid(x) + F.relu6(x) + F.hardtanh(x)),
                 ((1000,), 3000, "float16", lambda x: F.elu(x) + F.selu(x) + F.celu(x, 2.0) + F.leaky_relu(x, 0.2)),
                 ((8, 128), 1024, "float32", lambda x: torch.log1p(x.abs()) * torch.expm1(x * 0.1) + torch.erf(x)),
                 ((50000,), 64, "bfloat16", lambda x: F.softplus(x) * F.mish(x)),
                 ((2000,), 1024, "float16", lambda x: (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)),
                 ((4, 300), 257, "float32", lambda x: x * x.var(-1, correction=0, keepdim=True)),
                 # roundings, sign, nan_to_num and the base-2/10 logs and powers: casts, compare-selects, pow
                 ((2, 64), 1000, "float16", lambda x: torch.round(x * 4) / 4 + torch.frac(x) + torch.sign(x)),
                 ((333,), 777, "float32", lambda x: torch.nan_to_num(torch.log2(x)) + torch.exp2(x * 0.1) +
                  torch.pow(10.0, x)),
                 ((4096,), 4096, "bfloat16", lambda x: torch.floor(x) * torch.ceil(x) - torch.trunc(x) +
                  torch.log10(x.abs() + 1)),
                 # 2-norms over the row: the squares' sum and its root, F.normalize's clamp and division
                 ((8, 128), 1024, "float16", lambda x: F.normalize(x, dim=-1) * 2 + x.norm(dim=-1, keepdim=True)),
                 ((3000,), 96, "float32", lambda x: x / torch.linalg.vector_norm(x, dim=-1, keepdim=True))]
    return acts


def _traced_program(fn, shape, dtype):
    import torch
    from autofuse.vector_program import program_from_function
    built, _ = program_from_function(fn, [torch.empty(shape, dtype=getattr(torch, dtype), device="meta")])
    return built.program


def specs_of(p):
    """The (shape, dtype) of the tensors that hold a program's inputs (a bit input: its packed uint8 bytes)."""
    from cost_model.program import BIT, stored_shape
    return [(tuple(stored_shape(x)), "uint8") if x.dtype == BIT else (tuple(x.shape), x.dtype) for x in p.inputs]


def dropout_program(kind, lead, W, dtype, keep_shape=None, p=0.1):
    """A dropout over a packed keep-mask (a ``bit`` input, one bit per element), as a Vector program:
    ``dropout`` (``x · where(keep, 1 / (1 - p), 0)``, as autofuse generates it: eager's ``x · mask · scale``), ``residual`` (then a residual add), ``layer_norm`` (then
    a residual add and a LayerNorm with weight and bias: outputs the sum and the normalised row).
    ``keep_shape``: the mask's shape (default: full, ``(*lead, W)``; else broadcast like any input)."""
    from cost_model.program import Builder
    lead = tuple(lead)
    b = Builder(lead)
    x = b.input(dtype, lead + (W,))
    keep = b.input("bit", tuple(keep_shape) if keep_shape else lead + (W,))
    r = b.input(dtype, lead + (W,)) if kind != "dropout" else None
    if kind == "layer_norm":
        w, bias = b.input(dtype, (W,)), b.input(dtype, (W,))
    y = b.mul(x, b.where(keep, 1.0 / (1.0 - p), 0.0))
    if kind == "dropout":
        b.output(y, dtype)
        return b.build()
    y = b.add(y, r)
    if kind == "residual":
        b.output(y, dtype)
        return b.build()
    h = b.cast(b.cast(y, dtype=dtype), dtype="float32")          # the sum as stored, normalised
    d = b.sub(h, b.reduce(h, kind="mean"))
    n = b.mul(d, b.rsqrt(b.add(b.reduce(b.mul(d, d), kind="mean"), 1e-5)))
    b.output(h, dtype)
    b.output(b.add(b.mul(n, w), bias), dtype)
    return b.build()


def epilogue(kind, M, N, dtype="float16", product="float16"):
    """An epilogue program and its extra input specs: ``gelu``, ``swiglu`` (N = 2F), ``residual`` (scale by a
    per-col fp32 vector, add a full fp16 residual), ``layer_norm`` (a residual add, then a LayerNorm of the
    whole row: K slices shrink so a row-wide B tile fits L0B), ``bias_silu_cast`` (bias, silu, fp32 out),
    ``bias_dropout_residual`` (bias, a dropout over a packed keep-mask, a residual add)."""
    from cost_model.program import Builder
    b = Builder((M,))
    acc = b.input(product, (M, N))
    if kind == "gelu":
        b.output(b.gelu(acc), dtype)
    elif kind == "swiglu":
        F = N // 2
        b.output(b.mul(b.silu(b.slice(acc, start=0, stop=F)), b.slice(acc, start=F, stop=N)), dtype)
    elif kind == "residual":
        r, s_ = b.input(dtype, (M, N)), b.input("float32", (N,))
        b.output(b.add(b.mul(acc, s_), r), dtype)
    elif kind == "bias_dropout_residual":           # bias, dropout (keep bits, p = 0.1), residual add
        bias, keep, r = b.input(dtype, (N,)), b.input("bit", (M, N)), b.input(dtype, (M, N))
        y = b.where(keep, b.mul(b.add(acc, bias), 1.0 / 0.9), 0.0)
        b.output(b.add(y, r), dtype)
    elif kind == "layer_norm":                      # residual add, then LayerNorm over the whole row
        r, w = b.input(dtype, (M, N)), b.input(dtype, (N,))
        x = b.add(b.cast(acc, dtype="float32"), b.cast(r, dtype="float32"))
        d = b.sub(x, b.reduce(x, kind="mean"))
        y = b.mul(d, b.rsqrt(b.add(b.reduce(b.mul(d, d), kind="mean"), 1e-5)))
        b.output(b.mul(b.cast(y, dtype=dtype), w), dtype)
    else:
        bias = b.input(dtype, (N,))
        b.output(b.silu(b.add(acc, bias)), "float32")
    p = b.build()
    return p, specs_of(p)[1:]


def _epilogue_cases(quick: bool):
    """matmul_epilogue: GELU, SwiGLU on a fused gate_up, residual add, bias+SiLU; fp16 and fp32 products."""
    shapes = [(513, 256, 768, "swiglu", "float16"), (777, 64, 333, "residual", "float32"),
              (1024, 768, 768, "layer_norm", "float16")]
    if not quick:
        shapes += [(300, 128, 200, "gelu", "float16"), (1024, 512, 1024, "gelu", "float16"), (2048, 1024, 2816, "swiglu", "float16"),
                   (100, 4096, 4096, "residual", "float16"), (4096, 4096, 11008, "gelu", "float16"),
                   (1000, 333, 777, "bias_silu_cast", "float32"), (17, 4096, 2 * 11008, "swiglu", "float16"),
                   (2048, 2048, 2048, "gelu", "float32"), (1000, 256, 1000, "bias_dropout_residual", "float32"),
                   (2048, 1024, 4096, "bias_dropout_residual", "float16")]
    shapes += [(333, 128, 200, "bias_dropout_residual", "float16")]
    out = []
    for i, (M, K, N, kind, pdt) in enumerate(shapes):
        p, extra = epilogue(kind, M, N, product=pdt)
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(Case("matmul_epilogue", [((M, K), "float16"), ((K, N), "float16")] + extra, d,
                            {"program": p}))
    return out


def _conv_cases(quick: bool):
    """Convolutions as models run them: a ViT's patch embedding (kernel = stride 16, 3 -> 768 channels; 224² in the
    full sweep), 3×3 stride 1 pad 1 and 1×1 convolutions, depthwise 1-D short convolutions (kernel 3-4, causal
    padding, as LFM2, Mamba and Conformer run them), Whisper's front end (Conv1d, the second with stride 2), odd
    sizes (prime channels, dilation 2, a kernel taller than the input); fp16, bf16, fp32 on every device."""
    f16, bf16, f32 = "float16", "bfloat16", "float32"
    # (x shape, w shape, params, bias)
    shapes = [((1, 3, 64, 64), (192, 3, 16, 16), {"stride": 16}, True),                # ViT patch embedding
              ((2, 32, 14, 14), (64, 32, 3, 3), {"padding": 1}, True),                 # 3×3 stride 1 pad 1
              ((1, 64, 28, 28), (64, 64, 3, 3), {"padding": 1}, False),
              ((2, 64, 14, 14), (128, 64, 1, 1), {}, False),                           # 1×1
              ((1, 256, 7, 7), (64, 256, 1, 1), {}, True),
              ((2, 64, 40), (64, 1, 3), {"padding": 2, "groups": 64}, True),            # LFM2's short conv
              ((1, 128, 100), (128, 1, 4), {"padding": 3, "groups": 128}, True),        # Mamba's causal conv
              ((1, 80, 100), (64, 80, 3), {"padding": 1}, True),                        # Whisper's first conv
              ((1, 64, 100), (64, 64, 3), {"stride": 2, "padding": 1}, True),           # and its stride-2 one
              ((1, 17, 11, 13), (23, 17, 3, 3), {"padding": 2, "dilation": 2}, True),   # prime channels, dilation 2
              ((2, 8, 3, 9), (12, 4, 5, 3), {"padding": (2, 1), "groups": 2}, True)]    # kernel taller than input
    if not quick:
        shapes += [((1, 3, 224, 224), (768, 3, 16, 16), {"stride": 16}, True),       # ViT-B/16 patch embedding
                   ((4, 3, 224, 224), (768, 3, 16, 16), {"stride": 16}, True),
                   ((1, 128, 56, 56), (128, 128, 3, 3), {"padding": 1}, False),         # ResNet stage
                   ((8, 256, 14, 14), (256, 256, 3, 3), {"padding": 1}, False),
                   ((4, 512, 28, 28), (128, 512, 1, 1), {}, False),
                   ((1, 1024, 256), (1024, 1, 3), {"padding": 2, "groups": 1024}, True),  # LFM2-size short conv
                   ((2, 512, 512), (512, 1, 4), {"padding": 3, "groups": 512}, True),
                   ((1, 144, 256), (144, 1, 31), {"padding": 15, "groups": 144}, True),  # Conformer's depthwise
                   ((1, 80, 3000), (384, 80, 3), {"padding": 1}, True),                 # Whisper tiny, 30 s
                   ((1, 384, 3000), (384, 384, 3), {"stride": 2, "padding": 1}, True),
                   ((1, 31, 61, 67), (37, 31, 7, 7), {"padding": 3, "stride": 2}, True)]
    out = []
    for i, (xs, ws, params, bias) in enumerate(shapes):
        for j, d in enumerate(DEVICES):
            if quick and j != i % 3:
                continue
            dt = (f16, bf16, f32)[(i // 3 + j) % 3]
            big = math.prod(xs) * ws[0] > 50_000_000
            out.append(Case("conv", [(xs, dt), (ws, dt)], d, params, {"bias": ((ws[0],), dt)} if bias else {},
                            timing_only=big))
    return out


BUILDERS = {"matmul": _matmul_cases, "conv": _conv_cases, "vector": _vector_cases, "movement": _movement_cases,
            "flash_attention": _fa_cases, "flash_attention_grad": _fag_cases, "moe": _moe_cases, "links": _link_cases,
            "vector_program": _vector_program_cases, "matmul_epilogue": _epilogue_cases}


def drawn_attention(n: int, seed: int, backward: bool = False) -> list:
    """``n`` attention launches drawn at random (a check of the model away from the sweep's own shapes): batch,
    heads, odd and round lengths (one-row edge blocks included), head dims, dtypes, devices, causal or not, sliding
    windows, saved statistics; ``backward``: flash_attention_grad launches (q, k, v, out, dout) instead."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        B, N = rng.choice((1, 2, 4)), rng.choice((2, 4, 8, 12))
        S, D = rng.choice((33, 65, 77, 100, 129, 190, 257, 300, 513)), rng.choice((64, 80, 128))
        dt, dev = rng.choice(("float16", "bfloat16", "float32")), rng.choice(DEVICES)
        p = {"causal": rng.random() < 0.6}
        if p["causal"] and rng.random() < 0.4:
            p["window"] = rng.choice((16, 40, 64, 100))
        if rng.random() < 0.2:
            p["return_stats"] = True
        if not backward:
            out.append(Case("flash_attention", [((B, N, S, D), dt)] * 3, dev, p))
            continue
        tp = {}
        if p.pop("return_stats", False):
            tp["softmax_max"] = tp["softmax_sum"] = ((B, N, S), "float32")
        out.append(Case("flash_attention_grad", [((B, N, S, D), dt)] * 5, dev, p, tp))
    return out


def drawn_vector_program(n: int, seed: int) -> list:
    """``n`` generated Vector kernels drawn at random: one to three leading dims, widths from one element to
    rows that need column chunks, 3 to 20 ops, up to two reductions, shuffles (half rotation or interleave)."""
    from cost_model.program import random_program
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lead = tuple(rng.choice((1, 2, 3, 7, 16, 64, 100, 333, 1000, 4096)) for _ in range(rng.choice((1, 1, 2, 3))))
        W = rng.choice((1, 17, 64, 130, 257, 768, 1000, 4096, 12288, 33000))
        while np.prod(lead) * W > 8_000_000:                  # a few seconds of simulation at most
            lead = lead[1:] or (1,)
        p = random_program(rng.randrange(1 << 30), lead, W, rng.choice(("float16", "bfloat16", "float32")),
                           n_ops=rng.randint(3, 20), reductions=rng.choice((0, 1, 1, 2)),
                           shuffles=W % 2 == 0 and W <= 4096 and rng.random() < 0.3)
        out.append(Case("vector_program", specs_of(p), rng.choice(DEVICES), {"program": p}))
    return out


def drawn_matmul_epilogue(n: int, seed: int) -> list:
    """``n`` matmul + epilogue launches drawn at random: every epilogue kind, odd and round M, K, N (decode-sized
    to prefill-sized), fp16 and fp32 products."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = rng.choice(("gelu", "swiglu", "residual", "layer_norm", "bias_silu_cast", "bias_dropout_residual"))
        M, K = rng.choice((1, 17, 64, 100, 333, 513, 1024, 2048)), rng.choice((64, 128, 333, 768, 1024, 4096))
        N = rng.choice((64, 200, 512, 768, 1000, 2816, 4096)) * (2 if kind == "swiglu" else 1)
        if kind == "layer_norm":
            N = min(N, 1024)                            # a row-wide B tile must fit L0B
        p, extra = epilogue(kind, M, N, product=rng.choice(("float16", "float32")))
        out.append(Case("matmul_epilogue", [((M, K), "float16"), ((K, N), "float16")] + extra, rng.choice(DEVICES),
                        {"program": p}, timing_only=M * N * K > 2_000_000_000))
    return out


def drawn_grouped_matmul(n: int, seed: int) -> list:
    """``n`` grouped GEMMs drawn at random: 2 to 64 experts, tokens dealt at random (empty experts, one hot
    expert), decode- to prefill-sized loads, with and without an activation, a bias, the product stored."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        E = rng.choice((2, 4, 8, 16, 64))
        M = rng.choice((1, 8, 37, 64, 300, 1024, 4096))
        K, N = rng.choice((128, 256, 1000, 2048, 4096)), rng.choice((128, 384, 1024, 2048))
        w = np.random.default_rng(rng.randrange(1 << 30)).dirichlet([rng.choice((0.2, 1.0, 5.0))] * E)
        sizes = np.random.default_rng(rng.randrange(1 << 30)).multinomial(M, w).astype(np.int32)
        act = rng.choice((None, None, "swiglu", "gelu", "silu"))
        trans, bias, dt = rng.random() < 0.5, rng.random() < 0.3, rng.choice(("float16", "bfloat16"))
        ins = [((M, K), dt), ((E, N, K) if trans else (E, K, N), dt), ((E,), "int32")] + \
              ([((E, N), "float32")] if bias else [])
        p = {"trans_w": trans, "activation": act, "group_sizes": tuple(int(x) for x in sizes)}
        if act is not None and rng.random() < 0.3:
            p["return_product"] = True
        out.append(Case("grouped_matmul", ins, rng.choice(DEVICES), p, values={2: sizes},
                        timing_only=M * N * K > 2_000_000_000))
    return out


def drawn_gating(n: int, seed: int) -> list:
    """``n`` router top-k launches drawn at random: tokens, experts, k, softmax or sigmoid, renormalised or not,
    DeepSeek-V3's expert groups with a selection bias."""
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        T, E = rng.choice((1, 7, 64, 333, 1000, 4096)), rng.choice((8, 16, 60, 64, 128, 256))
        dt = rng.choice(("float16", "bfloat16", "float32"))
        p = {"k": rng.choice([k for k in (1, 2, 4, 6, 8) if k < E]), "renorm": rng.random() < 0.6,
             "norm": rng.choice(("softmax", "softmax", "sigmoid"))}
        ins = [((T, E), dt)]
        if E % 8 == 0 and E >= 16 and rng.random() < 0.3:
            p.update(n_group=8, topk_group=rng.choice((2, 3, 4)), group_score=rng.choice(("top2", "max")))
            p["k"] = min(p["k"], p["topk_group"] * (E // 8))
            ins.append(((E,), "float32"))
        out.append(Case("moe_gating_topk", ins, rng.choice(DEVICES), p, values={0: _distinct_logits(T, E, dt, nprng)}))
    return out


DRAWS = {"flash_attention": drawn_attention, "flash_attention_grad": lambda n, s: drawn_attention(n, s, True),
         "vector_program": drawn_vector_program, "matmul_epilogue": drawn_matmul_epilogue,
         "grouped_matmul": drawn_grouped_matmul, "moe_gating_topk": drawn_gating}


def cases(quick: bool = False, kernels=None) -> list:
    out = []
    for build in BUILDERS.values():
        out += build(quick)
    if kernels:
        out = [c for c in out if c.kernel in kernels]
    return out


def attention_pair(shape, causal, dtype, device, mask=None):
    """Attention unfused (Q·Kᵀ, scale, [mask], softmax, P·V) and fused (flash_attention).

    The causal mask is a [S, S] bool tensor for the unfused graph (as the traced model materialises it)
    and ``causal=True`` for the fused kernel; an explicit mask goes to both.
    """
    B, N, S, D = shape
    unfused = [Case("matmul", [(shape, dtype), (shape, dtype)], device, {"trans_b": True}),
               Case("elementwise", [((B, N, S, S), dtype)], device, {"op": "mul", "scalar": D ** -0.5})]
    if causal or mask is not None:
        m = ((S, S), "bool") if mask is None else mask
        op = ({"op": "masked_fill", "scalar": -1e4} if m[1] == "bool" else {"op": "add"})
        unfused.append(Case("elementwise", [((B, N, S, S), dtype), m], device, op))
    unfused += [Case("softmax", [((B, N, S, S), dtype)], device, {"dim": -1}),
                Case("matmul", [((B, N, S, S), dtype), (shape, dtype)], device)]
    fused = Case("flash_attention", [(shape, dtype)] * 3, device, {"causal": causal} if mask is None else {},
                 {} if mask is None else {"mask": mask})
    what = f"causal={causal}" if mask is None else f"mask={list(mask[0])}{mask[1]}"
    return (f"attention {list(shape)} {dtype} {what} on {device}", unfused, fused)


def add_rms_pair(shape, dtype, device):
    """x + residual then RMSNorm (two kernels) vs add_rms_norm (one): a fusion with a small margin."""
    H = shape[-1]
    unfused = [Case("elementwise", [(shape, dtype), (shape, dtype)], device, {"op": "add"}),
               Case("rms_norm", [(shape, dtype), ((H,), dtype)], device)]
    fused = Case("add_rms_norm", [(shape, dtype), (shape, dtype), ((H,), dtype)], device)
    return (f"add+rms_norm {list(shape)} {dtype} on {device}", unfused, fused)


def gating_pair(T, E, k, dtype, device):
    """Mixtral's router op by op (softmax, topk, sum, div) vs moe_gating_topk."""
    rng = np.random.default_rng(2)
    x = _distinct_logits(T, E, dtype, rng)
    unfused = [Case("softmax", [((T, E), "float32")], device, {"dim": -1}),
               Case("topk", [((T, E), "float32")], device, {"k": k}, values={0: x.float()}),
               Case("reduce", [((T, k), "float32")], device, {"op": "sum", "dim": -1, "keepdim": True}),
               Case("elementwise", [((T, k), "float32"), ((T, 1), "float32")], device, {"op": "div"})]
    fused = Case("moe_gating_topk", [((T, E), dtype)], device, {"k": k, "renorm": True, "eps": 0.0},
                 values={0: x})
    return (f"moe gating [{T}, {E}] k={k} {dtype} on {device}", unfused, fused)


def experts_pair(M, K, N, E, dtype, device):
    """One matmul launch per expert (grouped_mm_fallback) vs grouped_matmul, even loads."""
    sizes = tuple(M // E + (g < M % E) for g in range(E))
    w = ((E, N, K), dtype)
    unfused = [Case("matmul_per_group", [((M, K), dtype), w, ((E,), "int32")], device,
                    {"trans_w": True, "group_sizes": sizes}, values={2: np.cumsum(sizes).astype(np.int32)})]
    fused = Case("grouped_matmul", [((M, K), dtype), w, ((E,), "int32")], device,
                 {"trans_w": True, "group_sizes": sizes}, values={2: np.array(sizes, dtype=np.int32)})
    return (f"experts GEMM [{M}, {K}] x {E}x[{K}, {N}] {dtype} on {device}", unfused, fused)


def softmax_pair(shape, dtype, device, mask):
    """A scaled, masked softmax computed in fp32 as eager launches it (cast up, mul, where, softmax, cast down)
    vs the softmax family's one kernel."""
    f32 = "float32"
    unfused = [Case("elementwise", [(shape, dtype)], device, {"op": "cast", "out_dtype": f32}),
               Case("elementwise", [(shape, f32)], device, {"op": "mul", "scalar": 0.125}),
               Case("elementwise", [mask, (shape, f32)], device, {"op": "where", "scalar": -1e4}),
               Case("softmax", [(shape, f32)], device, {"dim": -1}),
               Case("elementwise", [(shape, f32)], device, {"op": "cast", "out_dtype": dtype})]
    fused = Case("softmax", [(shape, dtype)], device, {"dim": -1, "scale": 0.125, "fill": -1e4}, {"mask": mask})
    return (f"scaled masked softmax {list(shape)} {dtype} mask={list(mask[0])} on {device}", unfused, fused)


def pairs(quick: bool = False) -> list:
    """(label, unfused cases, fused case): attention vs flash_attention, add + rms_norm vs add_rms_norm."""
    out = []
    norms = [((333, 777), "float32"), ((1024, 2048), "float16")]
    if not quick:
        norms += [((8, 50000), "bfloat16"), ((7,), "float32"), ((2, 512, 4096), "float16"), ((64, 128), "float16"),
                  ((1, 2048, 8192), "bfloat16")]
    for i, (shape, dt) in enumerate(norms):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(add_rms_pair(shape, dt, d))
    for i, (shape, causal, dt) in enumerate(_fa_shapes(quick)):
        if shape[2] > 2048:
            continue
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(attention_pair(shape, causal, dt, d))
    for i, (shape, mask, dt) in enumerate(_fa_masks(quick)):
        if shape[2] > 2048:
            continue
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(attention_pair(shape, False, dt, d, mask))
    gates = [(1024, 8, 2, "float32"), (37, 60, 4, "bfloat16")] + ([] if quick else [(4096, 128, 8, "float16")])
    for i, (T, E, k, dt) in enumerate(gates):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(gating_pair(T, E, k, dt, d))
    sms = [((4, 256, 256), "float16", ((4, 1, 256), "bool")), ((2, 4, 64, 64), "bfloat16", ((64, 64), "bool"))]
    if not quick:
        sms += [((16, 1024, 1024), "float16", ((16, 1, 1024), "bool")), ((1, 8, 512, 512), "float32", ((512, 512), "bool"))]
    for i, (shape, dt, mask) in enumerate(sms):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(softmax_pair(shape, dt, d, mask))
    gemms = [(64, 512, 1024, 8, "float16")] + ([] if quick else [(1024, 1024, 2048, 8, "bfloat16")])
    for i, (M, K, N, E, dt) in enumerate(gemms):
        for d in (DEVICES if not quick else DEVICES[i % 3:i % 3 + 1]):
            out.append(experts_pair(M, K, N, E, dt, d))
    return out


# ------------------------------------------------------------------------------------------ running
@dataclass
class Record:
    case: Case
    pred_cycles: int
    sim_cycles: int
    pred_hbm: int
    sim_hbm: int
    pred_bound: str
    sim_bound: str
    tiling: dict | None
    wall: float
    phases: tuple = ()             # (name, modelled cycles, simulated cycles) per phase, for kernels with phases

    @property
    def err_cycles(self) -> float:
        return abs(self.pred_cycles - self.sim_cycles) / self.sim_cycles

    @property
    def err_hbm(self) -> float:
        return abs(self.pred_hbm - self.sim_hbm) / max(self.sim_hbm, 1)


def run(cs, verbose=False) -> list:
    out = []
    for c in cs:
        e = predict(c)
        t = time.time()
        s = simulate(c, e.tiling)
        r = Record(c, e.cycles, s.cycles, e.hbm_bytes, s.hbm_bytes, e.bound, s.bound, e.tiling, time.time() - t,
                   _phase_pairs(e, s))
        out.append(r)
        if verbose:
            print(f"  {r.err_cycles:6.1%} {r.err_hbm:6.1%}  {r.wall:5.1f}s  {c.label()}", flush=True)
    return out


def _phase_pairs(e, s) -> tuple:
    """(name, modelled cycles, simulated cycles) of each phase between a launch's SyncAlls, where the model prices
    the same phases the simulator ran."""
    if not e.phases or len(e.phases) != len(s.phases):
        return ()
    m_end = [m for _, m in e.phases]
    s_end = [t for t, _ in s.phases]
    return tuple((name, m - m0, t - t0) for (name, _), m, t, m0, t0 in
                 zip(e.phases, m_end, s_end, [0] + m_end[:-1], [0] + s_end[:-1]))


def phase_summary(records) -> list[str]:
    """Per kernel and phase: how many, the mean |error| and the mean signed error of the phase's cycles."""
    errs: dict[tuple[str, str], list[float]] = {}
    for r in records:
        for name, m, t in r.phases:
            if t > 0:
                errs.setdefault((r.case.kernel, name), []).append((m - t) / t)
    return [f"  {k} {name}: {len(v)} launches, mean |error| {np.mean(np.abs(v)):.1%}, mean {np.mean(v):+.1%}"
            for (k, name), v in errs.items()]


def pair_agreement(ps) -> tuple[int, int, list]:
    agree, rows = 0, []
    for label, unfused, fused in ps:
        pu = sum(predict(c).cycles for c in unfused)
        pf = predict(fused).cycles
        su = sum(simulate(c, predict(c).tiling).cycles for c in unfused)
        sf = simulate(fused, predict(fused).tiling).cycles
        ok = (pf < pu) == (sf < su)
        agree += ok
        rows.append((label, pu, pf, su, sf, ok))
    return agree, len(ps), rows


def timing(cs) -> tuple[float, float]:
    """Mean seconds per estimate() over the cases, with the model's caches cleared first (cold): (this
    process's CPU time, so that other work on a shared machine counts less; wall time), of one sweep."""
    from cost_model.estimate import clear_caches
    clear_caches()
    gc.collect()                   # the previous sweep's garbage is not this one's to collect
    t, w = time.process_time(), time.perf_counter()
    for c in cs:
        predict(c)
    return (time.process_time() - t) / len(cs), (time.perf_counter() - w) / len(cs)


def summary(records) -> dict:
    def stats(xs):
        xs = np.asarray(xs)
        return {"n": len(xs), "median": float(np.median(xs)), "p90": float(np.percentile(xs, 90)),
                "max": float(xs.max())}
    out = {"all": (stats([r.err_cycles for r in records]), stats([r.err_hbm for r in records]))}
    for k in sorted({r.case.kernel for r in records}):
        rs = [r for r in records if r.case.kernel == k]
        out[k] = (stats([r.err_cycles for r in rs]), stats([r.err_hbm for r in rs]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small sweep the tests use")
    ap.add_argument("--kernel", action="append", help="only these kernels (repeatable)")
    ap.add_argument("--top", type=int, default=25, help="how many worst cases to list")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--time", action="store_true",
                    help="only time estimate() over the cases (no simulation): a quiet measurement of the speed line")
    ap.add_argument("--drawn", type=int, default=0,
                    help="price this many launches drawn at random instead: attention, or with --kernel any of "
                         + ", ".join(DRAWS))
    ap.add_argument("--seed", type=int, default=1, help="the draw's seed (with --drawn)")
    ap.add_argument("--backward", action="store_true", help="draw attention backward launches (with --drawn)")
    ap.add_argument("--explain", type=int, action="append", metavar="I",
                    help="only these cases (their index in the sweep or the draw; repeatable): the model against "
                         "the simulator phase by phase, for kernels with phases")
    a = ap.parse_args(argv)
    if a.drawn:
        kinds = a.kernel or ["flash_attention_grad" if a.backward else "flash_attention"]
        unknown = [k for k in kinds if k not in DRAWS]
        if unknown:
            ap.error(f"--drawn draws {', '.join(DRAWS)}; not {', '.join(unknown)}")
        cs = [c for k in kinds for c in DRAWS[k](a.drawn, a.seed)]
    else:
        cs = cases(a.quick, a.kernel)
    if a.time:
        print_timing(cs)
        return
    if a.explain:
        bad = [i for i in a.explain if not 0 <= i < len(cs)]
        if bad:
            ap.error(f"--explain {bad[0]}: the cases here are numbered 0 to {len(cs) - 1}")
        for i in a.explain:
            explain(cs[i], i)
        return
    t0 = time.time()
    recs = run(cs, a.verbose)
    print(f"{len(recs)} cases, {time.time() - t0:.0f} s of simulation\n")
    print(f"{'kernel':16s} {'n':>4s}  {'cycles: median':>15s} {'p90':>6s} {'max':>6s}   "
          f"{'HBM: median':>12s} {'p90':>6s} {'max':>6s}")
    for k, (c, h) in summary(recs).items():
        print(f"{k:16s} {c['n']:4d}  {c['median']:15.1%} {c['p90']:6.1%} {c['max']:6.1%}   "
              f"{h['median']:12.1%} {h['p90']:6.1%} {h['max']:6.1%}")
    lines = phase_summary(recs)
    if lines:
        print("\nphases between SyncAlls, model against simulator (cycles):")
        print("\n".join(lines))
    print(f"\nworst {a.top} cases by cycle error (pred / sim cycles, HBM error, bound pred/sim, tiling):")
    for r in sorted(recs, key=lambda r: -max(r.err_cycles, r.err_hbm))[:a.top]:
        print(f"  {r.err_cycles:6.1%} {r.err_hbm:6.1%}  {r.pred_cycles:>10,} / {r.sim_cycles:<10,} "
              f"{r.pred_bound:>7s}/{r.sim_bound:<7s} {r.case.label()}  {r.tiling}")
    ps = pairs(a.quick) if not a.drawn else []
    if ps:
        ok, n, rows = pair_agreement(ps)
        print(f"\nunfused vs fused pairs: model and simulator agree on the faster in {ok}/{n} "
              f"({ok / n:.1%})")
        for label, pu, pf, su, sf, good in rows:
            if not good or a.verbose:
                print(f"  {'ok ' if good else 'BAD'} {label}: model {pu:,} vs {pf:,}, sim {su:,} vs {sf:,}")
    print_timing(cs)


def explain(case: Case, i: int) -> None:
    """One case, the model against the simulator at the model's tiling: the whole launch, then each phase between
    the kernel's SyncAlls (its length and, for the simulator, its HBM floor: the bytes it moved over HBM's
    bandwidth), for kernels whose model prices phases."""
    from cost_model.devices import get_device
    e = predict(case)
    s = simulate(case, e.tiling)
    hbm_bw = get_device(case.device).hbm_bytes_per_cycle
    print(f"[{i}] {case.label()} tiling {e.tiling}")
    print(f"  launch: model {e.cycles:,} cycles, simulator {s.cycles:,} ({(e.cycles - s.cycles) / s.cycles:+.1%}); "
          f"HBM bytes {e.hbm_bytes:,} / {s.hbm_bytes:,}")
    if not e.phases:
        return
    pairs = _phase_pairs(e, s)
    if not pairs:
        print(f"  phases: the model prices {len(e.phases)}, the simulator ran {len(s.phases)}")
        return
    for (name, m, t), (_, hbm) in zip(pairs, s.phases):
        print(f"  {name:12s} model {m:>11,}   simulator {t:>11,} (HBM floor {hbm / hbm_bw:>11,.0f})   "
              f"{(m - t) / max(1, t):+.1%}")


def print_timing(cs, sweeps=7):
    """estimate()'s speed: the best and the median of ``sweeps`` cold sweeps over the cases, CPU and wall time
    (one shared machine: the best is the least disturbed). The objects made before (torch, which the chains'
    capture imports, and the cases) are frozen out of the garbage collector: a full collection would scan
    them all (0.17 to 0.66 s measured here, with torch loaded), on whichever sweep it fell; estimate()'s own objects are
    collected as usual."""
    gc.collect()
    gc.freeze()
    cpu, wall = zip(*(timing(cs) for _ in range(sweeps)))
    print(f"\nestimate(): {min(cpu) * 1e3:.3f} ms CPU ({min(wall) * 1e3:.3f} ms wall) per call on average, best of "
          f"{sweeps} cold sweeps of {len(cs)} cases (median {statistics.median(cpu) * 1e3:.3f} ms CPU, "
          f"{statistics.median(wall) * 1e3:.3f} ms wall); objects made before the sweeps frozen out of the garbage "
          f"collector")
    # where the time goes: one more cold sweep, each call's CPU time booked to its kernel
    from cost_model.estimate import clear_caches
    clear_caches()
    gc.collect()
    spent: dict[str, list[float]] = {}
    for c in cs:
        t = time.process_time()
        predict(c)
        spent.setdefault(c.kernel, []).append(time.process_time() - t)
    total = sum(map(sum, spent.values()))
    print("by kernel (ms a call, share of the sweep): " + ", ".join(
        f"{k} {sum(v) / len(v) * 1e3:.2f} ({sum(v) / total:.0%})"
        for k, v in sorted(spent.items(), key=lambda kv: -sum(kv[1])) if sum(v) / total >= 0.01))


if __name__ == "__main__":
    main()
