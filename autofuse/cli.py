"""``autofuse`` command line: fusion reports, pictures, simulation, devices, patterns.

    autofuse devices
    autofuse patterns
    autofuse report   --model gpt2 --layers 2 --device ascend910 --level O3 [--format text|md|json|html] [-o FILE]
    autofuse viz      --model llama -o out/            (before.dot/.svg, after.dot/.svg, report.html)
    autofuse simulate --model gpt2 --seq 128 [--trace out/trace.json]

``--model`` is a zoo name (see ``autofuse report --help``) or ``path/to/file.py:function`` /
``package.module:function`` returning ``(model, example_inputs)``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _model_args(p):
    from autofuse.models import ZOO
    p.add_argument("--model", required=True,
                   help="zoo name (" + ", ".join(ZOO) + ") or file.py:function returning (model, example_inputs)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--attn", default="eager", choices=["eager", "sdpa"], help="transformers attention implementation")
    p.add_argument("--meta", action="store_true", help="plan on meta tensors (no data; verification on random data)")
    p.add_argument("--device", default="ascend910")
    p.add_argument("--level", default="O3", choices=["O0", "O1", "O2", "O3"])
    p.add_argument("--budget", default=None, help="memory budget, e.g. 16GB")


def _build(a):
    from autofuse.models import build
    return build(a.model, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, seq=a.seq,
                 batch=a.batch, dtype=DTYPES[a.dtype], meta=a.meta, attn=a.attn)


def _fuse(a):
    from autofuse import AutoFusionEngine
    model, inputs = _build(a)
    fused = AutoFusionEngine.fuse(model, inputs, target_device=a.device, optimization_level=a.level,
                                  memory_budget=a.budget)
    return model, inputs, fused


def _write(text: str, path):
    if path in (None, "-"):
        sys.stdout.write(text)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")


def cmd_devices(a):
    from cost_model.devices import DEVICES
    print(f"{'device':<12}{'arch':<9}{'cube cores':>11}{'vec cores':>10}{'GHz':>6}{'fp16 TFLOPS':>13}"
          f"{'HBM GB/s':>10}{'L2 MB':>7}{'UB KB':>7}{'L1 KB':>7}")
    for d in DEVICES.values():
        print(f"{d.name:<12}{d.arch:<9}{d.cube_cores:>11}{d.vector_cores:>10}{d.clock_hz / 1e9:>6.2f}"
              f"{d.cube_peak_flops() / 1e12:>13.1f}{d.hbm_bytes_per_cycle * d.clock_hz / 1e9:>10.0f}"
              f"{d.l2_bytes >> 20:>7}{d.buffers['UB'] >> 10:>7}{d.buffers['L1'] >> 10:>7}")


def cmd_patterns(a):
    from autofuse.match import families
    for name, fn in families().items():
        doc = (sys.modules[fn.__module__].__doc__ or "").strip().splitlines()
        print(f"{name}: {doc[0] if doc else ''}")


def cmd_report(a):
    _, _, fused = _fuse(a)
    r = fused.report
    if a.format == "json":
        text = r.to_json() + "\n"
    elif a.format == "md":
        text = r.to_markdown()
    elif a.format == "html":
        from autofuse.viz import report_html
        p = fused.plans[next(iter(fused.plans))]
        text = report_html(r, p.captured.graph_module, p.graph_module)
    else:
        text = r.summary() + "\n"
    _write(text, a.output)


def cmd_viz(a):
    from autofuse.viz import report_html, to_dot, to_svg
    _, _, fused = _fuse(a)
    p = fused.plans[next(iter(fused.plans))]
    os.makedirs(a.output, exist_ok=True)
    for name, gm, rep in (("before", p.captured.graph_module, p.report), ("after", p.graph_module, None)):
        _write(to_dot(gm, rep, name), os.path.join(a.output, f"{name}.dot"))
        _write(to_svg(gm, rep, f"{a.model} {name} ({p.report.device}, {p.report.optimization_level})"),
               os.path.join(a.output, f"{name}.svg"))
    _write(report_html(p.report, p.captured.graph_module, p.graph_module), os.path.join(a.output, "report.html"))


def cmd_simulate(a):
    from autofuse import simulate
    if a.meta:
        raise SystemExit("simulate needs data: drop --meta (use `autofuse report --meta` to plan without data)")
    model, (args, kwargs), fused = _fuse(a)
    before = simulate(model, (args, kwargs), device=a.device)
    after = fused.simulate(*args, **kwargs)
    print(f"unfused: {before.summary(top=a.top)}\n\nfused:   {after.summary(top=a.top)}\n")
    print(f"speed-up (simulated, {a.device}): {before.cycles / max(after.cycles, 1):.2f}x")
    if a.json:
        _write(json.dumps({"unfused": before.to_dict(), "fused": after.to_dict()}, indent=2, default=str) + "\n",
               a.json)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="autofuse", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("devices", help="list the device profiles").set_defaults(fn=cmd_devices)
    sub.add_parser("patterns", help="list the pattern families").set_defaults(fn=cmd_patterns)
    p = sub.add_parser("report", help="fuse a model and print what was fused, what was not and why")
    _model_args(p)
    p.add_argument("--format", default="text", choices=["text", "md", "json", "html"])
    p.add_argument("-o", "--output", default=None)
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("viz", help="write the graph before and after fusion (DOT, SVG) and an HTML report")
    _model_args(p)
    p.add_argument("-o", "--output", default="autofuse-viz")
    p.set_defaults(fn=cmd_viz)
    p = sub.add_parser("simulate", help="simulate the model unfused and fused, op by op")
    _model_args(p)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json", default=None, help="also write both simulations as JSON here")
    p.set_defaults(fn=cmd_simulate)
    a = ap.parse_args(argv)
    try:
        a.fn(a)
    except (ValueError, TypeError, RuntimeError) as e:
        raise SystemExit(f"autofuse {a.cmd}: {e}")


if __name__ == "__main__":
    main()
