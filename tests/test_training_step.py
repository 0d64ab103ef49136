"""Training-step simulation (autofuse.training): the forward and backward traced as one graph and simulated.

Checked: the forward phase costs exactly what the forward pass alone costs (eager, generic fusion alone and
fused graphs; eval and training mode); the joint graph computes the gradients autograd computes on the
user's model; phases, errors, and that nothing of the user's (parameters, gradients, generator) changes."""
import copy
import pathlib

import pytest
import torch

from autofuse import AutoFusionEngine
from autofuse.engine import generic_only
from autofuse.models import build
from autofuse.simulate import simulate_graph
from autofuse.training import BACKWARD, FORWARD, joint_graph


def _model(name, train, dtype=torch.float32):
    torch.manual_seed(0)
    model, (args, kwargs) = build(name, layers=2, hidden=32, heads=4, kv_heads=2, seq=16, batch=2, vocab=64,
                                  dtype=dtype)
    return model.train(train), args, kwargs


def _graphs(model, args, kwargs, generic=True):
    """The captured graph ("eager"), the fused plan's ("fused") and, with ``generic``, the plan of generic fusion
    alone ("generic", a second fuse), and the graphs' inputs."""
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    p = fused.plans[next(iter(fused.plans))]
    leaves = p.captured.flatten_inputs(*args, **kwargs)
    graphs = {"eager": p.captured.graph_module, "fused": p.graph_module}
    if generic:
        graphs["generic"] = _generic_graph(model, args, kwargs)
    return graphs, leaves


def _generic_graph(model, args, kwargs):
    g = AutoFusionEngine.fuse(model, (args, kwargs), fusion_switches=generic_only())
    return g.plans[next(iter(g.plans))].graph_module


@pytest.fixture(scope="module")
def planned():
    """``planned(name, train)``: ``_model(name, train)`` and its ``_graphs``, planned once per module for the tests
    that only read them (a test that changes something takes a deepcopy); the "generic" graph (a second fuse of
    the same model) only once a test asks for it (``generic=True``). Also the model's state and requires_grad
    flags as they were before it was fused, for the test that checks fusing and simulating leave them alone."""
    cache = {}

    def get(name, train, generic=False):
        if (name, train) not in cache:
            model, args, kwargs = _model(name, train)
            before = ({k: v.clone() for k, v in model.state_dict().items()},
                      [p.requires_grad for p in model.parameters()])
            graphs, leaves = _graphs(model, args, kwargs, generic=False)
            cache[name, train] = model, args, kwargs, graphs, leaves, before
        model, args, kwargs, graphs, _, _ = cache[name, train]
        if generic and "generic" not in graphs:
            graphs["generic"] = _generic_graph(model, args, kwargs)
        return cache[name, train]
    return get


def _nano_gpt(train):
    """The examples' small GPT (nanoGPT's structure): every op it captures is one autograd dispatches as is."""
    import runpy
    mod = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "examples" / "gpt_small.py"))
    torch.manual_seed(0)
    model = mod["GPT"](vocab=64, dim=32, heads=4, layers=2).train(train)
    return model, (torch.randint(0, 64, (2, 16)),), {}


@pytest.mark.parametrize("name, train", [("nano", False), ("nano", True), ("gpt2", True), ("llama", False)])
def test_forward_phase_costs_the_forward_pass(name, train, planned):
    if name == "nano":
        graphs, leaves = _graphs(*_nano_gpt(train))
    else:
        _, _, _, graphs, leaves, _ = planned(name, train, generic=True)
    assert sorted(graphs) == ["eager", "fused", "generic"]
    for side, gm in graphs.items():
        alone = simulate_graph(gm, leaves, values=False)
        step = simulate_graph(gm, leaves, values=False, backward=True)
        assert step.phases[BACKWARD] > 0, side
        assert step.cycles == step.phases[FORWARD] + step.phases[BACKWARD]
        if name == "nano":
            # the joint graph's forward is what autograd dispatches (native_layer_norm, addmm, bmm on copies);
            # it lowers to the forward pass's launches, so the figures are equal, not close
            assert step.phases[FORWARD] == alone.cycles, side
        else:
            # transformers' position and mask code uses composite ops autograd decomposes (diff into two
            # slices, a sub and a cat): one or two extra small launches of ~3k cycles each (launch overhead on
            # a [B, S] tensor), at most 4 % of these tiny 2-layer models' forward
            assert 0 <= step.phases[FORWARD] - alone.cycles <= 0.04 * alone.cycles, side


