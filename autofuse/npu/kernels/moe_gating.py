"""MoE router top-k on the Vector unit: ``moe_gating_topk`` (fused) and ``topk`` (the plain op).

    npu.run("moe_gating_topk", logits, bias, k=2, norm="softmax", renorm=True)   -> (weights, indices)
    npu.run("topk", x, k=4, largest=True)                                       -> (values, indices)

``moe_gating_topk`` (CANN's MoeGatingTopK / MoeGatingTopKSoftmax): logits ``x [T, E]`` → normalise in fp32
(``softmax`` | ``sigmoid`` | ``none``) → scores; ``choice = scores + bias`` (the optional ``bias [E]`` is for
selection only) → optional group limit (E experts in ``n_group`` groups; a group scores its max
(``group_score="max"``) or the sum of its two largest choices (``"top2"``, DeepSeek-V3); the ``topk_group`` best
groups are kept, the other groups' experts get ``-inf``, or ``group_fill`` where given: DeepSeek-V2's and Mistral
4's routers fill them with 0.0, which an expert of a kept group scoring below it loses to) → the k largest choices,
largest first → their *unbiased* scores (``weights_from="choices"``: the chosen choices as filled, DeepSeek-V2's
top-k values, 0.0 where a token took an expert of a group not kept) → optional renormalisation ``y / (sum(y) +
eps)`` (``eps=0``: exactly ``y / sum(y)``) → ``* routed_scaling_factor``. ``norm="topk_softmax"`` selects on the
logits themselves and takes the softmax over the k chosen (GraniteMoE's and GPT-OSS's routers:
``softmax(topk(x).values)``; the same function of x as ``softmax`` with ``renorm`` and ``eps=0``, but its selection
is on the logits, so indices equal ``torch.topk(x)``'s where rounding would tie two probabilities). Outputs
``weights [T, k]`` (``out_dtype``) and ``indices [T, k]`` (int32).
``topk`` is the same program with ``norm="none"``, values in x's dtype, ``largest=False`` choosing the
smallest (as ``torch.topk``), over the last dim of x of any rank.

Layout: tokens on lanes. A tile of ``lanes`` token rows is loaded as it lies in GM (``[lanes, E]``, one
burst), transposed on the Vector unit (TransDataTo5HD, ``vnchwconv``) to ``[E, lanes]``, and every step
over the experts is then an elementwise instruction between rows of ``lanes`` values: a reduction over E
costs ``(E - 1) · ceil(lanes / 64)`` fp32 repeats, not ``lanes · ceil(E / 64)`` as per-token rows would
(8× fewer for E = 8). Token rows are split evenly over the vector cores, tiles double-buffered.

Top-k: k rounds of ``max`` over the experts, ``compare == max`` and ``select`` the expert number (else E),
``min`` (the first expert holding the max), ``compare iota == index`` and ``select -inf`` (knock it out).
With a bias, the rounds select on the choices and, after the ties are settled (below), each chosen expert's
unbiased score is gathered (``compare iota == index``, ``select``, ``sum``). Group top-2 runs two such
rounds inside each group at once; group selection runs ``topk_group`` rounds over the group scores. A NaN
counts as the largest value, as in ``torch.topk``: ``max`` propagates it and the compares hold NaN equal to
NaN (modelled at no extra cost), so a NaN score is chosen first (last with ``largest=False``).

Ties: ``torch.topk`` on the CPU does not order equal values lowest-index-first; it leaves them where
libstdc++'s ``nth_element`` / ``partial_sort`` puts them (see :mod:`autofuse.npu.kernels.stl_select`). The
kernel flags rows where two of the chosen values are equal, or the k-th equals the best value left (one
more ``max`` and compares; two NaNs count as equal), and the Scalar unit re-selects those rows, on the
chosen rows' choices as they were before the knock-outs, with torch's algorithm (cycles: one
per comparison plus one per value read [A]), so indices equal ``torch.topk``'s with ties too. The same
holds for the group selection (``torch.topk(group_scores, topk_group)``: the same set).

``tiling``: ``{"lanes": token rows per tile}``.
"""
from __future__ import annotations

import math

import numpy as np

