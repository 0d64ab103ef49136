"""``vector_program``: one generated Vector kernel for any :class:`cost_model.program.Program`.

    npu.run("vector_program", x, w, program=prog)            # prog: a Program, its JSON or its dict
    npu.run("vector_program", x, w, program=prog, tiling={"rows": 8})                # whole rows
    npu.run("vector_program", x, w, program=prog, tiling={"rows": 4, "chunk": 2048})  # columns in chunks

The program is lowered (:func:`cost_model.lowering.lower`) to a tile schedule: which input columns each
tile loads, the Vector operations per tile, the UB registers they use. This kernel executes that schedule
on the simulated chip and counts what it costs; the passes each elementwise op takes are the elementwise
kernel's (``autofuse.npu.kernels.vector.OPS``).

Schedule:

1. The lead dims are coalesced (:func:`cost_model.lowering.geometry`); rows are cut into blocks of ``R``
   within the innermost group. Tasks (block, outer index) are dealt in even contiguous shares to the vector
   cores, which run in lockstep; RoPE-like inputs broadcast over an outer dim (cos over the heads) make
   the walk block-major, so a core keeps their tile across the outer dim.
2. Per task (double-buffered: MTE2 loads task i+1 while the Vector unit works on task i and MTE3 stores
   task i-1): each input view whose region changed is loaded (a weight or scalar once per core, RoPE's cos
   once per block); narrow (fp16/bf16) values are cast to fp32 once; one Vector instruction per program op
   (its passes as the elementwise kernel counts them; a pass sweeps the tile, or goes row by row when an
   operand is broadcast along the columns or is a column block of a wider register); values depending only
   on inputs that were not reloaded are not recomputed; a reduction is a per-row reduce and a Brcb; each
   output is cast into a double-buffered output tile (or written there by the op computing it) and stored.
3. A row that does not fit UB is walked in column chunks (``tiling["chunk"]``): one pass over the chunks
   per reduction level, the last pass storing the outputs; pass 1 accumulates the reductions chunk by
   chunk (the first chunk into the accumulator, the others through a partial and a merge), the per-row
   values after them are computed once, pass 2 walks the chunks backwards (the chunk pass 1 ended on is
   still in UB) recomputing what it needs from the reloaded inputs.

Bit inputs (a program input of dtype ``bit``, a dropout keep-mask): given as uint8 of
:func:`cost_model.program.stored_shape`, one bit per element along the last dim in
:func:`autofuse.npu.kernels.dropout.pack_keep`'s format. A tile loads the bytes of its columns (``c0 // 8``
to ``ceil((c0 + cols) / 8)``; chunks are multiples of 8 columns, so each starts on a byte) into a uint8 tile,
and the ``where`` the mask conditions is one Select (``select_bits``) reading those bytes as they were
loaded: no widening, no compare.

Numerics: as :mod:`cost_model.program` specifies (fp32 arithmetic, rounding at casts and outputs).

``tiling``: ``{"rows": R, "chunk": C}``; ``None`` picks the largest whole-row tile that fits UB, capped so
each core has about four tiles, or, when no whole row fits, chunks of the most columns that fit.
"""
from __future__ import annotations

import math

import numpy as np

from autofuse.npu.dtypes import STORAGE
from autofuse.npu.kernels.tiles import (active_mask, ceil_div, extents, largest, lockstep, pipeline, rnd,
                                        ub_need)
from autofuse.npu.kernels.vector import OPS
from autofuse.npu.machine import CapacityError, GMTensor
from autofuse.npu.run import kernel
from cost_model.lowering import bits_aligned, geometry, lower, sweep
from cost_model.program import BIT, STAT, ProgramError, as_program, check_given

F32_LANES = 64                       # fp32 values per repeat; the chunk width is a multiple of it
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "maximum": np.maximum,
           "minimum": np.minimum, "pow": np.power, "eq": np.equal, "ne": np.not_equal, "lt": np.less,
           "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "logical_and": np.logical_and,
           "logical_or": np.logical_or}
_REDUCE = {"sum": np.sum, "mean": np.sum, "max": np.max, "min": np.min}
_MERGE = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}


