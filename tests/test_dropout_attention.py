"""Training-mode attention with dropout, fused: the fused block draws the keep-mask eager draws (same seed, same
elements dropped, the generator left where eager leaves it), computes the same output and the same gradients,
and keeps the order of every other random op in the graph."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.verify import compare

B, N, S, D = 2, 4, 96, 32


def _qkv(dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, N, S, D, generator=g).to(dtype).requires_grad_(grad) for _ in range(3))


class Explicit(nn.Module):
    """dropout(softmax(QKᵀ·s + causal)) · V as GPT-2's and Llama's eager attention write it."""

    def __init__(self, p=0.1, causal=True):
        super().__init__()
        self.drop, self.causal = nn.Dropout(p), causal

    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) * D ** -0.5
        if self.causal:
            s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        return self.drop(torch.softmax(s.float(), -1).to(q.dtype)) @ v


class Sdpa(nn.Module):
    def __init__(self, p=0.1):
        super().__init__()
        self.p = p

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)


class WithHiddenDropout(nn.Module):
    """Random ops before and after the attention block: their draws must keep their order."""

    def __init__(self):
        super().__init__()
        self.attn, self.drop_in, self.drop_out = Explicit(0.2), nn.Dropout(0.3), nn.Dropout(0.1)

    def forward(self, q, k, v):
        return self.drop_out(self.attn(self.drop_in(q), k, v)) + torch.rand_like(q)


def _run_seeded(fn, seed=7):
    torch.manual_seed(seed)
    out = fn()
    return out, torch.rand(4)          # what the generator gives next: where each run left it


def _attention(fused):
    return [d for d in fused.report.decisions if d.pattern == "attention"]


def _float64(model, args):
    """The model in float64 on the same inputs (its dropouts draw the same masks from the same seed)."""
    m64 = type(model)().double() if not isinstance(model, Explicit) else Explicit(model.drop.p, model.causal)
    m64.load_state_dict(model.state_dict())
    m64.train(model.training)
    return _run_seeded(lambda: m64(*[a.detach().double() for a in args]))[0]


@pytest.mark.parametrize("model", [Explicit(), Explicit(0.25, causal=False), Sdpa(), WithHiddenDropout()],
                         ids=["explicit", "explicit-no-mask", "sdpa", "hidden-dropouts"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_dropout_draws_what_eager_draws(model, dtype):
    model.train()
    args = _qkv(dtype)
    fused = AutoFusionEngine.fuse(model, args)
    (d,) = _attention(fused)
    assert d.applied, d.reason
    assert "dropout_gen_mask" in fused.graph_module.code and "native_dropout" not in _fused_block_code(fused)
    got, after_fused = _run_seeded(lambda: fused(*args))
    want, after_eager = _run_seeded(lambda: model(*args))
    assert torch.equal(after_fused, after_eager)           # the generator moved exactly as far
    ref = _float64(model, args) if not isinstance(model, Sdpa) else None
    if ref is not None:
        ok, err, tol = compare(want, ref, got)
        assert ok, (err, tol)
    else:                    # SDPA's float64 twin: the same op in float64 from the same seed
        ref, _ = _run_seeded(lambda: model(*[a.double() for a in args]))
        ok, err, tol = compare(want, ref, got)
        assert ok, (err, tol)


def _fused_block_code(fused):
    """The code of the fused graph without the lines of the random ops it keeps (hidden dropouts)."""
    return "\n".join(line for line in fused.graph_module.code.splitlines() if "flash_attention" in line)


def test_the_dropped_weights_are_eagers():
    """V the identity: the output is the dropped-out weights, zero exactly where eager's are zero."""
    model = Explicit(0.5, causal=False).train()
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, S, S, generator=g) for _ in range(2))
    v = torch.eye(S).expand(1, 2, S, S).contiguous()
    fused = AutoFusionEngine.fuse(model, (q, k, v))
    assert _attention(fused)[0].applied
    got, _ = _run_seeded(lambda: fused(q, k, v), seed=11)
    want, _ = _run_seeded(lambda: model(q, k, v), seed=11)
    assert torch.equal(got != 0, want != 0) and (want == 0).float().mean() > 0.4


@pytest.mark.parametrize("model", [Explicit(), Sdpa()], ids=["explicit", "sdpa"])
def test_gradients_follow_the_same_mask(model):
    model.train()
    args = _qkv(grad=True)
    fused = AutoFusionEngine.fuse(model, args)
    assert _attention(fused)[0].applied
    grads = []
    for fn in (fused, model):
        for a in args:
            a.grad = None
        out, _ = _run_seeded(lambda fn=fn: fn(*args))
        (out * torch.linspace(-1, 1, D)).sum().backward()
        grads.append([a.grad.clone() for a in args])
    for gf, ge in zip(*grads):
        # fp32 both sides, the same mask: the backward recomputes in fp32 (a few roundings of each term)
        torch.testing.assert_close(gf, ge, rtol=1e-4, atol=1e-5)


