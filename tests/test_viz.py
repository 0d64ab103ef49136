"""Pictures: module paths and identical layers, Graphviz DOT with clusters, folded layers and costs, the
built-in SVG, and Model Explorer graphs checked by Model Explorer's own parser and web app."""
import json
import operator
import re
import subprocess
import sys
import time
import urllib.request
import xml.etree.ElementTree as ET

import pytest
import torch

import autofuse
from autofuse import hierarchy, viz
from autofuse import report as R
from autofuse.models import build

from browser import CHROMIUM, Browser, free_port

needs_dot = pytest.mark.skipif(not viz.have_graphviz(), reason="Graphviz `dot` is not installed "
                               "(apt-get install graphviz; .ci/run does): the DOT text is still tested")


# five layers: the first reads the embedding and the last feeds the final norm, so with Vector regions fused
# across layer boundaries (a down projection + the next layer's add + RMSNorm) layers 1-3 are the identical ones
LAYERS = 5


def _plan(name="llama", layers=LAYERS, level="O3"):
    torch.manual_seed(0)
    model, (args, kwargs) = build(name, layers=layers, hidden=32, heads=2, seq=8)
    fused = autofuse.AutoFusionEngine.fuse(model, (args, kwargs), optimization_level=level)
    p = next(iter(fused.plans.values()))
    before = R.node_costs(p.captured.graph_module, p.report.device, p.report)
    after = R.node_costs(p.graph_module, p.report.device, p.report, before=before)
    return p, before, after


@pytest.fixture(scope="module")
def llama():
    return _plan()


@pytest.fixture(scope="module")
def llama3():
    # three layers for the browser test: Model Explorer's web app shows the overlay of a small graph promptly
    return _plan(layers=3)


@pytest.fixture(scope="module")
def gpt2_o0():
    return _plan("gpt2", layers=1, level="O0")


# ------------------------------------------------------------------------------ module paths, identical layers

def test_every_node_has_a_module_path_and_fused_ops_sit_where_their_nodes_were(llama):
    p, _, _ = llama
    before = hierarchy.module_paths(p.captured.graph_module)
    assert set(before) == {n.name for n in p.captured.graph_module.graph.nodes}
    after = hierarchy.module_paths(p.graph_module, before=before)
    fused = [n for n in p.graph_module.graph.nodes if hierarchy.fused_lead(n)]        # the calls priced by a decision
    attention = [n for n in fused if hierarchy.fused_match(n).pattern == "attention"]
    assert len(attention) == LAYERS and len(fused) > LAYERS
    for i, n in enumerate(attention):
        assert after[n.name] == ("model", "layers", str(i), "self_attn")
    # canonicalization's reshapes between a projection and the attention serve the attention
    for n in p.captured.graph_module.graph.nodes:
        if n.name.startswith(("reshape_default", "permute_default")) and "nn_module_stack" not in n.meta:
            assert before[n.name][-1] in ("self_attn", "o_proj"), (n.name, before[n.name])
    # a value every layer reads (RoPE cos/sin, traced once in the first layer) belongs to no single layer
    shared = [n for n in p.captured.graph_module.graph.nodes if len({hierarchy.layer_of(before[u.name]) for u in n.users}) > 1
              and n.op == "call_function"]
    assert shared and all(len(before[n.name]) <= 2 for n in shared)


def test_identical_layers_are_grouped_and_a_status_difference_splits_them(llama):
    p, _, _ = llama
    paths = hierarchy.module_paths(p.captured.graph_module)
    (group,) = hierarchy.repeated_layers(p.captured.graph_module, paths)
    assert group.members == [("model", "layers", str(i)) for i in range(LAYERS)]
    assert group.label() == "layers.1 … layers.4"
    d = p.report.of("attention")[1]                # layer 1's attention, as if it had been rejected
    status = {name: "rejected" for name in d.nodes}
    (group,) = hierarchy.repeated_layers(p.captured.graph_module, paths, status)
    assert group.members == [("model", "layers", str(i)) for i in (0, 2, 3, 4)]
    assert group.label() == "layers.2 … layers.4"


