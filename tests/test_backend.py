"""``torch.compile(model, backend="autofuse")``: entry-point discovery, graph breaks, reports per compiled
object, and no library warnings on the way."""
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib
import warnings

import pytest
import torch

import autofuse
from autofuse.backend import Backend, graphs, reports
from autofuse.grad_ops import CUSTOM_FUNCTION
from autofuse.models import MHABlock
from autofuse.quiet import LEAFSPEC_MESSAGE
from test_autograd_semantics import TanhGelu as _TanhGelu      # BLOOM's GeLU, its derivative written out by hand

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENTRY = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["torch_dynamo_backends"]

# A model whose forward Dynamo must split twice: at print() and at .item(). Graphs: block a; block b and the
# reduction; the final multiply. Each attention block is fused in its own graph.
# Plain torch (a fresh interpreter runs it before anything imports autofuse).
BREAKING_MODEL = textwrap.dedent("""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)

        def forward(self, x):
            mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)
            return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]

    class Breaking(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Block(), Block()

        def forward(self, x):
            y = self.a(x)
            print("between the blocks")
            return self.b(y) * y.abs().mean().item()
""")


def _breaking():
    ns = {}
    exec(BREAKING_MODEL, ns)
    torch.manual_seed(0)
    return ns["Breaking"]().eval(), torch.randn(2, 16, 32)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_pyproject_declares_the_backend_entry_point():
    assert ENTRY == {"autofuse": "autofuse.backend:autofuse_backend"}
    module, _, attr = ENTRY["autofuse"].partition(":")
    assert isinstance(getattr(sys.modules[module], attr), Backend)


FRESH = textwrap.dedent("""
    import sys, torch
    {model}
    assert "autofuse" not in sys.modules
    torch.manual_seed(0)
    m = Breaking().eval()
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        got = torch.compile(m, backend="autofuse")(x)
        want = m(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)   # fp32 attention: reassociation error only
    import autofuse
    print("REPORTS", [len(r.applied) for r in autofuse.reports(m)])
""")


def _run_fresh(env_extra: dict) -> str:
    env = {**os.environ, **env_extra}
    r = subprocess.run([sys.executable, "-c", FRESH.format(model=BREAKING_MODEL)],
                       capture_output=True, text=True, env=env, cwd=ROOT.parent, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_fresh_interpreter_finds_the_backend_through_its_entry_point(tmp_path):
    """Dynamo's own discovery (importlib.metadata) in a fresh interpreter. Where this venv's autofuse distribution
    declares pyproject's entry point (``pip install -e .``, as CI installs the checkout), through it: what a user
    gets. Otherwise (installed from an older checkout, or not at all), through a probe distribution declaring
    exactly pyproject's entry point, whatever the state of the install."""
    installed = importlib.metadata.entry_points(group="torch_dynamo_backends").select(name="autofuse")
    if [ep.value for ep in installed] == [ENTRY["autofuse"]]:
        path = [str(ROOT)]
    else:
        dist = tmp_path / "autofuse_probe-0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: autofuse-probe\nVersion: 0\n")
        (dist / "entry_points.txt").write_text(f"[torch_dynamo_backends]\nautofuse = {ENTRY['autofuse']}\n")
        path = [str(tmp_path), str(ROOT)]
    out = _run_fresh({"PYTHONPATH": os.pathsep.join(path)})
    assert "REPORTS [1, 1, 0]" in out and out.count("between the blocks") == 2


def test_graph_breaks_fuse_each_graph_and_reports_follow_the_compiled_object(capsys):
    model, x = _breaking()
    compiled = torch.compile(model, backend="autofuse")
    assert reports(compiled) == []                      # Dynamo compiles at the first call
    with torch.no_grad():
        got = compiled(x)
        want = model(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)   # fp32 attention: reassociation error only
    gs = graphs(compiled)
    assert [len(g.fused.report.applied) for g in gs] == [1, 1, 0]
    assert all(g.owner == "Breaking" for g in gs)
    # planned in the model's mode (Dynamo's graph modules are in training mode whatever the model's is)
    assert not model.training and not any(r.training for r in reports(compiled))
    assert [r.nodes_before for r in reports(compiled)] == [g.fused.report.nodes_before for g in gs]
    assert reports(model) == reports(compiled) == autofuse.reports(compiled)
    # a second compiled model does not see the first one's graphs
    other, _ = _breaking()
    compiled_other = torch.compile(other, backend="autofuse")
    with torch.no_grad():
        compiled_other(x)
    assert len(reports(compiled_other)) == 3 and not set(map(id, reports(compiled_other))) & set(
        map(id, reports(compiled)))