def temps(op: str) -> int:
    """fp32 work registers elementwise op ``op`` needs (the elementwise kernel's figure)."""
    return OPS[op].temps if op in OPS else 0


def passes(op) -> tuple:
    """The Vector passes of a lowered op, by name."""
    k = op.kind
    if k == "ew":
        return OPS[op.op].passes(op.scalar, op.scalar is not None)
    if k == "reduce":
        return (f"reduce {op.op}",)
    if k == "merge":
        return (f"{op.op} acc",)
    if k == "mean":
        return ("div by duplicated count",)
    if k == "gather":
        return (f"gather {op.op}",)
    if k == "copy":
        return ("copy cat part",)
    if k == "out":
        return (f"{op.op} out",)
    return (k,)


def check_inputs(prog, inputs):
    """The tensors match the program's inputs (shapes and dtypes)."""
    if len(inputs) != len(prog.inputs):
        raise ProgramError(f"vector_program: {len(inputs)} tensors for a program of {len(prog.inputs)} inputs")
    for k, (t, spec) in enumerate(zip(inputs, prog.inputs)):
        check_input("vector_program: input", k, t, spec)


def check_input(what, k, t, spec):
    """Tensor ``t`` holds program input ``spec`` (:func:`cost_model.program.check_given`)."""
    check_given(what, k, None if t is None else (tuple(t.shape), t.dtype), spec)


