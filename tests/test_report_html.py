"""The HTML report: verdict first, memory, what was fused and why, per-family tables, roofline, time per layer;
self-contained; rendered by headless Chromium without console errors."""
import html
import json
import re

import pytest
import torch

import autofuse
from autofuse import report as R
from autofuse.models import MHABlock, build
from autofuse.simulate import simulate_graph

from browser import CHROMIUM, Browser


class TwoBlocks(torch.nn.Module):
    """Two attention blocks of different widths: a memory budget between their working sets fuses one."""

    def __init__(self):
        super().__init__()
        self.small, self.up, self.large = MHABlock(32, 4), torch.nn.Linear(32, 128), MHABlock(128, 4)

    def forward(self, x):
        return self.large(self.up(self.small(x)))


@pytest.fixture(scope="module")
def mixed():
    """One fused and one rejected (memory_budget) attention block, with both graphs simulated."""
    torch.manual_seed(0)
    model, x = TwoBlocks().eval(), torch.randn(2, 16, 32)
    sets = sorted(d.working_set_bytes for d in autofuse.AutoFusionEngine.fuse(model, (x,)).report.decisions)
    fused = autofuse.AutoFusionEngine.fuse(model, (x,), memory_budget=(sets[0] + sets[1]) // 2)
    p = next(iter(fused.plans.values()))
    leaves = p.captured.flatten_inputs(x)
    sims = {R.BASELINE: simulate_graph(p.captured.graph_module, leaves), "fused": simulate_graph(p.graph_module, leaves)}
    return p, sims


def test_the_budget_splits_the_two_blocks(mixed):
    p, _ = mixed
    assert [d.reason_code for d in p.report.applied] == ["fused"]
    assert [d.reason_code for d in p.report.rejected] == ["memory_budget"]


def test_page_opens_with_the_predicted_verdict_then_memory_fusions_roofline_layers(mixed):
    p, _ = mixed
    page = R.report_html(p.report, p.captured.graph_module, p.graph_module, title="two blocks")
    sections = [page.index(f"id='{s}'") for s in ("verdict", "memory", "fusions", "roofline", "layers")]
    assert sections == sorted(sections)
    before = R.node_costs(p.captured.graph_module, p.report.device, p.report)
    after = R.node_costs(p.graph_module, p.report.device, p.report, before=before)
    total_b, total_a = sum(c.cycles for c in before.values()), sum(c.cycles for c in after.values())
    # a node the rewrite kept costs what it cost before; the fused op what the planner priced; the rest of the
    # saving is code the rewrite left dead (a causal mask the fused kernel computes itself)
    assert all(after[n].cycles == before[n].cycles for n in after if not after[n].fused)
    assert total_b - total_a >= p.report.cycles_saved > 0
    head = page[sections[0]:sections[1]]
    assert f"{total_b:,} &rarr; {total_a:,} cycles" in head and f"{total_b / total_a:.2f}&times;" in head
    assert "predicted by the cost model" in head and "eager op by op" in head


def test_simulated_verdict_uses_the_simulations(mixed):
    p, sims = mixed
    page = R.report_html(p.report, p.captured.graph_module, p.graph_module, simulations=sims)
    head = page[:page.index("id='memory'")]
    b, f = sims[R.BASELINE].cycles, sims["fused"].cycles
    assert f"{b:,} &rarr; {f:,} cycles" in head and f"{b / f:.2f}&times;" in head and "simulated" in head


def test_any_number_of_named_baselines_render(mixed):
    p, _ = mixed
    page = R.report_html(p.report, p.captured.graph_module, p.graph_module, extra_baselines={"generic fusion alone": 12345})
    head = page[:page.index("id='memory'")]
    assert head.count("class='card") == 3 and "generic fusion alone" in head and "12,345 &rarr;" in head


def test_reasons_and_per_family_tables_list_every_candidate(mixed):
    p, _ = mixed
    page = R.report_html(p.report, p.captured.graph_module, p.graph_module)
    fusions = page[page.index("id='fusions'"):page.index("id='roofline'")]
    for code in ("fused", "memory_budget"):
        assert f"<td>{code}</td><td class='n'>1</td><td>{html.escape(R.REASONS[code])}</td>" in fusions
    assert "attention: 1 fused, 1 not fused" in fusions
    for d in p.report.decisions:
        assert f"<code>{d.anchor}</code>" in fusions and f"{d.cycles_unfused:,}" in fusions
    assert fusions.count("<tr class='applied'>") == 1 and fusions.count("<tr class='rejected'>") == 1


def test_reason_meanings_come_from_the_decision_module():
    from autofuse.decision import REASON_CODES
    assert set(R.REASONS) == set(REASON_CODES) and all(R.REASONS.values())


def test_a_forced_fusion_that_moves_more_says_so():
    """Forced where it does not pay (a region of views: nothing to save), a fusion's HBM figure reads as what it
    costs, and the meaning of its reason code does not call it cheaper."""
    torch.manual_seed(0)
    model, inputs = build("llama", seq=8, batch=1, layers=2, hidden=64, heads=4, kv_heads=None)
    fused = autofuse.AutoFusionEngine.fuse(model.eval(), inputs, fusion_switches={"vector_chain": "force"})
    worse = [d for d in fused.report.applied if d.hbm_bytes_saved < 0]
    assert worse, fused.report.summary()
    for d in worse:
        assert f"costs {-d.hbm_bytes_saved:,} B more HBM traffic" in d.reason and d.reason.startswith("forced"), d.reason
    for text in (fused.report.summary(), fused.report.to_markdown()):
        assert "saves -" not in text
    assert R.REASONS["fused"] == "applied: cheaper fused (or forced by a switch), verified equal to the unfused subgraph"


def test_the_generic_baseline_is_labelled_with_the_level_and_switches_it_was_planned_under():
    """Generic fusion alone is planned at the plan's level and under its switches: where those are not O3 without
    switches, the label says which (at O0 it fuses nothing, and equals eager op by op)."""
    torch.manual_seed(0)
    model, x = MHABlock(32, 4).eval(), torch.randn(2, 16, 32)
    at = {}
    for level, switches in (("O3", None), ("O0", None), ("O1", {"softmax": "off"})):
        fused = autofuse.AutoFusionEngine.fuse(model, (x,), optimization_level=level, fusion_switches=switches)
        report, p = fused.report, next(iter(fused.plans.values()))
        page = R.report_html(report, p.captured.graph_module, p.graph_module,
                             extra_baselines={"generic fusion alone": report.baselines["generic fusion alone"]})
        at[level] = (report, report.summary(), report.to_markdown(), page)
    report, text, md, page = at["O3"]
    assert "vs generic fusion alone (" in text and "vs generic fusion alone (" in md
    assert "against <b>generic fusion alone</b>" in page
    report, text, md, page = at["O0"]
    assert report.baselines["generic fusion alone"] == report.baselines["eager op by op"]
    assert "vs generic fusion alone at O0 (" in text and "vs generic fusion alone at O0 (" in md
    assert "against <b>generic fusion alone at O0</b>" in page
    report, text, md, page = at["O1"]
    assert report.fusion_switches == {"softmax": "off"}
    assert "vs generic fusion alone at O1 under the same switches (" in text
    assert "against <b>generic fusion alone at O1 under the same switches</b>" in page


def test_only_svg_pictures_go_into_the_page_as_markup(mixed):
    p, _ = mixed
    dot = 'digraph "<img src=x onerror=alert(1)>" { a [label=<<B>a</B>>]; }'
    page = R.report_html(p.report, p.captured.graph_module, p.graph_module,
                         graphs={"a DOT text": dot, "a picture": "<svg><g id='x'/></svg>"})
    assert "<img" not in page and "<B>" not in page and "&lt;img src=x" in page
    assert "<div class='graph'><svg><g id=" in page


def test_two_pictures_on_one_page_share_no_element_id(mixed):
    from autofuse import viz
    p, _ = mixed
    before = R.node_costs(p.captured.graph_module, p.report.device, p.report)
    after = R.node_costs(p.graph_module, p.report.device, p.report, before=before)
    pictures = {f"Graph {k} fusion": viz.svg_inline(viz.picture(gm, rep, costs, k)[1])
                for k, gm, rep, costs in (("before", p.captured.graph_module, p.report, before),
                                          ("after", p.graph_module, None, after))}
    page = R.report_html(p.report, p.captured.graph_module, p.graph_module, graphs=pictures)
    ids = re.findall(r'\bid=["\']([^"\']+)["\']', page)
    assert len(ids) > 10 and len(ids) == len(set(ids))
    # a reference inside a picture follows its id
    refs = re.findall(r'(?:href="#|url\(#)([^")]+)', page)
    assert set(refs) <= set(ids)


def test_page_is_self_contained(mixed):
    p, sims = mixed
    page = R.report_html(p.report, p.captured.graph_module, p.graph_module, simulations=sims,
                         graphs={"a graph": "<svg xmlns='http://www.w3.org/2000/svg'></svg>"})
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<link" not in page and "@import" not in page and "url(http" not in page
    roof = page[page.index("id='roofline'"):page.index("id='layers'")]
    assert "<svg" in roof and "</svg>" in roof


def test_layers_fold_identical_consecutive_layers_and_add_up():
    # five layers: the first reads the embedding (its first norm is not fused with a projection before it), so
    # its cycles differ; layers 1-4 cost the same, one by one
    model, (args, kwargs) = build("llama", layers=5, hidden=32, heads=2, seq=8)
    fused = autofuse.AutoFusionEngine.fuse(model, (args, kwargs))
    p = next(iter(fused.plans.values()))
    before = R.node_costs(p.captured.graph_module, p.report.device, p.report)
    after = R.node_costs(p.graph_module, p.report.device, p.report, before=before)
    rows = R.layer_rows(p.captured.graph_module, p.graph_module, before, after)
    layers = [r for r in rows if r.path[:2] == ("model", "layers")]
    assert [(r.name, r.count, r.cls) for r in layers if r.cls] == [
        ("model.layers.0", 1, "LlamaDecoderLayer"), ("model.layers.1 … 4", 4, "LlamaDecoderLayer")]
    layers = [r for r in layers if r.cls]
    assert all(r.fused < r.unfused for r in layers)
    assert sum(r.unfused * r.count for r in rows) == sum(c.cycles for c in before.values())
    assert sum(r.fused * r.count for r in rows) == sum(c.cycles for c in after.values())
    # the attention's saving sits in self_attn, the SwiGLU epilogue's in mlp
    parts = {name: (u, f) for name, u, f in layers[1].children}
    assert parts["self_attn"][1] < parts["self_attn"][0] and parts["mlp"][1] < parts["mlp"][0]
    # the five identical attention decisions share one table row that names all five anchors
    page = R.report_html(p.report, p.captured.graph_module, p.graph_module)
    fusions = page[page.index("id='fusions'"):page.index("id='roofline'")]
    attention = fusions[fusions.index("attention: 5 fused"):]
    attention = attention[:attention.index("</table>")]
    assert attention.count("<tr class='applied'>") == 1 and "&times;5 identical" in attention
    assert all(f"<code>{d.anchor}</code>" in fusions for d in p.report.decisions)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_pages_predicted_figures_are_the_reports(name):
    # every node priced as the planner priced it, each fused call by its own decision (a rejected candidate may
    # share its anchor; the rewrite renames what the call replaced): the page's sums are the text's and JSON's
    model, (args, kwargs) = build(name, layers=1, hidden=64, heads=2, seq=16)
    fused = autofuse.AutoFusionEngine.fuse(model, (args, kwargs))
    p = next(iter(fused.plans.values()))
    before = R.node_costs(p.captured.graph_module, p.report.device, p.report)
    after = R.node_costs(p.graph_module, p.report.device, p.report, before=before)
    v = R.verdict(p.report.device, before, after)
    assert (v.fused_cycles, v.baselines[R.BASELINE]) == (p.report.predicted_cycles, p.report.baselines[R.BASELINE])
    assert all(after[n].cycles >= 0 for n in after)


@pytest.fixture(scope="module", params=["mixtral", "gpt2 train"])
def many_calls(request):
    """Plans where one fusion emits several calls: Mixtral's experts block (routing, two grouped GEMMs, combine) and
    a training plan's attention (its dropout keep-mask drawn by its own launch)."""
    name, *mode = request.param.split()
    torch.manual_seed(0)
    model, (args, kwargs) = build(name, layers=1, hidden=32, heads=2, seq=8)
    model.train(bool(mode))
    return next(iter(autofuse.AutoFusionEngine.fuse(model, (args, kwargs)).plans.values()))


def test_every_call_a_fusion_emits_is_its_and_priced_once(many_calls):
    p = many_calls
    before = R.node_costs(p.captured.graph_module, p.report.device, p.report)
    after = R.node_costs(p.graph_module, p.report.device, p.report, before=before)
    v = R.verdict(p.report.device, before, after)
    assert (v.fused_cycles, v.baselines[R.BASELINE]) == (p.report.predicted_cycles, p.report.baselines[R.BASELINE])
    captured = {n.name for n in p.captured.graph_module.graph.nodes}
    new = [n for n in p.graph_module.graph.nodes if n.op == "call_function" and n.name not in captured]
    # every launch the rewrite added belongs to a fused block; the block's price is its lead call's
    assert new and all(after[n.name].fused for n in new if n.name in after)
    parts = [after[n.name] for n in new if n.name in after and after[n.name].part_of]
    assert parts and all(c.cycles == 0 and c.part_of in after and not after[c.part_of].part_of for c in parts)
    page = R.report_html(p.report, p.captured.graph_module, p.graph_module)
    head = page[page.index("id='verdict'"):page.index("id='memory'")]
    assert f"&rarr; {p.report.predicted_cycles:,} cycles" in head


def test_a_training_plans_page_says_so_as_text_and_markdown_do(many_calls, mixed):
    p = many_calls
    page = R.report_html(p.report, p.captured.graph_module, p.graph_module)
    said = "planned for training mode" in p.report.summary()
    assert said == p.report.training == ("<b>Planned for training mode</b>" in page)
    assert all(html.escape(g, quote=True) in page for g in p.report.guards)
    q, _ = mixed
    assert "training mode" not in R.report_html(q.report, q.captured.graph_module, q.graph_module)


def test_summary_and_markdown_still_render_from_the_report(mixed):
    p, _ = mixed
    assert p.report.summary().startswith("autofuse plan for ascend910 at O3: 1 fused, 1 not fused")
    assert str(p.report) == p.report.summary()          # print(report): the summary, not the dataclass's fields
    alts = [d.to_dict()["params"].get("alternatives") for d in p.report.decisions if "alternatives" in d.params]
    # the JSON carries each device's priced implementations (it dropped them: a dict was not a scalar or list)
    assert alts and all(set(a) == {"ascend910", "ascend910b", "ascend310p"} for a in alts)
    assert all({"implementation", "cycles", "runnable"} == set(r) for a in alts for rows in a.values() for r in rows)
    json.dumps(p.report.to_dict())
    assert repr(p.report).startswith("FusionReport(device='ascend910'")
    assert "| kept | attention |" in p.report.to_markdown() and "memory_budget" in p.report.to_markdown()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)")
def test_chromium_renders_the_page_without_errors_and_shows_both_fusions(mixed, tmp_path):
    p, sims = mixed
    path = tmp_path / "report.html"
    path.write_text(R.report_html(p.report, p.captured.graph_module, p.graph_module, title="two blocks", simulations=sims))
    with Browser() as b:
        b.open(path.as_uri())
        assert b.errors() == []
        assert b.eval("document.title") == "two blocks"
        assert b.eval("document.querySelector('h2').id") == "memory"      # the verdict comes before any section
        rows = b.eval("[...document.querySelectorAll('tr.applied, tr.rejected')].map(r => r.innerText)")
        assert len(rows) == 2
        applied, rejected = (next(r for r in rows if r.startswith(k)) for k in ("fused\t", "not fused\t"))
        assert p.report.applied[0].anchor in applied and "memory_budget" in rejected
        assert b.eval("document.querySelector('#roofline + p + div svg').getBBox().width") > 100
        # the tables sort: clicking "unfused cycles" puts the larger block first
        b.eval("document.querySelectorAll('#fusions ~ h3 + table th')[4].click()")
        first = b.eval("document.querySelector('#fusions ~ h3 + table tbody tr').innerText")
        big = max(p.report.decisions, key=lambda d: d.cycles_unfused)
        assert f"{big.cycles_unfused:,}" in first
        assert b.errors() == []


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)")
def test_sorting_puts_numbers_in_order_and_words_after_them(tmp_path):
    cells = ["2.00x", "fused here", "10.50x", "n/a", "1,200", "fused elsewhere", "0.98x"]
    rows = "".join(f"<tr><td>{c}</td></tr>" for c in cells)
    path = tmp_path / "t.html"
    path.write_text(f"<table class='sortable'><thead><tr><th>speed-up</th></tr></thead><tbody>{rows}</tbody></table>"
                    f"<script>{R._JS}</script>")
    with Browser() as b:
        b.open(path.as_uri())
        column = "[...document.querySelectorAll('tbody td')].map(c => c.textContent)"
        b.eval("document.querySelector('th').click()")
        assert b.eval(column) == ["1,200", "10.50x", "2.00x", "0.98x", "n/a", "fused here", "fused elsewhere"]
        b.eval("document.querySelector('th').click()")
        assert b.eval(column) == ["0.98x", "2.00x", "10.50x", "1,200", "fused elsewhere", "fused here", "n/a"]
        assert b.errors() == []


def test_every_family_and_named_region_kind_has_a_colour_of_its_own():
    from autofuse.report import family_colour
    kinds = {"attention": "attention", "softmax": "softmax", "rope": "rope", "moe_gating": "moe_gating",
             "moe_experts": "moe_experts", "add_rms_norm": "norm", "matmul+layer_norm": "norm", "rms_norm": "norm",
             "matmul+swiglu": "glu", "geglu": "glu", "matmul_epilogue": "epilogue", "vector_chain": "vector_chain",
             "all_gather_matmul": "mc2", "matmul_all_reduce": "mc2"}
    colour = {name: family_colour(name) for name in kinds}
    for a in kinds:
        for b in kinds:
            assert (colour[a] == colour[b]) == (kinds[a] == kinds[b]), (a, b, colour[a], colour[b])