def test_a_backend_object_with_settings_keeps_its_graphs_and_a_compiled_function_its_own():
    be = autofuse.backend(target_device="ascend910b", optimization_level="O2")
    block = MHABlock(32, 4).eval()

    def fn(x):
        return block(x) + 1

    compiled = torch.compile(fn, backend=be)
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), fn(x), atol=1e-5, rtol=1e-4)   # fp32: reassociation error only
    (r,) = be.reports
    assert (r.device, r.optimization_level, len(r.applied)) == ("ascend910b", "O2", 1)
    assert reports(compiled) == reports(fn) == [r] and be.fused_modules[0].report is r


def test_a_compiled_forward_reports_under_the_model_and_its_forward():
    """``model.forward = torch.compile(model.forward, ...)`` (the way to keep ``generate`` and friends): the
    reports are the model's, asked for by the model or by its compiled forward."""
    block = MHABlock(32, 4).eval()
    block.forward = torch.compile(block.forward, backend="autofuse")
    x = torch.randn(2, 16, 32)
    assert reports(block.forward) == []
    with torch.no_grad():
        block(x)
    (r,) = reports(block)
    assert reports(block.forward) == [r] and len(r.applied) == 1


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.scale = torch.nn.Linear(32, 32), 0.125

    def forward(self, x):
        return torch.softmax(self.lin(x) * self.scale, -1)


def test_a_float_attribute_changed_under_compile_follows_eager():
    """Dynamo recompiles a graph whose Python float attribute changed with the float as an input (a 0-d float64
    tensor, then a symbolic float): both are scalars, not float64 data to refuse or lower as a tensor."""
    torch.manual_seed(0)
    model, x = _Scaled().eval(), torch.randn(2, 8, 32)
    compiled = torch.compile(model, backend="autofuse")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            for s in (0.125, 0.5, 2.0):
                model.scale = s
                torch.testing.assert_close(compiled(x), model(x), atol=1e-6, rtol=1e-5)   # fp32: rounding only
    finally:
        torch._dynamo.reset()


def test_compile_path_raises_no_leafspec_warning():
    model, x = _breaking()
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        torch.compile(model, backend="autofuse")(x)
    assert not [w for w in seen if "LeafSpec" in str(w.message)]
    # the source: torch 2.13's run_decompositions warns by itself (if this fails, torch stopped warning and the
    # filter in autofuse.quiet can go)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.export.export(MHABlock(32, 4).eval(), (x,), strict=False).run_decompositions({})
    assert [w for w in seen if re.search(LEAFSPEC_MESSAGE, str(w.message))]


def test_training_mode_dropout_through_torch_compile_draws_eagers_masks():
    """``torch.compile(backend="autofuse")`` on a training-mode block: its attention dropout fused, the dropout
    after it kept; from the same seed the output is eager's and the generator ends where eager's does."""
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop, self.lin = torch.nn.Dropout(0.2), torch.nn.Linear(32, 32)

        def forward(self, q, k, v):
            p = self.drop(torch.softmax(self.lin(q) @ k.transpose(-2, -1) * 32 ** -0.5, -1))
            return F.dropout(p @ v, 0.1, self.training)

    torch._dynamo.reset()
    model = Block().train()
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 4, 64, 32, generator=g) for _ in range(3)]
    compiled = torch.compile(model, backend="autofuse")
    runs = []
    for fn in (compiled, model):
        torch.manual_seed(3)
        runs.append((fn(*args), torch.rand(2)))
    (got, after_compiled), (want, after_eager) = runs
    (rep,) = reports(compiled)
    (d,) = rep.of("attention")
    assert d.applied and d.params["dropout_p"] == 0.2 and rep.training
    assert torch.equal(after_compiled, after_eager)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_sizes_that_change_between_calls_are_planned_per_size():
    """Dynamo makes a graph dynamic after a size changes (the size becomes a symbol, passed as an input): the
    backend plans that graph at each concrete size it meets, and a size seen before reuses its plan."""
    torch._dynamo.reset()
    block = MHABlock(32, 4).eval()
    compiled = torch.compile(block, backend="autofuse")
    with torch.no_grad():
        for seq in (16, 24, 40, 24):
            x = torch.randn(2, seq, 32)
            torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=1e-4)   # fp32: reassociation only
    rs = reports(compiled)
    assert len(rs) == 3 and all(len(r.of("attention")) == 1 and r.of("attention")[0].applied for r in rs)
    assert any(isinstance(x, torch.SymInt) or any(isinstance(d, torch.SymInt) for d in getattr(x, "shape", ()))
               for g in graphs(compiled)[1:] for x in [n.meta.get("example_value") for n in g.graph_module.graph.nodes
                                                      if n.op == "placeholder"]), "Dynamo made the graph dynamic"


