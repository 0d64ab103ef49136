"""Reverse-mode autodiff over Vector programs: the backward of a generated Vector kernel is a Vector program.

:func:`backward_program` derives, from a forward :class:`~cost_model.program.Program` and the inputs that need
gradients, a program that one ``vector_program`` launch runs:

* **inputs**: the forward's inputs (same dtypes and shapes; an input the backward does not read is never
  loaded, and :func:`pruned` drops it), then one gradient per *float* forward output (``grad_of`` lists them; a
  bool output has none), in the output's dtype and shape ``(*lead, width)``, then the values of the forward
  outputs ``saved`` names (none by default);
* **body**: the forward values the gradients need, recomputed from the inputs (a fused backward recomputes
  in registers rather than reading saved intermediates) or read from the saved outputs that hold them, then
  the adjoints, accumulated in fp32 in reverse program order. Instructions are hash-consed (an instruction
  identical to an earlier one is that value: the backward reuses forward values instead of recomputing them)
  and dead code is dropped. :func:`backward_reads` names the forward values the gradient rules read, so a
  caller can choose what to keep for the backward (the inputs, or values that hold fewer bytes);
* **outputs**: one gradient per requested input (:class:`GradOutput`), rounded to the input's dtype.

Broadcasting. An operand of width 1 read over wider columns gets a column ``reduce sum`` of its adjoint.
An input broadcast along *lead* dims (a norm weight ``[cols]``, RoPE's ``cos [S, D]``) cannot be reduced
inside a row-wise program: every backward rule is linear in the adjoint with coefficients that are constant
along the dims a value does not vary along, so the program computes each row's contribution at full
``(*lead, width)`` and :attr:`GradOutput.sum_dims` names the lead dims the caller sums. Those per-row
contributions are written in the input's dtype, as eager autograd rounds them (``(grad * normed).sum(0)``
computes the product in fp16 for an fp16 weight); the caller's sum accumulates them in fp32.

Rules (``g`` the adjoint of the result ``y``; torch's autograd formulas, which ``run_program_torch`` uses):
unary ops by their derivatives (``gelu``'s ``Φ(x)`` is ``gelu(x) / x``, ``1/2`` at 0; softplus's ``sigmoid(x)``,
expm1's ``y + 1``, as torch's);
add sub mul div, ``pow`` with an immediate exponent, an immediate base (torch's ``y·log(base)``: 0 for a base of 0
where the exponent is >= 0, NaN for a negative base), or a value exponent;
``maximum``/``minimum`` send ``g`` to the larger/smaller operand and split it evenly on ties (of kind ``clamp``,
a clamp's bound: all of ``g`` where the value is within the bound, the bound included, none at NaN); ``where``
routes ``g`` to the branch its condition picks; compares, logic, casts to bool and the roundings (floor ceil trunc
round sign: torch's zero gradient, NaN and inf included) carry no gradient; a ``sqrt`` of kind ``norm`` (a
2-norm's root) passes none where it is 0, as torch's norm backward; a cast
to a float passes ``g`` rounded to the cast's dtype when that is 16-bit (eager's gradient of a 16-bit tensor is
16-bit: ``x.bfloat16() + y16`` and ``silu(g).half() * u32`` round it at the cast, as does a cast that reads a 16-bit
intermediate an op widens by promotion), then to its operand's dtype where that is a 16-bit value the program
computed, as torch's ``.to()`` backward casts it (through a round trip ``x.bfloat16().float()`` the gradient is
rounded to bfloat16; a 16-bit input's gradient is accumulated in fp32 and rounded once, at its output); ``reduce sum`` broadcasts ``g``, ``mean`` divides it by ``width`` (torch's mean backward), ``max``/``min`` share it evenly
among the elements equal to the result (torch's ``amax`` backward: NaN over a row whose result is NaN); a
softmax or log-softmax (max, shift, exp, sum, div or log) whose intermediates nothing else reads takes torch's
closed form; ``slice`` pads ``g``
with zeros (a cat, or for step 2 an interleave; with ``split``, a part of its own; the zeros are shaped from
``g``, so a slice's backward reads nothing of the sliced value), ``cat`` slices it,
``interleave`` takes its strided halves. The recompute takes ``pow`` by an immediate 2, 3, 0.5, -0.5 or -1 as
muls, sqrt, rsqrt or reciprocal (equal to an ulp; pow is a composite on the Vector unit).

Refused (:class:`NotDifferentiable`, naming the instruction): a slice with a step above 2.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cost_model.program import (COMPARE, F32, FLOATS, LOGIC, Input, Instr, Output, Program, ProgramError,
                                _is_ref, as_program)

_SQRT_2_PI = math.sqrt(2.0 / math.pi)        # gelu_tanh's inner scale
_GELU_C = 0.044715                            # gelu_tanh's cubic coefficient
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)   # the standard normal density at 0
_TWO_SQRT_PI = 2.0 / math.sqrt(math.pi)          # erf's slope at 0
_STEPS = ("floor", "ceil", "trunc", "round", "sign")     # piecewise constant: torch's gradient is zero everywhere


class NotDifferentiable(ProgramError):
    """A program instruction whose gradient this module cannot express as a Vector program (the message
    names the instruction and why); the caller differentiates the program another way."""


@dataclass(frozen=True)
class GradOutput:
    """The gradient of forward input ``input``: backward-program output ``output`` (None: the gradient is
    zero, the program computes nothing for it, or it comes in ``parts``), of shape ``(*lead, width)``; the
    caller sums it over ``sum_dims`` (keeping them), views it as ``shape`` and rounds it to ``dtype``. With
    ``parts`` (:func:`backward_program`'s ``split``) the gradient is those outputs at their columns (each
    summed over ``sum_dims`` too) and zeros at the others: the caller concatenates them."""

    input: int
    output: int | None
    sum_dims: tuple
    shape: tuple
    dtype: str
    parts: tuple = ()          # split: ((output, start, stop), ...), the columns of each; zeros elsewhere
    linked: bool = True        # a differentiable path joins the input to an output given a gradient: without
    #                            one, autograd gives no gradient (None), not zeros (an optimizer skips a None)


@dataclass(frozen=True)
class GradProgram:
    """What :func:`backward_program` derives: ``program`` (None when every requested gradient is zero) takes
    the forward's inputs, the gradients of forward outputs ``grad_of``, then the values of forward outputs
    ``saved``; ``grads``: one per requested input."""

    program: Program | None
    grad_of: tuple
    grads: tuple
    saved: tuple = ()          # forward outputs whose values ``program`` takes after the gradients
    takes: tuple | None = None  # pruned (:func:`pruned`): the inputs (numbers as above) ``program`` keeps


class _Emit:
    """A program under construction with hash-consing: an instruction equal to an earlier one is that value."""

    def __init__(self, lead, inputs):
        self.lead = tuple(lead)
        self.inputs = list(inputs)
        self.instrs: list[Instr] = []
        self.width = [int((tuple(i.shape) or (1,))[-1]) for i in inputs]
        self.memo: dict = {}

    def op(self, name, *args, **attrs) -> int:
        ins = Instr(name, tuple(a if _is_ref(a) else float(a) for a in args), **attrs)
        # value 0 and immediate 0.0 are equal in Python: the key tells them apart
        key = (ins, tuple(_is_ref(a) for a in ins.args))
        v = self.memo.get(key)
        if v is None:
            self.instrs.append(ins)
            v = self.memo[key] = len(self.inputs) + len(self.instrs) - 1
            self.width.append(_width(ins, self.width))
        return v

    # the arithmetic the rules use, folding the trivial immediates
    def mul(self, a, b):
        if not _is_ref(b):
            if b == 1.0:
                return a
            if b == -1.0:
                return self.op("neg", a)
        return self.op("mul", a, b)

    def add(self, a, b):
        return a if b is None else self.op("add", a, b)

    def zeros(self, width: int, src: int, wide: int | None = None) -> int:
        """Zeros of ``width`` columns, shaped from float value ``src``: ``where(lt(s, s), 0, 0)`` is 0 whatever ``s``
        holds (inf and NaN too, unlike ``s * 0``). A ``src`` narrower than ``width`` gives its zeros repeated by a
        cat (up to ``_ZERO_REPEATS`` times; beyond, ``wide``, at least ``width`` wide, shapes them): the backward
        shapes its zeros from an adjoint rather than from a forward value, which it would otherwise read, and
        keep, for its shape alone."""
        w = self.width[src]
        if w < width and (-(-width // w) <= _ZERO_REPEATS or wide is None):
            z = self.zeros(w, src)
            z = self.op("cat", *([z] * -(-width // w)))
            return z if self.width[z] == width else self.op("slice", z, start=0, stop=width)
        if w < width:
            src = wide
        s = src if self.width[src] == width else self.op("slice", src, start=0, stop=width)
        return self.op("where", self.op("lt", s, s), 0.0, 0.0)

    def widen(self, a: int, like: int) -> int:
        """Adjoint ``a`` (width 1 or ``like``'s) broadcast over float value ``like``'s columns."""
        if self.width[a] == self.width[like]:
            return a
        return self.op("where", self.op("lt", like, like), a, a)

    def args(self, v: int) -> list:
        """The values instruction value ``v`` reads (none for an input)."""
        return [a for a in self.instrs[v - len(self.inputs)].args if _is_ref(a)] if v >= len(self.inputs) else []

    def live(self, values) -> set:
        """``values`` and every value they are computed from."""
        live, stack = set(), list(values)
        while stack:
            v = stack.pop()
            if v not in live:
                live.add(v)
                stack += self.args(v)
        return live

    def build(self, outputs) -> Program:
        """The program of ``outputs`` (``(value, dtype)``), its dead instructions dropped."""
        nin = len(self.inputs)
        live = self.live(v for v, _ in outputs)
        new = {k: k for k in range(nin)}
        instrs = []
        for j, ins in enumerate(self.instrs):
            if nin + j in live:
                new[nin + j] = nin + len(instrs)
                instrs.append(Instr(ins.op, tuple(new[a] if _is_ref(a) else a for a in ins.args), ins.dtype,
                                    ins.kind, ins.start, ins.stop, ins.step))
        return Program(self.lead, tuple(self.inputs), tuple(instrs), tuple(Output(new[v], dt) for v, dt in outputs))


def _width(ins: Instr, width: list) -> int:
    ws = [width[a] for a in ins.args if _is_ref(a)]
    if ins.op == "reduce":
        return 1
    if ins.op == "slice":
        return len(range(ins.start, ws[0] if ins.stop is None else ins.stop, ins.step))
    if ins.op in ("cat", "interleave"):
        return sum(ws)
    return max(ws)


def _wrt(wrt, n: int) -> tuple:
    wrt = list(wrt)
    if len(wrt) == n and all(isinstance(w, bool) for w in wrt):
        return tuple(k for k, w in enumerate(wrt) if w)
    if any(isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n for k in wrt):
        raise ProgramError(f"wrt: give {n} bools or input numbers in 0..{n - 1}; got {wrt}")
    return tuple(sorted(set(wrt)))


def backward_program(program, wrt, outputs=None, split: bool = False, saved=()) -> GradProgram:
    """The backward of ``program`` for the inputs ``wrt`` (one bool per input, or input numbers) as a
    :class:`GradProgram`; see the module docstring. ``outputs``: the forward outputs that receive a gradient
    (default: every float output; an output nobody reads gets none, and costs the backward no load).
    ``split``: an input read only through disjoint step-1 slices (SwiGLU's fused gate and up halves) gets the
    gradient of each slice as an output of its own (:attr:`GradOutput.parts`) instead of their ``cat`` with
    zeros, a column shuffle that needs whole rows in UB: the backward of rows too wide for UB can then be
    walked in column chunks, and the caller concatenates the parts (a copy). ``saved``: forward outputs (numbers)
    the backward reads as inputs of its own, after the gradients, in place of recomputing their values (each
    must hold its value exactly: stored in the value's own dtype); what only they need is not recomputed, and an
    input only they need is not read. Raises :class:`NotDifferentiable` for an instruction whose gradient cannot
    be a Vector program, :class:`ProgramError` for a requested input that is not a float or a saved output that
    does not hold its value exactly."""
    e, outs, grads, grad_of, _ = _derive(as_program(program), wrt, outputs, split, tuple(saved))
    return GradProgram(e.build(outs) if outs else None, grad_of, tuple(grads), tuple(saved))


def backward_reads(program, wrt, outputs=None) -> tuple:
    """The forward values (numbers) the backward of ``program`` for ``wrt`` reads, beyond those it recomputes on
    the way to them: an input, or an instruction's value, that a gradient rule or a requested gradient reads.
    Every other value it needs is computed from these; a backward given values that every path from the
    program's inputs to these passes through (:func:`backward_program`'s ``saved``, with the inputs among them)
    needs nothing else. Raises as :func:`backward_program` does."""
    p = as_program(program)
    e, outs, _, _, (fwd, boundary) = _derive(p, wrt, outputs, False, ())
    owner = {}                     # emitted value -> the forward value it is
    for v, ev in enumerate(fwd):
        owner.setdefault(ev, v)
    read = set()

    def needs(a):                  # a recomputed value a gradient rule reads: its forward value, or for a step
        if a in owner:             # of one (pow's square) the forward values that step is computed from
            read.add(owner[a])
        else:
            for b in e.args(a):
                needs(b)
    for v, _ in outs:
        if v < boundary:
            needs(v)
    for v in e.live(v for v, _ in outs):
        if v >= boundary:          # a gradient rule's instruction: what it reads of the recompute, it needs
            for a in e.args(v):
                if a < boundary:
                    needs(a)
    return tuple(sorted(read))


def _derive(p: Program, wrt, outputs, split: bool, saved: tuple):
    """The backward under construction: ``(emit, outputs, grads, grad_of, (fwd, boundary))``, ``fwd`` the emitted
    value of each forward value, ``boundary`` the first emitted value past the recompute."""
    wrt = _wrt(wrt, len(p.inputs))
    outputs = range(len(p.outputs)) if outputs is None else set(outputs)
    vals, nin = p.values, len(p.inputs)
    for k in wrt:
        if p.inputs[k].dtype not in FLOATS:
            raise ProgramError(f"input {k} is {p.inputs[k].dtype}: only a float input has a gradient")
    for j in saved:
        if not 0 <= j < len(p.outputs) or p.outputs[j].dtype != vals[p.outputs[j].value].dtype:
            raise ProgramError(f"saved output {j}: not an output of the program that holds its value exactly "
                               f"(stored in the value's own dtype)")
    # per value, the requested inputs (bits) that reach it by a differentiable path
    paths = [1 << k if k in wrt else 0 for k in range(nin)]
    for ins in p.instrs:
        carries = ins.op not in COMPARE + LOGIC and not (ins.op == "cast" and ins.dtype == "bool")
        bits = 0
        if carries:
            for a in _diff_args(ins):
                bits |= paths[a]
        paths.append(bits)
    reach = [bool(b) for b in paths]
    grad_of = tuple(j for j, o in enumerate(p.outputs)
                    if j in outputs and o.dtype in FLOATS and vals[o.value].dtype != "bool")
    linked = 0
    for j in grad_of:
        linked |= paths[p.outputs[j].value]

    def given(j):                  # the gradient or the saved value of output j, as the backward's input
        return Input(p.outputs[j].dtype, tuple(p.lead) + (vals[p.outputs[j].value].width,))
    e = _Emit(p.lead, list(p.inputs) + [given(j) for j in grad_of] + [given(j) for j in saved])
    at = {p.outputs[j].value: nin + len(grad_of) + s for s, j in enumerate(saved)}
    fwd = list(range(nin))
    for v, ins in enumerate(p.instrs, nin):
        args = [fwd[a] if _is_ref(a) else a for a in ins.args]
        if v in at:
            fwd.append(at[v])
        elif ins.op == "pow" and _is_ref(args[0]) and not _is_ref(args[1]):
            fwd.append(_power(e, args[0], args[1]))     # the same value to an ulp, without the composite
        else:
            fwd.append(e.op(ins.op, *args, dtype=ins.dtype, kind=ins.kind, start=ins.start, stop=ins.stop,
                            step=ins.step))
    boundary = len(e.inputs) + len(e.instrs)
    adj: dict = {}

    def acc(v, contrib):
        """Add ``contrib`` to the adjoint of forward value ``v`` (a column sum when ``v`` is one column)."""
        if contrib is None or not reach[v]:
            return
        if vals[v].width == 1 and e.width[contrib] > 1:
            contrib = e.op("reduce", contrib, kind="sum")
        adj[v] = e.add(contrib, adj.get(v))

    for j, g_in in zip(grad_of, range(nin, nin + len(grad_of))):
        acc(p.outputs[j].value, g_in)
    softmaxes = _softmaxes(p)
    parts = {k: [] for k in (_sliced_inputs(p, wrt) if split else ())}
    for i in reversed(range(len(p.instrs))):
        v = nin + i
        ins = p.instrs[i]
        if v in adj and ins.op == "slice" and ins.args[0] in parts:
            parts[ins.args[0]].append((ins.start, vals[v].width, e.widen(adj[v], fwd[v])))
        elif v in adj and v in softmaxes:
            z, log = softmaxes[v]
            acc(z, _softmax_grad(e, adj[v], fwd[v], log))
        elif v in adj:
            _rule(e, i, p.instrs[i], v, adj[v], fwd, vals, reach, acc)
    outs, grads = [], []
    for k in wrt:
        inp = p.inputs[k]
        shape = tuple(inp.shape) or (1,)
        lead_part = (1,) * (len(p.lead) - len(shape) + 1) + shape[:-1]
        sum_dims = tuple(d for d, (a, b) in enumerate(zip(lead_part, p.lead)) if a == 1 and b != 1)
        if parts.get(k):
            got = []
            for start, width, g in sorted(parts[k]):
                outs.append((g, inp.dtype))
                got.append((len(outs) - 1, start, start + width))
            grads.append(GradOutput(k, None, sum_dims, tuple(inp.shape), inp.dtype, tuple(got)))
            continue
        if k not in adj:
            grads.append(GradOutput(k, None, sum_dims, tuple(inp.shape), inp.dtype, linked=bool(linked >> k & 1)))
            continue
        outs.append((e.widen(adj[k], k), inp.dtype))
        grads.append(GradOutput(k, len(outs) - 1, sum_dims, tuple(inp.shape), inp.dtype))
    return e, outs, grads, grad_of, (fwd, boundary)


def pruned(gp: GradProgram) -> GradProgram:
    """``gp`` with its program taking only the inputs it reads (an input it never loads still has to be given to a
    launch); :attr:`GradProgram.takes` lists them, by their numbers in the unpruned program."""
    if gp.program is None or gp.takes is not None:
        return gp
    prog = gp.program
    takes = tuple(k for k in range(len(prog.inputs)) if reads_input(prog, k))
    new = {k: i for i, k in enumerate(takes)}
    shift = len(prog.inputs) - len(takes)
    ref = lambda a: (new[a] if a < len(prog.inputs) else a - shift) if _is_ref(a) else a     # noqa: E731
    instrs = tuple(dataclasses.replace(ins, args=tuple(ref(a) for a in ins.args)) for ins in prog.instrs)
    out = Program(prog.lead, tuple(prog.inputs[k] for k in takes), instrs,
                  tuple(Output(ref(o.value), o.dtype) for o in prog.outputs))
    return dataclasses.replace(gp, program=out, takes=takes)


def _sliced_inputs(p: Program, wrt) -> set:
    """The inputs of ``wrt`` that ``p`` reads only through step-1 slices of disjoint columns."""
    nin = len(p.inputs)
    seen = {k: [] for k in wrt}
    for ins in p.instrs:
        for a in ins.args:
            if _is_ref(a) and a in seen and seen[a] is not None:
                ok = ins.op == "slice" and ins.step == 1
                seen[a] = seen[a] + [(ins.start, p.values[a].width if ins.stop is None else ins.stop)] if ok else None
    for o in p.outputs:
        if o.value in seen:
            seen[o.value] = None
    disjoint = lambda r: all(a[1] <= b[0] for a, b in zip(sorted(r), sorted(r)[1:]))   # noqa: E731
    return {k for k, r in seen.items() if r and k < nin and disjoint(r)}


def _softmaxes(p: Program) -> dict:
    """``{y: (z, log)}`` for each softmax ``y = exp(z − max z) / Σ exp(z − max z)`` (``log``: ``y = (z − max z) −
    log Σ exp(z − max z)``) whose intermediates nothing else reads. Their gradient is the closed form (torch's
    softmax backward): the chain rule through the max would add a term that is zero but for rounding (the
    result does not depend on the shift), at two reductions and five passes more. The sum may be selected
    as ``where(max == +inf, 1, Σ)`` (the logsumexp spellings' rows whose max is +inf: ``y`` is then ``z − inf``
    or its ``exp``, and the closed form, ``g − exp(y) Σ g`` or ``y (g − Σ g y)``, is eager's gradient of
    ``z − logsumexp(z)`` or of its ``exp``: NaN where ``y`` is, ``g`` or NaN elsewhere)."""
    nin = len(p.inputs)
    users = {}
    for j, ins in enumerate(p.instrs):
        for a in dict.fromkeys(a for a in ins.args if _is_ref(a)):
            users.setdefault(a, []).append(nin + j)
    outs = {o.value for o in p.outputs}

    def ins(v, op, kind=None):
        i = p.instrs[v - nin] if _is_ref(v) and v >= nin else None
        return i if i is not None and i.op == op and i.kind == kind else None

    def only(v, *readers):
        return v not in outs and sorted(users.get(v, ())) == sorted(readers)

    def lse_form(y, y_ins):
        """``(z, log)`` for ``y = (z − m) − D`` or ``exp(z − m) / exp(D)`` with ``D = where(m == +inf, 0, L − m)``
        and ``L = m + log Σ exp(z − m)`` (cast to a 16-bit dtype and back, or not): the logsumexp spellings as
        the softmax kernel computes them; ``y`` is ``z − lse`` or its exp, so the closed form is eager's gradient."""
        if y_ins.op == "sub":
            log, (a, D), X = True, y_ins.args, None
        elif y_ins.op == "div" and ins(y_ins.args[1], "exp") is not None:
            log, (a, X) = False, y_ins.args
            D = ins(X, "exp").args[0]
        else:
            return None
        w = ins(D, "where")
        if w is None or ins(w.args[0], "eq") is None or _is_ref(w.args[1]) or w.args[1] != 0.0:
            return None
        c, t = w.args[0], w.args[2]
        t_ins = ins(t, "sub")
        if t_ins is None:
            return None
        L, m = t_ins.args
        cast = ins(L, "cast")
        Ls = cast.args[0] if cast is not None else L
        a_ins = ins(Ls, "add")
        if a_ins is None or a_ins.args[0] != m or ins(a_ins.args[1], "log") is None:
            return None
        ls = a_ins.args[1]
        s = ins(ls, "log").args[0]
        if ins(s, "reduce", "sum") is None:
            return None
        e = ins(s, "reduce", "sum").args[0]
        if ins(e, "exp") is None or (not log and e != a):
            return None
        d = ins(e, "exp").args[0]
        d_ins = ins(d, "sub")
        if d_ins is None or (log and d != a) or d_ins.args[1] != m:
            return None
        z = d_ins.args[0]
        m_ins = ins(m, "reduce", "max")
        if not _is_ref(z) or m_ins is None or m_ins.args[0] != z or ins(c, "eq").args != (m, math.inf):
            return None
        readers = (only(d, e, y) and only(e, s) and only(D, y)) if log else \
            (only(d, e) and only(e, s, y) and only(D, X) and only(X, y))
        readers = readers and only(s, ls) and only(ls, Ls) and only(t, D) and \
            (only(Ls, t) if cast is None else (only(Ls, L) and only(L, t)))
        if readers and m not in outs and all(u in (d, Ls, t) or p.instrs[u - nin].op in COMPARE for u in users[m]):
            return z, log
        return None

    found = {}
    for j, y_ins in enumerate(p.instrs):
        y = nin + j
        got = lse_form(y, y_ins)
        if got is not None:
            found[y] = got
            continue
        if y_ins.op == "div":                              # exp(d) / sum(exp(d))
            e, s = y_ins.args
            log, ls = False, None
        elif y_ins.op == "sub" and ins(y_ins.args[1], "log"):   # d - log(sum(exp(d)))
            ls = y_ins.args[1]
            s = ins(ls, "log").args[0]
            log, e = True, None
        else:
            continue
        s_sel = s if ins(s, "where") is not None else None
        if s_sel is not None:                              # logsumexp's +inf rows: where(m == +inf, 1, sum)
            c, one, s = ins(s_sel, "where").args
            if one != 1.0 or _is_ref(one) or not _is_ref(s) or ins(c, "eq") is None:
                continue
        s_ins = ins(s, "reduce", "sum")
        if s_ins is None:
            continue
        e = s_ins.args[0] if log else e
        if e != s_ins.args[0] or ins(e, "exp") is None:
            continue
        d = ins(e, "exp").args[0]
        d_ins = ins(d, "sub")
        if d_ins is None or (log and d != y_ins.args[0]):
            continue
        z, m = d_ins.args
        m_ins = ins(m, "reduce", "max")
        if not _is_ref(z) or m_ins is None or m_ins.args[0] != z:
            continue
        if s_sel is not None and ins(c, "eq").args != (m, math.inf):
            continue
        s_out = s if s_sel is None else s_sel              # the sum the division or the log reads
        readers = (only(d, e, y) and only(e, s) and only(s_out, ls) and only(ls, y)) if log else \
            (only(d, e) and only(e, s, y) and only(s_out, y))
        if s_sel is not None:
            readers = readers and only(s, s_sel)
        # the max may be read by compares too (an empty row's test): they carry no gradient
        if readers and m not in outs and all(u == d or p.instrs[u - nin].op in COMPARE for u in users[m]):
            found[y] = (z, log)
    return found


def _softmax_grad(e: _Emit, g: int, y: int, log: bool) -> int:
    """torch's softmax backward ``y (g − Σ g y)``; log-softmax's ``g − exp(y) Σ g``."""
    if log:
        return e.op("sub", g, e.op("mul", e.op("exp", y), e.op("reduce", g, kind="sum")))
    return e.op("mul", y, e.op("sub", g, e.op("reduce", e.op("mul", g, y), kind="sum")))


def reads_input(program: Program, k: int) -> bool:
    """Whether ``program`` reads its input ``k`` (an instruction argument or an output)."""
    return any(_is_ref(a) and a == k for ins in program.instrs for a in ins.args) or \
        any(o.value == k for o in program.outputs)


def _diff_args(ins: Instr) -> list:
    """The value arguments a gradient can flow to (a where's condition cannot)."""
    args = ins.args[1:] if ins.op == "where" else ins.args
    return [a for a in args if _is_ref(a)]


def _rule(e: _Emit, i: int, ins: Instr, v: int, g: int, fwd: list, vals, reach, acc) -> None:
    """Send adjoint ``g`` of forward value ``v`` (instruction ``i``) to its operands through ``acc``."""
    op, args = ins.op, ins.args
    y = fwd[v]
    X = [fwd[a] if _is_ref(a) else a for a in args]          # operands in the backward program
    x = X[0]

    def refuse(why):
        raise NotDifferentiable(f"instruction {i} ({op}{' ' + ins.kind if ins.kind else ''}): {why}")

    if vals[v].width > 1 and e.width[g] == 1 and any(_is_ref(a) and vals[a].width == 1 and reach[a] for a in args):
        # a one-column adjoint of a wider value (a row sum's or mean's, broadcast) stands for the same value in
        # every column: an operand of one column read over the row takes its sum over the row, so widen it first
        g = e.widen(g, y)
    if op in COMPARE + LOGIC + _STEPS or (op == "cast" and ins.dtype == "bool"):
        return
    if op == "cast":
        # torch's .to() backward casts g to the operand's dtype: through a rounding the program computes (the round
        # trip x.bfloat16().float()) the gradient is rounded as eager's autograd rounds it; a 16-bit input's is
        # rounded once, to its own dtype, at the output. g itself is the gradient of the cast's result, 16-bit in
        # eager when the cast is to 16 bits: rounded to it first
        src = vals[args[0]].dtype
        if src not in FLOATS:
            return None
        computed = args[0] >= v - i                 # an instruction's value, not an input
        if ins.dtype in FLOATS and ins.dtype != F32:
            # a cast to 16 bits (the model's .half()/.bfloat16(), or eager's 16-bit storage of a value an op
            # widens by promotion): eager's gradient of that 16-bit tensor is 16-bit, so it is rounded there
            g = e.op("cast", g, dtype=ins.dtype)
        return acc(args[0], e.op("cast", g, dtype=src) if src != F32 and computed and src != ins.dtype else g)
    if op == "neg":
        return acc(args[0], e.op("neg", g))
    if op == "sqrt" and ins.kind == "root":
        # torch's std_backward and norm backward: g / (2 root), 0 where the root is 0 (a constant row, a row of
        # zeros: 0/0 through sqrt's own rule)
        return acc(args[0], e.op("where", e.op("eq", y, 0.0), 0.0, _UNARY_DERIV[op](e, g, x, y)))
    if op in _UNARY_DERIV:
        return acc(args[0], _UNARY_DERIV[op](e, g, x, y))
    if op == "mul" and args[0] == args[1] and _is_ref(args[0]) and _is_ref(args[1]):   # a square: 2 a g once
        return acc(args[0], _twice(e, g, x))
    if op in ("maximum", "minimum") and ins.kind in ("clamp", "hardtanh", "open"):
        # clamp's bound (an immediate): torch's clamp_backward passes g where x is within the bound, the bound
        # itself included, and none where x is NaN; hardtanh_backward none at the bound and all of it at NaN;
        # hardsigmoid's (open) only strictly inside
        if _is_ref(args[1]):
            refuse("a clamp whose bound is a tensor")
        if ins.kind == "hardtanh":
            return acc(args[0], e.op("where", e.op("le" if op == "maximum" else "ge", x, X[1]), 0.0, g))
        keep = e.op({("clamp", "maximum"): "ge", ("clamp", "minimum"): "le", ("open", "maximum"): "gt",
                     ("open", "minimum"): "lt"}[ins.kind, op], x, X[1])
        return acc(args[0], e.op("where", keep, g, 0.0))
    if op in ("add", "sub", "mul", "div", "maximum", "minimum", "pow"):
        a, b = X
        ga, gb = _binary(e, op, g, a, b, y, refuse)
        if _is_ref(args[0]):
            acc(args[0], ga)
        if _is_ref(args[1]):
            acc(args[1], gb)
        return None
    if op == "where":
        c = X[0]
        for arg, pick in ((args[1], (g, 0.0)), (args[2], (0.0, g))):
            if _is_ref(arg):
                acc(arg, e.op("where", c, *pick))
        return None
    if op == "reduce":
        if ins.kind == "sum":
            return acc(args[0], g)
        if ins.kind == "mean":
            w = vals[args[0]].width
            return acc(args[0], g if w == 1 else e.op("div", g, float(w)))
        # torch's amax/amin backward: g / count at every element equal to the result, as mask * (g / count): a row
        # whose result is NaN equals nowhere, and 0 * (g / 0) makes its whole gradient NaN, as eager's
        m = e.op("cast", e.op("eq", x, y), dtype=F32)
        count = e.op("reduce", m, kind="sum")
        return acc(args[0], e.mul(m, e.op("div", g, count)))
    if op == "slice":
        return acc(args[0], _unslice(e, ins, e.widen(g, y), x, refuse))
    if op == "cat":
        g = e.widen(g, y)
        off = 0
        for a in args:
            w = vals[a].width
            if reach[a]:
                acc(a, g if w == e.width[g] else e.op("slice", g, start=off, stop=off + w))
            off += w
        return None
    if op == "interleave":
        g = e.widen(g, y)
        w = e.width[g]
        for a, start in zip(args, (0, 1)):
            if reach[a]:
                acc(a, e.op("slice", g, start=start, stop=w, step=2))
        return None
    refuse("no gradient rule for this op")


def _unslice(e: _Emit, ins: Instr, g: int, x: int, refuse) -> int:
    """The adjoint of ``x`` from that of its slice ``g``: ``g`` at the sliced columns, zeros elsewhere."""
    w = e.width[x]
    start, n = ins.start, e.width[g]
    if ins.step == 1:
        block = g
    elif ins.step == 2:
        block = e.op("interleave", g, e.zeros(n, g))          # columns start, start + 2, ... then their gaps
        if start + 2 * n > w:
            block = e.op("slice", block, start=0, stop=w - start)
    else:
        refuse(f"a slice with step {ins.step}: its gradient scatters every {ins.step}th column, which no "
               f"shuffle of this IR expresses (step 2 is an interleave with zeros)")
    parts = [e.zeros(start, g, x)] if start else []
    parts.append(block)
    rest = w - start - e.width[block]
    if rest:
        parts.append(e.zeros(rest, g, x))
    return parts[0] if len(parts) == 1 else e.op("cat", *parts)


def _binary(e: _Emit, op: str, g: int, a, b, y: int, refuse) -> tuple:
    """The adjoints of a binary op's operands (either may be an immediate; its entry is then unused)."""
    if op == "add":
        return g, g
    if op == "sub":
        return g, e.op("neg", g)
    if op == "mul":
        return (e.mul(g, b) if _is_ref(b) or b != 0.0 else None), (e.mul(g, a) if _is_ref(a) or a != 0.0 else None)
    if op == "div":
        ga = e.op("div", g, b)
        gb = e.op("neg", e.op("mul", g, e.op("div", y, b))) if _is_ref(b) else None   # torch: -g * (a / b) / b
        return ga, gb
    if op in ("maximum", "minimum"):
        # torch: g to the winner, g / 2 to each on a tie
        h = e.op("where", e.op("eq", a, b), e.mul(g, 0.5), g)
        lose_a, lose_b = ("lt", "gt") if op == "maximum" else ("gt", "lt")
        ga = e.op("where", e.op(lose_a, a, b), 0.0, h) if _is_ref(a) else None
        gb = e.op("where", e.op(lose_b, a, b), 0.0, h) if _is_ref(b) else None
        return ga, gb
    # pow: torch's pow_backward_self / pow_backward_exponent
    ga = gb = None
    if _is_ref(a):
        if not _is_ref(b):
            ga = None if b == 0.0 else g if b == 1.0 else e.mul(g, e.mul(_power(e, a, b - 1.0), b))
        else:
            d = e.op("mul", b, e.op("pow", a, e.op("sub", b, 1.0)))
            ga = e.op("where", e.op("eq", b, 0.0), 0.0, e.op("mul", g, d))
    if _is_ref(b):
        if not _is_ref(a):
            if a == 0.0:        # torch's pow_backward_exponent: 0 where the exponent is >= 0, y·log(0) elsewhere
                gb = e.op("mul", g, e.op("where", e.op("ge", b, 0.0), 0.0, e.mul(y, -math.inf)))
            else:               # log of a negative base is NaN: so is every gradient, as torch's
                gb = e.mul(g, e.mul(y, math.log(a) if a > 0.0 else math.nan))
        else:
            zero = e.op("logical_and", e.op("eq", a, 0.0), e.op("ge", b, 0.0))
            gb = e.op("where", zero, 0.0, e.op("mul", g, e.op("mul", y, e.op("log", a))))
    return ga, gb


def _power(e: _Emit, a: int, k: float) -> int:
    """``a ** k``, by a cheaper op where one computes it (pow is a composite exp(k log a) on the Vector unit)."""
    if k == 1.0:
        return a
    if k == 0.0:
        return e.op("where", e.op("lt", a, a), 1.0, 1.0)      # 1 everywhere, NaN and inf included (as torch)
    if k in (2.0, 3.0):
        sq = e.op("mul", a, a)
        return sq if k == 2.0 else e.op("mul", sq, a)
    if k in _POW_AS:
        return e.op(_POW_AS[k], a)
    return e.op("pow", a, k)


_POW_AS = {0.5: "sqrt", -0.5: "rsqrt", -1.0: "reciprocal"}
_ZERO_REPEATS = 8          # zeros shaped from an adjoint narrower than them: at most this many pieces in a cat


def _gelu_tanh(e: _Emit, x: int) -> int:
    """d/dx of 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + c x^3): 0.5 (1 + t) + 0.5 x (1 - t^2) u'."""
    x2 = e.op("mul", x, x)
    t = e.op("tanh", e.mul(e.op("mul", x, e.op("add", e.mul(x2, _GELU_C), 1.0)), _SQRT_2_PI))
    du = e.mul(e.op("add", e.mul(x2, 3.0 * _GELU_C), 1.0), _SQRT_2_PI)
    right = e.op("mul", e.op("mul", e.mul(x, 0.5), e.op("sub", 1.0, e.op("mul", t, t))), du)
    return e.op("add", e.mul(e.op("add", t, 1.0), 0.5), right)


def _gelu(e: _Emit, x: int, y: int) -> int:
    """d/dx of x Phi(x): Phi(x) + x phi(x); Phi(x) = gelu(x) / x (erf is no op; 1/2 at x = 0)."""
    cdf = e.op("where", e.op("eq", x, 0.0), 0.5, e.op("div", y, x))
    pdf = e.mul(e.op("exp", e.mul(e.op("mul", x, x), -0.5)), _INV_SQRT_2PI)
    return e.op("add", cdf, e.op("mul", x, pdf))


def _twice(e: _Emit, g: int, x: int) -> int:
    """``2 x g``, the 2 applied to the narrower of the two (a per-row adjoint: one op per row, not per element)."""
    if e.width[g] < e.width[x]:
        return e.op("mul", e.mul(g, 2.0), x)
    return e.op("mul", g, e.mul(x, 2.0))


def _abs(e, g, x, y):
    # torch: g·sgn(x), sgn 0 at 0 and at NaN: g·0 there (an infinite g at 0, sqrt's, gives NaN as in eager)
    return e.op("where", e.op("gt", x, 0.0), g, e.op("where", e.op("lt", x, 0.0), e.op("neg", g), e.op("mul", g, 0.0)))


def _silu(e, g, x, y):
    s = e.op("sigmoid", x)                                  # torch: g s (1 + x (1 - s))
    return e.op("mul", g, e.op("mul", s, e.op("add", e.op("mul", x, e.op("sub", 1.0, s)), 1.0)))


# unary op -> (emit, g, x, y) -> the adjoint of x (torch's formulas)
_UNARY_DERIV = {
    "abs": _abs,
    # torch's threshold_backward: none where the result is <= 0, all of it elsewhere (at NaN too)
    "relu": lambda e, g, x, y: e.op("where", e.op("le", y, 0.0), 0.0, g),
    "square": lambda e, g, x, y: _twice(e, g, x),
    "exp": lambda e, g, x, y: e.op("mul", g, y),
    "log": lambda e, g, x, y: e.op("div", g, x),
    "sqrt": lambda e, g, x, y: e.op("div", g, e.mul(y, 2.0)),
    "rsqrt": lambda e, g, x, y: e.op("mul", g, e.mul(e.op("mul", e.op("mul", y, y), y), -0.5)),
    "reciprocal": lambda e, g, x, y: e.op("neg", e.op("mul", g, e.op("mul", y, y))),
    "sigmoid": lambda e, g, x, y: e.op("mul", g, e.op("mul", y, e.op("sub", 1.0, y))),
    "tanh": lambda e, g, x, y: e.op("mul", g, e.op("sub", 1.0, e.op("mul", y, y))),
    "silu": _silu,
    "gelu": lambda e, g, x, y: e.op("mul", g, _gelu(e, x, y)),
    "gelu_tanh": lambda e, g, x, y: e.op("mul", g, _gelu_tanh(e, x)),
    "erf": lambda e, g, x, y: e.op("mul", g, e.mul(e.op("exp", e.op("neg", e.op("mul", x, x))), _TWO_SQRT_PI)),
    "softplus": lambda e, g, x, y: e.op("mul", g, e.op("sigmoid", x)),
    "log1p": lambda e, g, x, y: e.op("div", g, e.op("add", x, 1.0)),
    "expm1": lambda e, g, x, y: e.op("mul", g, e.op("add", y, 1.0)),
    "sin": lambda e, g, x, y: e.op("mul", g, e.op("cos", x)),
    "cos": lambda e, g, x, y: e.op("neg", e.op("mul", g, e.op("sin", x))),
}


__all__ = ["GradOutput", "GradProgram", "NotDifferentiable", "backward_program", "backward_reads", "pruned",
           "reads_input"]
