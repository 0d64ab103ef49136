"""Verify a fusion before applying it: the fused call must reproduce the captured subgraph it replaces.

For a candidate the verifier (driven by :class:`autofuse.engine` through :func:`verify_block`)

1. takes the block as captured — its footprint (:func:`autofuse.rewrite.fused_block`), never the canonical
   view — and its fused replacement, two GraphModules over the same inputs;
2. gets input values: the example inputs' own values at those nodes (one run of the captured graph), or,
   for a model planned on meta tensors, random values of the recorded shapes;
3. derives adversarial inputs from the match's roles (:func:`adversarial`): a query row with every key
   masked (bool masks all-False and all-True, additive masks of ``-inf`` and of the dtype's lowest
   finite value), all-equal scores, magnitudes near the dtype's limit, NaN in one query row;
4. runs the block eagerly in its own dtype and in float64 (casts inside the block kept at float64, but a
   value rounded to 16 bits and cast back up keeps that rounding, and a 16-bit add of a mask keeps eager's
   16-bit sum where the mask holds a masking value: :class:`_F64`), and
   the fused block, on each input set, each run from the same seeded generator state (a dropout inside the
   block draws the same keep-mask in all three), and accepts when every output element passes :func:`compare`.

The bound (:func:`compare`): where eager's result is NaN or infinite, the fused result must be the same
(NaN where eager has NaN, the same infinity), or, where the float64 reference is finite, finite and as
close to it as allowed below (the fused kernel did not overflow where eager did), or the infinity of the reference's
sign where the reference is beyond the dtype's range (its correct rounding; eager's op order can give NaN there).
Where eager is finite but
the exact result is NaN, NaN is accepted too; on the NaN input set, NaN is accepted wherever eager gave a
number (torch's CPU SDPA zeroes a query row of NaN scores or not, depending on shape and kernel blocking:
no fixed semantics to reproduce), never a number where eager gave NaN. Where eager is finite,
the fused result must be finite and ``|fused − ref64| ≤ 2·max|eager − ref64| + floor``: at most twice
eager's own error on the same inputs, plus ``floor = ε(dtype)·max(1, max|ref64|)`` (one rounding of the
output, ``ε`` the dtype's machine epsilon; 8ε for float32, whose kernel accumulates in float32 where eager
may use a different summation order). No tolerance depends on one machine's figures. An integer or bool output (a
top-k's indices, a compare's mask) has no rounding to bound: each element must be eager's, or the float64 run's.

Identical blocks (same structure, shapes, dtypes, constants, kernel parameters) are verified once.
"""
from __future__ import annotations

import functools
import hashlib

import torch
import torch.fx as fx

from autofuse.graph import draw_order, floating, graph_module, in_order, val


def floor(dtype: torch.dtype) -> float:
    """One rounding of an output of ``dtype`` near 1 (machine epsilon); 8 epsilons for float32, whose sums of
    up to a few thousand terms in a different order differ from eager's by a few roundings."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return 8 * eps if dtype == torch.float32 else eps


def _constant_key(t) -> tuple:
    if not isinstance(t, torch.Tensor):
        return ("value", repr(t))
    if t.device.type == "meta" or t.numel() > (1 << 22):
        return ("tensor", tuple(t.shape), t.dtype, id(t))
    data = t.detach().contiguous().reshape(-1)
    return ("tensor", tuple(t.shape), t.dtype, hashlib.sha1(data.view(torch.uint8).numpy().tobytes()).hexdigest())


def structure_key(sub: fx.GraphModule) -> tuple:
    """A key equal for two blocks exactly when they compute the same function of same-shaped inputs:
    the ops in order, their arguments (nodes by position, not by name), every value's shape and dtype,
    and the contents of the constants the block reads. Node names, which differ from layer to layer,
    are left out."""
    index, parts = {}, []
    for i, n in enumerate(sub.graph.nodes):
        index[n] = i
        v = n.meta.get("val")
        vkey = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
        if n.op == "get_attr":
            target = _constant_key(functools.reduce(getattr, n.target.split("."), sub))
        else:
            target = n.target if n.op != "placeholder" else None
        args = fx.map_arg((n.args, n.kwargs), lambda a: ("%node", index[a]))
        parts.append((n.op, str(target), repr(args), vkey))
    return tuple(parts)


def random_like(node: fx.Node, gen: torch.Generator, sizes: dict | None = None) -> torch.Tensor:
    """Random values of the node's shape (dims whose size is a key of ``sizes`` reduced) and dtype: bool masks
    keep each row's first entry, integers are 0 or 1."""
    v = val(node)
    shape_ = tuple((sizes or {}).get(d, d) for d in v.shape)
    v = torch.empty(shape_, dtype=v.dtype, device="meta")
    if v.dtype == torch.bool:
        t = torch.rand(v.shape, generator=gen) < 0.7
        if t.dim() >= 1 and t.shape[-1] > 0:
            t[..., 0] = True
        return t
    if v.dtype.is_floating_point:
        return torch.randn(v.shape, generator=gen).to(v.dtype)
    return torch.randint(0, 2, v.shape, generator=gen).to(v.dtype)


