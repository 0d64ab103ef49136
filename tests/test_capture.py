"""Capture: both routes give one aten-level form with FakeTensor meta; the user's model is untouched."""

import functools
import re

import pytest
import torch
import torch.nn as nn

from autofuse import AutoFusionEngine
from autofuse.capture import CaptureError, Captured, capture
from autofuse.graph import to_networkx


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 48)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("bias", torch.zeros(16))

    def forward(self, x, scale=1.0):
        q, k, v = self.proj(x).chunk(3, -1)
        p = self.drop(torch.softmax(q @ k.transpose(-2, -1) * scale, -1))
        return {"out": p @ v + self.bias, "probs": p}


@pytest.mark.parametrize("route", ["export", "symbolic_trace", "auto"])
def test_routes_share_one_form_and_run(route):
    model = Block().train()  # capture keeps the model's mode (dropout stays) and leaves its flags as they were
    x = torch.randn(2, 8, 16)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cap = capture(model, (x,), route=route)
    assert isinstance(cap, Captured) and cap.route == ("export" if route == "auto" else route)
    assert model.training and model.drop.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    gm = cap.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in placeholders] == ["x"]
    for n in gm.graph.nodes:  # every value has FakeTensor meta (multi-output ops: a list of them)
        if n.op != "output":
            v = n.meta["val"]
            assert all(isinstance(t, torch.Tensor) for t in (v if isinstance(v, (list, tuple)) else [v])), n
    assert all(str(n.target).startswith(("aten.", "<built-in function getitem")) for n in gm.graph.nodes
               if n.op == "call_function")
    assert {n.target for n in gm.graph.nodes if n.op == "get_attr"} == {"proj.weight", "proj.bias", "bias"}
    assert cap.training and any(n.target == torch.ops.aten.native_dropout.default for n in gm.graph.nodes)
    torch.manual_seed(0)
    want = model(x)
    torch.manual_seed(0)
    got = cap(x)             # the same dropout draws as eager: same seed, same values
    assert set(got) == {"out", "probs"}
    torch.testing.assert_close(got["out"], want["out"])
    torch.manual_seed(0)
    torch.testing.assert_close(gm(x)[0], want["out"])  # direct call: flat leaves in, flat tuple out
    model.eval()
    ev = capture(model, (x,), route=route)
    assert not ev.training and not any(n.target == torch.ops.aten.native_dropout.default for n in ev.graph_module.graph.nodes)
    torch.testing.assert_close(ev(x)["out"], model(x)["out"])


class Either(nn.Module):
    """transformers' spelling: one of two inputs, the other left at its default None, and a ``**kwargs`` left empty."""

    def __init__(self):
        super().__init__()
        self.emb, self.proj = nn.Embedding(10, 8), nn.Linear(8, 8)

    def forward(self, ids=None, embeds=None, scale=2.0, **kwargs):
        if (ids is None) == (embeds is None):
            raise ValueError("You must specify exactly one of ids or embeds")
        h = self.emb(ids) if embeds is None else embeds
        return torch.tanh(self.proj(h)) * scale


@pytest.mark.parametrize("given", ["ids", "embeds"])
def test_symbolic_trace_keeps_the_defaults_a_call_leaves(given):
    # the parameters a call does not pass are traced at their defaults (None, 2.0), not as proxies whose
    # `is None` is False
    model = Either()
    args = (torch.tensor([[1, 2, 3]]),) if given == "ids" else ()
    kwargs = {} if given == "ids" else {"embeds": torch.randn(1, 3, 8)}
    cap = capture(model, args, kwargs, route="symbolic_trace")
    torch.testing.assert_close(cap(*args, **kwargs), model(*args, **kwargs))


def test_parameters_are_shared_not_copied():
    model = Block().eval()
    cap = capture(model, (torch.randn(2, 8, 16),))
    gm = cap.graph_module
    assert gm.get_parameter("proj.weight") is model.proj.weight
    assert gm.get_parameter("proj.weight").data_ptr() == model.proj.weight.data_ptr()
    assert gm.get_buffer("bias").data_ptr() == model.bias.data_ptr()
    with torch.no_grad():
        model.proj.weight.add_(1.0)  # an update of the user's model is seen by the captured module
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(cap(x)["out"], model.eval()(x)["out"])


def test_kwargs_and_non_tensor_leaves():
    model = Block().eval()
    x = torch.randn(2, 8, 16)
    cap = capture(model, (x,), {"scale": 0.5})
    assert len([n for n in cap.graph_module.graph.nodes if n.op == "placeholder"]) == 2
    torch.testing.assert_close(cap(x, scale=0.5)["out"], model(x, scale=0.5)["out"])
    with pytest.raises(TypeError, match="captured structure"):
        cap(x)


