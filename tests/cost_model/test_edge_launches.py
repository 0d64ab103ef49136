"""The cost model against the simulator on launches that random draws (``benchmarks/cost_model_accuracy.py
--drawn``) found mispriced: each within the accuracy sweep's bound, 15 % of the simulated cycles (the models
before read 20.5 % under, 15.9 % over and 17.9 % under on the first three, 23.0 % over, 18.9 % under and 18.7 %
under on the three attention launches, 17.4 % over and 18.7 % under on the two attention backward ones; the
last test checks one phase)."""
import pathlib
import sys

import numpy as np

import cost_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import cost_model_accuracy as bench  # noqa: E402

BOUND = 0.15


def _check(case, tiling=None):
    params = dict(case.params)
    params.update(case.tensor_params)
    if tiling is not None:
        params["tiling"] = tiling
    e = cost_model.estimate(case.kernel, case.inputs, device=case.device, **params)
    s = bench.simulate(case, e.tiling)
    assert abs(e.cycles - s.cycles) <= BOUND * s.cycles, (e.cycles, s.cycles, e.tiling)
    assert abs(e.hbm_bytes - s.hbm_bytes) <= BOUND * s.hbm_bytes, (e.hbm_bytes, s.hbm_bytes)


def test_grouped_gemm_many_short_experts_on_split_cores():
    """64 experts with skewed loads, K = 128, a GELU epilogue on the 910B: the AIVs' epilogue is the busiest unit,
    its product tiles double-buffered, the AIC's port carrying the fp32 workspace stores."""
    sizes = np.random.default_rng(5).multinomial(2048, np.random.default_rng(6).dirichlet([0.5] * 64)).astype(np.int32)
    case = bench.Case("grouped_matmul", [((2048, 128), "float16"), ((64, 1024, 128), "float16"), ((64,), "int32")],
                      "ascend910b", {"trans_w": True, "activation": "gelu", "group_sizes": tuple(int(v) for v in sizes)},
                      values={2: sizes}, timing_only=True)
    _check(case)


def test_matmul_epilogue_step_of_row_and_column_edges():
    """[513, 768] @ [768, 400] with SwiGLU on an fp32 product on the 310P: the last step holds a row-edge item on
    one core and column-edge items on others, priced by its busiest item, not by its largest rows times its
    largest columns."""
    p, extra = bench.epilogue("swiglu", 513, 400, product="float32")
    _check(bench.Case("matmul_epilogue", [((513, 768), "float16"), ((768, 400), "float16")] + extra, "ascend310p",
                      {"program": p}))


def test_attention_backward_halves_and_edge_blocks_on_split_cores():
    """[4, 4, 129, 80] bf16 on the 910B with 16-row query blocks: stage B runs per AIV half (8 rows, each a whole
    fractal row), and the launch's 1-row query block and 1-key KV block cost apart from the full ones."""
    case = bench.Case("flash_attention_grad", [((4, 4, 129, 80), "bfloat16")] * 5, "ascend910b", {"causal": False})
    _check(case, {"q": 16, "kv": 64})


def test_attention_misses_wait_only_the_cores_that_read_them():
    """[1, 8, 513, 128] fp32 causal on the 310P (MTE2-bound): a K/V tile's miss delays the cores reading that tile
    in its instruction, not every core; the cores' own waits come from the replayed deal."""
    case = bench.Case("flash_attention", [((1, 8, 513, 128), "float32")] * 3, "ascend310p", {"causal": True})
    _check(case, {"q": 64, "kv": 128, "vq": 64})


def test_attention_output_stores_share_the_gm_port():
    """[4, 8, 129, 128] fp32 causal on the 310P: items of one or two steps, each ending in an output store that
    holds the core's GM port (all cores storing at once, to HBM) ahead of the next item's Q load."""
    case = bench.Case("flash_attention", [((4, 8, 129, 128), "float32")] * 3, "ascend310p", {"causal": True})
    _check(case, {"q": 64, "kv": 128, "vq": 64})


def test_attention_long_and_short_steps_alternate():
    """[2, 12, 300, 64] fp16 on the 910B with 256-key tiles: every item is a 256-key step then a 44-key one; the
    software pipeline's loop spans two steps, so each pair lasts at least the long step's loop (not the mean of
    the two steps' halves)."""
    case = bench.Case("flash_attention", [((2, 12, 300, 64), "float16")] * 3, "ascend910b",
                      {"causal": False, "return_stats": True})
    _check(case, {"q": 64, "kv": 256, "vq": 32})


def test_attention_backward_statistics_sweep_replayed():
    """[4, 8, 65, 128] fp32 causal on the 310P, statistics recomputed: phase 1 (the forward's deal) replayed core
    by core, a K tile's miss delaying only the cores reading it in that instruction."""
    case = bench.Case("flash_attention_grad", [((4, 8, 65, 128), "float32")] * 5, "ascend310p", {"causal": True})
    _check(case, {"q": 16, "kv": 16})


def test_attention_backward_single_tile_rings():
    """[4, 8, 513, 80] fp32 on the 910B with 128-row query and 64-key blocks: the L0 rings hold one tile each, so
    the statistics sweep's K^T move waits for the S before it and the main phase's moves for the products before
    them."""
    case = bench.Case("flash_attention_grad", [((4, 8, 513, 80), "float32")] * 5, "ascend910b", {"causal": False})
    _check(case, {"q": 128, "kv": 64})


def test_attention_backward_causal_statistics_sweep_hits_or_misses():
    """[4, 8, 300, 128] fp32 causal on the 310P (its operands overflow the 16 MB L2, so the statistics sweep is
    priced by its port, not replayed): a core's items reach each K tile at steps of their own, so in one
    instruction some cores hit while others miss, each waiting for one or the other, not for both in turn. The
    sweep within the bound (the model before read it 33.6 % over)."""
    case = bench.Case("flash_attention_grad", [((4, 8, 300, 128), "float32")] * 5, "ascend310p", {"causal": True})
    e = cost_model.estimate(case.kernel, case.inputs, device=case.device, causal=True, tiling={"q": 32, "kv": 32})
    s = bench.simulate(case, e.tiling)
    phases = {name: (m, t) for name, m, t in bench._phase_pairs(e, s)}
    m, t = phases["statistics"]
    assert abs(m - t) <= BOUND * t, (m, t)
    assert abs(e.cycles - s.cycles) <= BOUND * s.cycles, (e.cycles, s.cycles)


def test_attention_backward_unit_stores_hold_the_port():
    """[2, 12, 257, 128] fp32 on the 310P with 32 x 32 blocks (27 units a core): at each unit's end its dK and dV
    stores, written through to HBM by every core at once, hold a coupled core's one GM port, and the next steps'
    workspace loads wait behind them; priced at the unit's end beyond the port's slack, not spread over the unit's
    steps (the model before read the launch 15.2 % under)."""
    case = bench.Case("flash_attention_grad", [((2, 12, 257, 128), "float32")] * 5, "ascend310p", {"causal": False})
    _check(case, {"q": 32, "kv": 32})