def test_a_graph_break_at_a_data_dependent_size_fuses_the_graph_after_it_per_size():
    from test_data_dependent import Selected, _inputs
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Selected().eval()
    compiled = torch.compile(model, backend="autofuse")
    with torch.no_grad():
        for seed in range(3):
            x = _inputs(seed)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)   # fp32 sums of 64 rows
    fused = [d.pattern for r in reports(compiled) for d in r.applied]
    assert "rms_norm" in fused and "vector_chain" in fused


def test_experts_weights_that_dynamo_passes_as_graph_inputs_still_fuse():
    """Dynamo hands a module's parameters to the backend as graph inputs, not attributes: an experts block reads
    its weights from those inputs (transformers' grouped_mm form, and the dense form), fused and equal to eager;
    before, the experts templates took only attributes and the blocks stayed op by op under torch.compile."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_dense_experts import GENERIC_OFF, DenseExperts, _inputs
    from test_moe_patterns import _build
    model, ids = _build("mixtral", "grouped_mm", "sdpa")
    dense = DenseExperts(E=8, k=2).eval()
    x, logits = _inputs(12, 8, 16, torch.float32)
    for m, args, kwargs, opts in ((model, (ids,), {"use_cache": False}, {}),
                                  (dense, (x, logits), {}, {"fusion_switches": GENERIC_OFF})):
        compiled = torch.compile(m, backend=Backend(**opts))
        with torch.no_grad():
            got, want = compiled(*args, **kwargs), m(*args, **kwargs)
        got, want = (getattr(got, "logits", got), getattr(want, "logits", want))
        experts = [d.reason_code for r in reports(compiled) for d in r.decisions if d.pattern == "moe_experts"]
        assert experts and set(experts) == {"fused"}, experts
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)   # fp32 kernels vs eager: summation orders


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return -g


class _TanhGeluSlope(_TanhGelu):
    """A near miss: the backward leaves out the tanh's own slope (a straight-through tanh), not the derivative."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return (0.5 * (1 + t) + 0.5 * x * (0.79788456 + 0.1070322243 * x * x)) * g


class _SplitSign(torch.autograd.Function):
    """Two outputs, the second not differentiable (marked so), the gradient given through the first only."""

    @staticmethod
    def forward(ctx, x):
        s = torch.sign(x)
        ctx.mark_non_differentiable(s)
        ctx.save_for_backward(s)
        return x * s, s

    @staticmethod
    def backward(ctx, g, _):
        (s,) = ctx.saved_tensors
        return g * s


class _FunctionMLP(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.up, self.down, self.norm = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16), torch.nn.LayerNorm(16)

    def forward(self, x):
        h = self.fn.apply(self.up(x))
        if isinstance(h, tuple):
            h = h[0] + h[1]
        return self.norm(self.down(h) + x)


def _compiled_step(fn, dtype, model_class=None):
    """A training step of ``_FunctionMLP(fn)`` (or ``model_class(fn)``) through torch.compile, eagerly, and eagerly
    in float64: ``(fused, eager, float64)`` as (model, output) pairs, the autofuse warnings the compiled call raised,
    and the compiled model."""
    import copy
    torch.manual_seed(0)
    model = (model_class or _FunctionMLP)(fn).to(dtype)
    eager, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.randn(4, 8, 16, dtype=dtype)
    compiled = torch.compile(model, backend="autofuse")
    runs = []
    for m, run, arg in ((model, compiled, x), (eager, eager, x), (exact, exact, x.double())):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = run(arg)
        out.double().square().sum().backward()
        runs.append((m, out))
        if run is compiled:
            warned = [str(w.message) for w in caught if "autofuse" in str(w.message)]
    return runs, warned, compiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", [_TanhGelu, _SplitSign])
