"""The ranks' agreement on the blocks that communicate, before any of them communicates.

A fused MC2 call (``autofuse/fused_mc2.py``) exchanges tiles with the same call on the other ranks of its process
group, so every rank must fuse the same pairs, cut into the same chunks (tile count, the matmul's ``m0``/``n0``,
the tiles' algorithm) on the same device; and verification runs the pair's collectives too. Each rank plans on
its own, with its own shapes (uneven shards: K differs), settings (switches, memory budget, level) and prices, so
what it would choose alone need not be what the others choose.

**Protocol.** After each rank has priced its candidates and kept those that fail a rank-local check (switch,
level, unsupported, a price that cannot be made), and before anything is verified, the ranks exchange a compact
description of each candidate on each process group that the captured graph communicates through: one
``all_gather_object`` per group, in the order the graph first uses the groups (every rank of a group captured the
same collectives in the same order, or eager's would not pair up either). A description holds the candidate's
shapes, whether this rank keeps it unfused and why, whether its own choice among overlapping blocks took it, the
speed-up it requires (forced, O1's margin, or any gain), its memory budget, its unfused cycles, and its price at
every tile count and algorithm with the collective's chunks those give (:func:`autofuse.fused_mc2.price_options`).

**Rule** (:func:`settle`, the same on every rank, from the same gathered descriptions):

1. the ranks' lists differ in shapes or device: every pair of the group stays unfused;
2. a rank keeps the pair unfused for a reason of its own (its switch, its level, unsupported, a block overlapping
   it won there): every rank keeps it unfused, saying which rank and why;
3. among the ways whose chunks are equal on every rank and whose working set fits every rank's budget, the one
   whose slowest rank is fastest; the pair is fused when that slowest rank's fused cycles satisfy every rank's
   required speed-up against the slowest rank's unfused cycles (the collective runs at the slowest rank's pace,
   fused or not). One tile gives equal chunks on every rank, so uneven shards still fuse where that pays.

The fused pairs are then verified in the same order on every rank (their verdicts agreed as before,
:func:`autofuse.fused_mc2.agree`); a pair another block overlaps loses to none once agreed.

**Plans made again on one rank.** A fused module plans again on one rank alone when that rank's call has a new
input layout (a transposed view): the other ranks do not plan, so no collective may run. The agreed outcome of a
group is kept per fused module, keyed by the group and its candidates' shapes; a plan whose group has the same
candidates takes the kept outcome and verdicts and communicates nothing. A rank given other shapes than its
peers alone would communicate here, as eager's collectives would mismatch on them.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from autofuse.fused import family_of
# a rank's need for a speed-up: "force" (its switch forces the family), "O1" (O1_MARGIN), else any gain
from autofuse.plan import O1_MARGIN, _switch


def collective_group(n: fx.Node) -> str | None:
    """The process group's name a captured functional collective communicates through, or None."""
    t = n.target
    if n.op != "call_function" or getattr(t, "namespace", None) != "_c10d_functional" or "wait_tensor" in str(t):
        return None
    names = [a for a in n.args if isinstance(a, str)]
    return names[-1] if names else None


