"""A Vector program lowered to its tile schedule: which input columns a tile loads, which Vector operations
run in which pass, which UB registers they use (:func:`lower`); how its rows are walked (:func:`geometry`);
what one Vector pass covers (:func:`sweep`); what a matmul epilogue needs of a program (:func:`epilogue_plan`).

A bit input (a packed bool mask, see :mod:`cost_model.program`) is loaded as the bytes of its columns
(:func:`col_bytes`) into a uint8 register and read as it was loaded by the ``where`` it conditions, an
elementwise op of its own (``select_bits``: one Select, no compare to make the mask). A tile's columns must
then start on a byte: chunks and epilogue tiles are multiples of 8 columns (:func:`bits_aligned`).

Pure data, like :mod:`cost_model.program`: the simulator's ``vector_program`` and ``matmul_epilogue`` kernels
execute this schedule and count what it costs; the cost model prices the same schedule. Nothing here is a
cost: pass counts come from each side's elementwise op table, cycles and bytes from each side's own rules.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from cost_model.program import (_COMMUTATIVE, _FLIP, BIT, COMPARE, F32, LOGIC, SHUFFLE, STAT, UNARY, Instr,
                                Program, ProgramError, _is_ref)
from cost_model.vecutil import largest


# ------------------------------------------------------------------------------------------ geometry
@dataclass(frozen=True)
class Geometry:
    """How a program's rows are walked: the lead dims coalesced into ``groups`` (size-1 dims dropped,
    neighbours along which every input varies alike merged), per input whether it varies along each group
    (``var[k][g]``), and the walk order.

    Rows are cut into blocks of ``R`` within the innermost group (``inner`` rows; a block never crosses
    it). A *task* is (block j, outer index o). ``block_major``: tasks go j-major, o-minor, when some input
    varies along the innermost group but not along an outer one (RoPE's cos over the heads): consecutive
    tasks then find its tile already loaded. Otherwise o-major (rows in memory order).
    """

    groups: tuple
    var: tuple
    block_major: bool

    @property
    def inner(self) -> int:
        return self.groups[-1]

    @property
    def outer(self) -> int:
        return math.prod(self.groups[:-1])

    def blocks(self, R: int) -> int:
        return -(-self.inner // R)

    def tasks(self, R: int) -> int:
        return self.blocks(R) * self.outer

    def shares(self, R: int, cores: int) -> list:
        """Each core's contiguous share of the task list, ``[(first task, count)]`` (cores with none left out).

        Even shares; block-major walks keep a whole block's outer sweep on one core (shares in multiples of
        ``outer``) when that costs at most 1/8 more tasks on the busiest core, so that every core starts a
        new block in the same step and reloads the block's inputs together.
        """
        T = self.tasks(R)
        n = min(cores, T)
        align = 1
        if self.block_major and n > 1 and -(-self.blocks(R) // n) * self.outer * 8 <= -(-T // n) * 9:
            align = self.outer
        units = -(-T // align)
        n = min(n, units)
        base, rem = divmod(units, n)
        out, start = [], 0
        for c in range(n):
            size = min(T - start, (base + (c < rem)) * align)
            out.append((start, size))
            start += size
        return [s for s in out if s[1] > 0]

    def task(self, t, R: int):
        """(block j, outer index o) of task number(s) ``t``."""
        if self.block_major:
            return t // self.outer, t % self.outer
        return t % self.blocks(R), t // self.blocks(R)


@functools.lru_cache(maxsize=4096)
def geometry(p: Program) -> Geometry:
    """Coalesce ``p``'s lead dims by its inputs' broadcast flags and choose the walk order (:class:`Geometry`).
    Cached by program (``cost_model.estimate.clear_caches`` clears it with the model's own caches)."""
    return _geometry(p)


def _geometry(p: Program) -> Geometry:
    vals = p.values
    nin = len(p.inputs)
    dims, flags = [], []
    for d, size in enumerate(p.lead):
        if size == 1:
            continue
        f = tuple(vals[k].rowvar[d] for k in range(nin))
        if dims and flags[-1] == f:
            dims[-1] *= size
        else:
            dims.append(size)
            flags.append(f)
    if not dims:
        dims, flags = [1], [tuple(True for _ in range(nin))]
    var = tuple(tuple(flags[g][k] for g in range(len(dims))) for k in range(nin))
    block_major = len(dims) > 1 and any(v[-1] and not all(v[:-1]) for v in var)
    return Geometry(tuple(dims), var, block_major)


# ------------------------------------------------------------------------------------------ lowering
NARROW = ("float16", "bfloat16")


def pitch(width: int, dtype: str = F32) -> int:
    """The row pitch of a UB register of ``width`` values: whole 32 B blocks, and at least 16 values per
    block row for the float types (the pitch the elementwise and norm kernels give their fp16/fp32 tiles)."""
    e = 32 if dtype == "bool" else 16
    if isinstance(width, int):
        return -(-max(width, 1) // e) * e
    return -(-np.maximum(width, 1) // e) * e


@dataclass(frozen=True)
class View:
    """A load: columns ``[offset, offset + width)`` of input ``input`` (width 1: broadcast along columns).
    ``rows``: varies along the innermost lead group (a tile holds R rows of it, else one row); ``fast``:
    varies along every lead group (a new region every task). A ``bit`` view (a packed bool mask) loads the
    bytes of its columns, :func:`col_bytes` of them per row, into a uint8 tile, and is read as it was loaded."""

    input: int
    offset: int
    width: int
    dtype: str
    rows: bool
    fast: bool


# Operands and instructions are made by the thousand per lowering: plain (not frozen) dataclasses, whose
# __init__ assigns fields directly (a frozen one's calls object.__setattr__ per field, several times slower).
# Treated as immutable all the same, and hashed by value as a frozen one is.
@dataclass(unsafe_hash=True)
class Src:
    """An operand: register ``reg`` (its columns ``[col, col + width)``, ``rows`` R or 1) or an immediate."""

    reg: object = None
    col: int = 0
    width: int = 0
    rows: bool = True
    imm: float | None = None

    @property
    def scalar_like(self) -> bool:
        """An immediate or a one-element register: read by the Scalar unit, used in tensor-scalar forms."""
        return self.imm is not None or (not self.rows and self.width == 1)


@dataclass(unsafe_hash=True)
class VecOp:
    """One Vector instruction of the per-tile program (one or more hardware passes, see ``kind``/``op``).

    ``kind``: ``cast_in`` (a narrow value widened to fp32), ``brcb`` (per-row values spread to 32 B blocks,
    the layout a broadcast operand is read in), ``ew`` (an elementwise op named ``op`` in the elementwise
    kernel's op table, ``scalar`` the immediate that selects its tensor-scalar form), ``cast`` (to ``dtype``),
    ``reduce`` (``op`` = sum/mean/max/min; chunked: the first chunk into the accumulator, later ones into
    ``aux`` and a ``merge``), ``merge``, ``mean`` (the sum divided by the count, as torch's mean: one pass), ``gather`` (a strided or unaligned slice,
    an interleave: one Gather), ``copy`` (a cat part into columns ``col..`` of the result), ``out`` (into an
    output tile: ``op`` ``cast`` or ``copy``).

    ``rows`` / ``width``: the result's shape (R rows or 1). ``dense``: every operand is a whole register of
    that shape (or a scalar), so a pass sweeps the tile at once; otherwise a pass goes row by row (a
    broadcast operand, a column block of a wider register). ``lanes``: the dtype whose width sets the lanes
    of a repeat. ``slow``: run only when one of ``views`` was reloaded (a hoisted value: its inputs are not
    new every task). ``temps``: registers of fp32 work space the op needs while it runs.
    """

    kind: str
    op: str
    dst: object
    srcs: tuple
    rows: bool
    width: int
    dense: bool
    lanes: str = F32
    slow: bool = False
    scalar: float | None = None
    dtype: str = F32
    temps: tuple = ()
    col: int = 0
    count: int = 0
    aux: object = None
    views: tuple = ()
    value: int | None = None


@dataclass(frozen=True)
class Store:
    """Output ``output`` from its tile: ``width`` columns (1: a per-row value, column 0 of an [R, STAT] tile)."""

    output: int
    width: int


@dataclass(frozen=True)
class Pass:
    """One walk over a block's columns: ``loads`` (view numbers, in order of first use) and ``ops`` per chunk,
    ``stores`` per chunk; ``end`` ops and ``end_stores`` once after the block's last chunk."""

    loads: tuple
    ops: tuple
    end: tuple
    stores: tuple
    end_stores: tuple


@dataclass(frozen=True)
class Reg:
    """A UB register: ``cls`` ``view`` (an input tile: its dtype and width, R or 1 rows), ``full`` ([R or 1,
    pitch(width)]) or ``row`` ([R, STAT], a per-row value in the Brcb layout); ``rows``: R rows (else 1)."""

    cls: str
    dtype: str
    rows: bool
    width: int


@dataclass(frozen=True)
class Lowered:
    """A program lowered to its tile schedule (:func:`lower`). Register numbers index ``regs``; operands
    and destinations are register numbers or ``("in", k)`` / ``("out", j)``, the double-buffered tiles
    ``in_regs[k]`` / ``out_regs[j]`` (the kernel alternates them)."""

    program: Program
    chunked: bool
    geometry: Geometry
    views: tuple
    passes: tuple
    regs: tuple
    in_regs: tuple
    out_regs: tuple
    width: int                      # the widest full-width value (whole rows: the columns of a tile)

    def ub_specs(self, R: int, C: int | None = None) -> list:
        """UB tiles ``[(shape, dtype)]`` in allocation order, for blocks of ``R`` rows and chunks of ``C``
        columns (``None``: whole rows). A bit register is a uint8 tile of its bytes."""
        return [(reg_shape(r, R, C), "uint8" if r.dtype == BIT else r.dtype) for r in self.regs]

    @property
    def reductions(self) -> bool:
        return any(op.kind == "reduce" for ps in self.passes for op in ps.ops)


def reg_shape(r: Reg, R: int, C: int | None = None) -> tuple:
    """The UB shape of register ``r`` (a bit register: in bytes)."""
    rows = R if r.rows else 1
    if r.cls == "row":
        return (rows, STAT)
    w = r.width if C is None or r.width == 1 else min(r.width, C)
    if r.cls == "view":
        return (rows, 1 if w == 1 else pad(w, r.dtype))
    return (rows, pitch(w, r.dtype))


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "bool": 1, "int8": 1, "uint8": 1, "int16": 2,
             "int32": 4, "int64": 8}


def col_bytes(cols, dtype: str):
    """Bytes of ``cols`` consecutive columns of a row of ``dtype``, starting on a byte (a ``bit`` row packs
    eight columns a byte: ``ceil(cols / 8)``). ``cols`` may be an array."""
    if dtype == BIT:
        return -(-cols // 8)
    return cols * _ITEMSIZE[dtype]


def pad(n, dtype) -> int:
    """``n`` elements rounded up to whole 32 B blocks (``bit``: the bytes of ``n`` columns, in bytes)."""
    if dtype == BIT:
        return -(-col_bytes(n, BIT) // 32) * 32
    e = 32 // _ITEMSIZE[dtype]
    return -(-n // e) * e


def bits_aligned(low: "Lowered", C) -> bool:
    """Whether tiles of ``C`` columns (``None``: whole rows) start every bit view on a byte."""
    return C is None or C % 8 == 0 or not any(w.dtype == BIT for w in low.views)


def sweep(op: VecOp, R, C=None):
    """What one pass of ``op`` covers on a block of ``R`` rows (chunks of ``C`` columns; either may be a
    per-core array): ``("flat", elements)`` swept contiguously, ``("rows", rows, columns)`` row by row, or
    ``("brcb", rows)``."""
    rows = R if op.rows else 1
    if op.kind == "brcb":
        return ("brcb", rows)
    if op.width == 1:
        # a per-row input before its Brcb: R contiguous values; other per-row values: [rows, STAT]
        return ("flat", rows if op.kind == "cast_in" and op.rows else rows * STAT)
    w = op.width if C is None else np.minimum(op.width, C)
    if op.kind in ("reduce", "gather", "copy") or not op.dense:
        return ("rows", rows, w)
    return ("flat", rows * pitch(w, op.lanes if op.lanes == "bool" else F32))


def lower(p: Program, chunked: bool = False, temps=lambda op: 0) -> Lowered:
    """The per-tile schedule of ``p``: which input columns to load, which Vector operations to run in which
    pass, and the UB registers they use (``temps(op)``: fp32 work registers elementwise op ``op`` needs).

    Whole rows (``chunked=False``): one pass per tile; every value computed once, in program order.

    ``chunked``: a block's columns are walked in chunks, in passes: pass ``q`` recomputes, chunk by chunk,
    the full-width values its reductions and stores need (from reloaded inputs), accumulates the reductions
    whose operand is first available in it, and stores the full-width outputs first available in it; after
    its last chunk it finishes those reductions (``mean``) and computes the per-row values that depend on
    them. Column shuffles other than step-1 slices of inputs need whole rows; a chunked lowering refuses them.

    Values that depend only on inputs that are not new every task (a weight, a scalar, RoPE's cos across
    heads) are *slow*: computed when one of their inputs was reloaded, kept in a register of their own.
    Per-row values too have registers of their own; every other value takes a register from a pool of its
    class, free again after its last reader.
    """
    return _Lowering(p, chunked, temps).run()


class _Lowering:
    def __init__(self, p: Program, chunked: bool, temps):
        self.p, self.chunked, self.temps_of = p, chunked, temps
        self.vals = p.values
        self.nin = len(p.inputs)
        self.geo = geometry(p)
        self.args_of = [[] for _ in p.inputs] + [[a for a in ins.args if _is_ref(a)] for ins in p.instrs]

    def _args(self, v):
        return self.args_of[v]

    def _ins(self, v):
        return self.p.instrs[v - self.nin] if v >= self.nin else None

    # -------------------------------------------------------------- analysis
    def run(self) -> Lowered:
        p, vals, nin = self.p, self.vals, self.nin
        need = set()
        stack = [o.value for o in p.outputs]
        while stack:
            v = stack.pop()
            if v not in need:
                need.add(v)
                stack += self._args(v)
        users = {v: [] for v in need}
        for u in sorted(need):
            for a in dict.fromkeys(self._args(u)):
                users[a].append(u)
        self.need = need
        self.out_of = {}
        for j, o in enumerate(p.outputs):
            self.out_of.setdefault(o.value, []).append(j)
        # load views: an input read only through step-1 slices loads just those columns
        views, alias = [], {}
        for k in sorted(v for v in need if v < nin):
            slices = [u for u in users[k] if self._ins(u).op == "slice" and self._ins(u).step == 1]
            direct = k in self.out_of or len(slices) < len(users[k])
            v, var = vals[k], self.geo.var[k]
            if direct:
                views.append(View(k, 0, v.width, v.dtype, var[-1], all(var)))
                alias[k] = len(views) - 1
            else:
                for u in slices:
                    ins = self._ins(u)
                    stop = v.width if ins.stop is None else ins.stop
                    views.append(View(k, ins.start, stop - ins.start, v.dtype, var[-1], all(var)))
                    alias[u] = len(views) - 1
        for w in views:
            if w.dtype == BIT and w.width == 1:
                raise ProgramError(f"input {w.input}: a bit input of width 1 (a per-row or scalar condition) is not "
                                   f"supported; give it as a bool input")
        self.views, self.view_of = tuple(views), alias
        if self.chunked:
            for v in sorted(need):
                ins = self._ins(v)
                if ins is not None and ins.op in SHUFFLE and v not in alias:
                    raise ProgramError(f"instruction {v - nin} ({ins.op}): a column shuffle needs whole rows in UB; "
                                       f"this program cannot be walked in column chunks")
        self.width = max([vals[v].width for v in need if v >= nin or v in alias] + [1])
        self.deps = {}
        for v in sorted(need):
            self.deps[v] = frozenset([alias[v]]) if v in alias else \
                frozenset().union(*[self.deps[a] for a in self._args(v)])
        always = {k for k, w in enumerate(views) if w.fast and (w.width > 1 or not self.chunked)}
        self.slow = {v: not (self.deps[v] & always) for v in need}
        self.rowsv = {v: any(views[k].rows for k in self.deps[v]) for v in need}
        self.persist = {}                  # width-1 values: where they sit, across passes
        raw = []
        npass = 1 if not self.chunked else 1 + max(
            [vals[o.value].level if vals[o.value].width > 1 else max(vals[o.value].level - 1, 0) for o in p.outputs]
            + [0])
        for q in ([None] if not self.chunked else range(npass)):
            raw.append(self._pass(q))
        return self._allocate(raw)

    # -------------------------------------------------------------- one pass
    def _pass(self, q):
        p, vals = self.p, self.vals
        self.ops, self.end, self.loads = [], [], []
        self.loc = dict(self.persist)
        self.narrow_of = {}
        self.claimed = set()
        if q is None:
            # inputs read only through slices are loaded as those slices' views
            chunk_vals = sorted(v for v in self.need if v >= self.nin or v in self.view_of)
            end_vals, outs_chunk, outs_end = [], list(range(len(p.outputs))), []
            self.storing = set(outs_chunk)
        else:
            def lvl(v):
                return vals[v].level
            outs_chunk = [j for j, o in enumerate(p.outputs) if vals[o.value].width > 1 and lvl(o.value) == q]
            outs_end = [j for j, o in enumerate(p.outputs)
                        if vals[o.value].width == 1 and max(lvl(o.value) - 1, 0) == q]
            self.storing = set(outs_chunk)
            reds = [v for v in self.need if self._ins(v) is not None and self._ins(v).op == "reduce"
                    and lvl(self._args(v)[0]) == q]
            end_vals = sorted(v for v in self.need if vals[v].width == 1 and lvl(v) == q + 1
                              and self._ins(v).op != "reduce" and v not in self.view_of)
            targets = [p.outputs[j].value for j in outs_chunk] + reds
            # per-row values of level 0 the end ops (and per-row outputs) read
            for v in end_vals + [p.outputs[j].value for j in outs_end]:
                stack = [v]
                while stack:
                    u = stack.pop()
                    if vals[u].level == 0:
                        targets.append(u)
                    else:
                        stack += [a for a in self._args(u) if vals[a].width == 1]
            chunk_vals = sorted(v for v in self._closure(targets, q) if v >= self.nin or v in self.view_of)
        for v in chunk_vals:
            self._emit(v, self.ops, q)
        if q is not None:
            for v in end_vals:
                self._emit(v, self.end, q)
        for j in outs_chunk:
            if j not in self.claimed:
                self.ops.append(self._out(j))
        for j in outs_end:
            self.end.append(self._out(j))
        stores = tuple(Store(j, vals[p.outputs[j].value].width) for j in outs_chunk)
        return (tuple(self.loads), list(self.ops), list(self.end), stores,
                tuple(Store(j, 1) for j in outs_end))

    def _closure(self, targets, q):
        """What pass q computes per chunk: the targets and their operands, except per-row results of earlier
        passes (reductions finished and the per-row values computed after them)."""
        seen, stack = set(), list(targets)
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            if self.vals[v].width == 1 and self.vals[v].level >= 1 and \
                    (self.vals[v].level <= q or self._ins(v).op != "reduce"):
                continue              # available from an earlier pass's end (or this pass's own end)
            seen.add(v)
            if v not in self.view_of:
                stack += self._args(v)
        return seen

    # operands --------------------------------------------------------
    def _src(self, v, target) -> Src:
        """v as an fp32 (or bool) operand, widening a narrow value on first use."""
        loc = self.loc[v]
        if isinstance(loc, tuple):
            _, dt, s = loc
            reg = ("w", v)
            target.append(VecOp("cast_in", "cast", reg, (s,), s.rows, s.width, True, slow=self.slow[v],
                                views=tuple(sorted(self.deps[v])), value=v))
            src = Src(reg, 0, s.width, s.rows)
            self.loc[v] = src
            self.narrow_of[v] = s
            return src
        return loc

    def _narrow(self, v):
        loc = self.loc[v]
        if isinstance(loc, tuple):
            return loc[2], loc[1]
        if v in self.narrow_of:
            return self.narrow_of[v], self.vals[v].dtype
        return None, None

    def _out(self, j) -> VecOp:
        o = self.p.outputs[j]
        v = o.value
        w = self.vals[v].width
        s, dt = self._narrow(v)
        if s is None or (dt != o.dtype and o.dtype == "bool"):
            s = self._src(v, self.ops if w > 1 or self.chunked is False else self.end)
            dt = "bool" if self.vals[v].dtype == "bool" else F32
        op = "copy" if dt == o.dtype else "cast"
        return VecOp("out", op, ("out", j), (s,), True, w, s.rows and s.col == 0 and s.width == w,
                     lanes=F32 if "bool" not in (dt, o.dtype) else "bool", dtype=o.dtype, value=v)

    def _dst(self, v, dtype):
        """Where op computing v writes: an output tile of that dtype stored this pass (no copy), or its register."""
        if self.vals[v].width > 1 and self.rowsv[v] and not self.slow[v]:
            for j in self.out_of.get(v, ()):
                if j in self.storing and j not in self.claimed and self.p.outputs[j].dtype == dtype:
                    self.claimed.add(j)
                    return ("out", j)
        return ("v", v)

    # one value --------------------------------------------------------
    def _emit(self, v, target, q):
        if v in self.loc:
            return
        vals = self.vals
        val = vals[v]
        slow, dv = self.slow[v], tuple(sorted(self.deps[v]))
        rows = self.rowsv[v]
        if v in self.view_of:
            k = self.view_of[v]
            if k not in self.loads:
                self.loads.append(k)
            w = self.views[k]
            s = Src(("in", k), 0, w.width, w.rows)
            if w.width == 1 and w.rows:                  # a per-row input: fp32, spread to blocks
                if w.dtype != F32:
                    target.append(VecOp("cast_in", "cast", ("cvt", v), (s,), True, 1, True, slow=slow, views=dv))
                    s = Src(("cvt", v), 0, 1, True)
                target.append(VecOp("brcb", "brcb", ("v", v), (s,), True, 1, True, slow=slow, views=dv))
                self._set(v, Src(("v", v), 0, 1, True))
            elif w.dtype in NARROW:
                self.loc[v] = ("narrow", w.dtype, s)
            else:
                self._set(v, s)
            return
        ins = self._ins(v)
        op = ins.op
        if op == "cast":
            a = ins.args[0]
            src_dt = vals[a].dtype
            if ins.dtype == src_dt:
                self.loc[v] = self.loc[a]
                if a in self.narrow_of:
                    self.narrow_of[v] = self.narrow_of[a]
                return
            if ins.dtype == F32 and src_dt != "bool":
                self._set(v, self._src(a, target))
                return
            s = self._src(a, target)
            dt = ins.dtype
            dst = self._dst(v, dt)
            target.append(VecOp("cast", "cast", dst, (s,), s.rows, s.width, True, slow=slow, dtype=dt,
                                lanes="bool" if "bool" in (dt, src_dt) else F32, views=dv, value=v))
            out = Src(dst, 0, s.width, s.rows)
            if dt in NARROW:
                self.loc[v] = ("narrow", dt, out)
            else:
                self._set(v, out)
            return
        if op == "reduce":
            s = self._src(ins.args[0], target)
            if vals[ins.args[0]].width == 1:
                # a reduction of one column is that column (sum, mean, max and min alike); reduced per chunk and
                # merged, a per-row value would be counted once a chunk
                self._set(v, Src(s.reg, s.col, 1, s.rows, s.imm))
                return
            acc = ("v", v)
            aux = ("part", v) if q is not None else None
            target.append(VecOp("reduce", ins.kind, acc, (s,), True, 1, False, slow=slow, views=dv, value=v,
                                count=vals[ins.args[0]].width, aux=aux))
            target.append(VecOp("brcb", "brcb", acc, (Src(acc, 0, 1, True),), True, 1, True, slow=slow, views=dv,
                                aux=aux))
            if q is not None:
                target.append(VecOp("merge", ins.kind, acc, (Src(acc, 0, 1, True), Src(aux, 0, 1, True)), True, 1,
                                    True, slow=slow, views=dv))
            if ins.kind == "mean":
                (self.end if q is not None else target).append(
                    VecOp("mean", "mean", acc, (Src(acc, 0, 1, True),), True, 1, True, slow=slow, views=dv, value=v,
                          count=vals[ins.args[0]].width))
            self._set(v, Src(acc, 0, 1, True))
            return
        if op == "slice":
            s = self._src(ins.args[0], target)
            stop = vals[ins.args[0]].width if ins.stop is None else ins.stop
            if ins.step == 1 and (s.col + ins.start) % 8 == 0:
                self._set(v, Src(s.reg, s.col + ins.start, stop - ins.start, s.rows))
                return
            dst = self._dst(v, F32)
            target.append(VecOp("gather", "slice", dst, (s,), s.rows, val.width, False, slow=slow, views=dv,
                                value=v, aux=(ins.start, ins.step)))
            self._set(v, Src(dst, 0, val.width, s.rows))
            return
        if op in ("interleave", "cat"):
            srcs = [self._src(a, target) for a in ins.args]
            dst = self._dst(v, F32)
            if op == "interleave":
                target.append(VecOp("gather", "interleave", dst, tuple(srcs), rows, val.width, False, slow=slow,
                                    views=dv, value=v))
            else:
                col = 0
                for s in srcs:
                    target.append(VecOp("copy", "cat", dst, (s,), rows, s.width, False, slow=slow, views=dv,
                                        value=v, col=col))
                    col += s.width
            self._set(v, Src(dst, 0, val.width, rows))
            return
        srcs = tuple(Src(imm=a) if not _is_ref(a) else self._src(a, target) for a in ins.args)
        name, scalar = _ew_name(ins, srcs, op == "where" and vals[ins.args[0]].dtype == BIT)
        dt = "bool" if val.dtype == "bool" else F32
        dst = self._dst(v, dt)
        dense = all(s.scalar_like or (s.rows == rows and s.width == val.width and s.col == 0) for s in srcs)
        nt = self.temps_of(name)
        temps = tuple(("tmp", v, i) for i in range(nt))
        target.append(VecOp("ew", name, dst, srcs, rows, val.width, dense, lanes="bool" if op in LOGIC else F32,
                            slow=slow, scalar=scalar, dtype=dt, temps=temps, views=dv, value=v))
        self._set(v, Src(dst, 0, val.width, rows))

    def _set(self, v, src):
        self.loc[v] = src
        if self.vals[v].width == 1 and isinstance(src.reg, tuple) and src.reg[0] in ("v", "w", "cvt"):
            self.persist[v] = src

    # -------------------------------------------------------------- registers
    def _allocate(self, raw) -> Lowered:
        """Map symbolic registers to UB registers (see :func:`lower`)."""
        regs: list[Reg] = []

        def new(cls, dtype, rows, width):
            regs.append(Reg(cls, dtype, rows, width))
            return len(regs) - 1

        in_regs = []
        for w in self.views:
            a = new("view", w.dtype, w.rows, w.width)
            # a view whose region never changes (broadcast along every lead dim, whole rows) loads once: one buffer
            fixed = not self.chunked and not any(self.geo.var[w.input])
            in_regs.append((a, a if fixed else new("view", w.dtype, w.rows, w.width)))
        in_regs = tuple(in_regs)
        # what each symbolic register holds: (class, dtype, rows, width)
        info = {}
        for _, ops, end, _, _ in raw:
            for op in ops + end:
                for key, (cls, dt, rows, width) in self._defs(op):
                    old = info.get(key)
                    info[key] = (cls, dt, rows, max(width, old[3]) if old else width)
        dedicated = {}
        for key, (cls, dt, rows, width) in info.items():
            if key[0] in ("cvt", "part") or cls == "row" or (key[0] in ("v", "w") and self.slow.get(key[1], False)):
                dedicated[key] = new(cls, dt, rows, width)
        pools: dict = {}                    # (cls, dtype, rows) -> [reg numbers]
        passes = []
        for loads, ops, end, stores, end_stores in raw:
            m = dict(dedicated)
            last = {}
            for i, op in enumerate(ops):
                for s in op.srcs:
                    if s.reg is not None:
                        last[s.reg] = i
                last.setdefault(op.dst, i)
            free = {c: list(r) for c, r in pools.items()}

            def take(key):
                cls, dt, rows, width = info[key]
                c = (cls, dt, rows)
                lst = free.setdefault(c, [])
                if lst:
                    r = lst.pop(0)
                else:
                    r = new(cls, dt, rows, width)
                    pools.setdefault(c, []).append(r)
                if regs[r].width < width:
                    regs[r] = Reg(cls, dt, rows, width)
                m[key] = r
                return r

            def release(key):
                if key in m and key not in dedicated:
                    cls, dt, rows, _ = info[key]
                    free.setdefault((cls, dt, rows), []).append(m[key])
                    free[(cls, dt, rows)].sort()

            out_ops = []
            for i, op in enumerate(ops):
                if isinstance(op.dst, tuple) and op.dst[0] in ("v", "w", "tmp", "cvt", "part") and op.dst not in m:
                    take(op.dst)
                for t in op.temps:
                    take(t)
                if op.aux is not None and not isinstance(op.aux[0], int) and op.aux not in m:
                    take(op.aux)
                out_ops.append(self._map(op, m))
                for t in op.temps:
                    release(t)
                for key in {s.reg for s in op.srcs if s.reg is not None} | {op.dst}:
                    if isinstance(key, tuple) and key[0] in ("v", "w", "tmp") and last.get(key) == i:
                        release(key)
            out_end = []
            for op in end:                  # a block's end ops (per-row values): their work registers too
                for t in op.temps:
                    take(t)
                out_end.append(self._map(op, m))
                for t in op.temps:
                    release(t)
            passes.append(Pass(loads, tuple(out_ops), tuple(out_end), stores, end_stores))
        p = self.p
        out_regs = []
        for o in p.outputs:
            w = self.vals[o.value].width
            cls = "row" if w == 1 else "full"
            out_regs.append((new(cls, o.dtype, True, w), new(cls, o.dtype, True, w)))
        return Lowered(p, self.chunked, self.geo, self.views, tuple(passes), tuple(regs), in_regs,
                       tuple(out_regs), self.width)

    def _defs(self, op):
        """Symbolic registers an op writes, with (class, dtype, rows, width)."""
        out = []
        dst = op.dst
        if isinstance(dst, tuple) and dst[0] in ("v", "w", "cvt"):
            if dst[0] == "cvt":
                out.append((dst, ("full", F32, True, 1)))
            elif op.width == 1 and op.rows:
                out.append((dst, ("row", F32, True, 1)))
            else:
                dt = op.dtype if op.kind in ("cast", "ew") and dst[0] == "v" else F32
                out.append((dst, ("full", dt, op.rows, op.width + (op.col if op.kind == "copy" else 0))))
        if op.kind == "copy" and isinstance(dst, tuple) and dst[0] == "v":
            out[-1] = (dst, ("full", F32, op.rows, self.vals[op.value].width))
        for t in op.temps:
            out.append((t, ("full", F32, op.rows, op.width)))
        if op.kind == "reduce" and op.aux is not None:
            out.append((op.aux, ("row", F32, True, 1)))
        return out

    @staticmethod
    def _map(op, m):
        def r(key):
            return m.get(key, key) if isinstance(key, tuple) else key
        srcs = tuple(s if s.reg is None or not isinstance(s.reg, tuple) or s.reg not in m else
                     Src(m[s.reg], s.col, s.width, s.rows, s.imm) for s in op.srcs)
        aux = r(op.aux) if isinstance(op.aux, tuple) and op.aux and isinstance(op.aux[0], str) else op.aux
        return VecOp(op.kind, op.op, r(op.dst), srcs, op.rows, op.width, op.dense, op.lanes, op.slow, op.scalar,
                     op.dtype, tuple(r(t) for t in op.temps), op.col, op.count, aux, op.views, op.value)


def _ew_name(ins: Instr, srcs, bits: bool = False):
    """The elementwise op-table name of an ``ew`` instruction and the scalar selecting its tensor-scalar form
    (an immediate, or NaN for a one-element input read by the Scalar unit). ``bits``: a ``where`` whose
    condition is a bit input, ``select_bits`` (the Select reads the loaded bits, no compare makes them)."""
    op = ins.op
    scal = [i for i, s in enumerate(srcs) if s.scalar_like]
    if op == "where":
        return ("select_bits" if bits else "where"), None
    if op in UNARY or op in LOGIC or not scal or len(scal) == len(srcs):
        return op, None
    i = scal[0]
    s = srcs[i].imm if srcs[i].imm is not None else float("nan")
    if i == 1 or op in _COMMUTATIVE:
        return op, s
    if op in COMPARE:
        return _FLIP[op], s
    return {"sub": "rsub", "div": "rdiv", "pow": "pow"}[op], (s if op != "pow" else None)


# ------------------------------------------------------------------------------------------ matmul epilogues
def epilogue_plan(prog, M, N, dtype, temps=lambda op: 0):
    """What the kernel needs to know of an epilogue program: its whole-row lowering, the offsets of the
    column blocks (pieces) of the product it reads, its width, and whether tiles must span whole rows (a
    reduction or a column shuffle)."""
    p0 = prog.inputs[0] if prog.inputs else None
    if p0 is None or p0.dtype not in ("float32", dtype) or tuple(p0.shape)[-1:] != (N,) or prog.rows != M:
        raise ProgramError(f"matmul_epilogue: the program's input 0 must be the product, [{M} rows, {N}] of "
                           f"float32 or {dtype}; it declares "
                           f"{None if p0 is None else (list(p0.shape), p0.dtype)}")
    low = lower(prog, False, temps)
    geo = low.geometry
    if len(geo.groups) != 1:
        part = [k for k, v in enumerate(geo.var) if any(v) and not all(v)]
        raise ProgramError(f"matmul_epilogue: the region reads "
                           f"{list(prog.inputs[part[0]].shape) if part else 'an input'} broadcast over some of the "
                           f"product's leading dims only{_broadcast_over(prog, part[0]) if part else ''}; an epilogue "
                           f"reads each input whole, per row, per column or as one number along the product's rows, "
                           f"so the region can only run as a Vector kernel of its own after the matmul", part)
    W = low.width
    pieces = [w.offset for w in low.views if w.input == 0]
    if any(w.width != W for w in low.views if w.input == 0) or not pieces:
        widths = sorted({w.width for w in low.views if w.input == 0})
        raise ProgramError(f"matmul_epilogue: the region reads the product's {N} columns as parts of widths "
                           f"{widths} (a projection split into unequal parts, as split_with_sizes does); an epilogue "
                           f"reads the product whole, or as equal parts as wide as its output ({W}), so the region "
                           f"can only run as a Vector kernel of its own after the matmul")
    ops = [op for ps in low.passes for op in ps.ops]
    whole = any(op.kind in ("reduce", "gather", "copy") for op in ops) or \
        any(s.col for op in ops for s in op.srcs)
    return low, pieces, W, whole


def _broadcast_over(prog, k) -> str:
    """`` (it changes along ... and repeats along ...)``: the product's leading dims (sizes, those of 1 left out) input
    ``k`` of ``prog`` follows and those it repeats along; a drop-path mask as the like case where it follows the
    outer ones only (one value per sample, as a drop-path mask [B, 1, 1] over [B, S, H] has)."""
    dims = [d for d, size in enumerate(prog.lead) if size > 1]
    follows = [d for d in dims if prog.values[k].rowvar[d]]
    along, over = [prog.lead[d] for d in follows], [prog.lead[d] for d in dims if d not in follows]
    like = "; as a per-sample drop-path mask [B, 1, 1] over [B, S, H] does" if follows == dims[:len(follows)] else ""
    return f" (it changes along the product's leading dims of sizes {along} and repeats along {over}{like})"


def epilogue_ub_specs(dev, prog, low, P, t) -> list:
    """UB tiles: (coupled) the staging tiles of the product, then the program's registers for ``sub`` rows."""
    rows = -(-t["m0"] // t["sub"]) * t["sub"]          # whole sub-blocks of the L0C tile
    stage = [((rows, t["n0"]), prog.inputs[0].dtype)] * P if dev.arch == "coupled" else []
    return stage + low.ub_specs(t["sub"], min(t["n0"], low.width))


def epilogue_fits(dev, prog, M, N, dtype, t, temps=lambda op: 0, plan=None) -> bool:
    """Whether tiling ``t`` of ``matmul_epilogue`` fits every buffer of ``dev`` (``plan``: the program's
    :func:`epilogue_plan`, if already made)."""
    low, pieces, W, whole = plan or epilogue_plan(prog, M, N, dtype, temps)
    P = len(pieces)
    isz = _ITEMSIZE[dtype]
    m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
    buf = dev.buffers
    return (k1 % k0 == 0 and min(m0, n0, k0, k1, t["sub"]) > 0
            and 2 * (m0 * k1 + P * k1 * n0) * isz + n0 * 4 <= buf["L1"] - 64
            and 2 * m0 * k0 * isz <= buf["L0A"] and 2 * P * k0 * n0 * isz <= buf["L0B"]
            and P * m0 * n0 * 4 <= buf["L0C"] and (not whole or n0 >= W) and bits_aligned(low, n0)
            and _ub_need(dev, epilogue_ub_specs(dev, prog, low, P, t)) <= buf["UB"])


def epilogue_default_tiling(dev, plan, K, dtype, mm_tile, sub_fits) -> dict:
    """The ``matmul_epilogue`` kernel's own default tiling, which the kernel runs and the cost model prices.

    ``mm_tile``: the plain matmul's default tile for the columns the epilogue reads (``pieces`` blocks of
    ``n0``), each side taking it from its own matmul; ``sub_fits(t)``: ``ok(sub)``, whether tiling ``t`` fits
    with ``sub`` rows a sub-block. The tile is as wide as the row for whole-row programs, K slices as deep as
    fit L0A/L0B double-buffered, the most sub-block rows that fit UB; m0 halves while UB cannot stage it."""
    _, pieces, W, whole = plan
    P, isz = len(pieces), _ITEMSIZE[dtype]
    t = dict(mm_tile)
    t["n0"] = max(16, t["n0"] // P // 16 * 16) if not whole else -(-W // 16) * 16
    t["sub"] = 1
    while True:
        m0, n0 = t["m0"], t["n0"]
        t["k0"] = next((k for k in (128, 64, 32, 16) if 2 * m0 * k * isz <= dev.buffers["L0A"]
                        and 2 * P * k * n0 * isz <= dev.buffers["L0B"]), 16)
        t["k1"] = min(2 * t["k0"], -(-K // t["k0"]) * t["k0"])
        rows = m0 if dev.arch == "coupled" else max(1, -(-m0 // 2))
        ok = sub_fits(t)
        t["sub"] = max(1, largest(ok, 1, min(rows, 64)))
        if ok(t["sub"]) or t["m0"] <= 16:
            return t
        t["m0"] = max(16, t["m0"] // 2)


def _ub_need(dev, specs) -> int:
    used = 0
    for shape, dt in specs:
        used = -(-used // dev.align["UB"]) * dev.align["UB"] + math.prod(shape) * _ITEMSIZE[dt]
    return used
