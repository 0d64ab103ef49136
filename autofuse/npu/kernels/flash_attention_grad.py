"""FlashAttention's backward (CANN's FlashAttentionScoreGrad): dq, dk, dv of
``out = softmax(scale·Q·Kᵀ + mask)·V``.

Inputs as the forward (:mod:`autofuse.npu.kernels.flash_attention`), BNSD with GQA: q ``[B, N, Sq, D]``, k
``[B, Nkv, Skv, D]``, v ``[B, Nkv, Skv, Dv]``, the forward's ``out`` ``[B, N, Sq, Dv]``, its gradient ``dout``,
an optional ``mask`` (bool: True = attend, a False takes ``fill``; or additive float; broadcast to
``[B, N, Sq, Skv]``), an optional ``drop_mask`` (the forward's packed keep bits, with ``keep_prob``) and
optional saved statistics ``softmax_max`` and ``softmax_sum`` ``[B, N, Sq]`` fp32 (each row's max of its scaled,
masked scores and its sum of ``exp(score - max)``, CANN's names; the forward kernel stores exactly these).
Outputs: dq in q's dtype, dk and dv in k's (for GQA summed over the query heads sharing a kv head).

The algorithm (FlashAttention-2's backward; every quantity fp32 except the Cube operands):

    phase 0 (Vector)  Dr = rowsum(dO ∘ O) per query row -> GM;  the fp32 dq workspace := 0
    phase 1 (only without saved statistics): the forward's first sweep again, per (b, h, query block)
        over its KV tiles: Cube S = Q·K_jᵀ, Vector online max m and sum l -> GM
        (a training plan's forward saves them with ``return_stats``, as CANN's FlashAttentionScore does)
    phase 2, one work unit = (b, kv head, KV block j): K_j, V_j loaded once; for every query head h of the
        kv head and every query block i that sees block j (causal: i at or below the diagonal):
        Cube    S = Q_i·K_jᵀ, dP = dO_i·V_jᵀ                          fp32 in L0C
        Vector  P = exp(scale·S (+mask) - m_i) / l_i                  causal / padding: -inf first
                Pd = P ∘ keep / keep_prob  (dropout)                   -> operand dtype
                dS = scale · P ∘ (dP ∘ keep / keep_prob - Dr_i)        -> operand dtype
                     (0 where a bool mask holds a finite fill: that score does not depend on q, k)
        Cube    dV_j += Pdᵀ·dO_i,  dK_j += dSᵀ·Q_i                     accumulated in L0C over the unit
                dQ_i  = dS·K_j  -> atomic add into the fp32 dq workspace in GM (as CANN accumulates dq)
        last step of a unit: dK_j, dV_j cast and stored
    phase 3 (Vector, fp16/bf16 q): dq = cast(workspace) (fp32 q: the workspace is dq)

Phases are separated by a core-wide synchronisation (each waits for every core's end of the previous
one, as CANN's SyncAll). A row with no key to attend (every key masked with ``fill=-inf``) has ``l = 0``:
``P = 0`` and zero gradients, as the reference's ``_safe_softmax`` (``empty_rows="nan"``: NaN gradients, as
differentiating plain ``softmax``). The statistics are kept as max and sum, not as one log-sum-exp:
``exp(x - lse)`` would carry lse's fp32 rounding (``u·|lse|`` in the exponent, 0.4 % for a row whose
finite fill is -65504), ``exp(x - m) / l`` only one rounding per operation. ``mask_keeps_nan`` is not taken.
``mask_add_dtype`` (a 16-bit additive mask added in its dtype, as the forward's): both phases add the mask as the
forward does (the scores cast down, the add, the sum cast back up), so P is the forward's; the rounding passes the
gradient through unchanged, as eager's 16-bit add does, so dS is the same formula.

Data paths. *Coupled* cores (910, 310P): S and dP leave L0C by FixPipe to UB; Pd and dS (operand dtype)
go UB -> GM workspace (MTE3, per core, double-buffered by step parity, stays in L2) -> L1 (MTE2) and from
there to L0A transposed (for dV, dK) or not (for dQ); the dQ partial goes L0C -> UB -> GM (MTE3 atomic
add); dK, dV are cast on the way L0C -> UB and stored by MTE3. *Split* cores (910B): the AIC does every
matmul; FixPipe writes S and dP to GM workspaces, the two AIVs paired with AIC c (2c, 2c+1) each load
half of the block's rows, write Pd and dS back, and the AIC loads both halves; FixPipe adds dQ partials
into the dq workspace and stores dK, dV. Cross-side waits are explicit deps on the producer's end times;
a workspace slot is rewritten only after the step two back has read it.

Software pipeline (phase 2): step s issues stage A(s+1) (loads, S and dP, the Vector work, Pd/dS out)
before stage B(s) (Pd/dS in, the three products, dQ out), so the Cube computes S, dP of the next step
while the Vector works on this one.

Sliding window (``window`` with ``causal``): phase 1 walks each query block's band of KV blocks as the forward
does; a phase-2 unit (KV block j) takes the query blocks from the one holding j's first key to the one holding
the last row whose window reaches j's last key; pairs holding the band's left edge take a compare and a select
more (as the diagonal's do).

Scheduling: units (b, kv head, KV block) go to the least-loaded core; with ``causal`` KV blocks j and
nkv-1-j are paired in one unit (the forward's dealing, :func:`flash_attention._schedule`), which evens
out the triangle. Phases 0 and 3 deal row blocks round-robin over the vector cores; phase 1 deals query
blocks as the forward does.

Vector passes per score (fp32, 64 lanes a repeat, per-row repeats): scale, sub m, exp, mul 1/l, sub Dr,
mul P, mul scale (7), + mask (bool select, fp32 add: 1; fp16/bf16 additive: cast and add, 2; added in its
dtype: cast down, add, cast up, 3; ``fill_in_mask``: 2 more, the compare and the select that give a filled score the
fill; a bool mask with a finite fill, or ``fill_in_mask``: 1 more, the select that zeroes dS), + causal diagonal
tiles (compare, select: 2), + dropout (select and scale on P and on dP: 4), + casts of Pd and dS (2,
fp16/bf16). Phase 1 as the forward's first sweep: scale, [mask], [causal], max, sub, exp, sum.

Logit soft-capping (``softcap`` c, Gemma 2's ``c·tanh(scale·s / c)`` before the mask): both phases cap the scaled
scores as the forward does (eight more passes per score: ``1/c``, tanh's six, ``c``); phase 2 keeps ``t = tanh``
in a UB tile of its own (``tcap``, fp32, one row block) and multiplies dS by ``1 - t²`` (three more passes:
square, ``1 - ·``, mul), the cap's derivative, before the scale.

Tiling (``default_tiling``): query rows ``q`` and KV rows ``kv`` per block, the largest ``q·kv`` that fits
every buffer (then the larger kv, fewer Q/dO reloads). Phases 0 and 3 work on the same row blocks as phase 2
(a query block for dO and O, a vector core's half of it for Dr and the dq workspace on split cores), so each
GM region is read and written with the same extent in every phase and later phases hit L2.
"""
from __future__ import annotations