def _autograd_grads(model, args, kwargs, joint, grads_out):
    """The gradients eager autograd gives the user's model for the joint graph's output gradients."""
    params = [t for _, t in joint.params]
    for t in params:
        t.grad = None
    out = model(*args, **kwargs)
    leaves = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)
              and o.is_floating_point() and o.requires_grad]
    torch.autograd.backward(leaves, grads_out[:len(leaves)])
    got = [t.grad.clone() for t in params]
    for t in params:
        t.grad = None
    return got


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_joint_graph_computes_autograds_gradients(name, planned):
    model, args, kwargs, graphs, leaves, _ = planned(name, False)
    for side in ("eager", "fused"):
        joint = joint_graph(graphs[side], leaves)
        jargs = joint.arguments(leaves)
        grads_out = jargs[len(joint.params) + len(joint.state) + joint.n_inputs:]
        res = simulate_graph(joint.graph_module, jargs)
        n_out = len(res.outputs) - len(joint.params)
        got = res.outputs[n_out:]
        want = _autograd_grads(model, args, kwargs, joint, grads_out)
        assert len(got) == len(want) == len([p for p in model.parameters() if p.requires_grad])
        for (pname, _), a, b in zip(joint.params, got, want):
            assert a is not None and a.shape == b.shape, pname
            if side == "eager":
                # the same aten derivative ops as autograd's; only BLAS summation order may differ (fp32)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{side} {pname}")
            else:
                # fused kernels compute in fp32 with their own accumulation order (test_autograd's bound)
                torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=f"{side} {pname}")


def test_phases_follow_the_trace_order(planned):
    _, _, _, graphs, leaves, _ = planned("gpt2", True)
    joint = joint_graph(graphs["fused"], leaves)
    phases = [n.meta["autofuse_phase"] for n in joint.graph_module.graph.nodes]
    first_bw = phases.index(BACKWARD)
    assert set(phases[:first_bw]) == {FORWARD} and set(phases[first_bw:]) == {BACKWARD}
    # the forward's fused calls are in the forward phase; gradients (mm of the weight grads) in the backward
    nodes = list(joint.graph_module.graph.nodes)
    assert any("autofuse" in str(n.target) for n in nodes[:first_bw])
    assert any(n.target == torch.ops.aten.mm.default for n in nodes[first_bw:])
    # tied weights (GPT-2's embedding and head) are one input, their gradient summed as autograd sums it
    names = [name for name, _ in joint.params]
    assert len({id(t) for _, t in joint.params}) == len(names)


def test_user_model_unchanged(planned):
    # `before` was taken from the model before it was fused (the shared plan's fixture)
    model, args, kwargs, graphs, leaves, (before, flags) = planned("gpt2", False)
    rng = torch.get_rng_state()
    simulate_graph(graphs["fused"], leaves, values=False, backward=True)
    assert torch.equal(torch.get_rng_state(), rng)   # eval mode draws nothing; output gradients are private
    assert all(p.grad is None for p in model.parameters())
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_nothing_to_train_is_an_error(planned):
    # the shared model, its captured graph and their inputs copied together (the graph holds the model's parameters)
    model, _, _, graphs, leaves, _ = planned("gpt2", False)
    model, captured, leaves = copy.deepcopy((model, graphs["eager"], leaves))
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter requires grad"):
        simulate_graph(captured, leaves, values=False, backward=True)


