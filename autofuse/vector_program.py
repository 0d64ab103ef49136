"""Vector programs on the torch side: the interpreter (the kernel's reference twin) and the aten mapping.

The program IR itself (:class:`Program`, :class:`Builder`, semantics) lives in :mod:`cost_model.program`,
pure data that the simulator kernel and the cost model read too; it is re-exported here.

* :func:`run_program_torch` computes exactly what a program specifies (fp32 arithmetic, rounding at casts
  and outputs), in torch: the fused op's reference twin and, in fp32 on leaves that require grad, its
  backward.
* :func:`program_from_nodes` turns a connected region of aten nodes (elementwise, broadcast, reductions
  along the last dim, casts, last-dim slices and concatenations, softmax / layer_norm along the last dim)
  into a program; see its docstring for the mapping.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from autofuse.canonicalize import DIVISOR
from autofuse.graph import arg, keep_mask_order, split_part
from cost_model.program import (BIT, COMPARE, FLOATS, Builder, Input, Instr, Output, Program, ProgramError, V,
                                as_program)

aten = torch.ops.aten
_TORCH_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "bool": torch.bool}

_UNARY_TORCH = {
    "neg": torch.neg, "abs": torch.abs, "relu": torch.relu, "square": torch.square, "exp": torch.exp,
    "log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu, "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "sin": torch.sin, "cos": torch.cos,
    "erf": torch.erf, "softplus": F.softplus, "log1p": torch.log1p, "expm1": torch.expm1,
    "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc, "round": torch.round, "sign": torch.sign,
}
_BINARY_TORCH = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
    "minimum": torch.minimum, "pow": torch.pow, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le,
    "gt": torch.gt, "ge": torch.ge, "logical_and": torch.logical_and, "logical_or": torch.logical_or,
}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPE[name]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


# ------------------------------------------------------------------------------------------ interpreter
def _f32(x):
    if isinstance(x, torch.Tensor):
        return x if x.dtype == torch.float32 or x.dtype == torch.bool else x.float()
    return x


def _bcast(ts):
    """Broadcast tensors on every dim but the last (for cat / interleave)."""
    lead = torch.broadcast_shapes(*[t.shape[:-1] for t in ts])
    return [t.expand(*lead, t.shape[-1]) for t in ts]


def _eval(ins: Instr, args):
    op = ins.op
    if op == "cast":
        x = args[0]
        if ins.dtype == "bool":
            return x != 0
        return x.to(_TORCH_DTYPE[ins.dtype])
    if op == "reduce":
        x = _f32(args[0])
        if ins.kind in ("sum", "mean"):
            s = x.sum(-1, keepdim=True)
            return s / x.shape[-1] if ins.kind == "mean" else s        # torch's mean: the sum divided by N
        return x.amax(-1, keepdim=True) if ins.kind == "max" else x.amin(-1, keepdim=True)
    if ins.kind == "clamp" and op in ("maximum", "minimum") and not isinstance(args[1], torch.Tensor):
        # a clamp's bound: torch.clamp's gradient (all of g at the bound itself), not maximum's (half of it)
        return torch.clamp(_f32(args[0]), **{"min" if op == "maximum" else "max": float(args[1])})
    if ins.kind in ("hardtanh", "open") and op in ("maximum", "minimum") and not isinstance(args[1], torch.Tensor):
        x, lo = _f32(args[0]), float(args[1])
        if ins.kind == "hardtanh":          # torch's hardtanh: no gradient at the bound, all of it at NaN
            return F.hardtanh(x, lo, math.inf) if op == "maximum" else F.hardtanh(x, -math.inf, lo)
        # hardsigmoid's: a gradient only strictly inside the bound (none at NaN)
        inside = x > lo if op == "maximum" else x < lo
        return torch.where(inside, x, torch.clamp(x.detach(), **{"min" if op == "maximum" else "max": lo}))
    if op == "slice":
        x = _f32(args[0])
        return x[..., ins.start:ins.stop:ins.step]
    if op == "cat":
        return torch.cat(_bcast([_f32(a) for a in args]), -1)
    if op == "interleave":
        a, b = _bcast([_f32(a) for a in args])
        return torch.stack([a, b], -1).flatten(-2)
    if op == "where":
        c, a, b = args
        a, b = _f32(a), _f32(b)
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            a = torch.tensor(a, dtype=torch.float32)
        return torch.where(c, a, b).float()
    if op == "logical_not":
        return torch.logical_not(args[0])
    if op == "sqrt" and ins.kind == "root":
        # a std's or a 2-norm's root: torch's backwards are 0 where it is 0 (sqrt's would be 0 · inf); the same values
        s = _f32(args[0])
        zero = s == 0
        return torch.where(zero, 0.0, torch.sqrt(torch.where(zero, 1.0, s)))
    if op in _UNARY_TORCH:
        return _UNARY_TORCH[op](_f32(args[0]))
    a, b = (_f32(x) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float32) for x in args)
    return _BINARY_TORCH[op](a, b)


def unpack_bits(bits: torch.Tensor, width: int) -> torch.Tensor:
    """The bool mask ``[..., width]`` of a ``bit`` input given as uint8 ``[..., ceil(width / 8)]`` (element ``c``
    is bit ``c % 8`` of byte ``c // 8``: the format :mod:`autofuse.npu.kernels.dropout` owns)."""
    from autofuse.ops import unpack_keep          # the format's torch side (the simulator holds its owner)
    if bits.dtype != torch.uint8 or bits.shape[-1] != -(-width // 8):
        raise ProgramError(f"a bit input of width {width} is uint8 [..., {-(-width // 8)}]; got "
                           f"{list(bits.shape)} {bits.dtype}")
    return unpack_keep(bits, width).to(bits.device)


def run_program_torch(program, inputs) -> list[torch.Tensor]:
    """What ``program`` computes on ``inputs`` (tensors shaped as the program declares), in torch, with the
    program's numerics: every arithmetic step in float32, rounding only at ``cast`` and at the outputs.

    Differentiable: called on float32 leaves that require grad it is the backward of the fused op (casts
    pass gradients through, as torch's own ``.to()`` does).
    """
    p = as_program(program)
    if len(inputs) != len(p.inputs):
        raise ProgramError(f"run_program_torch: {len(inputs)} tensors for a program of {len(p.inputs)} inputs")
    nl = len(p.lead)
    vals = []
    for spec, t in zip(p.inputs, inputs):
        shape = tuple(spec.shape) or (1,)
        if spec.dtype == BIT:
            t = unpack_bits(t, shape[-1])
        vals.append(t.reshape((1,) * (nl + 1 - len(shape)) + shape))
    for ins in p.instrs:
        vals.append(_eval(ins, [vals[a] if isinstance(a, int) else a for a in ins.args]))
    outs = []
    for o, shape in zip(p.outputs, p.output_shapes()):
        v = vals[o.value]
        v = (v != 0 if v.dtype != torch.bool else v) if o.dtype == "bool" else v.to(_TORCH_DTYPE[o.dtype])
        outs.append(v.expand(shape).contiguous())
    return outs


# ------------------------------------------------------------------------------------------ aten -> program
class NotExpressible(ValueError):
    """A node a Vector program cannot express (the message names the node and why)."""


@dataclass
class BuiltProgram:
    """A program built from aten nodes: the program, the fx nodes feeding its inputs (in order), the nodes
    whose values it outputs (in order), each output node's own shape (the op's output has shape
    ``(*lead, width)``; a reduction without keepdim is ``lead`` alone: reshape to it), and the shape each
    input is to be viewed as (its own, or ``(*lead, width)`` for full rows grouped in other leading dims)."""

    program: Program
    inputs: list
    outputs: list
    output_shapes: list
    input_shapes: list
    draws: dict = field(default_factory=dict)   # input number -> (dropout node, p): a keep-mask the call draws


def draws_keep_mask(n) -> bool:
    """A training-mode dropout that draws its keep-mask from torch's generator: ``native_dropout(x, p, True)``
    (any p: eager draws even at 0 and 1) whose mask nobody reads, or ``dropout(x, p, True)`` with 0 < p < 1
    (outside that range eager draws nothing). A Vector program runs it as eager's ``x · mask · 1/(1 − p)``,
    ``x · where(keep, 1/(1 − p), 0)`` over a ``bit`` input (a dropped NaN or inf is NaN), the mask its fused call
    draws with ``autofuse::dropout_gen_mask`` (the same call on the same shape and dtype as eager's, so the same
    elements are dropped)."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return False
    p, train = _dropout_args(n)
    if n.target == aten.native_dropout.default:
        return train is True and all(u.target is operator.getitem and u.args[1] == 0 for u in n.users)
    return n.target == aten.dropout.default and train is True and 0.0 < p < 1.0


def _dropout_args(n):
    args = list(n.args) + [None] * 3
    p = n.kwargs.get("p", args[1])
    train = n.kwargs.get("train", args[2])
    return (float(p) if _is_scalar(p) else -1.0), train


_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.alias.default,
          aten.clone.default, aten.contiguous.default, aten.lift_fresh_copy.default}
# not aten.detach: where it is left in the graph (a plan that autograd may differentiate, see canonicalize), it
# stops the gradient, which a program's derived backward would not; a region ends at it
_UNARY_ATEN = {aten.neg.default: "neg", aten.abs.default: "abs", aten.exp.default: "exp", aten.log.default: "log",
               aten.sqrt.default: "sqrt", aten.rsqrt.default: "rsqrt", aten.reciprocal.default: "reciprocal",
               aten.relu.default: "relu", aten.sigmoid.default: "sigmoid", aten.tanh.default: "tanh",
               aten.silu.default: "silu", aten.sin.default: "sin", aten.cos.default: "cos",
               aten.square.default: "square", aten.logical_not.default: "logical_not",
               aten.bitwise_not.default: "logical_not", aten.erf.default: "erf", aten.log1p.default: "log1p",
               aten.expm1.default: "expm1", aten.floor.default: "floor", aten.ceil.default: "ceil",
               aten.trunc.default: "trunc", aten.round.default: "round", aten.sign.default: "sign"}
# activations written with the program's instructions (see _Build.activation)
_ACTIVATION_ATEN = {aten.softplus.default, aten.mish.default, aten.log_sigmoid.default,
                    aten.log_sigmoid_forward.default, aten.leaky_relu.default,
                    aten.elu.default, aten.selu.default, aten.celu.default, aten.hardtanh.default,
                    aten.relu6.default, aten.hardsigmoid.default, aten.hardswish.default}
# ops whose result jumps at points eager's 16-bit rounding of their operand can move: they read it as eager holds it
_STEP_ATEN = {aten.floor.default, aten.ceil.default, aten.trunc.default, aten.round.default, aten.round.decimals,
              aten.sign.default, aten.frac.default, aten.nan_to_num.default}
# one-tensor ops written with the program's instructions (see _Build.formula)
_FORMULA_ATEN = {aten.frac.default, aten.round.decimals, aten.nan_to_num.default,
                 aten.log2.default, aten.log10.default, aten.exp2.default}
# three-operand combinations written with the program's instructions (see _Build.combination)
_COMBINE_ATEN = {aten.lerp.Scalar, aten.addcmul.default, aten.addcdiv.default}
_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946
_BINARY_ATEN = {aten.add.Tensor: "add", aten.add.Scalar: "add", aten.sub.Tensor: "sub", aten.sub.Scalar: "sub",
                aten.mul.Tensor: "mul", aten.mul.Scalar: "mul", aten.div.Tensor: "div", aten.div.Scalar: "div",
                aten.maximum.default: "maximum", aten.minimum.default: "minimum", aten.pow.Tensor_Scalar: "pow",
                aten.pow.Tensor_Tensor: "pow", aten.pow.Scalar: "pow", aten.logical_and.default: "logical_and",
                aten.logical_or.default: "logical_or", aten.bitwise_and.Tensor: "logical_and",
                aten.bitwise_or.Tensor: "logical_or", aten.__and__.Tensor: "logical_and",
                aten.__or__.Tensor: "logical_or"}
for _c in COMPARE:
    _BINARY_ATEN[getattr(aten, _c).Tensor] = _c
    _BINARY_ATEN[getattr(aten, _c).Scalar] = _c
_REDUCE_ATEN = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "max",
                aten.amin.default: "min"}
_SOFTMAX = {aten._softmax.default, aten.softmax.int, aten._safe_softmax.default}
_VAR_ATEN = {aten.var.dim, aten.var.correction, aten.std.dim, aten.std.correction}
_NORM_ATEN = {aten.linalg_vector_norm.default}          # the 2-norm over the last dim (x.norm, F.normalize's)
_PRELU_ATEN = {aten.prelu.default, aten._prelu_kernel.default}      # a learned slope: see _Build.prelu


def _meta(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _dtype_probe(a):
    """What ``torch.result_type`` needs of an argument: a number as itself, a tensor node as a tensor of its dtype
    and its 0-d-ness."""
    m = _meta(a)
    if isinstance(m, torch.Tensor):
        return torch.empty(() if m.dim() == 0 else (1,), dtype=m.dtype)
    return a


def _rounded(x: float, dtype) -> float:
    """The number ``x`` as ``dtype`` holds it."""
    return float(torch.tensor(float(x), dtype=torch.float64).to(dtype))


def _keepdim(n) -> bool:
    """A reduction's keepdim (``var.dim``/``std.dim`` take ``unbiased`` before it, ``linalg_vector_norm`` ``ord``; the
    ``correction`` forms take it by keyword only)."""
    if n.target in (aten.var.correction, aten.std.correction):
        return bool(n.kwargs.get("keepdim", False))
    return bool(arg(n, 3 if n.target in (aten.var.dim, aten.std.dim) or n.target in _NORM_ATEN else 2, "keepdim",
                    False))


def rms_norm_args(n):
    """``(x, normalized_shape, weight, eps)`` of an ``aten.rms_norm`` node, eps as torch takes it: no eps is fp32's
    machine epsilon (the decomposition's ``numeric_limits<opmath_t>::epsilon``)."""
    eps = arg(n, 3, "eps")
    return n.args[0], arg(n, 1, "normalized_shape"), arg(n, 2, "weight"), \
        torch.finfo(torch.float32).eps if eps is None else float(eps)


def _is_scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _Build:
    def __init__(self, nodes, outputs, rounding, first=None):
        self.first = first
        if rounding not in ("fp32", "eager"):
            raise ValueError(f"rounding must be 'fp32' or 'eager', got {rounding!r}")
        self.rounding = rounding
        order = {n: i for i, n in enumerate(next(iter(nodes)).graph.nodes)} if nodes else {}
        self.nodes = sorted(set(nodes), key=order.get)
        self.region = set(self.nodes)
        if outputs is None:
            outputs = [n for n in self.nodes if any(u not in self.region for u in n.users)]
        self.out_nodes = list(outputs)
        if not self.out_nodes:
            raise NotExpressible("the region has no output (no node is used outside it)")
        first = self.out_nodes[0]
        m = _meta(first)
        if not isinstance(m, torch.Tensor):
            raise NotExpressible(f"{first.name} ({first.target}) leaves the region as a list of pieces, not one "
                                 f"value of the region's rows")
        # the rows: the first output's leading dims (all its dims for a reduction without keepdim)
        keep = first.target not in set(_REDUCE_ATEN) | _VAR_ATEN | _NORM_ATEN or _keepdim(first)
        self.lead = tuple(m.shape[:-1]) if keep and m.dim() else tuple(m.shape)

    def fail(self, n, why):
        m = _meta(n)
        shape = list(m.shape) if isinstance(m, torch.Tensor) else "?"
        raise NotExpressible(f"node {n.name} ({n.target}, shape {shape}): {why}")

    # the input side: a region node all of whose tensor inputs are outside, and that is a view, is an input
    def run(self) -> BuiltProgram:
        self.inputs: list = []
        self.val: dict = {}                 # node -> V
        self.squeezed: set = set()          # reductions without keepdim
        self.stacked: dict = {}             # stack(a, b, -1) nodes -> [a, b], until flattened
        self.empty: set = set()             # slices of width 0 (Phi-3's pass-through part at full rotary)
        self.rounded: dict = {}             # (value, dtype) -> its cast: a 16-bit value an op widens (widened)
        ext = []
        for n in self.nodes:
            for a in n.all_input_nodes:
                if a not in self.region and isinstance(_meta(a), torch.Tensor) and a not in ext:
                    ext.append(a)
        # views of external tensors stay outside the op: their results are the op's inputs
        self.as_input = [n for n in self.nodes if n.target in _VIEWS and all(a not in self.region
                                                                             for a in n.all_input_nodes)
                         and not (self.first is not None and n.args[0] is self.first)]   # an epilogue reads
        # the matmul's product itself, through the view that regroups its rows
        ext = [a for a in ext if any(u in self.region and u not in self.as_input for u in a.users)]
        if self.first is not None:
            if self.first not in ext:
                raise NotExpressible(f"{self.first.name} is not an input of the region")
            ext.remove(self.first)
            ext.insert(0, self.first)
        b = self.b = Builder(self.lead)
        self.input_shapes = []
        self.draws = {}
        for a in ext + self.as_input:
            self.val[a] = self.declare(a, _meta(a), dtype_name(_meta(a).dtype))
            self.inputs.append(a)
        self.keep = {}                      # dropout node -> its keep-mask's bit input
        for n in self.nodes:
            if n.target in (aten.native_dropout.default, aten.dropout.default):
                if not draws_keep_mask(n):
                    self.fail(n, "a dropout that draws no keep-mask, or whose mask is read")
                if _meta(n.args[0]).dim() == 0 or _meta(n.args[0]).shape[-1] < 2:
                    self.fail(n, "a dropout of per-row values (its keep bits would be one per row)")
                self.draws[len(self.inputs)] = (n, _dropout_args(n)[0])
                self.keep[n] = self.declare(n, _meta(n.args[0]), BIT)
                if keep_mask_order(n) is not None and \
                        self.input_shapes[-1] != tuple(_meta(n.args[0]).shape):
                    # the bits are drawn in the input's memory order over its own dims, which the rows regroup
                    self.fail(n, "a dropout of a tensor not laid out row-major, whose rows the program regroups")
                self.inputs.append(None)
        for n in self.nodes:
            if n in self.val:
                continue
            self.val[n] = self.node(n)
        shapes = []
        for n in self.out_nodes:
            m = _meta(n)
            if n in self.empty:
                self.fail(n, "an empty (width 0) output")
            v = self.val[n]
            if v is None:                       # a stack not flattened into pairs, a split's list
                self.fail(n, "leaves the region as a value the program does not hold (a stack not flattened, "
                             "a split's pieces)")
            b.output(v, dtype_name(m.dtype))
            shapes.append(tuple(m.shape))
        try:
            prog = b.build()
        except ProgramError as e:
            raise NotExpressible(f"region ending in {self.out_nodes[0].name}: {e}") from None
        for n, shape, ps in zip(self.out_nodes, shapes, prog.output_shapes()):
            if math.prod(shape) != math.prod(ps) or (n not in self.squeezed and tuple(shape[-1:]) != ps[-1:]):
                self.fail(n, f"its shape is not the program's {list(ps)} (lead {list(self.lead)})")
        return BuiltProgram(prog, self.inputs, self.out_nodes, shapes, self.input_shapes, self.draws)

    def declare(self, a, m, dtype):
        """A program input for node ``a`` of value ``m`` (full rows grouped otherwise than the lead dims are
        viewed with them)."""
        shape = tuple(m.shape)
        if m.dim() and math.prod(shape[:-1]) == math.prod(self.lead) and len(shape) - 1 != len(self.lead) and \
                shape[:-1] != self.lead[len(self.lead) - len(shape) + 1:]:
            shape = self.lead + shape[-1:]
        try:
            v = self.b.input(dtype, shape)
        except ProgramError as e:
            self.fail(a, str(e))
        self.input_shapes.append(shape)
        return v

    def arg(self, n, x):
        """A node argument as a value handle or immediate (a 16-bit value the op widens, as eager stores it:
        :meth:`widened`)."""
        if isinstance(x, fx.Node):
            if x not in self.val:
                self.fail(n, f"input {x.name} is not available (not a tensor?)")
            if x in self.squeezed:
                self.fail(n, f"{x.name} is a reduction without keepdim; unsqueeze it first")
            if x in self.empty:
                self.fail(n, f"{x.name} is empty (width 0): only a concatenation may read it")
            if self.val[x] is None:             # a stack read other than by flattening it into pairs, a split
                self.fail(n, f"reads {x.name}, which the program does not hold as one value (a stack not "
                             f"flattened into pairs, a split's list)")
            return self.widened(n, x, self.val[x])
        if _is_scalar(x):
            return float(x)
        self.fail(n, f"argument {x!r} is neither a tensor nor a number")

    def widened(self, n, x, v):
        """Value ``v`` of region node ``x`` as op ``n`` reads it. The program keeps a float16/bfloat16 intermediate
        in fp32 (more accurate than eager, where eager's own ops keep their operands' dtype or a cast in the graph
        widens it: RMSNorm's ``x.float()``); but an op that widens it by type promotion (``add(bf16, fp32)`` ->
        fp32, a compare or a select in fp32) reads what eager stored, rounded to 16 bits, and computes on from there:
        a sum of rounded scores ties where eager's ties, as a top-k or a compare after it sees. One cast, once per
        value and dtype; none for a value that holds 16-bit values already (:meth:`exact`)."""
        mx = _meta(x)
        if not isinstance(v, V) or not isinstance(mx, torch.Tensor) or mx.dtype not in (torch.float16, torch.bfloat16) \
                or n.target in (aten._to_copy.default, aten.to.dtype) or x in self.inputs:
            return v
        wide = _meta(n)
        wide = wide[0] if isinstance(wide, (tuple, list)) and wide else wide
        if not isinstance(wide, torch.Tensor):
            return v
        wide = wide.dtype
        if wide == torch.bool and n.target in _BINARY_ATEN and _BINARY_ATEN[n.target] in COMPARE:
            wide = torch.result_type(*[_dtype_probe(a) for a in n.args[:2]])     # a compare: the operands' dtype
        if not wide.is_floating_point or wide == mx.dtype:
            return v
        name = dtype_name(mx.dtype)
        if self.exact(v.i, name):
            return v                                    # holds values of that dtype already
        key = (v.i, name)
        if key not in self.rounded:
            self.rounded[key] = self.b.cast(v, dtype=name)
        return self.rounded[key]

    def exact(self, k: int, name: str) -> bool:
        """Whether program value ``k`` holds only values of dtype ``name``: an input of it, a cast to it, or a move,
        sign change or selection of such values (RoPE's ``cat(−x₂, x₁)`` of a 16-bit input), whose rounding changes
        nothing."""
        b = self.b
        i = k - len(b.inputs)
        if i < 0:
            return b.inputs[k].dtype == name
        ins = b.instrs[i]
        if ins.op == "cast":
            return ins.dtype == name
        if ins.op not in ("neg", "abs", "relu", "slice", "cat", "interleave", "maximum", "minimum"):
            return False
        dt = _TORCH_DTYPE[name]
        return all(self.exact(a, name) if isinstance(a, int) else _rounded(a, dt) == a for a in ins.args)

    def round(self, n, v):
        """In eager rounding, the op's result rounded to the node's dtype, as eager stores it."""
        m = _meta(n)
        m = m[0] if isinstance(m, (tuple, list)) else m          # native_dropout: (output, mask)
        if self.rounding == "eager" and m.dtype in (torch.float16, torch.bfloat16):
            return self.b.cast(v, dtype=dtype_name(m.dtype))
        return v

    def compared(self, n, x, y):
        """A comparison's operands as eager compares them: in the operands' common dtype (a Python number or a 0-d
        tensor does not widen a float16/bfloat16 tensor's), so a number is rounded to it (``x16 >= 0.1`` compares
        with float16's 0.0999755859375) and so is an operand computed in fp32 here that eager stored rounded."""
        common = torch.result_type(*[_dtype_probe(a) for a in n.args[:2]])
        if common not in (torch.float16, torch.bfloat16):
            return x, y

        return tuple(self.held(a, v, common) for a, v in zip(n.args[:2], (x, y)))

    def held(self, a, v, dtype=None):
        """Value ``v`` of argument ``a`` as eager holds it in ``dtype`` (default: ``a``'s own): a float16/bfloat16
        value computed in fp32 here is rounded to it, a number too; a program input of that dtype is exact already.
        For the ops whose result jumps where eager's rounding moves it (compares, the roundings, sign)."""
        dtype = dtype or (_meta(a).dtype if isinstance(a, fx.Node) else torch.float32)
        if dtype not in (torch.float16, torch.bfloat16):
            return v
        if not isinstance(v, V):
            return _rounded(v, dtype)
        if a in self.inputs and _meta(a).dtype == dtype:
            return v
        return self.b.cast(v, dtype=dtype_name(dtype))

    def stored(self, n, v):
        """A number that fills a float16/bfloat16 result, as eager stores it there (rounded: ``1e5`` is inf)."""
        m = _meta(n)
        return _rounded(v, m.dtype) if not isinstance(v, V) and m.dtype in (torch.float16, torch.bfloat16) else v

    def last_dim(self, n, dim):
        m = _meta(n.args[0])
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) != 1):
            self.fail(n, "reduces over more than the last dim")
        d = dim[0] if isinstance(dim, (list, tuple)) else dim
        if d % m.dim() != m.dim() - 1:
            self.fail(n, f"works along dim {d}, not the last dim")

    def node(self, n):
        b, t = self.b, n.target
        if n.op != "call_function":
            self.fail(n, "not a call_function node")
        m = _meta(n)
        if t in _VIEWS:
            return self.view(n)
        if t in _UNARY_ATEN:
            x = self.arg(n, n.args[0])
            return self.round(n, b.op(_UNARY_ATEN[t], self.held(n.args[0], x) if t in _STEP_ATEN else x))
        if t in _ACTIVATION_ATEN:
            return self.round(n, self.activation(n, self.arg(n, n.args[0])))
        if t in _COMBINE_ATEN:
            return self.round(n, self.combination(n))
        if t in _FORMULA_ATEN:
            x = self.arg(n, n.args[0])
            return self.round(n, self.formula(n, self.held(n.args[0], x) if t in _STEP_ATEN else x))
        if t == aten.gelu.default:
            approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
            return self.round(n, b.op("gelu_tanh" if approx == "tanh" else "gelu", self.arg(n, n.args[0])))
        if t in _BINARY_ATEN:
            x, y = self.arg(n, n.args[0]), self.arg(n, n.args[1])
            if _BINARY_ATEN[t] in COMPARE:
                x, y = self.compared(n, x, y)
            alpha = n.kwargs.get("alpha", 1)
            if alpha != 1:
                y = b.mul(y, float(alpha)) if isinstance(y, V) else y * alpha
            if not isinstance(x, V) and not isinstance(y, V):
                self.fail(n, "no tensor operand")
            c = n.meta.get(DIVISOR)
            if c is not None and isinstance(x, V) and not isinstance(y, V) and y == 1.0 / c:
                return self.round(n, b.div(x, float(c)))      # eager's x / c, rounded once (not x · (1/c))
            return self.round(n, b.op(_BINARY_ATEN[t], x, y))
        if t == aten.rsub.Scalar:
            return self.round(n, b.sub(self.arg(n, n.args[1]), self.arg(n, n.args[0])))
        if t in (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default):
            v = self.arg(n, n.args[0])
            lo = n.args[1] if t != aten.clamp_max.default else None
            hi = n.args[2] if t == aten.clamp.default and len(n.args) > 2 else \
                (n.args[1] if t == aten.clamp_max.default else None)
            # kind "clamp": the same op, whose derived gradient is clamp's (all of it where lo <= x <= hi, bounds
            # included; none at NaN), not maximum's (half of it on a tie)
            if lo is not None:
                v = b.maximum(v, self.arg(n, lo), kind="clamp")
            if hi is not None:
                v = b.minimum(v, self.arg(n, hi), kind="clamp")
            return self.round(n, v)
        if t in (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf):
            c, x, y = [self.arg(n, a) for a in n.args[:3]]
            return self.round(n, b.where(c, self.stored(n, x), self.stored(n, y)))
        if t == aten.masked_fill.Scalar:
            fill = self.stored(n, self.arg(n, n.args[2]))
            return self.round(n, b.where(self.arg(n, n.args[1]), fill, self.arg(n, n.args[0])))
        if t in (aten._to_copy.default, aten.to.dtype):
            dt = n.kwargs.get("dtype", n.args[1] if t == aten.to.dtype else None)
            if dt is None or dt not in _TORCH_DTYPE.values():
                self.fail(n, f"a copy to {dt}: only casts between float16/bfloat16/float32/bool")
            return b.cast(self.arg(n, n.args[0]), dtype=dtype_name(dt))
        if t in _REDUCE_ATEN:
            dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
            self.last_dim(n, dim)
            keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
            if n.kwargs.get("dtype") is not None:
                self.fail(n, "a reduction with a dtype argument")
            v = self.round(n, b.reduce(self.arg(n, n.args[0]), kind=_REDUCE_ATEN[t]))
            if not keep:
                self.squeezed.add(n)
            return v
        if t in _VAR_ATEN:
            return self.variance(n)
        if t in _NORM_ATEN:
            return self.vector_norm(n)
        if t in _PRELU_ATEN:
            return self.round(n, self.prelu(n))
        if t in _SOFTMAX:
            self.last_dim(n, n.args[1])
            x = self.arg(n, n.args[0])
            e = b.exp(b.sub(x, b.reduce(x, kind="max")))
            return self.round(n, b.div(e, b.reduce(e, kind="sum")))
        if t in (aten.layer_norm.default, aten.native_layer_norm.default):
            return self.layer_norm(n)
        if t == aten.rms_norm.default:
            return self.rms_norm(n)
        if t in (aten.native_dropout.default, aten.dropout.default):
            p = _dropout_args(n)[0]
            scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
            # eager's x · mask · scale: a dropped NaN or inf stays NaN, a dropped -0.0 or negative value is -0.0
            return self.round(n, b.mul(self.arg(n, n.args[0]), b.where(self.keep[n], scale, 0.0)))
        if t == aten.slice.Tensor:
            dim = n.args[1] if len(n.args) > 1 else 0
            src = _meta(n.args[0])
            if dim % src.dim() != src.dim() - 1:
                self.fail(n, "slices a dim other than the last")
            if _meta(n).shape[-1] == 0:
                self.empty.add(n)               # nothing to compute; a cat of it is its other parts
                return None
            w = src.shape[-1]
            start = n.args[2] if len(n.args) > 2 else 0
            stop = n.args[3] if len(n.args) > 3 else w
            step = n.args[4] if len(n.args) > 4 else 1
            start, stop, _ = slice(start, stop, step).indices(w)
            return b.slice(self.arg(n, n.args[0]), start=start, stop=stop, step=step)
        if t == operator.getitem:
            return self.getitem(n)
        if t in (aten.split.Tensor, aten.split_with_sizes.default):
            return None                         # its getitems become slices
        if t == aten.stack.default:            # stack(a, b, dim=-1) then flatten(-2): an interleave
            dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
            if len(n.args[0]) != 2 or dim % m.dim() != m.dim() - 1:
                self.fail(n, "a stack other than of two values along a new last dim (then flattened)")
            self.stacked[n] = [self.arg(n, a) for a in n.args[0]]
            return None
        if t == aten.cat.default:
            dim = n.args[1] if len(n.args) > 1 else 0
            if dim % m.dim() != m.dim() - 1:
                self.fail(n, "concatenates along a dim other than the last")
            parts = [self.arg(n, a) for a in n.args[0] if a not in self.empty]
            return parts[0] if len(parts) == 1 else b.cat(*parts)
        self.fail(n, "no Vector-program instruction for this op")

    def view(self, n):
        """A view is the same value when it keeps the last dim and the rows (or only adds/drops size-1 dims
        of a broadcast value): the program's values are already broadcast over (*lead, width)."""
        src = n.args[0]
        si, so = _meta(src), _meta(n)
        if src in self.stacked:                # [..., w, 2] -> [..., 2w]: pairs
            if tuple(so.shape) != tuple(si.shape[:-2]) + (2 * si.shape[-2],):
                self.fail(n, "a view of a stack other than flattening its last two dims")
            return self.b.interleave(*self.stacked[src])
        v = self.arg(n, src) if src not in self.squeezed else self.val[src]
        if n.target in (aten.clone.default, aten.contiguous.default, aten.alias.default, aten.lift_fresh_copy.default):
            if src in self.squeezed:
                self.squeezed.add(n)
            return v
        if src in self.squeezed:                # (*lead) -> (*lead, 1): a keepdim reduction again
            if tuple(so.shape) == tuple(si.shape) + (1,):
                return v
            self.fail(n, "reshapes a reduction without keepdim other than by unsqueeze(-1)")
        strip = lambda s: tuple(s)[next((i for i, d in enumerate(s) if d != 1), len(s)):]   # noqa: E731
        if n.target == aten.expand.default and so.dim() and si.dim() and si.shape[-1] == 1 and \
                all(a in (b_, 1) for a, b_ in zip((1,) * (so.dim() - si.dim()) + tuple(si.shape), so.shape)):
            return v                            # a per-row value (F.normalize's norm) over the row: a broadcast
        if so.dim() and si.dim() and so.shape[-1] == si.shape[-1]:
            if strip(so.shape[:-1]) == strip(si.shape[:-1]):
                return v                        # leading size-1 dims added or dropped
            if n.target == aten.expand.default and all(a in (b_, 1) for a, b_ in
                                                       zip((1,) * (so.dim() - si.dim()) + tuple(si.shape), so.shape)):
                return v                        # a broadcast, which the program does anyway
            if math.prod(si.shape[:-1]) == math.prod(self.lead) == math.prod(so.shape[:-1]):
                return v                        # full rows regrouped (into the program's lead dims, or out)
        self.fail(n, f"a view {list(si.shape)} -> {list(so.shape)} that changes the rows or the last dim")

    def getitem(self, n):
        src, i = n.args
        if src.target == aten.native_layer_norm.default:       # (y, mean, rstd); the mean made when read
            v = self.val[src][i]
            return self.b.add(*v) if i == 1 else v
        if src not in self.region:          # its op left out of the region (a region split at a dropout refused)
            self.fail(n, f"a part of {src.name}, which is not in the region")
        if src.target in (aten.native_dropout.default, aten.log_sigmoid_forward.default) and i == 0:
            return self.val[src]                                  # (output, mask), (output, buffer)
        if src.target == aten.log_sigmoid_forward.default:
            return None                                           # the buffer: no value of the program
        if src.target not in (aten.split.Tensor, aten.split_with_sizes.default):
            self.fail(n, "getitem of something other than a split")
        x, dim, start, stop = split_part(n)
        if dim != _meta(x).dim() - 1:
            self.fail(n, "a split along a dim other than the last")
        return self.b.slice(self.arg(n, x), start=start, stop=stop)

    def layer_norm(self, n):
        """``layer_norm`` over the last dim: ``(x − mean) · rsqrt(mean((x − mean)²) + eps) [· w] [+ b]``, its deviations
        centred again (:meth:`centred`): a row of equal values normalises to exactly 0, as eager's (whose Welford mean
        of such a row is exact), not to its mean's rounding error times ``1/sqrt(eps)``."""
        b = self.b
        x = self.arg(n, n.args[0])
        shape = n.args[1]
        if len(shape) != 1:
            self.fail(n, "normalises over more than the last dim")
        w = n.args[2] if len(n.args) > 2 else None
        bias = n.args[3] if len(n.args) > 3 else None
        eps = n.args[4] if len(n.args) > 4 else 1e-5
        m0, c, d = self.centred(x)
        mean = (m0, c)                      # native_layer_norm's mean, m0 + c: added where it is read
        rstd = b.rsqrt(b.add(b.reduce(b.mul(d, d), kind="mean"), float(eps)))
        y = b.mul(d, rstd)
        if w is not None:
            y = b.mul(y, self.arg(n, w))
        if bias is not None:
            y = b.add(y, self.arg(n, bias))
        y = self.round(n, y) if n.target == aten.layer_norm.default else y
        return y if n.target == aten.layer_norm.default else (y, mean, rstd)

    def centred(self, x):
        """``(m₀, c, d)``: the deviations of ``x`` from its row mean, ``d = d₀ − c`` with ``d₀ = x − m₀`` (``m₀`` the fp32
        mean) and ``c = mean(d₀)`` (the mean is ``m₀ + c``): the mean's rounding error taken out, so that a row of equal
        values has deviations of exactly 0 (``d₀`` is the same rounding error in every column, and so is ``c``)."""
        b = self.b
        m0 = b.reduce(x, kind="mean")
        d0 = b.sub(x, m0)
        c = b.reduce(d0, kind="mean")
        return m0, c, b.sub(d0, c)

    def variance(self, n):
        """``var``/``std`` over the last dim as torch computes them: ``sum((x − mean)²) / (N − correction)`` (and
        its square root), in fp32; ``unbiased`` is correction 1. The deviations from the fp32 mean are centred
        again by their own mean, ``d = d₀ − Σd₀/N``, which takes out the mean's rounding error: a row of large
        mean and small spread (1e4 + 1e-2·randn) keeps eager's precision (5e-8 relative) instead of losing it to
        that error squared (8e-3). The variance is then ``Σd²``, never negative, and exactly 0 on a row of equal
        values (every ``d₀`` is the same rounding error of the mean, and so is their mean), as eager's is:
        ``Σd₀² − (Σd₀)²/N`` cancels there to a tiny number of either sign, whose square root is NaN."""
        b, t = self.b, n.target
        self.last_dim(n, arg(n, 1, "dim"))
        if t in (aten.var.dim, aten.std.dim):
            c = 1.0 if arg(n, 2, "unbiased", True) else 0.0
        else:
            c = n.kwargs.get("correction")
            c = 1.0 if c is None else float(c)
        width = _meta(n.args[0]).shape[-1]
        if width - c <= 0:
            self.fail(n, f"a correction of {c:g} over {width} values (eager divides by {width - c:g})")
        x = self.arg(n, n.args[0])
        d = self.centred(x)[2]
        v = b.div(b.reduce(b.mul(d, d), kind="sum"), float(width - c))
        # std's square root differentiates as torch's std_backward does (0 at a constant row, not 0/0)
        v = self.round(n, v if t in (aten.var.dim, aten.var.correction) else b.sqrt(v, kind="root"))
        if not _keepdim(n):
            self.squeezed.add(n)
        return v

    def vector_norm(self, n):
        """``linalg_vector_norm(x, 2, [-1])`` (``x.norm(dim=-1)``, ``F.normalize``'s denominator) as torch computes it:
        ``sqrt(Σ x²)`` in fp32. Its square root is of kind ``norm``: the gradient of a zero row is 0 as torch's norm
        backward masks it (``x · g / ‖x‖`` where ‖x‖ > 0), not sqrt's 0 · inf = NaN, so F.normalize of a zero row
        trains as eager (g / eps)."""
        b = self.b
        ord_ = arg(n, 1, "ord", 2)
        if not _is_scalar(ord_) or float(ord_) != 2.0:
            self.fail(n, f"a norm of order {ord_} (only the 2-norm)")
        self.last_dim(n, arg(n, 2, "dim"))
        if n.kwargs.get("dtype") is not None:
            self.fail(n, "a norm with a dtype argument")
        x = self.arg(n, n.args[0])
        v = self.round(n, b.sqrt(b.reduce(b.mul(x, x), kind="sum"), kind="root"))
        if not _keepdim(n):
            self.squeezed.add(n)
        return v

    def prelu(self, n):
        """``prelu(x, w)`` as torch's kernel computes it, ``x > 0 ? x : w · x`` (NaN and 0 take ``w · x``; its
        gradients torch's: ``g`` or ``w · g`` for x, ``x · g`` for w where x <= 0, summed over the rows by the caller).
        torch applies a weight of C elements along dim 1: a program's own broadcast when that is the last dim (a
        2-D input); ``_prelu_kernel`` takes the weight already shaped for it."""
        b = self.b
        x, w = n.args[0], n.args[1]
        mx, mw = _meta(x), _meta(w)
        if n.target == aten.prelu.default and mw.numel() != 1 and mx.dim() > 2:
            self.fail(n, f"a PReLU weight of {mw.numel()} elements along dim 1 of a {mx.dim()}-D input (not the "
                         f"last dim)")
        xv = self.arg(n, x)
        return b.where(b.gt(xv, 0.0), xv, b.mul(self.arg(n, w), xv))

    def combination(self, n):
        """``lerp(a, e, w)`` with a number w as torch computes it (``a + w·(e − a)`` below 0.5, ``e − (e − a)·(1 − w)``
        from it), ``addcmul`` ``x + value·(t1·t2)`` and ``addcdiv`` ``x + value·(t1 / t2)``, in fp32."""
        b, t = self.b, n.target
        if t == aten.lerp.Scalar:
            a, e = self.arg(n, n.args[0]), self.arg(n, n.args[1])
            w = float(arg(n, 2, "weight"))
            d = b.sub(e, a)
            return b.add(a, b.mul(d, w)) if abs(w) < 0.5 else b.sub(e, b.mul(d, 1.0 - w))
        x, t1, t2 = (self.arg(n, v) for v in n.args[:3])
        value = float(arg(n, 3, "value", 1))
        term = b.mul(t1, t2) if t == aten.addcmul.default else b.div(t1, t2)
        return b.add(x, term if value == 1.0 else b.mul(term, value))

    def formula(self, n, x):
        """A one-tensor op as torch computes it, in the program's instructions: ``frac`` ``x − trunc(x)`` (NaN at
        ±inf); ``round(decimals=k)`` ``round(x · 10^k) / 10^k`` (``round(x / 10^−k) · 10^−k`` for k < 0);
        ``nan_to_num`` the three replacements by compare and select, the defaults the largest and smallest finite
        values of the tensor's dtype, each number as that dtype holds it (``1e5`` in float16 is inf, as eager stores
        it); ``log2``/``log10`` ``log(x) / ln 2`` (``ln 10``: within an fp32 ulp of torch's, powers of two exact);
        ``exp2`` ``pow(2, x)``. Their gradients are torch's: 1 through frac, ``isfinite(x)`` through nan_to_num's
        selects."""
        b, t = self.b, n.target
        if t == aten.frac.default:
            return b.sub(x, b.trunc(x))
        if t == aten.round.decimals:
            k = int(arg(n, 1, "decimals", 0))
            ten = float(torch.tensor(10.0 ** abs(k), dtype=torch.float32))     # torch's opmath 10^|k|
            if k == 0:
                return b.round(x)
            return b.div(b.round(b.mul(x, ten)), ten) if k > 0 else b.mul(b.round(b.div(x, ten)), ten)
        if t == aten.nan_to_num.default:
            dt = _meta(n).dtype
            fi = torch.finfo(dt)
            nan, posinf, neginf = (arg(n, i, name) for i, name in ((1, "nan"), (2, "posinf"), (3, "neginf")))
            nan = self.stored(n, 0.0 if nan is None else float(nan))
            posinf = self.stored(n, fi.max if posinf is None else float(posinf))
            neginf = self.stored(n, fi.min if neginf is None else float(neginf))
            y = b.where(b.eq(x, -math.inf), neginf, x)
            y = b.where(b.eq(x, math.inf), posinf, y)
            return b.where(b.ne(x, x), nan, y)
        if t in (aten.log2.default, aten.log10.default):
            return b.div(b.log(x), math.log(2.0) if t == aten.log2.default else math.log(10.0))
        return b.pow(2.0, x)                                             # exp2

    def activation(self, n, x):
        """An activation as torch computes it on CPU, in the program's instructions (the gradients they derive are
        torch's, at the kinks too): ``softplus`` ``(x·β > threshold) ? x : softplus(x·β) / β``; ``mish``
        ``x · tanh(softplus(x))``; ``log_sigmoid`` ``−softplus(−x)``; ``leaky_relu`` ``x > 0 ? x : x · slope``;
        ``elu`` (``selu``, ``celu``) ``x <= 0 ? expm1(min(x · input_scale, 0)) · alpha · scale : x · scale``; ``hardtanh``
        (``relu6``) the clamp; ``hardsigmoid`` ``min(max(x + 3, 0), 6) / 6`` and ``hardswish`` ``x`` times its
        numerator, then ``/ 6``."""
        b, t = self.b, n.target
        a = list(n.args[1:])

        def param(i, name, default):
            return float(a[i] if len(a) > i else n.kwargs.get(name, default))
        if t == aten.softplus.default:
            beta, threshold = param(0, "beta", 1.0), param(1, "threshold", 20.0)
            z = x if beta == 1.0 else b.mul(x, beta)
            sp = b.softplus(z) if beta == 1.0 else b.div(b.softplus(z), beta)
            # beyond 17, softplus(z) is z in fp32: torch's default threshold (20) changes nothing
            return sp if beta == 1.0 and threshold == 20.0 else b.where(b.gt(z, threshold), x, sp)
        if t == aten.mish.default:
            return b.mul(x, b.tanh(b.softplus(x)))
        if t in (aten.log_sigmoid.default, aten.log_sigmoid_forward.default):    # the latter: (output, buffer)
            return b.neg(b.softplus(b.neg(x)))
        if t == aten.leaky_relu.default:
            return b.where(b.gt(x, 0.0), x, b.mul(x, param(0, "negative_slope", 0.01)))
        if t in (aten.elu.default, aten.selu.default, aten.celu.default):
            if t == aten.selu.default:
                alpha, scale, input_scale = _SELU_ALPHA, _SELU_SCALE, 1.0
            elif t == aten.celu.default:
                alpha = param(0, "alpha", 1.0)
                alpha, scale, input_scale = alpha, 1.0, 1.0 / alpha
            else:
                alpha, scale, input_scale = param(0, "alpha", 1.0), param(1, "scale", 1.0), param(2, "input_scale", 1.0)
            negcoef = float(torch.tensor(alpha, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32))
            # expm1 of min(z, 0): the branch not taken overflows to inf nowhere, so its zero gradient stays zero
            z = b.minimum(x if input_scale == 1.0 else b.mul(x, input_scale), 0.0, kind="clamp")
            neg = b.mul(b.expm1(z), negcoef) if negcoef != 1.0 else b.expm1(z)
            return b.where(b.le(x, 0.0), neg, x if scale == 1.0 else b.mul(x, scale))
        if t in (aten.hardtanh.default, aten.relu6.default):
            lo, hi = (param(0, "min_val", -1.0), param(1, "max_val", 1.0)) if t == aten.hardtanh.default else (0.0, 6.0)
            return b.minimum(b.maximum(x, lo, kind="hardtanh"), hi, kind="hardtanh")
        six = b.minimum(b.maximum(b.add(x, 3.0), 0.0, kind="open"), 6.0, kind="open")
        return b.div(six if t == aten.hardsigmoid.default else b.mul(x, six), 6.0)

    def rms_norm(self, n):
        """torch's ``rms_norm`` (``nn.RMSNorm``, ``F.rms_norm``) as its decomposition computes it: in fp32 (a 16-bit x
        widened), ``x · rsqrt(mean(x²) + eps) · weight``, rounded once to x's dtype; no eps is fp32's epsilon."""
        b = self.b
        x, shape, w, eps = rms_norm_args(n)
        if len(shape) != 1:
            self.fail(n, "normalises over more than the last dim")
        x = self.arg(n, x)
        y = b.mul(x, b.rsqrt(b.add(b.reduce(b.mul(x, x), kind="mean"), eps)))
        if w is not None:
            y = b.mul(y, self.arg(n, w))
        return self.round(n, y)


