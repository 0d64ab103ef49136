"""Property tests (hypothesis): random attention spellings must fuse and equal eager; random near misses must
not fuse and must still equal eager; parameters, buffers and the train/eval mode may change after fuse(); fused with
grad, the spellings (and a bias with a keep-mask in either order, rows that see no key) train as eager: the output
and the gradients within the bound (:func:`_check_training` says which are not compared, and why).

The default run draws a small number of cases; ``python -m pytest -m slow tests/test_properties.py -s``
draws 2,000 spellings, 600 near misses and 600 trained spellings. Counts (cases, fused, rejected, wrong) are
printed at the end of the run. "Equal eager" is the verifier's bound (:func:`autofuse.verify.compare`): NaN and
infinities where eager has them, elsewhere at most twice eager's own error against float64 plus one rounding.
"""
import dataclasses
import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from conftest import drawn  # noqa: E402

from autofuse import AutoFusionEngine  # noqa: E402
from autofuse.verify import compare  # noqa: E402

FUSED_OP = torch.ops.autofuse.flash_attention.default
COUNTS: Counter = Counter()          # this process's counts; each test reports its share (below)

@pytest.fixture(autouse=True)
def _report_counts(record_property):
    """Attach what each test added to the counts to its report, so that conftest's terminal summary can add
    them up in the process that prints it (with pytest-xdist the tests run in worker processes)."""
    before = Counter(COUNTS)
    yield
    record_property("property_counts", dict(COUNTS - before))


FAST = drawn(12)
SLOW = drawn(2000)
SLOW_NEAR = drawn(600)


@dataclass(frozen=True)
class Spelling:
    dtype: torch.dtype
    B: int
    N: int
    kv: int                 # kv heads (divides N)
    Sq: int
    Skv: int
    D: int
    scale: str              # where and how the scores are scaled
    mask: str               # none | additive | masked_fill | where | causal_tril | causal_triu | causal_arange
    fill: float | str       # a bool mask's fill: -inf, "finfo.min", -1e4, -1e9
    empty_row: bool         # one query row sees no key
    gqa: str                # none | repeat_kv | repeat_interleave
    softmax: str            # function | method | fp32 | decomposed
    sdpa: bool
    dropout: bool           # an nn.Dropout on the probabilities, or SDPA's dropout_p (training mode only)


_SCALES = ("mul", "div", "pre_q", "pre_qk", "temperature", "buffer", "sqrt_tensor")

# the attention family alone: its spellings and near misses are compared with the captured graph bit for bit,
# which the softmax family and the generic Vector regions would fuse parts of
ATTENTION_ONLY = {"softmax": "off", "vector_chain": "off", "matmul_epilogue": "off"}


@st.composite
def spellings(draw):
    N = draw(st.sampled_from([1, 2, 4]))
    kv = draw(st.sampled_from([d for d in (1, 2, 4) if N % d == 0]))
    causal_ok = True
    Sq = draw(st.integers(1, 40))
    sdpa = draw(st.booleans())
    mask = draw(st.sampled_from(["none", "additive", "masked_fill", "where", "causal_tril", "causal_triu",
                                 "causal_arange"]))
    Skv = Sq if mask.startswith("causal") else draw(st.integers(1, 40))
    if sdpa and mask in ("masked_fill", "where"):
        mask = "bool_sdpa"
    return Spelling(
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        B=draw(st.integers(1, 2)), N=N, kv=kv, Sq=Sq, Skv=Skv, D=draw(st.sampled_from([4, 8, 16, 24])),
        scale=draw(st.sampled_from(("mul",) if sdpa else _SCALES)), mask=mask,
        fill=draw(st.sampled_from([float("-inf"), "finfo.min", -1e4, -1e9])),
        empty_row=draw(st.booleans()) and causal_ok and mask in ("additive", "masked_fill", "where", "bool_sdpa"),
        gqa=draw(st.sampled_from(["none", "repeat_kv", "repeat_interleave"])) if kv < N else "none",
        softmax=draw(st.sampled_from(["function", "method", "fp32", "decomposed"])), sdpa=sdpa,
        dropout=draw(st.booleans()))


