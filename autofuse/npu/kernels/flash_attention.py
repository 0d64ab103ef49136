"""FlashAttention: ``out = softmax(scale · Q·Kᵀ + mask) · V``, tile by tile, never writing the scores out.

Layout BNSD: q ``[B, N, Sq, D]``, k ``[B, Nkv, Skv, D]``, v ``[B, Nkv, Skv, Dv]``; query head h reads kv head
``h // (N / Nkv)`` (GQA). ``mask`` broadcasts to ``[B, N, Sq, Skv]``: bool (True = attend, as torch SDPA)
or additive float. ``causal`` is top-left aligned (query i sees keys j <= i); with a mask both apply.
``fill`` is the score a bool-masked entry takes at the softmax input (``-inf`` by default; a finite fill
such as ``finfo.min`` or ``-1e4`` is reproduced exactly, so a query row with every key masked averages V
as eager softmax does). ``empty_rows`` says what a row with no key to attend gives: ``"zero"`` (torch's
SDPA and ``_safe_softmax``) or ``"nan"`` (plain ``softmax``). NaN in the inputs propagates as in eager:
``mask_keeps_nan`` applies a bool mask as SDPA does (adding ``-inf``: a NaN or ``+inf`` score gives NaN) instead of as
``masked_fill`` does (the fill replaces it); the Vector unit does either in one select/add pass.
``mask_add_dtype`` (``"float16"`` or ``"bfloat16"``, an additive mask of that dtype): the mask is added as eager's
16-bit add adds it, the scaled scores cast to that dtype, the mask added in it and the sum cast back up to fp32
(:func:`add_in_dtype`), so an entry whose mask absorbs the score (``finfo(float16).min`` + a score below 16 is
``-65504``) takes the mask's value exactly and a row whose every key is so masked averages V as eager's does.
``logits_dtype`` (``"float16"`` or ``"bfloat16"``, q's dtype): eager's 16-bit scores cast up, scaled and masked in
fp32, then cast down once before the softmax (Falcon's ALiBi path: ``softmax(logits32 + mask, -1, dtype=bf16)``):
S is rounded to that dtype as eager's matmul returns it, scaled and masked in fp32, and the logits rounded to it
once more before the softmax (four Vector passes per score more: each rounding a cast down and up).

The algorithm (one *work item* = batch, head, block of ``q`` query rows; items spread over the cores):

    for each KV tile j of ``kv`` keys:
        Cube    S = Q · K_jᵀ                               fp32 in L0C
        Vector  S *= scale; mask; m_new = max(m, rowmax S)   one pass each, fp32 (64 lanes a repeat)
                P = exp(S - m_new); l = l·α + rowsum P       α = exp(m - m_new)
                P -> operand dtype (cast pass)
        Cube    O_j = P · V_j                              fp32 in L0C
        Vector  O = O·α + O_j
    Vector  out = O / l (cast) -> GM

Running statistics m, l are fp32. A row with no key to attend gives 0 (as torch 2.13's SDPA) or NaN
(``empty_rows="nan"``, as ``softmax`` over a row of ``-inf``).

Data paths. *Coupled* cores (910, 310P) move S from L0C to UB by FixPipe; UB has no path to L1 on these
chips (CANN's DataCopy lists GM->A1/B1, CO1->CO2, CO2->GM, GM->VECIN, VECIN->VECOUT, VECOUT->GM for
them; a UB->L1 channel appears only on the 950), so P goes UB -> GM (MTE3, a per-core scratch workspace
that stays in L2) -> L0A (MTE2; the kernel writes its own workspace in the fractal layout, so P needs no
ND->NZ pass through L1, unlike K and V, which are staged in L1). *Split* cores (910B): the AIC computes S
per row block and FixPipe writes it to a workspace in GM; the two AIVs paired with it (AIC i: AIV 2i,
2i+1) each load their half of the rows, do the softmax and write P back; the AIC loads each half's P,
computes its P·V and writes the partial O_j to a workspace, which the AIVs load and accumulate (CANN's
design). Every GM hand-off is written and read as the same region (the L2 model matches regions), and
double-buffered (slot = step % 2) so the producer runs a step ahead. Cross-group waits are explicit: the
producer's end times are the consumer's ``deps`` (AIC -> AIV by ``np.repeat``, AIV -> AIC by the max
over the pair).

Software pipeline: step s issues ``A(s+1)`` (Q·Kᵀ, softmax, P out) before ``B(s)`` (P·V, accumulate), so the
Cube computes S of tile s+1 while the Vector works on tile s, and every queue (MTE2 above all) gets its
prefetches ahead of the loads that wait on the Vector. The running statistics are kept in two slots (step
parity) so the pipeline also runs across item boundaries.

Scheduling: the cores walk flat lists of (item, KV tile) steps in lockstep; items are dealt out head by
head, so cores working at the same time share K/V tiles through L2. With ``causal`` the KV tiles above
the diagonal are skipped and query blocks i and nq-1-i are paired on one core, which evens out the work
(single blocks when there are too few pairs to keep every core busy). A sliding ``window`` (with ``causal``,
CANN's band sparse mode) also skips the KV tiles left of the band: a query block walks the tiles from the one
holding its first row's first key to its diagonal, and the tiles holding the band's left edge take a compare
and a select more (as the diagonal's do); no mask is read. Schedules, tilings and region lists
depend on shapes only and are cached across launches.

Simulator speed (values and figures unchanged): the launch is deferred (``Launch.defer``: values are
computed behind the timeline, per share of the cores, on the host threads), the Vector closures take a
slice of the cores (``vector(..., per_core=True)``), the L1 -> L0 and L0C -> UB moves hand their arrays
over (``consume=True``), K is also kept transposed on the host so its transposing load is a row gather,
and region lists are tuples the machine keeps its bookkeeping for.

Tilings (``default_tiling``; fp16, D=128): 910 and 310P q=128, kv=128, vq=128 (UB: S fp32 64 KB, P 32 KB,
O_j and O fp32 64 KB each; L0B holds K and V tiles of 32 KB); 910B q=128, kv=128, vq=64 (one row block
per AIV).

``return_stats`` outputs each row's final max and sum (CANN's softmax_max / softmax_sum, fp32 ``[B, N, Sq]``,
the convention :mod:`flash_attention_grad` reads): ``m`` is the row's max of its scaled, masked scores (``-inf``
for a row with no key to attend, ``fill`` for a row whose keys all take a finite fill), ``l`` the sum of
``exp(score - m)`` (``exp(score)`` when ``m = -inf``: 0), taken before dropout. Both are already in UB (two
slots by step parity, no new buffer); once an item's last softmax has run, two MTE3 stores of ``rows x 4``
bytes each write them, issued with stage B of that tile ahead of the next tile's P store: the MTE3 queue
runs them while it would wait for that softmax, so they add no time (a store issued after the output
stores would wait behind the next P store and book the GM port late, holding up later K/V loads).

``return_probs`` adds a second sweep once each row's max and sum are final (stored to GM at the end of
the first sweep, the same stores): S is recomputed, ``exp(S - m) / l`` cast to q's dtype and stored. Rows
with no key give 0 probabilities (NaN with ``empty_rows="nan"``).

Vector work counted per S element: scale, max, sub, exp, sum, cast (six fp32 passes; fp32 operands
skip the cast), eight more with ``softcap`` (``1/c``, tanh's six, ``c``), plus :func:`mask_passes` for a mask
(a bool select or an fp32 add: one; an fp16/bf16 additive mask: cast and add, two; added in its dtype: cast down,
add, cast up, three; ``fill_in_mask``, the filled entries' compare and select, two more), two on causal diagonal
tiles (an index compare and a select), one for dropout (a select by the keep bits); per tile the O update costs two
passes over ``[rows, Dv]``.

Dropout (``drop_mask``, FlashAttentionScore's ``drop_mask`` input with ``keep_prob``): the keep bits of each
row block are loaded with its S (``rows x kv / 8`` bytes), and after the row sum (the softmax denominator is
the sum before dropout) P is zeroed where a bit is 0; the ``1 / keep_prob`` factor is folded into the final
``1 / l``. The mask is an input: it comes from ``dropout_gen_mask``, as CANN's comes from DropOutGenMask.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from autofuse.npu.dtypes import itemsize, to_dtype
from autofuse.npu.kernels.dropout import pack_keep, unpack_keep
from autofuse.npu.machine import GMTensor, split_cores
from autofuse.npu.run import kernel
# the buffer requests, shared with the cost model
from cost_model.attention_tiling import out_rows as _out_rows, requests as _requests

OPERAND_DTYPES = ("float16", "bfloat16", "float32")
MASK_DTYPES = ("bool", "float16", "bfloat16", "float32")
_NEG_INF = np.float32(-np.inf)
#: Vector passes of logit soft-capping per score: muls 1/c, tanh (muls 2, exp, adds 1, reciprocal, muls -2,
#: adds 1: the elementwise kernel's fp32 tanh), muls c
SOFTCAP_PASSES = 8


def _ceil(a, b):
    return -(-a // b)


def _r16(x):
    return _ceil(x, 16) * 16


# ------------------------------------------------------------------------------------------ numerics
_SPLITTER = {"float16": np.float32(2 ** 13 + 1), "bfloat16": np.float32(2 ** 16 + 1)}
_FP16_TINY = np.float32(2.0 ** -14)          # smallest normal fp16
_FP16_MAX = np.float32(65504.0)
_HALF = np.float32(0.5)


def round_to(x: np.ndarray, dtype: str, out: np.ndarray, tmp: np.ndarray, nonneg: bool = False) -> None:
    """``out = x`` rounded to ``dtype`` (nearest, ties to even) for finite float32 ``x`` with ``|x| < 1e30``.

    Veltkamp's split: ``c = x·(2^s + 1); hi = c - (c - x)`` is ``x`` rounded to ``24 - s`` significant bits,
    in three float32 passes (s = 13 for fp16's 11 bits, 16 for bf16's 8), where numpy's float16 cast takes
    a slow path. fp16 subnormals (``|x| < 2^-14``) have the fixed quantum ``2^-24 = ulp(0.5)``, so
    ``(|x| + 0.5) - 0.5`` rounds them, and fp16 overflows to inf; those fix-ups run only when such values
    occur (``nonneg``: x ≥ 0, e.g. probabilities, saves the sign handling). The test suite checks the
    result bit for bit against numpy's float16 cast and ``round_bf16``.
    """
    if dtype == "float32":
        np.copyto(out, x)
        return
    if not nonneg:
        amax = np.abs(x).max() if x.size else 0.0
        if not amax < 1e30:                       # inf, nan or near float32 overflow: the slow exact path
            np.copyto(out, to_dtype(x, dtype))
            return
    np.multiply(x, _SPLITTER[dtype], out=tmp)
    np.subtract(tmp, x, out=out)
    np.subtract(tmp, out, out=out)
    if dtype != "float16":
        return
    mag = x if nonneg else np.abs(x)
    if mag.min() < _FP16_TINY:
        small = mag < _FP16_TINY
        # whole-array passes: numpy's masked (where=) arithmetic costs several times a plain pass
        np.add(mag, _HALF, out=tmp)
        np.subtract(tmp, _HALF, out=tmp)
        if not nonneg:
            np.copysign(tmp, x, out=tmp)
        np.copyto(out, tmp, where=small)
    if not nonneg and mag.max() > _FP16_MAX:
        np.copyto(out, np.copysign(np.float32(np.inf), x), where=np.abs(out) > _FP16_MAX)


def mask_passes(mask_dtype: str | None, add_dtype: str | None = None, fill_select: bool = False) -> int:
    """Vector passes per score that apply a mask of ``mask_dtype`` (None: no mask): a bool select or an fp32 add,
    1; a 16-bit additive mask added in fp32, 2 (its cast up, the add); added in its own dtype (``add_dtype``), 3
    (the scores cast down, the add, the sum cast back up). ``fill_select`` (an additive mask's entries equal to the
    fill replace the score, ``fill_in_mask``): a compare and a select more."""
    if mask_dtype is None:
        return 0
    if mask_dtype in ("bool", "float32"):
        n = 1
    else:
        n = 3 if add_dtype is not None else 2
    return n + (2 if fill_select and mask_dtype != "bool" else 0)


def filled_value(fill, mask_dtype: str):
    """The value an additive mask of ``mask_dtype`` holds where a bool mask combined into it filled (``fill`` as
    that dtype rounds it: ``finfo(float32).min`` in a 16-bit mask is -inf, as torch rounds it)."""
    with np.errstate(over="ignore"):
        return np.float32(to_dtype(np.float32(fill), mask_dtype))


def check_mask_add(kernel: str, mask, add_dtype) -> str | None:
    """``add_dtype`` once checked: None, or the 16-bit dtype of the additive ``mask`` (a GMTensor) it names."""
    if add_dtype is None:
        return None
    if add_dtype not in ("float16", "bfloat16"):
        raise ValueError(f"{kernel}: mask_add_dtype={add_dtype!r}; give 'float16' or 'bfloat16' (or None: the mask "
                         f"is added in fp32)")
    if mask is None or mask.dtype != add_dtype:
        got = "no mask" if mask is None else f"a {mask.dtype} mask"
        raise ValueError(f"{kernel}: mask_add_dtype={add_dtype!r} needs an additive {add_dtype} mask, got {got}")
    return add_dtype


def add_in_dtype(x: np.ndarray, m: np.ndarray, dtype: str, tmp: np.ndarray, tmp2: np.ndarray) -> None:
    """``x = dtype(dtype(x) + m)`` in place, ``m`` holding values of ``dtype``: eager's add of a 16-bit mask to
    16-bit scores (the scores cast down, the add, the sum cast back up; the cast up is exact). The add is computed
    in fp32 and rounded once more: for two fp16 or bf16 operands that is the correctly rounded 16-bit sum (fp32's
    24 bits are at least twice the operands' 11 or 8, plus 2: the double rounding is innocuous), as torch's CPU add
    computes it; a sum past the dtype's range is -inf or inf, as in eager. ``tmp``, ``tmp2``: numpy scratch of x's
    shape (the hardware casts in place)."""
    with np.errstate(over="ignore", invalid="ignore"):
        round_to(x, dtype, tmp2, tmp)
        np.add(tmp2, m, out=tmp2)
        round_to(tmp2, dtype, x, tmp)


def round_in_place(x: np.ndarray, dtype: str, tmp: np.ndarray, tmp2: np.ndarray) -> None:
    """``x`` rounded to ``dtype`` in place, as :func:`round_to` rounds it (a cast down and back up). ``tmp``,
    ``tmp2``: numpy scratch of x's shape (the hardware casts in place)."""
    with np.errstate(over="ignore", invalid="ignore"):
        round_to(x, dtype, tmp2, tmp)
    np.copyto(x, tmp2)


# ------------------------------------------------------------------------------------------ tiling
def _buffer_use(device, req, counts):
    used = {}
    for side, buf, name, shape, dt, _, _ in req:
        key = (side if device.arch == "split" else "core", buf)
        size = math.prod(shape) * itemsize(dt)
        for _ in range(counts[name]):
            off = -(-used.get(key, 0) // device.align[buf]) * device.align[buf]
            used[key] = off + size
    return used


def _counts(device, req):
    """Tile counts per request (double buffers where they fit), or None if even single buffers overflow."""
    counts = {r[2]: r[5] for r in req}

    def fits():
        return all(v <= device.buffers[buf] for (_, buf), v in _buffer_use(device, req, counts).items())

    if not fits():
        return None
    for r in req:
        while counts[r[2]] < r[6]:
            counts[r[2]] += 1
            if not fits():
                counts[r[2]] -= 1
                break
    return counts


def _check_tiling(device, t: dict) -> str | None:
    q, kv, vq = t.get("q"), t.get("kv"), t.get("vq")
    if not all(isinstance(x, (int, np.integer)) and x > 0 for x in (q, kv, vq)):
        return f"tiling needs positive integers q, kv, vq, got {t}"
    if q % 16 or kv % 16:
        return f"q and kv must be multiples of 16 (the Cube fractal), got q={q}, kv={kv}"
    rows = q // 2 if device.arch == "split" else q
    if rows % vq:
        return f"vq={vq} must divide the {rows} query rows a vector core owns"
    return None


def tiling_fits(device, D: int, dtype: str, t: dict, mask_spec=None, Dv: int | None = None, drop: bool = False,
                sink: bool = False) -> bool:
    """Whether tiling ``t`` (q, kv, vq) is valid and fits every buffer it uses on ``device``."""
    if _check_tiling(device, t):
        return False
    return _counts(device, _requests(device, D, Dv or D, dtype, t, mask_spec, drop, sink)) is not None


_TILINGS: dict = {}


def default_tiling(device, Sq: int, Skv: int, D: int, dtype: str, mask_spec=None, Dv: int | None = None,
                   drop: bool = False, sink: bool = False) -> dict:
    """The kernel's own tiling for these shapes (see :func:`_default_tiling`); cached per device and shape."""
    key = (device.name, device.arch, tuple(device.buffers.items()), tuple(device.align.items()),
           _r16(Sq), _r16(Skv), D, Dv or D, dtype, mask_spec, bool(drop), bool(sink))
    if key not in _TILINGS:
        _TILINGS[key] = _default_tiling(device, Sq, Skv, D, dtype, mask_spec, Dv, bool(drop), bool(sink))
    return dict(_TILINGS[key])


def _default_tiling(device, Sq: int, Skv: int, D: int, dtype: str, mask_spec=None, Dv: int | None = None,
                    drop: bool = False, sink: bool = False) -> dict:
    """The largest tile (q rows × kv keys) that fits, then the largest Vector row block ``vq``.

    Blocks are clamped to the (16-rounded) sequence lengths so short sequences do not pay for padding.
    Among fitting tiles: the largest ``q·kv`` (fewer K/V reloads and O updates per score), then the
    largest ``vq`` (fewer, longer Vector instructions). A single-buffered S tile costs little: the O update
    of the previous tile runs on the Vector between two softmaxes, while the next S arrives.
    """
    Dv = Dv or D
    qmax, kvmax = _r16(Sq), _r16(Skv)
    qs = sorted({min(q, qmax) for q in (128, 64, 32, 16)}, reverse=True)
    kvs = sorted({min(kv, kvmax) for kv in (512, 256, 128, 64, 32, 16)}, reverse=True)
    split = device.arch == "split"
    best = None
    for q in qs:
        for kv in kvs:
            rows = q // 2 if split else q
            vqs = [v for v in (rows, rows // 2, rows // 4, rows // 8) if v >= 1 and rows % v == 0]
            pick = None
            for vq in vqs:
                t = {"q": q, "kv": kv, "vq": vq}
                if _counts(device, _requests(device, D, Dv, dtype, t, mask_spec, drop, sink)) is not None:
                    pick = t
                    break
            if pick is not None:
                key = (q * kv, q)
                if best is None or key > best[0]:
                    best = (key, pick)
    if best is None:
        raise ValueError(f"flash_attention: no tiling fits {device.name} for D={D}, Dv={Dv}, {dtype}")
    return best[1]


def flops(B: int, N: int, Sq: int, Skv: int, D: int, causal: bool = False, Dv: int | None = None) -> int:
    """Useful FLOPs: 2·D per score for Q·Kᵀ plus 2·Dv for P·V, over the scores a query attends.

    Causal counts only the attended (i, j ≤ i) pairs — about half of Sq·Skv for square attention.
    """
    Dv = Dv or D
    pairs = Sq * Skv
    if causal:
        i = np.arange(Sq)
        pairs = int(np.minimum(i + 1, Skv).sum())
    return 2 * B * N * pairs * (D + Dv)


def min_hbm_bytes(q_shape, k_shape, v_shape, dtype: str, mask=None, return_probs=False) -> int:
    """Bytes of reading q, k, v (and a mask) once and writing the output (and probabilities) once."""
    isz = itemsize(dtype)
    B, N, Sq, _ = q_shape
    n = math.prod(q_shape) + math.prod(k_shape) + math.prod(v_shape) + B * N * Sq * v_shape[-1]
    if return_probs:
        n += B * N * Sq * k_shape[-2]
    extra = 0 if mask is None else mask.size * (1 if mask.dtype == bool else mask.dtype.itemsize)
    return n * isz + extra


# ------------------------------------------------------------------------------------------ schedule
class _Steps:
    """Per-core step lists as ``[T, n]`` arrays: step s of core c works on item (b, h, qi) and KV tile j."""

    FIELDS = ("valid", "b", "h", "qi", "j", "first", "last", "skip")

    def __init__(self, per_core, qb, kvb, Sq, Skv, group_size, causal, window=0):
        n = len(per_core)
        T = max(len(p) for p in per_core)
        arr = np.zeros((len(self.FIELDS), T, n), dtype=np.int64)
        for c, steps in enumerate(per_core):
            if steps:
                arr[1:, :len(steps), c] = np.array(steps, dtype=np.int64).T
                arr[0, :len(steps), c] = 1
        for i, f in enumerate(self.FIELDS):
            setattr(self, f, arr[i].astype(bool) if f in ("valid", "first", "last", "skip") else arr[i])
        self.T, self.n = T, n
        self.hk = self.h // group_size
        self.q0 = self.qi * qb
        self.qext = np.where(self.valid, np.minimum(qb, Sq - self.q0), 0)
        self.k0 = self.j * kvb
        self.kext = np.where(self.valid, np.minimum(kvb, Skv - self.k0), 0)
        # a causal tile that crosses the diagonal needs the triangle mask
        self.partial = causal & self.valid & ~self.skip & (self.k0 + self.kext - 1 > self.q0)
        # a sliding window's tile that holds a key left of some row's window needs the band's other edge
        self.edge = self.valid & ~self.skip & band_edge(window, self.q0, self.qext, self.k0)
        self.work = self.valid & ~self.skip
        self.lists = {f: getattr(self, f).tolist() for f in ("b", "h", "hk", "q0", "qext", "k0", "kext")}


def _units(B, N, nq, paired):
    """Work units in head-major order (cores busy at the same time share K/V); ``paired`` puts query
    blocks i and nq-1-i in one unit, which evens out causal work."""
    units = []
    for b in range(B):
        for h in range(N):
            if paired:
                units += [[(b, h, i), (b, h, nq - 1 - i)] for i in range(nq // 2)]
                if nq % 2:
                    units.append([(b, h, nq // 2)])
            else:
                units += [[(b, h, i)] for i in range(nq)]
    return units


def _deal(units, ncores, tiles_of):
    """Units to the least-loaded core in order (round-robin when equal): per-core steps, makespan."""
    n = min(ncores, len(units))
    heap = [(0.0, c) for c in range(n)]
    per_core = [[] for _ in range(n)]
    for unit in units:
        load, c = heapq.heappop(heap)
        cost = 0.0
        for (b, h, qi) in unit:
            tiles = tiles_of(qi)
            for idx, (j, skip) in enumerate(tiles):
                per_core[c].append((b, h, qi, j, idx == 0, idx == len(tiles) - 1, skip))
            cost += sum(1.0 if not skip else 0.1 for _, skip in tiles)
        heapq.heappush(heap, (load + cost, c))
    return per_core, max(load for load, _ in heap)


def _schedule(B, N, nq, causal, ncores, tiles_of):
    """Per-core step lists. Causal: pairs of query blocks, unless too few pairs leave cores idle and
    single blocks finish sooner (the longest item then sets the time)."""
    best = _deal(_units(B, N, nq, False), ncores, tiles_of)
    if causal:
        paired = _deal(_units(B, N, nq, True), ncores, tiles_of)
        if paired[1] <= best[1]:
            best = paired
    return best[0]


# ------------------------------------------------------------------------------------------ kernel
def _as_f32(t: GMTensor, name: str) -> GMTensor:
    """The tensor with float32 storage (values unchanged), so tile loads copy without conversion."""
    if t.data.dtype == np.float32:
        return t
    return GMTensor(np.asarray(t.data, dtype=np.float32), t.dtype, name, t.scratch)


def _mask_view(mask: GMTensor, B, N, Sq, Skv):
    """The mask as a 4-D GM tensor and its broadcast flags; errors name the shapes."""
    if mask.dtype not in MASK_DTYPES:
        raise TypeError(f"flash_attention: mask is {mask.dtype}; it must be bool (True = attend) or an "
                        f"additive float ({', '.join(MASK_DTYPES[1:])})")
    shape = tuple(mask.shape)
    if len(shape) > 4:
        raise ValueError(f"flash_attention: mask has {len(shape)} dims {list(shape)}; at most 4")
    shape4 = (1,) * (4 - len(shape)) + shape
    for got, want, what in zip(shape4, (B, N, Sq, Skv), ("B", "N", "Sq", "Skv")):
        if got not in (1, want):
            raise ValueError(f"flash_attention: mask shape {list(shape)} does not broadcast to "
                             f"[B, N, Sq, Skv] = {[B, N, Sq, Skv]} (dim {what}: {got} vs {want})")
    data = mask.data.reshape(shape4)
    if mask.dtype != "bool" and data.dtype != np.float32:
        data = data.astype(np.float32)
    return GMTensor(data, mask.dtype, mask.name, False), shape4


@kernel("flash_attention")
def flash_attention(launch, q, k, v, mask=None, scale=None, causal=False, return_probs=False, tiling=None,
                    fill=float("-inf"), empty_rows="zero", mask_keeps_nan=False, drop_mask=None, keep_prob=1.0,
                    return_stats=False, softcap=None, sinks=None, window=0, mask_add_dtype=None, head_scale=None,
                    head_scale_dtype=None, logits_dtype=None, fill_in_mask=False):
    """Fused attention (see the module docstring). Returns ``out`` in q's dtype, then ``probs`` (q's dtype)
    with ``return_probs``, then ``softmax_max`` and ``softmax_sum`` (fp32 ``[B, N, Sq]``) with ``return_stats``.

    ``tiling``: ``{"q": query rows per item, "kv": keys per tile, "vq": rows per Vector sub-block}``
    (None: :func:`default_tiling`). ``drop_mask``: dropout on the probabilities, a uint8 keep-mask
    ``[B, N, Sq, ceil(Skv / 8)]`` with one bit per score (bit ``j % 8`` of byte ``j // 8``, 1 = keep, as
    :func:`pack_keep` packs it); kept probabilities are scaled by ``1 / keep_prob``. ``softcap``: the scaled
    scores soft-capped, ``softcap · tanh(S / softcap)``, before the mask (Gemma 2's logit soft-capping).
    ``sinks``: attention sinks, one logit per query head (``[N]``, GPT-OSS's): each row's softmax also takes
    its head's sink logit as one more score, which attends no value (its probability only enlarges the
    denominator); the online softmax starts from ``m = sink``, ``l = 1`` instead of ``-inf``, ``0``.
    ``window``: with ``causal``, a sliding window of that many keys (Mistral's, Gemma's, GPT-OSS's local layers;
    CANN's band sparse mode with ``pre_tokens = window - 1``, ``next_tokens = 0``): query i sees keys j with
    ``i - window < j <= i``; the KV tiles wholly outside the band are skipped, as those above the diagonal are.
    ``mask_add_dtype``: an additive 16-bit mask added in its dtype, as eager adds it (module docstring).
    ``head_scale``: one fp32 factor per query head (``[N]``, Swin v2's ``exp(clamp(logit_scale))``): each head's
    scores are multiplied by its factor after ``scale``, in fp32, before the soft-cap and the mask (the same
    Vector multiply as ``scale``, by a scalar that is the core's head's; no pass more). ``head_scale_dtype``
    (``"float16"``, ``"bfloat16"``): eager's 16-bit scores times a 16-bit factor, the scores rounded to that dtype
    before the multiply and the product after it (four passes more: each rounding a cast down and up).
    ``logits_dtype`` (q's 16-bit dtype): the scores rounded to it as eager's matmul returns them, and the scaled,
    masked logits rounded to it before the softmax (module docstring; four passes more).
    ``fill_in_mask`` (an additive mask that is a bool mask and additive terms combined, ``where(keep, terms,
    fill)``): the mask's entries equal to ``fill`` (as the mask's dtype holds it) are scores the bool mask filled,
    which take ``fill`` in place of ``score + fill``, as ``masked_fill`` replaces them (a fill the scores do not
    vanish into, -1e4, -1e9 or fp16's -65504 in fp32 scores: a row every key of which is filled is uniform, as
    eager's): a compare and a select per score more.
    """
    dev = launch.device
    check_operands("flash_attention", (("q", q), ("k", k), ("v", v)))
    B, N, Sq, D = q.shape
    Bk, Nkv, Skv, Dk = k.shape
    if (Bk, Nkv, Skv) != tuple(v.shape[:3]) or Bk != B or Dk != D:
        raise ValueError(f"flash_attention: shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
                         f"do not agree (need k [B, Nkv, Skv, D], v [B, Nkv, Skv, Dv])")
    if Nkv < 1 or N % Nkv:
        raise ValueError(f"flash_attention: {N} query heads are not a multiple of {Nkv} kv heads")
    Dv = v.shape[3]
    dtype = q.dtype
    scale = float(D ** -0.5 if scale is None else scale)
    fill = check_fill("flash_attention", empty_rows, fill)
    mask_add_dtype = check_mask_add("flash_attention", mask, mask_add_dtype)
    mask, mask_spec = mask_with_spec(mask, B, N, Sq, Skv)
    drop = drop_mask is not None
    if drop:
        _check_drop(drop_mask, keep_prob, (B, N, Sq, Skv), return_probs)
    window = check_window("flash_attention", window, causal)
    sink = sinks is not None
    if sink and (list(sinks.shape) != [N] or sinks.dtype not in OPERAND_DTYPES):
        raise ValueError(f"flash_attention: sinks is {sinks.dtype} {list(sinks.shape)}; it must be [{N}] (one logit "
                         f"per query head) in {', '.join(OPERAND_DTYPES)}")
    if tiling is None:
        t = default_tiling(dev, Sq, Skv, D, dtype, mask_spec, Dv, drop, sink)
    else:
        t = dict(tiling)
        bad = _check_tiling(dev, t)
        if bad:
            raise ValueError(f"flash_attention: {bad}")
    req = _requests(dev, D, Dv, dtype, t, mask_spec, drop, sink)
    counts = fitted_counts("flash_attention", dev, req, t)
    prog = _Program(launch, q, k, v, mask, scale, causal, return_probs, t, req, counts, Dv, bool(return_stats), sinks,
                    window)
    prog.fill, prog.empty = np.float32(fill), np.float32(0.0 if empty_rows == "zero" else np.nan)
    prog.keep_nan = bool(mask_keeps_nan)
    prog.drop, prog.inv_keep = drop_mask, np.float32(1.0 / keep_prob)
    prog.mask_add = mask_add_dtype
    if mask_add_dtype is not None:          # numpy scratch of the add's casts (the hardware casts in place)
        prog.tmp2 = np.empty_like(prog.tmp)
    if fill_in_mask and mask is not None and mask.dtype != "bool":
        prog.fill_in_mask = filled_value(fill, mask.dtype)
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"flash_attention: softcap={softcap}; it must be a positive finite number or None")
    prog.softcap = None if softcap is None else np.float32(softcap)
    if head_scale is not None and tuple(head_scale.shape) != (N,):
        raise ValueError(f"flash_attention: head_scale has shape {list(head_scale.shape)}; it must be [{N}] (one "
                         f"factor per query head)")
    prog.head_scale = head_scale            # a GM tensor, its values read by the passes (none in a timing-only launch)
    if head_scale_dtype is not None and (head_scale is None or head_scale_dtype not in ("float16", "bfloat16")):
        raise ValueError(f"flash_attention: head_scale_dtype={head_scale_dtype!r}; it takes 'float16' or 'bfloat16' "
                         f"and a head_scale")
    prog.head_round = head_scale_dtype
    if head_scale_dtype is not None and not hasattr(prog, "tmp2"):
        prog.tmp2 = np.empty_like(prog.tmp)
    if logits_dtype is not None and (logits_dtype not in ("float16", "bfloat16") or logits_dtype != dtype):
        raise ValueError(f"flash_attention: logits_dtype={logits_dtype!r}; it takes q's dtype, 'float16' or "
                         f"'bfloat16' (q is {dtype})")
    prog.logits_round = logits_dtype
    if logits_dtype is not None and not hasattr(prog, "tmp2"):
        prog.tmp2 = np.empty_like(prog.tmp)
    return prog.run()


def check_operands(kernel: str, named) -> None:
    """Every ``(name, tensor)`` is BNSD (4-D) in a Cube operand dtype, all of one dtype."""
    for name, t in named:
        if t.data.ndim != 4:
            raise ValueError(f"{kernel}: {name} must be [B, N, S, D] (BNSD), got shape {list(t.shape)}")
        if t.dtype not in OPERAND_DTYPES:
            raise TypeError(f"{kernel}: {name} is {t.dtype}; the Cube takes {', '.join(OPERAND_DTYPES)}")
    if len({t.dtype for _, t in named}) > 1:
        names = ", ".join(n for n, _ in named)
        raise TypeError(f"{kernel}: {names} dtypes differ ({', '.join(str(t.dtype) for _, t in named)})")


def check_window(kernel: str, window, causal) -> int:
    """``window`` as an int once checked: 0 (none), or a positive key count with ``causal``."""
    if isinstance(window, bool) or int(window) != window or window < 0:
        raise ValueError(f"{kernel}: window={window!r}; give a whole number of keys (0: no sliding window)")
    if window and not causal:
        raise ValueError(f"{kernel}: window={window} needs causal=True (the window is the band of keys j with "
                         f"i - window < j <= i; a window without the causal bound is not supported: pass it as a mask)")
    return int(window)


def _quiet(fn):
    """``fn`` with numpy's floating-point warnings off: infinite scores (inputs near the dtype's limits) give
    inf - inf = NaN as the Vector unit's IEEE arithmetic does, silently."""
    def run(cs):
        with np.errstate(all="ignore"):
            fn(cs)
    return run


def window_tiles(qi, qb, kvb, Sq, Skv, causal, window):
    """``(lo, hi)``: the KV tiles query block ``qi`` attends (causal: up to its last row's diagonal; with a
    ``window`` from the tile holding its first row's first key). At least one tile: a block whose rows all lie
    past the keys' end by more than the window (Sq > Skv + window) keeps one, wholly masked, so its rows are
    written (as rows with no key to attend)."""
    nkv = _ceil(Skv, kvb)
    if not causal:
        return 0, nkv
    last_row = min((qi + 1) * qb, Sq) - 1
    hi = _ceil(min(last_row + 1, Skv), kvb)
    lo = min(max(0, qi * qb - window + 1) // kvb, hi - 1) if window else 0
    return lo, hi


def band_edge(window, q0, qext, k0):
    """Whether a tile (rows ``q0 .. q0+qext-1``, keys from ``k0``) holds a key left of some row's window."""
    return (window > 0) & (k0 <= q0 + qext - 1 - window)


def mask_outside_band(x, row0, k0, rowi, col, diagonal, window):
    """``-inf`` in score blocks ``x`` ``[cores, rows, keys]`` (first row ``row0``, first key ``k0`` per core) where
    a key is past its row's diagonal (``diagonal``) or left of its row's sliding ``window`` (> 0): a compare and a
    select each, in place."""
    if not (diagonal or window):
        return
    rg = row0[:, None, None] + rowi[None, :, None]
    cg = k0[:, None, None] + col[None, None, :]
    if diagonal:
        np.copyto(x, _NEG_INF, where=cg > rg)
    if window:
        np.copyto(x, _NEG_INF, where=cg <= rg - window)


def check_fill(kernel: str, empty_rows: str, fill) -> float:
    """``fill`` as a float, once ``empty_rows`` and ``fill`` are checked."""
    if empty_rows not in ("zero", "nan"):
        raise ValueError(f"{kernel}: empty_rows={empty_rows!r}; use 'zero' (SDPA) or 'nan' (softmax)")
    fill = float(fill)
    if math.isnan(fill) or fill == math.inf:
        raise ValueError(f"{kernel}: fill={fill}; a masked score must be -inf or a finite value")
    return fill


def mask_spec(dtype: str, shape) -> tuple:
    """``(dtype, varies along queries, varies along keys)`` of a mask of ``shape`` broadcast to [B, N, Sq, Skv]: what
    the kernels' tilings depend on (the planner and the attention op's backward ask with shapes alone)."""
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    return dtype, shape4[2] != 1, shape4[3] != 1


def mask_with_spec(mask, B, N, Sq, Skv):
    """``(mask viewed as [B, N, Sq, Skv], its :func:`mask_spec`)``, or ``(None, None)``."""
    if mask is None:
        return None, None
    mask, mshape = _mask_view(mask, B, N, Sq, Skv)
    return mask, mask_spec(mask.dtype, mshape)


def fitted_counts(kernel: str, dev, req, t) -> dict:
    """The buffer counts of the tiling's requests, or a capacity error naming each buffer that overflows."""
    counts = _counts(dev, req)
    if counts is None:
        use = _buffer_use(dev, req, {r[2]: r[5] for r in req})
        over = ", ".join(f"{buf} needs {u:,} B of {dev.buffers[buf]:,} B" for (_, buf), u in use.items()
                         if u > dev.buffers[buf])
        raise ValueError(f"{kernel} tiling {t} does not fit {dev.name}: {over}")
    return counts


def core_groups(launch, n: int, split: bool, req, counts, sep: str = ""):
    """``(cube group, vector group, tiles)``: n AI cores (split chips: n AICs and their 2n AIVs) and each
    request's tiles (``counts[name]`` of them) on its side."""
    if split:
        cg, vg = launch.group("aic", n), launch.group("aiv", 2 * n)
    else:
        cg = vg = launch.group("core", n)
    tiles = {}
    for side, buf, name, shape, dt, _, _ in req:
        g = cg if side == "cube" else vg
        tiles[name] = [g.alloc(buf, shape, dt, f"{name}{sep}{i}") for i in range(counts[name])]
    return cg, vg, tiles


def _check_drop(drop_mask, keep_prob, shape, return_probs):
    B, N, Sq, Skv = shape
    want = [B, N, Sq, _ceil(Skv, 8)]
    if drop_mask.dtype != "uint8" or list(drop_mask.shape) != want:
        raise ValueError(f"flash_attention: drop_mask is {drop_mask.dtype} {list(drop_mask.shape)}; it must be "
                         f"uint8 {want} (one keep bit per score, pack_keep)")
    if not 0.0 < float(keep_prob) <= 1.0:
        raise ValueError(f"flash_attention: keep_prob={keep_prob}; it must be in (0, 1] (1 - dropout p)")
    if return_probs:
        raise ValueError("flash_attention: return_probs with a drop_mask is not supported (the probabilities "
                         "a caller reads are the ones before dropout or after it: ask for neither)")


class _Plan:
    """What depends only on shapes: the step lists and, filled in as the program runs, its region lists."""

    def __init__(self, steps, steps2):
        self.steps, self.steps2, self.regions = steps, steps2, {}


_PLANS: dict = {}                # shape key -> _Plan, least recently used first
_PLAN_CACHE = 8


class _Program:
    """One launch of the kernel: allocations, schedule, and the two pipeline stages.

    Row blocks: an item's ``q`` rows are cut into ``q / vq`` blocks of ``vq`` rows, the unit every GM
    hand-off uses (P on all devices; S and O_j on split cores), written and read as the same region so
    the re-read hits L2. On split cores AIV ``2c + h`` owns the blocks of half ``h`` of AIC c's rows.
    """

    def __init__(self, launch, q, k, v, mask, scale, causal, return_probs, t, req, counts, Dv, return_stats=False,
                 sinks=None, window=0):
        dev = launch.device
        self.launch, self.dev = launch, dev
        self.split = dev.arch == "split"
        self.q, self.k, self.v = _as_f32(q, "q"), _as_f32(k, "k"), _as_f32(v, "v")
        # K's values also kept transposed on the host ([B, Nkv, D, Skv]), so that the transposing K load
        # (ND -> NZ, free on the hardware) is a plain row gather for the simulator. Its tile regions are the
        # transposed ones of K's, one for one: the L2 sees the same distinct regions of the same sizes.
        kd = self.k.data
        if launch.values:
            kt = np.empty(kd.shape[:2] + kd.shape[:1:-1], dtype=kd.dtype)
            k3, kt3 = kd.reshape(-1, *kd.shape[2:]), kt.reshape(-1, *kt.shape[2:])
            split_cores(lambda cs: np.copyto(kt3[cs], k3[cs].transpose(0, 2, 1)), len(k3), kd.size)
        else:
            kt = kd.transpose(0, 1, 3, 2)
        self.kt = GMTensor(kt, k.dtype, "k", False)
        self.mask, self.scale, self.causal, self.return_probs = mask, np.float32(scale), causal, return_probs
        self.softcap = None                             # set by the caller (logit soft-capping)
        self.head_scale = None                          # set by the caller: [N] fp32 factors per query head, or None
        self.head_round = None                          # set by the caller: the 16-bit dtype of eager's scaled scores
        self.logits_round = None                        # set by the caller: the 16-bit dtype of eager's scores, logits
        self.sinks = sinks                              # [N] sink logits (attention sinks) or None
        self.window = window                            # sliding window (keys), 0: none
        self.dtype = q.dtype
        self.isz = itemsize(q.dtype)
        B, N, Sq, D = q.shape
        _, Nkv, Skv, _ = k.shape
        self.B, self.N, self.Sq, self.Skv, self.D, self.Dv = B, N, Sq, Skv, D, Dv
        self.qb, self.kvb, self.vq = t["q"], t["kv"], t["vq"]
        self.nh = 2 if self.split else 1              # vector cores per cube core
        self.rows = self.qb // self.nh                # rows one vector core owns
        self.nsub = self.rows // self.vq              # row blocks per vector core
        self.nb = self.qb // self.vq                  # row blocks per item
        nq, nkv = _ceil(Sq, self.qb), _ceil(Skv, self.kvb)
        qb, kvb = self.qb, self.kvb

        def tiles_main(qi):
            lo, hi = window_tiles(qi, qb, kvb, Sq, Skv, causal, window)
            return [(j, False) for j in range(lo, hi)]

        def tiles_probs(qi):
            lo, hi = window_tiles(qi, qb, kvb, Sq, Skv, causal, window)
            return [(j, not lo <= j < hi) for j in range(nkv)]

        key = (dev.name, dev.arch, dev.cube_cores, B, N, Nkv, Sq, Skv, D, Dv, qb, kvb, self.vq, causal, window,
               return_probs, None if mask is None else (mask.dtype, mask.shape), "drop" in counts, sinks is not None)
        plan = _PLANS.pop(key, None)
        if plan is None:
            group = N // Nkv
            cores = dev.cube_cores
            main = _schedule(B, N, nq, causal, cores, tiles_main)
            probs = _schedule(B, N, nq, causal, cores, tiles_probs) if return_probs else None
            # the two sweeps may deal their units differently (a window's items are alike, its sweep's are not):
            # both on the larger count of cores, the other's extra cores idle
            n = max(len(main), len(probs) if probs else 0)
            plan = _Plan(_Steps(main + [[]] * (n - len(main)), qb, kvb, Sq, Skv, group, causal, window),
                         _Steps(probs + [[]] * (n - len(probs)), qb, kvb, Sq, Skv, group, causal, window)
                         if return_probs else None)
        _PLANS[key] = plan                       # most recent last
        while len(_PLANS) > _PLAN_CACHE:
            _PLANS.pop(next(iter(_PLANS)))
        self.plan, self.steps, self.steps2 = plan, plan.steps, plan.steps2
        n = self.n = self.steps.n
        self.cg, self.vg, self.tl = core_groups(launch, n, self.split, req, counts)   # the plan tiling_fits checked
        self.nv = self.vg.n
        if "b0" in self.tl:
            self.tl["kt0"] = self.tl["v0"] = self.tl["b0"]
        if "c0" in self.tl:
            self.tl["s0"] = self.tl["o0"] = self.tl["c0"]
        self.ring = {}
        f32 = "float32"
        self.ws_p = launch.empty((n, 2, qb, kvb), self.dtype, "ws_p", scratch=True)
        if self.split:
            self.ws_s = launch.empty((n, 2, qb, kvb), f32, "ws_s", scratch=True)
            self.ws_o = launch.empty((n, 2, qb, Dv), f32, "ws_o", scratch=True)
        self.out = launch.empty((B, N, Sq, Dv), self.dtype, "out")
        self.probs = launch.empty((B, N, Sq, Skv), self.dtype, "probs") if return_probs else None
        if return_probs or return_stats:   # an output with return_stats, the probabilities sweep's input
            self.m_gm = launch.empty((B, N, Sq), f32, "softmax_max")
            self.l_gm = launch.empty((B, N, Sq), f32, "softmax_sum")
        # numpy scratch for the cast's rounding (not a machine buffer: the hardware casts in place)
        self.tmp = np.empty((self.nv, self.vq, kvb), dtype=np.float32)
        self.col = np.arange(kvb)
        self.ones = np.ones(kvb, dtype=np.float32)
        self.rowi = np.arange(self.vq)
        self.half = np.arange(self.nv) % 2 if self.split else np.zeros(n, dtype=np.int64)
        self.cube_of = np.arange(self.nv) // self.nh    # the cube core whose workspace a vector core uses
        self.base = 0
        self.deferred = []            # P stores of stage A, issued after stage B's loads (see run)
        self.ends = {}                # (what, step, row block) -> cube-core end times, for explicit waits
        self.stats_end = np.zeros(self.nv)
        self.drop, self.inv_keep = None, np.float32(1.0)       # dropout keep-mask, set by the caller
        self.mask_add = None            # the 16-bit dtype an additive mask is added in (None: fp32), set by the caller
        self.fill_in_mask = None        # an additive mask's value marking a bool-filled score (the caller's)
        self.return_stats = return_stats

    # ---------------------------------------------------------------- helpers
    def _regs(self, key, build):
        """The region list ``key`` of this program, built once per shape and reused by later launches (a
        tuple: the machine then keeps its bookkeeping of the list too)."""
        regs = self.plan.regions.get(key)
        if regs is None:
            regs = self.plan.regions[key] = tuple(build())
        return regs

    def _next(self, ring):
        tiles = self.tl[ring]
        i = self.ring.get(ring, 0)
        self.ring[ring] = i + 1
        return tiles[i % len(tiles)]

    def _vec(self, a):
        """Per cube core -> per vector core."""
        return np.repeat(a, self.nh) if self.split else a

    def _vdeps(self, kind, ks, r):
        """Vector-core end times of the cube-side events (kind, ks, block of sub-block r), as deps."""
        arrs = [self.ends.get((kind, ks, h * self.nsub + r)) for h in range(self.nh)]
        if any(a is None for a in arrs):
            return ()
        return (np.stack(arrs, 1).reshape(-1) if self.split else arrs[0],)

    def _put_v(self, kind, ks, r, end):
        """Record vector-core end times under the cube-side keys of their row blocks."""
        for h in range(self.nh):
            self.ends[(kind, ks, h * self.nsub + r)] = end[h::2] if self.split else end

    def _vdeps_h(self, kind, ks):
        """Vector-core end times of per-half cube-side events (kind, ks, half), as deps."""
        arrs = [self.ends.get((kind, ks, h)) for h in range(self.nh)]
        if any(a is None for a in arrs):
            return ()
        return (np.stack(arrs, 1).reshape(-1) if self.split else arrs[0],)

    def _put_vh(self, kind, ks, end):
        for h in range(self.nh):
            self.ends[(kind, ks, h)] = end[h::2] if self.split else end

    def _cdeps(self, kind, ks, g):
        e = self.ends.get((kind, ks, g))
        return () if e is None else (e,)

    @staticmethod
    def _masked(end, act):
        return end if act is None else np.where(act, end, 0.0)

    def _inverse(self, lv):
        """1 / l per row; a row with nothing attended (l = 0) gives ``empty`` (0 or NaN); NaN stays NaN."""
        zero = lv == 0
        return np.where(zero, self.empty, np.float32(1) / np.where(zero, np.float32(1), lv)).astype(np.float32)

    @staticmethod
    def _act(mask):
        return None if mask.all() else mask

    # ---------------------------------------------------------------- stage A: S, softmax, P out
    def stage_a(self, st, s, probs_pass=False):
        """Cube S = Q·K_sᵀ; Vector softmax of tile s row block by row block; P (or the probabilities) out."""
        cg, L = self.cg, st.lists
        n, D, vq, isz = self.n, self.D, self.vq, self.isz
        ks = s + self.base                 # step key: slots and waits continue across the two sweeps
        slot = ks % 2
        work = st.work[s]
        if not work.any() and not (probs_pass and st.valid[s].any()):
            return
        first = st.first[s] & st.valid[s]
        qext, kext = st.qext[s], st.kext[s]
        b, h, hk, q0, k0 = L["b"][s], L["h"][s], L["hk"][s], L["q0"][s], L["k0"][s]
        qe, ke = L["qext"][s], L["kext"][s]
        wact = self._act(work)
        if first.any():
            q1 = self.tl["q1"][0]
            regs = self._regs(("Q", ks), lambda: [
                (b[c], h[c], slice(q0[c], q0[c] + qe[c]), slice(0, D)) if first[c] else None for c in range(n)])
            cg.load(q1, self.q, regs, name="load Q")
            fact = self._act(first)
            if self.split:
                for g, q0t in enumerate(self.tl["q0"]):
                    rg = np.clip(qext - g * vq, 0, vq)
                    cg.move(q0t, q1, fn=lambda x, g=g: x[:, g * vq:(g + 1) * vq], nbytes=_r16(rg) * D * isz,
                            active=fact, name="Q->L0A")
            else:
                cg.move(self.tl["q0"][0], q1, nbytes=_r16(qext) * D * isz, active=fact, name="Q->L0A")
        s0 = None
        if work.any():
            kt1 = self._next("kt1")
            regs = self._regs(("K", ks), lambda: [
                (b[c], hk[c], slice(0, D), slice(k0[c], k0[c] + ke[c])) if work[c] else None for c in range(n)])
            cg.load(kt1, self.kt, regs, name="load K")             # = K's region, transposed
            if not probs_pass:
                v1 = self.tl["v1"][ks % 2]
                regs = self._regs(("V", ks), lambda: [
                    (b[c], hk[c], slice(k0[c], k0[c] + ke[c]), slice(0, self.Dv)) if work[c] else None
                    for c in range(n)])
                cg.load(v1, self.v, regs, name="load V")
            kt0 = self._next("kt0")
            # consume: the L1 tile is not read again before the next load into it (no host copy needed)
            cg.move(kt0, kt1, nbytes=D * _r16(kext) * isz, active=wact, name="K->L0B", consume=True)
            if self.split:                 # one S block per row block, written out by FixPipe
                for g, q0t in enumerate(self.tl["q0"]):
                    rg = np.clip(qext - g * vq, 0, vq)
                    gact = work & (rg > 0)
                    if not gact.any():
                        continue
                    ga = self._act(gact)
                    s0 = self._next("s0")
                    cg.mmad(s0, q0t, kt0, rg, D, kext, accumulate=False, active=ga, name="S=QK")
                    rl = rg.tolist()
                    regs = self._regs(("S>", ks, g), lambda: [
                        (c, slot, slice(g * vq, g * vq + rl[c]), slice(0, ke[c])) if gact[c] else None
                        for c in range(n)])
                    e = cg.store(s0, self.ws_s, regs, deps=self._cdeps("s_read", ks - 2, g), name="FixPipe S->GM")
                    self.ends[("s_written", ks, g)] = self._masked(e, ga)
            else:
                s0 = self._next("s0")
                cg.mmad(s0, self.tl["q0"][0], kt0, qext, D, kext, accumulate=False, active=wact, name="S=QK")
        # vector side: row block by row block into P, then P leaves in one piece per vector core
        vg, nv = self.vg, self.nv
        v = self._vview(st, s)
        P = self._next("p")
        if self.sinks is not None and not probs_pass:
            self._load_sink(v, ks)
        for r in range(self.nsub):
            ro = (self.half * self.nsub + r) * vq             # first row of the block within the item
            rows = np.clip(v["qext"] - ro, 0, vq)
            ract = v["work"] & (rows > 0)
            if not ract.any():
                continue
            a_ = self._act(ract)
            # the keep bits first: they depend on nothing, so their load runs ahead of S's, which waits for the tile
            dt_ = self._load_drop(v, s, r, rows, ro, ract) if self.drop is not None and not probs_pass else None
            S = self._next("s")
            if self.split:
                rl, ol, kl, cv = rows.tolist(), ro.tolist(), v["kl"], self.cube_of
                regs = self._regs(("S<", ks, r), lambda: [
                    (int(cv[c]), slot, slice(ol[c], ol[c] + rl[c]), slice(0, kl[c])) if ract[c] else None
                    for c in range(nv)])
                e = vg.load(S, self.ws_s, regs, deps=self._vdeps("s_written", ks, r), name="load S")
                self._put_v("s_read", ks, r, self._masked(e, a_))
            else:
                vg.move(S, s0, fn=(lambda x, r=r: x[:, r * vq:(r + 1) * vq]) if self.nsub > 1 else None,
                        nbytes=rows * v["kext"] * 4, active=a_, name="FixPipe S->UB", consume=self.nsub == 1)
            self._softmax(S, P, s, r, rows, ro, ract, v, probs_pass, dt_)
        vrows = np.clip(v["qext"] - self.half * self.rows, 0, self.rows)
        rl, ol, kl = vrows.tolist(), (self.half * self.rows).tolist(), v["kl"]
        if probs_pass:
            zact = v["skip"] & (vrows > 0)                     # a fully masked (skipped) tile: zeros
            if zact.any():
                Lf = self.tl["l"][0]

                def dup(cs):             # 0, or NaN on rows with nothing attended under empty_rows="nan"
                    z = zact[cs]
                    P.data[cs][z] = np.where(Lf.data[cs][z] == 0, self.empty, np.float32(0))[:, :, None]

                vg.vector("dup 0", [P], [Lf], vg.row_repeats(vrows, v["kext"], self.dtype) * zact,
                          compute=dup, per_core=True, active=self._act(zact))
            oact = (v["work"] | zact) & (vrows > 0)
            bl, hl, ql, kl0 = v["b"].tolist(), v["h"].tolist(), v["q0"].tolist(), v["k0"].tolist()
            regs = self._regs(("probs", ks), lambda: [
                (bl[c], hl[c], slice(ql[c] + ol[c], ql[c] + ol[c] + rl[c]), slice(kl0[c], kl0[c] + kl[c]))
                if oact[c] else None for c in range(nv)])
            vg.store(P, self.probs, regs, name="store probs")
        else:
            pact = v["work"] & (vrows > 0)
            regs = self._regs(("P>", ks), lambda: [
                (int(self.cube_of[c]), slot, slice(ol[c], ol[c] + rl[c]), slice(0, kl[c])) if pact[c] else None
                for c in range(nv)])
            a_ = self._act(pact)
            self.deferred.append(lambda: self._put_vh("p_written", ks, self._masked(
                vg.store(P, self.ws_p, regs, deps=self._vdeps_h("p_read", ks - 2), name="store P"), a_)))

    def _vview(self, st, s):
        """Step ``s`` as seen by the vector cores."""
        key = ("v", s + self.base)
        v = self.plan.regions.get(key)
        if v is None:
            v = self.plan.regions[key] = self._vview_build(st, s)
        return v

    def _vview_build(self, st, s):
        vec = self._vec
        kext = vec(st.kext[s])
        return {"work": vec(st.work[s]), "first": vec(st.first[s] & st.valid[s]), "last": vec(st.last[s]),
                "skip": vec(st.skip[s] & st.valid[s]), "qext": vec(st.qext[s]), "kext": kext, "kl": kext.tolist(),
                "q0": vec(st.q0[s]), "k0": vec(st.k0[s]), "b": vec(st.b[s]), "h": vec(st.h[s]),
                "partial": vec(st.partial[s]), "edge": vec(st.edge[s])}

    def _load_sink(self, v, ks):
        """The sink logit of each vector core's head, at the first step of its item (the softmax's start)."""
        fa = v["first"] & v["work"]
        if not fa.any():
            return
        hl = v["h"].tolist()
        self.vg.load(self.tl["sink"][0], self.sinks, self._regs(("sink", ks), lambda: [
            (slice(hl[c], hl[c] + 1),) if fa[c] else None for c in range(self.nv)]), name="load sink")

    def _load_drop(self, v, s, r, rows, ro, ract):
        """The dropout keep bits of one row block's scores: ``rows x ceil(kext / 8)`` bytes into a UB tile."""
        dt_ = self._next("drop")
        bl, hl, ql, kl0, kl = v["b"].tolist(), v["h"].tolist(), v["q0"].tolist(), v["k0"].tolist(), v["kl"]
        rl, ol = rows.tolist(), ro.tolist()
        self.vg.load(dt_, self.drop, self._regs(("drop", s + self.base, r), lambda: [
            (bl[c], hl[c], slice(ql[c] + ol[c], ql[c] + ol[c] + rl[c]),
             slice(kl0[c] // 8, (kl0[c] + kl[c] + 7) // 8)) if ract[c] else None
            for c in range(self.nv)]), name="load dropout mask")
        return dt_

    def _softmax(self, S, P, s, r, rows, ro, ract, v, probs_pass, dt_=None):
        """The Vector passes over one S row block (fp32), ending in rows ``ro`` of P (operand dtype).

        The passes run back to back on the Vector unit, so they are issued as one instruction whose repeats
        are their sum: scale, [mask], [causal compare + select], max, sub, exp, sum, [cast] (first sweep);
        scale, [mask], [causal], sub, exp, mul 1/l, [cast] (probabilities sweep).
        """
        vg, kvb, vq = self.vg, self.kvb, self.vq
        a_ = self._act(ract)
        cur, prev = s % 2, (s - 1) % 2
        sl = slice(r * vq, (r + 1) * vq)
        M, Lt, A = self.tl["m"], self.tl["l"], self.tl["alpha"]
        rr = vg.row_repeats(rows, v["kext"], "float32") * ract
        stat = vg.repeats(rows, "float32") * ract
        padcols = bool((v["kext"][ract] < kvb).any())
        passes = 4 if probs_pass else 5                     # scale, (max,) sub, exp, sum or mul
        if self.softcap is not None:
            passes += SOFTCAP_PASSES                        # muls 1/c, tanh, muls c
        if self.head_round is not None:
            passes += 4                                     # the scores and their per-head product rounded to 16 bits
        if self.logits_round is not None:
            passes += 4                                     # the scores and the masked logits rounded to 16 bits
        if self.dtype != "float32":
            passes += 1                                     # cast
        reads, writes = [S], [S, P]
        mt = None
        if self.mask is not None:
            mt = self._next("mask")
            mB, mN, mr, mc = self.mask.shape
            bl, hl, ql, kl0, kl = v["b"].tolist(), v["h"].tolist(), v["q0"].tolist(), v["k0"].tolist(), v["kl"]
            rl, ol = rows.tolist(), ro.tolist()
            vg.load(mt, self.mask, self._regs(("mask", s + self.base, r), lambda: [
                (bl[c] if mB != 1 else 0, hl[c] if mN != 1 else 0,
                 slice(ql[c] + ol[c], ql[c] + ol[c] + rl[c]) if mr != 1 else slice(0, 1),
                 slice(kl0[c], kl0[c] + kl[c]) if mc != 1 else slice(0, 1)) if ract[c] else None
                for c in range(self.nv)]), name="load mask")
            passes += mask_passes(self.mask.dtype, self.mask_add, self.fill_in_mask is not None)
            #                         select / (cast and) add / cast, add, cast; the filled entries' compare, select
            reads.append(mt)
        if dt_ is not None:
            passes += 1                                     # select by the keep bits
            reads.append(dt_)
        sk = self.tl["sink"][0] if self.sinks is not None and not probs_pass else None
        if sk is not None:
            reads.append(sk)
        part = v["partial"] & ract
        edge = v["edge"] & ract
        repeats = rr * passes + rr * part * 2 + rr * edge * 2 + stat * (3 if probs_pass else 5)
        vq0, vk0, kext, first = v["q0"], v["k0"], v["kext"], v["first"]
        tmp, f32 = self.tmp, self.dtype == "float32"
        partial = bool(part.any())
        window = self.window if edge.any() else 0
        # every pass is per core (per row, even), so the closures take a slice of the cores (vector(...,
        # per_core=True)): host threads may split the cores between them; values are the same however split.
        # The closures look tile arrays up when they run (the launch computes values behind its timeline).

        def scale_and_mask(cs):
            x = S.data[cs]
            if self.logits_round is not None:       # eager's 16-bit scores, as its matmul returns them
                round_in_place(x, self.logits_round, tmp[cs], self.tmp2[cs])
            np.multiply(x, self.scale, out=x)
            if self.head_scale is not None:         # each core's head's own factor, after the scale
                hs = np.asarray(self.head_scale.data, dtype=np.float32)[v["h"][cs]].reshape(-1, *(1,) * (x.ndim - 1))
                if self.head_round is None:
                    np.multiply(x, hs, out=x)
                else:                               # eager's 16-bit product of its 16-bit scores
                    with np.errstate(over="ignore", invalid="ignore"):
                        round_to(x, self.head_round, self.tmp2[cs], tmp[cs])
                        np.multiply(self.tmp2[cs], hs, out=self.tmp2[cs])
                        round_to(self.tmp2[cs], self.head_round, x, tmp[cs])
            if self.softcap is not None:
                np.multiply(x, np.float32(1) / self.softcap, out=x)
                np.tanh(x, out=x)
                np.multiply(x, self.softcap, out=x)
            if mt is not None:
                if self.mask.dtype == "bool" and self.keep_nan:
                    # SDPA adds -inf for a False: a NaN score stays NaN and a +inf one becomes NaN
                    np.add(x, self.fill, out=x, where=~mt.data[cs])
                elif self.mask.dtype == "bool":
                    np.copyto(x, self.fill, where=~mt.data[cs])
                elif self.mask_add is not None:     # eager's 16-bit add: a score the mask absorbs takes its value
                    add_in_dtype(x, mt.data[cs], self.mask_add, tmp[cs], self.tmp2[cs])
                else:
                    np.add(x, mt.data[cs], out=x)
                if self.fill_in_mask is not None:   # a filled score is the fill, as masked_fill makes it
                    np.copyto(x, self.fill_in_mask, where=mt.data[cs] == self.fill_in_mask)
            if self.logits_round is not None:       # the logits cast down once before the softmax, as eager's
                round_in_place(x, self.logits_round, tmp[cs], self.tmp2[cs])
            if padcols:                   # key columns past the end of K (zero-padded tile): after the mask,
                np.copyto(x, _NEG_INF, where=self.col[None, None, :] >= kext[cs, None, None])  # which may fill
            mask_outside_band(x, (vq0 + ro)[cs], vk0[cs], self.rowi, self.col, partial, window)
            return x

        def cast(x, cs):
            if f32:
                np.copyto(P.data[cs, sl], x)
            else:
                round_to(x, self.dtype, P.data[cs, sl], tmp[cs], nonneg=True)

        if probs_pass:
            Mt, Lf = M[0], Lt[0]

            def probs(cs):
                x = scale_and_mask(cs)
                m = Mt.data[cs, sl]
                np.subtract(x, np.where(m == _NEG_INF, np.float32(0), m)[:, :, None], out=x)
                np.exp(x, out=x)
                np.multiply(x, self._inverse(Lf.data[cs, sl])[:, :, None], out=x)
                cast(x, cs)

            vg.vector("probs: scale mask sub exp mul cast", writes, reads + [Mt, Lf], repeats,
                      compute=_quiet(probs), per_core=True, active=a_)
            return

        def softmax(cs):
            Mp, Lp, Mc, Lc, Ac = M[prev].data, Lt[prev].data, M[cur].data, Lt[cur].data, A[cur].data
            x = scale_and_mask(cs)
            fc = first[cs, None]
            # an item's first tile starts from nothing attended (m = -inf, l = 0) or from its sink logit, a score
            # of its own (m = sink, l = exp(sink - sink) = 1)
            m0 = _NEG_INF if sk is None else sk.data[cs, :1]
            mprev = np.where(fc, m0, Mp[cs, sl])
            mnew = np.maximum(mprev, x.max(axis=-1))
            muse = np.where(mnew == _NEG_INF, np.float32(0), mnew)   # a row with nothing attended yet
            alpha = np.exp(mprev - muse)
            Ac[cs, sl] = alpha
            Mc[cs, sl] = mnew
            np.subtract(x, muse[:, :, None], out=x)
            np.exp(x, out=x)
            lprev = np.where(fc, np.float32(0) if sk is None else np.float32(1), Lp[cs, sl])
            # row sums as a product with ones: numpy's own reduction over short rows is 3x slower
            Lc[cs, sl] = alpha * lprev + np.matmul(x, self.ones)
            if dt_ is not None:          # dropout after the row sum: the softmax's denominator is the full one
                np.multiply(x, unpack_keep(dt_.data[cs]), out=x)
            cast(x, cs)

        vg.vector("softmax: scale mask max sub exp sum cast", writes + [M[cur], Lt[cur], A[cur]],
                  reads + [M[prev], Lt[prev]], repeats, compute=_quiet(softmax), per_core=True,
                  active=a_)

    # ---------------------------------------------------------------- stage B: P·V, accumulate
    def stage_b(self, st, s):
        """Cube O_j = P·V_s per vector core's rows; Vector O = O·α + O_j; last tile of an item: out = O / l."""
        cg, L = self.cg, st.lists
        n, Dv, isz, R = self.n, self.Dv, self.isz, self.rows
        ks = s + self.base
        slot = ks % 2
        work = st.work[s]
        if not work.any():
            return
        wact = self._act(work)
        qext, kext = st.qext[s], st.kext[s]
        ke = L["kext"][s]
        v0 = self._next("v0")
        cg.move(v0, self.tl["v1"][ks % 2], nbytes=_r16(kext) * Dv * isz, active=wact, name="V->L0B", consume=True)
        o_tiles = []
        for hh in range(self.nh):
            rh = np.clip(qext - hh * R, 0, R)
            hact = work & (rh > 0)
            if not hact.any():
                continue
            ha = self._act(hact)
            rl = rh.tolist()
            # the kernel writes its own workspace, so P can be laid out as L0A fractals: straight to L0A
            p0 = self._next("p0")
            regs = self._regs(("P<", ks, hh), lambda: [
                (c, slot, slice(hh * R, hh * R + rl[c]), slice(0, ke[c])) if hact[c] else None for c in range(n)])
            e = cg.load(p0, self.ws_p, regs, deps=self._cdeps("p_written", ks, hh), name="load P->L0A")
            self.ends[("p_read", ks, hh)] = self._masked(e, ha)
            o0 = self._next("o0")
            cg.mmad(o0, p0, v0, rh, kext, Dv, accumulate=False, active=ha, name="O_j=PV")
            if self.split:
                regs = self._regs(("O>", ks, hh), lambda: [
                    (c, slot, slice(hh * R, hh * R + rl[c]), slice(0, Dv)) if hact[c] else None for c in range(n)])
                e = cg.store(o0, self.ws_o, regs, deps=self._cdeps("o_read", ks - 2, hh), name="FixPipe O_j->GM")
                self.ends[("o_written", ks, hh)] = self._masked(e, ha)
            o_tiles.append(o0)
        if self.return_probs or self.return_stats:
            # the item's max and sum are final since A(s): on the MTE3 queue ahead of A(s+1)'s P store, which
            # waits for the next softmax (and so would this store, and the GM port bookings after it)
            v = self._vview(st, s)
            self._store_stats(s, v, v["last"] & v["work"])
        self._flush()                     # A(s+1)'s P stores: after B(s)'s loads, before the output stores
        vg, nv = self.vg, self.nv
        v = self._vview(st, s)
        rows = np.clip(v["qext"] - self.half * R, 0, R)
        ract = v["work"] & (rows > 0)
        if not ract.any():
            return
        a_ = self._act(ract)
        PV, O, A = self.tl["pv"][0], self.tl["o"][0], self.tl["alpha"][s % 2]
        if self.split:
            rl, ol, cv = rows.tolist(), (self.half * R).tolist(), self.cube_of
            regs = self._regs(("O<", ks), lambda: [
                (int(cv[c]), slot, slice(ol[c], ol[c] + rl[c]), slice(0, Dv)) if ract[c] else None
                for c in range(nv)])
            e = vg.load(PV, self.ws_o, regs, deps=self._vdeps_h("o_written", ks), name="load O_j")
            self._put_vh("o_read", ks, self._masked(e, a_))
        else:
            vg.move(PV, o_tiles[0], nbytes=rows * Dv * 4, active=a_, name="FixPipe O_j->UB", consume=True)
        first = v["first"]

        def update(cs):
            od, pvd, ad = O.data, PV.data, A.data
            o = od[cs]
            np.multiply(o, ad[cs, :, None], out=o)
            np.add(o, pvd[cs], out=o)
            f = first[cs]
            if f.any():                           # a new item starts from O_j (nothing stale carried)
                o[f] = pvd[cs][f]

        vg.vector("O=O*alpha+O_j", [O], [O, PV, A], 2 * vg.row_repeats(rows, Dv, "float32") * ract,
                  compute=update, per_core=True, active=a_)
        fin = v["last"] & ract
        if fin.any():
            orows = _out_rows(self.vq)
            for r in range(R // orows):
                ro = self.half * R + r * orows
                rr = np.clip(v["qext"] - ro, 0, orows)
                f = fin & (rr > 0)
                if f.any():
                    self._finish(s, v, r, f, rr, ro, orows)

    def _finish(self, s, v, r, fin, rows, ro, orows):
        """Last tile of an item: out = O / l for ``orows`` rows, cast to the output dtype, store."""
        vg, Dv = self.vg, self.Dv
        O, Lt = self.tl["o"][0], self.tl["l"][s % 2]
        OUT = self._next("out")
        sl = slice(r * orows, (r + 1) * orows)

        def norm(cs):
            inv = self._inverse(Lt.data[cs, sl])
            if self.drop is not None:
                inv = inv * self.inv_keep                  # dropout's 1 / keep_prob, folded into 1 / l
            o = O.data[cs, sl] * inv[:, :, None]
            round_to(o, self.dtype, OUT.data[cs], np.empty_like(o))

        passes = 2 if self.dtype != "float32" else 1
        vg.vector("out=O/l, cast", [OUT], [O, Lt], vg.row_repeats(rows, Dv, "float32") * fin * passes,
                  compute=norm, per_core=True, active=self._act(fin))
        bl, hl, ql = v["b"].tolist(), v["h"].tolist(), v["q0"].tolist()
        rl, ol = rows.tolist(), ro.tolist()
        regs = self._regs(("out", s + self.base, r), lambda: [
            (bl[c], hl[c], slice(ql[c] + ol[c], ql[c] + ol[c] + rl[c]), slice(0, Dv)) if fin[c] else None
            for c in range(self.nv)])
        vg.store(OUT, self.out, regs, name="store out")

    def _stat_regions(self, v, act, key):
        rows = np.clip(v["qext"] - self.half * self.rows, 0, self.rows)
        act = act & (rows > 0)
        bl, hl, ql = v["b"].tolist(), v["h"].tolist(), v["q0"].tolist()
        rl, ol = rows.tolist(), (self.half * self.rows).tolist()
        return act, self._regs(key, lambda: [(bl[c], hl[c], slice(ql[c] + ol[c], ql[c] + ol[c] + rl[c]))
                                             if act[c] else None for c in range(self.nv)])

    def _store_stats(self, s, v, fin):
        """The final row max and sum of an item (CANN's softmax_max/_sum): an output, or the probabilities
        sweep's input."""
        fin, regs = self._stat_regions(v, fin, ("stats>", s))
        if fin.any():
            e1 = self.vg.store(self.tl["m"][s % 2], self.m_gm, regs, name="store max")
            e2 = self.vg.store(self.tl["l"][s % 2], self.l_gm, regs, name="store sum")
            self.stats_end = np.maximum(self.stats_end, self._masked(np.maximum(e1, e2), fin))

    def probs_sweep(self):
        st = self.steps2
        for s in range(st.T):
            v = self._vview(st, s)
            fact, regs = self._stat_regions(v, v["first"], ("stats<", s))
            if fact.any():
                self.vg.load(self.tl["m"][0], self.m_gm, regs, deps=(self.stats_end,), name="load max")
                self.vg.load(self.tl["l"][0], self.l_gm, regs, deps=(self.stats_end,), name="load sum")
            self.stage_a(st, s, probs_pass=True)

    def _flush(self):
        for issue in self.deferred:
            issue()
        self.deferred = []

    def run(self):
        # P stores of A(s+1) are issued after the loads of B(s): they happen later in time, and the GM
        # port books transfers in issue order (a later-issued, earlier-running transfer only gets the
        # idle intervals left before the bookings already made).
        # values behind the timeline (Launch.defer): the data stays within each core (and AIC c <-> AIVs 2c,
        # 2c+1) except for the statistics of the probabilities sweep, read back behind a barrier; every
        # closure reads tile arrays when it runs
        self.launch.defer()
        st = self.steps
        self.stage_a(st, 0)
        self._flush()
        for s in range(st.T):
            if s + 1 < st.T:
                self.stage_a(st, s + 1)
            self.stage_b(st, s)
            self._flush()
        if self.return_probs:
            self.base = st.T
            self.launch.barrier()          # the sweep's items may sit on other cores than the first's
            self.probs_sweep()
        outs = (self.out, self.probs) if self.return_probs else (self.out,)
        return outs + (self.m_gm, self.l_gm) if self.return_stats else outs


__all__ = ["flash_attention", "default_tiling", "tiling_fits", "flops", "min_hbm_bytes", "pack_keep", "round_to"]
