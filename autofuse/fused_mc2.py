"""Fused calls of the MC2 families (``patterns/mc2.py``): a matmul and its collective as one MC2 op.

==========================  =====================================================================
family                      fused call (``autofuse/ops_mc2.py``)
==========================  =====================================================================
``matmul_all_reduce``       ``matmul_all_reduce(x, W, "sum", group, tiles=T, device=..., tiling=..., algorithm=...,
                            backward=...)`` (``"all_reduce"`` or ``"identity"``: the match's, by spelling)
``matmul_reduce_scatter``   ``matmul_reduce_scatter(x, W, "sum", group, p, tiles=T, ...)``
``all_gather_matmul``       ``all_gather_matmul(x, W, group, p, tiles=T, ...)`` → (out, gathered x)
==========================  =====================================================================

**Price.** The unfused side is what the planner prices for every candidate: the captured matmul and the
collective launch (``autofuse.lower`` lowers ``_c10d_functional`` collectives to the collective kernels with
the group's size). The fused side is :func:`cost_model.mc2.choose_tiles`: the fused kernel at its fastest tile
count (and the tiles' collective algorithm), with the matmul tiling the kernel picks by itself (O1, O2) or the
one the cost model's search finds for that tile count (O3). When no tile count beats the unfused pair the price is still the best fused one,
so the planner keeps the pair with ``not_profitable`` and both figures; the decision's ``tiling`` names the
tile count that was tried best.

**Agreement** (:mod:`autofuse.agreement`): before anything is verified, the ranks of the pair's process group
exchange what each would do alone (:func:`price_options`: its price at every tile count and algorithm, with the
chunks that tiling cuts the collective into, :func:`traffic`) and all apply one rule, so that every rank fuses
the same pairs at the same tile count and chunks.

**Verification** runs on every rank at plan time (``fuse()`` runs on each rank): the captured pair and the
fused op each communicate through the pair's process group, and every rank verifies the agreed pairs in the same
order, so their collectives pair up. A verdict, though, depends on the rank's own data: :func:`agree` makes it
the group's (failed if it failed on any rank, the largest error), so that every rank applies the same fusions and
the fused graphs' collectives still pair up.
"""
from __future__ import annotations

import json
import operator

import torch
import torch.fx as fx

from autofuse import ops_mc2  # noqa: F401  (registers torch.ops.autofuse.matmul_all_reduce, ...)
from autofuse.fused import Family, Price, _adapt, register_family
from autofuse.graph import call, val
from cost_model.devices import get_device
from cost_model.mc2 import TILE_COUNTS, _dims, algorithms, choose_tiles, row_tiles, tile_plan

aten = torch.ops.aten
DEFAULT_TILES = 4          # the ops' own default tile count (what O1/O2 would run without a plan)


def operand_specs(match, nodes: dict) -> tuple:
    """``(x, w)`` as the fused kernel takes them: ``((shape, dtype), ((K, N), dtype))``."""
    p = match.params
    x, w = val(nodes[match.inputs["x"]]), val(nodes[match.inputs["weight"]])
    dt = str(x.dtype).replace("torch.", "")
    ws = tuple(w.shape) if p["weight_layout"] == "kn" else (w.shape[1], w.shape[0])
    return (tuple(x.shape), dt), (ws, dt)


def price_mc2(match, nodes: dict, device: str, search_tiling: bool) -> Price:
    """The fused kernel at its best tile count (see the module docstring). The unfused baseline is the planner's
    own price of the pair's nodes, so the two sides of the decision are priced alike."""
    from autofuse.plan import price_nodes
    p = match.params
    if p["unsupported"]:
        raise NotImplementedError(p["unsupported"])
    x, w = operand_specs(match, nodes)
    baseline = price_nodes([nodes[n] for n in match.nodes], device).cycles
    plan = choose_tiles(p["kind"], x, w, device, int(p["world_size"]), baseline=baseline, search_tiling=search_tiling)
    tiling = {"tiles": plan.best_tiles, "algorithm": plan.algorithm}
    if search_tiling:
        tiling["matmul"] = plan.tiling
    bound = f"{plan.bound} ({plan.best_tiles} tiles, link busy {plan.link_cycles:,} cycles)"
    return Price(plan.fused_cycles, plan.hbm_bytes, [p["kind"]], bound, tiling, plan.workspace)


def mc2_kwargs(device: str, price: Price, level: str) -> dict:
    kw = {"tiles": int(price.tiling.get("tiles", DEFAULT_TILES)), "device": device}
    if price.tiling.get("algorithm"):
        kw["algorithm"] = price.tiling["algorithm"]
    # a tiling the ranks agreed on (see price_options) is passed at every level: it decides the collective's chunks
    if (level == "O3" or price.options.get("agreed")) and price.tiling.get("matmul"):
        kw["tiling"] = json.dumps(price.tiling["matmul"], sort_keys=True)
    return kw


