"""``matmul_epilogue``: a Cube matmul whose output tiles run a Vector program before their one store.

    npu.run("matmul_epilogue", a, b, *extra, program=prog, bias=None, trans_b=False, tiling=None)

``prog`` (:class:`cost_model.program.Program`) takes the product ``a @ b (+ bias)`` as its input 0, float32
of shape ``(*a.shape[:-1], N)``, and ``extra`` as its inputs 1..; its outputs are the kernel's outputs.
GELU, a scale, a residual add, a cast: the program reads input 0 whole. SwiGLU over a fused gate_up
projection (``b`` holds the gate columns then the up columns): the program reads input 0 as two column
blocks, ``silu(slice(acc, 0, F)) * slice(acc, F, 2F)``; the kernel then computes, per output tile of ``n0``
columns, the matching gate and up columns in the same step (two accumulators, each K slice of A moved to
L0A once), and writes ``F`` columns, never the ``2F`` of the projection. Any set of equal-width column
blocks of the product works the same way (its *pieces*).

The product input may be float32 (the accumulator itself) or the operands' dtype (the product rounded to
fp16/bf16, which is what eager's matmul hands to the next op). An extra input may be a ``bit`` input (a
dropout keep-mask, uint8 of :func:`cost_model.program.stored_shape`: bias -> dropout -> residual add): tiles
then have a multiple of 8 columns, so that each tile's bits start on a byte.

Schedule (:class:`autofuse.npu.kernels.matmul.Cube` for the Cube side; the Vector side is the program's
tile schedule, :class:`autofuse.npu.kernels.vector_program.TileProgram`):

* coupled cores (910, 310P): each core owns its tiles. When tile s's K loop is done, FixPipe moves its
  accumulators L0C -> UB in one go, converting to the product's dtype, into a staging tile; L0C is then free
  for tile s+1. While the Cube computes tile s+1, the Vector unit runs the program over the staged tile in
  sub-blocks of ``sub`` rows and stores the outputs; its sub-blocks are issued between tile s+1's K
  chunks, so its loads (a residual, a weight) queue between the A/B loads rather than behind all of them.
  The next FixPipe into the staging tile waits for the program to have read it. The pre-activation never
  goes to GM.
* split cores (910B): the AIC computes tile s and FixPipe writes each piece, in the product's dtype, to a
  workspace in GM (two slots per core; it stays in L2); the two AIVs paired with the AIC each load half of
  the tile's rows sub-block by sub-block, run the program and store the outputs. An AIV's load waits for
  the AIC's write of the slot; the AIC's next write of that slot waits for both AIVs' reads.

A program with a reduction or a column shuffle needs whole rows: its tiles are then as wide as its rows.

``tiling``: ``{"m0", "n0" (program columns per tile), "k0", "k1", "sub" (rows per epilogue sub-block)}``.
"""
from __future__ import annotations

import math

import numpy as np

from autofuse.npu.kernels.matmul import CUBE_DTYPES, Cube, default_tiling as mm_default_tiling
from autofuse.npu.kernels.tiles import active_mask, ceil_div
from autofuse.npu.kernels.vector_program import TileProgram, _gm_view, check_input, temps
from autofuse.npu.machine import GMTensor
from autofuse.npu.run import kernel
from cost_model.lowering import epilogue_default_tiling, epilogue_fits as fits, epilogue_plan
from cost_model.program import ProgramError, as_program


def default_tiling(dev, prog, M, N, K, dtype) -> dict:
    """The plain matmul's default tile for the columns the epilogue reads (``pieces`` blocks of ``n0``), as
    wide as the row for whole-row programs, made smaller while UB cannot stage it; the most sub-block rows
    that fit UB (:func:`cost_model.lowering.epilogue_default_tiling`, shared with the cost model)."""
    plan = epilogue_plan(prog, M, N, dtype, temps)
    _, pieces, W, _ = plan
    mm_tile = mm_default_tiling(dev, M, W * len(pieces), K, 1, dtype, dtype)
    return epilogue_default_tiling(dev, plan, K, dtype, mm_tile,
                                   lambda t: lambda r: fits(dev, prog, M, N, dtype, {**t, "sub": r}, temps, plan))


