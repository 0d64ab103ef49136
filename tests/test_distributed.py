"""N ranks under torch.distributed (gloo on loopback, one process each): capture of tensor-parallel graphs,
the engine's decisions on matmul + collective pairs, the fused world against the single-device model, and the
fused ops' gradients (their backwards' launches against the unfused layers' eager autograd)."""
import os
import re
import socket
import time

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


def run_world(fn, world, timeout=None):
    # ranks forked from a server that imported torch and autofuse once (a spawned rank imports them itself: 4
    # ranks on 2 cores spent most of their time importing); the server has run no torch op, so no thread pool
    # is forked
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "dist_workers"])
    q = ctx.SimpleQueue()
    port = _port()
    ps = [ctx.Process(target=_rank, args=(r, world, port, fn, q)) for r in range(world)]
    for p in ps:
        p.start()
    got, start = [], time.monotonic()
    while len(got) < world:
        if timeout is not None and q.empty():
            # a rank that aborted (gloo's size mismatch) or hangs leaves the others waiting: ended here, named
            dead = {r: p.exitcode for r, p in enumerate(ps) if p.exitcode not in (None, 0)}
            if dead or time.monotonic() - start > timeout:
                for p in ps:
                    p.kill()
                pytest.fail(f"{fn}: " + (f"rank(s) died with exit codes {dead}" if dead else
                                         f"no answer from every rank within {timeout} s"))
            time.sleep(0.2)
            continue
        got.append(q.get())
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


def test_engine_fuses_every_pair_or_says_why(two):
    """Through AutoFusionEngine.fuse on each rank: the good pairs of each kind and weight spelling are fused
    with a tile count; the near misses are rejected as unsupported, naming what keeps them from fusing."""
    for r in (0, 1):
        pairs = two[r]["pairs"]
        assert len(pairs) == 9
        fused = [p for p in pairs if p[2]]
        assert sorted(p[0] for p in fused) == ["all_gather_matmul"] + ["matmul_all_reduce"] * 3 + \
            ["matmul_reduce_scatter"]
        assert all(p[3] == "fused" and p[6]["tiles"] >= 1 for p in fused)
        why = {p[4] for p in pairs if not p[2]}
        assert all(p[3] == "unsupported" for p in pairs if not p[2])
        assert any("'max'" in w for w in why) and any("bias" in w for w in why)
        assert any("also read" in w for w in why) and any("not 2-D" in w for w in why)
    assert two[0]["pairs"] == two[1]["pairs"]          # every rank decides alike


def test_a_pair_that_does_not_pay_is_kept_with_both_prices(two):
    (pattern, _, applied, code, reason, _, tiling), = two[0]["kept"]
    assert (pattern, applied, code) == ("matmul_all_reduce", False, "not_profitable")
    fused, unfused = (int(v.replace(",", "")) for v in re.findall(r"([\d,]+) cycles", reason))
    assert fused >= unfused and tiling["tiles"] >= 1          # the best tile count tried, named


def test_fused_pairs_compute_what_eager_does(two):
    for r in (0, 1):
        # fp32: the fused model's error against float64 is at most twice eager's own on the same inputs
        assert two[r]["pairs_err_fused"] <= 2 * two[r]["pairs_err_eager"] + 1e-6


def test_two_ranks_fused_equal_single_device(two):
    for r in (0, 1):
        res = two[r]
        # fp32: the fused world may differ from the float64 block by at most twice the unfused TP model's error
        assert res["err_fused"] <= 2 * res["err_unfused"] + 1e-6
        assert res["decisions"] == [("matmul_all_reduce", True, "fused")] * 2
        fused, unfused = res["cycles"]
        assert fused < unfused
        assert [c[0] for c in res["collectives"]] == ["matmul_all_reduce"] * 2
        assert all(b > 0 and link > 0 and with_.startswith("matmul ") and hidden > 0
                   for _, b, link, with_, hidden in res["collectives"])
        assert [(k, w) for k, _, w in res["unfused_collectives"]] == [("all_reduce", "")] * 2


