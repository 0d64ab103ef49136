"""The cost model's contract: devices, estimate/roofline, tiling hand-off, generic price, numpy only."""
import subprocess
import sys

import numpy as np
import pytest

import cost_model
from autofuse import npu
from cost_model.estimate import UNITS


def test_devices_match_the_simulator():
    assert cost_model.devices() == npu.devices()


def test_issue_contract_flash_attention():
    e = cost_model.estimate("flash_attention", [((1, 16, 2048, 128), "float16")] * 3, device="ascend910",
                            causal=True)
    assert e.cycles > 0 and e.hbm_bytes > 0
    assert isinstance(e.bytes, dict) and e.bytes
    assert set(e.busy) == set(UNITS) and e.bound in UNITS
    assert set(e.tiling) == {"q", "kv", "vq"}
    # the prediction can never beat the physical bound
    assert e.cycles >= e.roofline


@pytest.mark.parametrize("device", ["ascend910", "ascend910b"])
def test_flash_attention_return_probs_priced(device):
    spec = [((1, 4, 300, 64), "float16")] * 3
    base = cost_model.estimate("flash_attention", spec, device=device, causal=True)
    e = cost_model.estimate("flash_attention", spec, device=device, causal=True, return_probs=True)
    probs = 1 * 4 * 300 * 300 * 2
    # the probabilities reach HBM once, on top of what the first sweep moves; the second sweep takes time
    assert e.hbm_bytes >= base.hbm_bytes + probs
    assert e.cycles > base.cycles and e.cycles >= e.roofline


def test_roofline_matmul_by_hand():
    r = cost_model.roofline("matmul", [((2048, 2048), "float16"), ((2048, 2048), "float16")], device="ascend910")
    flops = 2 * 2048 ** 3
    peak = 2 * 16 * 16 * 16 * 32                     # fp16 FLOP per cycle, 32 cores
    io = 3 * 2048 * 2048 * 2 / 1200.0                # A, B, C once over 1.2 TB/s at 1 GHz
    assert r == pytest.approx(max(flops / peak, io))


@pytest.mark.parametrize("kernel,inputs,params", [
    ("matmul", [((512, 512), "float16")] * 2, {}),
    ("softmax", [((64, 1024), "float16")], {"dim": -1}),
    ("elementwise", [((64, 1024), "float16")] * 2, {"op": "add"}),
    ("rms_norm", [((64, 1024), "float16"), ((1024,), "float16")], {}),
])
def test_estimate_never_beats_roofline(kernel, inputs, params):
    for dev in cost_model.devices():
        e = cost_model.estimate(kernel, inputs, device=dev, **params)
        assert e.cycles - cost_model.get_device(dev).launch_cycles >= e.roofline * 0.999


def test_estimates_are_copies():
    e = cost_model.estimate("matmul", [((256, 256), "float16")] * 2, device="ascend910b")
    e.busy["cube"] = -1
    e.tiling["m0"] = 3
    again = cost_model.estimate("matmul", [((256, 256), "float16")] * 2, device="ascend910b")
    assert again.busy["cube"] > 0 and again.tiling["m0"] != 3


def test_unknown_kernel_names_the_known_ones():
    with pytest.raises(ValueError, match="matmul"):
        cost_model.estimate("nope", [((4,), "float16")])


def test_numpy_only():
    code = "import sys, cost_model; cost_model.estimate('matmul', [((64, 64), 'float16')] * 2); " \
           "bad = [m for m in ('torch', 'autofuse') if m in sys.modules]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("device", ["ascend910", "ascend910b", "ascend310p"])
@pytest.mark.parametrize("mkn", [(200, 300, 400), (64, 1000, 96), (1000, 64, 512)])
def test_chosen_matmul_tiling_is_accepted_and_no_slower_than_default(device, mkn):
    M, K, N = mkn
    a, b = np.zeros((M, K), np.float16), np.zeros((K, N), np.float16)
    e = cost_model.estimate("matmul", [((M, K), "float16"), ((K, N), "float16")], device=device)
    chosen = npu.run("matmul", a, b, device=device, tiling=e.tiling).stats.cycles
    default = npu.run("matmul", a, b, device=device).stats.cycles
    assert chosen <= default


