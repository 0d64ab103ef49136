"""Backward through the fused attention op: gradients equal eager attention's (the op recomputes attention
in fp32 on the host for its backward), for q, k, v, additive masks and probabilities, GQA and causal, and
through whole fused models into their parameters."""
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import autofuse
from autofuse import AutoFusionEngine
from autofuse.models import build
from autofuse.ops import flash_attention


def _inputs(B, N, Nkv, S, D, dtype, mask):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, S, D, generator=g).to(dtype).requires_grad_() for n in (N, Nkv, Nkv))
    m = None
    if mask == "float":
        m = torch.randn(1, 1, S, S, generator=g).to(dtype).requires_grad_()
    elif mask == "bool":
        m = torch.rand(B, 1, S, S, generator=g) > 0.3
        m[..., 0] = True                                    # every query sees a key
    return q, k, v, m


def _grads(fn, leaves, go):
    for t in leaves:
        t.grad = None
    fn().backward(go)
    return [t.grad.clone() for t in leaves]


def _sdpa(q, k, v, m, causal, dtype=torch.float64):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mm = None if m is None else (m.to(dtype) if m.is_floating_point() else m)
    if causal and mm is not None:           # SDPA takes a mask or is_causal, not both
        tril = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        mm = mm.masked_fill(~tril, float("-inf")) if mm.is_floating_point() else mm & tril
        causal = False
    return F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mm, is_causal=causal)


CASES = [((1, 4, 4, 16, 8), None, False), ((2, 4, 2, 24, 16), None, True), ((1, 2, 2, 16, 8), "float", False),
         ((2, 2, 1, 20, 8), "bool", False), ((1, 2, 2, 33, 8), "float", True)]


@pytest.mark.parametrize("shape,mask,causal", CASES)
def test_fp32_gradients_match_float64_attention(shape, mask, causal):
    q, k, v, m = _inputs(*shape, torch.float32, mask)
    leaves = [q, k, v] + ([m] if mask == "float" else [])
    go = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(1))
    fused = _grads(lambda: flash_attention(q, k, v, mask=m, causal=causal), leaves, go)
    ref = _grads(lambda: _sdpa(q, k, v, m, causal), leaves, go.double())
    for name, a, b in zip("qkvm", fused, ref):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,mask,causal", CASES[:2] + CASES[3:4])
def test_low_precision_gradients_no_worse_than_eager(dtype, shape, mask, causal):
    """|fused - ref64| <= 2 |eager - ref64| + 1e-3 per gradient, eager being SDPA's backward in the same dtype."""
    q, k, v, m = _inputs(*shape, dtype, mask)
    go = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(1)).to(dtype)
    fused = _grads(lambda: flash_attention(q, k, v, mask=m, causal=causal), [q, k, v], go)
    eager = _grads(lambda: _sdpa(q, k, v, m, causal, dtype), [q, k, v], go)
    ref = _grads(lambda: _sdpa(q, k, v, m, causal), [q, k, v], go.double())
    for name, a, e, r in zip("qkv", fused, eager, ref):
        assert a.dtype == dtype, name
        err_f = (a.double() - r.double()).abs().max().item()
        err_e = (e.double() - r.double()).abs().max().item()
        assert err_f <= 2 * err_e + 1e-3, f"{name}: fused {err_f:.2e}, eager {err_e:.2e}"


def test_probability_gradients_flow():
    q, k, v, _ = _inputs(1, 2, 2, 16, 8, torch.float32, None)
    g = torch.Generator().manual_seed(2)
    wo, wp = torch.randn(1, 2, 16, 8, generator=g), torch.randn(1, 2, 16, 16, generator=g)

    def loss(fn):
        for t in (q, k, v):
            t.grad = None
        out, probs = fn()
        ((out * wo).sum() + (probs * wp).sum()).backward()
        return [t.grad.clone() for t in (q, k, v)]

    fused = loss(lambda: flash_attention(q, k, v, return_probs=True))

    def eager():
        s = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5
        p = s.softmax(-1)
        return p @ v.double(), p

    for a, b in zip(fused, loss(eager)):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=1e-4)


