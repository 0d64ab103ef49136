"""Planner pieces that need no kernels: levels, budgets, the global conflict choice, reports."""
import json
import re

import networkx as nx
import pytest
import torch
import torch.nn as nn

from autofuse.decision import REASON_CODES, FusionDecision, FusionReport
from autofuse.plan import LEVELS, Candidate, Price, _best_independent_set, parse_level, parse_memory_budget


@pytest.mark.parametrize("text,expected", [("16GB", 16 * 2 ** 30), ("512MB", 512 * 2 ** 20), ("1.5GiB", int(1.5 * 2 ** 30)),
                                           (" 64 kb ", 64 * 1024), (4096, 4096), (None, None), ("100B", 100),
                                           ("2e9B", 2 * 10 ** 9), ("1.5e3MB", 1500 * 2 ** 20)])   # exponents too
def test_memory_budget_parsing(text, expected):
    assert parse_memory_budget(text) == expected


@pytest.mark.parametrize("text", ["16", " 100 ", "2e9", "1.5"])
def test_a_memory_budget_string_without_a_unit_is_refused_with_the_unit_it_lacks(text):
    """A string without a unit was bytes: memory_budget="16" (as --budget 16 passes it) fused nothing, exit 0, and
    nothing said a unit was missing. An int stays bytes."""
    number = text.strip()
    with pytest.raises(ValueError, match=re.escape(f"memory_budget={text!r} has no unit: did you mean '{number}GB'? "
                                                   f"(GB and GiB are 2**30 bytes") + ".*" + re.escape(f"'{number}B'")):
        parse_memory_budget(text)
    assert parse_memory_budget(16) == 16
    from autofuse import AutoFusionEngine
    with pytest.raises(ValueError, match=re.escape("memory_budget='16' has no unit")):
        AutoFusionEngine.fuse(nn.Linear(4, 4), (torch.randn(2, 4),), memory_budget="16")


@pytest.mark.parametrize("bad", ["lots", "16 parsecs", "-1GB", 0, -5, [1], "1e", "0.5e-9GB", 1.5])
def test_memory_budget_errors_name_the_argument(bad):
    with pytest.raises((ValueError, TypeError), match="memory_budget"):
        parse_memory_budget(bad)


def test_levels():
    assert parse_level("o2") == "O2" and parse_level(3) == "O3"
    assert set(LEVELS) == {"O0", "O1", "O2", "O3"}
    with pytest.raises(ValueError, match="optimization_level='O7'.*O0"):
        parse_level("O7")


class _M:
    def __init__(self, name, nodes):
        self.anchor, self.nodes, self.pattern, self.params = name, tuple(nodes), "attention", {}


def _cand(name, nodes, saving):
    return Candidate(_M(name, nodes), Price(cycles=1000 + saving), Price(cycles=1000), 0)


def test_global_choice_beats_first_match_greedy():
    # a overlaps b and c; b and c do not overlap. Greedy by order (or by the single largest saving) takes a;
    # the best conflict-free set is {b, c}.
    cands = [_cand("a", "xyz", 100), _cand("b", "xq", 70), _cand("c", "zr", 60)]
    g = nx.Graph()
    g.add_nodes_from(range(3))
    g.add_edges_from([(0, 1), (0, 2)])
    assert _best_independent_set(cands, g) == {1, 2}


def test_independent_components_are_chosen_separately():
    cands = [_cand(str(i), [f"n{i}"], 10 * (i + 1)) for i in range(5)]
    g = nx.Graph()
    g.add_nodes_from(range(5))
    assert _best_independent_set(cands, g) == set(range(5))


def test_report_round_trips_and_reason_codes_are_stable():
    d = FusionDecision("attention", ("a", "b"), "b", True, "fused", "predicted 3.00x", 300, 100, 5000, 1000,
                       kernel="flash_attention", params={"scale": 0.125, "q_shape": (1, 2, 3, 4)})
    r = FusionReport("ascend910", "O3", None, [d, FusionDecision("attention", ("c",), "c", False, "not_profitable",
                                                                  "no", 10, 20, 5, 5)])
    assert r.applied == [d] and len(r.rejected) == 1
    doc = json.loads(r.to_json())
    assert doc["applied"][0]["hbm_bytes_saved"] == 4000 and doc["applied"][0]["speedup"] == 3.0
    assert "fused" in r.summary() and "| fused | attention |" in r.to_markdown()
    assert {"fused", "not_profitable", "conflict", "verification_failed", "memory_budget"} <= set(REASON_CODES)


def test_a_region_that_cannot_be_carried_over_inside_a_fused_block_is_named_by_that_block():
    # nn.MultiheadAttention with a 3-D bool mask and its weights returned: the softmax and the mask's Vector chain
    # read the canonical form's product, which the captured graph does not hold; they lie in the fused attention
    # block, and the report says so instead of calling them unsupported
    import torch

    from autofuse import AutoFusionEngine
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(64, 4, batch_first=True).eval()
    q, kv = torch.randn(2, 16, 64), torch.randn(2, 24, 64)
    mask = torch.rand(8, 16, 24) > 0.6
    mask[:, :, 0] = False
    fused = AutoFusionEngine.fuse(m, ((q, kv, kv), {"attn_mask": mask}))
    assert [d.pattern for d in fused.report.applied] == ["attention"], fused.report.summary()
    # the mask's chain without the block's ops is offered too, and priced on its own
    others = [d for d in fused.report.rejected if d.reason_code != "not_profitable"]
    assert {d.pattern for d in others} == {"softmax", "vector_chain"}, fused.report.summary()
    assert all(d.reason_code == "conflict" and "overlaps the attention block" in d.reason and
               "cannot be carried over" in d.reason for d in others), fused.report.summary()
