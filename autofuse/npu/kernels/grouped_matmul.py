"""Grouped GEMM on the Cube: ``grouped_matmul`` (one launch for all experts) and ``matmul_per_group``
(what eager runs without it: one ``matmul`` launch per expert).

    npu.run("grouped_matmul", x, w, group_list, bias, activation="swiglu")        -> (y,)
    npu.run("grouped_matmul", x, w, group_list, activation="swiglu", return_product=True)  -> (y, p)
    npu.run("matmul_per_group", x, w, offs, group_list_type="cumsum")             -> (y,)

``x [M, K]`` holds the rows of every group one after another; ``group_list [E]`` gives the rows per group
(``group_list_type="count"``) or their running sum (``"cumsum"``, transformers' ``offs``). ``w`` is
``[E, K, N]``, or ``[E, N, K]`` with ``trans_w=True`` (how transformers stores ``gate_up_proj`` and
``down_proj``). Group g: ``y[rows_g] = act(x[rows_g] @ w[g] + bias[g])``; rows past the last group are 0.

Epilogues (Vector, fp32, before the store): ``relu``, ``gelu``, ``gelu_tanh``, ``silu`` (the passes of the
``elementwise`` kernel's ops), and ``swiglu``: the product has 2·N' columns, gate and up halves, and the
output ``silu(gate) · up`` has N' (``swiglu_order="gate_up"``: gate first, as transformers'
``chunk(2, dim=-1)`` splits ``gate_up_proj``'s output; ``"up_gate"``: up first; ``"interleaved"``: gate and up
alternate, gate at the even columns, as GPT-OSS's ``gate_up_proj`` holds them). An output tile of n0
columns computes its gate and up columns side by side (two B tiles, two accumulators), so the product
never leaves the core unfinished; interleaved, the two accumulators take the two halves of the tile's 2·n0
contiguous weight columns (pairs), and the epilogue gathers the even and odd columns apart (two more Vector
passes, as a GatherMask by pattern does). ``clamped_swiglu`` (GPT-OSS's experts): ``g = min(gate, limit)``,
``u = clamp(up, -limit, limit)``, output ``(u + 1) · g · sigmoid(alpha · g)``.

``return_product=True`` (with an epilogue; a training forward, whose backward needs the product): the kernel
also writes the pre-activation product ``p [M, N] = x[rows_g] @ w[g] + bias[g]`` in the output dtype (SwiGLU:
both halves, each in its own columns of the weight's gate/up order), so the backward reads it instead of
recomputing it. The epilogue already holds each fp32 product tile in UB: the Vector unit casts it into a
second pair of UB tiles (double-buffered; an fp32 product is stored straight from its tile) and MTE3 stores
it after the output tile, through the same path; ``y`` is unchanged.

*grouped_matmul*: the tiles (group, column block, row block) of every group, row blocks innermost (a
group's B column block is read by its row blocks back to back, so it comes from HBM once), are dealt to
the cube cores by load (each to the least-loaded core; an item's load is the slower of its Cube fractals
and its GM bytes at the MTE2 rate). Per tile, as the ``matmul`` kernel: K in chunks of k1 (GM→L1,
double-buffered), slices of k0 (L1→L0A/L0B, double-buffered), fp32 accumulation in L0C, a bias seeding the
accumulator. Without an epilogue the tile leaves by FixPipe (split) or FixPipe→UB→MTE3 (coupled), cast
on the way. With one: coupled cores move L0C→UB in fp32, the Vector unit runs it and casts, MTE3 stores;
split cores (910B) write the fp32 tile to a GM workspace slot (FixPipe), the two AIVs paired with the AIC
each load half of its rows (half of a short row block too), run the epilogue and store, as flash_attention
hands S and O_j over; two slots per AIC, so the Cube runs a tile ahead. The fp32 product tiles in UB are
double-buffered where UB holds two sets, so the next tile's product comes in while the Vector unit runs this
one's epilogue. Empty groups cost only the Scalar unit's bookkeeping: every core
reads the group list and walks its E entries (one cycle each [A]).

*matmul_per_group*: for each non-empty group, in order, one launch of the ``matmul`` kernel on that
group's rows (its own tiling: ``tiling={"by_rows": {rows: matmul tiling}}``, else the kernel's default),
one after another: each with its launch overhead and a cold L2, as separate launches run. A padded batched
matmul (every group padded to the largest) would launch once but multiply padding: at decode loads that
is cheaper only while the padding stays small, and it needs the group sizes on the host anyway; one
launch per expert is what ``transformers.grouped_mm_fallback`` does, so that is what is simulated.

``tiling`` (grouped_matmul): ``{"m0", "n0", "k0", "k1"}`` as the matmul kernel's, n0 counting output
columns.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from autofuse.npu.dtypes import itemsize
from autofuse.npu.kernels.matmul import matmul as _matmul_kernel
from autofuse.npu.kernels.tiles import ceil_div, pad, rnd, round_up
from autofuse.npu.kernels.vector import OPS
from autofuse.npu.machine import GMTensor, L2, Launch
from autofuse.npu.run import kernel
# the tile geometry, shared with the cost model (GLU: the gated activations)
from cost_model.grouped_matmul_tiling import GLU, default_tiling, product_sets, tiling_fits

CUBE_DTYPES = ("float16", "bfloat16", "float32")
ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu", "swiglu", "clamped_swiglu")
ORDERS = ("gate_up", "up_gate", "interleaved")
#: Vector passes per output element that gather interleaved gate/up pairs apart (the even and the odd columns)
DEINTERLEAVE_PASSES = 2


def epilogue_passes(activation, order="gate_up") -> int:
    """fp32 Vector passes of an epilogue per output element (the cast to the output dtype not included)."""
    if activation is None:
        return 0
    extra = DEINTERLEAVE_PASSES if activation in GLU and order == "interleaved" else 0
    if activation == "swiglu":
        return len(OPS["silu"].passes(None, False)) + 1 + extra
    if activation == "clamped_swiglu":       # mins, maxs + mins, muls alpha, sigmoid, mul, adds 1, mul
        return len(OPS["sigmoid"].passes(None, False)) + 7 + extra
    return len(OPS[activation].passes(None, False))


def group_rows(counts_or_offsets, group_list_type, M):
    """``(starts, counts)`` per group from a group list; errors name what is wrong."""
    gl = np.asarray(counts_or_offsets).reshape(-1).astype(np.int64)
    if group_list_type == "cumsum":
        if (np.diff(gl) < 0).any() or (gl.size and gl[0] < 0):
            raise ValueError(f"grouped_matmul: group_list (cumsum) must be non-decreasing, got {gl.tolist()[:16]}")
        counts = np.diff(np.concatenate([[0], gl]))
    elif group_list_type == "count":
        if (gl < 0).any():
            raise ValueError(f"grouped_matmul: group_list (count) has a negative count: {gl.tolist()[:16]}")
        counts = gl
    else:
        raise ValueError(f"grouped_matmul: group_list_type={group_list_type!r}; choose 'count' or 'cumsum'")
    if counts.sum() > M:
        raise ValueError(f"grouped_matmul: group_list covers {int(counts.sum())} rows, x has only {M}")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return starts, counts


def items_of(starts, counts, N_out, m0, n0):
    """Work items ``(group, row0, rows, col0, cols)``: groups in order, column blocks, row blocks innermost."""
    out = []
    for gi, (s, c) in enumerate(zip(starts.tolist(), counts.tolist())):
        if c <= 0:
            continue
        for c0 in range(0, N_out, n0):
            for r0 in range(0, c, m0):
                out.append((gi, s + r0, min(m0, c - r0), c0, min(n0, N_out - c0)))
    return out


def item_load(device, dtype, K, nb, item) -> float:
    """An item's load for the deal: the slower of its Cube fractals and its GM bytes at the MTE2 rate."""
    _, _, m, _, n = item
    cube = ceil_div(m, 16) * ceil_div(nb * n, 16) * ceil_div(K, device.cube_k0[dtype])
    mte2 = (m + nb * n) * K * itemsize(dtype) / device.rates["GM->L1"]
    return max(cube, mte2)