def test_fused_op_gradients_match_eager(two):
    # against eager autograd of the functional all_reduce (which all-reduces the gradient); fp32 products on the
    # simulator vs torch's: a few ulps of values of magnitude ~40
    assert two[0]["grad"] <= 2e-4 and two[1]["grad"] <= 2e-4


#: (kind, variant) -> the launches its forward and backward record; the backward's are the dual MC2 op and the
#: local GEMMs ("dw": dx not wanted, so the all-gather for dW is a plain functional collective, no fused launch;
#: matmul_all_reduce's all-reduce of dy, a functional collective, is not a kernel launch either)
MC2_LAUNCHES = {("all_gather_matmul", None): ["all_gather_matmul", "matmul_reduce_scatter", "matmul"],
                ("all_gather_matmul", "gathered"): ["all_gather_matmul", "matmul_reduce_scatter", "matmul"],
                ("all_gather_matmul", "dx"): ["all_gather_matmul", "matmul_reduce_scatter"],
                ("matmul_reduce_scatter", None): ["matmul_reduce_scatter", "all_gather_matmul", "matmul"],
                ("matmul_reduce_scatter", "dw"): ["matmul_reduce_scatter", "matmul"],
                ("matmul_all_reduce", None): ["matmul_all_reduce", "matmul", "matmul"],
                ("matmul_all_reduce", "inplace"): ["matmul_all_reduce", "matmul", "matmul"]}


def _mc2_grads_match_eager(res, world):
    for r in range(world):
        got = res[r]["mc2_grads"]
        assert {(k, v) for k, _, v in got} == set(MC2_LAUNCHES) and {d for _, d, _ in got} == {"float32", "float16"}
        for (kind, dtype, variant), g in got.items():
            assert g["launches"] == MC2_LAUNCHES[(kind, variant)], (kind, dtype, variant)
            asked = {"dx": ("dx",), "dw": ("dw",)}.get(variant, ("dx", "dw"))
            for t in asked:
                fused, eager = g[t]
                # against the float64 layer: the kernels accumulate in fp32 and round once, as eager's CPU
                # GEMMs do, and the collectives add the same partials; at most twice eager's own error
                assert fused <= 2 * eager, (kind, dtype, variant, t, fused, eager)


def test_mc2_backwards_are_launches_matching_eager(two):
    _mc2_grads_match_eager(two, 2)


def test_training_step_of_the_world(two):
    """rank_pipeline(backward=True): each rank's training step, fused and unfused, simulated."""
    for r in (0, 1):
        st = two[r]["step"]
        assert sorted(st["grads"]) == ["fc1_b", "fc1_w", "fc2_b", "fc2_w"]
        for name, (fused, eager) in st["grads"].items():
            # the fused step's MLP gradients (MC2 backward launches, simulated) against the float64 eager shard's:
            # fp32 accumulation rounded once, as eager's: at most twice the fp32 eager shard's own error
            assert fused <= 2 * eager, (name, fused, eager)
        fused, unfused = st["phases"]
        assert all(fused[p] > 0 and unfused[p] > 0 for p in ("forward", "backward"))
        # torch 2.13's autograd of the functional all_reduce all-reduces the gradient: one launch per pair, in the
        # fused backward as in the unfused one
        assert st["back_links"] == (["all_reduce"] * 2, ["all_reduce"] * 2)
        assert fused["forward"] < unfused["forward"]


def test_sequence_parallel_training_step(two):
    """The sequence-parallel MLP's step: both pairs fused; each backward is the other MC2 op (the duals) where the
    unfused backward runs torch's autograd of the collectives, the all-gather and reduce-scatter."""
    for r in (0, 1):
        st = two[r]["sp_step"]
        assert sorted(st["pairs"]) == [("all_gather_matmul", True), ("matmul_reduce_scatter", True)]
        assert [k for k, p in st["links"] if p == "backward"] == ["all_gather_matmul", "matmul_reduce_scatter"]
        assert [k for k, p in st["links_unfused"] if p == "backward"] == ["all_gather", "reduce_scatter"]
        for name, (fused, eager) in st["grads"].items():
            # fp32 accumulation rounded once, as eager's: at most twice eager's error against float64
            assert fused <= 2 * eager, (name, fused, eager)
        fused, unfused = st["cycles"]
        assert fused["backward"] < unfused["backward"] and fused["forward"] < unfused["forward"]


