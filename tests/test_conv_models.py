"""Convolutions in whole models: captured by AutoFusionEngine.fuse, simulated as the Cube's implicit GEMM (not a
generic pass), values unchanged; what falls back to generic."""
import pytest
import torch

import autofuse
from autofuse import AutoFusionEngine


class PatchEmbed(torch.nn.Module):
    """A ViT's front: a patch embedding (kernel = stride), flattened to tokens, a LayerNorm and a projection."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 32, 8, stride=8)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.head(self.norm(self.proj(x).flatten(2).transpose(1, 2)))


class ShortConv(torch.nn.Module):
    """An LFM2/Mamba-style short convolution (depthwise, kernel 3, causal: padded and cut) over a projection's
    [B, L, C] output, then a Whisper-style Conv1d with stride 2."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.short = torch.nn.Conv1d(32, 32, 3, groups=32, padding=2)
        self.down = torch.nn.Conv1d(32, 24, 3, stride=2, padding=1)

    def forward(self, x):
        h = self.inp(x).transpose(1, 2)
        h = self.short(h)[..., :x.shape[1]]
        return self.down(torch.nn.functional.gelu(h))


def _convs(result):
    return [n for n in result.nodes if "conv" in n.target]


@pytest.mark.parametrize("make, x", [(PatchEmbed, (2, 3, 32, 32)), (ShortConv, (2, 20, 16))])
def test_convolutions_simulate_as_cube_work(make, x):
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(*x)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert torch.equal(fused(x), model(x))                      # nothing is fused across a convolution
    r = fused.simulate(x)
    torch.testing.assert_close(r.outputs if isinstance(r.outputs, torch.Tensor) else r.outputs[0], model(x))
    convs = _convs(r)
    assert convs and all(n.kernels[-1] == "conv" and not n.fused for n in convs)
    assert r.by_kernel()["conv"] > 0 and "generic" not in r.by_kernel()
    # the kernels' own values (check=True runs them in full) are torch's, within fp32 accumulation
    checked = autofuse.simulate(model, (x,), check=True)
    assert all(n.max_error is not None and n.max_error < 1e-5 for n in _convs(checked))
    # the planner prices them as the simulator runs them: the conv kernel on the Cube
    text = checked.summary()
    assert "conv" in text


class OneValueTuples(torch.nn.Module):
    """A conv2d given its padding and stride as one-element tuples, which torch repeats over both dims."""

    def __init__(self):
        super().__init__()
        self.w, self.b = torch.nn.Parameter(torch.randn(8, 4, 3, 3)), torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.nn.functional.conv2d(x, self.w, self.b, stride=(2,), padding=(1,))


def test_a_single_padding_or_stride_value_is_repeated_over_the_dims():
    # it was priced as one generic pass
    x = torch.randn(2, 4, 9, 9)
    r = autofuse.simulate(OneValueTuples(), (x,), check=True)
    convs = _convs(r)
    assert convs and all(n.kernels[-1] == "conv" and n.max_error is not None and n.max_error < 1e-5 for n in convs)


def test_transposed_and_3d_convolutions_fall_back_to_generic():
    from autofuse.lower import lower
    for m, x in ((torch.nn.ConvTranspose2d(4, 4, 3), torch.randn(1, 4, 6, 6)),
                 (torch.nn.Conv3d(4, 4, 3), torch.randn(1, 4, 5, 5, 5)),
                 (torch.nn.Conv2d(4, 4, 4, padding="same"), torch.randn(1, 4, 6, 6))):
        gm = torch.export.export(m, (x,)).module()
        (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
        assert [st.kernel for st in lower(node).steps] == ["generic"], m
    # an odd 'same' kernel pads evenly: the Cube kernel, with its padding
    gm = torch.export.export(torch.nn.Conv2d(4, 4, 3, padding="same"), (torch.randn(1, 4, 6, 6),)).module()
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
    (st,) = lower(node).steps
    assert st.kernel == "conv" and st.params["padding"] == (1, 1)


def test_unfused_convolution_is_priced_on_the_cube():
    """The planner prices an nn.Conv2d as the conv kernel: Cube work, its FLOPs, far below a generic pass's
    price for the 3×3 block it would have moved as bytes only."""
    import cost_model
    from autofuse.lower import lower
    from autofuse.plan import price_node
    m = torch.nn.Conv2d(64, 64, 3, padding=1)
    gm = torch.export.export(m, (torch.randn(1, 64, 28, 28),)).module()
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
    prog = lower(node)
    assert [st.kernel for st in prog.steps] == ["conv"]
    assert prog.steps[0].params["padding"] == (1, 1)
    price = price_node(node, "ascend910")
    assert price.kernels == ["conv"]
    e = cost_model.estimate("conv", [((1, 64, 28, 28), "float32"), ((64, 64, 3, 3), "float32")], bias=((64,), "float32"),
                            padding=(1, 1))
    assert price.cycles == e.cycles and e.bound in ("cube", "mte2", "mte1")
    assert e.flops == 2 * 28 * 28 * 64 * 64 * 9
