"""Link profiles, the link unit and the collective kernels (numpy only: ranks are threads of this process)."""
import numpy as np
import pytest

from autofuse import npu
from autofuse.npu.dtypes import to_dtype
from cost_model.links import (LINKS, bytes_per_rank, default_algorithm, get_links, oneshot_limit, ring_bottleneck,
                               ring_time, steps)

from npu.worlds import world_run

DEVICES = ("ascend910b", "ascend910", "ascend310p")


def test_profiles_wire_as_published():
    b = get_links("ascend910b")
    assert b.intra.bytes_per_s == 56e9 and b.intra_lanes == 7 and b.intra_lanes * b.intra.bytes_per_s == 392e9
    f = get_links("ascend910")
    assert f.mesh == 4 and f.intra_lanes == 3 and f.intra.bytes_per_s == 30e9       # 3 x 240 Gb/s HCCS
    assert f.port(3, 4).kind == "roce" and f.port(0, 3).kind == "hccs"             # two 4-NPU groups
    assert get_links("ascend310p").intra_lanes == 1                                  # one shared PCIe port
    for prof in LINKS.values():                                   # every peer gets a distinct lane in a mesh
        for r in range(prof.node):
            lanes = [prof.lane(r, q) for q in range(prof.mesh * (r // prof.mesh), prof.mesh * (r // prof.mesh + 1))
                     if q != r]
            assert len(set(lanes)) == (len(lanes) if prof.full_mesh else 1)


def test_ring_formulas():
    assert steps("all_reduce", "ring", 8) == 14 and bytes_per_rank("all_reduce", "ring", 8, 800) == 1400
    assert steps("all_gather", "ring", 4) == 3 and bytes_per_rank("reduce_scatter", "ring", 4, 400) == 300


def _inputs(p, shape, dtype, rng):
    return [to_dtype(rng.standard_normal(shape).astype(np.float32), dtype) for _ in range(p)]


# fp32 sums in a different order than float64: p-1 roundings of values of magnitude ~p (relative 2^-23 each);
# fp16/bf16 round the partial to the dtype at every step: p-1 roundings of half an ulp at magnitude ~2p.
TOL = {"float32": lambda p: 1e-6 * p, "float16": lambda p: 2 ** -10 * 2 * p * p, "bfloat16": lambda p: 2 ** -7 * 2 * p * p}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p,algorithm,dtype", [(2, None, "float32"), (4, "ring", "float16"), (4, None, "bfloat16"),
                                               (8, None, "float32"), (8, "ring", "float16")])