def test_meta_model_capture_has_shapes():
    with torch.device("meta"):
        model = Block()
    x = torch.empty(2, 8, 16, device="meta")
    cap = capture(model, (x,))
    g = to_networkx(cap.graph_module)
    sm = [d for _, d in g.nodes(data=True) if d["target"] == "aten.softmax.int"]
    assert sm and sm[0]["shape"] == (2, 8, 8) and sm[0]["dtype"] == "torch.float32"
    assert all(d["op"] and d["target"] for _, d in g.nodes(data=True))
    assert g.number_of_nodes() == len(cap.graph_module.graph.nodes)


def test_gpt2_captures_on_meta_without_data():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=768, n_head=12)
    with torch.device("meta"):
        model = transformers.GPT2Model(cfg)
    ids = torch.zeros(1, 128, dtype=torch.long, device="meta")
    cap = capture(model, (ids,), {"use_cache": False})
    out = [n for n in cap.graph_module.graph.nodes if n.op == "output"][0]
    assert tuple(out.args[0][0].meta["val"].shape) == (1, 128, 768)


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # value-dependent Python control flow
            return x + 1
        return x - 1


def test_untraceable_model_names_route_and_construct():
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(4),))
    msg = str(info.value)
    assert "route 'export'" in msg and "route 'symbolic_trace'" in msg
    assert "if x.sum() > 0" in msg and "hint" in msg
    assert isinstance(info.value, RuntimeError)


def test_single_route_error_names_only_that_route():
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(4),), route="symbolic_trace")
    assert "route 'symbolic_trace'" in str(info.value) and "route 'export'" not in str(info.value)


def test_kv_cache_output_is_captured():
    """A model that returns a KV cache (transformers' default use_cache) is captured whole: the cache's tensors
    are graph outputs and the captured structure rebuilds the cache (tests/test_kv_cache.py runs it)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaModel(cfg)
    cap = capture(model, (torch.zeros(1, 4, dtype=torch.long),), route="export")
    with torch.no_grad():
        out = cap(torch.zeros(1, 4, dtype=torch.long))
    assert isinstance(out.cache, transformers.DynamicCache) and out.cache.layers[0].keys.shape == (1, 1, 4, 16)


def test_unknown_route():
    with pytest.raises(ValueError, match="route"):
        capture(Block(), (torch.randn(2, 8, 16),), route="dynamo")


# ------------------------------------------------------------------------------------------ one trace
def _same_graph(a, b):
    """Code, every value's shape/dtype/stride, module stacks and state marks equal; the same tensors attached."""
    ga, gb = a.graph_module, b.graph_module
    assert ga.code == gb.code
    assert a.in_spec == b.in_spec and a.out_spec == b.out_spec and a.training == b.training
    for x, y in zip(ga.graph.nodes, gb.graph.nodes):
        vx, vy = x.meta.get("val"), y.meta.get("val")
        flat = lambda v: v if isinstance(v, (list, tuple)) else [v]  # noqa: E731
        for tx, ty in zip(flat(vx), flat(vy)):
            if isinstance(tx, torch.Tensor):
                assert (tx.shape, tx.dtype, tx.stride(), tx.device) == (ty.shape, ty.dtype, ty.stride(), ty.device), x
            else:
                assert tx == ty, x
        # (not stack traces: they may name another line of a multi-line expression; nothing reads them)
        for key in ("nn_module_stack", "autofuse_state"):
            assert x.meta.get(key) == y.meta.get(key), (x, key)
        if x.op == "get_attr":
            assert _get(ga, x.target) is _get(gb, y.target)


def _get(mod, dotted):
    for p in dotted.split("."):
        mod = getattr(mod, p)
    return mod


def _both(model, args, kwargs=None, route="export"):
    """The capture by one trace and by export + run_decompositions({}) (the form's definition)."""
    from autofuse import capture as cap_mod
    one = capture(model, args, kwargs, route=route)
    original = cap_mod._export_functional
    try:
        cap_mod._export_functional = cap_mod._export_retrace
        two = capture(model, args, kwargs, route=route)
    finally:
        cap_mod._export_functional = original
    return one, two


def _transformers_cases():
    pytest.importorskip("transformers")
    from autofuse.models import build
    cases = {"gpt2 (tied embeddings)": lambda: build("gpt2", layers=2, hidden=32, heads=4, seq=16),
             "llama on meta": lambda: build("llama", layers=2, hidden=64, heads=4, kv_heads=2, seq=16, meta=True),
             "bert sdpa": lambda: build("bert", layers=2, hidden=32, heads=4, seq=16, attn="sdpa")}
    return cases