# ------------------------------------------------------------------------------ DOT

def _dot_nodes_and_edges(dot):
    declared = set(re.findall(r'^\s*"([^"]+)" \[', dot, re.M))
    edges = re.findall(r'^\s*"([^"]+)" -> "([^"]+)";', dot, re.M)
    return declared, edges


def test_before_picture_clusters_modules_folds_layers_and_draws_candidates(llama):
    p, before, _ = llama
    dot = viz.graph_dot(p.captured.graph_module, p.report, before, "llama before", cost_source="predicted")
    declared, edges = _dot_nodes_and_edges(dot)
    assert all(a in declared and b in declared for a, b in edges)
    assert "×2 identical to layers.1" in dot and "layers.2 … layers.3" in dot
    # layers 0, 1 and 4 drawn, layers 2 and 3 folded: none of their nodes is declared
    paths = hierarchy.module_paths(p.captured.graph_module)
    for name, path in paths.items():
        if path[:3] in (("model", "layers", "2"), ("model", "layers", "3")):
            assert name not in declared
    d0 = p.report.of("attention")[0]
    assert all(n in declared for n in d0.nodes if not n.startswith(("model_", "lm_head")))
    assert dot.count("attention · fused") == 3          # the drawn layers' candidate clusters; the others folded
    assert "LlamaDecoderLayer" in dot and "self_attn · LlamaAttention" in dot
    assert re.search(r"[\d,]+ cyc · [\d.]+ [KMG]?B · \w+", dot)                 # cost lines on kernel nodes
    assert "legend" in dot


def test_expand_all_draws_every_layer(llama):
    p, before, _ = llama
    dot = viz.graph_dot(p.captured.graph_module, p.report, before, expand_all=True)
    declared, _ = _dot_nodes_and_edges(dot)
    kept = {n.name for n in p.captured.graph_module.graph.nodes if n.op != "get_attr" and not (n.op == "placeholder" and
                                                                                 not n.users)}
    assert kept <= declared and "identical" not in dot and dot.count("attention · fused") == LAYERS


def test_after_picture_draws_the_fused_op_in_its_family_colour(llama):
    p, before, after = llama
    dot = viz.graph_dot(p.graph_module, None, after, before_paths=hierarchy.module_paths(p.captured.graph_module),
                        expand_all=True)
    lines = [ln for ln in dot.splitlines() if "fused attention" in ln and "label=<" in ln]
    assert len(lines) == LAYERS and all(R.family_colour("attention") in ln for ln in lines)
    c = next(v for name, v in after.items() if name.startswith("flash_attention"))
    assert f"{c.cycles:,} cyc" in lines[0]


def _after_dot(p, after, **kw):
    before_paths = hierarchy.module_paths(p.captured.graph_module)
    return viz.graph_dot(p.graph_module, None, after, before_paths=before_paths, **kw)


def _crossing(p):
    """Fused ops (lead calls) of the graph after whose block spans two layers -> the layers, lowest first."""
    before = hierarchy.module_paths(p.captured.graph_module)
    out = {}
    for n in p.graph_module.graph.nodes:
        if hierarchy.fused_lead(n):
            layers = sorted({hierarchy.layer_of(before[x]) for x in hierarchy.fused_block(n)[1]
                             if any(part.isdigit() for part in before.get(x, ()))}, key=lambda layer: int(layer[-1]))
            if len(layers) > 1:
                out[n.name] = layers
    return out


