"""``vector_program`` (``autofuse/npu/kernels/vector_program.py``): a generated Vector kernel, in closed form.

The program's tile schedule comes from :func:`cost_model.lowering.lower` (shared with the kernel: which
views each tile loads, which Vector operations run, which UB registers they use; no cost in it). This
module prices that schedule as a double-buffered task stream (:func:`cost_model.stream.stream`):

* tasks (block of rows, outer index) dealt in even contiguous shares to ``n`` vector cores in lockstep;
  whole rows: one stream task per lockstep step; column chunks: one per (step, pass, chunk), pass 2 walking
  the chunks backwards (the chunk pass 1 ended on needs no reload);
* per stream task and input view: loaded when its region changed on some core (every task for an input
  that varies along every lead dim; once per core for a weight; RoPE's cos when the block changes); a
  region first touched misses L2 (HBM), later touches hit (every core sharing a missed region waits for
  it, as the simulator charges a lockstep load); chunked reloads of pass 2 hit while a step's rows fit L2;
* the Vector time of the busiest core (its rows): per op, its passes (the elementwise op table's count)
  times the repeats of its sweep (:func:`cost_model.lowering.sweep`), ops on hoisted values only when
  one of their inputs was reloaded, merges from the second chunk on, the end ops after the last chunk;
* stores write through to HBM;
* bytes per row of a view: :func:`cost_model.lowering.col_bytes` of its columns (a bit view, a packed
  keep-mask: ``ceil(cols / 8)``; its ``where`` is one Select pass, ``select_bits`` in the op table);
* a step whose passes and chunks move very uneven amounts (chunked rows) has each transfer spread over
  two stream tasks: the port takes a transfer as soon as its buffer is free, not only in the next task's
  window (``_spread``).

Alternatives (:func:`alternatives`): a program priced as generated here, whole-row vs chunked tilings,
RoPE's rotation on the Cube (a matmul by a rotation matrix fused with the rest as an epilogue) and a
matmul+epilogue vs the matmul and the program as two launches.
"""
from __future__ import annotations

import math

import numpy as np

from cost_model.common import MIN_TILE_BYTES, ceil_div, itemsize, unique
from cost_model.devices import get_device
from cost_model.estimate import cached, kernel_cycles, make, register
from cost_model.lowering import col_bytes, geometry, lower, pitch, sweep
from cost_model.program import F32, STAT, Program, ProgramError, as_program, check_given
from cost_model.stream import stream
from cost_model.vecutil import fits, largest
from cost_model.vector import OPS as EW_OPS

F32_LANES = 64


def temps(op: str) -> int:
    return EW_OPS[op][2] if op in EW_OPS else 0


@cached
def lowered(prog: Program, chunked: bool):
    return lower(prog, chunked, temps)


def n_passes(op) -> int:
    if op.kind == "ew":
        return EW_OPS[op.op][4](op.scalar is not None, op.scalar)
    return 1


def _lanes(dtype):
    return 256 // itemsize(dtype)


def repeats(op, rows, C=None):
    """Vector repeats of one pass of ``op`` on ``rows`` rows (a number or an array) with chunks of ``C``
    columns."""
    g = sweep(op, rows, C)
    if g[0] == "brcb":
        return ceil_div(g[1], 8)
    if g[0] == "flat":
        return ceil_div(g[1], _lanes(op.lanes))
    return g[1] * ceil_div(g[2], _lanes(op.lanes))