_LOW = (torch.float16, torch.bfloat16, torch.float32)


class _OnCPU(fx.Interpreter):
    """Runs a block on the CPU: factory ops inside it (a causal mask built from ``arange``) that name another
    device (``meta``, for a model planned without data) make their tensors on the CPU. A model traced on
    another device may have taken that device's branch where the CPU has no kernel: transformers' MoE
    experts count tokens per expert with ``histc`` on integer ids off the CPU, on float ids on it (the same
    counts: ids are small integers, exact in float32)."""

    def call_function(self, target, args, kwargs):
        if isinstance(kwargs.get("device"), torch.device) and kwargs["device"].type != "cpu":
            kwargs = {**kwargs, "device": torch.device("cpu")}
        if target is torch.ops.aten.histc.default and not args[0].is_floating_point():
            return super().call_function(target, (args[0].float(), *args[1:]), kwargs).to(args[0].dtype)
        return super().call_function(target, args, kwargs)


class _F64(_OnCPU):
    """Runs a block in float64: float inputs and constants promoted, every float dtype argument inside the block
    (a cast, ``softmax(..., dtype=float32)``, a factory's dtype) made float64, except that a value the model
    rounds to 16 bits and casts back up (``x.bfloat16().float()``: fake quantisation) keeps its rounding, which
    is what the model asks for, not a 16-bit dtype's imprecision (its gradient passes through unrounded, as a
    derived backward passes it).

    Likewise a 16-bit add of a mask (:func:`_masked_sum`): where an operand holds a masking value (at or below
    ``MASKING``: ``-1e4``, ``finfo(float16).min``, ``-inf``), the sum is eager's 16-bit one; a 16-bit subtraction
    ``a - b`` is the sum ``a + (-b)`` (the same rounding): eager's difference where a subtrahend is at or above
    ``-MASKING`` (``score - 65500 * mask``) or the minuend at or below ``MASKING``. A mask's value says
    *masked*, not a magnitude: ``score + finfo(float16).min`` is ``-65504`` in float16 for every score below 16,
    so a row whose every key is masked is uniform in eager, while float64 keeps the scores' differences there and
    the softmax after it turns them back into order-one differences. Compared with such a reference, eager's own
    error at that row is of order one, the bound twice that, and a fused kernel adding the mask in fp32 (the
    float64 answer, not eager's) passed; with eager's masked sum as the reference, a kernel must mask as eager
    does. The gradient passes through unchanged, as through eager's add."""

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor) and _round_trip(n):
            out = out + (out.to(val(n).dtype).to(out.dtype) - out).detach()
        elif isinstance(out, torch.Tensor) and _add16(n):
            a, b = self.fetch_args_kwargs_from_env(n)[0][:2]
            if n.target is not torch.ops.aten.add.Tensor:       # a - b, as a + (-b): the same 16-bit rounding
                a, b = (a, -b) if n.target is torch.ops.aten.sub.Tensor else (b, -a)
            out = _masked_sum(out, a, b, val(n).dtype)
        return out

    def call_function(self, target, args, kwargs):
        # isinstance first: ``tensor in _LOW`` is always False but costs ~0.3 ms (Tensor.__eq__ fails on a dtype)
        args, kwargs = torch.utils._pytree.tree_map(
            lambda a: torch.float64 if isinstance(a, torch.dtype) and a in _LOW else a, (args, kwargs))
        if target is torch.ops.aten._grouped_mm.default and args[0].dtype == torch.float64:
            return _grouped_mm_f64(*args, **kwargs)          # torch's kernel has no float64
        return super().call_function(target, args, kwargs)

    def get_attr(self, target, args, kwargs):
        return _f64(super().get_attr(target, args, kwargs))


