"""Timing-only launches (``npu.run(..., timing_only=True)``) count exactly what full launches count.

A timing-only launch issues the same instructions on the same timelines but computes no value; its inputs are
shapes only, except the kernel's steering inputs (``run.STEER``). For every registered kernel, on several shapes
and dtypes and on all three devices, its ``Stats`` (cycles, bytes per path, HBM bytes, busy per unit and core,
instructions, workspace) and its trace events equal the full launch's. Near misses show that the steering
inputs matter and that a timing-only launch cannot read a value it was not given.
"""
import numpy as np
import pytest
import torch

from autofuse import npu
from autofuse.npu import machine
from autofuse.npu.machine import Absent, SimulatorError
from autofuse.npu.run import ALL, STEER
from autofuse.npu.kernels.dropout import HostDraws, pack_keep

DEVICES = npu.devices()


def _rand(*shape, dtype=torch.float16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _ints(high, *shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=g, dtype=torch.int32)


def _cases():
    """(kernel, inputs, params): every kernel, a few shapes and dtypes each."""
    bf16, f32 = torch.bfloat16, torch.float32
    c = []
    # Cube
    c += [("matmul", (_rand(70, 130), _rand(130, 40, seed=1)), {}),
          ("matmul", (_rand(3, 64, 96, dtype=bf16), _rand(3, 96, 48, dtype=bf16, seed=1)), {}),
          ("matmul", (_rand(2, 33, 64, dtype=f32), _rand(80, 64, dtype=f32, seed=1), _rand(80, dtype=f32)),
           {"trans_b": True}),
          ("matmul", (_rand(96, 40), _rand(96, 72, seed=1)), {"trans_a": True, "tiling": {"m0": 32, "n0": 64,
                                                                                         "k0": 32, "k1": 64}})]
    c += [("conv", (_rand(2, 6, 9, 11), _rand(8, 3, 3, 3, seed=1)), {"bias": _rand(8, seed=2), "padding": 1,
                                                                    "groups": 2}),
          ("conv", (_rand(1, 8, 30, dtype=f32), _rand(8, 1, 4, dtype=f32, seed=1)), {"padding": 3, "groups": 8})]
    # Vector
    x = _rand(33, 300, dtype=bf16)
    c += [("softmax", (x,), {"dim": -1}), ("softmax", (_rand(2, 4, 40, 72),), {"dim": -1}),
          ("softmax", (_rand(50, 20, dtype=f32),), {"dim": 0})]
    c += [("layer_norm", (_rand(5, 33, 200), _rand(200, seed=1), _rand(200, seed=2)), {}),
          ("layer_norm", (_rand(7, 1000, dtype=f32),), {}),
          ("rms_norm", (_rand(40, 256, dtype=bf16), _rand(256, dtype=bf16, seed=1)), {}),
          ("add_rms_norm", (_rand(17, 96), _rand(17, 96, seed=1), _rand(96, seed=2)), {})]
    a, b = _rand(8, 1, 96), _rand(96, seed=1)
    c += [("elementwise", (_rand(30, 70),), {"op": "gelu"}),
          ("elementwise", (a, b), {"op": "add"}),
          ("elementwise", (_rand(64, 65, dtype=bf16),), {"op": "mul", "scalar": 0.5}),
          ("elementwise", (_rand(20, 30) > 0, _rand(20, 30, seed=1), _rand(1, 30, seed=2)), {"op": "where"}),
          ("elementwise", (_rand(4, 40, 40, dtype=f32), torch.ones(40, 40, dtype=torch.bool).tril()),
           {"op": "masked_fill", "scalar": float("-inf")}),
          ("elementwise", (_rand(50, 33),), {"op": "cast", "out_dtype": "float32"}),
          ("elementwise", (_rand(50, 33, dtype=f32),), {"op": "pow", "scalar": torch.tensor(3.0)}),
          ("elementwise", (_rand(6, 7, 8), _rand(6, 1, 8, seed=1)), {"op": "lt"}),
          ("elementwise", (_ints(9, 300),), {"op": "mul", "scalar": 2})]
    c += [("reduce", (_rand(12, 500),), {"op": "sum", "dim": (-1,), "keepdim": True}),
          ("reduce", (_rand(9, 40, 30, dtype=bf16),), {"op": "mean", "dim": (0,)}),
          ("reduce", (_rand(64, 70, dtype=f32),), {"op": "amax", "dim": None})]
    # movement
    c += [("copy", (_rand(70, 130),), {}), ("copy", (_ints(5, 3, 1000),), {}),
          ("permute", (_rand(2, 30, 4, 16),), {"dims": (0, 2, 1, 3)}),
          ("permute", (_rand(48, 80, dtype=f32),), {"dims": (1, 0)}),
          ("cat", (_rand(4, 30), _rand(4, 50, seed=1)), {"dim": 1}),
          ("cat", (_rand(10, 8, dtype=bf16), _rand(3, 8, dtype=bf16, seed=1)), {"dim": 0}),
          ("gather", (_rand(300, 200), _ints(300, 50)), {}),
          ("gather", (_rand(64, 3, 40, dtype=f32), torch.tensor([[1, 1, 5], [5, 63, 1]], dtype=torch.int32)), {}),
          ("generic", (_rand(300, 200), _rand(200, seed=1)), {"outputs": [((300, 200), "float16")]}),
          ("generic", (), {"outputs": [((64,), "float32")]})]
    # fused attention
    q, k, v = _rand(2, 4, 96, 64), _rand(2, 2, 160, 64, seed=1), _rand(2, 2, 160, 64, seed=2)
    mask = torch.rand(2, 1, 96, 160, generator=torch.Generator().manual_seed(7)) > 0.3
    c += [("flash_attention", (q, k, v), {}),
          ("flash_attention", (q, k, v), {"causal": True, "mask": mask}),
          ("flash_attention", (q, k, v), {"return_probs": True, "mask": _rand(1, 1, 96, 160, seed=3)}),
          ("flash_attention", (_rand(1, 2, 130, 32, dtype=f32), _rand(1, 2, 130, 32, dtype=f32, seed=1),
                               _rand(1, 2, 130, 32, dtype=f32, seed=2)), {"causal": True}),
          ("score_bound", (q, k), {}), ("score_bound", (_rand(3, 70, dtype=bf16), _rand(1, 5, 70, dtype=bf16)), {}),
          ("bias_bound", (_rand(1, 4, 130, 130, dtype=f32),), {}), ("bias_bound", (_rand(2, 96, 160),), {})]
    # dropout: the keep-mask generator (the host's draws as its bits) and attention reading the bits
    keep = np.random.default_rng(5).random((2, 4, 96, 160)) < 0.9
    c += [("dropout_gen_mask", (), {"shape": (2, 4, 96, 160), "keep_prob": 0.9, "draws": HostDraws(keep)}),
          ("flash_attention", (q, k, v), {"causal": True, "drop_mask": pack_keep(keep), "keep_prob": 0.9}),
          ("flash_attention", (q, k, v), {"causal": True, "mask": mask, "drop_mask": pack_keep(keep), "keep_prob": 0.9,
                                          "return_stats": True})]
    # the attention's backward (out and dout: any values of their shapes; the statistics recomputed or given)
    o, do = _rand(2, 4, 96, 64, seed=4), _rand(2, 4, 96, 64, seed=5)
    stats = {"softmax_max": _rand(2, 4, 96, dtype=f32, seed=6), "softmax_sum": _rand(2, 4, 96, dtype=f32, seed=7).abs() + 1}
    c += [("flash_attention_grad", (q, k, v, o, do), {"causal": True}),
          ("flash_attention_grad", (q, k, v, o, do), {"mask": mask, "drop_mask": pack_keep(keep), "keep_prob": 0.9}),
          ("flash_attention_grad", (q, k, v, o, do), stats)]
    # MoE
    logits = _rand(50, 16, dtype=f32)
    c += [("moe_gating_topk", (logits,), {"k": 2, "renorm": True}),
          ("moe_gating_topk", (logits, _rand(16, dtype=f32, seed=1)),
           {"k": 4, "norm": "sigmoid", "n_group": 4, "topk_group": 2, "group_score": "top2"}),
          ("topk", (_rand(3, 20, 9),), {"k": 3}),
          ("topk", (torch.zeros(30, 8),), {"k": 2, "largest": False})]            # all tied
    ids = torch.randint(0, 3, (97, 2), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    c += [("moe_init_routing", (_rand(97, 130), ids), {"num_experts": 8}),
          ("moe_init_routing", (_rand(40, 64, dtype=bf16), _ints(4, 40, 3)), {"num_experts": 4,
                                                                             "group_list_type": "cumsum"}),
          ("moe_finalize_routing", (_rand(135, 200), torch.rand(45, 3), torch.randperm(
              135, generator=torch.Generator().manual_seed(4)).int(), _rand(45, 200, seed=5)), {}),
          ("moe_finalize_routing", (_rand(40, 64, dtype=f32), torch.rand(20, 2), _ints(40, 40)), {}),
          # the backwards: a permutation's rows, and rows named twice or never (zero fill + atomic adds)
          ("moe_finalize_routing_grad", (_rand(45, 200, seed=6), _rand(135, 200), torch.rand(45, 3), torch.randperm(
              135, generator=torch.Generator().manual_seed(4)).int()), {}),
          ("moe_finalize_routing_grad", (_rand(20, 64, dtype=f32, seed=6), _rand(40, 64, dtype=f32), torch.rand(20, 2),
                                         _ints(40, 40)), {"accumulate": True}),
          ("moe_gating_topk_grad", (_rand(50, 8, dtype=f32), torch.rand(50, 2), _ints(8, 50, 2)),
           {"k": 2, "renorm": True}),
          ("moe_gating_topk_grad", (_rand(33, 16, dtype=bf16), torch.rand(33, 4), _ints(16, 33, 4)),
           {"k": 4, "norm": "sigmoid", "routed_scaling_factor": 2.5}),
          ("index_add", (_rand(60, 7, 5, dtype=f32), _ints(60, 150), _rand(150, 7, 5, dtype=f32, seed=1)),
           {"alpha": 0.5}),
          ("index_add", (_rand(30, 16), torch.zeros(40, dtype=torch.int32), _rand(40, 16, seed=1)), {})]
    counts = torch.tensor([30, 0, 70, 5], dtype=torch.int32)
    x, w = _rand(108, 96), _rand(4, 80, 96, seed=1, scale=0.1)
    c += [("grouped_matmul", (x, w, counts, _rand(4, 80, dtype=f32, seed=2)), {"trans_w": True}),
          ("grouped_matmul", (x, w, counts), {"trans_w": True, "activation": "swiglu"}),
          ("grouped_matmul", (x.float(), w.float().transpose(1, 2).contiguous(), counts.cumsum(0).int()),
           {"group_list_type": "cumsum", "activation": "gelu"}),
          ("matmul_per_group", (x, w, counts.cumsum(0).int()), {"trans_w": True}),
          ("matmul_per_group", (x.float(), w.float().transpose(1, 2).contiguous(), counts), {"group_list_type": "count"}),
          # the weight gradients: x_gᵀ·dy_g per group (an empty group's zero block), bf16 and fp32
          ("grouped_matmul_weight_grad", (x, _rand(108, 80, seed=3), counts), {}),
          ("grouped_matmul_weight_grad", (x.float(), _rand(108, 40, dtype=f32, seed=3), counts.cumsum(0).int()),
           {"group_list_type": "cumsum"}),
          ("matmul_per_group_weight_grad", (x, _rand(108, 80, seed=3), counts.cumsum(0).int()), {}),
          ("matmul_per_group_weight_grad", (x.float(), _rand(108, 40, dtype=f32, seed=3), counts),
           {"group_list_type": "count"})]
    # communication (a rank-symmetric world in one process)
    xs = np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32)
    c += [("all_reduce", (xs.astype(np.float16),), {"world": 4}),
          ("reduce_scatter", (xs,), {"world": 4}),
          ("all_gather", (xs[:12],), {"world": 4}),
          ("all_to_all", (xs,), {"world": 4}),
          ("matmul_all_reduce", (xs.astype(np.float16), xs[:40].T.copy().astype(np.float16)), {"world": 2,
                                                                                                 "tiles": 2}),
          ("matmul_reduce_scatter", (xs, xs[:40].T.copy()), {"world": 2}),
          ("all_gather_matmul", (xs[:24].astype(np.float16), xs[:32].T.copy().astype(np.float16)), {"world": 2})]
    # generated Vector kernels: a norm beside an interleaved RoPE of one split input; matmul epilogues
    from cost_model.program import Builder
    from .test_vector_program import SPLIT
    c += [("vector_program", (_rand(2, 1, 8, 24, dtype=f32), _rand(16, dtype=f32, seed=1),
                              _rand(1, 1, 8, 4, dtype=f32, seed=2), _rand(1, 1, 8, 4, dtype=f32, seed=3)),
           {"program": SPLIT, "tiling": {"rows": 2}})]
    bld = Builder((70,))
    acc = bld.input("float32", (70, 96))
    bld.output(bld.relu(acc), "float16")
    relu = bld.build()
    c += [("matmul_epilogue", (_rand(70, 130), _rand(96, 130, seed=1)), {"program": relu, "trans_b": True,
                                                                        "bias": _rand(96, dtype=f32, seed=2)})]
    # expert parallelism in one launch (a rank-symmetric world)
    ids = np.repeat(np.arange(4), 6).astype(np.int32)
    c += [("moe_dispatch_combine", (xs[:24, :32].astype(np.float16), ids,
                                    np.random.default_rng(1).standard_normal((2, 32, 16)).astype(np.float16)),
           {"world": 2, "chunks": 2})]
    return c


CASES = _cases()


def _events(r):
    return [(g.kind, unit, name, np.asarray(s).tobytes(), np.asarray(e).tobytes(),
             None if a is None else np.asarray(a).tobytes()) for g, unit, name, s, e, a in r.trace._events]


def test_every_kernel_has_cases():
    assert {name for name, _, _ in CASES} == set(npu.KERNELS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[0]}-{j}" for j, c in enumerate(CASES)])
def test_timing_only_counts_what_the_full_launch_counts(device, i):
    name, inputs, params = CASES[i]
    full = npu.run(name, *inputs, device=device, **params)
    timed = npu.run(name, *inputs, device=device, timing_only=True, **params)
    assert timed.stats == full.stats                      # every field: cycles, bytes, hbm, busy, workspace, ...
    assert timed.stats.workspace_bytes == full.stats.workspace_bytes
    assert _events(timed) == _events(full)
    assert len(timed.outputs) == len(full.outputs)
    for t, f, dt in zip(timed.outputs, full.outputs, full.dtypes):
        assert t.shape == f.shape
        if STEER[name] != ALL:                            # no values computed: shapes and element types only
            assert isinstance(t, Absent) and t.element == dt


def test_timing_only_takes_meta_inputs_and_earlier_timing_only_outputs():
    a, b = _rand(200, 300), _rand(300, 120, seed=1)
    full = npu.run("matmul", a, b)
    meta = npu.run("matmul", a.to("meta"), b.to("meta"), timing_only=True)
    assert meta.stats == full.stats
    # a timing-only output feeds the next timing-only launch as a shape
    soft = npu.run("softmax", full.torch_outputs()[0], dim=-1)
    chained = npu.run("softmax", meta.outputs[0], dim=-1, timing_only=True)
    assert chained.stats == soft.stats
    with pytest.raises(ValueError, match="no output values"):
        meta.torch_outputs()
    with pytest.raises(ValueError, match="no values"):
        npu.run("softmax", meta.outputs[0], dim=-1)          # a full launch needs values


def test_steering_inputs_decide_the_counts():
    """Near miss: the same shapes with other steering values count differently, and a timing-only launch given
    those values counts them too (so the values a kernel branches on are really used)."""
    table = _rand(4096, 512)
    spread = torch.arange(0, 4096, 64, dtype=torch.int32)            # 64 distinct rows
    repeated = torch.zeros(64, dtype=torch.int32)                     # one row, L2 hits after the first
    s1, s2 = (npu.run("gather", table, i, timing_only=True).stats for i in (spread, repeated))
    assert s1.hbm_bytes > s2.hbm_bytes
    assert s1 == npu.run("gather", table, spread).stats and s2 == npu.run("gather", table, repeated).stats
    x, w = _rand(128, 64), _rand(4, 64, 64, seed=1)
    even, skewed = torch.tensor([32] * 4, dtype=torch.int32), torch.tensor([128, 0, 0, 0], dtype=torch.int32)
    g1, g2 = (npu.run("grouped_matmul", x, w, c, timing_only=True).stats for c in (even, skewed))
    assert g1.cycles != g2.cycles
    assert g2 == npu.run("grouped_matmul", x, w, skewed).stats


def test_a_value_read_outside_the_data_work_is_refused(monkeypatch):
    """A kernel that reads an input's values on the host without declaring it steering fails loudly in a
    timing-only launch instead of branching on made-up values."""
    monkeypatch.setitem(STEER, "gather", ())
    with pytest.raises(SimulatorError, match="timing-only"):
        npu.run("gather", _rand(30, 8), _ints(30, 5), timing_only=True)
    absent = Absent((4, 5), np.float32)
    for use in (np.asarray, lambda a: a + 1, lambda a: a.fill(0), lambda a: float(a[0, 0])):
        with pytest.raises((SimulatorError, TypeError)):
            use(absent)
    assert absent[1:3, None, 2].shape == (2, 1) and absent.reshape(-1, 2).shape == (10, 2)
    assert absent.transpose(1, 0).shape == (5, 4) and absent.astype(np.int32).dtype == np.int32


def test_timing_only_holds_no_values():
    """Inputs are not copied and tiles hold no arrays: a timing-only launch of a large matmul allocates nothing
    of the operands' or the output's size."""
    launch = machine.Launch(npu.run.__globals__["get_device"]("ascend910"), "t", values=False)
    g = launch.group("core", 4)
    assert isinstance(g.alloc("L1", (128, 128), "float16").data, Absent)
    assert isinstance(launch.empty((8192, 50257), "float16", "out").data, Absent)