def _row_repeats(op, us, C=None):
    """``[float(repeats(op, u, C)) for u in us]`` for Python int row counts ``us`` (``C`` an int or None): the same
    integers, the op's sweep worked out once rather than per row count."""
    if not op.rows:                                      # the sweep covers one row, whatever the block
        return [float(repeats(op, 1, C))] * len(us)
    lanes = _lanes(op.lanes)
    if op.kind == "brcb":
        return [float(-(-u // 8)) for u in us]
    if op.width == 1:
        per = 1 if op.kind == "cast_in" else STAT
        return [float(-(-(u * per) // lanes)) for u in us]
    w = op.width if C is None else min(op.width, C)
    if op.kind in ("reduce", "gather", "copy") or not op.dense:
        k = -(-w // lanes)
        return [float(u * k) for u in us]
    p = pitch(w, op.lanes if op.lanes == "bool" else F32)
    return [float(-(-(u * p) // lanes)) for u in us]


def _check(prog, specs):
    if len(specs) != len(prog.inputs):
        raise ProgramError(f"vector_program: {len(specs)} inputs for a program of {len(prog.inputs)}")
    for k, (spec, inp) in enumerate(zip(specs, prog.inputs)):
        check_given("vector_program: input", k, spec, inp)




# ------------------------------------------------------------------------------------------ tasks
def _tasks(geo, R, cores):
    """Per core and lockstep step (arrays [n, S]): task number, block j, outer index o, rows, live."""
    shares = geo.shares(R, cores)
    starts = np.array([s for s, _ in shares])
    sizes = np.array([e for _, e in shares])
    S = int(sizes.max())
    s = np.arange(S)
    live = s[None, :] < sizes[:, None]
    t = np.where(live, starts[:, None] + s[None, :], 0)
    j, o = geo.task(t, R)
    nb = geo.blocks(R)
    rows = np.where(j == nb - 1, geo.inner - (nb - 1) * R, R) * live
    return j, o, rows, live


def _view_key(geo, view, j, o):
    """An integer naming the rows a task loads of ``view`` (its outer and row coordinates)."""
    var = geo.var[view.input]
    outer = geo.groups[:-1]
    key = np.zeros_like(o)
    stride = mult = 1
    for g in range(len(outer) - 1, -1, -1):
        digit = (o // stride) % outer[g]
        stride *= outer[g]
        if var[g]:
            key = key + digit * mult
            mult *= outer[g]
    if var[-1]:
        key = key + j * mult
    return key


def _shared(keys, live, load, seen):
    """Per core and step, for a view whose regions cores may share or revisit: (hit?, miss?, slow?).

    In lockstep order (step by step, core by core) a region's first load misses L2, later ones hit; a core
    that hits a region another core missed in the same load waits for the miss (the simulator's rule)."""
    n, S = keys.shape
    take = (live & load).T.ravel()                       # step-major
    kk = keys.T.ravel()
    if n * S <= 256:
        return _shared_short(n, S, take, kk, seen)
    idx = take.nonzero()[0]
    miss = np.zeros(n * S, dtype=bool)
    if idx.size:
        _, first = np.unique(kk[idx], return_index=True)
        cand = idx[first]
        if seen:
            cand = cand[~np.isin(kk[cand], np.fromiter(seen, dtype=kk.dtype, count=len(seen)))]
        miss[cand] = True
        seen.update(kk[cand].tolist())
    step = np.arange(S).repeat(n)
    code = step.astype(np.int64) * (int(kk.max(initial=0)) + 1) + kk
    slow = take & np.isin(code, code[miss])
    hit = take & ~miss
    return hit.reshape(S, n).T, miss.reshape(S, n).T, slow.reshape(S, n).T


def _shared_short(n, S, take, kk, seen):
    """:func:`_shared` of a few tasks, in plain Python: the same masks (each region's first load in step-major
    order misses unless seen before; the loads of a missed region in the step of its miss wait for it)."""
    t, k = take.tolist(), kk.tolist()
    first = {}
    for p in range(n * S):
        if t[p] and k[p] not in first:
            first[k[p]] = p
    missed = [p for key, p in first.items() if key not in seen]
    seen.update(k[p] for p in missed)
    miss = [False] * (n * S)
    for p in missed:
        miss[p] = True
    width = max(max(k, default=0), 0) + 1              # the numpy form's (step, region) code
    codes = {p // n * width + k[p] for p in missed}
    slow = [t[p] and (p // n * width + k[p]) in codes for p in range(n * S)]
    hit = [t[p] and not miss[p] for p in range(n * S)]
    shape = lambda a: np.array(a, dtype=bool).reshape(S, n).T        # noqa: E731
    return shape(hit), shape(miss), shape(slow)


def _spread(a):
    """Half of each task's amount moved to the task before it (the first task keeps its own): the same total."""
    out = a.astype(float).copy()
    out[:, 1:] *= 0.5
    out[:, :-1] += a[:, 1:] * 0.5
    return out


def _op_repeats(ps, first, last, urows, cw, memo):
    """Vector repeats of a pass position's ops per row count: (ops run every task, their instruction count,
    {views: (repeats, instructions)} of the hoisted ones). Memoised: chunks of a pass share their ops."""
    key = (id(ps), first, last, cw)
    got = memo.get(key)
    if got is None:
        us = [int(u) for u in urows]
        every = [0.0] * len(us)
        n_every = 0
        groups = {}
        for op in ps.ops + (ps.end if last else ()):
            if op.kind == "merge" and first:
                continue
            np_ = n_passes(op)
            reps = [np_ * r for r in _row_repeats(op, us, cw)]
            if op.slow:
                g = groups.setdefault(op.views, [[0.0] * len(us), 0])
                g[0] = [a + b for a, b in zip(g[0], reps)]
                g[1] += np_
            else:
                every = [a + b for a, b in zip(every, reps)]
                n_every += np_
        got = memo[key] = (np.array(every), n_every, {v: (np.array(a), b) for v, (a, b) in groups.items()})
    return got


# ------------------------------------------------------------------------------------------ the model
def _model(dev, prog, low, R, C):
    geo = low.geometry
    j, o, rows, live = _tasks(geo, R, dev.vector_cores)
    n, S = rows.shape
    W = low.width
    chunks = [(c0, min(C, W - c0)) for c0 in range(0, W, C)] if C else [(0, W)]
    nch = len(chunks)
    views = low.views
    # the stream's sub-tasks per step: (pass, chunk) positions; pass 2 walks the chunks backwards
    seq = []
    for qi, ps in enumerate(low.passes):
        order = list(range(nch)) if qi % 2 == 0 else list(reversed(range(nch)))
        seq += [(qi, ps, c, i == 0, i == nch - 1) for i, c in enumerate(order)]
    P = len(seq)
    chunk_of = [c for _, _, c, _, _ in seq]
    at = {k: [pi for pi, x in enumerate(seq) if k in x[1].loads] for k in range(len(views))}
    keys, changed = [], []                               # changed: per step, whether some core's region did
    for w in views:
        key = _view_key(geo, w, j, o)
        ch = np.ones((n, S), dtype=bool)
        ch[:, 1:] = key[:, 1:] != key[:, :-1]
        keys.append(key)
        changed.append((ch & live).any(axis=0))
    rate = dev.rates["GM->UB"]
    step_bytes = rows.sum(axis=0).max() * sum(col_bytes(w.width, w.dtype) for w in views if w.rows) * len(low.passes)
    resident = step_bytes <= dev.l2_bytes            # a chunked step's rows stay in L2: pass-2 reloads hit
    urows, rix = unique(rows, return_inverse=True)    # the few row counts tasks have, and each task's among them
    shape = (n, S, P)
    lb, lport, vec, instr = (np.zeros(shape) for _ in range(4))
    sb, sport = np.zeros(shape), np.zeros(shape)
    hit_all = miss_all = 0.0
    seen = [set() for _ in views]
    memo = {}
    per_cols = {}                                 # (view, columns): a task's bytes, over the MTE2 rate, per step
    per_ops = {}                                  # pass position: its ops' Vector repeats and instructions per task
    per_store = {}                                # (output, columns): a task's stored bytes, the port's time per step
    for pi, (qi, ps, c, first, last) in enumerate(seq):
        cw = chunks[c][1]
        fresh = {}
        for k in ps.loads:
            w = views[k]
            wide = w.width > 1
            cols = 1 if not wide else (cw if C else w.width)
            L = at[k]
            i = L.index(pi)
            # the previous load of the view: earlier in this step (same task), or the last one of the step before
            if i > 0:
                f = np.full(S, wide and chunk_of[L[i - 1]] != c)
            else:
                f = changed[k] | (wide and chunk_of[L[-1]] != c)
                f[0] = True
            fresh[k] = f                                  # lockstep: every live core loads when any needs it
            load = live & f[None, :]
            got = per_cols.get((k, cols))
            if got is None:
                bk = (rows if w.rows else live.astype(int)) * col_bytes(cols, w.dtype)    # integers, 0 off live
                got = per_cols[k, cols] = (bk, bk / rate, bk.sum(axis=0))
            b, b_rate, b_step = got
            if w.fast and (wide or not C):
                again = any(chunk_of[p] == c for p in L[:i])
                if again and resident:            # every load hits
                    hit, miss = load, np.zeros_like(load)
                else:                             # none hits: no hit terms below (zeros, +0.0 each)
                    hit, miss = None, load
                slow = miss
            elif not w.rows and not any(geo.var[w.input]):
                # one region per chunk for every core: its first load misses (core 0; the others wait for it)
                tag = c if wide else nch
                loaded = f.nonzero()[0]
                miss = np.zeros((n, S), dtype=bool)
                slow = np.zeros((n, S), dtype=bool)
                if tag not in seen[k] and loaded.size:
                    s0 = loaded[0]
                    miss[0, s0] = True
                    slow[:, s0] = live[:, s0]
                    seen[k].add(tag)
                hit = load & ~miss
            else:
                code = keys[k] * (nch + 1) + (c if wide else nch)
                hit, miss, slow = _shared(code, live, load, seen[k])
            if hit is None:                       # miss = slow = load: the steps' loaded bytes (exact integers)
                mb = b_step * f
                port = slow * (mb / dev.hbm_bytes_per_cycle)[None, :]
                lport[:, :, pi] += port               # already 0.0 where nothing loads
            else:
                mb = (b * miss).sum(axis=0)
                hb = (b * hit).sum(axis=0)
                port = hit * (hb / dev.l2_bytes_per_cycle)[None, :] + slow * (mb / dev.hbm_bytes_per_cycle)[None, :]
                hit_all += float(hb.sum())
                lport[:, :, pi] += np.where(load, port, 0.0)
            dur = np.maximum(b_rate, port)
            lb[:, :, pi] += np.where(load, dur * rate, 0.0)
            instr[:, :, pi] += load
            miss_all += float(mb.sum())
        every, n_every, groups = _op_repeats(ps, first, last, urows, cw if C else None, memo)
        got = per_ops.get((id(ps), first, last, cw))
        if got is None:                           # chunks of a pass run the same ops: the same amounts
            got = per_ops[id(ps), first, last, cw] = (np.where(live, every[rix], 0.0), live * n_every)
        vec[:, :, pi] += got[0]
        instr[:, :, pi] += got[1]
        for views_, (k_, n_) in groups.items():     # hoisted ops: where one of their views was reloaded
            f = np.zeros(S, dtype=bool)
            for k in views_:
                if k in fresh:
                    f |= fresh[k]
            run = live & f[None, :]
            vec[:, :, pi] += np.where(run, k_[rix], 0.0)
            instr[:, :, pi] += run * n_
        for st in ps.stores + (ps.end_stores if last else ()):
            cols = 1 if st.width == 1 else (cw if C else st.width)
            got = per_store.get((st.output, cols))
            if got is None:
                b = rows * cols * itemsize(prog.outputs[st.output].dtype)
                got = per_store[st.output, cols] = (
                    b, np.where(live, (b.sum(axis=0) / dev.hbm_bytes_per_cycle)[None, :], 0.0))
            sb[:, :, pi] += got[0]
            sport[:, :, pi] += got[1]
            instr[:, :, pi] += live
    flat = lambda a: a.reshape(n, S * P)               # noqa: E731
    if P > 1:
        # a step's transfers are uneven over its passes and chunks; the machine's port takes a transfer as
        # soon as its buffer is free, not only in the next task's window: spread each over two tasks
        lb, lport, sb, sport = (_spread(flat(a)) for a in (lb, lport, sb, sport))
    core, busy = stream(dev, flat(lb), flat(lport), flat(vec), flat(sb), flat(sport), flat(instr))
    stored = float(sb.sum())
    hbm = miss_all + stored
    return core, hbm, {"GM->UB": hit_all + miss_all, "UB->GM": stored}, busy


# ------------------------------------------------------------------------------------------ tiling search
def _fits(dev, low, R, C=None):
    return fits(dev, low.ub_specs(R, C))


def _max_rows(dev, low, hi, C=None) -> int:
    """The most rows (<= hi) whose tiles fit UB (0 if none): the kernel's binary search (UB use only grows
    with R)."""
    if hi < 1:
        return 0
    align = dev.align["UB"]
    # every tile is [R or 1, cols]: its rows scale with R when it has 2 rows at R = 2
    tiles = [(math.prod(s1) * itemsize(dt), reg.rows) for (s1, dt), reg in zip(low.ub_specs(1, C), low.regs)]

    def ok(R):
        used = 0
        for nbytes, rows in tiles:
            used = -(-used // align) * align + nbytes * (R if rows else 1)
        return used <= dev.buffers["UB"]

    return max(0, largest(ok, 1, hi))


def _main_bytes(low, R, C=None):
    w = max(low.views, key=lambda v: col_bytes(v.width, v.dtype) * (R if v.rows else 1), default=None)
    if w is None:
        return 0
    return (R if w.rows else 1) * col_bytes(min(w.width, C) if C else w.width, w.dtype)


def kernel_default(dev, prog) -> dict:
    """The kernel's default tiling (``default_tiling`` in the kernel, mirrored)."""
    geo = geometry(prog)
    n0 = min(dev.vector_cores, geo.tasks(1))
    per_core = ceil_div(prog.rows, n0)
    whole = lowered(prog, False)
    W = whole.width
    if _fits(dev, whole, 1):
        rmax = _max_rows(dev, whole, min(geo.inner, max(per_core, 1)))
        target = max(per_core * W // 4, 4096)
        return {"rows": int(max(1, min(rmax, target // max(W, 1))))}
    ch = lowered(prog, True)
    k = largest(lambda k: _fits(dev, ch, 1, k * F32_LANES), 1, ceil_div(W, F32_LANES))
    if k < 1:
        raise ProgramError(f"vector_program: not even one row chunk of {F32_LANES} columns fits UB on {dev.name}")
    n = ceil_div(W, k * F32_LANES)                   # the kernel's balanced_chunk
    C = min(k * F32_LANES, ceil_div(ceil_div(W, n), F32_LANES) * F32_LANES)
    return {"rows": max(1, _max_rows(dev, ch, min(geo.inner, max(per_core, 1)), C)), "chunk": C}


def candidates(dev, prog) -> list:
    """Tilings to price: the kernel's default, and the most rows that fit cut to 1/2 and 1/8 of a core's
    rows (never a main tile under MIN_TILE_BYTES, which would only look cheaper: DMA setup is not modelled)."""
    geo = geometry(prog)
    d = kernel_default(dev, prog)
    out = [d]
    n0 = min(dev.vector_cores, geo.tasks(1))
    per_core = ceil_div(prog.rows, n0)
    C = d.get("chunk")
    low = lowered(prog, C is not None)
    rmax = max(1, _max_rows(dev, low, min(geo.inner, max(per_core, 1)), C))
    for div in (2, 8):
        r = max(1, min(rmax, ceil_div(per_core, div)))
        t = {"rows": int(r)} if C is None else {"rows": int(r), "chunk": C}
        if t not in out and (_main_bytes(low, r, C) >= MIN_TILE_BYTES or r == rmax):
            out.append(t)
    return out


def _price(dev, prog, t):
    whole = lowered(prog, False)
    C = t.get("chunk")
    chunked = C is not None and int(C) < whole.width
    low = lowered(prog, True) if chunked else whole
    R = max(1, min(int(t.get("rows", 1)), low.geometry.inner))
    return _model(dev, prog, low, R, int(C) if chunked else None)


@cached
def _search(device, prog):
    dev = get_device(device)
    best = None
    for t in candidates(dev, prog):
        res = _price(dev, prog, t)
        cost = kernel_cycles(dev, *res[:3])
        if best is None or cost < best[0]:
            best = (cost, t, res)
    return best[1], best[2]


def _io(prog):
    ins = sum(math.prod(i.shape[:-1]) * col_bytes((i.shape or (1,))[-1], i.dtype) for i in prog.inputs)
    outs = sum(math.prod(s) * itemsize(o.dtype) for o, s in zip(prog.outputs, prog.output_shapes()))
    return ins + outs


def _flops(prog):
    low = lowered(prog, False)
    return float(prog.rows * sum(n_passes(op) * max(op.width, 1) for ps in low.passes for op in ps.ops))


def _roofline(dev, specs, program=None, tiling=None):
    prog = as_program(program)
    return _bound(dev, prog, _flops(prog))


def _bound(dev, prog, fl):
    """The roofline of ``prog`` of ``fl`` flops (:func:`_flops`)."""
    vec = fl / (dev.vector_bytes_per_cycle / 4) / dev.vector_cores
    return max(vec, _io(prog) / dev.hbm_bytes_per_cycle)


@register("vector_program", _roofline)
def estimate_vector_program(dev, specs, program=None, tiling=None):
    prog = as_program(program)
    _check(prog, [s for s in specs])
    if prog.rows == 0 or any(math.prod(s) == 0 for s in prog.output_shapes()):
        return make("vector_program", dev, 0.0, 0.0, {}, {}, {"rows": 1}, 0.0)
    if tiling is None:
        t, res = _search(dev.name, prog)
    else:
        t = {k: int(v) for k, v in dict(tiling).items() if v is not None}
        res = _price(dev, prog, t)
    core, hbm, nbytes, busy = res
    fl = _flops(prog)                     # (once: the roofline takes it too)
    return make("vector_program", dev, core, hbm, nbytes, busy, dict(t), _bound(dev, prog, fl), fl)


__all__ = ["candidates", "estimate_vector_program", "kernel_default", "lowered", "n_passes", "repeats"]
