"""The convolution's cost model (cost_model/conv.py) against the simulator, its tiling and its lowering's price."""
import pytest
import torch

import cost_model
from autofuse import npu
from cost_model.conv import fits, geometry, kernel_default

# (x, w, params): a ViT patch embedding, a 3×3 block, a depthwise short conv, Whisper's stride-2 Conv1d
CASES = [(((2, 3, 64, 64), (96, 3, 16, 16)), {"stride": 16}, "ascend910b", "float16"),
         (((2, 32, 14, 14), (48, 32, 3, 3)), {"padding": 1}, "ascend910", "bfloat16"),
         (((2, 64, 48), (64, 1, 3)), {"padding": 2, "groups": 64}, "ascend310p", "float32"),
         (((1, 48, 90), (32, 48, 3)), {"stride": 2, "padding": 1}, "ascend910", "float16")]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_model_within_the_sweeps_bound(i):
    (xs, ws), params, device, dt = CASES[i]
    specs = [(xs, dt), (ws, dt)]
    e = cost_model.estimate("conv", specs, device=device, bias=((ws[0],), dt), **params)
    xs_, ws_ = (torch.zeros(s, dtype=getattr(torch, dt), device="meta") for s in (xs, ws))
    s = npu.run("conv", xs_, ws_, bias=torch.zeros(ws[0], dtype=getattr(torch, dt), device="meta"), device=device,
                tiling=e.tiling, timing_only=True, **params).stats
    assert abs(e.cycles - s.cycles) / s.cycles <= 0.15, (e.cycles, s.cycles)
    assert abs(e.hbm_bytes - s.hbm_bytes) / s.hbm_bytes <= 0.15, (e.hbm_bytes, s.hbm_bytes)
    assert e.bytes["L1->L0A"] == s.bytes["L1->L0A"] and e.bytes["GM->L1"] == s.bytes["GM->L1"]


def test_default_tiling_is_the_kernels_and_fits():
    from autofuse.npu.kernels.conv import default_tiling
    for device in ("ascend910", "ascend910b", "ascend310p"):
        dev = cost_model.get_device(device)
        for (xs, ws), params, _, dt in CASES + [(((1, 3, 224, 224), (768, 3, 16, 16)), {"stride": 16}, 0, "float32")]:
            geo = geometry(xs, ws, **params)
            t = kernel_default(dev, dt, geo)
            assert t == default_tiling(dev, dt, geo) and fits(dev, dt, geo, t)
