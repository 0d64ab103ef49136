"""Activation checkpoints kept: a call with grad runs each checkpoint's ops, fused calls included, through torch's
non-reentrant checkpoint, so the fused model keeps what eager's checkpointed model keeps for the backward (the
checkpoints' inputs) and recomputes the rest; its gradients are eager's."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import autofuse
from autofuse import AutoFusionEngine
from autofuse.checkpointing import Checkpointed
from autofuse.verify import compare


class Layer(nn.Module):
    """RMSNorm, a projection with GELU, a projection and the residual add: fused as a norm region and two
    epilogues."""

    def __init__(self, d=32, p=0.0):
        super().__init__()
        self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.w = nn.Parameter(torch.rand(d) + 0.5)
        self.p = p

    def forward(self, x):
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.w
        h = F.gelu(self.a(h))
        return x + F.dropout(self.b(h), self.p, self.training)


class Stack(nn.Module):
    """``p``: a dropout inside each checkpoint; ``between``: one outside, after each."""

    def __init__(self, layers=3, reentrant=False, checkpointed=True, p=0.0, between=0.0):
        super().__init__()
        self.layers = nn.ModuleList(Layer(p=p) for _ in range(layers))
        self.reentrant, self.checkpointed, self.between = reentrant, checkpointed, between

    def forward(self, x):
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.reentrant) if self.checkpointed \
                else layer(x)
            x = F.dropout(x, self.between, self.training and self.between > 0)
        return x.sum(-1)


def saved_bytes(fn, exclude=()):
    """``(fn(), bytes)``: the bytes of the distinct storages autograd saves while ``fn`` runs, but those of the
    tensors ``exclude``."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())


def _kept(fn, model):
    """What a forward keeps for its backward, beyond the model's parameters (a checkpoint saves its inputs; the
    parameters it reads are the model's own)."""
    return saved_bytes(fn, model.parameters())


def _grads(fn, model, x, seed=0):
    model.zero_grad()
    x.grad = None
    torch.manual_seed(seed)
    out = fn(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    (out * w).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _calls(fn):
    """How many checkpointed calls one forward makes (through :class:`Checkpointed`)."""
    n = [0]
    forward = Checkpointed.forward

    def counted(self, *args):
        n[0] += 1
        return forward(self, *args)

    Checkpointed.forward = counted
    try:
        fn()
    finally:
        Checkpointed.forward = forward
    return n[0]


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_fused_model_keeps_what_eagers_checkpoints_keep_and_trains_as_eager(reentrant):
    torch.manual_seed(0)
    model = Stack(reentrant=reentrant).train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert len(fused.report.applied) >= 6, fused.report.summary()      # the three layers' norms and epilogues
    assert any("are kept" in w for w in fused.report.warnings), fused.report.warnings
    _, kept_fused = _kept(lambda: fused(x), model)
    _, kept_eager = _kept(lambda: model(x), model)
    model.checkpointed = False
    _, kept_plain = _kept(lambda: model(x), model)
    model.checkpointed = True
    # the three layers' inputs (2·8·32 fp32 each): eager's checkpoints keep the same; without them, every
    # activation of every layer
    assert kept_fused == kept_eager == 3 * 2 * 8 * 32 * 4, (kept_fused, kept_eager)
    assert kept_plain > 10 * kept_fused
    assert _calls(lambda: fused(x)) == 3
    got, want = _grads(fused, model, x), _grads(model, model, x)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)    # fp32 both sides, other summation orders
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_checkpointed_gradients_are_within_eagers_error_in_each_dtype(dtype):
    """Against float64: the fused gradients' error at most twice eager's (the verifier's rule, autofuse.verify)."""
    torch.manual_seed(0)
    model = Stack(layers=2).train().to(dtype)
    x = torch.randn(2, 8, 32, dtype=dtype, requires_grad=True)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert _calls(lambda: fused(x)) == 2
    got = _grads(fused, model, x)
    want = _grads(model, model, x)
    ref_model = copy.deepcopy(model).double()
    xr = x.detach().double().requires_grad_()
    ref = _grads(ref_model, ref_model, xr)
    for g, w, r in zip([got[0]] + got[1], [want[0]] + want[1], [ref[0]] + ref[1]):
        ok, err, tol = compare(w, r, g)
        assert ok, (dtype, err, tol)