_CASTS = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)


def _round_trip(n: fx.Node) -> bool:
    """A cast of a wider float value to a 16-bit float that a cast reads back into a wider one."""
    def dtype(x):
        v = val(x) if isinstance(x, fx.Node) else None
        return v.dtype if isinstance(v, torch.Tensor) and v.is_floating_point() else None

    def bits(d):
        return torch.finfo(d).bits if d is not None else 0
    if n.op != "call_function" or n.target not in _CASTS or dtype(n) not in (torch.float16, torch.bfloat16):
        return False
    return bits(dtype(n.args[0])) > 16 and any(u.op == "call_function" and u.target in _CASTS and
                                               bits(dtype(u)) > 16 for u in n.users)


#: A value at or below this is a mask's, not a magnitude (the patterns take a fill at or below it as masking).
MASKING = -1e4


_ADDS = (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.rsub.Tensor)


def _add16(n: fx.Node) -> bool:
    """An ``add`` of two tensors, or a subtraction (``sub(a, b)``, ``rsub(b, a)``: ``a - b``, ``alpha`` 1), whose
    captured result is float16 or bfloat16 (so eager adds in that dtype)."""
    v = val(n) if n.op == "call_function" else None
    if n.target not in _ADDS or not isinstance(v, torch.Tensor) or v.dtype not in (torch.float16, torch.bfloat16):
        return False
    if n.kwargs and (n.target is torch.ops.aten.add.Tensor or n.kwargs != {"alpha": 1}):
        return False
    return len(n.args) == 2 and all(isinstance(a, fx.Node) for a in n.args)


def _masked_sum(out: torch.Tensor, a, b, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (the float64 ``a + b``) with eager's sum in ``dtype`` (the operands rounded to it, the sum rounded
    once, as torch adds two 16-bit tensors) where an operand is at or below ``MASKING``; the gradient of ``out``."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return out
    masked = (a <= MASKING) | (b <= MASKING)
    if not bool(masked.any()):
        return out
    with torch.no_grad():
        eager = (a.to(dtype) + b.to(dtype)).to(out.dtype)
        changed = masked & (eager != out)
    return torch.where(changed, out + (eager - out).detach(), out)


