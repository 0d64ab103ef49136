"""Expert parallelism in one launch (moe_dispatch_combine): values across ranks (threads), near misses, and
the chunked pipeline against one chunk and against the unfused launches."""
import numpy as np
import pytest

from autofuse import npu
from autofuse.npu.dtypes import to_dtype
from autofuse.npu.kernels.moe_ep import expert_spans, send_plan
from cost_model.moe_ep import unfused_steps

from npu.worlds import world_run


def _world(p, E_l, S, K, N, dtype, rng):
    xs = [to_dtype(rng.standard_normal((S, K)).astype(np.float32), dtype) for _ in range(p)]
    ws = [to_dtype(rng.standard_normal((E_l, K, N)).astype(np.float32) / np.sqrt(K), dtype) for _ in range(p)]
    ids = [rng.integers(0, p * E_l, S).astype(np.int32) for _ in range(p)]
    return xs, ws, ids


# products accumulate in fp32 and round once to the dtype (the all-to-alls move values unchanged): half an ulp
# of |x @ w| (<~ 5 here), and fp32's own few roundings
ULP = {"float32": 2 ** -23, "float16": 2 ** -10, "bfloat16": 2 ** -7}


@pytest.mark.parametrize("device", ["ascend910b", "ascend910"])
@pytest.mark.parametrize("p,E_l,chunks,dtype", [(2, 2, 1, "float32"), (4, 2, 3, "float16"), (4, 3, 2, "bfloat16")])
def test_rows_meet_their_experts(device, p, E_l, chunks, dtype):
    """Uneven routing (random expert ids, some experts empty on some ranks): every row is multiplied by the
    weight of its expert, wherever that expert lives, and comes back to its own place."""
    rng = np.random.default_rng(p * 10 + chunks)
    xs, ws, ids = _world(p, E_l, 37, 64, 48, dtype, rng)
    W = np.concatenate(ws).astype(np.float64)
    rs = world_run("moe_dispatch_combine", list(zip(xs, ids, ws)), device, chunks=chunks)
    for r, x, i in zip(rs, xs, ids):
        ref = np.einsum("sk,skn->sn", x.astype(np.float64), W[i])
        assert r.outputs[0].shape == ref.shape
        assert np.abs(r.outputs[0] - ref).max() <= 8 * ULP[dtype] * max(1.0, np.abs(ref).max()) + 1e-6


def test_send_plan_and_expert_spans():
    order, counts = send_plan(np.array([5, 0, 3, 5, 1]), world=3, local=2)
    assert order.tolist() == [1, 4, 2, 0, 3] and counts.tolist() == [[1, 1], [0, 1], [0, 2]]
    assert expert_spans([2, 0, 3], 1, 4) == [(0, 1, 2), (2, 2, 4)]
    with pytest.raises(ValueError, match="expert ids"):
        send_plan(np.array([6]), world=3, local=2)


def test_near_misses_are_refused():
    x, ids = np.zeros((8, 32), np.float16), np.zeros(8, np.int32)
    with pytest.raises(ValueError, match="weight"):
        npu.run("moe_dispatch_combine", x, ids, np.zeros((2, 16, 8), np.float16), world=2)     # K mismatch
    with pytest.raises(ValueError, match="expert ids"):
        npu.run("moe_dispatch_combine", x, ids + 9, np.zeros((2, 32, 8), np.float16), world=2)  # no such expert
    with pytest.raises(TypeError, match="Cube"):
        npu.run("moe_dispatch_combine", x.astype(np.int32), ids, np.zeros((2, 32, 8), np.int32), world=2)


def _unfused(S, K, N, E_l, p, device):
    """The eight launches of the unfused path (cost_model.moe_ep.unfused_steps), simulated on zeros."""
    total = 0
    for kernel, specs, params, values in unfused_steps(S, K, N, E_l, p):
        xs = [values.get(i, np.zeros(s, np.float16 if d == "float16" else getattr(np, d))) for i, (s, d) in
              enumerate(specs)]
        total += npu.run(kernel, *xs, device=device, **params).stats.cycles
    return total


def test_chunks_overlap_the_all_to_alls_with_the_grouped_gemm():
    """EP 8 on the 910B2, 2048 routed rows per rank, even routing: chunks let each chunk's dispatch run under
    the previous chunk's products and its combine under the next; one launch beats the eight of the unfused
    path."""
    p, E_l, S, K, N = 8, 2, 2048, 1024, 1024
    ids = np.repeat(np.arange(p * E_l), S // (p * E_l)).astype(np.int32)
    x, w = np.zeros((S, K), np.float16), np.zeros((E_l, K, N), np.float16)
    one, four = (npu.run("moe_dispatch_combine", x, ids, w, device="ascend910b", world=p, chunks=c).stats
                 for c in (1, 4))
    assert four.cycles < one.cycles
    assert four.busy["link"] > 0 and four.busy["cube"] > 0
    assert four.cycles < _unfused(S, K, N, E_l, p, "ascend910b")
