"""The grouped GEMM's weight gradient on the Cube: ``grouped_matmul_weight_grad`` (one launch for all experts,
CANN GroupedMatmul's "split K" grouping, as training uses it) and ``matmul_per_group_weight_grad`` (what eager
runs without it: one ``matmul`` launch per expert).

    npu.run("grouped_matmul_weight_grad", lhs, rhs, group_list)              -> (out,)   out [E, P, Q]
    npu.run("matmul_per_group_weight_grad", lhs, rhs, offs, group_list_type="cumsum")

``lhs [M, P]`` and ``rhs [M, Q]`` hold the rows of every group one after another (``group_list`` as for
``grouped_matmul``: rows per group, or their running sum with ``group_list_type="cumsum"``); group g gives
``out[g] = lhs[rows_g]ᵀ @ rhs[rows_g]``, fp32 accumulation, one rounding to ``out_dtype`` (default lhs's).
The groups split the contraction axis, not the output: every group has an output block of its own. For a
``grouped_matmul`` ``y = x @ w[g]`` (``w [E, K, N]``) with output gradient ``dy``, ``dw = kernel(x, dy)``
is ``[E, K, N]``; for ``w`` stored ``[E, N, K]`` (``trans_w``), ``dw = kernel(dy, x)`` is ``[E, N, K]``. A
group with no rows gets a zero block (its weight had no use); rows past the last group are not read.

*grouped_matmul_weight_grad*: the output tiles of every non-empty group (groups in order; within a group the
blocks along the wider output dim innermost: the operand block of the narrower dim is read by them back to
back and comes from HBM once, and the other operand, read again for each outer block, is the smaller one,
which the L2 holds) are dealt to the cube cores by load (the least-loaded core first; an item's load is the slower of its
Cube fractals and its GM bytes at the MTE2 rate). Per tile: the group's rows in chunks of k1 (GM→L1,
double-buffered; the lhs chunk loaded transposed, as the ND→NZ load does), slices of k0 rows (L1→L0A/L0B,
double-buffered), fp32 accumulation in L0C; the tile leaves by FixPipe (split, cast on the way) or L0C→UB
(cast)→MTE3 (coupled). A chunk's rows beyond the group are zero in L1 (the load zero-fills), so the product
over whole slices is exact. Cores step in lockstep over their items, each core running as many row chunks
as its own item has. Zero blocks of empty groups are written by the Vector side (coupled: the same cores;
split: the AIVs): a UB tile set to 0 once, then one MTE3 store per block, dealt round-robin.

*matmul_per_group_weight_grad*: for each non-empty group, in order, one launch of the ``matmul`` kernel on
``lhs[rows_g]ᵀ @ rhs[rows_g]`` (``trans_a``), each with its launch overhead and a cold L2, as
``transformers``' grouped_mm fallback backward runs them (``tiling={"by_rows": {rows: matmul tiling}}``).
Its zero-filled output (``torch.zeros_like(weight)`` before the loop) is not priced: the baseline is the
per-expert GEMMs alone.

``tiling`` (grouped_matmul_weight_grad): ``{"m0", "n0", "k0", "k1"}``, m0 × n0 the output tile, k0/k1 along
the group's rows.
"""
from __future__ import annotations

import numpy as np

from autofuse.npu.dtypes import itemsize
from autofuse.npu.kernels.grouped_matmul import CUBE_DTYPES, deal, group_rows, in_sequence
from autofuse.npu.kernels.matmul import matmul as _matmul_kernel
from autofuse.npu.kernels.tiles import ceil_div, round_up
from autofuse.npu.machine import GMTensor
from autofuse.npu.run import kernel
from cost_model.grouped_matmul_tiling import (weight_grad_default_tiling as default_tiling,
                                              weight_grad_tiling_fits as tiling_fits)


def items_of(starts, counts, P, Q, m0, n0):
    """Output tiles ``(group, first row, rows, p0, p extent, q0, q extent)`` of every group, groups in order;
    within a group, the blocks of the narrower operand innermost (``P <= Q``: row blocks, each reading an lhs
    block while the rhs block stays; else column blocks), so the operand read again for every outer block is
    the smaller one, which the L2 holds. Empty groups' tiles have 0 rows."""
    out = []
    for gi, (s, c) in enumerate(zip(starts.tolist(), counts.tolist())):
        blocks = [(p0, q0) for q0 in range(0, Q, n0) for p0 in range(0, P, m0)] if P <= Q else \
            [(p0, q0) for p0 in range(0, P, m0) for q0 in range(0, Q, n0)]
        out += [(gi, s, c, p0, min(m0, P - p0), q0, min(n0, Q - q0)) for p0, q0 in blocks]
    return out


def item_load(device, dtype, item) -> float:
    """A tile's load for the deal: the slower of its Cube fractals and its GM bytes at the MTE2 rate."""
    _, _, rows, _, pe, _, qe = item
    cube = ceil_div(pe, 16) * ceil_div(qe, 16) * ceil_div(rows, device.cube_k0[dtype])
    return max(cube, (pe + qe) * rows * itemsize(dtype) / device.rates["GM->L1"])


