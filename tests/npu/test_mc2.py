"""MC2 kernels: a matmul fused with its collective, values across ranks (threads) and the overlap they buy."""
import numpy as np
import pytest

from autofuse import npu
from autofuse.npu.dtypes import to_dtype
from autofuse.npu.kernels.mc2 import tile_plan

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


def test_tile_plan_rows_then_columns():
    """Row tiles while the rows hold enough base blocks; a few rows are cut by equal ranges of whole column
    blocks (as many as divide them evenly); neither can give more tiles than blocks."""
    assert tile_plan(1024, 256, 128, 64, 4) == ("rows", [(0, 256), (256, 512), (512, 768), (768, 1024)])
    assert tile_plan(16, 512, 16, 32, 4) == ("cols", [(0, 128), (128, 256), (256, 384), (384, 512)])
    assert tile_plan(16, 96, 16, 32, 4) == ("cols", [(0, 32), (32, 64), (64, 96)])       # 3 column blocks
    assert tile_plan(16, 100, 16, 32, 4) == ("rows", [(0, 16)])                          # no whole column blocks
    assert tile_plan(16, 512, 16, 32, 1) == ("rows", [(0, 16)])


@pytest.mark.parametrize("device", ["ascend910b", "ascend910"])
@pytest.mark.parametrize("p,dtype,algorithm", [(2, "float32", None), (4, "float16", "mesh|oneshot"),
                                               (4, "bfloat16", "mesh")])
def test_column_tiles_compute_the_sum(device, p, dtype, algorithm):
    """Decode-like shapes (8 rows: one row block) run in column tiles; the values are the sum (all-reduce) and
    each rank's rows of it (reduce-scatter), laid out as [M, N] whatever the tile-major storage."""
    rng = np.random.default_rng(p)
    xs, ws = _ops(p, 8, 64, 128, dtype, rng)
    ref = sum(x.astype(np.float64) @ w.astype(np.float64) for x, w in zip(xs, ws))
    tiling = {"m0": 16, "n0": 16, "k0": 32, "k1": 64}
    assert tile_plan(8, 128, 16, 16, 4)[0] == "cols"
    kw = dict(tiles=4, tiling=tiling, algorithm=algorithm)
    for r in world_run("matmul_all_reduce", list(zip(xs, ws)), device, **kw):
        assert r.outputs[0].shape == ref.shape and np.abs(r.outputs[0] - ref).max() <= _tol(dtype, p)
    share = 8 // p
    rs = world_run("matmul_reduce_scatter", list(zip(xs, ws)), device, tiles=4, tiling=tiling)
    for i, r in enumerate(rs):
        assert np.abs(r.outputs[0] - ref[i * share:(i + 1) * share]).max() <= _tol(dtype, p)


def test_decode_column_tiles_hide_the_link():
    """A decode step of a 7B-class attention output projection (16 tokens, K 512, N 4096) on 8 simulated 910B2:
    column tiles narrow enough to fill the cores let the first tiles' all-reduces run under the later tiles'
    products; the fused launch beats one tile and the matmul and the all-reduce launched one after the
    other."""
    x, w = np.zeros((16, 512), np.float16), np.zeros((512, 4096), np.float16)
    t = {"m0": 16, "n0": 32, "k0": 256, "k1": 512}
    mm = npu.run("matmul", x, w, device="ascend910b").stats.cycles
    ar = npu.run("all_reduce", np.zeros((16, 4096), np.float16), device="ascend910b", world=8).stats.cycles
    one = npu.run("matmul_all_reduce", x, w, device="ascend910b", world=8, tiles=1, tiling=t).stats
    many = npu.run("matmul_all_reduce", x, w, device="ascend910b", world=8, tiles=8, tiling=t).stats
    assert many.cycles < one.cycles < mm + ar


def test_gathered_tiles_start_on_arrival():
    """all_gather_matmul with row tiles: the Cube starts on this rank's rows and on each peer's tile as it lands,
    so more tiles finish sooner than one sweep after everything has landed."""
    x, w = np.zeros((256, 1024), np.float16), np.zeros((1024, 768), np.float16)
    t = {"m0": 64, "n0": 128, "k0": 128, "k1": 256}
    one, four = (npu.run("all_gather_matmul", x, w, device="ascend910b", world=8, tiles=T, tiling=t).stats.cycles
                 for T in (1, 4))
    assert four < one