@pytest.mark.parametrize("route", ["export", "symbolic_trace"])
@pytest.mark.parametrize("train", [False, True])
def test_one_trace_gives_the_graph_of_export_and_run_decompositions(route, train):
    model = Block().train(train)
    _same_graph(*_both(model, (torch.randn(2, 8, 16),), route=route))


@pytest.mark.parametrize("name", ["gpt2 (tied embeddings)", "llama on meta", "bert sdpa"])
def test_one_trace_gives_the_graph_of_export_and_run_decompositions_on_transformers(name):
    cases = _transformers_cases()
    model, (args, kwargs) = cases[name]()
    _same_graph(*_both(model, args, kwargs))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_one_trace_matches_on_more_architectures(impl):
    pytest.importorskip("transformers")
    from test_moe_patterns import _build
    from test_more_architectures import MODELS
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model, args, kwargs = make(impl)
        _same_graph(*_both(model.eval(), args, kwargs))
    for name in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        for experts in ("grouped_mm", "batched_mm"):
            model, ids = _build(name, experts, impl)
            _same_graph(*_both(model, (ids,), {"use_cache": False}))


def _kernels_seen(ops):
    """Each op's Python kernels and fake-tensor rule, by what they run: a callable by its function (a partial's
    by its function and keywords), so torch's and autofuse's contexts compare though they make their own."""
    from torch._subclasses.fake_impls import op_implementations_dict

    def seen(fn):
        if isinstance(fn, functools.partial):
            return seen(fn.func), tuple(sorted((k, seen(v)) for k, v in fn.keywords.items()))
        return getattr(fn, "__qualname__", fn) if callable(fn) else fn
    return {op: ({k: seen(v) for k, v in op.py_kernels.items()}, op in op_implementations_dict) for op in ops}


def test_the_composite_context_sets_every_kernel_torchs_own_sets_and_puts_them_back():
    """autofuse's cheaper context for keeping composite ops whole (:mod:`autofuse.composite`) mirrors torch's: for
    every preservable op, the same kernels under the same dispatch keys (and the same fake-tensor rules) inside
    it, and each op's own kernels, the very objects, after it."""
    from torch.export.exported_program import (_override_composite_implicit_decomp,
                                               _split_decomp_table_to_cia_and_python_decomp)

    from autofuse import composite
    assert composite.mirrors_torch() == torch.__version__.startswith("2.13.")   # the torch it was written for
    ops = composite.preserved_ops()
    # torch's list but instance_norm, which writes its running statistics unannounced (decomposed instead)
    torch_ops = _split_decomp_table_to_cia_and_python_decomp({})[0]
    assert torch.ops.aten.instance_norm.default in torch_ops and torch.ops.aten.instance_norm.default not in ops
    assert ops == {op: m for op, m in torch_ops.items() if op not in composite.MUTATING_UNTAGGED} and len(ops) > 100
    before = {op: dict(op.py_kernels) for op in ops}
    with _override_composite_implicit_decomp(ops):
        torchs = _kernels_seen(ops)
    with composite._kept(ops):
        ours = _kernels_seen(ops)
    assert ours == torchs
    after = {op: dict(op.py_kernels) for op in ops}
    assert all(after[op].keys() == before[op].keys() and all(after[op][k] is before[op][k] for k in before[op])
               for op in ops)
    assert _kernels_seen(ops) != ours                          # (the comparison sees a kept op's kernels)


def test_with_another_torch_the_capture_uses_torchs_own_composite_context(monkeypatch):
    """Where torch's function is not the one mirrored, torch's context runs, and the capture is the same."""
    from autofuse import composite
    model, x = Block(), torch.randn(2, 8, 16)
    ours = capture(model, (x,), route="export")
    used = []
    monkeypatch.setattr(composite, "mirrors_torch", lambda: False)
    monkeypatch.setattr(composite, "_kept", lambda ops: used.append(ops))     # would fail if it were entered
    _same_graph(capture(model, (x,), route="export"), ours)
    assert not used


