"""copy / permute / cat / gather kernels vs torch (bit-exact), L2 reuse, errors, timing."""
import numpy as np
import pytest
import torch

from autofuse import npu
from cost_model.devices import get_device
from cost_model.vecutil import coalesce_perm

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.bool]


def _rand(shape, dtype, seed=0):
    torch.manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return (torch.randn(shape) * 100).to(dtype)


def _same(got, ref):
    got = torch.from_numpy(np.ascontiguousarray(got))
    assert tuple(got.shape) == tuple(ref.shape)
    assert torch.equal(got.to(ref.dtype), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy(dtype):
    for shape in [(3, 5, 37, 19), (100_003,), (1,)]:
        x = _rand(shape, dtype)
        _same(npu.run("copy", x).outputs[0], x)


PERMS = [(0, 1, 3, 2), (1, 0, 2, 3), (3, 2, 1, 0), (0, 2, 1, 3), (2, 0, 1, 3), (1, 2, 3, 0), (0, 1, 2, 3),
         (0, 3, 1, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("perm", PERMS)
def test_permute(dtype, perm):
    x = _rand((3, 5, 37, 19), dtype, 1)
    _same(npu.run("permute", x, dims=perm).outputs[0], x.permute(perm).contiguous())


def test_permute_transpose_tiles_and_size_one_dims():
    x = _rand((1, 300, 1, 200), torch.float16, 2)
    _same(npu.run("permute", x, dims=(3, 2, 1, 0)).outputs[0], x.permute(3, 2, 1, 0).contiguous())
    _same(npu.run("permute", x, dims=(0, 3, 2, 1), tiling={"a": 32, "l": 48}).outputs[0],
          x.permute(0, 3, 2, 1).contiguous())
    _same(npu.run("permute", x).outputs[0], x.permute(3, 2, 1, 0).contiguous())     # dims=None reverses


def test_coalesce_perm():
    assert coalesce_perm((2, 3, 4, 5), (0, 1, 3, 2)) == ([6, 4, 5], [0, 2, 1])
    assert coalesce_perm((2, 3, 4, 5), (2, 3, 0, 1)) == ([6, 20], [1, 0])
    assert coalesce_perm((2, 1, 4), (1, 0, 2)) == ([2, 4], [0, 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cat(dtype):
    a, b = _rand((3, 5, 37, 19), dtype, 3), _rand((3, 2, 37, 19), dtype, 4)
    _same(npu.run("cat", a, b, dim=1).outputs[0], torch.cat([a, b], 1))
    _same(npu.run("cat", a, a, a, dim=0).outputs[0], torch.cat([a, a, a], 0))
    _same(npu.run("cat", a, a, dim=-1).outputs[0], torch.cat([a, a], -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather(dtype):
    torch.manual_seed(5)
    table = torch.randn(1000, 77).to(dtype)
    ids = torch.randint(0, 1000, (3, 50), dtype=torch.int32)
    _same(npu.run("gather", table, ids).outputs[0], table[ids.long()])
    _same(npu.run("gather", table, ids, tiling={"rows": 7, "cols": 32}).outputs[0], table[ids.long()])


def test_gather_repeated_rows_hit_l2():
    table = torch.randn(500, 256)
    ids = torch.tensor([7] * 200 + [9] * 56, dtype=torch.int32)
    r = npu.run("gather", table, ids)
    _same(r.outputs[0], table[ids.long()])
    # two distinct rows from HBM, the indices, and the whole output written through
    assert r.stats.hbm_bytes == 2 * 256 * 4 + ids.numel() * 4 + ids.numel() * 256 * 4


def test_errors():
    x = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match="not a permutation"):
        npu.run("permute", x, dims=(0, 0))
    with pytest.raises(ValueError, match="incompatible"):
        npu.run("cat", x, np.ones((3, 4), np.float32), dim=0)
    with pytest.raises(TypeError, match="cast first"):
        npu.run("cat", x, np.ones((4, 5), np.float16), dim=0)
    with pytest.raises(IndexError, match="index 9 out of range for a table of 4 rows"):
        npu.run("gather", x, np.array([1, 9], np.int32))
    with pytest.raises(TypeError, match="int32 indices"):
        npu.run("gather", x, np.array([1.0, 2.0], np.float32))


def test_timing():
    """Copies and transposes run at HBM speed on the 910; time scales with the bytes moved."""
    dev = get_device("ascend910")
    x = torch.randn(1024, 2048).half()
    for kernel, kw in (("copy", {}), ("permute", {"dims": (1, 0)})):
        s = npu.run(kernel, x, **kw).stats
        assert s.bound in ("mte2", "mte3")
        assert s.cycles - s.launch_cycles < 1.1 * s.hbm_bytes / dev.hbm_bytes_per_cycle
        s2 = npu.run(kernel, torch.cat([x, x]), **kw).stats
        assert 1.8 < (s2.cycles - s2.launch_cycles) / (s.cycles - s.launch_cycles) < 2.2