def test_a_fused_block_across_a_layer_boundary_sits_in_its_last_layer_and_folds_with_it(llama):
    """A projection with the residual add and the next layer's RMSNorm as its epilogue sat in ``model.layers``,
    outside every layer: drawn once per layer beside the folded box (96 of them in a 48-layer GPT-2, which
    Graphviz did not lay out in 10 minutes). It sits in the layer that reads it, so it folds with that layer."""
    p, _, after = llama
    before = hierarchy.module_paths(p.captured.graph_module)
    paths = hierarchy.module_paths(p.graph_module, before=before)
    crossing = _crossing(p)
    assert len(crossing) == LAYERS - 1                  # layers.i's down projection + layers.(i+1)'s input norm
    for n in p.graph_module.graph.nodes:
        if n.name in crossing:
            assert len(crossing[n.name]) == 2 and paths[n.name][:3] == crossing[n.name][-1], (n.name, paths[n.name])
            getitems = [u for u in n.users if u.target is operator.getitem]
            assert getitems and all(paths[g.name] == paths[n.name] for g in getitems)   # its outputs sit with it
    dot = _after_dot(p, after)
    declared, edges = _dot_nodes_and_edges(dot)
    assert all(a in declared or a.startswith("fold_") for e in edges for a in e)
    assert "×3 identical to layers.1" in dot and "layers.2 … layers.4" in dot
    # drawn: the one in layers.1 (layers.0 -> layers.1), labelled with both layers; the rest are in the folded box
    assert [n for n in crossing if n in declared] == [n for n, layers in crossing.items() if layers[-1][-1] == "1"]
    assert dot.count("spans layers.0 → layers.1") == 1 and "spans layers.1" not in dot
    # nothing fused is hidden: every fused op is drawn or lies in a layer the box stands for
    folded = {("model", "layers", str(i)) for i in (2, 3, 4)}
    for n in p.graph_module.graph.nodes:
        if hierarchy.fused_match(n) is not None:
            assert (n.name in declared) != (paths[n.name][:3] in folded), (n.name, paths[n.name])
    full = _after_dot(p, after, expand_all=True)
    assert all(full.count(f"spans layers.{i} → layers.{i + 1}") == 1 for i in range(LAYERS - 1))


def test_the_folded_picture_after_fusion_does_not_grow_with_depth(llama, llama3):
    """At 3 and 5 layers the graph after fusion is drawn with as many nodes and edges: only the folded box's
    count changes (at 24 and 48 GPT-2 layers the DOT had grown from 316 to 556 edges)."""
    sizes = []
    for (p, _, after), layers in ((llama3, 3), (llama, 5)):
        dot = _after_dot(p, after)
        declared, edges = _dot_nodes_and_edges(dot)
        assert f"×{layers - 2} identical to layers.1" in dot
        sizes.append((len(declared), len(edges)))
    assert sizes[0] == sizes[1]


def test_rejected_candidates_are_dashed_with_their_reason(gpt2_o0):
    p, before, _ = gpt2_o0
    dot = viz.graph_dot(p.captured.graph_module, p.report, before)
    assert "attention · not fused" in dot and "disabled_by_opt_level" in dot and "dashed" in dot


@needs_dot
def test_graphviz_renders_both_pictures(llama, tmp_path):
    p, before, after = llama
    for gm, rep, costs, kw in ((p.captured.graph_module, p.report, before, {}),
                               (p.graph_module, None, after, {"before_paths": hierarchy.module_paths(p.captured.graph_module)})):
        dot, svg = viz.picture(gm, rep, costs, "llama", **kw)
        root = ET.fromstring(svg.encode())
        titles = {t.text for t in root.iter("{http://www.w3.org/2000/svg}title")}
        declared, _ = _dot_nodes_and_edges(dot)
        assert declared <= titles                   # every declared node became an SVG group titled by its id


def test_plain_dot_has_every_node_and_edge(llama):
    p, _, _ = llama
    gm = p.graph_module
    dot = viz.to_dot(gm, None, "after")
    assert dot.startswith('digraph "after" {') and dot.rstrip().endswith("}")
    assert len(re.findall(r"^  \"[^\"]+\" \[label=", dot, re.M)) == len(gm.graph.nodes)
    assert len(re.findall(r" -> ", dot)) == sum(len(n.all_input_nodes) for n in gm.graph.nodes)