def test_a_custom_function_whose_backward_is_its_derivative_fuses_through_compile(fn, dtype):
    """A custom autograd.Function applied with grad whose backward gives its forward's derivative (BLOOM's GeLU)
    made the whole graph run unfused through torch.compile; fuse() captures such a Function, checked the same way.
    Its forward's ops now take the node's place and the graph fuses around and through it: the output and every
    gradient within the verifier's bound (twice eager's own error against float64)."""
    from autofuse.verify import compare
    ((model, got), (eager, want), (exact, ref)), warned, compiled = _compiled_step(fn, dtype)
    assert not warned
    assert [d for r in autofuse.reports(compiled) for d in r.applied], "the graph was fused"
    ok, err, tol = compare(want, ref, got)
    assert ok, ("output", err, tol)
    for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), exact.parameters()):
        ok, err, tol = compare(q.grad, r.grad, p.grad)
        assert ok, (name, err, tol)


class _RoundSTE(torch.autograd.Function):
    """A straight-through estimator: rounds in the forward, passes the gradient unchanged; the rounding's remainder
    is a second output, not differentiable."""

    @staticmethod
    def forward(ctx, x):
        r = torch.round(x * 4) / 4
        rest = x - r
        ctx.mark_non_differentiable(rest)
        return r, rest

    @staticmethod
    def backward(ctx, g, _):
        return g


class _ReverseMLP(_FunctionMLP):
    """The gradient reversal of a domain-adversarial network, between two blocks that fuse."""

    def forward(self, x):
        return self.norm(self.down(_Reverse.apply(torch.nn.functional.gelu(self.up(x)))) + x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", [_TanhGeluSlope, _RoundSTE, _Reverse])
def test_a_custom_function_whose_backward_is_not_its_derivative_keeps_it_and_fuses_around_it(fn, dtype):
    """A Function whose backward is not its forward's derivative (a backward that leaves out the tanh's slope, a
    straight-through rounding, a gradient reversal) is the user's choice of gradient: the whole graph ran unfused
    through torch.compile. It now runs as one op with its own backward (autofuse_grad::custom_function) and the rest
    fuses: output and gradients within the verifier's bound of the float64 model (whose Function's backward is the
    same; autograd's derivative of the forward would be off by O(1): the slope's term, 1 against 0 through a
    rounding, the sign)."""
    from autofuse.verify import compare
    model_class = _ReverseMLP if fn is _Reverse else _FunctionMLP
    ((model, got), (eager, want), (exact, ref)), warned, compiled = _compiled_step(fn, dtype, model_class)
    assert not warned
    assert [d for r in autofuse.reports(compiled) for d in r.applied], "the graph was fused"
    plans = [p for g in graphs(compiled) for p in g.fused.plans.values()]
    assert any(n.target is CUSTOM_FUNCTION for p in plans for n in p.captured.graph_module.graph.nodes)
    said = [w for r in autofuse.reports(compiled) for w in r.warnings if "custom autograd.Function" in w]
    assert len(said) == 1 and ".apply(" in said[0] and "test_backend.py" in said[0], said
    ok, err, tol = compare(want, ref, got)
    assert ok, ("output", err, tol)
    for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), exact.parameters()):
        ok, err, tol = compare(q.grad, r.grad, p.grad)
        assert ok, (name, err, tol)


