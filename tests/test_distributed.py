"""N ranks under torch.distributed (gloo on loopback, one process each): capture of tensor-parallel graphs,
the MC2 pairs, the fused world against the single-device model, and the fused op's gradients."""
import os
import socket

import pytest
import torch.multiprocessing as mp

import dist_workers


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, fn, queue):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AUTOFUSE_NPU_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, getattr(dist_workers, fn)(rank, world), None))
    except BaseException as e:          # reported by the test with the rank named
        import traceback
        queue.put((rank, None, f"{e!r}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def run_world(fn, world):
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _port()
    ps = [ctx.Process(target=_rank, args=(r, world, port, fn, q)) for r in range(world)]
    for p in ps:
        p.start()
    got = [q.get() for _ in range(world)]
    for p in ps:
        p.join(120)
    errors = [f"rank {r}: {e}" for r, _, e in got if e]
    assert not errors, "\n".join(errors)
    return {r: res for r, res, _ in got}


@pytest.fixture(scope="module")
def two():
    return run_world("checks", 2)


def test_functional_collectives_capture_as_c10d_nodes(two):
    assert two[0]["targets"] == ["_c10d_functional.all_gather_into_tensor.default",
                                 "_c10d_functional.all_reduce.default",
                                 "_c10d_functional.reduce_scatter_tensor.default",
                                 "_c10d_functional.wait_tensor.default"]


def test_find_mc2_pairs_and_near_misses(two):
    m = two[0]["matches"]
    assert ("matmul_all_reduce", None) in m and ("matmul_reduce_scatter", None) in m
    assert ("all_gather_matmul", None) in m
    why = [w for _, w in m if w]
    assert any("'max'" in w for w in why) and any("bias" in w for w in why) and any("also used" in w for w in why)
    assert len(m) == 6


def test_two_ranks_fused_equal_single_device(two):
    for r in (0, 1):
        res = two[r]
        # fp32: the fused world may differ from the float64 block by at most twice the unfused TP model's error
        assert res["err_fused"] <= 2 * res["err_unfused"] + 1e-6
        assert all(applied for _, applied, _ in res["decisions"]) and len(res["decisions"]) == 2
        fused, unfused = res["cycles"]
        assert fused < unfused
        assert all(k == "matmul_all_reduce" and b > 0 and link > 0 and with_ for k, b, link, with_ in
                   res["collectives"])


def test_fused_op_gradients_match_eager(two):
    # fp32 products on the simulator vs torch's: a few ulps of values of magnitude ~20
    assert two[0]["grad"] <= 1e-4 and two[1]["grad"] <= 1e-4


def test_parallelize_module_does_not_export(two):
    """torch 2.13: torch.export cannot take DTensor module hooks (DTensorSpec is not a graph input type); the
    hand-written functional-collective form captures. This pins the finding so a torch that fixes it shows."""
    assert "DTensorSpec" in two[0]["dtensor"]


def test_four_ranks():
    res = run_world("tp_block_only", 4)
    for r in range(4):
        assert res[r]["err_fused"] <= 2 * res[r]["err_unfused"] + 1e-6      # fp32: see the two-rank test
        assert all(res[r]["applied"]) and res[r]["cycles"][0] < res[r]["cycles"][1]


@pytest.mark.slow
def test_eight_ranks():
    res = run_world("tp_block_only", 8)
    for r in range(8):
        assert res[r]["err_fused"] <= 2 * res[r]["err_unfused"] + 1e-6
        assert all(res[r]["applied"]) and res[r]["cycles"][0] < res[r]["cycles"][1]