def test_a_random_op_between_the_dropout_and_the_output_keeps_the_block_unfused():
    """The fused call draws where it is inserted (at P·V); a random op the captured graph runs between the
    dropout and P·V would get the numbers eager's dropout got: the block stays as captured, and says why."""
    class Between(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.1)

        def forward(self, q, k, v):
            p = self.drop(torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, -1))
            return p @ (v + torch.rand_like(v))

    model = Between().train()
    args = _qkv()
    fused = AutoFusionEngine.fuse(model, args, fusion_switches={"softmax": "off"})
    (d,) = _attention(fused)
    assert not d.applied and "would move past the random op" in d.reason
    got, after_fused = _run_seeded(lambda: fused(*args))
    want, after_eager = _run_seeded(lambda: model(*args))
    assert torch.equal(got, want) and torch.equal(after_fused, after_eager)


def test_probabilities_read_outside_keep_the_block_unfused():
    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.1)

        def forward(self, q, k, v):
            p = self.drop(torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, -1))
            return p @ v, p

    fused = AutoFusionEngine.fuse(Returns().train(), _qkv(), fusion_switches={"softmax": "off"})
    (d,) = _attention(fused)
    assert not d.applied and d.reason_code == "training_dropout" and "read outside" in d.reason


def test_dropout_on_the_scores_is_not_attention_dropout():
    """Near miss: dropout before the softmax changes what is normalised; it is not FlashAttention's dropout."""
    class OnScores(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.1)

        def forward(self, q, k, v):
            return torch.softmax(self.drop(q @ k.transpose(-2, -1) * D ** -0.5), -1) @ v

    model = OnScores().train()
    args = _qkv()
    fused = AutoFusionEngine.fuse(model, args)
    assert not any(d.applied for d in _attention(fused))
    got, _ = _run_seeded(lambda: fused(*args))
    want, _ = _run_seeded(lambda: model(*args))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)     # its softmax may run fused: a few ulps


def test_eval_mode_has_no_dropout():
    model = Explicit().eval()
    fused = AutoFusionEngine.fuse(model, _qkv())
    assert _attention(fused)[0].applied and "dropout_gen_mask" not in fused.graph_module.code


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_edge_probabilities_keep_eagers_semantics(p):
    """native_dropout draws its mask even at p = 0 (the fused block draws it too: the generator ends where eager's
    does); at p = 1 every weight is dropped, which the kernel does not take: the block runs as captured."""
    class Native(nn.Module):
        def forward(self, q, k, v):
            w = torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, -1)
            return torch.ops.aten.native_dropout(w, p, True)[0] @ v

    model = Native()
    args = _qkv()
    fused = AutoFusionEngine.fuse(model, args, fusion_switches={"softmax": "off"})
    (d,) = _attention(fused)
    assert d.applied == (p == 0.0) and (p == 0.0 or d.reason_code == "training_dropout"), d.reason
    got, after_fused = _run_seeded(lambda: fused(*args))
    want, after_eager = _run_seeded(lambda: model(*args))
    assert torch.equal(after_fused, after_eager)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class ProbabilitiesDroppedWhole(nn.Module):
    """``nn.Dropout(1.0)`` on the probabilities (eager's ``dropout`` returns zeros and draws nothing), then a
    dropout whose mask shows where the generator was left."""

    def __init__(self):
        super().__init__()
        self.all, self.drop = nn.Dropout(1.0), nn.Dropout(0.5)

    def forward(self, q, k, v):
        w = torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, -1)
        return self.drop(torch.tanh(self.all(w) @ v + q) * 1.5)


@pytest.mark.parametrize("route", ["fuse", "torch.compile"])
def test_dropping_every_probability_draws_nothing_as_eager(route):
    import copy

    model = ProbabilitiesDroppedWhole().train()
    args = _qkv()
    if route == "fuse":
        fused = AutoFusionEngine.fuse(copy.deepcopy(model), args)
    else:
        torch._dynamo.reset()
        fused = torch.compile(copy.deepcopy(model), backend="autofuse")
    got, after_fused = _run_seeded(lambda: fused(*args))
    want, after_eager = _run_seeded(lambda: model(*args))
    assert torch.equal(after_fused, after_eager)           # the generator moved exactly as far
    # the same masks, fp32 both sides: tanh and the scale rounded alike up to an ulp or two
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
