"""moe_init_routing, moe_finalize_routing and index_add kernels vs torch."""
import numpy as np
import pytest
import torch

from autofuse import npu

DEVICES = ["ascend910", "ascend910b", "ascend310p"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_init_routing_is_a_stable_sort(device, dtype):
    torch.manual_seed(0)
    T, H, E, k = 97, 130, 8, 2
    x = torch.randn(T, H).to(dtype)
    ids = torch.randint(0, 3, (T, k), dtype=torch.int32)         # skewed: experts 3..7 empty
    r = npu.run("moe_init_routing", x, ids, num_experts=E, device=device)
    perm = torch.sort(ids.flatten().long(), stable=True).indices
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(T * k)
    assert np.array_equal(r.torch_outputs()[0].float().numpy(), x[perm // k].float().numpy())     # copies: exact
    assert np.array_equal(r.outputs[1], inv.numpy())
    assert np.array_equal(r.outputs[2], torch.bincount(ids.flatten().long(), minlength=E).numpy())
    c = npu.run("moe_init_routing", x, ids, num_experts=E, group_list_type="cumsum", device=device)
    assert np.array_equal(c.outputs[2], np.cumsum(r.outputs[2]))


def test_init_routing_order_is_stable_not_default_sort():
    """Near miss: torch.sort's default (unstable) order of equal expert ids differs for 17+ entries."""
    ids = torch.zeros(20, 1, dtype=torch.int32)
    ids[::3] = 1
    r = npu.run("moe_init_routing", torch.arange(20.0)[:, None].repeat(1, 8), ids, num_experts=2)
    assert r.outputs[0][:, 0].tolist() == torch.sort(ids.flatten().long(), stable=True).indices.float().tolist()


def test_init_routing_errors():
    x = torch.randn(4, 8)
    with pytest.raises(IndexError, match="expert id 5"):
        npu.run("moe_init_routing", x, torch.full((4, 2), 5, dtype=torch.int32), num_experts=4)
    with pytest.raises(TypeError, match="int32"):
        npu.run("moe_init_routing", x, torch.zeros(4, 2, dtype=torch.int64), num_experts=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finalize_routing(device, dtype):
    torch.manual_seed(1)
    T, H, k = 45, 200, 3
    ex = torch.randn(T * k, H).to(dtype)
    sc = torch.rand(T, k)
    row = torch.randperm(T * k).int()
    skip = torch.randn(T, H).to(dtype)
    for s in (None, skip):
        r = npu.run("moe_finalize_routing", ex, sc, row, s, device=device)
        ref = (ex.double()[row.long()].view(T, k, H) * sc.double()[:, :, None]).sum(1)
        if s is not None:
            ref = ref + s.double()
        eager = (ex.float()[row.long()].view(T, k, H) * sc[:, :, None]).sum(1)
        eager = (eager + (s.float() if s is not None else 0)).to(dtype)
        got = r.torch_outputs()[0].double()
        # fp32 accumulation and one rounding to the output dtype: within 2x eager's own error
        assert (got - ref).abs().max() <= 2 * (eager.double() - ref).abs().max() + 1e-6


@pytest.mark.parametrize("device", ["ascend910", "ascend910b"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_index_add(device, dtype):
    torch.manual_seed(2)
    x = torch.randn(60, 7, 5).to(dtype)
    idx = torch.randint(0, 60, (150,))
    src = torch.randn(150, 7, 5).to(dtype)
    r = npu.run("index_add", x, idx, src, alpha=0.5, device=device)
    ref = x.double().index_add(0, idx, src.double(), alpha=0.5)
    eager = x.index_add(0, idx, src, alpha=0.5)
    got = r.torch_outputs()[0].double()
    # each add rounds to the dtype, as torch's CPU index_add does: within 2x eager's error (+ fp32 eps)
    assert (got - ref).abs().max() <= 2 * (eager.double() - ref).abs().max() + 1e-5
