"""Vector programs: a chain of elementwise, broadcast, reduction, cast and column-shuffle ops, as data.

A :class:`Program` is what the compiler hands to one generated Vector kernel (``vector_program`` on the
simulator, ``cost_model.vector_program`` for its price, ``torch.ops.autofuse.vector_program`` in a graph).
It is pure data: frozen, hashable, JSON-serialisable, and free of torch and of any cost figure, so that the
simulator (which may import nothing of the cost model but the hardware description and this description of
the computation) and the cost model can both read it. Nothing here is a cost formula: this module says
*what* is computed; :mod:`cost_model.lowering` (pure data too) says *which* Vector operations, loads and
UB tiles a tile of it takes; the simulator counts what those operations cost and the cost model predicts it.

Iteration space
---------------
``[rows, cols]``: the compiler's leading dims ``lead`` (rows = their product) by the last dim. Every value is
a tensor broadcastable to ``(*lead, width)``:

* an :class:`Input` has its own ``shape``, right-aligned against ``(*lead, width)`` as torch broadcasts
  (a size-1 dim where ``lead`` has more is broadcast). The usual patterns: full ``[*lead, cols]``; per-row
  ``[*lead, 1]``; per-col ``[cols]`` (a norm weight); scalar ``[1]``; and any mix, such as RoPE's
  ``cos [S, D]`` against ``lead = (B, N, S)`` (broadcast over the heads);
* an instruction's result has the width of its widest operand (operands of width 1 broadcast along the
  columns) and varies along the lead dims any operand varies along.

Values are numbered: inputs first (``0 .. len(inputs)-1``), then one per instruction in order. An
instruction's ``args`` are value numbers (``int``) or immediates (``float``).

Instructions (``Instr.op``)
---------------------------
* unary: ``neg abs relu square exp log sqrt rsqrt reciprocal sigmoid tanh silu gelu gelu_tanh sin cos erf``,
  ``softplus`` (``log(1 + exp(x))``: torch's with beta 1, no threshold), ``log1p expm1``; ``floor ceil trunc round``
  (to an integral value, ``round`` half to even; ±0, ±inf and NaN kept, the sign of a zero result is x's: torch's
  ``ceil(-0.5)`` is -0.0), ``sign`` (torch's: 0 at NaN, +0 at ±0); ``logical_not`` (bool);
* binary: ``add sub mul div maximum minimum pow`` (either operand may be an immediate: ``pow(x, 2.0)``,
  ``sub(1.0, x)``); compare ``eq ne lt le gt ge`` (bool result); ``logical_and logical_or`` (bool);
* ``where(cond, a, b)``: ``cond`` bool, ``a``/``b`` values or immediates;
* ``cast(x, dtype=...)``: round to ``dtype`` (float16/bfloat16: to nearest, ties to even; bool: ``x != 0``;
  a bool cast to a float is 0/1);
* ``reduce(x, kind=...)`` along the columns, ``kind`` in ``sum mean max min``: a per-row value (width 1),
  which later instructions may broadcast back over the columns. Any number of reductions may follow each
  other (LayerNorm's two means, softmax's max then sum).
* column shuffles: ``slice(x, start=, stop=, step=)`` (``x[..., start:stop:step]``), ``cat(a, b, ...)``
  (along the columns), ``interleave(a, b)`` (``out[2i] = a[i], out[2i+1] = b[i]``). RoPE's half rotation is
  ``cat(neg(slice(x, D/2, D)), slice(x, 0, D/2))``; its interleaved form is
  ``interleave(neg(slice(x, 1, D, 2)), slice(x, 0, D, 2))``; SwiGLU on a fused gate_up output ``g`` of
  width 2F is ``mul(silu(slice(g, 0, F)), slice(g, F, 2F))``.

Bit inputs
----------
An input of dtype ``bit`` is a bool mask stored one bit per element along the last dim, as
``dropout_gen_mask`` writes a dropout keep-mask (and as the Vector unit's ``Select`` reads its condition):
element ``c`` of a row is bit ``c % 8`` (least significant first) of byte ``c // 8``. Its declared shape is
the mask's logical shape; the tensor given for it is uint8 of shape :func:`stored_shape` (the last dim
``ceil(width / 8)``). A bit value may only be the condition of a ``where`` of its own width (``x * where(keep,
s, 0.0)`` is a dropout): it is never widened to a bool register, the select reads it as it was loaded.

Outputs (:class:`Output`): a value and a dtype; the output tensor has shape ``(*lead, width)``.

Numerics (what ``run_program_torch`` and the kernel compute)
------------------------------------------------------------
Inputs enter as their exact values. Every arithmetic instruction computes in float32 on float32 operands
and gives a float32 value (fp16/bf16 inputs are widened exactly; immediates are rounded to float32).
Rounding to a narrower type happens only at a ``cast`` and at an output. Reductions accumulate in float32
(``mean`` is the sum divided by ``width``, as torch's mean computes it; ``sum · (1/width)`` can be an ulp off
it, enough to flip a comparison with the mean of a row of equal values). This is how the Vector unit computes
such a chain (one cast up on load, one cast down on store), and it matches eager PyTorch exactly where eager itself computes in fp32:
float32 programs (up to the last-ulp differences between exp/erf/tanh implementations), and fp16/bf16
graphs that cast up first (RMSNorm's ``x.float()``). It does *not* match eager fp16/bf16 op chains bit for
bit: eager rounds every intermediate result to fp16/bf16 (each op computes in fp32 and rounds its output),
the program keeps the intermediates in fp32, so its result is the more accurate one. A compiler that must
reproduce eager rounding inserts ``cast`` instructions after each op (``autofuse.vector_program.
program_from_nodes(..., rounding="eager")``); each costs a Vector pass or two.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field


FLOATS = ("float16", "bfloat16", "float32")
DTYPES = FLOATS + ("bool",)
BIT = "bit"                # an input only: a bool mask packed one bit per element (see "Bit inputs")
INPUT_DTYPES = DTYPES + (BIT,)
F32 = "float32"
STAT = 8                   # a per-row value in UB: one 32 B block of fp32 per row (the Brcb layout)

UNARY = ("neg", "abs", "relu", "square", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sigmoid", "tanh", "silu",
         "gelu", "gelu_tanh", "sin", "cos", "erf", "softplus", "log1p", "expm1", "floor", "ceil", "trunc", "round",
         "sign")
BINARY = ("add", "sub", "mul", "div", "maximum", "minimum", "pow")
COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")
LOGIC = ("logical_and", "logical_or", "logical_not")
REDUCE_KINDS = ("sum", "mean", "max", "min")
SHUFFLE = ("slice", "cat", "interleave")
OPS = UNARY + BINARY + COMPARE + LOGIC + ("where", "cast", "reduce") + SHUFFLE
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_COMMUTATIVE = ("add", "mul", "maximum", "minimum")


class ProgramError(ValueError):
    """A program is malformed, or does not fit the tensors it is given. ``inputs``: the numbers of the program's
    inputs the error is about, where it is about some (a caller that knows what they are in the model may say)."""

    def __init__(self, message: str, inputs: tuple = ()):
        super().__init__(message)
        self.inputs = tuple(inputs)


@dataclass(frozen=True)
class Input:
    """A tensor input: its dtype and shape (right-aligned against ``(*lead, width)``)."""

    dtype: str
    shape: tuple


def stored_shape(inp: Input) -> tuple:
    """The shape of the tensor that holds input ``inp``: its own, or for a ``bit`` input the last dim packed
    eight elements a byte."""
    shape = tuple(inp.shape) or (1,)
    return shape[:-1] + (-(-shape[-1] // 8),) if inp.dtype == BIT else tuple(inp.shape)


def check_given(what: str, k: int, got, inp: Input) -> None:
    """Raise :class:`ProgramError` unless ``got`` (``(shape, dtype)``, or None for a missing tensor) is how input
    ``inp`` is given: its own shape and dtype, or for a ``bit`` input uint8 of :func:`stored_shape`. ``what``
    and ``k`` name the input in the message (``"vector_program: input", 2``)."""
    bit = inp.dtype == BIT
    want = (stored_shape(inp), "uint8") if bit else (tuple(inp.shape), inp.dtype)
    if got is None or (tuple(got[0]), got[1]) != want:
        shown = "None" if got is None else f"{list(got[0])} {got[1]}"
        raise ProgramError(f"{what} {k} is {shown}; the program declares {list(inp.shape)} {inp.dtype}"
                           + (f", given as uint8 {list(want[0])} (one bit per element along the last dim)"
                              if bit else ""))


@dataclass(frozen=True)
class Instr:
    """One instruction: ``op`` over ``args`` (value numbers or float immediates); ``dtype`` for ``cast``,
    ``kind`` for ``reduce`` (and ``clamp`` on a ``maximum``/``minimum`` with an immediate bound: the same values,
    clamp's gradient; ``hardtanh``: none at the bound itself, all of it at NaN, as torch's hardtanh; ``open``: none at
    the bound nor at NaN, as its hardsigmoid; ``root`` on a ``sqrt``: the same value, a std's or a 2-norm's
    root, whose gradient is 0 where it is 0, as torch's std and norm backwards), ``start/stop/step`` for
    ``slice``."""

    op: str
    args: tuple
    dtype: str | None = None
    kind: str | None = None
    start: int = 0
    stop: int | None = None
    step: int = 1


@dataclass(frozen=True)
class Output:
    value: int
    dtype: str


@dataclass(frozen=True)
class Value:
    """What :meth:`Program.values` infers for each value: ``dtype`` (the type its values are exact in: the
    input's, float32 after arithmetic, bool after a compare, a cast's target), ``width``, ``rowvar`` (per lead
    dim: whether it varies along it), ``level`` (reductions on its path: the pass of a chunked schedule in
    which it is first available)."""

    dtype: str
    width: int
    rowvar: tuple
    level: int


def _is_ref(a) -> bool:
    return isinstance(a, int) and not isinstance(a, bool)


@dataclass(frozen=True, repr=False)
class Program:
    """A Vector program (see the module docstring). Construct with :class:`Builder` or :meth:`from_json`."""

    lead: tuple
    inputs: tuple
    instrs: tuple
    outputs: tuple
    _values: tuple = field(default=(), compare=False, hash=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "lead", tuple(int(d) for d in self.lead))
        object.__setattr__(self, "_values", tuple(_infer(self)))
        # programs key the cost model's caches: hash once
        object.__setattr__(self, "_hash", hash((self.lead, self.inputs, self.instrs, self.outputs)))

    def __hash__(self):
        return self._hash

    def __repr__(self):
        ops = ",".join(i.op + (f":{i.kind}" if i.kind else "") for i in self.instrs)
        if len(ops) > 48:
            ops = ops[:45] + "..."
        return f"Program(lead={list(self.lead)}, {len(self.instrs)} ops: {ops})"

    # ------------------------------------------------------------------ facts
    @property
    def values(self) -> tuple:
        """One :class:`Value` per value (inputs, then instructions)."""
        return self._values

    @property
    def rows(self) -> int:
        return math.prod(self.lead)

    def output_shapes(self) -> list[tuple]:
        return [tuple(self.lead) + (self.values[o.value].width,) for o in self.outputs]

    @property
    def levels(self) -> int:
        """Reductions in sequence on the longest path to an output (a chunked schedule makes this many
        passes over the row before its last one)."""
        return max((self.values[o.value].level for o in self.outputs), default=0)

    def value_of(self, i: int) -> Input | Instr:
        n = len(self.inputs)
        return self.inputs[i] if i < n else self.instrs[i - n]

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        ins = []
        for ins_ in self.instrs:
            d = {"op": ins_.op, "args": list(ins_.args)}
            for k in ("dtype", "kind", "stop"):
                if getattr(ins_, k) is not None:
                    d[k] = getattr(ins_, k)
            if ins_.start:
                d["start"] = ins_.start
            if ins_.step != 1:
                d["step"] = ins_.step
            ins.append(d)
        return {"lead": list(self.lead), "inputs": [[i.dtype, list(i.shape)] for i in self.inputs],
                "instrs": ins, "outputs": [[o.value, o.dtype] for o in self.outputs]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @staticmethod
    def from_dict(d: dict) -> "Program":
        def arg(a):
            if isinstance(a, bool):
                raise ProgramError(f"argument {a!r}: a bool is neither a value number nor a float immediate")
            return a if isinstance(a, int) else float(a)
        instrs = tuple(Instr(i["op"], tuple(arg(a) for a in i["args"]), i.get("dtype"), i.get("kind"),
                             int(i.get("start", 0)), None if i.get("stop") is None else int(i["stop"]),
                             int(i.get("step", 1))) for i in d["instrs"])
        return Program(tuple(d["lead"]), tuple(Input(dt, tuple(int(s) for s in sh)) for dt, sh in d["inputs"]),
                       instrs, tuple(Output(int(v), dt) for v, dt in d["outputs"]))

    @staticmethod
    def from_json(s: str) -> "Program":
        return Program.from_dict(json.loads(s))


def as_program(p) -> Program:
    """A :class:`Program` from a Program, its JSON string or its dict."""
    if isinstance(p, Program):
        return p
    if isinstance(p, str):
        return _from_json_cached(p)
    if isinstance(p, dict):
        return Program.from_dict(p)
    raise ProgramError(f"not a vector program: {type(p).__name__} (give a Program, its JSON or its dict)")


@functools.lru_cache(maxsize=256)
def _from_json_cached(s: str) -> Program:
    return Program.from_json(s)


# ------------------------------------------------------------------------------------------ inference
def _err(i, ins, msg):
    return ProgramError(f"instruction {i} ({ins.op}): {msg}")


def _infer(p: Program) -> list[Value]:
    nl = len(p.lead)
    vals: list[Value] = []
    for k, inp in enumerate(p.inputs):
        if not isinstance(inp, Input):
            raise ProgramError(f"input {k}: {inp!r} is not an Input")
        if inp.dtype not in INPUT_DTYPES:
            raise ProgramError(f"input {k}: dtype {inp.dtype} is not one of {', '.join(INPUT_DTYPES)}")
        shape = tuple(inp.shape) or (1,)
        if len(shape) - 1 > nl:
            raise ProgramError(f"input {k}: shape {list(inp.shape)} has more leading dims than lead {list(p.lead)}")
        lead_part = (1,) * (nl - len(shape) + 1) + tuple(shape[:-1])
        for d, (a, b) in enumerate(zip(lead_part, p.lead)):
            if a not in (1, b):
                raise ProgramError(f"input {k}: shape {list(inp.shape)} does not broadcast to lead {list(p.lead)} "
                                   f"(dim {d}: {a} vs {b})")
        vals.append(Value(inp.dtype, int(shape[-1]), tuple(a == b and b != 1 for a, b in zip(lead_part, p.lead)), 0))
    for i, ins in enumerate(p.instrs):
        if not isinstance(ins, Instr):
            raise ProgramError(f"instruction {i}: {ins!r} is not an Instr")
        if ins.op not in OPS:
            raise _err(i, ins, f"unknown op; ops are {', '.join(OPS)}")
        for a in ins.args:
            if _is_ref(a):
                if not 0 <= a < len(vals):
                    raise _err(i, ins, f"argument {a} is not an earlier value (0..{len(vals) - 1})")
            elif not isinstance(a, float):
                raise _err(i, ins, f"argument {a!r} is neither a value number (int) nor an immediate (float)")
        vals.append(_infer_one(i, ins, vals, nl))
    for j, o in enumerate(p.outputs):
        if not _is_ref(o.value) or not 0 <= o.value < len(vals):
            raise ProgramError(f"output {j}: value {o.value!r} does not exist")
        if o.dtype not in DTYPES:
            raise ProgramError(f"output {j}: dtype {o.dtype} is not one of {', '.join(DTYPES)}")
        if vals[o.value].dtype == BIT:
            raise ProgramError(f"output {j}: value {o.value} is a bit input; a bit value may only be the "
                               f"condition of a where")
    return vals


def _infer_one(i, ins, vals, nl) -> Value:
    refs = [vals[a] for a in ins.args if _is_ref(a)]
    rowvar = tuple(any(v.rowvar[d] for v in refs) for d in range(nl))
    level = max((v.level for v in refs), default=0)
    op = ins.op
    arity = {"where": 3, "cast": 1, "reduce": 1, "slice": 1, "interleave": 2, "logical_not": 1}
    if op in UNARY or op in arity:
        want = 1 if op in UNARY else arity[op]
        if len(ins.args) != want:
            raise _err(i, ins, f"takes {want} argument(s), got {len(ins.args)}")
    elif op == "cat":
        if len(ins.args) < 2:
            raise _err(i, ins, "takes two or more values")
    elif len(ins.args) != 2:
        raise _err(i, ins, f"takes 2 arguments, got {len(ins.args)}")
    if not refs:
        raise _err(i, ins, "needs at least one value argument (an all-immediate instruction is a constant)")
    if op in ("cast", "reduce", "slice", "interleave", "cat") and len(refs) != len(ins.args):
        raise _err(i, ins, "takes values, not immediates")

    def floats(vs):
        for v in vs:
            if v.dtype == "bool":
                raise _err(i, ins, "a bool operand; cast it to a float first")

    c = ins.args[0] if op == "where" else None
    if any(vals[a].dtype == BIT for a in ins.args if _is_ref(a) and a != c):
        raise _err(i, ins, "a bit input may only be the condition of a where")

    if op in SHUFFLE:
        floats(refs)
        if op == "slice":
            w = refs[0].width
            stop = w if ins.stop is None else ins.stop
            if not (0 <= ins.start < stop <= w) or ins.step < 1:
                raise _err(i, ins, f"slice [{ins.start}:{ins.stop}:{ins.step}] of a value of width {w}")
            return Value(F32, len(range(ins.start, stop, ins.step)), rowvar, level)
        if op == "interleave" and refs[0].width != refs[1].width:
            raise _err(i, ins, f"widths {refs[0].width} and {refs[1].width} differ")
        width = sum(v.width for v in refs)
        return Value(F32, width, rowvar, level)
    if op == "reduce":
        floats(refs)
        if ins.kind not in REDUCE_KINDS:
            raise _err(i, ins, f"kind {ins.kind!r} is not one of {', '.join(REDUCE_KINDS)}")
        return Value(F32, 1, rowvar, level + 1)
    widths = {v.width for v in refs}
    if len(widths - {1}) > 1:
        raise _err(i, ins, f"operand widths {sorted(widths)} do not broadcast")
    width = max(widths)
    if op == "cast":
        if ins.dtype not in DTYPES:
            raise _err(i, ins, f"dtype {ins.dtype!r} is not one of {', '.join(DTYPES)}")
        return Value(ins.dtype, width, rowvar, level)
    if op in LOGIC:
        if any(v.dtype != "bool" for v in refs) or len(refs) != len(ins.args):
            raise _err(i, ins, "takes bool values")
        return Value("bool", width, rowvar, level)
    if op == "where":
        c = ins.args[0]
        if not _is_ref(c) or vals[c].dtype not in ("bool", BIT):
            raise _err(i, ins, "the condition (first argument) must be a bool value or a bit input")
        branches = [vals[a] for a in ins.args[1:] if _is_ref(a)]
        floats(branches)
        if vals[c].dtype == BIT and vals[c].width != width:
            raise _err(i, ins, f"a bit condition of width {vals[c].width} selects over width {width}: it "
                               f"must have the where's own width")
        return Value(F32, width, rowvar, level)
    floats(refs)
    if op in COMPARE:
        return Value("bool", width, rowvar, level)
    return Value(F32, width, rowvar, level)


# ------------------------------------------------------------------------------------------ building
class V:
    """A value handle of a :class:`Builder` (its number)."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __repr__(self):
        return f"V({self.i})"


class Builder:
    """Builds a :class:`Program` with calls named by op::

        b = Builder(lead=(4096,))
        x, w = b.input("float16", (4096, 4096)), b.input("float16", (4096,))
        xf = b.cast(x, dtype="float32")
        r = b.rsqrt(b.add(b.reduce(b.mul(xf, xf), kind="mean"), 1e-6))
        b.output(b.mul(b.cast(b.mul(xf, r), dtype="float16"), w), "float16")
        prog = b.build()

    Python numbers become float immediates; ``V`` handles are values.
    """

    def __init__(self, lead):
        self.lead = tuple(lead)
        self.inputs: list[Input] = []
        self.instrs: list[Instr] = []
        self.outputs: list[Output] = []

    def input(self, dtype: str, shape) -> V:
        if self.instrs:
            raise ProgramError("declare every input before the first instruction")
        self.inputs.append(Input(str(dtype).replace("torch.", ""), tuple(int(s) for s in shape)))
        return V(len(self.inputs) - 1)

    def op(self, name: str, *args, **attrs) -> V:
        conv = tuple(a.i if isinstance(a, V) else float(a) for a in args)
        self.instrs.append(Instr(name, conv, **attrs))
        return V(len(self.inputs) + len(self.instrs) - 1)

    def __getattr__(self, name):
        if name in OPS:
            return lambda *args, **attrs: self.op(name, *args, **attrs)
        raise AttributeError(name)

    def output(self, v: V, dtype: str) -> None:
        self.outputs.append(Output(v.i, str(dtype).replace("torch.", "")))

    def build(self) -> Program:
        return Program(self.lead, tuple(self.inputs), tuple(self.instrs), tuple(self.outputs))


# ------------------------------------------------------------------------------------------ random programs
def random_program(seed: int, lead=(64,), width: int = 256, dtype: str = "float16", n_ops: int = 8,
                   reductions: int = 1, extras=("weight", "row", "scalar", "mask", "second"),
                   shuffles: bool = False) -> Program:
    """A random, numerically tame program (for property tests and the cost-model sweep).

    Inputs: ``x`` (full, ``dtype``) and, from ``extras``, a per-col weight, a per-row value, a scalar, a bool
    mask and a second full input. Ops that could overflow or leave their domain are guarded (``exp(tanh
    x)``, ``log(|x| + 1)``, ``a / (|b| + 1)``), so values stay within a few units whatever the inputs.
    ``reductions`` reductions (random kinds) are broadcast back; ``shuffles`` adds a half rotation
    (slice, neg, cat) or an interleave. Outputs: the last value, and a per-row value when there is one.
    """
    import random
    rnd = random.Random(seed)
    b = Builder(lead)
    x = b.input(dtype, tuple(lead) + (width,))
    full = [x]
    rowv, colv = [], []
    if "weight" in extras:
        colv.append(b.input(rnd.choice(["float16", "float32", dtype]), (width,)))
    if "row" in extras:
        rowv.append(b.input(rnd.choice(["float32", dtype]), tuple(lead) + (1,)))
    if "scalar" in extras:
        rowv.append(b.input("float32", (1,)))
    mask = b.input("bool", tuple(lead) + (width,)) if "mask" in extras else None
    if "second" in extras:
        full.append(b.input(rnd.choice(["float16", "bfloat16", "float32"]), tuple(lead) + (width,)))
    unary = ["neg", "abs", "relu", "tanh", "sigmoid", "sin", "cos", "silu", "gelu", "gelu_tanh", "square"]
    binary = ["add", "sub", "mul", "maximum", "minimum"]
    red_at = sorted(rnd.sample(range(1, n_ops + 1), min(reductions, n_ops)))
    cur = x
    for i in range(n_ops):
        if i + 1 in red_at:
            r = b.reduce(cur, kind=rnd.choice(["sum", "mean", "max", "min"]))
            r = b.tanh(b.mul(r, 1.0 / width))                  # a tame per-row value
            rowv.append(r)
            cur = b.op(rnd.choice(["mul", "sub", "add"]), cur, r)
            continue
        k = rnd.random()
        if k < 0.3:
            op = rnd.choice(unary)
            cur = b.op(op, cur)
            if op == "square":
                cur = b.tanh(cur)
        elif k < 0.6:
            other = rnd.choice(full + colv + rowv + [1.5, -0.25])
            cur = b.op(rnd.choice(binary), cur, other)
        elif k < 0.7:
            cur = b.exp(b.tanh(cur))
        elif k < 0.75:
            cur = b.div(cur, b.add(b.abs(rnd.choice(full + colv)), 1.0))
        elif k < 0.8:
            cur = b.log(b.add(b.abs(cur), 1.0))
        elif k < 0.85:
            cur = b.rsqrt(b.add(b.abs(cur), 0.5))
        elif k < 0.9 and mask is not None:
            cur = b.where(mask, cur, rnd.choice([0.0, b.neg(cur)]))
        elif k < 0.95:
            cur = b.where(b.gt(cur, rnd.choice(full + [0.1])), cur, b.mul(cur, 0.5))
        else:
            cur = b.cast(b.cast(cur, dtype=rnd.choice(["float16", "bfloat16"])), dtype="float32")
        full.append(cur)
    if shuffles and width % 2 == 0:
        h = width // 2
        if rnd.random() < 0.5:
            rot = b.cat(b.neg(b.slice(cur, start=h, stop=width)), b.slice(cur, start=0, stop=h))
        else:
            rot = b.interleave(b.neg(b.slice(cur, start=1, stop=width, step=2)),
                               b.slice(cur, start=0, stop=width, step=2))
        cur = b.add(cur, b.mul(rot, 0.5))
    b.output(cur, rnd.choice(["float16", "bfloat16", "float32"]))
    if rowv and reductions:
        b.output(rowv[-1], "float32")
    return b.build()