def _fill(sp: Spelling, dtype):
    f = torch.finfo(dtype).min if sp.fill == "finfo.min" else sp.fill
    if sp.fill == -1e9 and dtype == torch.float16:
        f = float("-inf")               # eager refuses to masked_fill a value float16 cannot hold
    return f


class Attention(nn.Module):
    """``forward(q, k, v[, mask])`` in the spelling ``sp``; q [B, N, Sq, D], k/v [B, kv, Skv, D]."""

    def __init__(self, sp: Spelling):
        super().__init__()
        self.sp = sp
        self.temp = nn.Parameter(torch.tensor(sp.D ** -0.5))
        self.register_buffer("inv_scale", torch.tensor(sp.D ** 0.5))
        self.drop = nn.Dropout(0.2)

    def forward(self, q, k, v, mask=None, bias=None):
        sp = self.sp
        rep = sp.N // sp.kv
        if rep > 1:
            if sp.gqa == "repeat_kv":
                b, h, s, d = k.shape
                k = k[:, :, None].expand(b, h, rep, s, d).reshape(b, h * rep, s, d)
                v = v[:, :, None].expand(b, h, rep, s, d).reshape(b, h * rep, s, d)
            else:
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        c = sp.D ** -0.5
        if sp.sdpa:
            am = mask if sp.mask in ("additive", "bool_sdpa") else None
            return F.scaled_dot_product_attention(q, k, v, attn_mask=am, is_causal=sp.mask.startswith("causal"),
                                                  dropout_p=0.2 if sp.dropout and self.training else 0.0)
        if sp.scale == "pre_q":
            q = q * c
        elif sp.scale == "pre_qk":
            q, k = q * c ** 0.5, k * c ** 0.5
        s = q @ k.transpose(-2, -1)
        if sp.scale == "mul":
            s = s * c
        elif sp.scale == "div":
            s = s / math.sqrt(sp.D)
        elif sp.scale == "temperature":
            s = s * self.temp
        elif sp.scale == "buffer":
            s = s / self.inv_scale
        elif sp.scale == "sqrt_tensor":
            s = s / torch.sqrt(torch.tensor(float(sp.D)))
        fill = _fill(sp, s.dtype)
        if sp.mask == "additive":
            s = s + mask
        elif sp.mask == "masked_fill":
            s = s.masked_fill(~mask, fill)
        elif sp.mask == "where":
            s = torch.where(mask, s, fill)
        elif sp.mask == "bias_fill":              # MPT's order: a bias, then the keep-mask's fill
            s = (s + bias).masked_fill(~mask, fill)
        elif sp.mask == "fill_bias":
            s = s.masked_fill(~mask, fill) + bias
        elif sp.mask == "causal_tril":
            s = s.masked_fill(torch.tril(torch.ones(sp.Sq, sp.Skv, device=s.device)) == 0, fill)
        elif sp.mask == "causal_triu":
            s = s.masked_fill(torch.triu(torch.ones(sp.Sq, sp.Skv, dtype=torch.bool, device=s.device), 1), fill)
        elif sp.mask == "causal_arange":
            i = torch.arange(sp.Sq, device=s.device)
            s = torch.where(i[:, None] >= i[None, :], s, fill)
        if sp.softmax == "function":
            p = F.softmax(s, dim=-1)
        elif sp.softmax == "method":
            p = s.softmax(-1)
        elif sp.softmax == "fp32":
            p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            e = (s - s.amax(-1, keepdim=True)).exp()
            p = e / e.sum(-1, keepdim=True)
        if sp.dropout:
            p = self.drop(p)
        return p @ v


