"""MoE experts in Llama 4's dense form: every token through every expert, its input scaled by a score that is
``sigmoid`` of the top-k logits scattered into ``-inf`` (zero for every expert it did not pick). The experts family
runs it sparse (each token through its k experts only) and must equal eager within the verifier's float64 bound;
near misses of the spelling (scores that are not zero off the picks, another activation, another layout) must not
fuse."""
import collections
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.verify import compare

GENERIC_OFF = {"softmax": "off", "vector_chain": "off", "matmul_epilogue": "off"}


class DenseExperts(nn.Module):
    """Llama 4's router tail and experts spelled by hand; ``kind`` spells a near miss."""

    def __init__(self, kind="llama4", E=4, H=16, inter=8, k=1):
        super().__init__()
        self.kind, self.E, self.k = kind, E, k
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * inter) * 0.5)
        self.down = nn.Parameter(torch.randn(E, inter, H) * 0.3)
        self.bias = nn.Parameter(torch.randn(E, 1, H))

    def forward(self, x, logits):
        H = x.shape[-1]
        top, idx = torch.topk(logits, self.k, dim=1, largest=self.kind != "smallest")
        fill = 0.0 if self.kind == "fill_zero" else float("-inf")
        scores = torch.full_like(logits, fill).scatter_(1, idx, top)
        scores = torch.sigmoid(scores.float()).to(scores.dtype)
        col = scores.reshape(-1, 1) if self.kind == "token_major" else scores.transpose(0, 1).reshape(-1, 1)
        routed = x.repeat(self.E, 1) * col
        h = torch.bmm(routed.view(self.E, -1, H), self.gate_up)
        gate, up = h.chunk(2, dim=-1)
        act = F.gelu if self.kind == "gelu" else F.silu
        y = torch.bmm(up * act(gate), self.down)
        if self.kind == "bias":
            y = y + self.bias
        return y.view(-1, H).reshape(self.E, -1, H).sum(dim=0)


def _inputs(T, E, H, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(dtype), torch.randn(T, E, generator=g).to(dtype)


@pytest.mark.parametrize("T,E,k", [(6, 4, 1), (10, 8, 2), (33, 16, 1), (1, 4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dense_experts_run_sparse_and_equal_eager(T, E, k, dtype):
    torch.manual_seed(0)
    m = DenseExperts(E=E, k=k).to(dtype)
    x, logits = _inputs(T, E, 16, dtype)
    fused = AutoFusionEngine.fuse(m, (x, logits), fusion_switches=GENERIC_OFF)
    experts = [d for d in fused.report.decisions if d.pattern == "moe_experts"]
    assert [d.reason_code for d in experts] == ["fused"], fused.report.summary()
    targets = {str(n.target) for n in fused.graph_module.graph.nodes if n.op == "call_function"}
    assert "aten.matmul.default" not in targets and "aten.bmm.default" not in targets   # no dense GEMM left
    with torch.no_grad():
        got, want = fused(x, logits), m(x, logits)
        ref = copy.deepcopy(m).double()(x.double(), logits.double())
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)


@pytest.mark.parametrize("kind", ["fill_zero", "smallest", "gelu", "token_major", "bias"])
def test_dense_experts_near_misses_are_not_fused(kind):
    """``fill_zero``: sigmoid(0) = 0.5 off the picks, so every expert counts; ``smallest``: not the top k;
    ``gelu``: not SwiGLU; ``token_major``: the scores laid out against the repeated tokens' order; ``bias``: an
    expert whose zero input gives a nonzero output."""
    torch.manual_seed(0)
    m = DenseExperts(kind)
    x, logits = _inputs(6, 4, 16, torch.float32)
    fused = AutoFusionEngine.fuse(m, (x, logits), fusion_switches=GENERIC_OFF)
    assert not [d for d in fused.report.decisions if d.pattern == "moe_experts"], fused.report.summary()
    with torch.no_grad():
        assert torch.equal(fused(x, logits), m(x, logits))


def test_dense_experts_train_as_eager():
    """The gradients of the tokens, the logits and both weights (an expert no token picked gets zeros, as eager's
    zero inputs give it)."""
    torch.manual_seed(0)
    m = DenseExperts(E=8, k=2)
    x, logits = _inputs(12, 8, 16, torch.float32)
    fused = AutoFusionEngine.fuse(m.train(), (x, logits), fusion_switches=GENERIC_OFF)
    assert [d.reason_code for d in fused.report.decisions if d.pattern == "moe_experts"] == ["fused"]
    grads = []
    for model in (fused, m):
        xs, ls = x.clone().requires_grad_(), logits.clone().requires_grad_()
        model.zero_grad() if model is m else None
        out = model(xs, ls)
        out.square().sum().backward()
        grads.append([xs.grad, ls.grad] + [p.grad.clone() for p in (m.gate_up, m.down)])
        m.zero_grad()
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_llama4_experts_blocks_are_fused():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.Llama4TextConfig(vocab_size=128, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                              intermediate_size_mlp=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_local_experts=8, num_experts_per_tok=2, pad_token_id=0)
    model, ids = tf.Llama4ForCausalLM(cfg).eval(), torch.randint(1, 128, (2, 8))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    codes = collections.Counter(d.reason_code for d in fused.report.decisions if d.pattern == "moe_experts")
    assert codes == {"fused": 2}, fused.report.summary()
    with torch.no_grad():
        got, want = fused(ids, use_cache=False).logits, model(ids, use_cache=False).logits
        ref = copy.deepcopy(model).double()(ids, use_cache=False).logits
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)



def test_a_large_dense_experts_block_is_verified_on_reduced_shapes(monkeypatch):
    """Verified at reduced sizes (as a real Llama 4 block must be: 10 GiB for one float64 value at Scout's sizes
    and 4096 tokens), the tokens repeated once per expert shrink with the tokens: 48 tokens -> 24, 4 x 48 rows ->
    4 x 24."""
    import autofuse.verify
    monkeypatch.setattr(autofuse.verify, "LARGEST_CHECKED", 0)        # every block counts as too large
    torch.manual_seed(0)
    m = DenseExperts(E=4, H=16, inter=8, k=2)
    x, logits = _inputs(48, 4, 16, torch.float32)
    fused = AutoFusionEngine.fuse(m, (x, logits), fusion_switches=GENERIC_OFF)
    (d,) = [d for d in fused.report.decisions if d.pattern == "moe_experts"]
    assert d.applied and d.verify_note.startswith("verified on reduced shapes (48 -> 24,") and "192 -> 96" in \
        d.verify_note, d.verify_note
    with torch.no_grad():
        torch.testing.assert_close(fused(x, logits), m(x, logits), rtol=1e-4, atol=1e-5)  # fp32 summation orders
