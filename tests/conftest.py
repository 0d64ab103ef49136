"""Shared test fixtures: a plain-torch reference for the fused attention op.

``attention_ref`` (``torch.ops.autofuse_test.attention_ref``) has the signature of
``torch.ops.autofuse.flash_attention`` and SDPA semantics: bool mask True = attend, additive mask
added to the scaled scores (after the soft-cap ``softcap·tanh(s/softcap)``), ``causal`` = top-left ``tril``, GQA by ``k/v.repeat_interleave``, fp32
softmax, a row with every key masked gives zeros; ``sinks`` (one logit per head) are a last score column of their own
in the softmax, dropped before P·V; ``mask_add_dtype`` (fp16, bf16): the additive mask added as eager adds it to scores
of that dtype (the scores rounded to it, the sum rounded to it).
"""
from collections import Counter

import pytest
import torch


@torch.library.custom_op("autofuse_test::attention_ref", mutates_args=())
def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                  scale: float | None = None, causal: bool = False, return_probs: bool = False,
                  fill: float | None = None, empty_rows: str = "zero", scale_tensor: torch.Tensor | None = None,
                  out_order: list[int] | None = None, mask_keeps_nan: bool = False, softcap: float | None = None,
                  sinks: torch.Tensor | None = None,
                  mask_add_dtype: torch.dtype | None = None,
                  fill_in_mask: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if scale_tensor is not None:
        s = s * float(scale_tensor)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        f = float("-inf") if fill is None else fill
        s = (torch.where(mask, s, s + f) if mask_keeps_nan else s.masked_fill(~mask, f)) \
            if mask.dtype == torch.bool else (s + mask.float() if mask_add_dtype is None else
                                              (s.to(mask_add_dtype) + mask.to(mask_add_dtype)).float())
        if fill_in_mask and mask.dtype != torch.bool:    # the mask's entries equal to the fill replace the score
            f = float(torch.tensor(f, dtype=mask.dtype))
            s = torch.where(mask == f, f, s)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if sinks is not None:
        col = sinks.float().reshape(-1).expand(s.shape[1]).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    if empty_rows == "zero" and sinks is None:
        p = torch.where(torch.isneginf(s).all(-1, keepdim=True), 0.0, p)
    out = (p.to(v.dtype) @ v).to(q.dtype)
    if out_order:
        out = out.permute(*out_order).contiguous().permute(*[list(out_order).index(d) for d in range(4)])
    return out, (p.to(q.dtype) if return_probs else q.new_empty(0))


@attention_ref.register_fake
def _(q, k, v, mask=None, scale=None, causal=False, return_probs=False, fill=None, empty_rows="zero",
      scale_tensor=None, out_order=None, mask_keeps_nan=False, softcap=None, sinks=None, mask_add_dtype=None,
      fill_in_mask=False):
    from autofuse.ops import _empty_in_order
    b, n, sq, _ = q.shape
    probs = q.new_empty(b, n, sq, k.shape[-2]) if return_probs else q.new_empty(0)
    return _empty_in_order(q, (b, n, sq, v.shape[-1]), out_order), probs


def drawn(examples: int):
    """The property tests' hypothesis settings: ``examples`` draws, derandomized (the same draws on every run and
    machine, no example database), no deadline (a draw fuses a model), no health check on slow or large draws."""
    from hypothesis import HealthCheck, settings
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def rewrite_with(captured, canonical, matches, op):
    """``captured`` with each attention match replaced by a call of ``op`` (the engine's rewrite without the
    planner)."""
    import functools

    from autofuse.fused import emit_attention
    from autofuse.rewrite import lift, rewrite
    can = {n.name: n for n in canonical.graph.nodes}
    cap = {n.name: n for n in captured.graph.nodes}
    order = {n.name: i for i, n in enumerate(captured.graph.nodes)}
    lifts = [lift(m, can, cap, order) for m in matches]
    return rewrite(captured, lifts, lambda m: functools.partial(emit_attention, op=op))


def off_by_a_bit(monkeypatch, module, kernel: str, factor: float = 1.01):
    """Make ``module.run_kernel`` (the one place fused ops call the simulator) return ``kernel``'s first output
    scaled by ``factor``: a faulty kernel for verification to catch."""
    real = module.run_kernel

    def faulty(name, *a, **kw):
        r = real(name, *a, **kw)
        if name == kernel:
            r.outputs = (r.outputs[0] * factor,) + tuple(r.outputs[1:])
        return r
    monkeypatch.setattr(module, "run_kernel", faulty)


def assert_as_eager(model, args, got):
    """``got`` is within the verifier's bound of ``model``'s eager output: at most twice eager's own error against
    float64 (the model run in float64 on float64 inputs), with the same NaN/inf pattern."""
    from autofuse.verify import compare
    want = model(*args)
    ref = model.double()(*[a.double() if a.is_floating_point() else a for a in args])
    model.to(args[0].dtype)
    ok, err, tol = compare(want, ref, got)
    assert ok, (err, tol)


def assert_same_product(got, want, magnitude, K):
    """``got`` and ``want`` are one GEMM product computed by two launches (fp32 sums, then one rounding to the dtype
    each): equal up to the order of the fp32 sums, which numpy's BLAS picks per GEMM shape and per CPU (seen: an
    AMD EPYC's OpenBLAS sums a narrower GEMM in another order than the wider one; an Intel machine's gave the same
    bits). Bound, on any CPU: both sums' worst case, 2·(K + 2)·u32·``magnitude`` (``magnitude`` = Σ|x||w| (+|bias|)
    per element, float64), plus one unit in the last place of the dtype (the two roundings)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    a, b, m = got.double(), want.double(), magnitude.double()
    top = torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(got.dtype).tiny)
    ulp = torch.finfo(got.dtype).eps * torch.exp2(torch.floor(torch.log2(top)))
    bound = 2 * (K + 2) * 2.0 ** -24 * m + ulp
    assert bool(((a - b).abs() <= bound).all()), float(((a - b).abs() - bound).max())


def main_output(out):
    """The tensor a model's output is judged by: the tensor itself, a tuple's first element, logits, or the
    last hidden state."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return out[0]
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.fixture
def ref_op():
    return torch.ops.autofuse_test.attention_ref.default


_PROPERTY_COUNTS: Counter = Counter()


def pytest_runtest_logreport(report):
    """Add up the property tests' counts from their reports (sent by xdist's workers, or made in this process)."""
    if report.when == "teardown":
        for key, value in report.user_properties:
            if key == "property_counts":
                _PROPERTY_COUNTS.update(value)


def pytest_terminal_summary(terminalreporter):
    """The property tests' counts (cases drawn, fused, rejected, wrong), when they ran."""
    counts = _PROPERTY_COUNTS
    if counts:
        terminalreporter.write_line(
            f"property tests: {counts['cases']} spellings ({counts['fused']} fused, {counts['rejected']} not "
            f"fused), {counts['near_miss_cases']} near misses ({counts['near_miss_rejected']} not fused, "
            f"{counts['near_miss_fused']} fused), {counts['trained']} trained ({counts['trained_fused']} fused); "
            f"wrong results: {counts['wrong']}")