def _check(lhs, rhs, group_list):
    for name, t in (("lhs", lhs), ("rhs", rhs)):
        if t.dtype not in CUBE_DTYPES:
            raise TypeError(f"grouped_matmul_weight_grad: {name} is {t.dtype}; the Cube takes {', '.join(CUBE_DTYPES)}")
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"grouped_matmul_weight_grad: lhs is {lhs.dtype}, rhs is {rhs.dtype}; cast one of them first")
    if lhs.data.ndim != 2 or rhs.data.ndim != 2 or lhs.shape[0] != rhs.shape[0]:
        raise ValueError(f"grouped_matmul_weight_grad: lhs [M, P] and rhs [M, Q] must share their rows, got "
                         f"{list(lhs.shape)} and {list(rhs.shape)}")
    if np.asarray(group_list.data).ndim != 1:
        raise ValueError(f"grouped_matmul_weight_grad: group_list must be 1-D [E], got {list(group_list.shape)}")


@kernel("grouped_matmul_weight_grad", steer=("group_list",))
def grouped_matmul_weight_grad(launch, lhs, rhs, group_list, group_list_type="count", out_dtype=None,
                               tiling=None):
    """``out[g] = lhs[rows_g]ᵀ @ rhs[rows_g]`` for every group g, one launch (module docstring)."""
    _check(lhs, rhs, group_list)
    return _WeightGrad(launch, lhs, rhs, group_list, group_list_type, out_dtype or lhs.dtype, tiling).run()


