"""Forwards whose sizes depend on data: a boolean index, a split by counts read with ``tolist()`` (JetMoe's
experts). Capture plans them at the example's sizes; whatever touches a data-dependent size runs as captured
(reported, never fused), the rest fuses, and the fused model equals eager on inputs that select other counts."""
import copy

import pytest
import torch

from autofuse import AutoFusionEngine
from autofuse.capture import CaptureError, capture
from autofuse.verify import compare
from conftest import assert_as_eager, main_output


class Selected(torch.nn.Module):
    """An RMSNorm over the rows a comparison keeps (their count depends on the values) beside a static activation
    chain over every row (``silu(x) · x``: no gated unit, a plain ``vector_chain``)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32))
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        h = self.lin(x)
        sel = h[h[:, 0] > 0]
        y = sel * torch.rsqrt(sel.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        z = torch.nn.functional.silu(x) * x * 2.0 + 1
        return y.sum(0) + z.sum(0)


def _inputs(seed):
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))


def test_capture_marks_the_data_dependent_nodes_and_gives_them_the_example_sizes():
    torch.manual_seed(0)
    m, x = Selected().eval(), _inputs(0)
    gm = capture(m, (x,)).graph_module
    marked = [n for n in gm.graph.nodes if "autofuse_data_dependent" in n.meta]
    assert marked, "the boolean index's rows are data-dependent"
    rows = int((m.lin(x)[:, 0] > 0).sum())
    pow_ = next(n for n in marked if n.target == torch.ops.aten.pow.Tensor_Scalar)
    assert tuple(pow_.meta["val"].shape) == (rows, 32)        # the example's count, a plain int
    assert all("aten.index.Tensor" in s for n in marked for s in n.meta["autofuse_data_dependent"])
    unmarked = [n for n in gm.graph.nodes if n.op == "call_function" and "autofuse_data_dependent" not in n.meta]
    assert any(n.target == torch.ops.aten.silu.default for n in unmarked)     # the static chain is not marked


def test_a_block_of_data_dependent_sizes_runs_as_captured_and_the_rest_fuses():
    torch.manual_seed(0)
    m = Selected().eval()
    before = copy.deepcopy(m.state_dict())
    f = AutoFusionEngine.fuse(m, (_inputs(0),))
    d = {x.pattern: x for x in f.report.decisions}
    assert not d["rms_norm"].applied and d["rms_norm"].reason_code == "unsupported"
    assert "depend on data" in d["rms_norm"].reason and "aten.index.Tensor" in d["rms_norm"].reason
    assert any(x.applied and x.pattern == "vector_chain" and "silu" in x.nodes for x in f.report.decisions)
    counts = set()
    with torch.no_grad():
        for seed in range(4):
            x = _inputs(seed)
            counts.add(int((m.lin(x)[:, 0] > 0).sum()))
            got = f(x)
            assert_as_eager(m, (x,), got)
    assert len(counts) > 1, "the inputs must select different row counts"
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())    # the user's model untouched


def test_meta_inputs_of_a_data_dependent_forward_are_refused_with_what_to_do():
    with torch.device("meta"):
        m = Selected().eval()
        x = torch.randn(64, 32)
    with pytest.raises(CaptureError, match=r"depend on data.*(?s:.*)torch\.compile"):
        capture(m, (x,))


def test_jetmoe_fuses_around_its_data_dependent_experts():
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    cfg = tf.JetMoeConfig(num_hidden_layers=2, hidden_size=64, num_key_value_heads=2, kv_channels=16,
                          intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, vocab_size=128)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.JetMoeForCausalLM(cfg).eval()
    ids = torch.randint(1, 128, (2, 16))
    f = AutoFusionEngine.fuse(model, ((ids,), {"use_cache": False}))
    names = {d.pattern for d in f.report.applied}
    assert {"attention", "moe_gating", "rope"} <= names, names
    with torch.no_grad():
        for seed in range(2):                  # other tokens route other counts to each expert
            x = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(seed + 1))
            got = main_output(f(x, use_cache=False))
            want = main_output(model(x, use_cache=False))
            ref = main_output(model.double()(x, use_cache=False))
            model.float()
            ok, err, tol = compare(want, ref, got)
            assert ok, (err, tol)
