"""The ``autofuse`` command line: in-process through ``autofuse.cli.main([...])``, and in a subprocess where
exit codes and what reaches the terminal are the point."""
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from autofuse import cli
from autofuse.cli import main
from autofuse.models import ZOO, build

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--model", "gpt2", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "8"]
TINY_LLAMA = "transformers:LlamaConfig?num_hidden_layers=1&hidden_size=32&intermediate_size=64&num_attention_heads=2" \
             "&num_key_value_heads=1&vocab_size=64"


def _exit(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


def _run(*argv, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "autofuse.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_devices(capsys):
    main(["devices"])
    out = capsys.readouterr().out
    for name in ("ascend910", "ascend910b", "ascend310p"):
        assert name in out
    assert "cube cores" in out and "split" in out and "coupled" in out


def test_patterns(capsys):
    main(["patterns"])
    assert capsys.readouterr().out.startswith("attention: ")


@pytest.mark.parametrize("name,graphs,has", [("attention", 2, "softmax"), ("moe_gating", 4, "topk"),
                                             ("vector_chain", 5, "rsqrt"), ("rope", 3, "neg"),
                                             ("matmul_all_reduce", 1, "")])
def test_patterns_show_draws_a_familys_templates_or_a_regions_names(capsys, name, graphs, has):
    """A family's templates (one digraph each); a discovered family (vector_chain) shows the templates that
    name its regions, and a region name (rope: the half rotation, the per-half and the interleaved spellings)
    its own."""
    main(["patterns", "--show", name])
    out = capsys.readouterr().out
    assert out.count("digraph") == graphs and has in out


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz `dot` (apt-get install graphviz)")
def test_patterns_show_numbers_the_pictures_by_the_file_name_only(capsys, tmp_path):
    """rope has three templates: t.svg gives t-0.svg to t-2.svg, and a ".svg" elsewhere in the path stays (the
    directory x.svgdir was renamed, and dot failed)."""
    out = tmp_path / "x.svgdir" / "t.svg"
    main(["patterns", "--show", "rope", "-o", str(out)])
    assert sorted(p.name for p in out.parent.iterdir()) == ["t-0.svg", "t-1.svg", "t-2.svg"]


def test_patterns_show_names_the_choices(capsys):
    code, err = _exit(["patterns", "--show", "ropee"], capsys)
    assert code != 0 and "did you mean 'rope'?" in err and "rms_norm, rope, swiglu" in err


def test_report_text_json_markdown(capsys):
    main(["report", *TINY])
    out = capsys.readouterr().out
    assert out.startswith("autofuse plan for ascend910 at O3: ") and "vs eager op by op" in out \
        and "vs generic fusion alone" in out
    main(["report", *TINY, "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    (d,) = [d for d in doc["applied"] if d["pattern"] == "attention"]
    assert d["reason_code"] == "fused" and d["cycles_fused"] < d["cycles_unfused"]
    assert all(d["cycles_fused"] < d["cycles_unfused"] for d in doc["applied"])
    # not fused: candidates that overlap a block saving more (the attention's softmax, a layer norm inside a
    # matmul epilogue), never one that failed verification
    assert {r["reason_code"] for r in doc["rejected"]} <= {"conflict", "not_profitable", "unsupported"}
    main(["report", *TINY, "--format", "md", "--level", "O0"])
    out = capsys.readouterr().out
    assert out.startswith("# autofuse report: ascend910, O0") and "disabled_by_opt_level" in out


@pytest.mark.parametrize("train", [False, True], ids=["inference", "train"])
@pytest.mark.parametrize("name", list(ZOO))
def test_every_zoo_models_report_dumps_to_json(name, train, capsys):
    # a training plan's attention holds its dropout draw (a shape, a dtype): the JSON names the dtype
    sizes = ["--hidden", "32", "--heads", "2", "--seq", "8"] + (["--layers", "1"] if name != "mha" else [])
    main(["report", "--model", name, *sizes, "--format", "json"] + (["--train"] if train else []))
    doc = json.loads(capsys.readouterr().out)
    assert doc["training"] is train and doc["applied"]
    draws = [d["params"]["dropout_draw"] for d in doc["applied"] if d["params"].get("dropout_draw")]
    assert all(isinstance(shape, list) and dtype == "float32" for shape, dtype, _ in draws)
    assert (name, train) != ("gpt2", True) or draws


def test_simulate_world_gives_both_baselines(tmp_path, capsys):
    # the ranks also plan the model with the pattern families off and run that plan through the same world
    out = tmp_path / "world.json"
    main(["simulate", "--world-size", "2", "--model", "tp-block", "--hidden", "32", "--heads", "2", "--seq", "8",
          "--json", str(out)])
    first = capsys.readouterr().out.splitlines()[0]
    doc = json.loads(out.read_text())
    generic, eager = doc["baselines"]["generic fusion alone"], doc["baselines"]["eager op by op"]
    assert eager == doc["cycles_unfused"] and generic == doc["cycles_generic"] == max(
        r["cycles_generic"] for r in doc["ranks"])
    assert doc["cycles"] <= generic <= eager
    assert f"{eager:,} unfused, eager op by op" in first and f"{generic:,} with generic fusion alone" in first


def test_simulated_figures_are_named_as_the_reports_name_them_and_predictions_say_so(tmp_path, capsys):
    sim = tmp_path / "sim.json"
    main(["simulate", "--model", "mha", "--hidden", "32", "--heads", "2", "--seq", "8", "--json", str(sim)])
    main(["report", "--model", "mha", "--hidden", "32", "--heads", "2", "--seq", "8", "--simulate", "--format",
          "json", "-o", str(tmp_path / "r.json")])
    simulated = json.loads(sim.read_text())["simulated"]
    assert simulated == json.loads((tmp_path / "r.json").read_text())["simulated"]
    assert set(simulated) == {"eager op by op", "generic fusion alone", "fused"}
    main(["viz", "--model", "mha", "--hidden", "32", "--heads", "2", "--seq", "8", "--simulate", "-o",
          str(tmp_path / "viz")])
    before = (tmp_path / "viz" / "before.dot").read_text()
    assert "simulated on ascend910; blocks&#x27; N → M cyc: predicted" in before
    page = (tmp_path / "viz" / "report.html").read_text()
    assert "The cycles in the tables below are the cost model's predictions" in page


def test_report_html_with_simulation(tmp_path, capsys):
    path = tmp_path / "r.html"
    main(["report", *TINY, "--format", "html", "--simulate", "-o", str(path), "--device", "ascend910b"])
    page = path.read_text()
    assert page.startswith("<!doctype html>") and "ascend910b" in page
    assert "simulated: the NPU simulator ran every kernel" in page
    assert page.count("<svg") >= 3                          # roofline and both graphs


def test_report_simulate_text_quotes_the_simulated_speedup(capsys):
    main(["report", *TINY, "--simulate"])
    out = capsys.readouterr().out
    assert "simulated on ascend910: " in out and "x against eager op by op" in out
    assert "x against generic fusion alone (" in out           # both baselines, as every verdict is given


def test_report_markdown_with_simulate_carries_the_simulated_verdict(capsys):
    """``--format md --simulate`` says what the simulator measured, as text, JSON and HTML do: the predicted
    verdict, then the simulated one against both baselines."""
    main(["report", *TINY, "--format", "md", "--simulate"])
    out = capsys.readouterr().out
    assert "Whole graph (predicted): " in out
    (line,) = [x for x in out.splitlines() if x.startswith("Whole graph (simulated on ascend910): ")]
    assert "x vs eager op by op (" in line and "x vs generic fusion alone (" in line


@pytest.mark.parametrize("name,template", [("matmul+swiglu", "swiglu"), ("layer_norm", "rms_norm"),
                                           ("add_rms_norm", "rms_norm"), ("geglu", "swiglu")])
def test_patterns_show_draws_the_template_that_finds_a_reported_name(name, template, capsys):
    main(["patterns", "--show", name])
    out, err = capsys.readouterr()
    assert f"found by the {template} template" in err and f'digraph "{template}"' in out


def test_a_factory_models_mode_is_the_commands(tmp_path, capsys):
    # a factory's new module trains by default: without --train the command plans the inference graph, as for
    # the zoo's and transformers' models
    src = tmp_path / "drop.py"
    src.write_text("import torch\ndef make():\n    m = torch.nn.Sequential(torch.nn.Linear(16, 16), "
                   "torch.nn.Dropout(0.1), torch.nn.GELU())\n    return m, (torch.randn(4, 16),)\n")
    main(["report", "--model", f"{src}:make", "--format", "json"])
    assert json.loads(capsys.readouterr().out)["training"] is False
    main(["report", "--model", f"{src}:make", "--format", "json", "--train"])
    assert json.loads(capsys.readouterr().out)["training"] is True


def test_viz_writes_pictures_report_and_model_explorer_files(tmp_path, capsys):
    me = tmp_path / "me" / "graphs.json"
    main(["viz", *TINY, "-o", str(tmp_path), "--model-explorer", str(me)])
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"before.dot", "before.svg", "after.dot", "after.svg", "report.html", "me"}
    for name in ("before.svg", "after.svg"):
        ET.parse(tmp_path / name)                       # well-formed XML
    before, after = (tmp_path / "before.dot").read_text(), (tmp_path / "after.dot").read_text()
    assert before.startswith("digraph") and "softmax" in before and "softmax" not in after
    assert "flash_attention" in after and "attention · fused" in before
    assert json.loads(me.read_text())["graphs"][0]["id"] == "fused"
    assert sorted(p.name for p in me.parent.iterdir()) == [
        "graphs.bound.json", "graphs.cycles.json", "graphs.fused.json", "graphs.hbm_bytes.json", "graphs.json"]
    assert (tmp_path / "report.html").read_text().count("<svg") >= 3


def test_viz_without_graphviz_keeps_the_dot_files_and_says_so(tmp_path, capsys, monkeypatch):
    from autofuse import viz
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    main(["viz", *TINY, "-o", str(tmp_path)])
    err = capsys.readouterr().err
    assert "Graphviz `dot` is not installed" in err and "apt-get install graphviz" in err
    assert "subgraph cluster_" in (tmp_path / "before.dot").read_text()
    svg = ET.parse(tmp_path / "before.svg").getroot()          # the built-in layout, one rect per drawn node
    assert svg.findall("{http://www.w3.org/2000/svg}rect")


def test_viz_folds_identical_layers_unless_expand_all(tmp_path, capsys):
    # five layers: the first and the last differ from the middle ones (regions fused across layer boundaries)
    args = ["viz", "--model", "llama", "--layers", "5", "--hidden", "32", "--heads", "2", "--seq", "8"]
    main([*args, "-o", str(tmp_path / "folded")])
    main([*args, "-o", str(tmp_path / "all"), "--expand-all"])
    folded, full = ((tmp_path / d / "before.dot").read_text() for d in ("folded", "all"))
    assert "×2 identical to layers.1" in folded and "identical" not in full
    assert folded.count("attention · fused") == 3 and full.count("attention · fused") == 5
    # after fusion a down projection fused with the next layer's norm sits in that layer and folds with it
    folded, full = ((tmp_path / d / "after.dot").read_text() for d in ("folded", "all"))
    assert "×3 identical to layers.1" in folded and "identical" not in full
    assert folded.count("spans layers.") == 1 and full.count("spans layers.") == 4


def test_a_graphviz_layout_out_of_time_is_stopped_and_the_run_says_so(tmp_path, capsys, monkeypatch):
    """A 48-layer GPT-2 spent 600 s in Graphviz, then said "without --expand-all, identical layers are drawn
    once" to a run without --expand-all, and the -v stage line still said "draw 600.56 s Graphviz"."""
    from autofuse import viz
    run, seen = subprocess.run, []

    def dot_runs_out_of_time(cmd, *args, **kw):
        if os.path.basename(str(cmd[0])) != "dot":
            return run(cmd, *args, **kw)
        seen.append(kw.get("timeout"))
        raise subprocess.TimeoutExpired(cmd, kw.get("timeout"))
    monkeypatch.setattr(viz.shutil, "which", lambda exe: "/usr/bin/dot")
    monkeypatch.setattr(viz.subprocess, "run", dot_runs_out_of_time)
    main(["viz", *TINY, "-o", str(tmp_path), "-v"])
    err = capsys.readouterr().err
    assert seen == [viz.RENDER_TIMEOUT] * 2
    for key in ("before", "after"):
        assert f"the {key} graph: Graphviz did not finish laying out a graph of " in err
        assert f"render {tmp_path / (key + '.dot')} with `dot -Tsvg`" in err
        assert "subgraph cluster_" in (tmp_path / f"{key}.dot").read_text()
    assert "expand-all" not in err
    stage = next(line for line in err.splitlines() if line.startswith("autofuse: draw"))
    assert stage.endswith(f"built-in layout (Graphviz stopped after {viz.RENDER_TIMEOUT:g} s)")


def test_simulate(capsys, tmp_path):
    path = tmp_path / "sim.json"
    main(["simulate", *TINY, "--json", str(path)])
    out = capsys.readouterr().out
    assert "unfused: simulated on ascend910" in out and "[fused]" in out
    speedup = float(out.split("speed-up (simulated, ascend910): ")[1].split("x")[0])
    doc = json.loads(path.read_text())
    assert speedup == pytest.approx(doc["unfused"]["cycles"] / doc["fused"]["cycles"], rel=1e-2)  # printed to 2 d.p.
    assert doc["fused"]["cycles"] < doc["unfused"]["cycles"]


# ------------------------------------------------------------------------------ model specs

def test_model_from_a_file(tmp_path, capsys):
    src = tmp_path / "mymodel.py"
    src.write_text("import torch\nfrom autofuse.models import MHABlock\n"
                   "def make():\n    return MHABlock(32, 4).eval(), (torch.randn(1, 16, 32),)\n")
    main(["report", "--model", f"{src}:make", "--format", "json"])
    assert len(json.loads(capsys.readouterr().out)["applied"]) == 1


MARKUP = "<img src=x onerror=console.error(`INJECTED`)>"


def test_the_html_report_shows_only_pictures_and_escapes_the_model_path(tmp_path, capsys):
    # the model path is the page's title and the pictures' title; the DOT texts are viz's files, not the page's
    where = tmp_path / MARKUP
    where.mkdir()
    (where / "m.py").write_text("import torch\nfrom autofuse.models import MHABlock\n"
                                "def make():\n    return MHABlock(32, 4).eval(), (torch.randn(1, 16, 32),)\n")
    page_path = tmp_path / "r.html"
    main(["report", "--model", f"{where}/m.py:make", "--format", "html", "-o", str(page_path)])
    page = page_path.read_text()
    assert "digraph" not in page and "dot:" not in page and "<img" not in page
    assert page.count("&lt;img src=x") >= 2                  # the page's title and the pictures' captions
    out = tmp_path / "viz"
    main(["viz", "--model", f"{where}/m.py:make", "-o", str(out)])
    for name in ("before.dot", "after.dot"):
        dot = (out / name).read_text()
        # a quoted DOT string for the graph's name, an escaped HTML-like label for its caption
        assert dot.startswith('digraph "') and "label=<<B>" in dot and "&lt;img src=x" in dot
    from browser import CHROMIUM, Browser
    if CHROMIUM is None:
        return
    with Browser() as b:
        b.open(page_path.as_uri())
        assert b.errors() == [] and b.eval("document.querySelectorAll('img, script[src]').length") == 0


def test_model_from_a_module(tmp_path, capsys, monkeypatch):
    (tmp_path / "zoo_of_mine.py").write_text(
        "import torch\nfrom autofuse.models import MHABlock\n"
        "def block():\n    return MHABlock(32, 4).eval(), (torch.randn(1, 16, 32),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    main(["report", "--model", "zoo_of_mine:block", "--format", "json"])
    assert len(json.loads(capsys.readouterr().out)["applied"]) == 1


def test_model_from_a_transformers_config(capsys):
    main(["report", "--model", TINY_LLAMA, "--seq", "8", "--batch", "1", "--format", "json"])
    applied = json.loads(capsys.readouterr().out)["applied"]
    assert [d["pattern"] for d in applied].count("attention") == 1
    assert {"rope", "matmul+swiglu"} <= {d["pattern"] for d in applied}


TINY_SWITCH = "transformers:SwitchTransformersConfig?num_layers=1&num_decoder_layers=1&d_model=32&d_kv=8&d_ff=64" \
              "&num_heads=4&num_experts=2"


def test_a_transformers_model_that_builds_its_mask_only_outside_compilation_is_given_eagers(capsys):
    """SwitchTransformers (and LongT5) make their default attention mask of ones only when not compiling, so the
    CLI's inputs (token ids alone) could not be captured: the CLI now gives the mask eager would build, and says
    so. A model that captures without a mask is not given one."""
    main(["report", "-v", "--model", TINY_SWITCH, "--seq", "8", "--batch", "1", "--format", "json"])
    out = capsys.readouterr()
    assert [d["pattern"] for d in json.loads(out.out)["applied"]].count("attention") == 3
    assert "attention mask" in out.err and "given as eager builds it" in out.err
    main(["report", "-v", "--model", TINY_LLAMA, "--seq", "8", "--batch", "1", "--format", "json"])
    assert "attention mask" not in capsys.readouterr().err


def test_transformers_spec_values_and_defaults():
    from autofuse.models import parse_transformers_spec
    assert parse_transformers_spec("transformers:X?a=2&b=1e-5&c=true&d=None&e=gelu&f=False") == (
        "X", {"a": 2, "b": 1e-5, "c": True, "d": None, "e": "gelu", "f": False})
    # lists (Swin's depths and heads per stage)
    assert parse_transformers_spec("transformers:X?depths=[2,2,6]&w=[]&m=[1.5, true,x]") == (
        "X", {"depths": [2, 2, 6], "w": [], "m": [1.5, True, "x"]})
    # lists of strings (layer types), bare or as JSON; JSON objects (a nested config); a quoted string
    assert parse_transformers_spec('transformers:X?l=[full_attention,sliding_attention]&j=["a","b"]'
                                   '&o={"moe_num_experts":4,"r":{"t":1.5}}&q="7"') == (
        "X", {"l": ["full_attention", "sliding_attention"], "j": ["a", "b"],
              "o": {"moe_num_experts": 4, "r": {"t": 1.5}}, "q": "7"})
    swin, _ = build("transformers:SwinConfig?depths=[1,1]&num_heads=[2,4]&embed_dim=16&image_size=32&patch_size=4"
                    "&window_size=4", meta=True, batch=1)
    assert list(swin.config.depths) == [1, 1] and list(swin.config.num_heads) == [2, 4]
    model, (args, kwargs) = build("transformers:LlamaConfig", meta=True, seq=4, batch=1)
    cfg = model.config
    # no keys: LlamaConfig's own defaults (Llama-7B), on meta tensors
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.use_cache) == (32, 4096, False)
    assert type(model).__name__ == "LlamaForCausalLM" and next(model.parameters()).is_meta
    assert kwargs["input_ids"].shape == (1, 4) and kwargs["use_cache"] is False
    enc, (_, kw) = build("transformers:BertConfig?num_hidden_layers=1&hidden_size=32&num_attention_heads=2"
                         "&intermediate_size=64", meta=True)
    assert type(enc).__name__ == "BertModel"
    s2s, (_, kw) = build("transformers:T5Config?num_layers=1&d_model=32&d_ff=64&num_heads=2&d_kv=16", meta=True)
    assert type(s2s).__name__ == "T5ForConditionalGeneration" and "decoder_input_ids" in kw
    # a special token id the configuration class does not list (T5's generate needs decoder_start_token_id)
    s2s, _ = build("transformers:T5Config?num_layers=1&d_model=32&d_ff=64&num_heads=2&d_kv=16"
                   "&decoder_start_token_id=0", meta=True)
    assert s2s.config.decoder_start_token_id == 0
    # a speech encoder-decoder is built whole, its encoder reading audio features (not its causal LM, the decoder)
    speech, (_, kw) = build("transformers:WhisperConfig?encoder_layers=1&decoder_layers=1&d_model=32"
                            "&encoder_attention_heads=2&decoder_attention_heads=2&encoder_ffn_dim=64"
                            "&decoder_ffn_dim=64&num_mel_bins=16&max_source_positions=8&vocab_size=128&pad_token_id=0"
                            "&bos_token_id=1&eos_token_id=2&decoder_start_token_id=1", batch=2)
    assert type(speech).__name__ == "WhisperForConditionalGeneration"
    assert kw["input_features"].shape == (2, 16, 16) and "decoder_input_ids" in kw
    with torch.no_grad():
        assert speech(**kw).logits.shape == (*kw["decoder_input_ids"].shape, 128)
    # a two-tower model takes its images too, sized by its vision config (the report failed in capture without them)
    tower = '{"num_hidden_layers":1,"hidden_size":32,"intermediate_size":64,"num_attention_heads":2'
    clip, (_, kw) = build(f"transformers:CLIPConfig?text_config={tower}}}&vision_config={tower},\"image_size\":32,"
                          f"\"patch_size\":8}}", batch=2, seq=5)
    assert kw["input_ids"].shape == (2, 5) and kw["pixel_values"].shape == (2, 3, 32, 32)
    with torch.no_grad():
        assert clip(**kw).logits_per_image.shape == (2, 2)
    # a model whose images stand in for image tokens of its text (LLaVA) gets text alone: its images need tokens
    text = ('{"model_type":"llama","num_hidden_layers":1,"hidden_size":32,"intermediate_size":64,'
            '"num_attention_heads":2,"num_key_value_heads":2,"vocab_size":128}')
    llava, (_, kw) = build(f'transformers:LlavaConfig?vision_config={{"model_type":"clip_vision_model",{tower[1:]},'
                           f'"image_size":32,"patch_size":8}}&text_config={text}&image_token_index=127', meta=True)
    assert "pixel_values" not in kw and "input_ids" in kw


# ------------------------------------------------------------------------------ errors: one line, exit 2 or 1

@pytest.mark.parametrize("argv,needle", [
    (["report", "--model", "gpt5"], "unknown model 'gpt5' (did you mean 'gpt2'?)"),
    (["report", "--model", "transformers:LlamaConfg"], "no configuration class 'LlamaConfg' (did you mean "
                                                        "'LlamaConfig'?)"),
    (["report", "--model", "transformers:LlamaConfig?num_layers=2"], "LlamaConfig has no key 'num_layers' "
                                                                      "(did you mean 'num_hidden_layers'?)"),
    (["report", "--model", "transformers:LlamaConfig", "--layers", "2"], "?num_hidden_layers=2"),
    (["report", "--model", "transformers:Qwen2Config?layer_types=[bogus]"], "is not a valid configuration: "),
    (["report", "--model", "missing/model.py:make"], "model file 'missing/model.py' does not exist"),
    (["report", "--model", "autofuse.models:nope"], "has no function 'nope'"),
    (["report", "--model", "autofuse.models:parse_value"], "must be callable without arguments"),
    (["report", "--model", "autofuse.models:MHABlock"], "must be callable without arguments"),
    (["report", *TINY, "--device", "tpu"], "--device 'tpu' is not a device: choose one of"),
    (["report", *TINY, "--budget", "lots"], "--budget 'lots': write a number and a unit"),
    (["report", *TINY, "--level", "O5"], "--level 'O5': choose one of O0, O1, O2, O3"),
    (["report", *TINY, "--disable", "attn"], "--disable 'attn' is not a pattern family"),
    (["report", *TINY, "--seq", "many"], "argument --seq: 'many' is not a whole number"),
    # sizes: positive, fitting together, and only where they apply (never replaced by a default without a word)
    (["report", *TINY, "--seq", "0"], "argument --seq: 0 is not a size: give 1 or more"),
    (["report", *TINY, "--heads", "-2"], "argument --heads: -2 is not a size"),
    (["report", "--model", "llama", "--heads", "4", "--kv-heads", "3"], "--heads 4 is not a multiple of --kv-heads 3"),
    (["report", "--model", "gpt2", "--hidden", "64", "--heads", "5"], "--hidden 64 is not a multiple of --heads 5"),
    (["report", "--model", "gpt2", "--kv-heads", "1"], "--kv-heads does not apply to gpt2"),
    (["report", "--model", "mha", "--layers", "3"], "--layers does not apply to mha"),
    (["simulate", "--model", "tp-block", "--world-size", "2", "--train"], "--train does not apply with --world-size"),
    (["simulate", "--model", "tp-block", "--world-size", "2", "--heads", "3"], "--heads must be a multiple of "
                                                                                 "--world-size"),
    (["simulate", *TINY, "--top", "-1"], "argument --top: -1: give 0 or more"),
    (["report", *TINY, "--budget", "0.5B"], "--budget '0.5B': it must be at least one byte"),
    (["report", *TINY, "--budget", "-1GB"], "--budget '-1GB': it must be at least one byte"),   # not a flag
    (["report", "--model", "gpt2", "--hidden", str(10 ** 20)], "is too large: give less than 2**31"),
    ([], "the following arguments are required: COMMAND"),
    (["report", *TINY, "--device", "tpu"], "--device 'tpu' is not a device: choose one of"),
    (["simulate", *TINY, "--meta"], "simulation needs data: drop --meta"),
    (["report"], "the following arguments are required: --model"),
    (["report", *TINY, "--bogus", "1"], "autofuse report: unrecognized arguments: --bogus 1 (see `autofuse report "
                                        "--help`)"),
    (["report", *TINY, "--budget", "1e400GB"], "is not a finite number of bytes"),
    # a budget without a unit would be bytes: 16 bytes fuse nothing, and the run said nothing of a missing unit
    (["report", *TINY, "--budget", "16"], "--budget '16' has no unit: did you mean '16GB'? (GB and GiB are 2**30 "
                                          "bytes"),
    (["report", *TINY, "--budget", "0.5"], "--budget '0.5' has no unit: did you mean '0.5GB'?"),
    (["report", *TINY, "--budget", "1.9B"], "bytes are whole"),
    (["simulate", "--model", "tp-block"], "simulate it with --world-size N, N of 2 or more"),
])
def test_usage_errors_print_one_line_and_exit_2(argv, needle, capsys):
    code, err = _exit(argv, capsys)
    assert code == 2 and needle in err
    assert err.count("\n") == 1 and err.startswith("autofuse")


@pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz")
def test_a_picture_that_cannot_be_written_says_so_in_one_line(tmp_path, capsys):
    (tmp_path / "t-0.svg").mkdir()            # a directory where dot would write the first picture
    code, err = _exit(["patterns", "--show", "attention", "-o", str(tmp_path / "t.svg")], capsys)
    assert code == 1 and f"could not write {tmp_path / 't-0.svg'}: Graphviz `dot` failed" in err, err
    assert "Traceback" not in err


def test_device_names_take_the_forms_fuse_takes(capsys):
    """`--device ASCEND910B` and `--device 910b` were refused although fuse(target_device=...) takes both."""
    for name in ("ASCEND910B", "910b"):
        main(["report", *TINY, "--device", name])
        assert capsys.readouterr().out.startswith("autofuse plan for ascend910b at O3")


def test_a_file_model_returning_the_wrong_thing_says_what_it_returned(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text("import torch\ndef make():\n    m = torch.nn.Linear(4, 4)\n    return m, torch.randn(2, 4), 3\n")
    code, err = _exit(["report", "--model", f"{src}:make"], capsys)
    assert code == 2 and "it returned a tuple of 3 item(s): Linear, Tensor, int" in err, err


def test_output_into_a_closed_pipe_ends_quietly():
    """`autofuse devices | head -1`: the reader is gone before the command writes (closed here before the child
    has imported torch); it exits without a traceback (a BrokenPipeError traceback was printed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "autofuse.cli", "devices"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_rank_builder_without_rank_and_world_size_is_a_usage_error(tmp_path, capsys):
    """Every rank printed its traceback and the command exited 1."""
    src = tmp_path / "builders.py"
    src.write_text("import torch\n\ndef make():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    code, err = _exit(["simulate", "--model", f"{src}:make", "--world-size", "2"], capsys)
    assert code == 2 and "must take (rank, world_size) and return (module, example_args)" in err
    assert err.count("\n") == 1


def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for argv, needle in ((["report", *TINY, "-o", str(tmp_path)], "is a directory: give a file name"),
                         (["viz", *TINY, "-o", str(tmp_path / "file")], "a file is there; viz writes a directory"),
                         (["report", *TINY, "-o", str(tmp_path / "file" / "r.txt")], "is not a writable directory"),
                         # /proc takes no new entries, whatever its permission bits say (to root too)
                         (["report", *TINY, "-o", "/proc/autofuse/r.txt"], "(/proc is not a writable directory)"),
                         (["simulate", *TINY, "--json", "/proc/autofuse/s.json"], "is not a writable directory")):
        code, err = _exit(argv, capsys)
        assert code == 2 and needle in err and err.count("\n") == 1, err
        assert "building the model" not in err


def test_a_forward_that_raises_on_its_inputs_is_named_as_such(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text("import torch\ndef make():\n    return torch.nn.Linear(16, 16), (torch.randn(4, 7),)\n")
    code, err = _exit(["report", "--model", f"{src}:make"], capsys)
    assert code == 1 and "every route failed with the same error, which the forward raises" in err, err


def test_a_function_returning_something_else_is_a_usage_error(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text("def make():\n    return 42\n")
    code, err = _exit(["report", "--model", f"{src}:make"], capsys)
    assert code == 2 and "must return (model, example_inputs)" in err and "returned int" in err


BRANCHY = ("import torch\nclass Branchy(torch.nn.Module):\n    def forward(self, x):\n"
           "        return x * 2 if x.sum() > 0 else x - 1\n"
           "def make():\n    return Branchy(), (torch.randn(3),)\n")


def test_a_model_that_cannot_be_captured_exits_1_with_its_reason_and_no_traceback(tmp_path, capsys):
    src = tmp_path / "branchy.py"
    src.write_text(BRANCHY)
    r = _run("report", "--model", f"{src}:make")         # a fresh process: all that reaches the user's terminal
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith(f"autofuse report: could not fuse {src}:make: could not capture Branchy:")
    assert "hint:" in r.stderr and "Traceback" not in r.stderr and "def forward" not in r.stderr
    code, err = _exit(["report", "--model", f"{src}:make", "-v"], capsys)      # -v adds the traceback
    assert code == 1 and "Traceback (most recent call last)" in err


def test_a_builder_that_raises_exits_1_with_its_error(tmp_path, capsys):
    src = tmp_path / "raising.py"
    src.write_text("def make():\n    raise RuntimeError('no weights here')\n")
    code, err = _exit(["report", "--model", f"{src}:make"], capsys)
    assert code == 1 and err == f"autofuse report: could not build {src}:make: RuntimeError: no weights here\n"


def test_usage_error_in_a_subprocess_exits_2_before_building_anything():
    r = _run("report", "--model", "gpt2", "--device", "npu9000")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1


def test_a_normal_run_prints_no_library_warnings_and_v_shows_every_stage():
    quiet = _run("report", *TINY)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    loud = _run("report", *TINY, "-v", "--simulate")
    assert loud.returncode == 0
    stages = [ln.split()[1] for ln in loud.stderr.splitlines() if ln.startswith("autofuse: ")]
    # --simulate: eager op by op, generic fusion alone, fused
    assert stages == ["build", "capture", "canonicalize", "match", "plan", "rewrite", "simulate", "simulate",
                      "simulate"]
    assert "of which verify" in loud.stderr and "LeafSpec" not in loud.stderr


# ------------------------------------------------------------------------------ progress on a terminal

class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_simulation_shows_a_progress_bar_on_a_terminal_only():
    from autofuse.simulate import simulate_graph
    model, (args, kwargs) = build("gpt2", layers=1, hidden=32, heads=2, seq=8)
    import autofuse
    p = next(iter(autofuse.AutoFusionEngine.fuse(model, (args, kwargs)).plans.values()))
    leaves = p.captured.flatten_inputs(*args, **kwargs)
    for stream, shown in ((_Terminal(), True), (io.StringIO(), False)):
        progress = cli.Progress(False, stream)
        with cli.simulation_progress(progress, "simulate"):
            simulate_graph(p.graph_module, leaves)
        text = stream.getvalue()
        assert ("\r" in text and f"/{len(p.graph_module.graph.nodes)}" in text) == shown
        assert text.endswith("\r\x1b[K") == shown            # the bar is cleared at the end


# ------------------------------------------------------------------------------ fusion switches

def test_fusion_switches_reach_the_engine(capsys, monkeypatch):
    import autofuse
    seen = {}
    real = autofuse.AutoFusionEngine.fuse

    def fuse(model, example_inputs=None, target_device="ascend910", optimization_level="O3", memory_budget=None,
             *, fusion_switches=None, **kw):
        seen.update(fusion_switches)
        return real(model, example_inputs, target_device, optimization_level, memory_budget, **kw)

    monkeypatch.setattr(autofuse.AutoFusionEngine, "fuse", staticmethod(fuse))
    main(["report", *TINY, "--disable", "attention"])
    assert seen == {"attention": "off"}
    seen.clear()
    main(["report", *TINY, "--force", "attention"])
    assert seen == {"attention": "force"}
    code, err = _exit(["report", *TINY, "--disable", "attention", "--force", "attention"], capsys)
    assert code == 2 and "switched both 'off' and 'force'" in err


def test_train_plans_the_training_graph_and_says_so(capsys):
    main(["report", *TINY, "--train"])
    out = capsys.readouterr().out
    assert "planned for training mode" in out
    (line,) = [x for x in out.splitlines() if "FUSED attention" in x]
    assert "dropout p=0.1 on the probabilities, eager's keep-mask drawn by dropout_gen_mask" in line
    main(["report", *TINY])
    assert "training mode" not in capsys.readouterr().out