def _same_parameter_grads(model, fused, args, kwargs):
    """Parameter gradients of a loss on the logits, through the eager model and through the fused one (each
    from the same generator state: dropouts draw the same masks), equal to fp32 rounding."""
    def grads(m):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        out = m(*args, **kwargs)
        logits = out if isinstance(out, torch.Tensor) else (out[0] if isinstance(out, tuple) else out.logits)
        logits.float().pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager, got = grads(model), grads(fused)
    assert got.keys() == eager.keys() and len(got) > 10
    for n in eager:
        torch.testing.assert_close(got[n], eager[n], atol=1e-5, rtol=1e-3, msg=n)


def test_fused_model_trains_like_the_eager_model():
    """Parameter gradients of a fused GPT-2 (2 layers) equal the eager model's."""
    torch.manual_seed(0)
    model, (args, kwargs) = build("gpt2", layers=2, hidden=32, heads=4, seq=16, batch=2)
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    # both attention blocks, and the layer norms and GELU epilogues: gradients flow through every fused op
    assert [d.applied for d in fused.report.of("attention")] == [True, True], fused.report.summary()
    assert {d.pattern for d in fused.report.applied} > {"attention"}, fused.report.summary()
    _same_parameter_grads(model, fused, args, kwargs)


@pytest.mark.parametrize("batch", [1, 2])
def test_fused_model_trains_with_dropout_like_the_eager_model(batch):
    """Training mode, GPT-2's attention dropout fused: from the same seed, the parameter gradients are eager's
    (the fused blocks drop the same elements, and their backward uses the same keep-mask). Batch 1: an epilogue
    stores its product for the backward with the program's lead dims ([1, S, H]), read back as the matmul's rows
    ([S, H]) its program declares."""
    torch.manual_seed(0)
    model, (args, kwargs) = build("gpt2", layers=2, hidden=32, heads=4, seq=16, batch=batch)
    model.train()
    fused = AutoFusionEngine.fuse(model, (args, kwargs))
    assert [d.applied for d in fused.report.of("attention")] == [True, True], fused.report.summary()
    assert all(d.params["dropout_p"] > 0 for d in fused.report.of("attention"))
    _same_parameter_grads(model, fused, args, kwargs)


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(b, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpoints_are_said_and_train_with_eagers_gradients(reentrant):
    """The plan keeps the checkpoints (tests/test_checkpointing.py) and says so in its report; its gradients are
    eager's."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant).train()
    x = torch.randn(2, 4, 16, requires_grad=True)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert any(w.startswith("2 activation checkpoint(s) in the forward") and "are kept" in w
               for w in fused.report.warnings), fused.report.warnings
    grads = []
    for m in (fused, model):
        model.zero_grad()
        x.grad = None
        m(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()] + [x.grad.clone()])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)      # fp32 both sides


def test_activation_checkpoints_through_compile_are_counted_once_each():
    """In a Dynamo graph each checkpoint is an operator that wraps its body in a new closure at each trace: the
    report counts the two blocks, not their traces (it said 4)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Checkpointed(False).train()
    x = torch.randn(2, 4, 16, requires_grad=True)
    compiled = torch.compile(model, backend="autofuse")
    compiled(x).sum().backward()
    (report,) = autofuse.reports(compiled)
    assert any(w.startswith("2 activation checkpoint(s) in the forward") for w in report.warnings), report.warnings


class _CheckpointedHead(nn.Module):
    """A checkpointed block whose input is the model's input (or a value its own no_grad block makes), then a
    layer outside it."""

    def __init__(self, reentrant, pre_no_grad=False):
        super().__init__()
        self.a, self.b, self.p = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.reentrant, self.pre_no_grad = reentrant, pre_no_grad

    def forward(self, x):
        if self.pre_no_grad:
            with torch.no_grad():
                x = self.p(x)
        else:
            x = x * 1.5
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.a(t)) * 2.0, x,
                                              use_reentrant=self.reentrant)
        return self.b(h) + self.p(x * 0.5)


def _grads_or_none(m, params, x):
    for p in params:
        p.grad = None
    x.grad = None
    m(x).square().mean().backward()
    return [None if t.grad is None else t.grad.clone() for t in (*params, x)]