def test_builtin_svg_is_well_formed_and_coloured_by_the_report(gpt2_o0):
    p, _, _ = gpt2_o0
    svg = viz.to_svg(p.captured.graph_module, p.report, "gpt2 <before> & after")
    root = ET.fromstring(svg)
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    params = [n for n in p.captured.graph_module.graph.nodes if n.op == "get_attr"]
    assert params and len(rects) == len(p.captured.graph_module.graph.nodes) - len(params)
    assert {r.get("fill") for r in rects} >= {viz.REJECTED, viz.VIEW, viz.PLAIN}
    assert "gpt2 &lt;before&gt; &amp; after" in svg


def test_colours_follow_the_report(llama):
    p, _, _ = llama
    before = viz.colours(p.captured.graph_module, p.report)
    assert all(before[n] == viz.APPLIED for d in p.report.applied for n in d.nodes)
    after = viz.colours(p.graph_module)
    # every kernel a fusion emitted (a getitem of its outputs is a view, coloured as one)
    assert sorted(n for n, c in after.items() if c == viz.FUSED_OP) == sorted(
        n.name for n in p.graph_module.graph.nodes if hierarchy.fused_match(n) is not None and not viz._is_view(n))


# ------------------------------------------------------------------------------ Model Explorer

def _model_explorer(p, before, after):
    return (viz.model_explorer(p.captured.graph_module, p.graph_module, p.report, before, after, label="llama"),
            viz.model_explorer_node_data(p.captured.graph_module, p.graph_module, p.report, before, after))


def test_model_explorer_graphs_carry_namespaces_shapes_and_costs(llama):
    p, before, after = llama
    doc, data = _model_explorer(p, before, after)
    assert doc["label"] == "llama" and [g["id"] for g in doc["graphs"]] == ["fused", "original"]
    fused, original = doc["graphs"]
    assert len(fused["nodes"]) == len(p.graph_module.graph.nodes)
    assert len(original["nodes"]) == len(p.captured.graph_module.graph.nodes)
    nodes = {n["id"]: n for n in fused["nodes"]}
    fa = [n for n in fused["nodes"] if n["label"] == "flash_attention"]
    assert [n["namespace"] for n in fa] == [f"model/layers.{i}/self_attn" for i in range(LAYERS)]
    attrs = {a["key"]: a["value"] for a in fa[0]["attrs"]}
    assert attrs["cycles"].startswith(f"{after[fa[0]['id']].cycles:,}") and attrs["bound"]
    for n in fused["nodes"]:
        for e in n["incomingEdges"]:
            assert e["sourceNodeId"] in nodes
    lin = next(n for n in original["nodes"] if n["id"] == "linear")
    assert lin["outputsMetadata"][0]["attrs"][0] == {"key": "tensor_shape", "value": "float32[2, 8, 32]"}
    assert any(n["namespace"].endswith("self_attn/attention (fused)") for n in original["nodes"])
    assert data["fused"]["fused"]["results"][fa[0]["id"]]["value"] == "fused attention"
    assert data["cycles"]["original"]["results"]["linear"]["value"] == before["linear"].cycles


