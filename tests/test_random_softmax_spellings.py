"""Property tests (hypothesis): random spellings of the softmax family, fused through ``AutoFusionEngine.fuse``, must
equal eager on fresh inputs, on ordinary values and on special ones, without grad and with grad.

A spelling is scores ``x`` of rank 2 to 4 in fp32, fp16 or bf16, up to four steps before the softmax (a cast up or
down, a scale or a division by a number, an additive mask added or subtracted, a bool mask by ``where`` or
``masked_fill`` with a fill of ``-inf``, ``finfo.min``, -1e9, -1e4, -30000 or -0.5), the softmax as
``F.softmax``, ``torch.softmax(dtype=float32)``, the method, ``log_softmax``, ``exp(z - max) / sum`` (with the
division or a reciprocal), ``z - logsumexp(z)``, its ``exp``, or ``log(softmax(z))``, over the last dim or another,
and a cast after it. Masks are broadcast over the rows, the columns or the leading dims, of the scores' dtype, fp32
or built from the keep-mask; inputs after the plan are drawn again, and a second time with special values: a row
whose every score is masked, a score of ``+inf`` or ``-inf``, and a score near the dtype's largest (halved by every
factor above 1 the spelling scales by, and by 2: eager computes each step in 16 bits, the kernel in fp32, and a
16-bit logsumexp spelling's statistic rounded where its scores are not would leave a score eager overflows finite).
With grad, the gradient of x (and of an fp32 mask) under a random weighting of the finite outputs.

"Equal eager" is the verifier's bound (:func:`autofuse.verify.compare`); with special inputs a NaN where eager has a
number is accepted only as the bound accepts it; a value of another dtype than the spelling's (an fp32 mask's
gradient) gets the rounding of the spelling's dtype, the precision it was computed in. Divisions are by powers of
two: the softmax kernel multiplies by its scale, so ``z / c`` is ``z · (1/c)`` there, within one rounding of eager's
quotient, but where eager's roundings happen to cancel (scores far from 0 against their spread, a row masked with
``finfo.min`` then divided by 3: the softmax reads only their differences) that one rounding exceeds twice eager's
error. A bool mask applied before an additive one that requires grad: eager's gradient of the mask is NaN on a row
every score of which is filled, the fused graph's none (README); compared elsewhere. In 16 bits
a spelling adds at most one additive mask: the kernel adds one mask, several terms summed first, which rounds once
where eager rounds each 16-bit add (the same values where each term is 0 or absorbs, as masks are built; -30000
twice in fp16 rounds otherwise).

Modes: through ``fuse()`` and through ``torch.compile(backend=autofuse.backend())``, each without and with grad. The
default run draws a few spellings per mode (derandomized: the same every run); ``python -m pytest -m slow
tests/test_random_softmax_spellings.py`` draws 300 per mode.
"""
import copy
import math
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from conftest import drawn  # noqa: E402

import autofuse  # noqa: E402
from autofuse import AutoFusionEngine  # noqa: E402
from autofuse.backend import reports  # noqa: E402
from autofuse.verify import compare, floor  # noqa: E402

FAST = drawn(12)
SLOW = drawn(300)

PRE = ["up", "down", "scale", "div", "addmask", "submask", "where", "masked_fill"]
FORMS = ["softmax", "softmax_dtype", "method", "log_softmax", "decomposed", "decomposed_recip", "lse", "exp_lse",
         "log_of"]
FILLS = [-math.inf, "min", -1e9, -1e4, -30000.0, -0.5]


@dataclass(frozen=True)
class Spelling:
    dtype: torch.dtype
    shape: tuple
    dim: int
    pre: tuple
    fill: object
    form: str
    post: object
    mask_shape: str
    mask_dtype: str
    scale: float


