"""The ``autofuse`` command line, called in-process through ``autofuse.cli.main([...])``."""
import json
import xml.etree.ElementTree as ET

import pytest

from autofuse.cli import main

TINY = ["--model", "gpt2", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "8"]


def test_devices(capsys):
    main(["devices"])
    out = capsys.readouterr().out
    for name in ("ascend910", "ascend910b", "ascend310p"):
        assert name in out
    assert "cube cores" in out and "split" in out and "coupled" in out


def test_patterns(capsys):
    main(["patterns"])
    assert capsys.readouterr().out.startswith("attention: ")


def test_report_text(capsys):
    main(["report", *TINY])
    out = capsys.readouterr().out
    assert "autofuse plan for ascend910 at O3: 1 fused, 0 not fused" in out and "FUSED" in out


def test_report_json(capsys):
    main(["report", *TINY, "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["device"] == "ascend910" and doc["optimization_level"] == "O3"
    (d,) = doc["applied"]
    assert d["reason_code"] == "fused" and d["cycles_fused"] < d["cycles_unfused"] and d["tiling"]
    assert doc["rejected"] == []


def test_report_markdown_and_level(capsys):
    main(["report", *TINY, "--format", "md", "--level", "O0"])
    out = capsys.readouterr().out
    assert out.startswith("# autofuse report: ascend910, O0") and "| kept | attention |" in out
    assert "disabled_by_opt_level" in out


def test_report_html_to_file(tmp_path):
    path = tmp_path / "r.html"
    main(["report", *TINY, "--format", "html", "-o", str(path), "--device", "ascend910b"])
    text = path.read_text()
    assert text.startswith("<!doctype html>") and "ascend910b" in text and text.count("<svg") == 2


def test_viz_writes_graphs_and_report(tmp_path):
    main(["viz", *TINY, "-o", str(tmp_path)])
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"before.dot", "before.svg", "after.dot", "after.svg", "report.html"}
    for name in ("before.svg", "after.svg"):
        ET.parse(tmp_path / name)                       # well-formed XML
    before, after = (tmp_path / "before.dot").read_text(), (tmp_path / "after.dot").read_text()
    assert before.startswith("digraph") and "softmax" in before and "softmax" not in after
    assert "flash_attention" in after


def test_simulate(capsys, tmp_path):
    path = tmp_path / "sim.json"
    main(["simulate", *TINY, "--json", str(path)])
    out = capsys.readouterr().out
    assert "unfused: simulated on ascend910" in out and "[fused]" in out
    speedup = float(out.split("speed-up (simulated, ascend910): ")[1].split("x")[0])
    doc = json.loads(path.read_text())
    assert speedup == pytest.approx(doc["unfused"]["cycles"] / doc["fused"]["cycles"], rel=1e-2)
    assert doc["fused"]["cycles"] < doc["unfused"]["cycles"]


def test_model_from_a_file(tmp_path, capsys):
    src = tmp_path / "mymodel.py"
    src.write_text(
        "import torch\n"
        "from autofuse.models import MHABlock\n"
        "def make():\n"
        "    return MHABlock(32, 4).eval(), (torch.randn(1, 16, 32),)\n")
    main(["report", "--model", f"{src}:make", "--format", "json"])
    assert len(json.loads(capsys.readouterr().out)["applied"]) == 1


@pytest.mark.parametrize("argv,needle", [
    (["report", "--model", "gpt5"], "unknown model 'gpt5'"),
    (["report", *TINY, "--device", "tpu"], "target_device='tpu'"),
    (["report", *TINY, "--budget", "lots"], "memory_budget='lots'"),
    (["simulate", *TINY, "--meta"], "simulate needs data"),
])
def test_errors_exit_with_a_message(argv, needle):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert needle in str(e.value)