@pytest.mark.parametrize("fn", [_TanhGelu, _TanhGeluSlope])
def test_a_custom_function_in_a_graph_dynamo_made_dynamic_is_inlined_or_kept_as_at_fixed_sizes(fn):
    """Called at a second length, Dynamo compiles the graph with a symbolic length and passes the Function that
    size as an argument: the derivative check ran on symbolic shapes (not checkable: the Function was kept, or the
    whole graph ran unfused, warned of, when the size stopped the keeping too). Both now hold at every length: the
    check runs at the compiling call's sizes, and the kept op takes the sizes beside its tensors. Output and
    gradients within fp32 rounding of eager's at each length (the same parameters, the same inputs)."""
    import copy
    torch.manual_seed(0)
    model = _FunctionMLP(fn)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="autofuse")
    for length in (8, 6, 10):
        x = torch.randn(4, length, 16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = compiled(x)
        assert not [w for w in caught if "autofuse" in str(w.message)], length
        want = eager(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)     # fp32 kernels vs eager: summation orders
        got.square().sum().backward()
        want.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=f"{length}: {name}")   # fp32 sums
            p.grad, q.grad = None, None
    plans = [p for g in graphs(compiled) for p in g.fused.plans.values()]
    assert len(plans) == 3 and all(p.report.applied for p in plans)
    kept = [n for p in plans for n in p.captured.graph_module.graph.nodes if n.target is CUSTOM_FUNCTION]
    assert len(kept) == (0 if fn is _TanhGelu else 3)


def test_a_kept_function_compiled_again_is_registered_once():
    """Each Dynamo compile of a graph applying a kept Function registered its two graphs again, for the process's
    life; the same graphs from the same line now share one entry (a reset and the same model compiled again)."""
    from autofuse.grad_ops import CUSTOM_FUNCTIONS
    torch.manual_seed(0)
    model, x = _FunctionMLP(_TanhGeluSlope), torch.randn(4, 8, 16)
    counts = []
    for _ in range(2):
        torch._dynamo.reset()
        torch.compile(model, backend="autofuse")(x).sum().backward()
        counts.append(len(CUSTOM_FUNCTIONS))
    assert counts[1] == counts[0]


class _DoubleInPlace(torch.autograd.Function):
    """Doubles its input in place (``ctx.mark_dirty``), with a backward of its own choosing."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 3


def test_a_custom_function_that_marks_an_output_dirty_still_runs_its_graph_unfused():
    """The near miss of the kept op: an in-place Function (its output marked dirty) is neither inlined nor kept;
    its graph runs as Dynamo gave it, warned of, with the Function's own gradient (3, not the doubling's 2)."""
    import copy

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.gelu(_DoubleInPlace.apply(self.l(x) * 1.0)) * 2 + 1

    torch.manual_seed(0)
    model, x = M(), torch.randn(4, 8)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="autofuse")
    with pytest.warns(UserWarning, match=r"custom autograd\.Function .*_DoubleInPlace\.apply.* runs unfused"):
        compiled(x).sum().backward()
    eager(x).sum().backward()
    assert not reports(compiled)
    assert torch.equal(model.l.weight.grad, eager.l.weight.grad)


def test_a_custom_functions_non_differentiable_output_stays_so():
    """``ctx.mark_non_differentiable`` holds through the kept op: the remainder needs no grad, as in eager."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(8, 8)

        def forward(self, x):
            r, rest = _RoundSTE.apply(self.l(x))
            return r.relu() * 2, rest

    torch.manual_seed(0)
    model, x = M(), torch.randn(4, 8)
    compiled = torch.compile(model, backend="autofuse")
    r, rest = compiled(x)
    want_r, want_rest = model(x)
    plans = [p for g in graphs(compiled) for p in g.fused.plans.values()]
    assert any(n.target is CUSTOM_FUNCTION for p in plans for n in p.captured.graph_module.graph.nodes)
    assert r.requires_grad and not rest.requires_grad and not want_rest.requires_grad
    torch.testing.assert_close(rest, want_rest)     # the same ops on the same values


