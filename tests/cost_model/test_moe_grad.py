"""The MoE backward models: their HBM bytes by hand, the zero fill's price, and agreement with the simulator on
shapes the sweep does not hold."""
import pytest
import torch

import cost_model
from autofuse import npu


def _fin_specs(T, H, k, R=None, dt="bfloat16", sdt="float32"):
    return [((T, H), dt), ((R or T * k, H), dt), ((T, k), sdt), ((T * k,), "int32")]


def test_finalize_grad_hbm_bytes_by_hand():
    # the gradient rows and every named expanded row read once, indices and scales once; every d_expanded row
    # and the dots written once; accumulate: every row of d_expanded also written as zeros first
    T, H, k = 50, 96, 2
    e = cost_model.estimate("moe_finalize_routing_grad", _fin_specs(T, H, k), device="ascend910")
    assert e.hbm_bytes == T * H * 2 + T * k * H * 2 + T * k * (4 + 4) + T * k * H * 2 + T * k * 4
    a = cost_model.estimate("moe_finalize_routing_grad", _fin_specs(T, H, k, R=T * k + 7), device="ascend910",
                            accumulate=True)
    assert a.hbm_bytes == e.hbm_bytes + (T * k + 7) * H * 2
    assert a.cycles > e.cycles


def test_gating_grad_hbm_bytes_by_hand():
    T, E, k = 300, 64, 4
    e = cost_model.estimate("moe_gating_topk_grad", [((T, E), "float16"), ((T, k), "float32"), ((T, k), "int32")],
                            device="ascend910b", k=k, renorm=True)
    assert e.hbm_bytes == T * E * 2 + T * k * (4 + 4) + T * E * 2
    # renormalisation adds the gathers of the chosen scores: more Vector work, never less
    plain = cost_model.estimate("moe_gating_topk_grad", [((T, E), "float16"), ((T, k), "float32"),
                                                         ((T, k), "int32")], device="ascend910b", k=k)
    assert e.busy["vector"] > plain.busy["vector"]


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("device", ["ascend910", "ascend910b", "ascend310p"])
@pytest.mark.parametrize("T,H,k,accumulate", [(23, 520, 3, False), (3, 1000, 2, True)])
def test_finalize_grad_model_tracks_the_simulator(device, T, H, k, accumulate):
    R = T * k + (4 if accumulate else 0)
    specs = _fin_specs(T, H, k, R=R)
    e = cost_model.estimate("moe_finalize_routing_grad", specs, device=device, accumulate=accumulate)
    ridx = torch.randperm(R)[:T * k].int()
    s = npu.run("moe_finalize_routing_grad", _bf16(T, H), _bf16(R, H), torch.zeros(T, k), ridx, device=device,
                accumulate=accumulate, tiling=e.tiling, timing_only=True).stats
    # the accuracy sweep's bound on one case: 15 % of the simulated cycles; every row distinct: the HBM bytes
    # are counted alike
    assert abs(e.cycles - s.cycles) <= 0.15 * s.cycles, (e.cycles, s.cycles)
    assert e.hbm_bytes == s.hbm_bytes


@pytest.mark.parametrize("device", ["ascend910", "ascend910b", "ascend310p"])
@pytest.mark.parametrize("T,E,k,p", [(129, 32, 3, {"norm": "sigmoid", "renorm": True}),
                                     (700, 16, 2, {"routed_scaling_factor": 1.5})])
def test_gating_grad_model_tracks_the_simulator(device, T, E, k, p):
    specs = [((T, E), "bfloat16"), ((T, k), "bfloat16"), ((T, k), "int32")]
    e = cost_model.estimate("moe_gating_topk_grad", specs, device=device, k=k, **p)
    s = npu.run("moe_gating_topk_grad", _bf16(T, E), _bf16(T, k), torch.zeros(T, k, dtype=torch.int32), k=k,
                device=device, tiling=e.tiling, timing_only=True, **p).stats
    assert abs(e.cycles - s.cycles) <= 0.15 * s.cycles, (e.cycles, s.cycles)
    assert e.hbm_bytes == s.hbm_bytes
