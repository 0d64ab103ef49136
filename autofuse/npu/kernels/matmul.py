"""Cube matmul: ``out[..., M, N] = a[..., M, K] @ b[..., K, N] (+ bias[N])``, batched, optional transposes.

Schedule (one base tile ``m0 × n0`` of the output per core and step, cores in lockstep):

    for each K chunk of k1 (double-buffered in L1):      MTE2  GM -> L1   (A chunk m0×k1, B chunk k1×n0)
        for each k0 slice of the chunk (double-buffered): MTE1  L1 -> L0A, L1 -> L0B
                                                           Cube  L0C += L0A @ L0B (fp32)
    coupled: FixPipe L0C -> UB (cast), MTE3 UB -> GM;  split: FixPipe L0C -> GM (cast)

L0C is double-buffered when it fits, so one tile's write-out overlaps the next tile's products. Work
items (batch, row block, column block) go round-robin over cores, so cores working at the same time
share A rows and B columns through L2. A bias is loaded once per tile and seeds the accumulator, as
the bias table does.
"""
from __future__ import annotations


import numpy as np

from autofuse.npu.dtypes import itemsize
from autofuse.npu.run import kernel

CUBE_DTYPES = ("float16", "bfloat16", "float32")


def _ceil(a, b):
    return -(-a // b)


def _round(a, b):
    return _ceil(a, b) * b


def overflow(device, dtype: str, out_dtype: str, t: dict, a1_elems=None) -> str | None:
    """The first buffer tiling ``t`` (m0, n0, k0, k1) overflows on ``device`` (None: it fits). ``a1_elems``: the
    elements of one L1 buffer of A (default an ``m0 × k1`` block; a convolution's input band)."""
    isz, osz = itemsize(dtype), itemsize(out_dtype)
    m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
    a1 = m0 * k1 if a1_elems is None else a1_elems
    buf = device.buffers
    l0c_tiles = 2 if 2 * m0 * n0 * 4 <= buf["L0C"] else 1
    for name, ok in (("L1", 2 * (a1 + k1 * n0) * isz + n0 * 4 <= buf["L1"] - 64),
                     ("L0A", 2 * m0 * k0 * isz <= buf["L0A"]), ("L0B", 2 * k0 * n0 * isz <= buf["L0B"]),
                     ("L0C", l0c_tiles * m0 * n0 * 4 <= buf["L0C"]),
                     ("UB", device.arch == "split" or 2 * m0 * n0 * osz <= buf["UB"])):
        if not ok:
            return name
    return None


def tiling_fits(device, dtype: str, out_dtype: str, t: dict) -> bool:
    """Whether tiling ``t`` (m0, n0, k0, k1) fits every buffer it uses on ``device``."""
    return t["k1"] % t["k0"] == 0 and overflow(device, dtype, out_dtype, t) is None


def default_tiling(device, M: int, N: int, K: int, batch: int, dtype: str, out_dtype: str) -> dict:
    """A base tile that keeps the Cube fed: the fewest waves of work times the slower of Cube and MTE2.

    K slices (k0) are the deepest that fit L0A/L0B double-buffered; L1 chunks are two slices deep, so the
    first product starts soon after launch. The cost model searches tilings properly; this is the
    kernel's own default when none is given.
    """
    isz = itemsize(dtype)
    k0f = device.cube_k0[dtype]
    best = None
    for m0 in (256, 128, 64, 32, 16):
        for n0 in (256, 128, 64, 32, 16):
            m0e, n0e = min(m0, _round(M, 16)), min(n0, _round(N, 16))
            if best is not None and (m0e, n0e) in best[2]:
                continue
            k0 = next((k for k in (128, 64, 32, 16) if 2 * m0e * k * isz <= device.buffers["L0A"]
                       and 2 * k * n0e * isz <= device.buffers["L0B"]), 16)
            k0 = min(k0, _round(K, 16))
            t = {"m0": m0e, "n0": n0e, "k0": k0, "k1": min(2 * k0, _round(K, k0))}
            if not tiling_fits(device, dtype, out_dtype, t):
                continue
            waves = _ceil(batch * _ceil(M, m0e) * _ceil(N, n0e), device.cube_cores)
            cube = (m0e // 16) * (n0e // 16) * _ceil(K, k0f)
            mte2 = (m0e + n0e) * K * isz / device.rates["GM->L1"]
            score = waves * max(cube, mte2)
            seen = best[2] if best else set()
            seen.add((m0e, n0e))
            if best is None or score < best[0]:
                best = (score, t, seen)
    if best is None:
        raise ValueError(f"no matmul tiling fits {device.name} for {dtype}")
    return best[1]


def _check(a, b, trans_a, trans_b):
    for name, t in (("a", a), ("b", b)):
        if t.data.ndim < 2:
            raise ValueError(f"matmul: {name} must have at least 2 dims, got shape {list(t.shape)}")
        if t.dtype not in CUBE_DTYPES:
            raise TypeError(f"matmul: {name} is {t.dtype}; the Cube takes {', '.join(CUBE_DTYPES)}")
    if a.dtype != b.dtype:
        raise TypeError(f"matmul: a is {a.dtype} but b is {b.dtype}; cast one of them first")
    K = a.shape[-2] if trans_a else a.shape[-1]
    Kb = b.shape[-1] if trans_b else b.shape[-2]
    if K != Kb:
        raise ValueError(f"matmul: inner dims differ: a {list(a.shape)}{' (transposed)' if trans_a else ''} "
                         f"and b {list(b.shape)}{' (transposed)' if trans_b else ''}")


class DenseA:
    """A matmul's A operand: per K chunk an ``m0 × k1`` block of a GM matrix loaded into L1 (MTE2), whose ``k0``
    slices move to L0A as they are (MTE1). ``a_idx``/``rows``: per core, the batch index and the row slice."""

    def __init__(self, a, a_idx, rows, trans_a):
        self.a, self.a_idx, self.rows, self.trans_a = a, a_idx, rows, trans_a

    def load(self, g, A1, ks, act, deps):
        a_reg = [None if r is None else self.a_idx[c] + ((ks, r) if self.trans_a else (r, ks))
                 for c, r in enumerate(self.rows)]
        g.load(A1, self.a, a_reg, active=act, deps=deps, fn=np.transpose if self.trans_a else None, name="load A")

    def fractal(self, sl):
        """``(fn, fn_cores)`` of the L1 -> L0A move of the chunk's columns ``sl`` (see ``Group.move``)."""
        return (lambda x: x[:, :, sl]), False


class Cube:
    """The Cube side of a matmul: L1 and L0 tiles and the K loop that fills L0C accumulators.

    ``pieces`` column blocks of B (each ``n0`` wide, e.g. the gate and up halves of a fused projection) are
    multiplied by the same A rows into accumulators of their own (``acc[slot][piece]``), each K slice of A
    moved to L0A once for all of them. L0C holds two sets of accumulators when they fit (``nc``). ``a1_shape``:
    the L1 buffers of A (default ``m0 × k1``; a convolution's input band, formed into L0A by its own ``a_side``).
    """

    def __init__(self, g, dtype, t, bias=False, pieces=1, a1_shape=None):
        dev = g.launch.device
        m0, n0, k0, k1 = t["m0"], t["n0"], t["k0"], t["k1"]
        self.g, self.dtype, self.k0, self.k1, self.pieces = g, dtype, k0, k1, pieces
        self.a1 = [g.alloc("L1", a1_shape or (m0, k1), dtype, f"a1_{i}") for i in range(2)]
        self.b1 = [[g.alloc("L1", (k1, n0), dtype, f"b1_{p}_{i}") for i in range(2)] for p in range(pieces)]
        self.bias1 = g.alloc("L1", (1, n0), "float32", "bias") if bias else None
        self.a0 = [g.alloc("L0A", (m0, k0), dtype, f"a0_{i}") for i in range(2)]
        self.b0 = [[g.alloc("L0B", (k0, n0), dtype, f"b0_{p}_{i}") for i in range(2)] for p in range(pieces)]
        self.nc = 2 if 2 * pieces * m0 * n0 * 4 <= dev.buffers["L0C"] else 1
        self.acc = [[g.alloc("L0C", (m0, n0), "float32", f"c_{i}_{p}") for p in range(pieces)]
                    for i in range(self.nc)]
        self.slot0 = 0

    def accumulate(self, a, b, a_idx, b_idx, rows, cols, m_ext, n_ext, K, act, acc, bias=None,
                   trans_a=False, trans_b=False, deps=(), a_side=None):
        """``acc[p] = a[rows] @ b[:, cols[p]] (+ bias)``, K chunk by chunk (yields after each chunk's work
        is issued, so a caller may interleave other work). ``a_idx``/``b_idx``: per core, the batch index
        of the operands; ``rows``/``cols[p]``: per core, slices (a row slice None: the core is idle); the A and
        B loads also wait for ``deps``. ``a_side``: how A reaches L1 and L0A (default :class:`DenseA` of ``a``)."""
        g, k0, k1 = self.g, self.k0, self.k1
        isz = itemsize(self.dtype)
        a_side = a_side or DenseA(a, a_idx, rows, trans_a)
        if self.bias1 is not None:
            g.load(self.bias1, bias, [(slice(None),) * (bias.data.ndim - 1) + (cols[0][c],) if r is not None else None
                                      for c, r in enumerate(rows)],
                   fn=lambda x: x.reshape(1, -1), name="load bias")
        for kk in range(_ceil(K, k1)):
            ks = slice(kk * k1, min(K, (kk + 1) * k1))
            A1 = self.a1[kk % 2]
            a_side.load(g, A1, ks, act, deps)
            for p in range(self.pieces):
                b_reg = [None if r is None else b_idx[c] + ((cols[p][c], ks) if trans_b else (ks, cols[p][c]))
                         for c, r in enumerate(rows)]
                g.load(self.b1[p][kk % 2], b, b_reg, active=act, deps=deps, fn=np.transpose if trans_b else None,
                       name="load B")
            k_chunk = ks.stop - ks.start
            for kq in range(_ceil(k_chunk, k0)):
                kv = min(k0, k_chunk - kq * k0)
                A0 = self.a0[self.slot0 % 2]
                sl = slice(kq * k0, (kq + 1) * k0)
                fn, fn_cores = a_side.fractal(sl)
                g.move(A0, A1, fn=fn, fn_cores=fn_cores, nbytes=_round(m_ext, 16) * kv * isz, active=act)
                first = kk == 0 and kq == 0
                for p in range(self.pieces):
                    B0 = self.b0[p][self.slot0 % 2]
                    g.move(B0, self.b1[p][kk % 2], fn=lambda x, sl=sl: x[:, sl, :], nbytes=kv * _round(n_ext, 16) * isz,
                           active=act)
                    g.mmad(acc[p], A0, B0, m_ext, kv, n_ext, accumulate=not first,
                           init=self.bias1.data[:, :, :] if (first and self.bias1 is not None) else None, active=act)
                self.slot0 += 1
            yield kk


class Program:
    """The matmul schedule on one group of cores and its buffers, which outlive one call of :meth:`run`:
    fused kernels (MC2) run it tile by tile in one launch, each call continuing the same timelines. The K
    loop of each output tile is the :class:`Cube`'s."""

    def __init__(self, launch, dtype, out_dtype, t, ncores, bias=False, a1_shape=None):
        dev = launch.device
        self.launch, self.dtype, self.out_dtype, self.t = launch, dtype, out_dtype, dict(t)
        m0, n0 = t["m0"], t["n0"]
        g = self.g = launch.group("core" if dev.arch == "coupled" else "aic", ncores)
        self.cube = Cube(g, dtype, t, bias=bias, a1_shape=a1_shape)
        self.ub = [g.alloc("UB", (m0, n0), out_dtype, f"ub_{i}") for i in range(2)] \
            if dev.arch == "coupled" else None
        self.slot1 = self.step = 0

    def run(self, a, b, bias, out, items, M_rows, N, K, trans_a=False, trans_b=False, fold=True, deps=()):
        """Output tiles ``items`` ((batch index, row block or (first row, rows), column block)) of ``out = a @ b``,
        written to ``out``; the A and B loads wait for ``deps`` too. Returns the time the last tile is stored."""
        g, cube = self.g, self.cube
        ncores = g.n
        m0, n0 = self.t["m0"], self.t["n0"]

        def index(t_, bidx):
            nb = t_.data.ndim - 2
            bi = bidx[len(bidx) - nb:] if nb else ()
            return tuple(0 if t_.shape[i] == 1 else bi[i] for i in range(nb))

        done = 0.0
        for step in range(_ceil(len(items), ncores)):
            mine = [items[step * ncores + c] if step * ncores + c < len(items) else None for c in range(ncores)]
            active = np.array([it is not None for it in mine])
            act = None if active.all() else active
            # a row block is its index, or (first row, rows) when a caller places blocks itself
            r0s = [None if it is None else (it[1] * m0 if it[1].__class__ is int else it[1][0]) for it in mine]
            m_ext = np.array([0 if it is None else (min(m0, M_rows - r0s[c]) if it[1].__class__ is int else it[1][1])
                              for c, it in enumerate(mine)])
            n_ext = np.array([min(n0, N - it[2] * n0) if it else 0 for it in mine])
            rows = [slice(r0s[c], r0s[c] + m_ext[c]) if it else None for c, it in enumerate(mine)]
            cols = [slice(it[2] * n0, it[2] * n0 + n_ext[c]) if it else None for c, it in enumerate(mine)]
            acc = cube.acc[self.step % cube.nc]
            self.step += 1
            for _ in cube.accumulate(a, b, [index(a, it[0]) if it else None for it in mine],
                                     [index(b, it[0]) if it else None for it in mine], rows, [cols], m_ext, n_ext,
                                     K, act, acc, bias, trans_a, trans_b, deps):
                pass
            out_reg = [None if it is None else
                       ((rows[c], cols[c]) if fold else tuple(it[0]) + (rows[c], cols[c])) for c, it in enumerate(mine)]
            done = max(done, self.write_out(acc[0], out, out_reg, m_ext, n_ext, act))
        return done

    def write_out(self, acc, out, out_reg, m_ext, n_ext, act, fn=None):
        """Store the accumulators ``acc`` to ``out[out_reg[c]]`` (coupled: FixPipe L0C -> UB with the cast, MTE3
        UB -> GM; split: FixPipe L0C -> GM); ``fn`` selects from each core's tile (``Group.store``). Returns
        the time the last active core's store ends."""
        g, ub = self.g, self.ub
        if ub is not None:
            U = ub[self.slot1 % 2]
            self.slot1 += 1
            g.move(U, acc, nbytes=m_ext * n_ext * 4, active=act, name="L0C->UB")
            end = g.store(U, out, out_reg, active=act, fn=fn, name="store out")
        else:
            end = g.store(acc, out, out_reg, active=act, fn=fn, name="store out")
        return float(np.max(end if act is None else np.where(act, end, 0.0)))


@kernel("matmul")
def matmul(launch, a, b, bias=None, trans_a=False, trans_b=False, tiling=None, out_dtype=None):
    """``a @ b`` on the Cube (see the module docstring). ``tiling``: dict m0, n0, k0, k1 (else chosen)."""
    _check(a, b, trans_a, trans_b)
    dev = launch.device
    dtype = a.dtype
    out_dtype = out_dtype or dtype
    M = a.shape[-1] if trans_a else a.shape[-2]
    K = a.shape[-2] if trans_a else a.shape[-1]
    N = b.shape[-2] if trans_b else b.shape[-1]
    batch_shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    # A batch of rows against one B is one taller GEMM: B tiles are then reused across the batch.
    fold = b.data.ndim == 2 and a.data.ndim > 2 and not trans_a
    if fold:
        a = type(a)(a.data.reshape(-1, K), a.dtype, a.name)
        M_rows = a.shape[0]
        batches = [()]
    else:
        M_rows = M
        batches = list(np.ndindex(*batch_shape)) if batch_shape else [()]
    if bias is not None and bias.shape[-1] != N:
        raise ValueError(f"matmul: bias has {bias.shape[-1]} elements, output has N={N} columns")
    t = dict(tiling) if tiling else default_tiling(dev, M_rows, N, K, len(batches), dtype, out_dtype)
    if not tiling_fits(dev, dtype, out_dtype, t):
        raise ValueError(f"matmul tiling {t} does not fit the buffers of {dev.name}")
    out_shape = (*batch_shape, M, N) if not fold else (*batch_shape, M, N)
    out = launch.empty((M_rows, N) if fold else out_shape, out_dtype, "out")
    items = [(bi, mi, ni) for bi in batches for mi in range(_ceil(M_rows, t["m0"])) for ni in range(_ceil(N, t["n0"]))]
    prog = Program(launch, dtype, out_dtype, t, min(dev.cube_cores, len(items)), bias is not None)
    prog.run(a, b, bias, out, items, M_rows, N, K, trans_a, trans_b, fold)
    if fold:
        out = type(out)(out.data.reshape(out_shape), out.dtype, out.name)
    return (out,)


def flops(M, N, K, batch=1) -> int:
    return 2 * M * N * K * batch


__all__ = ["Cube", "DenseA", "Program", "matmul", "default_tiling", "overflow", "tiling_fits", "flops"]