@pytest.mark.parametrize("between", [0.0, 0.5])
def test_a_dropout_inside_a_checkpoint_draws_eagers_mask_in_the_forward_and_again_in_the_recomputation(between):
    """The checkpointed call keeps the random generator's state for its recomputation, as eager's checkpoint
    does: the backward's dropout mask is the forward's, and both are eager's at the same seed; ``between``: with
    draws outside the checkpoints too, which keep their order among the draws."""
    torch.manual_seed(0)
    model = Stack(layers=2, p=0.25, between=between).train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    fused = AutoFusionEngine.fuse(model, (x,))
    got, want = _grads(fused, model, x, seed=3), _grads(model, model, x, seed=3)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    other = _grads(model, model, x, seed=4)
    assert not torch.allclose(other[0], want[0])       # the seed matters: the masks are drawn, not fixed


def test_through_torch_compile_the_checkpoints_are_kept_too():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack(layers=2).train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    compiled = torch.compile(model, backend="autofuse")
    got = _grads(compiled, model, x)
    (report,) = autofuse.reports(compiled)
    assert any(w.startswith("2 activation checkpoint(s)") and "are kept" in w for w in report.warnings), \
        report.warnings
    assert _calls(lambda: compiled(x)) == 2
    _, kept = _kept(lambda: compiled(x), model)
    assert kept == 2 * 2 * 8 * 32 * 4
    want = _grads(model, model, x)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_a_plan_made_without_grad_is_planned_again_for_a_call_with_grad():
    """Without grad a checkpoint is a plain call and a fused block may span two; a call with grad gets a plan of
    its own, which keeps them."""
    torch.manual_seed(0)
    model = Stack(layers=2).train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    with torch.no_grad():
        fused = AutoFusionEngine.fuse(model, (x,))
        fused(x)
    assert len(fused.plans) == 1
    assert _calls(lambda: fused(x)) == 2
    assert len(fused.plans) == 2
    with torch.no_grad():                       # no recomputation without grad: the plan's graph as it is
        assert _calls(lambda: fused(x)) == 0


def test_near_miss_a_model_without_checkpoints_runs_its_plan_as_before():
    torch.manual_seed(0)
    model = Stack(layers=2, checkpointed=False).train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert not any("checkpoint" in w for w in fused.report.warnings)
    assert _calls(lambda: fused(x)) == 0
    _, kept = _kept(lambda: fused(x), model)
    assert kept > 2 * 2 * 8 * 32 * 4


def test_a_region_keeps_to_one_checkpoint_only_where_they_are_kept():
    """A residual sum outside the checkpoints and the next layer's norm inside one are one region (an
    add_rms_norm) in an inference plan, two in a plan with grad: fused as one, the call would belong to the
    checkpoint and the sum's two terms would be kept for it where eager keeps the sum alone."""
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
            self.w = nn.Parameter(torch.ones(32))

        def step(self, i, x):
            return self.f[i](x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w)

        def forward(self, x):
            for i in range(3):
                x = x + torch.utils.checkpoint.checkpoint(self.step, i, x, use_reentrant=False)
            return x

    torch.manual_seed(0)
    model = Residual().train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    with torch.no_grad():
        inference = AutoFusionEngine.fuse(model, (x,))
    fused = AutoFusionEngine.fuse(model, (x,))
    names = lambda r: [n for d in r.applied for n in d.pattern.split("+")]  # noqa: E731
    assert names(inference.report).count("add_rms_norm") == 2, inference.report.summary()
    assert "add_rms_norm" not in names(fused.report), fused.report.summary()
    assert names(fused.report).count("rms_norm") == 3, fused.report.summary()
    assert any(w.startswith("3 activation checkpoint(s)") for w in fused.report.warnings), fused.report.warnings
    assert _calls(lambda: fused(x)) == 3
    got, want = _grads(fused, model, x), _grads(model, model, x)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["Llama", "Gemma"])
