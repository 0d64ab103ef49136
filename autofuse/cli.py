"""``autofuse`` command line: fusion reports, pictures, simulation, devices, patterns.

    autofuse devices
    autofuse patterns
    autofuse report   --model SPEC [MODEL] [ENGINE] [--format text|md|json|html] [--simulate] [--no-graphs]
                      [-o FILE] [-v]
    autofuse viz      --model SPEC [MODEL] [ENGINE] [-o DIR] [--expand-all] [--show-params] [--simulate]
                      [--model-explorer FILE.json] [-v]
    autofuse simulate --model SPEC [MODEL] [ENGINE] [--top N] [--json FILE] [--backward] [--world-size N] [-v]

    MODEL:  --layers N --hidden N --heads N --kv-heads N (zoo models) --seq N --batch N --dtype D
            --attn eager|sdpa --meta --train --past N (a decode step after a KV cache of N tokens)
    ENGINE: --device NAME --level O0..O3 --budget 16GB --disable FAMILY --enable FAMILY --force FAMILY

``--model`` is a zoo name (``gpt2``, ``llama``, ``qwen2``, ``mixtral``, ``bert``, ``mha``),
``transformers:ConfigClass?key=value&...`` (any transformers configuration, e.g.
``transformers:LlamaConfig?num_hidden_layers=2&hidden_size=256``; no keys = the class's defaults),
``path/to/file.py:function`` or ``package.module:function`` returning ``(model, example_inputs)``.

Exit status: 0 done; 2 the command line is wrong (one line on stderr says what to change); 1 the model
could not be captured or fused (its reason on stderr; ``-v`` adds the traceback). ``-v`` prints each
stage's wall time as it finishes (capture, canonicalize, match, plan, verify, rewrite, simulate, draw with
what laid the pictures out) and lets library warnings through; without it they are silenced. On a terminal,
simulation shows a progress bar.
``simulate --backward`` simulates a training step (forward and backward, each phase's figures printed; with
``--world-size N``, each rank's); add ``--train`` for the training-mode forward (dropout active).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
import traceback
import warnings

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "bfloat16": "bfloat16",
          "bf16": "bfloat16"}
ZOO_SIZES = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": None}
SPEC_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
             "kv_heads": "num_key_value_heads"}


class UsageError(Exception):
    """The command line is wrong; the message says what to change (exit status 2)."""


class _ParseError(UsageError):
    def __init__(self, prog, message):
        super().__init__(f"{message} (see `{prog} --help`)")
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``autofuse report: argument --seq: invalid int value: 'x' (see
    `autofuse report --help`)``, instead of the usage block."""

    def error(self, message):
        raise _ParseError(self.prog, message)


# ---------------------------------------------------------------------------------------------- progress

class Progress:
    """Stage lines (``-v``) and a progress bar for long loops (stderr, only on a terminal)."""

    def __init__(self, verbose: bool, stream=None):
        self.verbose = verbose
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._status = False

    def stage(self, name: str, seconds: float, detail: str = ""):
        if self.verbose:
            self.clear()
            self.stream.write(f"autofuse: {name:<13} {seconds:8.2f} s{('  ' + detail) if detail else ''}\n")
            self.stream.flush()

    def status(self, text: str):
        """A transient line on a terminal (overwritten by the next, cleared at the end)."""
        if self.tty:
            self.stream.write(f"\r\x1b[K{text}")
            self.stream.flush()
            self._status = True

    def bar(self, label: str, done: int, total: int):
        if self.tty and total:
            width = 30
            fill = int(width * done / total)
            self.status(f"{label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")

    def clear(self):
        if self._status:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._status = False


@contextlib.contextmanager
def _patched(obj, name, wrap):
    old = getattr(obj, name, None)
    if old is None:                     # the function moved: no live line for this stage
        yield
        return
    setattr(obj, name, wrap(old))
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def stage_timing(progress: Progress):
    """Times the engine's stages as they run, by wrapping the stage functions ``autofuse.engine`` calls
    (``capture``, ``canonicalize``, ``all_candidates``, ``plan``, ``rewrite``) and ``autofuse.verify.check``;
    a stage called inside another (the verifier rewrites each block it checks) counts toward the outer one,
    except verify, which is reported within plan. Yields a dict of stage -> seconds."""
    from autofuse import engine
    from autofuse import verify as verify_mod
    times: dict = {}
    depth = [0]

    def timed(name, detail=lambda r: ""):
        def wrap(fn):
            def inner(*args, **kwargs):
                if depth[0]:
                    return fn(*args, **kwargs)
                progress.status(f"autofuse: {name}…")
                depth[0] += 1
                t0 = time.perf_counter()
                try:
                    result = fn(*args, **kwargs)
                finally:
                    depth[0] -= 1
                dt = time.perf_counter() - t0
                times[name] = times.get(name, 0.0) + dt
                try:
                    extra = detail(result)
                except Exception:  # noqa: BLE001 - a stage that changed its result shape: time it without detail
                    extra = ""
                if name == "plan" and "verify" in times:
                    extra += f"{'; ' if extra else ''}of which verify {times['verify']:.2f} s"
                progress.stage(name, dt, extra)
                return result
            return inner
        return wrap

    def timed_verify(fn):
        def inner(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times["verify"] = times.get("verify", 0.0) + time.perf_counter() - t0
        return inner

    nodes = lambda gm: f"{len(gm.graph.nodes)} nodes"  # noqa: E731
    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(engine, "capture", timed(
            "capture", lambda c: f"{nodes(c.graph_module)}, route {c.route}")))
        stack.enter_context(_patched(engine, "canonicalize", timed("canonicalize", nodes)))
        stack.enter_context(_patched(engine, "all_candidates", timed("match", lambda c: f"{len(c)} candidates")))
        stack.enter_context(_patched(engine, "plan", timed("plan", lambda r: f"{len(r[0])} applied")))
        stack.enter_context(_patched(engine, "rewrite", timed("rewrite", nodes)))
        stack.enter_context(_patched(verify_mod, "check", timed_verify))
        yield times
    progress.clear()