@kernel("matmul_epilogue")
def matmul_epilogue(launch, a, b, *extra, program=None, bias=None, trans_b=False, tiling=None):
    """``program(a @ b (+ bias), *extra)`` with the matmul's output tiles fed to the program on chip (see the
    module docstring)."""
    prog = as_program(program)
    dev = launch.device
    for nm, t_ in (("a", a), ("b", b)):
        if t_.dtype not in CUBE_DTYPES or t_.data.ndim < 2:
            raise TypeError(f"matmul_epilogue: {nm} is {t_.dtype} {list(t_.shape)}; the Cube takes 2+-D "
                            f"{', '.join(CUBE_DTYPES)}")
    if a.dtype != b.dtype:
        raise TypeError(f"matmul_epilogue: a is {a.dtype}, b is {b.dtype}")
    if b.data.ndim != 2:
        raise ValueError(f"matmul_epilogue: b must be a [K, N] (or [N, K] with trans_b) matrix, got {list(b.shape)}")
    K = a.shape[-1]
    N = b.shape[0] if trans_b else b.shape[1]
    if (b.shape[1] if trans_b else b.shape[0]) != K:
        raise ValueError(f"matmul_epilogue: inner dims differ: a {list(a.shape)}, b {list(b.shape)}"
                         f"{' (transposed)' if trans_b else ''}")
    M = math.prod(a.shape[:-1])
    low, pieces, W, whole = epilogue_plan(prog, M, N, a.dtype, temps)
    P = len(pieces)
    if bias is not None and P > 1:
        raise ProgramError("matmul_epilogue: a bias with column blocks: give it to the program as a per-col input")
    if len(extra) != len(prog.inputs) - 1:
        raise ProgramError(f"matmul_epilogue: {len(extra)} extra tensors for a program of {len(prog.inputs) - 1}")
    for k, (t_, spec) in enumerate(zip(extra, prog.inputs[1:])):
        check_input("matmul_epilogue: extra input", k, t_, spec)
    outs = [launch.empty(shape, o.dtype, f"out{j}") for j, (o, shape) in
            enumerate(zip(prog.outputs, prog.output_shapes()))]
    if M == 0 or W == 0:
        return tuple(outs)
    t = dict(tiling) if tiling else default_tiling(dev, prog, M, N, K, a.dtype)
    if not fits(dev, prog, M, N, a.dtype, t, temps):
        raise ValueError(f"matmul_epilogue tiling {t} does not fit the buffers of {dev.name} (L0C: {P} "
                         f"accumulator(s) of m0 x n0; UB: the staged tile and the program's registers for "
                         f"{t.get('sub')} rows; a bit input: n0 a multiple of 8)")
    _Epilogue(launch, prog, low, pieces, W, a, b, extra, outs, bias, trans_b, t).run()
    return tuple(outs)