def test_transformers_activation_checkpointing_keeps_eagers_memory_and_gradients(arch):
    """``activation_checkpointing_enable()``: the causal mask and rotary tables are built before the layers (outside
    every checkpoint) and the attention block reads them; each layer is one checkpointed call, and the fused forward
    keeps no more than eager's checkpointed forward. Gemma's capture puts ops of its mask (and its embedding's
    scale) among the first layer's: ordered as captured, they broke its checkpoints into 18 calls."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = getattr(tf, f"{arch}Config")(vocab_size=128, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)
    model = getattr(tf, f"{arch}ForCausalLM")(cfg).train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(1, 128, (2, 16))
    fused = AutoFusionEngine.fuse(model, ((ids,), {}))
    assert [d.applied for d in fused.report.of("attention")] == [True, True], fused.report.summary()
    assert _calls(lambda: fused(ids)) == 2
    _, kept_fused = _kept(lambda: fused(ids).logits, model)
    _, kept_eager = _kept(lambda: model(ids).logits, model)
    assert kept_fused <= kept_eager, (kept_fused, kept_eager)
    grads = []
    for fn in (fused, model):
        model.zero_grad()
        fn(ids).logits.square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)      # fp32 both sides


def test_planning_sets_the_callers_saved_tensor_hooks_aside():
    """A call that plans inside the caller's ``saved_tensors_hooks`` (an eager checkpoint around the fused model,
    ``save_on_cpu()``): the hooks see the call's own tensors, never the fake ones a plan is made with, and are in
    place again after it."""
    from torch._subclasses.fake_tensor import FakeTensor
    torch.manual_seed(0)
    model = Stack(layers=2, checkpointed=False).train()
    fused = AutoFusionEngine.fuse(model, (torch.randn(2, 8, 32),))
    seen = []

    def pack(t):
        seen.append(isinstance(t, FakeTensor))
        return t

    x = torch.randn(3, 8, 32, requires_grad=True)     # a new signature: planned inside the hooks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused(x)
        planned = len(seen)
        torch.randn(4, requires_grad=True).exp()
    assert len(fused.plans) == 2
    assert planned and not any(seen), seen
    assert len(seen) == planned + 1                   # the caller's hook packs again after the plan

    y = torch.randn(5, 8, 32, requires_grad=True)     # planned inside an eager checkpoint of the fused model
    got = torch.utils.checkpoint.checkpoint(fused, y, use_reentrant=False)
    got.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(y).square().sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)


def test_the_simulated_training_step_prices_the_recomputation():
    """Both sides of the comparison recompute: the fused plan's checkpointed calls and eager's checkpointed ops run
    their forward kernels again in the backward, priced as a phase of their own; the ops outside (the final sum)
    are not recomputed, and a model without checkpoints has no such phase."""
    from autofuse.simulate import simulate
    torch.manual_seed(0)
    model = Stack(layers=2).train()
    x = torch.randn(2, 8, 32, requires_grad=True)
    for result in (AutoFusionEngine.fuse(model, (x,)).simulate(x, backward=True),
                   simulate(model, (x,), backward=True)):
        phases = result.phases
        assert 0 < phases["recompute"] < phases["forward"], phases
        assert result.cycles == sum(phases.values())
        outside = [r for r in result.nodes if r.phase == "forward" and r.target.startswith("aten.sum")]
        assert outside and phases["recompute"] <= phases["forward"] - sum(r.cycles for r in outside)
        assert "recomputing the activation checkpoints' ops" in result.summary()
    model.checkpointed = False
    assert "recompute" not in AutoFusionEngine.fuse(model, (x,)).simulate(x, backward=True).phases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_the_casts_a_plan_makes_run_in_their_checkpoint(dtype):
    """Under CPU autocast the rewrite casts an input up ahead of a fused kernel (Llama's v for its attention): such
    a cast, made by the plan and read only inside one checkpoint, runs in it (each layer was two checkpointed calls).
    The gradients stay within twice eager's error against float64."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = tf.LlamaForCausalLM(cfg).train()
    model.activation_checkpointing_enable({"use_reentrant": False})
    ref = copy.deepcopy(model).double()
    ids = torch.randint(1, 128, (2, 16))
    grads = []
    with torch.autocast("cpu", dtype=dtype):
        fused = AutoFusionEngine.fuse(model, ((ids,), {}))
        assert _calls(lambda: fused(ids)) == 2
        for fn in (fused, model):
            model.zero_grad()
            fn(ids).logits.float().square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
    ref(ids).logits.square().mean().backward()
    for g, w, r in zip(*grads, [p.grad for p in ref.parameters()]):
        ok, err, tol = compare(w, r, g)
        assert ok, (err, tol)