def test_all_reduce_is_the_sum(device, p, algorithm, dtype):
    rng = np.random.default_rng(p)
    xs = _inputs(p, (37, 50), dtype, rng)
    rs = world_run("all_reduce", [(x,) for x in xs], device, algorithm=algorithm)
    ref = sum(x.astype(np.float64) for x in xs)
    for r in rs:
        assert np.abs(r.outputs[0] - ref).max() <= TOL[dtype](p)
        assert r.stats.busy["link"] > 0 and r.stats.bytes["HBM->link"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_reduce_scatter_all_gather_all_to_all(device):
    p, rng = 4, np.random.default_rng(0)
    xs = _inputs(p, (p * 6, 5), "float32", rng)
    ref = sum(x.astype(np.float64) for x in xs)
    for i, r in enumerate(world_run("reduce_scatter", [(x,) for x in xs], device)):
        assert np.abs(r.outputs[0] - ref[i * 6:(i + 1) * 6]).max() <= TOL["float32"](p)
    for r in world_run("all_gather", [(x,) for x in xs], device):
        assert np.array_equal(r.outputs[0], np.concatenate(xs))                 # copies: exact
    for i, r in enumerate(world_run("all_to_all", [(x,) for x in xs], device)):
        assert np.array_equal(r.outputs[0], np.concatenate([x[i * 6:(i + 1) * 6] for x in xs]))


def test_all_to_all_uneven_splits():
    p, rng = 3, np.random.default_rng(1)
    ins = [[1, 2, 3], [0, 4, 1], [2, 2, 2]]            # rows rank r sends to each rank
    xs = [rng.standard_normal((sum(s), 4)).astype(np.float32) for s in ins]
    per = [(x,) for x in xs]
    world = __import__("autofuse.npu.link", fromlist=["ThreadWorld"]).ThreadWorld(p)
    import threading
    out = [None] * p

    def go(r):
        outs = [ins[q][r] for q in range(p)]
        out[r] = npu.run("all_to_all", *per[r], device="ascend910b", comm=world.comm(r), input_split_sizes=ins[r],
                         output_split_sizes=outs).outputs[0]
    ts = [threading.Thread(target=go, args=(r,)) for r in range(p)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    for r in range(p):
        want = np.concatenate([xs[q][sum(ins[q][:r]):sum(ins[q][:r + 1])] for q in range(p)])
        assert np.array_equal(out[r], want)


def test_near_misses_are_refused():
    x = np.zeros((8, 8), np.float32)
    with pytest.raises(ValueError, match="mesh"):
        npu.run("all_reduce", x, device="ascend910", world=8, algorithm="mesh")         # two 4-NPU domains
    with pytest.raises(ValueError, match="pairwise"):
        npu.run("all_to_all", x, device="ascend910b", world=4, algorithm="ring")
    with pytest.raises(ValueError, match="divisible"):
        npu.run("reduce_scatter", np.zeros((6, 8), np.float32), device="ascend910b", world=4)


def test_symmetric_stand_in_times_like_the_real_world():
    """One process standing for a symmetric world times rank 0 as the threaded world does."""
    xs = [np.full((256, 512), 1.0, np.float16)] * 4
    real = world_run("all_reduce", [(x,) for x in xs], "ascend910b")[0].stats.cycles
    alone = npu.run("all_reduce", xs[0], device="ascend910b", world=4).stats.cycles
    # the mirror of a peer's lane does not charge the peer's Scalar issue cycle per send (1 cycle each)
    assert abs(alone - real) <= 16


def test_ring_all_reduce_runs_at_the_link_bandwidth():
    """A ring all-reduce over 8 first-generation 910s takes what the ring formula predicts from the slowest
    port it crosses (RoCE between the two 4-NPU groups). 5 %: the fill and drain of the slice pipeline and the
    last slice's add are outside the formula."""
    n = 8 << 20
    r = npu.run("all_reduce", np.zeros(n // 2, np.float16), device="ascend910", world=8, algorithm="ring")
    prof = get_links("ascend910")
    want = ring_time("all_reduce", 8, n, ring_bottleneck(prof, 8))
    assert r.stats.seconds == pytest.approx(want, rel=0.05)


def test_kernels_without_links_keep_their_units_and_cycles():
    """The link unit is reported only by launches that communicate; the plain kernels' cycles are those the
    simulator gave before the link unit existed (measured on the parent commit)."""
    rng = np.random.default_rng(0)
    before = [3157, 11174, 17327, 5490]
    got = []
    for (M, K, N), dev in [((300, 130, 17), "ascend910"), ((512, 1024, 512), "ascend910b"),
                           ((33, 3333, 333), "ascend310p"), ((4, 100, 300), "ascend910b")]:
        a = rng.standard_normal((M, K)).astype(np.float16)
        b = rng.standard_normal((K, N)).astype(np.float16)
        s = npu.run("matmul", a, b, device=dev).stats
        assert "link" not in s.busy
        got.append(s.cycles)
    assert got == before


def test_small_all_reduce_goes_one_shot():
    """Inside a full mesh a small all-reduce goes one-shot (one latency, p-1 whole buffers sent), a large one
    two-shot (the mesh reduce-scatter and all-gather): the switch is where the one-shot's single latency stops
    paying for its extra bytes on the profile's links, and the simulator agrees on both sides of it."""
    b = get_links("ascend910b")
    limit = oneshot_limit(b, 8)
    assert limit == pytest.approx(2e-6 * 56e9 * 8 / 6)
    assert default_algorithm(b, "all_reduce", 8, limit * 0.9) == "oneshot"
    assert default_algorithm(b, "all_reduce", 8, limit * 1.1) == "mesh"
    assert default_algorithm(b, "all_reduce", 2, 1 << 30) == "oneshot"          # two ranks: always one step
    assert default_algorithm(b, "all_reduce", 16, 1024) == "hierarchical"       # beyond one mesh domain
    assert default_algorithm(get_links("ascend310p"), "all_reduce", 4, 1024) == "ring"     # a shared bus
    assert steps("all_reduce", "oneshot", 8) == 1 and bytes_per_rank("all_reduce", "oneshot", 8, 100) == 700

    def cycles(n, alg):
        return npu.run("all_reduce", np.zeros(n // 2, np.float16), device="ascend910b", world=8,
                       algorithm=alg).stats.cycles
    assert cycles(16 << 10, "oneshot") < cycles(16 << 10, "mesh")
    assert cycles(1 << 20, "mesh") < cycles(1 << 20, "oneshot")
    with pytest.raises(ValueError, match="oneshot"):
        npu.run("all_reduce", np.zeros(64, np.float16), device="ascend910b", world=16, algorithm="oneshot")
    with pytest.raises(ValueError, match="oneshot"):
        npu.run("reduce_scatter", np.zeros((8, 8), np.float16), device="ascend910b", world=4, algorithm="oneshot")


@pytest.mark.parametrize("algorithm", ["oneshot", "mesh"])
def test_one_and_two_shot_compute_the_sum(algorithm):
    rng = np.random.default_rng(7)
    xs = _inputs(4, (33, 40), "float16", rng)
    ref = sum(x.astype(np.float64) for x in xs)
    for r in world_run("all_reduce", [(x,) for x in xs], "ascend910b", algorithm=algorithm):
        assert np.abs(r.outputs[0] - ref).max() <= TOL["float16"](4)
