"""torch.nn's own layers through fuse(), in training and in eval mode: the fused model is the user's model.

Each layer sits between what fuses around it (a GELU chain after it); two training steps each compare the output,
the input's gradient and every parameter's with eager's (within the verifier's bound: twice eager's own error against the same model
in float64), the buffers the forward updates (running statistics, spectral_norm's power-iteration vectors) and the
parameters after an SGD step. What a layer does beyond arithmetic is part of it: the running statistics an
InstanceNorm with ``track_running_stats`` updates in training (torch.export keeps ``instance_norm`` whole, whose
update its schema does not declare), spectral_norm's power iteration under ``torch.no_grad()`` in torch.nn's own code
(its vectors carry no gradient), an embedding's ``max_norm`` renormalisation of its weight, the RNN's own list of its
parameters, which its forward rebuilds when traced, and the random draws of dropout-like layers (seeded alike)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine
from autofuse.verify import compare


def _img():
    return torch.randn(2, 4, 8, 8)


def _seq():
    return torch.randn(2, 6, 16)


def _ids():
    return torch.randint(0, 32, (2, 6))


LAYERS = {
    "Linear": (lambda: nn.Linear(16, 16), _seq),
    "Conv1d": (lambda: nn.Conv1d(4, 8, 3, padding=1), lambda: torch.randn(2, 4, 10)),
    "Conv2d (groups, dilation)": (lambda: nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2), _img),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(4, 4, 3, stride=2), _img),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(4), _img),
    "BatchNorm2d (no running stats)": (lambda: nn.BatchNorm2d(4, track_running_stats=False), _img),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(4, affine=True), _img),
    "InstanceNorm2d (running stats)": (lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True), _img),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), _img),
    "LayerNorm": (lambda: nn.LayerNorm(16), _seq),
    "RMSNorm": (lambda: nn.RMSNorm(16), _seq),
    "LocalResponseNorm": (lambda: nn.LocalResponseNorm(3), _img),
    "Embedding (padding_idx)": (lambda: nn.Embedding(32, 16, padding_idx=0), _ids),
    "Embedding (max_norm)": (lambda: nn.Embedding(32, 16, max_norm=1.0), _ids),
    "Embedding (scale_grad_by_freq)": (lambda: nn.Embedding(32, 16, scale_grad_by_freq=True),
                                       lambda: torch.randint(0, 8, (2, 6))),
    "EmbeddingBag": (lambda: nn.EmbeddingBag(32, 16, mode="mean"), _ids),
    "Dropout": (lambda: nn.Dropout(0.3), _seq),
    "Dropout2d": (lambda: nn.Dropout2d(0.3), _img),
    "AlphaDropout": (lambda: nn.AlphaDropout(0.3), _seq),
    "RReLU": (lambda: nn.RReLU(), _seq),
    "PReLU": (lambda: nn.PReLU(), _seq),
    "GLU": (lambda: nn.GLU(), _seq),
    "Softplus": (lambda: nn.Softplus(beta=2, threshold=5), _seq),
    "Hardtanh": (lambda: nn.Hardtanh(-0.5, 0.5), _seq),
    "LogSoftmax": (lambda: nn.LogSoftmax(-1), _seq),
    "MaxPool2d": (lambda: nn.MaxPool2d(2), _img),
    "AvgPool2d": (lambda: nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False), _img),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d((3, 3)), _img),
    "Upsample (bilinear)": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), _img),
    "PixelShuffle": (lambda: nn.PixelShuffle(2), _img),
    "Unfold": (lambda: nn.Unfold(2), _img),
    "ReflectionPad2d": (lambda: nn.ReflectionPad2d(1), _img),
    "LSTM": (lambda: nn.LSTM(16, 16, batch_first=True), _seq),
    "LSTM (2 layers, bidirectional, dropout)": (lambda: nn.LSTM(16, 8, num_layers=2, bidirectional=True,
                                                                dropout=0.3, batch_first=True), _seq),
    "GRU": (lambda: nn.GRU(16, 16, batch_first=True), _seq),
    "RNN": (lambda: nn.RNN(16, 16, batch_first=True), _seq),
    "TransformerEncoderLayer": (lambda: nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), _seq),
    "weight_norm": (lambda: nn.utils.parametrizations.weight_norm(nn.Linear(16, 16)), _seq),
    "spectral_norm": (lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16)), _seq),
    "orthogonal": (lambda: nn.utils.parametrizations.orthogonal(nn.Linear(16, 16)), _seq),
}


class _Around(nn.Module):
    """The layer, its first output if it returns several, then a GELU chain that fuses."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        y = self.layer(x)
        y = y[0] if isinstance(y, tuple) else y
        return F.gelu(y) * 2 + 1


