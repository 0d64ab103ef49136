"""Elementwise and reduction kernels on the Vector unit.

``elementwise`` — one kernel for every elementwise op, named by ``op``::

    npu.run("elementwise", x, op="gelu")                      # unary
    npu.run("elementwise", x, y, op="add")                    # binary, numpy/torch broadcasting
    npu.run("elementwise", x, op="mul", scalar=0.5)           # tensor-scalar form (Muls)
    npu.run("elementwise", cond, a, b, op="where")            # select; where(cond, a, scalar) with scalar=
    npu.run("elementwise", x, mask, op="masked_fill", scalar=float("-inf"))
    npu.run("elementwise", x, op="cast", out_dtype="float32")

Algorithm:

1. Broadcast the input shapes to the output shape and *coalesce*: drop size-1 output dims and merge
   neighbouring dims in which every input is either full or broadcast alike. ``x[8, 1, 4096] +
   y[4096]`` becomes ``[8, 4096]`` with y broadcast along rows. Inputs are viewed in that shape (a size-1
   dim where they are broadcast) and never materialised.
2. Tiles cover ``rows x cols`` of the last two coalesced dims; leading dims are walked one index at a
   time. Each input's tile is its region of that block: a broadcast row ``[1, cols]`` is read once per
   distinct region — reloaded only when its region changes, and re-reads of a region hit L2.
3. Rows are split evenly over the vector cores (columns, for the flat 1-D case); tiles double-buffered.
4. Per tile: cast inputs to the compute dtype where needed, the op's Vector passes, cast to the output
   dtype. fp32 computes in fp32; fp16 computes natively for the simple ops (add, mul, exp, sqrt, ...)
   and in fp32 (cast up, passes, cast down) for composite ones (sigmoid, tanh, gelu, silu, pow), as CANN
   kernels do; bf16 computes in fp32 (the Vector unit's bf16 arithmetic is casts only). Each op's passes
   are listed, by name, in ``OPS``: a pass is one Vector instruction sweeping the tile.

Numerics: the op is evaluated in float32 on the inputs' values and rounded once to the compute dtype and
once to the output dtype, which is what torch does on CPU (fp16/bf16 ops compute in fp32 there too).

``reduce`` — sum / mean / max / min over one or more dims, fp32 accumulation (max/min give values only,
like ``amax``/``amin``, which are accepted as aliases)::

    npu.run("reduce", x, op="sum", dim=(-1,), keepdim=True)

The reduced and kept dims are coalesced into alternating groups. The innermost kept group gives the lanes
of a tile; the innermost reduced group is chunked through UB. If it lies after the lanes (reducing the
last dims), a tile is ``lanes x chunk`` and is reduced along its rows; otherwise the tile is ``chunk x
lanes`` and rows are accumulated elementwise, so no transpose is needed. Other dims are looped over
(reduced ones) or distributed (kept ones). Lanes are split evenly over the vector cores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autofuse.npu.dtypes import FLOATS, STORAGE, itemsize
from autofuse.npu.kernels.dropout import unpack_keep
from autofuse.npu.kernels.tiles import (active_mask, block_elems, ceil_div, check_dtype, dtype_name, extents,
                                        fits, lanes, largest, lockstep, pad, pipeline, rnd, round_up, split_blocks, view)
from autofuse.npu.machine import GMTensor
from autofuse.npu.run import kernel
from cost_model.vecutil import coalesce, promote, reduce_groups, reduce_tiles

# ------------------------------------------------------------------------------------------- op table
_C_TANH = math.sqrt(2.0 / math.pi)


try:                                            # scipy's erf is a fast ufunc (scipy is optional)
    from scipy.special import erf as _erf
except ImportError:                             # pragma: no cover
    def _erf(x):
        """erf in float64 via math.erf (slow, exact to float64)."""
        return np.vectorize(math.erf, otypes=[np.float64])(x)

# Ascend C's Erf is a rational approximation: clip, z = x*x, P(z) and Q(z) of degree 4 by Horner (a Mul by
# z and an Adds per coefficient), x * P / Q.
_ERF = ("mins clip", "maxs clip", "mul z=x*x", *("mul P*z", "adds p_i") * 4, *("mul Q*z", "adds q_i") * 4,
        "mul x*P", "div P/Q")


# Sin: Cody-Waite range reduction to [-pi/2, pi/2] (k = round(x/pi), two-constant x - k*pi), an odd
# polynomial of degree 9 in r by Horner on z = r*r, and the sign (-1)^k from k's parity. Cos is
# sin(x + pi/2). No pass count of Ascend C's Sin/Cos is published; this is our reading of such an
# implementation (an assumption, like the Erf passes' degree).
_SIN = ("muls 1/pi", "cast round k", "cast k->f32", "mul k*pi_hi", "sub x-k*pi_hi", "mul k*pi_lo",
        "sub r-k*pi_lo", "mul z=r*r", *("mul P*z", "adds p_i") * 4, "mul r*P",
        "muls 0.5", "cast floor k/2", "muls 2", "sub parity", "muls -2", "adds 1", "mul sign")


# log1p(x) with Goldberg's correction: u = 1 + x rounds, ln(u) * x / (u - 1) undoes that rounding (within 3 fp32 ulps
# of torch's log1p); x itself where u is 1 (x below half an ulp of 1), and +inf at +inf (inf / inf)
_LOG1P = ("adds 1 u=1+x", "ln u", "adds -1 d=u-1", "div x/d", "mul ln(u)*x/d", "compare u==1", "select x",
          "compare x==inf", "select x")
# expm1(x) by Kahan's correction of exp(x) - 1 for |x| <= 0.5: (u - 1) * x / ln(u), u = exp(x); x where u is 1;
# plain exp(x) - 1 beyond 0.5 (accurate there; ±inf and -1 at -inf too). Ascend C has neither op: our reading
_EXPM1 = ("exp u", "adds -1 d=u-1", "ln u", "div x/ln(u)", "mul d*x/ln(u)", "compare u==1", "select x", "abs",
          "compare |x|>0.5", "select d")
# softplus(x) = max(x, 0) + log1p(exp(-|x|)): no overflow; the log1p of e = exp(-|x|) in (0, 1] by the same
# correction (e where 1 + e rounds to 1)
_SOFTPLUS = ("abs", "muls -1", "exp e", "adds 1 u=1+e", "ln u", "adds -1 d=u-1", "div e/d", "mul ln(u)*e/d",
             "compare d==0", "select e", "relu x", "add")

# floor, ceil, trunc and round (half to even): Ascend C's Cast from float to int32 rounds by the mode asked
# (CAST_FLOOR, CAST_CEIL, CAST_TRUNC, CAST_RINT; hiascend "Cast" API reference), cast back to float; x itself where
# |x| >= 2^23 (already integral; ±inf and NaN too, which int32 cannot hold), and x·0 where the result is 0, so a zero
# keeps x's sign as torch's does (ceil(-0.5) is -0.0)
def _rounding(mode):
    return (f"cast {mode} k", "cast k->f32", "abs", "compare |x|<2^23", "select x", "compare r==0", "muls 0",
            "select x*0")


def _log1p(x):
    return np.log1p(x.astype(np.float64))


def _softplus(x):
    x = x.astype(np.float64)
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


@dataclass(frozen=True)
class Op:
    """An elementwise op: how many tensors it takes, its numerics, its Vector passes.

    ``passes(scalar, has_scalar)`` lists the instructions per tile in the compute dtype. ``kind``:
    ``"arith"`` (result = promoted input dtype), ``"float"`` (integers promote to fp32), ``"compare"``
    (bool result), ``"logic"`` (bool in, bool out), ``"select"`` (where/masked_fill), ``"cast"``,
    ``"select_bits"`` (a where on a packed bit mask; the Vector program kernel's only).
    ``native16``: fp16 runs natively, without a cast to fp32. ``temps``: extra fp32 tiles the passes
    need beside the operands and the result.
    """

    arity: tuple
    fn: object
    passes: object
    kind: str = "arith"
    native16: bool = True
    temps: int = 0
    scalar: str = "optional"          # "optional" | "required" | "none"


def _fixed(*names):
    return lambda s, has: names


def _binary(tensor_pass, scalar_pass):
    return lambda s, has: (scalar_pass,) if has else (tensor_pass,)


def _pow_passes(p, has):
    """pow(x, p): squarings and multiplies for small integer p (Power's integer path), else exp(p*ln x)."""
    if not has:
        return ("ln x", "mul p*ln x", "exp")
    p = float(p)
    special = {0.0: ("duplicate 1",), 1.0: ("copy",), 0.5: ("sqrt",), -0.5: ("rsqrt",), -1.0: ("reciprocal",),
               2.0: ("mul x*x",)}
    if p in special:
        return special[p]
    if p.is_integer() and abs(p) <= 64:
        k = int(abs(p))
        passes = ("mul square",) * (k.bit_length() - 1) + ("mul acc",) * (bin(k).count("1") - 1)
        return passes + (("reciprocal",) if p < 0 else ())
    return ("ln x", "muls p", "exp")


def _where(c, a, b):
    return np.where(c, a, b)


def _select_bits(bits, a, b, width=None):
    """where(keep, a, b) with ``keep`` a packed bit mask (uint8 ``[..., bytes]``, bit ``c % 8`` of byte ``c // 8``
    is column ``c``, as :func:`autofuse.npu.kernels.dropout.pack_keep` packs it) over ``width`` columns (every
    bit when None)."""
    keep = unpack_keep(np.asarray(bits, dtype=np.uint8), width).astype(bool)
    return np.where(keep, a, b)


OPS = {
    # unary, native in fp16
    "neg": Op((1,), lambda x: -x, _fixed("muls -1"), scalar="none"),
    "abs": Op((1,), np.abs, _fixed("abs"), scalar="none"),
    "relu": Op((1,), lambda x: np.maximum(x, np.float32(0)), _fixed("relu"), scalar="none"),
    "square": Op((1,), np.square, _fixed("mul x*x"), scalar="none"),
    "exp": Op((1,), np.exp, _fixed("exp"), kind="float", scalar="none"),
    "log": Op((1,), np.log, _fixed("ln"), kind="float", scalar="none"),
    "sqrt": Op((1,), np.sqrt, _fixed("sqrt"), kind="float", scalar="none"),
    "rsqrt": Op((1,), lambda x: np.float32(1) / np.sqrt(x), _fixed("rsqrt"), kind="float", scalar="none"),
    "reciprocal": Op((1,), lambda x: np.float32(1) / x, _fixed("reciprocal"), kind="float", scalar="none"),
    # unary composites, fp32 inside for fp16/bf16
    "sigmoid": Op((1,), lambda x: np.float32(1) / (np.float32(1) + np.exp(-x)),
                  _fixed("muls -1", "exp", "adds 1", "reciprocal"), kind="float", native16=False, scalar="none"),
    # tanh(x) = 1 - 2 / (exp(2x) + 1): no overflow for large |x|
    "tanh": Op((1,), np.tanh, _fixed("muls 2", "exp", "adds 1", "reciprocal", "muls -2", "adds 1"),
               kind="float", native16=False, scalar="none"),
    # silu(x) = x / (1 + exp(-x))
    "silu": Op((1,), lambda x: x / (np.float32(1) + np.exp(-x)), _fixed("muls -1", "exp", "adds 1", "div x/(1+e)"),
               kind="float", native16=False, temps=1, scalar="none"),
    # gelu(x) = x/2 * (1 + erf(x / sqrt 2))
    "gelu": Op((1,), lambda x: (0.5 * x.astype(np.float64) * (1.0 + _erf(x.astype(np.float64) / math.sqrt(2.0)))),
               _fixed("muls 1/sqrt2", *_ERF, "adds 1", "mul x*(1+erf)", "muls 0.5"),
               kind="float", native16=False, temps=3, scalar="none"),
    # gelu, tanh form = x / (1 + exp(-2 sqrt(2/pi) (x + 0.044715 x^3))), as CANN's Gelu computes it
    "gelu_tanh": Op((1,), lambda x: 0.5 * x * (1 + np.tanh(np.float32(_C_TANH) * (x + np.float32(0.044715) * x ** 3))),
                    _fixed("mul x*x", "muls 0.044715", "adds 1", "mul *x", "muls -2sqrt(2/pi)", "exp", "adds 1",
                           "div x/(1+e)"), kind="float", native16=False, temps=1, scalar="none"),
    "sin": Op((1,), np.sin, _fixed(*_SIN), kind="float", native16=False, temps=2, scalar="none"),
    "cos": Op((1,), np.cos, _fixed("adds pi/2", *_SIN), kind="float", native16=False, temps=2, scalar="none"),
    "erf": Op((1,), lambda x: _erf(x.astype(np.float64)), _fixed(*_ERF), kind="float", native16=False, temps=3,
              scalar="none"),
    "softplus": Op((1,), _softplus, _fixed(*_SOFTPLUS), kind="float", native16=False, temps=2, scalar="none"),
    "log1p": Op((1,), _log1p, _fixed(*_LOG1P), kind="float", native16=False, temps=2, scalar="none"),
    "expm1": Op((1,), lambda x: np.expm1(x.astype(np.float64)), _fixed(*_EXPM1), kind="float", native16=False,
                temps=2, scalar="none"),
    "floor": Op((1,), np.floor, _fixed(*_rounding("floor")), kind="float", native16=False, temps=2, scalar="none"),
    "ceil": Op((1,), np.ceil, _fixed(*_rounding("ceil")), kind="float", native16=False, temps=2, scalar="none"),
    "trunc": Op((1,), np.trunc, _fixed(*_rounding("trunc")), kind="float", native16=False, temps=2, scalar="none"),
    # sign: torch's (0 at NaN, +0 at ±0), two compare-selects over a duplicated 0
    "sign": Op((1,), lambda x: np.where(x > 0, np.float32(1), np.where(x < 0, np.float32(-1), np.float32(0))),
               _fixed("duplicate 0", "compare x>0", "select 1", "compare x<0", "select -1"), kind="float",
               native16=False, temps=1, scalar="none"),
    "round": Op((1,), np.rint, _fixed(*_rounding("rint")), kind="float", native16=False, temps=2, scalar="none"),
    "cast": Op((1,), lambda x: x, _fixed("cast"), kind="cast", scalar="none"),
    "logical_not": Op((1,), np.logical_not, _fixed("not"), kind="logic", scalar="none"),
    # pow: tensor ** scalar (scalar=) or tensor ** tensor
    "pow": Op((1, 2), np.power, _pow_passes, kind="float", native16=False),
    # binary (tensor-tensor, or tensor-scalar with scalar=)
    "add": Op((1, 2), np.add, _binary("add", "adds")),
    "sub": Op((1, 2), np.subtract, _binary("sub", "adds -s")),
    "mul": Op((1, 2), np.multiply, _binary("mul", "muls")),
    "div": Op((1, 2), np.divide, _binary("div", "div by duplicated s"), kind="float"),
    "rsub": Op((1,), lambda x, s: s - x, _fixed("muls -1", "adds s"), scalar="required"),
    "rdiv": Op((1,), lambda x, s: s / x, _fixed("div duplicated s/x"), kind="float", scalar="required"),
    "maximum": Op((1, 2), np.maximum, _binary("max", "maxs")),
    "minimum": Op((1, 2), np.minimum, _binary("min", "mins")),
    "eq": Op((1, 2), np.equal, _fixed("compare"), kind="compare"),
    "ne": Op((1, 2), np.not_equal, _fixed("compare"), kind="compare"),
    "lt": Op((1, 2), np.less, _fixed("compare"), kind="compare"),
    "le": Op((1, 2), np.less_equal, _fixed("compare"), kind="compare"),
    "gt": Op((1, 2), np.greater, _fixed("compare"), kind="compare"),
    "ge": Op((1, 2), np.greater_equal, _fixed("compare"), kind="compare"),
    "logical_and": Op((2,), np.logical_and, _fixed("and"), kind="logic", scalar="none"),
    "logical_or": Op((2,), np.logical_or, _fixed("or"), kind="logic", scalar="none"),
    # where(cond, a, b) / where(cond, a, scalar): Select reads a bit mask made from cond by a Compare
    "where": Op((2, 3), _where, _fixed("compare cond->bitmask", "select"), kind="select"),
    # where(keep, a, b) over a packed bit mask (a Vector program's bit input, a dropout keep-mask): the Select
    # reads its condition as bits, so the mask loaded as it is stored needs no compare. Not an elementwise
    # kernel op (its condition does not broadcast like a tensor): the vector_program kernel's.
    "select_bits": Op((3,), _select_bits, _fixed("select"), kind="select_bits"),
    # masked_fill(x, mask, scalar) = where(mask, scalar, x)
    "masked_fill": Op((2,), lambda x, m, s: np.where(m, s, x), _fixed("compare mask->bitmask", "select"),
                      kind="select", scalar="required"),
}

_INTS = ("int32", "int8")


def _empty(launch, shape, dtype, name):
    """An output tensor; integer and bool outputs keep their own numpy storage."""
    if dtype in FLOATS:
        return launch.empty(shape, dtype, name)
    return GMTensor(launch.zeros(shape, STORAGE[dtype]), dtype, name)


def _wider(a: str, b: str) -> str:
    return a if itemsize(a) >= itemsize(b) else b


@kernel("elementwise", steer=("scalar",))                # a tensor scalar: pow's exponent picks the passes
def elementwise(launch, *inputs, op=None, scalar=None, out_dtype=None, tiling=None):
    """Elementwise ``op`` over ``inputs`` with broadcasting (see the module docstring and ``OPS``)."""
    if op not in OPS or OPS[op].kind == "select_bits":
        ops = sorted(k for k, v in OPS.items() if v.kind != "select_bits")
        raise ValueError(f"elementwise: unknown op {op!r}; ops are {', '.join(ops)}"
                         + (" (select_bits is a Vector program's where on a bit input: run it as a program)"
                            if op == "select_bits" else ""))
    spec = OPS[op]
    ts = [t for t in inputs if t is not None]
    if len(ts) != len(inputs):
        raise ValueError(f"elementwise {op}: an input is None")
    if isinstance(scalar, GMTensor):          # a one-element tensor given as the scalar: read its value
        if scalar.data.size != 1:
            raise ValueError(f"elementwise {op}: scalar= is a tensor of shape {list(scalar.shape)}; "
                             f"pass tensors as inputs")
        v = scalar.data.reshape(-1)[0]
        scalar = bool(v) if scalar.dtype == "bool" else int(v) if scalar.dtype in _INTS else float(v)
    has_scalar = scalar is not None
    if has_scalar and spec.scalar == "none":
        raise TypeError(f"elementwise {op}: takes no scalar")
    if spec.scalar == "required" and not has_scalar:
        raise TypeError(f"elementwise {op}: needs scalar=")
    if len(ts) not in spec.arity:
        raise TypeError(f"elementwise {op}: takes {' or '.join(map(str, spec.arity))} tensors, got {len(ts)}")
    if op in ("where",) and len(ts) == 2 and not has_scalar:
        raise TypeError("elementwise where: where(cond, a, b) needs a third tensor or scalar=")
    if op in ("where",) and len(ts) == 3 and has_scalar:
        raise TypeError("elementwise where: give b as a tensor or as scalar=, not both")
    if spec.arity == (1, 2) and len(ts) == 2 and has_scalar:
        raise TypeError(f"elementwise {op}: two tensors and a scalar")
    if spec.arity == (1, 2) and len(ts) == 1 and not has_scalar:
        raise TypeError(f"elementwise {op}: one tensor needs scalar=")
    for i, t in enumerate(ts):
        if t.dtype not in STORAGE:
            raise TypeError(f"elementwise {op}: input {i} has unsupported dtype {t.dtype}")
    dev = launch.device
    out_dtype = dtype_name(out_dtype)

    # ---- dtypes: operands (``data``) promote; masks/conditions are bool
    kind = spec.kind
    if kind == "select":
        conds = [0] if op == "where" else [1]
        for i in conds:
            if ts[i].dtype != "bool":
                raise TypeError(f"elementwise {op}: the {'condition' if op == 'where' else 'mask'} is "
                                f"{ts[i].dtype}, expected bool")
        data_idx = [i for i in range(len(ts)) if i not in conds]
    else:
        data_idx = list(range(len(ts)))
    float_scalar = has_scalar and isinstance(scalar, (float, np.floating)) and kind not in ("select",)
    if kind == "logic":
        for i, t in enumerate(ts):
            if t.dtype != "bool":
                raise TypeError(f"elementwise {op}: input {i} is {t.dtype}, expected bool")
        res, cd = "bool", "bool"
    else:
        res = promote([ts[i].dtype for i in data_idx], float_scalar)
        if res == "bool" and kind not in ("cast", "compare", "select"):
            raise TypeError(f"elementwise {op}: bool inputs; cast them first")
        if kind == "float" and res not in FLOATS:
            res = "float32"
        if kind == "cast":
            if out_dtype is None:
                raise TypeError("elementwise cast: needs out_dtype=")
            cd = res
        elif res == "float32" or (res == "float16" and spec.native16) or (res in _INTS and kind != "float"):
            cd = res
        elif res == "bool":
            cd = "float16"                               # select/compare on bool data: as 16-bit values
        else:
            cd = "float32"
        if res == "bfloat16" and kind == "select":
            cd = "bfloat16"                              # Select moves 16-bit patterns: bf16 needs no cast
    out_dt = out_dtype or ("bool" if kind == "compare" else res)
    if out_dt not in STORAGE:
        raise TypeError(f"elementwise {op}: unsupported out_dtype {out_dt}")
    passes = spec.passes(scalar, has_scalar)

    # ---- shapes
    try:
        out_shape = tuple(np.broadcast_shapes(*(t.shape for t in ts)))
    except ValueError:
        raise ValueError(f"elementwise {op}: shapes {[list(t.shape) for t in ts]} do not broadcast") from None
    out = _empty(launch, out_shape, out_dt, "out")
    total = math.prod(out_shape)
    if total == 0:
        return (out,)
    dims, flags = coalesce(out_shape, [t.shape for t in ts])
    lead, Dr, Dc = dims[:-2], dims[-2], dims[-1]
    nlead = math.prod(lead)
    views = [view(t, [d if flags[j][k] else 1 for j, d in enumerate(dims)]) for k, t in enumerate(ts)]
    oview = view(out, dims)
    row_full = [flags[-2][k] for k in range(len(ts))]
    col_full = [flags[-1][k] for k in range(len(ts))]
    scalar_like = [not any(flags[j][k] for j in range(len(dims))) for k in range(len(ts))]
    in_dt = [t.dtype for t in ts]
    # an input feeding the passes in another dtype is cast first (conditions are turned into masks instead)
    cast_in = [(k in data_idx) and in_dt[k] != cd for k in range(len(ts))]
    temps = spec.temps
    need_res = out_dt != cd
    all_dts = set(in_dt) | {cd, out_dt}
    cblk = max(block_elems(d) for d in all_dts)         # common row pitch: every tile row starts 32 B aligned

    def specs(r, c):
        cp = round_up(c, cblk)
        sp = []
        for k in range(len(ts)):
            shp = (r if row_full[k] else 1, cp if col_full[k] else 1)
            sp += [(shp, in_dt[k])] * 2
            if cast_in[k]:
                sp.append((shp, cd))
            if not col_full[k] and row_full[k] and not scalar_like[k]:
                sp.append(((r, block_elems(cd)), cd))    # Brcb: one 32 B block per row
        sp += [((r, cp), cd)] * (temps + need_res)
        return sp + [((r, cp), out_dt)] * 2

    # ---- work split and tile size
    rowspace = nlead * Dr
    row_mode = rowspace >= dev.vector_cores
    if row_mode:
        n = min(dev.vector_cores, rowspace)
    else:
        n = min(dev.vector_cores, rowspace * ceil_div(Dc, cblk))
    per_core = ceil_div(total, n)
    if tiling:
        r = int(tiling.get("rows", 1))
        c = min(int(tiling.get("cols", Dc)), Dc)
        if not row_mode:
            r = 1
    else:
        r, c = _default_tile(dev, specs, row_mode, Dr, Dc, per_core, ceil_div(rowspace, n), cblk, op)
    r = min(r, Dr)
    if r < 1 or c < 1:
        raise ValueError(f"elementwise {op}: tiling rows={r}, cols={c} must be positive")
    cp = round_up(c, cblk)

    g = launch.group("aiv", n)
    In = [[g.alloc("UB", (r if row_full[k] else 1, cp if col_full[k] else 1), in_dt[k], f"in{k}_{b}")
           for b in range(2)] for k in range(len(ts))]
    Cast = [g.alloc("UB", In[k][0].shape, cd, f"in{k}_{cd}") if cast_in[k] else None for k in range(len(ts))]
    Brcb = [g.alloc("UB", (r, block_elems(cd)), cd, f"in{k}_brcb")
            if (not col_full[k] and row_full[k] and not scalar_like[k]) else None for k in range(len(ts))]
    Tmp = [g.alloc("UB", (r, cp), cd, f"tmp{i}") for i in range(temps)]
    Res = g.alloc("UB", (r, cp), cd, "res") if need_res else None
    Out = [g.alloc("UB", (r, cp), out_dt, f"out_{b}") for b in range(2)]

    # ---- per-core tile lists: (lead flat index, r0, rows, c0, cols)
    if row_mode:
        shares = split_blocks(rowspace, n, r, period=Dr)
        per = [[(b0 // Dr, b0 % Dr, be, c0, min(c, Dc - c0)) for b0, be in blocks for c0 in range(0, Dc, c)]
               for blocks in shares]
    else:
        shares = split_blocks(rowspace * Dc, n, c, period=Dc, align=cblk)
        per = [[(b0 // Dc // Dr, b0 // Dc % Dr, 1, b0 % Dc, be) for b0, be in blocks] for blocks in shares]

    held = [[None] * n for _ in ts]             # region each core holds in its current buffer, per input
    slot = [1] * len(ts)
    out_slot = [0]
    rowb = any(not row_full[k] and not scalar_like[k] for k in data_idx) and r > 1
    sc = None if scalar is None else np.float32(scalar) if not isinstance(scalar, bool) else scalar

    def load(items):
        """MTE2 every input whose region changed on some core; returns (items, tiles, fresh flags)."""
        act = active_mask(items)
        lidx = [None if it is None else np.unravel_index(it[0], lead) if lead else () for it in items]
        tiles, fresh_k = [], []
        for k, t in enumerate(views):
            regs = []
            for c_, it in enumerate(items):
                if it is None:
                    regs.append(None)
                    continue
                _, r0, rr, c0, cc = it
                li = tuple(int(i) if flags[j][k] else 0 for j, i in enumerate(lidx[c_]))
                regs.append(li + (slice(r0, r0 + rr) if row_full[k] else slice(0, 1),
                                  slice(c0, c0 + cc) if col_full[k] else slice(0, 1)))
            fresh = any(rg is not None and rg != h for rg, h in zip(regs, held[k]))
            if fresh:
                slot[k] ^= 1
                g.load(In[k][slot[k]], t, regs, active=act, name=f"load in{k}")
                held[k] = list(regs)
            tiles.append(In[k][slot[k]])
            fresh_k.append(fresh)
        return items, act, lidx, tiles, fresh_k

    def work(h):
        """Casts, the op's passes, the output cast, MTE3."""
        items, act, lidx, tiles, fresh_k = h
        re = extents(items, lambda it: it[2])
        ce = extents(items, lambda it: it[4])
        cpe = round_up(ce, cblk)
        srcs = []
        for k, tile in enumerate(tiles):
            k_rows = re if row_full[k] else 1
            k_cols = cpe if col_full[k] else 1
            if cast_in[k]:
                if fresh_k[k]:
                    g.vector(f"cast in{k}->{cd}", (Cast[k],), (tile,),
                             g.repeats(k_rows * k_cols, _wider(in_dt[k], cd)), active=act,
                             compute=lambda k=k, src=tile: np.copyto(Cast[k].data, rnd(src.data, cd)))
                tile = Cast[k]
            if Brcb[k] is not None and fresh_k[k]:
                g.vector(f"brcb in{k}", (Brcb[k],), (tile,), ceil_div(re, 8), active=act)
            srcs.append(tile)
        ew = g.row_repeats(re, ce, cd) if rowb else g.repeats(re * cpe, cd)
        O = Out[out_slot[0] % 2]
        out_slot[0] += 1
        dst = Res if need_res else O
        work_tiles = tuple(Tmp) + (dst,)

        def compute():
            vals = [s_.data for s_ in srcs]
            if op == "masked_fill":
                y = spec.fn(vals[0], vals[1], sc)
            elif kind == "select":
                y = spec.fn(vals[0], vals[1], vals[2] if len(vals) == 3 else sc)
            elif has_scalar:
                y = spec.fn(vals[0], sc)
            else:
                y = spec.fn(*vals)
            np.copyto(dst.data, rnd(np.broadcast_to(y, dst.data.shape), cd), casting="unsafe")

        reads = tuple(srcs) + tuple(b for b in Brcb if b is not None)
        for i, name in enumerate(passes):
            last = i == len(passes) - 1
            g.vector(name, (dst,) if last else work_tiles[:1], reads + (work_tiles if i else ()), ew, active=act,
                     compute=compute if last else None)
        if need_res:
            g.vector(f"cast ->{out_dt}", (O,), (Res,), g.repeats(re * cpe, _wider(cd, out_dt)), active=act,
                     compute=lambda: np.copyto(O.data, rnd(Res.data, out_dt), casting="unsafe"))
        oregs = [None if it is None else tuple(int(i) for i in lidx[c_]) +
                 (slice(it[1], it[1] + it[2]), slice(it[3], it[3] + it[4])) for c_, it in enumerate(items)]
        g.store(O, oview, oregs, active=act, name="store out")

    with np.errstate(all="ignore"):
        pipeline(((lambda items=items: load(items)), work) for items in lockstep(per))
    return (out,)


def _default_tile(dev, specs, row_mode, Dr, Dc, per_core, rows_per_core, cblk, op):
    """Largest tile that fits UB double-buffered, capped so each core gets about four tiles (≥ 8 KB each)."""
    target = max(per_core // 4, 4096)
    if row_mode:
        if fits(dev, specs(1, Dc)):
            c = Dc
        else:
            step = 256 // 2
            c = step * largest(lambda k: fits(dev, specs(1, k * step)), 1, ceil_div(Dc, step))
        if c < 1:
            raise ValueError(f"elementwise {op}: not even one 32 B row of every operand fits UB on {dev.name}")
        r = largest(lambda x: fits(dev, specs(x, c)), 1, min(Dr, rows_per_core))
        r = max(1, min(r, target // max(c, 1)))
        return r, c
    c = cblk * largest(lambda k: fits(dev, specs(1, k * cblk)), 1, ceil_div(Dc, cblk))
    if c < 1:
        raise ValueError(f"elementwise {op}: not even one 32 B block of every operand fits UB on {dev.name}")
    c = max(cblk, min(c, round_up(max(target, 1), cblk)))
    return 1, min(c, Dc)


# ------------------------------------------------------------------------------------------- reduce
_RED = {"sum": ("sum", np.add), "mean": ("sum", np.add), "max": ("max", np.maximum), "amax": ("max", np.maximum),
        "min": ("min", np.minimum), "amin": ("min", np.minimum)}


@kernel("reduce")
def reduce(launch, x, op="sum", dim=None, keepdim=False, out_dtype=None, tiling=None):
    """``torch.sum/mean/amax/amin(x, dim, keepdim)``; fp32 accumulation, output in ``x``'s dtype (or
    ``out_dtype``). ``tiling``: ``{"block": lanes per tile, "chunk": reduced elements per tile}``."""
    if op not in _RED:
        raise ValueError(f"reduce: unknown op {op!r}; ops are {', '.join(_RED)}")
    check_dtype(f"reduce {op}", "x", x)
    dev = launch.device
    nd = x.data.ndim
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        red = set(range(nd))
    else:
        ds = [dim] if isinstance(dim, int) else list(dim)
        for d in ds:
            if not -max(nd, 1) <= d < max(nd, 1):
                raise ValueError(f"reduce: dim {d} out of range for x of shape {list(x.shape)}")
        red = {d % max(nd, 1) for d in ds}
    shape = tuple(x.shape)
    out_shape = tuple(1 if i in red else s for i, s in enumerate(shape)) if keepdim else \
        tuple(s for i, s in enumerate(shape) if i not in red)
    dtype = x.dtype
    out_dt = dtype_name(out_dtype) or dtype
    if out_dt not in FLOATS:
        raise TypeError(f"reduce: out_dtype {out_dt} is not a float type")
    out = launch.empty(out_shape, out_dt, "out")
    count = math.prod(shape[i] for i in red) if nd else 1
    if math.prod(out_shape) == 0:
        return (out,)
    if count == 0:
        if _RED[op][0] != "sum":
            raise ValueError(f"reduce {op}: reducing an empty dim has no identity")
        if launch.values:
            out.data[...] = np.nan if op == "mean" else 0.0
        return (out,)

    groups = reduce_groups(shape, red)            # coalesced dims: [size, reduced?]
    sizes = [s for s, _ in groups]
    iA = max(i for i, (_, f) in enumerate(groups) if not f)
    iR = max(i for i, (_, f) in enumerate(groups) if f)
    rowmode = iR > iA
    outerA = [i for i, (_, f) in enumerate(groups) if not f and i != iA]
    outerR = [i for i, (_, f) in enumerate(groups) if f and i != iR]
    SA, SR = sizes[iA], sizes[iR]
    P = math.prod(s for s, f in groups if not f)
    xv = view(x, sizes)
    ov = view(out, (P,))
    n = min(dev.vector_cores, P)
    per_lanes = ceil_div(P, n)
    if tiling:
        block, chunk = int(tiling.get("block", 1)), min(int(tiling.get("chunk", SR)), SR)
    else:
        block, chunk = _red_default(dev, dtype, out_dt, rowmode, SA, SR, per_lanes)
    block = min(block, SA)
    if block < 1 or chunk < 1:
        raise ValueError(f"reduce: tiling block={block}, chunk={chunk} must be positive")
    g = launch.group("aiv", n)
    sp = reduce_tiles(dtype, out_dt, rowmode, block, chunk)
    lowp = dtype != "float32"
    X = [g.alloc("UB", sp[0][0], dtype, f"x{i}") for i in range(2)]
    W = g.alloc("UB", sp[0][0], "float32", "w") if lowp else None
    part = g.alloc("UB", sp[-4][0], "float32", "partial") if rowmode else None
    acc = g.alloc("UB", sp[-3][0], "float32", "acc")
    Y = [g.alloc("UB", sp[-1][0], out_dt, f"y{i}") for i in range(2)]
    kind, ufunc = _RED[op]
    npred = {"sum": np.sum, "max": np.max, "min": np.min}[kind]
    f32 = "float32"
    outer_r = list(np.ndindex(*[sizes[i] for i in outerR])) if outerR else [()]
    nch = ceil_div(SR, chunk)
    ctr = {"x": 0, "y": 0}

    def load(items, ridx, k):
        """MTE2 chunk k of the reduced group (outer reduced index ridx) for each core's lanes."""
        r0 = k * chunk
        rv = min(chunk, SR - r0)
        regs = []
        for it in items:
            if it is None:
                regs.append(None)
                continue
            oa = np.unravel_index(it[0] // SA, [sizes[i] for i in outerA]) if outerA else ()
            idx = []
            for j in range(len(groups)):
                if j == iA:
                    a0 = it[0] % SA
                    idx.append(slice(a0, a0 + it[1]))
                elif j == iR:
                    idx.append(slice(r0, r0 + rv))
                elif j in outerA:
                    idx.append(int(oa[outerA.index(j)]))
                else:
                    idx.append(int(ridx[outerR.index(j)]))
            regs.append(tuple(idx))
        xb = X[ctr["x"] % 2]
        ctr["x"] += 1
        g.load(xb, xv, regs, active=active_mask(items), name="load x")
        return xb

    def accumulate(items, first, last, k, xb):
        """Cast (fp16/bf16), reduce the chunk into acc; after the item's last chunk: mean, cast, store."""
        act = active_mask(items)
        le = extents(items, lambda it: it[1])
        rv = min(chunk, SR - k * chunk)
        src = xb
        ew = g.repeats((le * pad(rv, dtype)) if rowmode else rv * pad(le, dtype), f32)
        if lowp:
            g.vector("cast x->fp32", (W,), (xb,), ew, active=act, compute=lambda: np.copyto(W.data, xb.data))
            src = W
        if rowmode:
            v = (slice(None), slice(None), slice(0, rv))
            tgt = acc if first else part
            g.vector(f"reduce {kind}", (tgt,), (src,), g.row_repeats(le, rv, f32), active=act,
                     compute=lambda: np.copyto(tgt.data[:, :block], npred(src.data[v], axis=2)))
            if not first:
                g.vector(f"{kind} acc", (acc,), (acc, part), g.repeats(pad(le, "float16"), f32),
                         active=act, compute=lambda: ufunc(acc.data, part.data, out=acc.data))
        else:
            # rows accumulate into acc elementwise: one pass per row of the chunk
            v = (slice(None), slice(0, rv))

            def col():
                r_ = npred(src.data[v], axis=1)[:, :acc.data.shape[1]]
                w_ = r_.shape[1]
                if first:
                    acc.data[...] = 0
                    acc.data[:, :w_] = r_
                else:
                    acc.data[:, :w_] = ufunc(acc.data[:, :w_], r_)
            g.vector(f"{kind} rows", (acc,), (src,) if first else (src, acc),
                     g.row_repeats(rv, pad(le, dtype), f32), active=act, compute=col)
        if not last:
            return
        if op == "mean":
            g.vector("muls 1/count", (acc,), (acc,), g.repeats(pad(le, "float16"), f32), active=act,
                     compute=lambda: np.multiply(acc.data, np.float32(1.0 / count), out=acc.data))
        yb = Y[ctr["y"] % 2]
        ctr["y"] += 1
        g.vector(f"cast ->{out_dt}" if out_dt != f32 else "copy", (yb,), (acc,), g.repeats(pad(le, "float16"), f32),
                 active=act, compute=lambda: np.copyto(yb.data, rnd(acc.data, out_dt)))
        g.store(yb, ov, [None if it is None else (slice(it[0], it[0] + it[1]),) for it in items], active=act,
                name="store out")

    def tasks():
        steps = [(ridx, k) for ridx in outer_r for k in range(nch)]
        for items in lockstep(split_blocks(P, n, block, period=SA)):
            for i, (ridx, k) in enumerate(steps):
                yield ((lambda items=items, ridx=ridx, k=k: load(items, ridx, k)),
                       (lambda xb, items=items, i=i, k=k: accumulate(items, i == 0, i == len(steps) - 1, k, xb)))

    with np.errstate(all="ignore"):
        pipeline(tasks())
    return (out,)


def _red_default(dev, dtype, out_dt, rowmode, SA, SR, per_lanes):
    f32_lanes = lanes(dev, "float32")
    if rowmode:
        ok1 = lambda ch: fits(dev, reduce_tiles(dtype, out_dt, True, 1, ch))   # noqa: E731
        chunk = SR if ok1(SR) else f32_lanes * largest(lambda k: ok1(k * f32_lanes), 1, ceil_div(SR, f32_lanes))
        block = largest(lambda b: fits(dev, reduce_tiles(dtype, out_dt, True, b, chunk)), 1, min(SA, per_lanes))
        if chunk == SR:
            block = min(block, max(1, ceil_div(per_lanes, 4)))
    else:
        block = min(SA, per_lanes, 1024)
        chunk = largest(lambda ch: fits(dev, reduce_tiles(dtype, out_dt, False, block, ch)), 1, SR)
    if block < 1 or chunk < 1:
        raise ValueError(f"reduce: no tile of {dtype} fits UB on {dev.name}")
    return block, chunk


__all__ = ["OPS", "elementwise", "reduce"]