@contextlib.contextmanager
def simulation_progress(progress: Progress, label: str):
    """A progress bar over the graph's nodes while :func:`autofuse.simulate.simulate_graph` runs (it walks the
    graph with ``autofuse.simulate._Sim``, an ``fx.Interpreter``; its ``run_node`` is wrapped)."""
    import importlib
    sim_mod = importlib.import_module("autofuse.simulate")     # `autofuse.simulate` the attribute is the function
    sim_cls = getattr(sim_mod, "_Sim", None)
    if sim_cls is None or not progress.tty:
        yield
        return
    state = {"done": 0, "shown": 0.0}
    original = sim_cls.run_node

    def run_node(self, n):
        out = original(self, n)
        state["done"] += 1
        now = time.perf_counter()
        if now - state["shown"] > 0.1:
            state["shown"] = now
            progress.bar(label, state["done"], len(self.module.graph.nodes))
        return out
    sim_cls.run_node = run_node
    try:
        yield
    finally:
        sim_cls.run_node = original
        progress.clear()


# ---------------------------------------------------------------------------------------------- arguments

def _whole(least: int):
    """An argparse type: a whole number of at least ``least`` (1 for a size, 0 for a count)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{n} is not a size: give 1 or more" if least == 1 else
                                             f"{n}: give {least} or more")
        if n >= 2 ** 31:                # torch's sizes are int64, and no model dimension comes near this
            raise argparse.ArgumentTypeError(f"{n} is too large: give less than 2**31 (2147483648)")
        return n
    return parse


_count, _count0 = _whole(1), _whole(0)


def _model_args(p):
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, help="zoo name (gpt2, llama, qwen2, mixtral, bert, mha), "
                   "transformers:ConfigClass?key=value&..., file.py:function or module:function")
    g.add_argument("--layers", type=_count, default=None, help="zoo models: layers (default 2)")
    g.add_argument("--hidden", type=_count, default=None, help="zoo models: hidden size (default 64)")
    g.add_argument("--heads", type=_count, default=None, help="zoo models: attention heads (default 4)")
    g.add_argument("--kv-heads", type=_count, default=None, help="zoo models: key/value heads (default heads/2)")
    g.add_argument("--seq", type=_count, default=None, help="sequence length of the example inputs (default 32)")
    g.add_argument("--batch", type=_count, default=None, help="batch of the example inputs (default 2)")
    g.add_argument("--past", type=int, default=0, metavar="N",
                   help="a decode step of a causal LM: --seq new tokens per sequence (default 1) after a KV cache of "
                        "N tokens")
    g.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default float32")
    g.add_argument("--attn", default=None, choices=["eager", "sdpa"], help="transformers attention (default eager)")
    g.add_argument("--meta", action="store_true", help="plan on meta tensors (no data; verification on random data)")
    g.add_argument("--train", action="store_true", help="the model in training mode (dropout active: the training plan)")
    e = p.add_argument_group("engine")
    e.add_argument("--device", default="ascend910", help="target device (see `autofuse devices`)")
    e.add_argument("--level", default="O3", help="optimization level O0..O3")
    e.add_argument("--budget", default=None, help="memory budget of each fused kernel's working set, with a unit: "
                   "16GB, 512MB, 1.5GiB (GB = GiB = 2**30 bytes, MB = MiB = 2**20, KB, TB likewise; B for bytes)")
    for flag, what in (("--disable", "never fuse FAMILY"), ("--enable", "fuse FAMILY where it pays (the default)"),
                       ("--force", "fuse FAMILY even where the cost model says it does not pay")):
        e.add_argument(flag, action="append", default=[], metavar="FAMILY",
                       help=f"{what}; repeatable, comma lists too (`autofuse patterns` lists the families)")
    p.add_argument("-v", "--verbose", action="store_true", help="stage timings and library warnings")


def _check_engine_args(a) -> dict:
    """Validate device, level, budget and fusion switches before any model is built; returns fuse() keywords."""
    from autofuse.match import families
    from autofuse.plan import parse_level, parse_memory_budget, unitless_hint
    from cost_model.devices import DEVICES, get_device
    try:
        a.device = get_device(a.device).name         # the names and short forms fuse() takes (ASCEND910, 910b)
    except ValueError:
        raise UsageError(f"--device {a.device!r} is not a device: choose one of {', '.join(DEVICES)} "
                         f"(`autofuse devices` lists their figures)") from None
    try:
        level = parse_level(a.level)
    except ValueError:
        raise UsageError(f"--level {a.level!r}: choose one of O0, O1, O2, O3 (O0 reports only, O3 fuses "
                         f"and tunes tilings)") from None
    try:
        budget = parse_memory_budget(a.budget)
    except (ValueError, TypeError) as e:
        if "has no unit" in str(e):
            raise UsageError(f"--budget {a.budget!r} has no unit: {unitless_hint(a.budget.strip())}") from None
        what = next((w for k, w in (("at least", "it must be at least one byte"),
                                    ("finite", "it is not a finite number of bytes"),
                                    ("whole", "bytes are whole: a whole number of bytes, or another unit"))
                     if k in str(e)), "write a number and a unit")
        raise UsageError(f"--budget {a.budget!r}: {what}, e.g. 16GB, 512MB or 1.5GiB") from None
    kw = {"target_device": a.device, "optimization_level": level, "memory_budget": budget}
    switches = {}
    from autofuse.engine import NAMES, switch_name_known
    from autofuse.models import did_you_mean
    known = list(families()) + list(NAMES)      # families, and the names discovery gives its regions
    for flag, value in (("disable", "off"), ("enable", "on"), ("force", "force")):
        for item in getattr(a, flag):
            for name in filter(None, item.split(",")):
                if not switch_name_known(name):
                    raise UsageError(f"--{flag} {name!r} is not a pattern family or region name"
                                     f"{did_you_mean(name, known)}: choose from {', '.join(known)}")
                if switches.get(name, value) != value:
                    raise UsageError(f"pattern family {name!r} is switched both {switches[name]!r} and {value!r}: "
                                     f"give one of --disable/--enable/--force for it")
                switches[name] = value
    if switches:
        kw["fusion_switches"] = switches
    return kw


def _build(a):
    """The model and its inputs; sizing flags that do not apply to the spec are errors, not silently ignored."""
    import torch

    from autofuse.models import TRANSFORMERS_PREFIX, build
    torch.manual_seed(0)            # the same command, the same weights and inputs: the same report
    dtype = getattr(torch, DTYPES[a.dtype or "float32"])
    batch = 2 if a.batch is None else a.batch
    given = {k: getattr(a, k) for k in ZOO_SIZES if getattr(a, k) is not None}
    if a.model.startswith(TRANSFORMERS_PREFIX) and given:
        k = next(iter(given))
        raise UsageError(f"--{k.replace('_', '-')} sizes zoo models; a transformers spec carries its sizes as keys: "
                         f"transformers:...?{SPEC_KEYS[k]}={given[k]} (the key names are the config's)")
    if ":" in a.model and not a.model.startswith(TRANSFORMERS_PREFIX):
        shaping = [f for f in ("layers", "hidden", "heads", "kv_heads", "seq", "batch", "dtype", "attn")
                   if getattr(a, f) is not None] + (["meta"] if a.meta else []) + (["past"] if a.past else [])
        if shaping:
            raise UsageError(f"--{shaping[0].replace('_', '-')} does not apply to {a.model}: the function builds "
                             f"the model and its inputs itself")
        return build(a.model)
    if a.model.startswith(TRANSFORMERS_PREFIX):
        _quiet_transformers(a.verbose)
        return build(a.model, seq=_seq(a), batch=batch, dtype=dtype, meta=a.meta, attn=a.attn or "eager",
                     past=a.past)
    sizes = {k: (given[k] if k in given else v) for k, v in ZOO_SIZES.items()}
    _check_zoo_sizes(a, sizes)
    if a.model != "mha":
        _quiet_transformers(a.verbose)
    return build(a.model, seq=_seq(a), batch=batch, dtype=dtype, meta=a.meta, attn=a.attn or "eager",
                 past=a.past, **sizes)


def _check_zoo_sizes(a, sizes: dict):
    """The zoo model's sizing flags apply to it and fit together (heads divide the hidden size, kv heads the heads)."""
    unused = {"mha": ("layers", "kv_heads", "attn"), "gpt2": ("kv_heads",), "bert": ("kv_heads",)}.get(a.model, ())
    for f in unused:
        if getattr(a, f) is not None:
            raise UsageError(f"--{f.replace('_', '-')} does not apply to {a.model}"
                             + (" (one attention block)" if a.model == "mha" else " (its attention has no kv groups)"))
    if sizes["hidden"] % sizes["heads"]:
        raise UsageError(f"--hidden {sizes['hidden']} is not a multiple of --heads {sizes['heads']}: each head takes "
                         f"hidden / heads features")
    if sizes["kv_heads"] is not None and sizes["heads"] % sizes["kv_heads"]:
        raise UsageError(f"--heads {sizes['heads']} is not a multiple of --kv-heads {sizes['kv_heads']}: each kv head "
                         f"serves a group of heads/kv-heads query heads")