def test_a_composite_op_registered_after_a_capture_is_kept_whole_by_the_next():
    """The list of preservable ops is kept between captures while nothing is registered: a custom op with a
    composite kernel registered later is listed, and the next capture keeps it whole as torch's export does."""
    from autofuse import composite
    capture(nn.Linear(4, 4), (torch.randn(2, 4),))
    lib = torch.library.Library("autofuse_composite_test", "FRAGMENT")       # noqa: TOR901 - the API under test
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
    op = torch.ops.autofuse_composite_test.twice.default
    assert op in composite.preserved_ops()

    class Twice(nn.Module):
        def forward(self, x):
            return torch.ops.autofuse_composite_test.twice(x) + 1
    one, two = _both(Twice(), (torch.randn(3),))
    _same_graph(one, two)
    assert [n.target for n in one.graph_module.graph.nodes if n.op == "call_function"][0] is op


def test_a_copy_into_a_view_is_captured_trainable():
    """``h[:, 0] = ...`` (as Qwen3-Next's gated delta rule writes its chunks) is functionalized to ``aten.copy``,
    which has no derivative; capture spells it as a broadcast copy, so the fused model trains like eager."""
    from autofuse import AutoFusionEngine

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            h = torch.zeros(x.shape[0], 3, 8)
            h[:, 0] = self.a(x)
            h[:, 1] = self.b(x)                      # broadcast along the last dim
            h[:, 2] = self.a(x).double()             # a cast
            return torch.tanh(h).sum(1) * 2.0

    torch.manual_seed(0)
    m = M().train()
    x = torch.randn(4, 8)
    gm = capture(m, (x,)).graph_module
    assert not [n for n in gm.graph.nodes if n.target == torch.ops.aten.copy.default]
    f = AutoFusionEngine.fuse(m, (x,))
    w = torch.randn(4, 8)
    grads = []
    for fn in (f, m):
        m.zero_grad()
        (fn(x) * w).sum().backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)   # fp32 sums of 4 rows: reassociation only


def test_a_capture_limit_is_not_called_an_error_of_the_forward():
    """BatchNorm with momentum=None reads its batch count (.item()): eager runs, both routes stop at the same
    data-dependent read. The hint names that construct and does not say the forward raises on its inputs."""
    from autofuse.capture import CaptureError
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8, momentum=None)).train()
    x = torch.randn(4, 8)
    model(x)                                    # eager runs
    with pytest.raises(CaptureError) as e:
        capture(model, (x,))
    assert "raises on these inputs" not in str(e.value)
    # located in torch's own code, with the argument that decides the read (not a branch of the user's)
    assert re.search(r"inside torch's own module code at torch/nn/modules/batchnorm.py:\d+ in forward", str(e.value))
    assert "momentum=None" in str(e.value)


def test_a_fake_quantize_reading_its_flags_is_located_in_its_own_code():
    """torch.ao's FakeQuantize branches on its enable flags (buffers): the capture error points at that line in
    torch/ao, not at the Sequential that called it, and the hint names the construct."""
    import torch.ao.quantization as tq
    from autofuse.capture import CaptureError
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), tq.FakeQuantize()).train()
    x = torch.randn(4, 8)
    model(x)                                    # eager runs
    with pytest.raises(CaptureError) as e:
        capture(model, (x,))
    assert re.search(r"inside torch's own module code at torch/ao/quantization/fake_quantize.py:\d+ in forward: "
                     r"if self.observer_enabled\[0\] == 1", str(e.value))
    assert "FakeQuantize reads its enable flags" in str(e.value) and "raises on these inputs" not in str(e.value)


class _Out:
    """An output class of the user's own, not registered as a pytree."""

    def __init__(self, a):
        self.a = a


def test_an_unregistered_output_class_and_a_device_mismatch_get_their_own_hints():
    """Both said the forward raises the error itself when run eagerly, which it does not."""
    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            return _Out(self.l(x).relu())
    with pytest.raises(CaptureError, match=r"register_dataclass") as e:
        capture(Returns(), (torch.randn(2, 8),))
    assert "raises on these inputs itself" not in str(e.value)
    with pytest.raises(CaptureError, match=r"different devices.*model\.to\('meta'\)") as e:
        capture(nn.Sequential(nn.Linear(8, 8), nn.GELU()), (torch.randn(2, 8, device="meta"),))
    assert "raises on these inputs itself" not in str(e.value)


is_torchdynamo_compiling = torch.compiler.is_compiling      # transformers.utils' name for it


class _MaskOnlyWhenEager(nn.Module):
    """transformers' LongT5 and SwitchTransformers stacks: a default mask is built only outside compilation."""

    def forward(self, x, mask=None):
        if mask is None and not is_torchdynamo_compiling():
            mask = torch.ones_like(x)
        return x * mask[:, :1]