def _spellings_train_as_eager(res, world):
    """Every spelling's pair is fused by both routes, with the backward its spelling has in eager, and the fused
    gradients are eager's (fp32: the simulator's sums against torch's, relative to the largest entry); switched
    off, the pair's collective as captured trains as eager too (an in-place all_reduce passes its gradient
    through)."""
    backward = {"all_reduce": "all_reduce", "all_reduce_inplace": "identity", "all_gather": "reduce_scatter",
                "reduce_scatter": "all_gather"}
    for r in range(world):
        got = res[r]
        assert {s for s, _ in got} == set(dist_workers.SPELLINGS)
        for (spelling, route), g in got.items():
            assert g["dx"] <= 1e-5 and g["dw"] <= 1e-5, (r, spelling, route, g)
            if route == "unfused":
                assert all(not a[1] for a in g["applied"]), (spelling, g["applied"])
                continue
            assert [a[:2] for a in g["applied"]] == [(dist_workers.SPELLINGS[spelling], True)], (spelling, route)
            assert g["applied"][0][2] == backward[spelling], (spelling, route, g["applied"])


def test_each_spelling_trains_as_eager():
    _spellings_train_as_eager(run_world("spelling_grads", 2), 2)


def test_data_parallel_over_the_fused_module_trains_as_eager_ddp():
    res = run_world("ddp_steps", 2)
    for r in (0, 1):
        got = res[r]
        assert got["fused"]
        for fused, eager in got["losses"]:
            # the same keep-masks and the gradients averaged over both ranks by DDP's hooks: fp32 rounding only
            assert abs(fused - eager) <= 1e-5 * abs(eager), got["losses"]
        assert got["param_diff"] <= 1e-5, got["param_diff"]
        assert "fuse the module inside and wrap the fused one" in got["refused"]


def test_parallelize_module_is_refused_naming_dtensor(two):
    """torch 2.13's export fails on DTensor modules with an empty AssertionError: capture refuses DTensor parameters
    first, naming them and the functional-collective form that autofuse fuses instead."""
    msg = two[0]["dtensor"]
    assert "0.weight" in msg and "are DTensors" in msg and "_functional_collectives" in msg, msg


def _world_equals_single_device(res, world):
    for r in range(world):
        # see the two-rank test for the bound
        assert res[r]["err_fused"] <= 2 * res[r]["err_unfused"] + 1e-6
        assert res[r]["decisions"] == [("matmul_all_reduce", True, "fused")] * 2
        assert res[r]["cycles"][0] < res[r]["cycles"][1]


def test_four_ranks():
    res = run_world("tp_block_only", 4)
    _world_equals_single_device(res, 4)
    _mc2_grads_match_eager(res, 4)


# -m slow: the spellings' fused and compiled routes are covered at two ranks by test_each_spelling_trains_as_eager,
# and the MC2 ops' forwards and backwards at four ranks (the three families, the in-place all_reduce's identity
# backward) by test_four_ranks
@pytest.mark.slow
def test_four_ranks_each_spelling_trains_as_eager():
    _spellings_train_as_eager(run_world("spelling_grads", 4), 4)


@pytest.mark.slow
def test_four_ranks_float16():
    res = run_world("tp_block_fp16", 4)
    for r in range(4):
        # float16: the fused world against the float64 block, at most twice the unfused TP model's error
        assert res[r]["err_fused"] <= 2 * res[r]["err_unfused"]


@pytest.mark.slow
def test_eight_ranks():
    res = run_world("tp_block_only", 8)
    _world_equals_single_device(res, 8)
    _mc2_grads_match_eager(res, 8)