def _seq(a) -> int:
    """The example inputs' tokens per sequence: --seq, else 32, or 1 for a decode step (--past)."""
    if a.past < 0:
        raise UsageError(f"--past {a.past}: the KV cache holds 0 or more tokens")
    return a.seq if a.seq is not None else (1 if a.past else 32)


def _quiet_transformers(verbose: bool):
    if not verbose:
        try:
            import transformers
        except ImportError:        # building the model says what to install
            return
        transformers.logging.set_verbosity_error()


class ModelFailed(Exception):
    """The model could not be captured, fused or simulated (exit status 1)."""


def _fuse(a, progress: Progress):
    from autofuse import AutoFusionEngine
    from autofuse.capture import CaptureError
    from autofuse.models import ModelSpecError
    kw = _check_engine_args(a)
    if a.meta and (a.cmd == "simulate" or getattr(a, "simulate", False)):
        raise UsageError("simulation needs data: drop --meta (`autofuse report --meta` plans without data)")
    t0 = time.perf_counter()
    progress.status("autofuse: building the model…")
    try:
        model, inputs = _build(a)
    except ModelSpecError as e:
        raise UsageError(str(e)) from None
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's builder or transformers failed: the model's failure
        raise ModelFailed(f"could not build {a.model}: {type(e).__name__}: {e}") from e
    # the mode the command asks for, whatever mode a factory left its model in (a new module trains by default)
    model.train(bool(a.train))
    progress.stage("build model", time.perf_counter() - t0, type(model).__name__ + (" on meta" if a.meta else "")
                   + (", training mode" if a.train else ""))
    # torch.export prints the partial graph of a failed trace to stderr; without -v the reason autofuse gives
    # is what the user reads
    quiet = contextlib.redirect_stderr(io.StringIO()) if not a.verbose else contextlib.nullcontext()
    try:
        with stage_timing(progress), quiet:
            try:
                fused = AutoFusionEngine.fuse(model, inputs, **kw)
            except CaptureError as e:
                given = _eagers_default_mask(a, inputs, e)
                if given is None:
                    raise
                inputs = given
                progress.stage("attention mask", 0.0, "the model builds its default mask of ones only outside "
                                                      "compilation: given as eager builds it")
                fused = AutoFusionEngine.fuse(model, inputs, **kw)
    except Exception as e:  # noqa: BLE001 - whatever the pipeline raised is the model's failure, explained
        raise ModelFailed(f"could not fuse {a.model}: {e}") from e
    return model, inputs, fused