class _NoneForAnotherReason(nn.Module):
    def forward(self, x, mask=None):
        if mask is None and not is_torchdynamo_compiling():
            pass                                             # no default built: eager fails too
        return x * mask[:, :1]


def test_a_default_built_only_when_not_compiling_is_named_with_what_to_pass():
    """The tracer's bare "'NoneType' object is not subscriptable" said nothing of why eager runs. (The default
    route captures this small module by symbolic_trace, which is not compiling; transformers' models it cannot.)"""
    x = torch.randn(2, 4)
    with pytest.raises(CaptureError, match=r"hint: _MaskOnlyWhenEager\.forward builds a default mask only when not "
                                           r"compiling .*pass mask in the example inputs.*torch\.compile"):
        capture(_MaskOnlyWhenEager(), (x,), route="export")
    mask = torch.ones_like(x)
    assert torch.equal(capture(_MaskOnlyWhenEager(), (x,), {"mask": mask}, route="export")(x, mask=mask),
                       _MaskOnlyWhenEager()(x))
    with pytest.raises(CaptureError) as e:
        capture(_MaskOnlyWhenEager(), (x,), route="export")
    assert e.value.defaults_skipped == ("mask",)                # what a caller may pass and try again with
    with pytest.raises(CaptureError) as e:                   # near miss: the frame builds no default
        capture(_NoneForAnotherReason(), (x,), route="export")
    assert "NoneType" in str(e.value) and "builds a default" not in str(e.value) and not e.value.defaults_skipped


def test_switch_transformers_without_an_attention_mask_is_told_to_pass_one():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.SwitchTransformersConfig(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                num_decoder_layers=1, num_heads=4, num_experts=2)
    model = transformers.SwitchTransformersModel(cfg).eval()
    ids = torch.randint(0, 99, (2, 8))
    with pytest.raises(CaptureError, match=r"SwitchTransformersStack\.forward builds a default attention_mask only "
                                           r"when not compiling.*attention_mask=torch\.ones_like\(input_ids\)"):
        capture(model, (ids,), {"decoder_input_ids": ids})
    kwargs = {"attention_mask": torch.ones_like(ids), "decoder_input_ids": ids}      # what the hint says to pass
    fused = AutoFusionEngine.fuse(model, ((ids,), kwargs))
    assert [d for d in fused.report.decisions if d.applied and d.pattern == "attention"]
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, **kwargs).last_hidden_state, model(ids, **kwargs).last_hidden_state,
                                   rtol=1e-5, atol=1e-5)   # fp32 fused attention vs eager: summation order only


def test_a_data_parallel_wrapper_and_record_function_ranges_capture():
    """nn.DataParallel wraps its forward in a profiler range (record_function): its enter and exit nodes only label
    a profile, and capture failed on them ("nodes without meta['val']")."""
    from autofuse import AutoFusionEngine

    class Labelled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            with torch.autograd.profiler.record_function("labelled"):
                return torch.relu(self.lin(x))
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    for model in (nn.DataParallel(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))), Labelled()):
        fused = AutoFusionEngine.fuse(model, (x,))
        assert fused.report.applied
        # fp32: one fused matmul epilogue against eager's ops, values below about 4
        assert (fused(x) - model(x)).abs().max() <= 1e-5


@pytest.mark.parametrize("kind", ["int64_input", "half_model"])
def test_a_matmul_of_two_dtypes_is_refused_at_capture_as_eager_refuses_it(kind):
    """The tracer's fake tensors let a product of two dtypes through; fuse() then planned an int64 input into a
    float model (failing at the first call) and failed in verification, with torch's node dump, for an fp32 input
    into a half model."""
    from autofuse import AutoFusionEngine
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    x = torch.randint(0, 4, (4, 16)) if kind == "int64_input" else torch.randn(4, 16)
    if kind == "half_model":
        model = model.half()
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        model(x)
    with pytest.raises(CaptureError, match=r"multiplies (int64 and float32|float32 and float16) tensors.*"
                                           r"hint: give example inputs in the model's dtype"):
        AutoFusionEngine.fuse(model, (x,))


class _ScriptedInner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.l(x))