def test_cli_simulate_backward(capsys):
    from autofuse.cli import main
    main(["simulate", "--model", "gpt2", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "8", "--train",
          "--backward", "--top", "2"])
    out = capsys.readouterr().out
    assert "speed-up (simulated, ascend910, training step)" in out
    for phase in ("forward", "backward"):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"{phase:<8}:"))
        eager, generic, fused = (int(v.replace(",", "")) for v in line.split(":")[1].split("cycles")[0].split("/"))
        assert min(eager, generic, fused) > 0
    assert "training step: forward" in out


class _Activations(torch.nn.Module):
    """Every activation whose derivative op lowers to a generated Vector kernel, and a LayerNorm."""

    def __init__(self, d=24):
        super().__init__()
        self.lins = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(7))
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        f = torch.nn.functional
        acts = [torch.relu, f.gelu, lambda t: f.gelu(t, approximate="tanh"), f.silu, torch.sigmoid, torch.tanh,
                lambda t: torch.softmax(t, -1)]
        for lin, act in zip(self.lins, acts):
            x = act(lin(x))
        return torch.log_softmax(self.norm(x), -1)


def test_derivative_ops_run_as_generated_kernels_that_compute_them():
    torch.manual_seed(0)
    model = _Activations()
    x = torch.randn(3, 5, 24)
    fused = AutoFusionEngine.fuse(model, (x,), fusion_switches=generic_only())
    p = fused.plans[next(iter(fused.plans))]
    res = simulate_graph(p.captured.graph_module, [x], backward=True, check=True, memo=False)
    lowered = {n.target: n for n in res.nodes if n.phase == BACKWARD and n.kernels[:1] == ("vector_program",)}
    want = {"threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
            "_softmax_backward_data", "_log_softmax_backward_data", "native_layer_norm_backward"}
    assert {t.split(".")[1] for t in lowered} == want
    for target, n in lowered.items():
        if n.max_error is not None:       # the kernel's values against torch's (fp32 programs: last-ulp sized)
            assert n.max_error <= 1e-5, target
    assert sum(n.max_error is not None for n in lowered.values()) == len(want) - 1   # LayerNorm's is a tuple


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_gradient_program(affine):
    from autofuse.lower import _layer_norm_dx, _row_grad_program
    from autofuse.vector_program import run_program_torch
    torch.manual_seed(1)
    x, g = torch.randn(4, 6, 40), torch.randn(4, 6, 40)
    w = torch.randn(40) if affine else None
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [40], w, None, 1e-5)
    want = torch.ops.aten.native_layer_norm_backward(g, x, [40], mean, rstd, w, None, [True, False, False])[0]
    parts = [g, x, mean, rstd] + ([w] if affine else [])
    prog, order = _row_grad_program(_layer_norm_dx, parts, [])
    got = run_program_torch(prog, [parts[i] for i in order])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)   # fp32 both, different summation order