def _grouped_mm_f64(x, w, offs=None, bias=None, out_dtype=None):
    """``aten._grouped_mm`` in its forward form (x [S, K], w [E, K, N], offs the cumulative rows per group) in
    float64, one matmul per group."""
    if x.dim() != 2 or w.dim() != 3 or offs is None or bias is not None:
        raise NotImplementedError("float64 reference of _grouped_mm: only (x [S, K], w [E, K, N], offs)")
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def _f64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _kind(x: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    k = torch.zeros(x.shape, dtype=torch.int8)
    k[torch.isnan(x)] = 1
    k[torch.isposinf(x)] = 2
    k[torch.isneginf(x)] = 3
    return k


def compare(eager: torch.Tensor, ref: torch.Tensor, fused: torch.Tensor, nan_ok: bool = False
            ) -> tuple[bool, float, float]:
    """``(ok, worst error, tolerance)`` of one output (see the module docstring for the bound). ``nan_ok``: the
    inputs hold NaN, and a NaN where eager happened to give a number is accepted (torch's CPU SDPA zeroes a
    query row of NaN scores, or not, depending on the shape and its kernel's blocking)."""
    if not floating(eager):
        # integers and bools (a top-k's indices, a compare's mask) have no rounding to bound: each element is
        # eager's, or the float64 run's where a rounding of eager's decided it otherwise
        wrong = (fused != eager) & (fused != ref.to(fused.dtype))
        err = float(wrong.sum().item()) if wrong.numel() else 0.0
        return err == 0.0, err, 0.0
    e, r, f = eager.double(), ref.double(), fused.double()
    if e.numel() and bool(torch.isfinite(e).all() & torch.isfinite(r).all() & torch.isfinite(f).all()):
        # every value finite (the usual case): what the general path below computes, in fewer passes
        tol = 2 * (e - r).abs().max().item() + floor(eager.dtype) * max(1.0, r.abs().max().item())
        err = (f - r).abs().max().item()
        return err <= tol, err, tol
    ke, kr, kf = _kind(e), _kind(r), _kind(f)
    e_fin, r_fin = ke == 0, kr == 0
    both = e_fin & r_fin
    err_e = (e - r)[both].abs().max().item() if both.any() else 0.0
    scale = r[r_fin].abs().max().item() if r_fin.any() else 1.0
    tol = 2 * err_e + floor(eager.dtype) * max(1.0, scale)
    same_special = (~e_fin) & (kf == ke)
    closer = (~e_fin) & r_fin & (kf == 0)                # eager overflowed, the fused kernel did not
    # eager finite where the exact result is NaN (torch's CPU SDPA returns 0 for a row of NaN scores): the
    # fused result may follow either
    same_special = same_special | (e_fin & (kr == 1) & (kf == 1))
    if eager.is_floating_point():
        # eager not finite where the exact result is a number beyond the dtype's range (its own op order met an
        # inf - inf): that result's infinity is its correct rounding
        beyond = (~e_fin) & r_fin & (r.abs() > torch.finfo(eager.dtype).max)
        same_special = same_special | (beyond & (kf == torch.where(r > 0, 2, 3).to(kf.dtype)))
    if nan_ok:
        same_special = same_special | (e_fin & (kf == 1))
    finite_ok = e_fin & (kf == 0)
    check = finite_ok | closer
    diff = torch.where(check & r_fin, (f - r).abs(), torch.zeros_like(f))
    err = diff.max().item() if diff.numel() else 0.0
    # eager finite but the reference not (eager rounded an overflow away): as close to eager is what we ask
    odd = e_fin & ~r_fin & (kf == 0)
    if odd.any():
        err = max(err, (f - e)[odd].abs().max().item())
    if not bool(torch.all(same_special | check)):
        return False, float("inf"), tol
    return err <= tol, err, tol


SEED = 0


def _seeded(run):
    """``run()`` from the generator state ``SEED``; the caller's state is restored afterwards."""
    with torch.random.fork_rng():
        # the CPU generator alone, which every check runs on: torch.manual_seed also seeds every other device kind,
        # lazily, recording a stack trace per kind (a millisecond per call)
        torch.default_generator.manual_seed(SEED)
        return run()


def check(sub: fx.GraphModule, fused_sub: fx.GraphModule, inputs: list, nan_ok: bool = False, canonical=None
          ) -> tuple[bool, float, float]:
    """(ok, error, tolerance) of the fused block against eager and float64 on ``inputs``. ``canonical``: the
    outputs -> the outputs in a form where what the captured op leaves unspecified is fixed (the order of an
    unsorted top-k's picks); each run's outputs are put in that form before they are compared."""
    with torch.no_grad():      # each run from the same generator state: a block with dropout draws the same masks
        eager = _seeded(lambda: _OnCPU(sub).run(*inputs))
        ref = _seeded(lambda: _F64(sub).run(*[_f64(x) for x in inputs]))
        fused = _seeded(lambda: _OnCPU(fused_sub).run(*inputs))
    if canonical is not None:
        eager, ref, fused = canonical(eager), canonical(ref), canonical(fused)
    return _worst(eager, ref, fused, nan_ok)


def _worst(eager, ref, fused, nan_ok: bool = False) -> tuple[bool, float, float]:
    """(every value passes, the worst error, the largest tolerance) over three runs' values, by :func:`compare`."""
    worst_err, worst_tol, failed = 0.0, 0.0, []
    for e, r, f in zip(eager, ref, fused):
        o, err, tol = compare(e, r, f, nan_ok)
        if not o:
            failed.append((err, tol))
        worst_err, worst_tol = max(worst_err, err), max(worst_tol, tol)
    if failed:          # the figures of a value that failed, not the worst of each over values that passed
        return (False, *max(failed, key=lambda et: et[0] - et[1]))
    return True, worst_err, worst_tol


def _read(gm: fx.GraphModule) -> set[int]:
    """The positions of ``gm``'s inputs its graph reads (a placeholder with users)."""
    return {i for i, p in enumerate(n for n in gm.graph.nodes if n.op == "placeholder") if p.users}


def check_gradients(sub: fx.GraphModule, fused_sub: fx.GraphModule, inputs: list) -> tuple[bool, float, float]:
    """(ok, error, tolerance) of the fused block's gradients: the gradient of every float input, given one random
    upstream gradient per float output, from eager's autograd, from float64, and through the fused block (its
    ops' own backwards, a derived Vector program's among them), bounded as outputs are (:func:`compare`). A
    block's forward can be right while the backward its fused op runs is not; this is where that shows."""
    floats = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.is_floating_point()]

    if not floats or {i for i in floats if i in _read(sub)} != {i for i in floats if i in _read(fused_sub)}:
        # none to check, or the fused call recomputes a value the block reads as an input (a residual sum it
        # also keeps for other readers): the two differentiate with respect to different inputs, and the
        # graph's own chain rule, not this block's, joins them
        return True, 0.0, 0.0
    upstream: list = []

    def grads(runner, conv):
        xs = [conv(x) for x in inputs]
        for i in floats:
            xs[i] = xs[i].detach().requires_grad_(True)
        with torch.enable_grad():
            outs = _seeded(lambda: runner.run(*xs))
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        pairs = [(j, o) for j, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        if not upstream:
            gen = torch.Generator().manual_seed(1)
            upstream.extend((j, torch.randn(o.shape, generator=gen, dtype=torch.float64)) for j, o in pairs)
        want = dict(upstream)
        pairs = [(o, want[j].to(o.dtype)) for j, o in pairs if j in want]
        if not pairs:
            return [torch.zeros_like(xs[i]) for i in floats]
        got = torch.autograd.grad([o for o, _ in pairs], [xs[i] for i in floats], [g for _, g in pairs],
                                  allow_unused=True)
        return [torch.zeros_like(xs[i]) if g is None else g.detach() for i, g in zip(floats, got)]

    return _worst(grads(_OnCPU(sub), lambda x: x), grads(_F64(sub), _f64), grads(_OnCPU(fused_sub), lambda x: x))


# ---------------------------------------------------------------------------------------- adversarial

def _row(t: torch.Tensor, index=0):
    """The second-to-last-dim slice ``index`` (a query row of q or of a mask, a key of k) as an index tuple."""
    return (..., index, slice(None)) if t.dim() >= 2 else (slice(None),)


def _aliases(inputs: list, pos: int) -> list[int]:
    """The positions of ``inputs`` holding the same value as ``pos`` (itself first): the same dtype and elements in
    the same order (a value the captured block reads through one view and the fused call through another)."""
    t = inputs[pos]
    same = [pos]
    flat = t.reshape(-1)
    if not bool((flat != flat[0]).any()):
        return same             # a constant tensor (zeros) says nothing about which value it is
    for i, x in enumerate(inputs):
        if i != pos and isinstance(x, torch.Tensor) and x.dtype == t.dtype and x.numel() == t.numel() and \
                torch.equal(x.reshape(-1), t.reshape(-1)):
            same.append(i)
    return same


def adversarial(inputs: list, roles: dict, read: tuple[set, set] | None = None,
                negated: frozenset = frozenset(), entangled: frozenset = frozenset()) -> list[tuple[str, list]]:
    """Input sets derived from ``inputs`` by role (``roles``: role -> positions in ``inputs`` of the values
    that role is computed from): ``[(label, inputs), ...]``. ``read``: the positions the captured block reads and
    those the fused one reads, for :func:`_equal_row`. ``negated``: the mask roles that reach the scores negated
    (``scores - m``): their masking values are ``+inf`` and ``finfo.max``. ``entangled``: pairs of positions whose
    values the model computes one from the other (:func:`entangled_inputs`), for :func:`_equal_row`."""
    out = []

    def variant(label, pos, fn, every=False):
        xs = list(inputs)
        t = xs[pos]
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return
        t = t.clone()
        fn(t)
        xs[pos] = t
        if every:
            # a mask is changed at every position holding its value (:func:`_aliases`): the captured block may read
            # it twice through two views (Swin v2 adds its window mask twice, each unsqueezed by itself) where the
            # fused call reads one of them twice; changing one view alone would be a model no input can make
            for i in _aliases(inputs, pos)[1:]:
                xs[i] = inputs[i].clone().copy_(t.reshape(inputs[i].shape))
        out.append((label, xs))

    masks = [(p, r in negated) for r, ps in roles.items() if r.startswith("mask") for p in ps]
    for p, neg in masks:
        t = inputs[p]
        if not isinstance(t, torch.Tensor):
            continue
        if t.dtype == torch.bool:
            variant("a query row with every key masked (mask row all False)", p, lambda x: x[_row(x)].fill_(False))
            variant("a query row with every key masked (mask row all True)", p, lambda x: x[_row(x)].fill_(True))
        elif t.is_floating_point():
            inf, low = (float("inf"), torch.finfo(t.dtype).max) if neg else (-float("inf"), torch.finfo(t.dtype).min)
            how = " subtracted" if neg else ""
            variant(f"a query row masked with {inf:+g}{how}", p, lambda x, v=inf: x[_row(x)].fill_(v), every=True)
            variant(f"a query row masked with {low:g}{how}", p, lambda x, v=low: x[_row(x)].fill_(v), every=True)
    for p in roles.get("q", ()):
        t = inputs[p]
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            continue
        big = torch.finfo(t.dtype).max ** 0.5 / 4
        variant("all-equal scores (q = 0)", p, lambda x: x.zero_())
        variant(f"magnitudes near the dtype's limit (q, k ~ {big:.3g})", p, lambda x, b=big: x.mul_(b))
        variant("NaN in one query row", p, lambda x: x[_row(x)].fill_(float("nan")))
    for p in roles.get("k", ()):
        t = inputs[p]
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            big = torch.finfo(t.dtype).max ** 0.5 / 4
            variant("magnitudes near the dtype's limit (k)", p, lambda x, b=big: x.mul_(b))
    # no NaN in a key or a value: eager spreads it to every row through masked entries (NaN + mask, 0 * NaN)
    # or not (a masked_fill removes it), by spelling; a kernel that skips masked tiles cannot follow both
    _equal_row(inputs, roles, out, read, entangled)
    return out


def entangled_inputs(external: list, budget: int = 64) -> frozenset:
    """Pairs ``(i, j)`` of a block's input positions (``external``: the captured graph's nodes it reads, in order)
    where the model computes input i from input j (found within ``budget`` nodes up from i): CodeGen's rotary
    ``repeat_interleave(sin)``, which the key's rotation reads, computed from ``sin``, from which the captured block
    computes the query's again. The canonical form computes such a value once, so the fused call reads it where
    the captured block recomputes it (see :func:`_equal_row`)."""
    pos = {n: i for i, n in enumerate(external)}
    out = set()
    for n, i in pos.items():
        stack, seen = list(n.all_input_nodes), set()
        while stack and len(seen) < budget:
            c = stack.pop()
            if c in seen:
                continue
            seen.add(c)
            if c in pos:                 # (a graph has no cycle: never n itself)
                out.add((i, pos[c]))
                continue
            stack.extend(c.all_input_nodes)
    return frozenset(out)


def _equal_row(inputs: list, roles: dict, out: list, read: tuple[set, set] | None = None,
               entangled: frozenset = frozenset()) -> None:
    """A generated Vector kernel's inputs (roles ``in0``, ``in1``, ...): one row of each float input of two or more
    columns holding one value, its first (a padded or saturated row): a row's mean is then exact in eager, its
    variance and a layer norm's deviations exactly 0, and a comparison with the mean ties. One input set. A value
    is changed at every position holding it (:func:`_aliases`: the captured block may read it through one view,
    the fused call through another), and only where both the captured block and the fused one read it (``read``):
    a value one of them recomputes from other inputs would otherwise differ between the two runs. Nor where the
    model computes the value from another input or another input from it (a pair of ``entangled``) and one of
    the two is read by one run only: that run recomputes what the other reads, and changing one of the two alone
    would give them inputs no model gives."""
    pos = [p for r, ps in roles.items() if r[:2] == "in" and r[2:].isdigit() for p in ps]
    once = read[0] ^ read[1] if read is not None else set()
    tied = {p for pair in entangled if once & set(pair) for p in pair}
    xs, changed = list(inputs), False
    for p in dict.fromkeys(pos):
        t = inputs[p]
        if p in tied:
            continue
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() and t.shape[-1] > 1 and t.numel():
            same = _aliases(inputs, p)
            if read is not None and not all(set(same) & r for r in read):
                continue
            t = t.clone()
            idx = _row(t)
            t[idx] = t[idx][..., :1].clone()
            for i in same:      # each alias keeps its own shape and memory order
                xs[i] = t if i == p else inputs[i].clone().copy_(t.reshape(inputs[i].shape))
            changed = True
    if changed:
        out.append(("a row of equal values (the first of the row's, in each Vector-kernel input)", xs))


def verify_block(sub: fx.GraphModule, fused_sub: fx.GraphModule, inputs: list, roles: dict, canonical=None,
                 gradients: bool = False, negated: frozenset = frozenset(),
                 entangled: frozenset = frozenset()) -> tuple:
    """Check on the given inputs, then on each adversarial set; the first failure ends it. ``canonical``: see
    :func:`check`. ``gradients``: the gradients on the given inputs too (:func:`check_gradients`). ``negated`` and
    ``entangled``: see :func:`adversarial`. Returns ``(ok, error, tolerance, label of the failing input set or "")``."""
    ok, err, tol = check(sub, fused_sub, inputs, canonical=canonical)
    if not ok:
        return ok, err, tol, "the example inputs"
    if gradients:
        ok, e, t = check_gradients(sub, fused_sub, inputs)
        if not ok:
            return ok, e, t, "the gradients on the example inputs"
        err, tol = max(err, e), max(tol, t)
    for label, xs in adversarial(inputs, roles, (_read(sub), _read(fused_sub)), negated, entangled):
        o, e, t = check(sub, fused_sub, xs, nan_ok=label.startswith("NaN"), canonical=canonical)
        if not o:
            return o, e, t, label
        err, tol = max(err, e), max(tol, t)
    return True, err, tol, ""


# ------------------------------------------------------------------------------------------ reduced shapes

#: A block whose largest float64 intermediate is above this is verified on reduced shapes (bytes).
LARGEST_CHECKED = 32 << 20
#: A block too large for that and with no reduction that runs is checked at its own size up to this (bytes of
#: its largest float64 value: the check holds a few such values at once), and left unverified above it.
LARGEST_AT_OWN_SIZE = 2 << 30


def largest_value_bytes(sub: fx.GraphModule) -> int:
    """Bytes of the block's largest value in float64 (what the reference run allocates at its peak)."""
    return max((v.numel() * 8 for n in sub.graph.nodes for v in [n.meta.get("val")]
                if isinstance(v, torch.Tensor)), default=0)


def shrink_arg(a, sizes: dict):
    if isinstance(a, bool) or not isinstance(a, (int, list, tuple)):
        return a
    if isinstance(a, int):
        return sizes.get(a, a)
    return type(a)(shrink_arg(x, sizes) for x in a)


def shrink(gm: fx.GraphModule, sizes: dict) -> fx.GraphModule:
    """A copy of the block with every integer argument equal to a key of ``sizes`` (a dimension size: the
    sequence length, the number of tokens) replaced by its value: the same computation on smaller tensors.
    Keyword ``dim`` arguments are left alone. Shape metadata is not updated (the runs recompute it)."""
    g = fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        new = g.node_copy(n, lambda x: env[x])
        if n.op == "call_function":
            new.args = tuple(shrink_arg(a, sizes) for a in new.args)
            new.kwargs = {k: (v if k == "dim" else shrink_arg(v, sizes)) for k, v in new.kwargs.items()}
        env[n] = new
    return graph_module(gm, g)


def consistent_sizes(sub: fx.GraphModule, sizes: dict, also=()) -> dict:
    """``sizes`` extended so that every view in ``sub`` stays consistent: a reduced flat row count ``d``
    that some value splits as ``[..., a, b]`` with ``a * b == d`` (a matmul over ``[B*S, K]`` viewed as
    ``[B, S, N]``) reduces ``b`` to ``r / a`` when ``a`` divides the reduced count ``r``, which keeps ``d -> r``
    (sizes the family derived from it, such as token-expert pairs, stay consistent); otherwise ``b -> r`` and
    ``d -> a * r``. ``also``: more nodes whose shapes count (the values the block's inputs are views of)."""
    out = dict(sizes)
    for d, r in sizes.items():
        for n in [*sub.graph.nodes, *also]:
            v = n.meta.get("val")
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else ()
            for i in range(len(shape) - 1):
                a, b = shape[i], shape[i + 1]
                if a * b == d and b not in out and not (a in out and out[a] * b == r):
                    if r % a == 0 and b > r // a:
                        out[b] = r // a
                    elif b > r:
                        out[b] = r
                        out[d] = a * r
    return out


def shrink_value(t, sizes: dict):
    """``t`` narrowed to the reduced size along every dim whose size is a key of ``sizes`` (leading entries)."""
    if not isinstance(t, torch.Tensor):
        return t
    for d, n in enumerate(t.shape):
        if n in sizes:
            t = t.narrow(d, 0, sizes[n])
    return t.contiguous()


def laid_out(t, node: fx.Node):
    """``t`` (a block input's value, row-major) in the memory order the captured graph gives that input
    (``node.meta["val"]``'s): a block runs on its inputs as the graph lays them out, and what it computes can
    depend on that (a dropout draws its keep-mask in its input's memory order). ``t`` itself where that is
    row-major or ``t`` is not a tensor of that rank."""
    v = node.meta.get("val")
    if not isinstance(t, torch.Tensor) or not isinstance(v, torch.Tensor) or v.dim() != t.dim():
        return t
    return in_order(t, draw_order(v))


__all__ = ["LARGEST_AT_OWN_SIZE", "LARGEST_CHECKED", "adversarial", "check", "compare", "consistent_sizes", "floor",
           "laid_out", "largest_value_bytes", "random_like", "shrink", "shrink_arg", "shrink_value", "structure_key",
           "verify_block", "check_gradients", "entangled_inputs"]