def deal(loads, ncores):
    """Items (in order) to the least-loaded core (ties: the lowest core): per-core lists of item numbers."""
    n = min(ncores, len(loads))
    heap = [(0.0, c) for c in range(n)]
    per = [[] for _ in range(n)]
    for i, ld in enumerate(loads):
        load, c = heapq.heappop(heap)
        per[c].append(i)
        heapq.heappush(heap, (load + ld, c))
    return per


def _check(x, w, trans_w, activation, swiglu_order, limit=None):
    for name, t in (("x", x), ("weight", w)):
        if t.dtype not in CUBE_DTYPES:
            raise TypeError(f"grouped_matmul: {name} is {t.dtype}; the Cube takes {', '.join(CUBE_DTYPES)}")
    if x.dtype != w.dtype:
        raise TypeError(f"grouped_matmul: x is {x.dtype}, weight is {w.dtype}; cast one of them first")
    if x.data.ndim != 2 or w.data.ndim != 3:
        raise ValueError(f"grouped_matmul: x must be [M, K] and weight [E, K, N] (or [E, N, K] with trans_w), "
                         f"got {list(x.shape)} and {list(w.shape)}")
    K = w.shape[2] if trans_w else w.shape[1]
    if x.shape[1] != K:
        raise ValueError(f"grouped_matmul: x has K={x.shape[1]}, weight {list(w.shape)}"
                         f"{' (trans_w)' if trans_w else ''} has K={K}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"grouped_matmul: activation={activation!r}; choose one of {ACTIVATIONS}")
    N = w.shape[1] if trans_w else w.shape[2]
    if activation in GLU and N % 2:
        raise ValueError(f"grouped_matmul: {activation} needs an even N (gate and up halves), got N={N}")
    if swiglu_order not in ORDERS:
        raise ValueError(f"grouped_matmul: swiglu_order={swiglu_order!r}; choose one of {ORDERS}")
    if activation == "clamped_swiglu" and not (limit is not None and math.isfinite(limit) and limit > 0):
        raise ValueError(f"grouped_matmul: clamped_swiglu needs a positive finite limit, got limit={limit}")
    return K, N


def _act_fn(activation, limit=None, alpha=1.0):
    if activation == "swiglu":
        silu = OPS["silu"].fn
        return lambda g, u: silu(g) * u
    if activation == "clamped_swiglu":
        sig, lim, a = OPS["sigmoid"].fn, np.float32(limit), np.float32(alpha)

        def clamped(g, u):
            g = np.minimum(g, lim)
            return (np.clip(u, -lim, lim) + np.float32(1)) * (g * sig(g * a))
        return clamped
    return OPS[activation].fn


@kernel("grouped_matmul", steer=("group_list",))
def grouped_matmul(launch, x, weight, group_list, bias=None, trans_w=False, group_list_type="count",
                   activation=None, swiglu_order="gate_up", out_dtype=None, tiling=None, return_product=False,
                   limit=None, alpha=1.0):
    """``y[rows_g] = act(x[rows_g] @ w[g] + bias[g])`` for every group g, one launch (module docstring); with
    ``return_product`` also the product ``x[rows_g] @ w[g] + bias[g]``. ``limit``, ``alpha``: clamped_swiglu's."""
    K, N = _check(x, weight, trans_w, activation, swiglu_order, limit)
    E = weight.shape[0]
    if group_list.data.size != E:
        raise ValueError(f"grouped_matmul: group_list has {group_list.data.size} entries for {E} experts")
    if bias is not None and tuple(bias.shape) != (E, N):
        raise ValueError(f"grouped_matmul: bias has shape {list(bias.shape)}; it must be [E, N] = {[E, N]}")
    if return_product and activation is None:
        raise ValueError("grouped_matmul: return_product needs an activation (without one the output is the "
                         "product); drop return_product or name the epilogue")
    return _Grouped(launch, x, weight, group_list, bias, bool(trans_w), group_list_type, activation, swiglu_order,
                    out_dtype or x.dtype, tiling, K, N, bool(return_product), limit, alpha).run()


class _Grouped:
    """One launch of grouped_matmul: allocations, the deal, the per-step Cube program and the epilogue."""

    def __init__(self, launch, x, w, group_list, bias, trans_w, glt, activation, order, out_dtype, tiling, K, N,
                 product=False, limit=None, alpha=1.0):
        dev = self.dev = launch.device
        self.launch, self.x, self.w, self.bias, self.trans_w = launch, x, w, bias, trans_w
        self.act, self.order, self.out_dtype, self.K = activation, order, out_dtype, K
        self.limit, self.alpha = limit, alpha
        self.nb = 2 if activation in GLU else 1
        self.N_out = N // self.nb
        self.dtype = x.dtype
        M = x.shape[0]
        self.starts, self.counts = group_rows(group_list.data, glt, M)
        self.group_list = group_list
        t = dict(tiling) if tiling else default_tiling(dev, x.dtype, out_dtype, K, self.N_out, activation,
                                                       bias is not None, product)
        if not tiling_fits(dev, x.dtype, out_dtype, t, activation, bias is not None, product):
            raise ValueError(f"grouped_matmul tiling {t} does not fit the buffers of {dev.name}"
                             f"{' with the product stored' if product else ''}")
        self.t = t
        self.out = launch.empty((M, self.N_out), out_dtype, "y")
        self.prod = launch.empty((M, N), out_dtype, "product") if product else None
        self.items = items_of(self.starts, self.counts, self.N_out, t["m0"], t["n0"])
        loads = [item_load(dev, x.dtype, K, self.nb, it) for it in self.items]
        self.per = deal(loads, dev.cube_cores) if self.items else [[]]
        self.n = len(self.per)
        self.split = dev.arch == "split"

    def alloc(self):
        dev, t, g = self.dev, self.t, None
        n, nb, dtype = self.n, self.nb, self.dtype
        m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
        g = self.cg = self.launch.group("aic" if self.split else "core", n)
        self.gl = g.alloc("L1", (pad(self.w.shape[0], "int32"),), "int32", "group list")
        self.a1 = [g.alloc("L1", (m0, k1), dtype, f"a1_{i}") for i in range(2)]
        self.b1 = [[g.alloc("L1", (k1, n0), dtype, f"b1_{h}{i}") for i in range(2)] for h in range(nb)]
        self.bias1 = [g.alloc("L1", (1, n0), "float32", f"bias_{h}") for h in range(nb)] if self.bias is not None \
            else None
        self.a0 = [g.alloc("L0A", (m0, k0), dtype, f"a0_{i}") for i in range(2)]
        self.b0 = [[g.alloc("L0B", (k0, n0), dtype, f"b0_{h}{i}") for i in range(2)] for h in range(nb)]
        nc = 2 if 2 * nb * m0 * n0 * 4 <= dev.buffers["L0C"] else 1
        self.c0 = [[g.alloc("L0C", (m0, n0), "float32", f"c_{h}{i}") for i in range(nc)] for h in range(nb)]
        self.nc = nc
        if self.act is None and self.split:
            return
        vg = self.vg = g if not self.split else self.launch.group("aiv", 2 * n)
        rows = ceil_div(m0, 2) if self.split else m0
        od = self.out_dtype
        if self.act is None:                     # coupled, no epilogue: L0C -> UB (cast) -> GM
            self.ub = [vg.alloc("UB", (m0, n0), od, f"ub_{i}") for i in range(2)]
            return
        sets = product_sets(dev, m0, n0, od, self.act, self.prod is not None)
        self.p32s = [[vg.alloc("UB", (rows, pad(n0, "float32")), "float32", f"p32_{h}{i}") for h in range(nb)]
                     for i in range(sets)]
        self.p32 = self.p32s[0]
        self.tmp = vg.alloc("UB", (rows, pad(n0, "float32")), "float32", "tmp")
        self.ub = [vg.alloc("UB", (rows, pad(n0, od)), od, f"ub_{i}") for i in range(2)]
        if self.prod is not None and od != "float32":     # the cast product tiles, double-buffered
            self.pub = [[vg.alloc("UB", (rows, pad(n0, od)), od, f"pub_{h}{i}") for i in range(2)] for h in range(nb)]
        if self.split:
            self.ws = self.launch.empty((n, 2, nb, m0, n0), "float32", "ws", scratch=True)

    def run(self):
        self.alloc()
        g, n = self.cg, self.n
        E = self.w.shape[0]
        # the group list: every core reads it and walks its entries (Scalar bookkeeping, empty groups included)
        gl = GMTensor(np.asarray(self.group_list.data).reshape(-1), self.group_list.dtype, "group_list")
        g.load(self.gl, gl, [(slice(0, E),)] * n, name="load group list")
        g._exec("scalar", np.full(n, float(E * self.dev.scalar_issue_cycles)), reads=(self.gl,),
                name="walk group list")
        steps = max(len(p) for p in self.per)
        self.slot0 = self.slot1 = self.slot2 = 0
        self.ends = {}
        for s in range(steps):
            mine = [self.items[p[s]] if s < len(p) else None for p in self.per]
            self.step(s, mine)
        return (self.out,) if self.prod is None else (self.out, self.prod)

    def _cols(self, it, h):
        """Columns of weight feeding accumulator ``h`` of item ``it`` (h: 0 gate / 1 up for swiglu; interleaved:
        the first and the second half of the item's 2·ce columns of gate/up pairs)."""
        c0, ce = it[3], it[4]
        if self.nb == 1:
            return slice(c0, c0 + ce)
        if self.order == "interleaved":
            return slice(2 * c0 + h * ce, 2 * c0 + (h + 1) * ce)
        first = (h == 0) == (self.order == "gate_up")
        off = 0 if first else self.N_out
        return slice(off + c0, off + c0 + ce)

    def step(self, s, mine):
        g, t, K, nb = self.cg, self.t, self.K, self.nb
        k0, k1 = t["k0"], t["k1"]
        isz = itemsize(self.dtype)
        active = np.array([it is not None for it in mine])
        act = None if active.all() else active
        m_ext = np.array([it[2] if it else 0 for it in mine])
        n_ext = np.array([it[4] if it else 0 for it in mine])
        rows = [slice(it[1], it[1] + it[2]) if it else None for it in mine]
        acc = [self.c0[h][s % self.nc] for h in range(nb)]
        w = self.w
        if self.bias1 is not None:
            for h in range(nb):
                g.load(self.bias1[h], self.bias, [(it[0], self._cols(it, h)) if it else None for it in mine],
                       active=act, fn=lambda b: b.reshape(1, -1), name="load bias")
        for kk in range(ceil_div(K, k1)):
            ks = slice(kk * k1, min(K, (kk + 1) * k1))
            A1 = self.a1[kk % 2]
            g.load(A1, self.x, [(rows[c], ks) if it else None for c, it in enumerate(mine)], active=act, name="load A")
            B1 = [self.b1[h][kk % 2] for h in range(nb)]
            for h in range(nb):
                regs = [None if it is None else ((it[0], self._cols(it, h), ks) if self.trans_w
                                                 else (it[0], ks, self._cols(it, h))) for it in mine]
                g.load(B1[h], w, regs, active=act, fn=np.transpose if self.trans_w else None, name="load B")
            kc = ks.stop - ks.start
            for kq in range(ceil_div(kc, k0)):
                kv = min(k0, kc - kq * k0)
                A0 = self.a0[self.slot0 % 2]
                B0 = [self.b0[h][self.slot0 % 2] for h in range(nb)]
                self.slot0 += 1
                sl = slice(kq * k0, (kq + 1) * k0)
                g.move(A0, A1, fn=lambda d, sl=sl: d[:, :, sl], nbytes=round_up(m_ext, 16) * kv * isz, active=act)
                for h in range(nb):
                    g.move(B0[h], B1[h], fn=lambda d, sl=sl: d[:, sl, :], nbytes=kv * round_up(n_ext, 16) * isz,
                           active=act)
                first = kk == 0 and kq == 0
                for h in range(nb):
                    init = self.bias1[h].data if (first and self.bias1 is not None) else None
                    g.mmad(acc[h], A0, B0[h], m_ext, kv, n_ext, accumulate=not first, init=init, active=act)
        self.epilogue(s, mine, acc, act, m_ext, n_ext)

    def epilogue(self, s, mine, acc, act, m_ext, n_ext):
        g, out = self.cg, self.out
        regs = [None if it is None else (slice(it[1], it[1] + it[2]), slice(it[3], it[3] + it[4])) for it in mine]
        if self.act is None:
            if self.split:
                g.store(acc[0], out, regs, active=act, name="FixPipe out")
            else:
                U = self.ub[self.slot1 % 2]
                self.slot1 += 1
                g.move(U, acc[0], nbytes=m_ext * n_ext * 4, active=act, name="L0C->UB")
                g.store(U, out, regs, active=act, name="store out")
            return
        self.p32 = self.p32s[self.slot1 % len(self.p32s)]       # this tile's product set, alternating as its out tiles
        if not self.split:
            for h in range(self.nb):
                g.move(self.p32[h], acc[h], nbytes=m_ext * n_ext * 4, active=act, name="L0C->UB (fp32)")
            self.vector_epilogue(g, mine, m_ext, n_ext, act, regs)
            return
        # split: AIC -> GM workspace (fp32) -> the two AIVs, half of the rows each
        slot = s % 2
        n, nb = self.n, self.nb
        wait = self.ends.get(("read", s - 2))
        # each item's rows split evenly (a short row block too: both AIVs take half of it)
        halves = [0 if it is None else ceil_div(it[2], 2) for it in mine]
        vmine, vregs, vws = [], [], []
        for c, it in enumerate(mine):
            for hh in range(2):
                half = halves[c]
                r0 = hh * half
                re = 0 if it is None else max(0, min(half, it[2] - r0))
                if re == 0:
                    vmine.append(None)
                    vregs.append(None)
                    vws.append(None)
                    continue
                vmine.append((it[0], it[1] + r0, re, it[3], it[4]))
                vregs.append((slice(it[1] + r0, it[1] + r0 + re), slice(it[3], it[3] + it[4])))
                vws.append((c, slot, None, slice(r0, r0 + re), slice(0, it[4])))
        # each half of the rows is written as the region its AIV reads (the L2 matches regions)
        end = np.zeros(n)
        for h in range(nb):
            for hh in range(2):
                regs = [None if r is None else r[:2] + (h,) + r[3:] for r in vws[hh::2]]
                if all(r is None for r in regs):
                    continue
                e = g.store(acc[h], self.ws, regs, active=np.array([r is not None for r in regs]),
                            deps=() if wait is None else (wait,), fn=_Rows(regs, [hh * v for v in halves]),
                            name="FixPipe product->GM")
                end = np.maximum(end, np.where([r is not None for r in regs], e, 0.0))
        vg = self.vg
        vactive = np.array([v is not None for v in vmine])
        vact = None if vactive.all() else vactive
        rend = np.zeros(2 * n)
        for h in range(nb):
            e = vg.load(self.p32[h], self.ws, [None if r is None else r[:2] + (h,) + r[3:] for r in vws],
                        active=vact, deps=(np.repeat(end, 2),), name="load product")
            rend = np.maximum(rend, np.where(vactive, e, 0.0))
        self.ends[("read", s)] = rend.reshape(n, 2).max(axis=1)
        vm = np.array([v[2] if v else 0 for v in vmine])
        vn = np.array([v[4] if v else 0 for v in vmine])
        self.vector_epilogue(vg, vmine, vm, vn, vact, vregs)

    def vector_epilogue(self, vg, mine, m_ext, n_ext, act, regs):
        """fp32 activation (or silu(gate)·up), cast to the output dtype, MTE3 store."""
        od = self.out_dtype
        U = self.ub[self.slot1 % 2]
        self.slot1 += 1
        p32, tmp = self.p32, self.tmp
        rep = ceil_div(m_ext * pad(n_ext, "float32"), 64)
        passes = epilogue_passes(self.act, self.order)
        fn = _act_fn(self.act, self.limit, self.alpha)
        gather = self._pairs(n_ext) if self.order == "interleaved" and self.nb == 2 else None

        def compute():
            with np.errstate(over="ignore"):       # exp of the padding's large negatives: inf, harmless
                epilogue()

        def epilogue():
            if gather is not None:              # gate/up pairs across the two accumulators: even and odd columns
                both = np.stack([p32[0].data, p32[1].data])
                r = fn(both[gather[0]], both[gather[1]])
            elif self.nb == 2:
                r = fn(p32[0].data, p32[1].data)
            else:
                r = fn(p32[0].data)
            np.copyto(tmp.data, np.asarray(r, dtype=np.float32))
            U.data[...] = 0
            w = min(U.data.shape[2], tmp.data.shape[2])
            U.data[:, :, :w] = rnd(tmp.data[:, :, :w], od)

        vg.vector(f"{self.act} epilogue", (tmp,), tuple(p32), rep * passes, active=act)
        vg.vector(f"cast->{od}", (U,), (tmp,), rep if od != "float32" else 0 * rep, active=act, compute=compute)
        vg.store(U, self.out, regs, active=act, name="store out")
        if self.prod is not None:
            self.store_product(vg, mine, rep, act)

    def _pairs(self, n_ext):
        """Index arrays into ``stack([acc0, acc1])`` ([2, cores, rows, W]) giving, per core, the gate and the up
        column of each output column j < ce: pair column 2j (+1 for up) of the 2·ce the item's two accumulators
        hold, acc0's ce first."""
        c, rows, W = self.p32[0].data.shape
        j = np.arange(W)
        ce = np.maximum(np.asarray(n_ext, dtype=np.int64), 1)[:, None]
        out = []
        for off in (0, 1):
            p = np.minimum(2 * j[None, :] + off, 2 * ce - 1)               # past ce: any valid column (padding)
            h = (p >= ce).astype(np.int64)
            col = p - h * ce
            hh = np.broadcast_to(h[:, None, :], (c, rows, W))
            cc = np.broadcast_to(col[:, None, :], (c, rows, W))
            out.append((hh, np.arange(c)[:, None, None], np.arange(rows)[None, :, None], cc))
        return out

    def store_product(self, vg, mine, rep, act):
        """The fp32 product tile(s) the epilogue read, cast to the output dtype (one Vector pass each) and
        stored by MTE3 in the product's own columns (SwiGLU: gate and up where the weight has them)."""
        od = self.out_dtype
        slot = self.slot2 % 2
        self.slot2 += 1
        for h in range(self.nb):
            regs = [None if it is None else (slice(it[1], it[1] + it[2]), self._cols(it, h)) for it in mine]
            src = self.p32[h]
            if od != "float32":
                src, p32 = self.pub[h][slot], self.p32[h]

                def cast(src=src, p32=p32):
                    w = min(src.data.shape[2], p32.data.shape[2])
                    src.data[...] = 0
                    src.data[:, :, :w] = rnd(p32.data[:, :, :w], od)

                vg.vector(f"cast product->{od}", (src,), (p32,), rep, active=act, compute=cast)
            vg.store(src, self.prod, regs, active=act, name="store product")


class _Rows:
    """``fn`` for ``Group.store``: each present region takes the tile's rows from its core's ``r0[c]`` on (its
    extent); called once per present region, in core order (the store's in-order path)."""

    def __init__(self, regions, r0):
        self.parts = iter([(r, o) for r, o in zip(regions, r0) if r is not None])

    def __call__(self, block):
        region, r0 = next(self.parts)
        ext = [s.stop - s.start for s in region if isinstance(s, slice)]
        return block[r0:r0 + ext[0], :ext[1]]


# ------------------------------------------------------------------------------------------ per group
def _append(parent: Launch, sub: Launch, offset: float) -> None:
    """Fold a finished sub-launch into ``parent`` as if it ran from ``offset`` on: its groups (timelines
    shifted), bytes, HBM traffic, instructions and events."""
    for g in sub.groups:
        for u in g.units:
            g.free[u] = g.free[u] + offset
        g.launch = parent
        parent.groups.append(g)
    for k, v in sub.bytes.items():
        parent.bytes[k] += v
    parent.hbm_read += sub.hbm_read
    parent.hbm_write += sub.hbm_write + sub.l2.dirty_bytes()
    parent.instructions += sub.instructions
    parent.events += [(g, u, nm, st + offset, en + offset, a) for g, u, nm, st, en, a in sub.events]


def in_sequence(launch: Launch, calls) -> None:
    """Run each ``call(sub)`` (it issues one ``matmul`` launch into the fresh launch ``sub`` and returns a
    function that places the result's values) as its own launch, one after another: each with its launch
    overhead and a cold L2, as separate launches run; their work is folded into ``launch``."""
    dev = launch.device
    t0 = 0.0
    for call in calls:
        if t0:                         # the launch overhead between the one before and this one (traced)
            launch.overheads.append((t0 - dev.launch_cycles, t0))
        sub = Launch(dev, "matmul", values=launch.values)
        place = call(sub)
        sub.sync()
        if launch.values:
            place()
        body = sub.elapsed()
        _append(launch, sub, t0)
        t0 += math.ceil(body) + dev.launch_cycles       # the next launch starts after this one and its overhead
    if not launch.groups:
        launch.group("aic" if dev.arch == "split" else "core", 1)
    elif t0:
        launch.groups[-1].free["scalar"] = np.maximum(launch.groups[-1].free["scalar"], t0 - dev.launch_cycles)


@kernel("matmul_per_group", steer=("group_list",))
def matmul_per_group(launch, x, weight, group_list, trans_w=False, group_list_type="cumsum", tiling=None):
    """One ``matmul`` launch per non-empty group, in order (what ``transformers.grouped_mm_fallback`` runs)."""
    K, N = _check(x, weight, trans_w, None, "gate_up")
    M = x.shape[0]
    starts, counts = group_rows(group_list.data, group_list_type, M)
    out = launch.empty((M, N), x.dtype, "y")
    by_rows = {int(k): v for k, v in ((tiling or {}).get("by_rows") or {}).items()}

    def call(gi, s, c):
        def run(sub):
            a = GMTensor(x.data[s:s + c], x.dtype, "x")
            b = GMTensor(weight.data[gi], weight.dtype, "w")
            y, = _matmul_kernel(sub, a, b, trans_b=trans_w, tiling=by_rows.get(c))
            return lambda: out.data.__setitem__(slice(s, s + c), y.data)
        return run

    in_sequence(launch, [call(gi, s, c) for gi, (s, c) in enumerate(zip(starts.tolist(), counts.tolist())) if c])
    return (out,)


__all__ = ["grouped_matmul", "matmul_per_group", "default_tiling", "tiling_fits", "items_of", "deal", "item_load",
           "group_rows", "in_sequence", "epilogue_passes", "ACTIVATIONS", "L2"]
