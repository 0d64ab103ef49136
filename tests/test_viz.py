"""Pictures: DOT and SVG of the graph before and after fusion, colours from the report, the HTML page."""
import re
import xml.etree.ElementTree as ET

import pytest
import torch

import autofuse
from autofuse import viz
from autofuse.models import build


@pytest.fixture(scope="module")
def plan():
    torch.manual_seed(0)
    model, (args, kwargs) = build("gpt2", layers=1, hidden=32, heads=2, seq=8)
    fused = autofuse.AutoFusionEngine.fuse(model, (args, kwargs))
    p = next(iter(fused.plans.values()))
    return fused, p, args, kwargs


def test_colours_follow_the_report(plan):
    fused, p, _, _ = plan
    (d,) = fused.report.applied
    before = viz.colours(p.captured.graph_module, p.report)
    assert all(before[n] == viz.APPLIED for n in d.nodes)
    after = viz.colours(p.graph_module)
    fused_nodes = [n for n, c in after.items() if c == viz.FUSED_OP]
    assert len(fused_nodes) == 1 and fused_nodes[0].startswith("flash_attention")
    assert all(after[n.name] == viz.VIEW for n in p.graph_module.graph.nodes
               if n.op == "call_function" and n.target == torch.ops.aten.view.default)


def test_rejected_blocks_are_orange():
    model, (args, kwargs) = build("gpt2", layers=1, hidden=32, heads=2, seq=8)
    fused = autofuse.AutoFusionEngine.fuse(model, (args, kwargs), optimization_level="O0")
    p = next(iter(fused.plans.values()))
    col = viz.colours(p.captured.graph_module, p.report)
    assert all(col[n] == viz.REJECTED for n in fused.report.rejected[0].nodes)


def test_dot_has_every_node_and_edge(plan):
    _, p, _, _ = plan
    gm = p.graph_module
    dot = viz.to_dot(gm, None, "after")
    assert dot.startswith('digraph "after" {') and dot.rstrip().endswith("}")
    assert len(re.findall(r"^  \"[^\"]+\" \[label=", dot, re.M)) == len(gm.graph.nodes)
    edges = sum(len(n.all_input_nodes) for n in gm.graph.nodes)
    assert len(re.findall(r" -> ", dot)) == edges


def test_svg_is_well_formed_and_draws_every_node(plan):
    fused, p, _, _ = plan
    svg = viz.to_svg(p.canonical, p.report, "gpt2 <before> & after")
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    rects = root.findall(f"{ns}rect")
    params = [n for n in p.canonical.graph.nodes if n.op == "get_attr"]
    assert params and len(rects) == len(p.canonical.graph.nodes) - len(params)
    full = ET.fromstring(viz.to_svg(p.canonical, p.report, show_params=True))
    assert len(full.findall(f"{ns}rect")) == len(p.canonical.graph.nodes)
    assert {r.get("fill") for r in rects} >= {viz.APPLIED, viz.VIEW, viz.PLAIN}
    assert "gpt2 &lt;before&gt; &amp; after" in svg
    assert int(root.get("width")) > 0 and int(root.get("height")) > 0


def test_report_html_with_simulation(plan):
    fused, p, args, kwargs = plan
    sim = fused.simulate(*args, **kwargs)
    page = viz.report_html(p.report, p.canonical, p.graph_module, simulation=sim)
    assert page.startswith("<!doctype html>") and page.count("<svg") == 2
    assert "simulated on ascend910" in page and "<td>fused</td>" in page
    assert f"{fused.report.applied[0].cycles_unfused:,}" in page