def _inputs(sp: Spelling, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sp.B, sp.N, sp.Sq, sp.D, generator=g).to(sp.dtype)
    k, v = (torch.randn(sp.B, sp.kv, sp.Skv, sp.D, generator=g).to(sp.dtype) for _ in range(2))
    if sp.mask == "additive":
        m = (torch.randn(sp.B, 1, sp.Sq, sp.Skv, generator=g)).to(sp.dtype)
        if sp.empty_row:
            m[:, :, 0] = _fill(sp, sp.dtype)
        return q, k, v, m
    if sp.mask in ("masked_fill", "where", "bool_sdpa", "bias_fill", "fill_bias"):
        m = torch.rand(sp.B, 1, sp.Sq, sp.Skv, generator=g) > 0.3
        if sp.empty_row:
            m[:, :, 0] = False
        if sp.mask in ("bias_fill", "fill_bias"):
            return q, k, v, m, torch.randn(1, sp.N, sp.Sq, sp.Skv, generator=g).to(sp.dtype)
        return q, k, v, m
    return q, k, v


def _float64(model):
    model64 = Attention(model.sp).double()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return model64.train(model.training)


def _equal_eager(model, args, got):
    want = model(*args)
    ref = _float64(model)
    with torch.no_grad():
        ref = ref(*[a.double() if a.is_floating_point() else a for a in args])
    ok, err, tol = compare(want, ref, got)
    return ok, f"error {err:.3g} > bound {tol:.3g}"


def _fused_calls(fused):
    return [n for n in fused.graph_module.graph.nodes if n.op == "call_function" and n.target is FUSED_OP]


def _check_spelling(sp: Spelling, seed: int):
    COUNTS["cases"] += 1
    model = Attention(sp).eval()
    args = _inputs(sp, seed)
    with torch.no_grad():
        # attention's spellings: the softmax family (tests/test_softmax_pattern.py) off, so that training mode
        # runs the captured graph's softmax, as this test compares it
        fused = AutoFusionEngine.fuse(model, args, fusion_switches=ATTENTION_ONLY)
        calls = _fused_calls(fused)
        if len(calls) != 1:
            COUNTS["rejected"] += 1
            COUNTS["wrong"] += 1
            pytest.fail(f"{sp} was not fused:\n{fused.report.summary()}")
        COUNTS["fused"] += 1
        ok, why = _equal_eager(model, args, fused(*args))
        if not ok:
            COUNTS["wrong"] += 1
            pytest.fail(f"{sp}: fused != eager: {why}")
        # the user's state changes after fuse(): the fused module follows
        with torch.no_grad():
            model.temp.mul_(1.5)
            model.inv_scale.mul_(0.5)
        ok, why = _equal_eager(model, args, fused(*args))
        if not ok:
            COUNTS["wrong"] += 1
            pytest.fail(f"{sp}: after a parameter/buffer edit: {why}")
    if sp.dropout:                   # training mode fuses the dropout too: the same seed draws the same masks
        model.train()
        runs = []
        for fn in (fused, model, _float64(model)):
            torch.manual_seed(seed)
            with torch.no_grad():
                out = fn(*[a.double() if fn is not fused and fn is not model and a.is_floating_point() else a
                           for a in args])
            runs.append((out, torch.rand(2)))      # the output, and where the run left the generator
        (got, g_after), (want, e_after), (ref, _) = runs
        assert len(_fused_calls(fused)) == 1, f"{sp}: not fused in training mode:\n{fused.report.summary()}"
        assert torch.equal(g_after, e_after), f"{sp}: the fused model moved the generator differently"
        ok, err, tol = compare(want, ref, got)
        assert ok, f"{sp}: training mode: error {err:.3g} > bound {tol:.3g}"
        model.eval()
        with torch.no_grad():
            ok, why = _equal_eager(model, args, fused(*args))
        assert ok, f"{sp}: back in eval mode: {why}"