from autofuse.npu.dtypes import itemsize
from autofuse.npu.kernels.stl_select import torch_topk
from autofuse.npu.kernels.tiles import (VEC_FLOATS, active_mask, ceil_div, check_dtype, extents, fits, largest,
                                        lockstep, pad, pipeline, rnd, round_up, split_blocks, view)
from autofuse.npu.machine import GMTensor
from autofuse.npu.run import ALL, kernel

NORMS = ("softmax", "sigmoid", "none", "topk_softmax")
GROUP_SCORES = ("max", "top2")
_NEG = np.float32(-np.inf)


def ub_specs(E, k, lanes, dtype, out_dtype, bias, n_group):
    """UB allocations of one configuration, in allocation order (the cost model mirrors this list)."""
    f32 = "float32"
    L = pad(lanes, f32)
    specs = [((lanes, pad(E, dtype)), dtype)] * 2                     # x tiles as loaded, double-buffered
    specs += [((E, L), f32)] * 3                                      # scores, choice / work, masks
    specs += [((E, L), f32)]                                          # iota over the experts
    if bias:
        specs += [((E, 8), f32), ((E, L), f32)]                       # bias (one block per expert), choice
    if n_group > 1:
        specs += [((n_group, L), f32)] * 2                            # group scores, kept groups
    specs += [((k, L), f32)] * 2                                      # values, indices
    specs += [((lanes, pad(k, out_dtype)), out_dtype)] * 2 + [((lanes, pad(k, "int32")), "int32")] * 2
    return specs


def default_lanes(device, T, E, k, dtype, out_dtype, bias, n_group) -> int:
    """Token rows per tile: the most that fit UB, capped so each core has about four tiles (multiples of 8)."""
    n = max(1, min(device.vector_cores, T))
    per_core = ceil_div(T, n)
    top = largest(lambda v: fits(device, ub_specs(E, k, 8 * v, dtype, out_dtype, bias, n_group)), 1, 1 << 12)
    if top < 1:
        raise ValueError(f"moe_gating_topk: {E} experts do not fit UB ({device.buffers['UB']:,} B) on "
                         f"{device.name} even 8 tokens at a time")
    want = max(8, round_up(ceil_div(per_core, 4), 8))
    return int(min(8 * top, want, round_up(per_core, 8)))


def _vnchwconv(rows, cols, isz):
    """Repeats of a TransDataTo5HD transpose of a [rows, cols] tile (512 B a repeat; 4-byte types twice)."""
    return (1 if isz == 2 else 2) * ceil_div(round_up(rows, 16) * round_up(cols, 16) * isz, 512)