class _WithScriptedPart(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.jit.script(_ScriptedInner())

    def forward(self, x):
        return torch.nn.functional.layer_norm(self.inner(x) + x, (16,))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_a_torchscript_submodule_is_captured_and_fused():
    """A submodule compiled with torch.jit.script is traced through like any other (before, building the plan's
    guards failed on its class's forward, a descriptor that raises on the class)."""
    from autofuse import AutoFusionEngine
    torch.manual_seed(0)
    model, x = _WithScriptedPart().eval(), torch.randn(2, 8, 16)
    fused = AutoFusionEngine.fuse(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-6, rtol=1e-5)      # fp32 reassociation only
        fused(x)
    assert len(fused.plans) == 1 and fused.report.applied


def test_a_generator_argument_is_refused_with_what_to_do():
    """torch.export cannot trace a torch.Generator input; the error says so and what to use (before, the hint said
    the forward itself raised on these inputs, which it does not)."""
    from autofuse import AutoFusionEngine

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(16, 16)

        def forward(self, x, g):
            return torch.relu(self.l(x)) + torch.rand(x.shape, generator=g)

    with pytest.raises(CaptureError, match=r"passes a torch.Generator.*torch.manual_seed.*torch.compile"):
        AutoFusionEngine.fuse(Noisy(), (torch.randn(2, 16), torch.Generator().manual_seed(0)))



class _QuantMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.l2(torch.nn.functional.gelu(self.l1(x))) + x


class _Int8Weights(nn.Module):
    """What the refusal below suggests: the int8 weights and their scales as buffers, dequantised in torch ops."""

    def __init__(self, float_model):
        super().__init__()
        for name in ("l1", "l2"):
            w = getattr(float_model, name).weight.detach()
            scale = w.abs().amax(1, keepdim=True) / 127
            self.register_buffer(f"{name}_w", torch.round(w / scale).to(torch.int8))
            self.register_buffer(f"{name}_scale", scale)
            self.register_buffer(f"{name}_b", getattr(float_model, name).bias.detach().clone())

    def forward(self, x):
        def lin(name, h):
            w = getattr(self, f"{name}_w").to(h.dtype) * getattr(self, f"{name}_scale")
            return torch.nn.functional.linear(h, w, getattr(self, f"{name}_b"))
        return lin("l2", torch.nn.functional.gelu(lin("l1", x))) + x


@pytest.mark.filterwarnings("ignore")          # torch.ao.quantization's deprecation warnings
@pytest.mark.parametrize("how", ["dynamic_qint8", "dynamic_float16", "static"])
def test_a_quantized_model_is_refused_naming_its_quantized_layers_and_what_to_do(how):
    """torch.ao.quantization's layers keep their weights packed in TorchScript objects, which torch's tracers
    cannot capture: the refusal names the layers and says what to do (before, it said only that a torchbind class
    had no '__obj_flatten__' and asked for a report to autofuse). The hand-written dequantisation it suggests
    fuses."""
    from autofuse import AutoFusionEngine
    import torch.ao.quantization as tq
    torch.manual_seed(0)
    float_model, x = _QuantMLP().eval(), torch.randn(4, 8, 32)
    if how == "static":
        class Stubbed(nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.quant, self.inner, self.dequant = tq.QuantStub(), inner, tq.DeQuantStub()

            def forward(self, x):
                return self.dequant(self.inner.l2(self.inner.l1(self.quant(x))))
        model = Stubbed(float_model).eval()
        model.qconfig = tq.get_default_qconfig("fbgemm")
        prepared = tq.prepare(model)
        prepared(x)
        quantized, layers = tq.convert(prepared), ("inner.l1 (QuantizedLinear)", "inner.l2 (QuantizedLinear)")
    else:
        dtype = torch.qint8 if how == "dynamic_qint8" else torch.float16
        quantized = tq.quantize_dynamic(_QuantMLP().eval(), {nn.Linear}, dtype=dtype)
        layers = ("l1 (DynamicQuantizedLinear)", "l2 (DynamicQuantizedLinear)")
    quantized(x)                                    # eager runs it
    with pytest.raises(CaptureError) as info:
        AutoFusionEngine.fuse(quantized, (x,))
    msg = str(info.value)
    assert all(layer in msg for layer in layers), msg
    assert "_packed_params" not in msg and "please report" not in msg, msg
    assert "fuse the float model" in msg and "w_int8.to(x.dtype) * scale" in msg, msg
    manual = _Int8Weights(float_model).eval()
    fused = AutoFusionEngine.fuse(manual, (x,))
    assert fused.report.applied, fused.report.summary()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), manual(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("how", ["prune", "weight_norm"])
def test_a_pruned_or_legacy_weight_normed_model_is_refused_naming_the_hook(how):
    """prune and the legacy weight_norm recompute a weight in a forward pre-hook at each call: the refusal blamed
    the forward and advised a buffer; it names the hook and the fix."""
    import torch.nn.utils.prune as prune
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    if how == "prune":
        prune.l1_unstructured(m[0], "weight", 0.5)
    else:
        torch.nn.utils.weight_norm(m[0])
    with pytest.raises(CaptureError) as info:
        capture(m, (torch.randn(2, 16),))
    msg = str(info.value)
    assert "0.weight is recomputed by the forward pre-hook" in msg and "register_buffer" not in msg
    assert "prune.remove" in msg and "torch.nn.utils.parametrizations" in msg


def test_an_input_of_an_unsupported_type_is_not_blamed_on_the_forward():
    """A Python object among the inputs: export refuses its type, and the hint said the forward raises on these
    inputs itself (eager runs them)."""
    class Cfg:
        scale = 2.0

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x, cfg):
            return self.fc(x) * cfg.scale

    with pytest.raises(CaptureError) as info:
        capture(M(), (torch.randn(2, 16), Cfg()))
    msg = str(info.value)
    assert "which the forward raises" not in msg and "register_dataclass" in msg and "is a Python object" in msg


def test_an_error_raised_only_inside_torchs_tracing_is_not_blamed_on_the_forward():
    """The hint "which the forward raises on these inputs itself" is given only where the error was raised in the
    forward's code (the user's, or a torch layer's); one raised by torch's tracing machinery alone (as torch's
    ShapeEnv raised IndexError on a Dynamo graph sliced by a symbolic int) says so instead."""
    from autofuse.capture import _capture_error

    def torch_internal_error():
        try:
            torch.broadcast_shapes((2,), (3,))                # raised in torch/functional.py
        except RuntimeError as e:
            e.__traceback__ = e.__traceback__.tb_next         # without this test's own frame
            return e

    failures = [("export", torch_internal_error()), ("symbolic_trace", torch_internal_error())]
    msg = str(_capture_error("export", nn.Linear(4, 4), failures))
    assert "which the forward raises" not in msg and "inside torch's tracing machinery" in msg, msg
    assert "run model(*example_inputs) eagerly; if that runs" in msg
    with pytest.raises(CaptureError) as info:                 # the forward's own error keeps the hint
        capture(nn.Linear(16, 16), (torch.randn(4, 7),))
    assert "which the forward raises on these inputs itself" in str(info.value)


def test_a_fused_exported_program_names_what_it_refuses_and_suggests_re_exporting():
    """fuse(ep) called with inputs the program refuses: the message names the exported program (not a
    "GraphModule"), does not send the user to model(*example_inputs), and says what to do (dynamic_shapes= for a
    size; the value for a specialised Python value); None for an input exported as a tensor is named."""
    import autofuse

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x, *, bias=None, scale=1.0):
            y = self.fc(x) * scale
            return y + bias if bias is not None else y

    torch.manual_seed(0)
    model, x, bias = M().eval(), torch.randn(2, 16), torch.randn(16)
    ep = torch.export.export(model, (x,), {"bias": bias, "scale": 2.0})
    fused = autofuse.AutoFusionEngine.fuse(ep)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, bias=bias, scale=2.0), model(x, bias=bias, scale=2.0))
        with pytest.raises(CaptureError) as info:
            fused(torch.randn(3, 16), bias=bias, scale=2.0)
        msg = str(info.value)
        assert "exported program" in msg and "dynamic_shapes=" in msg and "x.size()[0]" in msg, msg
        assert "GraphModule" not in msg and "example_inputs" not in msg and "<string>" not in msg, msg
        with pytest.raises(CaptureError) as info:
            fused(x, bias=bias, scale=3.0)
        msg = str(info.value)
        assert "scale == 2.0" in msg and "export again with this value" in msg and "example_inputs" not in msg, msg
        with pytest.raises(TypeError, match="keyword input 'bias' was exported as a tensor; this call gives None"):
            fused(x, bias=None, scale=2.0)