def test_model_explorer_python_parser_accepts_the_graphs_and_node_data(llama):
    """The package's own parsing: its node-data-provider runner builds ``graph_builder.Graph`` from graph JSON
    with dacite (``NdpRunner.run_ndp``); node data load into ``node_data_builder.ModelNodeData``."""
    pytest.importorskip("model_explorer", reason="ai-edge-model-explorer is not installed (pip install '.[test]')")
    import dacite
    from model_explorer import graph_builder, node_data_builder
    from model_explorer.extension_metadata import ExtensionMetadata
    from model_explorer.ndp_runner import NdpRunner
    from model_explorer.registered_extension import RegisteredExtension
    p, before, after = llama
    doc, data = _model_explorer(p, before, after)
    doc = json.loads(json.dumps(doc))                               # what the file holds
    strict = dacite.Config(strict=True)
    collection = dacite.from_dict(graph_builder.GraphCollection, doc, config=strict)
    assert [len(g.nodes) for g in collection.graphs] == [len(p.graph_module.graph.nodes),
                                                         len(p.captured.graph_module.graph.nodes)]
    received = []

    class Provider:
        def run(self, provider_id, model_path, graph_id, config_values, graph):
            received.append(graph)
            return node_data_builder.GraphNodeData(results={})

    ext = RegisteredExtension(metadata=ExtensionMetadata(id="probe", name="probe", description=""),
                              type="node_data_provider", ext_class=Provider)
    for g in doc["graphs"]:
        NdpRunner().run_ndp(ext, {"cmdId": "run", "modelPath": "x", "graphId": g["id"], "configValues": {},
                                  "graph": g})
    assert [len(g.nodes) for g in received] == [len(g["nodes"]) for g in doc["graphs"]]
    for name in ("cycles", "hbm_bytes"):
        node_data_builder.ModelNodeData(graphsData={k: dacite.from_dict(node_data_builder.GraphNodeData, v, strict)
                                                    for k, v in data[name].items()})
    # bound and fusion carry strings, which the app shows as labels; the Python dataclass annotates numbers only
    for name in ("bound", "fused"):
        for gd in data[name].values():
            assert set(gd) <= {"name", "results"} and all(isinstance(r["value"], str) for r in gd["results"].values())


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium; .ci/run does)")
def test_model_explorer_web_app_loads_the_file_and_its_node_data(llama3, tmp_path):
    """Model Explorer's server and web app (its JSON adapter is in the app) load the graphs and an overlay."""
    pytest.importorskip("model_explorer", reason="ai-edge-model-explorer is not installed (pip install '.[test]')")
    from model_explorer.config import ModelExplorerConfig
    p, before, after = llama3
    doc, data = _model_explorer(p, before, after)
    graphs, overlay = tmp_path / "llama.json", tmp_path / "llama.fused.json"
    graphs.write_text(json.dumps(doc))
    overlay.write_text(json.dumps(data["fused"]))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "model_explorer", str(graphs), "--node_data_paths", str(overlay),
                               "--no_open_in_browser", "--skip_health_check", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/check_health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        config = ModelExplorerConfig().add_model_from_path(str(graphs)).add_node_data_from_path(str(overlay))
        with Browser(timeout=120) as b:
            b.open(f"http://127.0.0.1:{port}/?data={config.to_url_param_value()}")
            b.wait("document.body.innerText.includes('GRAPH INFO') || /error/i.test(document.body.innerText)")
            text = b.eval("document.body.innerText")
            assert "GRAPH INFO" in text and not re.search(r"error", text, re.I), text[:2000]
            assert f"{len(p.captured.graph_module.graph.nodes)} nodes" in text or f"{len(p.captured.graph_module.graph.nodes)}" in text
            b.wait("document.body.innerText.includes('not a candidate')")      # the overlay's values, per node
            assert "fusion" in b.eval("document.body.innerText")
            # the app asks Google for its fonts; offline that fails, and says nothing about the file
            assert [e for e in b.errors() if not re.search(r"net::ERR_\w+ \(https://fonts\.", e)] == []
    finally:
        server.terminate()
        server.wait(10)