def default_tiling(dev, prog, per_core_rows: int) -> dict:
    """Whole rows when one fits UB: the most rows that fit, capped so each core has about four tiles of at
    least 4096 values; else the fewest even column chunks (multiples of 64) of which one row fits, and the
    most rows that fit with them."""
    whole = lower(prog, False, temps)
    W = whole.width
    fits = lambda low, r, c=None: ub_need(dev, low.ub_specs(r, c)) <= dev.buffers["UB"]   # noqa: E731
    inner = geometry(prog).inner
    if fits(whole, 1):
        rmax = largest(lambda r: fits(whole, r), 1, min(inner, max(per_core_rows, 1)))
        target = max(per_core_rows * W // 4, 4096)
        return {"rows": int(max(1, min(rmax, target // max(W, 1))))}
    chunked = lower(prog, True, temps)
    k = largest(lambda k: fits(chunked, 1, k * F32_LANES), 1, ceil_div(W, F32_LANES))
    if k < 1:
        raise CapacityError(f"vector_program: not even one row chunk of {F32_LANES} columns fits UB "
                            f"({dev.buffers['UB']:,} B) on {dev.name}")
    C = balanced_chunk(W, k * F32_LANES)
    rmax = largest(lambda r: fits(chunked, r, C), 1, min(inner, max(per_core_rows, 1)))
    return {"rows": int(rmax), "chunk": int(C)}


def balanced_chunk(width: int, most: int) -> int:
    """Chunks of at most ``most`` columns, as even as multiples of 64 allow (no sliver of a last chunk)."""
    n = ceil_div(width, most)
    return min(most, ceil_div(ceil_div(width, n), F32_LANES) * F32_LANES)


def _gm_view(t: GMTensor, shape, name):
    """A GM tensor viewed with the coalesced shape (a copy when its strides do not allow a view)."""
    shape = tuple(int(s) for s in shape)
    if tuple(t.shape) == shape:
        return t
    v = GMTensor(t.data.reshape(shape), t.dtype, name, t.scratch)
    return v


@kernel("vector_program")
def vector_program(launch, *inputs, program=None, tiling=None):
    """Run ``program`` over ``inputs``; returns one tensor per program output (see the module docstring)."""
    prog = as_program(program)
    check_inputs(prog, inputs)
    dev = launch.device
    outs = []
    for j, (o, shape) in enumerate(zip(prog.outputs, prog.output_shapes())):
        outs.append(launch.empty(shape, o.dtype, f"out{j}") if o.dtype != "bool"
                    else GMTensor(np.zeros(shape, dtype=STORAGE["bool"]), "bool", f"out{j}"))
    if prog.rows == 0 or any(math.prod(s) == 0 for s in prog.output_shapes()):
        return tuple(outs)
    geo = geometry(prog)
    tasks1 = geo.tasks(1)
    n0 = min(dev.vector_cores, tasks1)
    t = dict(tiling) if tiling else default_tiling(dev, prog, ceil_div(prog.rows, n0))
    R = max(1, min(int(t.get("rows", 1)), geo.inner))
    whole = lower(prog, False, temps)
    C = t.get("chunk")
    chunked = C is not None and int(C) < whole.width
    low = lower(prog, True, temps) if chunked else whole
    C = int(C) if chunked else None
    if not bits_aligned(low, C):
        raise ProgramError(f"vector_program: chunks of {C} columns: a bit input needs chunks of a multiple of 8 "
                           f"columns (each chunk's bits start on a byte)")
    shares = geo.shares(R, dev.vector_cores)
    g = launch.group("aiv", len(shares))
    gin = []
    for w in low.views:
        var = geo.var[w.input]
        shape = [gs if v else 1 for gs, v in zip(geo.groups, var)] + [inputs[w.input].shape[-1]
                                                                        if prog.inputs[w.input].shape else 1]
        gin.append(_gm_view(inputs[w.input], shape, f"in{w.input}"))
    gout = [_gm_view(o, list(geo.groups) + [o.shape[-1]], o.name) for o in outs]
    tp = TileProgram(g, prog, low, gin, gout, R, C)
    W = low.width
    chunks = [(c0, min(C, W - c0)) for c0 in range(0, W, C)] if C else [(0, W)]
    outer = geo.groups[:-1]

    def item(t, chunk):
        if t is None:
            return None
        j, o = geo.task(t, R)
        r0 = j * R
        oi = tuple(int(i) for i in np.unravel_index(o, outer)) if outer else ()
        return (oi, r0, min(R, geo.inner - r0)) + chunk

    seq = []
    for step in lockstep([list(range(s, s + e)) for s, e in shares]):
        for q, ps in enumerate(low.passes):
            order = list(range(len(chunks))) if q % 2 == 0 else list(reversed(range(len(chunks))))
            for i, c in enumerate(order):    # pass 2 backwards: the chunk pass 1 ended on is still in UB
                seq.append(([item(t, chunks[c]) for t in step], ps, i == 0, i == len(order) - 1))
    with np.errstate(all="ignore"):
        pipeline(((lambda s=s: tp.load(*s)), tp.work) for s in seq)
    return tuple(outs)


class TileProgram:
    """A lowered program executed tile by tile on a group of cores (the ``vector_program`` kernel's tasks,
    and the epilogue of ``matmul_epilogue``).

    A tile is described per core by ``(outer index, first row, rows, first column, columns)`` in the GM views
    ``gin`` (one per load view, coalesced as the geometry says) and ``gout``. ``provide`` maps a view number
    to ``fn(tile, items, act) -> (tile, row)`` that puts the view's values in place itself, instead of a load
    from GM: into the view's own tile (a matmul's product loaded from a workspace), or anywhere in UB (a
    matmul tile staged whole; ``row``: where this block's rows start in it).
    """

    def __init__(self, g, prog, low, gin, gout, R, C, provide=None):
        self.g, self.prog, self.low, self.gin, self.gout, self.R, self.C = g, prog, low, gin, gout, R, C
        self.provide = provide or {}
        self.tiles = [g.alloc("UB", shape, dt, f"r{i}") for i, (shape, dt) in enumerate(low.ub_specs(R, C))]
        self.held = [[None] * g.n for _ in low.views]
        self.slot = [0] * len(low.views)
        self.out_slot = [0] * len(prog.outputs)

    def _region(self, k, it):
        w = self.low.views[k]
        var = self.low.geometry.var[w.input]
        oi, r0, rr, c0, cw = it
        idx = tuple(oi[g] if var[g] else 0 for g in range(len(oi)))
        rows = slice(r0, r0 + rr) if var[-1] else slice(0, 1)
        # a view narrower than the tile's columns (one of two slices of an input) loads only its own
        # one column: a per-row input's, or a one-column slice of a wider input at its offset
        cols = slice(w.offset + c0, w.offset + min(c0 + cw, w.width)) if w.width > 1 else \
            slice(w.offset, w.offset + 1)
        if w.dtype == BIT:                   # the bytes of those columns (c0 is a multiple of 8)
            cols = slice(cols.start // 8, ceil_div(cols.stop, 8))
        return idx + (rows, cols)

    def load(self, items, ps, first, last):
        """MTE2: every view of this pass whose region changed on some core (a provided view: always);
        returns the work's context."""
        act = active_mask(items)
        fresh, cur = set(), {}
        for k in ps.loads:
            if k in self.provide:            # (tile, first row of this tile's block in it)
                # double-buffered like a load: the work of the previous tile may still read the other buffer
                a, b = self.low.in_regs[k]
                if a != b:
                    self.slot[k] ^= 1
                cur[k] = self.provide[k](self.tiles[self.low.in_regs[k][self.slot[k]]], items, act)
                fresh.add(k)
                continue
            regs = [None if it is None else self._region(k, it) for it in items]
            if any(r is not None and r != h for r, h in zip(regs, self.held[k])):
                a, b = self.low.in_regs[k]
                if a != b:
                    self.slot[k] ^= 1
                tile = self.tiles[self.low.in_regs[k][self.slot[k]]]
                self.g.load(tile, self.gin[k], regs, active=act, name=f"load v{k}")
                self.held[k] = [h if r is None else r for r, h in zip(regs, self.held[k])]
                fresh.add(k)
            cur[k] = (self.tiles[self.low.in_regs[k][self.slot[k]]], 0)
        return items, act, ps, first, last, fresh, cur

    def work(self, h):
        """The Vector ops of a tile and its stores (and, after a block's last chunk, the end ops)."""
        items, act, ps, first, last, fresh, cur = h
        re = extents(items, lambda it: it[2])
        cw = extents(items, lambda it: it[4])
        cw_max = int(cw.max())
        for op in ps.ops + (ps.end if last else ()):
            if op.slow and not fresh.intersection(op.views):
                continue
            if op.kind == "merge" and first:
                continue
            self._op(op, re, cw, cw_max, act, cur, first)
        for st in ps.stores + (ps.end_stores if last else ()):
            self._store(st, items, act)

    def _store(self, st, items, act):
        j = st.output
        tile = self.tiles[self.low.out_regs[j][self.out_slot[j]]]
        self.out_slot[j] ^= 1
        # an output narrower than the tile's columns (a rotated slice beside a full-width norm) stores its own
        regs = [None if it is None else tuple(it[0]) + (slice(it[1], it[1] + it[2]),
                                                        slice(it[3], min(it[3] + it[4], st.width))
                                                        if st.width > 1 else slice(0, 1)) for it in items]
        self.g.store(tile, self.gout[j], regs, active=act, name=f"store out{j}")

    # ------------------------------------------------------------------ one Vector op
    def _tile(self, reg, cur):
        if isinstance(reg, tuple):
            if reg[0] == "in":
                return cur[reg[1]][0]
            return self.tiles[self.low.out_regs[reg[1]][self.out_slot[reg[1]]]]
        return self.tiles[reg]

    def _op(self, op, re, cw, cw_max, act, cur, first):
        g = self.g
        dst_reg = op.aux if op.kind in ("reduce", "brcb") and op.aux is not None and not first else op.dst
        dst = self._tile(dst_reg, cur)
        srcs = [None if s.imm is not None else self._tile(s.reg, cur) for s in op.srcs]
        if op.kind == "brcb" and op.aux is not None and not first:
            srcs = [dst]
        temps_ = [self.tiles[t] for t in op.temps]
        geom = sweep(op, re, cw if self.C else None)
        if geom[0] == "brcb":
            reps = ceil_div(geom[1], 8)
        elif geom[0] == "flat":
            reps = g.repeats(geom[1], op.lanes)
        else:
            reps = g.row_repeats(geom[1], geom[2], op.lanes)
        # chunks of C columns: each op covers this chunk's columns, which a narrower op (a half of a product read
        # whole-row by an epilogue, whose chunk is the row) does not fill
        width = op.width if (self.C is None or op.width == 1) else min(op.width, cw_max)
        offs = [cur[s.reg[1]][1] if isinstance(s.reg, tuple) and s.reg[0] == "in" else 0 for s in op.srcs]
        compute = self._compute(op, dst, srcs, width, cw_max, offs, int(re.max(initial=1)))
        names = passes(op)
        reads = tuple(t for t in srcs if t is not None) + tuple(temps_)
        for i, name in enumerate(names):
            lastp = i == len(names) - 1
            g.vector(name, (dst,) if lastp or not temps_ else (temps_[0],), reads, reps, active=act,
                     compute=compute if lastp else None)

    def _compute(self, op, dst, srcs, width, cw, offs, rows):
        """The numerics of ``op`` (fp32, as the program specifies), run when its last pass issues. ``offs``:
        per operand, the first row of this block in its tile (a provided view may hold a whole matmul tile)."""
        kind = op.kind

        def arr(i):
            s, t = op.srcs[i], srcs[i]
            if s.imm is not None:
                return np.float32(s.imm)
            d = t.data
            if offs[i] or (s.rows and d.shape[1] > self.R):
                d = d[:, offs[i]:offs[i] + self.R]
            if s.width == 1:                     # a per-row value (column 0), or one column of a wider value
                return d[:, :, s.col:s.col + 1]
            return d[:, :, s.col:s.col + (s.width if self.C is None else min(s.width, cw))]

        def put(x, col=0, w=None):
            w = width if w is None else w
            dd = dst.data
            if dst.shape[-1] == STAT and op.width == 1:
                view = dd
                x = np.asarray(x)[..., :1] if np.ndim(x) == 3 else x
            else:
                view = dd[:, :, col:col + w]
            if dd.dtype == np.bool_:
                np.copyto(view, np.broadcast_to(np.asarray(x) != 0, view.shape))
            else:
                np.copyto(view, np.broadcast_to(x, view.shape), casting="unsafe")

        if kind in ("cast_in", "brcb"):
            return lambda: put(np.asarray(arr(0), dtype=np.float32))
        if kind == "cast":
            return lambda: put(_convert(arr(0), op.dtype))
        if kind == "out":
            return lambda: put(_convert(arr(0), op.dtype))
        if kind == "reduce":
            fn = _REDUCE[op.op]
            return lambda: put(fn(arr(0), axis=2, keepdims=True).astype(np.float32))
        if kind == "merge":
            fn = _MERGE[op.op]
            return lambda: put(fn(arr(0), arr(1)))
        if kind == "mean":
            return lambda: put(arr(0) / np.float32(op.count))      # torch's mean: the sum divided by the count
        if kind == "copy":
            return lambda: put(arr(0), op.col, op.width)
        if kind == "gather":
            if op.op == "slice":
                start, step = op.aux
                return lambda: put(arr(0)[:, :, start::step][:, :, :op.width])

            def interleave():
                a, b = arr(0), arr(1)
                out = np.empty(a.shape[:2] + (op.width,), dtype=np.float32)
                out[:, :, 0::2], out[:, :, 1::2] = a, b
                put(out)
            return interleave
        if kind == "ew" and op.op == "select_bits":
            # the loaded bytes of this tile's columns (the first is column 0 of the tile), unpacked to the op's width
            def bits():
                d = srcs[0].data
                if offs[0] or (op.srcs[0].rows and d.shape[1] > self.R):
                    d = d[:, offs[0]:offs[0] + self.R]
                return d
            return lambda: put(np.asarray(OPS["select_bits"].fn(bits(), arr(1), arr(2), width), dtype=np.float32))
        ins = self.prog.instrs[op.value - len(self.prog.inputs)]
        return lambda: put(_evaluate(ins.op, [arr(i) for i in range(len(op.srcs))]))


def _convert(x, dtype):
    if dtype == "bool":
        return np.asarray(x) != 0
    return rnd(np.asarray(x, dtype=np.float32), dtype)


def _evaluate(op, args):
    """One program instruction on fp32 (and bool) operands."""
    if op == "where":
        return np.where(args[0], args[1], args[2]).astype(np.float32)
    if op in _BINARY:
        return _BINARY[op](*args)
    if op == "logical_not":
        return np.logical_not(args[0])
    return OPS[op].fn(args[0])


__all__ = ["TileProgram", "check_input", "vector_program", "default_tiling", "passes", "temps"]
