"""The examples run as scripts (``runpy`` with ``__name__ == "__main__"``, small settings through their flags)
and do what they say: every attention block fused, fused output equal to eager, fused faster on the simulator."""
import os
import pathlib
import re
import runpy
import sys

import pytest


EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(name, argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


def _fused_blocks(out, **want):
    """The plan printed in ``out`` fuses exactly ``want[family]`` blocks of each named family and keeps none of
    them; the other candidates it lists (softmax, Vector chains, epilogues) are fused or kept for a reason other
    than a failed verification."""
    for family, n in want.items():
        assert len(re.findall(rf"FUSED {family} ", out)) == n, out
        assert not re.search(rf"kept  {family} ", out), out
    assert "verification_failed" not in out and "FUSED softmax" not in out, out


def test_gpt_small(monkeypatch, capsys):
    out = _run("gpt_small.py", ["--layers", "2", "--seq", "32", "--dim", "64", "--heads", "4"], monkeypatch, capsys)
    _fused_blocks(out, attention=2)
    err = float(re.search(r"max \|fused - eager\| logits = (\S+)", out).group(1))
    assert err < 1e-4
    m = re.search(r"simulated whole model on ascend910: ([\d,]+) -> ([\d,]+) cycles", out)
    assert int(m.group(2).replace(",", "")) < int(m.group(1).replace(",", ""))


def test_mha_layer(monkeypatch, capsys):
    out = _run("mha_layer.py", ["--seq", "64", "--dim", "64", "--heads", "4"], monkeypatch, capsys)
    assert "plan for ascend910b at O3: " in out
    _fused_blocks(out, attention=1)
    assert float(re.search(r"max \|fused - eager\| = (\S+)", out).group(1)) < 1e-4
    m = re.search(r"simulated on ascend910b: ([\d,]+) -> ([\d,]+) cycles", out)
    assert int(m.group(2).replace(",", "")) < int(m.group(1).replace(",", ""))


def test_fused_attention_function(monkeypatch, capsys):
    out = _run("fused_attention_function.py", ["--seq", "64", "--heads", "2", "--dim", "32"], monkeypatch, capsys)
    _fused_blocks(out, attention=1)
    m = re.search(r"output (\S+), probabilities (\S+)", out)
    assert float(m.group(1)) < 1e-2 and float(m.group(2)) < 1e-2      # float16 model: one fp16 rounding apart
    m = re.search(r"([\d,]+) cycles unfused -> ([\d,]+) fused", out)
    assert int(m.group(2).replace(",", "")) < int(m.group(1).replace(",", ""))


@pytest.mark.slow
def test_tensor_parallel_under_torchrun():
    """The torchrun example on 2 ranks (gloo, loopback): AutoFusionEngine.fuse on each rank fuses both
    row-parallel pairs; the output is as close to the float64 single-device block as the unfused
    tensor-parallel model (fp32: within twice its error)."""
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent)}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(port), str(EXAMPLES / "tensor_parallel.py"), "--hidden", "64", "--seq", "16"],
                         capture_output=True, text=True, env=env, timeout=600).stdout
    assert out.count("fused matmul_all_reduce") == 2 and out.count("[fused]") == 2, out
    m = re.search(r"fused (\S+), unfused tensor-parallel (\S+)", out)
    assert float(m.group(1)) <= 2 * float(m.group(2)) + 1e-6


def test_moe(monkeypatch, capsys):
    out = _run("moe.py", ["--layers", "1", "--hidden", "32", "--intermediate", "48", "--tokens", "16"], monkeypatch,
               capsys)
    _fused_blocks(out, attention=1, moe_gating=1, moe_experts=1)
    assert float(re.search(r"max \|fused - eager\| logits = (\S+)", out).group(1)) < 1e-4
    m = re.search(r"simulated MoE blocks on ascend910: ([\d,]+) -> ([\d,]+) cycles", out)
    assert int(m.group(2).replace(",", "")) < int(m.group(1).replace(",", ""))


def test_train_gpt_small(monkeypatch, capsys):
    """Training with attention dropout: both attention blocks fused with their dropout; the losses follow eager's."""
    out = _run("train_gpt_small.py", ["--steps", "3", "--seq", "32", "--dim", "64"], monkeypatch, capsys)
    _fused_blocks(out, attention=2)
    assert len(re.findall(r"FUSED attention .*dropout p=0\.1 on the probabilities", out)) == 2, out
    worst = float(re.search(r"max \|loss difference\| = (\S+),", out).group(1))
    assert worst < 1e-4            # fp32 both sides, the same keep-masks: a few roundings of each loss
    # the simulated training step: both sides, each with a forward and a backward phase
    steps = re.findall(r"(eager op by op|fused) +([\d,]+) cycles \(forward ([\d,]+), backward ([\d,]+)\)", out)
    assert [s[0] for s in steps] == ["eager op by op", "fused"], out
    for _, total, fwd, bwd in steps:
        total, fwd, bwd = (int(x.replace(",", "")) for x in (total, fwd, bwd))
        assert fwd > 0 and bwd > 0 and total == fwd + bwd
    assert re.search(r"speed-up of the training step: [\d.]+x", out)


@pytest.mark.parametrize("cache, n", [("dynamic", 3), ("static", 2)])
def test_generate(monkeypatch, capsys, cache, n):
    out = _run("generate.py", ["--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--prompt", "8",
                               "--new-tokens", "3", "--cache", cache], monkeypatch, capsys)
    assert "the same as eager" in out, out
    plans = re.findall(r"plan \d+: \d+ fused \(([^)]*)\)", out)
    # the prefill, then two decode steps (dynamic: a length each) or one signature for both (static)
    assert len(plans) == n and all("attention" in p for p in plans), out
    m = re.search(r"simulated decode step on ascend910 .*: ([\d,]+) -> ([\d,]+) cycles", out)
    assert int(m.group(2).replace(",", "")) < int(m.group(1).replace(",", ""))


def test_moe_layer(monkeypatch, capsys):
    out = _run("moe_layer.py", ["--hidden", "32", "--intermediate", "48", "--experts", "4", "--tokens", "16"],
               monkeypatch, capsys)
    _fused_blocks(out, moe_gating=1, moe_experts=1)
    assert float(re.search(r"max \|fused - eager\| = (\S+)", out).group(1)) < 1e-5       # fp32, one block
    m = re.search(r"simulated on ascend910: ([\d,]+) -> ([\d,]+) cycles", out)
    assert int(m.group(2).replace(",", "")) < int(m.group(1).replace(",", ""))
    # fp32 sums in another order: a few units in the last place of the largest gradient, far below 1e-4
    assert float(re.search(r"worst parameter gradient (\S+) of its largest", out).group(1)) < 1e-4
