"""torch's own nn.Transformer family fused: the values eager gives, where eager's code takes a path a trace does not.

``nn.TransformerEncoder`` in eval with a padding mask runs eager's nested-tensor path (0 at every padded position,
before the final norm), which a trace does not take; a mask given without ``is_causal`` is compared with a causal
mask on the data, which torch.export refuses. autofuse.capture answers both as eager does."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autofuse import AutoFusionEngine

warnings.filterwarnings("ignore", message=".*nested tensors.*")


def _encoder(batch_first=True, norm=False, mask_check=True, layers=2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=batch_first)
    enc = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(32) if norm else None, mask_check=mask_check)
    return enc.eval()


def _padding(kind, b=3, s=12):
    pad = torch.zeros(b, s, dtype=torch.bool)
    if kind == "left_aligned":            # each sequence's tokens first, then its padding
        pad[1, -4:] = True
        pad[2, -7:] = True
    elif kind == "not_aligned":           # a padded position before a token: eager's nested path does not apply
        pad[1, 2] = True
        pad[2, -3:] = True
    elif kind == "none_padded":
        pass
    return pad


def _close(got, want, ref):
    """Within twice eager's own error against the float64 model, elementwise bound by the largest of them."""
    bound = 2 * (want.double() - ref).abs().max().item() + 1e-6
    assert (got.double() - want.double()).abs().max().item() <= bound, (got - want).abs().max()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("kind", ["left_aligned", "not_aligned", "none_padded"])
def test_an_encoder_with_a_padding_mask_in_eval_gives_eagers_values(batch_first, norm, kind):
    enc = _encoder(batch_first, norm)
    pad = _padding(kind)
    x = torch.randn(3, 12, 32) if batch_first else torch.randn(12, 3, 32)
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=pad)
        ref = copy.deepcopy(enc).double()(x.double(), src_key_padding_mask=pad)
    fused = AutoFusionEngine.fuse(enc, ((x,), {"src_key_padding_mask": pad}))
    assert [d.pattern for d in fused.report.applied].count("attention") == 2, fused.report.summary()
    with torch.no_grad():
        got = fused(x, src_key_padding_mask=pad)
        # the plan serves other masks of the shape: the left alignment is checked on the data, as eager checks it
        other = _padding("not_aligned" if kind == "left_aligned" else "left_aligned")
        want2, got2 = enc(x, src_key_padding_mask=other), fused(x, src_key_padding_mask=other)
        ref2 = copy.deepcopy(enc).double()(x.double(), src_key_padding_mask=other)
    _close(got, want, ref)
    _close(got2, want2, ref2)
    if kind == "left_aligned" and not norm and batch_first:      # eager's nested path (batch_first only)
        assert (got[pad] == 0).all() and (want[pad] == 0).all()


def test_an_encoder_called_with_grad_takes_the_padded_path_as_eager():
    # with grad enabled and parameters that require it, eager does not take its nested path: no zeros
    enc = _encoder()
    pad, x = _padding("left_aligned"), torch.randn(3, 12, 32)
    want = enc(x, src_key_padding_mask=pad)
    fused = AutoFusionEngine.fuse(enc, ((x,), {"src_key_padding_mask": pad}))
    got = fused(x, src_key_padding_mask=pad)
    assert not (want[pad] == 0).all() and not (got[pad] == 0).all()
    ref = copy.deepcopy(enc).double()(x.double(), src_key_padding_mask=pad)
    _close(got.detach(), want.detach(), ref.detach())
    with torch.no_grad():                 # the same fused module, now without grad: the nested path's zeros
        assert (fused(x, src_key_padding_mask=pad)[pad] == 0).all()


@pytest.mark.parametrize("kind", ["left_aligned", "not_aligned"])
def test_an_encoder_without_the_mask_check_takes_each_sequences_first_tokens_as_eager(kind):
    # unchecked, eager's nested path keeps each sequence's first L tokens (L its unpadded count), whatever the
    # mask says: with a mask that pads before a token, other positions than the padded ones are 0
    enc = _encoder(mask_check=False)
    pad, x = _padding(kind), torch.randn(3, 12, 32)
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=pad)
        ref = copy.deepcopy(enc).double()(x.double(), src_key_padding_mask=pad)
        fused = AutoFusionEngine.fuse(enc, ((x,), {"src_key_padding_mask": pad}))
        got = fused(x, src_key_padding_mask=pad)
    assert torch.equal(got == 0, want == 0)
    _close(got, want, ref)


@pytest.mark.parametrize("value", [-5.0, 1.0])
def test_a_float_padding_mask_with_finite_values_pads_where_it_is_not_zero_as_eager(value):
    # eager's nested path drops every key whose mask entry is not 0 (whatever the value); the padded path would
    # have added it to the scores
    enc = _encoder()
    pad = torch.zeros(3, 12)
    pad[1, -4:] = value
    x = torch.randn(3, 12, 32)
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=pad)
        ref = copy.deepcopy(enc).double()(x.double(), src_key_padding_mask=pad.double())
        fused = AutoFusionEngine.fuse(enc, ((x,), {"src_key_padding_mask": pad}))
        got = fused(x, src_key_padding_mask=pad)
    _close(got, want, ref)