@FAST
@given(spellings(), st.integers(0, 2 ** 16))
def test_random_spellings_fuse_and_equal_eager(sp, seed):
    _check_spelling(sp, seed)


@pytest.mark.slow
@SLOW
@given(spellings(), st.integers(0, 2 ** 16))
def test_random_spellings_fuse_and_equal_eager_2000(sp, seed):
    _check_spelling(sp, seed)


# ------------------------------------------------------------------------------- training: the gradients

@st.composite
def trained_spellings(draw):
    """Attention spellings in training mode (no dropout: the gradients are compared), the masks also a bias and a
    keep-mask in either order (MPT's ``(s + bias).masked_fill(~keep, fill)``), rows that see no key included."""
    sp = draw(spellings())
    if not sp.sdpa and draw(st.booleans()):
        sp = dataclasses.replace(sp, mask=draw(st.sampled_from(["bias_fill", "fill_bias"])), Skv=sp.Sq,
                                 empty_row=draw(st.booleans()))
    return dataclasses.replace(sp, dropout=False)


def _check_training(sp: Spelling, seed: int):
    """Fused with grad: the output and the gradients of q, k, v and a float mask or bias equal eager's within the
    verifier's bound (a row that sees no key: NaN where eager's is, in the output and dv); the learnable temperature
    gets a gradient where eager's does. Its value is one sum over every score, added in another order than eager's:
    no elementwise bound from eager's error at that one element holds it (a draw found it 1.5 times over), and dq
    and dk carry its effect on each score. Over one key P is 1 and dS rounding noise: dq and dk are then sums of
    noise, which no bound from eager's own noise holds (a draw: 1.4e-6 against 9.5e-7), and are not compared. A bias
    added after a ``-inf`` fill gets no gradient from a row every key of which is filled, where eager's is NaN (README,
    Masks mean what they meant): compared elsewhere."""
    model = Attention(sp).train()
    args = _inputs(sp, seed)
    with torch.enable_grad():
        fused = AutoFusionEngine.fuse(model, args, fusion_switches=ATTENTION_ONLY)
    COUNTS["trained"] += 1
    COUNTS["trained_fused"] += bool(_fused_calls(fused))
    runs = []
    for fn, wide in ((fused, False), (model, False), (_float64(model), True)):
        xs = [a.detach().double() if wide and a.is_floating_point() else a.detach().clone() for a in args]
        xs = [x.requires_grad_() if x.is_floating_point() else x for x in xs]
        params = model if fn is fused else fn
        params.zero_grad()
        out = fn(*xs)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
        torch.where(torch.isfinite(out), out * w, 0).sum().backward()
        runs.append([out.detach()] + [x.grad for x in xs if x.is_floating_point()] + [params.temp.grad])
    names = ["output"] + [n for n, a in zip(("dq", "dk", "dv", "dmask", "dbias"), args) if a.is_floating_point()] + \
        ["dtemperature"]
    for name, got, want, exact in zip(names, *runs):
        if want is None:
            assert got is None, f"{sp}: {name}: eager has none, the fused model has one"
            continue
        assert got is not None, f"{sp}: {name}: the fused model has none"
        if name == "dtemperature" or (name in ("dq", "dk") and sp.Skv == 1):
            continue
        if name == "dbias" and sp.mask == "fill_bias" and _fill(sp, sp.dtype) == float("-inf"):
            keep = ~torch.isnan(want)
            got, want, exact = got[keep], want[keep], exact[keep]
        ok, err, tol = compare(want, exact, got)
        if not ok:
            COUNTS["wrong"] += 1
            pytest.fail(f"{sp}: training: {name}: error {err:.3g} > bound {tol:.3g}:\n{fused.report.summary()}")


# MPT's spelling with a left-padded query: the gradient a combined mask passed through its filled scores
@example(Spelling(torch.float32, 2, 2, 2, 8, 8, 8, "mul", "bias_fill", "finfo.min", True, "none", "function", False,
                  False), 0)