class _HostDraw(nn.Module):
    """Masks a random tenth of its input's rows with a mask drawn in Python, as transformers' SpecAugment does."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw

    def forward(self, x):
        keep = torch.tensor(self.draw(x.shape[0]) > 0.1)
        return x * keep[:, None]


@pytest.mark.parametrize("generator", ["numpy", "python"])
def test_a_forward_drawing_from_a_host_generator_is_refused_and_the_state_put_back(generator):
    """A draw from numpy's or Python's global generator would be a constant of the graph, the same at every call;
    the capture refuses it by name and leaves the generator as it found it (its draws are the user's)."""
    import random

    import numpy as np
    draw = (lambda n: np.random.rand(n)) if generator == "numpy" else (lambda n: np.array([random.random()
                                                                                            for _ in range(n)]))
    np.random.seed(3)
    random.seed(3)
    expected = np.random.rand(), random.random()
    np.random.seed(3)
    random.seed(3)
    name = "numpy's global random generator" if generator == "numpy" else "Python's random module"
    with pytest.raises(CaptureError, match=re.escape(f"the forward draws from {name}") + r".*hint: draw them outside"):
        capture(_HostDraw(draw), (torch.randn(16, 4),))
    assert (np.random.rand(), random.random()) == expected


class _BranchThenDraw(nn.Module):
    """A data-dependent branch, which export cannot trace, then a mask drawn with numpy's or Python's global
    generator (SpecAugment's order in wav2vec2: a span count read from data, then the draw); in training a
    BatchNorm updates its statistics. ``draw_first`` puts the draw before the branch: the trace draws, then stops."""

    def __init__(self, generator="numpy", draw_first=False):
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)
        self.generator, self.draw_first = generator, draw_first

    def draw(self, n):
        import random

        import numpy as np
        values = np.random.rand(n) if self.generator == "numpy" else np.array([random.random() for _ in range(n)])
        return torch.tensor(values > 0.1)

    def forward(self, x):
        keep = self.draw(x.shape[0]) if self.draw_first else None
        y = self.bn(self.lin(x))
        if y.sum() > 0:
            y = y * 2
        if keep is None:
            keep = self.draw(x.shape[0])
        return torch.nn.functional.dropout(y * keep[:, None], 0.1)