class Seq2Seq(nn.Module):
    """nn.Transformer called as torch's tutorial calls it: a causal ``tgt_mask``, ``tgt_is_causal`` left unset."""

    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(32, 4, 1, 1, 64, 0.0, batch_first=True)

    def forward(self, src, tgt, tgt_mask):
        return self.t(src, tgt, tgt_mask=tgt_mask)


@pytest.mark.parametrize("mask_kind", ["causal", "not_causal"])
def test_a_transformer_with_a_mask_and_no_causal_hint_fuses_and_gives_eagers_values(mask_kind):
    torch.manual_seed(0)
    m = Seq2Seq().eval()
    src, tgt = torch.randn(2, 10, 32), torch.randn(2, 7, 32)
    mask = nn.Transformer.generate_square_subsequent_mask(7)
    if mask_kind == "not_causal":
        mask = mask.T.contiguous()
    fused = AutoFusionEngine.fuse(m, (src, tgt, mask))
    assert [d.pattern for d in fused.report.applied].count("attention") == 3, fused.report.summary()
    with torch.no_grad():
        want = m(src, tgt, mask)
        ref = copy.deepcopy(m).double()(src.double(), tgt.double(), mask.double())
        _close(fused(src, tgt, mask), want, ref)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("masks", ["none", "padding", "causal", "both", "bool_3d"])
def test_the_encoder_layer_fast_path_as_ops_computes_torchs_kernel(norm_first, activation, masks):
    """autofuse.backend.encoder_layer, what the compile route runs for torch._transformer_encoder_layer_fwd, gives the
    kernel's values: within a few fp32 roundings (the kernel's own order of sums), NaN where it gives NaN (a batch
    whose every key is padded)."""
    from autofuse.backend import encoder_layer
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, 0.0, batch_first=True, norm_first=norm_first,
                                       activation=activation).eval()
    x = torch.randn(3, 10, 32)
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[1, -3:] = True
    pad[2, :] = True
    causal = nn.Transformer.generate_square_subsequent_mask(10)
    src_mask = {"causal": causal, "both": causal, "bool_3d": torch.rand(12, 10, 10) > 0.7}.get(masks)
    padding = pad if masks in ("padding", "both") else None
    canon = lambda m: None if m is None else F._canonical_mask(                    # noqa: E731
        mask=m, mask_name="mask", other_type=None, other_name="", target_type=x.dtype, check_other=False)
    a = layer.self_attn
    mask, mask_type = a.merge_masks(canon(src_mask), canon(padding), x)
    args = (x, a.embed_dim, a.num_heads, a.in_proj_weight, a.in_proj_bias, a.out_proj.weight, a.out_proj.bias,
            layer.activation_relu_or_gelu == 2, norm_first, layer.norm1.eps, layer.norm1.weight, layer.norm1.bias,
            layer.norm2.weight, layer.norm2.bias, layer.linear1.weight, layer.linear1.bias, layer.linear2.weight,
            layer.linear2.bias, mask, mask_type)
    with torch.no_grad():
        want, got = torch._transformer_encoder_layer_fwd(*args), encoder_layer(*args)
    assert torch.equal(want.isnan(), got.isnan())
    assert torch.allclose(got.nan_to_num(0), want.nan_to_num(0), atol=4e-6), (got - want).nan_to_num(0).abs().max()


def test_torchs_own_functions_are_back_after_overlapping_captures():
    # two captures on two threads may end in either order: torch's own functions are back after both
    from torch.nn.modules import transformer as tm

    from autofuse.capture import _torch_transformers_as_eager
    own = (tm.TransformerEncoder.forward, tm._detect_is_causal_mask)
    first, second = _torch_transformers_as_eager(), _torch_transformers_as_eager()
    first.__enter__()
    second.__enter__()
    assert tm.TransformerEncoder.forward is not own[0]
    first.__exit__(None, None, None)
    assert tm.TransformerEncoder.forward is not own[0]       # the second capture still runs
    second.__exit__(None, None, None)
    assert (tm.TransformerEncoder.forward, tm._detect_is_causal_mask) == own


def test_the_dropout_stand_in_is_torchs_own_again_after_overlapping_captures():
    from autofuse.capture import _eager_dropout
    op = torch.ops.aten.dropout.default
    own = dict(op.py_kernels)
    first, second = _eager_dropout(), _eager_dropout()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert dict(op.py_kernels) != own                      # the second capture still runs
    second.__exit__(None, None, None)
    assert dict(op.py_kernels) == own