@st.composite
def spellings(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    rank = draw(st.integers(2, 4))
    full = (draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([2, 4])), draw(st.sampled_from([3, 5, 8])),
            draw(st.sampled_from([4, 7, 16, 33])))
    pre = draw(st.lists(st.sampled_from(PRE), max_size=4))
    if dtype != torch.float32:
        seen = False                       # one additive mask in 16 bits (module docstring)
        kept = []
        for p in pre:
            if p in ("addmask", "submask"):
                if seen:
                    continue
                seen = True
            kept.append(p)
        pre = kept
    return Spelling(dtype, full[4 - rank:], draw(st.sampled_from([-1, -1, rank - 1, -2, 0])), tuple(pre),
                    draw(st.sampled_from(FILLS)), draw(st.sampled_from(FORMS)),
                    draw(st.sampled_from([None, None, "back", "float", "half"])),
                    draw(st.sampled_from(["full", "row", "col", "lead"])),
                    draw(st.sampled_from(["same", "float32", "from_keep"])),
                    draw(st.sampled_from([0.125, 0.5, 3.0, 1 / 3, 2.0])))


def _divisor(sp: Spelling) -> float:
    """What ``div`` divides by: the scale where it is a power of two, else its nearest power of two (module
    docstring: a division is computed as a product with the reciprocal)."""
    return sp.scale if math.frexp(sp.scale)[0] == 0.5 else 2.0 ** round(math.log2(sp.scale))


def _fill(sp: Spelling, dtype):
    if sp.fill == "min" or (sp.fill != -math.inf and sp.fill < torch.finfo(dtype).min):
        return torch.finfo(dtype).min
    return sp.fill


class Model(nn.Module):
    def __init__(self, sp: Spelling):
        super().__init__()
        self.sp = sp

    def forward(self, x, add, keep):
        sp, z, dt, d = self.sp, x, x.dtype, self.sp.dim
        for p in sp.pre:
            if p == "up":
                z = z.float()
            elif p == "down":
                z = z.to(dt)
            elif p == "scale":
                z = z * sp.scale
            elif p == "div":
                z = z / _divisor(sp)
            elif p == "addmask":
                z = z + add
            elif p == "submask":
                z = z - add
            elif p == "where":
                z = torch.where(keep, z, _fill(sp, z.dtype))
            else:
                z = z.masked_fill(~keep, _fill(sp, z.dtype))
        f = sp.form
        if f == "softmax":
            y = F.softmax(z, dim=d)
        elif f == "softmax_dtype":
            y = torch.softmax(z, d, dtype=torch.float32)
        elif f == "method":
            y = z.softmax(d)
        elif f == "log_softmax":
            y = F.log_softmax(z, dim=d)
        elif f in ("decomposed", "decomposed_recip"):
            e = (z - z.amax(d, keepdim=True)).exp()
            y = e / e.sum(d, keepdim=True) if f == "decomposed" else e * (1.0 / e.sum(dim=d, keepdim=True))
        elif f == "lse":
            y = z - torch.logsumexp(z, d, keepdim=True)
        elif f == "exp_lse":
            y = torch.exp(z - z.logsumexp(d, keepdim=True))
        else:
            y = torch.log(torch.softmax(z, d))
        return {"back": y.to(dt), "float": y.float(), "half": y.half()}.get(sp.post, y)


def _inputs(sp: Spelling, g: torch.Generator, special: bool):
    x = (torch.randn(sp.shape, generator=g) * 3).to(sp.dtype)
    ms = list(sp.shape)
    if sp.mask_shape == "row":
        ms[-1] = 1
    elif sp.mask_shape == "col":
        ms[-2] = 1
    elif sp.mask_shape == "lead":
        ms = [1] * (len(ms) - 2) + ms[-2:]
    keep = torch.rand(ms, generator=g) > 0.3
    mdt = {"same": sp.dtype, "float32": torch.float32, "from_keep": sp.dtype}[sp.mask_dtype]
    if special:
        keep.view(-1, ms[-1])[0] = False                    # a row (or a column) every score of which is masked
        grow = 1.0
        for p in sp.pre:
            grow *= max(1.0, sp.scale if p == "scale" else 1 / _divisor(sp) if p == "div" else 1.0)
        x.view(-1)[0] = math.inf if torch.rand(1, generator=g).item() < 0.3 else -math.inf
        x.view(-1)[-1] = torch.finfo(sp.dtype).max / grow / 2
    if sp.mask_dtype == "from_keep":
        add = torch.zeros(ms, dtype=mdt).masked_fill(~keep, _fill(sp, mdt))
    else:
        add = (torch.randn(ms, generator=g) * 2).to(mdt).masked_fill(~keep, _fill(sp, mdt))
    return x, add, keep