def _steps(model, x, steps=2):
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    fused = AutoFusionEngine.fuse(model, (x,))
    x64 = x.double() if x.is_floating_point() else x
    for step in range(steps):
        outs, args = [], []
        for run, arg in ((fused, x), (eager, x), (ref, x64)):
            arg = arg.detach().clone().requires_grad_(arg.is_floating_point())     # its gradient is compared too
            torch.manual_seed(11 + step)                # the same draws for dropout-like layers
            outs.append(run(arg))
            args.append(arg)
        got, want, exact = outs
        ok, err, tol = compare(want, exact, got)
        assert ok, (step, "output", err, tol)
        for y in outs:
            y.double().square().sum().backward()
        if x.is_floating_point():
            ok, err, tol = compare(args[1].grad, args[2].grad, args[0].grad)
            assert ok, (step, "input", err, tol)
        for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), (step, name)
            if q.grad is not None:
                ok, err, tol = compare(q.grad, r.grad, p.grad)
                assert ok, (step, name, err, tol)
        for (name, b), c in zip(model.named_buffers(), eager.buffers()):
            # running statistics: one update of the same values, fp32 sums in another order at most
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=f"step {step}: buffer {name}")
        with torch.no_grad():
            for m in (model, eager, ref):
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.01 * p.grad
                        p.grad = None
        # a step of 0.01 times gradients within the bound above (a few fp32 roundings of eager's): the parameters
        # move apart by far less than these
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"step {step}: parameter {name}")
    return fused


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_fuses_and_trains_as_in_eager(name, mode):
    make, inputs = LAYERS[name]
    torch.manual_seed(0)
    model = getattr(_Around(make()), mode)()
    fused = _steps(model, inputs())
    assert fused.report.applied, fused.report.summary()


def test_instance_norm_running_statistics_are_updated_and_fuse_leaves_them():
    """The running statistics move at each training call as eager's, and fuse() itself (capture, verification)
    leaves them as they were."""
    torch.manual_seed(0)
    model = _Around(nn.InstanceNorm2d(4, affine=True, track_running_stats=True)).train()
    x = _img()
    fused = AutoFusionEngine.fuse(model, (x,))
    norm = model.layer
    assert float(norm.running_mean.abs().max()) == 0 and float((norm.running_var - 1).abs().max()) == 0
    fused(x)
    assert float(norm.running_mean.abs().max()) > 0 and float((norm.running_var - 1).abs().max()) > 0


def test_spectral_norm_power_iteration_carries_no_gradient():
    """spectral_norm's vectors are updated under torch.no_grad() in torch.nn's own code: the weight's gradient
    flows through sigma = u·Wv with u and v constants, as in eager (differentiating the power iteration too moved
    it by 2e-3 of 23)."""
    torch.manual_seed(0)
    model = _Around(nn.utils.parametrizations.spectral_norm(nn.Linear(16, 16))).train()
    x = _seq()
    eager = copy.deepcopy(model)
    fused = AutoFusionEngine.fuse(model, (x,))
    fused(x).square().sum().backward()
    eager(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)     # fp32 both sides


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_recurrent_layers_capture_and_keep_their_parameter_list(cls):
    """An RNN's forward rebuilds its list of parameters when they are other tensors (traced values, in a capture):
    that list is torch's cache, not state the forward changes. Captured, the model's list holds its parameters as
    before."""
    torch.manual_seed(0)
    layer = cls(16, 16, batch_first=True)
    before = list(layer._flat_weights)
    AutoFusionEngine.fuse(_Around(layer).train(), (_seq(),))
    assert all(a is b for a, b in zip(layer._flat_weights, before)) and len(layer._flat_weights) == len(before)