def test_cli_world_size_needs_a_rank_builder(capsys):
    from autofuse import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["simulate", "--world-size", "2", "--model", "gpt2", "--device", "ascend910b"])
    assert e.value.code == 2 and "tp-block" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_simulates_a_world(capsys, tmp_path):
    from autofuse import cli
    out = tmp_path / "world.json"
    cli.main(["simulate", "--world-size", "2", "--model", "tp-block", "--device", "ascend910b", "--json", str(out),
              "--backward"])
    text = capsys.readouterr().out
    assert "2 ranks on ascend910b" in text and "matmul_all_reduce" in text
    assert "training step (forward + backward)" in text
    assert "backward launches on the links (rank 0, fused): " in text and "all_reduce" in text
    import json
    doc = json.loads(out.read_text())
    assert doc["world_size"] == 2 and doc["cycles"] < doc["cycles_unfused"]
    assert all(r[s]["phases"]["backward"] > 0 for r in doc["ranks"] for s in ("step", "step_unfused"))
    assert {d["reason_code"] for r in doc["ranks"] for d in r["decisions"] if d["pattern"] == "matmul_all_reduce"} \
        == {"fused"}


@pytest.fixture(scope="module")
def agreed():
    return run_world("agreement_checks", 2, timeout=420)


def test_uneven_shards_fuse_alike_on_every_rank(agreed):
    """K 192 / 128 over 2 ranks: alone the ranks price other tile counts best (their collectives would not pair up);
    they agree on one tiling before anything communicates, and the fused output is eager's."""
    assert agreed[0]["own_tiles"] != agreed[1]["own_tiles"]        # the case the agreement is for
    (a0, code0, why0, t0), (a1, code1, _, t1) = agreed[0]["uneven"], agreed[1]["uneven"]
    assert (a0, code0, t0) == (a1, code1, t1) == (True, "fused", 1)
    assert "own best tile counts differ" in why0 and "every rank runs 1 tile" in why0, why0
    for r in (0, 1):
        assert agreed[r]["uneven_err"] <= 1e-5, agreed[r]["uneven_err"]


def test_a_plan_made_again_on_one_rank_communicates_nothing(agreed):
    """Rank 0 alone gets a transposed input (a new layout: a new plan there); the kept agreement serves it, and its
    calls pair up with rank 1's."""
    assert agreed[0]["plans"] == 2 and agreed[1]["plans"] == 1
    assert agreed[0]["replan"] == [(True, "fused", 1)] * 2
    for r in (0, 1):
        assert agreed[r]["replan_err"] <= 1e-5, agreed[r]["replan_err"]


@pytest.mark.parametrize("mode, code", [("switch", "disabled_by_switch"), ("budget", "memory_budget"),
                                        ("level", "disabled_by_opt_level")])
def test_a_setting_of_one_rank_decides_for_the_group(agreed, mode, code):
    """Rank 1 alone switches the family off / has a 2KB budget / plans at O0: no rank fuses the pair, rank 0's
    report names rank 1 and its reason, and both ranks' outputs are eager's (no collective pairs with another)."""
    (a0, code0, why0, _, err0), (a1, code1, why1, _, err1) = agreed[0][mode], agreed[1][mode]
    assert "rank 0 keeps it unfused too" in why1, why1
    assert (a0, a1) == (False, False)
    assert code1 == code and code0 == "another_rank" and f"rank 1 keeps it unfused ({code}" in why0, why0
    assert err0 <= 1e-5 and err1 <= 1e-5, (err0, err1)


def test_fsdp2_and_dtensor_are_refused_with_advice():
    res = run_world("fsdp2_checks", 2, timeout=420)
    for r in (0, 1):
        got = res[r]
        assert got["fuse_of_fsdp2"].startswith("TypeError: fuse: model is sharded by torch.distributed.fsdp."
                                               "fully_shard (FSDP2)"), got["fuse_of_fsdp2"]
        assert "DistributedDataParallel(AutoFusionEngine.fuse(model" in got["fuse_of_fsdp2"]
        assert got["fsdp2_of_fused"].startswith("TypeError: autofuse: this fused module was sharded by "
                                                "torch.distributed.fsdp.fully_shard"), got["fsdp2_of_fused"]
        # torch.compile of a parallelize_module'd model: runs unfused, the warning names DTensor, not a branch
        assert got["compiled_err"] == 0.0
        said = " ".join(got["compile_warnings"])
        assert "are DTensors" in said and "_functional_collectives" in said, said
        assert "branches on tensor values" not in said, said