def _rng_states():
    import random

    import numpy as np
    kind, keys, *rest = np.random.get_state()
    return torch.get_rng_state(), (kind, keys.copy(), *rest), random.getstate()


def _same_rng_states(a, b) -> bool:
    import numpy as np
    return torch.equal(a[0], b[0]) and a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1]) and \
        a[1][2:] == b[1][2:] and a[2] == b[2]


@pytest.mark.parametrize("draw_first", [False, True], ids=["branch_first", "draw_first"])
@pytest.mark.parametrize("generator", ["numpy", "python"])
def test_a_host_draw_past_a_failing_trace_leads_the_refusal_and_nothing_of_the_user_changes(generator, draw_first):
    """Every route fails at the branch; the forward also draws from a host generator, which no capture can keep and
    torch.compile makes from torch's generator by default (numpy's): the refusal leads with the draw, seen by one
    eager call, and points to torch.compile only with the flag that makes its draws numpy's. That call, and the
    failed traces, leave the model (state_dict bit for bit, modes, attributes), the input and every generator as
    they were."""
    torch.manual_seed(0)
    model = _BranchThenDraw(generator, draw_first).train()
    model.bn.eval()                          # modes are put back module by module
    model.bn.train()
    model.lin.eval()
    x = torch.randn(6, 8)
    x_before = x.clone()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    attributes = dict(vars(model))
    rngs = _rng_states()
    with pytest.raises(CaptureError) as info:
        capture(model, (x,))
    text = str(info.value)
    name = "numpy's global random generator" if generator == "numpy" else "Python's random module"
    assert text.startswith(f"could not capture _BranchThenDraw: the forward draws from {name}"), text
    assert "hint: draw them outside the forward" in text.splitlines()[0]
    assert "route 'export' failed with GuardOnDataDependentSymNode" in text      # the branch is still named
    if generator == "numpy":
        # every mention of torch.compile says what makes its draws eager's
        assert text.count("torch.compile(model, backend='autofuse')") == \
            text.count("torch._dynamo.config.use_numpy_random_stream = True") == 2, text
    assert _same_rng_states(rngs, _rng_states())
    assert state.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert v.dtype == state[k].dtype and torch.equal(v.view(-1).view(torch.uint8),
                                                         state[k].view(-1).view(torch.uint8)), k
    assert [m.training for m in model.modules()] == modes
    assert dict(vars(model)) == attributes
    assert torch.equal(x, x_before)


def test_a_forward_that_raises_eagerly_keeps_the_tracers_message():
    """A failed capture of a forward that raises when run (here on a data-dependent branch, past which the traces do
    not go) gets the message it had, though the eager call drew from numpy's generator before raising; that
    generator is put back."""
    class Raises(nn.Module):
        def forward(self, x):
            import numpy as np
            if x.sum() > 0:
                np.random.rand(3)
                raise ValueError("positive")
            return x

    rngs = _rng_states()
    with pytest.raises(CaptureError) as info:
        capture(Raises(), (torch.ones(3),))
    assert str(info.value).startswith("could not capture Raises:\n  route 'export' failed")
    assert _same_rng_states(rngs, _rng_states())
