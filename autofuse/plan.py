"""Plan: price every candidate, choose a conflict-free set globally, respect the level and the budget.

Algorithm
---------
1. **Price.** For a candidate (a :class:`~autofuse.match.Match`), the unfused price is the sum, over
   the nodes it covers, of the cost model's estimate of each kernel those nodes lower to
   (:mod:`autofuse.lower`, the same table the simulator runs); the fused price is the estimate of the
   fused kernel with the candidate's parameters. Prices are cycles on the target device, plus HBM bytes.
2. **Filter by level** (see :data:`LEVELS`) and by profitability; a fused kernel whose own working set
   (inputs, outputs, workspace) exceeds the memory budget is rejected.
3. **Choose globally.** Candidates that share nodes conflict. In each connected component of the
   conflict graph the planner takes the independent set with the largest total saving (exactly, by
   branch and bound, for components up to 20 candidates; greedily by saving beyond), never simply
   the first match found.
4. **Verify** (``verify`` callback, see :mod:`autofuse.verify`): a chosen candidate whose fused kernel
   disagrees with the captured subgraph it replaces is rejected with ``verification_failed``.

The unfused price is taken on the captured graph: the nodes the fusion would remove (its footprint,
:func:`autofuse.rewrite.lift`), exactly as eager runs them op by op.

Every candidate ends as a :class:`~autofuse.decision.FusionDecision`.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx as fx

import cost_model
from cost_model.program import ProgramError
from autofuse.decision import FusionDecision, hbm_change
from autofuse.fused import Price, family_of, per_device
from autofuse.graph import returned, returned_read
from autofuse.lower import PAIRS, known_specs, lower, step_specs
from autofuse.rewrite import NotLiftable, lift, moved_draw

#: Optimization levels. Each is observably different on the same model.
LEVELS = {
    "O0": "capture and report only: nothing is fused (every candidate is listed as disabled)",
    "O1": "conservative: fuse only clear wins (predicted speed-up >= 1.5x), and no attention whose probabilities "
          "are read outside it; kernels use their default tiling",
    "O2": "fuse every candidate the cost model prices cheaper fused; kernels use their default tiling",
    "O3": "as O2, and each fused kernel gets the tiling the cost model's search finds cheapest",
}
O1_MARGIN = 1.5

# "16GB" on a device sheet means 16 GiB: decimal units are not what memory sizes are quoted in
_UNITS = {"b": 1, "kb": 2 ** 10, "mb": 2 ** 20, "gb": 2 ** 30, "tb": 2 ** 40,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40, "k": 2 ** 10, "m": 2 ** 20,
          "g": 2 ** 30, "t": 2 ** 40}


def parse_level(level) -> str:
    lv = str(level).upper()
    if lv in ("0", "1", "2", "3"):
        lv = "O" + lv
    if lv not in LEVELS:
        raise ValueError(f"optimization_level={level!r}: choose one of {', '.join(LEVELS)} "
                         f"({'; '.join(f'{k}: {v}' for k, v in LEVELS.items())})")
    return lv


def unitless_hint(number: str) -> str:
    """What to write instead of a budget string that is only a ``number``, with no unit."""
    return (f"did you mean '{number}GB'? (GB and GiB are 2**30 bytes, MB and MiB 2**20); write '{number}B' for "
            f"bytes")


def parse_memory_budget(budget) -> int | None:
    """Bytes from ``None``, an int (bytes), or a string with a unit such as ``"16GB"``, ``"512MiB"``, ``"1.5 GB"``.

    Units are binary: ``KB``/``KiB``/``K`` are 2**10 bytes, ``MB``/``MiB``/``M`` 2**20, ``GB``/``GiB``/``G`` 2**30
    and ``TB``/``TiB``/``T`` 2**40 (the device makers' convention: ``16GB`` of HBM is 16 GiB); ``B`` is bytes.
    A string without a unit is refused: ``"16"`` (``--budget 16``) would be 16 bytes, under any fused kernel's
    working set, and nothing would fuse; an int is bytes as it says.
    """
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(f"memory_budget={budget!r}: give bytes (int) or a string like '16GB'")
    if isinstance(budget, (int, float)):
        if not math.isfinite(budget) or budget < 1:
            raise ValueError(f"memory_budget={budget!r} must be a finite number of bytes, at least 1")
        if budget != int(budget):
            raise ValueError(f"memory_budget={budget!r}: a number is bytes, and bytes are whole; for another unit "
                             f"write a string such as '{budget:g}GB' or '{budget:g}MB'")
        return int(budget)
    if re.fullmatch(r"\s*-\s*[0-9.].*", budget):
        raise ValueError(f"memory_budget={budget!r} must be at least one byte (a negative budget has no meaning)")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", budget)
    if not m or m.group(2).lower() not in _UNITS and m.group(2) != "":
        raise ValueError(f"memory_budget={budget!r}: write a number and a unit, e.g. '16GB', '512MB', '1.5GiB'")
    unit = m.group(2).lower()
    if not unit:
        raise ValueError(f"memory_budget={budget!r} has no unit: {unitless_hint(m.group(1))}")
    scale = _UNITS[unit]
    value = float(m.group(1)) * scale
    if not math.isfinite(value):
        raise ValueError(f"memory_budget={budget!r} is not a finite number of bytes")
    if value < 1:
        raise ValueError(f"memory_budget={budget!r} must be at least one byte")
    if scale == 1 and value != int(value):
        raise ValueError(f"memory_budget={budget!r}: bytes are whole; write a whole number of bytes or another unit "
                         f"('1.5GB')")
    return int(value)


def _spec(n: fx.Node):
    v = n.meta.get("val")
    return tuple(v.shape), str(v.dtype).replace("torch.", "")


def _nbytes(spec) -> int:
    shape, dtype = spec
    return math.prod(shape) * getattr(torch, dtype).itemsize


def estimate_kernel(kernel, specs, device, params):
    """The cost model's estimate of one kernel as the planner prices it: integer and boolean data priced as data of
    its size (complex as pairs of floats), a kernel or parameter combination without a model as a generic Vector op
    (both noted)."""
    seen = set()
    specs, params = known_specs(specs, seen), known_specs(params, seen)
    if seen:
        e = estimate_kernel(kernel, specs, device, params)
        return dataclasses.replace(e, notes=tuple(e.notes) + (
            f"{', '.join(sorted(seen))} priced as {'pairs of floats' if seen <= PAIRS.keys() else 'data of its size'}",))
    try:
        return cost_model.estimate(kernel, specs, device=device, **params)
    except (KeyError, NotImplementedError, ValueError, TypeError) as e:
        # no model for this kernel/parameter combination: price it as a generic Vector op
        generic = cost_model.estimate("generic", specs, device=device, outputs=[params["outputs"][0]]
                                      if "outputs" in params else [])
        return dataclasses.replace(generic, notes=tuple(generic.notes) + (f"priced as generic ({e})",))


def price_node(node: fx.Node, device: str) -> Price:
    """The cost model's price of the kernels ``node`` lowers to (zero for views)."""
    prog = lower(node)
    price = Price()
    if prog.free:
        return price
    for st, (ins, out) in zip(prog.steps, step_specs(prog, node)):
        params = {k: (_spec(prog.inputs[v.i]) if hasattr(v, "i") else v) for k, v in st.params.items()}
        if st.kernel == "generic":
            params = {"outputs": [out]}
        e = estimate_kernel(st.kernel, ins, device, params)
        price.cycles += int(e.cycles)
        price.hbm_bytes += int(e.hbm_bytes)
        price.kernels.append(st.kernel)
    return price


def price_nodes(nodes, device: str) -> Price:
    total = Price()
    for n in nodes:
        total = total.add(price_node(n, device))
    return total


@dataclass
class Candidate:
    """One match: carried over to the captured graph (``lifted``, or None with ``why`` it cannot be), priced
    unfused (the captured ops it removes, as eager runs them) and fused (the call, its preamble and views)."""

    match: object
    unfused: Price
    fused: Price
    working_set: int
    lifted: object = None
    why: str = ""

    @property
    def saving(self) -> int:
        return self.unfused.cycles - self.fused.cycles

    @property
    def nodes(self) -> tuple:
        return self.lifted.footprint if self.lifted is not None else tuple(self.match.nodes)

    @property
    def anchor(self) -> str:
        return self.lifted.anchor if self.lifted is not None else self.match.anchor


def price_candidate(match, canonical: dict, captured: dict, order: dict, device: str, search_tiling: bool
                    ) -> Candidate:
    """Unfused and fused prices of one match. A match that cannot be carried over to the captured graph, or a
    fused kernel the cost model cannot price (or that cannot run this instance), leaves ``fused.cycles`` at
    -1 and the reason in ``why`` / ``fused.bound``."""
    fam = family_of(match)
    try:
        lifted = lift(match, canonical, captured, order)
    except NotLiftable as e:
        return Candidate(match, Price(), Price(cycles=-1), 0, None, f"cannot be carried over to the captured "
                                                                    f"graph: {e}")
    if match.params.get("dropout_draw") is not None or match.params.get("draws"):
        other = moved_draw(lifted, captured, order)
        if other is not None:
            return Candidate(match, Price(), Price(cycles=-1), 0, None,
                             f"its dropout draw would move past the random op {other} (the generator would give "
                             f"each of them other numbers than eager's)")
    empty = next((v for v in (*match.inputs.values(), *match.outputs.values()) if v in canonical and
                  isinstance(canonical[v].meta.get("val"), torch.Tensor) and canonical[v].meta["val"].numel() == 0),
                 None)
    if empty is not None:
        return Candidate(match, Price(), Price(cycles=-1), 0, None, f"{empty} is empty (a size is 0): nothing to "
                                                                    f"fuse, it runs as captured")
    unfused = price_nodes([captured[n] for n in lifted.footprint], device)
    try:
        fused = fam.price(match, canonical, device, search_tiling)
        extra = list(lifted.preamble) + [v for _, views in lifted.targets.values() for v in views]
        fused = fused.add(price_nodes(extra, device)) if extra else fused
    except (NotImplementedError, ValueError, TypeError, KeyError) as e:
        # a program the kernel cannot run says why in the user's terms; anything else is named by its type
        fused = Price(cycles=-1, bound=str(e) if isinstance(e, ProgramError) else f"{type(e).__name__}: {e}")
    ins = [canonical[v] for v in match.inputs.values() if not (isinstance(v, str) and v.startswith("const:"))]
    outs = [canonical[v] for v in match.outputs.values()]
    ws = sum(_nbytes(_spec(n)) for n in ins + outs) + max(fused.workspace, 0)
    return Candidate(match, unfused, fused, ws, lifted)


def _dropout(match) -> str:
    """``"; dropout p=..."`` for a fused block that draws a dropout keep-mask."""
    p = match.params
    if p.get("draws"):
        ps = ", ".join(f"p={d[1]:g}" for d in p["draws"])
        return f"; dropout {ps} inside, eager's keep-mask{'s' if len(p['draws']) > 1 else ''} drawn by dropout_gen_mask"
    if p.get("dropout_draw") is None:
        return ""
    return f"; dropout p={p['dropout_p']:g} on the probabilities, eager's keep-mask drawn by dropout_gen_mask"


def _window(match, price: Price) -> str:
    """``"; a W-key sliding window ..."`` for attention whose mask was proven a sliding window's band."""
    p = match.params
    w = p.get("window") if match.pattern == "attention" else None
    if not w:
        return ""
    if p.get("causal"):
        return f"; a {w}-key sliding window (the band's tiles only, no mask read)"
    if price.options.get("causal_skip"):
        return f"; a {w}-key sliding window (the band's tiles only where the score bound proves the skip exact)"
    return ""


def _choice(price: Price, device: str) -> str:
    """``"; <chosen implementation> (<other> N cycles)"`` when the price chose between implementations that change
    the fused call (``price.options``), else ``""``."""
    options = [o for o in price.alternatives.get(device, ()) if o[2]]
    if not price.options or len(options) < 2:
        return ""
    return f"; {options[0][0]} (" + ", ".join(f"{o[0]} {o[1]:,} cycles" for o in options[1:]) + ")"


def device_prices(match, canonical: dict, search_tiling: bool) -> dict:
    """device -> ``[(implementation, cycles, True)]`` for a region whose family prices one implementation: its
    kernels and tiling on every device profile (the report's "Implementation choices per device")."""
    fam = family_of(match)

    def priced(d):
        p = fam.price(match, canonical, d, search_tiling)
        kernels = list(p.kernels)
        # the tiling is the family's kernel's: after it when it runs alone or last, behind launches that prepare
        # its inputs (attention's keep-mask generator and score bound)
        if p.tiling and kernels and (len(kernels) == 1 or kernels[-1] == fam.kernel):
            kernels[-1] += " (" + ", ".join(f"{k} {v}" for k, v in p.tiling.items()) + ")"
        return [(" + ".join(kernels), int(p.cycles), True)]
    return per_device(priced)


def conflict_graph(cands: list, indices, can: dict) -> nx.Graph:
    """Candidates that share a node (of the canonical view or of the captured graph) conflict; a constant the
    canonical form shares between blocks (CSE of an arange) is no conflict."""
    conflicts = nx.Graph()
    conflicts.add_nodes_from(indices)
    by_node: dict = {}
    for i in indices:
        shared = {n for n in cands[i].match.nodes if n not in can or can[n].all_input_nodes}
        for name in shared | {"captured:" + n for n in cands[i].nodes}:
            by_node.setdefault(name, []).append(i)
    for group in by_node.values():
        conflicts.add_edges_from((a, b) for x, a in enumerate(group) for b in group[x + 1:])
    return conflicts


#: The families of automatic discovery: generic fusion alone is the plan with only these (the second baseline).
GENERIC = ("vector_chain", "matmul_epilogue")


def baselines(captured: fx.GraphModule, canonical: fx.GraphModule, cands: list, decisions: list, device: str
              ) -> dict:
    """Predicted whole-graph cycles: ``eager op by op`` (every captured node priced as its own kernels),
    ``generic fusion alone`` (the same minus the best conflict-free set of the generic candidates that could be
    fused: automatic discovery without the pattern families) and ``fused`` (minus the applied savings)."""
    eager = sum(price_node(n, device).cycles for n in captured.graph.nodes if n.op == "call_function")
    can = {n.name: n for n in canonical.graph.nodes}
    ok = [i for i, (c, d) in enumerate(zip(cands, decisions))
          if family_of(c.match).name in GENERIC and d.reason_code in ("fused", "conflict")
          and c.saving > 0]
    chosen = _best_independent_set(cands, conflict_graph(cands, ok, can))
    generic = eager - sum(cands[i].saving for i in chosen)
    fused = eager - sum(d.cycles_unfused - d.cycles_fused for d in decisions if d.applied)
    return {"eager op by op": eager, "generic fusion alone": generic, "fused": fused}


def _switch(switches: dict, match) -> str:
    """The switch of a match: its whole name's (``matmul+swiglu``), else one of its names' (``rms_norm``), else its
    family's (``vector_chain``). The more specific switch wins: ``{"vector_chain": "off", "rope": "force"}``
    forces RoPE and leaves the other Vector regions unfused."""
    return _switch_named(switches, match)[1]


def _switch_named(switches: dict, match) -> tuple:
    """``(the key that decides, its value)`` of :func:`_switch`; ``(None, "on")`` where no switch names the match."""
    # a whole name before its parts, a name before its family
    keys = [match.pattern] + match.pattern.split("+") + [family_of(match).name]
    for k in keys:
        if k in switches:
            return k, switches[k]
    return None, "on"


def _best_independent_set(cands: list[Candidate], conflicts: nx.Graph) -> set:
    """Max-saving conflict-free subset: exact branch and bound per component (≤ 20), else greedy."""
    chosen = set()
    for comp in nx.connected_components(conflicts):
        comp = sorted(comp, key=lambda i: (-cands[i].saving, i))     # ties: the earlier candidate, in every layer
        if len(comp) <= 20:
            best = [0, ()]

            def search(i, taken, total, remaining):
                if total + remaining <= best[0] and best[1]:
                    return
                if i == len(comp):
                    if total > best[0] or not best[1]:
                        best[0], best[1] = total, tuple(taken)
                    return
                c = comp[i]
                gain = max(cands[c].saving, 0)
                if all(not conflicts.has_edge(c, t) for t in taken):
                    search(i + 1, taken + [c], total + gain, remaining - gain)
                search(i + 1, taken, total, remaining - gain)

            search(0, [], 0, sum(max(cands[i].saving, 0) for i in comp))
            chosen.update(best[1])
        else:
            for c in comp:
                if all(not conflicts.has_edge(c, t) for t in chosen):
                    chosen.add(c)
    return chosen


def _data_dependent(c: Candidate, cap: dict) -> str:
    """Why a candidate may not fuse because its sizes depend on data (capture's ``autofuse_data_dependent``), or
    ``""``: a fused call is planned, priced and checked at one size, and these change from call to call. What
    counts is the call's boundary, the values it reads and the values it gives the graph: a block whose sizes
    depend on data only inside (a hand-written MoE layer's loop, each expert's tokens found by ``torch.where`` and
    added back by ``index_add``) is one call of fixed sizes, the data steering its kernels as any routing does."""
    inside = {cap[x] for x in c.nodes if x in cap}
    boundary = {a for n in inside for a in n.all_input_nodes if a not in inside} | \
        {n for n in inside if any(u not in inside for u in n.users)}
    if not any("autofuse_data_sized" in n.meta for n in boundary):
        return ""
    hit = [n for n in inside | boundary if "autofuse_data_dependent" in n.meta]
    src = sorted({s for n in hit for s in n.meta["autofuse_data_dependent"]})
    return (f"its sizes depend on data ({hit[0].name} and {len(hit) - 1} more of its nodes, sized by "
            f"{', '.join(src[:4])}{' ...' if len(src) > 4 else ''}): it runs as captured, for any sizes")


def returned_and_read(c: Candidate, cap: dict, out: set) -> str:
    """The captured node the candidate's fused call would both return to the model's caller (one of ``out``,
    :func:`autofuse.graph.returned`) and read itself (a residual stream returned as a hidden state and normed in
    the same block), by name, or ``""``. Its gradient must reach the returned tensor as eager's does: the fused
    call's backward would sum the inner use's gradient straight into the call's inputs, so ``retain_grad()`` and
    hooks on the returned tensor, and ``autograd.grad`` with respect to it, would miss the model's later uses of
    it."""
    if c.lifted is None:
        return ""
    n = returned_read([cap[name] for name in c.lifted.footprint], out)
    return "" if n is None else n.name


def plan(captured: fx.GraphModule, canonical: fx.GraphModule, matches: list, device: str, level: str,
         budget: int | None, verify=None, switches=None, agreement=None):
    """Decide every candidate. Returns ``(applied candidates, decisions, candidates)``.

    ``matches`` were found on ``canonical``; each is carried over to ``captured`` (:func:`autofuse.rewrite.lift`)
    and priced there. ``verify(candidate) -> (ok, error, tolerance)`` is called on each chosen candidate.
    ``switches``: family name -> ``"on"`` / ``"off"`` / ``"force"`` (force fuses a family's candidates
    whenever they can run, profitable or not). ``agreement``: an :class:`autofuse.agreement.Agreement` that the
    candidates which communicate are decided by, with the other ranks, before any is verified (their price, budget
    and level checks are the group's; they are verified first, and win over the blocks they overlap).
    """
    level = parse_level(level)
    switches = dict(switches or {})
    can = {n.name: n for n in canonical.graph.nodes}
    cap = {n.name: n for n in captured.graph.nodes}
    order = {n.name: i for i, n in enumerate(captured.graph.nodes)}
    cands = [price_candidate(m, can, cap, order, device, search_tiling=(level == "O3")) for m in matches]
    decisions: dict[int, FusionDecision] = {}
    # a plan made with grad serves autograd: a value returned to the caller keeps its gradient (returned_and_read)
    returned_values = returned(captured) if getattr(captured, "meta", {}).get("autofuse_grad", True) else set()

    def decide(i, applied, code, reason, **extra):
        c = cands[i]
        params = {k: v for k, v in c.match.params.items() if not k.endswith(("_like", "_likes"))}
        if c.fused.alternatives:
            params["alternatives"] = c.fused.alternatives
        elif applied:
            params["alternatives"] = device_prices(c.match, can, level == "O3")
        decisions[i] = FusionDecision(
            pattern=c.match.pattern, nodes=tuple(c.nodes), anchor=c.anchor, applied=applied,
            reason_code=code, reason=reason, cycles_unfused=c.unfused.cycles, cycles_fused=c.fused.cycles,
            hbm_bytes_unfused=c.unfused.hbm_bytes, hbm_bytes_fused=c.fused.hbm_bytes,
            kernel=family_of(c.match).kernel, bound_fused=c.fused.bound, params=params,
            tiling=dict(c.fused.tiling), unfused_kernels=tuple(c.unfused.kernels), working_set_bytes=c.working_set,
            workspace_bytes=c.fused.workspace, **extra)

    eligible = []
    open_: dict = {}            # communicating candidates for the agreement: index -> their options
    for i, c in enumerate(cands):
        sp = c.unfused.cycles / max(c.fused.cycles, 1)
        key, switch = _switch_named(switches, c.match)
        force = switch == "force"
        p = c.match.params
        if level == "O0":
            decide(i, False, "disabled_by_opt_level", "O0 fuses nothing")
        elif switch == "off":
            decide(i, False, "disabled_by_switch", f"switched off by the {key} switch"
                   + (f" (the {family_of(c.match).name} family)" if key == family_of(c.match).name != c.match.pattern
                      else ""))
        elif p.get("unsupported"):
            decide(i, False, "unsupported", p["unsupported"])
        elif c.lifted is None:
            decide(i, False, "unsupported", c.why)
        elif dyn := _data_dependent(c, cap):
            decide(i, False, "unsupported", dyn)
        elif (p.get("dropout_p") or p.get("dropout_draw") is not None) and (p.get("probs_used")
                                                                          or p["dropout_p"] >= 1.0):
            decide(i, False, "training_dropout", f"dropout p={p['dropout_p']:g} on the probabilities "
                   + ("whose values are also read outside the block" if p.get("probs_used") else "drops every weight")
                   + ": the block runs as captured")
        elif returned_values and (kept := returned_and_read(c, cap, returned_values)):
            decide(i, False, "returned_value_read",
                   f"{kept} is returned by the model and read again inside the block: in a plan made with grad its "
                   f"gradient must flow through the returned tensor (retain_grad, its hooks, autograd.grad with "
                   f"respect to it), so the block is not fused across it"
                   + ("; the region is also offered cut there" if family_of(c.match).name in GENERIC else ""))
        elif level == "O1" and p.get("probs_used") and not force:
            decide(i, False, "extra_outputs_at_O1", "the probabilities are used outside the block; O2+ fuses "
                                                    "it with return_probs")
        elif c.fused.cycles < 0:
            decide(i, False, "unsupported", f"the fused kernel cannot be priced for this block: {c.fused.bound}")
        elif agreement is not None and agreement.covers(c):
            # price and budget are the group's: every way this rank could run it, with its preamble and views
            extra = price_nodes(list(c.lifted.preamble) + [v for _, vs in c.lifted.targets.values() for v in vs],
                                device)
            ways = family_of(c.match).options(c.match, can, device, level == "O3")
            open_[i] = {k: p.add(extra) for k, p in ways.items()}
        elif c.fused.cycles >= c.unfused.cycles and not force:
            free = " (the captured ops it would replace cost nothing as captured: views, no-op copies)" \
                if c.unfused.cycles == 0 else ""
            decide(i, False, "not_profitable", f"fused kernel {c.fused.cycles:,} cycles >= unfused "
                                               f"{c.unfused.cycles:,} cycles on {device}{free}")
        elif level == "O1" and sp < O1_MARGIN and not force:
            decide(i, False, "below_level_margin", f"predicted {sp:.2f}x < {O1_MARGIN}x required at O1")
        elif budget is not None and c.working_set > budget:
            decide(i, False, "memory_budget", f"fused kernel needs {c.working_set:,} B (inputs, outputs, "
                                              f"workspace) > budget {budget:,} B")
        else:
            eligible.append(i)

    verdicts: dict = {}
    pinned, notes = set(), {}
    if agreement is not None:
        # the communicating candidates, decided with the other ranks before anything communicates (see
        # autofuse.agreement): this rank's own choice among overlapping blocks is one of its inputs
        mine = _best_independent_set(cands, conflict_graph(cands, eligible + sorted(open_), can))
        comm = [i for i, c in enumerate(cands) if agreement.covers(c)]
        outcomes = agreement.settle(cands, {i: decisions[i] for i in comm if i in decisions}, open_, mine, level,
                                    budget, switches)
        for i in comm:
            o = outcomes[i]
            if not o.fuse:
                decide(i, False, o.code, o.reason)
                continue
            c = cands[i]
            price = open_.get(i, {}).get(o.key)
            if price is None:
                # kept from a plan the group agreed on, which this rank cannot run now (its own check failed)
                raise RuntimeError(f"autofuse: the {c.match.pattern} pair at {c.anchor} was agreed fused with the "
                                   f"other ranks of its process group, but this rank alone planned again and cannot "
                                   f"fuse it now ({decisions[i].reason if i in decisions else 'its chunks differ'}); "
                                   f"its collectives would not pair up with theirs. Call the fused module on every "
                                   f"rank with inputs of the same kind")
            decisions.pop(i, None)
            ws = c.working_set - max(c.fused.workspace, 0) + max(price.workspace, 0)
            cands[i] = dataclasses.replace(c, fused=price, working_set=ws)
            pinned.add(i)
            eligible.append(i)
            notes[i] = o.note
            if o.verdict is not None:
                verdicts[i] = o.verdict         # agreed earlier: no verification, which would communicate
        eligible.sort()

    conflicts = conflict_graph(cands, eligible, can)

    # choose, verify the chosen; a candidate that fails verification leaves the pool and the choice is made
    # again, so a block that lost a conflict to it can still be fused. The agreed communicating candidates are
    # taken first, on every rank alike
    while True:
        taken = {i for i in pinned if verdicts.get(i, (True,))[0]}
        blocked = taken | {j for i in taken for j in conflicts.neighbors(i)}
        pool = conflicts.subgraph([i for i in eligible if verdicts.get(i, (True,))[0] and i not in blocked])
        chosen = taken | _best_independent_set(cands, pool)
        failed = False
        if verify is not None and hasattr(verify, "prepare"):       # e.g. one run for every block's inputs
            verify.prepare([cands[i] for i in sorted(chosen) if i not in verdicts])
        for i in sorted(chosen):
            if verify is not None and i not in verdicts:
                verdicts[i] = verify(cands[i])
                failed = failed or not verdicts[i][0]
        if not failed:
            break
    if agreement is not None:
        agreement.record(verdicts)

    applied = []
    for i in eligible:
        c = cands[i]
        err, tol = (verdicts[i][1], verdicts[i][2]) if i in verdicts else (None, None)
        detail = verdicts[i][3] if i in verdicts and len(verdicts[i]) > 3 else ""
        note = verdicts[i][4] if i in verdicts and len(verdicts[i]) > 4 else ""
        if i in verdicts and not verdicts[i][0]:
            decide(i, False, "verification_failed", note if err is None or tol is None else
                   f"fused result differs from the captured subgraph{' on ' + detail if detail else ''}: "
                   f"error {err:.3g} > tolerance {tol:.3g}" + (f" ({note})" if note else ""),
                   verify_error=err, verify_tolerance=tol, verify_note=note)
        elif i not in chosen:
            winner = next((j for j in chosen if conflicts.has_edge(i, j)), None)
            w = cands[winner] if winner is not None else None
            decide(i, False, "conflict", "overlaps blocks that together save more" if w is None else
                   f"overlaps {_other(c, w)}, which saves "
                   + (f"more ({w.saving:,} vs {c.saving:,} cycles)" if w.saving > c.saving else
                      f"as much ({w.saving:,} cycles) and comes first"))
        else:
            sp = c.unfused.cycles / max(c.fused.cycles, 1)
            # "forced" only where the switch changed the outcome: unprofitable, or short of O1's margin or outputs
            forced = _switch(switches, c.match) == "force" and (
                c.fused.cycles >= c.unfused.cycles or (level == "O1" and (sp < O1_MARGIN or c.match.params.get(
                    "probs_used"))))
            why = "forced by switch; " if forced else ""
            decide(i, True, "fused", f"{why}predicted {sp:.2f}x, {hbm_change(c.unfused.hbm_bytes - c.fused.hbm_bytes)}"
                                     f"; fused kernel bound by {c.fused.bound or '?'}"
                                     + _choice(c.fused, device) + _window(c.match, c.fused) + _dropout(c.match)
                                     + (f"; {note}" if note else "") + (f"; {notes[i]}" if notes.get(i) else ""),
                   verify_error=err, verify_tolerance=tol, verify_note=note)
            applied.append(c)
    for i, c in enumerate(cands):
        # a region that could not be carried over on its own (it reads a value only the canonical form computes)
        # but shares ops with an applied block: named by that block, which fuses them
        if c.lifted is None and c.why.startswith("cannot be carried over") and decisions[i].reason == c.why:
            ours = {n for n in c.match.nodes if n in can and can[n].all_input_nodes}
            w = next((a for a in applied if ours & set(a.match.nodes)), None)
            if w is not None:
                decide(i, False, "conflict", f"overlaps {_other(c, w)}, which is fused (on its own it {c.why})")
    return applied, [decisions[i] for i in range(len(cands))], cands


def _other(c, w) -> str:
    """The block ``w`` as a conflict reason names it beside ``c``: by its pattern and anchor, and where both share
    them (a SwiGLU epilogue on the gate's projection or on the up's) also by the nodes that tell them apart."""
    if (w.match.pattern, w.anchor) != (c.match.pattern, c.anchor):
        return f"the {w.match.pattern} block at {w.anchor}"
    ours, theirs = ([str(getattr(n, "name", n)) for n in x.nodes] for x in (c, w))
    only_theirs, only_ours = [n for n in theirs if n not in ours], [n for n in ours if n not in theirs]
    return (f"another {w.match.pattern} block at {w.anchor}"
            + (f", over {', '.join(only_theirs)}" if only_theirs else "")
            + (f" where this one is over {', '.join(only_ours)}" if only_ours else ""))