def traffic(kind: str, x, w, world: int, tiles: int, tiling: dict, device: str, algorithm: str) -> tuple:
    """What decides the fused kernel's collective traffic (``autofuse/npu/kernels/mc2.py``): the device (its links
    and the algorithms' size-based defaults), the tiles' split and ranges (from the tile count and the matmul's
    ``m0``/``n0``) and the tiles' algorithm. Ranks whose launches pair up must have equal ones."""
    M, _, N, _ = _dims([x, w])
    m0, n0 = int(tiling["m0"]), int(tiling["n0"])
    if kind == "all_gather_matmul":
        split, ranges = "rows", row_tiles(M, m0, tiles)
    else:
        split, ranges = tile_plan(max(M // world, 1) if kind == "matmul_reduce_scatter" else M, N, m0, n0, tiles)
    return device, split, tuple(tuple(r) for r in ranges), algorithm or ""


def price_options(match, nodes: dict, device: str, search_tiling: bool) -> dict:
    """Every way this rank could run the pair that the ranks may agree on: ``(tiles, algorithm, traffic) ->
    Price`` for each tile count of :data:`cost_model.mc2.TILE_COUNTS` and each algorithm, with the kernel's default
    matmul tiling and (``search_tiling``) the fastest one the search finds for that tile count; per key the
    cheaper. Any tile count with one tile has the same traffic on every rank (one range of every row)."""
    from autofuse.plan import price_nodes
    p = match.params
    kind, world = p["kind"], int(p["world_size"])
    x, w = operand_specs(match, nodes)
    dev = get_device(device)
    baseline = price_nodes([nodes[n] for n in match.nodes], device).cycles
    out = {}
    for T in TILE_COUNTS:
        for a in algorithms(kind, dev, world):
            for search in ((False, True) if search_tiling else (False,)):
                try:
                    plan = choose_tiles(kind, x, w, device, world, algorithm=a or "", counts=(T,), baseline=baseline,
                                        search_tiling=search)
                except (ValueError, KeyError, NotImplementedError):
                    continue
                key = (T, a or "", traffic(kind, x, w, world, T, plan.tiling, dev.name, a or ""))
                tiling = {"tiles": T, "algorithm": a or "", "matmul": dict(plan.tiling)}
                bound = f"{plan.bound} ({T} tiles, link busy {plan.link_cycles:,} cycles)"
                price = Price(plan.fused_cycles, plan.hbm_bytes, [kind], bound, tiling, plan.workspace,
                              options={"agreed": True})
                if key not in out or price.cycles < out[key].cycles:
                    out[key] = price
    return out


def emit_mc2(g: fx.Graph, ins: dict, m, kwargs: dict) -> dict:
    """The MC2 op on the pair's x and weight (a ``[K, N]`` weight is handed over as its ``[N, K]`` view)."""
    p = m.params
    ops = torch.ops.autofuse
    x, w = ins["x"], ins["weight"]
    if p["weight_layout"] == "kn":
        w = call(g, aten.t.default, w)
    kind, group = p["kind"], p["group_name"]
    if kind == "matmul_all_reduce":
        # the all-reduce's backward as the user's spelling differentiates it (patterns/mc2.py)
        fused = call(g, ops.matmul_all_reduce.default, x, w, "sum", group, backward=p["backward"], **kwargs)
    elif kind == "matmul_reduce_scatter":
        fused = call(g, ops.matmul_reduce_scatter.default, x, w, "sum", group, int(p["world_size"]), **kwargs)
    else:
        fused = call(g, ops.all_gather_matmul.default, x, w, group, int(p["world_size"]), **kwargs)
    fused.meta["autofuse_match"] = m
    if kind != "all_gather_matmul":
        return {"out": _adapt(g, fused, p["out_like"])}
    out = call(g, operator.getitem, fused, 0)
    outs = {"out": _adapt(g, out, p["out_like"])}
    if "gathered" in m.outputs:
        outs["gathered"] = _adapt(g, call(g, operator.getitem, fused, 1), p["gathered_like"])
    return outs


def agree(verdict: tuple, match) -> tuple:
    """The group's verdict from each rank's ``(ok, error, tolerance, label)``: failed on any rank fails on all,
    with the largest error (one MAX all-reduce over the pair's process group)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    ok, err, tol = verdict[:3]
    label, note = (tuple(verdict[3:5]) + ("", ""))[:2]
    # a block this rank could not check (error None: too large, see the verifier) fails everywhere
    t = torch.tensor([0.0 if ok else 1.0, float("inf") if err is None else float(err)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_resolve_process_group(match.params["group_name"]))
    failed = bool(t[0].item() > 0)
    if failed and ok:
        label = "another rank's inputs"
    return (not failed, None if err is None else float(t[1].item()), tol, label, note)


FAMILIES = {kind: register_family(Family(kind, getattr(torch.ops.autofuse, kind).default, kind, emit_mc2, price_mc2,
                                         mc2_kwargs, agree=agree, options=price_options))
            for kind in ("matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul")}

__all__ = ["FAMILIES", "agree", "emit_mc2", "mc2_kwargs", "operand_specs", "price_mc2", "price_options", "traffic"]