def _check(kernel_name, x, bias, k, norm, n_group, topk_group, group_score, out_dtype, E, group_fill=None,
           weights_from="scores", renorm=False):
    if norm not in NORMS:
        raise ValueError(f"{kernel_name}: norm={norm!r}; choose one of {', '.join(NORMS)}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"{kernel_name}: group_score={group_score!r}; choose one of {', '.join(GROUP_SCORES)}")
    if not 1 <= k <= E:
        raise ValueError(f"{kernel_name}: k={k} must be in [1, {E}] (the number of experts)")
    if n_group < 1 or E % n_group:
        raise ValueError(f"{kernel_name}: {E} experts cannot be split into n_group={n_group} equal groups")
    if n_group > 1:
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"{kernel_name}: topk_group={topk_group} must be in [1, n_group={n_group}]")
        if k > topk_group * (E // n_group):
            raise ValueError(f"{kernel_name}: k={k} exceeds the {topk_group * (E // n_group)} experts of the "
                             f"{topk_group} kept groups")
        if group_score == "top2" and E // n_group < 2:
            raise ValueError(f"{kernel_name}: group_score='top2' needs groups of at least 2 experts")
    if group_fill is not None and (n_group == 1 or math.isnan(group_fill)):
        raise ValueError(f"{kernel_name}: group_fill={group_fill} is the choice given to the experts of the groups "
                         f"not kept: give a number with n_group > 1, or None (-inf)")
    if weights_from not in ("scores", "choices") or weights_from == "choices" and (
            bias is not None or norm not in ("softmax", "sigmoid") or renorm or (group_fill or 0.0) > 0.0):
        raise ValueError(f"{kernel_name}: weights_from={weights_from!r}; 'scores' (the chosen experts' scores), or "
                         f"'choices' (the chosen choices as filled: softmax or sigmoid scores, no selection bias, no "
                         f"renormalisation, a group_fill of at most 0.0, so that a filled weight is one no score can "
                         f"be but 0.0)")
    if bias is not None:
        check_dtype(kernel_name, "bias", bias)
        if tuple(bias.shape) != (E,):
            raise ValueError(f"{kernel_name}: bias has shape {list(bias.shape)}; it must be [E] = [{E}]")
    if out_dtype not in VEC_FLOATS:
        raise ValueError(f"{kernel_name}: out_dtype={out_dtype!r}; choose one of {', '.join(VEC_FLOATS)}")


@kernel("moe_gating_topk", steer=ALL)          # ties re-selected on the Scalar unit: timing follows values
def moe_gating_topk(launch, x, bias=None, k=1, norm="softmax", renorm=False, eps=1e-20, routed_scaling_factor=1.0,
                    n_group=1, topk_group=1, group_score="max", out_dtype="float32", tiling=None, group_fill=None,
                    weights_from="scores"):
    """Router top-k (see the module docstring): ``x [T, E]`` → ``(weights [T, k], indices [T, k] int32)``."""
    check_dtype("moe_gating_topk", "x", x)
    if x.data.ndim != 2:
        raise ValueError(f"moe_gating_topk: x must be [T, E] router logits, got shape {list(x.shape)}")
    fill = None if group_fill is None else float(group_fill)
    _check("moe_gating_topk", x, bias, int(k), norm, int(n_group), int(topk_group), group_score, out_dtype,
           x.shape[1], fill, weights_from, bool(renorm))
    return _Program(launch, x, bias, int(k), norm, bool(renorm), float(eps), float(routed_scaling_factor),
                    int(n_group), int(topk_group), group_score, out_dtype, True, tiling, fill, weights_from).run()


@kernel("topk", steer=ALL)
def topk(launch, x, k=1, largest=True, tiling=None):
    """``torch.topk(x, k, dim=-1, largest, sorted=True)``: ``(values in x's dtype, indices int32)``."""
    check_dtype("topk", "x", x)
    if x.data.ndim < 1:
        raise ValueError("topk: x is 0-d; give it at least one dimension")
    E = x.shape[-1]
    _check("topk", x, None, int(k), "none", 1, 1, "max", x.dtype, E)
    lead = tuple(x.shape[:-1])
    x2 = view(x, (math.prod(lead), E))
    vals, idx = _Program(launch, x2, None, int(k), "none", False, 0.0, 1.0, 1, 1, "max", x.dtype, bool(largest),
                         tiling).run()
    return view(vals, lead + (int(k),)), view(idx, lead + (int(k),))


def _same(a, b):
    """``a == b`` with NaN equal to NaN: the compares of the selection, which order NaN as torch does."""
    return (a == b) | (np.isnan(a) & np.isnan(b))


def _best(w, axis, nan_first=True, keepdims=False):
    """The max along ``axis``: NaN where one is (``nan_first``, torch's largest-first order), else NaN only
    where every value is (the smallest-first order, on negated values, takes NaN last)."""
    return w.max(axis=axis, keepdims=keepdims) if nan_first else np.fmax.reduce(w, axis=axis, keepdims=keepdims)


def _pick(w, axis, nan_first=True):
    """``(max, first position holding it, hit mask)`` along ``axis`` of ``w``; the hit is knocked out of
    ``w`` (set to -inf) in place. NaN is ordered as torch orders it (:func:`_best`); the compare with the max
    holds at a NaN when the max is NaN."""
    m = _best(w, axis, nan_first, keepdims=True)
    shape = [1] * w.ndim
    shape[axis] = w.shape[axis]
    io = np.arange(w.shape[axis], dtype=np.float32).reshape(shape)
    first = np.where(_same(w, m), io, np.float32(w.shape[axis])).min(axis=axis, keepdims=True)
    hit = io == first
    np.copyto(w, _NEG, where=hit)
    return m.squeeze(axis), first.squeeze(axis), hit


class Lanes:
    """Tokens on lanes: the counting helpers and the normalisation shared by the router's forward and backward
    programs (``self.g`` the cores, ``self.ke`` this step's lanes per core, ``self.act`` its active cores,
    ``self.S`` the ``[E, lanes]`` fp32 scores, ``self.norm``)."""

    def ew(self, rows):
        """Repeats of an fp32 pass over ``rows`` expert rows of this step's lanes."""
        return rows * ceil_div(self.ke, 64)

    def vec(self, name, writes, reads, repeats, compute=None):
        self.g.vector(name, writes, reads, repeats, compute=compute, active=self.act)

    def normalise(self):
        S, E = self.S, self.E
        if self.norm == "softmax":
            def softmax():
                d = S.data
                d -= d[:, :, :].max(axis=1, keepdims=True)
                np.exp(d, out=d)
                d /= d.sum(axis=1, keepdims=True)
            for name in ("reduce max", "sub max", "exp", "reduce sum"):
                self.vec(name, (S,), (S,), self.ew(E - 1 if name.startswith("reduce") else E))
            self.vec("div sum", (S,), (S,), self.ew(E), softmax)
        elif self.norm == "sigmoid":
            for name in ("muls -1", "exp", "adds 1"):
                self.vec(name, (S,), (S,), self.ew(E))
            self.vec("reciprocal", (S,), (S,), self.ew(E),
                     lambda: np.copyto(S.data, np.float32(1) / (np.float32(1) + np.exp(-S.data))))


class _Program(Lanes):
    """One launch: tiles of token rows, each transposed, normalised, selected, written back."""

    def __init__(self, launch, x, bias, k, norm, renorm, eps, scale, n_group, topk_group, group_score, out_dtype,
                 largest_, tiling, group_fill=None, weights_from="scores"):
        dev = launch.device
        self.launch, self.dev, self.x, self.bias = launch, dev, x, bias
        T, E = x.shape
        self.T, self.E, self.k = T, E, k
        self.norm, self.renorm, self.eps, self.scale = norm, renorm, np.float32(eps), np.float32(scale)
        self.ng, self.kg, self.gscore = n_group, topk_group, group_score
        # the value the experts of the groups not kept get; where it is not -inf the chosen experts' unbiased scores
        # are gathered after the selection (as with a bias), so an expert chosen at the fill weighs its score, unless
        # the weights are the chosen choices themselves (weights_from="choices": the fill)
        self.fill = _NEG if group_fill is None else np.float32(group_fill)
        self.gather = bias is not None or (n_group > 1 and group_fill is not None and weights_from == "scores")
        self.out_dtype, self.largest = out_dtype, largest_
        self.dtype = x.dtype
        self.weights = launch.empty((T, k), out_dtype, "weights")
        self.indices = GMTensor(np.zeros((T, k), dtype=np.int32), "int32", "indices")
        launch.allocated.append((self.indices, T * k * 4))
        if T == 0:
            launch.group("aiv", 1)
            return
        lanes = int((tiling or {}).get("lanes", 0)) or default_lanes(dev, T, E, k, x.dtype, out_dtype,
                                                                     bias is not None, n_group)
        if lanes < 1:
            raise ValueError(f"moe_gating_topk: tiling {tiling} needs a positive 'lanes'")
        self.lanes = lanes
        self.n = n = max(1, min(dev.vector_cores, T))
        g = self.g = launch.group("aiv", n)
        f32 = "float32"
        L = pad(lanes, f32)
        self.X = [g.alloc("UB", (lanes, pad(E, x.dtype)), x.dtype, f"x{i}") for i in range(2)]
        self.S = g.alloc("UB", (E, L), f32, "scores")
        self.W = g.alloc("UB", (E, L), f32, "work")
        self.M = g.alloc("UB", (E, L), f32, "mask")
        self.iota = g.alloc("UB", (E, L), f32, "iota")
        if bias is not None:
            self.B = g.alloc("UB", (E, 8), f32, "bias")
            self.C = g.alloc("UB", (E, L), f32, "choice")
        if n_group > 1:
            self.G = g.alloc("UB", (n_group, L), f32, "group scores")
            self.K = g.alloc("UB", (n_group, L), f32, "kept groups")
        self.V = g.alloc("UB", (k, L), f32, "values")
        self.I = g.alloc("UB", (k, L), f32, "index")
        self.OW = [g.alloc("UB", (lanes, pad(k, out_dtype)), out_dtype, f"w{i}") for i in range(2)]
        self.OI = [g.alloc("UB", (lanes, pad(k, "int32")), "int32", f"i{i}") for i in range(2)]
        self.per_core = split_blocks(T, n, lanes)
        self.ctr = 0

    # ------------------------------------------------------------------ the program
    def run(self):
        if self.T == 0:
            return self.weights, self.indices
        g, E = self.g, self.E
        iota = self.iota
        g.vector("iota (arange over experts)", (iota,), (), ceil_div(pad(self.lanes, "float32"), 64) * E,
                 compute=lambda: iota.data.__setitem__(Ellipsis, np.arange(E, dtype=np.float32)[None, :, None]))
        if self.bias is not None:
            B = self.B
            g.load(B, self.bias, [(slice(0, E),)] * self.n, fn=lambda b: b.reshape(-1, 1), name="load bias")
            if self.bias.dtype != "float32":
                g.vector("cast bias", (B,), (B,), ceil_div(E * 8, 64))
        steps = [s for s in lockstep(self.per_core)]
        pipeline(((lambda s=s: self.load(s)), self.work) for s in steps)
        return self.weights, self.indices

    def load(self, items):
        X = self.X[self.ctr % 2]
        self.ctr += 1
        E = self.E
        self.g.load(X, self.x, [None if it is None else (slice(it[0], it[0] + it[1]), slice(0, E)) for it in items],
                    active=active_mask(items), name="load logits")
        return items, X

    def work(self, h):
        items, X = h
        self.items, self.act = items, active_mask(items)
        self.ke = extents(items, lambda it: it[1])
        E, k = self.E, self.k
        S, W, M, iota = self.S, self.W, self.M, self.iota
        isz = itemsize(self.dtype)
        ke = self.ke

        def transpose():
            S.data.fill(0.0)
            S.data[:, :, :X.data.shape[1]] = X.data[:, :, :E].transpose(0, 2, 1)

        self.vec("transpose x (vnchwconv)", (S,), (X,), _vnchwconv(ke, E, isz), transpose)
        if self.dtype != "float32":
            self.vec("cast x->fp32", (S,), (S,), self.ew(E))
        if not self.largest:
            self.vec("muls -1", (S,), (S,), self.ew(E), lambda: np.negative(S.data, out=S.data))
        self.normalise()
        choice = S
        if self.bias is not None:
            C, B = self.C, self.B
            self.vec("add bias", (C,), (S, B), self.ew(E),
                     lambda: np.add(S.data, B.data[:, :, :1], out=C.data))
            choice = C
        self.choice = choice
        if self.ng > 1:
            self.limit_groups(choice)
        else:
            self.vec("copy choice", (W,), (choice,), self.ew(E), lambda: np.copyto(W.data, choice.data))
        V, I = self.V, self.I

        def pick(r):
            m, first, hit = _pick(W.data, 1, self.largest)
            V.data[:, r], I.data[:, r] = m, first
            np.copyto(M.data, hit)

        for r in range(k):
            self.rounds("experts", (W, M, I), E, 1, 1, lambda _, r=r: pick(r))
        self.fix_ties(W, V, I)                            # on the chosen choices (biased, when a bias is given)
        if self.gather:                                   # then the chosen experts' unbiased scores
            iota = self.iota
            for r in range(k):
                self.vec("compare iota == index", (M,), (iota, I), self.ew(E),
                         lambda r=r: np.copyto(M.data, iota.data == I.data[:, r:r + 1]))
                self.vec("select score", (M,), (M, S), self.ew(E),
                         lambda: np.copyto(M.data, np.where(M.data > 0, S.data, np.float32(0))))
                self.vec("reduce sum (gather)", (V,), (M,), self.ew(E - 1),
                         lambda r=r: V.data.__setitem__((slice(None), r), M.data.sum(axis=1)))
        self.finish(V, I)
        self.store()

    def rounds(self, what, tiles, rows, groups, picks, pick):
        """``picks`` selection rounds over ``groups`` groups of ``rows // groups`` rows each: max, compare,
        select the row number, min (the first row holding the max), compare, select -inf (knock it out);
        ``pick(r)`` computes round r's values. ``tiles``: (work, mask, index) tiles the instructions use."""
        w, m, i = tiles
        for r in range(picks):
            self.vec(f"reduce max ({what})", (i,), (w,), self.ew(rows - groups))
            self.vec("compare == max", (m,), (w, i), self.ew(rows))
            self.vec("select row number", (m,), (m, self.iota), self.ew(rows))
            self.vec("reduce min (first)", (i,), (m,), self.ew(rows - groups))
            self.vec("compare iota == index", (m,), (self.iota, i), self.ew(rows))
            self.vec("select -inf (knock out)", (w,), (w, m), self.ew(rows), lambda r=r: pick(r))

    def limit_groups(self, choice):
        """Group scores (max, or the sum of the top two), the topk_group best groups, the fill (-inf) elsewhere."""
        E, ng, W, M = self.E, self.ng, self.W, self.M
        gs = E // ng
        G, K = self.G, self.K
        self.vec("copy choice", (W,), (choice,), self.ew(E), lambda: np.copyto(W.data, choice.data))
        grouped = lambda: W.data.reshape(W.data.shape[0], ng, gs, -1)            # noqa: E731
        if self.gscore == "max":
            self.vec("reduce max per group", (G,), (W,), self.ew(E - ng),
                     lambda: np.copyto(G.data, grouped().max(axis=2)))
        else:
            top = []
            self.rounds("per group", (W, M, K), E, ng, 2, lambda r: top.append(_pick(grouped(), 2)[0]))
            self.vec("add top two", (G,), (G,), self.ew(ng), lambda: np.copyto(G.data, top[0] + top[1]))
        # the topk_group best groups: rounds over a copy of the group scores, knocked out as chosen
        kg = self.kg
        gval = []
        self.vec("copy group scores", (K,), (G,), self.ew(ng), lambda: np.copyto(K.data, G.data))
        self.rounds("groups", (K, M, M), ng, 1, kg, lambda r: gval.append(_pick(K.data, 1)[0]))
        self.fix_ties_groups(G, K, lambda: np.stack(gval, axis=1))

        def mask():
            keep = np.repeat(np.isneginf(K.data), gs, axis=1)     # the chosen groups were knocked out
            np.copyto(W.data, np.where(keep, choice.data, self.fill))
        self.vec("select fill outside kept groups", (W,), (choice, K), self.ew(E), mask)

    # ------------------------------------------------------------------ ties, on the Scalar unit
    def _tie_rows(self, vals, nxt):
        """Per core and lane: whether two chosen values are equal or the last equals the best one left (NaN
        equal to NaN: several NaNs are ordered as torch orders them too)."""
        tie = _same(vals[:, -1], nxt)
        if vals.shape[1] > 1:
            tie |= _same(vals[:, 1:], vals[:, :-1]).any(axis=1)
        return tie

    def _scalar(self, comparisons, reads, writes):
        self.g._exec("scalar", np.asarray(comparisons, dtype=float) * self.dev.scalar_issue_cycles,
                     reads=reads, writes=writes, active=self.act, name="re-select tied rows (libstdc++ order)")

    def fix_ties(self, W, V, I):
        """Rows with ties get torch's indices (and the matching values) from the Scalar unit."""
        E, k = self.E, self.k
        self.vec("reduce max (best left)", (self.M,), (W,), self.ew(E - 1))
        self.vec("compare ties", (self.M,), (V,), self.ew(k))
        w = W.data
        nxt = _best(w, 1, self.largest)
        v = V.data[:, :k]
        tie = self._tie_rows(v, nxt)
        lane_ok = np.arange(w.shape[2])[None, :] < self.ke[:, None]
        tie &= lane_ok
        cost = np.zeros(self.n)
        if tie.any():
            choice = self.choice.data
            if self.ng > 1:                                  # outside the kept groups: the fill, as the selection saw
                kept = np.repeat(np.isneginf(self.K.data), self.E // self.ng, axis=1)
                choice = np.where(kept, choice, self.fill)
            for c, lane in zip(*np.nonzero(tie)):
                row = choice[c, :, lane].copy()              # the choices as they were before the knock-outs
                if self.largest:
                    got, calls = torch_topk(row, k, largest=True, sorted=True)
                else:                                        # the values were negated: torch's smallest-first order
                    got, calls = torch_topk(-row, k, largest=False, sorted=True)
                I.data[c, :k, lane] = got
                V.data[c, :k, lane] = row[got]
                cost[c] += calls + E
        if cost.any():
            self._scalar(cost, (W, V), (V, I))

    def fix_ties_groups(self, G, K, gval):
        ng, kg = self.ng, self.kg
        nxt = K.data.max(axis=1)
        tie = self._tie_rows(gval(), nxt)
        tie &= np.arange(K.data.shape[2])[None, :] < self.ke[:, None]
        cost = np.zeros(self.n)
        for c, lane in zip(*np.nonzero(tie)):
            got, calls = torch_topk(G.data[c, :, lane], kg, largest=True, sorted=False)
            K.data[c, :, lane] = G.data[c, :, lane]
            K.data[c, got, lane] = _NEG
            cost[c] += calls + ng
        if cost.any():
            self._scalar(cost, (G,), (K,))

    # ------------------------------------------------------------------ renormalise, scale, write out
    def finish(self, V, I):
        k = self.k
        if not self.largest:
            self.vec("muls -1", (V,), (V,), self.ew(k), lambda: np.negative(V.data, out=V.data))
        if self.norm == "topk_softmax":
            self.softmax_chosen(V)
        if self.renorm:
            M = self.M
            self.vec("reduce sum", (M,), (V,), self.ew(k - 1))
            if self.eps != 0:
                self.vec("adds eps", (M,), (M,), self.ew(1))

            def div():
                d = V.data[:, :k].sum(axis=1, keepdims=True, dtype=np.float32)
                if self.eps != 0:
                    d = d + self.eps
                np.divide(V.data[:, :k], d, out=V.data[:, :k])
            self.vec("div sum", (V,), (V, M), self.ew(k), div)
        if self.scale != 1:
            self.vec("muls routed_scaling_factor", (V,), (V,), self.ew(k),
                     lambda: np.multiply(V.data, self.scale, out=V.data))

    def softmax_chosen(self, V):
        """Softmax over the k chosen logits, largest first: minus the first, exp, sum, divide (fp32)."""
        k, M = self.k, self.M

        def softmax():
            v = V.data[:, :k]
            v -= v[:, :1].copy()
            np.exp(v, out=v)
            v /= v.sum(axis=1, keepdims=True, dtype=np.float32)
        self.vec("sub first (max)", (V,), (V,), self.ew(k))
        self.vec("exp", (V,), (V,), self.ew(k))
        self.vec("reduce sum", (M,), (V,), self.ew(k - 1))
        self.vec("div sum", (V,), (V, M), self.ew(k), softmax)

    def store(self):
        k, ke, items = self.k, self.ke, self.items
        OW, OI = self.OW[self.ctr % 2], self.OI[self.ctr % 2]
        V, I = self.V, self.I
        od = self.out_dtype
        if od != "float32":
            self.vec(f"cast values->{od}", (V,), (V,), self.ew(k))
        self.vec("transpose values (vnchwconv)", (OW,), (V,), _vnchwconv(k, ke, itemsize(od)),
                 lambda: OW.data[:, :, :k].__setitem__(Ellipsis, rnd(V.data[:, :k, :OW.data.shape[1]]
                                                                     .transpose(0, 2, 1), od)))
        self.vec("cast index->int32", (I,), (I,), self.ew(k))
        self.vec("transpose index (vnchwconv)", (OI,), (I,), _vnchwconv(k, ke, 4),
                 lambda: OI.data[:, :, :k].__setitem__(Ellipsis, I.data[:, :k, :OI.data.shape[1]].transpose(0, 2, 1)))
        regs = [None if it is None else (slice(it[0], it[0] + it[1]), slice(0, k)) for it in items]
        self.g.store(OW, self.weights, regs, active=self.act, name="store weights")
        self.g.store(OI, self.indices, regs, active=self.act, name="store indices")


__all__ = ["moe_gating_topk", "topk", "Lanes", "default_lanes", "ub_specs", "NORMS", "GROUP_SCORES"]
