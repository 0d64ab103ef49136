"""Cost model of the fused attention forward (flash_attention): the row statistics it writes with return_stats
are priced as the simulator counts them (their GM bytes exactly, their time within the sweep's bound)."""
import pytest
import torch

import cost_model
from autofuse import npu

DEVICES = ["ascend910", "ascend910b", "ascend310p"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,causal,dt", [((2, 4, 2, 256, 64), True, "float16"),
                                             ((1, 2, 2, 77, 64), False, "float32")])
def test_return_stats_priced_as_simulated(device, shape, causal, dt):
    B, N, Nkv, S, D = shape
    specs = [((B, N, S, D), dt), ((B, Nkv, S, D), dt), ((B, Nkv, S, D), dt)]
    ts = [torch.empty(s, dtype=getattr(torch, d), device="meta") for s, d in specs]
    plain = cost_model.estimate("flash_attention", specs, device=device, causal=causal)
    est = cost_model.estimate("flash_attention", specs, device=device, causal=causal, return_stats=True)
    sim = npu.run("flash_attention", *ts, device=device, causal=causal, return_stats=True, tiling=est.tiling,
                  timing_only=True).stats
    # two fp32 values a row: out to GM and, as outputs, to HBM
    assert est.hbm_bytes - plain.hbm_bytes == 8 * B * N * S
    assert est.bytes["UB->GM"] - plain.bytes["UB->GM"] == 8 * B * N * S
    assert {k: v for k, v in est.bytes.items() if "GM" in k} == {k: v for k, v in sim.bytes.items() if "GM" in k}
    assert est.cycles >= plain.cycles
    assert est.busy["mte3"] > plain.busy["mte3"]
    # the acceptance bound of the accuracy sweep (benchmarks/cost_model_accuracy.py): worst case 15 %
    assert abs(est.cycles - sim.cycles) <= 0.15 * sim.cycles, (est.cycles, sim.cycles)
    assert abs(est.hbm_bytes - sim.hbm_bytes) <= 0.15 * sim.hbm_bytes