import numpy as np

from autofuse.npu.dtypes import itemsize
from autofuse.npu.kernels.dropout import unpack_keep
from autofuse.npu.kernels.flash_attention import (SOFTCAP_PASSES, _as_f32, _check_drop, _counts, _schedule,
                                                  add_in_dtype, band_edge, check_fill, check_mask_add, check_operands, check_window,
                                                  core_groups, filled_value, fitted_counts, mask_outside_band,
                                                  mask_passes, mask_with_spec, round_to, window_tiles)
from autofuse.npu.kernels.moe_routing import _AtomicAdd
from autofuse.npu.run import kernel

F32 = "float32"
_NEG_INF = np.float32(-np.inf)


def _ceil(a, b):
    return -(-a // b)


def _r16(x):
    return _ceil(x, 16) * 16


# ------------------------------------------------------------------------------------------ tiling
def _rings(side, buf, shapes, dtype, lo=1, hi=2):
    """One request per distinct operand shape of a buffer (tiles of one shape share a ring)."""
    out, seen = [], set()
    for sh in shapes:
        if sh not in seen:
            seen.add(sh)
            out.append((side, buf, f"{buf}:{sh[0]}x{sh[1]}", sh, dtype, lo, hi))
    return out


def _requests(device, D, Dv, dtype, t, mask_spec, drop, stats, cap=False):
    """Buffer requests ``(side, buffer, name, shape, dtype, min_count, max_count)`` in allocation order (the
    forward's format: :func:`flash_attention._counts` grants double buffers while they fit). ``stats``: the
    phase-1 sweep runs (its running max and sum). ``cap``: soft-capping's tanh tile."""
    q, kv = t["q"], t["kv"]
    split = device.arch == "split"
    rows = q // 2 if split else q
    req = [("vec", "UB", "s", (rows, kv), F32, 1, 2), ("vec", "UB", "dp", (rows, kv), F32, 1, 2),
           ("vec", "UB", "p", (rows, kv), dtype, 1, 2), ("vec", "UB", "ds", (rows, kv), dtype, 1, 2)]
    if mask_spec is not None:
        mdt, mr, mc = mask_spec
        req.append(("vec", "UB", "mask", (rows if mr else 1, kv if mc else 1), mdt, 1, 2))
    if drop:
        req.append(("vec", "UB", "drop", (rows, kv // 8), "uint8", 1, 2))
    req += [("vec", "UB", "m", (rows,), F32, 1, 2), ("vec", "UB", "l", (rows,), F32, 1, 2),
            ("vec", "UB", "dr", (rows,), F32, 1, 2)]
    if cap:
        req.append(("vec", "UB", "tcap", (rows, kv), F32, 1, 1))
    if stats:
        req += [("vec", "UB", "rm", (rows,), F32, 1, 1), ("vec", "UB", "rl", (rows,), F32, 1, 1)]
    # phases 0 and 3: dO and O rows, their Dr, the zero / dq rows (fp32) and the cast dq rows
    req += [("vec", "UB", "pre_do", (q, Dv), dtype, 1, 2), ("vec", "UB", "pre_o", (q, Dv), dtype, 1, 2),
            ("vec", "UB", "pre_d", (q,), F32, 1, 2), ("vec", "UB", "dq32", (rows, D), F32, 1, 2)]
    if dtype != F32:
        req.append(("vec", "UB", "dqc", (rows, D), dtype, 1, 2))
    if not split:              # coupled: dQ partials and the dK, dV results pass through UB
        req += [("vec", "UB", "dqs", (q, D), F32, 1, 2), ("vec", "UB", "dks", (kv, D), dtype, 1, 1),
                ("vec", "UB", "dvs", (kv, Dv), dtype, 1, 1)]
    req += [("cube", "L1", "k1", (kv, D), dtype, 1, 2), ("cube", "L1", "v1", (kv, Dv), dtype, 1, 1),
            ("cube", "L1", "q1", (q, D), dtype, 2, 2), ("cube", "L1", "do1", (q, Dv), dtype, 2, 2),
            ("cube", "L1", "p1", (rows, kv), dtype, 1, 2), ("cube", "L1", "ds1", (rows, kv), dtype, 1, 2)]
    req += [("cube", "L0C", "dk0", (kv, D), F32, 1, 1), ("cube", "L0C", "dv0", (kv, Dv), F32, 1, 1),
            ("cube", "L0C", "sdp0", (q, kv), F32, 2, 4), ("cube", "L0C", "dq0", (rows, D), F32, 1, 2)]
    # K for dQ = dS·K_j, moved to L0B before the next step's loads may replace K_j in L1
    req.append(("cube", "L0B", "kb0", (kv, D), dtype, 1, 1))
    req += _rings("cube", "L0A", [(q, D), (q, Dv), (kv, rows), (rows, kv)], dtype)
    req += _rings("cube", "L0B", [(D, kv), (Dv, kv), (rows, Dv), (rows, D), (kv, D)], dtype)
    return req


def _check_tiling(t) -> str | None:
    q, kv = t.get("q"), t.get("kv")
    if not all(isinstance(x, (int, np.integer)) and x > 0 for x in (q, kv)):
        return f"tiling needs positive integers q, kv, got {t}"
    if q % 16 or kv % 16:
        return f"q and kv must be multiples of 16 (the Cube fractal), got q={q}, kv={kv}"
    return None


def tiling_fits(device, D, Dv, dtype, t, mask_spec=None, drop=False, stats=True, cap=False) -> bool:
    """Whether tiling ``t`` (q, kv) is valid and fits every buffer it uses on ``device``."""
    return _check_tiling(t) is None and \
        _counts(device, _requests(device, D, Dv, dtype, t, mask_spec, drop, stats, cap)) is not None


_TILINGS: dict = {}


def has_tiling(device, Sq, Skv, D, Dv, dtype, mask_spec=None, drop=False, stats=True, cap=False) -> bool:
    """Whether some tiling fits ``device`` (:func:`default_tiling` finds one): a head dim too wide for its buffers
    (512 in fp32 on the 910) has none. Asked at each backward: the answer is cached as the tiling is."""
    return _search(device, Sq, Skv, D, Dv, dtype, mask_spec, drop, stats, cap) is not None


def default_tiling(device, Sq, Skv, D, Dv, dtype, mask_spec=None, drop=False, stats=True, cap=False) -> dict:
    """The largest block ``q × kv`` that fits (ties: the larger kv, fewer reloads of Q and dO per score),
    clamped to the 16-rounded sequence lengths. Cached per device and shape."""
    t = _search(device, Sq, Skv, D, Dv, dtype, mask_spec, drop, stats, cap)
    if t is None:
        raise ValueError(f"flash_attention_grad: no tiling fits {device.name} for D={D}, Dv={Dv}, {dtype}")
    return dict(t)


def _search(device, Sq, Skv, D, Dv, dtype, mask_spec, drop, stats, cap):
    """:func:`default_tiling`'s block, or None where none fits; either cached per device and shape."""
    key = (device.name, device.arch, tuple(device.buffers.items()), _r16(Sq), _r16(Skv), D, Dv, dtype,
           mask_spec, bool(drop), bool(stats), bool(cap))
    if key not in _TILINGS:
        best = None
        for q in sorted({min(x, _r16(Sq)) for x in (128, 64, 32, 16)}, reverse=True):
            for kv in sorted({min(x, _r16(Skv)) for x in (256, 128, 64, 32, 16)}, reverse=True):
                t = {"q": q, "kv": kv}
                if tiling_fits(device, D, Dv, dtype, t, mask_spec, drop, stats, cap):
                    if best is None or (q * kv, kv) > best[0]:
                        best = ((q * kv, kv), t)
        _TILINGS[key] = None if best is None else best[1]
    return _TILINGS[key]


def flops(B, N, Sq, Skv, D, Dv, causal=False) -> int:
    """Useful FLOPs: S (2·D), dP (2·Dv), dV (2·Dv), dK (2·D), dQ (2·D) per attended score, plus the
    statistics sweep's S (2·D) when the statistics are recomputed (not counted here)."""
    pairs = Sq * Skv
    if causal:
        pairs = int(np.minimum(np.arange(Sq) + 1, Skv).sum())
    return 2 * B * N * pairs * (3 * D + 2 * Dv)


# ------------------------------------------------------------------------------------------ schedule
class _Steps:
    """Per-core step lists as ``[T, n]`` arrays (``valid``, ``first``/``last`` of a unit and the indices)."""

    def __init__(self, per_core, names, n=None):
        n, T = n or len(per_core), max(len(p) for p in per_core)
        arr = np.zeros((len(names) + 1, T, n), dtype=np.int64)
        for c, steps in enumerate(per_core):
            if steps:
                arr[1:, :len(steps), c] = np.array(steps, dtype=np.int64).T
                arr[0, :len(steps), c] = 1
        self.valid = arr[0].astype(bool)
        for i, f in enumerate(names):
            setattr(self, f, arr[i + 1].astype(bool) if f in ("first", "last") else arr[i + 1])
        self.T, self.n = T, n


def query_blocks(j, qb, kvb, Sq, Skv, causal, window=0):
    """``(i0, i1)``: the query blocks with a row that sees KV block j (causal: from the one holding the block's
    first key; with a sliding ``window`` up to the one holding the last row whose window reaches the block's
    last key)."""
    nq = _ceil(Sq, qb)
    if not causal:
        return 0, nq
    i0 = min(j * kvb, Sq) // qb
    if not window:
        return i0, nq
    last_key = min((j + 1) * kvb, Skv) - 1
    return i0, max(i0, min(nq, (last_key + window - 1) // qb + 1))


def _main_steps(B, Nkv, group, nq, nkv, qb, kvb, Sq, Skv, causal, ncores, n=None, window=0):
    """Phase 2: units (b, kv head, KV block j), each a list of (query head in group, query block) steps."""
    def inner(j):
        i0, i1 = query_blocks(j, qb, kvb, Sq, Skv, causal, window)
        return [(hh * nq + i, False) for hh in range(group) for i in range(i0, i1)]

    per_core = _schedule(B, Nkv, nkv, causal, ncores, inner)
    st = _Steps(per_core, ("b", "hk", "j", "x", "first", "last", "skip"), n)
    st.h = st.hk * group + st.x // nq
    st.i = st.x % nq
    return st


def _stats_steps(B, N, nq, nkv, qb, kvb, Sq, Skv, causal, ncores, n=None, window=0):
    """Phase 1: items (b, h, query block i), each over its KV tiles (causal: up to the diagonal; a sliding
    window: the band's, as the forward walks them)."""
    def tiles(i):
        lo, hi = window_tiles(i, qb, kvb, Sq, Skv, causal, window)
        return [(j, False) for j in range(lo, hi)]

    return _Steps(_schedule(B, N, nq, causal, ncores, tiles), ("b", "h", "i", "j", "first", "last", "skip"), n)


# ------------------------------------------------------------------------------------------ kernel
@kernel("flash_attention_grad")
def flash_attention_grad(launch, q, k, v, out, dout, mask=None, drop_mask=None, softmax_max=None, softmax_sum=None,
                         scale=None, causal=False, keep_prob=1.0, fill=float("-inf"), empty_rows="zero", tiling=None,
                         softcap=None, window=0, mask_add_dtype=None, fill_in_mask=False):
    """dq, dk, dv of fused attention (module docstring). ``softmax_max``, ``softmax_sum``: saved row statistics
    ``[B, N, Sq]`` fp32 (None: recomputed in phase 1). ``tiling``: ``{"q", "kv"}`` (None: :func:`default_tiling`).
    ``softcap``: the forward's logit soft-capping ``softcap · tanh(scale·S / softcap)`` (module docstring).
    ``window`` (with ``causal``): the forward's sliding window (module docstring). ``mask_add_dtype``: the forward's
    (an additive 16-bit mask added in its dtype). ``fill_in_mask`` (an additive mask that is a bool mask and additive
    terms combined, ``where(keep, terms, fill)``): its entries equal to ``fill`` (as the mask's dtype holds it) are
    scores the bool mask filled, and their dS is zeroed as a bool mask's finite fill's is."""
    dev = launch.device
    check_operands("flash_attention_grad", (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)))
    B, N, Sq, D = q.shape
    Bk, Nkv, Skv, Dk = k.shape
    Dv = v.shape[3]
    if (Bk, Nkv, Skv) != tuple(v.shape[:3]) or Bk != B or Dk != D or Nkv < 1 or N % Nkv:
        raise ValueError(f"flash_attention_grad: shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
                         f"do not agree (need k [B, Nkv, Skv, D], v [B, Nkv, Skv, Dv], Nkv dividing N)")
    for name, t in (("out", out), ("dout", dout)):
        if tuple(t.shape) != (B, N, Sq, Dv):
            raise ValueError(f"flash_attention_grad: {name} is {list(t.shape)}, expected {[B, N, Sq, Dv]}")
    if (softmax_max is None) != (softmax_sum is None):
        raise ValueError("flash_attention_grad: give softmax_max and softmax_sum together (or neither: the "
                         "kernel recomputes them)")
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if t is not None and (tuple(t.shape) != (B, N, Sq) or t.dtype != F32):
            raise ValueError(f"flash_attention_grad: {name} is {t.dtype} {list(t.shape)}; it must be float32 "
                             f"{[B, N, Sq]} (each row's statistic of its scaled, masked scores)")
    fill = check_fill("flash_attention_grad", empty_rows, fill)
    window = check_window("flash_attention_grad", window, causal)
    mask_add_dtype = check_mask_add("flash_attention_grad", mask, mask_add_dtype)
    mask, mask_spec = mask_with_spec(mask, B, N, Sq, Skv)
    drop = drop_mask is not None
    if drop:
        _check_drop(drop_mask, keep_prob, (B, N, Sq, Skv), False)
    stats = softmax_max is None
    if softcap is not None and not (np.isfinite(softcap) and softcap > 0):
        raise ValueError(f"flash_attention_grad: softcap={softcap}; it must be a positive finite number or None")
    cap = softcap is not None
    if tiling is None:
        t = default_tiling(dev, Sq, Skv, D, Dv, q.dtype, mask_spec, drop, stats, cap)
    else:
        t = dict(tiling)
        bad = _check_tiling(t)
        if bad:
            raise ValueError(f"flash_attention_grad: {bad}")
    req = _requests(dev, D, Dv, q.dtype, t, mask_spec, drop, stats, cap)
    counts = fitted_counts("flash_attention_grad", dev, req, t)
    prog = _Program(launch, q, k, v, out, dout, mask, drop_mask, (softmax_max, softmax_sum), t, req, counts,
                    bool(causal), window)
    prog.scale = np.float32(D ** -0.5 if scale is None else scale)
    prog.fill = np.float32(fill)
    prog.empty = np.float32(0.0 if empty_rows == "zero" else np.nan)
    prog.inv_keep = np.float32(1.0 / keep_prob)
    prog.softcap = None if softcap is None else np.float32(softcap)
    prog.mask_add = mask_add_dtype
    prog.fill_in_mask = None
    if fill_in_mask and mask is not None and mask.dtype != "bool":
        prog.fill_in_mask = filled_value(fill, mask.dtype)
    return prog.run()


class _Program:
    """One launch: allocations, the schedules and the four phases."""

    def __init__(self, launch, q, k, v, out, dout, mask, drop_mask, saved, t, req, counts, causal, window=0):
        dev = launch.device
        self.launch, self.dev = launch, dev
        self.split = dev.arch == "split"
        self.q, self.k, self.v = _as_f32(q, "q"), _as_f32(k, "k"), _as_f32(v, "v")
        self.o, self.do = _as_f32(out, "out"), _as_f32(dout, "dout")
        self.mask, self.drop = mask, drop_mask
        self.dtype, self.isz = q.dtype, itemsize(q.dtype)
        B, N, Sq, D = q.shape
        _, Nkv, Skv, _ = k.shape
        Dv = v.shape[3]
        self.B, self.N, self.Nkv, self.Sq, self.Skv, self.D, self.Dv = B, N, Nkv, Sq, Skv, D, Dv
        self.qb, self.kvb = t["q"], t["kv"]
        self.nh = 2 if self.split else 1
        self.R = self.qb // self.nh                 # query rows one vector core owns
        nq, nkv = _ceil(Sq, self.qb), _ceil(Skv, self.kvb)
        self.nq, self.nkv = nq, nkv
        self.causal, self.window = causal, window
        self.softcap = None                   # set by the caller (logit soft-capping)
        self.mask_add = None                  # the 16-bit dtype an additive mask is added in, set by the caller
        self.fill_in_mask = None              # an additive mask's value marking a bool-filled score (the caller's)
        # the schedules (the cores a phase uses: its units, dealt; the groups have the larger count)
        self.st_main = _main_steps(B, Nkv, N // Nkv, nq, nkv, self.qb, self.kvb, Sq, Skv, causal, dev.cube_cores,
                                   window=window)
        self.recompute = saved[0] is None
        self.st_stats = _stats_steps(B, N, nq, nkv, self.qb, self.kvb, Sq, Skv, causal, dev.cube_cores,
                                     window=window) if self.recompute else None
        n = max(self.st_main.n, self.st_stats.n if self.recompute else 0)
        if self.st_main.n < n:
            self.st_main = _main_steps(B, Nkv, N // Nkv, nq, nkv, self.qb, self.kvb, Sq, Skv, causal, dev.cube_cores,
                                       n, window)
        if self.recompute and self.st_stats.n < n:
            self.st_stats = _stats_steps(B, N, nq, nkv, self.qb, self.kvb, Sq, Skv, causal, dev.cube_cores, n,
                                         window)
        self.n = n
        self.cg, self.vg, self.tl = core_groups(launch, n, self.split, req, counts, sep="#")
        self.nv = self.vg.n
        self.ring = {}
        f32 = F32
        self.m_gm, self.l_gm = saved if not self.recompute else \
            (launch.empty((B, N, Sq), f32, "softmax_max", scratch=True),
             launch.empty((B, N, Sq), f32, "softmax_sum", scratch=True))
        self.dr = launch.empty((B, N, Sq), f32, "rowsum_dO_O", scratch=True)
        self.dq_ws = launch.empty((B, N, Sq, D), f32, "dq_workspace", scratch=True)
        self.dk = launch.empty((B, Nkv, Skv, D), k.dtype, "dk")
        self.dv = launch.empty((B, Nkv, Skv, Dv), v.dtype, "dv")
        qb, kvb = self.qb, self.kvb
        self.ws_p = launch.empty((n, 2, qb, kvb), self.dtype, "ws_p", scratch=True)
        self.ws_ds = launch.empty((n, 2, qb, kvb), self.dtype, "ws_ds", scratch=True)
        if self.split:
            self.ws_s = launch.empty((n, 2, qb, kvb), f32, "ws_s", scratch=True)
            self.ws_dp = launch.empty((n, 2, qb, kvb), f32, "ws_dp", scratch=True)
        self.half = np.arange(self.nv) % self.nh
        self.cube_of = np.arange(self.nv) // self.nh
        self.col = np.arange(kvb)
        self.rowi = np.arange(self.R)
        self.ends = {}

    # ---------------------------------------------------------------- helpers
    def _next(self, name):
        tiles = self.tl[name]
        i = self.ring.get(name, 0)
        self.ring[name] = i + 1
        return tiles[i % len(tiles)]

    def _ring(self, buf, shape):
        return self._next(f"{buf}:{shape[0]}x{shape[1]}")

    @staticmethod
    def _act(m):
        return None if m.all() else m

    def _vec(self, a):
        """Per cube core -> per vector core."""
        return np.repeat(a, self.nh) if self.split else a

    def _to_cube(self, end):
        """Vector-core end times -> per cube core (the later of the pair)."""
        return end.reshape(-1, self.nh).max(axis=1) if self.split else end

    def _sync(self):
        """Every core waits for every core (SyncAll): the later phase's deps."""
        t = self.launch.sync_all()
        return (np.full(self.cg.n, t), np.full(self.nv, t))

    # ---------------------------------------------------------------- phase 0: Dr = rowsum(dO∘O), dq := 0
    def _row_blocks(self, halves):
        """(b, h, first row, rows) blocks, round-robin over the vector cores, per lockstep step a list with one
        entry (or None) per vector core: query blocks, or (``halves``) the rows each vector core of a split
        core owns in phase 2 (the same regions as there)."""
        nv, R = self.nv, (self.R if halves else self.qb)
        items = [(b, h, r0, min(R, self.Sq - r0)) for b in range(self.B) for h in range(self.N)
                 for r0 in range(0, self.Sq, R)]
        return [[items[s * nv + c] if s * nv + c < len(items) else None for c in range(nv)]
                for s in range(_ceil(len(items), nv))]

    @staticmethod
    def _present(items):
        return np.array([it is not None for it in items]), np.array([it[3] if it else 0 for it in items])

    def phase_pre(self):
        vg, Dv, D, R = self.vg, self.Dv, self.D, self.R
        zero = self.tl["dq32"][0]
        vg.vector("dup 0", [zero], [], vg.repeats(R * D, F32), compute=lambda: zero.data.fill(0))
        zeros, blocks = self._row_blocks(True), self._row_blocks(False)

        def zero_steps(lo, hi):
            for items in zeros[lo:hi]:
                present, _ = self._present(items)
                vg.store(zero, self.dq_ws, [(it[0], it[1], slice(it[2], it[2] + it[3]), slice(0, D)) if it else None
                                            for it in items], active=self._act(present), name="zero dq")

        # the zero stores interleaved with the Dr steps (the GM port books transfers in issue order: stores all
        # issued first would hold it ahead of every load)
        for k, items in enumerate(blocks):
            zero_steps(k * len(zeros) // len(blocks), (k + 1) * len(zeros) // len(blocks))
            present, rows = self._present(items)
            act = self._act(present)
            regs = [(it[0], it[1], slice(it[2], it[2] + it[3]), slice(0, Dv)) if it else None for it in items]
            a, b, d = self._next("pre_do"), self._next("pre_o"), self._next("pre_d")
            vg.load(a, self.do, regs, active=act, name="load dO")
            vg.load(b, self.o, regs, active=act, name="load O")
            passes = 3 if self.dtype != F32 else 1          # (cast dO, cast O,) mul; + the row sum

            def rowsum(a=a, b=b, d=d):
                np.einsum("crd,crd->cr", a.data, b.data, out=d.data)

            vg.vector("Dr=rowsum(dO*O)", [d], [a, b], vg.row_repeats(rows, Dv, F32) * (passes + 1),
                      compute=rowsum, active=act)
            for hh in range(self.nh):                        # by halves on split cores: as phase 2 reads it
                rh = np.clip(rows - hh * R, 0, R)
                hp = present & (rh > 0)
                if hp.any():
                    vg.store(d, self.dr, [(it[0], it[1], slice(it[2] + hh * R, it[2] + hh * R + rh[c]))
                                          if hp[c] else None for c, it in enumerate(items)], active=self._act(hp),
                             fn=(lambda x, hh=hh: x[hh * R:(hh + 1) * R]) if self.split else None, name="store Dr")

    # ---------------------------------------------------------------- phase 1: the row statistics
    def phase_stats(self, deps):
        st = self.st_stats
        cg, D = self.cg, self.D
        group = self.N // self.Nkv
        cdeps, vdeps = deps
        for s in range(st.T):
            work = st.valid[s]
            if not work.any():
                continue
            wact = self._act(work)
            b, h, i, j = st.b[s], st.h[s], st.i[s], st.j[s]
            q0, k0 = i * self.qb, j * self.kvb
            qext = np.where(work, np.minimum(self.qb, self.Sq - q0), 0)
            kext = np.where(work, np.minimum(self.kvb, self.Skv - k0), 0)
            first = st.first[s] & work
            a_q = self.tl[f"L0A:{self.qb}x{D}"][0]      # an item's Q stays for all its steps (one tile)
            if first.any():
                q1 = self.tl["q1"][0]
                cg.load(q1, self.q, [(b[c], h[c], slice(q0[c], q0[c] + qext[c]), slice(0, D)) if first[c] else None
                                     for c in range(self.n)], deps=(cdeps,), name="load Q")
                cg.move(a_q, q1, nbytes=_r16(qext) * D * self.isz, active=self._act(first), name="Q->L0A")
            k1 = self._next("k1")
            cg.load(k1, self.k, [(b[c], h[c] // group, slice(k0[c], k0[c] + kext[c]), slice(0, D)) if work[c] else None
                                 for c in range(self.n)], active=wact, deps=(cdeps,), name="load K")
            b_kt = self._ring("L0B", (D, self.kvb))
            cg.move(b_kt, k1, fn=lambda x: x.transpose(0, 2, 1), nbytes=D * _r16(kext) * self.isz, active=wact,
                    name="K^T->L0B")
            s0 = self._next("sdp0")
            cg.mmad(s0, a_q, b_kt, qext, D, kext, accumulate=False, active=wact, name="S=QK")
            S = self._s_to_vector(s0, "s", st, s, qext, kext, work, ("s", s), vdeps)
            self._online_stats(S, st, s, qext, kext, work, q0, k0)

    def _vrows(self, qext, work):
        """Per vector core: its rows of the block, their offset in the block, and which cores work."""
        ro = self.half * self.R
        rows = np.clip(self._vec(qext) - ro, 0, self.R)
        return rows, ro, self._vec(work) & (rows > 0)

    def _s_to_vector(self, c0, ub, st, s, qext, kext, work, key, vdeps=None):
        """An fp32 [q, kv] L0C block to the vector cores' UB: FixPipe move (coupled), or FixPipe to a GM
        workspace and each AIV loading its half (split). Returns the UB tile."""
        X = self._next(ub)
        rows, ro, ract = self._vrows(qext, work)
        if not self.split:
            self.vg.move(X, c0, nbytes=qext * kext * 4, active=self._act(work), name=f"FixPipe {ub}->UB")
            return X
        ws = self.ws_s if ub == "s" else self.ws_dp
        slot = s % 2
        n = self.n
        rd = self.ends.get((ub + "_read", s - 2))
        ends = np.zeros(n)
        for hh in range(self.nh):               # per AIV's half: the region it loads (an L2 hit)
            rh = np.clip(qext - hh * self.R, 0, self.R)
            hw = work & (rh > 0)
            if not hw.any():
                continue
            e = self.cg.store(c0, ws, [(c, slot, slice(hh * self.R, hh * self.R + rh[c]), slice(0, kext[c]))
                                       if hw[c] else None for c in range(n)], active=self._act(hw),
                              deps=() if rd is None else (rd,), fn=lambda x, hh=hh: x[hh * self.R:(hh + 1) * self.R],
                              name=f"FixPipe {ub}->GM")
            ends = np.maximum(ends, np.where(hw, e, 0.0))
        e = ends
        kv_v = self._vec(kext)
        deps = (np.repeat(e, 2),) + ((vdeps,) if vdeps is not None else ())
        e2 = self.vg.load(X, ws, [(int(self.cube_of[c]), slot, slice(ro[c], ro[c] + rows[c]), slice(0, kv_v[c]))
                                  if ract[c] else None for c in range(self.nv)], active=self._act(ract), deps=deps,
                          name=f"load {ub}")
        self.ends[(ub + "_read", s)] = self._to_cube(np.where(ract, e2, 0.0))
        return X

    def _bounds(self, ract, vq0, rows, vk0, vke):
        """Per vector core: whether its block crosses the diagonal, and whether it holds a sliding window's left
        edge (each a compare and a select more)."""
        return self.causal & ract & (vk0 + vke - 1 > vq0), ract & band_edge(self.window, vq0, rows, vk0)

    def _mask_and_bounds(self, x, cs, b, h, vq0, k0, rows, kext, mt, causal_rows, tcap=None, band=False):
        """scale·x, [the soft-cap c·tanh(·/c), its tanh kept in ``tcap``], the mask, -inf past the keys / above the
        diagonal / left of a sliding window (``band``), in place (fp32, per core slice)."""
        np.multiply(x, self.scale, out=x)
        if self.softcap is not None:
            np.multiply(x, np.float32(1) / self.softcap, out=x)
            np.tanh(x, out=x)
            if tcap is not None:
                np.copyto(tcap.data[cs], x)
            np.multiply(x, self.softcap, out=x)
        if mt is not None:
            if self.mask.dtype == "bool":
                np.copyto(x, self.fill, where=~mt.data[cs])
            elif self.mask_add is not None:     # as the forward adds it (eager's 16-bit add)
                add_in_dtype(x, mt.data[cs], self.mask_add, np.empty_like(x), np.empty_like(x))
            else:
                np.add(x, mt.data[cs], out=x)
            if self.fill_in_mask is not None:   # a filled score is the fill, as the forward makes it
                np.copyto(x, self.fill_in_mask, where=mt.data[cs] == self.fill_in_mask)
        np.copyto(x, _NEG_INF, where=self.col[None, None, :] >= kext[cs, None, None])
        mask_outside_band(x, vq0[cs], k0[cs], self.rowi, self.col, causal_rows, self.window if band else 0)

    def _load_mask(self, b, h, vq0, rows, k0, kext, ract):
        mt = self._next("mask")
        mB, mN, mr, mc = self.mask.shape
        self.vg.load(mt, self.mask, [
            (b[c] if mB != 1 else 0, h[c] if mN != 1 else 0,
             slice(vq0[c], vq0[c] + rows[c]) if mr != 1 else slice(0, 1),
             slice(k0[c], k0[c] + kext[c]) if mc != 1 else slice(0, 1)) if ract[c] else None
            for c in range(self.nv)], active=self._act(ract), name="load mask")
        return mt

    def _vector_passes(self, rows, kext, partial, ract, base, edge=0):
        vg = self.vg
        rr = vg.row_repeats(rows, kext, F32) * ract
        passes = base + (SOFTCAP_PASSES if self.softcap is not None else 0)
        if self.mask is not None:
            passes += mask_passes(self.mask.dtype, self.mask_add, self.fill_in_mask is not None)
        return rr * passes + rr * partial * 2 + rr * edge * 2

    def _online_stats(self, S, st, s, qext, kext, work, q0, k0):
        vg = self.vg
        rows, ro, ract = self._vrows(qext, work)
        if not ract.any():
            return
        b, h = self._vec(st.b[s]), self._vec(st.h[s])
        vq0, vk0, vke = self._vec(q0) + ro, self._vec(k0), self._vec(kext)
        first, last = self._vec(st.first[s]) & ract, self._vec(st.last[s]) & ract
        partial, edge = self._bounds(ract, vq0, rows, vk0, vke)
        mt = self._load_mask(b, h, vq0, rows, vk0, vke, ract) if self.mask is not None else None
        M, L = self.tl["rm"][0], self.tl["rl"][0]
        causal_any, band = bool(partial.any()), bool(edge.any())

        def stats(cs):
            x = S.data[cs]
            self._mask_and_bounds(x, cs, b, h, vq0, vk0, rows, vke, mt, causal_any, band=band)
            fc = first[cs, None]
            mprev = np.where(fc, _NEG_INF, M.data[cs])
            mnew = np.maximum(mprev, x.max(axis=-1))
            muse = np.where(mnew == _NEG_INF, np.float32(0), mnew)
            alpha = np.exp(mprev - muse)
            lprev = np.where(fc, np.float32(0), L.data[cs])
            L.data[cs] = alpha * lprev + np.exp(x - muse[:, :, None]).sum(axis=-1)
            M.data[cs] = mnew

        reps = self._vector_passes(rows, vke, partial, ract, 5, edge) + vg.repeats(rows, F32) * ract * 5
        vg.vector("stats: scale mask max sub exp sum", [M, L], [S] + ([mt] if mt is not None else []), reps,
                  compute=stats, per_core=True, active=self._act(ract))
        if last.any():
            la = self._act(last)
            regs = [(b[c], h[c], slice(vq0[c], vq0[c] + rows[c])) if last[c] else None for c in range(self.nv)]
            vg.store(M, self.m_gm, regs, active=la, name="store max")
            vg.store(L, self.l_gm, regs, active=la, name="store sum")

    # ---------------------------------------------------------------- phase 2: the gradients
    def stage_a(self, st, s, deps):
        """Loads (K, V on a unit's first step; Q_i, dO_i), S and dP on the Cube, P and dS on the Vector, out."""
        cg, n, D, Dv = self.cg, self.n, self.D, self.Dv
        self.cur_a = None
        work = st.valid[s]
        if not work.any():
            return
        wact = self._act(work)
        cdeps, vdeps = deps
        b, hk, j, h, i = st.b[s], st.hk[s], st.j[s], st.h[s], st.i[s]
        q0, k0 = i * self.qb, j * self.kvb
        qext = np.where(work, np.minimum(self.qb, self.Sq - q0), 0)
        kext = np.where(work, np.minimum(self.kvb, self.Skv - k0), 0)
        first = st.first[s] & work
        if first.any():
            fa = self._act(first)
            # one K and one V tile: cores in lockstep start units at different steps (a core's K stays in
            # its slice of the tile until its next unit's load)
            k1, v1 = self.tl["k1"][0], self.tl["v1"][0]
            cg.load(k1, self.k, [(b[c], hk[c], slice(k0[c], k0[c] + kext[c]), slice(0, D)) if first[c] else None
                                 for c in range(n)], active=fa, deps=(cdeps,), name="load K")
            cg.load(v1, self.v, [(b[c], hk[c], slice(k0[c], k0[c] + kext[c]), slice(0, Dv)) if first[c] else None
                                 for c in range(n)], active=fa, deps=(cdeps,), name="load V")
            self.k1_cur, self.v1_cur = k1, v1
        q1, do1 = self._next("q1"), self._next("do1")
        qregs = [(b[c], h[c], slice(q0[c], q0[c] + qext[c])) if work[c] else None for c in range(n)]
        cg.load(q1, self.q, [r + (slice(0, D),) if r else None for r in qregs], active=wact, deps=(cdeps,),
                name="load Q")
        cg.load(do1, self.do, [r + (slice(0, Dv),) if r else None for r in qregs], active=wact, deps=(cdeps,),
                name="load dO")
        s0 = self._scores(q1, self.k1_cur, D, qext, kext, wact, ("Q", "K", "S=QK"))
        dp0 = self._scores(do1, self.v1_cur, Dv, qext, kext, wact, ("dO", "V", "dP=dO V"))
        S = self._s_to_vector(s0, "s", st, s, qext, kext, work, None, vdeps)
        dP = self._s_to_vector(dp0, "dp", st, s, qext, kext, work, None, vdeps)
        self._grad_vector(S, dP, st, s, qext, kext, work, q0, k0, vdeps)
        self.cur_a = (q1, do1, qext, kext, q0, work)

    def _scores(self, rows1, keys1, width, qext, kext, act, names):
        """``rows · keysᵀ`` (S = Q·K_jᵀ, dP = dO·V_jᵀ) from their L1 tiles into an fp32 L0C tile (the keys move
        to L0B transposed, as the L1 -> L0B load does)."""
        cg, isz = self.cg, self.isz
        a = self._ring("L0A", (self.qb, width))
        cg.move(a, rows1, nbytes=_r16(qext) * width * isz, active=act, name=f"{names[0]}->L0A")
        b = self._ring("L0B", (width, self.kvb))
        cg.move(b, keys1, fn=lambda x: x.transpose(0, 2, 1), nbytes=width * _r16(kext) * isz, active=act,
                name=f"{names[1]}^T->L0B")
        c = self._next("sdp0")
        cg.mmad(c, a, b, qext, width, kext, accumulate=False, active=act, name=names[2])
        return c

    def _grad_vector(self, S, dP, st, s, qext, kext, work, q0, k0, vdeps):
        vg, nv = self.vg, self.nv
        rows, ro, ract = self._vrows(qext, work)
        if not ract.any():
            return
        a_ = self._act(ract)
        b, h = self._vec(st.b[s]), self._vec(st.h[s])
        vq0, vk0, vke = self._vec(q0) + ro, self._vec(k0), self._vec(kext)
        partial, edge = self._bounds(ract, vq0, rows, vk0, vke)
        band = bool(edge.any())
        lregs = [(b[c], h[c], slice(vq0[c], vq0[c] + rows[c])) if ract[c] else None for c in range(nv)]
        mt_, lt, dt = self._next("m"), self._next("l"), self._next("dr")
        vg.load(mt_, self.m_gm, lregs, active=a_, deps=(vdeps,), name="load max")
        vg.load(lt, self.l_gm, lregs, active=a_, deps=(vdeps,), name="load sum")
        vg.load(dt, self.dr, lregs, active=a_, deps=(vdeps,), name="load Dr")
        mt = self._load_mask(b, h, vq0, rows, vk0, vke, ract) if self.mask is not None else None
        kt = None
        if self.drop is not None:
            kt = self._next("drop")
            vg.load(kt, self.drop, [(b[c], h[c], slice(vq0[c], vq0[c] + rows[c]),
                                     slice(vk0[c] // 8, (vk0[c] + vke[c] + 7) // 8)) if ract[c] else None
                                    for c in range(nv)], active=a_, name="load dropout mask")
        P, DS = self._next("p"), self._next("ds")
        tc = self.tl["tcap"][0] if self.softcap is not None else None
        causal_any = bool(partial.any())
        f32 = self.dtype == F32
        # a bool-masked score is a constant (masked_fill's backward): its dS is zeroed where it could be other
        # than 0, a finite fill's, or an empty row's NaN (empty_rows="nan"; with -inf a kept row's P is 0 there)
        zero_fill = int(mt is not None and ((self.mask.dtype == "bool" and
                                             (np.isfinite(self.fill) or np.isnan(self.empty)))
                                            or self.fill_in_mask is not None))

        def grads(cs):
            x = S.data[cs]
            self._mask_and_bounds(x, cs, b, h, vq0, vk0, rows, vke, mt, causal_any, tc, band)
            m = mt_.data[cs]
            np.subtract(x, np.where(m == _NEG_INF, np.float32(0), m)[:, :, None], out=x)
            np.exp(x, out=x)
            lv = lt.data[cs]
            zero = lv == 0                       # a row with no key to attend: 0 (or NaN, empty_rows="nan")
            np.multiply(x, np.where(zero, self.empty, np.float32(1) / np.where(zero, np.float32(1), lv))[:, :, None],
                        out=x)
            np.copyto(x, np.float32(0), where=self.rowi[None, :, None] >= rows[cs, None, None])   # padding rows
            dp = dP.data[cs]
            if kt is not None:
                keep = unpack_keep(kt.data[cs], self.kvb).astype(np.float32) * self.inv_keep
                np.multiply(dp, keep, out=dp)
            np.subtract(dp, dt.data[cs][:, :, None], out=dp)
            np.multiply(dp, x, out=dp)
            if tc is not None:                   # the cap's derivative: d(c·tanh(u/c))/du = 1 - tanh²
                t_ = tc.data[cs]
                np.multiply(dp, np.float32(1) - t_ * t_, out=dp)
            np.multiply(dp, self.scale, out=dp)
            if zero_fill:                        # a filled score is a constant: no gradient flows through it
                filled = ~mt.data[cs] if self.fill_in_mask is None else mt.data[cs] == self.fill_in_mask
                np.copyto(dp, np.float32(0), where=filled)
            if kt is not None:
                np.multiply(x, keep, out=x)
            if f32:
                np.copyto(P.data[cs], x)
                np.copyto(DS.data[cs], dp)
            else:
                round_to(x, self.dtype, P.data[cs], np.empty_like(x))
                round_to(dp, self.dtype, DS.data[cs], np.empty_like(dp))

        base = 7 + (0 if f32 else 2) + (4 if kt is not None else 0) + zero_fill + (3 if tc is not None else 0)
        reads = [S, dP, mt_, lt, dt] + ([mt] if mt is not None else []) + ([kt] if kt is not None else [])
        vg.vector("P=exp(scale S-m)/l, dS=P(dP-Dr)scale, cast", [P, DS, S, dP] + ([tc] if tc is not None else []), reads,
                  self._vector_passes(rows, vke, partial, ract, base, edge), compute=grads, per_core=True, active=a_)
        slot = s % 2
        cube_of = self.cube_of
        for tile, ws, key in ((P, self.ws_p, "p"), (DS, self.ws_ds, "ds")):
            rd = [self.ends[k_] for k_ in ((key + "_read", s - 2, hh) for hh in range(self.nh)) if k_ in self.ends]
            rd = np.max(rd, axis=0) if rd else None
            e = vg.store(tile, ws, [(int(cube_of[c]), slot, slice(ro[c], ro[c] + rows[c]), slice(0, vke[c]))
                                    if ract[c] else None for c in range(nv)], active=a_,
                         deps=() if rd is None else (self._vec(rd),), name=f"store {key}")
            self.ends[(key + "_written", s)] = self._to_cube(np.where(ract, e, 0.0))

    def k_for_dq(self, a_state):
        """K_j -> L0B for step s's dQ, issued before step s+1's loads (which may bring a new K_j into L1)."""
        work, kext = a_state[5], a_state[3]
        self.cg.move(self.tl["kb0"][0], self.k1_cur, nbytes=_r16(kext) * self.D * self.isz,
                     active=self._act(work), name="K->L0B")

    def stage_b(self, st, s, a_state):
        """Pd and dS back on the Cube: dV += Pdᵀ·dO, dK += dSᵀ·Q, dQ_i = dS·K_j (atomic add); at the unit's end
        dK and dV go out."""
        cg, n, D, Dv, isz = self.cg, self.n, self.D, self.Dv, self.isz
        q1, do1, qext, kext, q0, work = a_state
        if not work.any():
            return
        slot = s % 2
        b, hk, h, j = st.b[s], st.hk[s], st.h[s], st.j[s]
        k0 = j * self.kvb
        first, last = st.first[s] & work, st.last[s] & work
        mk = _r16(kext)
        tr = (lambda x: x.transpose(0, 2, 1))
        dk0, dv0 = self.tl["dk0"][0], self.tl["dv0"][0]
        R = self.R
        for hh in range(self.nh):
            # per half of the block on split cores (each AIV's rows: the region it stored, so the load hits L2)
            rh = np.clip(qext - hh * R, 0, R)
            hw = work & (rh > 0)
            if not hw.any():
                continue
            ha = self._act(hw)
            mr = _r16(rh)
            rows_of = (lambda x, hh=hh: x[:, hh * R:(hh + 1) * R]) if self.split else None
            p1, ds1 = self._next("p1"), self._next("ds1")
            for tile, ws, key in ((p1, self.ws_p, "p"), (ds1, self.ws_ds, "ds")):
                e = cg.load(tile, ws, [(c, slot, slice(hh * R, hh * R + rh[c]), slice(0, kext[c])) if hw[c] else None
                                       for c in range(n)], active=ha, deps=(self.ends[(key + "_written", s)],),
                            name=f"load {key}")
                self.ends[(key + "_read", s, hh)] = np.where(hw, e, 0.0)
            f = first & (hh == 0)              # the unit's first product into each accumulator starts it
            # dV_j += Pdᵀ·dO_i
            a_pt = self._ring("L0A", (self.kvb, R))
            cg.move(a_pt, p1, fn=tr, nbytes=mk * mr * isz, active=ha, name="Pd^T->L0A")
            b_do = self._ring("L0B", (R, Dv))
            cg.move(b_do, do1, fn=rows_of, nbytes=mr * Dv * isz, active=ha, name="dO->L0B")
            self._acc(dv0, a_pt, b_do, kext, rh, Dv, f, hw, "dV+=Pd^T dO")
            # dK_j += dSᵀ·Q_i
            a_dst = self._ring("L0A", (self.kvb, R))
            cg.move(a_dst, ds1, fn=tr, nbytes=mk * mr * isz, active=ha, name="dS^T->L0A")
            b_q = self._ring("L0B", (R, D))
            cg.move(b_q, q1, fn=rows_of, nbytes=mr * D * isz, active=ha, name="Q->L0B")
            self._acc(dk0, a_dst, b_q, kext, rh, D, f, hw, "dK+=dS^T Q")
            # dQ_i = dS·K_j, added into the fp32 workspace
            a_ds = self._ring("L0A", (R, self.kvb))
            cg.move(a_ds, ds1, nbytes=mr * mk * isz, active=ha, name="dS->L0A")
            dq0 = self._next("dq0")
            cg.mmad(dq0, a_ds, self.tl["kb0"][0], rh, kext, D, accumulate=False, active=ha, name="dQ=dS K")
            regs = [(b[c], h[c], slice(q0[c] + hh * R, q0[c] + hh * R + rh[c]), slice(0, D)) if hw[c] else None
                    for c in range(n)]
            src = dq0
            if not self.split:
                src = self._next("dqs")
                cg.move(src, dq0, nbytes=rh * D * 4, active=ha, name="FixPipe dQ->UB")
            cg.store(src, self.dq_ws, regs, active=ha,
                     fn=_AtomicAdd(self.dq_ws, regs) if self.launch.values else None, name="atomic add dQ")
        if last.any():
            la = self._act(last)
            kv_regs = [(b[c], hk[c], slice(k0[c], k0[c] + kext[c])) if last[c] else None for c in range(n)]
            for acc, outt, width, ub in ((dk0, self.dk, D, "dks"), (dv0, self.dv, Dv, "dvs")):
                src = acc
                if not self.split:
                    src = self._next(ub)
                    cg.move(src, acc, nbytes=kext * width * 4, active=la, name=f"FixPipe {ub[:2]}->UB (cast)")
                cg.store(src, outt, [r + (slice(0, width),) if r else None for r in kv_regs], active=la,
                         name=f"store {ub[:2]}")

    def _acc(self, c0, a, b_, m, k, n_, first, work, name):
        """``c0 (+)= a·b`` for the working cores: a unit's first step starts its accumulator afresh. Cores in
        lockstep may be at different points of their units, so one mmad serves both: it accumulates where
        the unit goes on (the bias-table seed is the accumulator itself) and starts from zero elsewhere."""
        wa = self._act(work)
        f = first & work
        if not f.any():
            return self.cg.mmad(c0, a, b_, m, k, n_, accumulate=True, active=wa, name=name)
        init = None
        if not f[work].all() and self.launch.values:
            init = c0.data * (~f)[:, None, None]
        return self.cg.mmad(c0, a, b_, m, k, n_, accumulate=False, init=init, active=wa, name=name)

    # ---------------------------------------------------------------- phase 3: dq = cast(workspace)
    def phase_post(self, deps):
        vg, D = self.vg, self.D
        for items in self._row_blocks(True):
            present, rows = self._present(items)
            act = self._act(present)
            regs = [(it[0], it[1], slice(it[2], it[2] + it[3]), slice(0, D)) if it else None for it in items]
            a, c = self._next("dq32"), self._next("dqc")
            vg.load(a, self.dq_ws, regs, active=act, deps=(deps,), name="load dq")

            def cast(cs, a=a, c=c):
                round_to(a.data[cs], self.dtype, c.data[cs], np.empty_like(a.data[cs]))

            vg.vector("cast dq", [c], [a], vg.row_repeats(rows, D, F32), compute=cast, per_core=True, active=act)
            vg.store(c, self.dq, regs, active=act, name="store dq")

    def run(self):
        self.phase_pre()
        deps = self._sync()
        if self.recompute:
            self.phase_stats(deps)
            deps = self._sync()
        st = self.st_main
        self.stage_a(st, 0, deps)
        a_prev = self.cur_a
        for s in range(st.T):
            a_s = a_prev
            if a_s is not None:
                self.k_for_dq(a_s)
            if s + 1 < st.T:
                self.stage_a(st, s + 1, deps)
                a_prev = self.cur_a
            if a_s is not None:
                self.stage_b(st, s, a_s)
        if self.dtype == F32:
            return self.dq_ws, self.dk, self.dv
        self.dq = self.launch.empty((self.B, self.N, self.Sq, self.D), self.dtype, "dq")
        self.phase_post(self._sync()[1])
        return self.dq, self.dk, self.dv


__all__ = ["flash_attention_grad", "default_tiling", "tiling_fits", "flops"]
