"""transformers' float16 overflow clamp (BART, Marian, LED, ... ``if h.dtype == torch.float16 and not
torch.isfinite(h).all(): h = torch.clamp(h, ±(max - 1000))``; LongT5's ``torch.isinf(h).any()``) branches on values,
which torch.export refuses. Capture takes it as ``torch.where`` over both branches (autofuse.capture,
``_overflow_clamps``): the fused model clamps where eager clamps and nowhere else, on both sides of the branch. Any
other data-dependent branch keeps its capture error."""
import copy

import pytest
import torch

from autofuse import AutoFusionEngine
from autofuse.capture import CaptureError, capture
from autofuse.verify import compare

LIMIT = torch.finfo(torch.float16).max - 1000       # transformers' clamp bound: 64504
BOUND16 = float(torch.tensor(LIMIT, dtype=torch.float16))      # 64512: the bound in float16 (and 64512 - 1)


class Clamped(torch.nn.Module):
    """The idiom as transformers spells it, after a product by a parameter that drives the values past float16's
    range (x * scale: one rounding of an exact product, eager's and any fused chain's alike)."""

    def __init__(self, spelling="isfinite"):
        super().__init__()
        self.spelling = spelling
        self.scale = torch.nn.Parameter(torch.ones((), dtype=torch.float16))

    def forward(self, x):
        hidden_states = x * self.scale
        if self.spelling == "isfinite":
            if hidden_states.dtype == torch.float16 and not torch.isfinite(hidden_states).all():
                clamp_value = torch.finfo(hidden_states.dtype).max - 1000
                hidden_states = torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)
        elif hidden_states.dtype == torch.float16 and torch.isinf(hidden_states).any():
            clamp_value = torch.finfo(hidden_states.dtype).max - 1000
            hidden_states = torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)
        return hidden_states - 1


def _inputs(*big):
    x = torch.linspace(-2, 2, 32, dtype=torch.float16).reshape(4, 8)
    for i, v in enumerate(big):
        x[i, i] = v
    return x


# (case, scale, the values put in x): eager's branch, and what an unconditional clamp would get wrong
CASES = [
    ("ordinary", 1.0, ()),                                  # nothing near the limit: no clamp
    ("finite above the bound", 2.0, (32500.0,)),            # 65000, finite: eager leaves it, as the fused model must
    ("overflow", 2.0, (32500.0, -40000.0)),                 # -inf: eager clamps both, 65000 to 64512 too
    ("NaN", 2.0, (32500.0, float("nan"))),                  # not finite: isfinite's branch clamps, isinf's does not
]