def _same_or_none(got, want):
    assert [g is None for g in got] == [w is None for w in want]
    for g, w in zip(got, want):
        if w is not None:
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("route", ["fuse", "compile"])
@pytest.mark.parametrize("reentrant,pre_no_grad", [(True, False), (True, True), (False, False)])
def test_reentrant_checkpoint_without_an_input_that_requires_grad_gives_no_gradient_as_eager(
        route, reentrant, pre_no_grad):
    """Eager's reentrant checkpoint (CheckpointFunction) runs its function without grad: with no tensor input that
    requires grad (the model's input, or a value made in the forward's own no_grad block) its output carries no
    gradient and the parameters inside get none (torch warns "Gradients will be None"). The fused model gave
    them one (the checkpoint was a plain call). With an input that requires grad, or non-reentrant, they get
    eager's gradients. One fused model serves calls in either state (a plan per autograd state); the plan
    warns of the checkpoint once."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _CheckpointedHead(reentrant, pre_no_grad)
    eager = __import__("copy").deepcopy(model)
    x = torch.randn(4, 8)
    grad_free = reentrant
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused = AutoFusionEngine.fuse(model, (x,)) if route == "fuse" else torch.compile(model, backend="autofuse")
        for requires_grad in (False, True, False):
            xx = x.clone().requires_grad_(requires_grad)
            want = _grads_or_none(eager, list(eager.parameters()), xx)
            got = _grads_or_none(fused, list(model.parameters()), xx)
            _same_or_none(got, want)
            if grad_free and (not requires_grad or pre_no_grad):
                assert want[0] is None and want[1] is None          # a.weight, a.bias: no gradient in eager
            else:
                assert want[0] is not None
    said = [str(w.message) for w in seen if "reentrant activation checkpoint" in str(w.message)]
    assert bool(said) == grad_free, said
    assert all("Gradients will be None" in m for m in said)
    if route == "fuse":
        assert len(fused.plans) == (2 if reentrant else 1)


def test_reentrant_checkpoint_without_grad_is_not_warned_of():
    """Called without grad nothing carries a gradient: the plan does not warn of the checkpoint."""
    model = _CheckpointedHead(True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="autofuse: .*reentrant")
        with torch.no_grad():
            fused = AutoFusionEngine.fuse(model, (torch.randn(4, 8),))
    assert not [w for w in fused.report.warnings if "reentrant" in w]


def test_transformers_gradient_checkpointing_is_said():
    """transformers' layers checkpoint themselves only in training mode where torch.is_grad_enabled(): the trace
    reads eager's grad mode, so 2 layers checkpoint with grad; without grad or in eval mode, none."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    model.activation_checkpointing_enable()
    ids = torch.randint(0, 64, (1, 8))
    fused = AutoFusionEngine.fuse(model, ((ids,), {}))
    assert any(w.startswith("2 activation checkpoint(s)") for w in fused.report.warnings), fused.report.warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with torch.no_grad():
            fused = AutoFusionEngine.fuse(model, ((ids,), {}))
        assert not [w for w in fused.report.warnings if "checkpoint" in w]
        fused = AutoFusionEngine.fuse(model.eval(), ((ids,), {}))
    assert not [w for w in fused.report.warnings if "checkpoint" in w]


class _NormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up = nn.LayerNorm(32), nn.Linear(32, 64)

    def forward(self, x):
        return F.gelu(self.up(self.norm(x * 2 + 1)))


@pytest.mark.parametrize("training", [True, False])
def test_a_training_plan_checks_the_derived_backward_of_each_generated_kernel(training, monkeypatch):
    """A generated kernel's backward is derived from its forward and runs as another program; a wrong derivation
    gave wrong gradients while the forward verified (a per-row term's share not summed over the row, a one-column
    slice reading column 0). A training plan now checks each such block's gradients against eager's and float64's
    on the example inputs, and leaves unfused a block whose backward does not match. Here the backward is made
    wrong on purpose (doubled)."""
    import autofuse.ops_vector as ov
    real = ov.run_grad_program
    monkeypatch.setattr(ov, "run_grad_program", lambda *a, **k: [None if g is None else g * 2 for g in real(*a, **k)])
    torch.manual_seed(0)
    model = _NormMLP().train(training)
    x = torch.randn(4, 8, 32)
    report = AutoFusionEngine.fuse(model, (x,)).report
    derived = [d for d in report.decisions if d.params.get("family") in ("vector_chain", "matmul_epilogue")]
    assert derived
    if training:
        assert not any(d.applied for d in derived)
        assert all(d.reason_code == "verification_failed" and "gradients" in d.reason for d in derived), \
            [d.reason for d in derived]
    else:                                   # an inference plan: its blocks' backwards never run, not checked
        assert any(d.applied for d in derived)