def test_mark_dynamic_inputs_are_planned_per_size():
    """torch._dynamo.mark_dynamic hands the backend a symbolic graph and leaves its mark on the input tensor; the
    capture sets the mark aside and plans at each concrete size (before, the block key held a SymInt)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = MHABlock(32, 4).eval()
    compiled = torch.compile(block, backend="autofuse")
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 16, 32)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=1e-4)   # fp32: reassociation only
            assert x._dynamo_dynamic_indices == {0}             # the user's mark is put back
    rs = reports(compiled)
    assert len(rs) == 2 and all(r.of("attention")[0].applied for r in rs)


def test_compile_mode_and_options_reach_the_backend():
    """torch.compile passes ``mode`` and ``options`` to the backend: options are engine settings, a mode (an Inductor
    schedule) is accepted with a warning, and an unknown option is named."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).eval()
    x = torch.randn(2, 16)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="autofuse", options={"target_device": "ascend910b",
                                                                   "optimization_level": "O1"})
    compiled(x)
    assert reports(compiled)[-1].device == "ascend910b" and reports(compiled)[-1].optimization_level == "O1"
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="mode='max-autotune' is Inductor's"):
        torch.testing.assert_close(torch.compile(model, backend="autofuse", mode="max-autotune")(x), model(x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"options=\): no option 'level'; the options are target_device, "
                                        r"optimization_level"):
        torch.compile(model, backend="autofuse", options={"level": "O2"})(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"no option 'optimisation_level' \(did you mean 'optimization_level'\?\)"):
        torch.compile(model, backend="autofuse", options={"optimisation_level": "O2"})(x)


def test_batchnorm_trains_through_compile_as_eager():
    """Dynamo passes a BatchNorm's running statistics as graph inputs, updated in place after the graph; its
    backward saved them, so the update goes through .data as eager's kernel's does (before, backward raised
    'modified by an inplace operation')."""
    import copy
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).train()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="autofuse")
    for step in range(2):
        x = torch.randn(2, 3, 8, 8)
        y, y_ref = compiled(x), ref(x)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-4)     # fp32: reassociation only
        y.square().sum().backward()
        y_ref.square().sum().backward()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)   # running statistics as eager's
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)   # fp32 sums over 72 pixels


def test_dynamic_true_fuses_norms_and_follows_a_changed_eps():
    """With dynamic=True Dynamo passes a norm's eps as a 0-d tensor read with .item() (a changed eps then needs no
    recompile): the backend takes it as the Python float it is, so the norm fuses (before, the graph could not be
    captured and ran unfused) and a changed eps is a new plan."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.LayerNorm(16)).eval()
    compiled = torch.compile(model, backend="autofuse", dynamic=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)         # no graph runs unfused
        for seq, eps in ((8, 1e-5), (12, 1e-5), (12, 0.5)):
            model[2].eps = eps
            x = torch.randn(2, seq, 16)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)    # fp32 reassociation only
    fused = [d.pattern for r in reports(compiled) for d in r.applied]
    assert "matmul+layer_norm" in fused or "layer_norm" in fused, fused


class _BreaksAfterAProjection(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.n = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)

    def forward(self, x):
        h = torch.relu(self.l(x))
        print("shape", h.shape)         # a graph break that reads the sizes
        return self.n(h + x)


def test_a_graph_that_hands_back_its_size_symbols_is_fused():
    """After a size change, the graph before a break returns the size symbols it takes (``return (s0, s1, h)``),
    which torch.export cannot take as outputs: the backend fuses the rest and hands them back (before, the graph
    ran unfused with a warning)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _BreaksAfterAProjection().eval()
    compiled = torch.compile(model, backend="autofuse")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)         # no graph runs unfused
        for shape in ((2, 8, 16), (3, 5, 16), (4, 7, 16)):
            x = torch.randn(*shape)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)    # fp32 reassociation only
    assert len(reports(compiled)) >= 4