def program_from_nodes(nodes, outputs=None, rounding: str = "fp32", first=None) -> BuiltProgram:
    """A :class:`~cost_model.program.Program` computing a connected region of aten nodes.

    ``nodes``: the region (fx nodes of one graph, in any order); ``outputs``: the nodes whose values leave it
    (default: those with a user outside the region). The iteration space is the first output's shape:
    ``lead`` = its leading dims, and every value must broadcast to ``(*lead, width)``.

    The mapping: unary ops (neg abs exp log sqrt rsqrt reciprocal relu sigmoid tanh silu sin cos square erf
    log1p expm1 floor ceil trunc round sign, gelu with either approximation) -> the op; frac round(decimals)
    nan_to_num log2 log10 exp2 -> their formulas (:meth:`_Build.formula`); softplus mish log_sigmoid leaky_relu elu
    selu celu hardtanh relu6 hardsigmoid hardswish -> their formulas (:meth:`_Build.activation`); add/sub (with
    alpha) mul div maximum minimum pow (tensor or scalar, a number to a tensor; ``rsub``) and clamp -> binary ops
    with immediates; comparisons -> compare; where / masked_fill
    -> where; logical/bitwise and/or/not on bools -> logic; ``_to_copy``/``to`` -> cast; sum/mean/amax/amin
    over the last dim -> reduce; the 2-norm over the last dim -> the root of the squares' sum
    (:meth:`_Build.vector_norm`); var/std over the last dim (any correction below the width) -> mean, the squared
    deviations' sum, a division; softmax, layer_norm and rms_norm over the last dim -> their reduce-then-use chains;
    slice / split+getitem / cat along the last dim -> slice / cat; views that keep the rows and the last dim
    -> nothing (a view of a region input stays outside: its result is the op's input); prelu ->
    ``x > 0 ? x : w · x`` (:meth:`_Build.prelu`). Anything else
    raises :class:`NotExpressible` naming the node.

    ``rounding``: ``"fp32"`` (the program's default numerics: intermediates stay fp32, which is more
    accurate than eager fp16/bf16; but a 16-bit intermediate that an op widens by type promotion is read rounded,
    as eager stored it: :meth:`_Build.widened`) or ``"eager"`` (a cast after every fp16/bf16 op, as eager rounds: the
    result matches eager's rounding, at the price of a cast pass or two per op).

    ``first``: an input node to number 0 — for a matmul epilogue, the matmul node (its region is the Vector
    chain after it; ``torch.ops.autofuse.matmul_epilogue`` takes the product as the program's input 0, in the
    matmul node's dtype, i.e. rounded as eager rounds it).
    """
    return _Build(list(nodes), outputs, rounding, first).run()


def program_from_function(fn, example_inputs, rounding: str = "fp32") -> tuple[BuiltProgram, fx.GraphModule]:
    """Trace ``fn(*example_inputs)`` to aten (``make_fx``) and build the program of all its ops; the graph's
    placeholders are the inputs, its returned tensors the outputs. For tests and benchmarks."""
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(fn)(*example_inputs)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    res = out.args[0]
    outputs = list(res) if isinstance(res, (tuple, list)) else [res]
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta.setdefault("val", None)
    return program_from_nodes(nodes, outputs, rounding), gm


__all__ = ["BuiltProgram", "Builder", "FLOATS", "Input", "Instr", "NotExpressible", "Output", "Program",
           "ProgramError", "V", "as_program", "dtype_name", "program_from_function", "program_from_nodes",
           "run_program_torch", "torch_dtype"]