def _filled_before_added(sp: Spelling) -> bool:
    """A bool mask applied before an additive one (``x.masked_fill(~keep, fill) + add``)."""
    bools = [i for i, p in enumerate(sp.pre) if p in ("where", "masked_fill")]
    adds = [i for i, p in enumerate(sp.pre) if p in ("addmask", "submask")]
    return bool(bools and adds and min(bools) < max(adds))


def _gradients(f, xs, seed, wrt_mask):
    x = xs[0].detach().clone().requires_grad_()
    add = xs[1].detach().clone().requires_grad_(wrt_mask)
    y = f(x, add, xs[2])
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (torch.where(torch.isfinite(y), y, 0).double() * w).sum().backward()
    return [x.grad] + ([add.grad] if wrt_mask else [])


def _check(sp: Spelling, grad: bool, seed: int = 0, compiled: bool = False):
    model = Model(sp)
    exact_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    example = _inputs(sp, g, False)
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore")
        if compiled:
            torch._dynamo.reset()
            fused = torch.compile(model, backend=autofuse.backend())
        else:
            fused = AutoFusionEngine.fuse(model, (example, {}))
    wrt_mask = grad and sp.mask_dtype == "float32" and any(p in ("addmask", "submask") for p in sp.pre)
    for special in (False, True):
        xs = _inputs(sp, g, special)
        wide = [t.double() if t.is_floating_point() else t for t in xs]
        if grad:
            pairs = zip(_gradients(model, xs, seed, wrt_mask), _gradients(exact_model, wide, seed, wrt_mask),
                        _gradients(fused, xs, seed, wrt_mask))
        else:
            with torch.no_grad():
                pairs = [(model(*xs), exact_model(*wide), fused(*xs))]
        for i, (want, exact, got) in enumerate(pairs):
            if i == 1 and _filled_before_added(sp) and want is not None and got is not None:
                # the mask's gradient on a row every score of which the bool mask filled before the add: eager's is
                # NaN there, the fused graph's where combining the masks passes none (README, Masks mean what they
                # meant); compared elsewhere
                keep_ = ~torch.isnan(want)
                want, exact, got = want[keep_], exact[keep_], got[keep_]
            if want is None:
                assert got is None, f"value {i}: eager has no gradient, the fused model has one"
                continue
            assert got is not None and got.dtype == want.dtype and got.shape == want.shape, f"value {i}"
            ok, err, tol = compare(want, exact, got, nan_ok=special)
            if not ok and want.dtype != sp.dtype and want.is_floating_point() and bool(torch.isfinite(exact).any()):
                # a value of another dtype than the spelling's computed from it (an fp32 mask's gradient, an output
                # cast up): one rounding of the spelling's dtype, the precision it was computed in
                fin = torch.isfinite(exact)
                tol = 2 * (want.double() - exact)[fin].abs().max().item() + \
                    floor(sp.dtype) * max(1.0, exact[fin].abs().max().item())
                ok = err <= tol
            fused_blocks = [d.pattern for r in (reports(fused) if compiled else [fused.report]) for d in r.applied]
            assert ok, (f"{'gradient' if grad else 'output'} {i} ({'special' if special else 'ordinary'} inputs), "
                        f"fused {fused_blocks}: error {err:.3g} > bound {tol:.3g}")
    if compiled:
        assert reports(fused), "torch.compile did not hand a graph to the autofuse backend"


MODES = {"no_grad": (False, False), "grad": (True, False), "compile": (False, True), "compile_grad": (True, True)}


@pytest.mark.parametrize("mode", MODES)
@FAST
@given(sp=spellings())
def test_random_softmax_spellings_equal_eager(mode, sp):
    grad, compiled = MODES[mode]
    _check(sp, grad, compiled=compiled)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@SLOW
@given(sp=spellings())
def test_random_softmax_spellings_equal_eager_300_per_mode(mode, sp):
    grad, compiled = MODES[mode]
    _check(sp, grad, compiled=compiled)