def test_generic_op_prices_a_kernel_less_op():
    e = cost_model.generic_op([((512, 1024), "float16")], [((512, 1024), "float32")], passes=2,
                              device="ascend910b")
    s = npu.run("generic", np.zeros((512, 1024), np.float16), device="ascend910b",
                outputs=[((512, 1024), "float32")], passes=2, tiling=e.tiling).stats
    assert abs(e.cycles - s.cycles) / s.cycles < 0.05
    assert e.hbm_bytes == s.hbm_bytes


SEARCHED = [
    ("copy", [((333, 777), "float32")], {}),
    ("copy", [((64, 8192), "float16")], {}),
    ("cat", [((64, 300), "float16"), ((64, 500), "float16")], {"dim": 1}),
    ("permute", [((1024, 768), "float16")], {"dims": (1, 0)}),
    ("permute", [((8, 100, 130), "float32")], {"dims": (0, 2, 1)}),
    ("gather", [((1000, 64), "float32"), ((4, 77), "int32")], {}),
]


@pytest.mark.parametrize("device", ["ascend910", "ascend910b", "ascend310p"])
@pytest.mark.parametrize("kernel,inputs,params", SEARCHED, ids=lambda x: x if isinstance(x, str) else None)
def test_chosen_movement_tiling_runs_right_and_no_slower(device, kernel, inputs, params):
    """The searched tiling is accepted by the kernel, computes the same values, and the simulator agrees it
    is no slower than the kernel's default."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, inputs[0][0][0], size=s).astype(np.int32) if d == "int32"
              else rng.standard_normal(s).astype(d) for s, d in inputs]
    e = cost_model.estimate(kernel, inputs, device=device, **params)
    chosen = npu.run(kernel, *arrays, device=device, tiling=e.tiling, **params)
    default = npu.run(kernel, *arrays, device=device, **params)
    for a, b in zip(chosen.outputs, default.outputs):
        assert np.array_equal(a, b)
    assert chosen.stats.cycles <= default.stats.cycles * 1.001


@pytest.mark.parametrize("device", ["ascend910", "ascend910b", "ascend310p"])
def test_generic_search_beats_one_wave(device):
    """A 1 MB op fits UB in a few slices; the search cuts it finer so loads, work and stores overlap."""
    ins, outs = [((333, 777), "float32"), ((777,), "float32")], [((333, 777), "float32")]
    e = cost_model.estimate("generic", ins, device=device, outputs=outs, passes=3)
    x, w = np.zeros((333, 777), np.float32), np.zeros(777, np.float32)
    chosen = npu.run("generic", x, w, device=device, outputs=outs, passes=3, tiling=e.tiling).stats
    default = npu.run("generic", x, w, device=device, outputs=outs, passes=3).stats
    assert chosen.cycles <= default.cycles
    assert abs(e.cycles - chosen.cycles) / chosen.cycles < 0.05


@pytest.mark.parametrize("device,shape,params", [
    ("ascend910b", (1, 4, 300, 64), {}),
    ("ascend910b", (2, 8, 256, 128), {"causal": True}),
    ("ascend910", (1, 4, 300, 64), {"causal": True, "return_probs": True}),
    ("ascend910b", (2, 2, 128, 64), {"mask": (2, 1, 1, 128)}),
    ("ascend310p", (1, 2, 128, 64), {"mask": (1, 1, 128, 128), "return_probs": True}),
])
def test_flash_attention_gm_traffic_per_path_is_the_simulators(device, shape, params):
    """The L2 cap rests on the GM traffic: the model's per-path bytes equal what the kernel moves."""
    x = np.zeros(shape, np.float16)
    p = dict(params)
    spec_p = dict(params)
    if "mask" in p:
        p["mask"] = np.ones(params["mask"], bool)
        spec_p["mask"] = (params["mask"], "bool")
    e = cost_model.estimate("flash_attention", [(shape, "float16")] * 3, device=device, **spec_p)
    s = npu.run("flash_attention", x, x, x, device=device, tiling=e.tiling, **p).stats
    assert e.bytes == {k: v for k, v in s.bytes.items() if "GM" in k}