def _same(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("spelling", ["isfinite", "isinf"])
def test_the_idiom_captures_as_where_and_runs_as_eager_on_both_sides_of_the_branch(spelling):
    torch.manual_seed(0)
    model = Clamped(spelling)
    captured = capture(model, (_inputs(),))
    targets = {n.target for n in captured.graph_module.graph.nodes if n.op == "call_function"}
    assert {torch.ops.aten.where.self, torch.ops.aten.clamp.default} <= targets, captured.graph_module.code
    fused = AutoFusionEngine.fuse(model, (_inputs(),))
    for case, scale, big in CASES:
        x = _inputs(*big)
        with torch.no_grad():
            model.scale.fill_(scale)            # read at each call: the plan assumed nothing about it
            want, got = model(x), fused(x)
        _same(got, want)
        above = (x * scale).isfinite() & ((x * scale).abs() > LIMIT)
        clamped = spelling == "isfinite" and not (x * scale).isfinite().all() or (x * scale).isinf().any()
        if case == "finite above the bound":
            assert above.any() and not clamped and want.max().item() > BOUND16         # 65000 - 1: left as it is
            assert not torch.equal(torch.clamp(x * scale, -LIMIT, LIMIT) - 1, want)   # which a clamp would change
        if clamped:
            assert above.any() and want.nan_to_num(0).max().item() == BOUND16
            assert (want.isinf().sum(), want.isnan().sum()) == (0, int(x.isnan().sum())), case


def test_the_idiom_trains_as_eager_on_both_sides_of_the_branch():
    """With grad: torch.where passes the gradient of the branch eager takes (clamped values get none)."""
    model = Clamped()
    fused = AutoFusionEngine.fuse(model, (_inputs(),))
    for case, scale, big in CASES:
        grads = []
        for m in (model, fused):
            with torch.no_grad():
                model.scale.fill_(scale)
            x = _inputs(*big).requires_grad_()
            out = m(x)
            out.backward(torch.ones_like(out))
            grads.append((out.detach(), x.grad))
        (want, want_g), (got, got_g) = grads
        _same(got, want)
        _same(got_g, want_g)


def test_the_user_model_and_torch_are_left_as_they_were():
    from torch.overrides import _get_current_function_mode_stack
    model = Clamped()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    capture(model, (_inputs(),))
    with pytest.raises(CaptureError):
        capture(NotTheIdiom("sum"), (_inputs(),))
    assert _get_current_function_mode_stack() == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert type(model).forward is Clamped.forward and "forward" not in vars(model)


class NotTheIdiom(torch.nn.Module):
    """Data-dependent branches near the idiom, which capture must refuse as before."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        h = x * 2
        if self.kind == "sum":
            if h.sum() > 0:
                h = h * 2
        elif self.kind == "else":
            if not torch.isfinite(h).all():
                h = torch.clamp(h, min=-60000, max=60000)
            else:
                h = h + 1
        elif self.kind == "other body":
            if not torch.isfinite(h).all():
                h = h * 0.5
        elif self.kind == "other variable":
            y = h + 1
            if not torch.isfinite(h).all():
                h = torch.clamp(y, min=-60000, max=60000)
        elif self.kind == "name read after":
            clamp_value = 0.0
            if not torch.isfinite(h).all():
                clamp_value = torch.finfo(h.dtype).max - 1000
                h = torch.clamp(h, min=-clamp_value, max=clamp_value)
            h = h + clamp_value
        elif self.kind == "wrong sense":
            if torch.isfinite(h).all():
                h = torch.clamp(h, min=-60000, max=60000)
        return h


@pytest.mark.parametrize("kind", ["sum", "else", "other body", "other variable", "name read after", "wrong sense"])
def test_other_data_dependent_branches_keep_the_capture_error(kind):
    with pytest.raises(CaptureError) as e:
        AutoFusionEngine.fuse(NotTheIdiom(kind), (_inputs(),))
    text = str(e.value)
    assert "GuardOnDataDependentSymNode" in text and "torch.compile(model, backend='autofuse')" in text, text
    assert "test_overflow_clamp.py" in text and " if " in text, text          # the user's line that branches


tf = pytest.importorskip("transformers")


def _bart(layers=1):
    cfg = tf.BartConfig(vocab_size=128, pad_token_id=0, decoder_start_token_id=0, encoder_layers=layers,
                        decoder_layers=layers, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128,
                        encoder_attention_heads=4, decoder_attention_heads=4, max_position_embeddings=64,
                        bos_token_id=0, eos_token_id=0, forced_eos_token_id=None)
    cfg._attn_implementation = "sdpa"
    return tf.BartForConditionalGeneration(cfg).eval()


def test_bart_in_float16_fuses_within_the_bound():
    """The whole model (encoder and decoder layers clamp) on ordinary inputs: no value overflows, nothing clamps,
    and the logits are within the verifier's bound of float64 (at most twice eager's error)."""
    torch.manual_seed(0)
    model = _bart()
    ref, model = copy.deepcopy(model).double(), model.half()
    ids, dec = torch.randint(1, 128, (2, 12)), torch.randint(1, 128, (2, 8))
    fused = AutoFusionEngine.fuse(model, ((ids,), {"decoder_input_ids": dec}))
    assert fused.report.of("attention") and all(d.applied for d in fused.report.of("attention"))
    with torch.no_grad():
        got, want = fused(ids, decoder_input_ids=dec).logits, model(ids, decoder_input_ids=dec).logits
        ok, err, tol = compare(want, ref(ids, decoder_input_ids=dec).logits, got)
    assert ok, (err, tol)


def test_bart_encoder_in_float16_clamps_where_eager_does():
    """A final layer norm's weight set past float16's range overflows some outputs: eager clamps them all to the
    bound (64512), and the fused encoder too; the rest are within the verifier's bound of float64."""
    torch.manual_seed(0)
    model = _bart()
    ref, encoder = copy.deepcopy(model).double().get_encoder(), model.half().get_encoder()
    ids = torch.randint(1, 128, (2, 12))
    fused = AutoFusionEngine.fuse(encoder, ((ids,), {}))
    for weight in (None, 60000.0):
        with torch.no_grad():
            if weight is not None:
                for m in (encoder, ref):
                    m.layers[-1].final_layer_norm.weight[0] = weight
            got, want = fused(ids).last_hidden_state, encoder(ids).last_hidden_state
            exact = ref(ids).last_hidden_state
        clamped = want.abs() >= LIMIT
        assert got.isfinite().all() and want.isfinite().all()
        assert bool(clamped.any()) == (weight is not None) and bool(exact.abs().max() > 65504) == (weight is not None)
        assert torch.equal(got[clamped], want[clamped])
        ok, err, tol = compare(want[~clamped], exact[~clamped], got[~clamped])
        assert ok, (weight, err, tol)


def test_detr_in_training_fuses_and_runs_as_eager():
    """The DETR family clamps so in training, in any dtype (``if self.training: if not torch.isfinite(h).all():``):
    DETR with a small ResNet backbone captures in training mode (it was refused there) and runs as eager, its
    dropouts at 0 (nothing drawn)."""
    torch.manual_seed(0)
    backbone = tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                               out_features=["stage2"])
    cfg = tf.DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone, d_model=32,
                        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=8, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0)
    model, x = tf.DetrModel(cfg).train(), torch.randn(1, 3, 64, 64)
    fused = AutoFusionEngine.fuse(model, (x,))
    assert fused.report.of("attention") and all(d.applied for d in fused.report.of("attention"))
    got, want = fused(x).last_hidden_state, model(x).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)       # the fp32 bound of tests/test_more_architectures