@torch._dynamo.config.patch(capture_scalar_outputs=True)     # .item() stays in the graph
def test_a_scalar_tensor_argument_read_with_item_is_not_taken_for_a_float():
    """Only the floats Dynamo wraps as tensors are taken as Python floats; a 0-d tensor the caller passes (a
    timestep), read with .item() inside the graph, stays a tensor input, so a new value is no new plan."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n = torch.nn.LayerNorm(16)

        def forward(self, x, t):
            return self.n(x) * t.item()

    torch._dynamo.reset()
    model = Scaled().eval()
    compiled = torch.compile(model, backend="autofuse", dynamic=True)
    x = torch.randn(2, 16)
    with torch.no_grad():
        for v in (0.5, 1.5, 2.5):
            t = torch.tensor(v, dtype=torch.float64)
            torch.testing.assert_close(compiled(x, t), model(x, t), atol=1e-6, rtol=1e-5)   # fp32 reassociation
    assert all(len(g.fused.plans) <= 1 for g in graphs(compiled))



def test_torchs_encoder_fast_path_fuses_through_compile():
    # in eval without grad Dynamo captures nn.TransformerEncoderLayer as torch's fused kernel
    # (_transformer_encoder_layer_fwd), which no pattern sees: the backend runs it as the ops it computes, and
    # the layers fuse with eager's values (eager runs the fast path too)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=True, activation="gelu")
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x, pad = torch.randn(2, 8, 32), torch.zeros(2, 8, dtype=torch.bool)
    pad[1, -3:] = True
    torch._dynamo.reset()
    compiled = torch.compile(enc, backend="autofuse")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fast-path")
        got = compiled(x, src_key_padding_mask=pad)
        want = enc(x, src_key_padding_mask=pad)
    (g,) = graphs(enc)
    assert "_transformer_encoder_layer_fwd" not in g.graph_module.code
    r = reports(enc)[-1]
    assert [d.pattern for d in r.applied].count("attention") == 2, r.summary()
    # two layers of fp32 roundings on values of order 1, in another order than the kernel's (6e-7 measured)
    assert torch.allclose(got, want, atol=4e-6), (got - want).abs().max()


def test_a_graph_calling_torchs_fast_path_kernel_says_it_is_opaque():
    # the same kernel called by a forward fused directly: it runs as torch's own, unfused, and the report and a
    # warning say so and what fuses the layer
    torch.manual_seed(0)

    class Direct(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=True).eval()

        def forward(self, x):
            m = self.layer
            a = m.self_attn
            return torch._transformer_encoder_layer_fwd(
                x, a.embed_dim, a.num_heads, a.in_proj_weight, a.in_proj_bias, a.out_proj.weight, a.out_proj.bias,
                False, False, m.norm1.eps, m.norm1.weight, m.norm1.bias, m.norm2.weight, m.norm2.bias,
                m.linear1.weight, m.linear1.bias, m.linear2.weight, m.linear2.bias, None, None)

    x = torch.randn(2, 8, 32)
    with torch.no_grad(), pytest.warns(UserWarning, match="set_fastpath_enabled"):
        fused = autofuse.AutoFusionEngine.fuse(Direct().eval(), (x,))
    assert not fused.report.applied
    assert any("_transformer_encoder_layer_fwd" in w for w in fused.report.warnings), fused.report.warnings


class _SlicedBy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.n = torch.nn.LayerNorm(32)

    def forward(self, x, n: int):
        return self.n(x[:, n:] * 2).softmax(-1)


def test_a_slice_by_an_int_argument_that_changed_fuses_per_value():
    """After an int argument changes, Dynamo passes it as a symbol (automatic dynamic); a graph that slices by it
    fuses, one plan per value, equal to eager. Before, its capture failed inside torch (torch.export runs a
    GraphModule through an fx Interpreter, bypassing the stand-in that keeps ints as given) and the graph ran
    unfused for good, with a hint that blamed the model."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _SlicedBy().eval()
    compiled = torch.compile(model, backend="autofuse")
    x = torch.randn(2, 8, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)         # no graph runs unfused
        for n in (0, 3, 1, 3):
            torch.testing.assert_close(compiled(x, n), model(x, n), atol=1e-5, rtol=1e-4)   # fp32 reassociation
    rs = reports(compiled)
    assert len(rs) == 3 and all(r.applied for r in rs), [r.summary() for r in rs]
    assert any(isinstance(n.meta.get("example_value"), torch.SymInt) for g in graphs(compiled)
               for n in g.graph_module.graph.nodes if n.op == "placeholder"), "Dynamo made the int a symbol"
    with torch.no_grad(), warnings.catch_warnings():       # dynamic=True: every int a symbol from the first call
        warnings.simplefilter("error", UserWarning)
        torch._dynamo.reset()
        model = _SlicedBy().eval()                         # its own reports
        compiled = torch.compile(model, backend="autofuse", dynamic=True)
        for n in (2, 5):
            torch.testing.assert_close(compiled(x, n), model(x, n), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(compiled(x[:, :6], n), model(x[:, :6], n), atol=1e-5, rtol=1e-4)
    assert len(reports(compiled)) == 4 and all(r.applied for r in reports(compiled))


def test_a_llamas_logits_to_keep_that_changed_fuses():
    """transformers' ``logits_to_keep`` is an int the model slices its hidden states by: a second value makes it a
    symbol in Dynamo's graph, which fuses (attention and norms) and equals eager."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    compiled = torch.compile(model, backend="autofuse")
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in (1, 3):
            got = compiled(input_ids=ids, use_cache=False, logits_to_keep=k).logits
            want = model(input_ids=ids, use_cache=False, logits_to_keep=k).logits
            assert got.shape == want.shape == (2, k, 128)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)    # fp32 kernels vs eager: summation orders
    assert not [w for w in caught if "runs unfused" in str(w.message)], [str(w.message) for w in caught]
    rs = reports(compiled)
    assert len(rs) == 2, [r.summary() for r in rs]
    for r in rs:
        fused = {d.pattern for d in r.applied}
        assert any("attention" in p for p in fused) and any("norm" in p for p in fused), fused


def test_a_signature_whose_capture_fails_runs_unfused_and_others_still_fuse(monkeypatch):
    """A dynamic graph planned per signature: one whose capture fails runs unfused (one warning, one attempt, not
    one per call); another signature of the same graph is still captured and fused (before, the first failure
    left the graph unfused for every later call)."""
    import autofuse.engine as engine
    from autofuse.capture import CaptureError
    real, tried = engine.compile_plan, []

    def compile_plan(model, args, kwargs, *rest, **options):
        seq = next(a for a in args if isinstance(a, torch.Tensor) and a.dim() == 3).shape[1]    # the activations
        tried.append(seq)
        if seq == 5:
            raise CaptureError("export", "capture failed: refused at length 5 for this test")
        return real(model, args, kwargs, *rest, **options)

    monkeypatch.setattr(engine, "compile_plan", compile_plan)
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = MHABlock(32, 4).eval()
    compiled = torch.compile(block, backend="autofuse")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seq in (8, 5, 5, 7, 5, 7):
            x = torch.randn(2, seq, 32)
            torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=1e-4)   # fp32: reassociation only
    unfused = [w for w in caught if "runs unfused" in str(w.message)]
    assert len(unfused) == 1 and "refused at length 5" in str(unfused[0].message)
    assert tried == [8, 5, 7], tried
    assert len(reports(compiled)) == 2


class _NumpyMask(torch.nn.Module):
    """Masks a random tenth of its rows with a mask drawn from numpy's global generator after a data-dependent
    branch (where Dynamo splits the graph), as transformers' SpecAugment draws after reading span counts."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        import numpy as np
        y = self.lin(x)
        if y.sum() > 0:
            y = y * 2
        keep = torch.from_numpy(np.random.rand(y.shape[0]) > 0.1)
        return torch.nn.functional.dropout(y * keep[:, None], 0.1)


def _seeded(f, x, seed):
    import numpy as np
    torch.manual_seed(seed)
    np.random.seed(seed)
    return f(x)


def test_a_numpy_draw_dynamo_moves_to_torchs_generator_is_warned_of_once():
    """By default Dynamo traces np.random's draw as a draw from torch's generator: the compiled model computes other
    values than eager at the same seeds. The backend says so once, naming the draw and the flag that makes it
    numpy's."""
    torch.manual_seed(0)
    model, x = _NumpyMask().train(), torch.randn(6, 8)
    compiled = torch.compile(model, backend=autofuse.backend())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(3):
            _seeded(compiled, x, seed)
    said = [str(w.message) for w in caught if "numpy's global random generator" in str(w.message)]
    assert len(said) == 1, said
    assert "np.random.rand at " in said[0] and "np.random.rand(y.shape[0])" in said[0]
    assert "torch._dynamo.config.use_numpy_random_stream = True" in said[0]


def test_with_numpy_random_stream_set_the_compiled_model_draws_as_eager():
    """With the flag the warning names, Dynamo breaks the graph at the draw and numpy makes it: the compiled model
    equals eager at the same seeds (the float64 draw reaches the next graph as an input, which runs unfused with a
    warning instead of stopping the model), and nothing is said of numpy's generator."""
    torch.manual_seed(0)
    model, x = _NumpyMask().train(), torch.randn(6, 8)
    with torch._dynamo.config.patch(use_numpy_random_stream=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend=autofuse.backend())
        for seed in range(3):
            assert torch.equal(_seeded(compiled, x, seed), _seeded(model, x, seed))
    texts = [str(w.message) for w in caught]
    assert not [t for t in texts if "numpy's global random generator" in t]
    assert any("runs unfused" in t and "use_numpy_random_stream" in t for t in texts)