@FAST
@given(trained_spellings(), st.integers(0, 2 ** 16))
def test_random_spellings_train_as_eager(sp, seed):
    _check_training(sp, seed)


@pytest.mark.slow
@SLOW_NEAR
@given(trained_spellings(), st.integers(0, 2 ** 16))
def test_random_spellings_train_as_eager_600(sp, seed):
    _check_training(sp, seed)


# --------------------------------------------------------------------------------------------- near misses

NEAR_MISSES = ("softmax_other_dim", "mask_after_softmax", "per_key_scale", "edited_probs", "swapped_key_heads",
               "probs_plus", "scores_used_elsewhere", "positive_fill")


class NearMiss(nn.Module):
    def __init__(self, kind, S):
        super().__init__()
        self.kind = kind
        self.w = nn.Parameter(torch.rand(S) + 0.5)

    def forward(self, q, k, v, keep):
        c = q.shape[-1] ** -0.5
        if self.kind == "swapped_key_heads":       # heads and sequence swapped, not the last two dims
            s = q @ k.permute(0, 2, 1, 3) * c
        else:
            s = q @ k.transpose(-2, -1) * c
        if self.kind == "per_key_scale":
            s = s * self.w
        if self.kind == "positive_fill":
            s = s.masked_fill(~keep, 0.5)
        p = torch.softmax(s, dim=-2 if self.kind == "softmax_other_dim" else -1)
        if self.kind == "mask_after_softmax":
            p = p.masked_fill(~keep, 0.0)
        if self.kind == "edited_probs":
            p = p * 2.0 - 0.1
        if self.kind == "probs_plus":
            p = p + 0.01
        out = p @ v
        if self.kind == "scores_used_elsewhere":
            return out, s.amax(-1)
        return out


def _check_near_miss(kind, S, D, dtype, seed):
    COUNTS["near_miss_cases"] += 1
    g = torch.Generator().manual_seed(seed)
    N = S                                  # square heads x sequence so the swapped permute type-checks
    q, k, v = (torch.randn(1, N, S, D, generator=g).to(dtype) for _ in range(3))
    if kind == "swapped_key_heads":
        D = S
        q, k, v = (torch.randn(1, N, S, S, generator=g).to(dtype) for _ in range(3))
    keep = torch.rand(1, 1, S, S, generator=g) > 0.3
    model = NearMiss(kind, S).to(dtype).eval()
    with torch.no_grad():
        # attention's near misses: the softmax family (tests/test_softmax_pattern.py) off, so that the output is
        # the captured graph's bit for bit, as this test checks
        fused = AutoFusionEngine.fuse(model, (q, k, v, keep), fusion_switches=ATTENTION_ONLY)
        if _fused_calls(fused):
            COUNTS["near_miss_fused"] += 1
            COUNTS["wrong"] += 1
            pytest.fail(f"near miss {kind} was fused:\n{fused.report.summary()}")
        got, want = fused(q, k, v, keep), model(q, k, v, keep)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want):
        if not torch.equal(a, b):          # nothing fused: the captured graph runs, bit for bit
            COUNTS["wrong"] += 1
            pytest.fail(f"near miss {kind}: the unfused graph differs from eager")
    COUNTS["near_miss_rejected"] += 1


@st.composite
def near_misses(draw):
    return (draw(st.sampled_from(NEAR_MISSES)), draw(st.integers(2, 12)), draw(st.sampled_from([4, 8, 16])),
            draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])), draw(st.integers(0, 2 ** 16)))


@FAST
@given(near_misses())
def test_random_near_misses_do_not_fuse(case):
    _check_near_miss(*case)


@pytest.mark.slow
@SLOW_NEAR
@given(near_misses())
def test_random_near_misses_do_not_fuse_600(case):
    _check_near_miss(*case)