class _WeightGrad:
    """One launch: allocations, the deal, the per-step Cube program and the zero blocks."""

    def __init__(self, launch, lhs, rhs, group_list, glt, out_dtype, tiling):
        dev = self.dev = launch.device
        self.launch, self.lhs, self.rhs, self.out_dtype = launch, lhs, rhs, out_dtype
        self.dtype = lhs.dtype
        M, P = lhs.shape
        Q = rhs.shape[1]
        self.group_list = group_list
        E = np.asarray(group_list.data).size
        self.starts, self.counts = group_rows(group_list.data, glt, M)
        zeros = bool((self.counts == 0).any())
        t = dict(tiling) if tiling else default_tiling(dev, self.dtype, out_dtype, P, Q,
                                                       int(self.counts.sum()) // max(E, 1), zeros)
        if not tiling_fits(dev, self.dtype, out_dtype, t, zeros):
            raise ValueError(f"grouped_matmul_weight_grad tiling {t} does not fit the buffers of {dev.name}")
        self.t = t
        self.out = launch.empty((E, P, Q), out_dtype, "dw")
        every = items_of(self.starts, self.counts, P, Q, t["m0"], t["n0"])
        self.items = [it for it in every if it[2] > 0]
        self.zeros = [it for it in every if it[2] == 0]
        self.per = deal([item_load(dev, self.dtype, it) for it in self.items], dev.cube_cores) if self.items \
            else [[]]
        self.n = len(self.per)
        self.split = dev.arch == "split"

    def alloc(self):
        t, g, n, dtype = self.t, None, self.n, self.dtype
        m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
        g = self.cg = self.launch.group("aic" if self.split else "core", n)
        self.gl = g.alloc("L1", (round_up(np.asarray(self.group_list.data).size, 8),), "int32", "group list")
        self.a1 = [g.alloc("L1", (m0, k1), dtype, f"a1_{i}") for i in range(2)]
        self.b1 = [g.alloc("L1", (k1, n0), dtype, f"b1_{i}") for i in range(2)]
        self.a0 = [g.alloc("L0A", (m0, k0), dtype, f"a0_{i}") for i in range(2)]
        self.b0 = [g.alloc("L0B", (k0, n0), dtype, f"b0_{i}") for i in range(2)]
        self.nc = 2 if 2 * m0 * n0 * 4 <= self.dev.buffers["L0C"] else 1
        self.c0 = [g.alloc("L0C", (m0, n0), "float32", f"c_{i}") for i in range(self.nc)]
        if not self.split:
            self.ub = [g.alloc("UB", (m0, n0), self.out_dtype, f"ub_{i}") for i in range(2)]

    def run(self):
        self.alloc()
        g, n = self.cg, self.n
        E = np.asarray(self.group_list.data).size
        # every core reads the group list and walks its entries (Scalar bookkeeping, empty groups included)
        gl = GMTensor(np.asarray(self.group_list.data).reshape(-1), self.group_list.dtype, "group_list")
        g.load(self.gl, gl, [(slice(0, E),)] * n, name="load group list")
        g._exec("scalar", np.full(n, float(E * self.dev.scalar_issue_cycles)), reads=(self.gl,),
                name="walk group list")
        if self.zeros:
            self.zero_blocks()
        self.slot0 = self.slot1 = 0
        for s in range(max(len(p) for p in self.per)):
            self.step(s, [self.items[p[s]] if s < len(p) else None for p in self.per])
        return (self.out,)

    def zero_blocks(self):
        """Empty groups' blocks: one UB tile set to 0 (one Vector pass), then an MTE3 store per block, dealt
        round-robin over the Vector side's cores."""
        t, od = self.t, self.out_dtype
        vg = self.cg if not self.split else self.launch.group("aiv", min(2 * self.dev.cube_cores,
                                                                         len(self.zeros)))
        z = vg.alloc("UB", (t["m0"], t["n0"]), od, "zeros")

        def fill():
            z.data[...] = 0

        vg.vector("dup 0", (z,), (), vg.repeats(t["m0"] * t["n0"], od), compute=fill)
        for s in range(0, len(self.zeros), vg.n):
            part = self.zeros[s:s + vg.n]
            regs = [(it[0], slice(it[3], it[3] + it[4]), slice(it[5], it[5] + it[6])) for it in part] + \
                [None] * (vg.n - len(part))
            vg.store(z, self.out, regs, name="store zero block")

    def step(self, s, mine):
        g, t = self.cg, self.t
        k0, k1 = t["k0"], t["k1"]
        isz = itemsize(self.dtype)
        present = np.array([it is not None for it in mine])
        rows = np.array([it[2] if it else 0 for it in mine])
        pe = np.array([it[4] if it else 0 for it in mine])
        qe = np.array([it[6] if it else 0 for it in mine])
        acc = self.c0[s % self.nc]
        for kk in range(ceil_div(int(rows.max()), k1)):
            live = present & (rows > kk * k1)          # cores whose tile still has rows in this chunk
            act = None if live.all() else live
            r0 = [it[1] + kk * k1 if it else 0 for it in mine]
            rc = np.minimum(k1, np.maximum(rows - kk * k1, 0))
            A1, B1 = self.a1[kk % 2], self.b1[kk % 2]
            g.load(A1, self.lhs, [(slice(r0[c], r0[c] + rc[c]), slice(it[3], it[3] + it[4])) if live[c] else None
                                  for c, it in enumerate(mine)], active=act, fn=np.transpose, name="load lhsT")
            g.load(B1, self.rhs, [(slice(r0[c], r0[c] + rc[c]), slice(it[5], it[5] + it[6])) if live[c] else None
                                  for c, it in enumerate(mine)], active=act, name="load rhs")
            for kq in range(ceil_div(int(rc.max()), k0)):
                kv = np.minimum(k0, np.maximum(rc - kq * k0, 0))
                sl_live = live & (kv > 0)
                sact = None if sl_live.all() else sl_live
                A0, B0 = self.a0[self.slot0 % 2], self.b0[self.slot0 % 2]
                self.slot0 += 1
                sl = slice(kq * k0, (kq + 1) * k0)
                g.move(A0, A1, fn=lambda d, sl=sl: d[:, :, sl], nbytes=round_up(pe, 16) * kv * isz, active=sact)
                g.move(B0, B1, fn=lambda d, sl=sl: d[:, sl, :], nbytes=kv * round_up(qe, 16) * isz, active=sact)
                g.mmad(acc, A0, B0, pe, kv, qe, accumulate=not (kk == 0 and kq == 0), active=sact)
        act = None if present.all() else present
        regs = [None if it is None else (it[0], slice(it[3], it[3] + it[4]), slice(it[5], it[5] + it[6]))
                for it in mine]
        if self.split:
            g.store(acc, self.out, regs, active=act, name="FixPipe dw")
            return
        U = self.ub[self.slot1 % 2]
        self.slot1 += 1
        g.move(U, acc, nbytes=pe * qe * 4, active=act, name="L0C->UB")
        g.store(U, self.out, regs, active=act, name="store dw")


# ------------------------------------------------------------------------------------------ per group
@kernel("matmul_per_group_weight_grad", steer=("group_list",))
def matmul_per_group_weight_grad(launch, lhs, rhs, group_list, group_list_type="cumsum", tiling=None):
    """One ``matmul`` launch (``trans_a``) per non-empty group, in order (transformers' fallback backward)."""
    _check(lhs, rhs, group_list)
    M, P = lhs.shape
    starts, counts = group_rows(group_list.data, group_list_type, M)
    out = launch.empty((counts.size, P, rhs.shape[1]), lhs.dtype, "dw")
    by_rows = {int(k): v for k, v in ((tiling or {}).get("by_rows") or {}).items()}

    def call(gi, s, c):
        def run(sub):
            a = GMTensor(lhs.data[s:s + c], lhs.dtype, "lhs")
            b = GMTensor(rhs.data[s:s + c], rhs.dtype, "rhs")
            y, = _matmul_kernel(sub, a, b, trans_a=True, tiling=by_rows.get(c))
            return lambda: out.data.__setitem__(gi, y.data)
        return run

    in_sequence(launch, [call(gi, s, c) for gi, (s, c) in enumerate(zip(starts.tolist(), counts.tolist())) if c])
    return (out,)


__all__ = ["grouped_matmul_weight_grad", "matmul_per_group_weight_grad", "default_tiling", "tiling_fits",
           "items_of", "item_load"]