def _eagers_default_mask(a, inputs, error):
    """The inputs with ``attention_mask`` given as a mask of ones, for a ``transformers:`` model whose capture
    failed because its forward builds that default only outside compilation (LongT5, SwitchTransformers: torch.export
    is compiling, so the mask stays None); else None. Eager's computation is the same: the mask it would build."""
    import torch
    if not (isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict)):
        return None
    args, kwargs = inputs
    if not (a.model.startswith("transformers:") and "attention_mask" in error.defaults_skipped
            and "input_ids" in kwargs and "attention_mask" not in kwargs):
        return None
    return args, {**kwargs, "attention_mask": torch.ones_like(kwargs["input_ids"])}


@contextlib.contextmanager
def _writing(path):
    """An OSError while ``path`` is written (or its directory made) is a failure that names it, in one line."""
    try:
        yield
    except OSError as e:
        raise ModelFailed(f"could not write {path}: {e.strerror or e}") from e


def _write(text: str, path):
    if path in (None, "-"):
        sys.stdout.write(text)
        return
    with _writing(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    print(f"wrote {path}")


def _plan(fused):
    return fused.plans[next(iter(fused.plans))]


GENERIC = "generic fusion alone"


def _simulations(a, fused, inputs, progress: Progress) -> dict:
    """``{"fused": ..., "eager op by op": ..., "generic fusion alone": ...}``: the plan, the captured graph and the
    plan with every pattern family switched off (automatic discovery alone), on the simulator."""
    from autofuse import AutoFusionEngine
    from autofuse.engine import generic_only
    from autofuse.report import BASELINE
    from autofuse.simulate import simulate_graph
    p = _plan(fused)
    args, kwargs = inputs
    leaves = p.captured.flatten_inputs(*args, **kwargs)
    kw = _check_engine_args(a)
    kw["fusion_switches"] = {**kw.get("fusion_switches", {}), **generic_only()}
    generic = AutoFusionEngine.fuse(fused.model, inputs, **kw)
    out = {}
    for name, gm in ((BASELINE, p.captured.graph_module), (GENERIC, _plan(generic).graph_module),
                     ("fused", p.graph_module)):
        t0 = time.perf_counter()
        try:
            with simulation_progress(progress, f"simulate {name}"):
                out[name] = simulate_graph(gm, leaves, a.device, backward=getattr(a, "backward", False))
        except Exception as e:  # noqa: BLE001
            raise ModelFailed(f"could not simulate {a.model} ({name}): {e}") from e
        progress.stage("simulate", time.perf_counter() - t0, f"{name}: {out[name].cycles:,} cycles")
    return out


def _costs(fused, sims):
    from autofuse.report import BASELINE, node_costs
    p = _plan(fused)
    before = node_costs(p.captured.graph_module, p.report.device, p.report, sims.get(BASELINE))
    return before, node_costs(p.graph_module, p.report.device, p.report, sims.get("fused"), before=before)


def _html(a, fused, sims, graphs=None) -> str:
    from autofuse.report import report_html
    p = _plan(fused)
    extra = {} if sims else {GENERIC: p.report.baselines.get(GENERIC)} if p.report.baselines.get(GENERIC) else {}
    return report_html(p.report, p.captured.graph_module, p.graph_module, title=f"autofuse: {a.model}", simulations=sims,
                       graphs=graphs, extra_baselines=extra)


# ---------------------------------------------------------------------------------------------- commands

def cmd_devices(a, progress):
    from cost_model.devices import DEVICES
    print(f"{'device':<12}{'arch':<9}{'cube cores':>11}{'vec cores':>10}{'GHz':>6}{'fp16 TFLOPS':>13}"
          f"{'HBM GB/s':>10}{'L2 MB':>7}{'UB KB':>7}{'L1 KB':>7}")
    for d in DEVICES.values():
        print(f"{d.name:<12}{d.arch:<9}{d.cube_cores:>11}{d.vector_cores:>10}{d.clock_hz / 1e9:>6.2f}"
              f"{d.cube_peak_flops() / 1e12:>13.1f}{d.hbm_bytes_per_cycle * d.clock_hz / 1e9:>10.0f}"
              f"{d.l2_bytes >> 20:>7}{d.buffers['UB'] >> 10:>7}{d.buffers['L1'] >> 10:>7}")


def _first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    end = para.find(". ")
    return para if end < 0 else para[:end + 1]


def cmd_patterns(a, progress):
    from autofuse.match import families
    fams = families()
    if a.show is None:
        _write("".join(f"{name}: {_first_sentence(sys.modules[fn.__module__].__doc__ or '')}\n"
                       for name, fn in fams.items()), a.output)
        return
    def declared(mod):            # a module's templates (a tuple, or a dict by kind)
        t = getattr(mod, "TEMPLATES", ())
        return list(t.values()) if isinstance(t, dict) else list(t)
    modules = list(dict.fromkeys(sys.modules[fn.__module__] for fn in fams.values()))
    named = [t for mod in modules for t in declared(mod)]
    names = sorted({t.name for t in named} - set(fams))
    # names found by the same template as another (an activation of either kind; a norm with or without its add, or
    # centred: a LayerNorm written out); a joined name (matmul+swiglu) by its part that is not the matmul
    alias = {"geglu": "swiglu", "add_rms_norm": "rms_norm", "layer_norm": "rms_norm"}
    parts = [p for p in a.show.split("+") if p != "matmul"]
    shown = alias.get(parts[0], parts[0]) if len(parts) == 1 and "+" in a.show else alias.get(a.show, a.show)
    if shown != a.show and shown in names:
        also = " (its statistic centred; torch's own aten.layer_norm op is named without one)" \
            if parts[0] == "layer_norm" else ""
        lead = f"{a.show} (a matmul fused with a Vector region) is" if "+" in a.show else f"{a.show} is"
        print(f"{lead} found by the {shown} template{also}:", file=sys.stderr)
        a.show = shown
    if a.show not in fams and a.show not in names:
        from autofuse.models import did_you_mean
        raise UsageError(f"--show {a.show!r} is not a pattern family or a region name"
                         f"{did_you_mean(a.show, list(fams) + names + list(alias))}: choose from {', '.join(fams)} "
                         f"(families) or {', '.join(sorted(set(names) | set(alias)))} "
                         f"(names of Vector regions, joined with + to matmul as reports print them)")
    templates = [t for t in named if t.name == a.show]
    if not templates:          # a family found by discovery (vector_chain): the templates that name its regions
        templates = declared(sys.modules[fams[a.show].__module__])
    dots = [t.to_dot() for t in templates]
    text = "\n".join(dots) + "\n"
    if a.output and a.output.endswith((".svg", ".png", ".pdf")):
        from autofuse import viz
        if not viz.have_graphviz():
            raise UsageError("drawing SVG, PNG or PDF needs Graphviz `dot` (apt-get install graphviz); write .dot "
                             "instead")
        import subprocess
        fmt = a.output.rsplit(".", 1)[1]
        outs = []
        for i, dot in enumerate(dots):
            path = a.output if len(dots) == 1 else f"{a.output[:-len(fmt) - 1]}-{i}.{fmt}"   # t.svg: t-0.svg, t-1.svg
            with _writing(path):
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                done = subprocess.run(["dot", f"-T{fmt}", "-o", path], input=dot.encode(), capture_output=True)
            if done.returncode:
                why = done.stderr.decode(errors="replace").strip().splitlines()
                raise ModelFailed(f"could not write {path}: Graphviz `dot` failed ({why[-1] if why else 'no message'})")
            outs.append(path)
        print("\n".join(outs))
    else:
        _write(text, a.output)


def cmd_report(a, progress):
    _, inputs, fused = _fuse(a, progress)
    r = fused.report
    sims = _simulations(a, fused, inputs, progress) if a.simulate else {}
    if a.format == "json":
        doc = r.to_dict()
        if sims:
            doc["simulated"] = {k: {"cycles": s.cycles, "hbm_bytes": s.hbm_bytes} for k, s in sims.items()}
        text = json.dumps(doc, indent=2) + "\n"
    elif a.format == "md":
        text = r.to_markdown(sims)
    elif a.format == "html":
        text = _html(a, fused, sims, _pictures(_graphs(a, fused, sims, progress)) if a.graphs else None)
    else:
        text = r.summary() + "\n"
        if sims:
            from autofuse.report import BASELINE, baseline_label
            fused_cycles = max(sims["fused"].cycles, 1)
            text += (f"simulated on {a.device}: {sims[BASELINE].cycles:,} -> {sims['fused'].cycles:,} cycles, "
                     f"{sims[BASELINE].cycles / fused_cycles:.2f}x against {BASELINE}, "
                     f"{sims[GENERIC].cycles / fused_cycles:.2f}x against {baseline_label(GENERIC, r)} "
                     f"({sims[GENERIC].cycles:,} cycles)\n")
    _write(text, a.output)


def _graphs(a, fused, sims, progress, expand_all=False, show_params=False) -> dict:
    """Caption -> inline SVG of both graphs (Graphviz when present, the built-in layout otherwise); the DOT
    texts are returned under ``"dot:before"``/``"dot:after"``."""
    from autofuse import hierarchy, viz
    p = _plan(fused)
    before_costs, after_costs = _costs(fused, sims)
    # a simulation measures the nodes; a fused block's "N → M cyc" is still the planner's prediction
    source = f"simulated on {a.device}; blocks' N → M cyc: predicted" if sims else "predicted by the cost model"
    out, layouts = {}, {}
    t0 = time.perf_counter()
    for key, gm, rep, costs, kw in (
            ("before", p.captured.graph_module, p.report, before_costs, {}),
            ("after", p.graph_module, None, after_costs, {"before_paths": hierarchy.module_paths(p.captured.graph_module)})):
        title = f"{a.model} {key} fusion ({p.report.device}, {p.report.optimization_level})"
        d = viz.draw(gm, rep, costs, title, expand_all=expand_all, show_params=show_params, cost_source=source, **kw)
        out[f"dot:{key}"] = d.dot
        out[f"Graph {key} fusion"] = viz.svg_inline(d.svg)
        layouts[key] = d.layout + (f" (Graphviz stopped after {d.timed_out.seconds:g} s)" if d.timed_out else "")
        if d.timed_out is not None:
            progress.clear()
            where = (f"render {os.path.join(a.output, key + '.dot')} with `dot -Tsvg`" if a.cmd == "viz" else
                     "`autofuse viz` writes its DOT text, which `dot -Tsvg` renders")
            print(f"autofuse {a.cmd}: the {key} graph: {d.timed_out}; its picture uses the built-in layout instead "
                  f"(every node in rows, without module clusters, folded layers or costs). For the Graphviz picture, "
                  f"{where} (no time limit)" + ("; without --expand-all identical layers are folded" if expand_all
                                                 else ""), file=sys.stderr)
    if not viz.have_graphviz():
        how = "built-in layout (Graphviz is not installed)"
    elif len(set(layouts.values())) == 1:
        how = layouts["before"]
    else:
        how = "; ".join(f"{k}: {v}" for k, v in layouts.items())
    progress.stage("draw", time.perf_counter() - t0, how)
    return out


def _pictures(graphs: dict) -> dict:
    """The pictures of :func:`_graphs` for the page, without the DOT texts (those are files of ``viz``)."""
    return {k: v for k, v in graphs.items() if not k.startswith("dot:")}


def cmd_viz(a, progress):
    from autofuse import viz
    _, inputs, fused = _fuse(a, progress)
    sims = _simulations(a, fused, inputs, progress) if a.simulate else {}
    graphs = _graphs(a, fused, sims, progress, a.expand_all, a.show_params)
    with _writing(a.output):
        os.makedirs(a.output, exist_ok=True)
    for key in ("before", "after"):
        _write(graphs[f"dot:{key}"], os.path.join(a.output, f"{key}.dot"))
        _write(graphs[f"Graph {key} fusion"] + "\n", os.path.join(a.output, f"{key}.svg"))
    if not viz.have_graphviz():
        print("Graphviz `dot` is not installed: the SVGs use the built-in layout (no module clusters); render the "
              "DOT files with `dot -Tsvg before.dot` after installing graphviz (apt-get install graphviz)",
              file=sys.stderr)
    _write(_html(a, fused, sims, _pictures(graphs)), os.path.join(a.output, "report.html"))
    if a.model_explorer:
        p = _plan(fused)
        before_costs, after_costs = _costs(fused, sims)
        doc = viz.model_explorer(p.captured.graph_module, p.graph_module, p.report, before_costs, after_costs, label=a.model)
        _write(json.dumps(doc) + "\n", a.model_explorer)
        stem = a.model_explorer[:-5] if a.model_explorer.endswith(".json") else a.model_explorer
        for name, data in viz.model_explorer_node_data(p.captured.graph_module, p.graph_module, p.report, before_costs,
                                                       after_costs).items():
            _write(json.dumps(data) + "\n", f"{stem}.{name}.json")


def cmd_simulate(a, progress):
    if a.world_size > 1:
        return _simulate_world(a, progress)
    from autofuse.report import BASELINE, baseline_label
    _, inputs, fused = _fuse(a, progress)
    sims = _simulations(a, fused, inputs, progress)
    before, generic, after = sims[BASELINE], sims[GENERIC], sims["fused"]
    label = baseline_label(GENERIC, _plan(fused).report)
    print(f"unfused: {before.summary(top=a.top)}\n\nfused:   {after.summary(top=a.top)}\n")
    print(f"speed-up (simulated, {a.device}{', training step' if a.backward else ''}): "
          f"{before.cycles / max(after.cycles, 1):.2f}x against {BASELINE} "
          f"({before.cycles:,} cycles), {generic.cycles / max(after.cycles, 1):.2f}x against {label} "
          f"({generic.cycles:,} cycles)")
    if a.backward:
        for phase in ("forward", "backward"):
            b, g, f = (s.phases[phase] for s in (before, generic, after))
            print(f"  {phase:<8}: {b:>14,} / {g:>14,} / {f:>14,} cycles ({BASELINE} / {label} / fused): "
                  f"{b / max(f, 1):.2f}x / {g / max(f, 1):.2f}x")
    if a.json:
        # "simulated": the three totals under the names report --simulate --format json gives them
        totals = {k: {"cycles": s.cycles, "hbm_bytes": s.hbm_bytes} for k, s in sims.items()}
        _write(json.dumps({"unfused": before.to_dict(), "generic": generic.to_dict(), "fused": after.to_dict(),
                           "simulated": totals}, indent=2, default=str) + "\n", a.json)


def _simulate_world(a, progress):
    """``simulate --world-size N``: every rank a gloo process fusing and simulating its shard
    (:func:`autofuse.distributed.simulate_world`)."""
    from autofuse.distributed import rank_builder, simulate_world
    kw = _check_engine_args(a)
    if a.meta:
        raise UsageError("simulation needs data: drop --meta")
    for f in ("layers", "kv_heads", "attn", "train", "past"):
        if getattr(a, f):
            raise UsageError(f"--{f.replace('_', '-')} does not apply with --world-size: the ranks' model is sized by "
                             f"--hidden --heads --seq --batch --dtype (tp-block) or built by your function")
    if a.model == "tp-block":
        import inspect

        from autofuse.tp_models import build as tp_build
        d = inspect.signature(tp_build).parameters
        hidden, heads = a.hidden or d["hidden"].default, a.heads or d["heads"].default
        if hidden % heads or heads % a.world_size:
            raise UsageError(f"tp-block splits its {heads} heads over {a.world_size} ranks and each head takes "
                             f"hidden / heads features: --heads must be a multiple of --world-size and divide --hidden "
                             f"(here --hidden {hidden} --heads {heads})")
    try:
        build = rank_builder(a.model, hidden=a.hidden, heads=a.heads, seq=a.seq, batch=a.batch,
                             dtype=DTYPES[a.dtype or "float32"])
    except ValueError as e:
        raise UsageError(str(e)) from None
    t0 = time.perf_counter()
    try:
        world = simulate_world(build, a.world_size, kw.pop("target_device"), kw.pop("optimization_level"),
                               backward=a.backward, **kw)
    except RuntimeError as e:
        raise ModelFailed(f"could not simulate {a.model} on {a.world_size} ranks: {e}") from e
    progress.stage("simulate", time.perf_counter() - t0, f"{a.world_size} ranks")
    print(world.summary())
    if a.json:
        _write(json.dumps(world.to_dict(), indent=2, default=str) + "\n", a.json)


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="autofuse", description="autofuse: fusion reports, pictures, simulation, devices, patterns.",
                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    from autofuse import __version__
    ap.add_argument("--version", action="version", version=f"autofuse {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser, metavar="COMMAND",
                            title="commands (`autofuse COMMAND --help` for each)")
    sub.add_parser("devices", help="list the device profiles").set_defaults(fn=cmd_devices)
    p = sub.add_parser("patterns", help="list the pattern families, or draw one's templates (--show NAME)")
    p.add_argument("--show", default=None, metavar="NAME", help="draw the family's templates (Graphviz DOT; "
                   "an -o FILE.svg, .png or .pdf renders them with dot)")
    p.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    p.set_defaults(fn=cmd_patterns)
    p = sub.add_parser("report", help="fuse a model and print what was fused, what was not and why")
    _model_args(p)
    p.add_argument("--format", default="text", choices=["text", "md", "json", "html"])
    p.add_argument("--simulate", action="store_true", help="measure the verdict on the simulator (needs data)")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="html: leave the graph pictures out")
    p.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    p.set_defaults(fn=cmd_report)
    p = sub.add_parser("viz", help="write the graphs before and after fusion (DOT, SVG) and an HTML report")
    _model_args(p)
    p.add_argument("-o", "--output", default="autofuse-viz", help="directory to write (default autofuse-viz)")
    p.add_argument("--expand-all", action="store_true", help="draw every repeated layer, not one of each kind")
    p.add_argument("--show-params", action="store_true", help="draw parameters and buffers too")
    p.add_argument("--simulate", action="store_true", help="annotate with simulated figures (needs data)")
    p.add_argument("--model-explorer", default=None, metavar="FILE.json",
                   help="also write Google Model Explorer graphs here, and node data next to it (FILE.cycles.json, ...)")
    p.set_defaults(fn=cmd_viz)
    p = sub.add_parser("simulate", help="simulate the model unfused and fused, op by op")
    _model_args(p)
    p.add_argument("--top", type=_count0, default=8, help="the launches to list (default 8)")
    p.add_argument("--json", default=None, help="also write the three simulations as JSON here: \"unfused\" (eager op "
                   "by op), \"generic\" (generic fusion alone) and \"fused\"; \"simulated\": their cycles and HBM "
                   "bytes under the names report --format json uses")
    p.add_argument("--backward", action="store_true",
                   help="simulate a training step: the forward and the backward of every trainable parameter "
                        "(with --train, dropout active too)")
    p.add_argument("--world-size", type=_count, default=1, metavar="N",
                   help="simulate N ranks under torch.distributed (gloo processes on this machine), each fusing and "
                        "simulating its shard: --model tp-block (a Megatron-split GPT-2 block sized by --hidden "
                        "--heads --seq --batch --dtype) or module:function / file.py:function taking (rank, "
                        "world_size) and returning (module, example_args)")
    p.set_defaults(fn=cmd_simulate)
    return ap