def test_a_graphviz_layout_that_times_out_falls_back_to_the_built_in_one_and_says_what_happened(llama, monkeypatch,
                                                                                                 capsys):
    """A 48-layer GPT-2 ran Graphviz for 600 s before the built-in layout was used, with a hint to leave out
    --expand-all, which the run had not given: the layout is stopped after RENDER_TIMEOUT, and the message names
    the graph's size, the time and what to do."""
    p, _, after = llama
    seen = []

    def slow(cmd, **kw):
        seen.append(kw.get("timeout"))
        raise subprocess.TimeoutExpired(cmd, kw.get("timeout"))
    monkeypatch.setattr(viz.shutil, "which", lambda exe: "/usr/bin/dot")
    monkeypatch.setattr(viz.subprocess, "run", slow)
    with pytest.raises(viz.LayoutTimeout, match=r"graph of 2 nodes and 1 edges within 5 s"):
        viz.render('digraph {\n  "a" [label="a"];\n  "b" [label="b"];\n  "a" -> "b";\n}', timeout=5)
    kw = {"before_paths": hierarchy.module_paths(p.captured.graph_module)}
    d = viz.draw(p.graph_module, None, after, "llama after", **kw)
    assert seen[-1] == viz.RENDER_TIMEOUT <= 60
    assert d.layout == "built-in layout" and d.timed_out is not None and d.svg.startswith("<svg")
    assert "subgraph cluster_" in d.dot                  # the DOT keeps the clusters for dot -Tsvg without a limit
    dot, svg = viz.picture(p.graph_module, None, after, "llama after", **kw)
    err = capsys.readouterr().err
    assert f"within {viz.RENDER_TIMEOUT:g} s" in err and "built-in layout instead" in err and "dot -Tsvg" in err
    assert "expand_all" not in err                       # it was not given: no hint to leave it out
    viz.picture(p.graph_module, None, after, "llama after", expand_all=True, **kw)
    assert "without expand_all identical layers are folded" in capsys.readouterr().err


# ------------------------------------------------------------------------------ fusions that emit several calls

@pytest.fixture(scope="module")
def mixtral():
    # the experts block emits routing, two grouped GEMMs and the combine; the router returns weights and indices
    return _plan("mixtral", layers=1)


def test_every_call_a_fusion_emits_is_drawn_and_exported_as_the_fusions(mixtral):
    p, before, after = mixtral
    captured = {n.name for n in p.captured.graph_module.graph.nodes}
    launches = [n.name for n in p.graph_module.graph.nodes if n.op == "call_function" and n.name not in captured
                and n.name in after]
    assert any(n.startswith("grouped_matmul") for n in launches)
    dot = viz.graph_dot(p.graph_module, None, after, before_paths=hierarchy.module_paths(p.captured.graph_module),
                        expand_all=True)
    for name in launches:
        (line,) = [ln for ln in dot.splitlines() if ln.lstrip().startswith(f'"{name}" [')]
        assert "· fused " in line, line
        assert 'fillcolor="#dbe7f5"' not in line                # not the plain colour of an unfused op
        if after[name].part_of:
            assert f"priced with {after[name].part_of}" in line
    doc, data = _model_explorer(p, before, after)
    nodes = {n["id"]: {a["key"]: a["value"] for a in n["attrs"]} for n in doc["graphs"][0]["nodes"]}
    overlay = data["fused"]["fused"]["results"]
    for name in launches:
        assert "fused" in nodes[name] and overlay[name]["value"].startswith("fused ")


def test_model_explorer_edges_leave_the_output_they_read_and_every_output_is_declared(mixtral):
    p, before, after = mixtral
    doc, _ = _model_explorer(p, before, after)
    for graph in doc["graphs"]:
        nodes = {n["id"]: n for n in graph["nodes"]}
        for n in graph["nodes"]:
            attrs = {a["key"]: a["value"] for a in n["attrs"]}
            for e in n["incomingEdges"]:
                declared = {o["id"] for o in nodes[e["sourceNodeId"]]["outputsMetadata"]}
                assert e["sourceNodeOutputId"] in declared, (e, n["id"])
                if attrs["op"] == "getitem":                   # a tuple's item: the output it takes
                    assert e["sourceNodeOutputId"] == attrs["arg1"]
    fused = {n["id"]: n for n in doc["graphs"][0]["nodes"]}
    routing = next(n for k, n in fused.items() if k.startswith("moe_init_routing"))
    shapes = {o["id"]: o["attrs"][0]["value"] for o in routing["outputsMetadata"]}
    assert set(shapes) == {"0", "1", "2"} and shapes["2"].startswith("int64[")       # the per-expert counts
    attention = next(n for k, n in fused.items() if k.startswith("flash_attention"))
    assert attention["outputsMetadata"][0]["id"] == "0"
    assert attention["outputsMetadata"][0]["attrs"][0]["key"] == "tensor_shape"