def _resolve(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    try:
        return _resolve_process_group(name)
    except Exception:  # noqa: BLE001 - a group this process cannot resolve: its pairs are unsupported
        return None


def _ident(match) -> tuple:
    p = match.params
    return (p["kind"], int(p["world_size"] or 0), tuple(p.get("x_shape") or ()), tuple(p.get("w_shape") or ()),
            p.get("dtype"), p.get("weight_layout"))


def _payload(match) -> tuple:
    """What every rank of the group must have alike: the kind, the group's size, the shape and dtype the collective
    moves (the product's for a reduction, x's for a gather; K may differ between ranks' shards)."""
    p = match.params
    x, w = tuple(p.get("x_shape") or ()), tuple(p.get("w_shape") or ())
    n = (w[0] if p.get("weight_layout") == "nk" else w[-1]) if w else None
    moved = x if p["kind"] == "all_gather_matmul" else x[:-1] + (n,)
    return p["kind"], int(p["world_size"] or 0), moved, p.get("dtype")


def _shown(payload) -> str:
    kind, _, moved, dtype = payload
    return f"{kind} moving {list(moved)} {dtype}"


@dataclasses.dataclass
class Outcome:
    """One communicating candidate's agreed fate on this rank."""
    fuse: bool
    code: str = ""
    reason: str = ""
    key: tuple | None = None        # the agreed (tiles, algorithm, traffic)
    note: str = ""                  # said in the fused decision's reason
    verdict: tuple | None = None    # kept for plans made again on this rank alone


class Agreement:
    """The agreement of one plan (see the module docstring). ``store``: the fused module's kept outcomes."""

    def __init__(self, groups: list, device: str, store: dict | None):
        self.groups, self.device, self.store = groups, device, store
        self.outcomes: dict = {}            # candidate index -> Outcome

    @classmethod
    def for_graph(cls, gm: fx.GraphModule, device: str, store: dict | None):
        """The agreement of a plan of ``gm``, or None when nothing is to agree on (no collective, no process group)."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return None
        groups = []
        for n in gm.graph.nodes:
            name = collective_group(n)
            if name is not None and name not in groups and _resolve(name) is not None:
                groups.append(name)
        return cls(groups, device, store) if groups else None

    def covers(self, cand) -> bool:
        fam = family_of(cand.match)
        return fam.agree is not None and fam.options is not None and cand.match.params.get("group_name") in self.groups

    def settle(self, cands: list, decisions: dict, open_: dict, chosen: set, level: str, budget, switches: dict
               ) -> dict:
        """Each covered candidate's :class:`Outcome`. ``decisions``: this rank's decisions so far (those it keeps
        unfused on its own); ``open_``: index -> its options (``price_options``), for the others; ``chosen``: the
        indices this rank's own choice among overlapping blocks takes."""
        import torch.distributed as dist
        for group in self.groups:
            idx = [i for i, c in enumerate(cands) if self.covers(c) and c.match.params["group_name"] == group]
            ids = tuple(_ident(cands[i].match) for i in idx)
            key = ("agreed", group, self.device, ids)
            kept = self.store.get(key) if self.store is not None else None
            if kept is not None:
                self.outcomes.update(zip(idx, kept))
                continue
            mine = {"device": self.device, "cands": []}
            for i in idx:
                c = cands[i]
                d = {"id": _payload(c.match), "status": "open", "reason": "", "chosen": i in chosen,
                     "rival": "", "need": "O2", "budget": budget, "unfused": c.unfused.cycles, "options": {},
                     "best": None}
                if i in decisions:
                    d["status"], d["reason"] = decisions[i].reason_code, decisions[i].reason
                else:
                    d["need"] = "force" if _switch(switches, c.match) == "force" else level
                    d["options"] = {k: (p.cycles, c.working_set - max(c.fused.workspace, 0) + max(p.workspace, 0))
                                    for k, p in open_[i].items()}
                    if d["options"]:
                        best = min(d["options"], key=lambda k: (d["options"][k][0], k[0], k[1]))
                        d["best"] = best[:2]
                mine["cands"].append(d)
            pg = _resolve(group)
            gathered = [None] * dist.get_world_size(pg)
            dist.all_gather_object(gathered, mine, group=pg)
            ranks = dist.get_process_group_ranks(pg)
            got = settle(gathered, ranks, dist.get_rank(pg))
            self.outcomes.update(zip(idx, got))
            if self.store is not None:
                self.store[key] = got
        return self.outcomes

    def record(self, verdicts: dict):
        """Keep the verdicts of the agreed pairs with their outcomes (for plans made again on this rank alone)."""
        for i, o in self.outcomes.items():
            if o.fuse and i in verdicts:
                o.verdict = verdicts[i]


def _who(ranks, gs) -> str:
    names = [str(ranks[g]) for g in gs]
    return ("rank " if len(names) == 1 else "ranks ") + ", ".join(names)


def settle(gathered: list, ranks: list, me: int) -> list:
    """The agreed :class:`Outcome` of each of this rank's (group rank ``me``) candidates on one group, from every
    rank's description (``gathered``, by group rank; ``ranks``: their global ranks). See the module docstring."""
    mine = gathered[me]["cands"]
    lists = [[c["id"] for c in d["cands"]] for d in gathered]
    devices = [d["device"] for d in gathered]
    if len(set(devices)) > 1:
        why = "the ranks plan for different devices (" + ", ".join(
            f"rank {r}: {d}" for r, d in zip(ranks, devices)) + ")"
    elif any(ls != lists[0] for ls in lists):
        why = "the ranks' graphs differ at this group's matmul + collective pairs (" + "; ".join(
            f"rank {r}: {', '.join(_shown(i) for i in ls) or 'none'}" for r, ls in zip(ranks, lists)) + ")"
    else:
        return [_settle_one([d["cands"][j] for d in gathered], ranks, me, devices[0]) for j in range(len(mine))]
    return [Outcome(False, "another_rank", f"{why}: every rank keeps its pairs on this group unfused, so that their "
                                           f"collectives pair up as eager's do") for _ in mine]


def _kept(ranks: list, me: int, why: dict) -> Outcome:
    """The pair stays unfused on every rank because of the ranks in ``why`` (group rank -> (code, reason)): on those
    ranks with their own code and reason, on the others as ``another_rank`` naming them."""
    others = [g for g in range(len(ranks)) if g != me and g not in why]       # ranks that would have fused it
    if me in why:
        code, reason = why[me]
        return Outcome(False, code, reason + (f"; {_who(ranks, others)} keep{'s' if len(others) == 1 else ''} it "
                                              f"unfused too ({ALIKE})" if others else ""))
    gs = sorted(why)
    code, reason = why[gs[0]]
    return Outcome(False, "another_rank", f"{_who(ranks, gs)} keep{'s' if len(gs) == 1 else ''} it unfused "
                                          f"({code}: {reason}); {ALIKE}, so this rank keeps it unfused too")


ALIKE = "the ranks that communicate through a pair must fuse it alike"


def _settle_one(ds: list, ranks: list, me: int, device: str) -> Outcome:
    closed = {g: (d["status"], d["reason"]) for g, d in enumerate(ds) if d["status"] != "open"}
    if closed:
        return _kept(ranks, me, closed)
    lost = {g: ("conflict", f"a block overlapping it is fused there instead{': ' + d['rival'] if d['rival'] else ''}")
            for g, d in enumerate(ds) if not d["chosen"]}
    if lost:
        return _kept(ranks, me, lost)
    common = set(ds[0]["options"]).intersection(*(d["options"] for d in ds[1:]))
    if not common:
        return Outcome(False, "unsupported", f"no tile count cuts the collective into the same chunks on every rank "
                                             f"(their matmul tilings differ); {ALIKE}, so every rank keeps it unfused")
    fits = [k for k in common if all(d["budget"] is None or d["options"][k][1] <= d["budget"] for d in ds)]
    if not fits:
        over = {g: ("memory_budget", f"fused kernel needs at least {min(d['options'][k][1] for k in common):,} B "
                                     f"(inputs, outputs, workspace) at any tile count the ranks share > budget "
                                     f"{d['budget']:,} B")
                for g, d in enumerate(ds) if d["budget"] is not None and
                all(d["options"][k][1] > d["budget"] for k in common)}
        return _kept(ranks, me, over or {g: ("memory_budget", "no tile count the ranks share fits every rank's "
                                                              "memory budget") for g in range(len(ds))})
    key = min(fits, key=lambda k: (max(d["options"][k][0] for d in ds), sum(d["options"][k][0] for d in ds),
                                   k[0], k[1], repr(k[2])))
    fused = max(d["options"][key][0] for d in ds)
    unfused = max(d["unfused"] for d in ds)
    sp = unfused / max(fused, 1)

    def accepts(need):
        return need == "force" or (fused < unfused and (need != "O1" or sp >= O1_MARGIN))

    tiles = f"{key[0]} tile{'s' if key[0] > 1 else ''}" + (f", algorithm {key[1]}" if key[1] else "")
    priced = f"the slowest rank's fused {fused:,} cycles vs unfused {unfused:,} at {tiles}, {sp:.2f}x"
    slow = f"(the group's slowest rank's, at {tiles})"
    decline = {g: ("not_profitable", f"fused kernel {fused:,} cycles >= unfused {unfused:,} cycles on {device} {slow}")
               if fused >= unfused else
               ("below_level_margin", f"predicted {sp:.2f}x < {O1_MARGIN}x required at O1 {slow}")
               for g, d in enumerate(ds) if not accepts(d["need"])}
    if decline:
        return _kept(ranks, me, decline)
    bests = [d["best"] for d in ds]
    note = ""
    if len(ds) > 1 and any(b != key[:2] for b in bests):
        own_best = ", ".join(f"rank {r}: {b[0]}" + (f" {b[1]}" if b[1] else "") for r, b in zip(ranks, bests))
        note = (f"the ranks' own best tile counts differ ({own_best}): every rank runs {tiles} ({priced}), "
                f"so that their collectives pair up")
    return Outcome(True, "fused", "", key, note)


__all__ = ["Agreement", "Outcome", "collective_group", "settle"]
