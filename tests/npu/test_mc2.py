"""MC2 kernels: a matmul fused with its collective, values across ranks (threads) and the overlap they buy."""
import numpy as np
import pytest

from autofuse import npu
from autofuse.npu.dtypes import to_dtype

from npu.worlds import world_run


def _ops(p, M, K, N, dtype, rng, shared_w=False):
    xs = [to_dtype(rng.standard_normal((M, K)).astype(np.float32), dtype) for _ in range(p)]
    ws = [to_dtype(rng.standard_normal((K, N)).astype(np.float32) / np.sqrt(K), dtype) for _ in range(p)]
    return xs, ([ws[0]] * p if shared_w else ws)


# products accumulate in fp32 (L0C) and round once to the dtype; the collective then rounds the partial at each
# of its p-1 adds: bound each rounding by half an ulp of the largest partial sum (|x @ w| <~ 5 here, times p).
ULP = {"float32": 2 ** -23, "float16": 2 ** -10, "bfloat16": 2 ** -7}


def _tol(dtype, p):
    return ULP[dtype] * 8 * p * p + 1e-5


@pytest.mark.parametrize("device", ["ascend910b", "ascend910", "ascend310p"])
@pytest.mark.parametrize("p,tiles,dtype", [(2, 1, "float32"), (2, 3, "float16"), (4, 2, "bfloat16"),
                                           (4, 4, "float16")])
def test_matmul_all_reduce_and_reduce_scatter(device, p, tiles, dtype):
    rng = np.random.default_rng(tiles)
    xs, ws = _ops(p, 96, 40, 72, dtype, rng)
    ref = sum(x.astype(np.float64) @ w.astype(np.float64) for x, w in zip(xs, ws))
    for r in world_run("matmul_all_reduce", list(zip(xs, ws)), device, tiles=tiles):
        assert r.outputs[0].shape == ref.shape
        assert np.abs(r.outputs[0] - ref).max() <= _tol(dtype, p)
    share = 96 // p
    for i, r in enumerate(world_run("matmul_reduce_scatter", list(zip(xs, ws)), device, tiles=tiles)):
        assert np.abs(r.outputs[0] - ref[i * share:(i + 1) * share]).max() <= _tol(dtype, p)


@pytest.mark.parametrize("device", ["ascend910b", "ascend910"])
@pytest.mark.parametrize("p,tiles,dtype", [(2, 2, "float16"), (4, 3, "float32")])
def test_all_gather_matmul(device, p, tiles, dtype):
    rng = np.random.default_rng(p)
    xs, ws = _ops(p, 40, 48, 56, dtype, rng, shared_w=True)
    gathered = np.concatenate(xs)
    ref = gathered.astype(np.float64) @ ws[0].astype(np.float64)
    for r in world_run("all_gather_matmul", list(zip(xs, ws)), device, tiles=tiles):
        assert np.array_equal(r.outputs[1], gathered)
        assert np.abs(r.outputs[0] - ref).max() <= _tol(dtype, 1)


def test_batched_rows_fold_into_one_matmul():
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((2, 16, 32)).astype(np.float32) for _ in range(2)]
    ws = [rng.standard_normal((32, 24)).astype(np.float32) for _ in range(2)]
    ref = sum(x.astype(np.float64) @ w for x, w in zip(xs, ws))
    out = world_run("matmul_all_reduce", list(zip(xs, ws)), tiles=2)[0].outputs[0]
    assert out.shape == (2, 16, 24) and np.abs(out - ref).max() <= _tol("float32", 2)


def test_near_misses_are_refused():
    x = np.zeros((64, 32), np.float16)
    with pytest.raises(ValueError, match="matmul"):
        npu.run("matmul_all_reduce", x, np.zeros((16, 8), np.float16), world=2)            # K mismatch
    with pytest.raises(ValueError, match="split"):
        npu.run("matmul_reduce_scatter", np.zeros((30, 32), np.float16), np.zeros((32, 8), np.float16), world=4)
    with pytest.raises(TypeError, match="Cube"):
        npu.run("matmul_all_reduce", x.astype(np.int32), np.zeros((32, 8), np.int32), world=2)


def test_tiles_overlap_link_with_compute():
    """A prefill-sized row-parallel matmul on 8 simulated 910B2: with tiles, the link and the Cube run at the
    same time, so the fused launch beats the matmul and the all-reduce launched one after the other, and more
    tiles hide more (until the pipeline is full)."""
    x, w = np.zeros((2048, 512), np.float16), np.zeros((512, 2048), np.float16)
    mm = npu.run("matmul", x, w, device="ascend910b").stats.cycles
    ar = npu.run("all_reduce", np.zeros((2048, 2048), np.float16), device="ascend910b", world=8).stats.cycles
    fused = {t: npu.run("matmul_all_reduce", x, w, device="ascend910b", world=8, tiles=t).stats for t in (1, 4)}
    assert fused[4].cycles < fused[1].cycles <= mm + ar
    assert fused[4].cycles < max(mm, ar) + 0.5 * min(mm, ar)
    assert fused[4].busy["link"] > 0 and fused[4].busy["cube"] > 0