class _Epilogue:
    def __init__(self, launch, prog, low, pieces, W, a, b, extra, outs, bias, trans_b, t):
        dev = launch.device
        self.launch, self.prog, self.low, self.pieces, self.W = launch, prog, low, pieces, W
        self.a = GMTensor(a.data.reshape(-1, a.shape[-1]), a.dtype, a.name)
        self.a.id = a.id
        self.b, self.bias, self.trans_b, self.t = b, bias, trans_b, t
        self.M, self.K = self.a.shape
        m0, n0 = t["m0"], t["n0"]
        self.items = [(mi, ni) for mi in range(ceil_div(self.M, m0)) for ni in range(ceil_div(W, n0))]
        self.split = dev.arch == "split"
        n = self.n = min(dev.cube_cores, len(self.items))
        self.cg = launch.group("core" if not self.split else "aic", n)
        self.vg = self.cg if not self.split else launch.group("aiv", 2 * n)
        self.cube = Cube(self.cg, a.dtype, {**t, "n0": n0}, bias=bias is not None, pieces=len(pieces))
        pdt = prog.inputs[0].dtype
        if not self.split:           # the finished tile, staged in UB in the product's dtype
            rows = ceil_div(m0, t["sub"]) * t["sub"]
            self.stage = [self.vg.alloc("UB", (rows, n0), pdt, f"stage_{p}") for p in range(len(pieces))]
        # GM views of the extra inputs and the outputs, [rows or 1, width] (the geometry has one row group)
        var = low.geometry.var
        gin = [None if w.input == 0 else
               _gm_view(extra[w.input - 1], (self.M if var[w.input][0] else 1, extra[w.input - 1].shape[-1]
                                             if prog.inputs[w.input].shape else 1), f"in{w.input}")
               for w in low.views]
        gout = [_gm_view(o, (self.M, o.shape[-1]), o.name) for o in outs]
        provide = {k: self._provider(k) for k, w in enumerate(low.views) if w.input == 0}
        self.tp = TileProgram(self.vg, prog, low, gin, gout, t["sub"], min(n0, W), provide)
        if self.split:
            self.ws = launch.empty((n, 2, m0, n0 * len(pieces)), pdt, "ws_acc", scratch=True)
            self.read_end = {}           # (step) -> per-AIC end of both AIVs' workspace reads
        self.ctx = None                   # the tile the epilogue is working on (set per sub-block)

    # ------------------------------------------------------------------ the product into the program
    def _provider(self, k):
        p = self.pieces.index(self.low.views[k].offset)

        def provide(tile, items, act):
            e = self.ctx
            r, sub = e["r"], self.t["sub"]
            if not self.split:       # the staged tile: rows [r*sub, ...) of it
                return self.stage[p], r * sub
            n0 = self.t["n0"]        # the AIV's rows of the tile, from the workspace slot the AIC wrote
            regs = [None if it is None else (c // 2, e["slot"], slice(e["row0"][c] + r * sub,
                                                                      e["row0"][c] + r * sub + it[2]),
                                             slice(p * n0, p * n0 + it[4])) for c, it in enumerate(items)]
            end = self.vg.load(tile, self.ws, regs, active=act, deps=(np.repeat(e["written"], 2),),
                               name="load product")
            e["reads"].append(np.where([it is not None for it in items], end, 0.0))
            return tile, 0
        return provide

    # ------------------------------------------------------------------ the launch
    def _tile(self, step):
        n, m0, n0 = self.n, self.t["m0"], self.t["n0"]
        mine = [self.items[step * n + c] if step * n + c < len(self.items) else None for c in range(n)]
        m_ext = np.array([min(m0, self.M - it[0] * m0) if it else 0 for it in mine])
        n_ext = np.array([min(n0, self.W - it[1] * n0) if it else 0 for it in mine])
        return mine, m_ext, n_ext

    def _cube(self, step):
        """Issue the K loop of a step's tiles (a generator: one K chunk per next())."""
        mine, m_ext, n_ext = self._tile(step)
        m0, n0 = self.t["m0"], self.t["n0"]
        act = active_mask(mine)
        rows = [None if it is None else slice(it[0] * m0, it[0] * m0 + m_ext[c]) for c, it in enumerate(mine)]
        cols = [[None if it is None else slice(off + it[1] * n0, off + it[1] * n0 + n_ext[c])
                 for c, it in enumerate(mine)] for off in self.pieces]
        acc = self.cube.acc[step % self.cube.nc]
        yield from self.cube.accumulate(self.a, self.b, [()] * self.n, [()] * self.n, rows, cols, m_ext, n_ext,
                                        self.K, act, acc, self.bias, False, self.trans_b)
        self.done = (acc, m_ext, n_ext, act)
        if self.split:               # FixPipe each piece to this core's workspace slot
            slot = step % 2
            deps = self.read_end.get(step - 2, ())
            deps = (deps,) if len(deps) else ()
            ends = []
            half, sub = ceil_div(m0, 2), self.t["sub"]
            # written in the regions the AIVs read (sub-blocks of each half), so that their reads hit L2
            for h in range(2):
                for r in range(ceil_div(half, sub)):
                    r0 = h * half + r * sub
                    rr = np.clip(np.minimum(m_ext, (h + 1) * half) - r0, 0, sub)
                    if not rr.any():
                        continue
                    for p, a_ in enumerate(acc):
                        regs = [None if it is None or rr[c] == 0 else
                                (c, slot, slice(r0, r0 + int(rr[c])), slice(p * n0, p * n0 + n_ext[c]))
                                for c, it in enumerate(mine)]
                        ends.append(self.cg.store(a_, self.ws, regs, deps=deps, name="FixPipe product->GM",
                                                  fn=lambda x, r0=r0, n=sub: x[r0:r0 + n]))
            self.written = {step: np.where(act if act is not None else True, np.max(ends, axis=0), 0.0)}

    def _epilogue(self, step):
        """Issue the epilogue of a step's tiles, sub-block by sub-block (one per next()), pipelined: the
        product and the inputs of sub-block r+1 come in while the Vector unit works on sub-block r."""
        mine, m_ext, n_ext = self._tile(step)
        m0, n0, sub = self.t["m0"], self.t["n0"], self.t["sub"]
        if self.split:               # AIV 2c+h takes rows [h*half, (h+1)*half) of core c's tile
            half = ceil_div(m0, 2)
            row0 = np.tile([0, half], self.n)
            rows_v = np.clip(np.repeat(m_ext, 2) - row0, 0, half)
            base = [None if it is None else it[0] * m0 for it in mine for _ in range(2)]
            cols0 = [None if it is None else it[1] * n0 for it in mine for _ in range(2)]
            n_v = np.repeat(n_ext, 2)
            e = {"acc": None, "slot": step % 2, "row0": row0, "written": self.written[step], "reads": []}
        else:
            rows_v, row0, n_v = m_ext, np.zeros(self.n, dtype=int), n_ext
            base = [None if it is None else it[0] * m0 for it in mine]
            cols0 = [None if it is None else it[1] * n0 for it in mine]
            e = {"slot": 0, "row0": row0}
        nsub = ceil_div(int(rows_v.max(initial=0)), sub)
        ps = self.low.passes[0]

        def items(r):
            return [None if base[c] is None or rows_v[c] <= r * sub else
                    ((), int(base[c] + row0[c] + r * sub), int(min(sub, rows_v[c] - r * sub)), int(cols0[c]),
                     int(n_v[c])) for c in range(len(base))]

        prev = None
        for r in range(nsub):
            self.ctx = dict(e, r=r)
            h = self.tp.load(items(r), ps, True, True)
            if prev is not None:
                self.tp.work(prev)
            prev = h
            yield r
        if prev is not None:
            self.tp.work(prev)
        if self.split and e["reads"]:
            self.read_end[step] = np.max(np.stack(e["reads"]), axis=0).reshape(self.n, 2).max(axis=1)

    def _stage(self):
        """FixPipe: the finished tile's accumulators L0C -> UB staging, converted to the product's dtype."""
        acc, m_ext, n_ext, act = self.done
        for p, a_ in enumerate(acc):
            self.cg.move(self.stage[p], a_, nbytes=m_ext * n_ext * 4, active=act, name="FixPipe L0C->UB")

    def run(self):
        steps = ceil_div(len(self.items), self.n)
        with np.errstate(all="ignore"):
            for s in range(steps):
                cube = self._cube(s)
                if self.split:
                    for _ in cube:
                        pass
                    for _ in self._epilogue(s):
                        pass
                    continue
                # coupled: tile s-1's epilogue sub-blocks between tile s's K chunks, then tile s to staging
                ep = self._epilogue(s - 1) if s > 0 else iter(())
                for _ in cube:
                    next(ep, None)
                for _ in ep:
                    pass
                self._stage()
            if not self.split and steps:
                for _ in self._epilogue(steps - 1):
                    pass


__all__ = ["matmul_epilogue", "default_tiling"]