def main(argv=None):
    """Run the command line; exits with status 2 on a usage error and 1 when the model fails."""
    argv = sys.argv[1:] if argv is None else list(argv)
    for i, tok in enumerate(argv[:-1]):
        if tok == "--budget" and argv[i + 1].startswith("-") and argv[i + 1][1:2].isdigit():
            argv[i:i + 2] = [f"--budget={argv[i + 1]}"]     # --budget -1GB is a (wrong) budget, not a flag
            break
    try:
        a, extra = parser().parse_known_args(argv)
    except _ParseError as e:
        _fail(2, f"{e.prog}: {e}")
    if extra:            # named by the subcommand they were given to, whose --help lists what it takes
        _fail(2, f"autofuse {a.cmd}: unrecognized arguments: {' '.join(extra)} (see `autofuse {a.cmd} --help`)")
    verbose = getattr(a, "verbose", False)
    progress = Progress(verbose)
    from autofuse.quiet import torch_internal_warnings
    with warnings.catch_warnings(), _library_logs(verbose):
        warnings.simplefilter("default" if verbose else "ignore")
        with torch_internal_warnings():     # after the line above, so that it holds with -v too
            try:
                _check_outputs(a)
                a.fn(a, progress)
                sys.stdout.flush()              # a closed pipe shows here, not at exit
            except UsageError as e:
                progress.clear()
                _fail(2, f"autofuse {a.cmd}: {e}")
            except ModelFailed as e:
                progress.clear()
                if verbose:
                    traceback.print_exception(e.__cause__ or e)
                _fail(1, f"autofuse {a.cmd}: {e}", one_line=False)
            except KeyboardInterrupt:
                progress.clear()
                _fail(130, f"autofuse {a.cmd}: interrupted")
            except BrokenPipeError:                 # the reader stopped (`| head`): nothing left to say
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                raise SystemExit(1)