def test_layer_norm_on_an_input_that_needs_no_gradient():
    """LayerNorm straight on the graph's input: autograd asks only for the weight's and bias's gradients
    (output mask [False, True, True]), so the step runs their two reductions and no input-gradient kernel."""
    class NormFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc = torch.nn.LayerNorm(32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.fc(self.ln(x))

    torch.manual_seed(0)
    model, x = NormFirst(), torch.randn(4, 8, 32)
    fused = AutoFusionEngine.fuse(model, (x,), fusion_switches=generic_only())
    p = fused.plans[next(iter(fused.plans))]
    res = simulate_graph(p.captured.graph_module, [x], backward=True, check=True, memo=False)
    ln = [n for n in res.nodes if n.target == "aten.native_layer_norm_backward.default"]
    assert len(ln) == 1 and ln[0].kernels == ("reduce", "reduce")
    grads = dict(zip([name for name, _ in res.joint.params], res.outputs[1:]))
    model(x).backward(res.joint.arguments([x])[-1])            # the step's output gradient
    assert sorted(grads) == sorted(name for name, _ in model.named_parameters())
    for name, prm in model.named_parameters():
        torch.testing.assert_close(grads[name], prm.grad)      # the same aten ops on the same values


class _Attention(torch.nn.Module):
    """Self-attention through SDPA: causal, or under a bool mask buffer."""

    def __init__(self, dim, heads, mask):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.register_buffer("mask", mask)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        f = torch.nn.functional
        out = f.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.mask is None)
        return self.proj(out.transpose(1, 2).reshape(B, S, D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_step_forward_is_the_forward_pass_and_its_backward_runs_eagers_kernels(masked, dtype):
    """On CPU, autograd dispatches SDPA to the flash kernel (and a bool mask to an additive one made for it);
    the step's forward lowers to the captured SDPA's op-by-op launches, the backward to the matmuls, softmax
    backward and elementwise launches eager's attention backward runs."""
    torch.manual_seed(0)
    S = 16
    mask = (torch.rand(S, S) > 0.3) | torch.eye(S, dtype=torch.bool) if masked else None
    model = _Attention(32, 4, mask).to(dtype)
    x = torch.randn(2, S, 32).to(dtype)
    fused = AutoFusionEngine.fuse(model, (x,), fusion_switches=generic_only())
    gm = fused.plans[next(iter(fused.plans))].captured.graph_module
    xs = [x.detach().requires_grad_(True)]
    alone = simulate_graph(gm, xs, "ascend910b")
    step = simulate_graph(gm, xs, "ascend910b", backward=True, check=True, memo=False)
    assert step.phases[FORWARD] == alone.cycles
    (fwd,) = [n for n in step.nodes if "flash_attention_for_cpu.default" in n.target]
    (bwd,) = [n for n in step.nodes if "flash_attention_for_cpu_backward" in n.target]
    (sdpa,) = [n for n in alone.nodes if "scaled_dot_product_attention" in n.target]
    assert fwd.kernels == sdpa.kernels and fwd.cycles == sdpa.cycles
    assert bwd.phase == BACKWARD and bwd.kernels == ("matmul", "matmul", "vector_program", "elementwise",
                                                     "elementwise", "matmul", "matmul")
    for n in step.nodes:     # the other kernels' values against torch's (fp32: last-ulp; fp16: stored rounding)
        if n.max_error is not None:
            assert n.max_error <= (1e-5 if dtype == torch.float32 else 1e-2), n.target


class _GroupedQueryAttention(torch.nn.Module):
    """SDPA with 4 query heads sharing 2 key/value heads (``enable_gqa``), causal."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.h, self.kvh, self.d = heads, kv_heads, dim // heads
        self.q, self.kv = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, 2 * kv_heads * self.d)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, self.kvh, self.d).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(B, S, -1)


def test_grouped_query_sdpa_is_fused_priced_and_trained():
    """Eager's grouped-query SDPA is priced with each k/v head's queries stacked (its GEMMs read k and v in
    place); the fused attention keeps the grouping; the step's forward costs what the forward pass costs."""
    torch.manual_seed(0)
    model, x = _GroupedQueryAttention(), torch.randn(2, 16, 32)
    fused = AutoFusionEngine.fuse(model, (x,))
    (att,) = fused.report.of("attention")
    assert att.reason_code == "fused" and att.params["num_kv_heads"] < att.params["num_heads"]
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), atol=1e-5, rtol=1e-4)
    p = fused.plans[next(iter(fused.plans))]
    xs = [x.detach().requires_grad_(True)]
    alone = simulate_graph(p.captured.graph_module, xs, "ascend910b")
    step = simulate_graph(p.captured.graph_module, xs, "ascend910b", backward=True)
    assert step.phases[FORWARD] == alone.cycles
    (bwd,) = [n for n in step.nodes if "flash_attention_for_cpu_backward" in n.target]
    assert bwd.kernels == ("matmul", "matmul", "vector_program", "elementwise", "elementwise", "matmul", "matmul")
    fused_step = simulate_graph(p.graph_module, xs, "ascend910b", backward=True)
    assert any(n.target == "autofuse.flash_attention_grad" for n in fused_step.nodes)
    assert fused_step.phases[BACKWARD] < step.phases[BACKWARD]