def _check_outputs(a):
    """The command's output paths can be written, checked before any work: a wrong path is a wrong command line."""
    dirs = {"output"} if a.cmd == "viz" else set()
    for field, flag in (("output", "-o"), ("json", "--json"), ("model_explorer", "--model-explorer")):
        path = getattr(a, field, None)
        if path in (None, "-"):
            continue
        if field in dirs:
            if os.path.exists(path) and not os.path.isdir(path):
                raise UsageError(f"{flag} {path}: a file is there; viz writes a directory (give a new or existing "
                                 f"directory)")
            where = path
        else:
            if os.path.isdir(path):
                raise UsageError(f"{flag} {path} is a directory: give a file name")
            where = os.path.dirname(os.path.abspath(path))
        # the nearest existing directory on the way must take new entries (the missing ones are created): tried
        # with an entry made and removed, as the permission bits do not tell (root, /proc)
        probe = os.path.abspath(where)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK) or not _takes_entries(probe):
            raise UsageError(f"{flag} {path}: cannot write there ({probe} is not a writable directory)")


def _takes_entries(directory: str) -> bool:
    import tempfile
    try:
        os.rmdir(tempfile.mkdtemp(dir=directory, prefix=".autofuse-probe-"))
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _library_logs(verbose: bool):
    """Without ``-v``, torch's and transformers' log records are dropped but for CRITICAL ones (torch logs graph
    dumps and guard diagnostics at WARNING, and tracebacks of the ops a failing capture ran at ERROR; autofuse
    explains the failure itself, and ``-v`` lets them all through)."""
    import logging
    loggers = [logging.getLogger(name) for name in ("torch", "transformers")]
    levels = [lg.level for lg in loggers]
    if not verbose:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _fail(code: int, message: str, one_line: bool = True):
    print(" ".join(message.split("\n")) if one_line else message, file=sys.stderr)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
